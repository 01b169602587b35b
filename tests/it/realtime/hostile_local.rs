//! Hostile and careless local input (issue 25), through the real `duplex` binary: files a
//! pipeline would write, WAV headers, the daemon's control socket and configuration, and the
//! clients of that socket. Each test is the regression test of one defect the probe found.

use crate::support::daemon;
use crate::support::packs;
use crate::support::pulse;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use daemon::{config_text, root, Daemon};
use pulse::Pulse;

use crate::support::cli::{duplex, error_line, run_within, stderr};

/// A 16-bit mono WAV of `n` samples at `rate`, of a quiet saw.
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

/// Regression: `duplex validate` of a pipeline whose virtual `playback` had `capture: keep.wav`
/// left `keep.wav` a 68-byte empty WAV (and so did a refused `run`); `token_sink` and
/// `codes_sink` truncated their files the same way, because sinks created their files when
/// they were built. Now a file a stage writes is checked at build and created at start.
#[test]
fn validating_or_refusing_a_pipeline_leaves_the_files_it_would_write_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let input = d.join("in.wav");
    wav(&input, 24_000, 12_000);
    let pack = packs::pack("tiny-gqa");
    let (capture, tokens, codes) = (
        d.join("keep.wav"),
        d.join("keep.jsonl"),
        d.join("codes.jsonl"),
    );
    let pipeline = |extra_stages: &str, extra_links: &str| {
        format!(
            "stages:
  source: {{ kind: wav_source, path: {input} }}
  framer: {{ kind: framer }}
  encode: {{ kind: mimi_encode, pack: {pack} }}
  temporal: {{ kind: temporal, pack: {pack} }}
  depformer: {{ kind: depformer, pack: {pack} }}
  speaker: {{ kind: playback, device: virtual, capture: {capture} }}
  tokens: {{ kind: token_sink, path: {tokens} }}
  codes: {{ kind: codes_sink, path: {codes} }}
{extra_stages}links:
  - source -> framer
  - source -> speaker
  - framer -> encode
  - encode -> temporal.codes
  - encode -> codes
  - temporal.step -> depformer
  - {{ from: depformer, to: temporal.tokens, feedback: true }}
  - temporal.agent -> tokens
{extra_links}",
            input = input.display(),
            pack = pack.display(),
            capture = capture.display(),
            tokens = tokens.display(),
            codes = codes.display(),
        )
    };
    let good = d.join("good.yaml");
    std::fs::write(&good, pipeline("", "")).unwrap();
    // Refused after every stage is built: a framer fed 16 kHz audio.
    let refused = d.join("refused.yaml");
    std::fs::write(
        &refused,
        pipeline(
            "  down: { kind: resample, to: 16000 }\n  late: { kind: framer }\n  void: { kind: null_sink }\n",
            "  - source -> down\n  - down -> late\n  - late -> void\n",
        ),
    )
    .unwrap();
    let precious: Vec<(&PathBuf, Vec<u8>)> = [&capture, &tokens, &codes]
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let bytes = format!("precious {i}: not to be truncated\n").repeat(40 + i);
            std::fs::write(p, &bytes).unwrap();
            (p, bytes.into_bytes())
        })
        .collect();
    let unchanged = |what: &str| {
        for (p, bytes) in &precious {
            let now = std::fs::read(p).unwrap();
            assert!(
                &now == bytes,
                "{what}: {} is {} bytes, was {}",
                p.display(),
                now.len(),
                bytes.len()
            );
        }
    };
    let mut c = duplex();
    c.args(["validate", good.to_str().unwrap()]);
    let o = run_within(c, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    unchanged("validate");
    let mut c = duplex();
    c.args(["run", refused.to_str().unwrap()]);
    let o = run_within(c, 120);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        error_line(&o).contains("cannot take these frames"),
        "{}",
        stderr(&o)
    );
    unchanged("refused run");
    // A run writes them all.
    let mut c = duplex();
    c.args(["run", good.to_str().unwrap()]);
    let o = run_within(c, 120);
    assert!(o.status.success(), "{}", stderr(&o));
    let played = duplex::audio::WavReader::open(&capture)
        .unwrap()
        .read_all()
        .unwrap();
    assert!(
        played.iter().any(|v| v.abs() > 0.01),
        "the capture holds the input"
    );
    for p in [&tokens, &codes] {
        let text = std::fs::read_to_string(p).unwrap();
        assert!(!text.contains("precious"), "{}: {text}", p.display());
        let lines = text.lines().count();
        assert!(lines >= 5, "{}: {lines} lines", p.display());
        for l in text.lines() {
            serde_json::from_str::<serde_json::Value>(l).unwrap();
        }
    }
    // What cannot be written is refused before start, naming the key, and creates nothing.
    let a_file = d.join("a-file");
    std::fs::write(&a_file, "x").unwrap();
    for (stage, want) in [
        (
            format!(
                "{{ kind: playback, device: virtual, capture: {} }}",
                d.display()
            ),
            "stage `out`: `capture`: ",
        ),
        (
            format!(
                "{{ kind: token_sink, path: {}/sub/t.jsonl }}",
                a_file.display()
            ),
            "stage `out`: `path`: ",
        ),
        (
            format!("{{ kind: codes_sink, path: {}/ }}", d.join("new").display()),
            "stage `out`: `path`: ",
        ),
    ] {
        let p = d.join("bad.yaml");
        std::fs::write(
            &p,
            format!(
                "stages:\n  source: {{ kind: wav_source, path: {} }}\n  out: {stage}\nlinks: [source -> out]\n",
                input.display()
            ),
        )
        .unwrap();
        let mut c = duplex();
        c.args(["validate", p.to_str().unwrap()]);
        let o = run_within(c, 60);
        assert_eq!(o.status.code(), Some(2), "{stage}: {}", stderr(&o));
        assert!(error_line(&o).contains(want), "{want}: {}", stderr(&o));
    }
    assert_eq!(std::fs::read_to_string(&a_file).unwrap(), "x");
    assert!(!d.join("new").exists());
}

