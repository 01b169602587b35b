//! The telephony providers' media streams: Twilio (`/twilio/media`), Telnyx
//! (`/telnyx/media`), Plivo (`/plivo/media`), Vonage (`/vonage/media`) and Exotel
//! (`/exotel/media`). Each provider's
//! framing is a [`Dialect`] (its file: which events open, carry and end a call, how audio and
//! marks go back, and how the provider proves the call is its own); the call itself is one
//! [`MediaStream`], the same for all: a session of the template with PCM ends, started at the
//! provider's start event, its audio paid for from its encoded size before it is decoded
//! (G.711 at 8 kHz or 16-bit linear PCM at the call's rate, both ways), the agent's audio sent
//! in the call's format with a mark about every second, and the provider's buffer cleared when
//! the audio sent and not yet played (by the marks it echoed) passes [`CLEAR_AFTER`] frames.
//! DTMF keys are in the session's status. Knows the session only through [`Protocol`].

pub(crate) mod exotel;
pub(crate) mod plivo;
pub(crate) mod telnyx;
pub(crate) mod twilio;
pub(crate) mod vonage;

use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;
use base64::Engine as _;
use serde_json::{json, Value};

use super::config::{ServeConfig, SessionParams};
use super::session::{base64_len, Encoder, Protocol, Taken, TransportStats};
use crate::audio::phone::{Coding, PhoneIn, PhoneOut};
use crate::session::Outbound;

/// Agent frames (80 ms) between two marks: about a second.
const MARK_EVERY: u64 = 12;
/// Agent frames sent and not played (by the echoed marks) past which the buffer is cleared.
pub(crate) const CLEAR_AFTER: u64 = 40;
/// DTMF keys kept for the session's status.
const MAX_KEYS: usize = 64;
/// How often a call's keys are logged at most.
const KEYS_LOGGED_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// A call's audio on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wire {
    pub coding: Coding,
    pub rate: u32,
}

impl Wire {
    /// Bytes of a second of it.
    fn bytes_per_second(&self) -> u64 {
        u64::from(self.rate) * self.coding.bytes_per_sample() as u64
    }
}

/// What a provider's message means for the call.
pub(crate) enum Event {
    /// The call starts: its id, its audio (or why it cannot be taken), its params.
    Start {
        id: String,
        wire: Result<Wire, String>,
        params: Vec<(String, String)>,
    },
    /// The caller's audio, base64.
    Media(String),
    /// A mark of ours, played.
    Played(String),
    /// A key pressed: one of `0-9 * # A-D` (`None`: the digit was something else).
    Dtmf(Option<char>),
    /// The call has ended.
    Stop,
    /// Nothing for the session (a `connected`, an outbound track, an acknowledgement).
    Ignore,
    /// Not a message of the provider's.
    Unknown,
}

/// A provider's framing.
pub(crate) trait Dialect: Send + Sync + 'static {
    /// The provider's name, for the log.
    const NAME: &'static str;
    /// Whether the audio travels in binary messages (Vonage) rather than base64 in JSON.
    const BINARY: bool = false;
    /// Bytes the agent's audio goes in multiples of (Exotel's 320), `1` for any.
    const CHUNK: usize = 1;

    /// The field that carries the call's id in what the server sends (Twilio's `streamSid`,
    /// Exotel's `stream_sid`), `None` where none is sent.
    const ID: Option<&'static str> = None;

    /// What a JSON message of the provider's means.
    fn read(&self, v: &Value) -> Event;

    /// A message of the agent's audio (base64 `payload`) for call `id` in `wire`; by default
    /// Twilio's `media` event.
    fn media(&self, id: &str, _wire: &Wire, payload: String) -> Value {
        with_id::<Self>(json!({"event": "media", "media": {"payload": payload}}), id)
    }

    /// A mark named `name`, echoed by the provider once what was sent before it has played;
    /// by default Twilio's `mark` event.
    fn mark(&self, id: &str, name: &str) -> Value {
        with_id::<Self>(json!({"event": "mark", "mark": {"name": name}}), id)
    }

    /// What drops the audio the provider holds; by default Twilio's `clear` event.
    fn clear(&self, id: &str) -> Value {
        with_id::<Self>(json!({"event": "clear"}), id)
    }
}

