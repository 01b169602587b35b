//! Suites that wait on no real time: the runtime, configuration, model, engine, codec, export,
//! quantization and documentation suites. CPU-bound, so they run as many at once as there are
//! cores, apart from the suites that keep real time.

mod audio_no_alloc;
mod cli_doctor;
mod config_validation;
mod docs;
mod engine;
mod error_kinds;
mod eval;
mod export;
mod gpu_check;
mod metrics_recorded;
mod mimi_step;
mod model_conformance;
mod model_contract;
mod model_pipeline;
mod model_placement;
mod model_temporal;
mod model_tokenizer;
mod quantize;
mod runtime_edges;
mod runtime_shutdown;