/// Regression: a `wav_source` took a WAV whose header said 1 Hz: 9.6 KB became 80 minutes of
/// audio (230 MB written by a `wav_sink` after a resampler). Now rates below 1000 Hz (the floor
/// of `resample` and `synth_source`) are refused before start, naming the file.
#[test]
fn a_wav_source_whose_header_says_1_hz_is_refused_before_start() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (rate, refused) in [(1, true), (999, true), (1000, false)] {
        let input = d.join(format!("at-{rate}.wav"));
        wav(&input, rate, 4800);
        let p = d.join("p.yaml");
        std::fs::write(
            &p,
            format!(
                "stages:\n  source: {{ kind: wav_source, path: {} }}\n  up: {{ kind: resample, to: 24000 }}\n  sink: {{ kind: wav_sink, path: {}/out.wav }}\nlinks: [source -> up, up -> sink]\n",
                input.display(),
                d.display()
            ),
        )
        .unwrap();
        for cmd in ["validate", "run"] {
            let mut c = duplex();
            c.args([cmd, p.to_str().unwrap()]);
            let o = run_within(c, 60);
            if !refused {
                assert!(o.status.success(), "{rate} Hz: {}", stderr(&o));
                continue;
            }
            assert_eq!(
                o.status.code(),
                Some(2),
                "{cmd} at {rate} Hz: {}",
                stderr(&o)
            );
            let line = error_line(&o);
            assert!(
                line.contains("stage `source`: `path`: ")
                    && line.contains(&input.display().to_string())
                    && line.contains(&format!("{rate} Hz")),
                "{line}"
            );
        }
        if refused {
            assert!(!d.join("out.wav").exists(), "nothing written at {rate} Hz");
        }
    }
}

/// A daemon configuration on a private sound server: `extra` lines replace those of the same
/// keys.
fn daemon_config(pa: &Pulse, extra: &str) -> PathBuf {
    let keys: Vec<&str> = extra.lines().filter_map(|l| l.split(':').next()).collect();
    let text: String = config_text(pa.dir(), "")
        .lines()
        .filter(|l| !keys.iter().any(|k| l.starts_with(&format!("{k}:"))))
        .map(|l| format!("{l}\n"))
        .collect();
    let p = pa.dir().join("daemon.yaml");
    std::fs::write(&p, format!("{text}{extra}")).unwrap();
    p
}

