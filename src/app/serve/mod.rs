//! `duplex serve`: conversations over the network (the Moshi WebSocket protocol, the OpenAI
//! Realtime API, the telephony providers' media streams, WebRTC, SIP calls), one session
//! pipeline per client, built from a YAML session template. HTTP and WebSocket are axum's
//! (hyper on a tokio runtime); SIP's transactions are rsipstack's.
//!
//! This module starts the server and holds what every connection shares ([`Server`]: the
//! settings, the template, the process's resources and engines, the live sessions); its rooms
//! do the rest, each knowing no model internals:
//!
//! - [`edge`]: the listener and the guard in front of every route (hosts, keys, origins,
//!   proxies, security headers); [`access`]: keys, origins and forwarded addresses;
//! - [`admission`]: slots, per-address limits and refusals (counted by reason, logged at most
//!   once per reason per [`LOG_EVERY`]);
//! - [`doors`]: the upgrade routes and SIP's calls; [`api`]: `/readyz` and the JSON endpoints;
//! - [`ops`]: the background work (series, engines' replacement, reload on SIGHUP, the drain
//!   on SIGTERM);
//! - [`session`]: one connection, whatever its transport; the transports beside it
//!   ([`kyutai`], [`realtime`], [`streams`] (Twilio, Telnyx, Plivo, Vonage, Exotel),
//!   [`webrtc`], [`sip`]) know it only through its `Protocol`; [`rtp`]: the RTP both media
//!   transports share (the jitter buffer, plain RTP's wire);
//! - [`config`]: the settings and a client's query parameters; [`web`]: the browser page.

mod access;
mod admission;
mod api;
pub mod config;
mod doors;
mod edge;
mod kyutai;
mod ops;
pub mod realtime;
mod rtp;
mod session;
mod sip;
mod streams;
mod web;
mod webrtc;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::routing::get;
use serde_json::json;

use crate::config::{self as cfg, ConfigError, LoadOptions, PipelineSpec};
use crate::observe::names;
use crate::resources::Resources;
use crate::stages::Registry;

pub(crate) use admission::{Admission, Connection, LogThrottle};
use api::{defaults, readyz, sessions, voices};
pub use config::{load as load_config, ServeConfig};
use doors::{chat, realtime_chat, twilio_media};
pub(crate) use edge::Client;
use edge::{accept, guard};
use ops::{drain_on_signal, publish_together, recover_engines, register_series, reload_on_hangup};

/// Flags of `duplex serve`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// Settings file (default: $XDG_CONFIG_HOME/duplex/serve.yaml, then the built-in defaults).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Check the configuration and the session template (models loaded, nothing served), then
    /// exit.
    #[arg(long)]
    pub check: bool,
}

/// One live session, as `/api/sessions` and the drain see it.
struct Live {
    peer: SocketAddr,
    /// The name of the key the client presented.
    key: Option<String>,
    started: Instant,
    handle: Option<crate::runtime::Handle>,
    monitor: Option<Arc<crate::observe::monitor::Monitor>>,
    stats: Arc<crate::session::LinkStats>,
    /// The transport's own counters (WebRTC's), when it has any.
    transport: Option<session::TransportStats>,
}

/// What every connection shares.
pub(crate) struct Server {
    /// The settings (shared with the transports that check a client's choices as they come).
    cfg: Arc<ServeConfig>,
    registry: Registry,
    /// The session template as last loaded (at start, or by a reload): every session's
    /// pipeline is made from it in memory.
    template: std::sync::RwLock<Templates>,
    /// What the process builds once: packs, tokenizers, voice codes, engines.
    resources: Resources,
    /// The shared engines and codecs of the template, kept open while the server serves it.
    engines: Mutex<crate::resources::Engines>,
    sessions: Mutex<BTreeMap<u64, Live>>,
    /// Slots taken: sessions admitted and not yet ended.
    taken: AtomicUsize,
    /// Sessions admitted at once (`max_sessions`, or the shared engine's slots when fewer).
    capacity: usize,
    per_ip: Mutex<HashMap<IpAddr, usize>>,
    /// Each client address's allowance of new sessions.
    new_sessions: Mutex<HashMap<IpAddr, crate::audio::pace::TokenBucket>>,
    /// The voices a client may name, checked at start.
    voices: Vec<String>,
    /// Log lines held back, per reason.
    log_throttle: LogThrottle,
    /// Whether a connection closed for sending no request has been logged (once per server).
    quiet_warned: AtomicBool,
    ready: AtomicBool,
    draining: AtomicBool,
    next_id: AtomicU64,
    started: Instant,
    /// Set to close every session now (the drain's end, a second signal).
    close_all: tokio::sync::watch::Sender<bool>,
    active: metrics::Gauge,
    /// The WebRTC endpoint (`None`: `webrtc.enabled: false`).
    webrtc: Option<webrtc::Endpoint>,
    /// The voice-activity detector of `/v1/realtime` (`None`: none).
    vad: Option<Arc<crate::model::vad::Vad>>,
    /// The nonces of Plivo's signed upgrades taken (a replay is refused).
    plivo_nonces: streams::plivo::Nonces,
}

