//! `GET /v1/realtime`: the OpenAI Realtime API's WebSocket protocol in its full-duplex
//! profile, for the clients voice agents are built with (the `openai` SDK, Pipecat, LiveKit).
//! One session per connection, from the same session template, admission, limits and keys as
//! `/api/chat`; only the two ends differ ([`Protocol`]): JSON events carrying base64 audio in,
//! and the template with PCM ends ([`pcm_ends`](super::session::pcm_ends)).
//!
//! The model listens and speaks at once, so nothing waits for a commit; responses are
//! stretches of its output, one utterance each, opened and closed as the clients' bookkeeping
//! expects ([`conversation`]: items with ids; the agent's turn's end, `response.create` and
//! the interruptions as the boundaries), their closing events sent in order with the deltas by
//! the writer ([`deltas`]), which holds back the rest of an interrupted utterance. The user's
//! turns come from the server's voice-activity detector ([`turns`], OpenAI's `server_vad`
//! semantics; `turn_detection: null` turns it off): `speech_started` ends the agent's open
//! response (`interrupt_response`), `speech_stopped` commits the turn as an item. The session
//! starts at the client's first `input_audio_buffer.append` or `response.create`, once its
//! `session.update` has come (or [`UPDATE_GRACE`] after the connection opened);
//! `session.update` before it sets the persona (`instructions`, and system messages of
//! `conversation.item.create`), the voice prompt (`voice`, a name of the voices folder: another
//! name leaves the template's) and the sampling (the `duplex` extension object, the query
//! parameters of `/api/chat`); after it, only the audio formats change, and a late update is
//! answered with what is in effect, never refused. Audio is `pcm16` (24 kHz, 16-bit little-endian) or G.711 μ-law /
//! A-law at 8 kHz, in the beta (`input_audio_format: "g711_ulaw"`) and the GA spelling
//! (`audio.input.format: {"type": "audio/pcmu"}`), converted by [`phone`](crate::audio::phone) (G.711 tables, resampled to
//! and from 24 kHz): an append is charged to the connection's audio budget from its base64
//! length before it is decoded, so what comes faster than real time is dropped undecoded. PCM16
//! split mid-sample keeps its odd byte for the next append, so the session's samples stay
//! aligned whatever is dropped. Server events use the GA names, or the beta ones (`response.audio.delta`)
//! when the client spoke beta or asked with `?event_names=beta` (`both` sends both). Every bad
//! event gets an `error` event with a `code`, the offending `param` and the client's
//! `event_id` (cut to 40 characters, as every value of a client's repeated), counted by kind
//! and logged once per kind and session; none ends the session. `docs/realtime.md` maps every event.
//!
//! Knows nothing of the pipeline beyond the session's link; nothing of HTTP beyond the socket's
//! messages.

use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;
use base64::Engine as _;
use serde_json::{json, Value};

mod conversation;
mod deltas;
mod events;
mod items;
mod turns;

use super::config::shown;
use super::config::ServeConfig;
use super::session::{base64_len, Encoder, Protocol, Taken};
use crate::audio::phone::{PhoneIn, PHONE_RATE};
use crate::audio::MODEL_RATE;
use crate::model::vad::Vad;

use conversation::Conversation;
use deltas::{Deltas, Shared};
use events::SAMPLING;
pub use events::{parse_event, ClientEvent, EventError, Format, SessionUpdate, TurnDetection};
use items::merged;
pub(super) use turns::open_detector;
use turns::Turns;

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

/// How long a session asked for by audio alone waits for the client's `session.update`: the
/// frameworks send theirs as soon as `session.created` comes, while their audio may already
/// flow.
const UPDATE_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Where a connection's session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not started: `asked` once the client asked for it (its first append or
    /// `response.create`), `updated` once its `session.update` came.
    Waiting { asked: bool, updated: bool },
    /// Its pipeline is built (its persona, voice and sampling are fixed), and priming.
    Started,
    /// Primed and ready: its first response is open.
    Ready,
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
    phase: Phase,
    /// When the connection opened: a session asked for by audio alone starts once the client
    /// has had [`UPDATE_GRACE`] to send its `session.update`.
    opened: std::time::Instant,
    /// The `metadata` of a `response.create` that came before the session was ready.
    first_metadata: Option<Value>,
    instructions: String,
    voice: Option<String>,
    next_event: u64,
    /// The user's turns, from the server's voice-activity detector.
    turns: Turns,
    /// The session's id, `sess_<id>` in the session object (`/api/sessions` lists it by `id`).
    id: Option<u64>,
}

