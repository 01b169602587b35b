//! `duplex daemon`: the live full-duplex pipeline for one person at their desk, unattended.
//!
//! The configuration and every check made on it live in `config.rs` (layered:
//! built-in defaults, the user's file, `DUPLEX__…` variables). This module runs it: it builds
//! the pipeline (`--check` builds it and stops there), reports readiness once the models are
//! loaded and warmed up (`READY=1` to systemd when `NOTIFY_SOCKET` is set, with watchdog pings),
//! answers a control socket, stops gracefully on SIGINT/SIGTERM and reloads on SIGHUP. A reload
//! is checked whole before anything changes; persona and sampling then apply at the next frame
//! boundary; a new input or output device moves only the stage that owns it (models and
//! conversation untouched); a new pack, pipeline, voice, tokenizer, long-session policy or seed
//! builds a new pipeline beside the running one, which it then replaces. A configuration that
//! fails a check, or that the new pipeline refuses, is rejected and the pipeline keeps running;
//! one that cannot be built for want of what the running one holds is built alone, and when
//! that fails too the last configuration that ran is built again.

mod config;

pub use config::{
    check_all, check_static, config_path, control_socket, load_config, DaemonConfig, Sampling,
    DEFAULTS_YAML,
};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::{ConfigError, ConfigErrorKind};
use crate::runtime::{Pipeline, StopHandle};

/// `duplex daemon --check`: every check start-up makes, start-up included short of running:
/// the configuration and everything [`check_static`] checks, then the pipeline is built
/// (models loaded, persona, voice and tokenizer read, devices opened) and dropped.
///
/// # Errors
///
/// A [`ConfigError`] (in the chain) naming the daemon's file or variable and key.
pub fn check(explicit: Option<&Path>) -> anyhow::Result<DaemonConfig> {
    let c = check_all(explicit, None)?;
    drop(build_pipeline(&c)?);
    Ok(c)
}

/// Sends a systemd notification when `NOTIFY_SOCKET` is set (no-op otherwise).
pub fn sd_notify(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(sock) = std::os::unix::net::UnixDatagram::unbound() else {
        return;
    };
    let p = path.to_string_lossy();
    let r = if let Some(abs) = p.strip_prefix('@') {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(abs.as_bytes())
            .and_then(|a| sock.send_to_addr(msg.as_bytes(), &a))
    } else {
        sock.send_to(msg.as_bytes(), &*p)
    };
    if let Err(e) = r {
        tracing::debug!("sd_notify: {e}");
    }
}

/// No device stage reports its device as anything but running (one that has not reported yet
/// is not down).
fn devices_running(board: &serde_json::Value) -> bool {
    ["mic.device", "speaker.device"]
        .iter()
        .all(|k| board[*k].as_str().is_none_or(|s| s == "running"))
}

/// Half the watchdog timeout systemd set for this process (`WATCHDOG_USEC`, `WATCHDOG_PID`),
/// when it set one.
fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// Feeds the systemd watchdog every `every` while the daemon does its job: frames come out of
/// the LM, or none are expected (not ready yet or being rebuilt, paused, a device away and
/// being reopened). A pipeline that is stuck stops feeding it, and systemd restarts the
/// service (`Restart=on-failure`).
fn watchdog(shared: &Shared, every: Duration) {
    let mut last = None;
    let mut stalled_since: Option<Instant> = None;
    loop {
        std::thread::sleep(every);
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let board = crate::control::snapshot();
        let frames = board["temporal.agent_frames"].as_u64();
        let devices_up = devices_running(&board);
        let expected = shared.ready.load(Ordering::Acquire)
            && devices_up
            && !crate::control::is_set("temporal.pause");
        if !expected || frames != last {
            sd_notify("WATCHDOG=1");
            if let Some(t) = stalled_since.take() {
                tracing::info!(
                    after_s = format!("{:.1}", t.elapsed().as_secs_f64()),
                    "frames again: feeding the watchdog"
                );
            }
        } else if stalled_since.is_none() {
            stalled_since = Some(Instant::now());
            tracing::warn!(
                "no new frame from the LM for {:.1} s: not feeding the watchdog until frames come again",
                every.as_secs_f64()
            );
        }
        last = frames;
    }
}

