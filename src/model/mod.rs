//! Model building blocks: finding and loading ONNX Runtime, the LM's token bookkeeping and
//! sampling.
//!
//! Nothing here knows about stages, threads or channels.

mod error;
pub mod lmgen;
pub mod ortlib;
pub mod pack;
pub mod sampling;
pub mod session;
mod tensors;
pub mod temporal;

pub use error::ModelError;
