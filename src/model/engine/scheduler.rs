//! The tick scheduler of a shared engine: which requests go into the next batched call, and
//! how long to wait for the ones still to come.
//!
//! Requests arrive on a channel from many clients (conversations). A tick starts with the
//! first request and gathers more until every client the scheduler *expects* has submitted,
//! or `max_wait` has passed since the tick started; then the engine runs what was gathered. A
//! client is expected when
//!
//! - it is in the middle of a frame (its last request was answered with
//!   [`Served::MidFrame`]: its next one comes right back), or
//! - it finished its last frame ([`Served::FrameDone`]) and its request before that came
//!   within `max_wait` of the answer (it had its next frame ready: a run as fast as possible), or
//! - the scheduler knows the clients' frame period ([`Scheduler::with_period`]: paced clients,
//!   a frame every 80 ms) and its next frame is due before the tick's deadline (its last frame
//!   started a period before). Ticks of paced clients so gather every frame due within
//!   `max_wait`, instead of one tick per client at its own phase.
//!
//! A client that was expected and had not come is counted *late* and not waited for again
//! until it has been served once more, so a client that never sends stalls nobody for more
//! than one `max_wait`. A client that leaves is forgotten at once. Requests the engine does not
//! take out of a tick stay for the next one.
//!
//! Knows nothing of ONNX Runtime, of what a request holds or of what a batch computes: the
//! shared LM engine drives it with temporal and depformer requests, and any other batched
//! model (the codec) can drive it with its own.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

/// What a request is to the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The first request of a client's frame, from client `.0`.
    Starts(usize),
    /// A later request of the same frame (it comes right after the previous one is answered).
    Continues(usize),
    /// Client `.0` is gone.
    Leaves(usize),
}

/// A request the scheduler can gather.
pub trait Request {
    /// What it is.
    fn arrival(&self) -> Arrival;
}

/// How a served request leaves its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// Its frame goes on: its next request comes right back.
    MidFrame,
    /// Its frame is done: its next request comes when its next frame is there.
    FrameDone,
}

/// Where a client is between its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transit {
    MidFrame,
    FrameDone { at: Instant },
}

/// Gathers ticks of `R` (see the module's documentation).
#[derive(Debug)]
pub struct Scheduler<R> {
    max_wait: Duration,
    transit: HashMap<usize, Transit>,
    /// Clients whose last frame-starting request came within `max_wait` of their answer.
    prompt: BTreeSet<usize>,
    /// The requests of the next tick, some carried over from the last; leaves included.
    pending: Vec<R>,
    /// The clients' frame period, when they are paced.
    period: Option<Duration>,
    /// When each client's last frame started.
    started: HashMap<usize, Instant>,
    /// The deadline of the tick being gathered.
    deadline: Option<Instant>,
}

impl<R: Request> Scheduler<R> {
    /// A scheduler whose ticks wait at most `max_wait` for the clients expected.
    pub fn new(max_wait: Duration) -> Self {
        Scheduler {
            max_wait,
            transit: HashMap::new(),
            prompt: BTreeSet::new(),
            pending: Vec::new(),
            period: None,
            started: HashMap::new(),
            deadline: None,
        }
    }

    /// A scheduler whose clients are paced, a frame every `period`: a client's next frame is
    /// expected in a tick when it is due before the tick's deadline.
    pub fn with_period(mut self, period: Duration) -> Self {
        self.period = Some(period);
        self
    }

    /// Clients expected in the next tick now.
    pub fn expected(&self) -> usize {
        self.transit
            .keys()
            .filter(|k| self.is_expected(**k))
            .count()
    }

    fn is_expected(&self, client: usize) -> bool {
        match self.transit.get(&client) {
            Some(Transit::MidFrame) => true,
            Some(Transit::FrameDone { .. }) => self.prompt.contains(&client) || self.due(client),
            None => false,
        }
    }

