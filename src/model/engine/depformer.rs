//! The shared engine's depformer half: a conversation's [`DepformerClient`], and the job it
//! sends to the engine's thread, where one [`DepformerBatch`] runs every frame of a tick.

use std::sync::Arc;

use crossbeam_channel::{bounded, Receiver, Sender};

use super::{stopped, Msg, SharedLm};
use crate::model::depformer::{DepformerBatch, DepformerInput, DepformerRow, UnusedSubsteps};
use crate::model::error::ModelError;
use crate::model::sampling::{Sampler, SamplingParams};

/// A frame on its way to the engine and back.
pub(super) struct DepformerJob {
    pub row: DepformerRow,
    pub reply: Sender<DepformerJob>,
}

/// Runs a tick's frames in one batch; an ONNX Runtime error fails every frame of it.
pub(super) fn tick(batch: &mut DepformerBatch, jobs: &mut [(usize, DepformerJob)]) {
    let mut rows: Vec<&mut DepformerRow> = jobs.iter_mut().map(|(_, j)| &mut j.row).collect();
    if let Err(e) = batch.run(&mut rows) {
        let msg = e.to_string();
        for r in rows {
            r.error = Some(ModelError::ort("depformer (shared engine)", &msg));
        }
    }
}

/// A session's client of a shared depformer engine: [`Depformer::run`](crate::model::depformer::Depformer::run)'s
/// interface, run in the engine's batch.
pub struct DepformerClient {
    lm: Arc<SharedLm>,
    id: usize,
    reply: Receiver<DepformerJob>,
    job: Option<DepformerJob>,
    /// What is done with the substeps nothing reads.
    pub unused: UnusedSubsteps,
    /// Substeps run and skipped so far.
    pub counts: (u64, u64),
    /// The conversation's temporal slot in the same engine, when it has one (set per frame).
    pub conversation: Option<usize>,
    /// Keep every substep's logits of the last frame in [`logits`](Self::logits) (diagnostics).
    pub keep_logits: bool,
    /// The last frame's logits per substep run, when `keep_logits` is set.
    pub logits: Vec<Vec<f32>>,
}

impl DepformerClient {
    pub(super) fn new(lm: Arc<SharedLm>, id: usize) -> Self {
        let (tx, rx) = bounded(1);
        DepformerClient {
            lm,
            id,
            reply: rx,
            job: Some(DepformerJob {
                row: DepformerRow::new(),
                reply: tx,
            }),
            unused: UnusedSubsteps::Run,
            counts: (0, 0),
            conversation: None,
            keep_logits: false,
            logits: Vec::new(),
        }
    }

    /// The key of this client's conversation: its slot, or a key of its own.
    fn key(&self) -> usize {
        self.conversation.unwrap_or(usize::MAX - self.id)
    }

    /// What the graph runs on.
    pub fn runs_on(&self) -> String {
        self.lm.runs_on()
    }

    /// Substeps per frame.
    pub fn steps(&self) -> usize {
        self.lm.steps
    }

    /// Generates the audio tokens of one frame into `out`, as
    /// [`Depformer::run`](crate::model::depformer::Depformer::run) does, in the engine's next tick.
    ///
    /// # Errors
    ///
    /// [`ModelError::Token`] for a provided id outside its table (checked here, before the
    /// batch), the engine's errors.
    pub fn run(
        &mut self,
        frame: DepformerInput<'_>,
        sampler: &mut Sampler,
        params: SamplingParams,
        out: &mut Vec<i64>,
    ) -> Result<(), ModelError> {
        self.lm.check_depformer_frame(&frame)?;
        let mut job = self.job.take().ok_or_else(|| stopped("depformer"))?;
        let logits = self.keep_logits.then(|| std::mem::take(&mut self.logits));
        job.row
            .load(frame, self.lm.steps, sampler, params, self.unused, logits);
        let sent = self.lm.tx.send(Msg::Depformer {
            client: self.key(),
            job,
        });
        if let Err(e) = sent {
            // Keep the random stream where it was.
            if let Msg::Depformer { mut job, .. } = e.0 {
                job.row.return_sampler(sampler);
            }
            return Err(stopped("depformer"));
        }
        let mut job = self.reply.recv().map_err(|_| stopped("depformer"))?;
        job.row.return_sampler(sampler);
        let done = job.row.unload(out, &mut self.counts, &mut self.logits);
        self.job = Some(job);
        done
    }
}

impl Drop for DepformerClient {
    fn drop(&mut self) {
        // A conversation keyed by its slot leaves with its temporal half.
        if self.conversation.is_none() {
            let _ = self.lm.tx.send(Msg::Leave {
                client: self.key(),
                slot: None,
            });
        }
    }
}
