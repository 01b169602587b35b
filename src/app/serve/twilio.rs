//! `GET /twilio/media`: Twilio's Media Streams protocol, so that a phone call reaches the model
//! (TwiML `<Connect><Stream url="wss://…/twilio/media"/></Connect>`). One session per call,
//! from the same session template, admission and limits as `/api/chat`, with PCM ends
//! ([`pcm_ends`](super::session::pcm_ends)); only the wire differs ([`Protocol`]).
//!
//! Twilio sends `connected`, `start` (the `streamSid`, the call's media format, and the
//! `<Parameter>`s of the TwiML, which may set the session's params by the names of `/api/chat`'s
//! query: `text_prompt`, `voice_prompt`, the sampling), `media` (base64 μ-law, 8 kHz, 20 ms),
//! `mark` (a mark of ours, echoed once the audio before it has played), `dtmf` and `stop`. The
//! session starts at `start` and ends at `stop`. The agent's audio goes back as `media` messages
//! (μ-law, one per 80 ms frame) with the `streamSid`, a `mark` after every second of it; when
//! the audio sent and not yet played (the marks not yet echoed) passes `CLEAR_AFTER`, a `clear`
//! drops what Twilio holds, so that a burst after a stall does not become lasting latency.
//! Twilio reads no errors: a bad message is counted and logged once per kind.
//!
//! A `media` message is charged to the connection's audio budget from its payload's size
//! (8,000 bytes a second) before it is decoded: what comes faster than real time is dropped
//! undecoded. One before `start` is dropped undecoded too, and counted (`early_audio`): Twilio
//! sends none, and until `start` there is no session to hear it. Only `media` keeps a call from
//! its idle limit; a connection that sends no `start` is closed at
//! `limits.handshake_timeout_s`.
//!
//! [`signature_ok`] checks Twilio's `X-Twilio-Signature` (HMAC-SHA1 of the stream's URL with
//! the account's auth token), which the route requires when `twilio_auth_token` is set.
//! Knows nothing of the pipeline beyond the session's link.

use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;
use base64::Engine as _;
use serde_json::{json, Value};

use super::config::ServeConfig;
use super::session::base64_len;
use super::session::{Encoder, Protocol, Taken};
use crate::audio::g711::Law;
use crate::audio::phone::{PhoneIn, PhoneOut, PHONE_RATE};
use crate::session::Outbound;

/// Agent frames (80 ms) between two marks: about a second.
const MARK_EVERY: u64 = 12;
/// Agent frames sent and not played (by the echoed marks) past which Twilio's buffer is cleared.
const CLEAR_AFTER: u64 = 40;

/// What the encoder shares with the protocol.
#[derive(Default)]
struct Call {
    stream_sid: String,
    /// Agent frames sent.
    sent: u64,
    /// Agent frames played, by the last mark echoed.
    played: u64,
    /// Marks echoed.
    echoed: u64,
}

/// Twilio's side of one call.
pub(super) struct Twilio {
    call: Arc<Mutex<Call>>,
    phone: Option<PhoneIn>,
    /// The call's `<Parameter>`s, as `/api/chat`'s query pairs.
    pairs: Vec<(String, String)>,
    start: bool,
}

impl Twilio {
    pub(super) fn new() -> Self {
        Twilio {
            call: Arc::new(Mutex::new(Call::default())),
            phone: PhoneIn::new(Law::Mu).ok(),
            pairs: Vec::new(),
            start: false,
        }
    }

    fn bad(cx: &mut Taken<'_>, what: &'static str, detail: &str) {
        cx.protocol_error("unknown_kind");
        if cx.first(what) {
            tracing::info!(
                session = cx.id,
                "ignored a Twilio message: {detail} (logged once per session)"
            );
        }
    }
}

struct Media {
    call: Arc<Mutex<Call>>,
    phone: Option<PhoneOut>,
}

impl Encoder for Media {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        let Some(bytes) = super::session::phone_bytes(&mut self.phone, m) else {
            return Vec::new();
        };
        let Ok(mut call) = self.call.lock() else {
            return Vec::new();
        };
        let sid = call.stream_sid.clone();
        let mut out = Vec::with_capacity(3);
        // Only for a client that echoes marks (Twilio does): another would be cleared for ever.
        if call.echoed > 0 && call.sent.saturating_sub(call.played) > CLEAR_AFTER {
            tracing::debug!(
                "{} frames sent and not played: Twilio's buffer cleared",
                call.sent - call.played
            );
            metrics::counter!(crate::observe::names::SESSION_DROPPED, "direction" => "out")
                .increment(call.sent - call.played);
            call.played = call.sent;
            out.push(json!({"event": "clear", "streamSid": sid}));
        }
        let payload = base64::engine::general_purpose::STANDARD.encode(bytes);
        out.push(json!({"event": "media", "streamSid": sid, "media": {"payload": payload}}));
        call.sent += 1;
        if call.sent.is_multiple_of(MARK_EVERY) {
            out.push(json!({
                "event": "mark",
                "streamSid": sid,
                "mark": {"name": format!("duplex-{}", call.sent)},
            }));
        }
        out.into_iter()
            .map(|v| Message::Text(v.to_string().into()))
            .collect()
    }
}

