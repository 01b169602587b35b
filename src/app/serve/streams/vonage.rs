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
            "websocket:dtmf" => Event::Dtmf(super::dtmf_key(&v["digit"])),
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
/// expired at `now_s` (see [`times_ok`]).
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
    times_ok(&claims, now_s)
}

/// How far the provider's clock may be from ours.
const SKEW_S: i64 = 60;
/// How long a JWT without `exp` is taken after its `iat`.
const IAT_LIFE_S: i64 = 300;

/// Whether a JWT's times hold at `now_s` (RFC 7519 §4.1.4–6, with [`SKEW_S`] of skew): `exp`
/// in the future; without `exp`, an `iat` within [`IAT_LIFE_S`]; `nbf`, when given, passed. A
/// time that is not an integer (a string, a fraction, a number beyond 64 bits) is no time: the
/// token is refused, as is one with neither `exp` nor `iat` (it would never expire).
fn times_ok(claims: &Value, now_s: u64) -> bool {
    let now = i64::try_from(now_s).unwrap_or(i64::MAX);
    let time = |k: &str| -> Result<Option<i64>, ()> {
        match &claims[k] {
            Value::Null => Ok(None),
            Value::Number(n) => n.as_i64().map(Some).ok_or(()),
            _ => Err(()),
        }
    };
    let (Ok(exp), Ok(iat), Ok(nbf)) = (time("exp"), time("iat"), time("nbf")) else {
        return false;
    };
    let alive = match (exp, iat) {
        (Some(exp), _) => now < exp.saturating_add(SKEW_S),
        (None, Some(iat)) => now < iat.saturating_add(IAT_LIFE_S + SKEW_S) && iat <= now + SKEW_S,
        (None, None) => false,
    };
    alive && nbf.is_none_or(|nbf| nbf <= now + SKEW_S)
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
        // Expired, with a minute's skew.
        assert!(jwt_ok("s3", Some(&ok), 159));
        assert!(!jwt_ok("s3", Some(&ok), 160));
        assert!(!jwt_ok("other", Some(&ok), 50));
        assert!(!jwt_ok("s3", Some(&sign("s3", "{}", "none")), 50));
        assert!(!jwt_ok("s3", None, 50));
        assert!(!jwt_ok("s3", Some("Bearer a.b"), 50));
    }

    #[test]
    fn vonage_jwts_without_an_integer_exp_expire() {
        use hmac::Mac;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let sign = |claims: &str| {
            let head = b64.encode("{\"alg\":\"HS256\",\"typ\":\"JWT\"}");
            let body = b64.encode(claims);
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"s3").unwrap();
            mac.update(format!("{head}.{body}").as_bytes());
            format!(
                "Bearer {head}.{body}.{}",
                b64.encode(mac.finalize().into_bytes())
            )
        };
        let at = |claims: &str, now: u64| jwt_ok("s3", Some(&sign(claims)), now);
        let now = 1_800_000_000;
        // Times that are not integers are no times: refused, never "no expiry".
        for claims in [
            r#"{"exp":"99999999999"}"#,
            r#"{"exp":1.8e12}"#,
            r#"{"exp":18446744073709551616}"#,
            r#"{"exp":null,"iat":"1"}"#,
            r#"{}"#,
        ] {
            assert!(!at(claims, now), "{claims}");
        }
        // Without exp, the iat's five minutes (and a minute of skew).
        assert!(at(&format!(r#"{{"iat":{}}}"#, now - 200), now));
        assert!(!at(&format!(r#"{{"iat":{}}}"#, now - 400), now));
        assert!(!at(&format!(r#"{{"iat":{}}}"#, now + 600), now));
        // Not before its nbf.
        assert!(!at(
            &format!(r#"{{"exp":{},"nbf":{}}}"#, now + 100, now + 90),
            now
        ));
        assert!(at(
            &format!(r#"{{"exp":{},"nbf":{}}}"#, now + 100, now + 30),
            now
        ));
    }
}
