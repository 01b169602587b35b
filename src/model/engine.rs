//! The shared LM engine: one temporal and one depformer session per pack and process, stepping
//! every conversation that has a frame ready in one batched call per tick.
//!
//! - **Weights once.** [`SharedLm::open`] opens a pack's temporal and depformer graphs; the
//!   process's [`Resources`](crate::resources::Resources) opens one per pack, execution provider
//!   and device the first time a stage asks for it, hands the same engine to every later one,
//!   and lets it go when the last conversation on it has left (the engine's thread ends when
//!   the last handle to it is dropped).
//! - **Slots.** The temporal engine holds `slots` KV slots, rows of one batch: per layer one K
//!   and one V buffer of `[slots, heads, capacity + 1, head_dim]`, bound in place as both past
//!   and present (the GQA graph appends each row's new entry at its own valid length, which
//!   `attention_mask` gives per row). A conversation claims a slot ([`SharedLm::temporal_slot`])
//!   and gives it back when its client is dropped. The extra row per slot takes the write of a
//!   slot that is in the batch without a frame (see below), so that nothing valid is touched.
//! - **Ticks.** Each engine runs on a thread of its own. A tick starts with the first request
//!   and gathers more until every session stepped in the previous tick has submitted again, or
//!   `max_wait` has passed; then one graph call steps them all. A session that was expected and
//!   had not submitted is counted late and stepped in a later tick; nobody waits longer for it.
//!   Under load, requests that arrive while a tick runs are the next tick's batch.
//! - **Temporal tick.** The batch is the slots `0..=highest slot with a frame`; a slot in that
//!   range without a frame runs as a dummy row at its own length (its output dropped, its
//!   length unchanged), so rows never move between buffers.
//! - **Depformer tick.** The depformer keeps no state between frames, so its batch is exactly
//!   the frames ready. Rows are ordered by how many substeps they need (the trailing substeps
//!   whose tokens are all provided are skipped with `user_substeps: skip`), so each substep's
//!   rows are a prefix of the previous one's. Every row brings its own sampler: the draws of a
//!   session are taken in its own order (text, substeps 0..15), whatever else is in the batch.
//!
//! The engine reports what it does (ticks with their batch, context and time; late frames;
//! slots; opening, closing, failing) as [`EngineEvent`]s to the [`EngineObserver`] it was opened
//! with, and records nothing itself: the process's observer (`observe::engine`) turns them into
//! metrics and the latency diagnosis of the temporal tick (`duplex_latency_pattern{stage=
//! "engine"}`) off the engine's thread.
//!
//! Only GQA temporal graphs can share an engine (the standard graph has one past length for the
//! whole batch). Knows nothing of stages, pipelines or the network.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;

use super::depformer::{DepformerInput, UnusedSubsteps};
use super::error::ModelError;
use super::pack::{check_depformer, check_temporal, Graph, LmGraphInfo, Pack, Variant};
use super::sampling::{Sampler, SamplingParams};
use super::session::{open, report, Provider, SessionOptions};
use super::temporal::validate_frame;
use super::tensors::{
    allocator_at, element, input_placements, kv_placements, placement_of, read_row, write_row,
    Buffer, PingPong, Placement,
};

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
    /// [`Resources`](crate::resources::Resources), which sets it from
    /// `DUPLEX_DRILL_ENGINE_PANIC_AT_TICK` for the first engine a process opens).
    pub panic_at_tick: Option<u64>,
    /// Who hears what the engine does.
    pub observer: Arc<dyn EngineObserver>,
}

