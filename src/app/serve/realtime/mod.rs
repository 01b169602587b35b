//! `GET /v1/realtime`: the OpenAI Realtime API's WebSocket protocol in its full-duplex
//! profile, for the clients voice agents are built with (the `openai` SDK, Pipecat, LiveKit).
//! One session per connection, from the same session template, admission, limits and keys as
//! `/api/chat`; only the two ends differ ([`Protocol`]): JSON events carrying base64 audio in,
//! and the template with PCM ends ([`pcm_ends`](super::session::pcm_ends)).
//!
//! The conversation is one response that stays open for the whole call: the model listens and
//! speaks at once, so nothing waits for a commit. The session starts at the client's first
//! `input_audio_buffer.append` or `response.create`; `session.update` before it sets the persona
//! (`instructions`), the voice prompt (`voice`, a name of the voices folder) and the sampling
//! (the `duplex` extension object, the query parameters of `/api/chat`); after it, only the
//! audio formats may change. Audio is `pcm16` (24 kHz, 16-bit little-endian) or G.711 μ-law /
//! A-law at 8 kHz, in the beta (`input_audio_format: "g711_ulaw"`) and the GA spelling
//! (`audio.input.format: {"type": "audio/pcmu"}`), converted by [`phone`](crate::audio::phone) (G.711 tables, resampled to
//! and from 24 kHz): an append is charged to the connection's audio budget from its base64
//! length before it is decoded, so what comes faster than real time is dropped undecoded. PCM16
//! split mid-sample keeps its odd byte for the next append, so the session's samples stay
//! aligned whatever is dropped. Server events use the GA names, or the beta ones (`response.audio.delta`)
//! when the client spoke beta or asked with `?event_names=beta` (`both` sends both). Every bad
//! event gets an `error` event with a `code`, the offending `param` and the client's
//! `event_id` (cut to 40 characters, as every value of a client's repeated); none ends the
//! session. `docs/realtime.md` maps every event.
//!
//! Knows nothing of the pipeline beyond the session's link; nothing of HTTP beyond the socket's
//! messages.

use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;
use base64::Engine as _;
use serde_json::{json, Value};

mod events;

use super::config::shown;
use super::session::{base64_len, Encoder, Protocol, Taken};
use super::ServeConfig;
use crate::audio::phone::{to_pcm16, PhoneIn, PhoneOut, PHONE_RATE};
use crate::audio::MODEL_RATE;
use crate::session::Outbound;

use events::SAMPLING;
pub use events::{parse_event, ClientEvent, EventError, Format, SessionUpdate};

/// Which names the server's events use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Names {
    /// `response.output_audio.delta`, `response.output_audio_transcript.delta`.
    Ga,
    /// `response.audio.delta`, `response.audio_transcript.delta`.
    Beta,
    /// Both, each delta twice.
    Both,
}

impl Names {
    /// From the `event_names` query parameter.
    pub(super) fn parse(s: &str) -> Result<Names, String> {
        match s {
            "ga" => Ok(Names::Ga),
            "beta" => Ok(Names::Beta),
            "both" => Ok(Names::Both),
            _ => Err(format!(
                "query parameter event_names={}: one of ga, beta, both",
                shown(s)
            )),
        }
    }
}

/// What the encoder shares with the protocol.
struct Shared {
    output: Format,
    names: Names,
    response: String,
    item: String,
}

/// The realtime API's side of one connection.
pub(super) struct Realtime {
    /// The server's settings: a client's choices are checked as they come.
    cfg: Arc<ServeConfig>,
    /// The session's params so far, as `/api/chat`'s query pairs.
    pairs: Vec<(String, String)>,
    /// Whether the names were set by the query (the client's spelling does not change them).
    names_fixed: bool,
    input: Format,
    /// G.711 input's decoder.
    phone: Option<PhoneIn>,
    /// Where the PCM16 stream stands within a sample.
    half: Half,
    shared: Arc<Mutex<Shared>>,
    /// The client asked for the session to start.
    start: bool,
    /// The session's pipeline has been built: its persona, voice and sampling are fixed.
    started: bool,
    instructions: String,
    voice: Option<String>,
    next_event: u64,
}

