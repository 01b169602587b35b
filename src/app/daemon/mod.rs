//! `duplex daemon`: the live full-duplex pipeline for one person at their desk, unattended.
//!
//! The configuration and every check made on it live in `config.rs` (layered:
//! built-in defaults, the user's file, `DUPLEX__…` variables). This module runs it: it builds
//! the pipeline (`--check` builds it and stops there), reports readiness once the models are
//! loaded and warmed up (`READY=1` to systemd when `NOTIFY_SOCKET` is set, with watchdog pings),
//! answers a control socket, stops gracefully on SIGINT/SIGTERM and reloads on SIGHUP. Where
//! the pipeline stands (running, replaced, stopping) is one state machine (`state.rs`): the
//! stop hook only moves it and drains what runs; the main loop acts on it (a stop while a
//! pipeline is being built, on a thread of its own, ends the wait for it: nothing is left to
//! drain). The recording switch (`ctl record`) lives in `record.rs`, SIGHUP's checks in
//! `reload.rs`. A reload is checked whole before anything changes; persona and sampling then
//! apply at the next frame boundary; a new input or output device moves only the stage that
//! owns it (models and conversation untouched); a new pack, pipeline, voice, tokenizer,
//! long-session policy or seed builds a new pipeline beside the running one, which it then
//! replaces. A configuration that
//! fails a check, or that the new pipeline refuses, is rejected and the pipeline keeps running;
//! one that cannot be built for want of what the running one holds is built alone, and when
//! that fails too the last configuration that ran is built again.

mod config;
mod live;
mod record;
mod reload;
mod state;

pub use config::{
    check_all, check_static, config_path, control_socket, load_config, DaemonConfig, Sampling,
    DEFAULTS_YAML,
};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::{ConfigError, ConfigErrorKind};
use crate::observe::monitor::Monitor;
use crate::runtime::Pipeline;

use super::control::{applied, Command, Handler, STAGE_ANSWER};
use live::Live;
use record::RecordState;
use reload::{finish_reload, reload};
use state::{After, Lifecycle};

