//! One client's connection: its session pipeline built from the template with the client's
//! choices, the handshake once the pipeline is primed, and the bridge between the WebSocket and
//! the pipeline's session stages until one side ends; then the outcome, counted.
//!
//! Message kinds (PROTOCOL.md): 0 handshake (always the first message, as soon as the session
//! is primed, also before an error), 4 metadata (right after it: Kyutai's `ServerInfo` fields
//! and duplex's own, the session id among them), 1 audio, 2 text, 5 error are sent; 1 is read, 3
//! (control) and unknown kinds are ignored (counted, logged once). The socket is read from the
//! upgrade on, also while the session primes: a client that leaves stops the priming at its next
//! step, and what it sends meanwhile goes to the session's bounded input queue (dropped and
//! counted when full). Every message, pings included, is paid from a token bucket
//! (`limits.max_messages_per_s`): a flood closes the session (1008, counted). Writing has its own
//! task: a client that stops reading stalls only that task, whose queue is bounded (the
//! pipeline's audio is then dropped and counted), whose socket buffer is capped, and which closes
//! the session after `stall_timeout`.
//!
//! What a client is told of a failure names its own mistake (a parameter, its audio) and nothing
//! of the server's files: the details go to the log, under the session's id. Close codes: 1000
//! normal, 1001 closed by the server, 1007 the client's audio is not Ogg/Opus, 1008 a policy (a
//! refused parameter, a flood, a client that stopped reading), 1009 a message too large, 1011 a
//! failure of the server's.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::{SinkExt, StreamExt};

use super::{Admission, Live, ServeConfig, Server};
use crate::config::{self as cfg, ConfigError, PipelineSpec};
use crate::observe::names;
use crate::session::{LinkStats, Outbound};
use crate::stages::Registry;

/// Kinds of the protocol's messages.
const HANDSHAKE: u8 = 0;
const AUDIO: u8 = 1;
const TEXT: u8 = 2;
const CONTROL: u8 = 3;
const METADATA: u8 = 4;
const ERROR: u8 = 5;

/// Chunks of client audio that may wait for the pipeline (a few seconds of 20 ms pages).
const INBOUND_QUEUE: usize = 256;
/// Messages that may wait for the client (about 2.5 s of 40 ms pages and their text).
const OUTBOUND_QUEUE: usize = 96;
/// The longest wait for a session's pipeline to be primed.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The `kind` label values of protocol errors.
pub(super) const PROTOCOL_ERRORS: [&str; 6] = [
    "unknown_kind",
    "bad_query",
    "too_large",
    "not_binary",
    "bad_audio",
    "flood",
];

/// How a session ended, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// The client closed (or vanished).
    ClientClosed,
    /// The client sent nothing for `idle_timeout`.
    Idle,
    /// The client did not read for `stall_timeout`.
    Stalled,
    /// The pipeline failed, or a message broke the protocol.
    Failed,
    /// The server closed it (drain, `max_session_s`).
    Closed,
    /// The pipeline ended on its own (the model's long-session policy).
    Ended,
    /// The client's choices were refused (a bad query parameter).
    Refused,
}

impl Outcome {
    /// Every outcome, for series that exist from the start.
    pub(super) const ALL: [Outcome; 7] = [
        Outcome::ClientClosed,
        Outcome::Idle,
        Outcome::Stalled,
        Outcome::Failed,
        Outcome::Closed,
        Outcome::Ended,
        Outcome::Refused,
    ];

    /// The `outcome` label value.
    pub(super) fn name(self) -> &'static str {
        match self {
            Outcome::ClientClosed => "client_closed",
            Outcome::Idle => "idle",
            Outcome::Stalled => "stalled",
            Outcome::Failed => "failed",
            Outcome::Closed => "closed",
            Outcome::Ended => "ended",
            Outcome::Refused => "refused",
        }
    }
}