/// Regression: `daemon --check` passed a `control_socket` under `/proc`, where no socket can be
/// made, and the daemon then failed at start (exit 1) naming no key. Now the socket's place is
/// checked as start uses it (its folders made, a socket bound, under a probe's name), in
/// `--check` and at start alike: exit 2, naming `control_socket`. A path too long for a Unix
/// socket is refused the same way.
#[test]
fn daemon_check_refuses_a_control_socket_where_none_can_be_made() {
    let pa = Pulse::start();
    let long = pa.dir().join("x".repeat(120)).join("control.sock");
    for sock in [
        PathBuf::from("/proc/duplex-test/control.sock"),
        PathBuf::from("/proc/control.sock"),
        long,
    ] {
        let config = daemon_config(&pa, &format!("control_socket: {}\n", sock.display()));
        for args in [&["daemon", "--check"][..], &["daemon"]] {
            let mut c = pa.duplex();
            c.current_dir(root())
                .args(args)
                .args(["--config", config.to_str().unwrap()]);
            let o = run_within(c, 60);
            assert_eq!(
                o.status.code(),
                Some(2),
                "{args:?} {}: {}",
                sock.display(),
                stderr(&o)
            );
            let line = error_line(&o);
            assert!(
                line.contains(&format!("{}: `control_socket`: ", config.display()))
                    && line.contains(&sock.display().to_string()),
                "{line}"
            );
        }
    }
    // The probe leaves nothing behind.
    let left: Vec<_> = std::fs::read_dir(pa.dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".duplex-probe"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// Regression: `daemon --check` with a user's broken `pipeline:` file that lacks a stage the
/// daemon sets params of (no `mic`, or no stages at all) blamed the built-in defaults'
/// `input_device` ("configs/daemon.yaml (built in): `input_device` (over FILE): stage `mic`:
/// missing `kind`"). Now the error leads with the user's pipeline file and the stage.
#[test]
fn daemon_check_blames_the_users_broken_pipeline_file_not_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let live = std::fs::read_to_string(root().join("pipelines/daemon.yaml")).unwrap();
    let renamed = live.replacen("  mic:\n", "  microphone:\n", 1).replacen(
        "  - mic -> down",
        "  - microphone -> down",
        1,
    );
    assert_ne!(renamed, live);
    for (name, text, want) in [
        (
            "no-mic.yaml",
            renamed,
            "stage `mic`: no such stage in this file, but the daemon sets its params",
        ),
        (
            "no-stages.yaml",
            "stages: {}\n".to_string(),
            "the pipeline has no stages",
        ),
        (
            "no-kind.yaml",
            live.replacen("    kind: mic\n", "", 1),
            "stage `mic`: missing `kind`",
        ),
    ] {
        let broken = dir.path().join(name);
        std::fs::write(&broken, text).unwrap();
        let config = dir.path().join("daemon.yaml");
        std::fs::write(&config, format!("pipeline: {}\n", broken.display())).unwrap();
        let mut c = duplex();
        c.args(["daemon", "--check", "--config", config.to_str().unwrap()]);
        let o = run_within(c, 60);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let line = error_line(&o);
        assert!(
            line.starts_with(&format!("error: {}: {want}", broken.display())),
            "{name}: {line}"
        );
    }
}

/// Regression (privacy): `ctl record on` then `record off` within 0.3 s: `off` answered "not
/// recording", then the recording started and went on. Several `record on` in one second
/// collided on one folder name and the reload failed blaming a `record.dir` the user never
/// set. Now `off` cancels a recording still starting (nothing of it is kept), a second `on`
/// says one is already starting, and an error names the daemon's `record_dir`.
#[test]
fn ctl_record_off_cancels_a_recording_still_starting() {
    let recs_dir = tempfile::tempdir().unwrap();
    let recs = recs_dir.path().join("recs");
    // The default `record_dir` (under XDG_STATE_HOME) cannot be made: under a regular file.
    let not_a_dir = recs_dir.path().join("state-is-a-file");
    std::fs::write(&not_a_dir, "x").unwrap();
    let d = Daemon::start_with(
        &format!("record_dir: {}\n", recs.display()),
        &[("XDG_STATE_HOME", not_a_dir.to_str().unwrap())],
    );
    let folders = || -> Vec<PathBuf> {
        std::fs::read_dir(&recs)
            .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    };
    let (ok, on) = d.ctl(&["record", "on"]);
    assert!(ok && on.contains("a new conversation, recorded"), "{on}");
    let (ok, off) = d.ctl(&["record", "off"]);
    assert!(ok && off.contains("cancelled"), "{off}");
    // Once the pipeline built for it is done with, nothing records, and nothing was kept.
    d.wait_status(60, "the cancelled recording settled", |s| {
        s["record_starting"] == false
    });
    let f0 = d.frames();
    d.wait_status(30, "frames flow", |s| {
        s["frames"].as_u64().unwrap_or(0) >= f0 + 25
    });
    let s = d.status().unwrap();
    assert!(s["recording"].is_null(), "{s}");
    assert!(folders().is_empty(), "{:?}", folders());
    // Three `record on` at once: one recording, and replies that say so.
    let replies: Vec<String> = (0..3).map(|_| d.ctl(&["record", "on"]).1).collect();
    assert!(
        replies[0].contains("a new conversation, recorded"),
        "{replies:?}"
    );
    for r in &replies[1..] {
        assert!(r.contains("already starting"), "{replies:?}");
    }
    d.wait_status(60, "recording", |s| {
        s["recording"].is_string() && s["record_starting"] == false && s["ready"] == true
    });
    let s = d.status().unwrap();
    assert!(
        !s["reloads"]["last"]
            .as_str()
            .unwrap_or("")
            .contains("rejected"),
        "{s}"
    );
    assert_eq!(folders().len(), 1, "{:?}", folders());
    let (ok, out) = d.ctl(&["record", "off"]);
    assert!(ok && out.contains("recording stopped"), "{out}");
    // A `record_dir` that cannot be made is said at once, naming the daemon's key and where
    // its value came from (here the built-in default), not the pipeline's `record.dir`.
    let text = std::fs::read_to_string(&d.config).unwrap();
    let without: String = text
        .lines()
        .filter(|l| !l.starts_with("record_dir:"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(d.reload(&without).starts_with("applied"));
    let (ok, out) = d.ctl(&["record", "on"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("configs/daemon.yaml (built in): `record_dir`")
            && out.contains(not_a_dir.to_str().unwrap())
            && !out.contains("record.dir"),
        "{out}"
    );
    let s = d.status().unwrap();
    assert!(
        s["recording"].is_null() && s["record_starting"] == false,
        "{s}"
    );
}

/// Connects to the daemon's socket and sends a byte every 150 ms until the server answers or
/// closes, `stop` is set, or 20 s have passed; true when the server ended it.
fn drip(mut s: UnixStream, stop: &AtomicBool) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(150)))
        .unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) && !stop.load(Ordering::Relaxed) {
        let mut buf = [0u8; 512];
        match s.read(&mut buf) {
            // Answered ("no command within 2 s"), or cut to make room.
            Ok(_) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return true,
        }
        if s.write_all(b"s").is_err() {
            return true;
        }
    }
    false
}