/// `duplex daemon --check`: every check start-up makes, start-up included short of running:
/// the configuration and everything [`check_static`] checks, then the pipeline is built
/// (models loaded, persona, voice and tokenizer read, devices opened) and dropped.
///
/// # Errors
///
/// A [`ConfigError`] (in the chain) naming the daemon's file or variable and key.
pub fn check(explicit: Option<&Path>) -> anyhow::Result<DaemonConfig> {
    let c = check_all(explicit, None)?;
    let built = build_pipeline(&c, &crate::app::process_resources(1))?;
    // Built to be checked, not run: its recording's folder is not kept.
    if let Some(r) = &built.recording {
        r.discard();
    }
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
        if shared.life.stopping() {
            return;
        }
        let live = shared.live();
        let frames = live.as_ref().and_then(Live::frames);
        let expected = shared.ready()
            && live.as_ref().is_some_and(Live::devices_running)
            && !shared.paused.load(Ordering::Acquire);
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

/// A pipeline built (models loaded, devices open) and not started yet, with what it was built
/// from.
struct Built {
    pipeline: Pipeline,
    monitor: Arc<Monitor>,
    config: DaemonConfig,
    recording: Option<Arc<crate::observe::record::Recording>>,
    /// Why echo cancellation is on or off.
    echo: String,
}

struct Shared {
    started: Instant,
    /// What the process builds once: a reload that keeps the pack reuses it, and an engine
    /// whose last pipeline is gone is freed.
    resources: crate::resources::Resources,
    /// The configuration in force: the running pipeline's, after every accepted reload.
    config: Mutex<DaemonConfig>,
    /// The last configuration whose pipeline was built and ran: what a reload that cannot be
    /// built goes back to (never one that was rejected).
    last_good: Mutex<DaemonConfig>,
    /// The pipeline running now, the one waiting to replace it, the stops asked for: the state
    /// the main loop, reloads and the signal hook move.
    life: Lifecycle,
    /// One reload at a time.
    reloading: Mutex<()>,
    /// Reloads finished so far, and how the last one ended (for `status`).
    reloads: Mutex<(u64, String)>,
    /// The user's switches: they outlive a pipeline, and each new one is given them.
    muted: AtomicBool,
    paused: AtomicBool,
    /// Whether the user wants conversations recorded, and whether a recorded one is starting.
    /// `ctl record on|off` and the start of every pipeline take this lock, so that an `off`
    /// is never lost between a recording's build and its start.
    record: Mutex<RecordState>,
    /// The control socket, once this process has bound it (a reload's check does not take it
    /// for another daemon's).
    socket: Mutex<Option<PathBuf>>,
}

impl Shared {
    fn new(c: &DaemonConfig) -> Self {
        Shared {
            started: Instant::now(),
            config: Mutex::new(c.clone()),
            last_good: Mutex::new(c.clone()),
            life: Lifecycle::default(),
            reloading: Mutex::new(()),
            reloads: Mutex::new((0, String::new())),
            muted: AtomicBool::new(false),
            paused: AtomicBool::new(false),
            record: Mutex::new(RecordState {
                wanted: c.record,
                starting: false,
            }),
            socket: Mutex::new(None),
            resources: crate::app::process_resources(1),
        }
    }

    /// Builds `c` on a thread of its own, waiting for it unless a stop comes first (`None`):
    /// loading a large pack can take longer than systemd waits for a stop.
    fn build_unless_stopped(self: &Arc<Self>, c: DaemonConfig) -> Option<anyhow::Result<Built>> {
        use std::sync::mpsc::RecvTimeoutError;
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("duplex:build".into())
            .spawn(move || {
                let _ = tx.send(shared.build(&c));
            });
        if let Err(e) = spawned {
            return Some(Err(anyhow::anyhow!("building the pipeline: {e}")));
        }
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(built) => return Some(built),
                Err(RecvTimeoutError::Timeout) if self.life.stopping() => return None,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Some(Err(anyhow::anyhow!(
                        "building the pipeline: its thread ended with no pipeline"
                    )))
                }
            }
        }
    }

    /// The next pipeline when none was built beside the last one: the configuration in force,
    /// or (a reload's that does not build on its own either) the last one that ran. `None`:
    /// a stop came meanwhile.
    fn build_next(self: &Arc<Self>, first: bool) -> anyhow::Result<Option<Built>> {
        // Not under the lock: loading a large pack takes a while, and `status` and SIGHUP
        // read the configuration meanwhile.
        let c = lock(&self.config).ok_or_else(|| anyhow::anyhow!("configuration lock poisoned"))?;
        let Some(built) = self.build_unless_stopped(c) else {
            return Ok(None);
        };
        match built {
            Ok(b) => {
                if !first {
                    finish_reload(self, Ok("new pipeline built alone".into()));
                }
                Ok(Some(b))
            }
            // The first start: the configuration was checked, but it does not build.
            Err(e) if first => Err(e),
            Err(e) => {
                let Some(old) = lock(&self.last_good) else {
                    return Err(e);
                };
                finish_reload(
                    self,
                    Err(format!(
                        "the new pipeline could not be built on its own either: {e:#}; going back to the last configuration that ran"
                    )),
                );
                if let Ok(mut g) = self.config.lock() {
                    *g = old.clone();
                }
                self.build_unless_stopped(old).transpose()
            }
        }
    }

    /// Starts `built` and makes it the running pipeline, with the user's switches.
    fn start(&self, built: Built) -> anyhow::Result<(crate::runtime::Running, Live)> {
        if let Ok(mut g) = self.last_good.lock() {
            *g = built.config.clone();
        }
        // Started and made current under the recording's lock: an `off` that came while it
        // was built cancels its recording here, and one that comes now finds it running.
        let record = self
            .record
            .lock()
            .map_err(|_| anyhow::anyhow!("recording state lock poisoned"))?;
        let mut recording = built.recording;
        // (Only a recording the daemon asked for: a pipeline file may record on its own.)
        if built.config.record && !record.wanted {
            if let Some(r) = recording.take() {
                r.discard();
                tracing::info!("the recording was cancelled before its pipeline started");
            }
        }
        let running = built.pipeline.start();
        let live = Live {
            handle: running.handle(),
            monitor: built.monitor,
            recording,
            echo: built.echo,
        };
        // The user's switches carry over to the new pipeline.
        for (flag, command) in [(&self.muted, "mute"), (&self.paused, "pause")] {
            if flag.load(Ordering::Acquire) {
                if let Err(e) = live.send(command, "") {
                    tracing::warn!("{command}: {e}");
                }
            }
        }
        let stopping = self.life.started(live.clone());
        drop(record);
        if stopping {
            live.handle.stop();
        }
        Ok((running, live))
    }

    fn live(&self) -> Option<Live> {
        self.life.live()
    }

    /// What [`Shared::record`] says now.
    fn record_state(&self) -> RecordState {
        self.record.lock().map(|r| *r).unwrap_or_default()
    }

    /// Builds the pipeline `c` stands for, recorded or not as the user wants now.
    fn build(&self, c: &DaemonConfig) -> anyhow::Result<Built> {
        let mut c = c.clone();
        c.record = self.record_state().wanted;
        build_pipeline(&c, &self.resources)
    }

    /// Models loaded and warmed up: a pipeline runs and every stage has started.
    fn ready(&self) -> bool {
        self.live().is_some_and(|l| l.handle.is_ready())
    }

    /// `ctl status`: the daemon's figures, then the running pipeline's.
    fn status(&self) -> serde_json::Value {
        let c = lock(&self.config);
        let mut s = serde_json::json!({
            "ready": self.ready(),
            "uptime_s": (self.started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            "config": c.as_ref().map(|c| c.file.clone()),
            "pack": c.as_ref().map(|c| c.pack.clone()),
            "persona": c.as_ref().map(|c| if c.persona_tokens.is_empty() {
                serde_json::json!(c.persona)
            } else {
                serde_json::json!(c.persona_tokens)
            }),
            "reloads": self.reloads.lock().ok().map(|r| serde_json::json!({ "done": r.0, "last": r.1 })),
            "muted": self.muted.load(Ordering::Acquire),
            "paused": self.paused.load(Ordering::Acquire),
            "recording": self.recording().map(|r| r.dir().display().to_string()),
            "record_starting": self.record_state().starting,
        });
        let pipeline = self
            .live()
            .map(|l| l.status())
            .unwrap_or_else(|| serde_json::json!({ "devices": { "input": {}, "output": {} } }));
        if let (Some(m), serde_json::Value::Object(p)) = (s.as_object_mut(), pipeline) {
            m.extend(p);
        }
        for (dir, configured) in [
            ("input", c.as_ref().map(|c| c.input_device.clone())),
            ("output", c.as_ref().map(|c| c.output_device.clone())),
        ] {
            s["devices"][dir]["configured"] = configured.into();
        }
        s
    }

    /// Carries out a command of the control socket on the running pipeline.
    fn command(self: &Arc<Self>, c: Command) -> serde_json::Value {
        let ask = |command: &str, arg: &str, pending: &str| match self.live() {
            Some(live) => match live.send(command, arg) {
                Ok(p) => applied(p.wait(STAGE_ANSWER), pending),
                Err(e) => serde_json::json!({ "ok": false, "error": e }),
            },
            None => serde_json::json!({
                "ok": false,
                "error": "no pipeline is running now (it is being built): try again in a moment",
            }),
        };
        match c {
            Command::Status => {
                let mut s = self.status();
                s["ok"] = true.into();
                s
            }
            Command::Reset => ask("reset", "", "the conversation restarts at the next frame"),
            Command::Persona(p) => ask("persona", &p, "the persona changes at the next frame"),
            Command::Mute(on) => self.switch(&self.muted, on, "mute", "unmute"),
            Command::Pause(on) => self.switch(&self.paused, on, "pause", "resume"),
            Command::Record(on) => self.record(on),
        }
    }

    /// The recording of the running pipeline, while it records.
    fn recording(&self) -> Option<Arc<crate::observe::record::Recording>> {
        self.live()
            .and_then(|l| l.recording)
            .filter(|r| !r.stopped())
    }

    /// Sets one of the user's switches, and tells the running pipeline.
    fn switch(&self, flag: &AtomicBool, on: bool, yes: &str, no: &str) -> serde_json::Value {
        flag.store(on, Ordering::Release);
        let command = if on { yes } else { no };
        if let Some(live) = self.live() {
            if let Err(e) = live.send(command, "") {
                return serde_json::json!({ "ok": false, "error": e });
            }
        }
        serde_json::json!({ "ok": true, "done": command })
    }
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
    let shared = Arc::new(Shared::new(&c));
    super::serve_metrics_at(c.metrics_address, Some(health(&shared)), "metrics_address");
    let _signals = install_signals(&shared, explicit);
    // After the signal hooks: a stop that comes as soon as the socket is there is handled.
    let command_shared = shared.clone();
    let handler: Handler = Arc::new(move |c| command_shared.command(c));
    let control =
        super::control::ControlServer::start(&c.control_socket, handler).map_err(|e| {
            c.error(
                "control_socket",
                ConfigErrorKind::Conflict,
                format!("{e:#}"),
            )
        })?;
    if let Ok(mut s) = shared.socket.lock() {
        *s = Some(c.control_socket.clone());
    }
    if let Some(file) = c.prime_cache_file.as_ref().filter(|f| f.exists()) {
        let spec = c.pipeline_spec_with(&c.echo_decision())?;
        super::load_primed_states(&shared.resources, file, &spec)
            .map_err(|e| c.error("prime_cache_file", ConfigErrorKind::Read, e.to_string()))?;
    }
    let result = supervise(&shared);
    drop(control);
    // The states primed meanwhile, for the next start (`prime_cache_file`), once a pipeline ran.
    let file = lock(&shared.config).and_then(|c| c.prime_cache_file.clone());
    if let Some(file) = file.filter(|_| shared.life.starts() > 0) {
        super::save_primed_states(&shared.resources, &file);
    }
    result
}

