//! The shared codec engine: one Mimi step graph (encoder or decoder) per pack, precision and
//! device, stepping every conversation that has a frame ready in one batched call per tick.
//!
//! - **Weights once.** [`SharedCodec::open`] opens one role's step graph with a batch row per
//!   slot ([`StepCodec::open_rows`]); the process's
//!   [`Resources`](crate::resources::Resources) opens one per (pack, role, precision, provider,
//!   device) and hands it to every conversation. Encode and decode are at different phases of
//!   a frame (the user's audio comes in while the agent's goes out), so each role is an engine
//!   of its own, on a thread of its own.
//! - **Slots.** A conversation claims a slot ([`SharedCodec::slot`]): a batch row with its own
//!   state. Its first frame, and the first after [`CodecSlot::reset`] (a new conversation,
//!   a persona, a long session's re-prime), starts a new stream in that row alone; a slot given
//!   back is reset for its next owner.
//! - **Ticks.** The same [`Scheduler`] as the LM engine's gathers the frames, paced at the
//!   codec's frame rate: a tick waits up to `max_wait` for the conversations whose next frame
//!   is due, so conversations at different phases of the 80 ms frame share a call instead of
//!   each paying one. One call steps their rows (from the first to the last, not every slot)
//!   and leaves every other row exactly as it was (the step graphs' `active` input), so
//!   conversations join, leave and miss ticks without touching each other.
//! - **Warm.** The engine's first call (the slow one: ONNX Runtime plans it) runs when it opens,
//!   so a conversation's first frame costs what any frame costs.
//!
//! A frame is checked in the conversation's thread before it joins a batch (its size, its codes'
//! range), so one client's bad frame never fails another's. Reports its ticks (role, batch,
//! time), late frames and slots as [`EngineEvent`]s. Knows nothing of stages or the network.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use super::scheduler::{Arrival, Request, Scheduler, Served};
use super::{EngineEvent, EngineObserver, SlotTable, Unobserved};
use crate::model::error::ModelError;
use crate::model::mimi_step::StepCodec;
use crate::model::pack::{FloatType, Pack, StepRole};
use crate::model::session::{Provider, SessionOptions};

/// Options of a shared codec engine (taken from the first stage that opens it).
#[derive(Clone)]
pub struct CodecOptions {
    /// Session options of the step graph.
    pub session: SessionOptions,
    /// Slots: conversations the engine holds at once (at least 1).
    pub slots: usize,
    /// How long a tick waits for the conversations whose next frame is due (paced at the
    /// codec's frame rate) or that are expected back at once: longer gathers more frames into
    /// one call and adds at most this much to a frame's latency.
    pub max_wait: Duration,
    /// Who hears what the engine does.
    pub observer: Arc<dyn EngineObserver>,
}

impl Default for CodecOptions {
    fn default() -> Self {
        CodecOptions {
            session: SessionOptions::default(),
            slots: 1,
            max_wait: Duration::from_millis(30),
            observer: Arc::new(Unobserved),
        }
    }
}

/// What a codec engine has done since it opened.
#[derive(Debug, Default)]
pub struct CodecStats {
    /// Batched calls.
    pub ticks: AtomicU64,
    /// Frames in them.
    pub rows: AtomicU64,
    /// Most frames in one call.
    pub max_batch: AtomicU64,
    /// Frames a tick expected that had not come.
    pub late: AtomicU64,
}

impl CodecStats {
    /// Mean frames per call.
    pub fn mean_batch(&self) -> f64 {
        let t = self.ticks.load(Ordering::Relaxed).max(1);
        self.rows.load(Ordering::Relaxed) as f64 / t as f64
    }
}

/// A frame on its way through the engine: its buffers travel with it and come back.
struct CodecJob {
    slot: usize,
    /// Start a new stream in the slot's row first.
    fresh: bool,
    pcm: Vec<f32>,
    codes: Vec<i64>,
    error: Option<ModelError>,
    reply: Sender<CodecJob>,
}

enum Msg {
    Frame(CodecJob),
    Leave(usize),
}

impl Request for Msg {
    fn arrival(&self) -> Arrival {
        match self {
            Msg::Frame(j) => Arrival::Starts(j.slot),
            Msg::Leave(s) => Arrival::Leaves(*s),
        }
    }
}

/// One role of one pack's codec, shared by the conversations of a process.
pub struct SharedCodec {
    /// Encoder or decoder.
    pub role: StepRole,
    /// Slots (batch rows).
    pub slots: usize,
    /// What the engine has done.
    pub stats: Arc<CodecStats>,
    /// The execution provider in use.
    pub provider: Provider,
    /// The step graph's precision.
    pub dtype: FloatType,
    observer: Arc<dyn EngineObserver>,
    failed: Arc<AtomicBool>,
    tx: Sender<Msg>,
    taken: SlotTable,
    frame: usize,
    codebooks: usize,
    vocab: i64,
}

