//! `duplex eval run --server URL`: each input through a running `duplex serve`, in real time, as
//! one fresh session over the realtime API (`/v1/realtime`: PCM16 at 24 kHz both ways, nothing
//! lost to a codec; the server's turn detection off, so the agent's audio is the whole
//! conversation's, on the model's frame clock), and what the server says of that session
//! (`/api/sessions`, found by the id in `session.created`): input it dropped, silence it filled
//! in for audio that came late, frames it was late with, output it dropped. Any of them, or
//! agent frames missing at the end, flags the sample: its figures measure the server's load,
//! not only the model.
//!
//! The session starts at the first audio: one frame of silence asks for it, and the agent's
//! first frame answers that frame, so it is dropped: agent frame *k* then follows the user's
//! frames before *k*, as offline. Knows the wire and the session list, not the server's insides.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use super::bad;
use crate::app::loadtest::{webrtc::http, ws::connect, ws::pcm16_append as append};
use crate::audio::FRAME_SAMPLES;
use crate::config::ConfigError;

const FRAME: Duration = Duration::from_millis(80);

/// How long after the input's end the agent's last frames may take (frames).
const TAIL_FRAMES: usize = 25;
/// The agent's transcript kept at most per sample (bytes).
const MAX_TEXT: usize = 1 << 16;

/// The server: its realtime WebSocket and its session list.
pub(super) struct Server {
    ws: String,
    sessions: hyper::Uri,
    key: Option<String>,
}

impl Server {
    /// `url`: the server's (or its proxy's) `http://host:port`.
    pub(super) fn new(url: &str, key: Option<String>) -> Result<Self, ConfigError> {
        let base = url.trim_end_matches('/');
        let rest = base.strip_prefix("http://").ok_or_else(|| {
            bad(
                "--server",
                format!("{url}: not an http:// address (the server's own, or its proxy's)"),
            )
        })?;
        let sessions = format!("http://{rest}/api/sessions")
            .parse()
            .map_err(|e| bad("--server", format!("{url}: {e}")))?;
        Ok(Server {
            ws: format!("ws://{rest}/v1/realtime"),
            sessions,
            key,
        })
    }
}

/// What one input gave over the wire.
pub(super) struct Served {
    /// The agent at 24 kHz, its frame k after the user's frames before k.
    pub agent: Vec<f32>,
    /// What the agent said, from the transcript deltas.
    pub transcript: String,
    /// The user's frames sent.
    pub frames: usize,
    /// Why the sample's figures are not the model's alone, each in words (none: they are).
    pub flags: Vec<String>,
}

