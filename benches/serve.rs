//! `duplex serve` on the tiny pack, on this machine, measured from outside the process: a
//! server binary and N clients streaming in real time (`duplex loadtest`'s, and for the
//! transports our own Ogg/Opus writer and tokio-tungstenite; the protocol tests use independent
//! clients, this measures the server).
//!
//! 1. Capacity: sessions at once, raised until one of them falls behind, with `duplex
//!    loadtest`'s clients (`duplex::app::loadtest`): per level, server latency (a client's audio
//!    arriving -> the agent audio it produced leaving) p50/p90, frames later than 2 frame budgets
//!    (160 ms), frames dropped, the server's CPU per session per second, split into the model
//!    stages and everything else (network, Opus, framing), and what the clients saw (latency,
//!    missing frames, underruns of a 160 ms jitter buffer). A level keeps up when the clients say
//!    so (loadtest's verdict) and nothing was late or dropped inside the server.
//! 2. Memory per additional session (resident), and what a quiet session costs (the model's clock
//!    keeps running on silence).
//! 3. Both again with the session template's LM and codec on the process's shared engines
//!    (`engine: shared`: weights once, every session stepped in one batched call per tick), side
//!    by side; then with the full-size Mimi (`tiny-gqa-mimi-full`: the tiny LM, the real codec's
//!    shapes), the codec per session against the shared codec, and the shared codec with its
//!    step graphs in int8 (`tools/quantize_pack.py --quantize-codec int8`), and the shared
//!    codec with two intra-op threads per role (`intra_threads: 2` on `encode` and `decode`):
//!    a tick's rows computed on both cores, for latency.
//! 4. The transports side by side on one server (the default template, tiny pack): the same
//!    sessions over `/api/chat` (Ogg/Opus), `/v1/realtime` in PCM16 and in μ-law (JSON events,
//!    base64), and `/twilio/media` (μ-law): server latency and the CPU outside the models.
//!
//! 5. Phone calls per core: concurrent G.711 calls over SIP (`sipp` placing the calls and
//!    streaming μ-law RTP, the server's SIP ingress answering) and over a media stream
//!    (`/twilio/media`), raised until one falls behind (a frame later than 160 ms in the
//!    server, one dropped, or a call not answered): server latency, the CPU per call-second in
//!    all and outside the models, and the level that kept up, per core.
//!
//! Run with `cargo bench --bench serve` (`-- tiny` for the tiny pack's sections only, `-- full`
//! for the full-size codec's, `-- transports` for the transports only, `-- phone` for the phone
//! calls only).

#[path = "support/mod.rs"]
mod support;

use std::path::Path;
use std::time::Duration;

use duplex::audio::opus::OggOpusWriter;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

const SECONDS: f64 = 8.0;

/// The runs: the tiny pack with everything per session and everything shared, then the tiny LM
/// with the full-size Mimi (`tiny-gqa-mimi-full`), the LM shared and the codec per session or
/// shared: where the codec is what limits a server.
const SETUPS: &[Setup] = &[
    Setup {
        label: "tiny pack, LM and codec of each session's own (engine: own)",
        pack: "tiny-gqa",
        lm_shared: false,
        codec_shared: false,
        codec_threads: 1,
        levels: &[1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32],
    },
    Setup {
        label:
            "tiny pack, LM and codec on the process's shared engines (engine: shared, the default)",
        pack: "tiny-gqa",
        lm_shared: true,
        codec_shared: true,
        codec_threads: 1,
        levels: &[1, 2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32],
    },
    Setup {
        label: "full-size codec (tiny-gqa-mimi-full), LM shared, codec of each session's own",
        pack: "tiny-gqa-mimi-full",
        lm_shared: true,
        codec_shared: false,
        codec_threads: 1,
        levels: &[1, 2, 3, 4, 6, 8],
    },
    Setup {
        label: "full-size codec (tiny-gqa-mimi-full), LM and codec shared",
        pack: "tiny-gqa-mimi-full",
        lm_shared: true,
        codec_shared: true,
        codec_threads: 1,
        levels: &[1, 2, 4, 6, 8, 10, 12],
    },
    Setup {
        label:
            "full-size codec (tiny-gqa-mimi-full), LM and codec shared, 2 threads per codec role",
        pack: "tiny-gqa-mimi-full",
        lm_shared: true,
        codec_shared: true,
        codec_threads: 2,
        levels: &[1, 2, 4, 6, 8, 10, 12],
    },
    Setup {
        label: "full-size codec in int8 (tiny-gqa-mimi-full-codec8), LM and codec shared",
        pack: "tiny-gqa-mimi-full-codec8",
        lm_shared: true,
        codec_shared: true,
        codec_threads: 1,
        levels: &[1, 2, 4, 6, 8, 10, 12],
    },
];