impl std::fmt::Debug for SharedCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCodec")
            .field("role", &self.role)
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

/// The `engine` label of a role's metrics.
pub fn label(role: StepRole) -> &'static str {
    match role {
        StepRole::Encoder => "codec_encoder",
        StepRole::Decoder => "codec_decoder",
    }
}

impl SharedCodec {
    /// Opens `pack`'s `role` step graph of precision `dtype` with `opts.slots` rows on a thread
    /// of its own, and warms it.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] when the pack's step graph cannot leave a row out of a call (built
    /// before the `active` input: naming the pack and the command that rebuilds it), and
    /// [`StepCodec::open_rows`]' errors.
    pub fn open(
        pack: &Pack,
        role: StepRole,
        dtype: FloatType,
        opts: &CodecOptions,
    ) -> Result<SharedCodec, ModelError> {
        let slots = opts.slots.max(1);
        let graph = role.graph();
        let mut codec = StepCodec::open_rows(pack, role, dtype, &opts.session, slots)?;
        if !codec.steps_some_rows() {
            return Err(ModelError::Pack {
                path: pack.dir.clone(),
                detail: format!(
                    "its {graph} graph ({}) has no `active` input, so a shared codec cannot step \
                     some conversations and leave the others: rebuild the step graphs with \
                     `python tools/make_mimi_step.py {}` (or use `engine: own`)",
                    dtype.name(),
                    pack.dir.display()
                ),
            });
        }
        let m = &pack.manifest;
        let (frame, codebooks, vocab) = (m.frame_size, m.codebooks, m.audio_vocab);
        // The first call is the slow one: paid now, not by a conversation's first frame.
        let t0 = Instant::now();
        match role {
            StepRole::Encoder => drop(codec.encode_rows(&vec![0.0; slots * frame])?),
            StepRole::Decoder => drop(codec.decode_rows(&vec![0; slots * codebooks], vocab)?),
        }
        codec.reset()?;
        let provider = codec.provider;
        let (tx, rx) = unbounded();
        let stats = Arc::new(CodecStats::default());
        let failed = Arc::new(AtomicBool::new(false));
        let (st, fail, obs) = (stats.clone(), failed.clone(), opts.observer.clone());
        let wait = opts.max_wait;
        let period = Duration::from_secs_f64(frame as f64 / f64::from(m.sample_rate.max(1)));
        std::thread::Builder::new()
            .name(format!("duplex:{}", label(role)))
            .spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run_codec(
                        codec,
                        &rx,
                        Scheduler::new(wait).with_period(period),
                        &st,
                        &*obs,
                        vocab,
                    )
                }));
                if run.is_err() {
                    fail.store(true, Ordering::Release);
                    obs.event(EngineEvent::Failed);
                    tracing::error!(
                        "the shared {graph} failed: its conversations end; the next one opens a \
                         fresh engine"
                    );
                }
            })
            .map_err(|e| ModelError::contract(graph, format!("no thread: {e}")))?;
        opts.observer.event(EngineEvent::CodecOpen {
            engine: label(role),
            open: true,
        });
        tracing::info!(
            pack = %pack.dir.display(),
            graph,
            slots,
            warm_ms = t0.elapsed().as_millis() as u64,
            "shared codec ready"
        );
        Ok(SharedCodec {
            role,
            slots,
            stats,
            provider,
            dtype,
            observer: opts.observer.clone(),
            failed,
            tx,
            taken: SlotTable::new(
                slots,
                opts.observer.clone(),
                |engine, slots, used| EngineEvent::CodecSlots {
                    engine,
                    slots,
                    used,
                },
                label(role),
                "shared codec",
                graph,
            ),
            frame,
            codebooks,
            vocab,
        })
    }

    /// Whether the engine's thread has failed (it serves nobody any more).
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Slots not claimed.
    pub fn free_slots(&self) -> usize {
        self.taken.free()
    }

    /// What the graph runs on: `cpu f32 stateful (shared codec, 8 slots)`.
    pub fn runs_on(&self) -> String {
        format!(
            "{} {} stateful (shared codec, {} slots)",
            self.provider.name(),
            self.dtype.name(),
            self.slots
        )
    }

    /// Sets the slot gauges (after a metrics recorder is installed).
    pub fn publish_slots(&self) {
        self.taken.publish();
    }

    /// Claims a slot: a batch row whose first frame starts a new stream.
    ///
    /// # Errors
    ///
    /// [`ModelError::Busy`] when every slot is in use.
    pub fn slot(self: &Arc<Self>) -> Result<CodecSlot, ModelError> {
        let slot = self.taken.claim(self.role.graph())?;
        let (tx, rx) = bounded(1);
        Ok(CodecSlot {
            job: Some(CodecJob {
                slot,
                fresh: true,
                pcm: Vec::with_capacity(self.frame),
                codes: Vec::with_capacity(self.codebooks),
                error: None,
                reply: tx,
            }),
            reply: rx,
            codec: self.clone(),
            slot,
            frames: 0,
        })
    }

    fn release(&self, slot: usize) {
        self.taken.release(slot);
    }
}

