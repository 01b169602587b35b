//! Who may reach the server, as the settings say: the host names it answers to, the browser
//! origins it lets in, the proxies it believes and the header they write, the API keys (from
//! `keys_file` and the environment), whether an open server on another machine's address was
//! meant, and Twilio's signing token and URL. Each value checked before anything is served.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use super::shown;
use crate::app::serve::access::{Cidr, ForwardedHeader, Keys};
use crate::config::fields::Fields;
use crate::config::{ConfigError, ConfigErrorKind};

/// The settings of the HTTP edge, checked.
pub(super) struct Edge {
    pub allowed_hosts: Vec<String>,
    pub allowed_origins: Vec<String>,
    pub forwarded_header: ForwardedHeader,
    pub trusted_proxies: Vec<Cidr>,
    pub keys: Keys,
    pub allow_anonymous: bool,
    pub protect_metrics: bool,
    pub twilio_auth_token: Option<String>,
    pub twilio_url: Option<String>,
}

/// Reads the edge's keys of `f` (`env`: the process environment as given, for the keys'
/// variable) for a server listening on `address`.
///
/// # Errors
///
/// A [`ConfigError`] naming the key at fault.
pub(super) fn read(
    f: &Fields<'_>,
    env: Option<&HashMap<String, String>>,
    address: SocketAddr,
) -> Result<Edge, ConfigError> {
    // Each entry of a list checked by `ok`; the first that is not names the key.
    let checked = |k: &str, what: &str, ok: fn(&str) -> bool, should: &str| {
        let items = f.list(k, what)?;
        match items.iter().find(|i| !ok(i)) {
            Some(bad) => Err(f.err(
                ConfigErrorKind::WrongType,
                k,
                format!("{:?} is not {should}", shown(bad)),
            )),
            None => Ok(items),
        }
    };
    let allowed_hosts: Vec<String> = checked(
        "allowed_hosts",
        "host names like voice.example.com",
        crate::app::serve::access::host_well_formed,
        "a host name like voice.example.com or *.example.com (no scheme, path or user)",
    )?
    .into_iter()
    .map(|h| h.to_ascii_lowercase())
    .collect();
    let allowed_origins = checked(
        "allowed_origins",
        "origins like https://app.example.com",
        crate::app::serve::access::origin_well_formed,
        "an origin like https://app.example.com (a scheme, http or https, and a host; no \
         path), or \"*\"",
    )?;
    let forwarded_header = ForwardedHeader::parse(&f.string("forwarded_header")?)
        .map_err(|m| f.err(ConfigErrorKind::WrongType, "forwarded_header", m))?;
    let trusted_proxies = f
        .list("trusted_proxies", "addresses or ranges like 10.0.0.0/8")?
        .iter()
        .map(|c| Cidr::parse(c))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|m| f.err(ConfigErrorKind::WrongType, "trusted_proxies", m))?;
    let keys_file = Some(f.string("keys_file")?)
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .map(PathBuf::from);
    let keys_env = env
        .and_then(|e| e.get(crate::app::serve::access::KEYS_ENV))
        .cloned();
    let keys = Keys::load(keys_file.as_deref(), keys_env.as_deref())
        .map_err(|e| f.err(ConfigErrorKind::Read, "keys_file", e.to_string()))?;
    if let Some(k) = &keys_file {
        crate::app::serve::access::check_keys_file(k)
            .map_err(|e| f.err(ConfigErrorKind::OutOfRange, "keys_file", e.to_string()))?;
    }
    let allow_anonymous = f.boolean("allow_anonymous")?;
    let protect_metrics = f.boolean("protect_metrics")?;
    if !address.ip().is_loopback() && !keys.any() && !allow_anonymous {
        return Err(f.err(
            ConfigErrorKind::OutOfRange,
            "address",
            format!(
                "{address} serves other machines, and no key is configured: anyone who reaches it \
                 would use the model. Give keys (`keys_file`, or {}), or say \
                 `allow_anonymous: true`",
                crate::app::serve::access::KEYS_ENV
            ),
        ));
    }
    let (twilio_auth_token, twilio_url) = read_twilio(f)?;
    Ok(Edge {
        allowed_hosts,
        allowed_origins,
        forwarded_header,
        trusted_proxies,
        keys,
        allow_anonymous,
        protect_metrics,
        twilio_auth_token,
        twilio_url,
    })
}

/// Twilio's auth token, and the URL it is given for the stream (wss:// or https://: Twilio
/// streams over TLS only, and signs that URL).
fn read_twilio(f: &Fields<'_>) -> Result<(Option<String>, Option<String>), ConfigError> {
    let nonempty = |v: String| Some(v.trim().to_string()).filter(|v| !v.is_empty());
    let twilio_auth_token = nonempty(f.string("twilio_auth_token")?);
    let twilio_url = nonempty(f.string("twilio_url")?);
    if let Some(u) = &twilio_url {
        let lower = u.to_ascii_lowercase();
        let authority = lower
            .strip_prefix("wss://")
            .or_else(|| lower.strip_prefix("https://"))
            .map(|rest| rest.split(['/', '?']).next().unwrap_or_default());
        if !authority.is_some_and(crate::app::serve::access::host_well_formed) {
            return Err(f.err(
                ConfigErrorKind::WrongType,
                "twilio_url",
                format!(
                    "{:?} is not the wss:// (or https://) URL Twilio is given for the stream, \
                     like wss://voice.example.com/twilio/media: Twilio streams over TLS only, \
                     and signs that URL",
                    shown(u)
                ),
            ));
        }
    }
    Ok((twilio_auth_token, twilio_url))
}