impl Realtime {
    /// A connection, with the `event_names` of its query (if any).
    pub(super) fn new(cfg: Arc<ServeConfig>, names: Option<Names>) -> Self {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Realtime {
            cfg,
            pairs: Vec::new(),
            names_fixed: names.is_some(),
            input: Format::Pcm16,
            phone: None,
            half: Half::None,
            shared: Arc::new(Mutex::new(Shared {
                output: Format::Pcm16,
                names: names.unwrap_or(Names::Ga),
                response: format!("resp_{stamp:x}"),
                item: format!("item_{stamp:x}"),
            })),
            start: false,
            started: false,
            instructions: String::new(),
            voice: None,
            next_event: 0,
        }
    }

    fn event_id(&mut self) -> String {
        self.next_event += 1;
        format!("event_duplex_{}", self.next_event)
    }

    fn event(&mut self, mut v: Value) -> Message {
        if let Value::Object(o) = &mut v {
            o.insert("event_id".into(), Value::String(self.event_id()));
        }
        Message::Text(v.to_string().into())
    }

    /// An `error` event: what was wrong with the client's event `client_event`.
    fn error(
        &mut self,
        code: &str,
        message: &str,
        param: Option<&str>,
        client_event: Option<&str>,
    ) -> Message {
        self.event(json!({
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "code": code,
                "message": message,
                "param": param,
                "event_id": client_event,
            }
        }))
    }

    /// The session object of `session.created` / `session.updated`.
    fn session(&self) -> Value {
        let (output, names) = self
            .shared
            .lock()
            .map(|s| (s.output, s.names))
            .unwrap_or((Format::Pcm16, Names::Ga));
        let mut s = json!({
            "type": "realtime",
            "object": "realtime.session",
            "model": "duplex",
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "audio": {
                "input": {"format": self.input.ga(), "turn_detection": null},
                "output": {"format": output.ga(), "voice": self.voice},
            },
            "duplex": self.pairs.iter().filter(|(k, _)| SAMPLING.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.parse::<f64>().map_or(Value::Null, Value::from))).collect::<serde_json::Map<_, _>>(),
        });
        if names != Names::Ga {
            s["input_audio_format"] = json!(self.input.beta());
            s["output_audio_format"] = json!(output.beta());
            s["voice"] = json!(self.voice);
            s["modalities"] = json!(["audio", "text"]);
        }
        s
    }

    fn set_input(&mut self, f: Format) {
        if f != self.input {
            self.input = f;
            self.phone = match f {
                Format::G711(law) => PhoneIn::new(law).ok(),
                Format::Pcm16 => None,
            };
        }
    }

    /// Applies a `session.update`: all of it, or nothing and an error naming the field.
    fn apply(&mut self, u: SessionUpdate, client_event: Option<&str>) -> Message {
        let mut pairs = self.pairs.clone();
        let mut set = |k: &str, v: String| {
            pairs.retain(|(key, _)| key != k);
            pairs.push((k.to_string(), v));
        };
        let mut fixed = Vec::new();
        if let Some(t) = &u.instructions {
            set("text_prompt", t.clone());
            fixed.push("session.instructions");
        }
        if let Some((param, name)) = &u.voice {
            set("voice_prompt", name.clone());
            fixed.push(*param);
        }
        for (k, v) in &u.sampling {
            set(k, v.clone());
        }
        if !u.sampling.is_empty() {
            fixed.push("session.duplex");
        }
        if self.started && pairs != self.pairs {
            let m = "the conversation has started: its persona, voice and sampling are fixed \
                     (only the audio formats may change)";
            return self.error("session_started", m, fixed.first().copied(), client_event);
        }
        if let Err(m) = self.cfg.session_params(&pairs) {
            // Which field: the one whose value alone makes the difference.
            let without = |key: &str| {
                let rest: Vec<(String, String)> =
                    pairs.iter().filter(|(k, _)| k != key).cloned().collect();
                self.cfg.session_params(&rest).is_ok()
            };
            let (param, message) = match &u.voice {
                Some((param, name)) if without("voice_prompt") => (
                    Some(*param),
                    format!(
                        "voice `{}` is not a voice of this server (GET /api/voices lists \
                         them): {}",
                        shown(name),
                        m.replace("query parameter ", "")
                    ),
                ),
                _ if without("text_prompt") => (
                    Some("session.instructions"),
                    m.replace("query parameter text_prompt", "instructions"),
                ),
                _ => (
                    SAMPLING
                        .iter()
                        .find(|k| m.contains(*k))
                        .map(|_| "session.duplex"),
                    m.replace("query parameter ", ""),
                ),
            };
            return self.error("invalid_value", &message, param, client_event);
        }
        self.pairs = pairs;
        if let Some(t) = u.instructions {
            self.instructions = t;
        }
        if let Some((_, name)) = u.voice {
            self.voice = Some(name);
        }
        if let Some(f) = u.input {
            self.set_input(f);
        }
        if let Ok(mut s) = self.shared.lock() {
            if let Some(f) = u.output {
                s.output = f;
            }
            if u.beta && !self.names_fixed {
                s.names = Names::Beta;
            }
        }
        let session = self.session();
        self.event(json!({"type": "session.updated", "session": session}))
    }

    /// How long `n` bytes of the client's audio play, in its format.
    fn plays(&self, n: usize) -> std::time::Duration {
        let per_s = match self.input {
            Format::Pcm16 => 2 * MODEL_RATE as u64,
            Format::G711(_) => PHONE_RATE as u64,
        };
        std::time::Duration::from_micros(n as u64 * 1_000_000 / per_s)
    }

    /// The client's audio in its format, as whole samples of 16-bit 24 kHz PCM for the
    /// session, or `None` when the connection's budget refused it (dropped undecoded). PCM16
    /// may come split anywhere, mid-sample too: the odd byte waits for the next append.
    fn audio(&mut self, b64: &str, cx: &mut Taken<'_>) -> Result<Option<Vec<u8>>, String> {
        let n = base64_len(b64);
        if n == 0 {
            return Ok(None);
        }
        if !cx.afford(self.plays(n)) {
            // Dropped whole: the samples after it stay whole.
            let mid_sample = !matches!(self.half, Half::None) ^ !n.is_multiple_of(2);
            self.half = if mid_sample { Half::Skip } else { Half::None };
            return Ok(None);
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("`audio` is not base64: {e}"))?;
        match self.input {
            Format::Pcm16 => {
                let mut out = Vec::with_capacity(bytes.len() + 1);
                let mut rest = &bytes[..];
                match std::mem::replace(&mut self.half, Half::None) {
                    Half::Byte(b) => out.push(b),
                    Half::Skip => rest = rest.get(1..).unwrap_or_default(),
                    Half::None => {}
                }
                out.extend_from_slice(rest);
                if !out.len().is_multiple_of(2) {
                    self.half = out.pop().map_or(Half::None, Half::Byte);
                }
                Ok(Some(out))
            }
            Format::G711(_) => {
                // PCM16 that ended mid-sample before the format changed: its half is dropped.
                self.half = Half::None;
                match self.phone.as_mut() {
                    Some(p) => p.pcm16(&bytes).map(Some),
                    None => Err("the G.711 decoder could not be made".into()),
                }
            }
        }
    }
}

