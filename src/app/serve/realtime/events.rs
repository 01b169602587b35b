//! The realtime API's client events, parsed and checked, nothing of them applied: one text
//! message becomes its `event_id` and a [`ClientEvent`], or the [`EventError`] that answers it
//! (the field at fault, the client's values repeated short); and the audio formats in either
//! spelling. Pure: no connection, no session. `docs/realtime.md` maps every event.

use serde_json::{json, Value};

use super::super::config::shown;
use crate::audio::g711::Law;
use crate::audio::MODEL_RATE;

/// An audio format of the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// 16-bit little-endian PCM, 24 kHz, mono.
    Pcm16,
    /// G.711 at 8 kHz.
    G711(Law),
}

impl Format {
    /// The beta name.
    pub(super) fn beta(self) -> &'static str {
        match self {
            Format::Pcm16 => "pcm16",
            Format::G711(Law::Mu) => "g711_ulaw",
            Format::G711(Law::A) => "g711_alaw",
        }
    }

    /// The GA object.
    pub(super) fn ga(self) -> Value {
        match self {
            Format::Pcm16 => json!({"type": "audio/pcm", "rate": MODEL_RATE}),
            Format::G711(Law::Mu) => json!({"type": "audio/pcmu"}),
            Format::G711(Law::A) => json!({"type": "audio/pcma"}),
        }
    }

    /// A format in either spelling.
    pub(super) fn parse(v: &Value) -> Result<Format, String> {
        let name = match v {
            Value::String(s) => s.as_str(),
            Value::Object(o) => {
                let t = o.get("type").and_then(Value::as_str).unwrap_or_default();
                if t == "audio/pcm" {
                    match o.get("rate") {
                        None => {}
                        Some(r) if r.as_u64() == Some(MODEL_RATE as u64) => {}
                        Some(r) => {
                            return Err(format!(
                                "audio/pcm is served at {MODEL_RATE} Hz, not {}",
                                shown(&r.to_string())
                            ))
                        }
                    }
                }
                t
            }
            _ => "",
        };
        match name {
            "pcm16" | "audio/pcm" => Ok(Format::Pcm16),
            "g711_ulaw" | "audio/pcmu" => Ok(Format::G711(Law::Mu)),
            "g711_alaw" | "audio/pcma" => Ok(Format::G711(Law::A)),
            _ => Err(format!(
                "{} is not a format of this server: pcm16, g711_ulaw, g711_alaw (or \
                 {{\"type\": \"audio/pcm\" | \"audio/pcmu\" | \"audio/pcma\"}})",
                shown(&v.to_string())
            )),
        }
    }
}

/// The sampling options of the `duplex` extension object: the query parameters of `/api/chat`.
pub(super) const SAMPLING: [&str; 10] = [
    "text_temperature",
    "text_topk",
    "audio_temperature",
    "audio_topk",
    "pad_mult",
    "repetition_penalty",
    "repetition_penalty_context",
    "text_seed",
    "audio_seed",
    "max_steps",
];

/// A client event, parsed; nothing of it applied yet.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientEvent {
    /// `session.update`.
    Update(SessionUpdate),
    /// `input_audio_buffer.append`: the audio, in base64 (decoded once the connection's
    /// budget has paid for it).
    Append(String),
    /// `input_audio_buffer.commit`.
    Commit,
    /// `input_audio_buffer.clear`.
    Clear,
    /// `response.create`: its `response.metadata`, echoed in `response.created`.
    CreateResponse(Option<Value>),
    /// `response.cancel`.
    CancelResponse,
    /// `conversation.item.create`: the item, and where it goes.
    CreateItem {
        /// The item as the client gave it.
        item: Value,
        /// `previous_item_id`.
        previous: Option<String>,
    },
    /// `conversation.item.retrieve`.
    RetrieveItem(String),
    /// `conversation.item.delete`.
    DeleteItem(String),
    /// `conversation.item.truncate`: the item, its content part, and where its audio ends.
    TruncateItem(String, u64, u64),
    /// `output_audio_buffer.clear` (WebRTC clients' barge-in).
    ClearOutput,
}

/// What a `session.update` asks for, in either spelling.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SessionUpdate {
    /// The persona.
    pub instructions: Option<String>,
    /// The voice prompt's name, and the field that named it.
    pub voice: Option<(&'static str, String)>,
    /// The client's audio format.
    pub input: Option<Format>,
    /// The agent's audio format.
    pub output: Option<Format>,
    /// The `duplex` sampling options, as `/api/chat`'s query pairs.
    pub sampling: Vec<(String, String)>,
    /// Spelled the beta way (`input_audio_format`, `output_audio_format`, `modalities`).
    pub beta: bool,
    /// `turn_detection`: `Some(None)` when the client turned it off (`null`).
    pub turn_detection: Option<Option<TurnDetection>>,
}

