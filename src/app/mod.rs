//! What the `duplex` binary does: turn a pipeline file into a running pipeline, stop it on a
//! signal, and report. Knows no model internals; stage kinds come from the
//! [`Registry`].

pub mod control;
pub mod daemon;
pub mod doctor;
pub mod eval;
pub mod loadtest;
pub mod logging;
mod replay;
mod report;
mod rtc;
pub mod serve;

use std::path::Path;

use anyhow::Context as _;

use crate::config::{
    self, ConfigError, ConfigErrorKind, LoadOptions, Override, Params, PipelineSpec,
};
use crate::runtime::{
    Body, ControlPlane, Link, Node, PipelineBuilder, RunOptions, RunReport, StopHandle,
};
use crate::stages::{BuildContext, BuildError, BuildErrorKind, Registry};

pub use replay::{run as replay, run_recording as replay_recording, ReplayArgs};

/// The process's shared resources for `conversations` at once: its engines heard by the metrics'
/// observer, and what its environment asks of them: `DUPLEX_PRIME_CACHE_MB` (the primed states kept; `duplex serve` has its own
/// `prime_cache_mb`) and `DUPLEX_DRILL_ENGINE_PANIC_AT_TICK=N` (a fault drill: the first
/// shared engine fails at its N-th temporal tick).
pub(crate) fn process_resources(conversations: usize) -> crate::resources::Resources {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let mut r = crate::resources::Resources::new(conversations);
    r.set_observer(crate::observe::engine::EngineMetrics::start);
    if let Some(mb) = var("DUPLEX_PRIME_CACHE_MB") {
        r.set_prime_cache_bytes((mb as usize).saturating_mul(1 << 20));
    }
    r.set_engine_drill(var("DUPLEX_DRILL_ENGINE_PANIC_AT_TICK"));
    r
}

/// `duplex compare`: reads two recordings and compares them.
///
/// # Errors
///
/// A [`ConfigError`] naming the recording that cannot be read (exit code 2).
pub fn compare(
    live: &Path,
    replay: &Path,
) -> Result<crate::observe::compare::Comparison, ConfigError> {
    use crate::observe::record::Recorded;
    let read = |d: &Path| Recorded::open(d).map_err(|m| replay::recording_error(&m));
    Ok(crate::observe::compare::compare(
        &read(live)?,
        &read(replay)?,
    ))
}
pub use report::timing_table;

/// Loads `file` and builds (but does not start) its pipeline.
///
/// # Errors
///
/// A [`ConfigError`] for anything wrong in the file, including graph errors (dangling links,
/// type mismatches, cycles) and stages that cannot be built (a missing input file).
pub fn build(
    file: &Path,
    opts: &LoadOptions,
    registry: &Registry,
) -> Result<(PipelineSpec, PipelineBuilder), ConfigError> {
    let spec = config::load(file, opts, registry)?;
    let b = build_spec(&spec, registry)?;
    Ok((spec, b))
}

/// Loads a file of primed states (`prime_cache_file`, `duplex prime --out`) into the process's
/// cache, for the packs of `spec`'s `temporal` stages; logs how many.
///
/// # Errors
///
/// As [`PrimeCache::load`](crate::resources::PrimeCache::load): the file names itself.
pub(crate) fn load_primed_states(
    resources: &crate::resources::Resources,
    file: &Path,
    spec: &PipelineSpec,
) -> Result<usize, crate::resources::PrimeFileError> {
    let packs: Vec<std::path::PathBuf> = spec
        .stages
        .iter()
        .filter(|s| s.kind == crate::stages::kind::TEMPORAL)
        .filter_map(crate::stages::read::pack)
        .collect();
    let n = resources.primed().load(file, &packs)?;
    tracing::info!(file = %file.display(), states = n, "primed states loaded");
    Ok(n)
}

