//! Online diagnosis of a stage's latency: is a slow frame contention for the device, or a cost
//! that grows with the conversation?
//!
//! Over a sliding window of recent frames (time inside the stage against frame index, or KV
//! length), two robust statistics are kept:
//!
//! - **trend**: the Theil–Sen slope (median of pairwise slopes), insensitive to outliers. The
//!   window shows *growth* when the rise it predicts across the window is large against the
//!   noise (3 × the residuals' robust deviation), against the level (10 % of the median) and in
//!   absolute terms (≥ 1 ms).
//! - **bimodality**: a two-cluster gap test on the detrended times. Frames more than 6 robust
//!   deviations above the trend, and at least 25 % of the median above it, form the upper
//!   cluster (and at least 2 ms above it, so that a cheap stage's scheduling noise does not
//!   count); the window shows *contention* when it holds at least 1 % of the frames (and 3)
//!   and, when the stage's frame period is known ([`Diagnoser::set_period`]), when its frames
//!   take at least 25 % of that period: a cheap stage preempted for a few milliseconds now
//!   and then is not what makes a frame late. The exported bimodality is the upper cluster's centre over the lower's (1 when there is no
//!   upper cluster).
//!
//! The verdict is `growth` if the trend says so (contention is still reported separately),
//! else `contention`, else `steady`; it changes only when the new verdict is seen on two
//! consecutive evaluations. Pure code: the caller feeds samples and exports the results.

use std::collections::VecDeque;
use std::fmt;

/// What the window shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Flat cost, unimodal noise.
    Steady,
    /// Cost rising with the conversation.
    Growth,
    /// Good frames mixed with a second, slower mode (another job on the device).
    Contention,
}

impl Pattern {
    /// All patterns, in export order.
    pub const ALL: [Pattern; 3] = [Pattern::Steady, Pattern::Growth, Pattern::Contention];

    /// `steady` / `growth` / `contention`.
    pub fn name(&self) -> &'static str {
        match self {
            Pattern::Steady => "steady",
            Pattern::Growth => "growth",
            Pattern::Contention => "contention",
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Tuning of the diagnosis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiagnosisConfig {
    /// Frames in the sliding window.
    pub window: usize,
    /// Evaluate every this many frames.
    pub every: usize,
    /// Growth: predicted rise ≥ this many robust deviations of the residuals.
    pub noise_k: f64,
    /// Growth: predicted rise ≥ this fraction of the window's median.
    pub min_rise_rel: f64,
    /// Growth: predicted rise ≥ this many seconds.
    pub min_rise_abs: f64,
    /// Contention: upper cluster starts this many robust deviations above the trend.
    pub outlier_devs: f64,
    /// Contention: … and this fraction of the median above it.
    pub min_separation: f64,
    /// Contention: … and at least this many seconds above it (microsecond scheduling noise of
    /// a cheap stage is not contention).
    pub min_separation_abs: f64,
    /// Contention: the upper cluster holds at least this fraction of the window.
    pub min_outlier_fraction: f64,
    /// Contention: the upper cluster's frames take at least this fraction of the stage's frame
    /// period (when it is known).
    pub min_period_share: f64,
}

impl Default for DiagnosisConfig {
    fn default() -> Self {
        DiagnosisConfig {
            window: 256,
            every: 16,
            noise_k: 3.0,
            min_rise_rel: 0.10,
            min_rise_abs: 0.001,
            outlier_devs: 6.0,
            min_separation: 0.25,
            min_separation_abs: 0.002,
            min_outlier_fraction: 0.01,
            min_period_share: 0.25,
        }
    }
}

/// One evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Diagnosis {
    /// The verdict after confirmation.
    pub pattern: Pattern,
    /// Theil–Sen slope, seconds per 1000 units of x (frames or KV rows).
    pub slope_per_1k: f64,
    /// Rise the slope predicts across the window, seconds.
    pub rise: f64,
    /// Upper cluster centre / lower cluster centre (1 without an upper cluster).
    pub bimodality: f64,
    /// Fraction of the window in the upper cluster.
    pub outlier_fraction: f64,
    /// The trend test alone says growth.
    pub growth: bool,
    /// The cluster test alone says contention.
    pub contention: bool,
}

/// A sliding-window diagnoser for one stage.
#[derive(Debug, Clone)]
pub struct Diagnoser {
    cfg: DiagnosisConfig,
    xs: VecDeque<f64>,
    ys: VecDeque<f64>,
    since: usize,
    current: Pattern,
    pending: Option<Pattern>,
    scratch: Vec<f64>,
    period: Option<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mid = v.len() / 2;
    let (_, m, _) = v.select_nth_unstable_by(mid, |a, b| a.total_cmp(b));
    *m
}

impl Diagnoser {
    /// A diagnoser with `cfg`.
    pub fn new(cfg: DiagnosisConfig) -> Self {
        Diagnoser {
            xs: VecDeque::with_capacity(cfg.window),
            ys: VecDeque::with_capacity(cfg.window),
            since: 0,
            current: Pattern::Steady,
            pending: None,
            scratch: Vec::new(),
            period: None,
            cfg,
        }
    }

