//! Telnyx's media streaming (`/telnyx/media`): JSON events `connected`, `start` (`stream_id`;
//! `start.media_format`: PCMU or PCMA at 8 kHz; `start.custom_parameters`, the session's
//! params), `media` (`media.payload`, base64; `media.track`), `dtmf`, `mark` (ours, played),
//! `stop`; back: `media` {`payload`}, `mark` {`name`}, `clear`. Telnyx signs no stream: the
//! `stream_auth_token` the call was given comes back in the `x-telnyx-streaming-auth-token`
//! header, which [`token_ok`] checks when `providers.telnyx_stream_token` is set.

use serde_json::Value;

use super::{string_params, Dialect, Event, Wire};
use crate::audio::g711::Law;
use crate::audio::phone::Coding;

/// Telnyx's framing.
pub(crate) struct Telnyx;

impl Dialect for Telnyx {
    const NAME: &'static str = "telnyx";

    fn read(&self, v: &Value) -> Event {
        let kind = v["event"].as_str().unwrap_or_default();
        if let Some(e) = super::twilio_like(kind, v) {
            return e;
        }
        match kind {
            "connected" | "error" => Event::Ignore,
            "start" => {
                let f = &v["start"]["media_format"];
                let encoding = f["encoding"].as_str().unwrap_or("PCMU");
                let rate = f["sample_rate"]
                    .as_u64()
                    .or_else(|| f["sample_rate"].as_str()?.parse().ok())
                    .unwrap_or(8000);
                let wire = match (encoding.to_ascii_uppercase().as_str(), rate) {
                    ("PCMU", 8000) => Ok(Law::Mu),
                    ("PCMA", 8000) => Ok(Law::A),
                    _ => Err(format!(
                        "{encoding} at {rate} Hz (PCMU or PCMA at 8 kHz taken)"
                    )),
                }
                .map(|law| Wire {
                    coding: Coding::G711(law),
                    rate: 8000,
                });
                Event::Start {
                    id: v["stream_id"].as_str().unwrap_or_default().to_string(),
                    wire,
                    params: string_params(&v["start"]["custom_parameters"], &[]),
                }
            }
            _ => Event::Unknown,
        }
    }
}

/// Whether the upgrade's `x-telnyx-streaming-auth-token` is `token`.
pub(crate) fn token_ok(token: &str, header: Option<&str>) -> bool {
    header.is_some_and(|h| super::same(h.trim().as_bytes(), token.as_bytes()))
}
