//! HTTP Digest (RFC 2617, MD5 with `qop=auth`) as SIP uses it, for servers that ask callers for
//! credentials: [`Digest::challenge`] makes a `WWW-Authenticate` value, [`Digest::check`] an
//! `Authorization` against it. A nonce is the time it was made, a salt of its own (a count) and
//! a MAC of both with a secret of this process, so the server keeps no state per challenge and
//! knows its own nonces (and their age) when they come back; what it does keep is each
//! `(nonce, nc)` it has taken, until the nonce expires, so that a captured answer cannot be
//! replayed, whatever address it comes from. An answer must name the request's URI (its host,
//! and its user when it names one) and `qop=auth` (`auth-int`, which would sign the body, and
//! answers without `qop` are refused).
//!
//! Knows nothing of transactions or sockets: the door asks, this answers.

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

/// How long a nonce is good for.
pub(crate) const NONCE_LIFE_S: u64 = 300;
/// `(nonce, nc)` pairs remembered at most (past it the oldest go, and with them their nonce's
/// whole life is refused: see [`Digest::check`]).
const MAX_SEEN: usize = 100_000;

/// Why an `Authorization` is not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// Not a Digest answer, or a field missing.
    Malformed,
    /// Another user or realm.
    Unknown,
    /// A nonce not ours, or too old.
    Stale,
    /// A `qop` other than `auth` (or none).
    Qop,
    /// An answer for another URI than the request's.
    Uri,
    /// This `(nonce, nc)` was taken before.
    Replayed,
    /// The password is wrong.
    Wrong,
}

/// The credentials callers must answer with, and the answers already taken.
pub(crate) struct Digest {
    user: String,
    password: String,
    realm: String,
    secret: Vec<u8>,
    /// Each challenge's salt: a count.
    salts: std::sync::atomic::AtomicU64,
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    pairs: HashSet<(String, String)>,
    /// In the order taken, with the time their nonce expires.
    order: VecDeque<(u64, (String, String))>,
    /// Nonces made before this are refused (set when the memory is full).
    floor_s: u64,
}