impl Realtime {
    /// A connection, with the `event_names` of its query (if any), and the server's
    /// voice-activity detector.
    pub(super) fn new(cfg: Arc<ServeConfig>, names: Option<Names>, vad: Option<Arc<Vad>>) -> Self {
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
                conv: Conversation::new(names.unwrap_or(Names::Ga), format!("{stamp:x}")),
                pending: Vec::new(),
                hold: None,
            })),
            phase: Phase::Waiting {
                asked: false,
                updated: false,
            },
            opened: std::time::Instant::now(),
            first_metadata: None,
            instructions: String::new(),
            voice: None,
            next_event: 0,
            turns: Turns::new(vad),
            id: None,
        }
    }

    /// The session has not started: its persona, voice and sampling may still change.
    fn waiting(&self) -> bool {
        matches!(self.phase, Phase::Waiting { .. })
    }

    /// The client asks for the session to start.
    fn ask(&mut self) {
        if let Phase::Waiting { asked, .. } = &mut self.phase {
            *asked = true;
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
            .map(|s| (s.output, s.conv.names))
            .unwrap_or((Format::Pcm16, Names::Ga));
        let mut s = json!({
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id.map(|i| format!("sess_{i}")),
            "model": "duplex",
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "audio": {
                "input": {"format": self.input.ga(), "turn_detection": self.turns.detection(), "transcription": null},
                "output": {"format": output.ga(), "voice": self.voice},
            },
            "tools": [],
            "tool_choice": "none",
            "duplex": self.pairs.iter().filter(|(k, _)| SAMPLING.contains(&k.as_str())).map(|(k, v)| (k.clone(), v.parse::<f64>().map_or(Value::Null, Value::from))).collect::<serde_json::Map<_, _>>(),
        });
        if names != Names::Ga {
            s["input_audio_format"] = json!(self.input.beta());
            s["output_audio_format"] = json!(output.beta());
            s["voice"] = json!(self.voice);
            s["modalities"] = json!(["audio", "text"]);
            s["turn_detection"] = self.turns.detection();
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

    /// Applies a `session.update`. Before the session starts, its persona, voice and sampling
    /// apply (a voice the server does not have is not applied, and said); after, they are
    /// fixed (the model was primed with them) and the update applies its audio formats, its
    /// answer saying what is in effect. A bad value (a format, a sampling option, instructions
    /// over the limit) gets an error naming it, and nothing of the update applies.
    fn apply(
        &mut self,
        u: SessionUpdate,
        client_event: Option<&str>,
        cx: &mut Taken<'_>,
    ) -> Message {
        if let Phase::Waiting { updated, .. } = &mut self.phase {
            *updated = true;
        }
        let mut u = u;
        let (mut pairs, fixed) = self.asked_pairs(&mut u, cx);
        let mut voice = u.voice.as_ref().map(|(_, n)| n.clone()).filter(|_| !fixed);
        if let Err(m) = self.cfg.session_params(&pairs) {
            let without = |key: &str| {
                let rest: Vec<(String, String)> =
                    pairs.iter().filter(|(k, _)| k != key).cloned().collect();
                self.cfg.session_params(&rest).is_ok()
            };
            if u.voice.is_some() && without("voice_prompt") {
                // The frameworks send OpenAI's names (`marin`, `alloy`): not this server's
                // voices, and no reason to refuse the rest. The voice in effect is said.
                if cx.first("unknown_voice") {
                    tracing::info!(
                        session = cx.id,
                        voice = %shown(voice.as_deref().unwrap_or_default()),
                        "realtime: not a voice of this server (GET /api/voices lists them); the template's voice stays"
                    );
                }
                pairs.retain(|(k, _)| k != "voice_prompt");
                voice = None;
            } else {
                let (param, message) = if without("text_prompt") {
                    (
                        Some("session.instructions"),
                        m.replace("query parameter text_prompt", "instructions"),
                    )
                } else {
                    (
                        SAMPLING
                            .iter()
                            .find(|k| m.contains(*k))
                            .map(|_| "session.duplex"),
                        m.replace("query parameter ", ""),
                    )
                };
                return self.error("invalid_value", &message, param, client_event);
            }
        }
        self.pairs = pairs;
        if let Some(t) = u.instructions.filter(|_| !fixed) {
            self.instructions = t;
        }
        if voice.is_some() {
            self.voice = voice;
        }
        if let Some(f) = u.input {
            self.set_input(f);
        }
        if let Some(td) = u.turn_detection {
            self.turns.set(td, cx);
        }
        if let Ok(mut s) = self.shared.lock() {
            if let Some(f) = u.output {
                s.output = f;
            }
            if u.beta && !self.names_fixed {
                s.conv.names = Names::Beta;
            }
        }
        let session = self.session();
        self.event(json!({"type": "session.updated", "session": session}))
    }

    /// The session's params as `u` asks for them (its voice's OpenAI name mapped to the
    /// operator's), and whether they are fixed already (the session started: they stay).
    fn asked_pairs(
        &self,
        u: &mut SessionUpdate,
        cx: &mut Taken<'_>,
    ) -> (Vec<(String, String)>, bool) {
        let mut pairs = self.pairs.clone();
        let mut set = |k: &str, v: String| {
            pairs.retain(|(key, _)| key != k);
            pairs.push((k.to_string(), v));
        };
        if let Some((_, name)) = u.voice.as_mut() {
            // OpenAI's names, mapped by the operator to voices of theirs.
            if let Some((_, to)) = self.cfg.realtime.voices.iter().find(|(n, _)| n == name) {
                *name = to.clone();
            }
        }
        if let Some(t) = &u.instructions {
            set("text_prompt", t.clone());
        }
        if let Some((_, name)) = &u.voice {
            set("voice_prompt", name.clone());
        }
        for (k, v) in &u.sampling {
            set(k, v.clone());
        }
        let fixed = !self.waiting() && pairs != self.pairs;
        if fixed && cx.first("fixed_after_start") {
            tracing::info!(
                session = cx.id,
                "realtime: a session.update after the conversation started keeps its persona, voice and sampling (the model was primed with them); its audio formats apply"
            );
        }
        if fixed {
            pairs = self.pairs.clone();
        }
        (pairs, fixed)
    }

    /// An `error` event for a client's mistake, counted by `kind` and logged once per kind
    /// in the session.
    fn refuse(
        &mut self,
        cx: &mut Taken<'_>,
        kind: &'static str,
        code: &str,
        message: &str,
        param: Option<&str>,
        client_event: Option<&str>,
    ) -> Message {
        cx.protocol_error(kind);
        if cx.first(kind) {
            tracing::info!(
                session = cx.id,
                kind,
                code,
                "realtime: a client event refused: {message}"
            );
        }
        self.error(code, message, param, client_event)
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
                    Some(p) => p.pcm16(&bytes).map(Some).map_err(|e| e.to_string()),
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

impl Protocol for Realtime {
    fn named(&mut self, id: u64) {
        self.id = Some(id);
    }

    fn hello(&mut self) -> Vec<Message> {
        let session = self.session();
        vec![self.event(json!({"type": "session.created", "session": session}))]
    }

    fn may_start(&self) -> bool {
        match self.phase {
            Phase::Waiting { asked, updated } => {
                asked && (updated || self.opened.elapsed() >= UPDATE_GRACE)
            }
            _ => false,
        }
    }

    fn params(&mut self, cfg: &ServeConfig) -> Result<super::config::SessionParams, String> {
        self.phase = Phase::Started;
        cfg.session_params(&self.pairs)
    }

    fn ready(&mut self, meta: &Value) -> Vec<Message> {
        let session = meta.get("session").cloned().unwrap_or(Value::Null);
        let own = json!({"duplex_session": session.to_string()});
        let first = self.first_metadata.take().map(|m| merged(m, &own));
        self.phase = Phase::Ready;
        let events = match self.shared.lock() {
            Ok(mut s) => {
                s.conv.metadata = own;
                s.conv.open(first)
            }
            Err(_) => Vec::new(),
        };
        events.into_iter().map(|v| self.event(v)).collect()
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
                let r = self.refuse(
                    cx,
                    e.kind,
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
        let replies = match event {
            ClientEvent::Update(u) => vec![self.apply(u, ce, cx)],
            ClientEvent::Append(b64) => match self.audio(&b64, cx) {
                Ok(pcm) => {
                    self.ask();
                    match pcm.filter(|p| !p.is_empty()) {
                        Some(pcm) => {
                            let ready = self.phase == Phase::Ready;
                            let found = self.turns.detect(&pcm, &self.shared, ready, cx);
                            let turns = found.into_iter().map(|v| self.event(v)).collect();
                            cx.offer(pcm);
                            turns
                        }
                        None => Vec::new(),
                    }
                }
                Err(m) => {
                    let code = if m.contains("base64") {
                        "invalid_base64"
                    } else {
                        "invalid_audio"
                    };
                    vec![self.refuse(cx, "bad_audio", code, &m, Some("audio"), ce)]
                }
            },
            // Full duplex: the model has heard the audio as it came; a commit makes it an
            // item (for the client's bookkeeping), a clear has nothing to drop.
            ClientEvent::Commit => self.conversation(|c| c.commit(None)),
            ClientEvent::Clear => vec![self.event(json!({"type": "input_audio_buffer.cleared"}))],
            // What the client plays is cut: so is the rest of the agent's utterance.
            ClientEvent::ClearOutput => {
                if let Ok(mut s) = self.shared.lock() {
                    s.interrupt("client_cancelled");
                }
                vec![self.event(json!({"type": "output_audio_buffer.cleared"}))]
            }
            ClientEvent::CreateResponse(metadata) => self.create_response(metadata),
            ClientEvent::CancelResponse => self.cancel_response(ce),
            ClientEvent::CreateItem { item, previous } => self.create_item(item, previous, cx),
            ClientEvent::RetrieveItem(item_id) => self.retrieve_item(&item_id, cx, ce),
            ClientEvent::DeleteItem(item_id) => self.delete_item(&item_id, cx, ce),
            ClientEvent::TruncateItem(item_id, index, end_ms) => {
                self.truncate_item(&item_id, index, end_ms, cx, ce)
            }
        };
        cx.replies.extend(replies);
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(Deltas::new(self.shared.clone()))
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
