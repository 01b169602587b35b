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