    /// The stage's frame period in seconds (the time between its frames): slow frames count
    /// as contention only when they take a real share of it.
    pub fn set_period(&mut self, seconds: f64) {
        self.period = (seconds.is_finite() && seconds > 0.0).then_some(seconds);
    }

    /// The current verdict.
    pub fn pattern(&self) -> Pattern {
        self.current
    }

    /// Adds one frame (`x`: frame index or KV length; `y`: seconds). Returns an evaluation
    /// every `every` frames once the window is half full.
    pub fn push(&mut self, x: f64, y: f64) -> Option<Diagnosis> {
        if self.xs.len() == self.cfg.window {
            self.xs.pop_front();
            self.ys.pop_front();
        }
        self.xs.push_back(x);
        self.ys.push_back(y);
        self.since += 1;
        if self.since < self.cfg.every || self.xs.len() < self.cfg.window / 2 {
            return None;
        }
        self.since = 0;
        let mut d = self.evaluate();
        let candidate = if d.growth {
            Pattern::Growth
        } else if d.contention {
            Pattern::Contention
        } else {
            Pattern::Steady
        };
        if candidate == self.current {
            self.pending = None;
        } else if self.pending == Some(candidate) {
            self.current = candidate;
            self.pending = None;
        } else {
            self.pending = Some(candidate);
        }
        d.pattern = self.current;
        Some(d)
    }

    /// The statistics of the current window (no confirmation).
    pub fn evaluate(&mut self) -> Diagnosis {
        let n = self.xs.len();
        let xs: Vec<f64> = self.xs.iter().copied().collect();
        let ys: Vec<f64> = self.ys.iter().copied().collect();
        // Theil–Sen slope: median of pairwise slopes (pairs at least n/4 apart, which keeps the
        // cost down and the estimate stable).
        let gap = (n / 4).max(1);
        self.scratch.clear();
        for i in 0..n {
            for j in (i + gap)..n {
                let dx = xs[j] - xs[i];
                if dx > 0.0 {
                    self.scratch.push((ys[j] - ys[i]) / dx);
                }
            }
        }
        let slope = median(&mut self.scratch);
        let mut level: Vec<f64> = ys.iter().zip(&xs).map(|(y, x)| y - slope * x).collect();
        let intercept = median(&mut level);
        let resid: Vec<f64> = ys
            .iter()
            .zip(&xs)
            .map(|(y, x)| y - (slope * x + intercept))
            .collect();
        let mut abs: Vec<f64> = resid.iter().map(|r| r.abs()).collect();
        let dev = (1.4826 * median(&mut abs)).max(1e-9);
        let mut sorted_y = ys.clone();
        let med_y = median(&mut sorted_y);
        let (xmin, xmax) = xs
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        let rise = slope * (xmax - xmin);
        let growth = rise >= self.cfg.noise_k * dev
            && rise >= self.cfg.min_rise_rel * med_y
            && rise >= self.cfg.min_rise_abs;
        // Two clusters on the detrended times.
        let threshold = (self.cfg.outlier_devs * dev)
            .max(self.cfg.min_separation * med_y)
            .max(self.cfg.min_separation_abs);
        let upper: Vec<f64> = resid.iter().copied().filter(|&r| r > threshold).collect();
        let frac = upper.len() as f64 / n as f64;
        let centre = if upper.is_empty() {
            med_y
        } else {
            let mut up = upper.clone();
            med_y + median(&mut up)
        };
        let significant = self
            .period
            .is_none_or(|p| centre >= self.cfg.min_period_share * p);
        let contention = upper.len() >= 3 && frac >= self.cfg.min_outlier_fraction && significant;
        let bimodality = centre / med_y.max(1e-12);
        Diagnosis {
            pattern: self.current,
            slope_per_1k: slope * 1000.0,
            rise,
            bimodality,
            outlier_fraction: frac,
            growth,
            contention,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic generator (xorshift) with a normal approximation.
    struct Rng(u64);
    impl Rng {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            (0..12).map(|_| self.uniform()).sum::<f64>() - 6.0
        }
    }

    fn run(trace: &[f64]) -> (Pattern, bool, bool, Option<usize>) {
        let mut d = Diagnoser::new(DiagnosisConfig::default());
        let mut saw_growth = false;
        let mut saw_contention = false;
        let mut first_non_steady = None;
        for (i, &y) in trace.iter().enumerate() {
            if let Some(r) = d.push(i as f64, y) {
                saw_growth |= r.growth;
                saw_contention |= r.contention;
                if r.pattern != Pattern::Steady && first_non_steady.is_none() {
                    first_non_steady = Some(i);
                }
            }
        }
        (d.pattern(), saw_growth, saw_contention, first_non_steady)
    }

    fn flat(rng: &mut Rng, n: usize) -> Vec<f64> {
        (0..n).map(|_| 0.048 + 0.002 * rng.normal()).collect()
    }

    fn ramp(rng: &mut Rng, n: usize) -> Vec<f64> {
        (0..n)
            .map(|i| 0.040 + 0.080 * i as f64 / n as f64 + 0.002 * rng.normal())
            .collect()
    }

    fn contention(rng: &mut Rng, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| {
                if rng.uniform() < 0.05 {
                    0.130 + 0.005 * rng.normal()
                } else {
                    0.048 + 0.002 * rng.normal()
                }
            })
            .collect()
    }

