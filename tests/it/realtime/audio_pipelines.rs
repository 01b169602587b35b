//! Headless audio stages through real pipelines: resampling keeps frequency and level, WAV
//! round trips are bit-exact, bad input files are named, a killed run leaves a readable file.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use duplex::app;
use duplex::audio::WavReader;
use wait::{free_port, stage_frames, wait_until};

use crate::support::wait;

fn read(p: &Path) -> (u32, Vec<f32>) {
    let mut r = WavReader::open(p).unwrap();
    (r.rate(), r.read_all().unwrap())
}

/// Frequency from upward zero crossings (linearly interpolated) over the whole signal.
fn frequency(x: &[f32], rate: u32) -> f64 {
    let mut crossings = Vec::new();
    for i in 1..x.len() {
        if x[i - 1] < 0.0 && x[i] >= 0.0 {
            let frac = -x[i - 1] as f64 / (x[i] - x[i - 1]) as f64;
            crossings.push((i - 1) as f64 + frac);
        }
    }
    let n = crossings.len();
    assert!(n > 10, "no sine found");
    (n - 1) as f64 / ((crossings[n - 1] - crossings[0]) / rate as f64)
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

fn write_pipeline(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn resample_48k_to_24k_to_48k_keeps_frequency_and_level() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let make = write_pipeline(
        dir.path(),
        "make.yaml",
        &format!(
            "stages:\n  tone: {{ kind: synth_source, freq: 997, amplitude: 0.5, rate: 48000, duration: 2.0, chunk_ms: 13 }}\n  out: {{ kind: wav_sink, path: {d}/in.wav, format: f32 }}\nlinks: [tone -> out]\n"
        ),
    );
    app::run_file(&make, &[]).unwrap();
    let rt = write_pipeline(
        dir.path(),
        "rt.yaml",
        &format!(
            r#"
stages:
  src: {{ kind: wav_source, path: {d}/in.wav }}
  down: {{ kind: resample, to: 24000 }}
  framer: {{ kind: framer }}
  up: {{ kind: resample, to: 48000 }}
  mid: {{ kind: wav_sink, path: {d}/mid.wav, format: f32 }}
  out: {{ kind: wav_sink, path: {d}/out.wav, format: f32 }}
links:
  - src -> down
  - down -> framer
  - framer -> up
  - framer -> mid
  - up -> out
"#
        ),
    );
    let report = app::run_file(&rt, &[]).unwrap();
    // 2 s at 24 kHz = exactly 25 model frames of 1920 samples.
    assert_eq!(report.stage("up").unwrap().frames, 25);

    let (r_in, x) = read(&dir.path().join("in.wav"));
    let (r_mid, m) = read(&dir.path().join("mid.wav"));
    let (r_out, y) = read(&dir.path().join("out.wav"));
    assert_eq!((r_in, r_mid, r_out), (48_000, 24_000, 48_000));
    assert_eq!(x.len(), 96_000);
    assert_eq!(m.len(), 48_000, "framer padding is not written");
    assert_eq!(y.len(), 96_000);
    // Away from the edges (filter start-up), frequency and level are kept within 1 %.
    let (xi, mi, yi) = (&x[4800..91_200], &m[2400..45_600], &y[4800..91_200]);
    for (name, sig, rate) in [("24k", mi, 24_000), ("48k", yi, 48_000)] {
        let f = frequency(sig, rate);
        assert!((f / 997.0 - 1.0).abs() < 0.01, "{name}: frequency {f}");
        let level = rms(sig) / rms(xi);
        assert!((level - 1.0).abs() < 0.01, "{name}: level ratio {level}");
    }
    // And the round trip lines up with the input sample by sample.
    let err = xi
        .iter()
        .zip(yi)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(err < 0.01, "max deviation {err}");
}

#[test]
fn wav_round_trip_through_a_pipeline_is_bit_exact_for_16_bit() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("in.wav");
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(&src, spec).unwrap();
    let values: Vec<i16> = (0..50_001i64)
        .map(|i| ((i * 40_503 + 17) % 65_536 - 32_768) as i16)
        .collect();
    for &v in &values {
        w.write_sample(v).unwrap();
    }
    w.finalize().unwrap();
    let d = dir.path().display();
    let p = write_pipeline(
        dir.path(),
        "p.yaml",
        &format!(
            "stages:\n  src: {{ kind: wav_source, path: {d}/in.wav, chunk_ms: 7 }}\n  framer: {{ kind: framer }}\n  out: {{ kind: wav_sink, path: {d}/out.wav }}\nlinks: [src -> framer, framer -> out]\n"
        ),
    );
    app::run_file(&p, &[]).unwrap();
    let back: Vec<i16> = hound::WavReader::open(dir.path().join("out.wav"))
        .unwrap()
        .samples::<i16>()
        .map(|s| s.unwrap())
        .collect();
    assert_eq!(back.len(), values.len());
    assert!(back == values, "samples differ");
}

