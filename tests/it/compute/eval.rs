//! `duplex eval`: a benchmark's inputs through a pack, offline, in the benchmark's own layout.
//! The output is on the input's clock (its rate, exactly its length, whatever the rate and
//! wherever the length falls against the 80 ms frame), agent frame k where the alignment says,
//! causal (what the agent said before the inputs differ is the same), seeded (a re-run is the
//! same file), resumable, and refused clearly when the inputs are not what it needs. Scored:
//! Silero in duplex is onnxruntime's in Python; spoken conversations' turns, gaps and
//! backchannels are found where they were put; every golden case of the benchmark's metrics is
//! reproduced. Compared: decisions, latency differences and token divergence counted pair by
//! pair on runs of known shape, and the tiny pack against its own graphs under another name
//! (identical) and its int8 and int4 copies (parting), through run, score and compare.
use crate::support::packs;

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::cli::{eval, printed as text};

/// A mono 16-bit WAV of `len` samples at `rate`: a tone with noise, from `seed` on after
/// sample `from` (before it, the same for every seed).
fn wav(path: &Path, rate: u32, len: usize, seed: u64, from: usize) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for k in 0..len {
        if k == from {
            x ^= seed.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let noise = ((x >> 40) as f64 / (1u64 << 24) as f64 - 0.5) * 0.4;
        let tone = (2.0 * std::f64::consts::PI * 300.0 * k as f64 / f64::from(rate)).sin() * 0.3;
        w.write_sample(((tone + noise) * 32767.0 * 0.8) as i16)
            .unwrap();
    }
    w.finalize().unwrap();
}

fn read(path: &Path) -> (u32, Vec<i32>) {
    let mut r = hound::WavReader::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rate = r.spec().sample_rate;
    (rate, r.samples::<i32>().map(|s| s.unwrap()).collect())
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(str::to_string)
        .collect()
}

fn tiny() -> String {
    packs::pack("tiny-gqa").display().to_string()
}

