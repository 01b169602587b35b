//! What is known about a port's frames before anything runs, so that mismatches between
//! stages are refused at build time rather than at the first frame.
//!
//! [`Caps`] are named integer properties of the frames on a port (a stage kind might declare
//! `rate`, `samples` per frame, `codebooks`); the runtime gives them no meaning. Before start,
//! [`PipelineBuilder`](super::PipelineBuilder) walks the graph from the sources, asks each
//! stage what it emits given what it receives ([`Stage::caps`](super::Stage::caps),
//! [`Source::caps`](super::Source::caps)), and turns a stage's refusal into a
//! [`GraphError`](super::GraphError) naming the link. A property nobody declared is unknown,
//! and unknown properties are never a mismatch.

use std::collections::BTreeMap;
use std::fmt;

/// Named properties of the frames on one port; absent = unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Caps(BTreeMap<&'static str, i64>);

impl Caps {
    /// Nothing known.
    pub fn new() -> Self {
        Caps::default()
    }

    /// With `key` known to be `value`.
    pub fn with(mut self, key: &'static str, value: i64) -> Self {
        self.0.insert(key, value);
        self
    }

    /// The value of `key`, when known.
    pub fn get(&self, key: &str) -> Option<i64> {
        self.0.get(key).copied()
    }

    /// Refuses frames whose `key` is known and is not `want`; `what` describes the property
    /// for the message (`samples per frame`).
    ///
    /// # Errors
    ///
    /// A [`CapsMismatch`] saying what was wanted and what comes.
    pub fn require(&self, key: &str, want: i64, what: &str) -> Result<(), CapsMismatch> {
        match self.get(key) {
            Some(v) if v != want => Err(CapsMismatch {
                what: what.to_string(),
                want,
                got: v,
            }),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|(k, v)| format!("{k} {v}")).collect();
        f.write_str(&parts.join(", "))
    }
}

/// Frames whose property is not what a stage needs (`sample rate (Hz): needs 24000, gets
/// 48000`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapsMismatch {
    /// The property, in words.
    pub what: String,
    /// What the stage needs.
    pub want: i64,
    /// What comes.
    pub got: i64,
}

impl fmt::Display for CapsMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: needs {}, gets {}", self.what, self.want, self.got)
    }
}

impl std::error::Error for CapsMismatch {}

/// Why a stage refuses what its inputs bring (before start; the runtime adds the link).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CapsError {
    /// One property is not what the stage needs, and what to put before the stage to fix it
    /// (`put a `resample` stage (to: 24000) before it`), when something can.
    Mismatch {
        /// What is needed and what comes.
        mismatch: CapsMismatch,
        /// What to do about it.
        fix: Option<String>,
    },
    /// Anything else, in words (a device that cannot play the rate that comes).
    Other(String),
}

impl CapsError {
    /// A mismatch with what fixes it.
    pub fn fix(mismatch: CapsMismatch, fix: impl Into<String>) -> Self {
        CapsError::Mismatch {
            mismatch,
            fix: Some(fix.into()),
        }
    }
}

impl From<CapsMismatch> for CapsError {
    fn from(mismatch: CapsMismatch) -> Self {
        CapsError::Mismatch {
            mismatch,
            fix: None,
        }
    }
}

impl fmt::Display for CapsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CapsError::Mismatch {
                mismatch,
                fix: None,
            } => write!(f, "{mismatch}"),
            CapsError::Mismatch {
                mismatch,
                fix: Some(fix),
            } => write!(f, "{mismatch}: {fix}"),
            CapsError::Other(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CapsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CapsError::Mismatch { mismatch, .. } => Some(mismatch),
            CapsError::Other(_) => None,
        }
    }
}