impl Server {
    /// Whether new sessions are taken at all (the models loaded, not draining, no shared engine
    /// failed), whatever the free slots.
    fn accepting(&self) -> bool {
        self.ready.load(Ordering::Acquire)
            && !self.draining.load(Ordering::Acquire)
            && !self.engine_failed()
    }

    /// Whether a shared engine the server holds has failed (until a fresh one replaces it).
    fn engine_failed(&self) -> bool {
        self.engines.lock().map(|e| e.any_failed()).unwrap_or(false)
    }

    /// The session template in force.
    pub(crate) fn template(&self) -> Arc<PipelineSpec> {
        match self.template.read() {
            Ok(t) => t.ogg.clone(),
            Err(p) => p.into_inner().ogg.clone(),
        }
    }

    /// The session template in force with PCM ends, for the transports that convert their own
    /// wire format (derived once per template).
    ///
    /// # Errors
    ///
    /// Why the template has no such ends.
    pub(crate) fn pcm_template(&self) -> Result<Arc<PipelineSpec>, ConfigError> {
        match self.template.read() {
            Ok(t) => t.pcm.clone(),
            Err(p) => p.into_inner().pcm.clone(),
        }
    }

    /// Reads the session template's file again and checks it by building one session of it
    /// (the models loaded through the process's resources: an unchanged pack costs nothing);
    /// sessions that start afterwards get it. A template that fails is refused, logged, and
    /// the one in force is kept.
    fn reload_template(&self) -> Result<(), ConfigError> {
        let template = read_template(&self.cfg, &self.registry, &self.resources)?;
        let engines =
            session::check_template(&self.cfg, &template, &self.registry, &self.resources)?;
        let templates = Templates::of(template, &self.registry);
        if let Ok(mut t) = self.template.write() {
            *t = templates;
        }
        if let Ok(mut e) = self.engines.lock() {
            *e = engines;
        }
        Ok(())
    }
}

/// Loads the configuration and the session template, with the template's stages checked.
fn prepare(
    args: &ServeArgs,
    resources: &Resources,
) -> Result<(ServeConfig, PipelineSpec, Registry), ConfigError> {
    let env: HashMap<String, String> = std::env::vars().collect();
    let cfg = config::load(args.config.as_deref(), Some(env))?;
    let registry = Registry::builtin();
    let template = read_template(&cfg, &registry, resources)?;
    Ok((cfg, template, registry))
}

/// Reads the session template's file (counted: the server reads it at start and at a reload,
/// never per session).
fn read_template(
    cfg: &ServeConfig,
    registry: &Registry,
    resources: &Resources,
) -> Result<PipelineSpec, ConfigError> {
    // The server's DUPLEX__ variables are its settings', not the template's.
    let opts = LoadOptions {
        sets: Vec::new(),
        env: Some(HashMap::new()),
    };
    resources.loads.template_read();
    cfg::load(&cfg.pipeline, &opts, registry)
}