impl std::fmt::Debug for EngineOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineOptions")
            .field("session", &self.session)
            .field("slots", &self.slots)
            .field("max_positions", &self.max_positions)
            .field("max_wait", &self.max_wait)
            .field("panic_at_tick", &self.panic_at_tick)
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
    taken: Mutex<Vec<bool>>,
    next_client: AtomicUsize,
    channels: usize,
    text_limit: i64,
    audio_limit: i64,
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
        let slots = opts.slots.max(1);
        let capacity = opts.max_positions.min(m.max_positions).max(1);
        let channels = m.delays.len();
        let steps = 2 * m.codebooks;
        let (tx, rx) = unbounded();
        let (ready_tx, ready_rx) = bounded(1);
        let tpath = pack.graph_path(Graph::Temporal);
        let dpath = pack.graph_path(Graph::Depformer);
        let session = opts.session;
        let wait = opts.max_wait;
        let drill = opts.panic_at_tick;
        let observer = opts.observer.clone();
        let obs = observer.clone();
        let stats = Arc::new(EngineStats::default());
        let st = stats.clone();
        let failed = Arc::new(AtomicBool::new(false));
        let fail = failed.clone();
        std::thread::Builder::new()
            .name("duplex:engine".into())
            .spawn(move || {
                let opened = TemporalWorker::open(&tpath, &session, slots, capacity, channels)
                    .and_then(|t| {
                        DepformerWorker::open(&dpath, &session, slots, steps).map(|d| (t, d))
                    });
                match opened {
                    Ok((t, d)) => {
                        let mut places = kv_placements(&t.kv, t.info.layers, &t.wanted);
                        places.extend(kv_placements(
                            d.kv.sets.iter().flatten(),
                            d.info.layers,
                            &d.wanted,
                        ));
                        let infos = (t.info.clone(), d.info.clone(), t.provider, places);
                        let _ = ready_tx.send(Ok(infos));
                        // A panic ends the engine: it is marked failed (its conversations get
                        // an error as their replies are dropped) and the next conversation
                        // opens a fresh one.
                        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            run_engine(t, d, &rx, wait, &st, drill, &*obs)
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
        tracing::info!(
            pack = %pack.dir.display(),
            slots,
            capacity,
            layers = tinfo.layers,
            kv_bytes_per_slot = tinfo.layers * 2 * tinfo.heads * (capacity + 1) * tinfo.head_dim
                * if tinfo.kv == super::pack::FloatType::F16 { 2 } else { 4 },
            "shared LM engine ready"
        );
        Ok(SharedLm {
            observer,
            failed,
            stats,
            slots,
            capacity,
            temporal_info: tinfo,
            depformer_info: dinfo,
            provider,
            cache_placements,
            tx,
            taken: Mutex::new(vec![false; slots]),
            next_client: AtomicUsize::new(0),
            channels,
            text_limit: m.text_vocab + 1,
            audio_limit: m.audio_vocab + 1,
            steps,
        })
    }

    /// Whether the engine's thread has failed (it serves nobody any more).
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Sets the slot gauges (after a metrics recorder is installed).
    pub fn publish(&self) {
        if let Ok(t) = self.taken.lock() {
            publish_slots(&*self.observer, self.slots, &t);
        }
    }

    /// Slots not claimed.
    pub fn free_slots(&self) -> usize {
        self.taken
            .lock()
            .map(|t| t.iter().filter(|x| !**x).count())
            .unwrap_or(0)
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
        let slot = {
            let mut t = self
                .taken
                .lock()
                .map_err(|_| ModelError::contract("engine", "the slot table is poisoned"))?;
            let Some(i) = t.iter().position(|x| !x) else {
                return Err(ModelError::Busy {
                    graph: "temporal".into(),
                    detail: format!(
                        "all {} slots of the shared engine are in use (raise `slots`)",
                        self.slots
                    ),
                });
            };
            t[i] = true;
            publish_slots(&*self.observer, self.slots, &t);
            i
        };
        let (tx, rx) = bounded(1);
        Ok(TemporalSlot {
            lm: self.clone(),
            slot,
            reply: rx,
            job: Some(TemporalJob {
                slot,
                input: Vec::with_capacity(self.channels),
                fresh: true,
                hidden: Vec::new(),
                logits: Vec::new(),
                error: None,
                reply: tx,
            }),
            capacity: max_positions.min(self.capacity).max(1),
            pos: 0,
        })
    }

    /// A client of the depformer engine.
    pub fn depformer_client(self: &Arc<Self>) -> DepformerClient {
        let (tx, rx) = bounded(1);
        DepformerClient {
            lm: self.clone(),
            id: self.next_client.fetch_add(1, Ordering::Relaxed),
            reply: rx,
            job: Some(DepformerJob {
                hidden: Vec::new(),
                text: 0,
                target: Vec::new(),
                provided: Vec::new(),
                sampler: Sampler::new(0),
                params: SamplingParams::GREEDY,
                unused: UnusedSubsteps::Run,
                out: Vec::new(),
                counts: (0, 0),
                logits: None,
                error: None,
                reply: tx,
            }),
            unused: UnusedSubsteps::Run,
            counts: (0, 0),
            conversation: None,
            keep_logits: false,
            logits: Vec::new(),
        }
    }

    fn release(&self, slot: usize) {
        if let Ok(mut t) = self.taken.lock() {
            if let Some(x) = t.get_mut(slot) {
                *x = false;
            }
            publish_slots(&*self.observer, self.slots, &t);
        }
    }
}

/// The slots, reported at every claim and release.
fn publish_slots(observer: &dyn EngineObserver, slots: usize, taken: &[bool]) {
    observer.event(EngineEvent::Slots {
        slots,
        used: taken.iter().filter(|x| **x).count(),
    });
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

/// What a client sends to the engine's thread.
enum Msg {
    Temporal { client: usize, job: TemporalJob },
    Depformer { client: usize, job: DepformerJob },
    Leave { client: usize, slot: Option<usize> },
}

fn stopped(graph: &str) -> ModelError {
    ModelError::contract(graph, "the shared engine's thread has stopped")
}

/// The requests of one tick.
#[derive(Default)]
struct Tick {
    temporal: Vec<(usize, TemporalJob)>,
    depformer: Vec<(usize, DepformerJob)>,
    /// Slots given back.
    left: Vec<usize>,
}

/// Where a conversation is between its requests, as the engine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transit {
    /// Its temporal result went out: its depformer request comes right back.
    Depformer,
    /// Its depformer result went out at `since`: its next temporal request comes when its
    /// next frame is there.
    Temporal { since: Instant },
}

/// What the engine knows of its conversations (keyed by slot, or by client for a depformer
/// whose temporal half is not shared).
#[derive(Default)]
struct Conversations {
    transit: HashMap<usize, Transit>,
    /// Conversations whose last temporal request came straight back (they had their next
    /// frame already: a run as fast as possible); the others are not waited for.
    prompt: BTreeSet<usize>,
}

impl Conversations {
    fn expected(&self, key: usize) -> bool {
        match self.transit.get(&key) {
            Some(Transit::Depformer) => true,
            Some(Transit::Temporal { .. }) => self.prompt.contains(&key),
            None => false,
        }
    }
}

impl Tick {
    fn is_empty(&self) -> bool {
        self.temporal.is_empty() && self.depformer.is_empty()
    }

    fn has(&self, key: usize) -> bool {
        self.temporal.iter().any(|(c, _)| *c == key)
            || self.depformer.iter().any(|(c, _)| *c == key)
    }

    fn take(&mut self, m: Msg, conv: &mut Conversations, max_wait: Duration) {
        match m {
            Msg::Temporal { client, job } => {
                if let Some(Transit::Temporal { since }) = conv.transit.get(&client) {
                    if since.elapsed() <= max_wait {
                        conv.prompt.insert(client);
                    } else {
                        conv.prompt.remove(&client);
                    }
                }
                conv.transit.remove(&client);
                self.temporal.push((client, job));
            }
            Msg::Depformer { client, job } => {
                conv.transit.remove(&client);
                self.depformer.push((client, job));
            }
            Msg::Leave { client, slot } => {
                conv.transit.remove(&client);
                conv.prompt.remove(&client);
                self.left.extend(slot);
            }
        }
    }
}

/// Gathers the requests of the next tick into `tick` (which may hold requests carried over),
/// waiting up to `max_wait` for the conversations expected; returns how many of those had not
/// come, or `None` when every client and the registry are gone.
fn gather(
    rx: &Receiver<Msg>,
    tick: &mut Tick,
    conv: &mut Conversations,
    max_wait: Duration,
) -> Option<usize> {
    while tick.is_empty() {
        let m = rx.recv().ok()?;
        tick.take(m, conv, max_wait);
    }
    let deadline = Instant::now() + max_wait;
    loop {
        while let Ok(m) = rx.try_recv() {
            tick.take(m, conv, max_wait);
        }
        let waiting = conv
            .transit
            .keys()
            .any(|k| conv.expected(*k) && !tick.has(*k));
        if !waiting {
            return Some(0);
        }
        match rx.recv_deadline(deadline) {
            Ok(m) => tick.take(m, conv, max_wait),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let late: Vec<usize> = conv
        .transit
        .keys()
        .copied()
        .filter(|k| conv.expected(*k) && !tick.has(*k))
        .collect();
    for k in &late {
        // Not waited for again until it has been served once more.
        conv.transit.remove(k);
        conv.prompt.remove(k);
    }
    Some(late.len())
}

/// The engine's thread: ticks until every client and the registry are gone.
fn run_engine(
    mut t: TemporalWorker,
    mut d: DepformerWorker,
    rx: &Receiver<Msg>,
    max_wait: Duration,
    stats: &EngineStats,
    panic_at_tick: Option<u64>,
    observer: &dyn EngineObserver,
) {
    let mut conv = Conversations::default();
    let mut tick = Tick::default();
    while let Some(late) = gather(rx, &mut tick, &mut conv, max_wait) {
        observer.event(EngineEvent::Late(late));
        stats.late.fetch_add(late as u64, Ordering::Relaxed);
        // A slot given back starts empty (its next owner's first step is fresh anyway).
        for s in tick.left.drain(..) {
            if let Some(l) = t.len.get_mut(s) {
                *l = 0;
            }
        }
        // Depformer requests first, and the temporal ones held meanwhile: conversations that
        // drifted half a frame apart meet again in the next temporal batch.
        let run_temporal = tick.depformer.is_empty();
        if run_temporal && !tick.temporal.is_empty() {
            let ticks = stats.temporal_ticks.load(Ordering::Relaxed);
            if panic_at_tick.is_some_and(|n| ticks + 1 >= n) {
                panic!(
                    "fault drill: the engine fails at temporal tick {}",
                    ticks + 1
                );
            }
            let n = tick.temporal.len();
            stats.temporal_ticks.fetch_add(1, Ordering::Relaxed);
            stats.temporal_rows.fetch_add(n as u64, Ordering::Relaxed);
            stats
                .temporal_max_batch
                .fetch_max(n as u64, Ordering::Relaxed);
            let t0 = Instant::now();
            let context = tick
                .temporal
                .iter()
                .map(|(_, j)| if j.fresh { 0 } else { t.len[j.slot] })
                .max()
                .unwrap_or(0);
            if let Err(e) = t.tick(&mut tick.temporal) {
                let msg = e.to_string();
                for (_, j) in &mut tick.temporal {
                    j.error = Some(ModelError::ort("temporal (shared engine)", &msg));
                }
            }
            observer.event(EngineEvent::TemporalTick {
                batch: n,
                context,
                seconds: t0.elapsed().as_secs_f64(),
            });
            for (k, j) in tick.temporal.drain(..) {
                conv.transit.insert(k, Transit::Depformer);
                let tx = j.reply.clone();
                let _ = tx.send(j);
            }
        }
        if !tick.depformer.is_empty() {
            let n = tick.depformer.len();
            stats.depformer_ticks.fetch_add(1, Ordering::Relaxed);
            stats.depformer_rows.fetch_add(n as u64, Ordering::Relaxed);
            let t0 = Instant::now();
            if let Err(e) = d.tick(&mut tick.depformer) {
                let msg = e.to_string();
                for (_, j) in &mut tick.depformer {
                    j.error = Some(ModelError::ort("depformer (shared engine)", &msg));
                }
            }
            observer.event(EngineEvent::DepformerTick {
                batch: n,
                seconds: t0.elapsed().as_secs_f64(),
            });
            let now = Instant::now();
            for (k, j) in tick.depformer.drain(..) {
                conv.transit.insert(k, Transit::Temporal { since: now });
                let tx = j.reply.clone();
                let _ = tx.send(j);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Temporal

struct TemporalJob {
    slot: usize,
    input: Vec<i64>,
    /// Forget the slot's conversation before this step.
    fresh: bool,
    hidden: Vec<f32>,
    logits: Vec<f32>,
    error: Option<ModelError>,
    reply: Sender<TemporalJob>,
}

struct TemporalWorker {
    // Field order matters: the binding (which holds views) is dropped before the buffers.
    binding: IoBinding,
    session: Session,
    info: LmGraphInfo,
    provider: Provider,
    kv: Vec<Buffer>,
    frame: Buffer,
    mask: Buffer,
    hidden: Buffer,
    logits: Buffer,
    alloc: Allocator,
    /// The KV slots' allocator: the memory the session reads them from.
    kv_alloc: Allocator,
    wanted: Vec<(String, Placement)>,
    channels: usize,
    rows: usize,
    len: Vec<usize>,
}

impl TemporalWorker {
    fn open(
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
            info,
        };
        report("temporal (shared engine)", w.provider, w.info.kv.name());
        Ok(w)
    }

    /// One batched step of the slots `0..=max(slot)`.
    fn tick(&mut self, jobs: &mut [(usize, TemporalJob)]) -> ort::Result<()> {
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

/// A conversation's KV slot in a shared engine: the temporal transformer's interface
/// ([`Temporal`](super::temporal::Temporal)'s methods), stepped in the engine's batch.
pub struct TemporalSlot {
    lm: Arc<SharedLm>,
    slot: usize,
    reply: Receiver<TemporalJob>,
    job: Option<TemporalJob>,
    capacity: usize,
    /// Positions since the last reset: also the rows in the slot (nothing is dropped).
    pos: usize,
}

impl TemporalSlot {
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
            return Err(ModelError::contract(
                "temporal",
                format!(
                    "no position left: the conversation reached {} positions (apply a long-session policy before)",
                    self.pos
                ),
            ));
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

// ---------------------------------------------------------------------------------------------
// Depformer

struct DepformerJob {
    hidden: Vec<f32>,
    text: i64,
    target: Vec<i64>,
    provided: Vec<bool>,
    sampler: Sampler,
    params: SamplingParams,
    unused: UnusedSubsteps,
    out: Vec<i64>,
    /// Substeps run and skipped in this job.
    counts: (u64, u64),
    /// Every substep's logits, when the client keeps them.
    logits: Option<Vec<Vec<f32>>>,
    error: Option<ModelError>,
    reply: Sender<DepformerJob>,
}

struct DepformerWorker {
    binding: IoBinding,
    session: Session,
    info: LmGraphInfo,
    provider: Provider,
    kv: PingPong,
    hidden: Buffer,
    prev: Buffer,
    substep: Buffer,
    logits: Buffer,
    alloc: Allocator,
    kv_alloc: Allocator,
    wanted: Vec<(String, Placement)>,
    steps: usize,
    scratch: Vec<f32>,
}

impl DepformerWorker {
    fn open(
        path: &std::path::Path,
        session: &SessionOptions,
        slots: usize,
        steps: usize,
    ) -> Result<DepformerWorker, ModelError> {
        let graph = "depformer";
        let os = open(path, graph, session)?;
        let info = check_depformer(&os.session, graph)?;
        let e = |err: ort::Error| ModelError::ort(graph, err);
        let alloc = Allocator::default();
        let wanted = input_placements(&os.session).map_err(e)?;
        let kv_alloc = allocator_at(&os.session, &placement_of(&wanted, "past_key_values.0.key"))
            .map_err(e)?;
        let (s, h, d) = (slots as i64, info.heads as i64, info.head_dim as i64);
        let mut sets: [Vec<Buffer>; 2] = [Vec::new(), Vec::new()];
        for set in sets.iter_mut() {
            for _ in 0..2 * info.layers {
                set.push(
                    Buffer::zeros(&kv_alloc, element(info.kv), &[s, h, steps as i64, d])
                        .map_err(e)?,
                );
            }
        }
        let w = DepformerWorker {
            binding: os.session.create_binding().map_err(e)?,
            hidden: Buffer::zeros(
                &alloc,
                element(info.hidden),
                &[s, 1, info.hidden_dim as i64],
            )
            .map_err(e)?,
            prev: Buffer::zeros(&alloc, TensorElementType::Int64, &[s, 1]).map_err(e)?,
            substep: Buffer::zeros(&alloc, TensorElementType::Int64, &[]).map_err(e)?,
            logits: Buffer::zeros(&alloc, element(info.logits), &[s, 1, info.vocab as i64])
                .map_err(e)?,
            session: os.session,
            provider: os.provider,
            kv: PingPong { sets },
            alloc,
            kv_alloc,
            wanted,
            steps,
            scratch: Vec::with_capacity(info.vocab),
            info,
        };
        report("depformer (shared engine)", w.provider, w.info.kv.name());
        Ok(w)
    }

    fn tick(&mut self, jobs: &mut [(usize, DepformerJob)]) -> ort::Result<()> {
        let steps = self.steps;
        // Substeps each row needs; rows in decreasing order of it.
        let needed: Vec<usize> = jobs
            .iter()
            .map(|(_, j)| match j.unused {
                UnusedSubsteps::Run => steps,
                UnusedSubsteps::Skip => (0..steps)
                    .rev()
                    .find(|&cb| !j.provided[cb])
                    .map_or(0, |cb| cb + 1),
            })
            .collect();
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by(|&a, &b| needed[b].cmp(&needed[a]));
        let mut prev: Vec<i64> = order.iter().map(|&i| jobs[i].1.text).collect();
        for (r, &i) in order.iter().enumerate() {
            write_row(&mut self.hidden, r, &jobs[i].1.hidden);
            let j = &mut jobs[i].1;
            j.out.clear();
            j.counts = (0, 0);
            if let Some(l) = j.logits.as_mut() {
                l.clear();
            }
        }
        let (h, d) = (self.info.heads as i64, self.info.head_dim as i64);
        let (hd, vocab) = (self.info.hidden_dim as i64, self.info.vocab);
        for cb in 0..steps {
            let n = order.iter().filter(|&&i| needed[i] > cb).count();
            if n > 0 {
                let a = &self.alloc;
                self.prev.as_slice::<i64>()[..n].copy_from_slice(&prev[..n]);
                self.substep.as_slice::<i64>()[0] = cb as i64;
                let bn = n as i64;
                let v = self.hidden.view(a, &[bn, 1, hd])?;
                self.binding.bind_input("hidden", &v)?;
                let v = self.prev.view(a, &[bn, 1])?;
                self.binding.bind_input("prev_token", &v)?;
                let v = self.substep.view(a, &[])?;
                self.binding.bind_input("substep_index", &v)?;
                let v = self.logits.view(a, &[bn, 1, vocab as i64])?;
                self.binding.bind_output("logits", v)?;
                self.kv.bind_batch(
                    &mut self.binding,
                    &self.kv_alloc,
                    cb % 2,
                    bn,
                    h,
                    cb as i64,
                    d,
                )?;
                drop(self.session.run_binding(&self.binding)?);
            }
            for (r, &i) in order.iter().enumerate() {
                let j = &mut jobs[i].1;
                if r < n {
                    read_row(&mut self.logits, r, vocab, &mut self.scratch);
                    if let Some(l) = j.logits.as_mut() {
                        l.push(self.scratch.clone());
                    }
                    let tok = j.sampler.sample(&self.scratch, j.params) as i64;
                    j.out.push(tok);
                    prev[r] = if j.provided[cb] { j.target[cb] } else { tok };
                    j.counts.0 += 1;
                } else {
                    j.sampler.skip(j.params);
                    j.out.push(j.target[cb]);
                    prev[r] = j.target[cb];
                    j.counts.1 += 1;
                }
            }
        }
        Ok(())
    }
}

/// A session's client of a shared depformer engine: [`Depformer::run`](super::depformer::Depformer::run)'s
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
    /// [`Depformer::run`](super::depformer::Depformer::run) does, in the engine's next tick.
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
        let steps = self.lm.steps;
        frame.check(self.lm.depformer_info.hidden_dim, steps)?;
        if !(0..self.lm.text_limit).contains(&frame.text) {
            return Err(ModelError::Token {
                graph: "depformer".into(),
                channel: "prev_token (text, substep 0)".into(),
                value: frame.text,
                limit: self.lm.text_limit,
            });
        }
        for cb in 0..steps {
            let v = frame.target[cb];
            if frame.provided[cb] && !(0..self.lm.audio_limit).contains(&v) {
                return Err(ModelError::Token {
                    graph: "depformer".into(),
                    channel: format!("prev_token (audio channel {}, substep {})", cb + 1, cb + 1),
                    value: v,
                    limit: self.lm.audio_limit,
                });
            }
        }
        let mut job = self.job.take().ok_or_else(|| stopped("depformer"))?;
        job.hidden.clear();
        job.hidden.extend_from_slice(frame.hidden);
        job.text = frame.text;
        job.target.clear();
        job.target.extend_from_slice(&frame.target[..steps]);
        job.provided.clear();
        job.provided.extend_from_slice(&frame.provided[..steps]);
        job.sampler = std::mem::replace(sampler, Sampler::new(0));
        job.params = params;
        job.unused = self.unused;
        job.error = None;
        job.logits = self.keep_logits.then(|| std::mem::take(&mut self.logits));
        let sent = self.lm.tx.send(Msg::Depformer {
            client: self.key(),
            job,
        });
        if let Err(e) = sent {
            // Keep the random stream where it was.
            if let Msg::Depformer { job, .. } = e.0 {
                *sampler = job.sampler;
            }
            return Err(stopped("depformer"));
        }
        let mut job = self.reply.recv().map_err(|_| stopped("depformer"))?;
        *sampler = std::mem::replace(&mut job.sampler, Sampler::new(0));
        self.counts.0 += job.counts.0;
        self.counts.1 += job.counts.1;
        if let Some(l) = job.logits.take() {
            self.logits = l;
        }
        out.clear();
        out.extend_from_slice(&job.out);
        let err = job.error.take();
        self.job = Some(job);
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