impl Drop for SharedCodec {
    fn drop(&mut self) {
        // The thread ends with the channel this drops.
        self.observer.event(EngineEvent::CodecOpen {
            engine: label(self.role),
            open: false,
        });
        tracing::info!(
            graph = self.role.graph(),
            "shared codec closed: its last conversation left"
        );
    }
}

fn stopped(graph: &str) -> ModelError {
    ModelError::contract(graph, "the shared codec's thread has stopped")
}

/// A conversation's row of a [`SharedCodec`]. Dropping it gives the row back.
pub struct CodecSlot {
    codec: Arc<SharedCodec>,
    slot: usize,
    job: Option<CodecJob>,
    reply: Receiver<CodecJob>,
    /// Frames since the stream started.
    pub frames: u64,
}

impl std::fmt::Debug for CodecSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CodecSlot")
            .field("slot", &self.slot)
            .field("frames", &self.frames)
            .finish_non_exhaustive()
    }
}

impl CodecSlot {
    /// The engine.
    pub fn codec(&self) -> &Arc<SharedCodec> {
        &self.codec
    }

    /// The batch row this conversation has.
    pub fn row(&self) -> usize {
        self.slot
    }

    /// Starts a new stream at the next frame.
    pub fn reset(&mut self) {
        if let Some(j) = self.job.as_mut() {
            j.fresh = true;
        }
        self.frames = 0;
    }

    /// The job that travels with this slot's frames, or the error of an engine that kept it
    /// (its thread stopped while it held it).
    fn job(&mut self) -> Result<&mut CodecJob, ModelError> {
        let graph = self.codec.role.graph();
        self.job.as_mut().ok_or_else(|| stopped(graph))
    }

    fn call(&mut self) -> Result<&mut CodecJob, ModelError> {
        let graph = self.codec.role.graph();
        let job = self.job.take().ok_or_else(|| stopped(graph))?;
        if let Err(crossbeam_channel::SendError(m)) = self.codec.tx.send(Msg::Frame(job)) {
            if let Msg::Frame(j) = m {
                self.job = Some(j);
            }
            return Err(stopped(graph));
        }
        let job = self.reply.recv().map_err(|_| stopped(graph))?;
        let j = self.job.insert(job);
        if let Some(e) = j.error.take() {
            // A stream that was to start afresh still is.
            return Err(e);
        }
        j.fresh = false;
        self.frames += 1;
        Ok(j)
    }

    /// Encodes the stream's next frame (an encoder's slot); returns its codes.
    ///
    /// # Errors
    ///
    /// A frame of the wrong size, a decoder's slot, the engine's errors.
    pub fn encode(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        let c = &self.codec;
        if c.role != StepRole::Encoder {
            return Err(ModelError::contract(c.role.graph(), "not an encoder"));
        }
        if frame.len() != c.frame {
            return Err(ModelError::contract(
                c.role.graph(),
                format!("{} samples, expected {}", frame.len(), c.frame),
            ));
        }
        let j = self.job()?;
        j.pcm.clear();
        j.pcm.extend_from_slice(frame);
        Ok(self.call()?.codes.clone())
    }

    /// Decodes the stream's next frame of codes (a decoder's slot); returns its samples.
    ///
    /// # Errors
    ///
    /// Codes of the wrong count or out of range, an encoder's slot, the engine's errors.
    pub fn decode(&mut self, codes: &[i64]) -> Result<Vec<f32>, ModelError> {
        let c = &self.codec;
        if c.role != StepRole::Decoder {
            return Err(ModelError::contract(c.role.graph(), "not a decoder"));
        }
        if codes.len() != c.codebooks {
            return Err(ModelError::contract(
                c.role.graph(),
                format!("{} codes, expected {}", codes.len(), c.codebooks),
            ));
        }
        if let Some((i, &v)) = codes
            .iter()
            .enumerate()
            .find(|(_, &v)| !(0..c.vocab).contains(&v))
        {
            return Err(ModelError::Token {
                graph: c.role.graph().into(),
                channel: format!("codebook {i}"),
                value: v,
                limit: c.vocab,
            });
        }
        let j = self.job()?;
        j.codes.clear();
        j.codes.extend_from_slice(codes);
        Ok(self.call()?.pcm.clone())
    }
}