/// How a run's template is set up.
struct Setup {
    /// What the section is called.
    label: &'static str,
    /// The pack under `models/`.
    pack: &'static str,
    /// The LM on the shared engine.
    lm_shared: bool,
    /// The codec on the shared encoder and decoder.
    codec_shared: bool,
    /// Intra-op threads of the codec's sessions (`intra_threads` on `encode` and `decode`).
    codec_threads: usize,
    /// Session counts tried, in order, until one falls behind.
    levels: &'static [usize],
}

fn start(setup: &Setup) -> support::Server {
    start_with(setup, 32, "")
}

/// As [`start`], admitting `max_sessions`, with `extra` added to the server's configuration.
fn start_with(setup: &Setup, max_sessions: usize, extra: &str) -> support::Server {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Some(float) = setup.pack.strip_suffix("-codec8") {
        // (made from the float pack by tools/quantize_pack.py when it is not there)
        support::quantized(
            &root.join("models").join(float),
            setup.pack,
            &["--quantize-codec", "int8"],
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    let mut text = std::fs::read_to_string(root.join("pipelines/serve.yaml"))
        .unwrap()
        .replace("models/tiny-gqa\n", &format!("models/{}\n", setup.pack))
        .replace("models/", &format!("{}/models/", root.display()));
    // The default template runs the LM and the codec on the process's shared engines.
    for (kind, shared) in [
        ("temporal", setup.lm_shared),
        ("depformer", setup.lm_shared),
        ("mimi_encode", setup.codec_shared),
        ("mimi_decode", setup.codec_shared),
    ] {
        let default = format!("    kind: {kind}\n    engine: shared\n");
        assert!(
            text.contains(&default),
            "the template's {kind} is not `engine: shared`"
        );
        if !shared {
            text = text.replace(&default, &format!("    kind: {kind}\n    engine: own\n"));
        }
    }
    if setup.codec_threads != 1 {
        for kind in ["mimi_encode", "mimi_decode"] {
            let line = format!("    kind: {kind}\n");
            text = text.replace(
                &line,
                &format!("{line}    intra_threads: {}\n", setup.codec_threads),
            );
        }
    }
    std::fs::write(&tpl, text).unwrap();
    let cfg = dir.path().join("serve.yaml");
    std::fs::write(
        &cfg,
        format!(
            // Every client comes from 127.0.0.1: the per-address limits are raised past the
            // bench's sessions.
            "address: \"127.0.0.1:0\"\npipeline: {}\nmax_sessions: {max_sessions}\nmax_connections_per_ip: 1000\n\
             limits:\n  idle_timeout_s: 120\n  sessions_per_minute_per_ip: 100000\n  \
             session_burst_per_ip: 100000\n{extra}",
            tpl.display()
        ),
    )
    .unwrap();
    support::serve(dir, &cfg, "warn")
}

fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
    let mut t = String::new();
    s.read_to_string(&mut t).unwrap();
    t.split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default()
}

/// Sum of the values of the series whose line starts with `prefix`.
fn sum(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The server-latency histogram: (upper bound, cumulative count).
fn latency_buckets(metrics: &str) -> Vec<(f64, f64)> {
    metrics
        .lines()
        .filter(|l| l.starts_with("duplex_frame_latency_seconds_bucket{path=\"server\""))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let d: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| {
            (
                *le,
                c - before.iter().find(|b| b.0 == *le).map_or(0.0, |b| b.1),
            )
        })
        .collect();
    let total = d.last().map_or(0.0, |x| x.1);
    let want = q * total;
    let mut prev = (0.0, 0.0);
    for (le, c) in &d {
        if *c >= want {
            if le.is_infinite() {
                return prev.0;
            }
            let f = if c - prev.1 > 0.0 {
                (want - prev.1) / (c - prev.1)
            } else {
                1.0
            };
            return prev.0 + f * (le - prev.0);
        }
        prev = (*le, *c);
    }
    f64::NAN
}

fn over(before: &[(f64, f64)], after: &[(f64, f64)], bound: f64) -> f64 {
    let at = |h: &[(f64, f64)], le: f64| h.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
    let inf = f64::INFINITY;
    (at(after, inf) - at(before, inf)) - (at(after, bound) - at(before, bound))
}

/// CPU seconds the process has used.
fn cpu_seconds(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = s.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap()) / ticks
}

