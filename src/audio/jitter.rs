//! The playback jitter buffer: what a device callback pulls from.
//!
//! The pipeline side ([`JitterWriter`]) pushes samples into a lock-free SPSC ring; the device
//! side ([`JitterBuffer`]) renders one callback's worth at a time. The buffer holds a target
//! depth before it plays; on an underrun it fades out what it has, plays silence (counted as
//! concealed samples), rebuffers to a target grown by one step (never beyond the cap) and fades
//! back in; after a stable period without underruns it shrinks the target by half a step (never
//! below the minimum). When the queue grows beyond `max_depth` (the producer is ahead of the
//! device), the oldest samples are dropped down to the target (counted).
//!
//! Every frame pushed is stamped with its origin instant; when its first sample is handed to the
//! device the mouth-to-ear latency (device instant − origin) is measured and passed back to the
//! pipeline side through a second ring.
//!
//! # Real-time safety
//!
//! [`JitterBuffer::render`] allocates nothing, takes no lock, makes no syscall (reading the
//! monotonic clock goes through the vDSO) and never blocks: rings are wait-free, statistics are
//! atomics. Allocation happens in [`jitter`] only.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ringbuf::traits::{Consumer, Observer, Producer, Split};
use ringbuf::{HeapCons, HeapProd, HeapRb};

/// Jitter buffer settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JitterConfig {
    /// Samples per second.
    pub rate: u32,
    /// Initial target depth.
    pub target: Duration,
    /// Smallest target after shrinking.
    pub min_target: Duration,
    /// Largest target after growing (the cap).
    pub max_target: Duration,
    /// Growth per underrun (shrinking goes by half of it).
    pub step: Duration,
    /// Time without underrun before the target shrinks.
    pub stable: Duration,
    /// Fade in / fade out length.
    pub fade: Duration,
    /// Depth beyond which the oldest samples are dropped down to the target.
    pub max_depth: Duration,
    /// Ring capacity (samples beyond it are dropped at push, newest first).
    pub capacity: Duration,
}

impl JitterConfig {
    /// Defaults at `rate`: target 120 ms, 40..=480 ms, step 20 ms, stable 10 s, fade 2.5 ms,
    /// max depth 600 ms, capacity 2 s.
    pub fn new(rate: u32) -> Self {
        JitterConfig {
            rate,
            target: Duration::from_millis(120),
            min_target: Duration::from_millis(40),
            max_target: Duration::from_millis(480),
            step: Duration::from_millis(20),
            stable: Duration::from_secs(10),
            fade: Duration::from_micros(2500),
            max_depth: Duration::from_millis(600),
            capacity: Duration::from_secs(2),
        }
    }

    fn samples(&self, d: Duration) -> usize {
        (d.as_secs_f64() * self.rate as f64).round() as usize
    }
}

/// Counters and gauges of a jitter buffer, shared between the device and the pipeline side.
#[derive(Debug, Default)]
pub struct JitterStats {
    /// Samples queued after the last render.
    pub depth: AtomicU64,
    /// Current target depth, samples.
    pub target: AtomicU64,
    /// Underruns (the queue ran dry while playing).
    pub underruns: AtomicU64,
    /// Silence played in place of missing samples while playing or rebuffering.
    pub concealed: AtomicU64,
    /// Samples dropped (oldest on overflow, newest when the ring is full).
    pub dropped: AtomicU64,
    /// Samples handed to the device.
    pub played: AtomicU64,
    /// Render calls.
    pub renders: AtomicU64,
    /// Latest delay the device reports between a callback and the playback of its first sample
    /// (its own buffering), in ns.
    pub device_delay_ns: AtomicU64,
    /// Set at end of stream: running dry is then the end, not an underrun.
    pub ending: AtomicBool,
}

impl JitterStats {
    fn get(a: &AtomicU64) -> u64 {
        a.load(Ordering::Relaxed)
    }

    /// A snapshot: (depth, target, underruns, concealed, dropped, played), in samples.
    pub fn snapshot(&self) -> JitterSnapshot {
        JitterSnapshot {
            depth: Self::get(&self.depth),
            target: Self::get(&self.target),
            underruns: Self::get(&self.underruns),
            concealed: Self::get(&self.concealed),
            dropped: Self::get(&self.dropped),
            played: Self::get(&self.played),
            renders: Self::get(&self.renders),
        }
    }
}

