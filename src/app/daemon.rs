//! `duplex daemon`: the live full-duplex pipeline for one person at their desk, unattended.
//!
//! Configuration is layered: `configs/daemon.yaml` (built in), the user's file
//! (`--config`, `$XDG_CONFIG_HOME/duplex/daemon.yaml`, `~/.config/duplex/daemon.yaml`), then
//! `DUPLEX__…` environment variables. The daemon turns it into overrides of its pipeline file,
//! runs it, reports readiness once the models are loaded and warmed up (`READY=1` to systemd
//! when `NOTIFY_SOCKET` is set, with watchdog pings), answers a control socket, stops gracefully
//! on SIGINT/SIGTERM and reloads on SIGHUP: persona and sampling apply at the next frame
//! boundary; a new input or output device moves only the stage that owns it (models and
//! conversation untouched); a new pack, pipeline, voice, tokenizer, long-session policy or seed
//! builds a new pipeline beside the running one, which it then replaces; an invalid new
//! configuration (a bad key, a device that does not exist, a pack that cannot be loaded) is
//! rejected and the pipeline keeps running.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use config::{Config, Environment, File, FileFormat, Value, ValueKind};

use crate::config::params::{as_f64, as_i64, as_string, describe, suggest};
use crate::config::{ConfigError, ConfigErrorKind, LoadOptions};
use crate::stages::Registry;

/// The defaults (the text of `configs/daemon.yaml`).
pub const DEFAULTS_YAML: &str = include_str!("../../configs/daemon.yaml");

/// Sampling settings of the daemon.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Text temperature.
    pub text_temperature: f64,
    /// Text top-k.
    pub text_top_k: i64,
    /// Audio temperature.
    pub audio_temperature: f64,
    /// Audio top-k.
    pub audio_top_k: i64,
    /// Seed.
    pub seed: i64,
}

/// A checked daemon configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    /// Where the user's settings came from (`defaults` when there is no file).
    pub file: String,
    /// The live pipeline file.
    pub pipeline: PathBuf,
    /// The model pack.
    pub pack: String,
    /// Input device.
    pub input_device: String,
    /// Output device.
    pub output_device: String,
    /// Persona text.
    pub persona: String,
    /// Persona token ids.
    pub persona_tokens: Vec<i64>,
    /// SentencePiece model.
    pub tokenizer: String,
    /// Voice prompt WAV.
    pub voice: String,
    /// Sampling.
    pub sampling: Sampling,
    /// Long-session policy.
    pub long_session: String,
    /// `/metrics` and `/healthz`.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// Control socket path.
    pub control_socket: PathBuf,
}

const KEYS: &[&str] = &[
    "pipeline",
    "pack",
    "input_device",
    "output_device",
    "persona",
    "persona_tokens",
    "tokenizer",
    "voice",
    "sampling",
    "long_session",
    "metrics_address",
    "control_socket",
];

/// The user's config file: `explicit`, else `$XDG_CONFIG_HOME/duplex/daemon.yaml`, else
/// `~/.config/duplex/daemon.yaml`, when it exists.
pub fn config_path(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let xdg = std::env::var_os("XDG_CONFIG_HOME").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config"));
    [xdg, home]
        .into_iter()
        .flatten()
        .map(|d| d.join("duplex/daemon.yaml"))
        .find(|p| p.is_file())
}

fn default_socket() -> PathBuf {
    let run = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("duplex-{}", unsafe_uid())));
    run.join("duplex/control.sock")
}

fn unsafe_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0)
}

