//! Observability: metric names and units shared by every layer.
//!
//! This module owns what the metrics are called; it knows nothing of what a stage computes.
//! Every layer records through the `metrics` facade with these names, which are no-ops until an
//! exporter is installed.

pub mod diagnose;
pub mod names;
