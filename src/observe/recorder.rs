//! The runtime's measurements as Prometheus series: an [`Observer`] that records service times,
//! frames, completion intervals, queue waits, depths and drops under their metric names.
//!
//! The handles are resolved once, when the pipeline starts, so recording a frame is a few
//! atomic operations. Series are labelled by stage and edge name only: pipelines with the same
//! stage names (the sessions of one template) add up into the same series, so the number of
//! series does not grow with the number of pipelines.

use std::sync::OnceLock;
use std::time::Duration;

use super::names;
use crate::runtime::Observer;

struct StageSeries {
    name: String,
    service: metrics::Histogram,
    frames: metrics::Counter,
    /// Only sinks complete frames: registered at the first one, so other stages have no series.
    completion: OnceLock<metrics::Histogram>,
}

struct EdgeSeries {
    wait: metrics::Histogram,
    depth: metrics::Gauge,
    dropped: metrics::Counter,
}

/// Records one pipeline's measurements (attach a new one to each pipeline).
#[derive(Default)]
pub struct Recorder {
    stages: OnceLock<Vec<StageSeries>>,
    edges: OnceLock<Vec<EdgeSeries>>,
}

impl Recorder {
    /// A recorder whose series are resolved when its pipeline starts.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Observer for Recorder {
    fn started(&self, stages: &[String], edges: &[String]) {
        let _ = self.stages.set(
            stages
                .iter()
                .map(|n| {
                    let l = [("stage", n.clone())];
                    StageSeries {
                        name: n.clone(),
                        service: metrics::histogram!(names::STAGE_SERVICE, &l),
                        frames: metrics::counter!(names::STAGE_FRAMES, &l),
                        completion: OnceLock::new(),
                    }
                })
                .collect(),
        );
        let _ = self.edges.set(
            edges
                .iter()
                .map(|n| {
                    let l = [("edge", n.clone())];
                    EdgeSeries {
                        wait: metrics::histogram!(names::EDGE_WAIT, &l),
                        depth: metrics::gauge!(names::EDGE_DEPTH, &l),
                        dropped: metrics::counter!(names::EDGE_DROPPED, &l),
                    }
                })
                .collect(),
        );
    }

    fn service(&self, stage: usize, _frame: u64, took: Duration) {
        if let Some(s) = self.stages.get().and_then(|v| v.get(stage)) {
            s.service.record(took.as_secs_f64());
        }
    }

    fn frames(&self, stage: usize, n: u64) {
        if let Some(s) = self.stages.get().and_then(|v| v.get(stage)) {
            s.frames.increment(n);
        }
    }

    fn completion(&self, stage: usize, interval: Duration) {
        if let Some(s) = self.stages.get().and_then(|v| v.get(stage)) {
            s.completion
                .get_or_init(
                    || metrics::histogram!(names::COMPLETION_INTERVAL, "stage" => s.name.clone()),
                )
                .record(interval.as_secs_f64());
        }
    }

    fn edge_wait(&self, edge: usize, wait: Duration) {
        if let Some(e) = self.edges.get().and_then(|v| v.get(edge)) {
            e.wait.record(wait.as_secs_f64());
        }
    }

    fn edge_depth(&self, edge: usize, depth: usize) {
        if let Some(e) = self.edges.get().and_then(|v| v.get(edge)) {
            e.depth.set(depth as f64);
        }
    }

    fn edge_dropped(&self, edge: usize) {
        if let Some(e) = self.edges.get().and_then(|v| v.get(edge)) {
            e.dropped.increment(1);
        }
    }
}
