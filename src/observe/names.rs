//! Metric names. Base units: seconds, totals.

/// Histogram, label `stage`: time inside a stage's `process`, without time blocked on outputs.
pub const STAGE_SERVICE: &str = "duplex_stage_service_seconds";
/// Counter, label `stage`: frames processed (or produced, for sources).
pub const STAGE_FRAMES: &str = "duplex_stage_frames_total";
/// Histogram, label `edge`: time a frame waited in an edge's queue.
pub const EDGE_WAIT: &str = "duplex_edge_wait_seconds";
/// Gauge, label `edge`: frames queued in an edge.
pub const EDGE_DEPTH: &str = "duplex_edge_depth";
/// Counter, label `edge`: frames dropped by an edge's overflow policy.
pub const EDGE_DROPPED: &str = "duplex_edge_dropped_total";
/// Histogram, label `stage` (sinks only): interval between completed frames.
pub const COMPLETION_INTERVAL: &str = "duplex_completion_interval_seconds";
/// Gauge = 1, labels `graph`, `execution_provider`, `dtype`: the provider a graph really runs on.
pub const MODEL_INFO: &str = "duplex_model_info";
/// Counter, label `stage`: conversations reset (or stopped) by the long-session policy.
pub const LM_RESETS: &str = "duplex_lm_long_session_total";
/// Gauge, label `stage`: rows in the temporal KV cache (the current attention context).
pub const LM_CONTEXT: &str = "duplex_lm_context_frames";
