//! Acoustic echo cancellation: WebRTC's AEC3 (the pure-Rust `sonora` port) fed with the
//! speaker's reference aligned to the microphone on one clock.
//!
//! The microphone's samples carry the instant they were captured and the reference's the
//! instant they were played (both from the devices' timestamps, so output and input latencies
//! are accounted for). For each 10 ms capture block the canceller is handed the reference that
//! was played `lead` later (the echo can only follow it; less when the output's latency is too
//! short for that reference to have been rendered yet), so what AEC3's own delay search has to
//! find is the acoustic path plus that lead. A path longer than that search covers (about half a
//! second: a loopback, a Bluetooth speaker) is found by a coarse search over the signal
//! envelopes (up to `max_delay`), and the reference is delayed by it (`extra_delay` adds a known
//! one by hand).
//!
//! Noise suppression, gain control and the high-pass filter stay off: the model wants the
//! user's voice as it is. Knows nothing of stages, devices or threads.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use sonora::config::EchoCanceller as AecConfig;
use sonora::{AudioProcessing, Config, StreamConfig};

use super::reference::{instant_of, position_at};

/// Settings of a [`Canceller`].
#[derive(Debug, Clone, Copy)]
pub struct CancellerConfig {
    /// Sample rate of both signals.
    pub rate: u32,
    /// How much later than a capture block the reference it is handed was played.
    pub lead: Duration,
    /// A delay of the echo path known in advance, added to the reference's.
    pub extra_delay: Duration,
    /// The longest echo path the coarse search looks for.
    pub max_delay: Duration,
}

impl CancellerConfig {
    /// Defaults at `rate`: 20 ms lead, no extra delay, coarse search up to 1.5 s.
    pub fn new(rate: u32) -> Self {
        CancellerConfig {
            rate,
            lead: Duration::from_millis(20),
            extra_delay: Duration::ZERO,
            max_delay: Duration::from_millis(1500),
        }
    }
}

/// What the canceller reports.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EchoStats {
    /// Echo return loss enhancement over the last seconds of single talk: the microphone's
    /// power over the output's while the speaker plays and the user is silent (dB).
    pub erle_db: Option<f64>,
    /// The echo path's delay past the devices: AEC3's estimate, plus the coarse delay, less
    /// the lead (ms).
    pub delay_ms: Option<f64>,
    /// The delay added to the reference after the coarse search (ms).
    pub coarse_delay_ms: f64,
    /// Share of the recent blocks with the speaker playing in which the user talks too.
    pub double_talk: f64,
    /// Times the reference was realigned to the capture clock (a jump of more than 20 ms).
    pub realigns: u64,
    /// Blocks processed without all of their reference after waiting 40 ms for it (handed
    /// silence where it was missing): the player stalled or stopped.
    pub late_reference: u64,
    /// 10 ms blocks processed.
    pub blocks: u64,
}

/// Block power (mean square) above which the speaker counts as playing (−50 dBFS).
const ACTIVE: f64 = 1e-5;
/// Blocks of envelope kept for the coarse search (6 s).
const ENVELOPE_BLOCKS: usize = 600;
/// Blocks between two coarse searches (0.5 s).
const SEARCH_EVERY: u64 = 50;
/// Delays AEC3 finds by itself comfortably; beyond, the reference is delayed.
const SEARCH_COMFORT: Duration = Duration::from_millis(300);
/// How long a block waits for its reference before it is processed without it.
const MAX_WAIT: Duration = Duration::from_millis(40);
/// Where the remaining delay is put once the reference is delayed.
const COARSE_TARGET: Duration = Duration::from_millis(150);

/// A stream echo canceller: push the reference as it arrives, then process capture.
pub struct Canceller {
    cfg: CancellerConfig,
    apm: AudioProcessing,
    block: usize,
    /// Reference samples, `reference[0]` at position `ref_base`.
    reference: VecDeque<f32>,
    ref_base: u64,
    ref_clock: Option<(u64, Instant)>,
    /// The next reference position handed to AEC3.
    feed: Option<u64>,
    /// Delay added to the reference (samples): coarse search plus `extra_delay`.
    coarse: u64,
    extra: u64,
    /// How much of `lead` the output's latency did not allow (samples).
    cut: u64,
    /// Capture samples not yet processed, the first at position `cap_pos`.
    pending: Vec<f32>,
    cap_pos: u64,
    /// `(position after the newest capture sample, its capture instant)`.
    cap_clock: Option<(u64, Instant)>,
    render: Vec<f32>,
    scratch: Vec<f32>,
    out_block: Vec<f32>,
    /// Envelopes (RMS per block) of the capture and the undelayed reference, for the coarse
    /// search.
    env_cap: VecDeque<f32>,
    env_ref: VecDeque<f32>,
    candidate: Option<usize>,
    /// Recent single-talk powers (input, output) and double-talk flags.
    recent: VecDeque<(f64, f64, bool)>,
    stats: EchoStats,
}

