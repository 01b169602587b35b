//! In-process timing statistics kept by the runtime for every stage and edge.
//!
//! These are what `duplex run` prints at the end (the per-stage timing table) and what tests
//! read. The same values are also recorded through the `metrics` facade for Prometheus; those
//! records are no-ops until an exporter is installed. Nothing here knows what a stage computes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Sub-buckets per power of two: bucket edges grow by 2^(1/16) ≈ 4.4 %, so a quantile read from
/// the histogram is within ~2.2 % of the true value.
const SUB: u32 = 16;
/// Buckets cover 1 ns … 2^40 ns (≈ 18 min); longer durations land in the last bucket.
const BUCKETS: usize = (40 * SUB) as usize + 1;

/// A log-bucketed histogram of durations with constant memory, for quantiles over runs of any
/// length.
#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    total: u64,
    sum_ns: u128,
    min_ns: u64,
    max_ns: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    /// An empty histogram.
    pub fn new() -> Self {
        LatencyHistogram {
            counts: vec![0; BUCKETS],
            total: 0,
            sum_ns: 0,
            min_ns: u64::MAX,
            max_ns: 0,
        }
    }

    fn bucket(ns: u64) -> usize {
        if ns <= 1 {
            return 0;
        }
        let idx = ((ns as f64).log2() * SUB as f64).floor() as usize;
        idx.min(BUCKETS - 1)
    }

    fn bucket_value(idx: usize) -> f64 {
        // Geometric middle of the bucket.
        2f64.powf((idx as f64 + 0.5) / SUB as f64)
    }

    /// Records one duration.
    pub fn record(&mut self, d: Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        self.counts[Self::bucket(ns)] += 1;
        self.total += 1;
        self.sum_ns += ns as u128;
        self.min_ns = self.min_ns.min(ns);
        self.max_ns = self.max_ns.max(ns);
    }

    /// Number of recorded durations.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Mean, or zero when empty.
    pub fn mean(&self) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos((self.sum_ns / self.total as u128) as u64)
    }

    /// Sum of all recorded durations.
    pub fn sum(&self) -> Duration {
        Duration::from_nanos(self.sum_ns.min(u64::MAX as u128) as u64)
    }

    /// Largest recorded duration (exact), or zero when empty.
    pub fn max(&self) -> Duration {
        Duration::from_nanos(self.max_ns)
    }

    /// Quantile `q` in `[0, 1]`, within one bucket (≈ ±2.2 %), clamped to the exact min and max.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        if rank >= self.total {
            return Duration::from_nanos(self.max_ns);
        }
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let v = Self::bucket_value(i).clamp(self.min_ns as f64, self.max_ns as f64);
                return Duration::from_nanos(v as u64);
            }
        }
        Duration::from_nanos(self.max_ns)
    }
}

/// Live statistics of one stage, shared between its actor thread and observers.
#[derive(Default)]
pub struct StageStats {
    /// Frames handed to `process` (or produced, for a source).
    pub frames: AtomicU64,
    /// Time inside `process`, without the time spent blocked on full outputs or feedback.
    pub service: Mutex<LatencyHistogram>,
    /// Interval between completions, recorded at sinks (stages without outputs).
    pub completion: Mutex<LatencyHistogram>,
    /// Total time blocked on full output edges or waiting for feedback.
    pub blocked_ns: AtomicU64,
}

/// Live statistics of one edge.
#[derive(Default)]
pub struct EdgeStats {
    /// Frames accepted into the edge.
    pub sent: AtomicU64,
    /// Frames dropped by the overflow policy.
    pub dropped: AtomicU64,
    /// Time from enqueue to dequeue.
    pub wait: Mutex<LatencyHistogram>,
    /// Largest depth observed at enqueue.
    pub max_depth: AtomicU64,
    /// Frames taken out by the consumer.
    pub received: AtomicU64,
    /// Accepted frames pushed out again by `drop_oldest` (also counted in `dropped`).
    pub evicted: AtomicU64,
}

/// A consistent copy of one stage's statistics.
#[derive(Clone)]
pub struct StageReport {
    /// Stage name.
    pub name: String,
    /// Frames processed.
    pub frames: u64,
    /// Service-time histogram.
    pub service: LatencyHistogram,
    /// Completion intervals (sinks only; empty elsewhere).
    pub completion: LatencyHistogram,
    /// Total time blocked on outputs or feedback.
    pub blocked: Duration,
}

