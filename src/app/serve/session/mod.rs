//! One client's connection, the same for every transport: its session pipeline built from the
//! template with the client's choices, the client told once the pipeline is primed, and the
//! bridge between the connection (its two halves: a WebSocket's, or a transport's own, as
//! WebRTC's driver gives them) and the pipeline's session stages until one side ends; then the
//! outcome, counted. [`run`] is its phases, in order: wait for the client's choices, build,
//! prime, bridge, finish. What differs between transports ([`Protocol`]) is what the client's
//! messages mean, what is said to it, and which ends the template gets (Ogg/Opus, or PCM for a
//! protocol that converts its own wire format: [`pcm_ends`]); each transport is a room of its
//! own beside this one (`kyutai`, `realtime`, `twilio`, `webrtc`) that knows the session only
//! through the [`protocol`] seam.
//!
//! The parts: [`template`] (the session's spec, checked, with PCM ends, primed at start),
//! [`protocol`] (the seam and the audio budget), [`io`] (the writer's task and the inflow).
//!
//! The socket is read from the upgrade on, also while the session primes: a client that leaves
//! stops the priming at its next step, and the audio it sends meanwhile goes to the session's
//! input queue, bounded in chunks and in bytes (dropped and counted when full). A connection
//! that is not a conversation yet (Twilio before its `start`, the realtime API before its first
//! audio) has `limits.handshake_timeout_s` to become one; after that only the client's audio
//! keeps it from `limits.idle_timeout_s`. A protocol that converts its client's audio charges
//! it to the connection's [`AudioBudget`] from its encoded size, before decoding anything: at
//! most real time plus the catch-up of the template's decoder (its `max_speed` and
//! `catch_up_ms`); what exceeds it is dropped undecoded and counted. Every message, pings
//! included, is paid from a token bucket (`limits.max_messages_per_s`): a flood closes the session (1008,
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

mod io;
mod meta;
mod protocol;
mod template;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Admission, Live, Server};
use crate::observe::names;
use crate::session::LinkStats;

use axum::extract::ws::Message;
use futures_util::StreamExt;

