//! `GET /twilio/media`: Twilio's Media Streams protocol, so that a phone call reaches the model
//! (TwiML `<Connect><Stream url="wss://…/twilio/media"/></Connect>`): a [`Dialect`] of the
//! providers' [`MediaStream`](super::MediaStream), one session per call from the same session
//! template, admission and limits as `/api/chat`, with PCM ends.
//!
//! Twilio sends `connected`, `start` (the `streamSid`, the call's media format, and the
//! `<Parameter>`s of the TwiML, which may set the session's params by the names of `/api/chat`'s
//! query: `text_prompt`, `voice_prompt`, the sampling), `media` (base64 μ-law, 8 kHz, 20 ms),
//! `mark` (a mark of ours, echoed once the audio before it has played), `dtmf` and `stop`. The
//! session starts at `start` and ends at `stop`. The agent's audio goes back as `media` messages
//! (μ-law, one per 80 ms frame) with the `streamSid`, a `mark` after every second of it; when
//! the audio sent and not yet played (the marks not yet echoed) passes
//! [`CLEAR_AFTER`](super::CLEAR_AFTER), a `clear`
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

use base64::Engine as _;
use serde_json::Value;

use super::{string_params, Dialect, Event, Wire};
use crate::audio::g711::Law;
use crate::audio::phone::Coding;

/// Twilio's framing.
pub(crate) struct Twilio;

impl Dialect for Twilio {
    const ID: Option<&'static str> = Some("streamSid");
    const NAME: &'static str = "twilio";

    fn read(&self, v: &Value) -> Event {
        let kind = v["event"].as_str().unwrap_or_default();
        if let Some(e) = super::twilio_like(kind, v) {
            return e;
        }
        match kind {
            "connected" => Event::Ignore,
            "start" => {
                let start = &v["start"];
                let id = v["streamSid"]
                    .as_str()
                    .or_else(|| start["streamSid"].as_str())
                    .unwrap_or_default();
                let encoding = start["mediaFormat"]["encoding"]
                    .as_str()
                    .unwrap_or("audio/x-mulaw");
                let rate = start["mediaFormat"]["sampleRate"].as_u64().unwrap_or(8000);
                let wire = if encoding == "audio/x-mulaw" && rate == 8000 {
                    Ok(Wire {
                        coding: Coding::G711(Law::Mu),
                        rate: 8000,
                    })
                } else {
                    Err(format!(
                        "{encoding} at {rate} Hz (Twilio streams audio/x-mulaw at 8000 Hz)"
                    ))
                };
                Event::Start {
                    id: id.to_string(),
                    wire,
                    params: string_params(&start["customParameters"], &[]),
                }
            }
            _ => Event::Unknown,
        }
    }
}

/// Whether `signature` (the `X-Twilio-Signature` header) is Twilio's for `url` (the stream's
/// URL as Twilio was given it, query included) and the account's `token`: the base64 of
/// HMAC-SHA1(token, url), compared in constant time.
pub(crate) fn signature_ok(token: &str, url: &str, signature: &str) -> bool {
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