/// Loads and checks the daemon configuration.
///
/// # Errors
///
/// A [`ConfigError`] naming the file and the key.
pub fn load_config(
    explicit: Option<&Path>,
    env: Option<HashMap<String, String>>,
) -> Result<DaemonConfig, ConfigError> {
    let path = config_path(explicit);
    let fname = path
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "defaults".into());
    let e = |k, m: String| ConfigError::new(&fname, k, m);
    let mut b = Config::builder().add_source(File::from_str(DEFAULTS_YAML, FileFormat::Yaml));
    if let Some(p) = &path {
        if !p.is_file() {
            return Err(e(ConfigErrorKind::Read, "no such file".into()));
        }
        b = b.add_source(File::new(&p.display().to_string(), FileFormat::Yaml).required(true));
    }
    b = b.add_source(
        Environment::with_prefix("DUPLEX")
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .source(env.map(|m| m.into_iter().collect())),
    );
    let cfg = b
        .build()
        .map_err(|err| e(ConfigErrorKind::Syntax, err.to_string()))?;
    let ValueKind::Table(root) = cfg.cache.kind else {
        return Err(e(ConfigErrorKind::Syntax, "not a YAML map".into()));
    };
    for k in root.keys() {
        if !KEYS.contains(&k.as_str()) {
            let hint = suggest(k, KEYS.iter().copied())
                .map(|s| format!(" (did you mean `{s}`?)"))
                .unwrap_or_default();
            return Err(e(
                ConfigErrorKind::UnknownKey,
                format!("unknown key{hint}; expected: {}", KEYS.join(", ")),
            )
            .key(k.clone()));
        }
    }
    let get = |k: &str| {
        root.get(k)
            .cloned()
            .unwrap_or_else(|| Value::new(None, ValueKind::Nil))
    };
    let string = |k: &str| -> Result<String, ConfigError> {
        let v = get(k);
        match v.kind {
            ValueKind::Nil => Ok(String::new()),
            _ => as_string(&v).ok_or_else(|| {
                e(
                    ConfigErrorKind::WrongType,
                    format!("expected a string, got {}", describe(&v)),
                )
                .key(k)
            }),
        }
    };
    let tokens = match get("persona_tokens").kind {
        ValueKind::Nil => Vec::new(),
        ValueKind::Array(a) => a
            .iter()
            .map(|v| {
                as_i64(v).ok_or_else(|| {
                    e(
                        ConfigErrorKind::WrongType,
                        format!("expected integers, got {}", describe(v)),
                    )
                    .key("persona_tokens")
                })
            })
            .collect::<Result<_, _>>()?,
        ValueKind::String(s) => s
            .split(',')
            .filter(|t| !t.trim().is_empty())
            .map(|t| {
                t.trim().parse().map_err(|_| {
                    e(
                        ConfigErrorKind::WrongType,
                        format!("{t:?} is not an integer"),
                    )
                    .key("persona_tokens")
                })
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(e(
                ConfigErrorKind::WrongType,
                "expected a list of integers".into(),
            )
            .key("persona_tokens"))
        }
    };
    let ValueKind::Table(s) = get("sampling").kind else {
        return Err(e(ConfigErrorKind::WrongType, "expected a map".into()).key("sampling"));
    };
    let num = |k: &str, min: f64, max: f64| -> Result<f64, ConfigError> {
        let key = format!("sampling.{k}");
        let v = s
            .get(k)
            .ok_or_else(|| e(ConfigErrorKind::Missing, "missing".into()).key(key.clone()))?;
        let x = as_f64(v).ok_or_else(|| {
            e(
                ConfigErrorKind::WrongType,
                format!("expected a number, got {}", describe(v)),
            )
            .key(key.clone())
        })?;
        if !(min..=max).contains(&x) {
            return Err(e(
                ConfigErrorKind::OutOfRange,
                format!("{x} is out of range {min}..={max}"),
            )
            .key(key));
        }
        Ok(x)
    };
    for k in s.keys() {
        if ![
            "text_temperature",
            "text_top_k",
            "audio_temperature",
            "audio_top_k",
            "seed",
        ]
        .contains(&k.as_str())
        {
            return Err(
                e(ConfigErrorKind::UnknownKey, "unknown key".into()).key(format!("sampling.{k}"))
            );
        }
    }
    let sampling = Sampling {
        text_temperature: num("text_temperature", 0.0, 100.0)?,
        text_top_k: num("text_top_k", 0.0, 1e6)? as i64,
        audio_temperature: num("audio_temperature", 0.0, 100.0)?,
        audio_top_k: num("audio_top_k", 0.0, 1e6)? as i64,
        seed: num("seed", 0.0, 9e15)? as i64,
    };
    let long_session = string("long_session")?;
    if !["reset_and_reprime", "stop"].contains(&long_session.as_str()) {
        return Err(e(
            ConfigErrorKind::OutOfRange,
            format!("{long_session:?} is not one of reset_and_reprime, stop"),
        )
        .key("long_session"));
    }
    let addr = string("metrics_address")?;
    let metrics_address = if addr.trim().is_empty() {
        None
    } else {
        Some(addr.trim().parse().map_err(|err| {
            e(
                ConfigErrorKind::WrongType,
                format!("{addr:?} is not an address like 127.0.0.1:9187 ({err})"),
            )
            .key("metrics_address")
        })?)
    };
    let sock = string("control_socket")?;
    let pipeline = PathBuf::from(string("pipeline")?);
    if !pipeline.is_file() {
        return Err(e(
            ConfigErrorKind::Read,
            format!("pipeline file {} not found", pipeline.display()),
        )
        .key("pipeline"));
    }
    Ok(DaemonConfig {
        file: fname.clone(),
        pipeline,
        pack: string("pack")?,
        input_device: string("input_device")?,
        output_device: string("output_device")?,
        persona: string("persona")?,
        persona_tokens: tokens,
        tokenizer: string("tokenizer")?,
        voice: string("voice")?,
        sampling,
        long_session,
        metrics_address,
        control_socket: if sock.is_empty() {
            default_socket()
        } else {
            PathBuf::from(sock)
        },
    })
}