impl Drop for CodecSlot {
    fn drop(&mut self) {
        let _ = self.codec.tx.send(Msg::Leave(self.slot));
        self.codec.release(self.slot);
    }
}

/// The engine's thread: ticks until every handle is gone.
fn run_codec(
    mut codec: StepCodec,
    rx: &Receiver<Msg>,
    mut sched: Scheduler<Msg>,
    stats: &CodecStats,
    observer: &dyn EngineObserver,
    vocab: i64,
) {
    let rows = codec.rows;
    let role = if codec.manifest.input == "pcm" {
        StepRole::Encoder
    } else {
        StepRole::Decoder
    };
    let engine = label(role);
    let frame = codec.manifest.frame_samples;
    let q = codec.manifest.codebooks;
    let mut active = vec![false; rows];
    let mut pcm = vec![0.0f32; rows * frame];
    let mut codes = vec![0i64; rows * q];
    // Frames stepped per row since its stream started, for the tick's report.
    let mut age = vec![0usize; rows];
    while let Some(late) = sched.gather(rx) {
        if late > 0 {
            observer.event(EngineEvent::CodecLate { engine, n: late });
            stats.late.fetch_add(late as u64, Ordering::Relaxed);
        }
        for m in sched.take_out(|m| matches!(m, Msg::Leave(_))) {
            if let Msg::Leave(s) = m {
                // Its next owner resets it again; a failure here is that one's to see.
                if let Err(e) = codec.reset_row(s) {
                    tracing::warn!("resetting a slot given back: {e}");
                }
                if let Some(a) = age.get_mut(s) {
                    *a = 0;
                }
            }
        }
        // One frame per row: a second one (none today: a slot waits for its answer) would
        // stay for the next tick.
        active.fill(false);
        let mut jobs: Vec<CodecJob> = Vec::new();
        for m in sched.take_out(|m| match m {
            Msg::Frame(j) => j.slot < rows && !std::mem::replace(&mut active[j.slot], true),
            Msg::Leave(_) => false,
        }) {
            if let Msg::Frame(j) = m {
                jobs.push(j);
            }
        }
        if jobs.is_empty() {
            continue;
        }
        for j in &mut jobs {
            if j.fresh {
                if let Err(e) = codec.reset_row(j.slot) {
                    j.error = Some(e);
                    active[j.slot] = false;
                }
                age[j.slot] = 0;
            }
            match role {
                StepRole::Encoder => {
                    pcm[j.slot * frame..(j.slot + 1) * frame].copy_from_slice(&j.pcm)
                }
                StepRole::Decoder => codes[j.slot * q..(j.slot + 1) * q].copy_from_slice(&j.codes),
            }
        }
        let n = jobs.len();
        let t0 = Instant::now();
        let result = match role {
            StepRole::Encoder => codec
                .encode_some(&pcm, Some(&active))
                .map(|c| codes.copy_from_slice(&c)),
            StepRole::Decoder => codec
                .decode_some(&codes, Some(&active), vocab)
                .map(|p| pcm.copy_from_slice(&p)),
        };
        let seconds = t0.elapsed().as_secs_f64();
        stats.ticks.fetch_add(1, Ordering::Relaxed);
        stats.rows.fetch_add(n as u64, Ordering::Relaxed);
        stats.max_batch.fetch_max(n as u64, Ordering::Relaxed);
        let context = jobs.iter().map(|j| age[j.slot]).max().unwrap_or(0);
        observer.event(EngineEvent::CodecTick {
            engine,
            batch: n,
            context,
            seconds,
        });
        for mut j in jobs {
            let s = j.slot;
            age[s] += 1;
            match &result {
                _ if j.error.is_some() => {}
                Ok(()) => match role {
                    StepRole::Encoder => {
                        j.codes.clear();
                        j.codes.extend_from_slice(&codes[s * q..(s + 1) * q]);
                    }
                    StepRole::Decoder => {
                        j.pcm.clear();
                        j.pcm.extend_from_slice(&pcm[s * frame..(s + 1) * frame]);
                    }
                },
                Err(e) => j.error = Some(ModelError::ort(role.graph(), e.to_string())),
            }
            sched.served(s, Served::FrameDone);
            let tx = j.reply.clone();
            let _ = tx.send(j);
        }
    }
}
