//! The actor runtime: typed stages on their own threads, joined by bounded edges.
//!
//! This layer owns threads, channels, overflow policies, the feedback edge, supervision,
//! shutdown, and per-stage and per-edge timing. It knows no stage kind, no audio, no model and
//! no YAML: stages arrive already built, with their ports declared as [`PortSpec`]s, and links
//! arrive as [`Link`]s. Before start, what stages know of their frames ([`Caps`]) is negotiated
//! along the links, so that a mismatch is refused with the link named.
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

pub use caps::Caps;
pub use control::{
    Command, CommandSpec, ControlError, ControlPlane, Endpoint, Pending, Reply, StatusSpec, Value,
};
pub use edge::Overflow;
pub use frame::{Frame, FrameData, FrameMeta, FrameType, Payload, PortSpec};
pub use graph::{
    split_port, Body, GraphError, GraphErrorKind, Link, Node, PipelineBuilder, RunOptions,
};
pub use pipeline::{Handle, Pipeline, RunError, RunOutcome, Running, StopHandle};
pub use stage::{Context, Flow, Input, Source, Stage, StageError, StageResult};
pub use stats::{EdgeReport, LatencyHistogram, RunReport, StageReport};

/// Receives every stage's service time as it is measured (a monitor, a diagnosis).
///
/// Called on the stage's own thread after each `process` (or `produce` that emitted): keep it
/// short.
pub trait Observer: Send + Sync {
    /// Stage `stage` (declaration order) spent `took` on its `frame`-th frame.
    fn service(&self, stage: usize, frame: u64, took: std::time::Duration);
}
