//! The ends of a network session's pipeline (`duplex serve`): `session_in`, the client's audio
//! stream as it arrives, paced by the client, with silence fed while the client is quiet so
//! that the model's clock keeps running; `session_audio_out` and `session_text_out`, the
//! agent's audio stream and transcript pieces for the client.
//!
//! `session_pcm_in` and `session_pcm_out` are the same ends for a transport that carries PCM
//! and converts its own wire format (the OpenAI realtime API, the telephone): the server puts
//! them in place of a template's `session_in → opus_decode` and `opus_encode →
//! session_audio_out`, so one template serves every transport. The input is 16-bit
//! little-endian 24 kHz PCM, paced like `opus_decode` (at most real time plus a catch-up
//! allowance; the rest is dropped and counted).
//!
//! They reach the client through the session's [`link`](crate::session), which the build
//! context carries; outside a session template they refuse to build. They never block on the
//! client: a full queue drops and counts (the server decides when a stall closes the session).

use std::time::{Duration, Instant};

use crate::audio::pace::Budget;
use crate::audio::{Pcm, MODEL_RATE};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{
    Body, Caps, CapsError, Context, Flow, Input, PortSpec, Source, Stage, StageResult,
};
use crate::session::{Inbound, Outbound, Output, Received};

use super::params::stage_params;
use super::{caps, AgentTokens, BuildContext, BuildError, OggOpus, StageKind};

/// Samples of silence per fed frame: one model frame (80 ms at 24 kHz).
const FILL_SAMPLES: usize = 1920;
const FILL_PERIOD: Duration = Duration::from_millis(80);
/// How often the input checks for a stop request while the client is quiet.
const POLL: Duration = Duration::from_millis(50);

pub(super) const INPUT: StageKind = StageKind {
    name: super::kind::SESSION_IN,
    doc: "the client's Ogg/Opus stream as it arrives (network sessions only); silence while it is quiet",
    params: InputParams::SPECS,
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<OggOpus>("out")],
    commands: &[],
    status: &[],
    build: build_input,
};

const FILL_AFTER: ParamSpec = ParamSpec {
    name: "fill_after_ms",
    ty: T::Int {
        min: 80,
        max: 60_000,
    },
    default: D::Int(240),
    doc: "feed silence (one frame per 80 ms) once the client has sent nothing for this long",
};

stage_params! {
    /// `session_in`'s params.
    struct InputParams {
        fill_after_ms: u64 = FILL_AFTER,
    }
}

stage_params! {
    /// `session_pcm_in`'s params: its silence and its pacing (as `opus_decode`'s).
    struct PcmInputParams {
        fill_after_ms: u64 = FILL_AFTER,
        max_speed: f64 = super::opus::MAX_SPEED,
        catch_up_ms: u64 = super::opus::CATCH_UP,
    }
}

pub(super) const PCM_INPUT: StageKind = StageKind {
    name: super::kind::SESSION_PCM_IN,
    doc: "the client's audio as 16-bit 24 kHz PCM from a transport that decodes its own wire format (network sessions only); paced; silence while it is quiet",
    params: PcmInputParams::SPECS,
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build: build_pcm_input,
};

pub(super) const PCM_OUT: StageKind = StageKind {
    name: super::kind::SESSION_PCM_OUT,
    doc: "sends the agent's 24 kHz PCM to a transport that encodes its own wire format (network sessions only); never blocks",
    params: &[],
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build: build_pcm_out,
};