/// CPU seconds used by the threads of the model stages (`duplex:encode`, …, as the kernel
/// truncates their names) and of the shared engine (`duplex:engine`) that are alive now.
fn model_thread_seconds(pid: u32) -> f64 {
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let names: Vec<String> = MODEL_STAGES
        .iter()
        .map(|s| format!("duplex:{s}").chars().take(15).collect())
        .collect();
    let mut total = 0.0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let comm = head.split_once('(').map_or("", |x| x.1);
        if names.iter().any(|n| n == comm) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            total +=
                (f[11].parse::<f64>().unwrap_or(0.0) + f[12].parse::<f64>().unwrap_or(0.0)) / ticks;
        }
    }
    total
}

fn rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap()
        / 1024.0
}

const MODEL_STAGES: &[&str] = &[
    "encode",
    "temporal",
    "depformer",
    "decode",
    "engine",
    "codec_encoder",
    "codec_decoder",
];

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // `cargo bench --bench serve -- full` runs the full-size codec's sections only.
    let only_full = std::env::args().any(|a| a == "full");
    // `-- shared` runs the sections with the shared codec only.
    let only_shared = std::env::args().any(|a| a == "shared");
    // `-- tiny` runs the tiny pack's sections only.
    let only_tiny = std::env::args().any(|a| a == "tiny");
    println!(
        "duplex serve, {} cores, {SECONDS} s per level",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let only_transports = std::env::args().any(|a| a == "transports");
    let only_phone = std::env::args().any(|a| a == "phone");
    if only_phone {
        phone(&rt);
        return;
    }
    let mut caps = Vec::new();
    for setup in SETUPS
        .iter()
        .filter(|_| !only_transports)
        .filter(|s| !only_full || s.pack != "tiny-gqa")
        .filter(|s| !only_shared || s.codec_shared)
        .filter(|s| !only_tiny || s.pack == "tiny-gqa")
    {
        let server = start(setup);
        println!("\n{}", setup.label);
        caps.push((setup.label, levels(&server, setup.levels)));
        quiet(&server, &rt);
    }
    if !caps.is_empty() {
        println!("\nreal-time sessions per process:");
        for (label, cap) in caps {
            println!("  {cap:>3}  {label}");
        }
    }
    if !only_full && !only_shared && !only_tiny {
        transports(&rt);
        if !only_transports {
            phone(&rt);
        }
    }
}

/// Raises the number of sessions until one falls behind; returns the last level that kept up.
/// What one run of `n` real-time clients cost the server.
struct Measured {
    /// Server latency, seconds.
    p50: f64,
    p90: f64,
    /// Frames later than 160 ms.
    late: f64,
    /// Frames dropped on the pipelines' links.
    dropped: f64,
    /// CPU seconds of the process, and of its model stages' threads, while the clients ran.
    cpu: f64,
    model: f64,
    /// Resident memory with every session live, MiB.
    rss: f64,
}

/// Runs `n` clients of `transport` for [`SECONDS`] against `server` at once; what each client
/// got (agent audio messages).
fn measure(
    server: &support::Server,
    rt: &tokio::runtime::Runtime,
    n: usize,
    transport: Transport,
) -> (Measured, Vec<usize>) {
    let port = server.port;
    measured(server, || {
        rt.block_on(async {
            let tasks: Vec<_> = (0..n)
                .map(|_| tokio::spawn(client(port, SECONDS, transport, false)))
                .collect();
            let mut v = Vec::new();
            for t in tasks {
                v.push(t.await.unwrap_or(0));
            }
            v
        })
    })
}