/// The session pipeline's spec for one client: the template the server holds, with the
/// configuration's and the client's params set over it (typed, checked as the file's are; the
/// file is not read again), `{session}` replaced by `id`.
fn session_spec(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    params: &super::config::SessionParams,
    id: &str,
) -> Result<PipelineSpec, ConfigError> {
    let sets = cfg.session_overrides(template, registry, params);
    let mut spec = template.with_overrides(registry, &sets)?;
    for s in &mut spec.stages {
        s.params.substitute("{session}", id);
    }
    Ok(spec)
}

/// The session pipeline's spec with the configuration's defaults (no client's params), its
/// `{session}` replaced by `id`.
pub(super) fn default_spec(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    id: &str,
) -> Result<PipelineSpec, ConfigError> {
    let params = cfg
        .session_params(&[])
        .map_err(|m| ConfigError::new(&cfg.file, cfg::ConfigErrorKind::Build, m))?;
    session_spec(cfg, template, registry, &params, id)
}

/// Builds one session of the template (not started) with the defaults: every stage checked,
/// the models loaded into `resources` (so the first client's session finds them there). For
/// start-up, `--check` and a reload. Returns the shared engines and codecs the session opened,
/// for the server to keep while it serves.
///
/// # Errors
///
/// A [`ConfigError`] naming the template (or the configuration key) at fault.
pub(super) fn check_template(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    resources: &crate::resources::Resources,
) -> Result<crate::resources::Engines, ConfigError> {
    for (kind, what) in [
        ("session_in", "the client's audio"),
        ("session_audio_out", "the agent's audio for the client"),
    ] {
        if !template.stages.iter().any(|s| s.kind == kind) {
            return Err(ConfigError::new(
                &template.file,
                cfg::ConfigErrorKind::Link,
                format!(
                    "a session template needs a `{kind}` stage ({what}); see pipelines/serve.yaml"
                ),
            ));
        }
    }
    let spec = default_spec(cfg, template, registry, "check")?;
    let (_client, end) = crate::session::link(1, 1);
    let b = crate::app::build_session(&spec, registry, Some(&end), None, resources)?;
    // Held across the drop of the check's pipeline, so that the engines stay open.
    let engines = resources.open_engines();
    b.build()
        .map_err(|e| ConfigError::new(&spec.file, cfg::ConfigErrorKind::Link, e.to_string()))?;
    Ok(engines)
}

/// Whether a session of `template` keeps its primed state in the process's cache (a
/// `temporal` stage with `priming: cached`).
pub(super) fn primes_cached(template: &PipelineSpec) -> bool {
    template
        .stages
        .iter()
        .any(|s| s.kind == "temporal" && s.params.str("priming") == "cached")
}

/// Runs one session of the template with the defaults, headless (no client: nothing comes in,
/// what goes out is dropped), until it is primed, then stops it: the state its priming left is
/// in the process's cache for the first client with the same voice and persona. Returns how
/// long it took.
///
/// # Errors
///
/// The session's build error, or its run's when it ended before it was primed.
pub(super) fn prime_at_start(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    resources: &crate::resources::Resources,
) -> anyhow::Result<std::time::Duration> {
    let t0 = std::time::Instant::now();
    let spec = default_spec(cfg, template, registry, "prime")?;
    let (client, end) = crate::session::link(8, 8);
    let b = crate::app::build_session(&spec, registry, Some(&end), None, resources)?;
    let running = b.build()?.start();
    let handle = running.handle();
    let run = std::thread::Builder::new()
        .name("duplex:prime".into())
        .spawn(move || running.wait())?;
    while !handle.is_ready() && !run.is_finished() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let primed = handle.is_ready();
    handle.stop();
    drop(client);
    let outcome = run
        .join()
        .map_err(|_| anyhow::anyhow!("the priming session's thread panicked"))?;
    if !primed {
        outcome.into_result()?;
        anyhow::bail!("the priming session ended before it was primed");
    }
    Ok(t0.elapsed())
}

/// A started session pipeline.
struct Started {
    running: crate::runtime::Running,
    handle: crate::runtime::Handle,
    monitor: Arc<crate::observe::monitor::Monitor>,
}