impl Canceller {
    /// A canceller with settings `cfg`.
    pub fn new(cfg: CancellerConfig) -> Self {
        let config = Config {
            echo_canceller: Some(AecConfig {
                enforce_high_pass_filtering: false,
                ..Default::default()
            }),
            ..Default::default()
        };
        let stream = StreamConfig::new(cfg.rate, 1);
        let apm = AudioProcessing::builder()
            .config(config)
            .capture_config(stream)
            .render_config(stream)
            .build();
        let block = (cfg.rate / 100) as usize;
        Canceller {
            apm,
            block,
            reference: VecDeque::with_capacity(cfg.rate as usize * 4),
            ref_base: 0,
            ref_clock: None,
            feed: None,
            coarse: 0,
            extra: samples(cfg.extra_delay, cfg.rate),
            cut: 0,
            pending: Vec::with_capacity(block * 8),
            cap_pos: 0,
            cap_clock: None,
            render: vec![0.0; block],
            scratch: vec![0.0; block],
            out_block: vec![0.0; block],
            env_cap: VecDeque::with_capacity(ENVELOPE_BLOCKS),
            env_ref: VecDeque::with_capacity(ENVELOPE_BLOCKS),
            candidate: None,
            recent: VecDeque::with_capacity(300),
            stats: EchoStats::default(),
            cfg,
        }
    }

    /// The settings.
    pub fn config(&self) -> &CancellerConfig {
        &self.cfg
    }

    /// What it reports.
    pub fn stats(&self) -> EchoStats {
        self.stats
    }

    /// Appends reference samples (consecutive positions from `written - samples.len()`).
    pub fn push_reference(&mut self, reference: &[f32]) {
        self.reference.extend(reference.iter().copied());
        // Keep what the coarse delay and the search may still need.
        let keep = samples(self.cfg.max_delay, self.cfg.rate) as usize
            + self.extra as usize
            + self.cfg.rate as usize;
        if self.reference.len() > keep {
            let n = self.reference.len() - keep;
            self.reference.drain(..n);
            self.ref_base += n as u64;
        }
    }

    /// The latest `(reference position, instant it is played)` pair.
    pub fn set_reference_clock(&mut self, clock: (u64, Instant)) {
        self.ref_clock = Some(clock);
    }

    /// Processes capture samples whose newest was captured at `newest`; appends the cancelled
    /// blocks completed so far to `out` and returns the capture instant of the newest sample
    /// appended (None when no block was completed).
    pub fn process(
        &mut self,
        input: &[f32],
        newest: Instant,
        out: &mut Vec<f32>,
    ) -> Option<Instant> {
        let end = self.cap_pos + (self.pending.len() + input.len()) as u64;
        self.cap_clock = Some((end, newest));
        self.pending.extend_from_slice(input);
        let mut last = None;
        let mut done = 0;
        while self.pending.len() - done >= self.block {
            let at = self.capture_instant(self.cap_pos);
            if !self.align(at) {
                // Its reference has not been rendered yet: the block waits for the next call.
                break;
            }
            self.block_at(done);
            out.extend_from_slice(&self.out_block);
            done += self.block;
            self.cap_pos += self.block as u64;
            last = Some(self.capture_instant(self.cap_pos - 1));
        }
        self.pending.drain(..done);
        last
    }

    /// The capture samples not yet processed (less than a block), taken out as they are.
    pub fn take_pending(&mut self) -> Vec<f32> {
        self.cap_pos += self.pending.len() as u64;
        std::mem::take(&mut self.pending)
    }

    /// The capture instant of capture position `pos`.
    fn capture_instant(&self, pos: u64) -> Instant {
        match self.cap_clock {
            Some((end, at)) => instant_of((end - 1, at), pos, self.cfg.rate),
            None => Instant::now(),
        }
    }

