//! Per-stage live analysis of one pipeline, fed by the runtime: utilization (the real-time
//! factor) and the latency diagnosis, exported as gauges, logged when the verdict changes, and
//! read by whoever holds the pipeline's monitor ([`Monitor::verdicts`],
//! [`Monitor::realtime_factor`]). A [private](Monitor::private) monitor exports nothing: its
//! holder publishes what many pipelines show together.
//!
//! The actor threads only count: each service time goes into a bounded queue, and a thread of
//! the monitor's own runs the diagnosis (Theil–Sen over the window, the cluster test), so a
//! stage never waits for it. When that thread falls behind, samples are dropped and counted
//! rather than queued without bound; the thread ends with the monitor.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use super::diagnose::{Diagnoser, DiagnosisConfig, Pattern};
use super::names;
use super::record::RecordStream;
use crate::runtime::Observer;

/// What the actor threads update.
struct StageMon {
    name: String,
    /// The current 1 s utilization window: its start, the time spent in the stage, and the
    /// frames seen (for the frame period).
    busy: Mutex<(Instant, Duration, u64)>,
    utilization: AtomicU64,
    util_gauge: metrics::Gauge,
    /// The current verdict (an index into `Pattern::ALL`), set by the diagnosis thread.
    pattern: AtomicU8,
}

/// One service time, for the diagnosis thread.
struct Sample {
    stage: usize,
    frame: u64,
    took: f64,
    /// The stage's frame period, when a utilization window just closed.
    period: Option<f64>,
}

/// What the diagnosis thread keeps per stage.
struct Diagnosis {
    diag: Diagnoser,
    slope: metrics::Gauge,
    bimodality: metrics::Gauge,
    outliers: metrics::Gauge,
    pattern: [metrics::Gauge; 3],
}

/// Samples that may wait for the diagnosis thread.
const QUEUE: usize = 4096;

/// The runtime observer that keeps the diagnosis of every stage of one pipeline.
pub struct Monitor {
    stages: Arc<Vec<StageMon>>,
    rtf: metrics::Gauge,
    /// The busiest stage's utilization, as `f64` bits.
    rtf_now: AtomicU64,
    samples: Sender<Sample>,
    /// Samples the diagnosis thread could not take in time.
    skipped: AtomicU64,
    /// Where verdict changes are also written (a recording's `verdicts` stream).
    changes: Arc<Mutex<Option<RecordStream>>>,
}

impl Monitor {
    /// A monitor for stages named `names` (in the pipeline's order), with its diagnosis thread,
    /// that exports its gauges.
    pub fn new(stage_names: &[String], cfg: DiagnosisConfig) -> Self {
        Self::build(stage_names, cfg, true)
    }

    /// A monitor that exports nothing: for one of many pipelines of a process (a server's
    /// sessions), whose holder publishes what they have together (gauges of each would
    /// overwrite the others').
    pub fn private(stage_names: &[String], cfg: DiagnosisConfig) -> Self {
        Self::build(stage_names, cfg, false)
    }

    fn build(stage_names: &[String], cfg: DiagnosisConfig, publish: bool) -> Self {
        let gauge = |g: metrics::Gauge| if publish { g } else { metrics::Gauge::noop() };
        let stages: Arc<Vec<StageMon>> = Arc::new(
            stage_names
                .iter()
                .map(|n| StageMon {
                    name: n.clone(),
                    busy: Mutex::new((Instant::now(), Duration::ZERO, 0)),
                    utilization: AtomicU64::new(0f64.to_bits()),
                    util_gauge: gauge(
                        metrics::gauge!(names::STAGE_UTILIZATION, "stage" => n.clone()),
                    ),
                    pattern: AtomicU8::new(0),
                })
                .collect(),
        );
        let diagnoses: Vec<Diagnosis> = stage_names
            .iter()
            .map(|n| {
                let l = [("stage", n.clone())];
                let pattern = Pattern::ALL.map(|p| {
                    gauge(metrics::gauge!(names::LATENCY_PATTERN, "stage" => n.clone(), "pattern" => p.name()))
                });
                pattern[0].set(1.0);
                Diagnosis {
                    diag: Diagnoser::new(cfg),
                    slope: gauge(metrics::gauge!(names::LATENCY_TREND, &l)),
                    bimodality: gauge(metrics::gauge!(names::LATENCY_BIMODALITY, &l)),
                    outliers: gauge(metrics::gauge!(names::LATENCY_OUTLIERS, &l)),
                    pattern,
                }
            })
            .collect();
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let shared = stages.clone();
        let changes: Arc<Mutex<Option<RecordStream>>> = Arc::new(Mutex::new(None));
        let sink = changes.clone();
        let spawned = std::thread::Builder::new()
            .name("duplex:diagnosis".into())
            .spawn(move || diagnose(rx, diagnoses, &shared, &sink));
        if let Err(e) = spawned {
            tracing::error!("latency diagnosis not running: {e}");
        }
        Monitor {
            stages,
            rtf: gauge(metrics::gauge!(names::REALTIME_FACTOR)),
            rtf_now: AtomicU64::new(0f64.to_bits()),
            samples: tx,
            skipped: AtomicU64::new(0),
            changes,
        }
    }