fn start(
    server: &Server,
    params: &super::config::SessionParams,
    id: u64,
    end: &crate::session::PipelineEnd,
) -> anyhow::Result<Started> {
    let template = server.template();
    let spec = session_spec(
        &server.cfg,
        &template,
        &server.registry,
        params,
        &id.to_string(),
    )?;
    let recording = server.cfg.record.as_ref().and_then(|r| {
        use crate::observe::record::{prune, Recording};
        prune(&r.dir, r.max_total_bytes, server.cfg.max_sessions);
        let tag = format!("s{id}");
        match Recording::create_tagged(&r.dir, &tag, crate::app::manifest(&spec), r.max_file_bytes)
        {
            Ok(rec) => Some(Arc::new(rec)),
            Err(e) => {
                tracing::error!(session = id, "recording: {e}; the session runs unrecorded");
                None
            }
        }
    });
    let b = crate::app::build_session(
        &spec,
        &server.registry,
        Some(end),
        recording.as_deref(),
        &server.resources,
    )?;
    let (b, monitor) = crate::app::observe_with(b, &spec.metrics, false);
    let b = match recording {
        Some(r) => {
            monitor.record_changes(r.stream("verdicts"));
            b.observer(r)
        }
        None => b,
    };
    let running = b.build()?.start();
    let handle = running.handle();
    Ok(Started {
        running,
        handle,
        monitor,
    })
}

fn message(kind: u8, payload: &[u8]) -> Message {
    let mut v = Vec::with_capacity(payload.len() + 1);
    v.push(kind);
    v.extend_from_slice(payload);
    Message::Binary(v.into())
}

/// What a client is told when its session could not start: its own mistake when it made one
/// (a persona or voice the template's stage refused), else that the server failed, with the
/// session's id to find the details in the log. Never the server's paths.
fn for_client(e: &anyhow::Error, id: u64) -> String {
    if let Some(c) = e.downcast_ref::<ConfigError>() {
        let from_client = match c.key.as_deref() {
            Some("persona") | Some("persona_tokens") => Some("text_prompt"),
            Some("voice") => Some("voice_prompt"),
            _ => None,
        };
        if let Some(param) = from_client {
            // The stage's message names the file it read; the client knows its voice by name.
            let msg = match param {
                "voice_prompt" => "not a usable voice".to_string(),
                _ => c.message.clone(),
            };
            return format!("query parameter {param}: {msg}");
        }
    }
    format!("the session could not start: a server error (logged as session {id})")
}

/// The build facts of Kyutai's `build_info`, captured by `build.rs`.
fn build_info() -> serde_json::Value {
    serde_json::json!({
        "build_timestamp": env!("DUPLEX_BUILD_TIMESTAMP"),
        "build_date": env!("DUPLEX_BUILD_DATE"),
        "git_branch": env!("DUPLEX_GIT_BRANCH"),
        "git_timestamp": env!("DUPLEX_GIT_TIMESTAMP"),
        "git_date": env!("DUPLEX_GIT_DATE"),
        "git_hash": env!("DUPLEX_GIT_HASH"),
        "git_describe": env!("DUPLEX_GIT_DESCRIBE"),
        "rustc_host_triple": env!("DUPLEX_RUSTC_HOST_TRIPLE"),
        "rustc_version": env!("DUPLEX_RUSTC_VERSION"),
        "cargo_target_triple": env!("DUPLEX_CARGO_TARGET_TRIPLE"),
    })
}

