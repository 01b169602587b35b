//! The browser voice chat on loopback, measured: a 60 s conversation in headless Chromium (fake
//! microphone → page → `duplex serve` on the tiny pack → page playback), sampling the page's
//! live panel 4 times a second. Prints the mouth-to-ear estimate with its breakdown (capture
//! block, network round trip, server, jitter buffer, the audio devices' own latency) and the
//! jitter buffer's statistics.
//!
//! Run with `cargo bench --bench browser` (needs `make setup`: Chromium and the venv).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

const SECONDS: u32 = 60;

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    let text = std::fs::read_to_string(root.join("pipelines/serve.yaml"))
        .unwrap()
        .replace("models/", &format!("{}/models/", root.display()));
    std::fs::write(&tpl, text).unwrap();
    let cfg = dir.path().join("serve.yaml");
    std::fs::write(
        &cfg,
        format!("address: \"127.0.0.1:0\"\npipeline: {}\n", tpl.display()),
    )
    .unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut port = String::new();
    for line in BufReader::new(server.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if let Some(a) = line.strip_prefix("listening on ") {
            port = a.rsplit(':').next().unwrap().to_string();
            break;
        }
    }
    // The fake microphone: a tone with a syllable-rate envelope, longer than the run.
    let wav = dir.path().join("mic.wav");
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(&wav, spec).unwrap();
    for i in 0..(SECONDS as usize + 10) * 24_000 {
        let t = i as f64 / 24_000.0;
        let x = 0.3 * (0.5 + 0.5 * (6.0 * t).sin()) * (std::f64::consts::TAU * 200.0 * t).sin();
        w.write_sample((x * 32767.0) as i16).unwrap();
    }
    w.finalize().unwrap();
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("tests/clients/browser.py"))
        .args(["--url", &format!("http://127.0.0.1:{port}/"), "--wav"])
        .arg(&wav)
        .args(["--talk", &SECONDS.to_string(), "--history"])
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    let history = r["history"].as_array().unwrap();
    let series = |f: &dyn Fn(&serde_json::Value) -> Option<f64>| -> Vec<f64> {
        history.iter().filter_map(f).collect()
    };
    let mut depth = series(&|h| h["p"]["depth_ms"].as_f64());
    let target = series(&|h| h["p"]["target_ms"].as_f64());
    let part = |k: &str| {
        let v = series(&|h| h["b"][k].as_f64());
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    let player = &r["stats"]["player"];
    println!(
        "browser voice chat on loopback, tiny pack, {SECONDS} s, {} samples of the live panel",
        history.len()
    );
    println!("mouth to ear (estimate), mean over the run:");
    let parts = [
        "capture_ms",
        "network_ms",
        "server_ms",
        "buffer_ms",
        "device_ms",
    ];
    let total: f64 = parts.iter().map(|k| part(k)).sum();
    for k in parts {
        println!("  {:<12} {:>7.1} ms", k.trim_end_matches("_ms"), part(k));
    }
    println!("  {:<12} {:>7.1} ms", "total", total);
    let n = depth.len();
    let mean = depth.iter().sum::<f64>() / n.max(1) as f64;
    println!(
        "jitter buffer: depth mean {mean:.1} ms, p10 {:.1}, p50 {:.1}, p90 {:.1}, max {:.1}; target {:.0}..{:.0} ms",
        quantile(&mut depth, 0.1),
        quantile(&mut depth, 0.5),
        quantile(&mut depth, 0.9),
        quantile(&mut depth, 1.0),
        target.iter().cloned().fold(f64::INFINITY, f64::min),
        target.iter().cloned().fold(0.0, f64::max),
    );
    println!(
        "played {:.1} s, underruns {}, concealed {:.0} ms, dropped {:.0} ms; console errors {}",
        player["played"].as_f64().unwrap_or(0.0) / 24_000.0,
        player["underruns"],
        player["concealed"].as_f64().unwrap_or(0.0) / 24.0,
        player["dropped"].as_f64().unwrap_or(0.0) / 24.0,
        r["console_errors"].as_array().map_or(0, |a| a.len())
    );
}
