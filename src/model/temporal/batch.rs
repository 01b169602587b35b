//! The GQA temporal step, once: [`TemporalBatch`] steps the rows of many conversations in one
//! call of the graph (the shared engine's temporal worker holds one), and [`OneRow`] is a
//! conversation of its own as that batch at one row.
//!
//! The rows live in one batch: per layer one K and one V buffer of `[rows, heads, capacity + 1,
//! head_dim]`, bound in place as both past and present (the GQA graph appends each row's new
//! entry at its own valid length, which `attention_mask` gives per row). A tick runs the rows
//! `0..=highest row with a frame`; a row in that range without a frame runs as a dummy at its
//! own length (its output dropped, its length unchanged), so rows never move between buffers;
//! the extra position per row takes its write, so that nothing valid is touched.

use std::sync::Arc;

use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;

use super::{
    element_bytes, no_position_left, ort_err, state_shape, ChunkIo, FrameLimits, RowSpan,
    TemporalOptions, TemporalState, TemporalStep,
};
use crate::model::error::ModelError;
use crate::model::pack::{LmGraphInfo, Pack};
use crate::model::session::{report, OpenSession, Provider};
use crate::model::tensors::{
    allocator_at, element, input_placements, kv_placements, placement_of, read_row, Buffer,
    Placement,
};

/// One row's part of a tick: its frame in, its outputs back.
pub(crate) struct BatchRow {
    /// The row.
    pub slot: usize,
    /// One token per channel (checked by the caller).
    pub input: Vec<i64>,
    /// Forget the row's conversation before this step.
    pub fresh: bool,
    pub hidden: Vec<f32>,
    pub logits: Vec<f32>,
    /// Why this row did not run.
    pub error: Option<ModelError>,
}

impl BatchRow {
    pub fn new(slot: usize, channels: usize) -> Self {
        BatchRow {
            slot,
            input: Vec::with_capacity(channels),
            fresh: true,
            hidden: Vec::new(),
            logits: Vec::new(),
            error: None,
        }
    }
}

/// The GQA temporal graph over rows of conversations.
pub(crate) struct TemporalBatch {
    // Field order matters: the binding (which holds views) is dropped before the buffers.
    binding: IoBinding,
    session: Session,
    pub info: LmGraphInfo,
    pub provider: Provider,
    /// Per layer: K then V, `[rows, heads, capacity + 1, head_dim]`.
    pub kv: Vec<Buffer>,
    frame: Buffer,
    mask: Buffer,
    hidden: Buffer,
    logits: Buffer,
    alloc: Allocator,
    /// The KV buffers' allocator: the memory the session reads them from.
    kv_alloc: Allocator,
    /// Where the session wants each input.
    pub wanted: Vec<(String, Placement)>,
    channels: usize,
    /// Positions per row in the buffers: the capacity, and one for a dummy row's write.
    rows: usize,
    /// Each row's valid length (also its position: nothing is dropped).
    pub len: Vec<usize>,
    /// Prefill's buffers (a chunk's own inputs and outputs), made at its first use.
    chunk: Option<ChunkIo>,
    /// The graph's name in errors.
    graph: &'static str,
}

impl TemporalBatch {
    /// The batch of `slots` rows of `capacity` positions each on an opened and checked GQA
    /// graph; its KV buffers live where the session reads them (device memory under CUDA).
    ///
    /// # Errors
    ///
    /// ONNX Runtime errors (allocation included).
    pub fn new(
        os: OpenSession,
        info: LmGraphInfo,
        graph: &'static str,
        slots: usize,
        capacity: usize,
        channels: usize,
    ) -> Result<TemporalBatch, ModelError> {
        let e = ort_err(graph);
        let alloc = Allocator::default();
        let wanted = input_placements(&os.session).map_err(&e)?;
        let kv_alloc = allocator_at(&os.session, &placement_of(&wanted, "past_key_values.0.key"))
            .map_err(&e)?;
        let rows = capacity + 1;
        let (s, h, d) = (slots as i64, info.heads as i64, info.head_dim as i64);
        let mut kv = Vec::new();
        for _ in 0..2 * info.layers {
            kv.push(
                Buffer::zeros(&kv_alloc, element(info.kv), &[s, h, rows as i64, d]).map_err(&e)?,
            );
        }
        let hd = info.hidden_dim as i64;
        let b = TemporalBatch {
            binding: os.session.create_binding().map_err(&e)?,
            frame: Buffer::zeros(&alloc, TensorElementType::Int64, &[s, channels as i64, 1])
                .map_err(&e)?,
            mask: Buffer::zeros(&alloc, TensorElementType::Int64, &[s, rows as i64]).map_err(&e)?,
            hidden: Buffer::zeros(&alloc, element(info.hidden), &[s, 1, hd]).map_err(&e)?,
            logits: Buffer::zeros(&alloc, element(info.logits), &[s, 1, info.vocab as i64])
                .map_err(&e)?,
            session: os.session,
            provider: os.provider,
            kv,
            alloc,
            kv_alloc,
            wanted,
            channels,
            rows,
            len: vec![0; slots],
            chunk: None,
            graph,
            info,
        };
        Ok(b)
    }