/// Writes the process's primed states to `file` at exit (`prime_cache_file`); a failure is
/// logged, as nothing else is left to do about it then.
pub(crate) fn save_primed_states(resources: &crate::resources::Resources, file: &Path) {
    match resources.primed().save(file) {
        Ok(n) => tracing::info!(file = %file.display(), states = n, "primed states saved"),
        Err(e) => tracing::error!("saving the primed states (`prime_cache_file`): {e}"),
    }
}

/// Builds (but does not start) the pipeline of an already loaded spec.
///
/// # Errors
///
/// As [`build`], for the stages and the graph.
pub fn build_spec(
    spec: &PipelineSpec,
    registry: &Registry,
) -> Result<PipelineBuilder, ConfigError> {
    build_session(spec, registry, None, None, &process_resources(1))
}

/// Builds (but does not start) the pipeline of an already loaded spec that serves the network
/// session `session` (its session stages reach the client through it).
///
/// # Errors
///
/// As [`build`], for the stages and the graph.
pub fn build_session(
    spec: &PipelineSpec,
    registry: &Registry,
    session: Option<&crate::session::PipelineEnd>,
    recording: Option<&crate::observe::record::Recording>,
    resources: &crate::resources::Resources,
) -> Result<PipelineBuilder, ConfigError> {
    load_ort(spec)?;
    let plane = ControlPlane::new();
    let taps = crate::audio::reference::Taps::default();
    let conversation = crate::stages::Conversation::default();
    let mut b = PipelineBuilder::new()
        .origin(spec.file.clone())
        .options(RunOptions {
            drain_timeout: spec.runtime.drain_timeout,
            abort_timeout: spec.runtime.abort_timeout,
        });
    for s in &spec.stages {
        // `load` only accepts kinds the registry knows.
        let Some(kind) = registry.get(&s.kind) else {
            return Err(
                ConfigError::new(&spec.file, ConfigErrorKind::UnknownKind, "unknown kind")
                    .stage(s.name.clone()),
            );
        };
        let cx = BuildContext::new(&s.name, &spec.file, &plane, kind, resources)
            .with_session(session)
            .with_recording(recording)
            .with_taps(&taps)
            .with_conversation(&conversation);
        let mut body = (kind.build)(&cx, &s.params)
            .map_err(|e| build_error(&spec.file, &s.name, &s.params, e))?;
        if let Some(p) = &s.inject {
            body = with_delay(spec, s, body, p)?;
        }
        b = b.node(Node {
            name: s.name.clone(),
            kind: s.kind.clone(),
            inputs: (kind.inputs)(),
            outputs: (kind.outputs)(),
            body,
        });
    }
    if let Some((reader, name)) = taps.unprovided().into_iter().next() {
        let known = spec
            .stages
            .iter()
            .filter(|s| s.kind == crate::stages::kind::PLAYBACK)
            .map(|s| s.name.as_str())
            .collect::<Vec<_>>();
        return Err(ConfigError::new(
            &spec.file,
            ConfigErrorKind::Build,
            format!(
                "{name:?} names no playback stage (playback stages here: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ),
        )
        .stage(reader)
        .key("reference"));
    }
    b = b.control(plane);
    for l in &spec.links {
        let mut link = Link::new(l.from.clone(), l.to.clone())
            .capacity(l.capacity)
            .overflow(l.overflow);
        if l.feedback {
            link = link.feedback();
        }
        b = b.link(link);
    }
    // Structural checks now, so that they are reported as configuration errors.
    b.describe().map_err(|g| {
        let mut e = ConfigError::new(&spec.file, ConfigErrorKind::Link, g.to_string());
        // The graph error already starts with the file name.
        e.message = e
            .message
            .strip_prefix(&format!("{}: ", spec.file))
            .unwrap_or(&e.message)
            .to_string();
        e
    })?;
    Ok(b)
}

/// A stage's `inject_delay:` option laid on it (a latency signature, for drills and tests of
/// the diagnosis); a source has no input to delay.
fn with_delay(
    spec: &PipelineSpec,
    s: &config::StageSpec,
    body: Body,
    p: &Params,
) -> Result<Body, ConfigError> {
    Ok(match body {
        Body::Stage(st) => {
            let sig = crate::stages::inject_delay::Signature::new(p).map_err(|e| {
                ConfigError::new(&spec.file, ConfigErrorKind::Build, e.to_string())
                    .key(format!("stages.{}.inject_delay", s.name))
            })?;
            Body::Stage(crate::stages::inject_delay::delayed(st, sig))
        }
        Body::Source(_) => {
            return Err(ConfigError::new(
                &spec.file,
                ConfigErrorKind::Build,
                format!(
                    "`{}` applies to stages with inputs; `{}` is a source (put an \
                     `inject_delay` stage after it)",
                    config::INJECT_KEY,
                    s.kind
                ),
            )
            .stage(s.name.clone())
            .key(config::INJECT_KEY))
        }
    })
}

/// A stage builder's error as a configuration error naming the file, the stage, the param and
/// the layer its value came from (a `Unavailable` kind for what may work later).
pub(crate) fn build_error(file: &str, stage: &str, params: &Params, e: BuildError) -> ConfigError {
    let kind = match e.kind {
        BuildErrorKind::Unavailable => ConfigErrorKind::Unavailable,
        BuildErrorKind::Busy => ConfigErrorKind::Busy,
        _ => ConfigErrorKind::Build,
    };
    let mut c = ConfigError::new(file, kind, e.message).stage(stage);
    if let Some(k) = e.key {
        c = c.key(k);
        c.origin = params.origin(k).map(Into::into);
    }
    c
}

/// Loads ONNX Runtime from `ort.library` when the pipeline sets it (its file, a `DUPLEX__…`
/// variable, a `--set`, or the daemon's settings set over it), so that it comes before every
/// other way of finding it; otherwise the first model stage finds it
/// ([`ortlib`](crate::model::ortlib)'s search).
fn load_ort(spec: &PipelineSpec) -> Result<(), ConfigError> {
    match &spec.ort_library {
        Some(chosen) => load_chosen_ort(chosen).map(|_| ()),
        None => Ok(()),
    }
}

/// Loads ONNX Runtime for a command, once per process: the library `chosen` names (its
/// settings' `ort.library`, from the file, `DUPLEX__ORT__LIBRARY` or a flag), else the
/// search of [`ortlib`](crate::model::ortlib) (`ORT_DYLIB_PATH`, the project's `.venv`, the
/// active Python's). `command` stands for the settings file in messages when nothing was
/// chosen (`duplex replay`). The library is logged at INFO with where it came from.
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) for a library that a setting or `ORT_DYLIB_PATH` names and that
/// is missing, does not load, or is not the one this process already runs; an
/// [`OrtLibError`](crate::model::ortlib::OrtLibError) (exit 1) when none is installed anywhere
/// or the one found does not load.
pub fn load_ort_for(
    command: &str,
    chosen: Option<&config::OrtChoice>,
) -> anyhow::Result<&'static crate::model::ortlib::OrtLibrary> {
    use crate::model::ortlib::{self, OrtLibError};
    if let Some(c) = chosen {
        return Ok(load_chosen_ort(c)?);
    }
    ortlib::environment(None).map_err(|err| match err {
        OrtLibError::Missing { .. } => {
            ConfigError::new(command, ConfigErrorKind::Read, err.to_string()).into()
        }
        other => anyhow::Error::new(other),
    })
}

