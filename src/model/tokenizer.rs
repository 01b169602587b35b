//! Text tokens: SentencePiece encoding of persona text, and text for the agent's token stream.
//!
//! Encoding goes through the SentencePiece library itself (exact normalisation and
//! segmentation). The id → piece table is read from the model file (a protobuf `ModelProto`), so
//! that a transcript can be assembled piece by piece, byte-fallback pieces included, without
//! decoding partial UTF-8.

use std::path::{Path, PathBuf};

use sentencepiece::SentencePieceProcessor;

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

fn varint(b: &[u8], i: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*i)?;
        *i += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// One protobuf field: number, wire type, varint value (wire type 0), bytes (wire type 2).
type Field<'a> = (u64, u64, u64, &'a [u8]);

/// Walks the fields of one protobuf message.
fn fields(b: &[u8]) -> Option<Vec<Field<'_>>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let key = varint(b, &mut i)?;
        let (field, wt) = (key >> 3, key & 7);
        match wt {
            0 => out.push((field, wt, varint(b, &mut i)?, &b[0..0])),
            1 => i += 8,
            2 => {
                let n = varint(b, &mut i)? as usize;
                let s = b.get(i..i + n)?;
                out.push((field, wt, 0, s));
                i += n;
            }
            5 => i += 4,
            _ => return None,
        }
    }
    Some(out)
}

/// The pieces of a serialised `ModelProto` (field 1), in id order.
fn read_pieces(b: &[u8]) -> Option<Vec<Piece>> {
    let mut pieces = Vec::new();
    for (field, wt, _, msg) in fields(b)? {
        if field != 1 || wt != 2 {
            continue;
        }
        let mut text = String::new();
        let mut kind = 1; // NORMAL
        for (f, w, v, s) in fields(msg)? {
            match (f, w) {
                (1, 2) => text = String::from_utf8_lossy(s).into_owned(),
                (3, 0) => kind = v,
                _ => {}
            }
        }
        pieces.push(match kind {
            1 | 4 => Piece::Text(text.replace('\u{2581}', " ")),
            6 => text
                .strip_prefix("<0x")
                .and_then(|h| h.strip_suffix('>'))
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .map(Piece::Byte)
                .unwrap_or(Piece::Silent),
            _ => Piece::Silent,
        });
    }
    Some(pieces)
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
        let sp = SentencePieceProcessor::from_serialized_proto(&bytes)
            .map_err(|e| err(format!("not a SentencePiece model: {e}")))?;
        let pieces = read_pieces(&bytes)
            .filter(|p| p.len() == sp.len())
            .ok_or_else(|| err("cannot read the piece table".into()))?;
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
            .encode(text)
            .map(|v| v.into_iter().map(|p| p.id as i64).collect())
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