#[test]
fn outputs_are_on_the_inputs_clock_seeded_resumable_and_in_the_benchmarks_layout() {
    let dir = tempfile::tempdir().unwrap();
    let inputs = dir.path().join("fdb");
    // Every rate the benchmark's inputs come in, lengths on and around the 80 ms frame.
    let cases: [(&str, u32, usize); 6] = [
        ("task16/a", 16_000, 1280 * 6 + 1),
        ("task24/b", 24_000, 1920 * 6 - 1),
        ("task24/c", 24_000, 1920 * 6),
        ("task24/d", 24_000, 1920 * 6 + 1),
        ("task48/e", 48_000, 3840 * 6 + 7),
        ("v15/f", 48_000, 3840 * 5),
    ];
    for (rel, rate, len) in cases {
        wav(&inputs.join(rel).join("input.wav"), rate, len, 1, 0);
    }
    // A v1.5 sample: its clean input too, and an annotation that must be beside the output.
    wav(
        &inputs.join("v15/f/clean_input.wav"),
        48_000,
        3840 * 5 - 100,
        2,
        0,
    );
    std::fs::write(inputs.join("v15/f/metadata.json"), "{}").unwrap();
    let out = dir.path().join("out");
    let pack = tiny();
    let args = [
        "run",
        "--pack",
        &pack,
        "--inputs",
        inputs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--seed",
        "3",
    ];
    let o = eval(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("7 inputs run (0 done before)"),
        "{}",
        text(&o)
    );
    let root = out.join("tiny-gqa/seed-3");
    for (rel, rate, len) in cases {
        let d = root.join(rel);
        let (r, samples) = read(&d.join("output.wav"));
        assert_eq!(
            (r, samples.len()),
            (rate, len),
            "{rel}: output.wav against input.wav"
        );
        assert!(
            samples.iter().any(|&s| s != 0),
            "{rel}: the agent said nothing"
        );
        // One token line per 80 ms frame of the input (the last one padded).
        let at24 = len as u64 * 24_000 / u64::from(rate);
        let frames = at24.div_ceil(1920) as usize;
        assert_eq!(lines(&d.join("tokens.jsonl")).len(), frames, "{rel}");
        assert!(d.join("transcript.txt").is_file(), "{rel}");
        // The benchmark's scripts find the input beside the output.
        assert_eq!(
            read(&d.join("input.wav")),
            read(&inputs.join(rel).join("input.wav"))
        );
    }
    let f = root.join("v15/f");
    assert_eq!(read(&f.join("clean_output.wav")).1.len(), 3840 * 5 - 100);
    assert!(f.join("metadata.json").is_file() && f.join("clean_input.wav").is_file());
    assert_eq!(
        lines(&f.join("clean_tokens.jsonl")).len(),
        (3840 * 5 - 100) / 2 / 1920 + 1
    );
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("run.json")).unwrap()).unwrap();
    assert_eq!(run["seed"], 3);
    assert_eq!(run["align"], "personaplex");
    assert_eq!(run["samples"], 6);
    assert_eq!(run["pack"]["name"], "tiny-gqa");
    assert!(run["pack"]["graphs"]["temporal/model.onnx"]["sha256"].is_string());
    assert!(run["this_run"]["real_time_factor"].as_f64().unwrap() > 0.0);

    // Resumed: nothing left to run, nothing rewritten.
    let before = std::fs::metadata(root.join("task24/c/output.wav"))
        .unwrap()
        .modified()
        .unwrap();
    let o = eval(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("0 inputs run (7 done before)"),
        "{}",
        text(&o)
    );
    let after = std::fs::metadata(root.join("task24/c/output.wav"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(before, after);
    // Run again, the same seed: the same conversation, to the sample.
    let first = read(&root.join("task48/e/output.wav"));
    let tokens = lines(&root.join("task48/e/tokens.jsonl"));
    let mut again = args.to_vec();
    again.push("--again");
    let o = eval(&again);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(read(&root.join("task48/e/output.wav")), first);
    assert_eq!(lines(&root.join("task48/e/tokens.jsonl")), tokens);

    // The user left, the agent right, on one clock.
    let o = eval(&["stereo", root.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let mut r = hound::WavReader::open(root.join("task24/b/stereo.wav")).unwrap();
    assert_eq!((r.spec().channels, r.spec().sample_rate), (2, 24_000));
    let both: Vec<i32> = r.samples::<i32>().map(|s| s.unwrap()).collect();
    let left: Vec<i32> = both.iter().step_by(2).copied().collect();
    let right: Vec<i32> = both.iter().skip(1).step_by(2).copied().collect();
    assert_eq!(left, read(&inputs.join("task24/b/input.wav")).1);
    assert_eq!(right, read(&root.join("task24/b/output.wav")).1);
}

#[test]
fn the_agent_is_causal_and_placed_where_the_alignment_says() {
    let dir = tempfile::tempdir().unwrap();
    // Two inputs the same up to sample m, then not.
    let m = 1920 * 6 + 500;
    let inputs = dir.path().join("in");
    wav(&inputs.join("x/input.wav"), 24_000, 1920 * 15, 1, m);
    wav(&inputs.join("y/input.wav"), 24_000, 1920 * 15, 2, m);
    let run = |align: &str| -> PathBuf {
        let out = dir.path().join(align);
        let o = eval(&[
            "run",
            "--pack",
            &tiny(),
            "--inputs",
            inputs.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--align",
            align,
        ]);
        assert!(o.status.success(), "{}", text(&o));
        out.join("tiny-gqa/seed-0")
    };
    let pp = run("personaplex");
    let (x, y) = (
        lines(&pp.join("x/tokens.jsonl")),
        lines(&pp.join("y/tokens.jsonl")),
    );
    let first = x.iter().zip(&y).position(|(a, b)| a != b);
    // Agent frame k has heard the user's frames before k (the LM's one-step token ring): the
    // same through frame m / 1920, where the inputs part, then not.
    let parted = m / 1920;
    assert!(
        first.is_some(),
        "different inputs, the same conversation: {x:?}"
    );
    assert!(
        first.unwrap() > parted,
        "frame {first:?} differs, the inputs part in frame {parted}"
    );
    let (_, xa) = read(&pp.join("x/output.wav"));
    let (_, ya) = read(&pp.join("y/output.wav"));
    let through = (parted + 1) * 1920;
    assert_eq!(xa[..through], ya[..through]);
    // Kyutai's client writes what it hears one frame later: the same audio, 80 ms on.
    let mc = run("moshi-client");
    let (_, late) = read(&mc.join("x/output.wav"));
    assert_eq!(late.len(), xa.len());
    assert!(late[..1920].iter().all(|&s| s == 0));
    assert_eq!(late[1920..], xa[..xa.len() - 1920]);
}

/// `duplex eval run --pack PACK --inputs INPUTS --out OUT`: its exit code and its words.
fn run_on(pack: &Path, inputs: &Path, out: &Path) -> (Option<i32>, String) {
    let o = eval(&[
        "run",
        "--pack",
        pack.to_str().unwrap(),
        "--inputs",
        inputs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    (o.status.code(), text(&o))
}

#[test]
fn inputs_it_cannot_run_are_refused_naming_them_and_what_was_done_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = packs::pack("tiny-gqa");
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = dir.path().join("out");
    let (code, said) = run_on(&tiny, &empty, &out);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("no input.wav in it or its folders"), "{said}");
    // A good sample, then one that is not a WAV: the first is written, the second named.
    let inputs = dir.path().join("in");
    wav(&inputs.join("a/input.wav"), 24_000, 1920 * 4, 1, 0);
    std::fs::create_dir_all(inputs.join("b")).unwrap();
    std::fs::write(inputs.join("b/input.wav"), "not a wav").unwrap();
    let (code, said) = run_on(&tiny, &inputs, &out);
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("b/input.wav"), "{said}");
    assert!(out.join("tiny-gqa/seed-0/a/output.wav").is_file());
    assert!(!out.join("tiny-gqa/seed-0/b/output.wav").exists());
    // Links to folders are not followed (two links to `.` walked for ever), and a float WAV
    // holding NaN is refused naming the file and why, the samples before it kept.
    let walk = dir.path().join("walk");
    wav(&walk.join("a/input.wav"), 24_000, 1920 * 2, 1, 0);
    std::os::unix::fs::symlink(".", walk.join("loop1")).unwrap();
    std::os::unix::fs::symlink("..", walk.join("a/loop2")).unwrap();
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 32,
        sample_format: hound::SampleFormat::Float,
    };
    std::fs::create_dir_all(walk.join("c")).unwrap();
    let mut w = hound::WavWriter::create(walk.join("c/input.wav"), spec).unwrap();
    for i in 0..1920 * 2 {
        w.write_sample(if i == 100 { f32::NAN } else { 0.1 })
            .unwrap();
    }
    w.finalize().unwrap();
    let walked = dir.path().join("walked");
    let (code, said) = run_on(&tiny, &walk, &walked);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("c/input.wav") && said.contains("not a finite number"),
        "{said}"
    );
    assert!(walked.join("tiny-gqa/seed-0/a/output.wav").is_file());
    assert!(
        !walked.join("tiny-gqa/seed-0/loop1").exists(),
        "a link was walked"
    );
    // Not a pack.
    let (code, said) = run_on(&inputs, &inputs, &out);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("not a model pack"), "{said}");
}

