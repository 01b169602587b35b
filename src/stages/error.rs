//! A stage builder's error: whether the configuration is wrong (fix it; exit code 2) or
//! something is not available now, the param at fault, and the error it came from (the
//! model's, an audio device's, a file's). Knows nothing of any stage kind.

/// Why a stage could not be built, so that the caller can tell a mistake in the configuration
/// (fix it; exit code 2) from something that is not available now (memory, a busy device: it
/// may work later, or built alone).
#[derive(Debug, Clone)]
pub struct BuildError {
    /// Which of the two.
    pub kind: BuildErrorKind,
    /// The param at fault, when one is.
    pub key: Option<&'static str>,
    /// What is wrong and what to do.
    pub message: String,
    /// The error it came from (the model's, an audio device's), when it came from one.
    cause: Option<std::sync::Arc<dyn std::error::Error + Send + Sync>>,
}

/// Equal when they say the same (kind, key, message), whatever they came from.
impl PartialEq for BuildError {
    fn eq(&self, other: &Self) -> bool {
        (self.kind, self.key, &self.message) == (other.kind, other.key, &other.message)
    }
}

impl Eq for BuildError {}

/// What a [`BuildError`] means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BuildErrorKind {
    /// The configuration is wrong (a file that is not what it should be, a value the model
    /// refuses, a device that does not exist): rejected; fix it.
    Invalid,
    /// Something the stage needs cannot be had now (memory, a device that exists but cannot
    /// be opened, a session ONNX Runtime cannot create): the same configuration may build
    /// later or on its own.
    Unavailable,
    /// What it asks for is full now (every slot of a shared engine taken): it builds once
    /// something is given back.
    Busy,
}

impl BuildError {
    /// A mistake in the configuration.
    pub fn invalid(message: impl Into<String>) -> Self {
        BuildError {
            kind: BuildErrorKind::Invalid,
            key: None,
            message: message.into(),
            cause: None,
        }
    }

    /// Something not available now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        BuildError {
            kind: BuildErrorKind::Unavailable,
            key: None,
            message: message.into(),
            cause: None,
        }
    }

    /// Names the param at fault.
    pub fn key(mut self, key: &'static str) -> Self {
        self.key = Some(key);
        self
    }

    /// The same error, come from `cause`.
    fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(std::sync::Arc::new(cause));
        self
    }

    /// The error it came from (a [`ModelError`](crate::model::ModelError), an
    /// [`AudioError`](crate::audio::AudioError)), for a caller that tells them apart. Its
    /// message is this error's already, so it is not also [`source`](std::error::Error::source):
    /// a chain printed whole would say it twice.
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.cause.as_deref()
    }
}

impl std::fmt::Display for BuildError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for BuildError {}

impl From<crate::files::FileError> for BuildError {
    fn from(e: crate::files::FileError) -> Self {
        BuildError::invalid(e.to_string()).caused_by(e)
    }
}

impl From<crate::model::ModelError> for BuildError {
    fn from(e: crate::model::ModelError) -> Self {
        use crate::model::ModelError as M;
        let unavailable = matches!(e, M::Ort { .. });
        let busy = matches!(e, M::Busy { .. });
        let key = match &e {
            M::Manifest { .. } | M::Pack { .. } | M::Contract { .. } => Some("pack"),
            M::Provider { .. } => Some("execution_provider"),
            _ => None,
        };
        BuildError {
            kind: if busy {
                BuildErrorKind::Busy
            } else if unavailable {
                BuildErrorKind::Unavailable
            } else {
                BuildErrorKind::Invalid
            },
            key,
            message: e.to_string(),
            cause: None,
        }
        .caused_by(e)
    }
}

impl From<crate::audio::AudioError> for BuildError {
    fn from(e: crate::audio::AudioError) -> Self {
        use crate::audio::AudioError as A;
        let b = match e {
            // Found but not opened: busy, or the server is restarting.
            A::Device { .. } => BuildError::unavailable(e.to_string()).key("device"),
            A::NoDevice { .. } => BuildError::invalid(e.to_string()).key("device"),
            _ => BuildError::invalid(e.to_string()),
        };
        b.caused_by(e)
    }
}
