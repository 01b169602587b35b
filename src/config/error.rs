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
}

/// A mistake in a pipeline file, with where it is.
///
/// Rendered as `FILE: stage `NAME`: key `KEY`: MESSAGE`, omitting what does not apply.
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
        }
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
        write!(f, "{}", self.file)?;
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
