//! Observability: metric names and buckets, the Prometheus exporter, and the online latency
//! diagnosis that tells contention from growth.
//!
//! This module owns what the metrics are called and how they are read; it knows nothing of what
//! a stage computes. The runtime's measurements reach it through observers ([`recorder`] for
//! the series, [`monitor`] for the diagnosis); stages record their own series through the
//! `metrics` facade with these names. Recording is a no-op until [`exporter::install`] runs.

pub mod diagnose;
pub mod exporter;
pub mod monitor;
pub mod names;
pub mod record;
pub mod recorder;
