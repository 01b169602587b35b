//! Bad inputs and faults a new user meets, through the real `duplex` binary: each gets a clear
//! error naming the file, stage, key or layer, exit code 2 before start and 1 at run time, no
//! panic, no hang, and nothing already produced is lost. Each test is the regression test of
//! one defect found by trying them.

use crate::support::packs;
use crate::support::pulse;
use crate::support::wait;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use wait::{free_port, stage_frames, wait_until};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

use crate::support::cli::{duplex, error_line, run_within, stderr};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A 16-bit mono WAV of `n` samples at `rate`.
fn wav(path: &Path, rate: u32, n: usize) {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for i in 0..n {
        w.write_sample(((i * 37) % 2000) as i16 - 1000).unwrap();
    }
    w.finalize().unwrap();
}

fn validate(p: &Path, extra: &[&str]) -> Output {
    let mut c = duplex();
    c.arg("validate").arg(p).args(extra);
    run_within(c, 30)
}

/// `validate` of `p` is refused before start (exit 2): its `error: …` line.
fn refused(p: &Path, extra: &[&str]) -> String {
    let o = validate(p, extra);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    error_line(&o)
}

/// A pipeline that validates anywhere: a WAV in `dir`, resampled, discarded.
fn good_pipeline(dir: &Path) -> PathBuf {
    let input = dir.join("good-in.wav");
    wav(&input, 48_000, 4800);
    write(
        dir,
        "good.yaml",
        &format!(
            "stages:\n  source: {{ kind: wav_source, path: {} }}\n  down: {{ kind: resample, to: 24000 }}\n  sink: {{ kind: null_sink }}\nlinks: [source -> down, down -> sink]\n",
            input.display()
        ),
    )
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// Regression: 452 bytes of nested anchors took 19.6 GB in 31 s (`validate`, `run`,
/// `daemon --check`, `--set`); 5000 levels of nesting hung for over 20 s. Now a configuration is
/// refused, naming the file, before it costs more than a configuration may.
#[test]
fn a_yaml_bomb_is_refused_at_a_bounded_cost() {
    let dir = tempfile::tempdir().unwrap();
    let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
    for i in 1..10 {
        let p = i - 1;
        bomb.push_str(&format!(
            "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
        ));
    }
    assert!(bomb.len() < 600);
    let p = write(dir.path(), "bomb.yaml", &bomb);
    let mut deep = String::new();
    for i in 0..5000 {
        deep.push_str(&" ".repeat(i));
        deep.push_str("k:\n");
    }
    let deep = write(dir.path(), "deep.yaml", &deep);
    let flow = write(
        dir.path(),
        "flow.yaml",
        &format!("a: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)),
    );
    let good = good_pipeline(dir.path());
    let set = format!("stages.source.path={bomb}");
    let cases: Vec<(Vec<String>, &str, String)> = vec![
        (
            vec!["validate".into(), p.display().to_string()],
            "more than 100000 values",
            p.display().to_string(),
        ),
        (
            vec!["run".into(), p.display().to_string()],
            "more than 100000 values",
            p.display().to_string(),
        ),
        (
            vec![
                "daemon".into(),
                "--check".into(),
                "--config".into(),
                p.display().to_string(),
            ],
            "more than 100000 values",
            p.display().to_string(),
        ),
        (
            vec!["validate".into(), deep.display().to_string()],
            "bytes is more than",
            deep.display().to_string(),
        ),
        (
            vec!["validate".into(), flow.display().to_string()],
            "nested too deep",
            flow.display().to_string(),
        ),
        // A value given on the command line is read with far smaller limits, as text when
        // beyond them: here it is just a (far too long) file name.
        (
            vec![
                "validate".into(),
                good.display().to_string(),
                "--set".into(),
                set.clone(),
            ],
            "stage `source`: `path`: ",
            // Shown on one line and cut short, wherever it is named.
            "--set stages.source.path=a0: &a0 [x, x, x, x, x, x, x, x, x]\\na1: &a1 [*a0, *a0, *a0,… (522 bytes) (over ".into(),
        ),
    ];
    for (args, want, lead) in cases {
        let mut c = Command::new("sh");
        // 1.5 GB of address space: what a bomb would need is far more.
        c.current_dir(root()).args([
            "-c",
            "ulimit -v 1500000; exec \"$0\" \"$@\"",
            env!("CARGO_BIN_EXE_duplex"),
        ]);
        c.args(&args);
        let o = run_within(c, 20);
        let line = error_line(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        // (The message may go on over several lines: the value on the command line is a path
        // with newlines in it.)
        assert!(
            line.starts_with(&format!("error: {lead}")) && stderr(&o).contains(want),
            "{args:?}: {line}"
        );
    }
}

/// Regression: a `wav_sink` writing the `wav_source`'s input destroyed it (a 60 s file became
/// 0.24 s), and two sinks on one path lost a stream, both with exit 0. Now refused at
/// validation, naming both stages and the path; a symbolic link to the same file counts.
#[test]
fn overlapping_paths_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.wav");
    wav(&input, 48_000, 48_000);
    let before = std::fs::read(&input).unwrap();
    let link = dir.path().join("link.wav");
    std::os::unix::fs::symlink(&input, &link).unwrap();
    let pipeline = |sink_a: &Path, sink_b: &Path| {
        format!(
            "stages:\n  source: {{ kind: wav_source, path: {} }}\n  a: {{ kind: wav_sink, path: {} }}\n  b: {{ kind: wav_sink, path: {} }}\nlinks: [source -> a, source -> b]\n",
            input.display(),
            sink_a.display(),
            sink_b.display()
        )
    };
    let out1 = dir.path().join("out1.wav");
    let out2 = dir.path().join("sub/../out1.wav");
    for (a, b, want) in [
        (&input, &out1, "would overwrite the file it reads"),
        (&link, &out1, "would overwrite the file it reads"),
        (
            &out1,
            &out2,
            "write the same file: one stream would be lost",
        ),
    ] {
        let p = write(dir.path(), "p.yaml", &pipeline(a, b));
        for cmd in ["validate", "run"] {
            let mut c = duplex();
            c.args([cmd, p.to_str().unwrap(), "--set", "metrics.address="]);
            let o = run_within(c, 30);
            let line = error_line(&o);
            assert_eq!(o.status.code(), Some(2), "{cmd}: {line}");
            assert!(
                line.contains("stages `a`") && line.contains(want),
                "{cmd}: {line}"
            );
            assert_eq!(
                std::fs::read(&input).unwrap(),
                before,
                "the input is intact"
            );
        }
    }
    // A sink writing into the model pack a model stage reads.
    let pack = packs::pack("tiny-gqa");
    let p = write(
        dir.path(),
        "p.yaml",
        &format!(
            "stages:\n  codes: {{ kind: codes_source, path: {0} }}\n  temporal: {{ kind: temporal, pack: {1} }}\n  depformer: {{ kind: depformer, pack: {1} }}\n  tokens: {{ kind: token_sink, path: {1}/temporal/model.onnx }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
            input.display(),
            pack.display()
        ),
    );
    let line = refused(&p, &[]);
    assert!(
        line.contains("would write inside the directory it reads"),
        "{line}"
    );
}

/// Regression: `ort.library` was ignored, in the file, with `--set` and from the environment:
/// a path that does not exist silently loaded `.venv`'s library.
#[test]
fn ort_library_comes_first_and_a_missing_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = good_pipeline(dir.path());
    let p = write(
        dir.path(),
        "p.yaml",
        "ort: { library: /nonexistent/libonnxruntime.so }\nstages:\n  tone: { kind: synth_source, duration: 0.1 }\n  sink: { kind: null_sink }\nlinks: [tone -> sink]\n",
    );
    let o = validate(&p, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        error_line(&o).starts_with(&format!(
            "error: {}: `ort.library`: ONNX Runtime library /nonexistent/libonnxruntime.so",
            p.display()
        )),
        "{}",
        stderr(&o)
    );
    let o = validate(&good, &["--set", "ort.library=/nope.so"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        error_line(&o).starts_with("error: --set ort.library=/nope.so (over "),
        "{}",
        stderr(&o)
    );
    let mut c = duplex();
    c.arg("validate")
        .arg(&good)
        .env("DUPLEX__ORT__LIBRARY", "/nope.so");
    let o = run_within(c, 30);
    assert!(
        error_line(&o).starts_with("error: environment variable DUPLEX__ORT__LIBRARY (over "),
        "{}",
        stderr(&o)
    );
    // A real one is what runs, found via the file's key, not the project's .venv.
    let lib = std::fs::read_dir(root().join(".venv/lib"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/onnxruntime/capi"))
        .find(|p| p.is_dir())
        .and_then(|capi| {
            std::fs::read_dir(capi)
                .unwrap()
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with("libonnxruntime.so.")
                })
        })
        .unwrap();
    let codes = write(
        dir.path(),
        "codes.json",
        "[[1,2,3,4,5,6,7,8],[1,2,3,4,5,6,7,8]]",
    );
    let p = write(
        dir.path(),
        "lm.yaml",
        &format!(
            "ort: {{ library: {} }}\nmetrics: {{ address: \"\" }}\nstages:\n  codes: {{ kind: codes_source, path: {} }}\n  temporal: {{ kind: temporal, pack: {2} }}\n  depformer: {{ kind: depformer, pack: {2} }}\n  tokens: {{ kind: token_sink, path: {3} }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
            lib.display(),
            codes.display(),
            packs::pack("tiny-gqa").display(),
            dir.path().join("t.jsonl").display()
        ),
    );
    let mut c = duplex();
    c.arg("run").arg(&p);
    let o = run_within(c, 60);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("origin={}: `ort.library`", p.display())),
        "{}",
        stderr(&o)
    );
}