/// `v` with the call's id in the dialect's [`ID`](Dialect::ID) field.
fn with_id<D: Dialect + ?Sized>(mut v: Value, id: &str) -> Value {
    if let (Some(field), Some(o)) = (D::ID, v.as_object_mut()) {
        o.insert(field.to_string(), Value::String(id.to_string()));
    }
    v
}

/// What the encoder shares with the protocol.
#[derive(Default)]
struct Call {
    id: String,
    wire: Option<Wire>,
    /// Agent frames sent.
    sent: u64,
    /// Agent frames played, by the last mark echoed.
    played: u64,
    /// Marks echoed.
    echoed: u64,
    keys: String,
    /// Keys pressed since the last line logged, and when that was.
    unlogged: usize,
    logged: Option<std::time::Instant>,
}

/// One provider call's side of its session.
pub(crate) struct MediaStream<D: Dialect> {
    dialect: Arc<D>,
    call: Arc<Mutex<Call>>,
    phone: Option<PhoneIn>,
    pairs: Vec<(String, String)>,
    start: bool,
}

impl<D: Dialect> MediaStream<D> {
    pub(crate) fn new(dialect: D) -> Self {
        MediaStream {
            dialect: Arc::new(dialect),
            call: Arc::new(Mutex::new(Call::default())),
            phone: None,
            pairs: Vec::new(),
            start: false,
        }
    }

    fn bad(cx: &mut Taken<'_>, what: &'static str, detail: &str) {
        cx.protocol_error("unknown_kind");
        if cx.first(what) {
            tracing::info!(
                session = cx.id,
                "ignored a {} message: {detail} (logged once per session)",
                D::NAME
            );
        }
    }

    /// Audio before the call's start: dropped undecoded (there is no session to hear it yet),
    /// counted, logged once.
    fn early(cx: &mut Taken<'_>) {
        cx.protocol_error("early_audio");
        if cx.first("early") {
            tracing::info!(
                session = cx.id,
                "dropped {} audio before the call's start, undecoded (logged once per session)",
                D::NAME
            );
        }
    }

    /// The caller's audio, `bytes` on the wire.
    fn audio(&mut self, bytes: &[u8], cx: &mut Taken<'_>) {
        if !self.start {
            return Self::early(cx);
        }
        let Some(phone) = self.phone.as_mut() else {
            return;
        };
        match phone.pcm16(bytes) {
            Ok(pcm) if !pcm.is_empty() => cx.offer(pcm),
            Ok(_) => {}
            Err(e) => Self::bad(cx, "audio", &e.to_string()),
        }
    }

    /// Whether `n` bytes of the call's audio may be decoded (the connection's budget).
    fn afford(&self, n: usize, cx: &mut Taken<'_>) -> bool {
        let Some(wire) = self.call.lock().ok().and_then(|c| c.wire) else {
            return true;
        };
        let us = n as u64 * 1_000_000 / wire.bytes_per_second().max(1);
        cx.afford(std::time::Duration::from_micros(us))
    }
}

struct StreamEncoder<D: Dialect> {
    dialect: Arc<D>,
    call: Arc<Mutex<Call>>,
    phone: Option<(Wire, PhoneOut)>,
    /// Bytes held back to make whole chunks.
    held: Vec<u8>,
}

