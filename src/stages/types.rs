//! The frame types stages exchange, registered with the runtime.

pub use crate::audio::Pcm;
use crate::runtime::FrameData;

impl FrameData for Pcm {
    const NAME: &'static str = "Pcm";
}

pub use crate::model::lm::{LmStep, Sampled};

/// One frame of audio codes (one code per codebook).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Codes(pub Vec<i64>);

impl FrameData for Codes {
    const NAME: &'static str = "Codes";
}

impl FrameData for LmStep {
    const NAME: &'static str = "LmStep";
}

impl FrameData for Sampled {
    const NAME: &'static str = "Tokens";
}

/// One frame of the agent's output: its text token and audio codes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentTokens {
    /// Index of the agent frame in the conversation (0, 1, …).
    pub index: u64,
    /// Text token.
    pub text: i64,
    /// Audio codes (one per codebook).
    pub audio: Vec<i64>,
    /// The text token as text, when a tokenizer is configured.
    pub piece: Option<String>,
}

impl FrameData for AgentTokens {
    const NAME: &'static str = "AgentTokens";
}

/// The [`Caps`](crate::runtime::Caps) properties stage kinds declare, so that mismatches are
/// refused before start.
pub mod caps {
    use crate::runtime::CapsError;

    /// Sample rate of `Pcm` frames, Hz.
    pub const RATE: &str = "rate";
    /// Samples per `Pcm` frame (when every frame has the same number).
    pub const SAMPLES: &str = "samples";
    /// Codes per frame of `Codes` and `AgentTokens`.
    pub const CODEBOOKS: &str = "codebooks";
    /// Codes are below this.
    pub const VOCAB: &str = "vocab";

    /// Checks a Pcm input against a rate and, when `samples` is given, a frame size; a
    /// refusal says which stages to put before this one.
    pub fn require_pcm(
        c: &crate::runtime::Caps,
        rate: u32,
        samples: Option<usize>,
    ) -> Result<(), CapsError> {
        let fix = |what: crate::runtime::CapsMismatch| match samples {
            Some(n) => CapsError::fix(
                what,
                format!(
                    "put `resample` (to: {rate}) and `framer` (size: {n}, rate: {rate}) before it"
                ),
            ),
            None => CapsError::fix(
                what,
                format!("put a `resample` stage (to: {rate}) before it"),
            ),
        };
        c.require(RATE, rate as i64, "sample rate (Hz)")
            .map_err(fix)?;
        if let Some(n) = samples {
            c.require(SAMPLES, n as i64, "samples per frame")
                .map_err(fix)?;
        }
        Ok(())
    }

    /// Checks a codes input against a codebook count and vocabulary.
    pub fn require_codes(
        c: &crate::runtime::Caps,
        codebooks: usize,
        vocab: i64,
    ) -> Result<(), CapsError> {
        c.require(
            CODEBOOKS,
            codebooks as i64,
            "codes per frame (the pack's codebooks)",
        )?;
        match c.get(VOCAB) {
            Some(v) if v > vocab => Err(CapsError::Other(format!(
                "codes up to {v} may come, but the pack's codebooks hold {vocab} entries"
            ))),
            _ => Ok(()),
        }
    }
}

/// A piece of a network client's Ogg/Opus byte stream (either direction), or a gap in it: the
/// client sent nothing for that long and silence stands in for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OggOpus {
    /// Bytes of the stream, split anywhere.
    Bytes(Vec<u8>),
    /// Samples (24 kHz) of silence in the client's place.
    Silence(usize),
}

impl FrameData for OggOpus {
    const NAME: &'static str = "OggOpus";
}