/// The metadata message (kind 4), sent right after the handshake: the fields of the
/// `ServerInfo` Kyutai's web client validates (the session's sampling, the LM's graph, the
/// instance, the build), then duplex's own (the session id, the server's name and version, the
/// session's other effective settings). `lm_model_file` is the pack's temporal graph under the
/// pack's folder name: what model, not where the server keeps it.
fn metadata(server: &Server, params: &super::config::SessionParams, id: u64) -> serde_json::Value {
    let sm = &params.sampling;
    let pack = server.cfg.pack.clone().or_else(|| {
        server
            .template()
            .stages
            .iter()
            .find(|s| s.kind == "temporal")
            .and_then(|s| s.params.opt_str("pack").map(str::to_string))
    });
    let lm_model_file = pack.map_or_else(
        || "unknown".to_string(),
        |p| {
            let name = std::path::Path::new(&p)
                .file_name()
                .map_or_else(|| p.clone(), |n| n.to_string_lossy().into_owned());
            format!("{name}/temporal/model.onnx")
        },
    );
    serde_json::json!({
        "text_temperature": sm.text_temperature,
        "text_topk": sm.text_top_k,
        "audio_temperature": sm.audio_temperature,
        "audio_topk": sm.audio_top_k,
        "pad_mult": sm.pad_mult,
        "repetition_penalty_context": sm.repetition_penalty_context,
        "repetition_penalty": sm.repetition_penalty,
        "lm_model_file": lm_model_file,
        "instance_name": server.cfg.instance_name,
        "build_info": build_info(),
        "session": id,
        "server": "duplex",
        "version": env!("CARGO_PKG_VERSION"),
        "text_seed": sm.text_seed,
        "audio_seed": sm.audio_seed,
        "max_steps": params.max_steps,
        "persona": !params.text_prompt.trim().is_empty(),
        "voice_prompt": params.voice.as_ref().and_then(|v| v.file_name()).map(|n| n.to_string_lossy().into_owned()),
    })
}

/// Sends the handshake (every session's first message: a client written against Kyutai's
/// Python server takes the first message as one), then an error message, and closes (best
/// effort: the client may be gone).
async fn refuse(socket: &mut WebSocket, text: &str) {
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = socket.send(message(HANDSHAKE, &[0; 8])).await;
        let _ = socket.send(message(ERROR, text.as_bytes())).await;
        let _ = socket
            .send(Message::Close(Some(CloseFrame {
                code: 1008,
                reason: close_reason(text).into(),
            })))
            .await;
    })
    .await;
}

/// Runs one connection to its end.
pub(super) async fn run(
    server: Arc<Server>,
    mut socket: WebSocket,
    peer: SocketAddr,
    query: Vec<(String, String)>,
    admission: Admission,
) {
    let id = server.next_id.fetch_add(1, Ordering::Relaxed);
    let t0 = Instant::now();
    metrics::counter!(names::SESSIONS_ADMITTED).increment(1);
    let outcome = match server.cfg.session_params(&query) {
        Err(m) => {
            tracing::info!(session = id, client = %peer, "refused: {m}");
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_query").increment(1);
            refuse(&mut socket, &m).await;
            Outcome::Refused
        }
        Ok(params) => {
            let meta = metadata(&server, &params, id);
            let (client, end) = crate::session::link(INBOUND_QUEUE, OUTBOUND_QUEUE);
            server
                .sessions
                .lock()
                .map(|mut m| {
                    m.insert(
                        id,
                        Live {
                            peer,
                            key: admission.key.as_ref().map(|k| k.name().to_string()),
                            started: t0,
                            handle: None,
                            monitor: None,
                            stats: client.stats.clone(),
                        },
                    )
                })
                .ok();
            let s = server.clone();
            let built = tokio::task::spawn_blocking(move || {
                let r = start(&s, &params, id, &end);
                drop(end);
                r
            })
            .await;
            match built {
                Ok(Ok(started)) => {
                    if let Ok(mut m) = server.sessions.lock() {
                        if let Some(l) = m.get_mut(&id) {
                            l.handle = Some(started.handle.clone());
                            l.monitor = Some(started.monitor.clone());
                        }
                    }
                    tracing::info!(session = id, client = %peer, "session started");
                    bridge(&server, socket, client, started, id, meta).await
                }
                Ok(Err(e)) => {
                    tracing::warn!(session = id, client = %peer, "the session could not start: {e:#}");
                    refuse(&mut socket, &for_client(&e, id)).await;
                    Outcome::Failed
                }
                Err(e) => {
                    tracing::error!(session = id, "building the session panicked: {e}");
                    refuse(&mut socket, "the session could not start: internal error").await;
                    Outcome::Failed
                }
            }
        }
    };
    if let Ok(mut m) = server.sessions.lock() {
        m.remove(&id);
    }
    let took = t0.elapsed().as_secs_f64();
    metrics::counter!(names::SESSIONS_ENDED, "outcome" => outcome.name()).increment(1);
    metrics::histogram!(names::SESSION_DURATION).record(took);
    tracing::info!(
        session = id,
        client = %peer,
        outcome = outcome.name(),
        "session ended after {took:.1} s"
    );
    drop(admission);
}

