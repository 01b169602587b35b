//! The shared engine's temporal half: the [`TemporalWorker`] that steps every slot of a tick
//! in one call of the GQA temporal graph, and a conversation's [`TemporalSlot`].
//!
//! The slots are rows of one batch: per layer one K and one V buffer of `[slots, heads,
//! capacity + 1, head_dim]`, bound in place as both past and present (the GQA graph appends
//! each row's new entry at its own valid length, which `attention_mask` gives per row). The
//! batch is the slots `0..=highest slot with a frame`; a slot in that range without a frame
//! runs as a dummy row at its own length (its output dropped, its length unchanged), so rows
//! never move between buffers; the extra row per slot takes its write, so that nothing valid
//! is touched.

use std::sync::Arc;

use crossbeam_channel::{bounded, Receiver, Sender};
use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;

use super::{stopped, Msg, SharedLm};
use crate::model::error::ModelError;
use crate::model::pack::{check_temporal, LmGraphInfo, Variant};
use crate::model::session::{open, report, Provider, SessionOptions};
use crate::model::temporal::{
    element_bytes, no_position_left, state_shape, validate_frame, ChunkIo, RowSpan, TemporalState,
};
use crate::model::tensors::{
    allocator_at, element, input_placements, placement_of, read_row, Buffer, Placement,
};

pub(super) struct TemporalJob {
    pub slot: usize,
    pub input: Vec<i64>,
    /// Forget the slot's conversation before this step.
    pub fresh: bool,
    pub hidden: Vec<f32>,
    pub logits: Vec<f32>,
    pub error: Option<ModelError>,
    pub reply: Sender<TemporalJob>,
}

/// What a priming conversation asks of its slot between ticks.
pub(super) enum PrimeWork {
    /// Frames known in advance, in one graph call of this row alone.
    Prefill(Vec<Vec<i64>>),
    /// The slot's state, copied out.
    Snapshot,
    /// The slot put where a state was taken.
    Restore(Arc<TemporalState>),
}

pub(super) struct PrimeJob {
    pub slot: usize,
    /// Forget the slot's conversation first.
    pub fresh: bool,
    pub work: PrimeWork,
    /// After a prefill: its last frame's hidden state and text logits.
    pub hidden: Vec<f32>,
    pub logits: Vec<f32>,
    /// After a snapshot: the state.
    pub state: Option<TemporalState>,
    pub error: Option<ModelError>,
    pub reply: Sender<PrimeJob>,
}

pub(super) struct TemporalWorker {
    // Field order matters: the binding (which holds views) is dropped before the buffers.
    binding: IoBinding,
    session: Session,
    pub info: LmGraphInfo,
    pub provider: Provider,
    pub kv: Vec<Buffer>,
    frame: Buffer,
    mask: Buffer,
    hidden: Buffer,
    logits: Buffer,
    alloc: Allocator,
    /// The KV slots' allocator: the memory the session reads them from.
    kv_alloc: Allocator,
    pub wanted: Vec<(String, Placement)>,
    channels: usize,
    rows: usize,
    pub len: Vec<usize>,
    /// Prefill's buffers (a chunk's own inputs and outputs), made at its first use.
    chunk: Option<ChunkIo>,
}

impl TemporalWorker {
    pub fn open(
        path: &std::path::Path,
        session: &SessionOptions,
        slots: usize,
        capacity: usize,
        channels: usize,
    ) -> Result<TemporalWorker, ModelError> {
        let graph = "temporal";
        let os = open(path, graph, session)?;
        let info = check_temporal(&os.session, graph, channels)?;
        if info.variant != Variant::Gqa {
            return Err(ModelError::contract(
                graph,
                "a shared engine needs the GQA temporal graph (per-row lengths); this pack's is the standard one: use `engine: own`, or export the `cpu`/`cuda` variant",
            ));
        }
        let e = |err: ort::Error| ModelError::ort(graph, err);
        let alloc = Allocator::default();
        // The slots live where the session reads them (device memory under CUDA).
        let wanted = input_placements(&os.session).map_err(e)?;
        let kv_alloc = allocator_at(&os.session, &placement_of(&wanted, "past_key_values.0.key"))
            .map_err(e)?;
        let rows = capacity + 1;
        let (s, h, d) = (slots as i64, info.heads as i64, info.head_dim as i64);
        let mut kv = Vec::new();
        for _ in 0..2 * info.layers {
            kv.push(
                Buffer::zeros(&kv_alloc, element(info.kv), &[s, h, rows as i64, d]).map_err(e)?,
            );
        }
        let w = TemporalWorker {
            binding: os.session.create_binding().map_err(e)?,
            frame: Buffer::zeros(&alloc, TensorElementType::Int64, &[s, channels as i64, 1])
                .map_err(e)?,
            mask: Buffer::zeros(&alloc, TensorElementType::Int64, &[s, rows as i64]).map_err(e)?,
            hidden: Buffer::zeros(
                &alloc,
                element(info.hidden),
                &[s, 1, info.hidden_dim as i64],
            )
            .map_err(e)?,
            logits: Buffer::zeros(&alloc, element(info.logits), &[s, 1, info.vocab as i64])
                .map_err(e)?,
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
            info,
        };
        report(
            session,
            "temporal (shared engine)",
            w.provider,
            w.info.kv.name(),
        );
        Ok(w)
    }