/// A consistent copy of one edge's statistics.
#[derive(Clone)]
pub struct EdgeReport {
    /// `from.port -> to.port`.
    pub name: String,
    /// Declared capacity.
    pub capacity: usize,
    /// Overflow policy.
    pub overflow: super::Overflow,
    /// Frames accepted.
    pub sent: u64,
    /// Frames dropped by the policy.
    pub dropped: u64,
    /// Queue wait histogram.
    pub wait: LatencyHistogram,
    /// Largest depth seen.
    pub max_depth: u64,
    /// Frames still queued (accepted, neither received nor evicted): after an abort, what was
    /// discarded.
    pub queued: u64,
}

/// Statistics of a whole run, readable while it runs and returned when it ends.
#[derive(Clone)]
pub struct RunReport {
    /// Per stage, in declaration order.
    pub stages: Vec<StageReport>,
    /// Per edge, in declaration order.
    pub edges: Vec<EdgeReport>,
    /// Wall time from start to the end of the last actor (or to the snapshot).
    pub wall: Duration,
}

impl RunReport {
    /// The report of the stage called `name`.
    pub fn stage(&self, name: &str) -> Option<&StageReport> {
        self.stages.iter().find(|s| s.name == name)
    }

    /// The report of the edge whose name starts with `from` (for example `"src.out"` or `"src"`)
    /// and goes to `to`.
    pub fn edge(&self, from: &str, to: &str) -> Option<&EdgeReport> {
        self.edges.iter().find(|e| {
            let (a, b) = e.name.split_once(" -> ").unwrap_or((&e.name, ""));
            (a == from || a.split('.').next() == Some(from))
                && (b == to || b.split('.').next() == Some(to))
        })
    }
}

pub(crate) struct StatsRegistry {
    pub stages: Vec<(String, Arc<StageStats>)>,
    pub edges: Vec<(String, usize, super::Overflow, Arc<EdgeStats>)>,
}

impl StatsRegistry {
    pub fn snapshot(&self, wall: Duration) -> RunReport {
        let lock = |m: &Mutex<LatencyHistogram>| match m.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        };
        RunReport {
            stages: self
                .stages
                .iter()
                .map(|(n, s)| StageReport {
                    name: n.clone(),
                    frames: s.frames.load(Ordering::Relaxed),
                    service: lock(&s.service),
                    completion: lock(&s.completion),
                    blocked: Duration::from_nanos(s.blocked_ns.load(Ordering::Relaxed)),
                })
                .collect(),
            edges: self
                .edges
                .iter()
                .map(|(n, cap, ov, e)| EdgeReport {
                    name: n.clone(),
                    capacity: *cap,
                    overflow: *ov,
                    sent: e.sent.load(Ordering::Relaxed),
                    dropped: e.dropped.load(Ordering::Relaxed),
                    wait: lock(&e.wait),
                    max_depth: e.max_depth.load(Ordering::Relaxed),
                    queued: e.sent.load(Ordering::Relaxed).saturating_sub(
                        e.received.load(Ordering::Relaxed) + e.evicted.load(Ordering::Relaxed),
                    ),
                })
                .collect(),
            wall,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_one_bucket() {
        let mut h = LatencyHistogram::new();
        for i in 1..=1000u64 {
            h.record(Duration::from_micros(i));
        }
        assert_eq!(h.count(), 1000);
        for (q, want) in [(0.5, 500.0), (0.9, 900.0), (0.99, 990.0)] {
            let got = h.quantile(q).as_secs_f64() * 1e6;
            assert!((got / want - 1.0).abs() < 0.03, "q{q}: {got} vs {want}");
        }
        assert_eq!(h.max(), Duration::from_micros(1000));
        assert_eq!(h.quantile(1.0), Duration::from_micros(1000));
        let mean = h.mean().as_secs_f64() * 1e6;
        assert!((mean - 500.5).abs() < 0.01);
    }

    #[test]
    fn empty_histogram_reads_zero() {
        let h = LatencyHistogram::new();
        assert_eq!(h.quantile(0.5), Duration::ZERO);
        assert_eq!(h.mean(), Duration::ZERO);
    }
}
