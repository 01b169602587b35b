//! The `sip:` section: phone calls answered over SIP (off by default): where SIP listens, the
//! address announced behind NAT, the RTP ports, who may call (an allow-list of addresses,
//! Digest credentials), the jitter buffer, how long a silent caller's RTP is waited for, how many
//! TCP connections SIP holds and the session timer's longest interval.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::SipSettings;
use crate::app::serve::access::Cidr;
use crate::app::serve::sip::StreamLimits;
use crate::config::fields::Fields;
use crate::config::{ConfigError, ConfigErrorKind};

const SIP_KEYS: &[&str] = &[
    "enabled",
    "address",
    "tcp",
    "public_address",
    "rtp_ports",
    "allow",
    "digest_username",
    "digest_password",
    "realm",
    "ring_ms",
    "rtp_timeout_s",
    "jitter_ms",
    "max_jitter_ms",
    "tcp_max_connections",
    "tcp_connections_per_ip",
    "session_expires_s",
    "min_se_s",
];

/// The `sip:` section; `keys`: whether the server has API keys (a server with keys takes calls
/// only from an allow-list or with credentials).
pub(super) fn read_sip(s: &Fields<'_>, keys: bool) -> Result<Option<SipSettings>, ConfigError> {
    s.known(SIP_KEYS)?;
    if !s.boolean("enabled")? {
        return Ok(None);
    }
    let a = s.string("address")?;
    let address: SocketAddr = a.trim().parse().map_err(|e| {
        s.err(
            ConfigErrorKind::WrongType,
            "address",
            format!("{a:?} is not an address like 0.0.0.0:5060 ({e})"),
        )
    })?;
    let public_address = match s.string("public_address")?.trim() {
        "" => None,
        p => Some(p.parse::<IpAddr>().map_err(|_| {
            s.err(
                ConfigErrorKind::WrongType,
                "public_address",
                format!("{p:?} is not an IP address"),
            )
        })?),
    };
    if public_address.is_some_and(|ip| ip.is_unspecified()) {
        return Err(s.err(
            ConfigErrorKind::OutOfRange,
            "public_address",
            "0.0.0.0 is no address a caller can reach",
        ));
    }
    let rtp_ports = match s.string("rtp_ports")?.trim() {
        "" => None,
        r => {
            let bad = || {
                s.err(
                    ConfigErrorKind::WrongType,
                    "rtp_ports",
                    format!("{r:?} is not a range like 10000-20000 (two ports or more, low first)"),
                )
            };
            let (lo, hi) = r.split_once('-').ok_or_else(bad)?;
            let (lo, hi): (u16, u16) = (
                lo.trim().parse().map_err(|_| bad())?,
                hi.trim().parse().map_err(|_| bad())?,
            );
            if lo == 0 || hi <= lo {
                return Err(bad());
            }
            Some((lo, hi))
        }
    };
    let allow = s
        .list("allow", "addresses or ranges like 10.0.0.0/8")?
        .iter()
        .map(|c| Cidr::parse(c))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|m| s.err(ConfigErrorKind::WrongType, "allow", m))?;
    let user = s.string("digest_username")?.trim().to_string();
    let password = s.string("digest_password")?;
    let digest = match (user.is_empty(), password.is_empty()) {
        (true, true) => None,
        (false, false) => Some((user, password)),
        _ => {
            return Err(s.err(
                ConfigErrorKind::Missing,
                "digest_password",
                "digest_username and digest_password go together",
            ))
        }
    };
    if keys && allow.is_empty() && digest.is_none() {
        return Err(s.err(
            ConfigErrorKind::Missing,
            "allow",
            "this server has keys: SIP calls need an allow-list (sip.allow) or credentials \
             (sip.digest_username, sip.digest_password)",
        ));
    }
    let ms = |k: &str, max: f64| -> Result<Duration, ConfigError> {
        Ok(Duration::from_secs_f64(s.number(k, 0.0, max)? / 1000.0))
    };
    let jitter = ms("jitter_ms", 1000.0)?;
    let max_jitter = ms("max_jitter_ms", 5000.0)?;
    if max_jitter < jitter {
        return Err(s.err(
            ConfigErrorKind::OutOfRange,
            "max_jitter_ms",
            "less than jitter_ms",
        ));
    }
    let session_expires = Duration::from_secs(s.number("session_expires_s", 1.0, 86_400.0)? as u64);
    let min_se = Duration::from_secs(s.number("min_se_s", 1.0, 86_400.0)? as u64);
    if min_se > session_expires {
        return Err(s.err(
            ConfigErrorKind::OutOfRange,
            "min_se_s",
            "more than session_expires_s",
        ));
    }
    Ok(Some(SipSettings {
        address,
        tcp: s.boolean("tcp")?,
        public_address,
        rtp_ports,
        allow,
        digest,
        realm: s.string("realm")?.trim().to_string(),
        ring: ms("ring_ms", 60_000.0)?,
        rtp_timeout: Duration::from_secs_f64(s.number("rtp_timeout_s", 0.5, 3600.0)?),
        jitter,
        max_jitter,
        tcp_limits: StreamLimits {
            per_ip: s.number("tcp_connections_per_ip", 1.0, 100_000.0)? as usize,
            total: s.number("tcp_max_connections", 1.0, 1_000_000.0)? as usize,
        },
        session_expires,
        min_se,
    }))
}