/// Regression: eight local clients each sending a byte every 150 ms held every slot of the
/// control socket (a timeout per read, never reached), and `duplex ctl status` answered "busy"
/// for as long as they went on. Now each connection has one deadline for its command line, and
/// when every slot is taken the one that has waited longest for its line gives way: the
/// drippers are cut, and `ctl status` gets through, even when they connect again at once.
#[test]
fn dripping_control_clients_are_cut_and_ctl_status_gets_through() {
    let d = Daemon::start("");
    let no_stop = Arc::new(AtomicBool::new(false));
    // Eight clients, each holding a slot: connected, its first byte sent, and not told "busy"
    // (a slot may still be held a moment by the last `status`).
    let drippers: Vec<_> = (0..8)
        .map(|_| {
            let s = loop {
                let mut s = UnixStream::connect(&d.socket).unwrap();
                s.write_all(b"s").unwrap();
                s.set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                let mut buf = [0u8; 512];
                match s.read(&mut buf) {
                    Ok(n) => {
                        let got = String::from_utf8_lossy(&buf[..n]).to_string();
                        assert!(got.contains("busy"), "{got}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    Err(_) => break s,
                }
            };
            let stop = no_stop.clone();
            std::thread::spawn(move || drip(s, &stop))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let (ok, out) = d.ctl(&["status"]);
    assert!(ok && out.contains("\"ok\":true"), "{out}");
    eprintln!(
        "ctl status with 8 drippers: {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    for t in drippers {
        assert!(t.join().unwrap(), "a dripper was never cut");
    }
    // Drippers that connect again as soon as they are cut.
    let stop = Arc::new(AtomicBool::new(false));
    let again: Vec<_> = (0..8)
        .map(|_| {
            let (socket, stop) = (d.socket.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(s) = UnixStream::connect(&socket) {
                        drip(s, &stop);
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..3 {
        let t0 = Instant::now();
        let (ok, out) = d.ctl(&["status"]);
        assert!(ok && out.contains("\"ok\":true"), "{out}");
        eprintln!(
            "ctl status with 8 drippers connecting again: {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in again {
        t.join().unwrap();
    }
}