/// What a `session.update`'s `turn_detection` object asks of the voice-activity detector;
/// what it leaves out stays as it was.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TurnDetection {
    /// `server_vad` or `semantic_vad` (taken as `server_vad`).
    pub kind: String,
    /// `threshold` (0..1).
    pub threshold: Option<f32>,
    /// `prefix_padding_ms`.
    pub prefix_padding_ms: Option<u32>,
    /// `silence_duration_ms`.
    pub silence_duration_ms: Option<u32>,
    /// `interrupt_response`.
    pub interrupt_response: Option<bool>,
}

/// Why a client's event was refused: the fields of the `error` event that answers it.
#[derive(Debug, Clone, PartialEq)]
pub struct EventError {
    /// The `kind` of `duplex_session_protocol_errors_total`.
    pub kind: &'static str,
    /// `error.code`.
    pub code: &'static str,
    /// `error.message`.
    pub message: String,
    /// `error.param`: the offending field.
    pub param: Option<String>,
    /// `error.event_id`: the client's event's, when it had one.
    pub event_id: Option<String>,
}

/// Parses one text message of a client's: its `event_id` (when it has one) and the event, or
/// the error that answers it. Never panics, whatever the text.
///
/// # Errors
///
/// An [`EventError`] naming the field at fault.
pub fn parse_event(text: &str) -> Result<(Option<String>, ClientEvent), EventError> {
    let fail = |kind, code, message: String, param: Option<&str>, id: &Option<String>| EventError {
        kind,
        code,
        message,
        param: param.map(str::to_string),
        event_id: id.clone(),
    };
    let v: Value = serde_json::from_str(text).map_err(|e| {
        fail(
            "not_json",
            "invalid_json",
            format!("not a JSON event: {e}"),
            None,
            &None,
        )
    })?;
    // Repeated in replies, so cut as every value of a client's is.
    let id = v.get("event_id").and_then(Value::as_str).map(shown);
    let Some(kind) = v.get("type").and_then(Value::as_str) else {
        let m = "an event needs a string `type`".to_string();
        return Err(fail("unknown_kind", "missing_type", m, Some("type"), &id));
    };
    let event =
        match kind {
            "session.update" => {
                let session = v.get("session").unwrap_or(&Value::Null);
                ClientEvent::Update(parse_update(session).map_err(|(param, m)| {
                    fail("bad_event", "invalid_value", m, Some(&param), &id)
                })?)
            }
            "input_audio_buffer.append" => {
                let Some(b64) = v.get("audio").and_then(Value::as_str) else {
                    let m = "`audio` must be a base64 string".to_string();
                    return Err(fail("bad_audio", "invalid_value", m, Some("audio"), &id));
                };
                ClientEvent::Append(b64.to_string())
            }
            "input_audio_buffer.commit" => ClientEvent::Commit,
            "input_audio_buffer.clear" => ClientEvent::Clear,
            "response.create" => ClientEvent::CreateResponse(
                v.pointer("/response/metadata")
                    .filter(|m| m.is_object())
                    .cloned(),
            ),
            "response.cancel" => ClientEvent::CancelResponse,
            "conversation.item.create" => {
                let Some(item) = v.get("item").filter(|i| i.is_object()) else {
                    let m = "`item` must be an object".to_string();
                    return Err(fail("bad_event", "invalid_value", m, Some("item"), &id));
                };
                ClientEvent::CreateItem {
                    item: item.clone(),
                    previous: v
                        .get("previous_item_id")
                        .and_then(Value::as_str)
                        .filter(|p| *p != "root")
                        .map(shown),
                }
            }
            "conversation.item.retrieve"
            | "conversation.item.delete"
            | "conversation.item.truncate" => {
                let Some(item) = v.get("item_id").and_then(Value::as_str) else {
                    let m = "`item_id` must be a string".to_string();
                    return Err(fail("bad_event", "invalid_value", m, Some("item_id"), &id));
                };
                let item = item.to_string();
                match kind {
                    "conversation.item.retrieve" => ClientEvent::RetrieveItem(item),
                    "conversation.item.delete" => ClientEvent::DeleteItem(item),
                    _ => ClientEvent::TruncateItem(
                        item,
                        v.get("content_index").and_then(Value::as_u64).unwrap_or(0),
                        v.get("audio_end_ms").and_then(Value::as_u64).unwrap_or(0),
                    ),
                }
            }
            "output_audio_buffer.clear" => ClientEvent::ClearOutput,
            k if UNSUPPORTED.iter().any(|u| k.starts_with(u)) => {
                let m = format!(
                    "`{}` is not an event of a realtime conversation (docs/realtime.md)",
                    shown(k)
                );
                return Err(fail(
                    "unknown_kind",
                    "unsupported_event",
                    m,
                    Some("type"),
                    &id,
                ));
            }
            k => {
                let m = format!("unknown event type `{}`", shown(k));
                return Err(fail("unknown_kind", "unknown_event", m, Some("type"), &id));
            }
        };
    Ok((id, event))
}