use crate::app::serve::config::Limits;
pub(super) use io::{halves, ClientSink, ClientStream};
use io::{Inflow, Reply, Writer, WriterEnd, REPLY_QUEUE};
use meta::{for_client, metadata};
pub(super) use protocol::{
    base64_len, phone_bytes, AudioBudget, Encoder, Protocol, Taken, TransportStats,
};
use template::session_spec;
pub(super) use template::{check_template, default_spec, pcm_ends, prime_at_start, primes_cached};

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
pub(super) const PROTOCOL_ERRORS: [&str; 12] = [
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
    "sip_malformed",
    "bad_sdp",
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
    let template = if pcm {
        server.pcm_template()?
    } else {
        server.template()
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

/// Runs one connection (its two halves: [`halves`] for a WebSocket) to its end, in the
/// protocol `proto`: its phases in order, each a method of [`Conn`].
pub(super) async fn run<P: Protocol>(
    server: Arc<Server>,
    halves: (ClientSink, ClientStream),
    peer: SocketAddr,
    proto: P,
    admission: Admission,
) {
    let (mut c, end) = Conn::open(server, halves, peer, proto, &admission);
    c.await_choices().await;
    if let Some((started, meta)) = c.build(end).await {
        let Started {
            running,
            handle,
            monitor: _monitor,
        } = started;
        let waited = tokio::task::spawn_blocking(move || running.wait());
        let opened = c.prime(&handle, &meta, &waited).await;
        c.bridge().await;
        c.stop(&handle, waited, opened).await;
    }
    c.finish().await;
    drop(admission);
}

/// One connection across its phases: who it is, its two directions, and how it ends.
struct Conn<P: Protocol> {
    server: Arc<Server>,
    id: u64,
    peer: SocketAddr,
    t0: Instant,
    limits: Limits,
    proto: P,
    stream: ClientStream,
    client: crate::session::ClientEnd,
    inflow: Inflow,
    reply_tx: tokio::sync::mpsc::Sender<Reply>,
    writer: Option<tokio::task::JoinHandle<WriterEnd>>,
    /// Fires when the pipeline's outputs have ended.
    ended: tokio::sync::oneshot::Receiver<()>,
    close_all: tokio::sync::watch::Receiver<bool>,
    /// How the session ends, once it does.
    outcome: Option<Outcome>,
    /// What the client is told before the close, and the close's reason when it has its own.
    told: Option<(Vec<Message>, String)>,
    /// The close code and reason when the client broke no rule (a refusal, its bad audio).
    close_else: Option<(u16, &'static str)>,
    published: Published,
}

impl<P: Protocol> Conn<P> {
    /// The connection admitted: counted, its link made, its writer started, listed in
    /// `/api/sessions`, the protocol's hello queued. Returns the link's pipeline end for the
    /// session to come.
    fn open(
        server: Arc<Server>,
        (sink, stream): (ClientSink, ClientStream),
        peer: SocketAddr,
        proto: P,
        admission: &Admission,
    ) -> (Self, crate::session::PipelineEnd) {
        let id = server.next_id.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        metrics::counter!(names::SESSIONS_ADMITTED).increment(1);
        let limits = server.cfg.limits;
        let (mut client, end) =
            crate::session::link_bounded(INBOUND_QUEUE, INBOUND_BYTES, OUTBOUND_QUEUE);
        let (reply_tx, reply_rx) = tokio::sync::mpsc::channel(REPLY_QUEUE);
        let (ended_tx, ended) = tokio::sync::oneshot::channel();
        let outbound = std::mem::replace(&mut client.outbound, tokio::sync::mpsc::channel(1).1);
        let writer = Writer {
            sink,
            encoder: proto.encoder(),
            stall: limits.stall_timeout,
            bytes_out: metrics::counter!(names::SESSION_BYTES, "direction" => "out"),
        };
        let writer = Some(tokio::spawn(writer.run(reply_rx, outbound, ended_tx)));
        if let Ok(mut m) = server.sessions.lock() {
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
            );
        }
        let close_all = server.close_all.subscribe();
        let budget = AudioBudget::of(&server.template());
        let mut proto = proto;
        let inflow = Inflow::new(id, limits, reply_tx.clone(), budget);
        proto.named(id);
        inflow.reply(proto.hello());
        let conn = Conn {
            server,
            id,
            peer,
            t0,
            limits,
            proto,
            stream,
            client,
            inflow,
            reply_tx,
            writer,
            ended,
            close_all,
            outcome: None,
            told: None,
            close_else: None,
            published: Published::default(),
        };
        (conn, end)
    }

    /// Takes the client's messages until `done` (asked after each one, and every `poll`) says
    /// so, the client ends the session, or the server closes every session; `true` when `done`
    /// did.
    async fn take_until(&mut self, poll: Duration, mut done: impl FnMut(&P) -> bool) -> bool {
        let Conn {
            stream,
            inflow,
            proto,
            client,
            close_all,
            outcome,
            ..
        } = self;
        while outcome.is_none() {
            if done(proto) {
                return true;
            }
            tokio::select! {
                m = stream.next() => *outcome = inflow.take(m, proto, client),
                _ = tokio::time::sleep(poll) => {}
                _ = close_all.changed() => *outcome = Some(Outcome::Closed),
            }
        }
        false
    }

    /// Until the client has said what it wants: its messages are taken (what it says of its
    /// session applied; what it may send of its audio queued for the session to come), within
    /// the handshake limit.
    async fn await_choices(&mut self) {
        let deadline = self.t0 + self.limits.handshake_timeout;
        let said = self
            .take_until(Duration::from_millis(50), |p| {
                p.may_start() || Instant::now() >= deadline
            })
            .await;
        if said && !self.proto.may_start() {
            tracing::info!(
                session = self.id,
                client = %self.peer,
                "closed: no conversation began within {:.0} s (limits.handshake_timeout_s)",
                self.limits.handshake_timeout.as_secs_f64()
            );
            self.inflow.close = Some((
                1008,
                "no conversation began within limits.handshake_timeout_s",
            ));
            self.outcome = Some(Outcome::Idle);
        }
    }

    /// The session's pipeline built and started with the client's choices, and its metadata;
    /// or why not, in the client's words (`told`).
    async fn build(
        &mut self,
        end: crate::session::PipelineEnd,
    ) -> Option<(Started, serde_json::Value)> {
        if self.outcome.is_some() {
            return None;
        }
        let (id, peer) = (self.id, self.peer);
        let refused = match self.proto.params(&self.server.cfg) {
            Err(m) => {
                tracing::info!(session = id, client = %peer, "refused: {m}");
                self.outcome = Some(Outcome::Refused);
                m
            }
            Ok(params) => {
                let meta = metadata(&self.server, &params, id);
                let s = self.server.clone();
                let pcm = self.proto.pcm();
                let built = tokio::task::spawn_blocking(move || {
                    let r = start(&s, &params, id, &end, pcm);
                    drop(end);
                    r
                })
                .await;
                match built {
                    Ok(Ok(s)) => {
                        if let Ok(mut m) = self.server.sessions.lock() {
                            if let Some(l) = m.get_mut(&id) {
                                l.handle = Some(s.handle.clone());
                                l.monitor = Some(s.monitor.clone());
                            }
                        }
                        tracing::info!(session = id, client = %peer, "session started");
                        return Some((s, meta));
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(session = id, client = %peer, "the session could not start: {e:#}");
                        self.outcome = Some(Outcome::Failed);
                        for_client(&e, id)
                    }
                    Err(e) => {
                        tracing::error!(session = id, "building the session panicked: {e}");
                        self.outcome = Some(Outcome::Failed);
                        "the session could not start: internal error".into()
                    }
                }
            }
        };
        self.close_else = Some((1008, ""));
        self.told = Some((self.proto.refusal(&refused), close_reason(&refused)));
        None
    }

    /// Primed (warm-up, persona, voice) before the client is told it is ready; the socket is
    /// read meanwhile, so a client that leaves (or floods) stops the priming. Returns whether
    /// the session opened.
    async fn prime(
        &mut self,
        handle: &crate::runtime::Handle,
        meta: &serde_json::Value,
        waited: &tokio::task::JoinHandle<crate::runtime::RunOutcome>,
    ) -> bool {
        let ready_since = Instant::now();
        self.take_until(Duration::from_millis(10), |_| {
            handle.is_ready() || ready_since.elapsed() > READY_TIMEOUT || waited.is_finished()
        })
        .await;
        if self.outcome.is_some() {
            tracing::info!(
                session = self.id,
                "the client left while its session was starting: priming stopped"
            );
            return false;
        }
        if !handle.is_ready() {
            self.outcome = Some(Outcome::Failed);
            return false;
        }
        self.inflow.reply(self.proto.ready(meta));
        let _ = self.reply_tx.try_send(Reply::Open);
        self.client.open();
        true
    }

    /// The conversation: the client's messages in, the pipeline's out (the writer's task), until
    /// one side ends, the client stops reading or sending, or the server closes it.
    async fn bridge(&mut self) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let began = Instant::now();
        let mut ended_seen = false;
        let (id, limits) = (self.id, self.limits);
        let Conn {
            stream,
            inflow,
            proto,
            client,
            writer,
            ended,
            close_all,
            outcome,
            published,
            ..
        } = self;
        while outcome.is_none() {
            tokio::select! {
                m = stream.next() => *outcome = inflow.take(m, proto, client),
                w = async { writer.as_mut().expect("writer runs").await }, if writer.is_some() => {
                    *writer = None;
                    *outcome = Some(match w {
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
                r = &mut *ended, if !ended_seen => {
                    ended_seen = true;
                    if r.is_ok() {
                        *outcome = Some(Outcome::Ended);
                    }
                }
                _ = tick.tick() => {
                    published.update(&client.stats);
                    if inflow.last_heard.elapsed() > limits.idle_timeout {
                        tracing::info!(session = id, "closed: the client sent nothing for {:.0} s (limits.idle_timeout_s)", limits.idle_timeout.as_secs_f64());
                        *outcome = Some(Outcome::Idle);
                    } else if limits.max_session.is_some_and(|m| began.elapsed() > m) {
                        tracing::info!(session = id, "closed: the session reached limits.max_session_s");
                        *outcome = Some(Outcome::Closed);
                    }
                }
                _ = close_all.changed() => *outcome = Some(Outcome::Closed),
            }
        }
    }

    /// The pipeline stopped (its input ended, so it drains first) and waited for; a failure
    /// becomes what the client is told: its own fault (its audio) in full, the server's by
    /// reference.
    async fn stop(
        &mut self,
        handle: &crate::runtime::Handle,
        waited: tokio::task::JoinHandle<crate::runtime::RunOutcome>,
        opened: bool,
    ) {
        self.client.close_input();
        if self.outcome != Some(Outcome::Ended) {
            handle.stop();
        }
        let result = waited.await.ok();
        self.published.update(&self.client.stats);
        let Some(e) = result.and_then(|r| r.error) else {
            return;
        };
        let id = self.id;
        let bad_input = matches!(
            e,
            crate::runtime::RunError::StageFailed {
                bad_input: true,
                ..
            }
        );
        let text = if bad_input {
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_audio").increment(1);
            tracing::info!(session = id, "the client's input was refused: {e}");
            self.close_else = Some(self.proto.bad_audio());
            e.to_string()
        } else {
            tracing::warn!(session = id, "the session's pipeline failed: {e}");
            format!("the session failed: a server error (logged as session {id})")
        };
        let messages = if opened {
            self.proto.failure(&text)
        } else {
            self.proto.refusal(&text)
        };
        self.told = Some((messages, String::new()));
        self.outcome = Some(Outcome::Failed);
    }

    /// What the pipeline still had for the client goes out (within the stall limit), then what
    /// it is told and the close (a client that closed gets its close answered); the session is
    /// unlisted, and its outcome counted and logged.
    async fn finish(mut self) {
        let outcome = self.outcome.unwrap_or(Outcome::Failed);
        let close = self.inflow.close.or(self.close_else);
        let writer = self.writer.take();
        if writer.is_some() {
            let (messages, reason) = self.told.take().unwrap_or_default();
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
            let _ = self.reply_tx.try_send(Reply::Finish(messages, frame));
        }
        let wait = match outcome {
            Outcome::Stalled => Duration::ZERO,
            Outcome::ClientClosed => Duration::from_secs(1),
            _ => self.limits.stall_timeout + Duration::from_secs(3),
        };
        // The replies' senders (ours, the inflow's) go, so that the writer ends whatever it got.
        let Conn {
            server,
            id,
            peer,
            t0,
            client,
            inflow,
            reply_tx,
            stream: _stream,
            ..
        } = self;
        drop(inflow);
        drop(reply_tx);
        if let Some(w) = writer {
            if tokio::time::timeout(wait, w).await.is_err() {
                tracing::debug!(session = id, "the writer was cut short");
            }
        }
        drop(client);
        ended(&server, id, peer, t0, outcome);
    }
}

/// A session's end, counted and logged; it leaves `/api/sessions`.
fn ended(server: &Server, id: u64, peer: SocketAddr, t0: Instant, outcome: Outcome) {
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
