//! The seam between a session and its transport: what a protocol says at each phase
//! ([`Protocol`]), how the pipeline's messages become its messages ([`Encoder`]), what taking
//! one of the client's messages may do ([`Taken`]), and what the client's audio may cost before
//! it is decoded ([`AudioBudget`]). A transport knows the session through these alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::Message;

use crate::app::serve::config::{ServeConfig, SessionParams};
use crate::config::PipelineSpec;
use crate::observe::names;
use crate::session::Outbound;

/// What differs between the protocols a session is spoken in (Kyutai's binary one, the realtime
/// API's JSON events): the messages that open, answer and end a session, how the client's
/// audio arrives and how the pipeline's messages are written. The rest of a connection (the
/// session's pipeline, the limits, the writer, the outcomes and their metrics) is
/// [`run`]'s, the same for all.
pub(crate) trait Protocol: Send + 'static {
    /// The session's id (as `/api/sessions` lists it), told before [`Protocol::hello`].
    fn named(&mut self, _id: u64) {}

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
    fn params(&mut self, cfg: &ServeConfig) -> Result<SessionParams, String>;

    /// Messages that tell the client its session is ready; the pipeline's output follows.
    fn ready(&mut self, meta: &serde_json::Value) -> Vec<Message>;

    /// One message of the client's (binary or text; not a close, ping or pong), paid for.
    fn take(&mut self, m: Message, cx: &mut Taken<'_>);

    /// The writer's encoder of the pipeline's messages.
    fn encoder(&self) -> Box<dyn Encoder>;

    /// What a client is told when its session cannot start (before `ready`); by default
    /// nothing (a telephone's protocol has no words for it).
    fn refusal(&self, _text: &str) -> Vec<Message> {
        Vec::new()
    }

    /// What a client is told when its session fails (after `ready`); by default nothing.
    fn failure(&self, _text: &str) -> Vec<Message> {
        Vec::new()
    }

    /// The close code and reason when the pipeline refused the client's audio.
    fn bad_audio(&self) -> (u16, &'static str) {
        (1007, "the call's audio could not be used")
    }

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
pub(crate) type TransportStats = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// Turns the pipeline's messages into the protocol's (in the writer's task).
pub(crate) trait Encoder: Send {
    /// The messages for one of the pipeline's.
    fn encode(&mut self, m: Outbound) -> Vec<Message>;
}

/// The telephone transports' (Twilio's, SIP's) G.711 bytes of one of the pipeline's
/// messages: the agent's audio through `phone`; `None` for text (a call carries none: the
/// transcript is in the session's logs) and for audio that made no whole byte yet.
pub(crate) fn phone_bytes(
    phone: &mut Option<crate::audio::phone::PhoneOut>,
    m: Outbound,
) -> Option<Vec<u8>> {
    let Outbound::Pcm(samples) = m else {
        return None;
    };
    let bytes = phone.as_mut()?.encode(&samples);
    (!bytes.is_empty()).then_some(bytes)
}

/// What a protocol's [`Protocol::take`] may do with a message.
pub(crate) struct Taken<'a> {
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
    pub(super) warned: &'a mut std::collections::HashSet<&'static str>,
    pub(super) budget: &'a mut AudioBudget,
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
pub(crate) struct AudioBudget {
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
    pub(crate) fn pacing(template: &PipelineSpec) -> Option<(f64, Duration)> {
        let decoder = template
            .stages
            .iter()
            .find_map(crate::stages::read::decoder_pacing);
        match decoder {
            Some((speed, catch_up)) if speed > 0.0 => {
                Some((speed, Duration::from_millis(catch_up)))
            }
            Some(_) => None,
            None => Some((1.0, Duration::from_secs(1))),
        }
    }

    /// The budget of the template's decoder's [`pacing`](Self::pacing).
    pub(crate) fn of(template: &PipelineSpec) -> AudioBudget {
        Self::paced(Self::pacing(template))
    }

    /// A budget of `pacing` (times real time, the catch-up ahead; `None`: unpaced).
    pub(crate) fn paced(pacing: Option<(f64, Duration)>) -> AudioBudget {
        AudioBudget {
            bucket: pacing.map(|(speed, catch_up)| {
                crate::audio::pace::RealTime::new(1_000_000, speed, catch_up)
            }),
            refused_us: 0,
            refused: metrics::counter!(names::OPUS_REFUSED),
        }
    }

    /// Takes `d` from the budget now, or refuses it (counted).
    pub(super) fn take(&mut self, d: Duration) -> bool {
        self.take_at(d, Instant::now())
    }

    /// Takes `d` from the budget at `now`, or refuses it (counted).
    pub(crate) fn take_at(&mut self, d: Duration, now: Instant) -> bool {
        let us = d.as_micros().min(usize::MAX as u128) as usize;
        let Some(b) = self.bucket.as_mut() else {
            return true;
        };
        if b.take_at(us, now) {
            return true;
        }
        self.refused_us += us as u64;
        let frame = 80_000;
        self.refused.increment(self.refused_us / frame);
        self.refused_us %= frame;
        false
    }
}

/// The bytes a base64 text decodes to (or would, were it valid), from its length alone.
pub(crate) fn base64_len(b64: &str) -> usize {
    let b = b64.trim_end().as_bytes();
    let pad = b.iter().rev().take_while(|c| **c == b'=').count().min(2);
    (b.len() * 3 / 4).saturating_sub(pad)
}
