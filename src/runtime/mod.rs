//! The actor runtime: typed stages on their own threads, joined by bounded edges.
//!
//! This layer owns threads, channels, overflow policies, the feedback edge, supervision,
//! shutdown, and per-stage and per-edge timing. It knows no stage kind, no audio, no model and
//! no YAML: stages arrive already built, with their ports declared as [`PortSpec`]s, and links
//! arrive as [`Link`]s. Before start, what stages know of their frames ([`Caps`]) is negotiated
//! along the links, so that a mismatch is refused with the link named. What it measures goes to
//! the pipeline's [`Observer`]s (a metrics recorder, a monitor): it imports no metric name.
//!
//! ```
//! use std::time::Instant;
//! use duplex::runtime::*;
//!
//! #[derive(Clone)]
//! struct Num(u64);
//! impl FrameData for Num { const NAME: &'static str = "Num"; }
//!
//! struct Count(u64);
//! impl Source for Count {
//!     fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
//!         if self.0 == 3 { return Ok(Flow::Done); }
//!         self.0 += 1;
//!         cx.emit(0, Instant::now(), Num(self.0))?;
//!         Ok(Flow::Continue)
//!     }
//! }
//! struct Sum(std::sync::Arc<std::sync::atomic::AtomicU64>);
//! impl Stage for Sum {
//!     fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
//!         let f = input.take::<Num>()?;
//!         self.0.fetch_add(f.data.0, std::sync::atomic::Ordering::SeqCst);
//!         Ok(())
//!     }
//! }
//! let total = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
//! let report = PipelineBuilder::new()
//!     .source("count", "count", vec![PortSpec::new::<Num>("out")], Count(0))
//!     .stage("sum", "sum", vec![PortSpec::new::<Num>("in")], vec![], Sum(total.clone()))
//!     .link(Link::new("count", "sum"))
//!     .build()
//!     .unwrap()
//!     .run()
//!     .unwrap();
//! assert_eq!(total.load(std::sync::atomic::Ordering::SeqCst), 6);
//! assert_eq!(report.stage("sum").unwrap().frames, 3);
//! ```

mod caps;
mod control;
mod edge;
mod frame;
mod graph;
mod pipeline;
mod stage;
mod stats;

pub use caps::{Caps, CapsError, CapsMismatch};
pub use control::{
    Command, CommandSpec, ControlError, ControlPlane, Endpoint, Pending, Reply, StatusSpec, Value,
};
pub use edge::Overflow;
pub use frame::{Frame, FrameData, FrameMeta, FrameType, Payload, PortSpec};
pub use graph::{
    split_port, Body, GraphError, GraphErrorKind, Link, Node, PipelineBuilder, RunOptions,
};
pub use pipeline::{Handle, Pipeline, RunError, RunOutcome, Running, StageCause, StopHandle};
pub use stage::{Context, Flow, Input, Source, Stage, StageError, StageResult};
pub use stats::{EdgeReport, LatencyHistogram, RunReport, StageReport};

/// Receives what the runtime measures, as it measures it: a metrics recorder, a monitor. The
/// runtime itself records nothing anywhere else and knows no metric names.
///
/// Called on the actor threads, in the middle of moving frames: keep each call short (no heavy
/// work, no lock held for long; hand analysis to a thread of your own).
pub trait Observer: Send + Sync {
    /// The pipeline starts: the names of its stages and edges, indexed as in the later calls
    /// (stages in declaration order, edges in link order, named `from.port -> to.port`).
    fn started(&self, _stages: &[String], _edges: &[String]) {}
    /// Stage `stage` spent `took` on its `frame`-th frame (time blocked on outputs or feedback
    /// excluded).
    fn service(&self, _stage: usize, _frame: u64, _took: std::time::Duration) {}
    /// Stage `stage` handled (or, for a source, produced) `n` more frames.
    fn frames(&self, _stage: usize, _n: u64) {}
    /// Sink `stage` completed a frame `interval` after the previous one.
    fn completion(&self, _stage: usize, _interval: std::time::Duration) {}
    /// A frame waited `wait` in edge `edge`'s queue.
    fn edge_wait(&self, _edge: usize, _wait: std::time::Duration) {}
    /// Edge `edge` holds `depth` frames.
    fn edge_depth(&self, _edge: usize, _depth: usize) {}
    /// Edge `edge`'s overflow policy dropped a frame.
    fn edge_dropped(&self, _edge: usize) {}
}

/// The observers of one pipeline, called in turn.
#[derive(Clone, Default)]
pub(crate) struct Observers(std::sync::Arc<[std::sync::Arc<dyn Observer>]>);

impl Observers {
    pub(crate) fn new(list: Vec<std::sync::Arc<dyn Observer>>) -> Self {
        Observers(list.into())
    }

    pub(crate) fn each(&self, f: impl Fn(&dyn Observer)) {
        for o in self.0.iter() {
            f(o.as_ref());
        }
    }
}
