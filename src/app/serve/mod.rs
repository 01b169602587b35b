//! `duplex serve`: conversations over the network (the Moshi WebSocket protocol, the OpenAI
//! Realtime API, Twilio's media streams, WebRTC), one session pipeline per client, built from a
//! YAML session template.
//!
//! HTTP and WebSocket are axum's (hyper on a tokio runtime); this module decides who is
//! admitted (a slot free, the models loaded, not draining, the client's address under its
//! connection limit and its rate of new sessions), answers only to the host names it serves
//! (DNS rebinding), puts the security headers on every response, serves `/readyz`, `/healthz`,
//! `/api/sessions` and `/metrics`, and drains on SIGTERM. Refusals are counted by reason and
//! logged at most once per reason per [`LOG_EVERY`]. What happens on one connection is
//! [`session`]'s business; what a session computes is its pipeline's. Knows no model internals.

mod access;
pub mod config;
mod kyutai;
pub mod realtime;
mod session;
mod twilio;
mod web;
mod webrtc;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, RawQuery, State, WebSocketUpgrade};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::config::{self as cfg, ConfigError, LoadOptions, PipelineSpec};
use crate::observe::names;
use crate::resources::Resources;
use crate::stages::Registry;

pub use config::{load as load_config, ServeConfig};

/// The kernel's send buffer per connection, bytes (about 2 s of the agent's audio).
const SEND_BUFFER: usize = 32 * 1024;
/// What may wait in a WebSocket's own write buffer when the client does not read (pongs,
/// close frames, the last messages): past it a write fails and the session ends.
const WRITE_BUFFER_MAX: usize = 256 * 1024;
/// A refusal of one reason is logged at most once per this long (with the count held back).
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);
/// Client addresses whose rate of new sessions is tracked at once; past it, the addresses
/// whose allowance is whole again are forgotten.
const RATE_TABLE_MAX: usize = 10_000;
/// The security headers of every response.
const SECURITY_HEADERS: [(&str, &str); 4] = [
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    (
        "content-security-policy",
        "default-src 'self'; connect-src 'self'; img-src 'self' data:; media-src 'self' blob:; \
         worker-src 'self' blob:; object-src 'none'; base-uri 'none'; form-action 'self'; \
         frame-ancestors 'none'",
    ),
];

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
}

/// A reserved session slot (and one of its key's sessions), given back when dropped.
pub(crate) struct Admission {
    server: Arc<Server>,
    key: Option<KeyHold>,
}

/// One of a key's sessions, given back when dropped.
pub(crate) struct KeyHold {
    keys: Arc<access::Keys>,
    index: usize,
}

impl KeyHold {
    /// The key's name.
    pub(crate) fn name(&self) -> &str {
        &self.keys.key(self.index).name
    }
}

impl Drop for KeyHold {
    fn drop(&mut self) {
        self.keys.release(self.index);
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let left = self.server.taken.fetch_sub(1, Ordering::AcqRel) - 1;
        self.server.active.set(left as f64);
    }
}

/// One open TCP connection of a client address, counted until dropped.
pub(crate) struct Connection {
    server: Arc<Server>,
    ip: IpAddr,
}

impl Drop for Connection {
    fn drop(&mut self) {
        metrics::gauge!(names::CONNECTIONS_OPEN).decrement(1.0);
        if let Ok(mut m) = self.server.per_ip.lock() {
            if let Some(n) = m.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&self.ip);
                }
            }
        }
    }
}

