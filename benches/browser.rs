//! The browser voice chat, measured: 60 s conversations in headless Chromium (fake microphone →
//! page → `duplex serve` on the tiny pack → page playback), sampling the page's live panel 4
//! times a second, over the WebSocket and over WebRTC side by side: on loopback, then (where
//! this machine allows a network namespace: root) with the server behind a veth pair dropping
//! 2 % and then 5 % of the packets both ways (nftables). Prints, per row, the mouth-to-ear
//! estimate (mean, p90), underruns (WebRTC: concealment events), concealed ms, the longest stall
//! and the server's late frames; for the loopback rows also the estimate's breakdown (capture
//! block, network round trip, server, the server's jitter buffer, the page's, the devices).
//!
//! Run with `cargo bench --bench browser` (needs `make setup`: Chromium and the venv).

#[path = "../tests/it/support/netns.rs"]
mod netns;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

const SECONDS: u32 = 60;

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// `duplex serve` on `host` (run by `launcher` when given), the default template.
fn serve(dir: &Path, host: &str, launcher: Option<Command>) -> (Child, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tpl = dir.join("session.yaml");
    let text = std::fs::read_to_string(root.join("pipelines/serve.yaml"))
        .unwrap()
        .replace("models/", &format!("{}/models/", root.display()));
    std::fs::write(&tpl, text).unwrap();
    let cfg = dir.join(format!("serve-{host}.yaml"));
    std::fs::write(
        &cfg,
        format!(
            "address: \"{host}:0\"\npipeline: {}\nallow_anonymous: true\n",
            tpl.display()
        ),
    )
    .unwrap();
    let mut cmd = match launcher {
        Some(mut c) => {
            c.arg(env!("CARGO_BIN_EXE_duplex"));
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_duplex")),
    };
    let mut server = cmd
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
    (server, format!("http://{host}:{port}/"))
}

/// One conversation's page output.
fn talk(url: &str, wav: &Path, transport: &str) -> serde_json::Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("tests/clients/browser.py"))
        .args(["--url", url, "--wav"])
        .arg(wav)
        .args([
            "--talk",
            &SECONDS.to_string(),
            "--history",
            "--transport",
            transport,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap()
}

const PARTS: [&str; 6] = [
    "capture_ms",
    "network_ms",
    "server_ms",
    "server_jitter_ms",
    "buffer_ms",
    "device_ms",
];

/// Prints one row of the table, the estimate's parts under it (and the console's errors).
fn row(network: &str, transport: &str, r: &serde_json::Value) {
    let history = r["history"].as_array().unwrap();
    let mut m2e: Vec<f64> = history
        .iter()
        .filter_map(|h| h["b"].as_object())
        .map(|b| b.values().filter_map(|v| v.as_f64()).sum())
        .collect();
    let mean = m2e.iter().sum::<f64>() / m2e.len().max(1) as f64;
    let s = &r["stats"];
    let q = &s["quality"];
    println!(
        "{network:<10} {transport:<10} {mean:>7.1} {:>7.1} {:>9} {:>10.0} {:>9.0} {:>5} {:>7}",
        quantile(&mut m2e, 0.9),
        q["underruns"],
        q["concealed_ms"].as_f64().unwrap_or(0.0),
        q["longest_stall_ms"].as_f64().unwrap_or(0.0),
        s["late_frames"],
        r["console_errors"].as_array().map_or(0, |a| a.len())
    );
    for e in r["console_errors"].as_array().into_iter().flatten() {
        println!("{:<21} console error: {e}", "");
    }
    {
        let part = |k: &str| {
            let v: Vec<f64> = history.iter().filter_map(|h| h["b"][k].as_f64()).collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let parts: Vec<String> = PARTS
            .iter()
            .map(|k| format!("{} {:.1}", k.trim_end_matches("_ms"), part(k)))
            .collect();
        println!("{:<21} parts (ms): {}", "", parts.join(", "));
    }
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
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
    println!("browser voice chat, tiny pack, {SECONDS} s per row; mouth to ear (estimate) in ms");
    println!(
        "{:<10} {:<10} {:>7} {:>7} {:>9} {:>10} {:>9} {:>5} {:>7}",
        "network", "transport", "mean", "p90", "underruns", "concealed", "stall", "late", "errors"
    );
    let (mut server, url) = serve(dir.path(), "127.0.0.1", None);
    for transport in ["websocket", "webrtc"] {
        row("loopback", transport, &talk(&url, &wav, transport));
    }
    let _ = server.kill();
    let _ = server.wait();
    match netns::Netns::create() {
        Err(why) => println!("(no lossy rows: no network namespace here: {why})"),
        Ok(ns) => {
            let (mut server, url) = serve(dir.path(), &ns.ip, Some(ns.exec()));
            for loss in [2, 5] {
                ns.set_loss(loss);
                for transport in ["websocket", "webrtc"] {
                    let r = talk(&url, &wav, transport);
                    row(&format!("{loss} % loss"), transport, &r);
                }
            }
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}