/// Why the writer stopped.
enum WriterEnd {
    /// The pipeline's outputs ended (it finished or failed).
    Done,
    /// The client did not take a message within `stall_timeout`.
    Stalled,
    /// The socket failed (the client is gone, or its write buffer is full).
    Gone,
}

/// The reading side of a connection: what every incoming message costs and where it goes.
struct Inflow<'a> {
    client: &'a crate::session::ClientEnd,
    id: u64,
    limits: super::config::Limits,
    /// Every message, pings included, is paid from this.
    rate: crate::audio::pace::TokenBucket,
    last_heard: Instant,
    warned: std::collections::HashSet<&'static str>,
    bytes_in: metrics::Counter,
    /// The close code and reason when the client broke a rule.
    close: Option<(u16, &'static str)>,
}

impl<'a> Inflow<'a> {
    fn new(client: &'a crate::session::ClientEnd, id: u64, limits: super::config::Limits) -> Self {
        let per_s = limits.max_messages_per_s;
        Inflow {
            client,
            id,
            limits,
            rate: crate::audio::pace::TokenBucket::new(per_s, 2.0 * per_s),
            last_heard: Instant::now(),
            warned: Default::default(),
            bytes_in: metrics::counter!(names::SESSION_BYTES, "direction" => "in"),
            close: None,
        }
    }

    fn protocol_error(&mut self, kind: &'static str) {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => kind).increment(1);
    }

    /// Takes one message (or the end of the stream); returns how the session ends when it does.
    fn take(&mut self, m: Option<Result<Message, axum::Error>>) -> Option<Outcome> {
        let id = self.id;
        let m = match m {
            None | Some(Ok(Message::Close(_))) => return Some(Outcome::ClientClosed),
            Some(Err(e)) => {
                use tungstenite::Error as WsError;
                let too_large = matches!(
                    e.into_inner().downcast_ref::<WsError>(),
                    Some(WsError::Capacity(_))
                );
                if too_large {
                    self.protocol_error("too_large");
                    tracing::warn!(
                        session = id,
                        "closed: a message over limits.max_message_bytes ({})",
                        self.limits.max_message_bytes
                    );
                    self.close = Some((1009, "message too large"));
                    return Some(Outcome::Failed);
                }
                tracing::info!(session = id, "connection lost");
                return Some(Outcome::ClientClosed);
            }
            Some(Ok(m)) => m,
        };
        if !self.rate.take_at(1.0, Instant::now()) {
            self.protocol_error("flood");
            tracing::warn!(
                session = id,
                "closed: more than limits.max_messages_per_s ({}) messages a second",
                self.limits.max_messages_per_s
            );
            self.close = Some((1008, "too many messages"));
            return Some(Outcome::Failed);
        }
        match m {
            Message::Binary(b) => {
                self.bytes_in.increment(b.len() as u64);
                match b.first() {
                    Some(&AUDIO) => {
                        self.last_heard = Instant::now();
                        if self.client.offer(b[1..].to_vec()).is_err()
                            && self.warned.insert("flood")
                        {
                            tracing::warn!(session = id, "the client sends faster than the session takes its audio: chunks dropped (counted)");
                        }
                    }
                    Some(&CONTROL) => {}
                    k => {
                        self.protocol_error("unknown_kind");
                        if self.warned.insert("kind") {
                            tracing::info!(
                                session = id,
                                "ignored a message of unknown kind {k:?} (logged once per session)"
                            );
                        }
                    }
                }
            }
            Message::Text(_) => {
                self.protocol_error("not_binary");
                if self.warned.insert("text") {
                    tracing::info!(
                        session = id,
                        "ignored a text message: the protocol is binary (logged once per session)"
                    );
                }
            }
            // Pings are answered by the WebSocket layer (one pong pending at most); they count
            // against the message rate above.
            _ => {}
        }
        None
    }
}