/// What the server spent while `clients` ran (for [`SECONDS`]), and what they said.
fn measured<R>(server: &support::Server, clients: impl FnOnce() -> R) -> (Measured, R) {
    let pid = server.child.id();
    let m0 = http_get(server.port, "/metrics");
    let cpu0 = cpu_seconds(pid);
    let model0 = model_thread_seconds(pid);
    // Just before the clients stop: resident memory with every session live, and the CPU of the
    // process and of the model stages' threads (which end with their sessions).
    let sampler = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs_f64(SECONDS - 0.3));
        (rss_mib(pid), cpu_seconds(pid), model_thread_seconds(pid))
    });
    let said = clients();
    let (rss, cpu_at, model) = sampler.join().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let m1 = http_get(server.port, "/metrics");
    let (h0, h1) = (latency_buckets(&m0), latency_buckets(&m1));
    let m = Measured {
        p50: quantile(&h0, &h1, 0.5),
        p90: quantile(&h0, &h1, 0.9),
        late: over(&h0, &h1, 0.16),
        dropped: sum(&m1, "duplex_edge_dropped_total") - sum(&m0, "duplex_edge_dropped_total"),
        cpu: cpu_at - cpu0,
        model: model - model0,
        rss,
    };
    (m, said)
}

fn levels(server: &support::Server, levels: &[usize]) -> usize {
    let pid = server.child.id();
    std::thread::sleep(Duration::from_secs(1));
    let rss0 = rss_mib(pid);
    println!("server at rest: {rss0:.0} MiB resident\n");
    println!(
        "{:>8} {:>10} {:>10} {:>8} {:>8} {:>13} {:>14} {:>9} {:>10} {:>16} {:>11} {:>8} {:>8}",
        "sessions",
        "lat p50 ms",
        "lat p90 ms",
        "late",
        "dropped",
        "cpu/sess/s",
        "outside models",
        "RSS MiB",
        "MiB/sess",
        "client p50/p90",
        "client late",
        "missing",
        "underrun"
    );
    let mut capacity = 0;
    for &n in levels {
        // The clients are `duplex loadtest`'s: one level of `n`, each streaming a speech-like
        // tone in real time over Kyutai's protocol, timing the agent's frames as it gets them.
        let args = duplex::app::loadtest::LoadtestArgs {
            url: format!("http://127.0.0.1:{}", server.port),
            protocol: duplex::app::loadtest::Protocol::Kyutai,
            sessions: Some(n),
            levels: Vec::new(),
            seconds: SECONDS,
            wav: None,
            key: None,
            late_ms: 160,
            buffer_ms: 160,
            json: true,
        };
        let (
            Measured {
                p50,
                p90,
                late,
                dropped,
                cpu,
                model,
                rss,
            },
            report,
        ) = measured(server, || {
            duplex::app::loadtest::run(&args).expect("loadtest")
        });
        let seen = &report.levels[0];
        let sess_s = n as f64 * (SECONDS - 0.3);
        println!(
            "{:>8} {:>10.1} {:>10.1} {:>8} {:>8} {:>11.1} ms {:>11.1} ms {:>9.0} {:>10.1} {:>7.1}/{:<8.1} {:>11} {:>8} {:>8}{}",
            n,
            p50 * 1e3,
            p90 * 1e3,
            late,
            dropped,
            cpu / sess_s * 1e3,
            (cpu - model) / sess_s * 1e3,
            rss,
            (rss - rss0) / n as f64,
            seen.latency_ms.p50,
            seen.latency_ms.p90,
            seen.late,
            seen.missing,
            seen.underruns,
            match &seen.refusal {
                Some(why) => format!("  ({} refused: {why})", seen.refused),
                None => String::new(),
            }
        );
        // Kept up: by the clients (`duplex loadtest`'s verdict) and inside the server.
        if seen.keeps_up && late == 0.0 && dropped == 0.0 {
            capacity = n;
        } else {
            break;
        }
        // The sessions end and free their slots before the next level.
        std::thread::sleep(Duration::from_secs(1));
    }
    println!("keeps up with {capacity} concurrent real-time sessions (duplex loadtest's verdict, and no frame later than 160 ms in the server, none dropped)");
    capacity
}

fn quiet(server: &support::Server, rt: &tokio::runtime::Runtime) {
    let pid = server.child.id();

    // Quiet sessions: the clock keeps running on silence.
    let n = 4;
    let rss_before = rss_mib(pid);
    let cpu0 = cpu_seconds(pid);
    let port = server.port;
    let sampler = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs_f64(SECONDS / 2.0));
        rss_mib(pid)
    });
    rt.block_on(async {
        let tasks: Vec<_> = (0..n)
            .map(|_| tokio::spawn(client(port, SECONDS, Transport::Kyutai, true)))
            .collect();
        for t in tasks {
            let _ = t.await;
        }
    });
    let rss = sampler.join().unwrap();
    let cpu = cpu_seconds(pid) - cpu0;
    println!(
        "{n} quiet sessions: {:.1} ms CPU per session per second, {:.1} MiB resident per session",
        cpu / (n as f64 * SECONDS) * 1e3,
        (rss - rss_before) / n as f64
    );
}

