//! Vonage's WebSocket calls (`/vonage/media`, an NCCO `connect` to a `websocket` endpoint): a
//! first text message `websocket:connected` (`content-type: audio/l16;rate=16000`, or 8000 or
//! 24000; the NCCO's `headers`, the session's params), then the caller's audio in binary
//! messages of 16-bit little-endian PCM, 20 ms each; `websocket:dtmf`; `websocket:notify` (a
//! mark of ours, played); the call ends when the socket closes. Back: binary messages of
//! exactly 20 ms, `{"action": "notify"}` as marks, `{"action": "clear"}`. [`jwt_ok`] checks the
//! `Authorization: Bearer` JWT (HS256 with the account's signature secret) when
//! `providers.vonage_signature_secret` is set.

use base64::Engine as _;
use serde_json::{json, Value};

use super::{string_params, Dialect, Event, Wire};
use crate::audio::phone::Coding;

/// Vonage's framing.
pub(crate) struct Vonage;

impl Dialect for Vonage {
    const NAME: &'static str = "vonage";
    const BINARY: bool = true;

    fn read(&self, v: &Value) -> Event {
        match v["event"].as_str().unwrap_or_default() {
            "websocket:connected" => {
                let ct = v["content-type"].as_str().unwrap_or_default();
                let rate = ct
                    .split(';')
                    .find_map(|p| p.trim().strip_prefix("rate="))
                    .and_then(|r| r.parse::<u32>().ok());
                let wire = match (ct.split(';').next().map(str::trim), rate) {
                    (Some("audio/l16"), Some(r @ (8000 | 16000 | 24000))) => Ok(Wire {
                        coding: Coding::Linear16,
                        rate: r,
                    }),
                    _ => Err(format!("{ct:?} (audio/l16 at 8, 16 or 24 kHz taken)")),
                };
                Event::Start {
                    id: String::new(),
                    wire,
                    params: string_params(v, &["event", "content-type"]),
                }
            }
            "websocket:dtmf" => Event::Dtmf(
                v["digit"]
                    .as_str()
                    .map(str::to_string)
                    .or_else(|| v["digit"].as_u64().map(|d| d.to_string()))
                    .unwrap_or_default(),
            ),
            "websocket:notify" => {
                Event::Played(v["payload"]["name"].as_str().unwrap_or_default().into())
            }
            "websocket:cleared" => Event::Ignore,
            _ => Event::Unknown,
        }
    }

    fn media(&self, _id: &str, _wire: &Wire, _payload: String) -> Value {
        // Vonage's audio is binary: the encoder sends it so.
        Value::Null
    }

    fn mark(&self, _id: &str, name: &str) -> Value {
        json!({"action": "notify", "payload": {"name": name}})
    }

    fn clear(&self, _id: &str) -> Value {
        json!({"action": "clear"})
    }
}

/// Whether `header` (`Authorization: Bearer …`) holds a JWT signed HS256 with `secret`, not
/// expired at `now_s` (by its `exp`, when it has one).
pub(crate) fn jwt_ok(secret: &str, header: Option<&str>, now_s: u64) -> bool {
    use hmac::Mac;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let Some(token) = header.and_then(|h| {
        let (scheme, t) = h.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then_some(t.trim())
    }) else {
        return false;
    };
    let mut parts = token.split('.');
    let (Some(head), Some(body), Some(sig), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let Some(alg) = b64
        .decode(head)
        .ok()
        .and_then(|h| serde_json::from_slice::<Value>(&h).ok())
        .and_then(|h| h["alg"].as_str().map(str::to_string))
    else {
        return false;
    };
    if alg != "HS256" {
        return false;
    }
    let Ok(mut mac) = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()) else {
        return false;
    };
    mac.update(format!("{head}.{body}").as_bytes());
    let want = mac.finalize().into_bytes();
    let Ok(got) = b64.decode(sig) else {
        return false;
    };
    if !super::same(&got, &want) {
        return false;
    }
    let claims: Value = b64
        .decode(body)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    claims["exp"].as_u64().is_none_or(|exp| exp > now_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jwt_is_taken_only_signed_with_the_secret_and_unexpired() {
        use hmac::Mac;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let sign = |secret: &str, claims: &str, alg: &str| {
            let head = b64.encode(format!("{{\"alg\":\"{alg}\",\"typ\":\"JWT\"}}"));
            let body = b64.encode(claims);
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
            mac.update(format!("{head}.{body}").as_bytes());
            format!(
                "Bearer {head}.{body}.{}",
                b64.encode(mac.finalize().into_bytes())
            )
        };
        let ok = sign("s3", "{\"iat\":1,\"exp\":100}", "HS256");
        assert!(jwt_ok("s3", Some(&ok), 50));
        assert!(!jwt_ok("s3", Some(&ok), 100));
        assert!(!jwt_ok("other", Some(&ok), 50));
        assert!(!jwt_ok("s3", Some(&sign("s3", "{}", "none")), 50));
        assert!(!jwt_ok("s3", None, 50));
        assert!(!jwt_ok("s3", Some("Bearer a.b"), 50));
    }
}