    /// Every KV buffer's placement against the session's wish.
    pub fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        kv_placements(&self.kv, self.info.layers, &self.wanted)
    }

    /// One batched step of the rows `0..=max(slot)`. A row that has no position left gets its
    /// `error` and does not run.
    ///
    /// # Errors
    ///
    /// ONNX Runtime errors (the tick as a whole).
    pub fn tick(&mut self, jobs: &mut [&mut BatchRow]) -> ort::Result<()> {
        let n = jobs.iter().map(|j| j.slot + 1).max().unwrap_or(0);
        if n == 0 {
            return Ok(());
        }
        let c = self.channels;
        for j in jobs.iter_mut() {
            if j.fresh {
                self.len[j.slot] = 0;
            }
            if self.len[j.slot] + 1 >= self.rows {
                j.error = Some(no_position_left(self.len[j.slot]));
            }
        }
        {
            let frame = self.frame.as_slice::<i64>();
            // Rows without a frame run on token 0 (valid in every table); their output is dropped.
            frame[..n * c].fill(0);
            for j in jobs.iter() {
                if j.error.is_none() {
                    frame[j.slot * c..(j.slot + 1) * c].copy_from_slice(&j.input);
                }
            }
        }
        // A row's valid length is its own (right padding); a dummy row writes at its length,
        // past what it attends to, where its next real step writes again.
        let lens: Vec<usize> = (0..n).map(|b| self.len[b].min(self.rows - 1)).collect();
        let total = lens.iter().max().copied().unwrap_or(0) + 1;
        {
            let mask = self.mask.as_slice::<i64>();
            for (b, &l) in lens.iter().enumerate() {
                let row = &mut mask[b * total..(b + 1) * total];
                row[..l + 1].fill(1);
                row[l + 1..].fill(0);
            }
        }
        let (bn, h, d) = (n as i64, self.info.heads as i64, self.info.head_dim as i64);
        self.bind_cache(0, &[bn, h, self.rows as i64, d])?;
        let a = &self.alloc;
        let v = self.frame.view(a, &[bn, c as i64, 1])?;
        self.binding.bind_input("input_frame", &v)?;
        let v = self.mask.view(a, &[bn, total as i64])?;
        self.binding.bind_input("attention_mask", &v)?;
        let hd = self.info.hidden_dim;
        let v = self.hidden.view(a, &[bn, 1, hd as i64])?;
        self.binding.bind_output("hidden", v)?;
        let vocab = self.info.vocab;
        let v = self.logits.view(a, &[bn, 1, vocab as i64])?;
        self.binding.bind_output("text_logits", v)?;
        drop(self.session.run_binding(&self.binding)?);
        for j in jobs.iter_mut() {
            if j.error.is_some() {
                continue;
            }
            read_row(&mut self.hidden, j.slot, hd, &mut j.hidden);
            read_row(&mut self.logits, j.slot, vocab, &mut j.logits);
            j.fresh = false;
            self.len[j.slot] += 1;
        }
        Ok(())
    }

    /// Binds every layer's K and V buffer, from element `at` on, at `shape`, as both past and
    /// present.
    fn bind_cache(&mut self, at: usize, shape: &[i64]) -> ort::Result<()> {
        for i in 0..self.info.layers {
            for (j, kv) in ["key", "value"].iter().enumerate() {
                let buf = &mut self.kv[2 * i + j];
                let past = buf.view_at(&self.kv_alloc, at, shape)?;
                let present = buf.view_at(&self.kv_alloc, at, shape)?;
                self.binding
                    .bind_input(format!("past_key_values.{i}.{kv}"), &past)?;
                self.binding
                    .bind_output(format!("present.{i}.{kv}"), present)?;
            }
        }
        Ok(())
    }

    /// Where a row's positions lie in the KV buffers (a block of `rows` per head).
    fn slot_span(&self, slot: usize) -> RowSpan {
        let (h, d) = (self.info.heads, self.info.head_dim);
        RowSpan {
            base: slot * h * self.rows * d,
            stride: self.rows,
            heads: h,
            head_dim: d,
            elem: element_bytes(self.info.kv),
        }
    }

    /// `frames` through the graph as one call of row `slot` alone (the GQA graph writes their
    /// entries at the row's length, as a step's), leaving the last frame's outputs in `hidden`
    /// and `logits`. Between ticks: the row is nobody else's.
    ///
    /// # Errors
    ///
    /// No position left for all of them, ONNX Runtime errors.
    pub fn prefill(
        &mut self,
        slot: usize,
        frames: &[Vec<i64>],
        hidden: &mut Vec<f32>,
        logits: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        let n = frames.len();
        if n == 0 {
            return Ok(());
        }
        let len = self.len[slot];
        if len + n >= self.rows {
            return Err(no_position_left(len));
        }
        let e = ort_err(self.graph);
        let (c, hd, vocab) = (self.channels, self.info.hidden_dim, self.info.vocab);
        let at = self.slot_span(slot).base;
        if self.chunk.as_ref().is_none_or(|io| io.frames < n) {
            self.chunk = Some(ChunkIo::new(&self.alloc, &self.info, c, n).map_err(&e)?);
        }
        let Some(mut io) = self.chunk.take() else {
            return Ok(());
        };
        io.fill(frames);
        let total = len + n;
        self.mask.as_slice::<i64>()[..total].fill(1);
        let ran = self.run_chunk(&mut io, n, total, at);
        if let Err(err) = ran {
            self.chunk = Some(io);
            return Err(e(err));
        }
        read_row(&mut io.hidden, n - 1, hd, hidden);
        read_row(&mut io.logits, n - 1, vocab, logits);
        self.chunk = Some(io);
        self.len[slot] += n;
        Ok(())
    }

    /// One graph call on the first `n` frames of `io`, at row `slot`'s positions (from
    /// element `at` of each buffer), attending to `total` positions.
    fn run_chunk(
        &mut self,
        io: &mut ChunkIo,
        n: usize,
        total: usize,
        at: usize,
    ) -> ort::Result<()> {
        let (a, s, c) = (&self.alloc, n as i64, self.channels as i64);
        let (hd, vocab) = (self.info.hidden_dim as i64, self.info.vocab as i64);
        let v = io.frame.view(a, &[1, c, s])?;
        self.binding.bind_input("input_frame", &v)?;
        let v = self.mask.view(a, &[1, total as i64])?;
        self.binding.bind_input("attention_mask", &v)?;
        let v = io.hidden.view(a, &[1, s, hd])?;
        self.binding.bind_output("hidden", v)?;
        let v = io.logits.view(a, &[1, s, vocab])?;
        self.binding.bind_output("text_logits", v)?;
        let (h, d) = (self.info.heads as i64, self.info.head_dim as i64);
        self.bind_cache(at, &[1, h, self.rows as i64, d])?;
        self.session.run_binding(&self.binding).map(drop)
    }

    /// Row `slot`'s state, copied out (host memory only).
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] when the cache is in device memory.
    pub fn snapshot(&mut self, slot: usize) -> Result<TemporalState, ModelError> {
        let len = self.len[slot];
        let rows = self
            .slot_span(slot)
            .gather(&mut self.kv, len)
            .map_err(|why| self.state_error("taking a state", why))?;
        Ok(TemporalState {
            len,
            pos: len,
            rows,
            shape: state_shape(&self.info),
        })
    }

    /// Puts row `slot` where `state` was taken.
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] when the state is of another graph, longer than the row, or
    /// the cache is in device memory.
    pub fn restore(&mut self, slot: usize, state: &TemporalState) -> Result<(), ModelError> {
        let bad = |why: &str| self.state_error("restoring a state", why);
        if state.shape != state_shape(&self.info) {
            return Err(bad("it is of another graph"));
        }
        // A row never drops positions: every position is a row.
        if state.pos != state.len || state.len + 1 >= self.rows {
            return Err(bad("it is longer than this cache"));
        }
        let span = self.slot_span(slot);
        span.scatter(&mut self.kv, &state.rows, state.len)
            .map_err(|why| self.state_error("restoring a state", why))?;
        self.len[slot] = state.len;
        Ok(())
    }

    fn state_error(&self, what: &str, why: &str) -> ModelError {
        ModelError::contract(self.graph, format!("{what}: {why}"))
    }

    /// First element of position `row` of layer `layer`'s key cache, row `slot`, head 0 (host
    /// memory only).
    pub fn key_cache_value(&mut self, slot: usize, layer: usize, row: usize) -> Option<f32> {
        let base = self.slot_span(slot).base;
        let idx = base + row.min(self.rows - 1) * self.info.head_dim;
        let buf = self.kv.get_mut(2 * layer)?;
        if buf.placement().device != "Cpu" {
            return None;
        }
        match self.info.kv {
            crate::model::pack::FloatType::F32 => buf.as_slice::<f32>().get(idx).copied(),
            crate::model::pack::FloatType::F16 => {
                buf.as_slice::<half::f16>().get(idx).map(|v| v.to_f32())
            }
        }
    }
}

