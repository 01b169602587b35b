//! `opus_decode` and `opus_encode`: a network client's Ogg/Opus stream ↔ 24 kHz mono PCM, on
//! the [`audio::opus`](crate::audio::opus) reader and writer.
//!
//! The decoder takes the stream in chunks split anywhere and emits whatever PCM they complete
//! (the framer after it cuts model frames); a gap stands for silence. It paces what it decodes
//! by wall time ([`RealTime`]): at most real time (`max_speed`) plus a catch-up allowance; a
//! packet beyond that is skipped before it is decoded and counted, so neither a client sending
//! faster than real time nor packets claiming hours of audio cost more than a session talking.
//! A stream that is not Ogg/Opus, or a damaged page, fails the stage with what was wrong, which
//! ends that session alone. The encoder emits the header pages first, then one page per 40 ms
//! packet.

use std::time::{Duration, Instant};

use crate::audio::opus::{OggOpusReader, OggOpusWriter, RATE};
use crate::audio::pace::{Budget, RealTime, Unlimited};
use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{
    Body, Caps, CapsError, Context, Endpoint, Input, PortSpec, Stage, StageError, StageResult,
    StatusSpec,
};

use super::params::stage_params;
use super::{caps, BuildContext, BuildError, OggOpus, StageKind};

/// How fast a client's audio is taken (`opus_decode`, `session_pcm_in`).
pub(super) const MAX_SPEED: ParamSpec = ParamSpec {
    name: "max_speed",
    ty: T::Float {
        min: 0.0,
        max: 100.0,
    },
    default: D::Float(1.0),
    doc: "audio taken at most this many times as fast as it plays, beyond `catch_up_ms` (0 = unpaced, for streams you trust)",
};

/// How far ahead of real time a client's audio may come at once.
pub(super) const CATCH_UP: ParamSpec = ParamSpec {
    name: "catch_up_ms",
    ty: T::Int {
        min: 80,
        max: 60_000,
    },
    default: D::Int(1000),
    doc: "audio that may come ahead of real time at once (a burst after a network stall); more is skipped and counted",
};

stage_params! {
    /// `opus_decode`'s params: how fast it takes a client's audio.
    pub(super) struct DecodeParams {
        max_speed: f64 = MAX_SPEED,
        catch_up_ms: u64 = CATCH_UP,
    }
}

stage_params! {
    /// `opus_encode`'s params.
    struct EncodeParams {
        bitrate: i32 = ParamSpec {
            name: "bitrate",
            ty: T::Int {
                min: 0,
                max: 512_000,
            },
            default: D::Int(0),
            doc: "bits per second (0 = libopus's choice)",
        },
    }
}

/// The pacing of [`MAX_SPEED`] (`speed`) and [`CATCH_UP`] (`catch_up_ms`) as a stage's params
/// set them.
pub(super) fn budget(speed: f64, catch_up_ms: u64) -> Box<dyn Budget + Send> {
    if speed > 0.0 {
        let catch_up = Duration::from_millis(catch_up_ms);
        Box::new(RealTime::new(RATE, speed, catch_up))
    } else {
        Box::new(Unlimited)
    }
}

pub(super) const DECODE: StageKind = StageKind {
    name: super::kind::OPUS_DECODE,
    doc: "a client's Ogg/Opus stream (chunks split anywhere) -> 24 kHz mono PCM; gaps -> silence; paced",
    params: DecodeParams::SPECS,
    inputs: || vec![PortSpec::new::<OggOpus>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[StatusSpec {
        name: "refused_ms",
        doc: "audio skipped undecoded: it came faster than real time beyond the catch-up allowance",
    }],
    build: build_decode,
};

pub(super) const ENCODE: StageKind = StageKind {
    name: super::kind::OPUS_ENCODE,
    doc: "24 kHz mono PCM -> an Ogg/Opus stream: header pages, then one page per 40 ms packet",
    params: EncodeParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<OggOpus>("out")],
    commands: &[],
    status: &[],
    build: build_encode,
};