struct Shared {
    started: Instant,
    ready: AtomicBool,
    /// The configuration in force: the running pipeline's, after every accepted reload.
    config: Mutex<DaemonConfig>,
    /// The last configuration whose pipeline was built and ran: what a reload that cannot be
    /// built goes back to (never one that was rejected).
    last_good: Mutex<DaemonConfig>,
    /// Stops the pipeline running now.
    current: Mutex<Option<StopHandle>>,
    /// A pipeline built for a new configuration beside the running one, waiting to start.
    next: Mutex<Option<(Pipeline, DaemonConfig)>>,
    /// A reload's pipeline could not be built beside the running one (not enough memory for
    /// two): build it alone once the running one has stopped.
    alone: AtomicBool,
    /// One reload at a time.
    reloading: Mutex<()>,
    /// Reloads finished so far, and how the last one ended (for `status`).
    reloads: Mutex<(u64, String)>,
    /// The daemon is stopping for good.
    shutdown: AtomicBool,
    /// The control socket, once this process has bound it.
    socket: Mutex<Option<PathBuf>>,
}

fn lock<T: Clone>(m: &Mutex<T>) -> Option<T> {
    m.lock().ok().map(|g| g.clone())
}

/// Runs the daemon until stopped.
///
/// # Errors
///
/// Configuration errors (exit 2) and pipeline failures (exit 1).
pub fn run(explicit: Option<&Path>) -> anyhow::Result<()> {
    let c = check_all(explicit, None)?;
    tracing::info!(config = %c.file, pipeline = %c.pipeline.display(), "starting");
    let shared = Arc::new(Shared {
        started: Instant::now(),
        ready: AtomicBool::new(false),
        config: Mutex::new(c.clone()),
        last_good: Mutex::new(c.clone()),
        current: Mutex::new(None),
        next: Mutex::new(None),
        alone: AtomicBool::new(false),
        reloading: Mutex::new(()),
        reloads: Mutex::new((0, String::new())),
        shutdown: AtomicBool::new(false),
        socket: Mutex::new(None),
    });
    let health_shared = shared.clone();
    let health: crate::observe::exporter::Health = Arc::new(move || {
        let ready = health_shared.ready.load(Ordering::Acquire);
        let board = crate::control::snapshot();
        let devices = devices_running(&board);
        let rtf = board["realtime_factor"].as_f64().unwrap_or(0.0);
        let ok = ready && devices && rtf < 1.0;
        (
            ok,
            serde_json::json!({ "ok": ok, "ready": ready, "devices_alive": devices, "realtime_factor": rtf, "status": board }),
        )
    });
    super::serve_metrics_at(c.metrics_address, Some(health), "metrics_address");
    let stop_shared = shared.clone();
    let reload_shared = shared.clone();
    let explicit = explicit.map(Path::to_path_buf);
    let _signals = super::SignalGuard::install_hooks(
        move |count| {
            stop_shared.shutdown.store(true, Ordering::Release);
            if count == 1 {
                sd_notify("STOPPING=1");
            }
            if let Ok(g) = stop_shared.current.lock() {
                match g.as_ref() {
                    Some(h) if count == 1 => {
                        tracing::warn!(
                            "stop requested: draining the pipeline (signal again to abort)"
                        );
                        h.stop();
                    }
                    Some(h) => h.abort(),
                    None => {
                        // Still loading models: nothing to drain, and loading a large pack can
                        // take longer than systemd waits for a stop.
                        tracing::warn!("stop requested while the pipeline is being built: exiting");
                        if let Some(path) = stop_shared.socket.lock().ok().and_then(|p| p.clone()) {
                            let _ = std::fs::remove_file(path);
                        }
                        std::process::exit(0);
                    }
                }
            }
        },
        move || {
            // Off the signal thread: checking a configuration reads files and lists devices.
            let (sh, ex) = (reload_shared.clone(), explicit.clone());
            let spawned = std::thread::Builder::new()
                .name("duplex:reload".into())
                .spawn(move || reload(&sh, ex));
            if let Err(e) = spawned {
                tracing::error!("reload rejected: {e}");
            }
        },
    );
    // After the signal hooks: a stop that comes as soon as the socket is there is handled.
    let control =
        super::control::ControlServer::start(&c.control_socket, shared_status(shared.clone()))?;
    if let Ok(mut s) = shared.socket.lock() {
        *s = Some(c.control_socket.clone());
    }
    let mut notified = false;
    let mut prepared: Option<(Pipeline, DaemonConfig)> = None;
    let result = loop {
        let (pipeline, built_from) = match prepared.take() {
            Some(p) => p,
            None => {
                // Not under the lock: loading a large pack takes a while, and `status` and
                // SIGHUP read the configuration meanwhile.
                let Some(c) = lock(&shared.config) else {
                    break Err(anyhow::anyhow!("configuration lock poisoned"));
                };
                match build_pipeline(&c) {
                    Ok(p) => {
                        if notified {
                            finish_reload(&shared, Ok("new pipeline built alone".into()));
                        }
                        (p, c)
                    }
                    // The first start: the configuration was checked, but it does not build.
                    Err(e) if !notified => return Err(e),
                    Err(e) => {
                        let Some(old) = lock(&shared.last_good) else {
                            break Err(e);
                        };
                        finish_reload(
                            &shared,
                            Err(format!(
                                "the new pipeline could not be built on its own either: {e:#}; going back to the last configuration that ran"
                            )),
                        );
                        if let Ok(mut g) = shared.config.lock() {
                            *g = old.clone();
                        }
                        (build_pipeline(&old)?, old)
                    }
                }
            }
        };
        if let Ok(mut g) = shared.last_good.lock() {
            *g = built_from;
        }
        crate::control::clear_requests();
        crate::control::publish("temporal.ready", false);
        let running = pipeline.start();
        if let Ok(mut g) = shared.current.lock() {
            *g = Some(running.stop_handle());
        }
        if shared.shutdown.load(Ordering::Acquire) {
            running.stop_handle().stop();
        }
        // Readiness: models loaded (build) and warmed up (the LM reports it after priming).
        let t0 = Instant::now();
        let ready_shared = shared.clone();
        let first = !notified;
        notified = true;
        let _ = std::thread::Builder::new()
            .name("duplex:ready".into())
            .spawn(move || {
                while !crate::control::snapshot()["temporal.ready"]
                    .as_bool()
                    .unwrap_or(false)
                {
                    if t0.elapsed() > Duration::from_secs(120) {
                        tracing::error!("the model did not warm up within 120 s");
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                ready_shared.ready.store(true, Ordering::Release);
                tracing::info!(after_ms = t0.elapsed().as_millis() as u64, "ready");
                if first {
                    sd_notify("READY=1");
                    if let Some(every) = watchdog_interval() {
                        watchdog(&ready_shared, every);
                    }
                }
            });
        let outcome = running.wait();
        if let Ok(mut g) = shared.current.lock() {
            *g = None;
        }
        shared.ready.store(false, Ordering::Release);
        if shared.shutdown.load(Ordering::Acquire) {
            break outcome.error.map_or(Ok(()), |e| {
                Err(anyhow::Error::new(e).context("daemon pipeline"))
            });
        }
        // Stopped for a reload: a pipeline built beside this one, or (when it could not be)
        // the new configuration to build alone.
        prepared = shared.next.lock().ok().and_then(|mut n| n.take());
        let alone = shared.alone.swap(false, Ordering::AcqRel);
        if prepared.is_some() || alone {
            tracing::info!("restarting the pipeline with the new configuration");
            continue;
        }
        break match outcome.error {
            Some(e) => Err(anyhow::Error::new(e).context("daemon pipeline")),
            None => Ok(()),
        };
    };
    drop(control);
    result
}

/// Builds (models loaded, devices open) the pipeline `c` stands for, without starting it.
fn build_pipeline(c: &DaemonConfig) -> anyhow::Result<Pipeline> {
    let spec = c.pipeline_spec()?;
    let builder = super::build_spec(&spec, &crate::stages::Registry::builtin())?;
    let builder = super::observe(builder, &spec.metrics);
    Ok(builder.build()?)
}

/// Whether a pipeline that failed to build might build on its own (its stages lacked memory
/// or a device, not a correct configuration).
fn may_build_alone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<ConfigError>()
            .is_some_and(|c| c.kind == ConfigErrorKind::Unavailable)
    })
}