/// Regression: `duplex stages > /dev/full` (and `validate`, `run`, `doctor`) panicked with
/// exit 101. A full or closed stdout is an I/O error: exit 1, said on stderr.
#[test]
fn a_full_or_closed_stdout_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let good = good_pipeline(dir.path());
    let tone = dir.path().join("tone.wav");
    let p = write(
        dir.path(),
        "p.yaml",
        &format!(
            "metrics: {{ address: \"\" }}\nstages:\n  tone: {{ kind: synth_source, duration: 0.2 }}\n  out: {{ kind: wav_sink, path: {} }}\nlinks: [tone -> out]\n",
            tone.display()
        ),
    );
    for args in [
        vec!["stages".to_string()],
        vec!["validate".into(), good.display().to_string()],
        vec!["run".into(), p.display().to_string()],
        vec!["doctor".into()],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let o = duplex()
            .args(&args)
            .stdout(full)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("error: writing to standard output: No space left on device"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    // A pipe whose reader has gone before anything is written (closed before the command
    // starts: dropping the reader after the spawn would race with a command that fits its
    // output in the pipe's buffer).
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors `pipe` writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    use std::os::fd::FromRawFd;
    // SAFETY: both descriptors were just created by `pipe` and are owned by nothing else.
    let (read, write) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    drop(read);
    let o = duplex()
        .arg("stages")
        .stdout(write)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("Broken pipe"), "{}", stderr(&o));
}

