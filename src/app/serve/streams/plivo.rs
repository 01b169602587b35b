//! Plivo's audio streams (`/plivo/media`, a `<Stream bidirectional="true">`): JSON events
//! `start` (`start.streamId`; `start.mediaFormat`: `audio/x-mulaw` at 8 kHz or `audio/x-l16` at
//! 8 or 16 kHz; `extra_headers`, `k=v;k=v`, the session's params), `media` (`media.payload`),
//! `dtmf`, `playedStream` (a checkpoint of ours, played), `clearedAudio`; the call ends when the
//! socket closes. Back: `playAudio` {`media`: {`contentType`, `sampleRate`, `payload`}},
//! `checkpoint` {`streamId`, `name`}, `clearAudio`. [`signature_ok`] checks Plivo's
//! `X-Plivo-Signature-V3` when `providers.plivo_auth_token` is set.

use base64::Engine as _;
use serde_json::{json, Value};

use super::{Dialect, Event, Wire};
use crate::audio::g711::Law;
use crate::audio::phone::Coding;

/// Plivo's framing.
pub(crate) struct Plivo;

impl Dialect for Plivo {
    const NAME: &'static str = "plivo";

    fn read(&self, v: &Value) -> Event {
        match v["event"].as_str().unwrap_or_default() {
            "start" => {
                let f = &v["start"]["mediaFormat"];
                let encoding = f["encoding"].as_str().unwrap_or("audio/x-mulaw");
                let rate = f["sampleRate"]
                    .as_u64()
                    .or_else(|| f["sampleRate"].as_str()?.parse().ok())
                    .unwrap_or(8000) as u32;
                let wire = match (encoding, rate) {
                    ("audio/x-mulaw", 8000) => Ok(Wire {
                        coding: Coding::G711(Law::Mu),
                        rate,
                    }),
                    ("audio/x-l16", 8000 | 16000) => Ok(Wire {
                        coding: Coding::Linear16,
                        rate,
                    }),
                    _ => Err(format!(
                        "{encoding} at {rate} Hz (audio/x-mulaw at 8 kHz, audio/x-l16 at 8 or \
                         16 kHz taken)"
                    )),
                };
                let params = v["extra_headers"]
                    .as_str()
                    .unwrap_or_default()
                    .split([';', ','])
                    .filter_map(|kv| {
                        let (k, v) = kv.split_once('=')?;
                        Some((k.trim().to_ascii_lowercase(), v.trim().to_string()))
                    })
                    .collect();
                Event::Start {
                    id: v["start"]["streamId"].as_str().unwrap_or_default().into(),
                    wire,
                    params,
                }
            }
            "media" => match v["media"]["payload"].as_str() {
                Some(p) => Event::Media(p.to_string()),
                None => Event::Unknown,
            },
            "playedStream" => Event::Played(v["name"].as_str().unwrap_or_default().into()),
            "dtmf" => Event::Dtmf(super::dtmf_key(&v["dtmf"]["digit"])),
            "clearedAudio" => Event::Ignore,
            _ => Event::Unknown,
        }
    }

    fn media(&self, _id: &str, wire: &Wire, payload: String) -> Value {
        let content = match wire.coding {
            Coding::G711(_) => "audio/x-mulaw",
            Coding::Linear16 => "audio/x-l16",
        };
        json!({"event": "playAudio", "media": {
            "contentType": content, "sampleRate": wire.rate, "payload": payload,
        }})
    }

    fn mark(&self, id: &str, name: &str) -> Value {
        json!({"event": "checkpoint", "streamId": id, "name": name})
    }

    fn clear(&self, id: &str) -> Value {
        json!({"event": "clearAudio", "streamId": id})
    }
}

/// How long a nonce is remembered: a signed upgrade replayed later than this is refused by
/// the provider's own clock skew long before (Plivo signs each request anew).
const NONCE_MEMORY: std::time::Duration = std::time::Duration::from_secs(600);
/// Nonces remembered at most (past it the oldest are forgotten).
const MAX_NONCES: usize = 100_000;

/// The nonces of the signed upgrades taken: a captured upgrade cannot be replayed.
#[derive(Default)]
pub(crate) struct Nonces(std::sync::Mutex<NonceBook>);

#[derive(Default)]
pub(crate) struct NonceBook {
    seen: std::collections::HashSet<String>,
    order: std::collections::VecDeque<(std::time::Instant, String)>,
}

impl Nonces {
    /// Takes `nonce` at `now`: false when it was taken before (within [`NONCE_MEMORY`]).
    pub(crate) fn fresh(&self, nonce: &str, now: std::time::Instant) -> bool {
        let Ok(mut b) = self.0.lock() else {
            return false;
        };
        while b
            .order
            .front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= NONCE_MEMORY)
            || b.order.len() >= MAX_NONCES
        {
            if let Some((_, n)) = b.order.pop_front() {
                b.seen.remove(&n);
            }
        }
        if !b.seen.insert(nonce.to_string()) {
            return false;
        }
        b.order.push_back((now, nonce.to_string()));
        true
    }
}

/// What Plivo signs for a stream's URL and `nonce`: `scheme://host/path`, then `?` and the
/// query's pairs sorted by name (values decoded) when it has a query, then `.` and the nonce.
fn signed_string(url: &str, nonce: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    pairs.sort();
    let mut s = base.to_string();
    if !pairs.is_empty() {
        let q: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        s.push('?');
        s.push_str(&q.join("&"));
    }
    format!("{s}.{nonce}")
}

/// Whether one of the signatures in `header` (`X-Plivo-Signature-V3`, comma-separated) is
/// the base64 HMAC-SHA256 with `token` of `url` and `nonce` (`X-Plivo-Signature-V3-Nonce`).
pub(crate) fn signature_ok(token: &str, url: &str, nonce: &str, header: &str) -> bool {
    use hmac::Mac;
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes()) else {
        return false;
    };
    mac.update(signed_string(url, nonce).as_bytes());
    let want = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    !nonce.is_empty()
        && header
            .split(',')
            .any(|s| super::same(s.trim().as_bytes(), want.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signed_string_sorts_the_query_and_ends_with_the_nonce() {
        assert_eq!(
            signed_string("wss://h.example.com/plivo/media?b=2&a=x%20y", "123"),
            "wss://h.example.com/plivo/media?a=x y&b=2.123"
        );
        assert_eq!(
            signed_string("wss://h.example.com/plivo/media", "9"),
            "wss://h.example.com/plivo/media.9"
        );
        assert!(!signature_ok("t", "wss://h/p", "", "x"));
    }

    #[test]
    fn plivo_nonces_do_not_replay() {
        let n = Nonces::default();
        let t = std::time::Instant::now();
        assert!(n.fresh("abc", t));
        assert!(!n.fresh("abc", t + std::time::Duration::from_secs(5)));
        assert!(n.fresh("abd", t));
        // Forgotten once its memory has passed (the provider's signature has long expired).
        assert!(n.fresh("abc", t + NONCE_MEMORY));
    }
}
