//! The `webrtc:` section: the UDP address every peer's media shares, the addresses announced
//! as candidates, the STUN/TURN servers the page is given, and the jitter buffer's delays.

use std::net::SocketAddr;
use std::time::Duration;

use super::WebRtcSettings;
use crate::config::fields::Fields;
use crate::config::{ConfigError, ConfigErrorKind};

const WEBRTC_KEYS: &[&str] = &[
    "enabled",
    "address",
    "public_addresses",
    "ice_servers",
    "turn_username",
    "turn_credential",
    "jitter_ms",
    "max_jitter_ms",
    "location_base",
];

/// The path of a `location_base` (itself when it is a path; a URL's path, `""` when it has
/// none).
pub(crate) fn path_of(base: &str) -> &str {
    match base.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("", |i| &rest[i..]),
        None => base,
    }
}

/// `location_base`: a path prefix (`/replica/a`) or an absolute `http(s)://` URL, without a
/// trailing slash, a query or a fragment.
fn read_location_base(w: &Fields<'_>) -> Result<String, ConfigError> {
    let base = w
        .string("location_base")?
        .trim()
        .trim_end_matches('/')
        .to_string();
    if base.is_empty() {
        return Ok(base);
    }
    let path = match base.split_once("://") {
        Some(("http" | "https", rest)) if !rest.is_empty() => path_of(&base),
        Some(_) => "/",
        None => base.as_str(),
    };
    let ok = path.is_empty()
        || (path.starts_with('/')
            && path.len() > 1
            && !path.contains("//")
            && path
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "/-_.~".contains(c)));
    if !ok {
        return Err(w.err(
            ConfigErrorKind::WrongType,
            "location_base",
            format!(
                "{base:?} is neither a path like /replica/a nor a URL like https://a.example.com \
                 (letters, digits and / - _ . ~ in its path, no query)"
            ),
        ));
    }
    Ok(base)
}

/// The `webrtc:` section.
pub(super) fn read_webrtc(
    w: &Fields<'_>,
    http: SocketAddr,
) -> Result<Option<WebRtcSettings>, ConfigError> {
    w.known(WEBRTC_KEYS)?;
    if !w.boolean("enabled")? {
        return Ok(None);
    }
    let address = match w.string("address")?.trim() {
        "" => http,
        a => a.parse().map_err(|e| {
            w.err(
                ConfigErrorKind::WrongType,
                "address",
                format!("{a:?} is not a UDP address like 0.0.0.0:8998 ({e})"),
            )
        })?,
    };
    let public_addresses = w
        .list(
            "public_addresses",
            "IP addresses like 203.0.113.7 or 203.0.113.7:8998",
        )?
        .iter()
        .map(|a| {
            a.parse::<SocketAddr>()
                .map(|s| (s.ip(), Some(s.port())))
                .or_else(|_| a.parse::<std::net::IpAddr>().map(|ip| (ip, None)))
                .map_err(|_| {
                    w.err(
                        ConfigErrorKind::WrongType,
                        "public_addresses",
                        format!("{a:?} is not an IP address (or address:port)"),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some((ip, _)) = public_addresses.iter().find(|(ip, _)| ip.is_unspecified()) {
        return Err(w.err(
            ConfigErrorKind::OutOfRange,
            "public_addresses",
            format!("{ip} is no address a peer can reach"),
        ));
    }
    let user = w.string("turn_username")?;
    let credential = w.string("turn_credential")?;
    let mut ice_servers = Vec::new();
    for url in w.list("ice_servers", "URLs like stun:stun.example.com:3478")? {
        let turn = url.starts_with("turn:") || url.starts_with("turns:");
        if !turn && !url.starts_with("stun:") && !url.starts_with("stuns:") {
            return Err(w.err(
                ConfigErrorKind::WrongType,
                "ice_servers",
                format!("{url:?} is not a stun:, stuns:, turn: or turns: URL"),
            ));
        }
        if turn && (user.trim().is_empty() || credential.is_empty()) {
            return Err(w.err(
                ConfigErrorKind::Missing,
                "turn_username",
                format!("{url} is a TURN server: it needs turn_username and turn_credential"),
            ));
        }
        let auth = turn.then(|| (user.trim().to_string(), credential.clone()));
        ice_servers.push((url, auth));
    }
    let jitter = w.number("jitter_ms", 0.0, 1000.0)?;
    let max_jitter = w.number("max_jitter_ms", 0.0, 5000.0)?;
    if max_jitter < jitter {
        return Err(w.err(
            ConfigErrorKind::OutOfRange,
            "max_jitter_ms",
            format!("{max_jitter} is less than jitter_ms ({jitter})"),
        ));
    }
    let location_base = read_location_base(w)?;
    Ok(Some(WebRtcSettings {
        location_base,
        address,
        public_addresses,
        ice_servers,
        jitter: Duration::from_secs_f64(jitter / 1000.0),
        max_jitter: Duration::from_secs_f64(max_jitter / 1000.0),
    }))
}
