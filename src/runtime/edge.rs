//! Bounded edges between actors, with an overflow policy per edge.
//!
//! An edge is a `crossbeam_channel::bounded` channel plus counters. What happens when it is full
//! is decided per edge, from the pipeline file:
//!
//! - [`Overflow::Block`]: the producer waits (back-pressure). The wait is interruptible: a
//!   pipeline that is asked to stop wakes every blocked producer.
//! - [`Overflow::DropNewest`]: the frame being sent is dropped.
//! - [`Overflow::DropOldest`]: the oldest queued frame is dropped to make room.
//!
//! Every drop is counted (in [`EdgeStats`], and told to the pipeline's observers) and logged at
//! most once per second per edge with the number dropped since the last message, so no frame is
//! ever lost silently.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};

use super::frame::{FrameMeta, Payload};
use super::stats::EdgeStats;
use super::Observers;

/// What an edge does with a frame that does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Overflow {
    /// Wait for room (back-pressure). The default.
    #[default]
    Block,
    /// Drop the oldest queued frame, keep the new one.
    DropOldest,
    /// Drop the new frame, keep the queue.
    DropNewest,
}

impl Overflow {
    /// The spelling used in pipeline files.
    pub fn as_str(&self) -> &'static str {
        match self {
            Overflow::Block => "block",
            Overflow::DropOldest => "drop_oldest",
            Overflow::DropNewest => "drop_newest",
        }
    }

    /// All spellings, for error messages and listings.
    pub const NAMES: [&'static str; 3] = ["block", "drop_oldest", "drop_newest"];
}

impl fmt::Display for Overflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Overflow {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "block" => Ok(Overflow::Block),
            "drop_oldest" => Ok(Overflow::DropOldest),
            "drop_newest" => Ok(Overflow::DropNewest),
            _ => Err(format!(
                "unknown overflow policy {s:?}, expected one of {}",
                Overflow::NAMES.join(", ")
            )),
        }
    }
}

pub(crate) struct Envelope {
    pub meta: FrameMeta,
    pub payload: Payload,
    pub sent_at: Instant,
}

/// Cancellation signals shared by all actors of one run. A signal fires by dropping its sender:
/// every `recv` on the receiver then returns at once, which lets blocking selects wake up.
#[derive(Clone)]
pub(crate) struct Signals {
    pub drain: Receiver<()>,
    pub abort: Receiver<()>,
    pub drain_flag: Arc<AtomicBool>,
    pub abort_flag: Arc<AtomicBool>,
}

struct Shared {
    name: String,
    policy: Overflow,
    stats: Arc<EdgeStats>,
    consumer_alive: AtomicBool,
    unlogged: AtomicU64,
    last_log: Mutex<Option<Instant>>,
    /// This edge's index among the pipeline's, and who is told what happens on it.
    index: usize,
    observers: Observers,
}

impl Shared {
    fn count_drop(&self) {
        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        self.observers.each(|o| o.edge_dropped(self.index));
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let Ok(mut last) = self.last_log.try_lock() else {
            return;
        };
        if last.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1)) {
            *last = Some(now);
            let n = self.unlogged.swap(0, Ordering::Relaxed);
            let total = self.stats.dropped.load(Ordering::Relaxed);
            tracing::warn!(
                edge = %self.name,
                overflow = %self.policy,
                "edge {} is full: dropped {n} frame(s) since the last report, {total} in all",
                self.name
            );
        }
    }
}

/// Why a send did not deliver its frame.
pub(crate) enum SendError {
    /// The pipeline is aborting.
    Stopped,
    /// The consumer is gone.
    Disconnected,
}

pub(crate) struct EdgeTx {
    tx: Sender<Envelope>,
    /// A receiver handle used only to drop the oldest frame under `DropOldest`.
    spill: Option<Receiver<Envelope>>,
    shared: Arc<Shared>,
}

pub(crate) struct EdgeRx {
    pub rx: Receiver<Envelope>,
    shared: Arc<Shared>,
}

impl Drop for EdgeRx {
    fn drop(&mut self) {
        self.shared.consumer_alive.store(false, Ordering::Release);
    }
}

pub(crate) fn edge(
    name: String,
    capacity: usize,
    policy: Overflow,
    stats: Arc<EdgeStats>,
    (index, observers): (usize, Observers),
) -> (EdgeTx, EdgeRx) {
    let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
    let shared = Arc::new(Shared {
        index,
        observers,
        name,
        policy,
        stats,
        consumer_alive: AtomicBool::new(true),
        unlogged: AtomicU64::new(0),
        last_log: Mutex::new(None),
    });
    let spill = (policy == Overflow::DropOldest).then(|| rx.clone());
    (
        EdgeTx {
            tx,
            spill,
            shared: shared.clone(),
        },
        EdgeRx { rx, shared },
    )
}

impl EdgeTx {
    /// Sends one frame under the edge's policy. Returns the time spent blocked.
    pub fn send(&self, env: Envelope, signals: &Signals) -> Result<Duration, SendError> {
        let sh = &self.shared;
        if !sh.consumer_alive.load(Ordering::Acquire) {
            return Err(SendError::Disconnected);
        }
        let mut blocked = Duration::ZERO;
        match sh.policy {
            Overflow::Block => match self.tx.try_send(env) {
                Ok(()) => {}
                Err(TrySendError::Disconnected(_)) => return Err(SendError::Disconnected),
                Err(TrySendError::Full(env)) => {
                    let t0 = Instant::now();
                    crossbeam_channel::select! {
                        send(self.tx, env) -> r => {
                            if r.is_err() {
                                return Err(SendError::Disconnected);
                            }
                        }
                        recv(signals.abort) -> _ => return Err(SendError::Stopped),
                    }
                    blocked = t0.elapsed();
                }
            },
            Overflow::DropNewest => match self.tx.try_send(env) {
                Ok(()) => {}
                Err(TrySendError::Disconnected(_)) => return Err(SendError::Disconnected),
                Err(TrySendError::Full(_)) => {
                    sh.count_drop();
                    return Ok(blocked);
                }
            },
            Overflow::DropOldest => {
                let mut env = env;
                loop {
                    match self.tx.try_send(env) {
                        Ok(()) => break,
                        Err(TrySendError::Disconnected(_)) => return Err(SendError::Disconnected),
                        Err(TrySendError::Full(back)) => {
                            env = back;
                            if let Some(spill) = &self.spill {
                                match spill.try_recv() {
                                    Ok(_) => {
                                        sh.stats.evicted.fetch_add(1, Ordering::Relaxed);
                                        sh.count_drop()
                                    }
                                    // The consumer emptied the queue meanwhile: retry.
                                    Err(TryRecvError::Empty) => {}
                                    Err(TryRecvError::Disconnected) => {
                                        return Err(SendError::Disconnected)
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        sh.stats.sent.fetch_add(1, Ordering::Relaxed);
        let depth = self.tx.len() as u64;
        sh.stats.max_depth.fetch_max(depth, Ordering::Relaxed);
        sh.observers
            .each(|o| o.edge_depth(sh.index, depth as usize));
        Ok(blocked)
    }
}

impl EdgeRx {
    /// Records the queue wait of a frame just received.
    pub fn received(&self, env: &Envelope) {
        let wait = env.sent_at.elapsed();
        let sh = &self.shared;
        sh.stats.received.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut h) = sh.stats.wait.lock() {
            h.record(wait);
        }
        let depth = self.rx.len();
        sh.observers.each(|o| {
            o.edge_wait(sh.index, wait);
            o.edge_depth(sh.index, depth);
        });
    }
}