impl<D: Dialect> Encoder for StreamEncoder<D> {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        let Outbound::Pcm(samples) = m else {
            // The providers' streams carry no text; the transcript is in the session's logs.
            return Vec::new();
        };
        let Ok(mut call) = self.call.lock() else {
            return Vec::new();
        };
        let Some(wire) = call.wire else {
            return Vec::new();
        };
        if self.phone.as_ref().is_none_or(|(w, _)| *w != wire) {
            match PhoneOut::coded(wire.coding, wire.rate) {
                Ok(p) => self.phone = Some((wire, p)),
                Err(_) => return Vec::new(),
            }
        }
        let Some((_, phone)) = self.phone.as_mut() else {
            return Vec::new();
        };
        self.held.extend(phone.encode(&samples));
        // Whole samples, and whole chunks where the provider counts them (Vonage: 20 ms).
        let chunk = if D::BINARY {
            (wire.bytes_per_second() / 50) as usize
        } else {
            D::CHUNK.max(wire.coding.bytes_per_sample())
        };
        let whole = self.held.len() / chunk * chunk;
        if whole == 0 {
            return Vec::new();
        }
        let bytes: Vec<u8> = self.held.drain(..whole).collect();
        let id = call.id.clone();
        let mut out = Vec::with_capacity(4);
        // Only for a client that echoes marks: another would be cleared for ever.
        if call.echoed > 0 && call.sent.saturating_sub(call.played) > CLEAR_AFTER {
            metrics::counter!(crate::observe::names::SESSION_DROPPED, "direction" => "out")
                .increment(call.sent - call.played);
            call.played = call.sent;
            out.push(json_message(&self.dialect.clear(&id)));
        }
        if D::BINARY {
            out.extend(
                bytes
                    .chunks(chunk)
                    .map(|c| Message::Binary(c.to_vec().into())),
            );
        } else {
            let payload = base64::engine::general_purpose::STANDARD.encode(bytes);
            out.push(json_message(&self.dialect.media(&id, &wire, payload)));
        }
        call.sent += 1;
        if call.sent.is_multiple_of(MARK_EVERY) {
            let name = format!("duplex-{}", call.sent);
            out.push(json_message(&self.dialect.mark(&id, &name)));
        }
        out
    }
}

fn json_message(v: &Value) -> Message {
    Message::Text(v.to_string().into())
}

impl<D: Dialect> Protocol for MediaStream<D> {
    fn may_start(&self) -> bool {
        self.start
    }

    fn params(&mut self, cfg: &ServeConfig) -> Result<SessionParams, String> {
        cfg.session_params(&self.pairs)
            .map_err(|m| m.replace("query parameter", "the stream's parameter"))
    }

