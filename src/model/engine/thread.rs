//! The shared LM engine's thread: the messages its clients send, and the loop that gathers
//! them into ticks (a batched temporal step, then the depformer's batch) and serves priming
//! jobs between ticks. Knows the engine's workers, not its clients.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::depformer::DepformerJob;
use super::scheduler::{Arrival, Request, Scheduler, Served};
use super::temporal::{PrimeJob, TemporalJob, TemporalWorker};
use super::*;

/// What a client sends to the engine's thread.
pub(super) enum Msg {
    Temporal { client: usize, job: TemporalJob },
    Prime { client: usize, job: PrimeJob },
    Depformer { client: usize, job: DepformerJob },
    Leave { client: usize, slot: Option<usize> },
}

pub(super) fn stopped(graph: &str) -> ModelError {
    ModelError::contract(graph, "the shared engine's thread has stopped")
}

impl Request for Msg {
    fn arrival(&self) -> Arrival {
        match self {
            // A frame starts with its temporal step; its depformer request comes right back.
            Msg::Temporal { client, .. } => Arrival::Starts(*client),
            // A priming job is a frame of its own, served between ticks.
            Msg::Prime { client, .. } => Arrival::Starts(*client),
            Msg::Depformer { client, .. } => Arrival::Continues(*client),
            Msg::Leave { client, .. } => Arrival::Leaves(*client),
        }
    }
}

/// Where the engine's depformer draws the audio: asked for by its stages, taken up by its
/// thread, which opens the draw with the engine's session options.
#[derive(Debug)]
pub(super) struct DrawPlace {
    pub(super) wanted: AtomicBool,
    pub(super) on: AtomicBool,
    pub(super) session: SessionOptions,
}

/// The engine's thread: ticks until every client and the registry are gone. `draw`: where the
/// audio is to be drawn.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_engine(
    mut t: TemporalWorker,
    mut d: DepformerBatch,
    rx: &Receiver<Msg>,
    max_wait: Duration,
    stats: &EngineStats,
    panic_at_tick: Option<u64>,
    observer: &dyn EngineObserver,
    draw: &DrawPlace,
) {
    let mut sched = Scheduler::new(max_wait);
    let mut draw_tried = false;
    while let Some(late) = sched.gather(rx) {
        observer.event(EngineEvent::Late(late));
        stats.late.fetch_add(late as u64, Ordering::Relaxed);
        // A slot given back starts empty (its next owner's first step is fresh anyway).
        for m in sched.take_out(|m| m.kind() == Kind::Leave) {
            if let Msg::Leave { slot: Some(s), .. } = m {
                if let Some(l) = t.batch.len.get_mut(s) {
                    *l = 0;
                }
            }
        }
        // Depformer requests first, and the temporal ones held meanwhile: conversations that
        // drifted half a frame apart meet again in the next temporal batch.
        let mut deps = take(&mut sched, Kind::Depformer, |m| match m {
            Msg::Depformer { client, job } => Some((client, job)),
            _ => None,
        });
        if !deps.is_empty() {
            if !draw_tried && draw.wanted.load(Ordering::Acquire) {
                draw_tried = true;
                let graph = "depformer (shared engine)";
                match d.draw_on_device(graph, &draw.session) {
                    Ok(()) => {
                        draw.on.store(true, Ordering::Release);
                        tracing::info!("the shared engine draws the audio where the logits are");
                    }
                    Err(e) => tracing::warn!(
                        "the shared engine draws the audio on the host: device sampling could not start ({e})"
                    ),
                }
            }
            let n = deps.len();
            stats.depformer_ticks.fetch_add(1, Ordering::Relaxed);
            stats.depformer_rows.fetch_add(n as u64, Ordering::Relaxed);
            let t0 = Instant::now();
            depformer::tick(&mut d, &mut deps);
            observer.event(EngineEvent::DepformerTick {
                batch: n,
                seconds: t0.elapsed().as_secs_f64(),
            });
            for (k, j) in deps {
                sched.served(k, Served::FrameDone);
                let tx = j.reply.clone();
                let _ = tx.send(j);
            }
            continue;
        }
        let temps = take(&mut sched, Kind::Temporal, |m| match m {
            Msg::Temporal { client, job } => Some((client, job)),
            _ => None,
        });
        let primes = take(&mut sched, Kind::Prime, |m| match m {
            Msg::Prime { client, job } => Some((client, job)),
            _ => None,
        });
        if !temps.is_empty() {
            temporal_tick(&mut t, temps, &mut sched, stats, panic_at_tick, observer);
        }
        // Priming conversations' jobs after the live rows' tick: one chunk each at most
        // before the next.
        for (k, mut j) in primes {
            t.prime(&mut j);
            sched.served(k, Served::FrameDone);
            let tx = j.reply.clone();
            let _ = tx.send(j);
        }
    }
}

/// What a request is, for taking one kind out of a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Temporal,
    Prime,
    Depformer,
    Leave,
}

impl Msg {
    fn kind(&self) -> Kind {
        match self {
            Msg::Temporal { .. } => Kind::Temporal,
            Msg::Prime { .. } => Kind::Prime,
            Msg::Depformer { .. } => Kind::Depformer,
            Msg::Leave { .. } => Kind::Leave,
        }
    }
}

/// The pending requests of `kind`, taken out of the tick as what `pick` makes of them.
fn take<T>(sched: &mut Scheduler<Msg>, kind: Kind, pick: impl Fn(Msg) -> Option<T>) -> Vec<T> {
    sched
        .take_out(|m| m.kind() == kind)
        .into_iter()
        .filter_map(pick)
        .collect()
}

/// One batched temporal step of the conversations in `temps`.
fn temporal_tick(
    t: &mut TemporalWorker,
    mut temps: Vec<(usize, TemporalJob)>,
    sched: &mut Scheduler<Msg>,
    stats: &EngineStats,
    panic_at_tick: Option<u64>,
    observer: &dyn EngineObserver,
) {
    let ticks = stats.temporal_ticks.load(Ordering::Relaxed);
    if panic_at_tick.is_some_and(|n| ticks + 1 >= n) {
        panic!(
            "fault drill: the engine fails at temporal tick {}",
            ticks + 1
        );
    }
    let n = temps.len();
    stats.temporal_ticks.fetch_add(1, Ordering::Relaxed);
    stats.temporal_rows.fetch_add(n as u64, Ordering::Relaxed);
    stats
        .temporal_max_batch
        .fetch_max(n as u64, Ordering::Relaxed);
    let t0 = Instant::now();
    let context = temps
        .iter()
        .map(|(_, j)| {
            if j.row.fresh {
                0
            } else {
                t.batch.len[j.row.slot]
            }
        })
        .max()
        .unwrap_or(0);
    if let Err(e) = t.tick(&mut temps) {
        let msg = e.to_string();
        for (_, j) in &mut temps {
            j.row.error = Some(ModelError::ort("temporal (shared engine)", &msg));
        }
    }
    observer.event(EngineEvent::TemporalTick {
        batch: n,
        context,
        seconds: t0.elapsed().as_secs_f64(),
    });
    for (k, j) in temps {
        sched.served(k, Served::MidFrame);
        let tx = j.reply.clone();
        let _ = tx.send(j);
    }
}
