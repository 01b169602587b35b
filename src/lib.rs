//! duplex: real-time, full-duplex speech-to-speech pipelines as typed actor stages.
//!
//! The crate is layered; each layer knows nothing of the one above it:
//!
//! - [`runtime`]: actors on OS threads, bounded edges with overflow policies, the feedback edge,
//!   supervision, shutdown and timing. Knows no audio, no model, no YAML.
//! - [`audio`]: building blocks for sound: WAV files, resampling, framing, test signals.
//! - [`model`]: building blocks for models: finding and loading ONNX Runtime.
//! - [`config`]: YAML pipeline files → a validated, typed pipeline description.
//! - [`stages`]: one file per stage kind, adapting a building block to the runtime's `Stage`.
//! - [`observe`]: metric names and buckets, the exporter, the latency diagnosis.
//! - [`resources`]: what a process builds once and its pipelines share (packs, tokenizers,
//!   voice codes, engines).
//! - [`session`]: the bounded link between a network client and the pipeline serving it.
//! - [`eval`]: the field's full-duplex metrics (Full-Duplex-Bench's), from timestamps.
//! - [`files`]: opening the files a user names: regular files only, bounded reads.
//! - [`yaml`]: reading the YAML a user wrote (pipelines, settings, packs' manifests) at a
//!   bounded cost, as values that remember their origin.
//! - [`app`]: what the `duplex` binary does (build a pipeline from a file, run it, report).
//!
//! Run a pipeline file from Rust:
//!
//! ```no_run
//! let report = duplex::app::run_file("pipelines/resample-roundtrip.yaml".as_ref(), &[])?;
//! println!("{}", duplex::app::timing_table(&report));
//! # Ok::<(), anyhow::Error>(())
//! ```
#![warn(missing_docs)]

pub mod app;
pub mod audio;
pub mod config;
pub mod eval;
pub mod files;
pub mod model;
pub mod observe;
pub mod resources;
pub mod runtime;
pub mod session;
pub mod stages;
pub mod yaml;
