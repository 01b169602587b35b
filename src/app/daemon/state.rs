//! Where the daemon's pipeline stands, as one state behind one lock: the pipeline running, the
//! one built beside it waiting to replace it, whether a reload's pipeline is to be built alone,
//! the stops asked for and the pipelines started. The main loop, the reload thread, `ctl record`
//! and the signal hook each move it by one transition here ([`Lifecycle::stop`] is all the hook
//! does to it); none reads one flag and writes another apart.
//!
//! Knows nothing of how pipelines are built or what a reload checks.

use std::sync::Mutex;

use super::live::Live;
use super::Built;

/// What the main loop does once the running pipeline has ended.
pub(super) enum After {
    /// A stop was asked for: the daemon ends.
    Stop,
    /// A reload built this pipeline beside the one that ended: start it.
    Replace(Box<Built>),
    /// A reload's pipeline could not be built beside the running one: build it now, alone.
    BuildAlone,
    /// The pipeline ended on its own (its input ran out, or it failed): the daemon ends.
    Ended,
}

#[derive(Default)]
struct State {
    live: Option<Live>,
    next: Option<Box<Built>>,
    alone: bool,
    stops: u32,
    starts: u64,
}

/// The daemon's pipeline lifecycle (see the module's documentation).
#[derive(Default)]
pub(super) struct Lifecycle(Mutex<State>);

impl Lifecycle {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        // A panic elsewhere while holding the lock leaves a state still worth reading.
        let mut g = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut g)
    }

    /// The pipeline running now.
    pub fn live(&self) -> Option<Live> {
        self.with(|s| s.live.clone())
    }

    /// Whether a stop was asked for.
    pub fn stopping(&self) -> bool {
        self.with(|s| s.stops > 0)
    }

    /// Pipelines started so far.
    pub fn starts(&self) -> u64 {
        self.with(|s| s.starts)
    }

    /// The signal hook's one transition: the `count`th stop is asked for. Returns the running
    /// pipeline, for the hook to drain (the first stop) or abort (a later one).
    pub fn stop(&self, count: u32) -> Option<Live> {
        self.with(|s| {
            s.stops = s.stops.max(count.max(1));
            s.live.clone()
        })
    }

    /// A pipeline has started and runs now. Returns whether a stop came meanwhile (it is then
    /// to be drained at once).
    pub fn started(&self, live: Live) -> bool {
        self.with(|s| {
            s.live = Some(live);
            s.starts += 1;
            s.stops > 0
        })
    }

    /// The running pipeline has ended: what comes next.
    pub fn ended(&self) -> After {
        self.with(|s| {
            s.live = None;
            let alone = std::mem::take(&mut s.alone);
            match s.next.take() {
                _ if s.stops > 0 => After::Stop,
                Some(b) => After::Replace(b),
                None if alone => After::BuildAlone,
                None => After::Ended,
            }
        })
    }

    /// A reload's pipeline, built beside the running one, waits to replace it. Returns the
    /// pipeline to stop for it (a stop that comes meanwhile wins: [`ended`](Self::ended) drops
    /// the new one).
    pub fn replace_with(&self, built: Built) -> Option<Live> {
        self.with(|s| {
            s.next = Some(Box::new(built));
            s.live.clone()
        })
    }

    /// A reload's pipeline is to be built alone once the running one has stopped. Returns the
    /// pipeline to stop for it.
    pub fn build_alone(&self) -> Option<Live> {
        self.with(|s| {
            s.alone = true;
            s.live.clone()
        })
    }
}