/// Loads the library `chosen` names. A process loads one library: a later choice of another
/// is refused rather than silently given the first.
///
/// # Errors
///
/// A [`ConfigError`] naming the settings file, `ort.library` and the layer that set it.
pub fn load_chosen_ort(
    chosen: &config::OrtChoice,
) -> Result<&'static crate::model::ortlib::OrtLibrary, ConfigError> {
    use crate::model::ortlib;
    chosen.check()?;
    let lib = ortlib::environment(Some(ortlib::Chosen {
        path: &chosen.path,
        origin: &chosen.origin,
    }))
    .map_err(|err| chosen.error(ConfigErrorKind::Build, err.to_string()))?;
    let same = |a: &Path, b: &Path| match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    };
    if !same(&lib.path, &chosen.path) {
        return Err(chosen.error(
            ConfigErrorKind::Conflict,
            format!(
                "this process already runs ONNX Runtime from {} ({}); one library per process: \
                 restart to use {}",
                lib.path.display(),
                lib.origin,
                chosen.path.display()
            ),
        ));
    }
    Ok(lib)
}

/// `duplex validate`: the resolved graph as text.
///
/// # Errors
///
/// As [`build`].
pub fn validate(
    file: &Path,
    opts: &LoadOptions,
    registry: &Registry,
) -> Result<String, ConfigError> {
    let (spec, b) = build(file, opts, registry)?;
    let mut s = format!("pipeline {}", spec.file);
    if let Some(d) = &spec.description {
        s.push_str(&format!(" — {d}"));
    }
    s.push('\n');
    s.push_str(
        &b.describe()
            .map_err(|g| ConfigError::new(&spec.file, ConfigErrorKind::Link, g.to_string()))?,
    );
    Ok(s)
}