impl DaemonConfig {
    /// The overrides of the pipeline file this configuration stands for.
    pub fn sets(&self) -> Vec<(String, String)> {
        let mut v = vec![
            ("stages.mic.device".into(), self.input_device.clone()),
            ("stages.speaker.device".into(), self.output_device.clone()),
            (
                "stages.temporal.long_session".into(),
                self.long_session.clone(),
            ),
            ("metrics.address".into(), String::new()),
        ];
        for s in ["encode", "temporal", "depformer", "decode"] {
            v.push((format!("stages.{s}.pack"), self.pack.clone()));
        }
        for (k, val) in [
            ("persona", &self.persona),
            ("tokenizer", &self.tokenizer),
            ("voice", &self.voice),
        ] {
            if !val.is_empty() {
                v.push((format!("stages.temporal.{k}"), val.clone()));
            }
        }
        if !self.persona_tokens.is_empty() {
            let t: Vec<String> = self.persona_tokens.iter().map(|t| t.to_string()).collect();
            v.push(("stages.temporal.persona_tokens".into(), t.join(",")));
        }
        let s = &self.sampling;
        v.push((
            "stages.depformer.text_temperature".into(),
            s.text_temperature.to_string(),
        ));
        v.push((
            "stages.depformer.text_top_k".into(),
            s.text_top_k.to_string(),
        ));
        v.push((
            "stages.depformer.audio_temperature".into(),
            s.audio_temperature.to_string(),
        ));
        v.push((
            "stages.depformer.audio_top_k".into(),
            s.audio_top_k.to_string(),
        ));
        v.push(("stages.depformer.seed".into(), s.seed.to_string()));
        v
    }
}

/// `duplex daemon --check`: the configuration and the pipeline it stands for, checked.
///
/// # Errors
///
/// A [`ConfigError`] naming the file and key.
pub fn check(explicit: Option<&Path>) -> Result<DaemonConfig, ConfigError> {
    let c = load_config(explicit, None)?;
    let opts = LoadOptions {
        sets: c.sets(),
        env: Some(HashMap::new()),
    };
    crate::config::load(&c.pipeline, &opts, &Registry::builtin())?;
    Ok(c)
}

