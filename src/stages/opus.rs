//! `opus_decode` and `opus_encode`: a network client's Ogg/Opus stream ↔ 24 kHz mono PCM, on
//! the [`audio::opus`](crate::audio::opus) reader and writer.
//!
//! The decoder takes the stream in chunks split anywhere and emits whatever PCM they complete
//! (the framer after it cuts model frames); a gap stands for silence. A stream that is not
//! Ogg/Opus, or a damaged page, fails the stage with what was wrong, which ends that session
//! alone. The encoder emits the header pages first, then one page per 40 ms packet.

use std::time::Instant;

use crate::audio::opus::{OggOpusReader, OggOpusWriter, RATE};
use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, Context, Input, PortSpec, Stage, StageError, StageResult};

use super::{caps, BuildContext, BuildError, OggOpus, StageKind};

pub(super) const DECODE: StageKind = StageKind {
    name: "opus_decode",
    doc: "a client's Ogg/Opus stream (chunks split anywhere) -> 24 kHz mono PCM; gaps -> silence",
    params: &[],
    inputs: || vec![PortSpec::new::<OggOpus>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build: build_decode,
};

pub(super) const ENCODE: StageKind = StageKind {
    name: "opus_encode",
    doc: "24 kHz mono PCM -> an Ogg/Opus stream: header pages, then one page per 40 ms packet",
    params: &[ParamSpec {
        name: "bitrate",
        ty: T::Int {
            min: 0,
            max: 512_000,
        },
        default: D::Int(0),
        doc: "bits per second (0 = libopus's choice)",
    }],
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<OggOpus>("out")],
    commands: &[],
    status: &[],
    build: build_encode,
};

fn build_decode(_: &BuildContext<'_>, _: &Params) -> Result<Body, BuildError> {
    Ok(Body::Stage(Box::new(Decode {
        reader: OggOpusReader::new(),
        out: Vec::new(),
        decode_time: metrics::histogram!(crate::observe::names::OPUS_TIME, "direction" => "decode"),
    })))
}

struct Decode {
    reader: OggOpusReader,
    out: Vec<f32>,
    decode_time: metrics::Histogram,
}

impl Stage for Decode {
    fn caps(&self, _: &[Caps]) -> Result<Vec<Caps>, String> {
        Ok(vec![Caps::new().with(caps::RATE, RATE as i64)])
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<OggOpus>()?;
        match f.data {
            OggOpus::Bytes(b) => {
                let t0 = Instant::now();
                self.reader
                    .push(&b, &mut self.out)
                    .map_err(|e| StageError::msg(format!("the client's audio: {e}")))?;
                self.decode_time.record(t0.elapsed().as_secs_f64());
            }
            OggOpus::Silence(n) => self.out.resize(self.out.len() + n, 0.0),
        }
        if self.out.is_empty() {
            return Ok(());
        }
        let samples = std::mem::take(&mut self.out);
        cx.emit(0, f.meta.origin, Pcm::new(RATE, samples))
    }
}

fn build_encode(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let bitrate = match p.int("bitrate") {
        0 => None,
        b => Some(b as i32),
    };
    // A serial of the stage's own, so that two streams of one process differ.
    let serial = {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(cx.stage) as u32
    };
    let writer =
        OggOpusWriter::new(serial, bitrate).map_err(|e| BuildError::invalid(e).key("bitrate"))?;
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
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, String> {
        caps::require_pcm(&inputs[0], RATE, None)?;
        Ok(vec![Caps::new()])
    }

    fn start(&mut self, cx: &mut Context<'_>) -> StageResult {
        let pages = self.writer.headers().map_err(StageError::msg)?;
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
        let pages = self.writer.push(f.data.valid()).map_err(StageError::msg)?;
        self.encode_time.record(t0.elapsed().as_secs_f64());
        self.emit(pages, cx)
    }

    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        let pages = self.writer.flush().map_err(StageError::msg)?;
        self.emit(pages, cx)
    }
}