/// The session `id`'s entry in the server's session list.
async fn figures(server: &Server, id: u64) -> Option<Value> {
    let (status, _, body) = http(
        hyper::Method::GET,
        &server.sessions,
        String::new(),
        server.key.as_deref(),
    )
    .await
    .ok()?;
    if !status.is_success() {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    v["sessions"]
        .as_array()?
        .iter()
        .find(|s| s["id"].as_u64() == Some(id))
        .cloned()
}

fn count(v: &Option<Value>, key: &str) -> u64 {
    v.as_ref().and_then(|v| v[key].as_u64()).unwrap_or(0)
}

/// One conversation: `user` (24 kHz) to the server in real time, the agent back.
///
/// # Errors
///
/// The server refused the session, or it ended before it was ready (the message says how).
pub(super) async fn converse(
    server: &Server,
    user: &[f32],
    persona: Option<&str>,
    seed: u64,
) -> anyhow::Result<Served> {
    let (mut tx, mut rx) = connect(&server.ws, server.key.as_deref()).await?.split();
    let mut session = json!({
        "type": "realtime",
        "audio": {"input": {"turn_detection": null}},
        "duplex": {"text_seed": seed, "audio_seed": seed},
    });
    if let Some(p) = persona {
        session["instructions"] = p.into();
    }
    let update = json!({"type": "session.update", "session": session});
    tx.send(Message::Text(update.to_string().into())).await?;
    tx.send(append(&[0.0; FRAME_SAMPLES])).await?;
    let mut id: Option<u64> = None;
    let ready = async {
        while let Some(m) = rx.next().await {
            match m? {
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(&t).unwrap_or_default();
                    match v["type"].as_str().unwrap_or_default() {
                        "session.created" | "session.updated" => {
                            if let Some(n) = v["session"]["id"]
                                .as_str()
                                .and_then(|s| s.strip_prefix("sess_"))
                                .and_then(|n| n.parse().ok())
                            {
                                id = Some(n);
                            }
                        }
                        "response.created" => return Ok(()),
                        "error" => {
                            return Err(anyhow!(
                                "{}",
                                v["error"]["message"].as_str().unwrap_or("an error event")
                            ))
                        }
                        _ => {}
                    }
                }
                Message::Close(c) => {
                    return Err(anyhow!(
                        "closed ({})",
                        c.map_or("no reason".into(), |c| c.reason.to_string())
                    ))
                }
                _ => {}
            }
        }
        Err(anyhow!("closed before the session was ready"))
    };
    tokio::time::timeout(Duration::from_secs(120), ready)
        .await
        .map_err(|_| anyhow!("not ready within 120 s"))??;
    let before = match id {
        Some(i) => figures(server, i).await,
        None => None,
    };
    // The input in real time, then silence until the agent's answer to its last frame is in.
    let frames = user.len().div_ceil(FRAME_SAMPLES);
    let want = (frames + 1) * FRAME_SAMPLES;
    // What is kept of the agent: its audio up to the sample's length and tail (a server that
    // sends more gets no more memory), its transcript up to MAX_TEXT.
    let keep = (want + TAIL_FRAMES * FRAME_SAMPLES) * 2;
    let got = Arc::new(AtomicUsize::new(0));
    let reader = {
        let got = got.clone();
        tokio::spawn(async move {
            let (mut pcm, mut text) = (Vec::<u8>::new(), String::new());
            let mut cut = None;
            while let Some(m) = rx.next().await {
                let m = match m {
                    Ok(m) => m,
                    Err(e) => {
                        // A message over the client's limit, a broken stream: the session is
                        // cut off here, said in the sample's flags.
                        cut = Some(format!("the session was cut off: {e}"));
                        break;
                    }
                };
                let t = match m {
                    Message::Text(t) => t,
                    Message::Close(_) => break,
                    _ => continue,
                };
                let v: Value = serde_json::from_str(&t).unwrap_or_default();
                let delta = v["delta"].as_str().unwrap_or_default();
                match v["type"].as_str().unwrap_or_default() {
                    "response.output_audio.delta" | "response.audio.delta" => {
                        if pcm.len() < keep {
                            let b = base64::engine::general_purpose::STANDARD
                                .decode(delta)
                                .unwrap_or_default();
                            let room = keep - pcm.len();
                            pcm.extend_from_slice(&b[..b.len().min(room)]);
                        }
                        got.store(pcm.len() / 2, Ordering::Release);
                    }
                    "response.output_audio_transcript.delta"
                    | "response.audio_transcript.delta"
                        if text.len() + delta.len() <= MAX_TEXT =>
                    {
                        text.push_str(delta)
                    }
                    _ => {}
                }
            }
            (pcm, text, cut)
        })
    };
    let mut flags = Vec::new();
    let t0 = Instant::now();
    let mut k = 0usize;
    loop {
        let frame: Vec<f32> = (0..FRAME_SAMPLES)
            .map(|i| user.get(k * FRAME_SAMPLES + i).copied().unwrap_or(0.0))
            .collect();
        if tx.send(append(&frame)).await.is_err() {
            flags.push(format!(
                "the server closed the session at frame {k} of {frames}"
            ));
            break;
        }
        k += 1;
        tokio::time::sleep_until((t0 + FRAME * k as u32).into()).await;
        if k >= frames && (got.load(Ordering::Acquire) >= want || k >= frames + TAIL_FRAMES) {
            break;
        }
    }
    let after = match id {
        Some(i) => figures(server, i).await,
        None => None,
    };
    let _ = tx.send(Message::Close(None)).await;
    let abort = reader.abort_handle();
    let (pcm, transcript, cut) = match tokio::time::timeout(Duration::from_secs(10), reader).await {
        Ok(r) => r?,
        Err(_) => {
            // The reader is not left running (and reading) past its sample.
            abort.abort();
            return Err(anyhow!("the server did not close the session"));
        }
    };
    flags.extend(cut);
    if after.is_none() {
        flags.push("no figures for the session in the server's /api/sessions".into());
    }
    for (key, what) in [
        (
            "dropped_in",
            "input chunks dropped (the pipeline was not taking them)",
        ),
        (
            "silence_frames",
            "frames of silence filled in (the audio came late)",
        ),
        (
            "late_frames",
            "frames later than two frames' time in the server",
        ),
        ("dropped_out", "output messages dropped (not read in time)"),
    ] {
        let n = count(&after, key).saturating_sub(count(&before, key));
        if n > 0 {
            flags.push(format!("{n} {what}"));
        }
    }
    let samples: Vec<f32> = pcm
        .chunks_exact(2)
        .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0)
        .collect();
    if samples.len() < want {
        flags.push(format!(
            "{} agent frames missing at the end",
            (want - samples.len()).div_ceil(FRAME_SAMPLES)
        ));
    }
    Ok(Served {
        agent: samples.get(FRAME_SAMPLES..).unwrap_or_default().to_vec(),
        transcript,
        frames,
        flags,
    })
}