/// Bridges the socket and a started pipeline until one side ends.
async fn bridge(
    server: &Arc<Server>,
    socket: WebSocket,
    mut client: crate::session::ClientEnd,
    started: Started,
    id: u64,
    meta: serde_json::Value,
) -> Outcome {
    let limits = server.cfg.limits;
    let Started {
        running,
        handle,
        monitor: _monitor,
    } = started;
    let mut close_all = server.close_all.subscribe();
    let waited = tokio::task::spawn_blocking(move || running.wait());
    let (mut sink, mut stream) = socket.split();
    let mut outbound = std::mem::replace(&mut client.outbound, tokio::sync::mpsc::channel(1).1);
    let mut inflow = Inflow::new(&client, id, limits);
    let mut outcome = None;
    // Primed (warm-up, persona, voice) before the handshake. The socket is read meanwhile: a
    // client that leaves (or floods) stops the priming.
    let ready_since = Instant::now();
    while outcome.is_none() && !handle.is_ready() {
        if ready_since.elapsed() > READY_TIMEOUT || waited.is_finished() || *close_all.borrow() {
            break;
        }
        tokio::select! {
            m = stream.next() => outcome = inflow.take(m),
            _ = tokio::time::sleep(Duration::from_millis(10)) => {}
        }
    }
    let mut waited = Some(waited);
    if outcome.is_none() {
        if handle.is_ready() {
            // The 9-byte handshake (kind 0, protocol version 0, model version 0) first, always;
            // then the metadata.
            let meta = meta.to_string();
            if sink.send(message(HANDSHAKE, &[0; 8])).await.is_err()
                || sink.send(message(METADATA, meta.as_bytes())).await.is_err()
            {
                outcome = Some(Outcome::ClientClosed);
            }
            inflow.client.open();
        } else {
            outcome = Some(Outcome::Failed);
        }
    } else {
        tracing::info!(
            session = id,
            "the client left while its session was starting: priming stopped"
        );
    }
    // Writer: outgoing messages, each sent within `stall_timeout`.
    let stall = limits.stall_timeout;
    let writer = tokio::spawn(async move {
        let bytes_out = metrics::counter!(names::SESSION_BYTES, "direction" => "out");
        let end = loop {
            let Some(m) = outbound.recv().await else {
                break WriterEnd::Done;
            };
            let (msg, n) = match m {
                Outbound::Audio(b) => (message(AUDIO, &b), b.len() + 1),
                Outbound::Text(t) => (message(TEXT, t.as_bytes()), t.len() + 1),
            };
            let n = n as u64;
            match tokio::time::timeout(stall, sink.send(msg)).await {
                Ok(Ok(())) => bytes_out.increment(n),
                Ok(Err(_)) => break WriterEnd::Gone,
                Err(_) => break WriterEnd::Stalled,
            }
        };
        (sink, end)
    });
    let mut writer = Some(writer);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut published = Published::default();
    let began = Instant::now();
    let mut writer_end = None;
    while outcome.is_none() {
        tokio::select! {
            m = stream.next() => outcome = inflow.take(m),
            w = async { writer.as_mut().expect("writer runs").await }, if writer.is_some() => {
                writer = None;
                match w {
                    Ok((s, end)) => {
                        outcome = Some(match end {
                            WriterEnd::Done => {
                                // The pipeline ended: how is for its outcome to say.
                                Outcome::Ended
                            }
                            WriterEnd::Stalled => {
                                metrics::counter!(names::SESSION_STALLS).increment(1);
                                tracing::warn!(session = id, "closed: the client read nothing for {:.0} s (limits.stall_timeout_s)", stall.as_secs_f64());
                                Outcome::Stalled
                            }
                            WriterEnd::Gone => Outcome::ClientClosed,
                        });
                        writer_end = Some(s);
                    }
                    Err(_) => outcome = Some(Outcome::Failed),
                }
            }
            _ = tick.tick() => {
                published.update(&inflow.client.stats);
                if inflow.last_heard.elapsed() > limits.idle_timeout {
                    tracing::info!(session = id, "closed: the client sent nothing for {:.0} s (limits.idle_timeout_s)", limits.idle_timeout.as_secs_f64());
                    outcome = Some(Outcome::Idle);
                } else if limits.max_session.is_some_and(|m| began.elapsed() > m) {
                    tracing::info!(session = id, "closed: the session reached limits.max_session_s");
                    outcome = Some(Outcome::Closed);
                }
            }
            _ = close_all.changed() => outcome = Some(Outcome::Closed),
        }
    }
    let mut close = inflow.close;
    drop(inflow);
    let mut outcome = outcome.unwrap_or(Outcome::Failed);
    // The client's input ends: the pipeline drains what it has and stops.
    client.close_input();
    if outcome != Outcome::Ended {
        handle.stop();
    }
    let result = match waited.take() {
        Some(w) => w.await.ok(),
        None => None,
    };
    // What the pipeline still had for the client goes out (within the stall limit); a client
    // that closed gets its close answered.
    if let Some(w) = writer.take() {
        let wait = match outcome {
            Outcome::Stalled => Duration::ZERO,
            Outcome::ClientClosed => Duration::from_secs(1),
            _ => stall + Duration::from_secs(1),
        };
        match tokio::time::timeout(wait, w).await {
            Ok(Ok((s, _))) => writer_end = Some(s),
            _ => tracing::debug!(session = id, "the writer was cut short"),
        }
    }
    published.update(&client.stats);
    let error = result.and_then(|r| r.error);
    // What the client is told: its own fault (its audio) in full, the server's by reference.
    let mut told = None;
    if let Some(e) = &error {
        let bad_input = matches!(
            e,
            crate::runtime::RunError::StageFailed {
                bad_input: true,
                ..
            }
        );
        if bad_input {
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_audio").increment(1);
            tracing::info!(session = id, "the client's input was refused: {e}");
            told = Some(e.to_string());
            close = close.or(Some((1007, "the audio is not a usable Ogg/Opus stream")));
        } else {
            tracing::warn!(session = id, "the session's pipeline failed: {e}");
            told = Some(format!(
                "the session failed: a server error (logged as session {id})"
            ));
        }
        outcome = Outcome::Failed;
    }
    if let Some(mut s) = writer_end {
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            if outcome != Outcome::ClientClosed {
                if let Some(t) = &told {
                    let _ = s.send(message(ERROR, t.as_bytes())).await;
                }
                let (code, reason) = close.unwrap_or(match outcome {
                    Outcome::Idle => (1000, "idle timeout"),
                    Outcome::Closed => (1001, "the server closed the session"),
                    Outcome::Failed => (1011, "the session failed"),
                    Outcome::Stalled => (1008, "the client stopped reading"),
                    Outcome::Ended => (
                        1000,
                        "the conversation ended (max_steps, or the long-session policy)",
                    ),
                    _ => (1000, "session ended"),
                });
                let _ = s
                    .send(Message::Close(Some(CloseFrame {
                        code,
                        reason: reason.into(),
                    })))
                    .await;
            }
            let _ = s.close().await;
        })
        .await;
    }
    outcome
}

/// A close frame's reason: at most 123 bytes, cut at a character boundary.
fn close_reason(text: &str) -> String {
    let mut end = text.len().min(120);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// The link's counters as published so far, to add only what is new.
#[derive(Default)]
struct Published {
    silence: u64,
    dropped_in: u64,
    dropped_out: u64,
}

impl Published {
    fn update(&mut self, s: &LinkStats) {
        let step = |seen: &mut u64, now: u64, c: metrics::Counter| {
            if now > *seen {
                c.increment(now - *seen);
                *seen = now;
            }
        };
        step(
            &mut self.silence,
            LinkStats::get(&s.silence_frames),
            metrics::counter!(names::SESSION_SILENCE),
        );
        step(
            &mut self.dropped_in,
            LinkStats::get(&s.dropped_in),
            metrics::counter!(names::SESSION_DROPPED, "direction" => "in"),
        );
        step(
            &mut self.dropped_out,
            LinkStats::get(&s.dropped_out),
            metrics::counter!(names::SESSION_DROPPED, "direction" => "out"),
        );
    }
}