/// `duplex serve`.
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) for a wrong configuration or template, another error (exit 1)
/// when the address cannot be bound.
pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    // The recorder first: what the check loads is counted.
    crate::observe::exporter::recorder()?;
    crate::resources::Loads::register_series();
    let mut resources = crate::app::process_resources(1);
    let (cfg, template, registry) = prepare(args, &resources)?;
    resources.set_prime_cache_bytes(cfg.prime_cache_bytes);
    // A shared LM engine (`engine: shared`) holds one slot per session the server admits.
    resources.set_conversations(cfg.max_sessions);
    // A session built once, not started: every stage of the template is checked and the
    // models are loaded (their graphs, ONNX Runtime) into the process's resources before
    // anything is served; the first client's session finds them there.
    for (again, first) in cfg.keys.duplicates() {
        tracing::warn!(
            "keys: {again} is the same key as {first}, listed twice (keys_file, {}): its \
             `sessions=` and name are those of the first",
            access::KEYS_ENV
        );
    }
    let t0 = Instant::now();
    let engines = session::check_template(&cfg, &template, &registry, &resources)?;
    let capacity = capacity(&cfg, &engines);
    // On the ONNX Runtime the template loaded.
    let vad = realtime::open_detector(&cfg)?;
    if args.check {
        println!(
            "ok: {} (session template {}, {} stages, checked in {:.1} s); would serve {} sessions on {}",
            cfg.file,
            cfg.pipeline.display(),
            template.stages.len(),
            t0.elapsed().as_secs_f64(),
            capacity,
            cfg.address
        );
        return Ok(());
    }
    if let Some(file) = cfg.prime_cache_file.as_ref().filter(|f| f.exists()) {
        load_primed(
            &cfg,
            &template,
            &registry,
            &resources,
            file,
            "`prime_cache_file`",
        )?;
    }
    if cfg.prime_at_start && session::primes_cached(&template) {
        // The first client with the default voice and persona restores its state.
        let took =
            session::prime_at_start(&cfg, &template, &registry, &resources).map_err(|e| {
                anyhow::anyhow!("priming the default session at start (`prime_at_start`): {e:#}")
            })?;
        let (states, bytes) = resources.primed().usage();
        tracing::info!(
            ms = took.as_millis() as u64,
            states,
            bytes,
            "primed the default session's state at start"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("duplex:serve")
        .enable_all()
        .build()?;
    let held = Held {
        template: std::sync::RwLock::new(Templates::of(template, &registry)),
        resources,
        engines: Mutex::new(engines),
        vad,
    };
    rt.block_on(serve(cfg, held, registry, capacity))
}

/// What the server holds across sessions: the parsed template (replaced by a reload), the
/// process's resources, and the shared engines the template opened (kept open while serving).
struct Held {
    template: std::sync::RwLock<Templates>,
    resources: Resources,
    engines: Mutex<crate::resources::Engines>,
    vad: Option<Arc<crate::model::vad::Vad>>,
}

/// The session template, and its form with PCM ends (or why it has none), derived together.
struct Templates {
    ogg: Arc<PipelineSpec>,
    pcm: Result<Arc<PipelineSpec>, ConfigError>,
}

impl Templates {
    fn of(template: PipelineSpec, registry: &Registry) -> Templates {
        let pcm = session::pcm_ends(&template, registry).map(Arc::new);
        Templates {
            ogg: Arc::new(template),
            pcm,
        }
    }
}

/// Sessions the server admits at once: `max_sessions`, or fewer when the template's shared LM
/// engine or codec has fewer slots (each session holds one of each).
fn capacity(cfg: &ServeConfig, engines: &crate::resources::Engines) -> usize {
    let slots = engines.min_slots().unwrap_or(usize::MAX);
    if slots < cfg.max_sessions {
        tracing::warn!(
            max_sessions = cfg.max_sessions,
            slots,
            "a shared engine or codec has fewer slots than `max_sessions`: admitting {slots} sessions at once"
        );
    }
    cfg.max_sessions.min(slots)
}

async fn serve(
    cfg: ServeConfig,
    held: Held,
    registry: Registry,
    capacity: usize,
) -> anyhow::Result<()> {
    let handle = crate::observe::exporter::recorder()?;
    let listener = tokio::net::TcpListener::bind(cfg.address)
        .await
        .map_err(|e| anyhow::anyhow!("listening on {} (`address`): {e}", cfg.address))?;
    let addr = listener.local_addr()?;
    // The media of every WebRTC peer on one UDP socket: by default the HTTP address's own.
    let webrtc = match &cfg.webrtc {
        Some(w) => {
            let udp = if w.address == cfg.address {
                addr
            } else {
                w.address
            };
            let e = webrtc::Endpoint::start(w.clone(), udp)?;
            tracing::info!("WebRTC media on udp://{}", e.local());
            Some(e)
        }
        None => None,
    };
    // SIP's sockets, bound before anything is served: a taken port stops the start.
    let sip = match &cfg.sip {
        Some(s) => {
            let guard = sip::guard::Guard::new(s.allow.clone(), sip::guard::Limits::default());
            let tcp = s.tcp.then_some(s.tcp_limits);
            let e = sip::Endpoint::bind(s.address, tcp, s.public_address, guard).await?;
            tracing::info!(
                "SIP calls on udp://{}{}",
                e.local,
                if e.tcp { " and tcp (same port)" } else { "" }
            );
            Some(e)
        }
        None => None,
    };
    metrics::gauge!(names::SESSIONS_CAPACITY).set(capacity as f64);
    if let Ok(engines) = held.engines.lock() {
        engines.publish();
    }
    let (close_all, _) = tokio::sync::watch::channel(false);
    let server = Arc::new(Server {
        registry,
        template: held.template,
        resources: held.resources,
        engines: held.engines,
        sessions: Mutex::new(BTreeMap::new()),
        taken: AtomicUsize::new(0),
        per_ip: Mutex::new(HashMap::new()),
        new_sessions: Mutex::new(HashMap::new()),
        voices: cfg.usable_voices(),
        log_throttle: LogThrottle::default(),
        quiet_warned: AtomicBool::new(false),
        ready: AtomicBool::new(true),
        draining: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
        started: Instant::now(),
        close_all,
        active: metrics::gauge!(names::SESSIONS_ACTIVE),
        capacity,
        webrtc,
        vad: held.vad,
        plivo_nonces: Default::default(),
        cfg: Arc::new(cfg),
    });
    server.active.set(0.0);
    register_series();
    if let Some(e) = sip {
        tokio::spawn(doors::sip::run(server.clone(), e));
    }
    let health_server = server.clone();
    let health: crate::observe::exporter::Health = Arc::new(move || {
        let failed = health_server.engine_failed();
        (
            !failed,
            json!({
                "ok": !failed,
                "engine_failed": failed,
                "uptime_s": health_server.started.elapsed().as_secs_f64(),
                "sessions": health_server.taken.load(Ordering::Acquire),
            }),
        )
    });
    let app = axum::Router::new()
        .route("/api/chat", get(chat))
        .route("/v1/realtime", get(realtime_chat))
        .route("/twilio/media", get(twilio_media))
        .route("/{provider}/media", get(doors::streams::media))
        .route(
            "/api/webrtc",
            axum::routing::post(doors::webrtc::offer).layer(axum::extract::DefaultBodyLimit::max(
                webrtc::MAX_OFFER_BYTES,
            )),
        )
        .route("/api/webrtc/{token}", doors::webrtc::resource())
        .route("/readyz", get(readyz))
        .route("/api/sessions", get(sessions))
        .route("/api/defaults", get(defaults))
        .route("/api/voices", get(voices))
        .merge(web::routes());
    // A call's resource under this replica's own prefix too (`webrtc.location_base`), for a
    // proxy that routes the prefix here without stripping it.
    let app = match server.cfg.webrtc.as_ref().and_then(|w| w.location_path()) {
        Some(p) => app.route(
            &format!("{p}/api/webrtc/{{token}}"),
            doors::webrtc::resource(),
        ),
        None => app,
    };
    let app = app
        .with_state(server.clone())
        .merge(crate::observe::exporter::routes(handle, Some(health)))
        .fallback(crate::observe::exporter::not_found)
        .layer(axum::middleware::from_fn_with_state(server.clone(), guard));
    tracing::info!(
        "serving {} sessions of {} on ws://{addr}/api/chat, /v1/realtime and /twilio/media",
        server.capacity,
        server.cfg.pipeline.display()
    );
    // Stdout for whoever started us (tests, scripts): where we listen, once bound.
    println!("listening on {addr}");
    tokio::spawn(publish_together(server.clone()));
    tokio::spawn(reload_on_hangup(server.clone()));
    tokio::spawn(recover_engines(server.clone()));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(drain_on_signal(server.clone(), done_tx));
    let mut done = std::pin::pin!(async {
        let _ = done_rx.await;
    });
    accept(&server, listener, app, &mut done).await;
    if let Some(file) = &server.cfg.prime_cache_file {
        crate::app::save_primed_states(&server.resources, file);
    }
    tracing::info!("stopped");
    Ok(())
}

/// Loads a file of primed states into the process's cache, for the template's temporal packs.
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) naming `what` (where the file was named) and the file:
/// unreadable, not a state file, or a state of another pack's temporal graph.
fn load_primed(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    resources: &Resources,
    file: &std::path::Path,
    what: &str,
) -> Result<usize, ConfigError> {
    let spec = session::default_spec(cfg, template, registry, "prime")?;
    crate::app::load_primed_states(resources, file, &spec).map_err(|e| {
        ConfigError::new(
            &cfg.file,
            crate::config::ConfigErrorKind::Read,
            format!("{what}: {e}"),
        )
    })
}