    /// Aligns the reference handed to AEC3 with the block captured from `at`: the reference
    /// played `lead` later (less, down to none, when it has not been rendered that far yet),
    /// kept contiguous from block to block unless the two clocks drift apart by 20 ms. False
    /// while the block should wait for its reference (at most [`MAX_WAIT`]).
    fn align(&mut self, at: Instant) -> bool {
        let Some(clock) = self.ref_clock else {
            self.feed = None;
            return true;
        };
        let rate = self.cfg.rate;
        let n = self.block as u64;
        let lead = samples(self.cfg.lead, rate);
        let nominal =
            position_at(clock, at + self.cfg.lead, rate).saturating_sub(self.coarse + self.extra);
        let end = self.ref_base + self.reference.len() as u64;
        let tolerance = samples(Duration::from_millis(20), rate);
        let keep = self
            .feed
            .is_some_and(|f| f.abs_diff(nominal.saturating_sub(self.cut)) <= tolerance);
        if !keep {
            // The longest lead whose reference has arrived, a block to spare.
            let f = end
                .saturating_sub(2 * n)
                .clamp(nominal.saturating_sub(lead), nominal);
            self.cut = nominal - f;
            if self.feed.is_some() {
                self.stats.realigns += 1;
            }
            self.feed = Some(f);
        }
        let f = self.feed.unwrap_or(0);
        if f + n <= end {
            return true;
        }
        let end_of_block = at + Duration::from_millis(10);
        if Instant::now().saturating_duration_since(end_of_block) < MAX_WAIT {
            return false;
        }
        // The player stalls or stopped: on without it (what is missing is silence).
        self.stats.late_reference += 1;
        true
    }

    /// Cancels the block at `pending[offset..]` into `out_block`, with the reference aligned
    /// by [`align`](Self::align).
    fn block_at(&mut self, offset: usize) {
        let n = self.block;
        // The reference block handed to AEC3, and the undelayed one for the envelopes.
        let (ref_power, env_ref) = match self.feed {
            Some(f) => {
                fill(&mut self.render, &self.reference, self.ref_base, f);
                self.feed = Some(f + n as u64);
                // The same reference without the coarse delay, for the coarse search.
                fill(
                    &mut self.scratch,
                    &self.reference,
                    self.ref_base,
                    f + self.coarse,
                );
                (power(&self.render), power(&self.scratch).sqrt() as f32)
            }
            None => {
                self.render.fill(0.0);
                (0.0, 0.0)
            }
        };
        let input = &self.pending[offset..offset + n];
        let in_power = power(input);
        let _ = self
            .apm
            .process_render_f32(&[&self.render], &mut [&mut self.scratch]);
        let _ = self.apm.set_stream_delay_ms(0);
        if self
            .apm
            .process_capture_f32(&[input], &mut [&mut self.out_block])
            .is_err()
        {
            self.out_block.copy_from_slice(input);
        }
        let out_power = power(&self.out_block);
        self.stats.blocks += 1;
        self.observe(in_power, out_power, ref_power);
        push_env(&mut self.env_cap, in_power.sqrt() as f32);
        push_env(&mut self.env_ref, env_ref);
        if self.stats.blocks.is_multiple_of(SEARCH_EVERY) {
            self.coarse_search();
        }
    }

    /// Updates ERLE, double talk and the delay from one block's powers.
    fn observe(&mut self, input: f64, output: f64, reference: f64) {
        if reference > ACTIVE && input > ACTIVE * 0.01 {
            // Once converged, an output within 12 dB of the input is the user's voice.
            let converged = self.stats.erle_db.is_some_and(|e| e > 15.0);
            let double = converged && output > input * 0.063;
            if self.recent.len() == 300 {
                self.recent.pop_front();
            }
            self.recent.push_back((input, output, double));
            let single: Vec<&(f64, f64, bool)> = self.recent.iter().filter(|r| !r.2).collect();
            if single.len() >= 50 {
                let (i, o) = single
                    .iter()
                    .fold((0.0, 0.0), |(i, o), r| (i + r.0, o + r.1));
                self.stats.erle_db = Some(10.0 * (i / o.max(1e-20)).log10());
            }
            let dt = self.recent.iter().filter(|r| r.2).count();
            self.stats.double_talk = dt as f64 / self.recent.len() as f64;
        }
        if self.stats.blocks.is_multiple_of(100) {
            let s = self.apm.statistics();
            let rate = self.cfg.rate as f64;
            let lead = samples(self.cfg.lead, self.cfg.rate).saturating_sub(self.cut);
            self.stats.delay_ms = s.delay_ms.map(|d| {
                d as f64 + (self.coarse + self.extra) as f64 * 1e3 / rate - lead as f64 * 1e3 / rate
            });
        }
    }