pub(super) const AUDIO_OUT: StageKind = StageKind {
    name: super::kind::SESSION_AUDIO_OUT,
    doc: "sends the agent's Ogg/Opus pages to the client (network sessions only); never blocks",
    params: &[],
    inputs: || vec![PortSpec::new::<OggOpus>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build: build_audio_out,
};

pub(super) const TEXT_OUT: StageKind = StageKind {
    name: "session_text_out",
    doc: "sends the agent's transcript pieces to the client (network sessions only); padding is never sent",
    params: &[],
    inputs: || vec![PortSpec::new::<AgentTokens>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build: build_text_out,
};

fn build_input(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = InputParams::from_params(p)?;
    let input = cx.session(INPUT.name)?.take_input().ok_or_else(|| {
        BuildError::invalid(
            "a second `session_in`: a session has one input stream, so one `session_in` stage",
        )
    })?;
    Ok(Body::Source(Box::new(SessionIn {
        input,
        fill_after: Duration::from_millis(p.fill_after_ms),
        last: None,
        next_fill: None,
    })))
}

struct SessionIn {
    input: Inbound,
    fill_after: Duration,
    /// When the client last sent something (or the session opened).
    last: Option<Instant>,
    /// When the next frame of silence is due, while filling.
    next_fill: Option<Instant>,
}

/// What the client's clock gives next.
enum Next {
    /// A piece of the stream (or of silence), stamped with when it came.
    Piece(Instant, OggOpus),
    /// The client's input ended, or the stage is stopping.
    Done,
}

impl SessionIn {
    /// The next piece of the client's stream as it arrives; silence (one frame per 80 ms)
    /// once the session is open and the client has been quiet for `fill_after`.
    fn next(&mut self, cx: &mut Context<'_>) -> StageResult<Next> {
        loop {
            if cx.should_stop() {
                return Ok(Next::Done);
            }
            let now = Instant::now();
            let due = if self.input.is_open() {
                let last = *self.last.get_or_insert(now);
                Some(self.next_fill.unwrap_or(last + self.fill_after))
            } else {
                None
            };
            if let Some(due) = due.filter(|d| *d <= now) {
                self.next_fill = Some(due + FILL_PERIOD);
                self.input.count_silence();
                return Ok(Next::Piece(due, OggOpus::Silence(FILL_SAMPLES)));
            }
            let wait = due.map_or(POLL, |d| (d - now).min(POLL));
            let input = &self.input;
            match cx.waiting(|| input.recv(wait)) {
                Received::Chunk(bytes) => {
                    let at = Instant::now();
                    self.last = Some(at);
                    self.next_fill = None;
                    return Ok(Next::Piece(at, OggOpus::Bytes(bytes)));
                }
                Received::Quiet => {}
                Received::Ended => return Ok(Next::Done),
            }
        }
    }
}

impl Source for SessionIn {
    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        match self.next(cx)? {
            Next::Done => Ok(Flow::Done),
            Next::Piece(at, piece) => {
                cx.emit(0, at, piece)?;
                Ok(Flow::Continue)
            }
        }
    }
}

fn build_pcm_input(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = PcmInputParams::from_params(p)?;
    let input = cx.session(PCM_INPUT.name)?.take_input().ok_or_else(|| {
        BuildError::invalid(
            "a second session input: a session has one input stream, so one `session_pcm_in` stage",
        )
    })?;
    let budget = super::opus::budget(p.max_speed, p.catch_up_ms);
    Ok(Body::Source(Box::new(SessionPcmIn {
        clock: SessionIn {
            input,
            fill_after: Duration::from_millis(p.fill_after_ms),
            last: None,
            next_fill: None,
        },
        budget,
        odd: None,
        warned: false,
        refused: metrics::counter!(crate::observe::names::OPUS_REFUSED),
        refused_samples: 0,
    })))
}

/// The client's PCM, paced, with silence while it is quiet: [`SessionIn`]'s clock, then the
/// bytes turned to samples.
struct SessionPcmIn {
    clock: SessionIn,
    budget: Box<dyn Budget + Send>,
    /// The first byte of a sample split between two chunks.
    odd: Option<u8>,
    warned: bool,
    refused: metrics::Counter,
    /// Samples dropped by the budget, not yet counted in whole frames.
    refused_samples: usize,
}

impl SessionPcmIn {
    fn samples(&mut self, bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::with_capacity(bytes.len() / 2 + 1);
        let mut rest = bytes;
        if let (Some(lo), Some((&hi, tail))) = (self.odd, rest.split_first()) {
            out.push(i16::from_le_bytes([lo, hi]) as f32 / 32768.0);
            self.odd = None;
            rest = tail;
        }
        out.extend(crate::audio::phone::from_pcm16(rest));
        if !rest.len().is_multiple_of(2) {
            self.odd = rest.last().copied();
        }
        out
    }
}

impl Source for SessionPcmIn {
    fn caps(&self) -> Vec<Caps> {
        vec![Caps::new().with(caps::RATE, MODEL_RATE as i64)]
    }

    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        loop {
            let (at, piece) = match self.clock.next(cx)? {
                Next::Done => return Ok(Flow::Done),
                Next::Piece(at, piece) => (at, piece),
            };
            let samples = match piece {
                OggOpus::Silence(n) => vec![0.0; n],
                OggOpus::Bytes(b) => self.samples(&b),
            };
            if samples.is_empty() {
                continue;
            }
            if !self.budget.take(samples.len()) {
                if !self.warned {
                    self.warned = true;
                    tracing::warn!(
                        "the client's audio comes faster than real time: what exceeds the catch-up \
                         allowance is dropped (counted in {})",
                        crate::observe::names::OPUS_REFUSED
                    );
                }
                self.refused_samples += samples.len();
                let frame = crate::audio::FRAME_SAMPLES;
                self.refused
                    .increment((self.refused_samples / frame) as u64);
                self.refused_samples %= frame;
                continue;
            }
            cx.emit(0, at, Pcm::new(MODEL_RATE, samples))?;
            return Ok(Flow::Continue);
        }
    }
}

