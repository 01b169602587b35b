//! The configuration layer's error type: what is wrong, in which file, stage and key.

use std::fmt;

/// What kind of mistake a [`ConfigError`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The file cannot be read.
    Read,
    /// The file is not valid YAML.
    Syntax,
    /// A key that means nothing at this level.
    UnknownKey,
    /// A stage `kind` that does not exist.
    UnknownKind,
    /// A param the stage kind does not have.
    UnknownParam,
    /// A value of the wrong type.
    WrongType,
    /// A value outside its allowed range or set.
    OutOfRange,
    /// A required value is missing.
    Missing,
    /// A link that is malformed or does not fit the graph (dangling, mistyped, cyclic…).
    Link,
    /// A stage could not be built from valid params (a file that cannot be opened…).
    Build,
    /// A stage needs something that is not available now (memory, a device that exists but
    /// cannot be opened): the configuration itself may be right.
    Unavailable,
    /// What the stage asks for is full now (every slot of a shared engine taken): the same
    /// configuration builds once something is given back. A run-time condition (exit 1).
    Busy,
    /// Valid values that cannot go together: two stages writing one file, a sink overwriting
    /// a source's input.
    Conflict,
}

/// A mistake in a pipeline file, with where it is.
///
/// Rendered as `FILE: stage `NAME`: `KEY`: MESSAGE`, omitting what does not apply; a value
/// that came from another layer leads with it: `environment variable DUPLEX__X (over FILE): …`.
#[derive(Debug, Clone)]
pub struct ConfigError {
    /// The pipeline file.
    pub file: String,
    /// The stage concerned, if any.
    pub stage: Option<String>,
    /// The key concerned (a param name, `links[2].overflow`…), if any.
    pub key: Option<String>,
    /// What kind of mistake.
    pub kind: ConfigErrorKind,
    /// What is wrong and, where possible, what to do.
    pub message: String,
    /// The layer that supplied the offending value when it is not `file` itself: an
    /// environment variable, a `--set` flag, the daemon's configuration file.
    pub origin: Option<Box<str>>,
}

impl ConfigError {
    /// An error in `file`.
    pub fn new(file: &str, kind: ConfigErrorKind, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.into(),
            stage: None,
            key: None,
            kind,
            message: message.into(),
            origin: None,
        }
    }

    /// Blames the layer `v` came from, when it is not the file itself.
    pub fn from_value(mut self, v: &config::Value) -> Self {
        if let Some(o) = super::layers::foreign_origin(v, &self.file) {
            self.origin = Some(o.into());
        }
        self
    }

    /// Sets the stage.
    pub fn stage(mut self, stage: impl Into<String>) -> Self {
        self.stage = Some(stage.into());
        self
    }

    /// Sets the key.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.origin {
            Some(o) => write!(f, "{o} (over {})", self.file)?,
            None => write!(f, "{}", self.file)?,
        }
        if let Some(s) = &self.stage {
            write!(f, ": stage `{s}`")?;
        }
        if let Some(k) = &self.key {
            write!(f, ": `{k}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

impl From<crate::yaml::YamlError> for ConfigError {
    fn from(e: crate::yaml::YamlError) -> Self {
        let kind = match e.kind {
            crate::yaml::YamlErrorKind::Read => ConfigErrorKind::Read,
            crate::yaml::YamlErrorKind::Syntax => ConfigErrorKind::Syntax,
        };
        ConfigError::new(&e.file, kind, e.message)
    }
}