/// A copy of [`JitterStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JitterSnapshot {
    /// Samples queued.
    pub depth: u64,
    /// Target depth, samples.
    pub target: u64,
    /// Underruns.
    pub underruns: u64,
    /// Concealed samples.
    pub concealed: u64,
    /// Dropped samples.
    pub dropped: u64,
    /// Played samples.
    pub played: u64,
    /// Render calls.
    pub renders: u64,
}

/// The pipeline side: pushes samples, stamped with the origin of the frame they come from.
pub struct JitterWriter {
    prod: HeapProd<f32>,
    marks: HeapProd<(u64, Instant)>,
    latencies: HeapCons<u64>,
    pushed: u64,
    stats: Arc<JitterStats>,
}

/// The device side: renders callbacks.
pub struct JitterBuffer {
    cons: HeapCons<f32>,
    marks: HeapCons<(u64, Instant)>,
    latencies: HeapProd<u64>,
    target: usize,
    min_target: usize,
    max_target: usize,
    step: usize,
    stable: usize,
    fade: usize,
    max_depth: usize,
    playing: bool,
    started: bool,
    fade_in_left: usize,
    since_underrun: usize,
    consumed: u64,
    stats: Arc<JitterStats>,
}

/// Creates a connected writer and buffer.
pub fn jitter(cfg: &JitterConfig) -> (JitterWriter, JitterBuffer) {
    jitter_with_stats(cfg, Arc::new(JitterStats::default()))
}

/// Like [`jitter`], counting into existing statistics (a reopened device keeps its counts).
pub fn jitter_with_stats(
    cfg: &JitterConfig,
    stats: Arc<JitterStats>,
) -> (JitterWriter, JitterBuffer) {
    let cap = cfg.samples(cfg.capacity).max(1);
    let (prod, cons) = HeapRb::<f32>::new(cap).split();
    let (mprod, mcons) = HeapRb::<(u64, Instant)>::new(1024).split();
    let (lprod, lcons) = HeapRb::<u64>::new(1024).split();
    let target = cfg.samples(cfg.target);
    stats.target.store(target as u64, Ordering::Relaxed);
    (
        JitterWriter {
            prod,
            marks: mprod,
            latencies: lcons,
            pushed: 0,
            stats: stats.clone(),
        },
        JitterBuffer {
            cons,
            marks: mcons,
            latencies: lprod,
            target,
            min_target: cfg.samples(cfg.min_target),
            max_target: cfg.samples(cfg.max_target).max(target),
            step: cfg.samples(cfg.step).max(1),
            stable: cfg.samples(cfg.stable).max(1),
            fade: cfg.samples(cfg.fade),
            max_depth: cfg.samples(cfg.max_depth).max(target),
            playing: false,
            started: false,
            fade_in_left: 0,
            since_underrun: 0,
            consumed: 0,
            stats,
        },
    )
}

impl JitterWriter {
    /// Queues samples whose newest was captured at `origin`. Returns how many were queued; the
    /// rest (ring full) are dropped and counted.
    pub fn push(&mut self, samples: &[f32], origin: Instant) -> usize {
        // The mark is the position of the frame's first sample.
        let _ = self.marks.try_push((self.pushed, origin));
        let n = self.prod.push_slice(samples);
        self.pushed += n as u64;
        if n < samples.len() {
            self.stats
                .dropped
                .fetch_add((samples.len() - n) as u64, Ordering::Relaxed);
        }
        n
    }

    /// The shared statistics.
    pub fn stats(&self) -> &Arc<JitterStats> {
        &self.stats
    }

    /// Mouth-to-ear latencies measured since the last call.
    pub fn drain_latencies(&mut self, mut f: impl FnMut(Duration)) {
        while let Some(ns) = self.latencies.try_pop() {
            f(Duration::from_nanos(ns));
        }
    }
}

impl JitterBuffer {
    /// The shared statistics.
    pub fn stats(&self) -> &Arc<JitterStats> {
        &self.stats
    }

    /// Current target depth in samples.
    pub fn target(&self) -> usize {
        self.target
    }