fn duplex() -> Command {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
}

#[test]
fn bad_input_files_are_named_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("empty.wav"), b"").unwrap();
    std::fs::write(
        d.join("text.wav"),
        b"hello, I am not a WAV file, but I am long enough",
    )
    .unwrap();
    let mut hdr_only = Vec::new();
    {
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 8000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let w = hound::WavWriter::new(std::io::Cursor::new(&mut hdr_only), spec).unwrap();
        w.finalize().unwrap();
    }
    std::fs::write(d.join("nosamples.wav"), &hdr_only).unwrap();
    for (file, want) in [
        ("empty.wav", "the file is empty"),
        ("text.wav", "not a readable WAV file"),
        ("nosamples.wav", "has no samples"),
        ("missing.wav", "No such file"),
    ] {
        let p = write_pipeline(
            d,
            "p.yaml",
            &format!(
                "stages:\n  src: {{ kind: wav_source, path: {}/{file} }}\n  sink: {{ kind: null_sink }}\nlinks: [src -> sink]\n",
                d.display()
            ),
        );
        let out = duplex()
            .args(["run", p.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {err}");
        assert!(
            err.contains(file) && err.contains(want) && err.contains("stage `src`"),
            "{file}: {err}"
        );
    }
}

#[test]
fn truncated_input_fails_the_run_but_keeps_what_was_written() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(d.join("cut.wav"), spec).unwrap();
    for i in 0..48_000 {
        w.write_sample((i % 1000) as i16).unwrap();
    }
    w.finalize().unwrap();
    let bytes = std::fs::read(d.join("cut.wav")).unwrap();
    std::fs::write(d.join("cut.wav"), &bytes[..bytes.len() - 48_000]).unwrap();
    let p = write_pipeline(
        d,
        "p.yaml",
        &format!(
            "stages:\n  src: {{ kind: wav_source, path: {0}/cut.wav }}\n  out: {{ kind: wav_sink, path: {0}/out.wav }}\nlinks: [src -> out]\n",
            d.display()
        ),
    );
    let out = duplex()
        .args(["run", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("stage `src` failed at frame")
            && err.contains("cut.wav: corrupt or truncated after 24000"),
        "{err}"
    );
    // Everything read before the damage reached the output file, which is complete.
    let (_, got) = read(&d.join("out.wav"));
    assert_eq!(got.len(), 24_000);
}

#[test]
fn a_killed_run_leaves_a_readable_wav() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = write_pipeline(
        d,
        "p.yaml",
        &format!(
            "stages:\n  tone: {{ kind: synth_source, rate: 24000, duration: 60, realtime: true }}\n  out: {{ kind: wav_sink, path: {}/live.wav, flush_ms: 100 }}\nlinks: [tone -> out]\n",
            d.display()
        ),
    );
    let mut child = duplex().args(["run", p.to_str().unwrap()]).spawn().unwrap();
    let samples = || {
        let mut r = WavReader::open(&d.join("live.wav")).ok()?;
        r.read_all().ok().map(|s| s.len())
    };
    // Killed once half a second is on disk (flushed every 100 ms, a valid file each time).
    wait_until(Duration::from_secs(30), "half a second written", || {
        samples().is_some_and(|n| n >= 12_000)
    });
    child.kill().unwrap(); // SIGKILL: no destructor runs
    child.wait().unwrap();
    let mut r = WavReader::open(&d.join("live.wav")).expect("readable after kill -9");
    let n = r.read_all().unwrap().len();
    // What was flushed before the kill is there, and no more than was made by then.
    assert!((12_000..24_000 * 60).contains(&n), "{n} samples");
}

