//! Who may use the server, decided at the HTTP edge before any upgrade: API keys, browser
//! origins, and which address a request really comes from behind a reverse proxy.
//!
//! - **Keys** come from `keys_file` (one per line: the key itself or `sha256:` and its digest,
//!   then optional `name=…` and `sessions=…`) and from the `DUPLEX_API_KEYS` environment
//!   variable (entries of the same form, separated by commas). Only digests are kept; a
//!   presented key is hashed and compared with every digest in constant time. A key is never
//!   logged: its name is, or the first 8 hex digits of its digest.
//! - A key is taken from the `kyutai-api-key` header, the `auth_id` query parameter (Kyutai's
//!   names; browsers cannot set WebSocket headers) or `Authorization: Bearer …`.
//! - **Origins**: a browser's upgrade (it sends `Origin`) is let in from the server's own origin,
//!   from loopback pages, or from `allowed_origins`; a client that sends no `Origin` is not a
//!   browser page and is judged by its key alone.
//! - **Proxies**: the one header the operator's proxy writes (`forwarded_header`:
//!   `X-Forwarded-For` by default, or `Forwarded`) is believed, only from `trusted_proxies`; the
//!   client's address is the rightmost one in it that is not a trusted proxy. The other header
//!   is never read: a proxy passes it through from the client. Per-address limits group IPv6
//!   addresses by their /64 (one host has a whole /64).
//!
//! Knows nothing of sessions or sockets.

use crate::files::FileError;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;
use std::sync::Mutex;

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The environment variable with keys (comma-separated entries of a keys file's form).
pub const KEYS_ENV: &str = "DUPLEX_API_KEYS";

/// One accepted key.
#[derive(Debug, Clone)]
pub struct Key {
    digest: [u8; 32],
    /// How the logs and `/api/sessions` name it.
    pub name: String,
    /// Sessions it may hold at once (`None`: only the server's limits).
    pub max_sessions: Option<usize>,
}

/// The accepted keys, and the sessions each holds.
#[derive(Debug, Default)]
pub struct Keys {
    keys: Vec<Key>,
    held: Mutex<HashMap<usize, usize>>,
}

/// Why a request was not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// No key was presented.
    Missing,
    /// The key presented is not one of the server's.
    Unknown,
}

impl Denied {
    /// The `reason` label value.
    pub fn reason(self) -> &'static str {
        match self {
            Denied::Missing => "missing_key",
            Denied::Unknown => "unknown_key",
        }
    }
}

fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One entry: `KEY` or `sha256:HEX`, then `name=…` and `sessions=…` in any order.
fn parse_entry(line: &str, index: usize) -> Result<Key, String> {
    let mut words = line.split_whitespace();
    let secret = words.next().ok_or("an empty entry")?;
    let digest = match secret.strip_prefix("sha256:") {
        Some(h) => {
            let h = h.to_ascii_lowercase();
            if h.len() != 64 || !h.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err("`sha256:` must be followed by 64 hex digits".into());
            }
            let mut d = [0u8; 32];
            for (i, byte) in d.iter_mut().enumerate() {
                *byte = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
            }
            d
        }
        None => {
            if secret.len() < 16 {
                return Err(format!(
                    "a key of {} characters is too easy to guess: use 16 or more (e.g. `openssl rand -hex 24`)",
                    secret.len()
                ));
            }
            sha256(secret.as_bytes())
        }
    };
    let mut key = Key {
        digest,
        name: format!("key{}-{}", index + 1, &hex(&digest)[..8]),
        max_sessions: None,
    };
    for w in words {
        match w.split_once('=') {
            Some(("name", n)) if !n.is_empty() => key.name = n.to_string(),
            Some(("sessions", n)) => {
                key.max_sessions = Some(
                    n.parse::<usize>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| format!("sessions={n}: a whole number of 1 or more"))?,
                )
            }
            _ => return Err(format!("{w:?}: expected name=… or sessions=…")),
        }
    }
    Ok(key)
}

