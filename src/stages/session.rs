//! The ends of a network session's pipeline (`duplex serve`): `session_in`, the client's audio
//! stream as it arrives, paced by the client, with silence fed while the client is quiet so
//! that the model's clock keeps running; `session_audio_out` and `session_text_out`, the
//! agent's audio stream and transcript pieces for the client.
//!
//! They reach the client through the session's [`link`](crate::session), which the build
//! context carries; outside a session template they refuse to build. They never block on the
//! client: a full queue drops and counts (the server decides when a stall closes the session).

use std::time::{Duration, Instant};

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Context, Flow, Input, PortSpec, Source, Stage, StageResult};
use crate::session::{Inbound, Outbound, Output, Received};

use super::{AgentTokens, BuildContext, BuildError, OggOpus, StageKind};

/// Samples of silence per fed frame: one model frame (80 ms at 24 kHz).
const FILL_SAMPLES: usize = 1920;
const FILL_PERIOD: Duration = Duration::from_millis(80);
/// How often the input checks for a stop request while the client is quiet.
const POLL: Duration = Duration::from_millis(50);

pub(super) const INPUT: StageKind = StageKind {
    name: "session_in",
    doc: "the client's Ogg/Opus stream as it arrives (network sessions only); silence while it is quiet",
    params: &[ParamSpec {
        name: "fill_after_ms",
        ty: T::Int { min: 80, max: 60_000 },
        default: D::Int(240),
        doc: "feed silence (one frame per 80 ms) once the client has sent nothing for this long",
    }],
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<OggOpus>("out")],
    commands: &[],
    status: &[],
    build: build_input,
};

pub(super) const AUDIO_OUT: StageKind = StageKind {
    name: "session_audio_out",
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
    let input = cx.session(INPUT.name)?.take_input().ok_or_else(|| {
        BuildError::invalid(
            "a second `session_in`: a session has one input stream, so one `session_in` stage",
        )
    })?;
    Ok(Body::Source(Box::new(SessionIn {
        input,
        fill_after: Duration::from_millis(p.int("fill_after_ms") as u64),
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

impl Source for SessionIn {
    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        loop {
            if cx.should_stop() {
                return Ok(Flow::Done);
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
                cx.emit(0, due, OggOpus::Silence(FILL_SAMPLES))?;
                return Ok(Flow::Continue);
            }
            let wait = due.map_or(POLL, |d| (d - now).min(POLL));
            let input = &self.input;
            match cx.waiting(|| input.recv(wait)) {
                Received::Chunk(bytes) => {
                    let at = Instant::now();
                    self.last = Some(at);
                    self.next_fill = None;
                    cx.emit(0, at, OggOpus::Bytes(bytes))?;
                    return Ok(Flow::Continue);
                }
                Received::Quiet => {}
                Received::Ended => return Ok(Flow::Done),
            }
        }
    }
}

fn build_audio_out(cx: &BuildContext<'_>, _: &Params) -> Result<Body, BuildError> {
    let out = cx.session(AUDIO_OUT.name)?.output();
    Ok(Body::Stage(Box::new(AudioOut {
        out,
        latency: metrics::histogram!(crate::observe::names::FRAME_LATENCY, "path" => "server"),
    })))
}

struct AudioOut {
    out: Output,
    latency: metrics::Histogram,
}

impl Stage for AudioOut {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<OggOpus>()?;
        if let OggOpus::Bytes(b) = f.data {
            // Refused messages are counted by the link; the server closes a stalled client.
            if self.out.offer(Outbound::Audio(b)).is_ok() {
                let took = f.meta.origin.elapsed();
                self.latency.record(took.as_secs_f64());
                self.out.latency(took);
            }
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
