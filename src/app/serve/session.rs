//! One client's connection: its session pipeline built from the template with the client's
//! choices, the client told once the pipeline is primed, and the bridge between the connection
//! (its two halves: a WebSocket's, or a transport's own, as WebRTC's driver gives them) and the
//! pipeline's session stages until one side ends; then the outcome, counted. The same for every
//! protocol: what differs ([`Protocol`]) is what the client's messages mean, what is said to it,
//! and which ends the template gets (Ogg/Opus, or PCM for a protocol that converts its own wire
//! format: [`pcm_ends`]). Kyutai's protocol is here ([`Kyutai`]); the realtime API's, Twilio's
//! and WebRTC's in their modules.
//!
//! Kyutai's message kinds (docs/PROTOCOL.md): 0 handshake (always the first message, as soon as
//! the session is primed, also before an error), 4 metadata (right after it: Kyutai's `ServerInfo`
//! fields and duplex's own, the session id among them), 1 audio, 2 text, 5 error are sent; 1 is
//! read, 3 (control) and unknown kinds are ignored (counted, logged once).
//!
//! The socket is read from the upgrade on, also while the session primes: a client that leaves
//! stops the priming at its next step, and the audio it sends meanwhile goes to the session's
//! input queue, bounded in chunks and in bytes (dropped and counted when full). A connection
//! that is not a conversation yet (Twilio before its `start`, the realtime API before its first
//! audio) has `limits.handshake_timeout_s` to become one; after that only the client's audio
//! keeps it from `limits.idle_timeout_s`. A protocol that converts its client's audio charges
//! it to the connection's [`AudioBudget`] from its encoded size, before decoding anything: at
//! most real time plus the catch-up of the template's decoder (its `max_speed` and
//! `catch_up_ms`); what exceeds it is dropped undecoded and counted. Every message, pings included, is paid
//! from a token bucket (`limits.max_messages_per_s`): a flood closes the session (1008,
//! counted). Writing has its own task, which sends the protocol's replies first and the
//! pipeline's messages once the session is open: a client that stops reading stalls only that
//! task, whose queues are bounded (the pipeline's audio is then dropped and counted), whose
//! socket buffer is capped, and which closes the session after `stall_timeout`.
//!
//! What a client is told of a failure names its own mistake (a parameter, its audio) and nothing
//! of the server's files: the details go to the log, under the session's id. Close codes: 1000
//! normal, 1001 closed by the server, 1007 the client's audio is not usable (or its text is not
//! UTF-8), 1008 a policy (a refused parameter, a flood, a client that stopped reading, no
//! conversation within the handshake limit), 1009 a message too large, 1011 a failure of the
//! server's.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::pin::Pin;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::{Sink, SinkExt, Stream, StreamExt};

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
/// Bytes of client audio that may wait for the pipeline: over five seconds of 24 kHz PCM16,
/// minutes of Opus.
const INBOUND_BYTES: u64 = 256 * 1024;
/// Messages that may wait for the client (about 2.5 s of 40 ms pages and their text).
const OUTBOUND_QUEUE: usize = 96;
/// The longest wait for a session's pipeline to be primed.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The `kind` label values of protocol errors.
pub(super) const PROTOCOL_ERRORS: [&str; 10] = [
    "unknown_kind",
    "not_json",
    "bad_event",
    "bad_query",
    "too_large",
    "not_binary",
    "bad_audio",
    "flood",
    "early_audio",
    "bad_utf8",
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

/// The template with PCM ends in place of its Ogg/Opus ones, for a transport that converts
/// its own wire format: `session_in → opus_decode` becomes one `session_pcm_in` (named as the
/// decoder, with the silence params of both; unpaced, since the transport pays for its audio
/// before decoding it, at the decoder's pace), `opus_encode → session_audio_out` one
/// `session_pcm_out` (named as the encoder). The model's part of the template is untouched.
///
/// # Errors
///
/// A [`ConfigError`] naming the template when it has no such ends.
pub(super) fn pcm_ends(
    template: &PipelineSpec,
    registry: &Registry,
) -> Result<PipelineSpec, ConfigError> {
    let stage_of = |end: &str| end.split('.').next().unwrap_or_default().to_string();
    let kind_of = |spec: &PipelineSpec, name: &str| {
        spec.stages
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.kind.clone())
            .unwrap_or_default()
    };
    let missing = |what: &str| {
        ConfigError::new(
            &template.file,
            cfg::ConfigErrorKind::Link,
            format!(
                "the PCM transports (the realtime API, the telephone) need the template's {what}; \
                 see pipelines/serve.yaml"
            ),
        )
    };
    let input = template
        .stages
        .iter()
        .find(|s| s.kind == "session_in")
        .map(|s| s.name.clone())
        .ok_or_else(|| missing("`session_in` stage"))?;
    let decoder = template
        .links
        .iter()
        .find(|l| stage_of(&l.from) == input)
        .map(|l| stage_of(&l.to))
        .filter(|d| kind_of(template, d) == "opus_decode")
        .ok_or_else(|| missing("`session_in` feeding an `opus_decode` stage"))?;
    let spec = template.merge_pair(registry, &input, &decoder, &decoder, "session_pcm_in")?;
    let output = spec
        .stages
        .iter()
        .find(|s| s.kind == "session_audio_out")
        .map(|s| s.name.clone())
        .ok_or_else(|| missing("`session_audio_out` stage"))?;
    let encoder = spec
        .links
        .iter()
        .find(|l| stage_of(&l.to) == output)
        .map(|l| stage_of(&l.from))
        .filter(|e| kind_of(&spec, e) == "opus_encode")
        .ok_or_else(|| missing("`opus_encode` stage feeding `session_audio_out`"))?;
    let spec = spec.merge_pair(registry, &encoder, &output, &encoder, "session_pcm_out")?;
    // The transport paces what it takes (the connection's `AudioBudget`, charged before it
    // decodes anything, with the decoder's `max_speed` and `catch_up_ms`): pacing the same
    // audio twice would refuse a chunk as large as the allowance at the second budget, a
    // moment behind the first.
    spec.with_overrides(
        registry,
        &[cfg::ParamOverride::new(
            decoder,
            "max_speed",
            cfg::ParamValue::Float(0.0),
            "the connection's audio budget (paced before decoding)",
        )],
    )
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
    pcm: bool,
) -> anyhow::Result<Started> {
    let template = server.template();
    let template = if pcm {
        Arc::new(pcm_ends(&template, &server.registry)?)
    } else {
        template
    };
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
            // The stage's limits are the server's own settings (`session_overrides`): named
            // as the operator wrote them.
            let msg = match param {
                "voice_prompt" => "not a usable voice".to_string(),
                _ => c.message.replace(
                    "`max_persona_tokens`",
                    "the server's `limits.max_prompt_tokens`",
                ),
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

/// What differs between the protocols a session is spoken in (Kyutai's binary one, the realtime
/// API's JSON events): the messages that open, answer and end a session, how the client's
/// audio arrives and how the pipeline's messages are written. The rest of a connection (the
/// session's pipeline, the limits, the writer, the outcomes and their metrics) is
/// [`run`]'s, the same for all.
pub(super) trait Protocol: Send + 'static {
    /// Messages sent as soon as the connection opens (before the session's params are known).
    fn hello(&mut self) -> Vec<Message> {
        Vec::new()
    }

    /// Whether the session may start: the client has said what it wants (Kyutai's protocol:
    /// at once, from the query; the realtime API: at its first audio or `response.create`).
    fn may_start(&self) -> bool {
        true
    }

    /// The session's params, once it may start; a refusal names the client's mistake.
    fn params(&mut self, cfg: &ServeConfig) -> Result<super::config::SessionParams, String>;

    /// Messages that tell the client its session is ready; the pipeline's output follows.
    fn ready(&mut self, meta: &serde_json::Value) -> Vec<Message>;

    /// One message of the client's (binary or text; not a close, ping or pong), paid for.
    fn take(&mut self, m: Message, cx: &mut Taken<'_>);

    /// The writer's encoder of the pipeline's messages.
    fn encoder(&self) -> Box<dyn Encoder>;

    /// What a client is told when its session cannot start (before `ready`).
    fn refusal(&self, text: &str) -> Vec<Message>;

    /// What a client is told when its session fails (after `ready`).
    fn failure(&self, text: &str) -> Vec<Message>;

    /// The close code and reason when the pipeline refused the client's audio.
    fn bad_audio(&self) -> (u16, &'static str);

    /// What a client is told before its connection is closed for a message over `limit` bytes.
    fn too_large(&mut self, _limit: usize) -> Vec<Message> {
        Vec::new()
    }

    /// Whether the protocol carries PCM and converts its own wire format: its sessions run the
    /// template with PCM ends ([`pcm_ends`]).
    fn pcm(&self) -> bool {
        false
    }

    /// The transport's own live counters, for `/api/sessions` (WebRTC's packets and jitter
    /// buffer).
    fn transport(&self) -> Option<TransportStats> {
        None
    }
}

/// A transport's live counters as JSON, read when `/api/sessions` is asked.
pub(super) type TransportStats = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Turns the pipeline's messages into the protocol's (in the writer's task).
pub(super) trait Encoder: Send {
    /// The messages for one of the pipeline's.
    fn encode(&mut self, m: Outbound) -> Vec<Message>;
}

/// What a protocol's [`Protocol::take`] may do with a message.
pub(super) struct Taken<'a> {
    /// The session's link: the client's audio is offered to it.
    pub client: &'a crate::session::ClientEnd,
    /// The session's id, for the log.
    pub id: u64,
    /// Messages for the client, sent before anything of the pipeline's.
    pub replies: Vec<Message>,
    /// Set when the message broke the protocol beyond an answer: the close code and reason.
    pub close: Option<(u16, &'static str)>,
    /// Whether the message carried the client's audio (it is not idle).
    pub heard: bool,
    /// Set when the message ends the session as the client's close would (a call hung up).
    pub end: bool,
    warned: &'a mut std::collections::HashSet<&'static str>,
    budget: &'a mut AudioBudget,
}

impl Taken<'_> {
    /// Counts a protocol error of `kind` (one of [`PROTOCOL_ERRORS`]).
    pub fn protocol_error(&self, kind: &'static str) {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => kind).increment(1);
    }

    /// Whether `what` is logged for the first time in this session.
    pub fn first(&mut self, what: &'static str) -> bool {
        self.warned.insert(what)
    }

    /// Whether `d` of the client's audio, in its encoded form, may be decoded and offered: the
    /// connection's [`AudioBudget`] pays it, or the audio is to be dropped undecoded (counted,
    /// logged once). Either way the client is heard: it is not idle.
    pub fn afford(&mut self, d: Duration) -> bool {
        self.heard = true;
        if self.budget.take(d) {
            return true;
        }
        if self.first("budget") {
            tracing::warn!(
                session = self.id,
                "the client's audio comes faster than real time: what exceeds the catch-up \
                 allowance is dropped undecoded (counted in {})",
                names::OPUS_REFUSED
            );
        }
        false
    }

    /// Offers a chunk of the client's audio; a full queue drops it (counted, logged once).
    pub fn offer(&mut self, chunk: Vec<u8>) {
        self.heard = true;
        if self.client.offer(chunk).is_err() && self.first("flood") {
            tracing::warn!(
                session = self.id,
                "the client sends faster than the session takes its audio: chunks dropped (counted)"
            );
        }
    }
}

/// What a connection's audio may cost before it is decoded: a [`RealTime`] budget counted in
/// microseconds, paced as the template's decoder paces what it takes (its `max_speed` and
/// `catch_up_ms`; `max_speed: 0` leaves it unpaced). What it refuses is counted in
/// [`names::OPUS_REFUSED`], in 80 ms frames.
///
/// [`RealTime`]: crate::audio::pace::RealTime
pub(super) struct AudioBudget {
    bucket: Option<crate::audio::pace::RealTime>,
    /// Refused microseconds not yet counted in whole frames.
    refused_us: u64,
    refused: metrics::Counter,
}

impl AudioBudget {
    /// The pacing of the template's decoder (`opus_decode`; [`pcm_ends`] leaves its
    /// `session_pcm_in` unpaced, for the transport to pace): how many times real time, and the
    /// catch-up allowed ahead of it. `None`: unpaced (`max_speed: 0`, streams the operator
    /// trusts). A template without one (a check's): real time and a second.
    pub(super) fn pacing(template: &PipelineSpec) -> Option<(f64, Duration)> {
        let decoder = template.stages.iter().find(|s| s.kind == "opus_decode");
        match decoder.map(|s| (s.params.float("max_speed"), s.params.int("catch_up_ms"))) {
            Some((speed, catch_up)) if speed > 0.0 => {
                Some((speed, Duration::from_millis(catch_up.max(0) as u64)))
            }
            Some(_) => None,
            None => Some((1.0, Duration::from_secs(1))),
        }
    }

    /// The budget of the template's decoder's [`pacing`](Self::pacing).
    pub(super) fn of(template: &PipelineSpec) -> AudioBudget {
        AudioBudget {
            bucket: Self::pacing(template).map(|(speed, catch_up)| {
                crate::audio::pace::RealTime::new(1_000_000, speed, catch_up)
            }),
            refused_us: 0,
            refused: metrics::counter!(names::OPUS_REFUSED),
        }
    }

    /// Takes `d` from the budget, or refuses it (counted).
    fn take(&mut self, d: Duration) -> bool {
        let us = d.as_micros().min(usize::MAX as u128) as usize;
        let Some(b) = self.bucket.as_mut() else {
            return true;
        };
        if b.take_at(us, Instant::now()) {
            return true;
        }
        self.refused_us += us as u64;
        let frame = 80_000;
        self.refused.increment(self.refused_us / frame);
        self.refused_us %= frame;
        false
    }
}

/// Kyutai's protocol (docs/PROTOCOL.md): binary messages whose first byte is their kind.
pub(super) struct Kyutai {
    query: Vec<(String, String)>,
}

impl Kyutai {
    pub(super) fn new(query: Vec<(String, String)>) -> Self {
        Kyutai { query }
    }
}

struct KyutaiEncoder;

impl Encoder for KyutaiEncoder {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match m {
            Outbound::Audio(b) => vec![message(AUDIO, &b)],
            Outbound::Text(t) => vec![message(TEXT, t.as_bytes())],
            // Not made by an Ogg/Opus template's pipeline.
            Outbound::Pcm(_) => Vec::new(),
        }
    }
}

impl Protocol for Kyutai {
    fn params(&mut self, cfg: &ServeConfig) -> Result<super::config::SessionParams, String> {
        cfg.session_params(&self.query).inspect_err(|_| {
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_query").increment(1);
        })
    }

    fn ready(&mut self, meta: &serde_json::Value) -> Vec<Message> {
        // The 9-byte handshake (kind 0, protocol version 0, model version 0) first, always;
        // then the metadata.
        vec![
            message(HANDSHAKE, &[0; 8]),
            message(METADATA, meta.to_string().as_bytes()),
        ]
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        let id = cx.id;
        match m {
            Message::Binary(b) => match b.first() {
                Some(&AUDIO) => cx.offer(b[1..].to_vec()),
                Some(&CONTROL) => {}
                k => {
                    cx.protocol_error("unknown_kind");
                    if cx.first("kind") {
                        tracing::info!(
                            session = id,
                            "ignored a message of unknown kind {k:?} (logged once per session)"
                        );
                    }
                }
            },
            Message::Text(_) => {
                cx.protocol_error("not_binary");
                if cx.first("text") {
                    tracing::info!(
                        session = id,
                        "ignored a text message: the protocol is binary (logged once per session)"
                    );
                }
            }
            _ => {}
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(KyutaiEncoder)
    }

    fn refusal(&self, text: &str) -> Vec<Message> {
        // The handshake first: a client written against Kyutai's Python server takes the first
        // message as one.
        vec![message(HANDSHAKE, &[0; 8]), message(ERROR, text.as_bytes())]
    }

    fn failure(&self, text: &str) -> Vec<Message> {
        vec![message(ERROR, text.as_bytes())]
    }

    fn bad_audio(&self) -> (u16, &'static str) {
        (1007, "the audio is not a usable Ogg/Opus stream")
    }
}

/// What the writer is given besides the pipeline's messages.
enum Reply {
    /// A message of the protocol's.
    Send(Message),
    /// The session is ready: the pipeline's messages may follow.
    Open,
    /// The end: what the pipeline still has (when the session was open), then these messages,
    /// then a close frame with this code and reason (or the answer to the client's close).
    Finish(Vec<Message>, Option<(u16, String)>),
}

/// Replies that may wait for the client.
const REPLY_QUEUE: usize = 64;

/// Why the writer stopped.
enum WriterEnd {
    /// It sent what it had, and the end.
    Done,
    /// The client did not take a message within `stall_timeout`.
    Stalled,
    /// The socket failed (the client is gone, or its write buffer is full).
    Gone,
}

/// The writing half of a client's connection: a WebSocket's, or a transport's own (WebRTC's
/// driver, which turns the messages into RTP and data-channel writes).
pub(super) type ClientSink = Pin<Box<dyn Sink<Message, Error = axum::Error> + Send>>;
/// The reading half of a client's connection; its end is the client's.
pub(super) type ClientStream = Pin<Box<dyn Stream<Item = Result<Message, axum::Error>> + Send>>;

/// A WebSocket's two halves, as [`run`] takes them.
pub(super) fn halves(socket: WebSocket) -> (ClientSink, ClientStream) {
    let (sink, stream) = socket.split();
    (Box::pin(sink), Box::pin(stream))
}

/// The writing side of a connection.
struct Writer {
    sink: ClientSink,
    encoder: Box<dyn Encoder>,
    stall: Duration,
    bytes_out: metrics::Counter,
}

impl Writer {
    /// Sends one message within the stall limit.
    async fn send(&mut self, m: Message) -> Result<(), WriterEnd> {
        let n = match &m {
            Message::Binary(b) => b.len(),
            Message::Text(t) => t.len(),
            _ => 0,
        } as u64;
        match tokio::time::timeout(self.stall, self.sink.send(m)).await {
            Ok(Ok(())) => {
                self.bytes_out.increment(n);
                Ok(())
            }
            Ok(Err(_)) => Err(WriterEnd::Gone),
            Err(_) => Err(WriterEnd::Stalled),
        }
    }

    async fn send_encoded(&mut self, m: Outbound) -> Result<(), WriterEnd> {
        for msg in self.encoder.encode(m) {
            self.send(msg).await?;
        }
        Ok(())
    }

    /// The protocol's replies first, then (once the session is open) the pipeline's messages,
    /// each sent within the stall limit; `ended` fires when the pipeline's outputs have ended.
    async fn run(
        mut self,
        mut replies: tokio::sync::mpsc::Receiver<Reply>,
        mut outbound: tokio::sync::mpsc::Receiver<Outbound>,
        ended: tokio::sync::oneshot::Sender<()>,
    ) -> WriterEnd {
        let mut ended = Some(ended);
        let mut open = false;
        let result: Result<(), WriterEnd> = async {
            loop {
                let next = tokio::select! {
                    biased;
                    r = replies.recv() => Err(r),
                    m = outbound.recv(), if open && ended.is_some() => Ok(m),
                };
                match next {
                    Err(Some(Reply::Send(m))) => self.send(m).await?,
                    Err(Some(Reply::Open)) => open = true,
                    Err(Some(Reply::Finish(messages, close))) => {
                        if open {
                            while let Some(m) = outbound.recv().await {
                                self.send_encoded(m).await?;
                            }
                        }
                        for m in messages {
                            self.send(m).await?;
                        }
                        let _ = tokio::time::timeout(Duration::from_secs(2), async {
                            if let Some((code, reason)) = close {
                                let _ = self
                                    .sink
                                    .send(Message::Close(Some(CloseFrame {
                                        code,
                                        reason: reason.into(),
                                    })))
                                    .await;
                            }
                            let _ = self.sink.close().await;
                        })
                        .await;
                        return Ok(());
                    }
                    Err(None) => return Ok(()),
                    Ok(Some(m)) => self.send_encoded(m).await?,
                    Ok(None) => {
                        if let Some(e) = ended.take() {
                            let _ = e.send(());
                        }
                    }
                }
            }
        }
        .await;
        match result {
            Ok(()) => WriterEnd::Done,
            Err(e) => e,
        }
    }
}

/// The reading side of a connection: what every incoming message costs and where it goes.
struct Inflow {
    id: u64,
    limits: super::config::Limits,
    /// Every message, pings included, is paid from this.
    rate: crate::audio::pace::TokenBucket,
    last_heard: Instant,
    warned: std::collections::HashSet<&'static str>,
    bytes_in: metrics::Counter,
    replies: tokio::sync::mpsc::Sender<Reply>,
    /// The close code and reason when the client broke a rule.
    close: Option<(u16, &'static str)>,
    budget: AudioBudget,
}

impl Inflow {
    fn new(
        id: u64,
        limits: super::config::Limits,
        replies: tokio::sync::mpsc::Sender<Reply>,
        budget: AudioBudget,
    ) -> Self {
        let per_s = limits.max_messages_per_s;
        Inflow {
            budget,
            id,
            limits,
            rate: crate::audio::pace::TokenBucket::new(per_s, 2.0 * per_s),
            last_heard: Instant::now(),
            warned: Default::default(),
            bytes_in: metrics::counter!(names::SESSION_BYTES, "direction" => "in"),
            replies,
            close: None,
        }
    }

    fn protocol_error(&mut self, kind: &'static str) {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => kind).increment(1);
    }

    /// Queues replies for the client; when its queue is full (it does not read), they are
    /// dropped: the writer closes a stalled client.
    fn reply(&self, messages: Vec<Message>) {
        for m in messages {
            let _ = self.replies.try_send(Reply::Send(m));
        }
    }

    /// Takes one message (or the end of the stream); returns how the session ends when it does.
    fn take(
        &mut self,
        m: Option<Result<Message, axum::Error>>,
        proto: &mut dyn Protocol,
        client: &crate::session::ClientEnd,
    ) -> Option<Outcome> {
        let id = self.id;
        let m = match m {
            None | Some(Ok(Message::Close(_))) => return Some(Outcome::ClientClosed),
            Some(Err(e)) => {
                use tungstenite::Error as WsError;
                let inner = e.into_inner();
                let e = inner.downcast_ref::<WsError>();
                if matches!(e, Some(WsError::Utf8(_))) {
                    self.protocol_error("bad_utf8");
                    tracing::info!(session = id, "closed: a text message that is not UTF-8");
                    self.close = Some((1007, "a text message that is not UTF-8"));
                    return Some(Outcome::Failed);
                }
                if matches!(e, Some(WsError::Capacity(_))) {
                    self.protocol_error("too_large");
                    tracing::warn!(
                        session = id,
                        "closed: a message over limits.max_message_bytes ({})",
                        self.limits.max_message_bytes
                    );
                    self.reply(proto.too_large(self.limits.max_message_bytes));
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
        let n = match &m {
            Message::Binary(b) => b.len(),
            Message::Text(t) => t.len(),
            // Pings are answered by the WebSocket layer (one pong pending at most); they count
            // against the message rate above.
            _ => return None,
        };
        self.bytes_in.increment(n as u64);
        let mut cx = Taken {
            client,
            id,
            replies: Vec::new(),
            close: None,
            heard: false,
            end: false,
            warned: &mut self.warned,
            budget: &mut self.budget,
        };
        proto.take(m, &mut cx);
        let Taken {
            replies,
            close,
            heard,
            end,
            ..
        } = cx;
        if heard {
            self.last_heard = Instant::now();
        }
        self.reply(replies);
        if close.is_some() {
            self.close = close;
            return Some(Outcome::Failed);
        }
        end.then_some(Outcome::ClientClosed)
    }
}

/// Runs one connection (its two halves: [`halves`] for a WebSocket) to its end, in the
/// protocol `proto`.
pub(super) async fn run<P: Protocol>(
    server: Arc<Server>,
    (sink, mut stream): (ClientSink, ClientStream),
    peer: SocketAddr,
    mut proto: P,
    admission: Admission,
) {
    let id = server.next_id.fetch_add(1, Ordering::Relaxed);
    let t0 = Instant::now();
    metrics::counter!(names::SESSIONS_ADMITTED).increment(1);
    let limits = server.cfg.limits;
    let (mut client, end) =
        crate::session::link_bounded(INBOUND_QUEUE, INBOUND_BYTES, OUTBOUND_QUEUE);
    let (reply_tx, reply_rx) = tokio::sync::mpsc::channel(REPLY_QUEUE);
    let (ended_tx, mut ended) = tokio::sync::oneshot::channel();
    let outbound = std::mem::replace(&mut client.outbound, tokio::sync::mpsc::channel(1).1);
    let writer = Writer {
        sink,
        encoder: proto.encoder(),
        stall: limits.stall_timeout,
        bytes_out: metrics::counter!(names::SESSION_BYTES, "direction" => "out"),
    };
    let mut writer = Some(tokio::spawn(writer.run(reply_rx, outbound, ended_tx)));
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
                    transport: proto.transport(),
                },
            )
        })
        .ok();
    let mut close_all = server.close_all.subscribe();
    let budget = AudioBudget::of(&server.template());
    let mut inflow = Inflow::new(id, limits, reply_tx.clone(), budget);
    inflow.reply(proto.hello());
    // Until the client has said what it wants: its messages are taken (what it says of its
    // session applied; what it may send of its audio queued for the session to come), within
    // the handshake limit.
    let mut outcome = None;
    let deadline = tokio::time::Instant::from_std(t0 + limits.handshake_timeout);
    while outcome.is_none() && !proto.may_start() {
        tokio::select! {
            m = stream.next() => outcome = inflow.take(m, &mut proto, &client),
            _ = tokio::time::sleep_until(deadline) => {
                tracing::info!(session = id, client = %peer, "closed: no conversation began within {:.0} s (limits.handshake_timeout_s)", limits.handshake_timeout.as_secs_f64());
                inflow.close = Some((1008, "no conversation began within limits.handshake_timeout_s"));
                outcome = Some(Outcome::Idle);
            }
            _ = close_all.changed() => outcome = Some(Outcome::Closed),
        }
    }
    // The session's pipeline, built and started (or why not, in the client's words).
    let mut started = None;
    let mut refused = None;
    if outcome.is_none() {
        match proto.params(&server.cfg) {
            Err(m) => {
                tracing::info!(session = id, client = %peer, "refused: {m}");
                refused = Some(m);
                outcome = Some(Outcome::Refused);
            }
            Ok(params) => {
                let meta = metadata(&server, &params, id);
                let s = server.clone();
                let pcm = proto.pcm();
                let built = tokio::task::spawn_blocking(move || {
                    let r = start(&s, &params, id, &end, pcm);
                    drop(end);
                    r
                })
                .await;
                match built {
                    Ok(Ok(s)) => {
                        if let Ok(mut m) = server.sessions.lock() {
                            if let Some(l) = m.get_mut(&id) {
                                l.handle = Some(s.handle.clone());
                                l.monitor = Some(s.monitor.clone());
                            }
                        }
                        tracing::info!(session = id, client = %peer, "session started");
                        started = Some((s, meta));
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(session = id, client = %peer, "the session could not start: {e:#}");
                        refused = Some(for_client(&e, id));
                        outcome = Some(Outcome::Failed);
                    }
                    Err(e) => {
                        tracing::error!(session = id, "building the session panicked: {e}");
                        refused = Some("the session could not start: internal error".into());
                        outcome = Some(Outcome::Failed);
                    }
                }
            }
        }
    }
    let mut close = inflow.close;
    let mut told = refused.map(|t| {
        let c = close_reason(&t);
        close = close.or(Some((1008, "")));
        (proto.refusal(&t), c)
    });
    let mut opened = false;
    if let Some((
        Started {
            running,
            handle,
            monitor: _monitor,
        },
        meta,
    )) = started
    {
        let waited = tokio::task::spawn_blocking(move || running.wait());
        // Primed (warm-up, persona, voice) before the client is told it is ready. The socket is
        // read meanwhile: a client that leaves (or floods) stops the priming.
        let ready_since = Instant::now();
        while outcome.is_none() && !handle.is_ready() {
            if ready_since.elapsed() > READY_TIMEOUT || waited.is_finished() || *close_all.borrow()
            {
                break;
            }
            tokio::select! {
                m = stream.next() => outcome = inflow.take(m, &mut proto, &client),
                _ = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
        }
        if outcome.is_none() {
            if handle.is_ready() {
                inflow.reply(proto.ready(&meta));
                let _ = reply_tx.try_send(Reply::Open);
                client.open();
                opened = true;
            } else {
                outcome = Some(Outcome::Failed);
            }
        } else {
            tracing::info!(
                session = id,
                "the client left while its session was starting: priming stopped"
            );
        }
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let mut published = Published::default();
        let began = Instant::now();
        let mut ended_seen = false;
        while outcome.is_none() {
            tokio::select! {
                m = stream.next() => outcome = inflow.take(m, &mut proto, &client),
                w = async { writer.as_mut().expect("writer runs").await }, if writer.is_some() => {
                    writer = None;
                    outcome = Some(match w {
                        Ok(WriterEnd::Stalled) => {
                            metrics::counter!(names::SESSION_STALLS).increment(1);
                            tracing::warn!(session = id, "closed: the client read nothing for {:.0} s (limits.stall_timeout_s)", limits.stall_timeout.as_secs_f64());
                            Outcome::Stalled
                        }
                        Ok(_) => Outcome::ClientClosed,
                        Err(_) => Outcome::Failed,
                    });
                }
                // The pipeline ended: how is for its outcome to say. (A writer that stopped drops
                // the sender unsent: its own branch says why.)
                r = &mut ended, if !ended_seen => {
                    ended_seen = true;
                    if r.is_ok() {
                        outcome = Some(Outcome::Ended);
                    }
                }
                _ = tick.tick() => {
                    published.update(&client.stats);
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
        close = inflow.close;
        // The client's input ends: the pipeline drains what it has and stops.
        client.close_input();
        if outcome != Some(Outcome::Ended) {
            handle.stop();
        }
        let result = waited.await.ok();
        published.update(&client.stats);
        // What the client is told: its own fault (its audio) in full, the server's by reference.
        if let Some(e) = result.and_then(|r| r.error) {
            let bad_input = matches!(
                e,
                crate::runtime::RunError::StageFailed {
                    bad_input: true,
                    ..
                }
            );
            let text = if bad_input {
                metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_audio")
                    .increment(1);
                tracing::info!(session = id, "the client's input was refused: {e}");
                close = close.or(Some(proto.bad_audio()));
                e.to_string()
            } else {
                tracing::warn!(session = id, "the session's pipeline failed: {e}");
                format!("the session failed: a server error (logged as session {id})")
            };
            let messages = if opened {
                proto.failure(&text)
            } else {
                proto.refusal(&text)
            };
            told = Some((messages, String::new()));
            outcome = Some(Outcome::Failed);
        }
    }
    drop(inflow);
    let outcome = outcome.unwrap_or(Outcome::Failed);
    // What the pipeline still had for the client goes out (within the stall limit), then what
    // it is told and the close; a client that closed gets its close answered.
    if let Some(w) = writer.take() {
        let (messages, reason) = told.unwrap_or_default();
        let frame = (outcome != Outcome::ClientClosed).then(|| {
            let (code, default) = close.unwrap_or(match outcome {
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
            let reason = if reason.is_empty() {
                default.to_string()
            } else {
                reason
            };
            (code, reason)
        });
        let messages = if outcome == Outcome::ClientClosed {
            Vec::new()
        } else {
            messages
        };
        let _ = reply_tx.try_send(Reply::Finish(messages, frame));
        drop(reply_tx);
        let wait = match outcome {
            Outcome::Stalled => Duration::ZERO,
            Outcome::ClientClosed => Duration::from_secs(1),
            _ => limits.stall_timeout + Duration::from_secs(3),
        };
        if tokio::time::timeout(wait, w).await.is_err() {
            tracing::debug!(session = id, "the writer was cut short");
        }
    }
    drop(client);
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
    late: u64,
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
            &mut self.late,
            LinkStats::get(&s.late_frames),
            metrics::counter!(names::SESSION_LATE_FRAMES),
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
