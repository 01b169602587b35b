//! The shared LM engine: one temporal and one depformer session per pack and process, stepping
//! every conversation that has a frame ready in one batched call per tick.
//!
//! - **Weights once.** [`SharedLm::open`] opens a pack's temporal and depformer graphs; the
//!   process's [`Resources`](crate::resources::Resources) opens one per pack, execution provider
//!   and device the first time a stage asks for it, hands the same engine to every later one,
//!   and lets it go when the last conversation on it has left (the engine's thread ends when
//!   the last handle to it is dropped).
//! - **Slots.** The temporal half ([`temporal`]) holds `slots` KV slots, rows of one batch. A
//!   conversation claims a slot ([`SharedLm::temporal_slot`]) and gives it back when its client
//!   is dropped.
//! - **Ticks.** Each engine runs on a thread of its own, driven by a [`scheduler::Scheduler`]:
//!   a tick starts with the first request and gathers more until every conversation expected
//!   (one in the middle of its frame, or one that came straight back last time) has
//!   submitted, or `max_wait` has passed; a conversation that does not come is counted late
//!   and stepped in a later tick, and nobody waits for it again until then. Under load,
//!   requests that arrive while a tick runs are the next tick's batch.
//! - **Priming.** A conversation being primed asks for its slot's own work between ticks:
//!   a prefill chunk (frames known in advance, one graph call of its row alone), a copy of its
//!   state, or a state restored into it ([`TemporalSlot::prefill`], `snapshot`, `restore`).
//!   Each is one request, served after the tick it arrived with, so a priming conversation
//!   holds the live ones up by one chunk at most.
//! - **Depformer tick.** The depformer keeps no state between frames, so its batch is exactly
//!   the frames ready: one [`DepformerBatch`](crate::model::depformer::DepformerBatch), the
//!   same step a conversation's own depformer runs at one row ([`depformer`]). Its audio is
//!   drawn on the host, or where the logits are once any of its stages asks
//!   ([`SharedLm::want_device_sampling`]): the same tokens either way, so the whole batch
//!   switches.
//!
//! The engine reports what it does (ticks with their batch, context and time; late frames;
//! slots; opening, closing, failing) as [`EngineEvent`]s to the [`EngineObserver`] it was opened
//! with, and records nothing itself: the process's observer (`observe::engine`) turns them into
//! metrics and the latency diagnosis of the temporal tick (`duplex_latency_pattern{stage=
//! "engine"}`) off the engine's thread.
//!
//! Only GQA temporal graphs can share an engine (the standard graph has one past length for the
//! whole batch). Knows nothing of stages, pipelines or the network.

pub mod codec;
pub mod depformer;
pub mod scheduler;
pub mod temporal;
mod thread;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

pub use self::codec::{CodecOptions, CodecSlot, SharedCodec};
pub use self::depformer::DepformerClient;
pub use self::temporal::TemporalSlot;
use self::temporal::TemporalWorker;
use self::thread::{run_engine, DrawPlace};
use self::thread::{stopped, Msg};
use super::depformer::{check_frame, DepformerBatch, DepformerInput};
use super::error::ModelError;
use super::pack::{Graph, LmGraphInfo, Pack};
use super::session::{Provider, SessionOptions};
use super::temporal::FrameLimits;
use super::tensors::Placement;

/// The `stage` label of the temporal tick's latency verdict, trend and bimodality.
pub const ENGINE_STAGE: &str = "engine";

/// What an engine reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EngineEvent {
    /// The engine opened.
    Opened,
    /// The engine closed (its last conversation left).
    Closed,
    /// The engine's thread failed.
    Failed,
    /// Slots, and how many are claimed.
    Slots {
        /// Slots.
        slots: usize,
        /// Claimed.
        used: usize,
    },
    /// Frames a tick expected that had not come.
    Late(usize),
    /// A temporal tick.
    TemporalTick {
        /// Rows with a frame.
        batch: usize,
        /// The longest context among them.
        context: usize,
        /// The graph call's time.
        seconds: f64,
    },
    /// A depformer tick.
    DepformerTick {
        /// Frames in it.
        batch: usize,
        /// Its time.
        seconds: f64,
    },
    /// A shared codec opened (`open`) or closed.
    CodecOpen {
        /// `codec_encoder` or `codec_decoder`.
        engine: &'static str,
        /// Opened, or closed.
        open: bool,
    },
    /// A shared codec's slots, and how many are claimed.
    CodecSlots {
        /// `codec_encoder` or `codec_decoder`.
        engine: &'static str,
        /// Slots.
        slots: usize,
        /// Claimed.
        used: usize,
    },
    /// Frames a shared codec's tick expected that had not come.
    CodecLate {
        /// `codec_encoder` or `codec_decoder`.
        engine: &'static str,
        /// How many.
        n: usize,
    },
    /// A shared codec's batched call.
    CodecTick {
        /// `codec_encoder` or `codec_decoder`.
        engine: &'static str,
        /// Rows with a frame.
        batch: usize,
        /// The most frames any of them had stepped since its stream started.
        context: usize,
        /// The graph call's time.
        seconds: f64,
    },
}

