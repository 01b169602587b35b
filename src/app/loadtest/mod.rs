//! `duplex loadtest URL`: how many real-time conversations a running `duplex serve` keeps up
//! with, measured as its clients see it. N clients at once (a fixed level, or levels raised
//! until one falls behind), each streaming audio in real time (a WAV, or a speech-like tone)
//! over Kyutai's protocol (`/api/chat`, Ogg/Opus), the realtime API (`/v1/realtime`, PCM16)
//! ([`ws`]) or WebRTC (`/api/webrtc`, Opus over RTP, [`webrtc`]), from the moment its session
//! is ready.
//!
//! Per level: sessions admitted and refused; the latency of each agent frame as the client sees
//! it (its k-th 80 ms frame sent → the agent's k-th frame received: the model steps once per
//! frame); frames later than `late_ms`, and missing at the end; underruns of a simulated
//! client jitter buffer (playback starts `buffer_ms` after the first agent frame, one frame per
//! 80 ms). A level keeps up when every session was admitted and none had a late or missing
//! frame or an underrun. A session's first frame is reported on its own (`first_frame_ms`), and
//! neither it nor the last is counted as late: over Opus the codec's look-ahead makes the
//! first wait for the session's start and the last for the server's silence fill after the
//! client stops, which says nothing of the server's load. Knows nothing of the server's
//! insides: only the wire.

pub(crate) mod webrtc;
pub(crate) mod ws;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::config::{ConfigError, ConfigErrorKind};

/// One model frame.
const FRAME: Duration = Duration::from_millis(80);

/// The protocol the clients speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// Kyutai's (`/api/chat`): Ogg/Opus in binary messages.
    Kyutai,
    /// The OpenAI realtime API (`/v1/realtime`): PCM16 in base64 JSON events.
    Realtime,
    /// WebRTC (`/api/webrtc`): an SDP offer over HTTP, then Opus over RTP in 20 ms packets.
    #[value(name = "webrtc")]
    WebRtc,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Protocol::Kyutai => "kyutai",
            Protocol::Realtime => "realtime",
            Protocol::WebRtc => "webrtc",
        }
    }
}

/// `duplex loadtest`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadtestArgs {
    /// The server (or its proxy): `http://host:port` or `ws://host:port`, the endpoint following
    /// `--protocol`.
    pub url: String,
    /// The protocol the clients speak.
    #[arg(long, value_enum, default_value = "kyutai")]
    pub protocol: Protocol,
    /// One level of this many sessions (instead of raising the level).
    #[arg(long, conflicts_with = "levels")]
    pub sessions: Option<usize>,
    /// The levels tried, in order, until one falls behind.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,6,8,12,16,24,32")]
    pub levels: Vec<usize>,
    /// Seconds each client streams.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// A WAV (24 kHz mono 16-bit) each client streams, looped (default: a speech-like tone).
    #[arg(long)]
    pub wav: Option<PathBuf>,
    /// The API key (sent as `Authorization: Bearer`).
    #[arg(long)]
    pub key: Option<String>,
    /// An agent frame later than this (after its user frame was sent) counts as late.
    #[arg(long, default_value_t = 160)]
    pub late_ms: u64,
    /// The simulated client's jitter buffer.
    #[arg(long, default_value_t = 160)]
    pub buffer_ms: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What one client saw.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// The session was refused (or the connection failed), and why.
    refused: Option<String>,
    /// Per agent frame, its latency.
    latencies: Vec<Duration>,
    /// Frames expected and not received.
    missing: usize,
    /// Frames that came after the simulated player needed them.
    underruns: usize,
}

/// One level's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Level {
    /// Sessions started at once.
    pub sessions: usize,
    /// Sessions the server admitted and served.
    pub admitted: usize,
    /// Sessions refused (or whose connection failed), with the first reason.
    pub refused: usize,
    /// Why the first refused one was.
    pub refusal: Option<String>,
    /// Latency of the agent frames as the clients saw them, milliseconds.
    pub latency_ms: Quantiles,
    /// Latency of the sessions' first agent frames, milliseconds.
    pub first_frame_ms: Quantiles,
    /// Frames later than `late_ms`.
    pub late: usize,
    /// Frames that never came.
    pub missing: usize,
    /// Underruns of the simulated jitter buffers.
    pub underruns: usize,
    /// Whether the server kept up at this level.
    pub keeps_up: bool,
}

/// Quantiles of a set of durations, milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// The largest.
    pub max: f64,
}