/// Runs a pipeline file to its end with the built-in stage kinds, stopping gracefully on
/// SIGINT/SIGTERM (a second signal aborts).
///
/// # Errors
///
/// A [`ConfigError`] (in the chain) when the file is wrong, a
/// [`RunError`](crate::runtime::RunError) when a stage fails.
pub fn run_file(file: &Path, sets: &[Override]) -> anyhow::Result<RunReport> {
    let opts = LoadOptions {
        sets: sets.to_vec(),
        env: None,
    };
    // The exporter goes first: metric handles that stages create while they are built must be
    // bound to the real recorder.
    let registry = Registry::builtin();
    let spec = config::load(file, &opts, &registry)?;
    serve_metrics(&spec.metrics);
    let recording = record(&spec)?;
    let resources = process_resources(1);
    let builder = build_session(&spec, &registry, None, recording.as_deref(), &resources)?;
    let (builder, monitor) = observe(builder, &spec.metrics);
    let builder = match &recording {
        Some(r) => {
            monitor.record_changes(r.stream("verdicts"));
            builder.observer(r.clone())
        }
        None => builder,
    };
    let pipeline = builder
        .build()
        .with_context(|| format!("building {}", file.display()))?;
    let running = pipeline.start();
    let _signals = SignalGuard::install(running.stop_handle());
    let outcome = running.wait();
    if let Some(r) = recording {
        r.finish();
        tracing::info!("recorded into {}", r.dir().display());
    }
    if let Some(e) = outcome.error {
        logging::report(&timing_table(&outcome.report));
        return Err(anyhow::Error::new(e).context(format!("running {}", file.display())));
    }
    Ok(outcome.report)
}

/// A recording of the run when the pipeline's `record.dir` is set (see
/// [`Recording`](crate::observe::record::Recording)), with its manifest: the pipeline file,
/// every stage's kind and params, and the identity of the packs they name. Build the pipeline
/// with it (its stages may write streams of their own) and attach it as an observer.
///
/// # Errors
///
/// A [`ConfigError`] on `record.dir` when the folder cannot be made.
pub fn record(
    spec: &PipelineSpec,
) -> Result<Option<std::sync::Arc<crate::observe::record::Recording>>, ConfigError> {
    let Some(dir) = &spec.record.dir else {
        return Ok(None);
    };
    let r =
        crate::observe::record::Recording::create(dir, manifest(spec), spec.record.max_file_bytes)
            .map_err(|m| {
                ConfigError::new(&spec.file, ConfigErrorKind::Build, m.to_string())
                    .key("record.dir")
            })?;
    Ok(Some(std::sync::Arc::new(r)))
}

