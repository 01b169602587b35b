//! Recording a run (`record.dir`): a manifest of what ran and the per-frame timings of every
//! stage and link, appended as they happen, readable after a kill -9, rotated by size; replayed
//! headless (`duplex replay --recording`) and compared (`duplex compare`): contention in the
//! live run is blamed on the environment, a cost that grows on the code, another pack is a
//! different computation, and bad recordings are named.

use crate::support::packs;
use crate::support::wait;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use wait::wait_until;

fn duplex(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// The one recording folder under `dir`.
fn recording(dir: &Path) -> PathBuf {
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(all.len(), 1, "{all:?}");
    all.remove(0)
}

/// Every timings line of a recording, file by file (a last line cut by a kill is left out).
fn timings(rec: &Path) -> Vec<Vec<serde_json::Value>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(rec)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("timings.")
        })
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            let complete = if text.ends_with('\n') {
                lines.len()
            } else {
                lines.len().saturating_sub(1)
            };
            lines[..complete]
                .iter()
                .map(|l| {
                    serde_json::from_str(l)
                        .unwrap_or_else(|e| panic!("{}: {l:?}: {e}", f.display()))
                })
                .collect()
        })
        .collect()
}

fn pipeline(dir: &Path, seconds: u32, realtime: bool) -> PathBuf {
    pipeline_with(dir, seconds, realtime, "tiny-gqa", "")
}