impl Quantiles {
    fn of(mut v: Vec<Duration>) -> Self {
        if v.is_empty() {
            return Quantiles::default();
        }
        v.sort();
        let at = |q: f64| {
            let i = ((v.len() - 1) as f64 * q).round() as usize;
            v[i].as_secs_f64() * 1e3
        };
        Quantiles {
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

/// The whole report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The endpoint.
    pub url: String,
    /// `kyutai`, `realtime` or `webrtc`.
    pub protocol: &'static str,
    /// Seconds per client.
    pub seconds: f64,
    /// The levels run, in order.
    pub levels: Vec<Level>,
    /// The highest level that kept up (0: none).
    pub keeps_up_with: usize,
}

impl Report {
    /// Why no session was admitted at any level (the first refusal), when none was: the
    /// server is not there, or refuses every client (a key, an origin).
    pub fn none_admitted(&self) -> Option<&str> {
        if self.levels.iter().any(|l| l.admitted > 0) {
            return None;
        }
        self.levels.iter().find_map(|l| l.refusal.as_deref())
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} ({}), {} s per client\n",
            self.url, self.protocol, self.seconds
        )?;
        writeln!(
            f,
            "{:>8} {:>8} {:>8} {:>10} {:>10} {:>10} {:>12} {:>6} {:>8} {:>9}",
            "sessions",
            "admitted",
            "refused",
            "p50 ms",
            "p90 ms",
            "max ms",
            "1st max ms",
            "late",
            "missing",
            "underruns"
        )?;
        for l in &self.levels {
            writeln!(
                f,
                "{:>8} {:>8} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>12.1} {:>6} {:>8} {:>9}{}",
                l.sessions,
                l.admitted,
                l.refused,
                l.latency_ms.p50,
                l.latency_ms.p90,
                l.latency_ms.max,
                l.first_frame_ms.max,
                l.late,
                l.missing,
                l.underruns,
                l.refusal
                    .as_ref()
                    .map(|r| format!("  (refused: {r})"))
                    .unwrap_or_default()
            )?;
        }
        writeln!(
            f,
            "\nthis server keeps up with {} concurrent real-time sessions",
            self.keeps_up_with
        )
    }
}

/// A refusal of the arguments, before anything is sent (exit code 2).
fn bad(what: &str, kind: ConfigErrorKind, message: String) -> anyhow::Error {
    ConfigError::new(what, kind, message).into()
}

/// The audio the clients stream: 24 kHz samples, looped.
fn audio(args: &LoadtestArgs) -> anyhow::Result<Vec<f32>> {
    if let Some(path) = &args.wav {
        let file = path.display().to_string();
        let mut r = crate::audio::WavReader::open(path)
            .map_err(|e| bad(&file, ConfigErrorKind::Read, e.to_string()))?;
        let (rate, channels) = (r.rate(), r.channels());
        if rate != crate::audio::MODEL_RATE || channels != 1 {
            let m = format!(
                "{rate} Hz, {channels} channel(s); loadtest streams 24 kHz mono (convert it first)"
            );
            return Err(bad(&file, ConfigErrorKind::WrongType, m));
        }
        let pcm = r
            .read_all()
            .map_err(|e| bad(&file, ConfigErrorKind::Read, e.to_string()))?;
        if pcm.is_empty() {
            return Err(bad(&file, ConfigErrorKind::Missing, "no samples".into()));
        }
        return Ok(pcm);
    }
    // A tone with a syllable-rate envelope.
    Ok((0..crate::audio::MODEL_RATE as usize * 4)
        .map(|i| {
            let t = i as f32 / crate::audio::MODEL_RATE as f32;
            let env = 0.5 + 0.5 * (std::f32::consts::TAU * 3.0 * t).sin();
            0.3 * env * (std::f32::consts::TAU * 180.0 * t).sin()
        })
        .collect())
}

/// The endpoint's URL for `protocol`.
fn endpoint(url: &str, protocol: Protocol) -> anyhow::Result<String> {
    let base = url.trim_end_matches('/');
    let (plain, secure) = match protocol {
        Protocol::Kyutai | Protocol::Realtime => ("ws", "wss"),
        // The offer is an HTTP request.
        Protocol::WebRtc => ("http", "https"),
    };
    let rest = ["http://", "ws://"]
        .iter()
        .find_map(|s| base.strip_prefix(s))
        .map(|r| (plain, r))
        .or_else(|| {
            ["https://", "wss://"]
                .iter()
                .find_map(|s| base.strip_prefix(s))
                .map(|r| (secure, r))
        });
    let Some((scheme, rest)) = rest else {
        let m = format!("{url}: not a ws://, wss://, http:// or https:// address");
        return Err(bad("URL", ConfigErrorKind::WrongType, m));
    };
    if scheme == "https" {
        let m = format!(
            "{url}: the WebRTC client offers over plain HTTP only (run it against the \
             server's or the proxy's http:// address)"
        );
        return Err(bad("URL", ConfigErrorKind::WrongType, m));
    }
    let base = format!("{scheme}://{rest}");
    // A full endpoint is taken as given.
    if ["/api/chat", "/v1/realtime", "/api/webrtc"]
        .iter()
        .any(|e| base.ends_with(e))
    {
        return Ok(base);
    }
    Ok(match protocol {
        Protocol::Kyutai => format!("{base}/api/chat"),
        Protocol::Realtime => format!("{base}/v1/realtime"),
        Protocol::WebRtc => format!("{base}/api/webrtc"),
    })
}