fn md5_hex(s: &str) -> String {
    use md5::Digest as _;
    md5::Md5::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The `name="value"` (or `name=value`) pairs of a Digest header.
fn params(header: &str) -> Option<Vec<(String, String)>> {
    let rest = header.trim().strip_prefix("Digest")?.trim();
    let mut out = Vec::new();
    let mut s = rest;
    while !s.is_empty() {
        let (name, after) = s.split_once('=')?;
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (&q[..end], &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim(), &after[end..])
        };
        out.push((name.trim().to_ascii_lowercase(), value.to_string()));
        s = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(out)
}

impl Digest {
    /// `user` and `password` in `realm`, nonces keyed with `secret`.
    pub(crate) fn new(user: &str, password: &str, realm: &str, secret: &[u8]) -> Digest {
        Digest {
            user: user.to_string(),
            password: password.to_string(),
            realm: realm.to_string(),
            secret: secret.to_vec(),
            salts: std::sync::atomic::AtomicU64::new(0),
            seen: Mutex::new(Seen::default()),
        }
    }

    /// A nonce made at `now_s` with `salt` (each challenge its own, so that two made in one
    /// second are two nonces): the time, the salt, and a MAC of both.
    fn nonce(&self, now_s: u64, salt: u64) -> String {
        use hmac::Mac;
        let mut mac = match hmac::Hmac::<sha1::Sha1>::new_from_slice(&self.secret) {
            Ok(m) => m,
            Err(_) => return format!("{now_s:x}.{salt:x}"),
        };
        mac.update(&now_s.to_be_bytes());
        mac.update(&salt.to_be_bytes());
        let tag: String = mac.finalize().into_bytes()[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("{now_s:x}.{salt:x}.{tag}")
    }

    /// The `WWW-Authenticate` value of a 401 made at `now_s`.
    pub(crate) fn challenge(&self, now_s: u64) -> String {
        format!(
            "Digest realm=\"{}\", nonce=\"{}\", algorithm=MD5, qop=\"auth\"",
            self.realm,
            self.nonce(
                now_s,
                self.salts
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            )
        )
    }

    /// Whether `header` answers one of our challenges for `method` on `request_uri` at
    /// `now_s`; a taken answer cannot be taken again.
    ///
    /// # Errors
    ///
    /// Why it is not taken.
    pub(crate) fn check(
        &self,
        header: &str,
        method: &str,
        request_uri: &str,
        now_s: u64,
    ) -> Result<(), Fault> {
        use subtle::ConstantTimeEq;
        let p = params(header).ok_or(Fault::Malformed)?;
        let get = |k: &str| p.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let (Some(u), Some(r), Some(n), Some(uri), Some(response)) = (
            get("username"),
            get("realm"),
            get("nonce"),
            get("uri"),
            get("response"),
        ) else {
            return Err(Fault::Malformed);
        };
        if u != self.user || r != self.realm {
            return Err(Fault::Unknown);
        }
        let mut fields = n.split('.');
        let (Some(made), Some(salt)) = (
            fields.next().and_then(|t| u64::from_str_radix(t, 16).ok()),
            fields.next().and_then(|t| u64::from_str_radix(t, 16).ok()),
        ) else {
            return Err(Fault::Stale);
        };
        if made > now_s || now_s - made > NONCE_LIFE_S || self.nonce(made, salt) != n {
            return Err(Fault::Stale);
        }
        if get("qop") != Some("auth") {
            return Err(Fault::Qop);
        }
        if !same_uri(uri, request_uri) {
            return Err(Fault::Uri);
        }
        let (Some(nc), Some(cnonce)) = (get("nc"), get("cnonce")) else {
            return Err(Fault::Malformed);
        };
        let ha1 = md5_hex(&format!("{}:{}:{}", self.user, self.realm, self.password));
        let ha2 = md5_hex(&format!("{method}:{uri}"));
        let want = md5_hex(&format!("{ha1}:{n}:{nc}:{cnonce}:auth:{ha2}"));
        if !bool::from(
            want.as_bytes()
                .ct_eq(response.to_ascii_lowercase().as_bytes()),
        ) {
            return Err(Fault::Wrong);
        }
        self.take(n, nc, made + NONCE_LIFE_S, now_s)
    }

    /// Takes `(nonce, nc)` once.
    fn take(&self, nonce: &str, nc: &str, expires_s: u64, now_s: u64) -> Result<(), Fault> {
        let mut seen = self.seen.lock().map_err(|_| Fault::Replayed)?;
        while seen.order.front().is_some_and(|(e, _)| *e <= now_s) {
            if let Some((_, k)) = seen.order.pop_front() {
                seen.pairs.remove(&k);
            }
        }
        if expires_s - NONCE_LIFE_S < seen.floor_s {
            return Err(Fault::Replayed);
        }
        let key = (nonce.to_string(), nc.to_ascii_lowercase());
        if !seen.pairs.insert(key.clone()) {
            return Err(Fault::Replayed);
        }
        seen.order.push_back((expires_s, key));
        if seen.order.len() > MAX_SEEN {
            // Forgetting a pair would let it be replayed: refuse its nonce's whole life instead.
            if let Some((e, k)) = seen.order.pop_front() {
                seen.pairs.remove(&k);
                seen.floor_s = seen.floor_s.max(e - NONCE_LIFE_S + 1);
            }
        }
        Ok(())
    }
}

/// Whether an answer's `uri` names the request's URI: the same scheme, host and port, and the
/// same user when it names one (some user agents, sipp among them, name the server's address
/// alone).
fn same_uri(answer: &str, request: &str) -> bool {
    let parse = |s: &str| rsipstack::sip::Uri::try_from(s.trim()).ok();
    match (parse(answer), parse(request)) {
        (Some(a), Some(r)) => {
            a.scheme == r.scheme
                && a.host_with_port == r.host_with_port
                && a.auth
                    .as_ref()
                    .is_none_or(|u| Some(&u.user) == r.auth.as_ref().map(|x| &x.user))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const URI: &str = "sip:duplex@127.0.0.1";

    /// An answer as a UA computes it (RFC 2617 §3.2.2).
    fn answer(d: &Digest, pass: &str, nonce: &str, uri: &str, qop: &str, nc: &str) -> String {
        let ha1 = md5_hex(&format!("{}:{}:{pass}", d.user, d.realm));
        let ha2 = md5_hex(&format!("INVITE:{uri}"));
        let resp = md5_hex(&format!("{ha1}:{nonce}:{nc}:0a4f113b:{qop}:{ha2}"));
        format!(
            "Digest username=\"{}\", realm=\"{}\", nonce=\"{nonce}\", uri=\"{uri}\", \
             qop={qop}, nc={nc}, cnonce=\"0a4f113b\", response=\"{resp}\", algorithm=MD5",
            d.user, d.realm
        )
    }

    fn nonce_of(challenge: &str) -> String {
        let p = params(challenge).unwrap();
        p.into_iter().find(|(n, _)| n == "nonce").unwrap().1
    }

    #[test]
    fn a_digest_answer_is_checked_against_our_own_nonce() {
        // RFC 2617 §3.5's credentials, with our nonce in place of the RFC's.
        let d = Digest::new("Mufasa", "Circle Of Life", "testrealm@host.com", b"s3cret");
        assert_eq!(
            md5_hex("Mufasa:testrealm@host.com:Circle Of Life"),
            "939e7578ed9e3c518a452acee763bce9"
        );
        let now = 1_000_000;
        let n = nonce_of(&d.challenge(now));
        let good = answer(&d, "Circle Of Life", &n, URI, "auth", "00000001");
        assert_eq!(d.check(&good, "INVITE", URI, now + 10), Ok(()));
        let wrong = answer(&d, "x", &n, URI, "auth", "00000002");
        assert_eq!(d.check(&wrong, "INVITE", URI, now), Err(Fault::Wrong));
        let h = answer(&d, "Circle Of Life", &n, URI, "auth", "00000003");
        assert_eq!(d.check(&h, "BYE", URI, now), Err(Fault::Wrong));
        assert_eq!(d.check(&h, "INVITE", URI, now + 301), Err(Fault::Stale));
        let other = Digest::new("Mufasa", "Circle Of Life", "testrealm@host.com", b"other");
        assert_eq!(other.check(&h, "INVITE", URI, now), Err(Fault::Stale));
        assert_eq!(
            d.check("Basic abc", "INVITE", URI, now),
            Err(Fault::Malformed)
        );
    }

    #[test]
    fn sip_digest_answers_do_not_replay_name_their_uri_and_use_qop_auth() {
        let d = Digest::new("trunk", "s3cret", "duplex", b"k");
        let now = 5_000;
        // Two challenges in one second are two nonces.
        assert_ne!(nonce_of(&d.challenge(now)), nonce_of(&d.challenge(now)));
        let n = nonce_of(&d.challenge(now));
        let h = answer(&d, "s3cret", &n, URI, "auth", "00000001");
        assert_eq!(d.check(&h, "INVITE", URI, now), Ok(()));
        // The same answer again (from any address): refused, every time.
        for _ in 0..3 {
            assert_eq!(d.check(&h, "INVITE", URI, now + 1), Err(Fault::Replayed));
        }
        // The same nonce with the next count: a UA's next request, taken.
        let next = answer(&d, "s3cret", &n, URI, "auth", "00000002");
        assert_eq!(d.check(&next, "INVITE", URI, now + 2), Ok(()));
        // An answer computed for another URI than the request's: another host, another user.
        let elsewhere = answer(&d, "s3cret", &n, "sip:other@192.0.2.1", "auth", "00000003");
        assert_eq!(d.check(&elsewhere, "INVITE", URI, now), Err(Fault::Uri));
        let bob = answer(&d, "s3cret", &n, "sip:bob@127.0.0.1", "auth", "00000003");
        assert_eq!(d.check(&bob, "INVITE", URI, now), Err(Fault::Uri));
        // The server's address alone names it (sipp answers so).
        let host = answer(&d, "s3cret", &n, "sip:127.0.0.1", "auth", "00000005");
        assert_eq!(d.check(&host, "INVITE", URI, now), Ok(()));
        // auth-int is not taken as auth; nor an answer without qop.
        let int = answer(&d, "s3cret", &n, URI, "auth-int", "00000004");
        assert_eq!(d.check(&int, "INVITE", URI, now), Err(Fault::Qop));
        let bare = h.replace("qop=auth, ", "");
        assert_eq!(d.check(&bare, "INVITE", URI, now), Err(Fault::Qop));
        // Pairs are forgotten once their nonce has expired (then refused as stale anyway).
        assert_eq!(
            d.check(&next, "INVITE", URI, now + NONCE_LIFE_S + 1),
            Err(Fault::Stale)
        );
        let fresh = nonce_of(&d.challenge(now + NONCE_LIFE_S + 1));
        let h2 = answer(&d, "s3cret", &fresh, URI, "auth", "00000001");
        assert_eq!(d.check(&h2, "INVITE", URI, now + NONCE_LIFE_S + 2), Ok(()));
        assert_eq!(d.seen.lock().unwrap().pairs.len(), 1);
    }
}