/// Who hears an engine's [`EngineEvent`]s. Called on the engine's thread: it must not block.
pub trait EngineObserver: Send + Sync {
    /// One event.
    fn event(&self, ev: EngineEvent);
}

/// An observer that hears nothing (an engine opened without one).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unobserved;

impl EngineObserver for Unobserved {
    fn event(&self, _: EngineEvent) {}
}

/// Options of a shared engine (taken from the first stage that opens it).
#[derive(Clone)]
pub struct EngineOptions {
    /// Session options of both graphs.
    pub session: SessionOptions,
    /// KV slots: conversations the engine can hold at once (0: the process's count, which
    /// [`Resources`](crate::resources::Resources) fills in; at least 1 here).
    pub slots: usize,
    /// Positions per conversation (clamped to the pack's `max_positions`).
    pub max_positions: usize,
    /// How long a tick waits for the sessions it expects.
    pub max_wait: Duration,
    /// A fault drill: the engine's thread panics at this temporal tick (see
    /// [`Resources::set_engine_drill`](crate::resources::Resources::set_engine_drill), for the
    /// first engine a process opens).
    pub panic_at_tick: Option<u64>,
    /// Who hears what the engine does.
    pub observer: Arc<dyn EngineObserver>,
    /// Draw the depformer's audio where its logits are from the start (see
    /// [`SharedLm::want_device_sampling`]).
    pub device_sampling: bool,
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("session", &self.session)
            .field("slots", &self.slots)
            .field("max_positions", &self.max_positions)
            .field("max_wait", &self.max_wait)
            .field("panic_at_tick", &self.panic_at_tick)
            .field("device_sampling", &self.device_sampling)
            .finish_non_exhaustive()
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            session: SessionOptions::default(),
            slots: 0,
            max_positions: usize::MAX,
            max_wait: Duration::from_millis(5),
            panic_at_tick: None,
            observer: Arc::new(Unobserved),
            device_sampling: false,
        }
    }
}

/// What an engine has done since it opened.
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Temporal ticks (batched graph calls).
    pub temporal_ticks: AtomicU64,
    /// Session steps in them (rows with a frame).
    pub temporal_rows: AtomicU64,
    /// Most rows with a frame in one temporal tick.
    pub temporal_max_batch: AtomicU64,
    /// Depformer ticks.
    pub depformer_ticks: AtomicU64,
    /// Session frames in them.
    pub depformer_rows: AtomicU64,
    /// Frames that were expected in a tick and had not come (both engines).
    pub late: AtomicU64,
}

impl EngineStats {
    /// Mean rows per temporal tick.
    pub fn mean_temporal_batch(&self) -> f64 {
        let t = self.temporal_ticks.load(Ordering::Relaxed).max(1);
        self.temporal_rows.load(Ordering::Relaxed) as f64 / t as f64
    }
}

/// One pack's shared temporal and depformer engines.
pub struct SharedLm {
    observer: Arc<dyn EngineObserver>,
    failed: Arc<AtomicBool>,
    /// What the engine has done.
    pub stats: Arc<EngineStats>,
    /// KV slots.
    pub slots: usize,
    /// Positions per slot.
    pub capacity: usize,
    /// The temporal graph.
    pub temporal_info: LmGraphInfo,
    /// The depformer graph.
    pub depformer_info: LmGraphInfo,
    /// The execution provider in use.
    pub provider: Provider,
    /// Every KV buffer of both graphs: its input name, where it is, and where the session wants
    /// that input.
    pub cache_placements: Vec<(String, Placement, Placement)>,
    tx: Sender<Msg>,
    taken: SlotTable,
    draw: Arc<DrawPlace>,
    next_client: AtomicUsize,
    /// What a temporal frame must be (also the depformer's token ranges).
    limits: FrameLimits,
    steps: usize,
}

