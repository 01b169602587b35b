//! The shared engine's temporal half: the [`TemporalWorker`] that steps every slot of a tick
//! in one call of the GQA temporal graph (the [`TemporalBatch`], the same step a conversation
//! of its own takes at one row), and a conversation's [`TemporalSlot`].

use std::sync::Arc;

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{stopped, Msg, SharedLm};
use crate::model::error::ModelError;
use crate::model::pack::{check_temporal, LmGraphInfo, Variant};
use crate::model::session::{open, report, Provider, SessionOptions};
use crate::model::temporal::{BatchRow, Temporal, TemporalBatch, TemporalState, TemporalStep};

pub(super) struct TemporalJob {
    pub row: BatchRow,
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

/// The engine's temporal graph: the batch of every slot.
pub(super) struct TemporalWorker {
    pub batch: TemporalBatch,
}

impl TemporalWorker {
    pub fn open(
        path: &std::path::Path,
        session: &SessionOptions,
        slots: usize,
        capacity: usize,
        channels: usize,
    ) -> Result<TemporalWorker, ModelError> {
        let graph = "temporal (shared engine)";
        let os = open(path, "temporal", session)?;
        let info = check_temporal(&os.session, "temporal", channels)?;
        if info.variant != Variant::Gqa {
            return Err(ModelError::contract(
                "temporal",
                "a shared engine needs the GQA temporal graph (per-row lengths); this pack's is the standard one: use `engine: own`, or export the `cpu`/`cuda` variant",
            ));
        }
        let batch = TemporalBatch::new(os, info, graph, slots, capacity, channels)?;
        report(session, graph, batch.provider, batch.info.kv.name());
        Ok(TemporalWorker { batch })
    }

    /// The graph's description.
    pub fn info(&self) -> &LmGraphInfo {
        &self.batch.info
    }

    /// One batched step of the slots `0..=max(slot)`.
    pub fn tick(&mut self, jobs: &mut [(usize, TemporalJob)]) -> ort::Result<()> {
        let mut rows: Vec<&mut BatchRow> = jobs.iter_mut().map(|(_, j)| &mut j.row).collect();
        self.batch.tick(&mut rows)
    }

    /// Serves a priming conversation's job (between ticks: its slot is nobody else's).
    pub fn prime(&mut self, job: &mut PrimeJob) {
        if job.fresh {
            self.batch.len[job.slot] = 0;
        }
        let b = &mut self.batch;
        let r = match &job.work {
            PrimeWork::Prefill(frames) => {
                b.prefill(job.slot, frames, &mut job.hidden, &mut job.logits)
            }
            PrimeWork::Snapshot => b.snapshot(job.slot).map(|s| job.state = Some(s)),
            PrimeWork::Restore(state) => b.restore(job.slot, state),
        };
        if let Err(e) = r {
            job.error = Some(e);
        }
    }
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
                row: BatchRow::new(slot, lm.limits.channels),
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

    /// One priming job, served between the engine's ticks.
    fn prime(&mut self, work: PrimeWork) -> Result<PrimeJob, ModelError> {
        let fresh = self.job.as_ref().is_some_and(|j| j.row.fresh);
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
            j.row.fresh = false;
        }
        Ok(job)
    }
}

impl TemporalStep for TemporalSlot {
    fn info(&self) -> &LmGraphInfo {
        &self.lm.temporal_info
    }

    fn provider(&self) -> Provider {
        self.lm.provider
    }

    fn slot(&self) -> Option<usize> {
        Some(self.slot)
    }

    fn runs_on(&self) -> String {
        self.lm.runs_on()
    }

    fn reset(&mut self) {
        self.pos = 0;
        if let Some(j) = self.job.as_mut() {
            j.row.fresh = true;
        }
    }

    fn kv_len(&self) -> usize {
        self.pos
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, input: &[i64]) -> Result<(), ModelError> {
        self.lm
            .limits
            .check_step(input, self.pos, self.positions_left())?;
        let mut job = self.job.take().ok_or_else(|| stopped("temporal"))?;
        job.row.input.clear();
        job.row.input.extend_from_slice(input);
        job.row.error = None;
        self.lm
            .tx
            .send(Msg::Temporal {
                client: self.slot,
                job,
            })
            .map_err(|_| stopped("temporal"))?;
        let mut job = self.reply.recv().map_err(|_| stopped("temporal"))?;
        let err = job.row.error.take();
        self.job = Some(job);
        if let Some(e) = err {
            return Err(e);
        }
        self.pos += 1;
        Ok(())
    }

    fn prefill(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        self.lm
            .limits
            .check_prefill(frames, self.pos, self.positions_left())?;
        for part in frames.chunks(chunk.max(1)) {
            let job = self.prime(PrimeWork::Prefill(part.to_vec()))?;
            self.pos += part.len();
            if let Some(j) = self.job.as_mut() {
                j.row.hidden.clone_from(&job.hidden);
                j.row.logits.clone_from(&job.logits);
            }
        }
        Ok(())
    }

    fn snapshot(&mut self) -> Option<TemporalState> {
        self.prime(PrimeWork::Snapshot).ok()?.state
    }

    fn restore(&mut self, state: &Arc<TemporalState>) -> Result<(), ModelError> {
        self.prime(PrimeWork::Restore(state.clone()))?;
        self.pos = state.pos;
        Ok(())
    }

    fn read_hidden(&mut self, out: &mut Vec<f32>) {
        out.clear();
        if let Some(j) = &self.job {
            out.extend_from_slice(&j.row.hidden);
        }
    }

    fn read_logits(&mut self, out: &mut Vec<f32>) {
        out.clear();
        if let Some(j) = &self.job {
            out.extend_from_slice(&j.row.logits);
        }
    }
}

impl From<TemporalSlot> for Temporal {
    fn from(t: TemporalSlot) -> Self {
        Box::new(t)
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