fn build_decode(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = DecodeParams::from_params(p)?;
    let budget = budget(p.max_speed, p.catch_up_ms);
    let control = cx.endpoint();
    control.set("refused_ms", 0u64);
    Ok(Body::Stage(Box::new(Decode {
        reader: OggOpusReader::new(),
        out: Vec::new(),
        budget,
        refused_silence: 0,
        reported: 0,
        control,
        decode_time: metrics::histogram!(crate::observe::names::OPUS_TIME, "direction" => "decode"),
        refused: metrics::counter!(crate::observe::names::OPUS_REFUSED),
    })))
}

struct Decode {
    reader: OggOpusReader,
    out: Vec<f32>,
    budget: Box<dyn Budget + Send>,
    /// Samples of fed silence the budget refused.
    refused_silence: u64,
    /// Refused samples already counted in the metric.
    reported: u64,
    control: Endpoint,
    decode_time: metrics::Histogram,
    refused: metrics::Counter,
}

impl Decode {
    /// Publishes what the budget refused since the last call; warns once, when it starts.
    fn count_refused(&mut self) {
        let now = self.reader.refused().1 + self.refused_silence;
        if now > self.reported {
            if self.reported == 0 {
                tracing::warn!(
                    "the client's audio comes faster than real time: what exceeds the catch-up \
                     allowance is skipped undecoded (counted in {})",
                    crate::observe::names::OPUS_REFUSED
                );
            }
            let frame = crate::audio::FRAME_SAMPLES as u64;
            self.refused.increment(now / frame - self.reported / frame);
            self.reported = now;
            self.control.set("refused_ms", now * 1000 / RATE as u64);
        }
    }
}

impl Stage for Decode {
    fn caps(&self, _: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        Ok(vec![Caps::new().with(caps::RATE, RATE as i64)])
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<OggOpus>()?;
        match f.data {
            OggOpus::Bytes(b) => {
                let t0 = Instant::now();
                self.reader
                    .push(&b, &mut self.out, self.budget.as_mut())
                    .map_err(|e| StageError::bad_input(format!("the client's audio: {e}")))?;
                self.decode_time.record(t0.elapsed().as_secs_f64());
            }
            OggOpus::Silence(n) => {
                if self.budget.take(n) {
                    self.out.resize(self.out.len() + n, 0.0);
                } else {
                    self.refused_silence += n as u64;
                }
            }
        }
        self.count_refused();
        if self.out.is_empty() {
            return Ok(());
        }
        let samples = std::mem::take(&mut self.out);
        cx.emit(0, f.meta.origin, Pcm::new(RATE, samples))
    }
}

fn build_encode(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let bitrate = match EncodeParams::from_params(p)?.bitrate {
        0 => None,
        b => Some(b),
    };
    // A serial of the stage's own, so that two streams of one process differ.
    let serial = {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(cx.stage) as u32
    };
    let writer = OggOpusWriter::new(serial, bitrate)
        .map_err(|e| BuildError::invalid(e.to_string()).key("bitrate"))?;
    Ok(Body::Stage(Box::new(Encode {
        writer,
        origin: None,
        encode_time: metrics::histogram!(crate::observe::names::OPUS_TIME, "direction" => "encode"),
    })))
}

struct Encode {
    writer: OggOpusWriter,
    origin: Option<Instant>,
    encode_time: metrics::Histogram,
}

impl Encode {
    fn emit(&mut self, pages: Vec<Vec<u8>>, cx: &mut Context<'_>) -> StageResult {
        let origin = self.origin.unwrap_or_else(Instant::now);
        for p in pages {
            cx.emit(0, origin, OggOpus::Bytes(p))?;
        }
        Ok(())
    }
}

impl Stage for Encode {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        caps::require_pcm(&inputs[0], RATE, None)?;
        Ok(vec![Caps::new()])
    }

    fn start(&mut self, cx: &mut Context<'_>) -> StageResult {
        let pages = self.writer.headers()?;
        self.emit(pages, cx)
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Pcm>()?;
        if f.data.rate != RATE {
            return Err(StageError::msg(format!(
                "expects {RATE} Hz audio, got {} Hz: put a `resample` stage (to: {RATE}) before it",
                f.data.rate
            )));
        }
        self.origin = Some(f.meta.origin);
        let t0 = Instant::now();
        let pages = self.writer.push(f.data.valid())?;
        self.encode_time.record(t0.elapsed().as_secs_f64());
        self.emit(pages, cx)
    }

    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        let pages = self.writer.flush()?;
        self.emit(pages, cx)
    }
}