#[test]
fn cli_lists_validates_and_runs() {
    let out = duplex().arg("stages").output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for k in [
        "synth_source",
        "wav_source",
        "resample",
        "framer",
        "wav_sink",
        "null_sink",
    ] {
        assert!(s.contains(k), "{k} missing from `duplex stages`");
    }
    assert!(s.contains("out: Pcm") && s.contains("in:  in: Any"), "{s}");

    // The shipped example, with its input (made by `make demo`) replaced by a file of ours.
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("in.wav");
    let mut w =
        duplex::audio::WavWriter::create(&wav, 48_000, duplex::audio::WavFormat::I16).unwrap();
    w.write(&[0.0; 4800]).unwrap();
    w.finalize().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = duplex()
        .args([
            "validate",
            root.join("pipelines/resample-roundtrip.yaml")
                .to_str()
                .unwrap(),
        ])
        .args(["--set", &format!("stages.source.path={}", wav.display())])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        s.contains("framer.out -> up.in") && s.contains("capacity 8"),
        "{s}"
    );

    let p = write_pipeline(
        dir.path(),
        "p.yaml",
        "stages:\n  tone: { kind: synth_source, duration: 0.5 }\n  sink: { kind: null_sink }\nlinks: [tone -> sink]\n",
    );
    let out = duplex()
        .args([
            "run",
            p.to_str().unwrap(),
            "--set",
            "stages.tone.duration=0.25",
        ])
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    // 0.25 s in 20 ms chunks
    let line = s.lines().find(|l| l.starts_with("sink")).unwrap();
    assert!(line.split_whitespace().nth(1) == Some("13"), "{s}");

    let out = duplex()
        .env("DUPLEX__STAGES__TONE__WAVEFORM", "square")
        .args(["validate", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("stage `tone`: `waveform`: \"square\" is not one of silence, sine, noise"),
        "{e}"
    );
}

#[test]
fn realtime_sources_are_paced_and_their_sleep_is_not_service_time() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let make = write_pipeline(
        dir.path(),
        "make.yaml",
        &format!(
            "stages:\n  tone: {{ kind: synth_source, rate: 24000, duration: 0.4 }}\n  out: {{ kind: wav_sink, path: {d}/in.wav }}\nlinks: [tone -> out]\n"
        ),
    );
    app::run_file(&make, &[]).unwrap();
    for (kind, extra) in [
        ("synth_source", "duration: 0.4"),
        ("wav_source", "path: IN"),
    ] {
        let extra = extra.replace("IN", &format!("{d}/in.wav"));
        let p = write_pipeline(
            dir.path(),
            "p.yaml",
            &format!(
                "stages:\n  src: {{ kind: {kind}, {extra}, realtime: true }}\n  sink: {{ kind: null_sink }}\nlinks: [src -> sink]\n"
            ),
        );
        let report = app::run_file(&p, &[]).unwrap();
        let src = report.stage("src").unwrap();
        assert_eq!(src.frames, 20, "{kind}: 0.4 s in 20 ms frames");
        // A paced source sleeps until each frame is due: 0.4 s of audio cannot take less than
        // 0.4 s, and the sleeping is counted as blocked, not as service time.
        assert!(
            report.wall >= Duration::from_millis(395),
            "{kind}: {:?}",
            report.wall
        );
        assert!(
            src.blocked >= Duration::from_millis(380),
            "{kind}: {:?}",
            src.blocked
        );
        assert!(src.service.sum() < src.blocked, "{kind}");
    }
}

#[test]
fn sigint_drains_the_pipeline_and_finishes_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_port();
    let p = write_pipeline(
        d,
        "p.yaml",
        &format!(
            "stages:\n  tone: {{ kind: synth_source, rate: 24000, duration: 600, realtime: true }}\n  framer: {{ kind: framer }}\n  out: {{ kind: wav_sink, path: {}/live.wav, flush_ms: 100000 }}\nlinks: [tone -> framer, framer -> out]\nmetrics: {{ address: \"127.0.0.1:{port}\" }}\n",
            d.display()
        ),
    );
    let child = duplex()
        .args(["run", p.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupted once the sink has taken 7 frames (over half a second).
    wait_until(Duration::from_secs(30), "7 frames at the sink", || {
        stage_frames(port, "out").is_some_and(|n| n >= 7)
    });
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The timing table was printed, and the file was finished (not just flushed: the header
    // interval above is longer than the run), ending with the padded last frame's real samples.
    assert!(stdout.contains("sink out: completion interval"), "{stdout}");
    let (_, got) = read(&d.join("live.wav"));
    assert!(got.len() >= 12_000, "{} samples", got.len());
    assert_eq!(
        got.len() % 480,
        0,
        "whole 20 ms source chunks: {}",
        got.len()
    );
}
