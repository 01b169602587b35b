//! How long a client of `duplex serve` waits for its conversation to start, by how the
//! session's LM is primed, side by side in one run: from the WebSocket upgrade request to the
//! handshake (the state is primed) and to the first agent audio.
//!
//! The server's session template (`pipelines/serve.yaml`: LM on the shared engine) with a 10 s
//! voice prompt and a persona of about a hundred tokens, on the tiny LM with the full-size
//! codec (`models/tiny-gqa-mimi-full`) and on the `small` LM (dim 512, 4 layers) with the
//! full-size codec. Per pack and priming mode a server of its own; three sessions one after
//! the other, each streaming a tone in real time for 2 s after its handshake; per session, the
//! handshake's time, the priming's share of it (`duplex_priming_seconds`: the rest is building
//! the session and warming its graphs) and the first audio's time:
//!
//! - `stepped`: one temporal step per priming frame (the reference);
//! - `chunked`: the priming frames as prefills of 32 frames, one graph call each;
//! - `cached`: chunked for the first session, then the state it left restored from the
//!   process's cache for the next ones (the default template's).
//!
//! Run with `cargo bench --bench priming` (it builds the `small` pack on first use).

#[path = "support/mod.rs"]
mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use duplex::audio::opus::OggOpusWriter;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

const SESSIONS: usize = 3;

/// About a hundred tokens of the tiny tokenizer (105).
const PERSONA: &str = "You are a patient and cheerful assistant who helps people plan their \
    days. You speak in short sentences, you ask one question at a time, and you never \
    interrupt.";

fn start(pack: &Path, priming: &str) -> support::Server {
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    let models = support::root().join("models");
    let text = std::fs::read_to_string(support::root().join("pipelines/serve.yaml"))
        .unwrap()
        .replace("models/", &format!("{}/", models.display()))
        .replace(
            &format!("{}/tiny-gqa\n", models.display()),
            &format!("{}\n", pack.display()),
        );
    assert!(text.contains("    priming: cached\n"), "the template moved");
    let text = text.replace(
        "    priming: cached\n",
        &format!("    priming: {priming}\n"),
    );
    std::fs::write(&tpl, text).unwrap();
    let voices = dir.path().join("voices");
    std::fs::create_dir(&voices).unwrap();
    support::voice_wav(&voices.join("voice.wav"));
    let cfg = dir.path().join("serve.yaml");
    std::fs::write(
        &cfg,
        format!(
            "address: \"127.0.0.1:0\"\npipeline: {}\nmax_sessions: 2\nvoices: {}\nvoice_prompt: voice.wav\ntext_prompt: \"{PERSONA}\"\n",
            tpl.display(),
            voices.display()
        ),
    )
    .unwrap();
    support::serve(dir, &cfg, "info")
}

/// One session: (upgrade -> handshake, upgrade -> first agent audio).
async fn session(port: u16) -> (Duration, Duration) {
    let t0 = Instant::now();
    let (ws, _) = tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/api/chat"))
        .await
        .unwrap();
    let (mut tx, mut rx) = ws.split();
    let mut handshake = None;
    while let Some(Ok(m)) = rx.next().await {
        if let Message::Binary(b) = m {
            if b.first() == Some(&0) {
                handshake = Some(t0.elapsed());
                break;
            }
        }
    }
    let handshake = handshake.expect("no handshake");
    let reader = tokio::spawn(async move {
        while let Some(Ok(m)) = rx.next().await {
            if let Message::Binary(b) = m {
                if b.first() == Some(&1) {
                    return Some(t0.elapsed());
                }
            }
        }
        None
    });
    let mut w = OggOpusWriter::new(1, None).unwrap();
    let start = tokio::time::Instant::now();
    for k in 0..25 {
        let m = support::tone_message(&mut w, k);
        if tx.send(Message::Binary(m.into())).await.is_err() {
            break;
        }
        tokio::time::sleep_until(start + Duration::from_secs_f64((k + 1) as f64 * 0.08)).await;
    }
    let audio = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .ok()
        .and_then(|r| r.ok().flatten())
        .expect("no agent audio");
    let _ = tx.send(Message::Close(None)).await;
    (handshake, audio)
}

/// Seconds the server has spent priming, summed over its sessions (`duplex_priming_seconds`).
fn priming_seconds(port: u16) -> f64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
    let mut t = String::new();
    s.read_to_string(&mut t).unwrap();
    t.lines()
        .filter(|l| l.starts_with("duplex_priming_seconds_sum"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The priming steps the server's first session ran, from its log.
fn steps(log: &Path) -> String {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .find(|l| l.contains("LM warmed up and primed"))
        .and_then(|l| l.split("steps=").nth(1))
        .and_then(|t| t.split_whitespace().next())
        .unwrap_or("?")
        .to_string()
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    println!(
        "duplex serve: upgrade -> handshake and -> first agent audio, 10 s voice prompt + persona, {} cores, {SESSIONS} sessions one after the other per server",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let packs = [
        (
            "tiny LM + full Mimi",
            support::root().join("models/tiny-gqa-mimi-full"),
        ),
        (
            "small LM + full Mimi",
            support::with_step_graphs(support::pack(
                "small-gqa-fullmimi",
                &["--size", "small", "--variant", "gqa", "--mimi", "full"],
            )),
        ),
    ];
    for (label, dir) in &packs {
        println!("\n{label} ({})", dir.display());
        println!(
            "{:>8} {:>7} {:>28} {:>28} {:>28}",
            "priming",
            "steps",
            "1st: handshake/prime/audio",
            "2nd: handshake/prime/audio",
            "3rd: handshake/prime/audio"
        );
        let mut later = Vec::new();
        for mode in ["stepped", "chunked", "cached"] {
            let server = start(dir, mode);
            let mut times = Vec::new();
            let mut cells = Vec::new();
            for _ in 0..SESSIONS {
                let before = priming_seconds(server.port);
                let (h, a) = rt.block_on(session(server.port));
                // The session's end settles before the next one starts.
                std::thread::sleep(Duration::from_millis(1500));
                let p = (priming_seconds(server.port) - before) * 1000.0;
                cells.push(format!("{:.0} / {p:.0} / {:.0} ms", ms(h), ms(a)));
                times.push((h, a));
            }
            println!(
                "{mode:>8} {:>7} {:>28} {:>28} {:>28}",
                steps(&server.log),
                cells[0],
                cells[1],
                cells[2]
            );
            // A later session's handshake (the median of the sessions after the first).
            let mut h: Vec<f64> = times[1..].iter().map(|(h, _)| ms(*h)).collect();
            h.sort_by(f64::total_cmp);
            later.push(h[h.len() / 2]);
        }
        println!(
            "later sessions' upgrade -> handshake: chunked {:.2}x, cached {:.2}x of stepped ({:.0} / {:.0} / {:.0} ms)",
            later[1] / later[0],
            later[2] / later[0],
            later[0],
            later[1],
            later[2]
        );
    }
}