    /// Also writes every verdict change to `stream` (a recording's), with its wall-clock time.
    pub fn record_changes(&self, stream: RecordStream) {
        if let Ok(mut c) = self.changes.lock() {
            *c = Some(stream);
        }
    }

    /// The current verdict of stage `i`.
    pub fn pattern(&self, i: usize) -> Option<Pattern> {
        self.stages
            .get(i)
            .map(|s| Pattern::ALL[s.pattern.load(Ordering::Relaxed) as usize % 3])
    }

    /// The real-time factor: the busiest stage's utilization over the last second.
    pub fn realtime_factor(&self) -> f64 {
        f64::from_bits(self.rtf_now.load(Ordering::Relaxed))
    }

    /// Every stage's utilization over the last second, in the pipeline's order.
    pub fn utilizations(&self) -> Vec<(String, f64)> {
        self.stages
            .iter()
            .map(|s| {
                (
                    s.name.clone(),
                    f64::from_bits(s.utilization.load(Ordering::Relaxed)),
                )
            })
            .collect()
    }

    /// Every stage's current verdict, in the pipeline's order.
    pub fn verdicts(&self) -> Vec<(String, Pattern)> {
        (0..self.stages.len())
            .filter_map(|i| Some((self.stages[i].name.clone(), self.pattern(i)?)))
            .collect()
    }

    /// Service times the diagnosis thread had no room for (it fell behind).
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }
}

/// The diagnosis thread: takes samples until the monitor is dropped.
fn diagnose(
    rx: Receiver<Sample>,
    mut diagnoses: Vec<Diagnosis>,
    stages: &[StageMon],
    changes: &Mutex<Option<RecordStream>>,
) {
    for s in rx.iter() {
        let (Some(d), Some(mon)) = (diagnoses.get_mut(s.stage), stages.get(s.stage)) else {
            continue;
        };
        if let Some(p) = s.period {
            d.diag.set_period(p);
        }
        let before = d.diag.pattern();
        let Some(r) = d.diag.push(s.frame as f64, s.took) else {
            continue;
        };
        d.slope.set(r.slope_per_1k);
        d.bimodality.set(r.bimodality);
        d.outliers.set(r.outlier_fraction);
        let now = d.diag.pattern();
        let index = Pattern::ALL.iter().position(|p| *p == now).unwrap_or(0);
        mon.pattern.store(index as u8, Ordering::Relaxed);
        if now != before {
            for (g, p) in d.pattern.iter().zip(Pattern::ALL) {
                g.set(if p == now { 1.0 } else { 0.0 });
            }
            tracing::warn!(
                stage = %mon.name,
                from = %before,
                to = %now,
                slope_ms_per_1k_frames = format!("{:.2}", r.slope_per_1k * 1e3),
                bimodality = format!("{:.2}", r.bimodality),
                outliers = format!("{:.3}", r.outlier_fraction),
                "latency pattern changed"
            );
            if let Some(c) = changes.lock().ok().as_ref().and_then(|c| c.as_ref()) {
                c.write(&serde_json::json!({
                    "t": super::record::now_us(),
                    "stage": mon.name,
                    "frame": s.frame,
                    "from": before.name(),
                    "to": now.name(),
                    "slope_ms_per_1k_frames": r.slope_per_1k * 1e3,
                    "bimodality": r.bimodality,
                    "outliers": r.outlier_fraction,
                }));
            }
        }
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
        let sample = Sample {
            stage,
            frame,
            took: took.as_secs_f64(),
            period,
        };
        if let Err(TrySendError::Full(_)) = self.samples.try_send(sample) {
            self.skipped.fetch_add(1, Ordering::Relaxed);
        }
    }
}
