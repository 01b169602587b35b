//! A conversation's temporal state copied out of its cache, and where its rows lie in KV
//! buffers: what priming's cache keeps and restores.

use super::{FloatType, LmGraphInfo, Variant};
use crate::model::tensors::Buffer;

/// A conversation's temporal state, copied out of its transformer ([`TemporalStep::snapshot`](super::TemporalStep::snapshot)):
/// the cache's valid rows and where the conversation stands. Restoring it
/// ([`TemporalStep::restore`](super::TemporalStep::restore)) puts a transformer exactly where the snapshot was taken: a primed
/// state computed once serves every later conversation with the same priming.
#[derive(Clone)]
pub struct TemporalState {
    pub(crate) len: usize,
    pub(crate) pos: usize,
    /// Per layer's K then V: `heads × len × head_dim` elements, head by head.
    pub(crate) rows: Vec<Vec<u8>>,
    /// What it fits: layers, heads, head_dim, dtype, variant.
    pub(crate) shape: StateShape,
}

impl TemporalState {
    /// Bytes it holds.
    pub fn bytes(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// Positions it has used.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// A state of `bytes` bytes that fits no graph (for tests of what keeps states).
    #[cfg(test)]
    pub(crate) fn filler(bytes: usize) -> Self {
        TemporalState {
            len: 0,
            pos: 0,
            rows: vec![vec![0; bytes]],
            shape: (0, 0, 0, FloatType::F32, Variant::Gqa),
        }
    }
}

/// What a state fits: the graph's layers, heads, head size, cache dtype and variant.
pub(crate) type StateShape = (usize, usize, usize, FloatType, Variant);

/// The shape of the states a graph's cache holds.
pub(crate) fn state_shape(info: &LmGraphInfo) -> StateShape {
    (
        info.layers,
        info.heads,
        info.head_dim,
        info.kv,
        info.variant,
    )
}

/// Where a conversation's rows lie in KV buffers of host memory (every layer's K and V buffer
/// alike): head `i`'s rows start at element `base + i × stride × head_dim` (`stride`: rows per
/// head in the buffer). A state's rows are the same, compact: `heads × len × head_dim`.
pub(crate) struct RowSpan {
    /// The first head's first element.
    pub base: usize,
    /// Rows from one head's first row to the next's.
    pub stride: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Bytes per element.
    pub elem: usize,
}

impl RowSpan {
    /// Head `head`'s first `len` rows, in bytes.
    fn head(&self, head: usize, len: usize) -> std::ops::Range<usize> {
        let at = (self.base + head * self.stride * self.head_dim) * self.elem;
        at..at + len * self.head_dim * self.elem
    }

    /// The first `len` rows of every head of each buffer, compact (a state's `rows`).
    ///
    /// # Errors
    ///
    /// Why not: a buffer in device memory, or shorter than the span.
    pub fn gather(&self, bufs: &mut [Buffer], len: usize) -> Result<Vec<Vec<u8>>, &'static str> {
        bufs.iter_mut()
            .map(|buf| {
                let all = host_bytes(buf)?;
                let mut out = Vec::with_capacity(self.heads * len * self.head_dim * self.elem);
                for head in 0..self.heads {
                    out.extend_from_slice(all.get(self.head(head, len)).ok_or(TOO_LONG)?);
                }
                Ok(out)
            })
            .collect()
    }

    /// Writes a state's `len` compact rows of every head into each buffer.
    ///
    /// # Errors
    ///
    /// As [`gather`](Self::gather).
    pub fn scatter(
        &self,
        bufs: &mut [Buffer],
        rows: &[Vec<u8>],
        len: usize,
    ) -> Result<(), &'static str> {
        let n = len * self.head_dim * self.elem;
        for (buf, rows) in bufs.iter_mut().zip(rows) {
            let all = host_bytes(buf)?;
            for head in 0..self.heads {
                let src = rows.get(head * n..(head + 1) * n).ok_or(TOO_LONG)?;
                all.get_mut(self.head(head, len))
                    .ok_or(TOO_LONG)?
                    .copy_from_slice(src);
            }
        }
        Ok(())
    }
}

const TOO_LONG: &str = "it is longer than this cache";

/// A KV buffer's bytes, when it is in host memory.
fn host_bytes(buf: &mut Buffer) -> Result<&mut [u8], &'static str> {
    if buf.placement().device != "Cpu" {
        return Err("the cache is in device memory (a state is kept in host memory)");
    }
    Ok(buf.as_bytes())
}

impl std::fmt::Debug for TemporalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemporalState")
            .field("len", &self.len)
            .field("pos", &self.pos)
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
    }
}