    fn ready(&mut self, _meta: &Value) -> Vec<Message> {
        Vec::new()
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        let text = match m {
            Message::Binary(b) if D::BINARY => {
                if self.afford(b.len(), cx) {
                    self.audio(&b, cx);
                }
                return;
            }
            Message::Binary(_) => {
                return Self::bad(cx, "binary", "a binary message (the provider sends JSON)")
            }
            Message::Text(t) => t,
            _ => return,
        };
        let Ok(v) = serde_json::from_str::<Value>(text.as_str()) else {
            return Self::bad(cx, "json", "not JSON");
        };
        match self.dialect.read(&v) {
            Event::Start { id, wire, params } => {
                let wire = match wire {
                    Ok(w) => w,
                    Err(why) => {
                        tracing::info!(session = cx.id, "refused a {} call: {why}", D::NAME);
                        cx.close = Some((1003, "the call's audio format is not one we take"));
                        return;
                    }
                };
                self.phone = PhoneIn::coded(wire.coding, wire.rate).ok();
                if let Ok(mut call) = self.call.lock() {
                    call.id = id;
                    call.wire = Some(wire);
                }
                self.pairs = params;
                self.start = true;
            }
            Event::Media(payload) => {
                if !self.start {
                    return Self::early(cx);
                }
                let n = base64_len(&payload);
                if n == 0 || !self.afford(n, cx) {
                    return;
                }
                let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(payload) else {
                    return Self::bad(cx, "base64", "a media payload that is not base64");
                };
                self.audio(&bytes, cx);
            }
            Event::Played(name) => {
                let played = name
                    .strip_prefix("duplex-")
                    .and_then(|n| n.parse::<u64>().ok());
                if let (Some(p), Ok(mut call)) = (played, self.call.lock()) {
                    call.played = call.played.max(p);
                    call.echoed += 1;
                }
            }
            Event::Dtmf(Some(key)) => {
                let Ok(mut call) = self.call.lock() else {
                    return;
                };
                if call.keys.len() < MAX_KEYS {
                    call.keys.push(key);
                }
                // At most a line a second per call, however fast keys come.
                let now = std::time::Instant::now();
                call.unlogged += 1;
                if call
                    .logged
                    .is_none_or(|t| now.saturating_duration_since(t) >= KEYS_LOGGED_EVERY)
                {
                    let n = std::mem::take(&mut call.unlogged);
                    let last: String = call.keys.chars().rev().take(n.min(MAX_KEYS)).collect();
                    let last: String = last.chars().rev().collect();
                    call.logged = Some(now);
                    tracing::info!(
                        session = cx.id,
                        "{}: the caller pressed {last} ({n} key(s) since the last line)",
                        D::NAME
                    );
                }
            }
            Event::Dtmf(None) => Self::bad(cx, "dtmf", "a digit that is not a DTMF key"),
            Event::Stop => cx.end = true,
            Event::Ignore => {}
            Event::Unknown => Self::bad(cx, "event", "an unknown event"),
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(StreamEncoder {
            dialect: self.dialect.clone(),
            call: self.call.clone(),
            phone: None,
            held: Vec::new(),
        })
    }

    fn pcm(&self) -> bool {
        true
    }

    fn transport(&self) -> Option<TransportStats> {
        let call = self.call.clone();
        Some(Arc::new(move || {
            let c = call.lock();
            serde_json::json!({
                "kind": D::NAME,
                "call": c.as_ref().map(|c| c.id.clone()).unwrap_or_default(),
                "frames_sent": c.as_ref().map(|c| c.sent).unwrap_or_default(),
                "frames_played": c.as_ref().map(|c| c.played).unwrap_or_default(),
                "dtmf": c.as_ref().map(|c| c.keys.clone()).unwrap_or_default(),
            })
        }))
    }
}

/// The events Twilio's framing gave its successors (Telnyx, Exotel): `media` with
/// `media.payload` (an outbound `media.track` ignored), `mark` with `mark.name`, `dtmf` with
/// `dtmf.digit`, `stop`; `None` for another kind.
pub(crate) fn twilio_like(kind: &str, v: &Value) -> Option<Event> {
    Some(match kind {
        "media" if v["media"]["track"].as_str().is_some_and(|t| t != "inbound") => Event::Ignore,
        "media" => match v["media"]["payload"].as_str() {
            Some(p) => Event::Media(p.to_string()),
            None => Event::Unknown,
        },
        "mark" => Event::Played(v["mark"]["name"].as_str().unwrap_or_default().into()),
        "dtmf" => Event::Dtmf(dtmf_key(&v["dtmf"]["digit"])),
        "stop" => Event::Stop,
        _ => return None,
    })
}

/// The DTMF key a provider's `digit` names: one character of `0-9 * # A-D` (a string, or a
/// number 0–9), else `None`. Nothing else a client sends is logged or kept as a key.
pub(crate) fn dtmf_key(digit: &Value) -> Option<char> {
    let text = match digit {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.as_u64().filter(|d| *d <= 9)?.to_string(),
        _ => return None,
    };
    let mut chars = text.chars();
    let (Some(c), None) = (chars.next(), chars.next()) else {
        return None;
    };
    let c = c.to_ascii_uppercase();
    matches!(c, '0'..='9' | '*' | '#' | 'A'..='D').then_some(c)
}

/// A JSON object's string fields as the session's params (names lowercased, `-` as `_`),
/// leaving out `skip`.
pub(crate) fn string_params(v: &Value, skip: &[&str]) -> Vec<(String, String)> {
    v.as_object()
        .map(|o| {
            o.iter()
                .filter(|(k, _)| !skip.contains(&k.as_str()))
                .filter_map(|(k, v)| {
                    Some((
                        k.to_ascii_lowercase().replace('-', "_"),
                        v.as_str()?.to_string(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `a` equals `b`, in constant time.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn provider_dtmf_digits_are_kept_to_dtmf_keys() {
        assert_eq!(dtmf_key(&json!("5")), Some('5'));
        assert_eq!(dtmf_key(&json!("#")), Some('#'));
        assert_eq!(dtmf_key(&json!("b")), Some('B'));
        assert_eq!(dtmf_key(&json!(7)), Some('7'));
        // A line break that would forge a log line, a long digit, anything else: no key.
        for bad in [
            json!("1\nINFO forged"),
            json!("x".repeat(100_000)),
            json!(""),
            json!("E"),
            json!(12),
            json!(-1),
            json!(null),
            json!(["1"]),
        ] {
            assert_eq!(dtmf_key(&bad), None, "{bad:.20}");
        }
    }
}