impl Keys {
    /// The keys of `file` (when given) and of `env` (the value of [`KEYS_ENV`], when set).
    ///
    /// # Errors
    ///
    /// A [`FileError`] naming the file and line (or the variable and entry), never the key.
    pub fn load(file: Option<&Path>, env: Option<&str>) -> Result<Keys, FileError> {
        let mut keys = Vec::new();
        if let Some(f) = file {
            let text = crate::files::read_limited(f, 1 << 20)
                .map_err(|e| FileError::new(f.display(), e))?;
            let text = String::from_utf8(text)
                .map_err(|_| FileError::new(f.display(), "not UTF-8 text"))?;
            for (i, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let k = parse_entry(line, keys.len())
                    .map_err(|e| FileError::new(format!("{} line {}", f.display(), i + 1), e))?;
                keys.push(k);
            }
        }
        if let Some(v) = env {
            for (i, entry) in v.split(',').map(str::trim).enumerate() {
                if entry.is_empty() {
                    continue;
                }
                let k = parse_entry(entry, keys.len())
                    .map_err(|e| FileError::new(format!("{KEYS_ENV} entry {}", i + 1), e))?;
                keys.push(k);
            }
        }
        Ok(Keys {
            keys,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The names of keys listed more than once (the same key, by value or digest), each with
    /// the name of its first listing: the operator is warned.
    pub fn duplicates(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (i, k) in self.keys.iter().enumerate() {
            if let Some(first) = self.keys[..i].iter().find(|f| f.digest == k.digest) {
                out.push((k.name.clone(), first.name.clone()));
            }
        }
        out
    }

    /// Whether any key is configured (with none, the server is open).
    pub fn any(&self) -> bool {
        !self.keys.is_empty()
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// The key `presented` is, compared with every key in constant time.
    ///
    /// # Errors
    ///
    /// [`Denied`], when there is no key or it is not one of ours.
    pub fn check(&self, presented: Option<&str>) -> Result<usize, Denied> {
        let p = presented.filter(|p| !p.is_empty()).ok_or(Denied::Missing)?;
        let d = sha256(p.as_bytes());
        let mut found = None;
        for (i, k) in self.keys.iter().enumerate() {
            if bool::from(k.digest.ct_eq(&d)) {
                found = Some(i);
            }
        }
        found.ok_or(Denied::Unknown)
    }

    /// Key `i`.
    pub fn key(&self, i: usize) -> &Key {
        &self.keys[i]
    }

    /// Takes one of key `i`'s sessions; `false` when it holds its `sessions=` already.
    pub fn hold(&self, i: usize) -> bool {
        let Ok(mut m) = self.held.lock() else {
            return false;
        };
        let n = m.entry(i).or_insert(0);
        if self.keys[i].max_sessions.is_some_and(|max| *n >= max) {
            return false;
        }
        *n += 1;
        true
    }

    /// Gives one of key `i`'s sessions back.
    pub fn release(&self, i: usize) {
        if let Ok(mut m) = self.held.lock() {
            if let Some(n) = m.get_mut(&i) {
                *n = n.saturating_sub(1);
            }
        }
    }
}

/// What [`Keys::load`] does not refuse but an operator cannot have meant: a keys file with no
/// key in it (blank, or comments only: the server would start open), or one with keys in the
/// clear that its group or others may read.
///
/// # Errors
///
/// A [`FileError`] naming the file and what to do.
pub fn check_keys_file(file: &Path) -> Result<(), FileError> {
    let text =
        crate::files::read_limited(file, 1 << 20).map_err(|e| FileError::new(file.display(), e))?;
    let text = String::from_utf8_lossy(&text);
    let entries: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    if entries.is_empty() {
        return Err(FileError::new(
            file.display(),
            "no key in it (only blank lines and comments): the server would start open to \
             anyone; add keys, or leave keys_file empty",
        ));
    }
    let clear = entries.iter().any(|e| !e.starts_with("sha256:"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(file)
            .map_err(|e| FileError::new(file.display(), e))?
            .permissions()
            .mode();
        if clear && mode & 0o077 != 0 {
            return Err(FileError::new(
                file.display(),
                format!(
                    "holds keys in the clear and its group or others may read it (mode {:03o}): \
                     chmod 600 it, or list the keys' sha256: digests instead",
                    mode & 0o777
                ),
            ));
        }
    }
    Ok(())
}

/// The key a request presents: the `kyutai-api-key` header, `Authorization: Bearer …`, the
/// `openai-insecure-api-key.…` WebSocket subprotocol (how a browser's OpenAI realtime client
/// passes its key), or the `auth_id` query parameter, in that order.
pub fn presented(headers: &HeaderMap, query: Option<&str>) -> Option<String> {
    if let Some(k) = headers.get("kyutai-api-key").and_then(|v| v.to_str().ok()) {
        return Some(k.trim().to_string());
    }
    if let Some(a) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        if let Some((scheme, token)) = a.trim().split_once(' ') {
            if scheme.eq_ignore_ascii_case("bearer") {
                return Some(token.trim().to_string());
            }
        }
    }
    if let Some(k) = headers
        .get_all(axum::http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix("openai-insecure-api-key."))
    {
        return Some(k.to_string());
    }
    let q = query?;
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == "auth_id")
        .map(|(_, v)| v.into_owned())
}

/// Whether a browser page of `origin` may open sessions on a server reached as `host`: its own
/// origin, a loopback page (`localhost`, `127.0.0.0/8`, `::1`), or one of `allowed`
/// (`https://app.example.com`, exact, scheme included; `*` allows every origin). A scheme's
/// default port is the same origin as none (`https://a.example:443` is `https://a.example`).
pub fn origin_allowed(origin: &str, host: Option<&str>, allowed: &[String]) -> bool {
    let origin = normal_origin(origin);
    if allowed
        .iter()
        .any(|a| a == "*" || normal_origin(a) == origin)
    {
        return true;
    }
    let Some((scheme, authority)) = origin.split_once("://") else {
        // `null` (a sandboxed page, a file) and anything else unparsable.
        return false;
    };
    if !matches!(scheme, "http" | "https") {
        return false;
    }
    let host = host.map(|h| normal_origin(&format!("{scheme}://{}", h.trim())));
    if host.is_some_and(|h| h == origin) {
        return true;
    }
    let name = match authority.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(n, _)| n),
    };
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// An origin as compared: lower-case, no trailing `/`, no default port (`:443` for `https`,
/// `:80` for `http`).
pub fn normal_origin(origin: &str) -> String {
    let o = origin.trim().trim_end_matches('/').to_ascii_lowercase();
    for (scheme, port) in [("https://", ":443"), ("http://", ":80")] {
        if o.starts_with(scheme) {
            if let Some(bare) = o.strip_suffix(port) {
                return bare.to_string();
            }
        }
    }
    o
}

/// Whether `origin` is one an operator may list: `*`, or `http(s)://host[:port]` with nothing
/// after the authority.
pub fn origin_well_formed(origin: &str) -> bool {
    if origin == "*" {
        return true;
    }
    let o = origin.trim_end_matches('/');
    let Some((scheme, authority)) = o.split_once("://") else {
        return false;
    };
    matches!(scheme.to_ascii_lowercase().as_str(), "http" | "https")
        && !authority.is_empty()
        && !authority.contains(['/', '@', '?', '#', ' '])
        && host_well_formed(authority)
}

/// Whether `host` is a host name or address, with an optional port: what a `Host` header or an
/// origin's authority holds.
pub fn host_well_formed(host: &str) -> bool {
    let (name, port) = match host.strip_prefix('[') {
        Some(rest) => {
            let Some((addr, after)) = rest.split_once(']') else {
                return false;
            };
            if addr.parse::<Ipv6Addr>().is_err() {
                return false;
            }
            ("ipv6", after)
        }
        None => match host.split_once(':') {
            Some((n, _)) => (n, &host[n.len()..]),
            None => (host, ""),
        },
    };
    let port_ok = match port.strip_prefix(':') {
        Some(p) => p.parse::<u16>().is_ok(),
        None => port.is_empty(),
    };
    let label = |l: &str| {
        !l.is_empty()
            && l.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '*')
    };
    port_ok && name.len() <= 253 && name.split('.').all(label)
}

/// A range of addresses: an address, or `address/prefix`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `10.0.0.0/8`, `::1`, `fd00::/8`.
    ///
    /// # Errors
    ///
    /// A message saying what is wrong.
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (a, p) = s.trim().split_once('/').unwrap_or((s.trim(), ""));
        let net: IpAddr = a
            .parse()
            .map_err(|_| format!("{s:?} is not an address or a range like 10.0.0.0/8"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let prefix = if p.is_empty() {
            max
        } else {
            p.parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix must be 0 to {max}"))?
        };
        Ok(Cidr { net, prefix })
    }

    /// Whether `ip` is in the range (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let m = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & m == u32::from(a) & m
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let m = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & m == u128::from(a) & m
            }
            _ => false,
        }
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 it is.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The address per-address limits count: an IPv4 address, or an IPv6 address's /64.
pub fn group(ip: IpAddr) -> IpAddr {
    match canonical(ip) {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & (u128::MAX << 64);
            IpAddr::V6(Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

/// The header a trusted proxy writes the client's address in (`forwarded_header`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardedHeader {
    /// `X-Forwarded-For` (nginx, Caddy, HAProxy's `option forwardfor`, most load balancers).
    #[default]
    XForwardedFor,
    /// `Forwarded: for=…` (RFC 7239).
    Forwarded,
}

impl ForwardedHeader {
    /// From the configuration's value.
    ///
    /// # Errors
    ///
    /// A message listing the values.
    pub fn parse(s: &str) -> Result<ForwardedHeader, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "x-forwarded-for" => Ok(ForwardedHeader::XForwardedFor),
            "forwarded" => Ok(ForwardedHeader::Forwarded),
            _ => Err(format!(
                "{:?}: x-forwarded-for or forwarded (the header your proxy writes)",
                super::config::shown(s)
            )),
        }
    }

    /// The header's name.
    pub fn name(self) -> &'static str {
        match self {
            ForwardedHeader::XForwardedFor => "x-forwarded-for",
            ForwardedHeader::Forwarded => "forwarded",
        }
    }
}