/// A conversation of its own on the GQA graph: the batch at one row.
pub struct OneRow {
    batch: TemporalBatch,
    row: BatchRow,
    capacity: usize,
    limits: FrameLimits,
}

impl OneRow {
    pub(super) fn new(batch: TemporalBatch, pack: &Pack, opts: &TemporalOptions) -> Self {
        let limits = FrameLimits::of(pack);
        let mut row = BatchRow::new(0, limits.channels);
        // A conversation of its own forgets by its length (`reset`), not by its row.
        row.fresh = false;
        let t = OneRow {
            row,
            capacity: batch.rows - 1,
            limits,
            batch,
        };
        report(
            &opts.session,
            "temporal",
            t.batch.provider,
            t.info().kv.name(),
        );
        let i = t.info();
        tracing::info!(
            variant = ?i.variant,
            layers = i.layers,
            heads = i.heads,
            head_dim = i.head_dim,
            dtype = i.kv.name(),
            kv = ?opts.kv,
            capacity = t.capacity,
            fixed_shapes = false,
            cuda_graph = false,
            "temporal transformer ready"
        );
        t
    }
}

impl TemporalStep for OneRow {
    fn info(&self) -> &LmGraphInfo {
        &self.batch.info
    }

    fn provider(&self) -> Provider {
        self.batch.provider
    }