impl SharedLm {
    /// Opens `pack`'s temporal and depformer graphs as one engine on a thread of its own.
    ///
    /// # Errors
    ///
    /// A pack whose temporal graph is not GQA, contract and ONNX Runtime errors of either graph.
    pub fn open(pack: &Pack, opts: &EngineOptions) -> Result<SharedLm, ModelError> {
        let m = &pack.manifest;
        if opts.session.provider == Provider::Cpu {
            pack.check_cpu_room(None)?;
        }
        let slots = opts.slots.max(1);
        let capacity = opts.max_positions.min(m.max_positions).max(1);
        let channels = m.delays.len();
        let steps = 2 * m.codebooks;
        let (tx, rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let tpath = pack.graph_path(Graph::Temporal);
        let engine_pack = pack.clone();
        let session = opts.session;
        let wait = opts.max_wait;
        let drill = opts.panic_at_tick;
        let observer = opts.observer.clone();
        let obs = observer.clone();
        let stats = Arc::new(EngineStats::default());
        let st = stats.clone();
        let failed = Arc::new(AtomicBool::new(false));
        let fail = failed.clone();
        let draw = Arc::new(DrawPlace {
            wanted: AtomicBool::new(opts.device_sampling),
            on: AtomicBool::new(false),
            session,
        });
        let place = draw.clone();
        std::thread::Builder::new()
            .name("duplex:engine".into())
            .spawn(move || {
                let opened = TemporalWorker::open(&tpath, &session, slots, capacity, channels)
                    .and_then(|t| {
                        DepformerBatch::open(&engine_pack, "depformer (shared engine)", &session, slots)
                            .map(|d| (t, d))
                    });
                match opened {
                    Ok((t, d)) => {
                        let mut places = t.batch.cache_placements();
                        places.extend(d.cache_placements());
                        let infos = (t.info().clone(), d.info.clone(), t.batch.provider, places);
                        let _ = ready_tx.send(Ok(infos));
                        // A panic ends the engine: it is marked failed (its conversations get
                        // an error as their replies are dropped) and the next conversation
                        // opens a fresh one.
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            run_engine(t, d, &rx, wait, &st, drill, &*obs, &place)
                        }));
                        if let Err(p) = run {
                            fail.store(true, Ordering::Release);
                            obs.event(EngineEvent::Failed);
                            let why = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_else(|| "a panic".into());
                            tracing::error!(
                                "the shared LM engine failed ({why}): its conversations end; the next one opens a fresh engine"
                            );
                        }
                    }
                    Err(e) => drop(ready_tx.send(Err(e))),
                }
            })
            .map_err(|e| ModelError::contract("engine", format!("no thread: {e}")))?;
        let (tinfo, dinfo, provider, cache_placements) = ready_rx
            .recv()
            .map_err(|_| ModelError::contract("temporal", "the engine's thread ended"))??;
        if tinfo.hidden_dim != dinfo.hidden_dim {
            return Err(ModelError::contract(
                "depformer",
                format!(
                    "takes a hidden state of {} values, the temporal graph gives {}",
                    dinfo.hidden_dim, tinfo.hidden_dim
                ),
            ));
        }
        observer.event(EngineEvent::Opened);
        let lm = SharedLm {
            observer: observer.clone(),
            failed,
            stats,
            slots,
            capacity,
            temporal_info: tinfo,
            depformer_info: dinfo,
            provider,
            cache_placements,
            tx,
            taken: SlotTable::new(
                slots,
                observer.clone(),
                |_, slots, used| EngineEvent::Slots { slots, used },
                "engine",
                "shared engine",
                "temporal",
            ),
            next_client: AtomicUsize::new(0),
            draw,
            limits: FrameLimits::of(pack),
            steps,
        };
        tracing::info!(
            pack = %pack.dir.display(),
            slots,
            capacity,
            layers = lm.temporal_info.layers,
            kv_bytes_per_slot = lm.kv_bytes_per_slot(),
            "shared LM engine ready"
        );
        Ok(lm)
    }

    /// Bytes of temporal KV cache one slot holds: K and V of every layer, `capacity + 1` rows.
    pub fn kv_bytes_per_slot(&self) -> usize {
        let i = &self.temporal_info;
        let element = if i.kv == super::pack::FloatType::F16 {
            2
        } else {
            4
        };
        i.layers * 2 * i.heads * (self.capacity + 1) * i.head_dim * element
    }

    /// From the next depformer tick on, draws every conversation's audio where the logits are
    /// (device sampling: the same tokens, no logits to the host each substep). Taken up once;
    /// if the engine's thread cannot, it says why in the log and goes on drawing on the host.
    pub fn want_device_sampling(&self) {
        self.draw.wanted.store(true, Ordering::Release);
    }

    /// Whether the engine's depformer draws the audio where the logits are.
    pub fn draws_on_device(&self) -> bool {
        self.draw.on.load(Ordering::Acquire)
    }

    /// Whether the engine's thread has failed (it serves nobody any more).
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Sets the slot gauges (after a metrics recorder is installed).
    pub fn publish(&self) {
        self.taken.publish();
    }

    /// Slots not claimed.
    pub fn free_slots(&self) -> usize {
        self.taken.free()
    }

    /// What the graphs run on: `cpu f32`, `cuda f16` (with the engine's batch).
    pub fn runs_on(&self) -> String {
        format!(
            "{} {} (shared engine, {} slots)",
            self.provider.name(),
            self.temporal_info.kv.name(),
            self.slots
        )
    }

    /// Claims a KV slot for a conversation of at most `max_positions` positions.
    ///
    /// # Errors
    ///
    /// When every slot is in use.
    pub fn temporal_slot(
        self: &Arc<Self>,
        max_positions: usize,
    ) -> Result<TemporalSlot, ModelError> {
        let slot = self.taken.claim("engine")?;
        Ok(TemporalSlot::new(
            self.clone(),
            slot,
            max_positions.min(self.capacity).max(1),
        ))
    }

    /// A client of the depformer engine.
    pub fn depformer_client(self: &Arc<Self>) -> DepformerClient {
        DepformerClient::new(
            self.clone(),
            self.next_client.fetch_add(1, Ordering::Relaxed),
        )
    }

    /// Checks a depformer frame before it joins a batch.
    fn check_depformer_frame(&self, frame: &DepformerInput<'_>) -> Result<(), ModelError> {
        check_frame(
            frame,
            self.depformer_info.hidden_dim,
            self.steps,
            self.limits.text,
            self.limits.audio,
        )
    }

    fn release(&self, slot: usize) {
        self.taken.release(slot);
    }
}