/// Lines of one reason logged at most once per [`LOG_EVERY`]: a burst of refusals, or a client
/// repeating a mistake, costs one line, not one per request.
#[derive(Default)]
pub(crate) struct LogThrottle(Mutex<HashMap<&'static str, (Instant, u64)>>);

impl LogThrottle {
    /// Whether a line of `reason` may be logged now; `Some(n)` with the lines held back since
    /// the last one.
    pub(crate) fn allow(&self, reason: &'static str) -> Option<u64> {
        let mut m = self.0.lock().ok()?;
        let now = Instant::now();
        match m.get_mut(reason) {
            Some((last, held)) if now.duration_since(*last) < LOG_EVERY => {
                *held += 1;
                None
            }
            Some((last, held)) => {
                *last = now;
                Some(std::mem::take(held))
            }
            None => {
                m.insert(reason, (now, 0));
                Some(0)
            }
        }
    }
}

impl Server {
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

    /// A refusal before the upgrade, counted by `reason` and logged (at most once per reason
    /// per [`LOG_EVERY`]).
    fn refusal(
        &self,
        ip: IpAddr,
        reason: &'static str,
        status: StatusCode,
        retry_after: u64,
        msg: String,
    ) -> Box<Response> {
        metrics::counter!(names::SESSIONS_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = self.log_throttle.allow(reason) {
            let more = if held > 0 {
                format!(" ({held} more of this reason since the last line)")
            } else {
                String::new()
            };
            tracing::info!(client = %ip, reason, "refused: {msg}{more}");
        }
        Box::new(
            (
                status,
                [(header::RETRY_AFTER, retry_after.to_string())],
                format!("{msg}\n"),
            )
                .into_response(),
        )
    }

    /// Takes one new session from `ip`'s allowance (`limits.sessions_per_minute_per_ip`,
    /// `limits.session_burst_per_ip`); `false` when it is spent.
    fn take_session_allowance(&self, ip: IpAddr) -> bool {
        let ip = access::group(ip);
        let Ok(mut m) = self.new_sessions.lock() else {
            return true;
        };
        let now = Instant::now();
        if m.len() >= RATE_TABLE_MAX && !m.contains_key(&ip) {
            m.retain(|_, b| !b.is_full_at(now));
        }
        let l = &self.cfg.limits;
        m.entry(ip)
            .or_insert_with(|| {
                crate::audio::pace::TokenBucket::new(
                    l.sessions_per_minute_per_ip / 60.0,
                    l.session_burst_per_ip,
                )
            })
            .take_at(1.0, now)
    }

    /// Counts a new connection from `peer` (an IPv6 address by its /64), or `None` when that
    /// address has `max_connections_per_ip` open already (a trusted proxy has no such limit).
    fn connect(self: &Arc<Self>, peer: IpAddr) -> Option<Connection> {
        let ip = access::group(peer);
        let proxy = self.cfg.trusted_proxies.iter().any(|c| c.contains(peer));
        let mut m = self.per_ip.lock().ok()?;
        let n = m.entry(ip).or_insert(0);
        // A trusted proxy carries many clients: their own limits apply at admission.
        if *n >= self.cfg.max_connections_per_ip && !proxy {
            return None;
        }
        *n += 1;
        metrics::gauge!(names::CONNECTIONS_OPEN).increment(1.0);
        Some(Connection {
            server: self.clone(),
            ip,
        })
    }

    /// Reserves a session slot for a client at `ip`, or says why not (and counts it).
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Admission, Box<Response>> {
        if self.draining.load(Ordering::Acquire) {
            return Err(self.refusal(
                ip,
                "draining",
                StatusCode::SERVICE_UNAVAILABLE,
                30,
                "this server is shutting down: try another".into(),
            ));
        }
        if !self.ready.load(Ordering::Acquire) {
            return Err(self.refusal(
                ip,
                "not_ready",
                StatusCode::SERVICE_UNAVAILABLE,
                5,
                "the models are still loading".into(),
            ));
        }
        if !self.take_session_allowance(ip) {
            let l = &self.cfg.limits;
            return Err(self.refusal(
                ip,
                "rate",
                StatusCode::TOO_MANY_REQUESTS,
                (60.0 / l.sessions_per_minute_per_ip).ceil() as u64,
                format!(
                    "too many new sessions from {ip} (limits.sessions_per_minute_per_ip = {}, \
                     limits.session_burst_per_ip = {})",
                    l.sessions_per_minute_per_ip, l.session_burst_per_ip
                ),
            ));
        }
        let max = self.capacity;
        match self
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t < max).then_some(t + 1)
            }) {
            Ok(t) => {
                self.active.set((t + 1) as f64);
                Ok(Admission {
                    server: self.clone(),
                    key: None,
                })
            }
            Err(_) => Err(self.refusal(
                ip,
                "full",
                StatusCode::SERVICE_UNAVAILABLE,
                5,
                format!("all {max} session slots are in use: try again shortly"),
            )),
        }
    }

    /// Admits a client: one of its key's sessions (when it presented a key) and a slot.
    fn admit_client(self: &Arc<Self>, client: &Client) -> Result<Admission, Box<Response>> {
        let key = match client.key {
            Some(i) if !self.cfg.keys.hold(i) => {
                let k = self.cfg.keys.key(i);
                return Err(self.refusal(
                    client.ip,
                    "key_limit",
                    StatusCode::TOO_MANY_REQUESTS,
                    5,
                    format!(
                        "key {} holds its {} session(s) already",
                        k.name,
                        k.max_sessions.unwrap_or(0)
                    ),
                ));
            }
            Some(i) => Some(KeyHold {
                keys: self.cfg.keys.clone(),
                index: i,
            }),
            None => None,
        };
        let mut admission = self.admit(client.ip)?;
        admission.key = key;
        Ok(admission)
    }

    fn free_slots(&self) -> usize {
        self.capacity
            .saturating_sub(self.taken.load(Ordering::Acquire))
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
    let mut resources = Resources::new(1);
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
    };
    rt.block_on(serve(cfg, held, registry, capacity))
}

