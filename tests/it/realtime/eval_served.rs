//! `duplex eval run --server`: a benchmark's inputs through a running `duplex serve` (the
//! tests' template, tiny pack) in real time over its realtime API: the benchmark's layout with
//! `output.wav` on the input's clock, the session's own figures read from `/api/sessions` (so
//! nothing flags the sample as unmeasured), a served run compared with an offline one, and a
//! server that refuses every input (exit 1, the refusal said) or an address that is not one
//! (exit 2).

use crate::support::{packs, serve};

use std::path::Path;

use serve::Server;

use crate::support::cli::{eval, printed as text};

/// A 16 kHz mono WAV of `len` samples of a speech-like tone.
fn input(path: &Path, len: usize) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 16_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for i in 0..len {
        let t = i as f64 / 16_000.0;
        let env = 0.5 + 0.5 * (std::f64::consts::TAU * 3.0 * t).sin();
        let v = 0.3 * env * (std::f64::consts::TAU * 180.0 * t).sin();
        w.write_sample((v * 32767.0) as i16).unwrap();
    }
    w.finalize().unwrap();
}

#[test]
fn served_inputs_come_back_on_their_clock_with_the_sessions_own_figures() {
    let server = Server::start("max_sessions: 1\n", 240);
    let dir = tempfile::tempdir().unwrap();
    let inputs = dir.path().join("in");
    // Lengths off the 80 ms frame, at 16 kHz: resampled there and back.
    input(&inputs.join("talk/a/input.wav"), 16_000 + 333);
    input(&inputs.join("talk/b/input.wav"), 24_000 - 7);
    let out = dir.path().join("out");
    let url = format!("http://{}:{}", server.host, server.port);
    let served = || {
        eval(&[
            "run",
            "--server",
            &url,
            "--inputs",
            inputs.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--seed",
            "3",
        ])
    };
    let o = served();
    assert!(o.status.success(), "{}", text(&o));
    let said = text(&o);
    assert!(said.contains("served seed 3: 2 inputs run"), "{said}");
    for (s, len) in [("a", 16_000 + 333), ("b", 24_000 - 7)] {
        let sample = out.join("served/seed-3/talk").join(s);
        let r = hound::WavReader::open(sample.join("output.wav")).unwrap();
        assert_eq!(
            (r.spec().sample_rate, r.len() as usize),
            (16_000, len),
            "{s}"
        );
        let loudest = r
            .into_samples::<i16>()
            .map(|v| v.unwrap().unsigned_abs())
            .max()
            .unwrap();
        assert!(loudest > 0, "{s}: the agent's audio is silence");
        assert!(sample.join("transcript.txt").is_file());
        assert!(
            sample.join("input.wav").is_file(),
            "the input is linked beside"
        );
    }
    // The session was found in /api/sessions by the id its session.created gave: whatever the
    // machine's load flagged, never that its figures were missing.
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("served/seed-3/run.json")).unwrap())
            .unwrap();
    assert_eq!(run["server"], url.as_str());
    assert_eq!(run["seed"], 3);
    for (name, why) in run["flagged"].as_object().unwrap() {
        assert!(!why.to_string().contains("no figures"), "{name}: {why}");
    }
    // Done before: nothing sent again.
    let o = served();
    assert!(text(&o).contains("0 inputs run through"), "{}", text(&o));
    // Beside an offline run of the same inputs and seed: compared, the wire's run without
    // token logs.
    let tiny = packs::pack("tiny-gqa");
    let o = eval(&[
        "run",
        "--pack",
        tiny.to_str().unwrap(),
        "--inputs",
        inputs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--seed",
        "3",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = eval(&["compare", out.to_str().unwrap(), "--base", "tiny-gqa"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("| served | talk | all | 2 |"),
        "{}",
        text(&o)
    );
    assert!(text(&o).contains("| 0/0 |"), "{}", text(&o));
}

#[test]
fn a_server_that_refuses_every_input_and_an_address_that_is_none_are_said() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.txt");
    serve::write_keys(&keys, "eval-key-000000000000000000000000\n");
    let server = Server::start(&format!("keys_file: {}\n", keys.display()), 240);
    let inputs = dir.path().join("in");
    input(&inputs.join("a/input.wav"), 8000);
    let out = dir.path().join("out");
    let o = eval(&[
        "run",
        "--server",
        &format!("http://{}:{}", server.host, server.port),
        "--inputs",
        inputs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("refused") && text(&o).contains("401"),
        "{}",
        text(&o)
    );
    assert!(!out.join("served/seed-0/a/output.wav").exists());
    for bad in [["--server", "https://h:1"], ["--server", "ws://h:1"]] {
        let o = eval(&[
            "run",
            bad[0],
            bad[1],
            "--inputs",
            inputs.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains("--server"), "{}", text(&o));
    }
}

/// A server that floods the client with audio deltas of 6 MiB each (the hostile probe's 8 MB
/// deltas took the client to 3 GB in 10 s): the client takes no message over its limit, the
/// session is cut off and said in the sample's flags, and the run ends.
#[test]
fn eval_served_client_is_bounded_against_a_server_that_floods_it() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut server =
        std::process::Command::new(crate::support::daemon::root().join(".venv/bin/python"))
            .arg(crate::support::daemon::root().join("tests/clients/flooding_server.py"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().parse().unwrap();
    let inputs = dir.path().join("in");
    input(&inputs.join("a/input.wav"), 16_000);
    let out = dir.path().join("out");
    let o = eval(&[
        "run",
        "--server",
        &format!("http://127.0.0.1:{port}"),
        "--inputs",
        inputs.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let _ = server.kill();
    let _ = server.wait();
    let said = text(&o);
    assert!(o.status.code().is_some(), "{said}");
    let run: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("served/seed-0/run.json")).unwrap())
            .unwrap();
    let flags = run["flagged"]["a/input.wav"].to_string();
    assert!(flags.contains("the session was cut off"), "{flags}\n{said}");
    assert!(
        flags.contains("Message too long") || flags.contains("too long"),
        "{flags}"
    );
}