    /// Whether a paced client's next frame is due before the deadline of the tick.
    fn due(&self, client: usize) -> bool {
        match (self.period, self.started.get(&client), self.deadline) {
            (Some(p), Some(t), Some(d)) => *t + p <= d,
            _ => false,
        }
    }

    /// Whether the next tick holds a request (not a leave) of `client`.
    fn has(&self, client: usize) -> bool {
        self.pending.iter().any(|r| match r.arrival() {
            Arrival::Starts(c) | Arrival::Continues(c) => c == client,
            Arrival::Leaves(_) => false,
        })
    }

    fn has_work(&self) -> bool {
        self.pending
            .iter()
            .any(|r| !matches!(r.arrival(), Arrival::Leaves(_)))
    }

    fn take(&mut self, r: R) {
        match r.arrival() {
            Arrival::Starts(c) => {
                if let Some(Transit::FrameDone { at }) = self.transit.get(&c) {
                    if at.elapsed() <= self.max_wait {
                        self.prompt.insert(c);
                    } else {
                        self.prompt.remove(&c);
                    }
                }
                self.transit.remove(&c);
                if self.period.is_some() {
                    self.started.insert(c, Instant::now());
                }
            }
            Arrival::Continues(c) => {
                self.transit.remove(&c);
            }
            Arrival::Leaves(c) => {
                self.transit.remove(&c);
                self.prompt.remove(&c);
                self.started.remove(&c);
            }
        }
        self.pending.push(r);
    }

