//! Recording a run (`record.dir`): a manifest of what ran and the per-frame timings of every
//! stage and link, appended as they happen, readable after a kill -9, rotated by size.

#[path = "support/packs.rs"]
mod packs;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

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
                lines.len() - 1
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
    let pack = packs::pack("tiny-gqa");
    let pk = pack.display();
    let p = dir.join("p.yaml");
    std::fs::write(
        &p,
        format!(
            "stages:\n  tone: {{ kind: synth_source, rate: 24000, duration: {seconds}, realtime: {realtime}, chunk_ms: 80 }}\n  framer: {{ kind: framer }}\n  encode: {{ kind: mimi_encode, pack: {pk} }}\n  temporal: {{ kind: temporal, pack: {pk} }}\n  depformer: {{ kind: depformer, pack: {pk} }}\n  sink: {{ kind: token_sink, path: {}/tokens.jsonl }}\nlinks:\n  - tone -> framer\n  - framer -> encode\n  - encode -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> sink\nmetrics:\n  address: \"\"\n",
            dir.display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn a_recorded_run_has_its_manifest_and_every_frames_timings() {
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
    assert_eq!(m["version"], 1);
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
    std::thread::sleep(Duration::from_secs(4));
    child.kill().unwrap();
    child.wait().unwrap();
    let files = timings(&recording(&recs));
    assert!(files.len() >= 2, "{} files", files.len());
    for f in &files {
        // Each file says what its indices mean.
        assert!(f[0]["stages"].is_array(), "{:?}", f[0]);
    }
    let temporal_frames = files
        .iter()
        .flatten()
        .filter(|l| l["stage"] == 3 && l["service_us"].is_number())
        .count();
    // About 3 s of frames at 12.5 per second were on disk when it was killed.
    assert!(temporal_frames >= 20, "{temporal_frames} frames recorded");
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