/// The client's address: `peer`, or when `peer` is one of `trusted` proxies, the rightmost
/// address of `header` (every line of it, in order) that is not itself a trusted proxy: what
/// our nearest proxy saw, not what a client wrote before it. The other header is not read. A
/// chain with no such address, or one that does not parse, leaves `peer`.
pub fn client_ip(
    peer: IpAddr,
    headers: &HeaderMap,
    trusted: &[Cidr],
    header: ForwardedHeader,
) -> IpAddr {
    let is_trusted = |ip: IpAddr| trusted.iter().any(|c| c.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let mut chain: Vec<Option<IpAddr>> = Vec::new();
    for v in headers.get_all(header.name()) {
        let Ok(v) = v.to_str() else {
            chain.push(None);
            continue;
        };
        for element in v.split(',') {
            match header {
                ForwardedHeader::XForwardedFor => chain.push(forwarded_ip(element)),
                ForwardedHeader::Forwarded => {
                    let node = element.split(';').find_map(|pair| {
                        let (k, val) = pair.trim().split_once('=')?;
                        k.trim().eq_ignore_ascii_case("for").then_some(val)
                    });
                    // An element without `for=` names no hop.
                    if let Some(val) = node {
                        chain.push(forwarded_ip(val));
                    }
                }
            }
        }
    }
    // From the nearest hop outwards: the first address our proxies did not add themselves. A
    // hop that does not parse ends the search: nothing beyond it is believed.
    for hop in chain.into_iter().rev() {
        match hop {
            Some(ip) if is_trusted(ip) => continue,
            Some(ip) => return ip,
            None => return peer,
        }
    }
    peer
}

/// `1.2.3.4`, `"[2001:db8::1]:4711"`, `1.2.3.4:80` → the address.
fn forwarded_ip(v: &str) -> Option<IpAddr> {
    let v = v.trim().trim_matches('"');
    if let Ok(ip) = v.parse() {
        return Some(ip);
    }
    if let Some(rest) = v.strip_prefix('[') {
        return rest.split(']').next()?.parse().ok();
    }
    v.rsplit_once(':')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn keys_by_value_or_digest_with_names_and_limits() {
        let digest = hex(&sha256(b"second-key-0123456789"));
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("keys");
        std::fs::write(
            &f,
            format!("# ops\nfirst-key-0123456789 name=alice sessions=1\n\nsha256:{digest}\n"),
        )
        .unwrap();
        let keys = Keys::load(Some(&f), Some("third-key-0123456789 name=ci")).unwrap();
        assert_eq!(keys.len(), 3);
        let a = keys.check(Some("first-key-0123456789")).unwrap();
        assert_eq!(keys.key(a).name, "alice");
        let b = keys.check(Some("second-key-0123456789")).unwrap();
        assert!(
            keys.key(b).name.starts_with("key2-"),
            "{}",
            keys.key(b).name
        );
        assert_eq!(
            keys.key(keys.check(Some("third-key-0123456789")).unwrap())
                .name,
            "ci"
        );
        assert_eq!(keys.check(None), Err(Denied::Missing));
        assert_eq!(keys.check(Some("")), Err(Denied::Missing));
        assert_eq!(
            keys.check(Some("first-key-012345678")),
            Err(Denied::Unknown)
        );
        assert!(keys.hold(a));
        assert!(!keys.hold(a), "alice holds one session at most");
        keys.release(a);
        assert!(keys.hold(a));
        for (text, needle) in [
            ("short", "too easy to guess"),
            ("sha256:abc", "64 hex digits"),
            ("long-enough-key-000 sessions=0", "sessions=0"),
            ("long-enough-key-000 colour=red", "colour=red"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = Keys::load(Some(&f), None).unwrap_err().to_string();
            assert!(e.contains("line 1") && e.contains(needle), "{e}");
            assert!(
                !e.contains("long-enough-key-000"),
                "the key is in the message: {e}"
            );
        }
    }

    #[test]
    fn a_key_comes_from_the_header_the_bearer_or_auth_id() {
        let h = headers(&[("kyutai-api-key", "k1")]);
        assert_eq!(presented(&h, Some("auth_id=k2")).as_deref(), Some("k1"));
        let h = headers(&[("authorization", "Bearer k3")]);
        assert_eq!(presented(&h, None).as_deref(), Some("k3"));
        let h = headers(&[(
            "sec-websocket-protocol",
            "realtime, openai-insecure-api-key.k5, openai-beta.realtime-v1",
        )]);
        assert_eq!(presented(&h, None).as_deref(), Some("k5"));
        let h = HeaderMap::new();
        assert_eq!(
            presented(&h, Some("text_topk=5&auth_id=k%2B4")).as_deref(),
            Some("k+4")
        );
        assert_eq!(presented(&h, Some("text_topk=5")), None);
    }

    #[test]
    fn origins_own_loopback_or_listed() {
        let allowed = vec!["https://app.example.com".to_string()];
        let host = Some("voice.example.com:8998");
        for ok in [
            "http://voice.example.com:8998",
            "http://localhost:3000",
            "http://127.0.0.1:8080",
            "http://[::1]:8000",
            "https://app.example.com/",
        ] {
            assert!(origin_allowed(ok, host, &allowed), "{ok}");
        }
        for bad in [
            "https://evil.example",
            "null",
            "http://voice.example.com:9999",
            "file://",
            "http://localhost.evil.example",
            "https://app.example.com.evil.example",
        ] {
            assert!(!origin_allowed(bad, host, &allowed), "{bad}");
        }
        assert!(origin_allowed("https://evil.example", host, &["*".into()]));
        // A scheme's default port is no port, on either side and for the server's own origin.
        for (origin, allowed) in [
            ("https://app.example.com:443", "https://app.example.com"),
            ("https://app.example.com", "https://app.example.com:443/"),
            ("HTTP://App.Example.com:80", "http://app.example.com"),
        ] {
            assert!(origin_allowed(origin, None, &[allowed.into()]), "{origin}");
        }
        assert!(!origin_allowed(
            "https://app.example.com:80",
            None,
            &["https://app.example.com".into()]
        ));
        assert!(origin_allowed(
            "https://voice.example.com:443",
            Some("voice.example.com"),
            &[]
        ));
    }

    #[test]
    fn origins_and_hosts_an_operator_may_list() {
        for ok in [
            "*",
            "https://app.example.com",
            "http://localhost:3000/",
            "https://[::1]:8443",
        ] {
            assert!(origin_well_formed(ok), "{ok}");
        }
        for bad in [
            "",
            "not a url",
            "app.example.com",
            "ftp://app.example.com",
            "https://",
            "https://app.example.com/path",
            "https://user@app.example.com",
            "https://app.example.com:99999",
            "https://a..b",
        ] {
            assert!(!origin_well_formed(bad), "{bad}");
        }
        for ok in [
            "voice.example.com",
            "localhost:8998",
            "[::1]:80",
            "10.0.0.1",
        ] {
            assert!(host_well_formed(ok), "{ok}");
        }
        for bad in ["", "a b", "x:y", "[::1", "host:", "::1"] {
            assert!(!host_well_formed(bad), "{bad}");
        }
    }

    #[test]
    fn forwarded_addresses_only_from_trusted_proxies_and_ipv6_by_64() {
        let trusted = vec![
            Cidr::parse("10.0.0.0/8").unwrap(),
            Cidr::parse("::1").unwrap(),
        ];
        let peer: IpAddr = "10.1.2.3".parse().unwrap();
        let client: IpAddr = "203.0.113.7".parse().unwrap();
        let xff = ForwardedHeader::XForwardedFor;
        let fwd = ForwardedHeader::Forwarded;
        let h = headers(&[("x-forwarded-for", "198.51.100.1, 203.0.113.7, 10.9.9.9")]);
        assert_eq!(client_ip(peer, &h, &trusted, xff), client);
        let h = headers(&[(
            "forwarded",
            "for=\"[2001:db8::5]:4711\";proto=https, for=10.0.0.2",
        )]);
        assert_eq!(
            client_ip(peer, &h, &trusted, fwd),
            "2001:db8::5".parse::<IpAddr>().unwrap()
        );
        // The header the proxy does not write is the client's own: never read. (nginx appends
        // to X-Forwarded-For and passes a client's Forwarded through.)
        let h = headers(&[
            ("forwarded", "for=192.0.2.99"),
            ("x-forwarded-for", "203.0.113.7"),
        ]);
        assert_eq!(client_ip(peer, &h, &trusted, xff), client);
        assert_eq!(
            client_ip(
                peer,
                &headers(&[("forwarded", "for=192.0.2.99")]),
                &trusted,
                xff
            ),
            peer
        );
        // A client's own X-Forwarded-For line, then the proxy's: the rightmost untrusted wins,
        // over several lines of the header too.
        let h = headers(&[
            ("x-forwarded-for", "192.0.2.99"),
            ("x-forwarded-for", "203.0.113.7"),
        ]);
        assert_eq!(client_ip(peer, &h, &trusted, xff), client);
        // From anyone else, the headers are theirs to forge: ignored.
        let stranger: IpAddr = "198.51.100.9".parse().unwrap();
        let h = headers(&[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(client_ip(stranger, &h, &trusted, xff), stranger);
        assert_eq!(
            client_ip(
                peer,
                &headers(&[("x-forwarded-for", "junk")]),
                &trusted,
                xff
            ),
            peer
        );
        // Nothing beyond a hop that does not parse is believed.
        let h = headers(&[("x-forwarded-for", "192.0.2.99, junk, 10.0.0.5")]);
        assert_eq!(client_ip(peer, &h, &trusted, xff), peer);
        assert_eq!(ForwardedHeader::parse("Forwarded"), Ok(fwd));
        assert!(ForwardedHeader::parse("x-real-ip").is_err());
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nope").is_err());
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("::ffff:1.2.3.4".parse().unwrap()));
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(group(a), group(b));
        assert_ne!(group(a), group(c));
        assert_eq!(group(client), client);
    }
}
