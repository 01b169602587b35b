//! The shared engines' reports (the LM's and the codec's), as metrics and a latency diagnosis:
//! the [`EngineObserver`] of every engine a process opens.
//!
//! The engine's thread only hands each event over (a bounded queue, never blocking: an event
//! that does not fit is dropped and counted); a thread of this module's records the series and
//! runs the diagnosis of the temporal tick (its time against the longest context in the batch,
//! one window per batch size: a batch that grows is not a conversation that grows), so the
//! engine's tick pays for neither. A shared codec's ticks are diagnosed the same way under its
//! own `stage` label (`codec_encoder`, `codec_decoder`: its time against the frames its rows
//! have coded, which a codec of fixed context must not grow with). Knows nothing of the engine's internals beyond the events.
//!
//! Also what any graph really runs on ([`model_info`]), as the model layer reports it when a
//! session is ready.

use std::collections::HashMap;
use std::sync::Arc;

use crossbeam_channel::{bounded, Sender, TrySendError};

use super::diagnose::{Diagnoser, DiagnosisConfig, Pattern};
use super::names;
use crate::model::engine::{EngineEvent, EngineObserver, ENGINE_STAGE};

/// Exports `duplex_model_info{graph, execution_provider, dtype} = 1`: the
/// [`ReadyHook`](crate::model::session::ReadyHook) the stages hand to the sessions they open.
pub fn model_info(graph: &str, provider: crate::model::session::Provider, dtype: &str) {
    metrics::gauge!(
        names::MODEL_INFO,
        "graph" => graph.to_string(),
        "execution_provider" => provider.name(),
        "dtype" => dtype.to_string()
    )
    .set(1.0);
}

/// Events that may wait for the recording thread.
const QUEUE: usize = 4096;

/// Records an engine's events as metrics, off the engine's thread.
pub struct EngineMetrics {
    tx: Sender<EngineEvent>,
    dropped: metrics::Counter,
}

impl std::fmt::Debug for EngineMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EngineMetrics")
    }
}

impl EngineMetrics {
    /// An observer with its recording thread (which ends when the observer is dropped).
    pub fn start() -> Arc<dyn EngineObserver> {
        let (tx, rx) = bounded::<EngineEvent>(QUEUE);
        let spawned = std::thread::Builder::new()
            .name("duplex:engine-metrics".into())
            .spawn(move || {
                let mut diagnosers: HashMap<(&'static str, usize), Diagnoser> = HashMap::new();
                for ev in rx {
                    record(ev, &mut diagnosers);
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("no thread for the engine's metrics ({e}): they are not recorded");
        }
        Arc::new(EngineMetrics {
            tx,
            dropped: metrics::counter!(names::ENGINE_EVENTS_DROPPED),
        })
    }
}

impl EngineObserver for EngineMetrics {
    fn event(&self, ev: EngineEvent) {
        if let Err(TrySendError::Full(_)) = self.tx.try_send(ev) {
            self.dropped.increment(1);
        }
    }
}

/// Feeds one tick to the diagnosis of `stage` at its batch size, and sets the verdict's gauges
/// when it has one.
fn diagnose(
    diagnosers: &mut HashMap<(&'static str, usize), Diagnoser>,
    stage: &'static str,
    batch: usize,
    context: usize,
    seconds: f64,
) {
    let d = diagnosers.entry((stage, batch)).or_insert_with(|| {
        let mut d = Diagnoser::new(DiagnosisConfig::default());
        d.set_period(0.08);
        d
    });
    if let Some(r) = d.push(context as f64, seconds) {
        for p in Pattern::ALL {
            metrics::gauge!(names::LATENCY_PATTERN, "stage" => stage, "pattern" => p.name())
                .set(if p == r.pattern { 1.0 } else { 0.0 });
        }
        metrics::gauge!(names::LATENCY_TREND, "stage" => stage).set(r.slope_per_1k);
        metrics::gauge!(names::LATENCY_BIMODALITY, "stage" => stage).set(r.bimodality);
    }
}

fn record(ev: EngineEvent, diagnosers: &mut HashMap<(&'static str, usize), Diagnoser>) {
    match ev {
        EngineEvent::Opened => metrics::gauge!(names::ENGINES_OPEN).increment(1.0),
        EngineEvent::Closed => metrics::gauge!(names::ENGINES_OPEN).decrement(1.0),
        EngineEvent::Failed => metrics::counter!(names::ENGINE_FAILURES).increment(1),
        EngineEvent::Slots { slots, used } => {
            metrics::gauge!(names::ENGINE_SLOTS).set(slots as f64);
            metrics::gauge!(names::ENGINE_SLOTS_USED).set(used as f64);
        }
        EngineEvent::Late(n) => metrics::counter!(names::ENGINE_LATE).increment(n as u64),
        EngineEvent::DepformerTick { batch, seconds } => {
            metrics::histogram!(names::ENGINE_BATCH, "engine" => "depformer").record(batch as f64);
            metrics::histogram!(names::ENGINE_TICK, "engine" => "depformer").record(seconds);
        }
        EngineEvent::TemporalTick {
            batch,
            context,
            seconds,
        } => {
            metrics::histogram!(names::ENGINE_BATCH, "engine" => "temporal").record(batch as f64);
            let bucket = context / 375 * 375;
            metrics::histogram!(
                names::ENGINE_TICK,
                "engine" => "temporal",
                "context" => format!("{}-{}", bucket, bucket + 374)
            )
            .record(seconds);
            diagnose(diagnosers, ENGINE_STAGE, batch, context, seconds);
        }
        EngineEvent::CodecOpen { engine, open } => {
            let g = metrics::gauge!(names::CODECS_OPEN, "engine" => engine);
            if open {
                g.increment(1.0);
                // Its late frames from zero, so a rate has a series before the first one.
                metrics::counter!(names::CODEC_LATE, "engine" => engine).increment(0);
            } else {
                g.decrement(1.0)
            }
        }
        EngineEvent::CodecSlots {
            engine,
            slots,
            used,
        } => {
            metrics::gauge!(names::CODEC_SLOTS, "engine" => engine).set(slots as f64);
            metrics::gauge!(names::CODEC_SLOTS_USED, "engine" => engine).set(used as f64);
        }
        EngineEvent::CodecLate { engine, n } => {
            metrics::counter!(names::CODEC_LATE, "engine" => engine).increment(n as u64)
        }
        EngineEvent::CodecTick {
            engine,
            batch,
            context,
            seconds,
        } => {
            metrics::histogram!(names::ENGINE_BATCH, "engine" => engine).record(batch as f64);
            metrics::histogram!(names::ENGINE_TICK, "engine" => engine).record(seconds);
            diagnose(diagnosers, engine, batch, context, seconds);
        }
    }
}