/// `words` spoken by espeak-ng, at 16 kHz (resampled by duplex's resampler).
fn spoken(dir: &Path, words: &str) -> Vec<f32> {
    let raw = dir.join(format!("{}.wav", words.len()));
    let o = Command::new("espeak-ng")
        .args(["-v", "en", "-s", "160", "-w"])
        .arg(&raw)
        .arg(words)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut r = duplex::audio::WavReader::open(&raw).unwrap();
    let rate = r.rate();
    let x = r.read_all().unwrap();
    let mut rs = duplex::audio::StreamResampler::new(rate, 16_000, 1024).unwrap();
    let mut out = Vec::new();
    rs.process(&x, &mut out).unwrap();
    rs.flush(&mut out).unwrap();
    out
}

/// Where `x` is louder than its silence: the first and last sample over 2 % of full scale.
fn loud(x: &[f32]) -> (usize, usize) {
    let first = x.iter().position(|v| v.abs() > 0.02).unwrap();
    let last = x.iter().rposition(|v| v.abs() > 0.02).unwrap();
    (first, last)
}

fn write16(path: &Path, x: &[f32]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut w =
        duplex::audio::WavWriter::create(path, 16_000, duplex::audio::WavFormat::I16).unwrap();
    w.write(x).unwrap();
    w.finalize().unwrap();
}

#[test]
fn silero_in_duplex_gives_python_onnxruntimes_probabilities() {
    let dir = tempfile::tempdir().unwrap();
    let x = spoken(dir.path(), "the quick brown fox jumps over the lazy dog");
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/vad/silero_vad.onnx");
    let vad = duplex::model::vad::Vad::open(&model).unwrap();
    let ours = vad.probabilities(&x).unwrap();
    // The same samples through Silero's loop written here in Python, on onnxruntime.
    let raw = dir.path().join("x.f32");
    std::fs::write(
        &raw,
        x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    let script = r#"
import json, sys, numpy as np, onnxruntime as ort
x = np.fromfile(sys.argv[2], dtype="<f4")
s = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
state, context, probs = np.zeros((2, 1, 128), np.float32), np.zeros(64, np.float32), []
for i in range(0, len(x), 512):
    chunk = np.zeros(512, np.float32)
    chunk[: len(x[i:i + 512])] = x[i:i + 512]
    window = np.concatenate([context, chunk])[None, :]
    out, state = s.run(None, {"input": window, "state": state, "sr": np.array(16000, np.int64)})
    probs.append(float(out.reshape(-1)[0]))
    context = window[0, -64:]
print(json.dumps(probs))
"#;
    let o = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"))
        .args(["-c", script])
        .arg(&model)
        .arg(&raw)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let theirs: Vec<f32> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ours.len(), theirs.len());
    let worst = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-5, "probabilities differ by up to {worst}");
    assert!(
        ours.iter().filter(|&&p| p > 0.5).count() > 20,
        "no speech heard in {ours:?}"
    );
}

