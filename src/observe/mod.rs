//! Observability: metric names and buckets, the Prometheus exporter, and the online latency
//! diagnosis that tells contention from growth.
//!
//! This module owns what the metrics are called and how they are read; it knows nothing of what
//! a stage computes. Every layer records through the `metrics` facade with these names, which
//! are no-ops until [`exporter::install`] runs.

pub mod diagnose;
pub mod exporter;
pub mod monitor;
pub mod names;