    fn reset(&mut self) {
        self.batch.len[0] = 0;
    }

    fn kv_len(&self) -> usize {
        self.batch.len[0]
    }

    fn position(&self) -> usize {
        self.batch.len[0]
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, input: &[i64]) -> Result<(), ModelError> {
        self.limits
            .check_step(input, self.position(), self.positions_left())?;
        self.row.input.clear();
        self.row.input.extend_from_slice(input);
        self.row.error = None;
        self.batch
            .tick(&mut [&mut self.row])
            .map_err(ort_err("temporal"))?;
        match self.row.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn prefill(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        self.limits
            .check_prefill(frames, self.position(), self.positions_left())?;
        for part in frames.chunks(chunk.max(1)) {
            self.batch
                .prefill(0, part, &mut self.row.hidden, &mut self.row.logits)?;
        }
        Ok(())
    }

    fn snapshot(&mut self) -> Option<TemporalState> {
        self.batch.snapshot(0).ok()
    }

    fn restore(&mut self, state: &Arc<TemporalState>) -> Result<(), ModelError> {
        self.batch.restore(0, state)
    }

    fn read_hidden(&mut self, out: &mut Vec<f32>) {
        out.clone_from(&self.row.hidden);
    }

    fn read_logits(&mut self, out: &mut Vec<f32>) {
        out.clone_from(&self.row.logits);
    }

    fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        self.batch.cache_placements()
    }

    fn key_cache_value(&mut self, layer: usize, row: usize) -> Option<f32> {
        self.batch.key_cache_value(0, layer, row)
    }
}