/// Where a PCM16 stream split anywhere stands within a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    /// At a sample's start.
    None,
    /// A sample's first byte has come.
    Byte(u8),
    /// A sample's first byte was dropped: its second is to be skipped.
    Skip,
}

/// The writer's side: the agent's audio and transcript as delta events.
struct Deltas {
    shared: Arc<Mutex<Shared>>,
    /// G.711 output's encoder, and the format it was made for.
    phone: Option<(Format, PhoneOut)>,
    next_event: u64,
}

impl Deltas {
    fn events(&mut self, kind: &str, delta: String) -> Vec<Message> {
        let (names, response, item) = match self.shared.lock() {
            Ok(s) => (s.names, s.response.clone(), s.item.clone()),
            Err(_) => return Vec::new(),
        };
        let (ga, beta) = match kind {
            "audio" => ("response.output_audio.delta", "response.audio.delta"),
            _ => (
                "response.output_audio_transcript.delta",
                "response.audio_transcript.delta",
            ),
        };
        let types: &[&str] = match names {
            Names::Ga => &[ga],
            Names::Beta => &[beta],
            Names::Both => &[ga, beta],
        };
        types
            .iter()
            .map(|t| {
                self.next_event += 1;
                let v = json!({
                    "type": t,
                    "event_id": format!("event_duplex_out_{}", self.next_event),
                    "response_id": response,
                    "item_id": item,
                    "output_index": 0,
                    "content_index": 0,
                    "delta": delta,
                });
                Message::Text(v.to_string().into())
            })
            .collect()
    }
}

impl Encoder for Deltas {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match m {
            Outbound::Pcm(samples) => {
                let format = self.shared.lock().map_or(Format::Pcm16, |s| s.output);
                let bytes = match format {
                    Format::Pcm16 => to_pcm16(&samples),
                    Format::G711(law) => {
                        if self.phone.as_ref().map(|(f, _)| *f) != Some(format) {
                            self.phone = PhoneOut::new(law).ok().map(|p| (format, p));
                        }
                        match self.phone.as_mut() {
                            Some((_, p)) => p.encode(&samples),
                            None => return Vec::new(),
                        }
                    }
                };
                if bytes.is_empty() {
                    return Vec::new();
                }
                let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
                self.events("audio", b64)
            }
            Outbound::Text(t) => self.events("text", t),
            // Not made by a template with PCM ends.
            Outbound::Audio(_) => Vec::new(),
        }
    }
}

