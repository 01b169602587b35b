//! The load test's WebSocket clients: Kyutai's protocol (`/api/chat`, Ogg/Opus in binary
//! messages, the handshake byte before the audio) and the realtime API (`/v1/realtime`, PCM16
//! in base64 JSON events, ready at `response.created`). Each counts the agent's audio as it
//! comes (Ogg pages by their granule positions, nothing decoded; realtime deltas by their
//! length). Knows nothing of the server's insides: only the wire.

use anyhow::anyhow;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

use super::{chunk, seen, LoadtestArgs, Seen, FRAME};
use crate::audio::opus::OggOpusWriter;
use crate::audio::FRAME_SAMPLES;

/// The WebSocket protocol a client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wire {
    /// Kyutai's (`/api/chat`).
    Kyutai,
    /// The realtime API (`/v1/realtime`).
    Realtime,
}

type WsError = tokio_tungstenite::tungstenite::Error;

pub(super) async fn talk(
    url: &str,
    protocol: Wire,
    pcm: &[f32],
    args: &LoadtestArgs,
) -> anyhow::Result<Seen> {
    let (mut tx, mut rx) = connect(url, args.key.as_deref()).await?.split();
    if protocol == Wire::Realtime {
        let update = serde_json::json!({
            "type": "session.update",
            "session": {"type": "realtime"},
        });
        tx.send(Message::Text(update.to_string().into())).await?;
        // The session starts at the first audio: one frame of silence asks for it.
        let silence =
            base64::engine::general_purpose::STANDARD.encode(vec![0u8; 2 * FRAME_SAMPLES]);
        let append = serde_json::json!({"type": "input_audio_buffer.append", "audio": silence});
        tx.send(Message::Text(append.to_string().into())).await?;
    }
    tokio::time::timeout(Duration::from_secs(120), ready(&mut rx, protocol))
        .await
        .map_err(|_| anyhow!("not ready within 120 s"))??;
    let frames = args.frames();
    let t0 = Instant::now();
    let reader = tokio::spawn(arrivals(rx, protocol));
    let mut w = OggOpusWriter::new(1, None)?;
    for k in 0..frames {
        let frame = chunk(pcm, k, FRAME_SAMPLES);
        if tx
            .send(frame_message(&mut w, protocol, &frame)?)
            .await
            .is_err()
        {
            break;
        }
        tokio::time::sleep_until((t0 + FRAME * (k as u32 + 1)).into()).await;
    }
    // The last frames' answers, then the end.
    tokio::time::sleep(args.tail()).await;
    let _ = tx.send(Message::Close(None)).await;
    let arrivals = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .map_err(|_| anyhow!("the server did not close"))??;
    // Frame k was sent at t0 + k · 80 ms; the agent's k-th frame answers it (after the frame
    // of silence that started a realtime session).
    let skip = usize::from(protocol == Wire::Realtime);
    let arrivals: Vec<Instant> = arrivals.into_iter().skip(skip).collect();
    Ok(seen(&arrivals, t0, frames, args.buffer_ms))
}

/// The WebSocket to the server, with the key when there is one.
/// The largest message the clients take (an 80 ms frame's delta is about 5 KB).
pub(crate) const MAX_MESSAGE: usize = 1 << 20;

pub(crate) async fn connect(
    url: &str,
    key: Option<&str>,
) -> anyhow::Result<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = url
        .into_client_request()
        .map_err(|e| anyhow!("{url}: {e}"))?;
    if let Some(k) = key {
        let v = format!("Bearer {k}")
            .parse()
            .map_err(|_| anyhow!("the key is not a header value"))?;
        req.headers_mut().insert("authorization", v);
    }
    // A server that sends messages larger than any this protocol has is cut off, not
    // buffered.
    let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_MESSAGE));
    let (ws, _) = tokio::time::timeout(
        Duration::from_secs(30),
        tokio_tungstenite::connect_async_with_config(req, Some(config), false),
    )
    .await
    .map_err(|_| anyhow!("no answer within 30 s"))?
    .map_err(|e| match e {
        WsError::Http(r) => {
            let body = r
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).trim().to_string())
                .unwrap_or_default();
            anyhow!("HTTP {}: {body}", r.status())
        }
        e => anyhow!(e),
    })?;
    Ok(ws)
}

/// Until the session is ready: Kyutai's handshake, the realtime API's response.created.
async fn ready<S>(rx: &mut S, protocol: Wire) -> anyhow::Result<()>
where
    S: futures_util::Stream<Item = Result<Message, WsError>> + Unpin,
{
    while let Some(m) = rx.next().await {
        match m? {
            Message::Binary(b) if protocol == Wire::Kyutai => match b.first() {
                Some(0) => return Ok(()),
                Some(5) => return Err(anyhow!("{}", String::from_utf8_lossy(&b[1..]))),
                _ => {}
            },
            Message::Text(t) if protocol == Wire::Realtime => {
                let v: serde_json::Value = serde_json::from_str(&t).unwrap_or_default();
                match v["type"].as_str() {
                    Some("response.created") => return Ok(()),
                    Some("error") => {
                        return Err(anyhow!(
                            "{}",
                            v["error"]["message"].as_str().unwrap_or("error")
                        ))
                    }
                    _ => {}
                }
            }
            Message::Close(c) => {
                return Err(anyhow!(
                    "{}",
                    c.map_or("closed".into(), |c| c.reason.to_string())
                ));
            }
            _ => {}
        }
    }
    Err(anyhow!("closed before the session was ready"))
}