/// What the server holds across sessions: the parsed template (replaced by a reload), the
/// process's resources, and the shared engines the template opened (kept open while serving).
struct Held {
    template: std::sync::RwLock<Templates>,
    resources: Resources,
    engines: Mutex<crate::resources::Engines>,
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
        cfg: Arc::new(cfg),
    });
    server.active.set(0.0);
    register_series();
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
        .route(
            "/api/webrtc",
            axum::routing::post(webrtc::offer).layer(axum::extract::DefaultBodyLimit::max(
                webrtc::MAX_OFFER_BYTES,
            )),
        )
        .route(
            "/api/webrtc/{token}",
            axum::routing::delete(webrtc::hangup)
                .post(webrtc::again)
                .patch(webrtc::again),
        )
        .route("/readyz", get(readyz))
        .route("/api/sessions", get(sessions))
        .route("/api/defaults", get(defaults))
        .route("/api/voices", get(voices))
        .merge(web::routes())
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
    let resources = Resources::new(1);
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

/// Publishes, every second, what the sessions' private monitors show together: the real-time
/// factor and each stage's utilization as the highest over live sessions, and each stage's
/// verdict as growth or contention when any session shows it (steady when none does).
async fn publish_together(server: Arc<Server>) {
    use crate::observe::diagnose::Pattern;
    let rtf = metrics::gauge!(names::REALTIME_FACTOR);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let stages: Vec<String> = server
            .template()
            .stages
            .iter()
            .map(|s| s.name.clone())
            .collect();
        let monitors: Vec<_> = match server.sessions.lock() {
            Ok(m) => m.values().filter_map(|l| l.monitor.clone()).collect(),
            Err(_) => continue,
        };
        rtf.set(
            monitors
                .iter()
                .map(|m| m.realtime_factor())
                .fold(0.0, f64::max),
        );
        for stage in &stages {
            let mut util = 0.0f64;
            let mut seen = [false; 3];
            for m in &monitors {
                if let Some((_, u)) = m.utilizations().into_iter().find(|(n, _)| n == stage) {
                    util = util.max(u);
                }
                if let Some((_, p)) = m.verdicts().into_iter().find(|(n, _)| n == stage) {
                    if let Some(i) = Pattern::ALL.iter().position(|x| *x == p) {
                        seen[i] = true;
                    }
                }
            }
            metrics::gauge!(names::STAGE_UTILIZATION, "stage" => stage.clone()).set(util);
            // ALL is steady, growth, contention.
            let steady = !seen[1] && !seen[2];
            for (i, p) in Pattern::ALL.iter().enumerate() {
                let on = if i == 0 { steady } else { seen[i] };
                metrics::gauge!(names::LATENCY_PATTERN, "stage" => stage.clone(), "pattern" => p.name())
                    .set(if on { 1.0 } else { 0.0 });
            }
        }
    }
}

/// The client of a request: its address (behind a trusted proxy, the one the proxy forwarded)
/// and the key it presented, when keys are configured and it presented a good one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client {
    ip: IpAddr,
    /// Whether `ip` came from a proxy's header.
    forwarded: bool,
    key: Option<usize>,
}

/// Whether `path` needs a key (when keys are configured): the API (`/api/`, `/v1/`), and
/// `/metrics` with `protect_metrics`. The page's files, `/healthz` and `/readyz` never do, nor
/// `/twilio/media`, which Twilio's signature guards instead.
fn protected(path: &str, cfg: &ServeConfig) -> bool {
    path.starts_with("/api/")
        || path.starts_with("/v1/")
        || (path == "/metrics" && cfg.protect_metrics)
}

