//! Model building blocks: finding and loading ONNX Runtime, the LM's token bookkeeping and
//! sampling.
//!
//! Nothing here knows about stages; only the shared engine ([`engine`]) runs threads and
//! channels of its own, to batch many conversations' steps.

pub mod depformer;
mod draw_graph;
pub mod engine;
mod error;
pub mod lm;
pub mod lmgen;
pub mod mimi;
pub mod mimi_step;
pub mod onnx;
pub mod ortlib;
pub mod pack;
pub mod persona;
pub mod sampling;
pub mod session;
pub mod temporal;
mod tensors;
pub mod tokenizer;
pub mod vad;

pub use tensors::{buffer_allocations, Placement};

pub use error::ModelError;
