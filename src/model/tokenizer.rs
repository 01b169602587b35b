//! Text tokens: SentencePiece encoding of persona text, and text for the agent's token stream.
//!
//! Encoding goes through a Rust implementation of SentencePiece (`sentencepiece-rs`: the model's
//! own normalisation rules and segmentation, the C++ library's ids). A transcript is assembled
//! piece by piece from the model's piece table, byte-fallback pieces included, without decoding
//! partial UTF-8.

use std::path::{Path, PathBuf};

use sentencepiece_rs::{PieceType, SentencePieceProcessor};

use super::error::ModelError;

/// What a piece is, from the model file.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    /// Text (`▁` stands for a space).
    Text(String),
    /// One byte of UTF-8 (byte fallback, `<0xAB>`).
    Byte(u8),
    /// Control, unknown or unused: no text.
    Silent,
}

/// A SentencePiece model.
pub struct Tokenizer {
    sp: SentencePieceProcessor,
    pieces: Vec<Piece>,
    path: PathBuf,
}

/// The pieces of a model, in id order, as a transcript shows them.
fn read_pieces(sp: &SentencePieceProcessor) -> Vec<Piece> {
    sp.model()
        .pieces()
        .iter()
        .map(|p| match p.kind {
            PieceType::Normal | PieceType::UserDefined => {
                Piece::Text(p.piece.replace('\u{2581}', " "))
            }
            PieceType::Byte => p
                .piece
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .map_or(Piece::Silent, Piece::Byte),
            _ => Piece::Silent,
        })
        .collect()
}

impl Tokenizer {
    /// Loads a SentencePiece `.model` file.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] naming the file when it cannot be read or is not a SentencePiece model.
    pub fn open(path: &Path) -> Result<Tokenizer, ModelError> {
        let err = |detail: String| ModelError::Pack {
            path: path.to_path_buf(),
            detail,
        };
        // Bounded, and a FIFO refused rather than waited on; the real models are under 1 MiB.
        let bytes = crate::files::read_limited(path, 64 << 20).map_err(|e| err(e.to_string()))?;
        let sp = SentencePieceProcessor::from_serialized_model(&bytes)
            .map_err(|e| err(format!("not a SentencePiece model: {e}")))?;
        let pieces = read_pieces(&sp);
        Ok(Tokenizer {
            sp,
            pieces,
            path: path.to_path_buf(),
        })
    }

    /// Pieces in the vocabulary.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// Whether the vocabulary is empty.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Token ids of `text`.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] if SentencePiece fails.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>, ModelError> {
        self.sp
            .encode_to_ids(text)
            .map(|v| v.into_iter().map(|id| id as i64).collect())
            .map_err(|e| ModelError::Pack {
                path: self.path.clone(),
                detail: format!("encoding {text:?}: {e}"),
            })
    }

    /// Token ids of a persona: the text wrapped in `<system> … <system>` (unless it already is),
    /// as PersonaPlex primes it.
    ///
    /// # Errors
    ///
    /// As [`encode`](Self::encode).
    pub fn encode_persona(&self, text: &str) -> Result<Vec<i64>, ModelError> {
        let t = text.trim();
        if t.starts_with("<system>") && t.ends_with("<system>") && t.len() > 16 {
            self.encode(t)
        } else {
            self.encode(&format!("<system> {t} <system>"))
        }
    }
}

/// Turns a stream of token ids into text, piece by piece.
pub struct Transcript {
    pending: Vec<u8>,
}

impl Default for Transcript {
    fn default() -> Self {
        Self::new()
    }
}

impl Transcript {
    /// An empty transcript.
    pub fn new() -> Self {
        Transcript {
            pending: Vec::new(),
        }
    }

    /// The text that token `id` adds, if any: nothing for control tokens (padding), nothing yet
    /// for the first bytes of a multi-byte character.
    pub fn push(&mut self, tok: &Tokenizer, id: i64) -> Option<String> {
        let piece = usize::try_from(id).ok().and_then(|i| tok.pieces.get(i))?;
        match piece {
            Piece::Silent => None,
            Piece::Text(t) => {
                let mut s = self.take_pending();
                s.push_str(t);
                Some(s)
            }
            Piece::Byte(b) => {
                self.pending.push(*b);
                match std::str::from_utf8(&self.pending) {
                    Ok(s) => {
                        let s = s.to_string();
                        self.pending.clear();
                        Some(s)
                    }
                    Err(e) if e.error_len().is_some() || self.pending.len() >= 4 => {
                        Some(self.take_pending())
                    }
                    Err(_) => None,
                }
            }
        }
    }

    fn take_pending(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}