#[test]
fn a_scored_conversation_gives_the_gap_between_the_turns_where_the_speech_is() {
    let dir = tempfile::tempdir().unwrap();
    let user = spoken(dir.path(), "hello there, how are you today");
    let agent = spoken(dir.path(), "I am fine, thank you");
    let (u0, u1) = loud(&user);
    let (a0, _) = loud(&agent);
    // The user from 0.5 s; the agent answers 0.8 s after the user's last sound.
    let total = 16_000 * 7;
    let user_at = 8000 - u0;
    let user_end = user_at + u1;
    let agent_at = user_end + 12_800 - a0;
    let mut input = vec![0.0f32; total];
    input[user_at..user_at + user.len()].copy_from_slice(&user);
    let mut output = vec![0.0f32; total];
    output[agent_at..agent_at + agent.len()].copy_from_slice(&agent);
    let sample = dir.path().join("run/candor_turn_taking/1");
    write16(&sample.join("input.wav"), &input);
    write16(&sample.join("output.wav"), &output);
    // The benchmark's annotation (the user's turn ends where the user stops) and an ASR of the
    // output (its words where the agent speaks).
    let (t_user_end, t_agent) = (user_end as f64 / 16000.0, (agent_at + a0) as f64 / 16000.0);
    std::fs::write(
        sample.join("turn_taking.json"),
        format!(
            "[{{\"text\": \"[TURN-TAKING]\", \"timestamp\": [{t_user_end}, {}]}}]",
            t_user_end + 0.5
        ),
    )
    .unwrap();
    let words: Vec<String> = (0..5)
        .map(|k| {
            let s = t_agent + 0.25 * k as f64;
            format!("{{\"text\": \"w{k}\", \"timestamp\": [{s}, {}]}}", s + 0.2)
        })
        .collect();
    std::fs::write(
        sample.join("output.json"),
        format!("{{\"text\": \"\", \"chunks\": [{}]}}", words.join(", ")),
    )
    .unwrap();
    let o = eval(&["score", dir.path().join("run").to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let said = text(&o);
    assert!(said.contains("candor_turn_taking: 1;"), "{said}");
    assert!(said.contains("smooth turn-taking TOR 1.000"), "{said}");
    let score: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sample.join("duplex_score.json")).unwrap())
            .unwrap();
    // The detector's segments are where the speech is, within its padding and its 32 ms chunks.
    let seg = |who: &str| -> Vec<(f64, f64)> {
        score["vad"][who]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| (s[0].as_f64().unwrap(), s[1].as_f64().unwrap()))
            .collect()
    };
    let (u, a) = (seg("user"), seg("agent"));
    assert!(!u.is_empty() && !a.is_empty(), "{score}");
    let near = |got: f64, want: f64| (got - want).abs() < 0.15;
    assert!(near(u[0].0, 0.5), "user starts at {} (0.5)", u[0].0);
    assert!(
        near(u.last().unwrap().1, t_user_end),
        "user ends at {:?} ({t_user_end})",
        u.last()
    );
    assert!(
        near(a[0].0, t_agent),
        "agent starts at {} ({t_agent})",
        a[0].0
    );
    // The response latency interval: from the user's end to the agent's start, as the
    // benchmark computes it from these segments.
    let resp = &score["v1.5"]["response_latency_intervals"][0];
    let (r0, r1) = (resp[0].as_f64().unwrap(), resp[1].as_f64().unwrap());
    assert!(
        near(r0, t_user_end) && near(r1, t_agent),
        "{resp} against [{t_user_end}, {t_agent}]"
    );
    assert!(
        score["v1.5"]["stop_latency_intervals"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{score}"
    );
    // v1 from the ASR: the turn taken, 0.8 s after the user's end.
    let turn = &score["v1"]["smooth_turn_taking"];
    assert_eq!(turn["tor"], 1);
    assert!(near(turn["latency"].as_f64().unwrap(), 0.8), "{turn}");
}