/// `/healthz`: ready, devices running, keeping up with real time.
fn health(shared: &Arc<Shared>) -> crate::observe::exporter::Health {
    let shared = shared.clone();
    Arc::new(move || {
        let live = shared.live();
        let ready = shared.ready();
        let devices = live.as_ref().is_some_and(Live::devices_running);
        let rtf = live.as_ref().map_or(0.0, |l| l.monitor.realtime_factor());
        let ok = ready && devices && rtf < 1.0;
        (
            ok,
            serde_json::json!({ "ok": ok, "ready": ready, "devices_alive": devices, "realtime_factor": rtf, "status": shared.status() }),
        )
    })
}

/// SIGINT/SIGTERM stop (drain, then abort at the second); SIGHUP reloads. The hooks only tell
/// the daemon's state: the main loop does the rest (a stop while a pipeline is being built
/// ends the build's wait, not the process from the hook).
fn install_signals(shared: &Arc<Shared>, explicit: Option<&Path>) -> super::SignalGuard {
    let stop_shared = shared.clone();
    let reload_shared = shared.clone();
    let explicit = explicit.map(Path::to_path_buf);
    super::SignalGuard::install_hooks(
        move |count| {
            let live = stop_shared.life.stop(count);
            if count == 1 {
                sd_notify("STOPPING=1");
            }
            match live {
                Some(l) if count == 1 => {
                    tracing::warn!("stop requested: draining the pipeline (signal again to abort)");
                    l.handle.stop();
                }
                Some(l) => l.handle.abort(),
                // Still loading models: nothing to drain, and loading a large pack can take
                // longer than systemd waits for a stop. The main loop stops waiting for it.
                None => tracing::warn!("stop requested while the pipeline is being built: exiting"),
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
    )
}

/// The daemon's main loop: build, start, wait; again after a reload, until a stop.
fn supervise(shared: &Arc<Shared>) -> anyhow::Result<()> {
    let mut first = true;
    let mut prepared: Option<Built> = None;
    loop {
        let built = match prepared.take() {
            Some(b) => b,
            None => match shared.build_next(first)? {
                Some(b) => b,
                None => return Ok(()),
            },
        };
        let (running, live) = shared.start(built)?;
        spawn_ready(shared, live, first);
        first = false;
        let outcome = running.wait();
        let failed = |e| Err(anyhow::Error::new(e).context("daemon pipeline"));
        // Stopped for a reload: a pipeline built beside this one, or (when it could not be)
        // the new configuration to build alone.
        match shared.life.ended() {
            After::Stop | After::Ended => return outcome.error.map_or(Ok(()), failed),
            After::Replace(b) => prepared = Some(*b),
            After::BuildAlone => {}
        }
        tracing::info!("restarting the pipeline with the new configuration");
    }
}

/// Readiness, off the main loop: models loaded (build) and warmed up (every stage's start, the
/// LM's priming included, has returned). The first pipeline tells systemd, and feeds its
/// watchdog from then on.
fn spawn_ready(shared: &Arc<Shared>, live: Live, first: bool) {
    let t0 = Instant::now();
    let shared = shared.clone();
    let _ = std::thread::Builder::new()
        .name("duplex:ready".into())
        .spawn(move || {
            while !live.handle.is_ready() {
                if t0.elapsed() > Duration::from_secs(120) {
                    tracing::error!("the model did not warm up within 120 s");
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            tracing::info!(after_ms = t0.elapsed().as_millis() as u64, "ready");
            if first {
                sd_notify("READY=1");
                if let Some(every) = watchdog_interval() {
                    watchdog(&shared, every);
                }
            }
        });
}

/// Builds (models loaded, devices open) the pipeline `c` stands for, without starting it.
fn build_pipeline(
    c: &DaemonConfig,
    resources: &crate::resources::Resources,
) -> anyhow::Result<Built> {
    let echo = c.echo_decision();
    let spec = c.pipeline_spec_with(&echo)?;
    let echo = if spec.stages.iter().any(|s| s.name == config::AEC_STAGE) {
        tracing::info!(
            "echo cancellation {}: {}",
            if echo.0 { "on" } else { "off" },
            echo.1
        );
        echo.1
    } else {
        format!("the pipeline file has no `{}` stage", config::AEC_STAGE)
    };
    // The pipeline's `record:` section: every (re)built pipeline records into a folder of its own.
    // Its `record.dir` is the daemon's `record_dir`, which the error names.
    let recording = super::record(&spec).map_err(|e| match c.record {
        true => c.error(
            "record_dir",
            e.kind,
            format!(
                "recordings go under {}: {}",
                c.record_dir.display(),
                e.message
            ),
        ),
        // The pipeline file's own `record:` section.
        false => e,
    })?;
    let built = (|| {
        let builder = super::build_session(
            &spec,
            &crate::stages::Registry::builtin(),
            None,
            recording.as_deref(),
            resources,
        )?;
        let (builder, monitor) = super::observe(builder, &spec.metrics);
        let builder = match &recording {
            Some(r) => {
                monitor.record_changes(r.stream("verdicts"));
                builder.observer(r.clone())
            }
            None => builder,
        };
        anyhow::Ok((builder.build()?, monitor))
    })();
    match built {
        Ok((pipeline, monitor)) => Ok(Built {
            pipeline,
            monitor,
            config: c.clone(),
            recording,
            echo,
        }),
        Err(e) => {
            // Nothing ran: no recording is left behind.
            if let Some(r) = recording {
                r.discard();
            }
            Err(e)
        }
    }
}

/// Whether a pipeline that failed to build might build on its own (its stages lacked memory
/// or a device, not a correct configuration).
fn may_build_alone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<ConfigError>()
            .is_some_and(|c| matches!(c.kind, ConfigErrorKind::Unavailable | ConfigErrorKind::Busy))
    })
}
