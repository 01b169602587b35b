//! What primes a conversation: a persona as token ids (text encoded with the pack's tokenizer,
//! or ids as given, checked against the text vocabulary) and the script of forced steps that
//! primes the voice and the persona before the first user frame, as PersonaPlex does it.
//! Knows the pack's manifest, not how the steps are run.

use super::pack::PackManifest;

/// Forced tokens of one step (priming).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForcedStep {
    /// User codes.
    pub user: Vec<i64>,
    /// Forced text token.
    pub text: Option<i64>,
    /// Forced agent codes.
    pub agent: Option<Vec<i64>>,
}

/// Why a persona cannot be primed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PersonaError {
    /// Both forms were given.
    #[error("give `persona` or `persona_tokens`, not both")]
    Both,
    /// Text without a tokenizer to encode it.
    #[error(
        "`persona` text needs a tokenizer: set `tokenizer:` (a SentencePiece .model) or give `persona_tokens`"
    )]
    NoTokenizer,
    /// The tokenizer failed.
    #[error("{0}")]
    Encode(String),
    /// An id outside the text vocabulary.
    #[error("persona token {token} is out of range 0..{vocab} (the pack's text vocabulary)")]
    OutOfRange {
        /// The id.
        token: i64,
        /// The vocabulary size.
        vocab: i64,
        /// It came from encoding text (not from `persona_tokens`).
        from_text: bool,
    },
}

impl PersonaError {
    /// The setting at fault: `persona` or `persona_tokens`.
    pub fn key(&self) -> &'static str {
        match self {
            PersonaError::OutOfRange {
                from_text: false, ..
            } => "persona_tokens",
            _ => "persona",
        }
    }
}

/// A persona as token ids: `text` encoded with `tokenizer` (wrapped as PersonaPlex primes it),
/// or `tokens` as given, every id checked against the pack's text vocabulary. The one check
/// shared by a stage being built, a persona changed live, and a configuration being checked.
///
/// # Errors
///
/// A [`PersonaError`] saying what to fix.
pub fn persona_tokens(
    m: &PackManifest,
    tokenizer: Option<&super::tokenizer::Tokenizer>,
    text: Option<&str>,
    tokens: &[i64],
) -> Result<Vec<i64>, PersonaError> {
    let ids = match (text, tokens) {
        (Some(_), [_, ..]) => return Err(PersonaError::Both),
        (Some(t), _) => match tokenizer {
            Some(tok) => tok
                .encode_persona(t)
                .map_err(|e| PersonaError::Encode(e.to_string()))?,
            None => return Err(PersonaError::NoTokenizer),
        },
        (None, ids) => ids.to_vec(),
    };
    if let Some(&t) = ids.iter().find(|t| !(0..m.text_vocab).contains(*t)) {
        return Err(PersonaError::OutOfRange {
            token: t,
            vocab: m.text_vocab,
            from_text: text.is_some(),
        });
    }
    Ok(ids)
}

/// The steps that prime the model before a conversation, as PersonaPlex does it, with the sine
/// codes on the user stream throughout:
///
/// 1. the voice prompt's codes forced on the agent channels, text forced to padding (optional);
/// 2. `silence_frames` of silence codes with padding text (always, even without a voice);
/// 3. the persona's text tokens, one per step, agent forced to silence (optional);
/// 4. `silence_frames` more of silence.
pub fn priming_script(
    m: &PackManifest,
    voice: Option<&[Vec<i64>]>,
    persona: &[i64],
    silence_frames: usize,
) -> Vec<ForcedStep> {
    let step = |text: i64, agent: &[i64]| ForcedStep {
        user: m.sine_codes.clone(),
        text: Some(text),
        agent: Some(agent.to_vec()),
    };
    let mut s = Vec::new();
    for codes in voice.unwrap_or(&[]) {
        s.push(step(m.text_padding, codes));
    }
    s.extend((0..silence_frames).map(|_| step(m.text_padding, &m.silence_codes)));
    s.extend(persona.iter().map(|&t| step(t, &m.silence_codes)));
    s.extend((0..silence_frames).map(|_| step(m.text_padding, &m.silence_codes)));
    s
}
