//! Suites that keep real time or wait on other processes: live audio on a private sound server,
//! the daemon, the server with its independent clients, the browser, Prometheus. They run
//! beside each other but never beside the CPU-bound suites of `compute`.

mod aec;
mod audio_live;
mod audio_pipelines;
mod audio_virtual;
mod browser;
mod cli_bad_input;
mod control_plane;
mod daemon;
mod daemon_faults;
mod eval_served;
mod hostile_local;
mod hostile_serve;
mod loadtest;
mod observe_prometheus;
mod ort_selection;
mod record;
mod sampling_controls;
mod serve;
mod serve_access;
mod serve_faults;
mod serve_providers;
mod serve_realtime;
mod serve_replicas;
mod serve_resources;
mod serve_sip;
mod serve_webrtc;
mod webrtc_loss;
