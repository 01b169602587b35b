//! Measuring full-duplex behaviour: the field's metrics, computed from timestamps (ASR words,
//! voice-activity segments), as pure functions.
//!
//! - [`fdb`]: Full-Duplex-Bench's v1 and v1.5 timestamp metrics.
//! - [`silero`]: speech segments from Silero VAD's probabilities, by its offline rules.
//! - [`paired`]: two systems on the same inputs: McNemar's exact test, bootstrap intervals of
//!   paired differences, where token streams part.
//!
//! Knows nothing of files, audio or packs: `duplex eval` ([`crate::app::eval`]) reads those.

pub mod fdb;
pub mod paired;
pub mod silero;