/// What `duplex ctl status` answers: the headline figures, then everything the stages publish
/// (`board`).
fn shared_status(shared: Arc<Shared>) -> super::control::Status {
    Arc::new(move || {
        let c = shared.config.lock().map(|c| c.clone()).ok();
        let board = crate::control::snapshot();
        let prefixed = |prefix: &str| -> serde_json::Map<String, serde_json::Value> {
            board
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(k, v)| Some((k.strip_prefix(prefix)?.to_string(), v.clone())))
                .collect()
        };
        let device = |stage: &str, configured: Option<&String>| {
            serde_json::json!({
                "configured": configured,
                "name": board[format!("{stage}.name")],
                "state": board[format!("{stage}.device")],
            })
        };
        serde_json::json!({
            "ready": shared.ready.load(Ordering::Acquire),
            "uptime_s": (shared.started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            "config": c.as_ref().map(|c| c.file.clone()),
            "pack": c.as_ref().map(|c| c.pack.clone()),
            "persona": c.as_ref().map(|c| if c.persona_tokens.is_empty() {
                serde_json::json!(c.persona)
            } else {
                serde_json::json!(c.persona_tokens)
            }),
            "reloads": shared.reloads.lock().ok().map(|r| serde_json::json!({ "done": r.0, "last": r.1 })),
            "frames": board["temporal.agent_frames"],
            "context": board["temporal.context"],
            "realtime_factor": board["realtime_factor"],
            "muted": crate::control::is_set("mic.mute"),
            "paused": crate::control::is_set("temporal.pause"),
            "devices": {
                "input": device("mic", c.as_ref().map(|c| &c.input_device)),
                "output": device("speaker", c.as_ref().map(|c| &c.output_device)),
            },
            "execution_providers": prefixed("model."),
            "verdicts": prefixed("pattern."),
            "board": board,
        })
    })
}

