//! Observability: metric names and buckets, the Prometheus exporter, and the online latency
//! diagnosis that tells contention from growth.
//!
//! This module owns what the metrics are called and how they are read; it knows nothing of what
//! a stage computes. The runtime's measurements reach it through observers ([`recorder`] for
//! the series, [`monitor`] for the diagnosis); stages record their own series through the
//! `metrics` facade with these names. Recording is a no-op until [`exporter::install`] runs.
//! [`record`] writes a run's per-frame timings to files (and reads them back); [`compare`] sets
//! a recording beside its headless replay and says whether a slowdown was the environment's or
//! the code's.

pub mod compare;
pub mod diagnose;
pub mod engine;
pub mod exporter;
pub mod monitor;
pub mod names;
pub mod record;
pub mod recorder;