/// Regression: a FIFO as input (`wav_source` path, `replay --codes`) made `validate` and `run`
/// block forever with no message.
#[test]
fn a_fifo_where_a_file_is_expected_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.wav");
    mkfifo(&fifo);
    let p = write(
        dir.path(),
        "p.yaml",
        &format!(
            "stages:\n  source: {{ kind: wav_source, path: {} }}\n  sink: {{ kind: null_sink }}\nlinks: [source -> sink]\n",
            fifo.display()
        ),
    );
    for cmd in ["validate", "run"] {
        let mut c = duplex();
        c.args([cmd, p.to_str().unwrap(), "--set", "metrics.address="]);
        let o = run_within(c, 10);
        assert_eq!(o.status.code(), Some(2));
        assert!(
            error_line(&o).contains("is a FIFO (named pipe), not a regular file"),
            "{}",
            stderr(&o)
        );
    }
    let mut c = duplex();
    c.args(["replay", "--pack"])
        .arg(packs::pack("tiny-gqa"))
        .arg("--codes")
        .arg(&fifo)
        .arg("--out")
        .arg(dir.path().join("out.jsonl"));
    let o = run_within(c, 10);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        error_line(&o).contains("is a FIFO (named pipe), not a regular file"),
        "{}",
        stderr(&o)
    );
    // The pipeline file itself.
    let pfifo = dir.path().join("p-fifo.yaml");
    mkfifo(&pfifo);
    let o = validate(&pfifo, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(error_line(&o).contains("FIFO"), "{}", stderr(&o));
}