/// Ends a reload: logs how, and counts it for `status`.
fn finish_reload(shared: &Shared, outcome: Result<String, String>) {
    let last = match &outcome {
        Ok(done) => {
            tracing::info!("reload applied: {done}");
            format!("applied: {done}")
        }
        Err(why) => {
            tracing::error!("reload rejected, keeping the running configuration: {why}");
            format!("rejected: {why}")
        }
    };
    if let Ok(mut r) = shared.reloads.lock() {
        r.0 += 1;
        r.1 = last;
    }
}

/// A new pack or pipeline: builds the new pipeline beside the running one (models loaded,
/// devices open), then stops the running one and hands the new one over. A configuration the
/// new pipeline refuses is rejected with the running one untouched. Only when the new pipeline
/// lacked something the running one holds (memory for two packs, an exclusive device) is the
/// running one stopped and the new one built alone; when that fails too, the last
/// configuration that ran is built again.
///
/// Runs on the reload thread, under the reload lock: a SIGHUP during a rebuild waits for it.
fn rebuild(shared: &Arc<Shared>, new: DaemonConfig) {
    tracing::warn!(
        "reload: pack or pipeline changed: building the new pipeline beside the running one"
    );
    let t0 = Instant::now();
    match build_pipeline(&new) {
        Ok(p) if !shared.shutdown.load(Ordering::Acquire) => {
            tracing::info!(
                after_ms = t0.elapsed().as_millis() as u64,
                "new pipeline built; replacing the running one"
            );
            if let Ok(mut n) = shared.next.lock() {
                *n = Some((p, new.clone()));
            }
            if let Ok(mut c) = shared.config.lock() {
                *c = new;
            }
            stop_current(shared);
            finish_reload(
                shared,
                Ok("new pipeline built beside the running one".into()),
            );
        }
        Ok(_) => {}
        Err(e) if may_build_alone(&e) => {
            tracing::warn!(
                "the new pipeline could not be built beside the running one ({e:#}); stopping the running one and building the new one alone"
            );
            if let Ok(mut c) = shared.config.lock() {
                *c = new;
            }
            shared.alone.store(true, Ordering::Release);
            // The main loop ends this reload, once it has built (or failed to build) alone.
            stop_current(shared);
        }
        Err(e) => finish_reload(shared, Err(format!("{e:#}"))),
    }
}