    #[test]
    fn each_signature_gets_its_verdict() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        assert_eq!(run(&flat(&mut rng, 1500)).0, Pattern::Steady);
        assert_eq!(run(&ramp(&mut rng, 1500)).0, Pattern::Growth);
        assert_eq!(run(&contention(&mut rng, 1500)).0, Pattern::Contention);
        let mut spiky = ramp(&mut rng, 1500);
        for (i, v) in spiky.iter_mut().enumerate() {
            if i % 37 == 0 {
                *v += 0.09;
            }
        }
        let (p, _, saw_contention, _) = run(&spiky);
        assert_eq!(p, Pattern::Growth, "a ramp with spikes is growth");
        assert!(
            saw_contention,
            "... and its spikes are flagged as contention too"
        );
    }

    #[test]
    fn microsecond_noise_of_a_cheap_stage_is_not_contention() {
        let mut rng = Rng(7);
        let t: Vec<f64> = (0..1500)
            .map(|_| {
                if rng.uniform() < 0.05 {
                    150e-6
                } else {
                    40e-6 + 5e-6 * rng.normal()
                }
            })
            .collect();
        assert_eq!(run(&t).0, Pattern::Steady);
    }

    /// A 20 ms-period stage that works for 0.2 ms and is preempted for 3-5 ms now and then
    /// (seen on a 2-core machine), against an LM stage at an 80 ms period whose slow mode takes
    /// 30 ms. Only the second makes frames late.
    #[test]
    fn slow_frames_count_as_contention_only_when_they_take_a_share_of_the_period() {
        let verdict = |period: Option<f64>, base: f64, slow: f64| {
            let mut rng = Rng(11);
            let mut d = Diagnoser::new(DiagnosisConfig::default());
            if let Some(p) = period {
                d.set_period(p);
            }
            for i in 0..1500 {
                let y = if rng.uniform() < 0.03 {
                    slow + 0.001 * rng.uniform()
                } else {
                    base * (1.0 + 0.05 * rng.normal())
                };
                d.push(i as f64, y);
            }
            d.pattern()
        };
        assert_eq!(verdict(None, 200e-6, 0.003), Pattern::Contention);
        assert_eq!(verdict(Some(0.020), 200e-6, 0.003), Pattern::Steady);
        assert_eq!(verdict(Some(0.080), 0.004, 0.030), Pattern::Contention);
    }

    #[test]
    fn false_verdict_rates_over_many_random_traces() {
        let n = 200;
        let mut rng = Rng(12345);
        let mut wrong = [0usize; 4];
        let mut latency_growth = Vec::new();
        let mut latency_contention = Vec::new();
        for _ in 0..n {
            if run(&flat(&mut rng, 1500)).0 != Pattern::Steady {
                wrong[0] += 1;
            }
            if run(&ramp(&mut rng, 1500)).0 != Pattern::Growth {
                wrong[1] += 1;
            }
            if run(&contention(&mut rng, 1500)).0 != Pattern::Contention {
                wrong[2] += 1;
            }
            // Latency: 500 flat frames, then the signature starts.
            let mut t = flat(&mut rng, 500);
            t.extend(ramp(&mut rng, 1500).iter().map(|v| v + 0.008));
            if let (_, _, _, Some(i)) = run(&t) {
                latency_growth.push(i.saturating_sub(500));
            }
            let mut t = flat(&mut rng, 500);
            t.extend(contention(&mut rng, 1000));
            match run(&t) {
                (Pattern::Contention, _, _, Some(i)) => {
                    latency_contention.push(i.saturating_sub(500))
                }
                _ => wrong[3] += 1,
            }
        }
        let rate = |w: usize| 100.0 * w as f64 / n as f64;
        latency_growth.sort();
        latency_contention.sort();
        println!(
            "diagnosis over {n} random traces each: false verdicts flat {:.1}%, ramp {:.1}%, contention {:.1}% (late onset {:.1}%); frames to verdict after onset: growth median {} (max {}), contention median {} (max {})",
            rate(wrong[0]),
            rate(wrong[1]),
            rate(wrong[2]),
            rate(wrong[3]),
            latency_growth.get(latency_growth.len() / 2).copied().unwrap_or(0),
            latency_growth.last().copied().unwrap_or(0),
            latency_contention.get(latency_contention.len() / 2).copied().unwrap_or(0),
            latency_contention.last().copied().unwrap_or(0),
        );
        assert!(rate(wrong[0]) <= 2.0 && rate(wrong[1]) <= 2.0 && rate(wrong[2]) <= 2.0);
        assert!(rate(wrong[3]) <= 2.0);
    }
}