    /// Looks for the echo path's delay in the envelopes; delays the reference when the path
    /// is longer than AEC3 covers comfortably (and undoes that when it no longer is).
    fn coarse_search(&mut self) {
        let rate = self.cfg.rate;
        let block_ms = 10.0;
        let max_lag = (self.cfg.max_delay.as_secs_f64() * 1e3 / block_ms) as usize;
        let n = self.env_cap.len();
        if n < max_lag + 200 {
            return;
        }
        let Some((lag, score)) = best_lag(&self.env_cap, &self.env_ref, max_lag) else {
            return;
        };
        if score < 0.5 {
            self.candidate = None;
            return;
        }
        // Two searches in a row must agree (within 30 ms).
        let agreed = self.candidate.is_some_and(|c| c.abs_diff(lag) <= 3);
        self.candidate = Some(lag);
        if !agreed {
            return;
        }
        let path = Duration::from_secs_f64(lag as f64 * block_ms / 1e3);
        let target = if path > SEARCH_COMFORT {
            samples(path - COARSE_TARGET, rate) / self.block as u64 * self.block as u64
        } else {
            0
        };
        if target.abs_diff(self.coarse) >= samples(Duration::from_millis(60), rate) {
            tracing::info!(
                path_ms = lag as f64 * block_ms,
                reference_delay_ms = target as f64 * 1e3 / rate as f64,
                "echo path longer than the canceller searches: delaying the reference"
            );
            self.coarse = target;
            self.stats.coarse_delay_ms = target as f64 * 1e3 / rate as f64;
        }
    }
}

/// The lag (in blocks, `0..=max_lag`) at which `cap` best follows `reference`, with its
/// normalised correlation.
fn best_lag(
    cap: &VecDeque<f32>,
    reference: &VecDeque<f32>,
    max_lag: usize,
) -> Option<(usize, f64)> {
    let n = cap.len().min(reference.len());
    let w = n.checked_sub(max_lag)?;
    let c: Vec<f64> = cap.iter().skip(n - w).map(|&v| v as f64).collect();
    let cm = c.iter().sum::<f64>() / w as f64;
    let cv: f64 = c.iter().map(|v| (v - cm).powi(2)).sum();
    if cv <= 0.0 {
        return None;
    }
    let r: Vec<f64> = reference.iter().map(|&v| v as f64).collect();
    let mut best = None::<(usize, f64)>;
    for lag in 0..=max_lag {
        let seg = &r[n - w - lag..n - lag];
        let m = seg.iter().sum::<f64>() / w as f64;
        let v: f64 = seg.iter().map(|x| (x - m).powi(2)).sum();
        if v <= 0.0 {
            continue;
        }
        let xy: f64 = seg.iter().zip(&c).map(|(x, y)| (x - m) * (y - cm)).sum();
        let score = xy / (v * cv).sqrt();
        if best.is_none_or(|b| score > b.1) {
            best = Some((lag, score));
        }
    }
    best
}

fn push_env(env: &mut VecDeque<f32>, v: f32) {
    if env.len() == ENVELOPE_BLOCKS {
        env.pop_front();
    }
    env.push_back(v);
}

/// Copies the reference from position `from` into `out`, zeros where it has none.
fn fill(out: &mut [f32], reference: &VecDeque<f32>, base: u64, from: u64) {
    for (i, o) in out.iter_mut().enumerate() {
        let p = from + i as u64;
        *o = if p >= base {
            reference.get((p - base) as usize).copied().unwrap_or(0.0)
        } else {
            0.0
        };
    }
}

fn power(x: &[f32]) -> f64 {
    x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len().max(1) as f64
}