/// How a bench client speaks to the server.
#[derive(Clone, Copy, Debug)]
enum Transport {
    /// `/api/chat`: Ogg/Opus in Kyutai's binary messages.
    Kyutai,
    /// `/v1/realtime` with this input and output format (`pcm16`, `g711_ulaw`).
    Realtime(&'static str),
    /// `/twilio/media`: μ-law, 20 ms media messages.
    Twilio,
}

/// The tone of [`support::tone_message`] for frame `k`, as 24 kHz samples.
fn tone(k: usize) -> Vec<f32> {
    (0..1920)
        .map(|i| 0.3 * (((k * 1920 + i) as f32) * 0.06).sin())
        .collect()
}

/// μ-law at 8 kHz of 24 kHz samples (every third: the tone is far below 4 kHz).
fn mu_law(pcm: &[f32]) -> Vec<u8> {
    use duplex::audio::g711::{encode, Law};
    pcm.iter()
        .step_by(3)
        .map(|s| encode(Law::Mu, (s * 32767.0) as i16))
        .collect()
}

/// One client of `transport`: streams `seconds` of a tone in real time (80 ms messages; 20 ms
/// for Twilio, as it sends them; nothing when `quiet`), reads everything; returns the agent
/// audio messages received.
async fn client(port: u16, seconds: f64, transport: Transport, quiet: bool) -> usize {
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let path = match transport {
        Transport::Kyutai => "api/chat",
        Transport::Twilio => "twilio/media",
        Transport::Realtime(_) => "v1/realtime",
    };
    let (ws, _) = tokio_tungstenite::connect_async(format!("ws://127.0.0.1:{port}/{path}"))
        .await
        .unwrap();
    let (mut tx, mut rx) = ws.split();
    let reader = tokio::spawn(async move {
        let mut audio = 0;
        while let Some(Ok(m)) = rx.next().await {
            let delta = match m {
                Message::Binary(b) => b.first() == Some(&1),
                // GA or beta names (the session.update below is spelled beta), or Twilio's.
                Message::Text(t) => [
                    "\"response.output_audio.delta\"",
                    "\"response.audio.delta\"",
                    "\"event\":\"media\"",
                ]
                .iter()
                .any(|d| t.contains(d)),
                _ => false,
            };
            audio += usize::from(delta);
        }
        audio
    });
    let first = match transport {
        Transport::Kyutai => None,
        Transport::Realtime(format) => Some(serde_json::json!({
            "type": "session.update",
            "session": {"input_audio_format": format, "output_audio_format": format},
        })),
        Transport::Twilio => Some(serde_json::json!({
            "event": "start",
            "streamSid": "MZbench",
            "start": {
                "streamSid": "MZbench",
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000},
            },
        })),
    };
    if let Some(m) = first {
        let _ = tx.send(Message::Text(m.to_string().into())).await;
    }
    let mut w = OggOpusWriter::new(1, None).unwrap();
    let frames = (seconds / 0.08) as usize;
    let t0 = tokio::time::Instant::now();
    for k in 0..frames {
        let append = |audio: &[u8]| {
            let e = serde_json::json!({"type": "input_audio_buffer.append", "audio": b64(audio)});
            vec![Message::Text(e.to_string().into())]
        };
        let messages: Vec<Message> = match transport {
            _ if quiet => Vec::new(),
            Transport::Kyutai => vec![Message::Binary(support::tone_message(&mut w, k).into())],
            Transport::Realtime("pcm16") => {
                let bytes: Vec<u8> = tone(k)
                    .iter()
                    .flat_map(|s| ((s * 32767.0) as i16).to_le_bytes())
                    .collect();
                append(&bytes)
            }
            Transport::Realtime(_) => append(&mu_law(&tone(k))),
            Transport::Twilio => mu_law(&tone(k))
                .chunks(160)
                .map(|c| {
                    let e = serde_json::json!({
                        "event": "media",
                        "streamSid": "MZbench",
                        "media": {"payload": b64(c)},
                    });
                    Message::Text(e.to_string().into())
                })
                .collect(),
        };
        for m in messages {
            if tx.send(m).await.is_err() {
                break;
            }
        }
        tokio::time::sleep_until(t0 + Duration::from_secs_f64((k + 1) as f64 * 0.08)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = tx.send(Message::Close(None)).await;
    tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or(0)
}

/// The transports side by side: the same number of sessions over each, on one server of the
/// default template (tiny pack, shared engines), each run twice in turn.
fn transports(rt: &tokio::runtime::Runtime) {
    let server = start(&SETUPS[1]);
    let n = 6;
    println!(
        "\ntransports: {n} sessions each, {SECONDS} s, tiny pack on the shared engines (the default template)\n"
    );
    println!(
        "{:<24} {:>10} {:>10} {:>8} {:>14} {:>10}",
        "transport", "lat p50 ms", "lat p90 ms", "late", "outside models", "audio msgs"
    );
    let all = [
        ("/api/chat (Ogg/Opus)", Transport::Kyutai),
        ("/v1/realtime (pcm16)", Transport::Realtime("pcm16")),
        ("/v1/realtime (g711_ulaw)", Transport::Realtime("g711_ulaw")),
        ("/twilio/media (μ-law)", Transport::Twilio),
    ];
    std::thread::sleep(Duration::from_secs(1));
    for round in 0..2 {
        for (label, t) in all {
            let (m, got) = measure(&server, rt, n, t);
            let sess_s = n as f64 * (SECONDS - 0.3);
            println!(
                "{:<24} {:>10.1} {:>10.1} {:>8} {:>11.1} ms {:>10}{}",
                label,
                m.p50 * 1e3,
                m.p90 * 1e3,
                m.late,
                (m.cpu - m.model) / sess_s * 1e3,
                got.iter().sum::<usize>() / n,
                if round == 0 { "" } else { "  (second round)" }
            );
        }
    }
    println!(
        "(outside models: the server's CPU per session-second less the model stages' threads)"
    );
}

/// Calls raised at each level of the phone section.
const CALLS: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64];

/// A sipp scenario: a call that streams `wav` (μ-law RTP) for its length, then hangs up.
fn sipp_call(wav: &Path, seconds: f64) -> String {
    let ms = (seconds * 1000.0) as u64;
    format!(
        r#"<?xml version="1.0" encoding="ISO-8859-1" ?>
<scenario name="bench">
  <send retrans="500"><![CDATA[
INVITE sip:duplex@[remote_ip]:[remote_port] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:duplex@[remote_ip]:[remote_port]>
Call-ID: [call_id]
CSeq: 1 INVITE
Contact: sip:sipp@[local_ip]:[local_port]
Max-Forwards: 70
Content-Type: application/sdp
Content-Length: [len]

v=0
o=user1 1 1 IN IP[local_ip_type] [local_ip]
s=-
c=IN IP[media_ip_type] [media_ip]
t=0 0
m=audio [media_port] RTP/AVP 0
a=rtpmap:0 PCMU/8000
]]></send>
  <recv response="100" optional="true"/>
  <recv response="200" rrs="true"/>
  <send><![CDATA[
ACK sip:duplex@[remote_ip]:[remote_port] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:duplex@[remote_ip]:[remote_port]>[peer_tag_param]
Call-ID: [call_id]
CSeq: 1 ACK
Max-Forwards: 70
Content-Length: 0
]]></send>
  <nop><action><exec rtp_stream="{wav},1,0"/></action></nop>
  <pause milliseconds="{ms}"/>
  <send retrans="500"><![CDATA[
BYE sip:duplex@[remote_ip]:[remote_port] SIP/2.0
Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
From: sipp <sip:sipp@[local_ip]:[local_port]>;tag=[pid]SIPpTag00[call_number]
To: <sip:duplex@[remote_ip]:[remote_port]>[peer_tag_param]
Call-ID: [call_id]
CSeq: 2 BYE
Max-Forwards: 70
Content-Length: 0
]]></send>
  <recv response="200" crlf="true"/>
</scenario>
"#,
        wav = wav.display()
    )
}

/// `seconds` of the bench's tone as a μ-law WAV at 8 kHz (format 7), for sipp's RTP stream.
fn mu_law_wav(path: &Path, seconds: f64) {
    let frames = (seconds / 0.08).ceil() as usize;
    let data: Vec<u8> = (0..frames).flat_map(|k| mu_law(&tone(k))).collect();
    let mut w = Vec::new();
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    for v in [7u16, 1] {
        w.extend_from_slice(&v.to_le_bytes());
    }
    for v in [8000u32, 8000] {
        w.extend_from_slice(&v.to_le_bytes());
    }
    for v in [1u16, 8] {
        w.extend_from_slice(&v.to_le_bytes());
    }
    w.extend_from_slice(b"data");
    w.extend_from_slice(&(data.len() as u32).to_le_bytes());
    w.extend_from_slice(&data);
    std::fs::write(path, w).unwrap();
}

/// A UDP and TCP port free on loopback.
fn free_port() -> u16 {
    loop {
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = u.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Phone calls per core: concurrent calls over SIP and over Twilio's media stream, raised until
/// one falls behind, on one server of the default template (tiny pack, shared engines).
fn phone(rt: &tokio::runtime::Runtime) {
    let sip_port = free_port();
    let server = start_with(
        &SETUPS[1],
        64,
        &format!("sip:\n  enabled: true\n  address: \"127.0.0.1:{sip_port}\"\n  rtp_ports: \"\"\n"),
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("call.wav");
    mu_law_wav(&wav, SECONDS);
    let scenario = dir.path().join("call.xml");
    std::fs::write(&scenario, sipp_call(&wav, SECONDS)).unwrap();
    println!(
        "\nphone calls: G.711 at 8 kHz, {SECONDS} s each, tiny pack on the shared engines, {cores} cores\n"
    );
    println!(
        "{:<22} {:>6} {:>10} {:>10} {:>8} {:>8} {:>9} {:>13} {:>14}",
        "transport",
        "calls",
        "lat p50 ms",
        "lat p90 ms",
        "late",
        "dropped",
        "answered",
        "cpu/call/s",
        "outside models"
    );
    std::thread::sleep(Duration::from_secs(1));
    let mut kept = Vec::new();
    for transport in ["SIP (sipp, RTP)", "/twilio/media"] {
        let mut capacity = 0;
        for &n in CALLS {
            let answered0 = sum(
                &http_get(server.port, "/metrics"),
                "duplex_sip_requests_total{method=\"INVITE\",status=\"200\"}",
            );
            let (m, answered) = if transport.starts_with("SIP") {
                let (m, ok) = measured(&server, || {
                    std::process::Command::new("sipp")
                        .arg("-sf")
                        .arg(&scenario)
                        .args(["-m", &n.to_string(), "-l", &n.to_string(), "-r", "1000"])
                        .args(["-i", "127.0.0.1", "-p", &free_port().to_string()])
                        .args(["-mp", &free_port().to_string(), "-nostdin"])
                        .arg(format!("127.0.0.1:{sip_port}"))
                        .current_dir(dir.path())
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                });
                let answered = sum(
                    &http_get(server.port, "/metrics"),
                    "duplex_sip_requests_total{method=\"INVITE\",status=\"200\"}",
                ) - answered0;
                (m, if ok { answered as usize } else { 0 })
            } else {
                let (m, got) = measure(&server, rt, n, Transport::Twilio);
                let answered = got.iter().filter(|&&a| a > 0).count();
                (m, answered)
            };
            let call_s = n as f64 * (SECONDS - 0.3);
            println!(
                "{:<22} {:>6} {:>10.1} {:>10.1} {:>8} {:>8} {:>9} {:>10.1} ms {:>11.1} ms",
                transport,
                n,
                m.p50 * 1e3,
                m.p90 * 1e3,
                m.late,
                m.dropped,
                answered,
                m.cpu / call_s * 1e3,
                (m.cpu - m.model) / call_s * 1e3,
            );
            if m.late == 0.0 && m.dropped == 0.0 && answered == n {
                capacity = n;
            } else {
                break;
            }
            std::thread::sleep(Duration::from_secs(2));
        }
        kept.push((transport, capacity));
    }
    println!();
    for (transport, capacity) in kept {
        println!(
            "{transport}: keeps up with {capacity} concurrent calls ({:.1} per core; no frame later \
             than 160 ms in the server, none dropped, every call answered)",
            capacity as f64 / cores as f64
        );
    }
}