/// A pack's graphs by SHA-256 (the `.onnx` files; external weight files by size).
pub(crate) fn pack_files(pack: &str) -> serde_json::Value {
    use sha2::Digest;
    let mut files = serde_json::Map::new();
    let root = Path::new(pack);
    for g in ["temporal", "depformer", "mimi_encoder", "mimi_decoder"] {
        for (name, hash) in [("model.onnx", true), ("model.onnx.data", false)] {
            let f = root.join(g).join(name);
            let Ok(meta) = std::fs::metadata(&f) else {
                continue;
            };
            let mut v = serde_json::json!({ "bytes": meta.len() });
            if hash {
                if let Ok(b) = std::fs::read(&f) {
                    v["sha256"] = format!("{:x}", sha2::Sha256::digest(&b)).into();
                }
            }
            files.insert(format!("{g}/{name}"), v);
        }
    }
    files.into()
}

/// What a recording says ran: the pipeline, its stages and links, and each pack's graphs by
/// SHA-256 (the `.onnx` files; external weight files by size).
pub(crate) fn manifest(spec: &PipelineSpec) -> serde_json::Value {
    let mut packs = serde_json::Map::new();
    let stages: Vec<serde_json::Value> = spec
        .stages
        .iter()
        .map(|s| {
            if let Some(crate::config::ParamValue::Str(p)) = s.params.get("pack") {
                packs.entry(p.clone()).or_insert_with(|| pack_files(p));
            }
            let mut stage =
                serde_json::json!({ "name": s.name, "kind": s.kind, "params": s.params.to_json_map() });
            if let Some(p) = &s.inject {
                stage[config::INJECT_KEY] = p.to_json_map().into();
            }
            stage
        })
        .collect();
    let links: Vec<String> = spec
        .links
        .iter()
        .map(|l| format!("{} -> {}", l.from, l.to))
        .collect();
    serde_json::json!({
        "pipeline": spec.file,
        "description": spec.description,
        "stages": stages,
        "links": links,
        "packs": packs,
    })
}

/// Serves `/metrics` on the configured address (each command calls it once, before its
/// pipeline). A busy address is logged, not fatal: the pipeline runs without an exporter.
pub fn serve_metrics(m: &config::MetricsSettings) {
    serve_metrics_at(m.address, None, "metrics.address");
}

/// Serves `/metrics` and `/healthz` (with `health`) on `address`; a failure names `key`, the
/// setting that chose the address. The exporter's thread lives as long as the process: a
/// second call binds a second address (or fails on the same one, logged).
pub fn serve_metrics_at(
    address: Option<std::net::SocketAddr>,
    health: Option<crate::observe::exporter::Health>,
    key: &str,
) {
    if let Some(addr) = address {
        match crate::observe::exporter::install(addr, health) {
            Ok(()) => tracing::info!("metrics on http://{addr}/metrics"),
            Err(e) => tracing::warn!("{e}: metrics are not exported (set `{key}`)"),
        }
    }
}

/// Attaches the observers of a pipeline: its Prometheus series ([`Recorder`]) and a latency
/// monitor (diagnosis and real-time factor), which is returned too: it belongs to that
/// pipeline alone.
///
/// [`Recorder`]: crate::observe::recorder::Recorder
pub fn observe(
    builder: PipelineBuilder,
    m: &config::MetricsSettings,
) -> (
    PipelineBuilder,
    std::sync::Arc<crate::observe::monitor::Monitor>,
) {
    observe_with(builder, m, true)
}