fn samples(d: Duration, rate: u32) -> u64 {
    (d.as_secs_f64() * rate as f64).round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A speech-like test signal: noise shaped by a syllable-rate envelope.
    fn babble(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        let mut lp = 0.0f32;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let white = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                lp = 0.7 * lp + 0.3 * white;
                // Syllables of 150 ms with pseudo-random loudness (some silent), not periodic.
                let syl = (i / 3600) as u64;
                let h = (syl.wrapping_add(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 59) as f32;
                let loud = if h < 8.0 { 0.0 } else { h / 31.0 };
                let phase = (i % 3600) as f32 / 3600.0;
                let env = loud * (std::f32::consts::PI * phase).sin();
                lp * env * 1.6
            })
            .collect()
    }

    /// Runs a simulated room: the echo is `gain · reference` `delay` after it was played; the
    /// reference is pushed 10 ms at a time with play instants, 30 ms before it plays; capture
    /// is processed 20 ms at a time.
    fn room(
        delay_ms: u64,
        seconds: usize,
        near: Option<(&[f32], usize)>,
    ) -> (Vec<f32>, Vec<f32>, Canceller) {
        room_ahead(delay_ms, seconds, near, 720)
    }

    /// [`room`] with the reference rendered `ahead` samples before it plays.
    fn room_ahead(
        delay_ms: u64,
        seconds: usize,
        near: Option<(&[f32], usize)>,
        ahead: usize,
    ) -> (Vec<f32>, Vec<f32>, Canceller) {
        let rate = 24_000usize;
        let n = rate * seconds;
        let far = babble(n, 7);
        let d = delay_ms as usize * rate / 1000;
        let mut mic: Vec<f32> = (0..n)
            .map(|i| if i >= d { 0.5 * far[i - d] } else { 0.0 })
            .collect();
        if let Some((v, at)) = near {
            for (i, x) in v.iter().enumerate() {
                if at + i < n {
                    mic[at + i] += x;
                }
            }
        }
        let t0 = Instant::now();
        let at = |i: usize| t0 + Duration::from_secs_f64(i as f64 / rate as f64);
        let mut c = Canceller::new(CancellerConfig::new(rate as u32));
        let mut out = Vec::new();
        let mut pushed = 0;
        for f in 0..n / 480 {
            while pushed < ((f + 1) * 480 + ahead).min(n) {
                c.push_reference(&far[pushed..pushed + 240]);
                c.set_reference_clock((pushed as u64, at(pushed)));
                pushed += 240;
            }
            let r = f * 480..(f + 1) * 480;
            c.process(&mic[r.clone()], at(r.end - 1), &mut out);
        }
        (mic, out, c)
    }

    fn db(a: &[f32], b: &[f32]) -> f64 {
        10.0 * (power(a) / power(b).max(1e-20)).log10()
    }

    #[test]
    fn a_short_echo_path_is_cancelled_by_30_db_within_a_second_or_two() {
        let (mic, out, c) = room(40, 8, None);
        let s = 24_000;
        // The last block waits for a reference that never comes.
        assert!(out.len() >= 8 * s - 480, "{}", out.len());
        let erle = db(&mic[2 * s..out.len()], &out[2 * s..]);
        assert!(erle >= 30.0, "ERLE {erle:.1} dB");
        let st = c.stats();
        assert!(st.erle_db.unwrap() > 25.0, "{st:?}");
        let d = st.delay_ms.unwrap();
        assert!((d - 40.0).abs() < 15.0, "delay {d} ms: {st:?}");
        assert_eq!(st.coarse_delay_ms, 0.0);
    }

    #[test]
    fn an_output_latency_shorter_than_the_lead_shortens_the_lead_without_holes() {
        // Rendered 5 ms before it plays: the 20 ms lead cannot be had.
        let (mic, out, c) = room_ahead(40, 8, None, 120);
        let s = 24_000;
        let erle = db(&mic[2 * s..out.len()], &out[2 * s..]);
        let st = c.stats();
        assert!(erle >= 30.0, "ERLE {erle:.1} dB: {st:?}");
        assert_eq!((st.late_reference, st.realigns), (0, 0), "{st:?}");
        let d = st.delay_ms.unwrap();
        assert!((d - 40.0).abs() < 15.0, "delay {d} ms: {st:?}");
    }

    #[test]
    fn a_path_longer_than_aec3_searches_is_found_by_the_coarse_search() {
        let (mic, out, c) = room(800, 16, None);
        let s = 24_000;
        let st = c.stats();
        assert!(st.coarse_delay_ms > 500.0, "{st:?}");
        let erle = db(&mic[12 * s..out.len()], &out[12 * s..]);
        assert!(erle >= 25.0, "ERLE {erle:.1} dB: {st:?}");
    }

    #[test]
    fn the_users_voice_survives_double_talk() {
        let user = babble(24_000 * 3, 99)
            .iter()
            .map(|v| v * 0.8)
            .collect::<Vec<_>>();
        let at = 24_000 * 5;
        let (_, out, c) = room(40, 9, Some((&user, at)));
        let got = &out[at..at + user.len()];
        let best = (0..240)
            .map(|lag| {
                let (mut xy, mut xx, mut yy) = (0.0f64, 0.0, 0.0);
                for i in 0..user.len() - 240 {
                    let (a, b) = (user[i] as f64, got[i + lag] as f64);
                    xy += a * b;
                    xx += a * a;
                    yy += b * b;
                }
                xy / (xx * yy).sqrt()
            })
            .fold(0.0, f64::max);
        assert!(best >= 0.7, "correlation {best:.3}");
        assert!(c.stats().double_talk > 0.05, "{:?}", c.stats());
    }
}