/// Flags of `duplex prime`.
#[derive(Debug, Clone, clap::Args)]
pub struct PrimeArgs {
    /// The server's settings file (as `duplex serve --config`): its session template, pack and
    /// default voice and persona (`text_prompt`, `voice_prompt`; DUPLEX__TEXT_PROMPT=… and
    /// DUPLEX__VOICE_PROMPT=… override them).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The file of primed states to write; states already in it (of the same pack) are kept.
    #[arg(long)]
    pub out: PathBuf,
}

/// `duplex prime`: primes a session of the server's template with its default voice and
/// persona, headless, and writes the state (with those the file held) to `--out`, for
/// `prime_cache_file`. Returns what it says it did.
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) for a wrong configuration or template, a template that does not
/// prime `cached`, or an `--out` of another pack; another error (exit 1) when the priming or
/// the writing fails.
pub fn prime(args: &PrimeArgs) -> anyhow::Result<String> {
    let resources = crate::app::process_resources(1);
    let serve_args = ServeArgs {
        config: args.config.clone(),
        check: false,
    };
    let (cfg, template, registry) = prepare(&serve_args, &resources)?;
    if !session::primes_cached(&template) {
        return Err(ConfigError::new(
            &template.file,
            crate::config::ConfigErrorKind::Build,
            "its `temporal` stage does not keep primed states: set `priming: cached`",
        )
        .into());
    }
    let before = if args.out.exists() {
        load_primed(&cfg, &template, &registry, &resources, &args.out, "--out")?
    } else {
        0
    };
    session::check_template(&cfg, &template, &registry, &resources)?;
    let took = session::prime_at_start(&cfg, &template, &registry, &resources)?;
    let n = resources
        .primed()
        .save(&args.out)
        .map_err(|e| anyhow::anyhow!("writing the primed states: {e}"))?;
    Ok(format!(
        "primed in {:.2} s; {} holds {n} primed states ({} new)\n",
        took.as_secs_f64(),
        args.out.display(),
        n.saturating_sub(before)
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_names_are_allowed_by_address_localhost_or_the_list() {
        let allowed = vec!["voice.example.com".to_string(), "*.example.org".to_string()];
        for ok in [
            "127.0.0.1:8998",
            "10.1.2.3",
            "[::1]:8998",
            "localhost:8998",
            "LOCALHOST",
            "app.localhost",
            "voice.example.com:443",
            "voice.example.com.",
            "a.example.org",
        ] {
            assert!(super::edge::host_allowed(ok, &allowed), "{ok}");
        }
        for bad in [
            "evil.example",
            "voice.example.com.evil.example",
            "example.org",
            "xexample.org",
            "[evil]:80",
            "localhost.evil.example",
        ] {
            assert!(!super::edge::host_allowed(bad, &allowed), "{bad}");
        }
    }

    #[test]
    fn websocket_keys_are_sixteen_bytes_of_base64() {
        assert!(super::doors::websocket_key_ok(b"dGhlIHNhbXBsZSBub25jZQ=="));
        for bad in [
            &b""[..],
            b"not a key",
            b"dGhlIHNhbXBsZSBub25jZQ=",
            b"dGhlIHNhbXBsZSBub25jZQ===",
            b"dGhlIHNhbXBsZSBub25j*Q==",
        ] {
            assert!(!super::doors::websocket_key_ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn query_strings_are_percent_decoded() {
        let q = super::doors::url_pairs(
            "text_prompt=%3Csystem%3E+Hi%21&voice_prompt=a.wav&x&bad=%zz&end=%4",
        );
        assert_eq!(q[0], ("text_prompt".into(), "<system> Hi!".into()));
        assert_eq!(q[1], ("voice_prompt".into(), "a.wav".into()));
        assert_eq!(q[2], ("x".into(), "".into()));
        assert_eq!(q[3], ("bad".into(), "%zz".into()));
        assert_eq!(q[4], ("end".into(), "%4".into()));
    }
}