/// Regression: errors that blamed the wrong source or said too little.
#[test]
fn errors_blame_the_layer_the_value_came_from_and_say_enough() {
    let dir = tempfile::tempdir().unwrap();
    let good = good_pipeline(dir.path());
    let g = good.display().to_string();
    let env_case = |var: &str, value: &str| {
        let mut c = duplex();
        c.arg("validate").arg(&good).env(var, value);
        run_within(c, 30)
    };
    let o = env_case("DUPLEX__BOGUS", "1");
    assert_eq!(
        error_line(&o),
        format!("error: environment variable DUPLEX__BOGUS (over {g}): `bogus`: unknown top-level key; expected: description, stages, links, defaults, runtime, ort, metrics, record")
    );
    let o = env_case("DUPLEX__DEFAULTS__CAPACITY", "0");
    assert_eq!(
        error_line(&o),
        format!("error: environment variable DUPLEX__DEFAULTS__CAPACITY (over {g}): `defaults.capacity`: 0 is below 1")
    );
    let o = validate(&good, &["--set", "bogus=1"]);
    assert!(
        error_line(&o).starts_with(&format!(
            "error: --set bogus=1 (over {g}): `bogus`: unknown"
        )),
        "{}",
        stderr(&o)
    );
    let o = validate(&good, &["--set", "stages.down.to=7"]);
    assert_eq!(
        error_line(&o),
        format!("error: --set stages.down.to=7 (over {g}): stage `down`: `to`: 7 is out of range 1000..=768000")
    );
    let o = validate(&good, &["--set", "stages..down=1"]);
    assert_eq!(
        error_line(&o),
        format!("error: --set stages..down=1 (over {g}): \"stages..down\" is not a key path: names of letters, digits and `_` joined by single dots, like `stages.source.path`")
    );
    // A list on the command line, in YAML's own form; and a hint when it is not one.
    let codes = write(dir.path(), "codes.json", "[[1,2,3,4,5,6,7,8]]");
    let lm = write(
        dir.path(),
        "lm.yaml",
        &format!(
            "stages:\n  codes: {{ kind: codes_source, path: {} }}\n  temporal: {{ kind: temporal, pack: {1} }}\n  depformer: {{ kind: depformer, pack: {1} }}\n  tokens: {{ kind: null_sink }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
            codes.display(),
            packs::pack("tiny-gqa").display()
        ),
    );
    let o = validate(&lm, &["--set", "stages.temporal.persona_tokens=[1, 2]"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = validate(&lm, &["--set", "stages.temporal.persona_tokens=one"]);
    assert!(
        error_line(&o).contains("(write a list, like [1, 2, 3], or 1,2,3)"),
        "{}",
        stderr(&o)
    );
    for (text, want) in [
        (
            "stages:\n  source: { kind: synth_source }\n  source: { kind: null_sink }\n",
            "line 3: `stages.source` is given twice (first at line 2); a map holds each key once",
        ),
        (
            "stages:\n  tone: { kind: synth_source, freq: .inf }\n  sink: { kind: null_sink }\nlinks: [tone -> sink]\n",
            "stage `tone`: `freq`: inf is out of range",
        ),
        (
            "stages:\n  tone: { kind: synth_source, duration: .nan }\n  sink: { kind: null_sink }\nlinks: [tone -> sink]\n",
            "stage `tone`: `duration`: NaN is out of range",
        ),
        (
            "stages:\n  tone: { kind: synth_source }\n  sink: { kind: null_sink }\nlinks: [tone -> tone, tone -> sink]\n",
            "link `tone -> tone`: stage `tone` has no input port: it is a source, nothing can be linked into it",
        ),
        (
            "stages:\n  mic: { kind: mic, rate: 7 }\n  sink: { kind: null_sink }\nlinks: [mic -> sink]\n",
            "stage `mic`: `rate`: 7 Hz is not an audio rate",
        ),
    ] {
        let p = write(dir.path(), "p.yaml", text);
        let line = refused(&p, &[]);
        assert!(
            line.starts_with(&format!("error: {}: {want}", p.display())),
            "{text}\n{line}"
        );
    }
    // An OS error is said once.
    let blocker = write(dir.path(), "file", "x");
    let p = write(
        dir.path(),
        "p.yaml",
        &format!(
            "stages:\n  tone: {{ kind: synth_source, duration: 0.1 }}\n  out: {{ kind: wav_sink, path: {}/out.wav }}\nlinks: [tone -> out]\n",
            blocker.display()
        ),
    );
    let mut c = duplex();
    c.args(["run", p.to_str().unwrap(), "--set", "metrics.address="]);
    let o = run_within(c, 30);
    let line = error_line(&o);
    assert_ne!(o.status.code(), Some(0), "{line}");
    assert_eq!(line.matches("os error").count(), 1, "{line}");
}

/// Regression: mismatches that the graph of stages can know before start failed at run time
/// with exit 1: an empty `wav_sink` path, 960-sample frames into `mimi_encode`, a 16 kHz
/// framer into the model, 7-code frames into `temporal`.
#[test]
fn mismatches_known_before_start_are_refused_before_start() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.wav");
    wav(&input, 48_000, 9600);
    let pack = packs::pack("tiny-gqa").display().to_string();
    let lm = |front: &str, framer: &str| {
        format!(
            "stages:\n{front}  framer: {{ kind: framer{framer} }}\n  encode: {{ kind: mimi_encode, pack: {pack} }}\n  temporal: {{ kind: temporal, pack: {pack} }}\n  depformer: {{ kind: depformer, pack: {pack} }}\n  tokens: {{ kind: null_sink }}\nlinks:\n  - source -> down\n  - down -> framer\n  - framer -> encode\n  - encode -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n"
        )
    };
    let front = |to: u32| {
        format!(
            "  source: {{ kind: wav_source, path: {} }}\n  down: {{ kind: resample, to: {to} }}\n",
            input.display()
        )
    };
    for (text, want) in [
        (
            format!(
                "stages:\n  source: {{ kind: wav_source, path: {} }}\n  sink: {{ kind: wav_sink, path: \"\" }}\nlinks: [source -> sink]\n",
                input.display()
            ),
            "stage `sink`: `path`: an empty path".to_string(),
        ),
        (
            lm(&front(24_000), ", size: 960"),
            "link `framer.out -> encode.in`: stage `encode` cannot take these frames: samples per frame: needs 1920, gets 960".into(),
        ),
        (
            lm(&front(16_000), ", rate: 16000"),
            "link `framer.out -> encode.in`: stage `encode` cannot take these frames: sample rate (Hz): needs 24000, gets 16000".into(),
        ),
        (
            lm(&front(16_000), ""),
            "link `down.out -> framer.in`: stage `framer` cannot take these frames: sample rate (Hz): needs 24000, gets 16000: put a `resample` stage (to: 24000) before it".into(),
        ),
        (
            format!(
                "stages:\n  codes: {{ kind: codes_source, path: {}, codebooks: 7 }}\n  temporal: {{ kind: temporal, pack: {pack} }}\n  depformer: {{ kind: depformer, pack: {pack} }}\n  tokens: {{ kind: null_sink }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
                write(dir.path(), "c.json", "[[1,2,3,4,5,6,7]]").display()
            ),
            "link `codes.out -> temporal.codes`: stage `temporal` cannot take these frames: codes per frame (the pack's codebooks): needs 8, gets 7".into(),
        ),
    ] {
        let p = write(dir.path(), "p.yaml", &text);
        let line = refused(&p, &[]);
        assert!(
            line.starts_with(&format!("error: {}: {want}", p.display())),
            "{want}\n{line}"
        );
    }
}

/// Regression: a WAV cut after 500 samples wrote nothing, one cut after 1500 lost 540. Every
/// sample read is passed on, then the run fails naming the file (exit 1).
#[test]
fn a_truncated_wav_passes_on_every_sample_then_fails() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.wav");
    wav(&full, 48_000, 4800);
    let bytes = std::fs::read(&full).unwrap();
    for keep in [500usize, 1500] {
        let cut = dir.path().join("cut.wav");
        std::fs::write(&cut, &bytes[..44 + 2 * keep]).unwrap();
        let out = dir.path().join(format!("out-{keep}.wav"));
        let p = write(
            dir.path(),
            "p.yaml",
            &format!(
                "stages:\n  source: {{ kind: wav_source, path: {} }}\n  sink: {{ kind: wav_sink, path: {} }}\nlinks: [source -> sink]\n",
                cut.display(),
                out.display()
            ),
        );
        let mut c = duplex();
        c.args(["run", p.to_str().unwrap(), "--set", "metrics.address="]);
        let o = run_within(c, 30);
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(
            error_line(&o).contains(&format!(
                "cut.wav: corrupt or truncated after {keep} sample frames"
            )),
            "{}",
            stderr(&o)
        );
        let written = hound::WavReader::open(&out).unwrap().duration() as usize;
        assert_eq!(written, keep, "every sample read is written");
    }
}

