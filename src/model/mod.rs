//! Model building blocks: finding and loading ONNX Runtime.
//!
//! Nothing here knows about stages, threads or channels. Later: model packs, sessions, KV
//! caches, the LM step bookkeeping, sampling, Mimi streaming and priming.

pub mod ortlib;
