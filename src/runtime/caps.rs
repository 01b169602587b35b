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
    /// A message saying what was wanted and what comes.
    pub fn require(&self, key: &str, want: i64, what: &str) -> Result<(), String> {
        match self.get(key) {
            Some(v) if v != want => Err(format!("{what}: needs {want}, gets {v}")),
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
