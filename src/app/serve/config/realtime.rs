//! The `realtime:` section: what `/v1/realtime` adds to a session, the voice-activity
//! detector that reports the user's turns (Silero VAD's ONNX model) and the names of OpenAI's
//! voices mapped to this server's.

use std::path::PathBuf;

use super::{RealtimeSettings, ServeConfig, DEFAULTS_ORIGIN};
use crate::config::fields::Fields;
use crate::config::{ConfigError, ConfigErrorKind};

const REALTIME_KEYS: &[&str] = &["vad_model", "voices"];

/// The `realtime:` section.
pub(super) fn read_realtime(r: &Fields<'_>) -> Result<RealtimeSettings, ConfigError> {
    r.known(REALTIME_KEYS)?;
    let vad_model = match r.string("vad_model")?.trim() {
        "" => None,
        p => Some(PathBuf::from(p)),
    };
    // The built-in default names where `tools/setup.sh` puts the model: its absence only
    // leaves the detector off. A file the user named must be there.
    let vad_required = vad_model.is_some() && !r.origin("vad_model").starts_with(DEFAULTS_ORIGIN);
    let mut voices = Vec::new();
    if let Some(v) = r.optional_table("voices")? {
        for name in v.keys() {
            let to = v.string(&name)?;
            if to.trim().is_empty() {
                return Err(v.err(
                    ConfigErrorKind::WrongType,
                    &name,
                    "expected the file name of a voice prompt in `voices` (GET /api/voices lists them)",
                ));
            }
            voices.push((name, to.trim().to_string()));
        }
    }
    Ok(RealtimeSettings {
        vad_model,
        vad_required,
        voices,
    })
}

/// Each voice `voices` maps a name to is one of the server's (`config`'s voices folder): an
/// error names the mapped name's key.
pub(super) fn check_voices(r: &Fields<'_>, config: &ServeConfig) -> Result<(), ConfigError> {
    if config.realtime.voices.is_empty() {
        return Ok(());
    }
    let v = r.table("voices")?;
    for (name, to) in &config.realtime.voices {
        config
            .voice_path(to)
            .map_err(|m| v.err(ConfigErrorKind::Read, name, m))?;
    }
    Ok(())
}