    /// Fills `out` with the next samples; `now` is the instant they reach the device (the
    /// callback's playback instant, or its best estimate).
    ///
    /// # Real-time safety
    ///
    /// No allocation, no lock, no syscall, no blocking.
    pub fn render(&mut self, out: &mut [f32], now: Instant) {
        // A handle of our own: cloning an Arc is one atomic increment, no allocation.
        let stats = Arc::clone(&self.stats);
        let s = &*stats;
        s.renders.fetch_add(1, Ordering::Relaxed);
        let mut depth = self.cons.occupied_len();
        if depth > self.max_depth {
            let drop = depth - self.target;
            let skipped = self.cons.skip(drop);
            self.consumed += skipped as u64;
            s.dropped.fetch_add(skipped as u64, Ordering::Relaxed);
            depth -= skipped;
            self.skip_marks();
        }
        if !self.playing {
            if depth >= self.target {
                self.playing = true;
                self.started = true;
                self.fade_in_left = self.fade;
            } else {
                out.fill(0.0);
                if self.started && !s.ending.load(Ordering::Relaxed) {
                    s.concealed.fetch_add(out.len() as u64, Ordering::Relaxed);
                }
                self.publish(depth);
                return;
            }
        }
        let first = self.consumed;
        let n = self.cons.pop_slice(out);
        self.consumed += n as u64;
        self.measure(first, now);
        // Fade in after (re)buffering.
        if self.fade_in_left > 0 {
            let start = self.fade - self.fade_in_left;
            let k = self.fade_in_left.min(n);
            for (i, v) in out[..k].iter_mut().enumerate() {
                *v *= (start + i + 1) as f32 / (self.fade + 1) as f32;
            }
            self.fade_in_left -= k;
        }
        if n < out.len() && s.ending.load(Ordering::Relaxed) {
            // End of stream: the last samples, then silence.
            out[n..].fill(0.0);
            self.playing = false;
        } else if n < out.len() {
            // Underrun: fade out what there is, conceal the rest, rebuffer to a larger target.
            let k = self.fade.min(n);
            for (i, v) in out[n - k..n].iter_mut().enumerate() {
                *v *= (k - i) as f32 / (k + 1) as f32;
            }
            out[n..].fill(0.0);
            s.underruns.fetch_add(1, Ordering::Relaxed);
            s.concealed
                .fetch_add((out.len() - n) as u64, Ordering::Relaxed);
            self.playing = false;
            self.target = (self.target + self.step).min(self.max_target);
            self.since_underrun = 0;
        } else {
            self.since_underrun += n;
            if self.since_underrun >= self.stable {
                self.since_underrun = 0;
                self.target = self
                    .target
                    .saturating_sub(self.step / 2)
                    .max(self.min_target);
            }
        }
        s.played.fetch_add(n as u64, Ordering::Relaxed);
        self.publish(self.cons.occupied_len());
    }

    fn publish(&self, depth: usize) {
        self.stats.depth.store(depth as u64, Ordering::Relaxed);
        self.stats
            .target
            .store(self.target as u64, Ordering::Relaxed);
    }

    /// Frames whose first sample was handed over in this render: latency = now − origin.
    fn measure(&mut self, first: u64, now: Instant) {
        while let Some(&(pos, origin)) = self.marks.try_peek() {
            if pos >= self.consumed {
                break;
            }
            let _ = self.marks.try_pop();
            if pos >= first {
                let ns = now.saturating_duration_since(origin).as_nanos() as u64;
                let _ = self.latencies.try_push(ns);
            }
        }
    }