/// Every request, before any route: its `Host` must be one this server answers to (an IP
/// address, `localhost`, or a name of `allowed_hosts`: 421 otherwise, so a web page that
/// rebinds its own name to this address reads nothing); a browser's `Origin` must be allowed
/// (403); with keys configured, the API needs one (401, or 429 from the route for a key at its
/// limit). Every refusal is counted by reason and logged at most once per reason per
/// [`LOG_EVERY`], never with the key. Every response gets the security headers.
async fn guard(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let cfg = &server.cfg;
    let ip = access::client_ip(
        peer.ip(),
        req.headers(),
        &cfg.trusted_proxies,
        cfg.forwarded_header,
    );
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    let refuse = |reason: &'static str, status: StatusCode, msg: &'static str| {
        metrics::counter!(names::HTTP_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = server.log_throttle.allow(reason) {
            tracing::info!(client = %ip, reason, held, "refused a request: {msg}");
        }
        let mut r = (status, format!("{msg}\n")).into_response();
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"duplex\""),
            );
        }
        r
    };
    let mut res = 'decided: {
        if host
            .as_deref()
            .is_some_and(|h| !host_allowed(h, &cfg.allowed_hosts))
        {
            break 'decided refuse(
                "host",
                StatusCode::MISDIRECTED_REQUEST,
                "this server does not serve that host name (`allowed_hosts`)",
            );
        }
        let origin = req
            .headers()
            .get(header::ORIGIN)
            .map(|o| String::from_utf8_lossy(o.as_bytes()).into_owned());
        let opens_sessions = matches!(
            req.uri().path(),
            "/api/chat" | "/v1/realtime" | "/api/webrtc"
        );
        if let Some(o) = origin.filter(|_| opens_sessions) {
            if !access::origin_allowed(&o, host.as_deref(), &cfg.allowed_origins) {
                break 'decided refuse(
                    "origin",
                    StatusCode::FORBIDDEN,
                    "a page of this origin may not open sessions here (`allowed_origins`)",
                );
            }
        }
        let mut key = None;
        if cfg.keys.any() && protected(req.uri().path(), cfg) {
            let presented = access::presented(req.headers(), req.uri().query());
            match cfg.keys.check(presented.as_deref()) {
                Ok(i) => key = Some(i),
                Err(d) => {
                    break 'decided refuse(
                        d.reason(),
                        StatusCode::UNAUTHORIZED,
                        match d {
                            access::Denied::Missing => {
                                "a key is needed: the kyutai-api-key header, the auth_id query \
                                 parameter, or Authorization: Bearer"
                            }
                            access::Denied::Unknown => "this key is not accepted here",
                        },
                    )
                }
            }
        }
        req.extensions_mut().insert(Client {
            ip,
            forwarded: ip != peer.ip(),
            key,
        });
        next.run(req).await
    };
    let h = res.headers_mut();
    for (k, v) in SECURITY_HEADERS {
        h.insert(k, header::HeaderValue::from_static(v));
    }
    res
}

/// Whether `host` (a `Host` header: name or address, maybe with a port) is served: an IP
/// address (no page can rebind one), `localhost` and its subdomains, or a name of `allowed`
/// (`*.example.com` allows the subdomains of example.com).
fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let host = host.trim().to_ascii_lowercase();
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return rest
            .split(']')
            .next()
            .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok());
    } else {
        host.rsplit_once(':')
            .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
            .map_or(host.as_str(), |(n, _)| n)
    };
    let name = name.trim_end_matches('.');
    if name.parse::<IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    allowed.iter().any(|a| match a.strip_prefix("*.") {
        Some(domain) => name
            .strip_suffix(domain)
            .is_some_and(|sub| sub.ends_with('.') && sub.len() > 1),
        None => a.trim_end_matches('.') == name,
    })
}