/// `duplex daemon --check`, all of it: the configuration and its pipeline ([`check`]), the
/// pack (a directory holding the four graphs and a valid manifest) and the devices (they exist
/// now). Errors name the file and key.
///
/// # Errors
///
/// A [`ConfigError`] naming the file and the key (`pack`, `input_device`, `output_device`).
pub fn check_all(explicit: Option<&Path>) -> Result<DaemonConfig, ConfigError> {
    let c = check(explicit)?;
    let e = |key: &str, m: String| ConfigError::new(&c.file, ConfigErrorKind::Read, m).key(key);
    crate::model::pack::Pack::open(Path::new(&c.pack)).map_err(|err| e("pack", err.to_string()))?;
    use crate::audio::device::{find, Direction};
    for (key, dir, spec) in [
        ("input_device", Direction::Input, &c.input_device),
        ("output_device", Direction::Output, &c.output_device),
    ] {
        if spec != "virtual" {
            find(dir, spec).map_err(|err| e(key, err.to_string()))?;
        }
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
    config: Mutex<DaemonConfig>,
    /// Stops the pipeline running now.
    current: Mutex<Option<crate::runtime::StopHandle>>,
    /// A pipeline built for a new configuration beside the running one, waiting to start.
    next: Mutex<Option<crate::runtime::Pipeline>>,
    /// A new pipeline is being built.
    rebuilding: AtomicBool,
    /// The configuration of the pipeline running before a reload whose pipeline could not be
    /// built beside it: what to go back to when it cannot be built alone either.
    fallback: Mutex<Option<DaemonConfig>>,
    /// The daemon is stopping for good.
    shutdown: AtomicBool,
    /// The control socket, once this process has bound it.
    socket: Mutex<Option<PathBuf>>,
}

/// Runs the daemon until stopped.
///
/// # Errors
///
/// Configuration errors (exit 2) and pipeline failures (exit 1).
pub fn run(explicit: Option<&Path>) -> anyhow::Result<()> {
    let c = check_all(explicit)?;
    tracing::info!(config = %c.file, pipeline = %c.pipeline.display(), "starting");
    let shared = Arc::new(Shared {
        started: Instant::now(),
        ready: AtomicBool::new(false),
        config: Mutex::new(c.clone()),
        current: Mutex::new(None),
        next: Mutex::new(None),
        rebuilding: AtomicBool::new(false),
        fallback: Mutex::new(None),
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
    super::serve_metrics_at(c.metrics_address, Some(health));
    let stop_shared = shared.clone();
    let reload_shared = shared.clone();
    let explicit = explicit_owned(explicit);
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
        move || reload(&reload_shared, explicit.clone()),
    );
    // After the signal hooks: a stop that comes as soon as the socket is there is handled.
    let control =
        super::control::ControlServer::start(&c.control_socket, shared_status(shared.clone()))?;
    if let Ok(mut s) = shared.socket.lock() {
        *s = Some(c.control_socket.clone());
    }
    let mut notified = false;
    let mut prepared = None;
    let result = loop {
        let pipeline = match prepared.take() {
            Some(p) => p,
            None => {
                // Not under the lock: loading a large pack takes a while, and `status` and
                // SIGHUP read the configuration meanwhile.
                let Some(c) = shared.config.lock().ok().map(|g| g.clone()) else {
                    break Err(anyhow::anyhow!("configuration lock poisoned"));
                };
                let previous = shared.fallback.lock().ok().and_then(|mut f| f.take());
                match (build_pipeline(&c), previous) {
                    (Ok(p), _) => p,
                    (Err(e), Some(old)) => {
                        tracing::error!(
                            "reload rejected: the new pipeline could not be built on its own either: {e:#}; going back to the previous configuration"
                        );
                        if let Ok(mut g) = shared.config.lock() {
                            *g = old.clone();
                        }
                        build_pipeline(&old)?
                    }
                    (Err(e), None) => return Err(e),
                }
            }
        };
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
        let alone = shared.fallback.lock().is_ok_and(|f| f.is_some());
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
fn build_pipeline(c: &DaemonConfig) -> anyhow::Result<crate::runtime::Pipeline> {
    let opts = LoadOptions {
        sets: c.sets(),
        env: Some(HashMap::new()),
    };
    let (spec, builder) = super::build(&c.pipeline, &opts, &Registry::builtin())?;
    let builder = super::observe(builder, &spec.metrics);
    Ok(builder.build()?)
}

fn explicit_owned(p: Option<&Path>) -> Option<PathBuf> {
    p.map(Path::to_path_buf)
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

/// A new pack or pipeline: builds the new pipeline beside the running one (models loaded,
/// devices open), then stops the running one and hands the new one over. When the new pipeline
/// cannot be built beside the running one (two packs may not fit in memory), the running one is
/// stopped and the new one built alone; when that fails too, the old configuration is built
/// again.
fn rebuild(shared: &Arc<Shared>, new: DaemonConfig) {
    if shared.rebuilding.swap(true, Ordering::AcqRel) {
        tracing::error!(
            "reload rejected: a new pipeline is still being built; reload again when it is running"
        );
        return;
    }
    tracing::warn!(
        "reload: pack or pipeline changed: building the new pipeline beside the running one"
    );
    let sh = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("duplex:rebuild".into())
        .spawn(move || {
            let shared = sh;
            let t0 = Instant::now();
            match build_pipeline(&new) {
                Ok(p) if !shared.shutdown.load(Ordering::Acquire) => {
                    tracing::info!(
                        after_ms = t0.elapsed().as_millis() as u64,
                        "new pipeline built; replacing the running one"
                    );
                    if let Ok(mut n) = shared.next.lock() {
                        *n = Some(p);
                    }
                    if let Ok(mut c) = shared.config.lock() {
                        *c = new;
                    }
                    if let Ok(g) = shared.current.lock() {
                        if let Some(h) = g.as_ref() {
                            h.stop();
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    // Two packs may not fit in memory at once (one GPU): stop the running
                    // pipeline to free what it holds and build the new one alone; the main loop
                    // goes back to the old configuration if that fails too.
                    tracing::warn!(
                        "the new pipeline could not be built beside the running one ({e:#}); stopping the running one and building the new one alone"
                    );
                    if let Ok(mut c) = shared.config.lock() {
                        let old = std::mem::replace(&mut *c, new);
                        if let Ok(mut f) = shared.fallback.lock() {
                            *f = Some(old);
                        }
                    }
                    if let Ok(g) = shared.current.lock() {
                        if let Some(h) = g.as_ref() {
                            h.stop();
                        }
                    }
                }
            }
            shared.rebuilding.store(false, Ordering::Release);
        });
    if let Err(e) = spawned {
        tracing::error!("reload rejected: {e}");
        shared.rebuilding.store(false, Ordering::Release);
    }
}

/// SIGHUP: read the configuration again; apply persona and sampling at the next frame
/// boundary; reject an invalid configuration and keep running.
fn reload(shared: &Arc<Shared>, explicit: Option<PathBuf>) {
    let new = match check_all(explicit.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("reload rejected, keeping the running configuration: {e:#}");
            return;
        }
    };
    let Ok(mut cur) = shared.config.lock() else {
        return;
    };
    let mut new = new;
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
        drop(cur);
        rebuild(shared, new);
        return;
    }
    let mut changed = false;
    if new.persona != cur.persona || new.persona_tokens != cur.persona_tokens {
        changed = true;
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
    }
    if new.sampling != cur.sampling {
        changed = true;
        let s = &new.sampling;
        crate::control::post(
            "depformer.sampling",
            format!(
                "{} {} {} {}",
                s.text_temperature, s.text_top_k, s.audio_temperature, s.audio_top_k
            ),
        );
        tracing::info!("reload: sampling changes at the next frame");
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
            changed = true;
            tracing::info!("reload: {what} device {old:?} -> {spec:?} at the next frame");
            crate::control::post(key, spec.clone());
        }
    }
    if !changed {
        tracing::info!("reload: nothing to change");
    }
    *cur = new;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Option<HashMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// Defaults, then the user's file, then `DUPLEX__…` variables, each over the one before.
    #[test]
    fn layers_defaults_file_and_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("daemon.yaml");
        let pipeline = concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines/daemon.yaml");
        std::fs::write(
            &file,
            format!(
                "pipeline: {pipeline}\ninput_device: from-file\noutput_device: from-file\nsampling:\n  seed: 3\n"
            ),
        )
        .unwrap();
        let c = load_config(
            Some(&file),
            env(&[
                ("DUPLEX__INPUT_DEVICE", "from-env"),
                ("DUPLEX__SAMPLING__SEED", "7"),
            ]),
        )
        .unwrap();
        assert_eq!(c.input_device, "from-env");
        assert_eq!(c.output_device, "from-file");
        assert_eq!(c.sampling.seed, 7);
        // Untouched sampling keys keep their defaults.
        assert_eq!(c.sampling.text_top_k, 25);
        assert_eq!(c.long_session, "reset_and_reprime");
        assert_eq!(c.file, file.display().to_string());
        // A bad value from the environment names the key.
        let e = load_config(Some(&file), env(&[("DUPLEX__SAMPLING__SEED", "soon")])).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("sampling.seed"), "{e}");
        assert!(e.to_string().contains("daemon.yaml"), "{e}");
        // And one the daemon does not know.
        let e = load_config(Some(&file), env(&[("DUPLEX__INPUT_DEVISE", "x")])).unwrap_err();
        assert!(e.to_string().contains("did you mean `input_device`"), "{e}");
    }

    /// The configuration becomes overrides of the pipeline file's stages.
    #[test]
    fn the_configuration_becomes_pipeline_overrides() {
        let c = load_config(None, env(&[("DUPLEX__PERSONA_TOKENS", "1,2,3")])).unwrap();
        let sets: HashMap<String, String> = c.sets().into_iter().collect();
        assert_eq!(sets["stages.temporal.persona_tokens"], "1,2,3");
        assert_eq!(sets["stages.encode.pack"], c.pack);
        assert_eq!(sets["stages.speaker.device"], c.output_device);
        assert_eq!(
            sets["metrics.address"], "",
            "the daemon serves metrics itself"
        );
    }
}