    fn skip_marks(&mut self) {
        while let Some(&(pos, _)) = self.marks.try_peek() {
            if pos >= self.consumed {
                break;
            }
            let _ = self.marks.try_pop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> JitterConfig {
        // 1 kHz: durations in ms are sample counts.
        JitterConfig {
            rate: 1000,
            target: Duration::from_millis(40),
            min_target: Duration::from_millis(20),
            max_target: Duration::from_millis(80),
            step: Duration::from_millis(20),
            stable: Duration::from_millis(200),
            fade: Duration::from_millis(4),
            max_depth: Duration::from_millis(150),
            capacity: Duration::from_millis(300),
        }
    }

    fn ones(n: usize) -> Vec<f32> {
        vec![1.0; n]
    }

    #[test]
    fn buffers_to_the_target_then_plays_with_exact_depth_accounting() {
        let (mut w, mut b) = jitter(&cfg());
        let t0 = Instant::now();
        let mut out = [0.0f32; 10];
        assert_eq!(w.push(&ones(30), t0), 30);
        b.render(&mut out, t0);
        assert_eq!(out, [0.0; 10], "30 < target 40: still buffering");
        let s = b.stats().snapshot();
        assert_eq!(
            (s.depth, s.played, s.concealed),
            (30, 0, 0),
            "start-up is not concealment"
        );
        w.push(&ones(20), t0);
        b.render(&mut out, t0);
        let s = b.stats().snapshot();
        assert_eq!((s.depth, s.played), (40, 10));
        // Fade-in over 4 samples, then full level.
        assert_eq!(&out[..5], &[0.2, 0.4, 0.6, 0.8, 1.0]);
        for _ in 0..4 {
            b.render(&mut out, t0);
        }
        assert_eq!(b.stats().snapshot().depth, 0);
        assert_eq!(b.stats().snapshot().played, 50);
    }

    #[test]
    fn underrun_fades_out_conceals_and_grows_the_target_up_to_the_cap() {
        let (mut w, mut b) = jitter(&cfg());
        let t0 = Instant::now();
        let mut out = [0.0f32; 10];
        w.push(&ones(45), t0);
        for _ in 0..4 {
            b.render(&mut out, t0);
        }
        b.render(&mut out, t0); // 5 left, 10 asked
        assert_eq!(
            &out[..5],
            &[1.0, 0.8, 0.6, 0.4, 0.2],
            "the last 4 samples fade out"
        );
        assert_eq!(&out[5..], &[0.0; 5]);
        let s = b.stats().snapshot();
        assert_eq!((s.underruns, s.concealed, s.target), (1, 5, 60));
        // Rebuffering: silence until 60 are queued, counted as concealed.
        w.push(&ones(50), t0);
        b.render(&mut out, t0);
        assert_eq!(out, [0.0; 10]);
        assert_eq!(b.stats().snapshot().concealed, 15);
        // Two more underruns: 80, then capped at 80.
        for want in [80, 80] {
            let u = b.stats().snapshot().underruns;
            w.push(&ones(100), t0);
            while b.stats().snapshot().underruns == u {
                b.render(&mut out, t0);
            }
            assert_eq!(b.target(), want);
        }
    }

    #[test]
    fn target_shrinks_after_a_stable_period_but_not_below_the_minimum() {
        let (mut w, mut b) = jitter(&cfg());
        let t0 = Instant::now();
        let mut out = [0.0f32; 10];
        w.push(&ones(40), t0);
        // Keep it fed: 10 in, 10 out, for 1 s (5 stable periods of 200 ms).
        for _ in 0..100 {
            w.push(&ones(10), t0);
            b.render(&mut out, t0);
        }
        let s = b.stats().snapshot();
        assert_eq!(s.underruns, 0);
        assert_eq!(s.target, 20, "40 -> 30 -> 20, then the minimum");
    }

    #[test]
    fn overflow_drops_the_oldest_down_to_the_target() {
        let (mut w, mut b) = jitter(&cfg());
        let t0 = Instant::now();
        let mut out = [0.0f32; 10];
        let ramp: Vec<f32> = (0..200).map(|i| i as f32).collect();
        assert_eq!(w.push(&ramp, t0), 200);
        b.render(&mut out, t0);
        let s = b.stats().snapshot();
        assert_eq!(
            s.dropped, 160,
            "200 queued > max depth 150: keep the newest 40"
        );
        // The newest are kept: playback resumes at sample 160 (faded in).
        assert_eq!(out[9], 169.0);
        // A full ring drops the newest at push, counted too.
        let n = w.push(&vec![0.5; 400], t0);
        assert_eq!(n, 300 - 30);
        assert_eq!(b.stats().snapshot().dropped, 160 + 130);
    }

    #[test]
    fn mouth_to_ear_is_measured_when_a_frames_first_sample_plays() {
        let (mut w, mut b) = jitter(&cfg());
        let t0 = Instant::now();
        let mut out = [0.0f32; 10];
        w.push(&ones(20), t0);
        w.push(&ones(20), t0 + Duration::from_millis(20));
        b.render(&mut out, t0 + Duration::from_millis(100));
        b.render(&mut out, t0 + Duration::from_millis(110));
        b.render(&mut out, t0 + Duration::from_millis(120));
        let mut got = Vec::new();
        w.drain_latencies(|d| got.push(d));
        assert_eq!(
            got,
            vec![Duration::from_millis(100), Duration::from_millis(100)]
        );
    }
}