/// Every session series exists from the start, at zero: rates and alerts need no first event.
fn register_series() {
    metrics::counter!(names::SESSIONS_ADMITTED).absolute(0);
    for reason in [
        "full",
        "draining",
        "per_ip",
        "not_ready",
        "rate",
        "key_limit",
    ] {
        metrics::counter!(names::SESSIONS_REFUSED, "reason" => reason).absolute(0);
    }
    for outcome in session::Outcome::ALL {
        metrics::counter!(names::SESSIONS_ENDED, "outcome" => outcome.name()).absolute(0);
    }
    for direction in ["in", "out"] {
        metrics::counter!(names::SESSION_BYTES, "direction" => direction).absolute(0);
        metrics::counter!(names::SESSION_DROPPED, "direction" => direction).absolute(0);
    }
    for kind in session::PROTOCOL_ERRORS {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => kind).absolute(0);
    }
    metrics::counter!(names::SESSION_SILENCE).absolute(0);
    metrics::counter!(names::SESSION_LATE_FRAMES).absolute(0);
    for reason in ["no_request", "error"] {
        metrics::counter!(names::CONNECTIONS_CLOSED, "reason" => reason).absolute(0);
    }
    metrics::counter!(names::SESSION_STALLS).absolute(0);
    for reason in [
        "host",
        "bad_request",
        "origin",
        "missing_key",
        "unknown_key",
        "signature",
    ] {
        metrics::counter!(names::HTTP_REFUSED, "reason" => reason).absolute(0);
    }
    metrics::counter!(names::OPUS_REFUSED).absolute(0);
    for (direction, outcome) in webrtc::driver::PACKET_SERIES {
        metrics::counter!(names::WEBRTC_PACKETS, "direction" => direction, "outcome" => outcome)
            .absolute(0);
    }
    metrics::gauge!(names::WEBRTC_PEERS).set(0.0);
}

/// Accepts connections until `done`: each one counted against its address's limit (one over
/// it gets 429 and is closed), with small frames sent at once, a bounded kernel send buffer (a
/// client that stops reading is seen within seconds), and the request head due within
/// `limits.handshake_timeout_s` (a connection that never says anything is closed).
async fn accept(
    server: &Arc<Server>,
    listener: tokio::net::TcpListener,
    app: axum::Router,
    done: &mut (impl std::future::Future<Output = ()> + Unpin),
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt;
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(server.cfg.limits.handshake_timeout);
    let refuser = server.clone();
    let over_limit = axum::Router::new().fallback(
        move |ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
            let limit = "max_connections_per_ip";
            *refuser.refusal(
                peer.ip(),
                "per_ip",
                StatusCode::TOO_MANY_REQUESTS,
                5,
                format!("too many connections from {} ({limit})", peer.ip()),
            )
        },
    );
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut *done => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let _ = socket2::SockRef::from(&tcp).set_send_buffer_size(SEND_BUFFER);
        // Shared with the session when the connection becomes one: an upgraded connection
        // leaves hyper, and stays counted until the session ends.
        let conn = server.connect(peer.ip()).map(Arc::new);
        let routes = if conn.is_some() {
            app.clone()
        } else {
            over_limit.clone()
        };
        let held = conn.clone();
        let svc = routes.map_request(move |r: hyper::Request<hyper::body::Incoming>| {
            let mut r = r.map(axum::body::Body::new);
            r.extensions_mut().insert(ConnectInfo(peer));
            if let Some(c) = &held {
                r.extensions_mut().insert(c.clone());
            }
            r
        });
        let serving = http
            .clone()
            .keep_alive(conn.is_some())
            .serve_connection(
                TokioIo::new(tcp),
                hyper_util::service::TowerToHyperService::new(svc),
            )
            .with_upgrades();
        let quiet = server.clone();
        tokio::spawn(async move {
            if let Err(e) = serving.await {
                let reason = if e.is_timeout() {
                    "no_request"
                } else {
                    "error"
                };
                metrics::counter!(names::CONNECTIONS_CLOSED, "reason" => reason).increment(1);
                if reason == "no_request" && !quiet.quiet_warned.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        client = %peer,
                        "closed a connection that sent no request within limits.handshake_timeout_s \
                         (further ones are only counted: {})",
                        names::CONNECTIONS_CLOSED
                    );
                } else {
                    tracing::debug!(client = %peer, "connection: {e}");
                }
            }
            drop(conn);
        });
    }
}

/// A shared engine that failed is replaced: its sessions have ended with an error, `/healthz`
/// and `/readyz` say 503 meanwhile, and one session of the template is built again to open a
/// fresh engine (the next client's session would open one too).
async fn recover_engines(server: Arc<Server>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        if !server.engine_failed() {
            continue;
        }
        let s = server.clone();
        let r = tokio::task::spawn_blocking(move || {
            let template = s.template();
            session::check_template(&s.cfg, &template, &s.registry, &s.resources)
        })
        .await;
        match r {
            Ok(Ok(engines)) => {
                if let Ok(mut e) = server.engines.lock() {
                    *e = engines;
                }
                tracing::warn!("a fresh shared engine replaces the one that failed");
            }
            Ok(Err(e)) => tracing::error!("the failed engine could not be replaced yet: {e}"),
            Err(e) => tracing::error!("replacing the failed engine: {e}"),
        }
    }
}