impl Level {
    /// The level of `n` sessions from what its clients saw: a frame later than `late_after`
    /// (but the first and the last) is late; whether it kept up is for the caller to say.
    fn of(n: usize, seen: &[Seen], late_after: Duration) -> Level {
        let served: Vec<&Seen> = seen.iter().filter(|s| s.refused.is_none()).collect();
        Level {
            sessions: n,
            admitted: served.len(),
            refused: n - served.len(),
            refusal: seen.iter().find_map(|s| s.refused.clone()),
            latency_ms: Quantiles::of(
                served
                    .iter()
                    .flat_map(|s| s.latencies.iter().copied())
                    .collect(),
            ),
            first_frame_ms: Quantiles::of(
                served
                    .iter()
                    .filter_map(|s| s.latencies.first().copied())
                    .collect(),
            ),
            late: served
                .iter()
                .map(|s| {
                    let inner = s.latencies.len().saturating_sub(1);
                    s.latencies[..inner]
                        .iter()
                        .skip(1)
                        .filter(|l| **l > late_after)
                        .count()
                })
                .sum(),
            missing: served.iter().map(|s| s.missing).sum(),
            underruns: served.iter().map(|s| s.underruns).sum(),
            keeps_up: false,
        }
    }
}

/// Runs the load test.
///
/// # Errors
///
/// A bad address or WAV (before anything is sent).
pub fn run(args: &LoadtestArgs) -> anyhow::Result<Report> {
    let url = endpoint(&args.url, args.protocol)?;
    if let Some(k) = &args.key {
        if axum::http::HeaderValue::from_str(&format!("Bearer {k}")).is_err() {
            let m = "not a header value (a line break or a control character in it)".into();
            return Err(bad("--key", ConfigErrorKind::WrongType, m));
        }
    }
    if !(1.0..=3600.0).contains(&args.seconds) {
        let m = format!("{}: from 1 to 3600", args.seconds);
        return Err(bad("--seconds", ConfigErrorKind::OutOfRange, m));
    }
    let pcm = std::sync::Arc::new(audio(args)?);
    let levels = match args.sessions {
        Some(n) => vec![n],
        None => args.levels.clone(),
    };
    if !levels.iter().all(|&n| (1..=10_000).contains(&n)) {
        let m = "from 1 to 10000 sessions".to_string();
        return Err(bad("--sessions/--levels", ConfigErrorKind::OutOfRange, m));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut report = Report {
        url: url.clone(),
        protocol: args.protocol.name(),
        seconds: args.seconds,
        levels: Vec::new(),
        keeps_up_with: 0,
    };
    for n in levels {
        let seen: Vec<Seen> = rt.block_on(async {
            let tasks: Vec<_> = (0..n)
                .map(|_| {
                    let (url, pcm, args) = (url.clone(), pcm.clone(), args.clone());
                    tokio::spawn(async move { client(&url, &pcm, &args).await })
                })
                .collect();
            let mut v = Vec::new();
            for t in tasks {
                v.push(t.await.unwrap_or_else(|e| Seen {
                    refused: Some(format!("the client failed: {e}")),
                    ..Seen::default()
                }));
            }
            v
        });
        let level = Level::of(n, &seen, Duration::from_millis(args.late_ms));
        let keeps_up =
            level.refused == 0 && level.late == 0 && level.missing == 0 && level.underruns == 0;
        let level = Level { keeps_up, ..level };
        if !args.json {
            tracing::info!(
                sessions = n,
                keeps_up,
                p50_ms = level.latency_ms.p50,
                late = level.late,
                "level done"
            );
        }
        report.levels.push(level);
        if !keeps_up {
            break;
        }
        report.keeps_up_with = n;
        // The server's sessions end (and free their slots) before the next level.
        std::thread::sleep(Duration::from_secs(1));
    }
    Ok(report)
}

/// One client: connects, waits for its session to be ready, streams `seconds` of `pcm` in real
/// time, and times the agent's frames as they come.
async fn client(url: &str, pcm: &[f32], args: &LoadtestArgs) -> Seen {
    let talked = match args.protocol {
        Protocol::Kyutai => ws::talk(url, ws::Wire::Kyutai, pcm, args).await,
        Protocol::Realtime => ws::talk(url, ws::Wire::Realtime, pcm, args).await,
        Protocol::WebRtc => webrtc::talk(url, pcm, args).await,
    };
    match talked {
        Ok(s) => s,
        Err(e) => Seen {
            refused: Some(format!("{e:#}")),
            ..Seen::default()
        },
    }
}

impl LoadtestArgs {
    /// The model frames each client streams.
    fn frames(&self) -> usize {
        (self.seconds / FRAME.as_secs_f64()) as usize
    }

    /// How long a client waits for the agent's last frames after its own.
    fn tail(&self) -> Duration {
        Duration::from_millis(self.late_ms.max(500))
    }
}

/// The `k`-th chunk of `len` samples a client streams from `pcm` (looped; the last chunk of
/// each pass padded with silence).
fn chunk(pcm: &[f32], k: usize, len: usize) -> Vec<f32> {
    let at = (k * len) % pcm.len();
    let mut c: Vec<f32> = pcm[at..].iter().take(len).copied().collect();
    c.resize(len, 0.0);
    c
}

/// What a client saw, from when the agent's frames arrived: frame k was sent at t0 + k · 80 ms.
fn seen(arrivals: &[Instant], t0: Instant, frames: usize, buffer_ms: u64) -> Seen {
    let latencies: Vec<Duration> = arrivals
        .iter()
        .take(frames)
        .enumerate()
        .map(|(k, at)| at.saturating_duration_since(t0 + FRAME * k as u32))
        .collect();
    // Playback from the first agent frame plus the buffer, one frame per 80 ms.
    let underruns = match arrivals.first() {
        Some(first) => {
            let start = *first + Duration::from_millis(buffer_ms);
            // The last frame waits for the server's silence fill (see the module's doc).
            arrivals
                .iter()
                .take(frames.saturating_sub(1))
                .enumerate()
                .filter(|(k, at)| **at > start + FRAME * *k as u32)
                .count()
        }
        None => 0,
    };
    Seen {
        refused: None,
        missing: frames.saturating_sub(latencies.len()),
        latencies,
        underruns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_the_protocol_and_refuse_other_schemes() {
        assert_eq!(
            endpoint("http://h:1", Protocol::Kyutai).unwrap(),
            "ws://h:1/api/chat"
        );
        assert_eq!(
            endpoint("ws://h:1/", Protocol::Realtime).unwrap(),
            "ws://h:1/v1/realtime"
        );
        assert_eq!(
            endpoint("https://h/api/chat", Protocol::Realtime).unwrap(),
            "wss://h/api/chat"
        );
        assert_eq!(
            endpoint("ws://h:1", Protocol::WebRtc).unwrap(),
            "http://h:1/api/webrtc"
        );
        assert_eq!(
            endpoint("http://proxy/replica/a/api/webrtc/", Protocol::WebRtc).unwrap(),
            "http://proxy/replica/a/api/webrtc"
        );
        assert!(endpoint("https://h", Protocol::WebRtc).is_err());
        assert!(endpoint("h:1", Protocol::Kyutai).is_err());
    }

    #[test]
    fn the_table_has_a_heading_over_every_column() {
        let q = Quantiles {
            p50: 90.0,
            p90: 100.0,
            p99: 110.0,
            max: 120.0,
        };
        let level = Level {
            sessions: 4,
            admitted: 4,
            refused: 0,
            refusal: None,
            latency_ms: q.clone(),
            first_frame_ms: q,
            late: 1,
            missing: 2,
            underruns: 3,
            keeps_up: false,
        };
        let r = Report {
            url: "ws://h:1/api/chat".into(),
            protocol: "kyutai",
            seconds: 8.0,
            levels: vec![level],
            keeps_up_with: 2,
        };
        let text = r.to_string();
        let lines: Vec<&str> = text.lines().collect();
        let (head, row) = (lines[2], lines[3]);
        // Right-aligned columns: each column's figures end where a heading ends, and the last
        // heading is over the last column.
        let ends = |l: &str| -> Vec<usize> {
            let b = l.as_bytes();
            (0..b.len())
                .filter(|&i| b[i] != b' ' && (i + 1 == b.len() || b[i + 1] == b' '))
                .collect()
        };
        let heads = ends(head);
        assert!(
            ends(row).iter().all(|e| heads.contains(e)) && head.len() == row.len(),
            "\n{head}\n{row}"
        );
        assert!(text.ends_with("keeps up with 2 concurrent real-time sessions\n"));
    }
}