/// The slots of a shared engine (the LM's KV slots, a codec's rows): which are claimed,
/// reported to the engine's observer at every claim and release.
pub(crate) struct SlotTable {
    taken: Mutex<Vec<bool>>,
    observer: Arc<dyn EngineObserver>,
    /// The event that reports (slots, claimed).
    report: fn(&'static str, usize, usize) -> EngineEvent,
    /// The engine's name in that event, in messages (`shared engine`, `shared codec`) and the
    /// graph a full table is reported for.
    engine: &'static str,
    what: &'static str,
    graph: &'static str,
}

impl SlotTable {
    /// `slots` free slots of the engine `what` (its event label `engine`), whose claims are
    /// for `graph`.
    pub(crate) fn new(
        slots: usize,
        observer: Arc<dyn EngineObserver>,
        report: fn(&'static str, usize, usize) -> EngineEvent,
        engine: &'static str,
        what: &'static str,
        graph: &'static str,
    ) -> Self {
        SlotTable {
            taken: Mutex::new(vec![false; slots]),
            observer,
            report,
            engine,
            what,
            graph,
        }
    }

    fn publish_locked(&self, taken: &[bool]) {
        let used = taken.iter().filter(|x| **x).count();
        self.observer
            .event((self.report)(self.engine, taken.len(), used));
    }

    /// Reports the slots (after a metrics recorder is installed).
    pub(crate) fn publish(&self) {
        if let Ok(t) = self.taken.lock() {
            self.publish_locked(&t);
        }
    }

    /// Slots not claimed.
    pub(crate) fn free(&self) -> usize {
        self.taken
            .lock()
            .map(|t| t.iter().filter(|x| !**x).count())
            .unwrap_or(0)
    }

    /// Claims the lowest free slot.
    ///
    /// # Errors
    ///
    /// [`ModelError::Busy`] when every slot is in use.
    pub(crate) fn claim(&self, poisoned: &str) -> Result<usize, ModelError> {
        let mut t = self
            .taken
            .lock()
            .map_err(|_| ModelError::contract(poisoned, "the slot table is poisoned"))?;
        let Some(i) = t.iter().position(|x| !x) else {
            return Err(ModelError::Busy {
                graph: self.graph.into(),
                detail: format!(
                    "all {} slots of the {} are in use (raise `slots`)",
                    t.len(),
                    self.what
                ),
            });
        };
        t[i] = true;
        self.publish_locked(&t);
        Ok(i)
    }

    /// Gives slot `slot` back.
    pub(crate) fn release(&self, slot: usize) {
        if let Ok(mut t) = self.taken.lock() {
            if let Some(x) = t.get_mut(slot) {
                *x = false;
            }
            self.publish_locked(&t);
        }
    }
}

impl Drop for SharedLm {
    fn drop(&mut self) {
        // The engine's thread ends with the channel this drops.
        self.observer.event(EngineEvent::Closed);
        tracing::info!(
            slots = self.slots,
            "shared LM engine closed: its last conversation left"
        );
    }
}

impl std::fmt::Debug for SharedLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLm")
            .field("slots", &self.slots)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}