/// `compare.json`'s row for `pack`, `task`, `seed`.
fn row<'a>(v: &'a serde_json::Value, pack: &str, task: &str, seed: &str) -> &'a serde_json::Value {
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["pack"] == pack && r["task"] == task && r["seed"] == seed)
        .unwrap_or_else(|| panic!("no row {pack} {task} {seed} in {v}"))
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn compare_counts_each_pairs_decisions_and_latency_difference_and_where_tokens_part() {
    use duplex::eval::paired::mcnemar_exact;
    let dir = tempfile::tempdir().unwrap();
    let user = spoken(dir.path(), "hello there, how are you today");
    let agent = spoken(dir.path(), "I am fine, thank you");
    let (u0, u1) = (loud(&user).0, loud(&user).1);
    let a0 = loud(&agent).0;
    let out = dir.path().join("out");
    let total = 16_000 * 6;
    let user_at = 8000 - u0;
    let user_end = user_at + u1;
    let mut input = vec![0.0f32; total];
    input[user_at..user_at + user.len()].copy_from_slice(&user);
    // Two packs' runs, two seeds, three samples: the base answers 0.5 s after the user; the
    // other 0.3, 0.4 s later than the base in samples 0 and 1, and not at all in sample 2. Its
    // tokens part from the base's at frame 10 with seed 0, never with seed 1.
    let frames = 75;
    for (pack, quantization) in [("float", "null"), ("quant", "{\"temporal\": \"int4\"}")] {
        for seed in [0u64, 1] {
            let root = out.join(pack).join(format!("seed-{seed}"));
            std::fs::create_dir_all(&root).unwrap();
            std::fs::write(
                root.join("run.json"),
                format!("{{\"pack\": {{\"quantization\": {quantization}}}, \"seed\": {seed}}}"),
            )
            .unwrap();
            for k in 0..3usize {
                let sample = root.join(format!("talk/{k}"));
                write16(&sample.join("input.wav"), &input);
                let mut output = vec![0.0f32; total];
                let later = match (pack, k) {
                    ("float", _) => Some(0),
                    ("quant", 2) => None,
                    (_, k) => Some(4800 + 1600 * k),
                };
                if let Some(later) = later {
                    let at = user_end + 8000 + later - a0;
                    output[at..at + agent.len()].copy_from_slice(&agent);
                }
                write16(&sample.join("output.wav"), &output);
                let log: String = (0..frames)
                    .map(|f| {
                        let text = if pack == "quant" && seed == 0 && f >= 10 {
                            4
                        } else {
                            3
                        };
                        format!("{{\"frame\":{f},\"text\":{text},\"audio\":[{f},1]}}\n")
                    })
                    .collect();
                std::fs::write(sample.join("tokens.jsonl"), log).unwrap();
            }
        }
    }
    // Two packs of float weights would leave the base unsaid; here it is the float one.
    let o = eval(&["compare", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let said = text(&o);
    assert!(said.contains("| quant | talk | all | 6 |"), "{said}");
    let v = read_json(&out.join("compare.json"));
    assert_eq!(v["base"], "float");
    let all = row(&v, "quant", "talk", "all");
    // Answers: both in samples 0 and 1, only the base in 2; never over the user.
    let answers = &all["responds"];
    assert_eq!(
        (
            answers["both"].as_u64(),
            answers["first_only"].as_u64(),
            answers["second_only"].as_u64(),
            answers["neither"].as_u64()
        ),
        (Some(4), Some(2), Some(0), Some(0)),
        "{all}"
    );
    assert_eq!(all["responds_p"].as_f64().unwrap(), mcnemar_exact(2, 0));
    assert_eq!(all["overlaps"]["neither"], 6, "{all}");
    // 0.3 s and 0.4 s later, twice each: the mean 0.35 s, its interval around it.
    let d = &all["response_latency"];
    let (mean, low, high) = (
        d["mean"].as_f64().unwrap(),
        d["low"].as_f64().unwrap(),
        d["high"].as_f64().unwrap(),
    );
    assert_eq!(d["n"], 4);
    assert!((mean - 0.35).abs() < 0.04, "{d}");
    assert!(
        low <= mean && mean <= high && low > 0.25 && high < 0.45,
        "{d}"
    );
    // Tokens: seed 1's streams are the same; seed 0's part at frame 10, text and all.
    assert_eq!(all["identical"], 3);
    assert_eq!(all["first_divergence_frame"], 10.0);
    assert_eq!(all["first_text_divergence_frame"], 10.0);
    let s0 = row(&v, "quant", "talk", "0");
    let s1 = row(&v, "quant", "talk", "1");
    assert_eq!(
        (s0["pairs"].as_u64(), s1["pairs"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(
        (s0["identical"].as_u64(), s1["identical"].as_u64()),
        (Some(0), Some(3))
    );
    // Every sample was scored on the way, and the plot names both the pack and the task.
    assert!(out.join("float/seed-1/talk/2/duplex_score.json").is_file());
    let svg = std::fs::read_to_string(out.join("compare.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("quant · talk"),
        "{}",
        &svg[..200.min(svg.len())]
    );
    // A base that is not there, and a folder of one pack, are refused before anything.
    let o = eval(&["compare", out.to_str().unwrap(), "--base", "fp32"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("no pack `fp32`") && text(&o).contains("float, quant"),
        "{}",
        text(&o)
    );
    let o = eval(&["compare", out.join("quant").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

#[test]
fn the_tiny_pack_its_copy_and_its_int8_and_int4_copies_run_and_compare_on_spoken_conversations() {
    let dir = tempfile::tempdir().unwrap();
    // Two tasks of two spoken conversations, the user's speech where each says.
    let inputs = dir.path().join("in");
    let mut spoken_at = Vec::new();
    for (k, (task, words, at)) in [
        ("turn", "hello there, how are you today", 0.5),
        ("turn", "what is the weather like", 0.8),
        ("pause", "tell me a story about a cat", 0.3),
        ("pause", "good morning", 1.0),
    ]
    .into_iter()
    .enumerate()
    {
        let x = spoken(dir.path(), words);
        let (first, last) = loud(&x);
        let start = (at * 16_000.0) as usize - first;
        let mut input = vec![0.0f32; 16_000 * 3];
        input[start..start + x.len()].copy_from_slice(&x);
        let rel = format!("{task}/{k}");
        write16(&inputs.join(&rel).join("input.wav"), &input);
        spoken_at.push((rel, at, (start + last) as f64 / 16_000.0));
    }
    // The packs: the tiny one, the same graphs under another name, int8 and int4 copies.
    let packs = dir.path().join("packs");
    let same = packs.join("tiny-same");
    std::fs::create_dir_all(&same).unwrap();
    for e in std::fs::read_dir(tiny()).unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(e.path(), same.join(e.file_name())).unwrap();
    }
    let mut all = vec![tiny(), same.display().to_string()];
    for q in ["int8", "int4"] {
        // Named as the pack's folder is: `tiny-gqa-int8`.
        all.push(packs::quantized("tiny-gqa", q).display().to_string());
    }
    let out = dir.path().join("out");
    let mut args = vec![
        "run",
        "--inputs",
        inputs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--seed",
        "0,1",
    ];
    for p in &all {
        args.extend(["--pack", p.as_str()]);
    }
    let o = eval(&args);
    assert!(o.status.success(), "{}", text(&o));
    // Two packs of float weights: the base must be said.
    let o = eval(&["compare", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--base") && text(&o).contains("tiny-gqa, tiny-same"),
        "{}",
        text(&o)
    );
    let o = eval(&["compare", out.to_str().unwrap(), "--base", "tiny-gqa"]);
    assert!(o.status.success(), "{}", text(&o));
    eprintln!("{}", String::from_utf8_lossy(&o.stdout));
    // The user's speech is found where it was put, in every run (the detector's padding and
    // chunks: within 0.15 s).
    for (rel, start, end) in &spoken_at {
        for seed in ["seed-0", "seed-1"] {
            let s = read_json(
                &out.join("tiny-gqa-int4")
                    .join(seed)
                    .join(rel)
                    .join("duplex_score.json"),
            );
            let user = s["vad"]["user"].as_array().unwrap();
            let (u0, u1) = (
                user[0][0].as_f64().unwrap(),
                user.last().unwrap()[1].as_f64().unwrap(),
            );
            assert!(
                (u0 - start).abs() < 0.15 && (u1 - end).abs() < 0.15,
                "{rel}: {user:?} against [{start}, {end}]"
            );
        }
    }
    let v = read_json(&out.join("compare.json"));
    for task in ["turn", "pause"] {
        // The same graphs: every pair the same, token for token, decision for decision.
        let r = row(&v, "tiny-same", task, "all");
        assert_eq!(r["pairs"], 4, "{r}");
        assert_eq!(r["identical"], 4, "{r}");
        assert_eq!(
            r["responds"]["first_only"].as_u64().unwrap()
                + r["responds"]["second_only"].as_u64().unwrap(),
            0,
            "{r}"
        );
        assert_eq!(r["responds_p"], 1.0);
        if let Some(d) = r["response_latency"].as_object() {
            assert_eq!(
                (d["low"].as_f64(), d["high"].as_f64()),
                (Some(0.0), Some(0.0)),
                "{r}"
            );
        }
        // Four bits part from the float pack (sampled with the same seeds: where the weights
        // move a draw across a boundary).
        let r = row(&v, "tiny-gqa-int4", task, "all");
        assert_eq!(r["pairs"], 4, "{r}");
        assert!(
            r["identical"].as_u64().unwrap() < 4 && r["first_divergence_frame"].is_number(),
            "{r}"
        );
        // Per seed, too.
        for seed in ["0", "1"] {
            assert_eq!(row(&v, "tiny-gqa-int8", task, seed)["pairs"], 2);
        }
    }
    let svg = std::fs::read_to_string(out.join("compare.svg")).unwrap();
    for p in ["tiny-same", "tiny-gqa-int8", "tiny-gqa-int4"] {
        assert!(svg.contains(p), "{p} not in the plot");
    }
}

#[test]
fn backchannels_are_counted_and_their_timing_set_against_the_reference() {
    use duplex::eval::fdb;
    let dir = tempfile::tempdir().unwrap();
    let yeah = spoken(dir.path(), "yeah");
    let (y0, y1) = loud(&yeah);
    // The agent says "yeah" at 1.0 s and at 2.5 s of a 4 s output, the user talks throughout.
    let total = 16_000 * 4;
    let mut output = vec![0.0f32; total];
    for at in [16_000, 40_000] {
        let from = at - y0;
        output[from..from + yeah.len()].copy_from_slice(&yeah);
    }
    let user = spoken(
        dir.path(),
        "so I went to the market and then I came back home again",
    );
    let mut input = vec![0.0f32; total];
    let n = user.len().min(total);
    input[..n].copy_from_slice(&user[..n]);
    let run = dir.path().join("run");
    let sample = run.join("icc_backchannel/7");
    write16(&sample.join("input.wav"), &input);
    write16(&sample.join("output.wav"), &output);
    // An invented reference: more weight early than late.
    let gt: Vec<f64> = (0..20).map(|k| 1.0 / (1.0 + f64::from(k))).collect();
    let reference = dir.path().join("gt.json");
    std::fs::write(
        &reference,
        serde_json::json!({"7": gt, "8": [1.0, 2.0]}).to_string(),
    )
    .unwrap();
    let score = |extra: &[&str]| {
        let mut args = vec![
            "score",
            run.to_str().unwrap(),
            "--backchannel-reference",
            reference.to_str().unwrap(),
        ];
        args.extend(extra);
        eval(&args)
    };
    // The ASR's words: one "yeah" in each.
    let len_s = (y1 - y0) as f64 / 16_000.0;
    let said: Vec<fdb::Word> = [1.0, 2.5]
        .iter()
        .map(|at| fdb::Word {
            start: Some(at + 0.02),
            end: Some(at + len_s - 0.02),
        })
        .collect();
    let chunks: Vec<String> = said
        .iter()
        .map(|w| {
            format!(
                "{{\"text\": \"yeah\", \"timestamp\": [{}, {}]}}",
                w.start.unwrap(),
                w.end.unwrap()
            )
        })
        .collect();
    std::fs::write(
        sample.join("output.json"),
        format!("{{\"text\": \"\", \"chunks\": [{}]}}", chunks.join(", ")),
    )
    .unwrap();
    let o = score(&[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("backchannel frequency 0.500/s, JSD"),
        "{}",
        text(&o)
    );
    let got = read_json(&sample.join("duplex_score.json"));
    let bc = &got["v1"]["backchannel"];
    let found: Vec<(f64, f64)> = bc["backchannels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s[0].as_f64().unwrap(), s[1].as_f64().unwrap()))
        .collect();
    // Two, where the agent said them (Silero's 0.1 s rounding and padding: within 0.15 s).
    assert_eq!(found.len(), 2, "{bc}");
    for ((a, b), at) in found.iter().zip([1.0, 2.5]) {
        assert!(
            (a - at).abs() < 0.15 && (b - (at + len_s)).abs() < 0.15,
            "{found:?}"
        );
    }
    // Short, a word each: backchannels, not a turn taken; the JSD is the benchmark's on those
    // segments and that reference.
    assert_eq!(bc["tor"], 0, "{bc}");
    let want = fdb::backchannel(&found, Some(&said), 16_000, total as u64, &gt);
    assert_eq!(bc["jsd"].as_f64().unwrap(), want.jsd);
    assert!(want.jsd > 0.0 && want.jsd < 1.0, "{want:?}");
    // Without the ASR the benchmark counts no backchannel (and has no TOR): the same here.
    std::fs::remove_file(sample.join("output.json")).unwrap();
    let o = score(&[]);
    assert!(o.status.success(), "{}", text(&o));
    let bc = &read_json(&sample.join("duplex_score.json"))["v1"]["backchannel"];
    assert_eq!(
        (bc["frequency"].as_f64(), bc["jsd"].as_f64()),
        (Some(0.0), Some(1.0)),
        "{bc}"
    );
    assert!(bc["tor"].is_null(), "{bc}");
    // A FIFO (waited on for ever before): refused at once.
    std::fs::remove_file(&reference).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(&reference)
        .status()
        .unwrap()
        .success());
    let o = score(&[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not a regular file"), "{}", text(&o));
    std::fs::remove_file(&reference).unwrap();
    // A reference that is not one: refused, naming the flag and the file.
    std::fs::write(&reference, "{\"7\": [1.0]}").unwrap();
    let o = score(&[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("--backchannel-reference") && text(&o).contains("fewer than two"),
        "{}",
        text(&o)
    );
}

mod golden {
    //! Every case of `tests/data/fdb-golden/cases.json` (invented inputs, the values
    //! Full-Duplex-Bench's own functions give for them; see its README) through
    //! `duplex::eval::fdb`: bit for bit where FDB's arithmetic is one expression, within 1e-12
    //! where it sums with numpy.
    use duplex::eval::fdb::{self, Segment, Word};
    use serde_json::Value;

    fn words(v: &Value) -> Vec<Word> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|w| Word {
                start: w["start"].as_f64(),
                end: w["end"].as_f64(),
            })
            .collect()
    }

    fn segs(v: &Value) -> Vec<Segment> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| (s[0].as_f64().unwrap(), s[1].as_f64().unwrap()))
            .collect()
    }

    fn pairs(v: &[[f64; 2]]) -> Value {
        v.iter().map(|p| Value::from(p.to_vec())).collect()
    }

    fn opt(x: Option<f64>) -> Value {
        x.map_or(Value::Null, Value::from)
    }

    /// `got` against `want`: numbers equal as doubles (`tol` relative where given), nulls,
    /// lists and objects alike; `at` names the field.
    fn same(got: &Value, want: &Value, tol: f64, at: &str, faults: &mut Vec<String>) {
        match (got, want) {
            (Value::Number(a), Value::Number(b)) => {
                let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
                let ok = if tol == 0.0 {
                    a == b
                } else {
                    (a - b).abs() <= tol * b.abs().max(f64::MIN_POSITIVE)
                };
                if !ok {
                    faults.push(format!("{at}: {a:?}, FDB {b:?}"));
                }
            }
            (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
                for (k, (x, y)) in a.iter().zip(b).enumerate() {
                    same(x, y, tol, &format!("{at}[{k}]"), faults);
                }
            }
            (Value::Object(a), Value::Object(b)) if a.len() == b.len() => {
                for (k, y) in b {
                    let x = a.get(k).unwrap_or(&Value::Null);
                    same(x, y, tol, &format!("{at}.{k}"), faults);
                }
            }
            (a, b) if a == b => {}
            (a, b) => faults.push(format!("{at}: {a}, FDB {b}")),
        }
    }

    fn turn_value(t: Option<fdb::Turn>) -> Value {
        let t = t.expect("FDB computes this case");
        serde_json::json!({"tor": t.tor, "latency_raw": opt(t.latency_raw), "latency": opt(t.latency)})
    }

    fn bc_value(b: &fdb::Backchannel, full: bool) -> Value {
        let list = |v: &[f64]| -> Value {
            if v.is_empty() {
                Value::Null
            } else {
                Value::from(v.to_vec())
            }
        };
        let mut v = serde_json::json!({
            "tor": b.tor,
            "backchannels": b.backchannels.iter().map(|s| vec![s.0, s.1]).collect::<Vec<_>>(),
            "freq": b.freq,
            "jsd": b.jsd,
        });
        if full {
            v["max_end_time"] = b.max_end_time.into();
            v["n_bins"] = if b.n_bins == 0 {
                Value::Null
            } else {
                b.n_bins.into()
            };
            v["pred_distribution"] = list(&b.pred_distribution);
            v["gt_resized"] = list(&b.gt_resized);
        }
        v
    }

    fn backchannels(samples: &[&Value]) -> Vec<fdb::Backchannel> {
        let mut carried = None;
        samples
            .iter()
            .map(|i| {
                let w = words(&i["model_words"]);
                let mut b = fdb::backchannel(
                    &segs(&i["model_segments"]),
                    i["has_output_json"].as_bool().unwrap().then_some(&w[..]),
                    i["output_sample_rate"].as_u64().unwrap() as u32,
                    i["output_num_samples"].as_u64().unwrap(),
                    &i["gt_distribution"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap())
                        .collect::<Vec<_>>(),
                );
                // (no ASR: FDB keeps the TOR the sample before it left)
                b.tor = b.tor.or(carried);
                carried = b.tor;
                b
            })
            .collect()
    }

    fn mean(v: impl Iterator<Item = f64>) -> f64 {
        let v: Vec<f64> = v.collect();
        v.iter().sum::<f64>() / v.len() as f64
    }

    /// What duplex computes for `case`, in the shape of its `expected`, and the fields compared
    /// within a tolerance.
    fn computed(case: &Value) -> (Value, &'static [&'static str]) {
        let input = &case["input"];
        let set = case["level"] == "set";
        let samples: Vec<&Value> = if set {
            input["samples"].as_array().unwrap().iter().collect()
        } else {
            vec![input]
        };
        match case["metric"].as_str().unwrap() {
            "v1_pause_handling" => {
                let tors: Vec<u8> = samples
                    .iter()
                    .map(|s| fdb::take_turn(&words(&s["model_words"]), true).unwrap())
                    .collect();
                if set {
                    let avg = tors.iter().map(|&t| f64::from(t)).sum::<f64>() / tors.len() as f64;
                    let per: Vec<Value> =
                        tors.iter().map(|t| serde_json::json!({"tor": t})).collect();
                    (
                        serde_json::json!({"per_sample": per, "average_tor": avg}),
                        &[],
                    )
                } else {
                    (serde_json::json!({"tor": tors[0]}), &[])
                }
            }
            m @ ("v1_smooth_turn_taking" | "v1_user_interruption") => {
                let turns: Vec<Option<fdb::Turn>> = samples
                    .iter()
                    .map(|s| {
                        let at = if m == "v1_smooth_turn_taking" {
                            s["turn_window"][0].as_f64().unwrap()
                        } else {
                            s["interrupt_window"][1].as_f64().unwrap()
                        };
                        fdb::turn(&words(&s["model_words"]), at)
                    })
                    .collect();
                if !set {
                    return (turn_value(turns[0]), &[]);
                }
                let all: Vec<fdb::Turn> = turns.iter().map(|t| t.unwrap()).collect();
                let (tor, lat) = fdb::turn_means(&all);
                let mut v = serde_json::json!({
                    "per_sample": turns.into_iter().map(turn_value).collect::<Vec<_>>(),
                    "average_tor": tor,
                    "average_latency": opt(lat),
                });
                if lat.is_none() {
                    v["fdb_raises"] = "ZeroDivisionError".into();
                }
                (v, &[])
            }
            "v1_backchannel" => {
                let b = backchannels(&samples);
                if !set {
                    return (bc_value(&b[0], true), &["jsd", "pred_distribution"]);
                }
                (
                    serde_json::json!({
                        "per_sample": b.iter().map(|x| bc_value(x, false)).collect::<Vec<_>>(),
                        "mean_jsd": mean(b.iter().map(|x| x.jsd)),
                        "mean_tor": mean(b.iter().map(|x| f64::from(x.tor.unwrap()))),
                        "mean_freq": mean(b.iter().map(|x| x.freq)),
                    }),
                    &["jsd", "mean_jsd", "mean_tor", "mean_freq"],
                )
            }
            "v15_get_timing" => {
                let secs = |v: &Value| -> Vec<Segment> {
                    v.as_array()
                        .unwrap()
                        .iter()
                        .map(|s| {
                            (
                                s[0].as_f64().unwrap() / 16000.0,
                                s[1].as_f64().unwrap() / 16000.0,
                            )
                        })
                        .collect()
                };
                let t = fdb::timing(
                    &secs(&input["user_vad_samples"]),
                    &secs(&input["model_vad_samples"]),
                );
                let segs = |s: &[Segment]| -> Value { s.iter().map(|p| vec![p.0, p.1]).collect() };
                (
                    serde_json::json!({
                        "user_merged": segs(&t.user_merged),
                        "model_merged": segs(&t.model_merged),
                        "latency_stop_list": pairs(&t.stop),
                        "latency_resp_list": pairs(&t.response),
                    }),
                    &[],
                )
            }
            "v15_get_timing_function" => {
                let f = input["function"].as_str().unwrap();
                let v = match f {
                    "overlaps" => {
                        serde_json::json!({"result": pairs(&fdb::overlaps(&segs(&input["user"]), &segs(&input["model"])))})
                    }
                    "response_gaps" => {
                        serde_json::json!({"result": pairs(&fdb::response_gaps(&segs(&input["user"]), &segs(&input["model"])))})
                    }
                    "_merge" => {
                        serde_json::json!({"merged": fdb::merge(&segs(&input["segments"]), input["gap"].as_f64().unwrap()).iter().map(|p| vec![p.0, p.1]).collect::<Vec<_>>()})
                    }
                    other => panic!("no function {other}"),
                };
                (v, &[])
            }
            "python_round" => {
                let x: Vec<f64> = input["x"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                (
                    serde_json::json!({
                        "round_3": x.iter().map(|&v| fdb::round3(v)).collect::<Vec<_>>(),
                        "ms_key": x.iter().map(|&v| fdb::ms_key(v)).collect::<Vec<_>>(),
                        "round_1": x.iter().map(|&v| fdb::round1(v)).collect::<Vec<_>>(),
                    }),
                    &[],
                )
            }
            other => panic!("no metric {other}"),
        }
    }

    #[test]
    fn every_full_duplex_bench_golden_case_is_reproduced() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/fdb-golden/cases.json");
        let cases: Vec<Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(cases.len(), 94);
        let mut faults = Vec::new();
        for case in &cases {
            let name = case["name"].as_str().unwrap();
            let (got, tolerant) = computed(case);
            let want = &case["expected"];
            for (k, w) in want.as_object().unwrap() {
                let tol = if tolerant.contains(&k.as_str()) {
                    1e-12
                } else {
                    0.0
                };
                // (per-sample backchannel JSDs are numpy sums too)
                let tol = if k == "per_sample" && case["metric"] == "v1_backchannel" {
                    1e-12
                } else {
                    tol
                };
                let g = got.get(k).cloned().unwrap_or(Value::Null);
                same(&g, w, tol, &format!("{name}.{k}"), &mut faults);
            }
        }
        assert!(
            faults.is_empty(),
            "{} faults:\n{}",
            faults.len(),
            faults.join("\n")
        );
    }
}