/// As [`observe`], with a monitor that exports its gauges only when `publish` (a server's
/// sessions do not: the server publishes them together).
pub fn observe_with(
    builder: PipelineBuilder,
    m: &config::MetricsSettings,
    publish: bool,
) -> (
    PipelineBuilder,
    std::sync::Arc<crate::observe::monitor::Monitor>,
) {
    use crate::observe::monitor::Monitor;
    let cfg = crate::observe::diagnose::DiagnosisConfig {
        window: m.window,
        every: m.every,
        ..Default::default()
    };
    let names = builder.stage_names();
    let monitor = std::sync::Arc::new(if publish {
        Monitor::new(&names, cfg)
    } else {
        Monitor::private(&names, cfg)
    });
    let recorder = std::sync::Arc::new(crate::observe::recorder::Recorder::new());
    (
        builder.observer(recorder).observer(monitor.clone()),
        monitor,
    )
}

/// The `count`th stop signal for `handles`: the first drains them, a later one aborts them.
fn stop_all(handles: &[StopHandle], count: u32) {
    if count == 1 {
        tracing::warn!("stop requested: draining the pipeline (signal again to abort)");
        handles.iter().for_each(|h| h.stop());
    } else {
        tracing::warn!("second stop request: aborting");
        handles.iter().for_each(|h| h.abort());
    }
}

/// Stops a pipeline on SIGINT/SIGTERM: the first signal drains, a second aborts. The handler
/// runs on a small tokio runtime of its own and ends when the guard is dropped.
pub struct SignalGuard {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SignalGuard {
    /// Installs the handler for `handle`.
    pub fn install(handle: StopHandle) -> Self {
        Self::install_all(vec![handle])
    }

    /// Installs the handler for pipelines that run together: a signal drains (a second one
    /// aborts) every one of them.
    pub fn install_all(handles: Vec<StopHandle>) -> Self {
        Self::install_hooks(
            move |count| stop_all(&handles, count),
            || {
                tracing::info!("SIGHUP ignored: nothing to reload");
            },
        )
    }

    /// Installs the handler for `handle`; SIGHUP calls `reload`.
    pub fn install_with_reload(handle: StopHandle, reload: impl Fn() + Send + 'static) -> Self {
        Self::install_hooks(
            move |count| stop_all(std::slice::from_ref(&handle), count),
            reload,
        )
    }

    /// Installs handlers: SIGINT/SIGTERM call `stop` with the number of stop signals so far,
    /// SIGHUP calls `reload`. Returns once they are in place, so that a signal sent from then
    /// on reaches them rather than the default action.
    pub fn install_hooks(
        stop: impl Fn(u32) + Send + 'static,
        reload: impl Fn() + Send + 'static,
    ) -> Self {
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let thread = std::thread::Builder::new()
            .name("duplex:signals".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async move {
                    use tokio::signal::unix::{signal, SignalKind};
                    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
                        signal(SignalKind::interrupt()),
                        signal(SignalKind::terminate()),
                        signal(SignalKind::hangup()),
                    ) else {
                        return;
                    };
                    let _ = ready_tx.send(());
                    let mut count = 0;
                    loop {
                        tokio::select! {
                            _ = &mut rx => return,
                            _ = int.recv() => {}
                            _ = term.recv() => {}
                            _ = hup.recv() => {
                                reload();
                                continue;
                            }
                        }
                        count += 1;
                        stop(count);
                    }
                });
            })
            .ok();
        // Fails at once when the thread could not register them (its sender is gone).
        let _ = ready_rx.recv_timeout(std::time::Duration::from_secs(5));
        SignalGuard {
            stop: Some(tx),
            thread,
        }
    }
}

impl Drop for SignalGuard {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The process exit code for an error chain: 2 for configuration errors (refused before start),
/// 1 otherwise: a run-time failure, or a capacity that is full now (`ConfigErrorKind::Busy`:
/// every slot of a shared engine taken), which works later as it is.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    let busy = e.chain().any(|c| {
        c.downcast_ref::<ConfigError>()
            .is_some_and(|c| c.kind == ConfigErrorKind::Busy)
    });
    if busy {
        1
    } else if e
        .chain()
        .any(|c| c.is::<ConfigError>() || c.is::<crate::runtime::GraphError>())
    {
        2
    } else {
        1
    }
}