impl Protocol for Twilio {
    fn may_start(&self) -> bool {
        self.start
    }

    fn params(&mut self, cfg: &ServeConfig) -> Result<super::config::SessionParams, String> {
        cfg.session_params(&self.pairs)
            .map_err(|m| m.replace("query parameter", "the stream's <Parameter>"))
    }

    fn ready(&mut self, _meta: &Value) -> Vec<Message> {
        Vec::new()
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        let Message::Text(text) = m else {
            return Self::bad(cx, "binary", "a binary message (Twilio sends JSON text)");
        };
        let Ok(v) = serde_json::from_str::<Value>(text.as_str()) else {
            return Self::bad(cx, "json", "not JSON");
        };
        match v.get("event").and_then(Value::as_str).unwrap_or_default() {
            "connected" | "dtmf" => {}
            "start" => {
                let start = &v["start"];
                let sid = v
                    .get("streamSid")
                    .or_else(|| start.get("streamSid"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let encoding = start["mediaFormat"]["encoding"]
                    .as_str()
                    .unwrap_or("audio/x-mulaw");
                let rate = start["mediaFormat"]["sampleRate"].as_u64().unwrap_or(8000);
                if encoding != "audio/x-mulaw" || rate != 8000 {
                    tracing::info!(session = cx.id, "refused a call of {encoding} at {rate} Hz (Twilio streams audio/x-mulaw at 8000 Hz)");
                    cx.close = Some((1003, "the call's audio is not μ-law at 8 kHz"));
                    return;
                }
                if let Ok(mut call) = self.call.lock() {
                    call.stream_sid = sid.to_string();
                }
                if let Some(params) = start["customParameters"].as_object() {
                    self.pairs = params
                        .iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect();
                }
                self.start = true;
            }
            "media" => {
                if v["media"]["track"].as_str().is_some_and(|t| t != "inbound") {
                    return;
                }
                let Some(payload) = v["media"]["payload"].as_str() else {
                    return Self::bad(cx, "payload", "a media message without a payload");
                };
                if !self.start {
                    cx.protocol_error("early_audio");
                    if cx.first("early") {
                        tracing::info!(
                            session = cx.id,
                            "dropped media before the call's start, undecoded (logged once per \
                             session)"
                        );
                    }
                    return;
                }
                let n = base64_len(payload);
                if n == 0 {
                    return;
                }
                let played =
                    std::time::Duration::from_micros(n as u64 * 1_000_000 / PHONE_RATE as u64);
                if !cx.afford(played) {
                    return;
                }
                let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(payload) else {
                    return Self::bad(cx, "base64", "a media payload that is not base64");
                };
                let Some(phone) = self.phone.as_mut() else {
                    return;
                };
                match phone.pcm16(&bytes) {
                    Ok(pcm) if !pcm.is_empty() => cx.offer(pcm),
                    Ok(_) => {}
                    Err(e) => Self::bad(cx, "audio", &e.to_string()),
                }
            }
            "mark" => {
                let played = v["mark"]["name"]
                    .as_str()
                    .and_then(|n| n.strip_prefix("duplex-"))
                    .and_then(|n| n.parse::<u64>().ok());
                if let (Some(p), Ok(mut call)) = (played, self.call.lock()) {
                    call.played = call.played.max(p);
                    call.echoed += 1;
                }
            }
            "stop" => cx.end = true,
            _ => Self::bad(cx, "event", "an unknown event"),
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(Media {
            call: self.call.clone(),
            phone: PhoneOut::new(Law::Mu).ok(),
        })
    }

    fn pcm(&self) -> bool {
        true
    }
}

/// Whether `signature` (the `X-Twilio-Signature` header) is Twilio's for `url` (the stream's
/// URL as Twilio was given it, query included) and the account's `token`: the base64 of
/// HMAC-SHA1(token, url), compared in constant time.
pub(super) fn signature_ok(token: &str, url: &str, signature: &str) -> bool {
    use hmac::Mac;
    use subtle::ConstantTimeEq;
    let Ok(mut mac) = hmac::Hmac::<sha1::Sha1>::new_from_slice(token.as_bytes()) else {
        return false;
    };
    mac.update(url.as_bytes());
    let want = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    want.as_bytes().ct_eq(signature.trim().as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_the_hmac_sha1_of_the_url() {
        // HMAC-SHA1("key", "The quick brown fox jumps over the lazy dog") is
        // de7c9b85b8b78aa6bc8a7a36f70a90701c9db4d9 (RFC 2104's worked example, widely quoted).
        let sig = base64::engine::general_purpose::STANDARD.encode([
            0xde, 0x7c, 0x9b, 0x85, 0xb8, 0xb7, 0x8a, 0xa6, 0xbc, 0x8a, 0x7a, 0x36, 0xf7, 0x0a,
            0x90, 0x70, 0x1c, 0x9d, 0xb4, 0xd9,
        ]);
        let url = "The quick brown fox jumps over the lazy dog";
        assert!(signature_ok("key", url, &sig));
        assert!(!signature_ok("other", url, &sig));
        assert!(!signature_ok("key", "wss://example.com/twilio/media", &sig));
        assert!(!signature_ok("key", url, ""));
    }
}