/// SIGHUP: the session template is read and checked again; new sessions get it, live ones keep
/// theirs. A template that fails is refused (logged, counted) and the one in force is kept.
async fn reload_on_hangup(server: Arc<Server>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("no SIGHUP handler: the session template is read at start only");
        return;
    };
    while hup.recv().await.is_some() {
        let s = server.clone();
        let t0 = Instant::now();
        let r = tokio::task::spawn_blocking(move || s.reload_template()).await;
        match r {
            Ok(Ok(())) => {
                metrics::counter!(names::RELOADS, "result" => "applied").increment(1);
                tracing::info!(
                    template = %server.cfg.pipeline.display(),
                    "reloaded the session template in {:.2} s: new sessions get it",
                    t0.elapsed().as_secs_f64()
                );
            }
            Ok(Err(e)) => {
                metrics::counter!(names::RELOADS, "result" => "rejected").increment(1);
                tracing::error!("reload refused, the session template in force is kept: {e}");
            }
            Err(e) => tracing::error!("reload failed: {e}"),
        }
    }
}

/// SIGINT/SIGTERM: stop admitting, let sessions run up to `drain_timeout`, close them, and
/// end the server. A second signal closes them at once.
async fn drain_on_signal(server: Arc<Server>, done: tokio::sync::oneshot::Sender<()>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("signal handlers could not be installed: SIGTERM ends the server at once");
        return;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    server.draining.store(true, Ordering::Release);
    let live = server.taken.load(Ordering::Acquire);
    let timeout = server.cfg.drain_timeout;
    tracing::warn!(
        sessions = live,
        "draining: no new sessions; live ones may run {:.0} s (signal again to close them now)",
        timeout.as_secs_f64()
    );
    let all_ended = async {
        while server.taken.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        _ = all_ended => {}
        _ = tokio::time::sleep(timeout) => {
            tracing::warn!("drain timeout: closing the live sessions");
        }
        _ = int.recv() => tracing::warn!("second signal: closing the live sessions now"),
        _ = term.recv() => tracing::warn!("second signal: closing the live sessions now"),
    }
    let _ = server.close_all.send(true);
    // Sessions close their sockets and pipelines; give them a bounded time.
    let closed = async {
        while server.taken.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .is_err()
    {
        tracing::error!("sessions did not close within 10 s; exiting anyway");
    }
    let _ = done.send(());
}

async fn chat(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    RawQuery(query): RawQuery,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let query = query_pairs(query);
    let proto = kyutai::Kyutai::new(query);
    open_session(server, peer, client, conn, &headers, ws, proto)
}

/// `GET /v1/realtime`: the OpenAI Realtime API ([`realtime`]); `event_names=ga|beta|both` in
/// the query chooses the server events' names (the API's `model` parameter is ignored).
async fn realtime_chat(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    RawQuery(query): RawQuery,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let names = match query_pairs(query)
        .into_iter()
        .find(|(k, _)| k == "event_names")
        .map(|(_, v)| realtime::Names::parse(&v))
        .transpose()
    {
        Ok(n) => n,
        Err(m) => {
            metrics::counter!(names::HTTP_REFUSED, "reason" => "bad_request").increment(1);
            return (StatusCode::BAD_REQUEST, format!("{m}\n")).into_response();
        }
    };
    let proto = realtime::Realtime::new(server.cfg.clone(), names);
    // Browsers name the API's subprotocol (and pass their key in another one).
    let ws = ws.protocols(["realtime"]);
    open_session(server, peer, client, conn, &headers, ws, proto)
}

/// `GET /twilio/media`: a phone call through Twilio's Media Streams ([`twilio`]). Twilio
/// presents no key of ours: with `twilio_auth_token` the request must carry Twilio's signature;
/// a server with keys and no token refuses calls.
async fn twilio_media(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let cfg = &server.cfg;
    let refuse = |status: StatusCode, reason: &'static str, msg: &'static str| {
        metrics::counter!(names::HTTP_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = server.log_throttle.allow(reason) {
            tracing::info!(client = %client.ip, reason, held, "refused a call: {msg}");
        }
        (status, format!("{msg}\n")).into_response()
    };
    match &cfg.twilio_auth_token {
        Some(token) => {
            let url = cfg.twilio_url.clone().unwrap_or_else(|| {
                let host = headers
                    .get(header::HOST)
                    .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
                    .unwrap_or_default();
                format!("wss://{host}{uri}")
            });
            let signature = headers
                .get("x-twilio-signature")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if !twilio::signature_ok(token, &url, signature) {
                return refuse(
                    StatusCode::FORBIDDEN,
                    "signature",
                    "not signed by Twilio for this URL (X-Twilio-Signature, `twilio_url`)",
                );
            }
        }
        None if cfg.keys.any() => {
            return refuse(
                StatusCode::FORBIDDEN,
                "signature",
                "this server has keys: calls need `twilio_auth_token` to be checked",
            );
        }
        None => {}
    }
    let server = server.clone();
    open_session(
        server,
        peer,
        client,
        conn,
        &headers,
        ws,
        twilio::Twilio::new(),
    )
}

/// A query's pairs, the empty names left out.
fn query_pairs(query: Option<String>) -> Vec<(String, String)> {
    query
        .map(|q| {
            url_pairs(&q)
                .into_iter()
                .filter(|(k, _)| !k.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Admits a WebSocket client (its key's and address's limits, the server's capacity) and runs
/// its session in `proto`.
fn open_session<P: session::Protocol>(
    server: Arc<Server>,
    peer: SocketAddr,
    client: Client,
    conn: Arc<Connection>,
    headers: &axum::http::HeaderMap,
    ws: WebSocketUpgrade,
    proto: P,
) -> Response {
    // RFC 6455 4.1: the key is 16 random bytes in base64; anything else is not a WebSocket
    // client.
    let key = headers.get(header::SEC_WEBSOCKET_KEY).map(|k| k.as_bytes());
    if !key.is_some_and(websocket_key_ok) {
        metrics::counter!(names::HTTP_REFUSED, "reason" => "bad_request").increment(1);
        return (
            StatusCode::BAD_REQUEST,
            "Sec-WebSocket-Key must be 16 bytes in base64 (RFC 6455)\n",
        )
            .into_response();
    }
    // Behind a proxy, the client's address (its port is the proxy's business: 0).
    let peer = if client.forwarded {
        SocketAddr::new(client.ip, 0)
    } else {
        peer
    };
    let admission = match server.admit_client(&client) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let limit = server.cfg.limits.max_message_bytes;
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .max_write_buffer_size(WRITE_BUFFER_MAX)
        .on_failed_upgrade(move |e| tracing::info!(client = %peer, "WebSocket upgrade failed: {e}"))
        .on_upgrade(move |socket| async move {
            session::run(server, session::halves(socket), peer, proto, admission).await;
            drop(conn);
        })
}

/// A `Sec-WebSocket-Key` as RFC 6455 has it: 16 bytes in base64, so 22 characters of the
/// alphabet and `==`.
fn websocket_key_ok(key: &[u8]) -> bool {
    let b64 = |c: &u8| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/';
    key.len() == 24 && key[..22].iter().all(b64) && &key[22..] == b"=="
}

/// `k=v&k2=v2`, percent-decoded (`+` is a space).
fn url_pairs(q: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(q.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

async fn readyz(State(server): State<Arc<Server>>) -> Response {
    let ready = server.ready.load(Ordering::Acquire);
    let draining = server.draining.load(Ordering::Acquire);
    let free = server.free_slots();
    let failed = server.engine_failed();
    let ok = ready && !draining && free > 0 && !failed;
    let body = json!({
        "ready": ok,
        "engine_failed": failed,
        "models_loaded": ready,
        "draining": draining,
        "sessions": server.taken.load(Ordering::Acquire),
        "capacity": server.capacity,
    });
    if ok {
        (StatusCode::OK, axum::Json(body)).into_response()
    } else {
        let retry = if draining { 30 } else { 5 };
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, retry.to_string())],
            axum::Json(body),
        )
            .into_response()
    }
}

/// `/api/defaults`: what a client that sends no query parameters gets. The default persona's
/// text is the operator's (a system prompt): only whether there is one is published.
async fn defaults(State(server): State<Arc<Server>>) -> Response {
    let c = &server.cfg;
    axum::Json(json!({
        "text_temperature": c.sampling.text_temperature,
        "text_topk": c.sampling.text_top_k,
        "audio_temperature": c.sampling.audio_temperature,
        "audio_topk": c.sampling.audio_top_k,
        "pad_mult": c.sampling.pad_mult,
        "repetition_penalty": c.sampling.repetition_penalty,
        "repetition_penalty_context": c.sampling.repetition_penalty_context,
        "max_steps": c.max_steps,
        "default_persona": !c.text_prompt.trim().is_empty(),
        "voice_prompt": c.voice_prompt,
        "max_prompt_tokens": c.limits.max_prompt_tokens,
        "webrtc": server.webrtc.as_ref().map(|w| w.page_settings()),
    }))
    .into_response()
}

/// `/api/voices`: the voices a client may name with `voice_prompt` (the WAV files of the voices
/// folder that passed the voice check at start).
async fn voices(State(server): State<Arc<Server>>) -> Response {
    axum::Json(json!({ "voices": server.voices })).into_response()
}

async fn sessions(State(server): State<Arc<Server>>) -> Response {
    use crate::session::LinkStats as L;
    // Clients' addresses only to a caller who presented a key, or on a loopback server.
    let show_clients = server.cfg.keys.any() || server.cfg.address.ip().is_loopback();
    let list: Vec<serde_json::Value> = match server.sessions.lock() {
        Ok(m) => m
            .iter()
            .map(|(id, l)| {
                let status = l.handle.as_ref().map(|h| h.control().status());
                let frames = status
                    .as_ref()
                    .and_then(|s| {
                        s.values()
                            .find_map(|st| st.get("agent_frames").map(|v| v.to_json()))
                    })
                    .unwrap_or(json!(0));
                // How the session's state was primed (cached, chunked, stepped), and how long
                // it took.
                let find = |k: &str| {
                    status
                        .as_ref()
                        .and_then(|s| s.values().find_map(|st| st.get(k).map(|v| v.to_json())))
                };
                let priming = json!({ "how": find("priming"), "ms": find("priming_ms") });
                let verdicts: serde_json::Map<String, serde_json::Value> = l
                    .monitor
                    .as_ref()
                    .map(|m| {
                        m.verdicts()
                            .into_iter()
                            .map(|(s, p)| (s, json!(p.name())))
                            .collect()
                    })
                    .unwrap_or_default();
                json!({
                    "id": id,
                    "client": show_clients.then(|| l.peer.to_string()),
                    "key": l.key,
                    "age_s": l.started.elapsed().as_secs_f64(),
                    "ready": l.handle.as_ref().is_some_and(|h| h.is_ready()),
                    "frames": frames,
                    "priming": priming,
                    "realtime_factor": l.monitor.as_ref().map(|m| m.realtime_factor()),
                    "verdicts": verdicts,
                    "silence_frames": L::get(&l.stats.silence_frames),
                    "late_frames": L::get(&l.stats.late_frames),
                    "dropped_out": L::get(&l.stats.dropped_out),
                    "bytes_in": L::get(&l.stats.bytes_in),
                    "bytes_out": L::get(&l.stats.bytes_out),
                    "server_latency_ms": L::get(&l.stats.latency_us) as f64 / 1000.0,
                    "transport": l.transport.as_ref().map(|t| t()),
                })
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    axum::Json(json!({
        "sessions": list,
        "capacity": server.capacity,
        "draining": server.draining.load(Ordering::Acquire),
    }))
    .into_response()
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
            assert!(super::host_allowed(ok, &allowed), "{ok}");
        }
        for bad in [
            "evil.example",
            "voice.example.com.evil.example",
            "example.org",
            "xexample.org",
            "[evil]:80",
            "localhost.evil.example",
        ] {
            assert!(!super::host_allowed(bad, &allowed), "{bad}");
        }
    }

    #[test]
    fn websocket_keys_are_sixteen_bytes_of_base64() {
        assert!(super::websocket_key_ok(b"dGhlIHNhbXBsZSBub25jZQ=="));
        for bad in [
            &b""[..],
            b"not a key",
            b"dGhlIHNhbXBsZSBub25jZQ=",
            b"dGhlIHNhbXBsZSBub25jZQ===",
            b"dGhlIHNhbXBsZSBub25j*Q==",
        ] {
            assert!(!super::websocket_key_ok(bad), "{bad:?}");
        }
    }

    #[test]
    fn query_strings_are_percent_decoded() {
        let q =
            super::url_pairs("text_prompt=%3Csystem%3E+Hi%21&voice_prompt=a.wav&x&bad=%zz&end=%4");
        assert_eq!(q[0], ("text_prompt".into(), "<system> Hi!".into()));
        assert_eq!(q[1], ("voice_prompt".into(), "a.wav".into()));
        assert_eq!(q[2], ("x".into(), "".into()));
        assert_eq!(q[3], ("bad".into(), "%zz".into()));
        assert_eq!(q[4], ("end".into(), "%4".into()));
    }
}