/// A `session.update`'s `session`, in either spelling; a refusal names the field.
fn parse_update(session: &Value) -> Result<SessionUpdate, (String, String)> {
    let Some(obj) = session.as_object() else {
        return Err(("session".into(), "`session` must be an object".into()));
    };
    let pick = |path: &[&str]| -> Option<&Value> {
        let mut v = session;
        for p in path {
            v = v.get(p)?;
        }
        (!v.is_null()).then_some(v)
    };
    let mut u = SessionUpdate {
        beta: ["input_audio_format", "output_audio_format", "modalities"]
            .iter()
            .any(|k| obj.contains_key(*k)),
        ..Default::default()
    };
    let format =
        |beta: &'static str, ga: [&'static str; 3]| -> Result<Option<Format>, (String, String)> {
            let (param, v) = match (pick(&[beta]), pick(&ga)) {
                (Some(v), _) => (format!("session.{beta}"), v),
                (None, Some(v)) => (format!("session.{}", ga.join(".")), v),
                (None, None) => return Ok(None),
            };
            Format::parse(v).map(Some).map_err(|m| (param, m))
        };
    u.input = format("input_audio_format", ["audio", "input", "format"])?;
    u.output = format("output_audio_format", ["audio", "output", "format"])?;
    if let Some(v) = pick(&["instructions"]) {
        let t = v.as_str().ok_or_else(|| {
            (
                "session.instructions".to_string(),
                "`instructions` must be a string".to_string(),
            )
        })?;
        u.instructions = Some(t.to_string());
    }
    let voice = pick(&["voice"])
        .map(|v| ("session.voice", v))
        .or_else(|| pick(&["audio", "output", "voice"]).map(|v| ("session.audio.output.voice", v)));
    if let Some((param, v)) = voice {
        let name = v.as_str().ok_or_else(|| {
            (
                param.to_string(),
                "`voice` must be a string: a voice prompt's name (GET /api/voices)".to_string(),
            )
        })?;
        u.voice = Some((param, name.to_string()));
    }
    let td = match (
        obj.get("turn_detection"),
        session.pointer("/audio/input/turn_detection"),
    ) {
        (Some(v), _) => Some(("session.turn_detection", v)),
        (None, Some(v)) => Some(("session.audio.input.turn_detection", v)),
        (None, None) => None,
    };
    if let Some((param, v)) = td {
        u.turn_detection = Some(turn_detection(v).map_err(|(f, m)| {
            let field = if f.is_empty() {
                param.to_string()
            } else {
                format!("{param}.{f}")
            };
            (field, m)
        })?);
    }
    if let Some(d) = pick(&["duplex"]) {
        let d = d.as_object().ok_or_else(|| {
            (
                "session.duplex".to_string(),
                "`duplex` must be an object of sampling options".to_string(),
            )
        })?;
        for (k, v) in d {
            let param = || format!("session.duplex.{}", shown(k));
            if !SAMPLING.contains(&k.as_str()) {
                let m = format!("unknown option: one of {}", SAMPLING.join(", "));
                return Err((param(), m));
            }
            let x = v
                .as_f64()
                .ok_or_else(|| (param(), "a number".to_string()))?;
            u.sampling.push((k.clone(), x.to_string()));
        }
    }
    Ok(u)
}

/// A `turn_detection` value: `null` (off) or an object; a refusal names the field within it.
fn turn_detection(v: &Value) -> Result<Option<TurnDetection>, (String, String)> {
    if v.is_null() {
        return Ok(None);
    }
    let Some(o) = v.as_object() else {
        return Err((
            String::new(),
            "`turn_detection` must be an object or null".into(),
        ));
    };
    let kind = match o
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("server_vad")
    {
        k @ ("server_vad" | "semantic_vad") => k.to_string(),
        k => {
            let m = format!("`{}`: one of server_vad, semantic_vad", shown(k));
            return Err(("type".into(), m));
        }
    };
    let number = |k: &str, max: f64| -> Result<Option<f64>, (String, String)> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => match x.as_f64() {
                Some(x) if (0.0..=max).contains(&x) => Ok(Some(x)),
                _ => Err((
                    k.to_string(),
                    format!("`{k}` must be a number from 0 to {max}"),
                )),
            },
        }
    };
    let interrupt_response = match o.get("interrupt_response") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(_) => {
            let m = "`interrupt_response` must be true or false";
            return Err(("interrupt_response".into(), m.into()));
        }
    };
    Ok(Some(TurnDetection {
        kind,
        threshold: number("threshold", 1.0)?.map(|x| x as f32),
        prefix_padding_ms: number("prefix_padding_ms", 10_000.0)?.map(|x| x as u32),
        silence_duration_ms: number("silence_duration_ms", 10_000.0)?.map(|x| x as u32),
        interrupt_response,
    }))
}

/// Client events answered with `unsupported_event`: events of other APIs (a transcription
/// session), or of the server's that a client has no business sending.
pub(super) const UNSUPPORTED: [&str; 2] = [
    "transcription_session.update",
    "response.function_call_arguments",
];
