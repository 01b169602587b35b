//! The integration tests, one binary (`cargo test --release --test it`): a module per suite,
//! grouped by how they use the machine, so that `make test` can run the groups apart.
//!
//! - `compute::*`: CPU-bound suites that wait on no real time.
//! - `realtime::*`: suites that keep real time (sound server, daemon, server, browser).
//!
//! Tests share this process: none changes its environment or working directory or installs the
//! global metrics recorder here (a test that needs its own process reruns itself alone:
//! `support::rerun_alone`).
//!
//! One suite: `cargo test --release --test it -- compute::engine::`. The bad-input suite
//! (`tests/fuzz_inputs.rs`) is a binary of its own: it measures each case's allocations with a
//! global allocator and works in a scratch directory of its own.

mod compute;
mod realtime;
mod support;
