//! The `providers:` section: how the telephony providers' media streams (Telnyx, Plivo,
//! Vonage, Exotel) prove a call is theirs. A server with API keys takes a provider's calls only
//! when its secret is set, so that the telephone is never the one open door.

use super::Providers;
use crate::config::fields::Fields;
use crate::config::ConfigError;

const PROVIDER_KEYS: &[&str] = &[
    "telnyx_stream_token",
    "plivo_auth_token",
    "plivo_url",
    "vonage_signature_secret",
    "exotel_credentials",
];

/// The `providers:` section.
pub(super) fn read_providers(p: &Fields<'_>) -> Result<Providers, ConfigError> {
    p.known(PROVIDER_KEYS)?;
    let set = |k: &str| -> Result<Option<String>, ConfigError> {
        Ok(Some(p.string(k)?.trim().to_string()).filter(|v| !v.is_empty()))
    };
    let exotel = set("exotel_credentials")?;
    if exotel.as_ref().is_some_and(|c| !c.contains(':')) {
        return Err(p.err(
            crate::config::ConfigErrorKind::WrongType,
            "exotel_credentials",
            "KEY:TOKEN, as in the applet's wss://KEY:TOKEN@host URL",
        ));
    }
    Ok(Providers {
        telnyx_stream_token: set("telnyx_stream_token")?,
        plivo_auth_token: set("plivo_auth_token")?,
        plivo_url: set("plivo_url")?,
        vonage_signature_secret: set("vonage_signature_secret")?,
        exotel_credentials: exotel,
    })
}
