//! Per-stage live analysis fed by the runtime: utilization (the real-time factor) and the
//! latency diagnosis, exported as gauges, logged when the verdict changes, and read by whoever
//! holds the pipeline's monitor ([`Monitor::verdicts`], [`Monitor::realtime_factor`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::diagnose::{Diagnoser, DiagnosisConfig, Pattern};
use super::names;
use crate::runtime::Observer;

struct StageMon {
    name: String,
    diag: Mutex<Diagnoser>,
    /// The current 1 s utilization window: its start, the time spent in the stage, and the
    /// frames seen (for the frame period).
    busy: Mutex<(Instant, Duration, u64)>,
    utilization: AtomicU64,
    slope: metrics::Gauge,
    bimodality: metrics::Gauge,
    outliers: metrics::Gauge,
    util_gauge: metrics::Gauge,
    pattern: [metrics::Gauge; 3],
}

/// The runtime observer that keeps the diagnosis of every stage.
pub struct Monitor {
    stages: Vec<StageMon>,
    rtf: metrics::Gauge,
    /// The busiest stage's utilization, as `f64` bits.
    rtf_now: AtomicU64,
}

impl Monitor {
    /// A monitor for stages named `names` (in the pipeline's order).
    pub fn new(stage_names: &[String], cfg: DiagnosisConfig) -> Self {
        let stages = stage_names
            .iter()
            .map(|n| {
                let l = [("stage", n.clone())];
                let pattern = Pattern::ALL.map(|p| {
                    metrics::gauge!(names::LATENCY_PATTERN, "stage" => n.clone(), "pattern" => p.name())
                });
                pattern[0].set(1.0);
                StageMon {
                    name: n.clone(),
                    diag: Mutex::new(Diagnoser::new(cfg)),
                    busy: Mutex::new((Instant::now(), Duration::ZERO, 0)),
                    utilization: AtomicU64::new(0f64.to_bits()),
                    slope: metrics::gauge!(names::LATENCY_TREND, &l),
                    bimodality: metrics::gauge!(names::LATENCY_BIMODALITY, &l),
                    outliers: metrics::gauge!(names::LATENCY_OUTLIERS, &l),
                    util_gauge: metrics::gauge!(names::STAGE_UTILIZATION, &l),
                    pattern,
                }
            })
            .collect();
        Monitor {
            stages,
            rtf: metrics::gauge!(names::REALTIME_FACTOR),
            rtf_now: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// The real-time factor: the busiest stage's utilization over the last second.
    pub fn realtime_factor(&self) -> f64 {
        f64::from_bits(self.rtf_now.load(Ordering::Relaxed))
    }

    /// Every stage's current verdict, in the pipeline's order.
    pub fn verdicts(&self) -> Vec<(String, Pattern)> {
        self.stages
            .iter()
            .map(|s| {
                let p = s
                    .diag
                    .lock()
                    .map(|d| d.pattern())
                    .unwrap_or(Pattern::Steady);
                (s.name.clone(), p)
            })
            .collect()
    }

    /// The current verdict of stage `i`.
    pub fn pattern(&self, i: usize) -> Option<Pattern> {
        self.stages
            .get(i)
            .and_then(|s| s.diag.lock().ok().map(|d| d.pattern()))
    }
}

impl Observer for Monitor {
    fn service(&self, stage: usize, frame: u64, took: Duration) {
        let Some(s) = self.stages.get(stage) else {
            return;
        };
        // Utilization over 1 s windows; the real-time factor is the busiest stage's.
        let mut period = None;
        if let Ok(mut b) = s.busy.lock() {
            b.1 += took;
            b.2 += 1;
            let wall = b.0.elapsed();
            if wall >= Duration::from_secs(1) {
                let u = b.1.as_secs_f64() / wall.as_secs_f64();
                period = Some(wall.as_secs_f64() / b.2 as f64);
                *b = (Instant::now(), Duration::ZERO, 0);
                s.utilization.store(u.to_bits(), Ordering::Relaxed);
                s.util_gauge.set(u);
                let max = self
                    .stages
                    .iter()
                    .map(|x| f64::from_bits(x.utilization.load(Ordering::Relaxed)))
                    .fold(0.0, f64::max);
                self.rtf.set(max);
                self.rtf_now.store(max.to_bits(), Ordering::Relaxed);
            }
        }
        let Ok(mut d) = s.diag.lock() else { return };
        if let Some(p) = period {
            d.set_period(p);
        }
        let before = d.pattern();
        if let Some(r) = d.push(frame as f64, took.as_secs_f64()) {
            s.slope.set(r.slope_per_1k);
            s.bimodality.set(r.bimodality);
            s.outliers.set(r.outlier_fraction);
            if r.pattern != before {
                for (g, p) in s.pattern.iter().zip(Pattern::ALL) {
                    g.set(if p == r.pattern { 1.0 } else { 0.0 });
                }
                tracing::warn!(
                    stage = %s.name,
                    from = %before,
                    to = %r.pattern,
                    slope_ms_per_1k_frames = format!("{:.2}", r.slope_per_1k * 1e3),
                    bimodality = format!("{:.2}", r.bimodality),
                    outliers = format!("{:.3}", r.outlier_fraction),
                    "latency pattern changed"
                );
            }
        }
    }
}