    /// One batched step of the slots `0..=max(slot)`.
    pub fn tick(&mut self, jobs: &mut [(usize, TemporalJob)]) -> ort::Result<()> {
        let n = jobs.iter().map(|(_, j)| j.slot + 1).max().unwrap_or(0);
        if n == 0 {
            return Ok(());
        }
        let c = self.channels;
        for (_, j) in jobs.iter_mut() {
            let slot = j.slot;
            if j.fresh {
                self.len[slot] = 0;
            }
            if self.len[slot] + 1 >= self.rows {
                j.error = Some(ModelError::contract(
                    "temporal",
                    "no position left in the slot (apply a long-session policy before)",
                ));
            }
        }
        {
            let frame = self.frame.as_slice::<i64>();
            // Rows without a frame run on token 0 (valid in every table); their output is dropped.
            frame[..n * c].fill(0);
            for (_, j) in jobs.iter() {
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
        let a = &self.alloc;
        let v = self.frame.view(a, &[bn, c as i64, 1])?;
        self.binding.bind_input("input_frame", &v)?;
        let v = self.mask.view(a, &[bn, total as i64])?;
        self.binding.bind_input("attention_mask", &v)?;
        let shape = [bn, h, self.rows as i64, d];
        for i in 0..self.info.layers {
            for (j, kv) in ["key", "value"].iter().enumerate() {
                let buf = &mut self.kv[2 * i + j];
                let past = buf.view(&self.kv_alloc, &shape)?;
                let present = buf.view(&self.kv_alloc, &shape)?;
                self.binding
                    .bind_input(format!("past_key_values.{i}.{kv}"), &past)?;
                self.binding
                    .bind_output(format!("present.{i}.{kv}"), present)?;
            }
        }
        let hd = self.info.hidden_dim;
        let v = self.hidden.view(a, &[bn, 1, hd as i64])?;
        self.binding.bind_output("hidden", v)?;
        let vocab = self.info.vocab;
        let v = self.logits.view(a, &[bn, 1, vocab as i64])?;
        self.binding.bind_output("text_logits", v)?;
        drop(self.session.run_binding(&self.binding)?);
        for (_, j) in jobs.iter_mut() {
            if j.error.is_some() {
                continue;
            }
            read_row(&mut self.hidden, j.slot, hd, &mut j.hidden);
            read_row(&mut self.logits, j.slot, vocab, &mut j.logits);
            self.len[j.slot] += 1;
        }
        Ok(())
    }
}

impl TemporalWorker {
    /// Serves a priming conversation's job (between ticks: its slot is nobody else's).
    pub fn prime(&mut self, job: &mut PrimeJob) {
        if job.fresh {
            self.len[job.slot] = 0;
        }
        let r = match &job.work {
            PrimeWork::Prefill(frames) => {
                self.prefill(job.slot, frames, &mut job.hidden, &mut job.logits)
            }
            PrimeWork::Snapshot => self.snapshot(job.slot).map(|s| job.state = Some(s)),
            PrimeWork::Restore(state) => self.restore(job.slot, state),
        };
        if let Err(e) = r {
            job.error = Some(e);
        }
    }

    /// Where a slot's rows lie in the KV buffers (a block of `rows` rows per head).
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

    /// `frames` through the graph as one call of the slot's row alone (the GQA graph writes
    /// their entries at the row's length, as a step's), leaving the last frame's outputs in
    /// `hidden` and `logits`.
    fn prefill(
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
        let e = |err: ort::Error| ModelError::ort("temporal (shared engine)", err);
        let (c, hd, vocab) = (self.channels, self.info.hidden_dim, self.info.vocab);
        let at = self.slot_span(slot).base;
        if self.chunk.as_ref().is_none_or(|io| io.frames < n) {
            self.chunk = Some(ChunkIo::new(&self.alloc, &self.info, c, n).map_err(e)?);
        }
        let Some(io) = self.chunk.as_mut() else {
            return Ok(());
        };
        io.fill(frames);
        let total = len + n;
        self.mask.as_slice::<i64>()[..total].fill(1);
        let (a, s) = (&self.alloc, n as i64);
        let v = io.frame.view(a, &[1, c as i64, s]).map_err(e)?;
        self.binding.bind_input("input_frame", &v).map_err(e)?;
        let v = self.mask.view(a, &[1, total as i64]).map_err(e)?;
        self.binding.bind_input("attention_mask", &v).map_err(e)?;
        let shape = [
            1,
            self.info.heads as i64,
            self.rows as i64,
            self.info.head_dim as i64,
        ];
        for i in 0..self.info.layers {
            for (j, kv) in ["key", "value"].iter().enumerate() {
                let buf = &mut self.kv[2 * i + j];
                let past = buf.view_at(&self.kv_alloc, at, &shape).map_err(e)?;
                let present = buf.view_at(&self.kv_alloc, at, &shape).map_err(e)?;
                self.binding
                    .bind_input(format!("past_key_values.{i}.{kv}"), &past)
                    .map_err(e)?;
                self.binding
                    .bind_output(format!("present.{i}.{kv}"), present)
                    .map_err(e)?;
            }
        }
        let v = io.hidden.view(a, &[1, s, hd as i64]).map_err(e)?;
        self.binding.bind_output("hidden", v).map_err(e)?;
        let v = io.logits.view(a, &[1, s, vocab as i64]).map_err(e)?;
        self.binding.bind_output("text_logits", v).map_err(e)?;
        drop(self.session.run_binding(&self.binding).map_err(e)?);
        read_row(&mut io.hidden, n - 1, hd, hidden);
        read_row(&mut io.logits, n - 1, vocab, logits);
        self.len[slot] += n;
        Ok(())
    }

    /// The slot's state, copied out (host memory only).
    fn snapshot(&mut self, slot: usize) -> Result<TemporalState, ModelError> {
        let len = self.len[slot];
        let rows = self
            .slot_span(slot)
            .gather(&mut self.kv, len)
            .map_err(|why| state_error("taking a state", why))?;
        Ok(TemporalState {
            len,
            pos: len,
            rows,
            shape: state_shape(&self.info),
        })
    }

    /// Puts the slot where `state` was taken.
    fn restore(&mut self, slot: usize, state: &TemporalState) -> Result<(), ModelError> {
        let bad = |why: &str| state_error("restoring a state", why);
        if state.shape != state_shape(&self.info) {
            return Err(bad("it is of another graph"));
        }
        // A slot never drops rows: every position is a row.
        if state.pos != state.len || state.len + 1 >= self.rows {
            return Err(bad("it is longer than this slot"));
        }
        self.slot_span(slot)
            .scatter(&mut self.kv, &state.rows, state.len)
            .map_err(bad)?;
        self.len[slot] = state.len;
        Ok(())
    }
}

fn state_error(what: &str, why: &str) -> ModelError {
    ModelError::contract("temporal (shared engine)", format!("{what}: {why}"))
}

/// A conversation's KV slot in a shared engine: the temporal transformer's interface
/// ([`Temporal`](crate::model::temporal::Temporal)'s methods), stepped in the engine's batch.
pub struct TemporalSlot {
    lm: Arc<SharedLm>,
    slot: usize,
    reply: Receiver<TemporalJob>,
    job: Option<TemporalJob>,
    prime_reply: Receiver<PrimeJob>,
    prime_tx: Sender<PrimeJob>,
    capacity: usize,
    /// Positions since the last reset: also the rows in the slot (nothing is dropped).
    pos: usize,
}

impl TemporalSlot {
    pub(super) fn new(lm: Arc<SharedLm>, slot: usize, capacity: usize) -> Self {
        let (tx, rx) = bounded(1);
        let (prime_tx, prime_reply) = bounded(1);
        TemporalSlot {
            slot,
            reply: rx,
            prime_reply,
            prime_tx,
            job: Some(TemporalJob {
                slot,
                input: Vec::with_capacity(lm.channels),
                fresh: true,
                hidden: Vec::new(),
                logits: Vec::new(),
                error: None,
                reply: tx,
            }),
            capacity,
            pos: 0,
            lm,
        }
    }

    /// The slot's index (its row in the batch).
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<SharedLm> {
        &self.lm
    }

    /// What the graph runs on.
    pub fn runs_on(&self) -> String {
        self.lm.runs_on()
    }

    /// Forgets the conversation: the slot's next step starts from an empty cache.
    pub fn reset(&mut self) {
        self.pos = 0;
        if let Some(j) = self.job.as_mut() {
            j.fresh = true;
        }
    }

    /// Rows in the slot's KV cache.
    pub fn kv_len(&self) -> usize {
        self.pos
    }

    /// Positions used since the last reset.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Steps left before the positions run out.
    pub fn positions_left(&self) -> usize {
        self.capacity.saturating_sub(self.pos)
    }

    /// Checks token ids against the embedding tables.
    ///
    /// # Errors
    ///
    /// [`ModelError::Token`] naming the channel.
    pub fn validate(&self, input: &[i64]) -> Result<(), ModelError> {
        validate_frame(
            input,
            self.lm.channels,
            self.lm.text_limit,
            self.lm.audio_limit,
        )
    }

    /// Runs one step in the engine's next tick (blocks until it has run).
    ///
    /// # Errors
    ///
    /// Token errors (checked here: a bad frame never reaches the batch), no position left,
    /// the engine's errors.
    pub fn step(&mut self, input: &[i64]) -> Result<(), ModelError> {
        self.validate(input)?;
        if self.positions_left() == 0 {
            return Err(no_position_left(self.pos));
        }
        let mut job = self.job.take().ok_or_else(|| stopped("temporal"))?;
        job.input.clear();
        job.input.extend_from_slice(input);
        job.error = None;
        self.lm
            .tx
            .send(Msg::Temporal {
                client: self.slot,
                job,
            })
            .map_err(|_| stopped("temporal"))?;
        let mut job = self.reply.recv().map_err(|_| stopped("temporal"))?;
        job.fresh = false;
        let err = job.error.take();
        self.job = Some(job);
        if let Some(e) = err {
            return Err(e);
        }
        self.pos += 1;
        Ok(())
    }

    /// Frames known in advance (priming), in chunks of at most `chunk`: each chunk one graph
    /// call of this slot's row alone, served between the engine's ticks, so that a priming
    /// conversation holds the live ones up by one chunk at most. Leaves the slot where as many
    /// [`step`](Self::step)s would (within the float rounding of a different reduction order);
    /// [`read_hidden`](Self::read_hidden) and [`read_logits`](Self::read_logits) then give
    /// the last frame's.
    ///
    /// # Errors
    ///
    /// Token errors (every frame is checked before any runs), no position left for all of
    /// them, the engine's errors.
    pub fn prefill(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        for f in frames {
            self.validate(f)?;
        }
        if self.positions_left() < frames.len() {
            return Err(no_position_left(self.pos + self.positions_left()));
        }
        for part in frames.chunks(chunk.max(1)) {
            let job = self.prime(PrimeWork::Prefill(part.to_vec()))?;
            self.pos += part.len();
            if let Some(j) = self.job.as_mut() {
                j.hidden.clone_from(&job.hidden);
                j.logits.clone_from(&job.logits);
            }
        }
        Ok(())
    }

    /// The conversation's state, copied out of the engine (`None` where the slots are in
    /// device memory).
    pub fn snapshot(&mut self) -> Option<TemporalState> {
        self.prime(PrimeWork::Snapshot).ok()?.state
    }

    /// Puts the conversation where `state` was taken (by this engine's slot or a transformer
    /// of its own on the same graph).
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] when the state is of another graph, longer than the slot, or
    /// the slots are in device memory.
    pub fn restore(&mut self, state: &Arc<TemporalState>) -> Result<(), ModelError> {
        self.prime(PrimeWork::Restore(state.clone()))?;
        self.pos = state.pos;
        Ok(())
    }

    /// One priming job, served between the engine's ticks.
    fn prime(&mut self, work: PrimeWork) -> Result<PrimeJob, ModelError> {
        let fresh = self.job.as_ref().is_some_and(|j| j.fresh);
        let job = PrimeJob {
            slot: self.slot,
            fresh,
            work,
            hidden: Vec::new(),
            logits: Vec::new(),
            state: None,
            error: None,
            reply: self.prime_tx.clone(),
        };
        self.lm
            .tx
            .send(Msg::Prime {
                client: self.slot,
                job,
            })
            .map_err(|_| stopped("temporal"))?;
        let mut job = self.prime_reply.recv().map_err(|_| stopped("temporal"))?;
        if let Some(e) = job.error.take() {
            return Err(e);
        }
        if let Some(j) = self.job.as_mut() {
            j.fresh = false;
        }
        Ok(job)
    }

    /// The last step's hidden state.
    pub fn read_hidden(&mut self, out: &mut Vec<f32>) {
        out.clear();
        if let Some(j) = &self.job {
            out.extend_from_slice(&j.hidden);
        }
    }

    /// The last step's text logits.
    pub fn read_logits(&mut self, out: &mut Vec<f32>) {
        out.clear();
        if let Some(j) = &self.job {
            out.extend_from_slice(&j.logits);
        }
    }
}

impl Drop for TemporalSlot {
    fn drop(&mut self) {
        let _ = self.lm.tx.send(Msg::Leave {
            client: self.slot,
            slot: Some(self.slot),
        });
        self.lm.release(self.slot);
    }
}