/// The LM pipeline on `pack`, with `temporal` params added to the temporal stage.
fn pipeline_with(dir: &Path, seconds: u32, realtime: bool, pack: &str, temporal: &str) -> PathBuf {
    let pack = packs::pack(pack);
    let pk = pack.display();
    let p = dir.join("p.yaml");
    std::fs::write(
        &p,
        format!(
            "stages:\n  tone: {{ kind: synth_source, rate: 24000, duration: {seconds}, realtime: {realtime}, chunk_ms: 80 }}\n  framer: {{ kind: framer }}\n  encode: {{ kind: mimi_encode, pack: {pk} }}\n  temporal: {{ kind: temporal, pack: {pk}{temporal} }}\n  depformer: {{ kind: depformer, pack: {pk} }}\n  sink: {{ kind: token_sink, path: {}/tokens.jsonl }}\nlinks:\n  - tone -> framer\n  - framer -> encode\n  - encode -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> sink\nmetrics:\n  address: \"\"\n",
            dir.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn a_recorded_run_has_its_manifest_and_every_frames_timings() {
    let _one = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let p = pipeline(dir.path(), 4, false);
    let recs = dir.path().join("recs");
    let out = duplex(
        dir.path(),
        &[
            "run",
            p.to_str().unwrap(),
            "--set",
            &format!("record.dir={}", recs.display()),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rec = recording(&recs);
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(rec.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["format"], "duplex-recording");
    assert_eq!(m["version"], 2);
    assert_eq!(m["stages"][3]["kind"], "temporal");
    let pack = packs::pack("tiny-gqa").display().to_string();
    let sha = m["packs"][&pack]["temporal/model.onnx"]["sha256"]
        .as_str()
        .unwrap();
    assert_eq!(sha.len(), 64, "{m}");
    let files = timings(&rec);
    assert_eq!(files.len(), 1);
    let lines = &files[0];
    let stages = lines[0]["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 6);
    let temporal = stages.iter().position(|s| s == "temporal").unwrap() as u64;
    let frames: Vec<u64> = lines
        .iter()
        .filter(|l| l["stage"] == temporal && l["service_us"].is_number())
        .map(|l| l["frame"].as_u64().unwrap())
        .collect();
    // 4 s = 50 frames, each timed once, in order; every line has a wall-clock time.
    assert_eq!(frames, (0..50).collect::<Vec<_>>());
    assert!(lines[1..]
        .iter()
        .all(|l| l["t"].as_u64().unwrap() > 1_700_000_000_000_000));
    assert!(lines.iter().any(|l| l["wait_us"].is_number()));

    // The temporal stage's own stream: warm-up, the priming script, then every step's user
    // codes and the agent frame it gave, which is what the token sink wrote.
    let lm: Vec<serde_json::Value> = std::fs::read_to_string(rec.join("lm.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lm[0]["warmup"].is_number(), "{}", lm[0]);
    assert!(!lm[1]["prime"].as_array().unwrap().is_empty(), "{}", lm[1]);
    let steps: Vec<&serde_json::Value> = lm.iter().filter(|l| l["step"].is_number()).collect();
    assert_eq!(steps.len(), 50);
    assert!(steps
        .iter()
        .all(|s| s["user"].as_array().unwrap().len() == 8));
    let agent: Vec<(serde_json::Value, serde_json::Value)> = steps
        .iter()
        .filter(|s| !s["agent"].is_null())
        .map(|s| (s["agent"]["text"].clone(), s["agent"]["audio"].clone()))
        .collect();
    let tokens: Vec<(serde_json::Value, serde_json::Value)> =
        std::fs::read_to_string(dir.path().join("tokens.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (v["text"].clone(), v["audio"].clone())
            })
            .collect();
    assert!(!tokens.is_empty());
    assert_eq!(agent, tokens);
}

#[test]
fn a_killed_run_leaves_a_readable_recording_and_files_rotate_by_size() {
    let _one = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let p = pipeline(dir.path(), 60, true);
    let recs = dir.path().join("recs");
    let mut child = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["run", p.to_str().unwrap(), "--set"])
        .arg(format!("record.dir={}", recs.display()))
        .args(["--set", "record.max_file_kb=8"])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed once two files and 20 of the LM's steps are on disk.
    let on_disk = || -> Option<(usize, usize)> {
        let rec = std::fs::read_dir(&recs).ok()?.next()?.ok()?.path();
        std::fs::read_dir(&rec).ok()?;
        let files = timings(&rec);
        let frames = files
            .iter()
            .flatten()
            .filter(|l| l["stage"] == 3 && l["service_us"].is_number())
            .count();
        let steps = rec.join("lm.jsonl").exists().then(|| lm_steps(&rec))?;
        Some((files.len(), frames.min(steps)))
    };
    wait_until(
        Duration::from_secs(60),
        "two files and 20 steps recorded",
        || on_disk().is_some_and(|(files, frames)| files >= 2 && frames >= 20),
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let files = timings(&recording(&recs));
    assert!(files.len() >= 2, "{} files", files.len());
    for (i, f) in files.iter().enumerate() {
        // Each file says first what its indices mean (the newest may have been opened just
        // before the kill, with no line complete yet).
        if i + 1 < files.len() || !f.is_empty() {
            assert!(f[0]["stages"].is_array(), "file {i}: {:?}", f.first());
        }
    }
    let temporal_frames = files
        .iter()
        .flatten()
        .filter(|l| l["stage"] == 3 && l["service_us"].is_number())
        .count();
    // What was on disk when it was killed is still there, readable.
    assert!(temporal_frames >= 20, "{temporal_frames} frames recorded");
    // What was on disk replays: every recorded step, the same tokens.
    let rec = recording(&recs);
    let out = dir.path().join("replay");
    let r = replay(dir.path(), &rec, &out, &[]);
    let steps = lm_steps(&rec);
    assert!(steps >= 20, "{steps} steps");
    assert!(
        r.contains(&format!("tokens: {steps} of {steps} steps identical")),
        "{r}"
    );
}

fn lm_steps(rec: &Path) -> usize {
    let text = std::fs::read_to_string(rec.join("lm.jsonl")).unwrap();
    let n = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["step"].is_number())
        .count();
    n
}

/// `duplex replay --recording REC --out OUT …`: its standard output (the comparison), after
/// checking it succeeded.
fn replay(dir: &Path, rec: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "replay",
        "--recording",
        rec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = duplex(dir, &args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// Records `seconds` of the LM pipeline with `temporal` params, as fast as it runs.
fn record(dir: &Path, seconds: u32, pack: &str, temporal: &str) -> PathBuf {
    let p = pipeline_with(dir, seconds, false, pack, temporal);
    let recs = dir.join("recs");
    let o = duplex(
        dir,
        &[
            "run",
            p.to_str().unwrap(),
            "--set",
            &format!("record.dir={}", recs.display()),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    recording(&recs)
}

/// The LM runs of these tests are timed: one at a time (every test of this file), so that they
/// do not contend with each other, which is what the comparison would rightly report.
static TIMED: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn live_contention_replayed_headless_is_blamed_on_the_environment() {
    let _one = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // The live run's LM step is contended: one frame in ten takes 50 ms more.
    let rec = record(
        dir.path(),
        40,
        "tiny-gqa",
        ", inject_delay: { mode: bimodal, base_ms: 0, jitter_ms: 0, slow_ms: 50, slow_fraction: 0.1 }",
    );
    let out = dir.path().join("replay");
    let r = replay(dir.path(), &rec, &out, &[]);
    eprintln!("{r}");
    assert!(
        r.contains("stage temporal (500 live frames, 500 headless)"),
        "{r}"
    );
    // The contention is the environment's; on the tiny pack the attention's own growth with the
    // context may also stand out in both runs, and is then named as the code's.
    let verdict = r
        .lines()
        .find(|l| l.starts_with("verdict: temporal: "))
        .unwrap_or("");
    assert!(
        verdict.ends_with("came from the environment (contention)")
            && (verdict.contains("headless is flat and unimodal while live was bimodal")
                || verdict.contains("headless grows like live")),
        "{r}"
    );
    assert!(r.contains("tokens: 500 of 500 steps identical"), "{r}");
    assert!(r.contains("graphs: the same"), "{r}");
    // The live monitor's verdict changed as it ran, and the recording kept it.
    assert!(
        r.lines().any(|l| l.starts_with("live verdict changes: ")
            && l.contains("temporal steady→contention at frame")),
        "{r}"
    );
    // The replay is a recording of its own, with the tokens the live run gave.
    let tokens = |p: &Path| std::fs::read_to_string(p).unwrap();
    assert_eq!(
        tokens(&out.join("tokens.jsonl")),
        tokens(&dir.path().join("tokens.jsonl"))
    );
    let m: serde_json::Value = serde_json::from_str(&tokens(&out.join("manifest.json"))).unwrap();
    assert_eq!(m["replay_of"], rec.display().to_string());
    // `duplex compare` reads the two back to the same verdict.
    let c = duplex(
        dir.path(),
        &["compare", rec.to_str().unwrap(), out.to_str().unwrap()],
    );
    assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
    let text = String::from_utf8_lossy(&c.stdout);
    assert!(
        text.contains("came from the environment (contention)"),
        "{text}"
    );

    // On another pack the replay is flagged as a different computation.
    let other = dir.path().join("other");
    let tiny = packs::pack("tiny").display().to_string();
    let r = replay(dir.path(), &rec, &other, &["--pack", &tiny]);
    assert!(r.contains("graphs: temporal/model.onnx differs"), "{r}");
    assert!(r.contains("a different computation"), "{r}");
}

#[test]
fn a_cost_that_grows_live_and_headless_is_blamed_on_the_code() {
    let _one = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // The naive cache: copied through host arrays every step, a cost that grows with the
    // context. The live run is the LM alone on recorded codes (no encoder racing it on this
    // machine's two cores, which would bury a sub-millisecond rise in noise).
    let codes: Vec<Vec<u32>> = (0..GROWTH_FRAMES)
        .map(|i| {
            (0..8)
                .map(|k| ((i * 7919 + k * 104_729) % 2048) as u32)
                .collect()
        })
        .collect();
    std::fs::write(
        dir.path().join("codes.json"),
        serde_json::to_string(&codes).unwrap(),
    )
    .unwrap();
    // The standard graph with a window longer than the run, so the naive cache's cost grows
    // all the way (the pack's own 3000-frame window would cap it).
    let (_keep, long) = packs::variant("tiny", "context: 8000\n");
    let pk = long.display().to_string();
    let p = dir.path().join("lm.yaml");
    std::fs::write(
        &p,
        format!(
            "stages:\n  codes: {{ kind: codes_source, path: codes.json }}\n  temporal: {{ kind: temporal, pack: {pk}, kv: host }}\n  depformer: {{ kind: depformer, pack: {pk} }}\n  sink: {{ kind: token_sink, path: tokens.jsonl }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> sink\nmetrics:\n  address: \"\"\n"
        ),
    )
    .unwrap();
    let recs = dir.path().join("recs");
    let o = duplex(
        dir.path(),
        &[
            "run",
            p.to_str().unwrap(),
            "--set",
            &format!("record.dir={}", recs.display()),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rec = recording(&recs);
    let r = replay(dir.path(), &rec, &dir.path().join("replay"), &[]);
    eprintln!("{r}");
    // Headless grows, as live did ("headless grows like live"), or live was too noisy on this
    // machine to show it ("headless grows though live did not"): either way, the code.
    let verdict = r.lines().find(|l| l.starts_with("verdict: ")).unwrap_or("");
    assert!(
        verdict.starts_with("verdict: temporal: headless grows")
            && verdict.contains("the cost is in the code (growth)"),
        "{r}"
    );
}

/// Long enough for the naive cache's growth to stand out of the noise on the tiny pack (at
/// 2500 frames, about +0.2 ms, it was once judged flat on a quiet machine).
const GROWTH_FRAMES: usize = 5000;

#[test]
fn bad_recordings_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let _one = TIMED.lock().unwrap_or_else(|e| e.into_inner());
    let rec = record(dir.path(), 2, "tiny-gqa", "");
    let fails = |rec: &Path, want: &str| {
        let out = dir.path().join(format!("r{}", rand_suffix()));
        let o = duplex(
            dir.path(),
            &[
                "replay",
                "--recording",
                rec.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "want {want:?} in\n{err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    let copy = |name: &str| {
        let to = dir.path().join(name);
        std::fs::create_dir_all(&to).unwrap();
        for e in std::fs::read_dir(&rec).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        to
    };
    fails(&dir.path().join("nothing"), "no such recording folder");
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    fails(&empty, "not a recording");
    // From another version of the format.
    let old = copy("old");
    let m = std::fs::read_to_string(old.join("manifest.json")).unwrap();
    std::fs::write(
        old.join("manifest.json"),
        m.replace("\"version\": 2", "\"version\": 1"),
    )
    .unwrap();
    fails(&old, "recording format version 1");
    // A line edited in the middle of the LM stream.
    let edited = copy("edited");
    let lm = std::fs::read_to_string(edited.join("lm.jsonl")).unwrap();
    let mut lines: Vec<&str> = lm.lines().collect();
    lines[3] = "{\"step\": 1, \"user\": [1, 2";
    std::fs::write(edited.join("lm.jsonl"), lines.join("\n") + "\n").unwrap();
    fails(&edited, "lm.jsonl:4: not a recording line");
    // A manifest that is not JSON, and one whose params were edited.
    let broken = copy("broken");
    std::fs::write(broken.join("manifest.json"), "{ \"format\": ").unwrap();
    fails(&broken, "manifest.json: not valid JSON");
    let params = copy("params");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(params.join("manifest.json")).unwrap())
            .unwrap();
    m["stages"][3]["params"]["kv"] = serde_json::json!("sideways");
    std::fs::write(params.join("manifest.json"), m.to_string()).unwrap();
    fails(&params, "`kv`");
    // Cut short mid-line (a kill): still replays.
    let cut = copy("cut");
    let lm = std::fs::read_to_string(cut.join("lm.jsonl")).unwrap();
    std::fs::write(cut.join("lm.jsonl"), &lm[..lm.len() - 20]).unwrap();
    let r = replay(dir.path(), &cut, &dir.path().join("cut-replay"), &[]);
    assert!(r.contains("steps identical"), "{r}");
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn a_recording_folder_that_cannot_be_made_is_refused_before_start() {
    let dir = tempfile::tempdir().unwrap();
    let p = pipeline(dir.path(), 1, false);
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let out = duplex(
        dir.path(),
        &[
            "run",
            p.to_str().unwrap(),
            "--set",
            &format!("record.dir={}", file.display()),
        ],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("record.dir") && err.contains("not-a-dir"),
        "{err}"
    );
}
