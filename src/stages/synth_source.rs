//! `synth_source`: silence, a sine or white noise, for a set duration.

use crate::audio::{Pcm, Synth, Waveform};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, Context, Flow, PortSpec, Source, StageResult};

use super::pacing::Pacer;
use super::params::stage_params;
use super::{caps, BuildContext, BuildError, StageKind};

stage_params! {
    /// `synth_source`'s params.
    struct SynthParams {
        waveform: String = ParamSpec {
            name: "waveform",
            ty: T::Choice(&["silence", "sine", "noise"]),
            default: D::Str("sine"),
            doc: "what to generate",
        },
        freq: f64 = ParamSpec {
            name: "freq",
            ty: T::Float { min: 0.0, max: 1e6 },
            default: D::Float(440.0),
            doc: "sine frequency, Hz",
        },
        amplitude: f32 = ParamSpec {
            name: "amplitude",
            ty: T::Float { min: 0.0, max: 1.0 },
            default: D::Float(0.5),
            doc: "peak amplitude",
        },
        rate: u32 = ParamSpec {
            name: "rate",
            ty: T::Int {
                min: 1000,
                max: 768_000,
            },
            default: D::Int(24_000),
            doc: "sample rate, Hz",
        },
        duration: f64 = ParamSpec {
            name: "duration",
            ty: T::Float { min: 0.0, max: 1e7 },
            default: D::Float(5.0),
            doc: "seconds",
        },
        chunk_ms: f64 = ParamSpec {
            name: "chunk_ms",
            ty: T::Float {
                min: 0.1,
                max: 10_000.0,
            },
            default: D::Float(20.0),
            doc: "samples per frame, in ms",
        },
        realtime: bool = ParamSpec {
            name: "realtime",
            ty: T::Bool,
            default: D::Bool(false),
            doc: "pace frames at real time (else as fast as possible)",
        },
        seed: u64 = ParamSpec {
            name: "seed",
            ty: T::Int {
                min: 0,
                max: i64::MAX,
            },
            default: D::Int(0),
            doc: "noise seed",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "synth_source",
    doc: "generates silence, a sine or white noise (mono f32)",
    params: SynthParams::SPECS,
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = SynthParams::from_params(p)?;
    let rate = p.rate;
    let amplitude = p.amplitude;
    let waveform = match p.waveform.as_str() {
        "silence" => Waveform::Silence,
        "noise" => Waveform::Noise {
            amplitude,
            seed: p.seed,
        },
        _ => Waveform::Sine {
            freq: p.freq,
            amplitude,
        },
    };
    let chunk = ((p.chunk_ms / 1000.0 * rate as f64).round() as usize).max(1);
    Ok(Body::Source(Box::new(SynthSource {
        synth: Synth::new(waveform, rate),
        rate,
        remaining: (p.duration * rate as f64).round() as u64,
        chunk,
        pacer: Pacer::new(p.realtime, rate),
    })))
}

struct SynthSource {
    synth: Synth,
    rate: u32,
    remaining: u64,
    chunk: usize,
    pacer: Pacer,
}

impl Source for SynthSource {
    fn caps(&self) -> Vec<Caps> {
        vec![Caps::new().with(caps::RATE, self.rate as i64)]
    }

    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        if self.remaining == 0 {
            return Ok(Flow::Done);
        }
        let n = (self.chunk as u64).min(self.remaining) as usize;
        let mut samples = vec![0.0; n];
        self.synth.fill(&mut samples);
        self.remaining -= n as u64;
        let Some(origin) = self.pacer.next(n, cx) else {
            return Ok(Flow::Done);
        };
        cx.emit(0, origin, Pcm::new(self.rate, samples))?;
        Ok(Flow::Continue)
    }
}