    /// Gathers the next tick: blocks for a first request (when none is pending), then waits
    /// up to `max_wait` for the clients expected. Returns how many expected clients had not
    /// come (late), or `None` when the channel is closed and nothing is pending.
    pub fn gather(&mut self, rx: &Receiver<R>) -> Option<usize> {
        while !self.has_work() {
            let r = rx.recv().ok()?;
            self.take(r);
        }
        let deadline = Instant::now() + self.max_wait;
        self.deadline = Some(deadline);
        loop {
            while let Ok(r) = rx.try_recv() {
                self.take(r);
            }
            let waiting = self
                .transit
                .keys()
                .any(|k| self.is_expected(*k) && !self.has(*k));
            if !waiting {
                self.deadline = None;
                return Some(0);
            }
            match rx.recv_deadline(deadline) {
                Ok(r) => self.take(r),
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let late: Vec<usize> = self
            .transit
            .keys()
            .copied()
            .filter(|k| self.is_expected(*k) && !self.has(*k))
            .collect();
        for k in &late {
            // Not waited for again until it has been served once more.
            self.transit.remove(k);
            self.prompt.remove(k);
        }
        self.deadline = None;
        Some(late.len())
    }

    /// Takes the pending requests that `pick` selects out of the tick, in arrival order; the
    /// others stay for the next one.
    pub fn take_out(&mut self, mut pick: impl FnMut(&R) -> bool) -> Vec<R> {
        self.pending.extract_if(.., |r| pick(r)).collect()
    }

    /// Records that `client`'s request was answered (call it for every request run).
    pub fn served(&mut self, client: usize, how: Served) {
        let t = match how {
            Served::MidFrame => Transit::MidFrame,
            Served::FrameDone => Transit::FrameDone { at: Instant::now() },
        };
        self.transit.insert(client, t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::unbounded;

    /// A fake job: just its arrival.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Job(Arrival);

    impl Request for Job {
        fn arrival(&self) -> Arrival {
            self.0
        }
    }

    fn start(c: usize) -> Job {
        Job(Arrival::Starts(c))
    }

    fn cont(c: usize) -> Job {
        Job(Arrival::Continues(c))
    }

    /// Runs everything pending as one batch: each job is answered as `how`.
    fn run_all(s: &mut Scheduler<Job>, how: Served) -> Vec<Job> {
        let batch = s.take_out(|_| true);
        for j in &batch {
            match j.0 {
                Arrival::Starts(c) | Arrival::Continues(c) => s.served(c, how),
                Arrival::Leaves(_) => {}
            }
        }
        batch
    }

    #[test]
    fn a_tick_never_waits_past_max_wait_for_a_client_that_does_not_come() {
        let wait = Duration::from_millis(60);
        let mut s = Scheduler::new(wait);
        let (tx, rx) = unbounded();
        tx.send(start(1)).unwrap();
        tx.send(start(2)).unwrap();
        assert_eq!(s.gather(&rx), Some(0), "nobody is expected yet");
        run_all(&mut s, Served::MidFrame);
        assert_eq!(s.expected(), 2);
        // Client 1 continues its frame; client 2 never does.
        tx.send(cont(1)).unwrap();
        let t0 = Instant::now();
        assert_eq!(s.gather(&rx), Some(1), "client 2 is late");
        let waited = t0.elapsed();
        assert!(
            waited >= wait,
            "it waited for the expected client: {waited:?}"
        );
        assert!(
            waited < wait + Duration::from_secs(5),
            "and not past max_wait (with a generous margin for a loaded machine): {waited:?}"
        );
        assert_eq!(run_all(&mut s, Served::FrameDone), vec![cont(1)]);
    }

    #[test]
    fn a_client_that_never_sends_stalls_the_others_once_at_most() {
        // A long max_wait: a tick that waited for the silent client would be seen.
        let wait = Duration::from_millis(400);
        let mut s = Scheduler::new(wait);
        let (tx, rx) = unbounded();
        for c in [1, 2] {
            tx.send(start(c)).unwrap();
        }
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::MidFrame);
        tx.send(cont(1)).unwrap();
        assert_eq!(s.gather(&rx), Some(1), "client 2 is late once");
        run_all(&mut s, Served::MidFrame);
        // From now on client 2 is not waited for: client 1's ticks go at its own pace.
        for _ in 0..5 {
            tx.send(cont(1)).unwrap();
            let t0 = Instant::now();
            assert_eq!(s.gather(&rx), Some(0));
            assert!(
                t0.elapsed() < wait,
                "a tick with everyone expected there does not wait: {:?}",
                t0.elapsed()
            );
            assert_eq!(run_all(&mut s, Served::MidFrame), vec![cont(1)]);
        }
        assert_eq!(s.expected(), 1);
    }

    #[test]
    fn a_tick_goes_as_soon_as_every_expected_client_has_come() {
        let wait = Duration::from_secs(30);
        let mut s = Scheduler::new(wait);
        let (tx, rx) = unbounded();
        for c in 0..3 {
            tx.send(start(c)).unwrap();
        }
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::MidFrame);
        let sender = std::thread::spawn(move || {
            for c in 0..3 {
                std::thread::sleep(Duration::from_millis(20));
                tx.send(cont(c)).unwrap();
            }
            tx
        });
        let t0 = Instant::now();
        assert_eq!(s.gather(&rx), Some(0), "all three came");
        assert!(t0.elapsed() < wait, "it did not wait for max_wait");
        let mut got = run_all(&mut s, Served::FrameDone);
        got.sort_by_key(|j| format!("{j:?}"));
        assert_eq!(got, vec![cont(0), cont(1), cont(2)]);
        drop(sender.join().unwrap());
        assert_eq!(
            s.gather(&rx),
            None,
            "the channel is closed and nothing is pending"
        );
    }

    #[test]
    fn clients_join_and_leave_between_ticks() {
        let wait = Duration::from_secs(30);
        let mut s = Scheduler::new(wait);
        let (tx, rx) = unbounded();
        tx.send(start(1)).unwrap();
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::MidFrame);
        // Client 1 leaves mid-frame: the next tick does not wait for it.
        tx.send(Job(Arrival::Leaves(1))).unwrap();
        // A newcomer is not expected in its first tick: its request alone makes a tick.
        tx.send(start(7)).unwrap();
        let t0 = Instant::now();
        assert_eq!(s.gather(&rx), Some(0));
        assert!(t0.elapsed() < wait);
        let batch = run_all(&mut s, Served::MidFrame);
        assert_eq!(batch, vec![Job(Arrival::Leaves(1)), start(7)]);
        assert_eq!(s.expected(), 1, "only the newcomer is expected now");
    }

    #[test]
    fn a_prompt_client_is_expected_for_its_next_frame_a_paced_one_is_not() {
        let wait = Duration::from_millis(50);
        let mut s = Scheduler::new(wait);
        let (tx, rx) = unbounded();
        for c in [1, 2] {
            tx.send(start(c)).unwrap();
        }
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::FrameDone);
        // Client 1 has its next frame at once; client 2 comes back after more than max_wait.
        tx.send(start(1)).unwrap();
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::FrameDone);
        assert!(
            s.is_expected(1),
            "it came back within max_wait: expected next time"
        );
        std::thread::sleep(wait * 2);
        tx.send(start(2)).unwrap();
        // Client 2's tick waits for client 1 (prompt), which does not come this time.
        assert_eq!(s.gather(&rx), Some(1));
        run_all(&mut s, Served::FrameDone);
        assert!(
            !s.is_expected(2),
            "client 2 came back late: nobody waits for it"
        );
        assert!(
            !s.is_expected(1),
            "a late client is not waited for again until served"
        );
    }

    #[test]
    fn paced_clients_due_within_the_wait_share_a_tick() {
        let period = Duration::from_millis(400);
        let wait = Duration::from_millis(200);
        let mut s = Scheduler::new(wait).with_period(period);
        let (tx, rx) = unbounded();
        // Two paced clients 100 ms apart in phase (times generous for a loaded machine).
        tx.send(start(1)).unwrap();
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::FrameDone);
        std::thread::sleep(Duration::from_millis(100));
        tx.send(start(2)).unwrap();
        s.gather(&rx).unwrap();
        run_all(&mut s, Served::FrameDone);
        // Client 1's next frame, a period later: client 2's is due 100 ms after it, within the
        // wait, so the tick waits for it and steps both.
        std::thread::sleep(Duration::from_millis(300));
        tx.send(start(1)).unwrap();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            tx.send(start(2)).unwrap();
            tx
        });
        assert_eq!(s.gather(&rx), Some(0));
        assert_eq!(run_all(&mut s, Served::FrameDone), vec![start(1), start(2)]);
        let tx = sender.join().unwrap();
        // Without the period, the same arrivals make two ticks.
        let mut s = Scheduler::new(wait);
        for c in [1, 2] {
            tx.send(start(c)).unwrap();
            s.gather(&rx).unwrap();
            run_all(&mut s, Served::FrameDone);
        }
        std::thread::sleep(Duration::from_millis(400));
        tx.send(start(1)).unwrap();
        assert_eq!(s.gather(&rx), Some(0));
        assert_eq!(run_all(&mut s, Served::FrameDone), vec![start(1)]);
    }

    #[test]
    fn requests_left_in_a_tick_carry_over_to_the_next() {
        let mut s = Scheduler::new(Duration::from_millis(10));
        let (tx, rx) = unbounded();
        tx.send(start(1)).unwrap();
        tx.send(cont(2)).unwrap();
        s.gather(&rx).unwrap();
        let firsts = s.take_out(|j| matches!(j.0, Arrival::Continues(_)));
        assert_eq!(firsts, vec![cont(2)]);
        s.served(2, Served::FrameDone);
        drop(tx);
        assert_eq!(
            s.gather(&rx),
            Some(0),
            "the held request makes the next tick"
        );
        assert_eq!(s.take_out(|_| true), vec![start(1)]);
        assert_eq!(s.gather(&rx), None);
    }
}