impl Protocol for Realtime {
    fn hello(&mut self) -> Vec<Message> {
        let session = self.session();
        vec![self.event(json!({"type": "session.created", "session": session}))]
    }

    fn may_start(&self) -> bool {
        self.start
    }

    fn params(&mut self, cfg: &ServeConfig) -> Result<super::config::SessionParams, String> {
        self.started = true;
        cfg.session_params(&self.pairs)
    }

    fn ready(&mut self, meta: &Value) -> Vec<Message> {
        let (response, item) = self
            .shared
            .lock()
            .map(|s| (s.response.clone(), s.item.clone()))
            .unwrap_or_default();
        let session = meta.get("session").cloned().unwrap_or(Value::Null);
        vec![self.event(json!({
            "type": "response.created",
            "response": {
                "id": response,
                "object": "realtime.response",
                "status": "in_progress",
                "output": [{"id": item, "type": "message", "role": "assistant", "content": []}],
                "output_modalities": ["audio"],
                "metadata": {"duplex_session": session.to_string()},
            }
        }))]
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        let parsed = match &m {
            Message::Text(t) => parse_event(t.as_str()),
            Message::Binary(_) => Err(EventError {
                kind: "not_json",
                code: "invalid_json",
                message: "events are JSON text messages; audio goes in \
                          input_audio_buffer.append as base64"
                    .into(),
                param: None,
                event_id: None,
            }),
            _ => return,
        };
        let (id, event) = match parsed {
            Ok(p) => p,
            Err(e) => {
                cx.protocol_error(e.kind);
                let r = self.error(
                    e.code,
                    &e.message,
                    e.param.as_deref(),
                    e.event_id.as_deref(),
                );
                cx.replies.push(r);
                return;
            }
        };
        let ce = id.as_deref();
        let reply = match event {
            ClientEvent::Update(u) => Some(self.apply(u, ce)),
            ClientEvent::Append(b64) => match self.audio(&b64, cx) {
                Ok(pcm) => {
                    self.start = true;
                    if let Some(pcm) = pcm.filter(|p| !p.is_empty()) {
                        cx.offer(pcm);
                    }
                    None
                }
                Err(m) => {
                    cx.protocol_error("bad_audio");
                    let code = if m.contains("base64") {
                        "invalid_base64"
                    } else {
                        "invalid_audio"
                    };
                    Some(self.error(code, &m, Some("audio"), ce))
                }
            },
            // Full duplex: the model has heard the audio as it came; there is nothing to commit
            // or clear, and the one response is under way.
            ClientEvent::Commit => Some(self.event(json!({
                "type": "input_audio_buffer.committed",
                "previous_item_id": null,
                "item_id": null,
            }))),
            ClientEvent::Clear => Some(self.event(json!({"type": "input_audio_buffer.cleared"}))),
            ClientEvent::CreateResponse => {
                self.start = true;
                None
            }
            ClientEvent::CancelResponse => None,
        };
        cx.replies.extend(reply);
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(Deltas {
            shared: self.shared.clone(),
            phone: None,
            next_event: 0,
        })
    }

    fn refusal(&self, text: &str) -> Vec<Message> {
        let v = json!({
            "type": "error",
            "event_id": "event_duplex_refused",
            "error": {"type": "invalid_request_error", "code": "session_refused", "message": text, "param": null, "event_id": null},
        });
        vec![Message::Text(v.to_string().into())]
    }

    fn failure(&self, text: &str) -> Vec<Message> {
        let v = json!({
            "type": "error",
            "event_id": "event_duplex_failed",
            "error": {"type": "server_error", "code": "session_failed", "message": text, "param": null, "event_id": null},
        });
        vec![Message::Text(v.to_string().into())]
    }

    fn bad_audio(&self) -> (u16, &'static str) {
        (1007, "the audio could not be used")
    }

    fn too_large(&mut self, limit: usize) -> Vec<Message> {
        let m = format!(
            "an event over limits.max_message_bytes ({limit} bytes): send audio in smaller appends"
        );
        vec![self.error("event_too_large", &m, None, None)]
    }

    fn pcm(&self) -> bool {
        true
    }
}