/// The agent's audio on its way to the client, with the server latency of what was taken.
struct AudioSender {
    out: Output,
    latency: metrics::Histogram,
}

impl AudioSender {
    fn new(out: Output) -> Self {
        AudioSender {
            out,
            latency: metrics::histogram!(crate::observe::names::FRAME_LATENCY, "path" => "server"),
        }
    }

    /// Offers `m` for the frame that came in at `origin`.
    fn send(&self, m: Outbound, origin: Instant) {
        // Refused messages are counted by the link; the server closes a stalled client.
        if self.out.offer(m).is_ok() {
            let took = origin.elapsed();
            self.latency.record(took.as_secs_f64());
            self.out.latency(took);
        }
    }
}

fn build_pcm_out(cx: &BuildContext<'_>, _: &Params) -> Result<Body, BuildError> {
    let out = cx.session(PCM_OUT.name)?.output();
    Ok(Body::Stage(Box::new(PcmOut(AudioSender::new(out)))))
}

struct PcmOut(AudioSender);

impl Stage for PcmOut {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        caps::require_pcm(&inputs[0], MODEL_RATE, None)?;
        Ok(Vec::new())
    }

    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Pcm>()?;
        let samples = f.data.valid().to_vec();
        self.0.send(Outbound::Pcm(samples), f.meta.origin);
        Ok(())
    }
}

fn build_audio_out(cx: &BuildContext<'_>, _: &Params) -> Result<Body, BuildError> {
    let out = cx.session(AUDIO_OUT.name)?.output();
    Ok(Body::Stage(Box::new(AudioOut(AudioSender::new(out)))))
}

struct AudioOut(AudioSender);

impl Stage for AudioOut {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<OggOpus>()?;
        if let OggOpus::Bytes(b) = f.data {
            self.0.send(Outbound::Audio(b), f.meta.origin);
        }
        Ok(())
    }
}

fn build_text_out(cx: &BuildContext<'_>, _: &Params) -> Result<Body, BuildError> {
    let out = cx.session(TEXT_OUT.name)?.output();
    Ok(Body::Stage(Box::new(TextOut { out })))
}

struct TextOut {
    out: Output,
}

impl Stage for TextOut {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let t = input.take::<AgentTokens>()?.data;
        if let Some(piece) = t.piece.filter(|p| !p.is_empty()) {
            let _ = self.out.offer(Outbound::Text(piece));
        }
        Ok(())
    }
}