/// The agent's frames as they come: when each 80 ms of audio (at 24 kHz) arrived, in order.
async fn arrivals<S>(mut rx: S, protocol: Wire) -> Vec<Instant>
where
    S: futures_util::Stream<Item = Result<Message, WsError>> + Unpin,
{
    let mut arrivals: Vec<Instant> = Vec::new();
    let mut samples = 0usize;
    let mut ogg = OggClock::default();
    while let Some(Ok(m)) = rx.next().await {
        let got = match (protocol, m) {
            // Ogg pages: the last granule position is the stream's length at 48 kHz.
            (Wire::Kyutai, Message::Binary(b)) if b.first() == Some(&1) => ogg.samples(&b[1..]),
            (Wire::Realtime, Message::Text(t)) => {
                let v: serde_json::Value = serde_json::from_str(&t).unwrap_or_default();
                let kind = v["type"].as_str().unwrap_or_default();
                if kind == "response.output_audio.delta" || kind == "response.audio.delta" {
                    let bytes = base64::engine::general_purpose::STANDARD
                        .decode(v["delta"].as_str().unwrap_or_default())
                        .unwrap_or_default();
                    Some(samples + bytes.len() / 2)
                } else {
                    None
                }
            }
            (_, Message::Close(_)) => break,
            _ => None,
        };
        if let Some(total) = got {
            samples = samples.max(total);
            let now = Instant::now();
            while arrivals.len() < samples / FRAME_SAMPLES {
                arrivals.push(now);
            }
        }
    }
    arrivals
}

/// One frame of the user's audio as the protocol sends it.
fn frame_message(w: &mut OggOpusWriter, protocol: Wire, frame: &[f32]) -> anyhow::Result<Message> {
    Ok(match protocol {
        Wire::Kyutai => {
            let mut b = vec![1u8];
            for p in w.push(frame)? {
                b.extend_from_slice(&p);
            }
            Message::Binary(b.into())
        }
        Wire::Realtime => pcm16_append(frame),
    })
}

/// Samples (in [-1, 1]) as the realtime API's `input_audio_buffer.append` (PCM16, base64).
pub(crate) fn pcm16_append(frame: &[f32]) -> Message {
    let bytes: Vec<u8> = frame
        .iter()
        .flat_map(|s| ((s.clamp(-1.0, 1.0) * 32767.0).round() as i16).to_le_bytes())
        .collect();
    let audio = base64::engine::general_purpose::STANDARD.encode(bytes);
    let e = serde_json::json!({"type": "input_audio_buffer.append", "audio": audio});
    Message::Text(e.to_string().into())
}

/// How much of an Ogg/Opus stream has come, from its pages' headers alone (nothing decoded):
/// the granule position of the last page, less the stream's pre-skip (from `OpusHead`).
#[derive(Default)]
struct OggClock {
    pre_skip: u64,
}

impl OggClock {
    /// Samples at 24 kHz the stream holds once `bytes` (whole pages, as the server sends them)
    /// have come; `None` when no page of them ends audio.
    fn samples(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut at = 0;
        let mut last = None;
        while at + 27 <= bytes.len() && &bytes[at..at + 4] == b"OggS" {
            let granule = u64::from_le_bytes(bytes[at + 6..at + 14].try_into().ok()?);
            let segments = bytes[at + 26] as usize;
            let table = bytes.get(at + 27..at + 27 + segments)?;
            let len: usize = table.iter().map(|&s| s as usize).sum();
            let body = bytes.get(at + 27 + segments..at + 27 + segments + len)?;
            if body.starts_with(b"OpusHead") && body.len() >= 12 {
                self.pre_skip = u16::from_le_bytes([body[10], body[11]]) as u64;
            } else if granule != u64::MAX && granule > 0 {
                last = Some(granule);
            }
            at += 27 + segments + len;
        }
        // Opus granules count at 48 kHz.
        last.map(|g| (g.saturating_sub(self.pre_skip) / 2) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ogg_clock_counts_the_samples_sent_without_decoding() {
        let mut w = OggOpusWriter::new(3, None).unwrap();
        let mut clock = OggClock::default();
        assert_eq!(clock.samples(&w.headers().unwrap().concat()), None);
        let mut last = None;
        for _ in 0..3 {
            last = clock
                .samples(&w.push(&vec![0.0; FRAME_SAMPLES]).unwrap().concat())
                .or(last);
        }
        // 3 frames of 80 ms in 40 ms pages: 5760 samples at 24 kHz, the pre-skip taken off.
        assert_eq!(last, Some(3 * FRAME_SAMPLES));
    }
}
