//! Exotel's Voicebot stream (`/exotel/media`): JSON events `connected`, `start` (`stream_sid`;
//! `start.media_format`: 16-bit linear PCM, `raw/slin`, at 8 kHz unless the URL's
//! `sample-rate` said 16 or 24 kHz; `start.custom_parameters`), `media` (`media.payload`),
//! `dtmf`, `mark`, `stop`; back: `media`, `mark`, `clear`, each with the `stream_sid`, the audio
//! in multiples of 320 bytes. Exotel authenticates with HTTP Basic (the applet's
//! `wss://KEY:TOKEN@host/…`): [`basic_ok`] checks it against `providers.exotel_credentials`.

use base64::Engine as _;
use serde_json::Value;

use super::{string_params, Dialect, Event, Wire};
use crate::audio::phone::Coding;

/// Exotel's framing; `rate`: the URL's `sample-rate` (8000 when it has none).
pub(crate) struct Exotel {
    pub rate: u32,
}

impl Dialect for Exotel {
    const ID: Option<&'static str> = Some("stream_sid");
    const NAME: &'static str = "exotel";
    const CHUNK: usize = 320;

    fn read(&self, v: &Value) -> Event {
        let kind = v["event"].as_str().unwrap_or_default();
        if let Some(e) = super::twilio_like(kind, v) {
            return e;
        }
        match kind {
            "connected" => Event::Ignore,
            "start" => {
                let start = &v["start"];
                let id = v["stream_sid"]
                    .as_str()
                    .or_else(|| start["stream_sid"].as_str())
                    .unwrap_or_default();
                let rate = start["media_format"]["sample_rate"]
                    .as_u64()
                    .or_else(|| start["media_format"]["sample_rate"].as_str()?.parse().ok())
                    .map_or(self.rate, |r| r as u32);
                let wire = if [8000, 16000, 24000].contains(&rate) {
                    Ok(Wire {
                        coding: Coding::Linear16,
                        rate,
                    })
                } else {
                    Err(format!("16-bit PCM at {rate} Hz (8, 16 or 24 kHz taken)"))
                };
                Event::Start {
                    id: id.to_string(),
                    wire,
                    params: string_params(&start["custom_parameters"], &[]),
                }
            }
            _ => Event::Unknown,
        }
    }
}

/// Whether an `Authorization` header is HTTP Basic of `credentials` (`KEY:TOKEN`).
pub(crate) fn basic_ok(credentials: &str, header: Option<&str>) -> bool {
    let want = base64::engine::general_purpose::STANDARD.encode(credentials.as_bytes());
    header
        .and_then(|h| {
            let (scheme, value) = h.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("basic").then_some(value.trim())
        })
        .is_some_and(|v| super::same(v.as_bytes(), want.as_bytes()))
}
