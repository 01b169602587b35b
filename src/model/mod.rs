//! Model building blocks: finding and loading ONNX Runtime, the LM's token bookkeeping and
//! sampling.
//!
//! Nothing here knows about stages, threads or channels.

pub mod lmgen;
pub mod ortlib;
pub mod sampling;