/// Regression: a second SIGINT aborted and threw queued frames away, but exited 0; now it
/// says how many were discarded and exits 1. Also: `target_ms` above `max_target_ms` was
/// accepted.
#[test]
fn an_abort_says_what_it_discarded_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let p = write(
        dir.path(),
        "p.yaml",
        &format!("metrics: {{ address: \"127.0.0.1:{port}\" }}\ndefaults: {{ capacity: 64 }}\nstages:\n  tone: {{ kind: synth_source, duration: 60 }}\n  slow: {{ kind: inject_delay, mode: ramp, base_ms: 50, ramp_to_ms: 50, ramp_frames: 1 }}\n  sink: {{ kind: null_sink }}\nlinks: [tone -> slow, slow -> sink]\n"),
    );
    let mut child = duplex()
        .args(["run", p.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The run's log, read as it comes.
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let reader = {
        let (mut from, log) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = std::io::Read::read(&mut from, &mut buf) {
                log.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let said = |what: &str| String::from_utf8_lossy(&log.lock().unwrap()).contains(what);
    // Frames queue before the slow stage (it has taken two; the source is far ahead).
    wait_until(Duration::from_secs(30), "the slow stage at work", || {
        stage_frames(port, "slow").is_some_and(|n| n >= 2)
    });
    let pid = child.id().to_string();
    let interrupt = || {
        assert!(Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap()
            .success())
    };
    interrupt();
    wait_until(Duration::from_secs(20), "the drain to begin", || {
        said("stop requested: draining")
    });
    interrupt();
    wait_until(Duration::from_secs(20), "the run to stop", || {
        child.try_wait().unwrap().is_some()
    });
    let mut o = child.wait_with_output().unwrap();
    reader.join().unwrap();
    o.stderr = log.lock().unwrap().clone();
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let line = error_line(&o);
    let n: u64 = line
        .split("aborted: ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(
        n > 0
            && line.contains("queued frame(s) discarded (")
            && line.contains("on tone.out -> slow.in"),
        "{line}"
    );
    // The jitter buffer's bounds.
    let p = write(
        dir.path(),
        "q.yaml",
        "stages:\n  tone: { kind: synth_source, duration: 0.1, rate: 24000 }\n  out: { kind: playback, device: virtual, target_ms: 300, max_target_ms: 200 }\nlinks: [tone -> out]\n",
    );
    let line = refused(&p, &[]);
    assert!(
        line.contains("stage `out`: `max_target_ms`: 200 ms is below `target_ms` (300 ms)"),
        "{line}"
    );
}

/// Regression: `duplex devices` printed 48-56 lines of ALSA and JACK library noise, and with
/// no sound server exited 0 without a hint.
#[test]
fn devices_lists_quietly_and_says_when_no_server_answers() {
    let pa = pulse::Pulse::start();
    let o = pa.duplex().arg("devices").output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        !err.contains("ALSA lib") && !err.contains("jack") && !err.contains("Jack"),
        "{err}"
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("alsa:pulse"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let empty = tempfile::tempdir().unwrap();
    let o = duplex()
        .arg("devices")
        .env("XDG_RUNTIME_DIR", empty.path())
        .env("HOME", empty.path())
        .env_remove("PULSE_SERVER")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no usable sound device") && err.contains("no sound server answers"),
        "{err}"
    );
    assert!(!err.contains("ALSA lib"), "{err}");
}

/// Regression: ONNX Runtime's own log lines carried ANSI colour codes when stderr was not a
/// terminal; they now go through duplex's logging.
#[test]
fn onnx_runtime_logs_go_through_our_logging_without_colour() {
    let dir = tempfile::tempdir().unwrap();
    let codes = write(dir.path(), "codes.json", "[[1,2,3,4,5,6,7,8]]");
    let o = duplex()
        .args(["--log", "debug", "replay", "--pack"])
        .arg(packs::pack("tiny-gqa"))
        .arg("--codes")
        .arg(&codes)
        .arg("--out")
        .arg(dir.path().join("out.jsonl"))
        .env("ORT_LOG", "info")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("category=\"onnxruntime\"") || err.contains("category="),
        "{err}"
    );
    assert!(!err.contains('\u{1b}'), "colour codes in: {err}");
}

#[test]
fn an_echo_canceller_naming_no_playback_stage_is_refused_before_start() {
    let dir = tempfile::tempdir().unwrap();
    for (name, aec, want) in [
        (
            "aec.yaml",
            "reference: spekaer",
            "aec.yaml: stage `aec`: `reference`: \"spekaer\" names no playback stage (playback \
             stages here: speaker)",
        ),
        (
            "rate.yaml",
            "rate: 44123",
            "rate.yaml: stage `aec`: `rate`: 44123 Hz",
        ),
    ] {
        let p = write(
            dir.path(),
            name,
            &format!(
                "stages:
  tone: {{ kind: synth_source, duration: 0.2 }}
  aec: {{ kind: aec, {aec} }}
  speaker: {{ kind: playback, device: virtual }}
links:
  - tone -> aec
  - aec -> speaker
"
            ),
        );
        let mut c = duplex();
        c.arg("run").arg(&p);
        let o = run_within(c, 60);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(error_line(&o).contains(want), "{}", stderr(&o));
    }
}

/// `cuda_graph: true` where a CUDA graph cannot apply is refused before start (exit 2),
/// naming the stage (the temporal's, the depformer's) and the key that rules it out.
#[test]
fn cuda_graph_where_it_cannot_apply_is_refused_before_start() {
    let dir = tempfile::tempdir().unwrap();
    let pack = packs::pack("tiny-gqa").display().to_string();
    let codes = write(dir.path(), "c.json", "[[1,2,3,4,5,6,7,8]]");
    let provider = (
        "cuda_graph: true",
        "execution_provider",
        "`cuda_graph: true` needs `execution_provider: cuda`",
    );
    let shared = (
        "cuda_graph: true, execution_provider: cuda, engine: shared",
        "engine",
        "`cuda_graph: true` needs `engine: own`",
    );
    let kv = (
        "cuda_graph: true, execution_provider: cuda, kv: host",
        "kv",
        "`cuda_graph: true` needs `kv: resident`",
    );
    for (stage, (params, key, want)) in [
        ("temporal", provider),
        ("temporal", kv),
        ("temporal", shared),
        ("depformer", provider),
        ("depformer", shared),
    ] {
        let (t, d) = if stage == "temporal" {
            (format!(", {params}"), String::new())
        } else {
            (String::new(), format!(", {params}"))
        };
        let text = format!(
            "stages:\n  codes: {{ kind: codes_source, path: {} }}\n  temporal: {{ kind: temporal, pack: {pack}{t} }}\n  depformer: {{ kind: depformer, pack: {pack}{d} }}\n  tokens: {{ kind: null_sink }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
            codes.display()
        );
        let p = write(dir.path(), "p.yaml", &text);
        let mut c = duplex();
        c.arg("run").arg(&p);
        let o = run_within(c, 60);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{stage} {params}: {e}");
        assert!(
            e.contains(&format!("stage `{stage}`: `{key}`: {want}")),
            "{stage} {params}: {e}"
        );
    }
}