fn stop_current(shared: &Shared) {
    if let Ok(g) = shared.current.lock() {
        if let Some(h) = g.as_ref() {
            h.stop();
        }
    }
}

/// SIGHUP: read the configuration again and check it whole before touching anything; apply
/// persona and sampling at the next frame boundary, move a device stage, or rebuild; reject an
/// invalid configuration and keep running.
fn reload(shared: &Arc<Shared>, explicit: Option<PathBuf>) {
    let Ok(_one) = shared.reloading.lock() else {
        return;
    };
    let own = shared.socket.lock().ok().and_then(|s| s.clone());
    let mut new = match check_all(explicit.as_deref(), own.as_deref()) {
        Ok(c) => c,
        Err(e) => return finish_reload(shared, Err(format!("{e:#}"))),
    };
    let Some(cur) = lock(&shared.config) else {
        return;
    };
    if new.metrics_address != cur.metrics_address || new.control_socket != cur.control_socket {
        tracing::warn!(
            "reload: `metrics_address` and `control_socket` are bound at start-up; the new values apply after a restart"
        );
        new.metrics_address = cur.metrics_address;
        new.control_socket = cur.control_socket.clone();
    }
    // What the models are built with (the voice and the tokenizer are read when the LM stage
    // is built, the seed starts its random stream): a rebuild, built beside the running one.
    if new.pack != cur.pack
        || new.pipeline != cur.pipeline
        || new.voice != cur.voice
        || new.tokenizer != cur.tokenizer
        || new.long_session != cur.long_session
        || new.sampling.seed != cur.sampling.seed
    {
        rebuild(shared, new);
        return;
    }
    let mut changed = Vec::new();
    if new.persona != cur.persona || new.persona_tokens != cur.persona_tokens {
        let p = if new.persona_tokens.is_empty() {
            new.persona.clone()
        } else {
            new.persona_tokens
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        crate::control::post("temporal.persona", p);
        tracing::info!("reload: persona changes at the next frame");
        changed.push("persona");
    }
    if new.sampling != cur.sampling {
        let s = &new.sampling;
        crate::control::post(
            "depformer.sampling",
            format!(
                "{} {} {} {}",
                s.text_temperature, s.text_top_k, s.audio_temperature, s.audio_top_k
            ),
        );
        tracing::info!("reload: sampling changes at the next frame");
        changed.push("sampling");
    }
    // A new device: only the stage that owns it moves, at its next frame; the models and the
    // conversation are untouched.
    for (what, key, old, spec) in [
        ("input", "mic.switch", &cur.input_device, &new.input_device),
        (
            "output",
            "speaker.switch",
            &cur.output_device,
            &new.output_device,
        ),
    ] {
        if old != spec {
            tracing::info!("reload: {what} device {old:?} -> {spec:?} at the next frame");
            crate::control::post(key, spec.clone());
            changed.push(what);
        }
    }
    // Checked whole, and applied to the running pipeline: this is now what runs.
    if let Ok(mut g) = shared.last_good.lock() {
        *g = new.clone();
    }
    if let Ok(mut g) = shared.config.lock() {
        *g = new;
    }
    finish_reload(
        shared,
        Ok(if changed.is_empty() {
            "nothing to change".into()
        } else {
            format!("{} at the next frame", changed.join(", "))
        }),
    );
}