/// `input` (a WAV): its rate, its length and its samples at 24 kHz.
fn at_24k(input: &std::path::Path) -> anyhow::Result<(u32, usize, Vec<f32>)> {
    let mut r = crate::audio::WavReader::open(input)?;
    let (rate, x) = (r.rate(), r.read_all()?);
    let len = x.len();
    Ok((rate, len, super::resampled(x, rate, super::CODEC_RATE)?))
}

/// `duplex eval run --server`: every input of `found`, once per seed, through the server.
pub(super) fn run(
    a: &super::RunArgs,
    url: &str,
    found: &[super::Sample],
) -> anyhow::Result<String> {
    use anyhow::Context as _;
    let server = Server::new(url, a.key.clone())?;
    let label = a.label.clone().unwrap_or_else(|| "served".into());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the client's runtime")?;
    let lead_frames = usize::from(a.align == "moshi-client");
    let inputs: usize = found.iter().map(|s| s.inputs.len()).sum();
    let progress = super::Progress::new((inputs * a.seed.len()) as u64);
    let mut summary = String::new();
    for &seed in &a.seed {
        let root = a.out.join(&label).join(format!("seed-{seed}"));
        std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
        let (mut ran, mut skipped, mut refused) = (0, 0, 0);
        let mut flagged = serde_json::Map::new();
        for sample in found {
            let dir = root.join(&sample.rel);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            super::link_inputs(sample, &dir)?;
            for input in &sample.inputs {
                let pre = super::prefix(input);
                let name = format!("{}/{input}", sample.rel.display());
                if dir.join(format!("{pre}output.wav")).is_file() && !a.again {
                    skipped += 1;
                    progress.done(String::new);
                    continue;
                }
                let (rate, len, user) = at_24k(&sample.dir.join(input))?;
                let served = match rt.block_on(converse(&server, &user, a.persona.as_deref(), seed))
                {
                    Ok(s) => s,
                    Err(e) => {
                        refused += 1;
                        flagged.insert(name.clone(), json!([format!("refused: {e:#}")]));
                        progress.done(|| format!("{label} seed {seed} {name}: refused: {e:#}"));
                        continue;
                    }
                };
                let agent = super::resampled(served.agent, super::CODEC_RATE, rate)?;
                let lead = lead_frames * FRAME_SAMPLES * rate as usize / super::CODEC_RATE as usize;
                let out = super::aligned(&agent, lead, len);
                let partial = dir.join(format!(".{pre}output.wav.partial"));
                let mut w =
                    crate::audio::WavWriter::create(&partial, rate, crate::audio::WavFormat::I16)?;
                w.write(&out)?;
                w.finalize()?;
                let said = dir.join(format!("{pre}transcript.txt"));
                std::fs::write(&said, served.transcript.trim().to_string() + "\n")
                    .with_context(|| format!("writing {}", said.display()))?;
                std::fs::rename(&partial, dir.join(format!("{pre}output.wav")))?;
                if !served.flags.is_empty() {
                    flagged.insert(name.clone(), json!(served.flags));
                }
                ran += 1;
                progress.done(|| {
                    format!(
                        "{label} seed {seed} {name}: {} frames{}",
                        served.frames,
                        if served.flags.is_empty() {
                            String::new()
                        } else {
                            format!(", flagged: {}", served.flags.join("; "))
                        }
                    )
                });
            }
        }
        let record = json!({
            "command": "duplex eval run --server",
            "server": url,
            "protocol": "realtime (/v1/realtime, PCM16 at 24 kHz, turn detection off)",
            "inputs": a.inputs.display().to_string(),
            "samples": found.len(),
            "persona": a.persona,
            "seed": seed,
            "sampling": "the server's, with text_seed and audio_seed set to the seed",
            "align": a.align,
            "frame_ms": 80,
            "this_run": {"inputs_run": ran, "inputs_skipped_as_done": skipped, "refused": refused},
            "flagged": flagged,
        });
        let file = root.join("run.json");
        std::fs::write(&file, serde_json::to_string_pretty(&record)? + "\n")
            .with_context(|| format!("writing {}", file.display()))?;
        summary.push_str(&format!(
            "{label} seed {seed}: {ran} inputs run through {url} ({skipped} done before, {refused} refused), {} flagged -> {}\n",
            flagged.len(),
            root.display()
        ));
        for (name, why) in &flagged {
            summary.push_str(&format!("  flagged {name}: {why}\n"));
        }
        if ran == 0 && refused > 0 {
            return Err(anyhow!(
                "{summary}the server refused every input ({})",
                flagged
                    .values()
                    .next()
                    .map(|v| v.to_string())
                    .unwrap_or_default()
            ));
        }
    }
    Ok(summary)
}
