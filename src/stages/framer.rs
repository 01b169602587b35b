//! `framer`: cuts audio into frames of exactly `size` samples; the last partial frame is padded
//! with zeros and flagged (`Pcm::padded`).

use std::time::Instant;

use crate::audio::{Framer, Pcm, FRAME_SAMPLES, MODEL_RATE};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{
    Body, Caps, CapsError, Context, Input, PortSpec, Stage, StageError, StageResult,
};

use super::params::stage_params;
use super::{caps, BuildContext, BuildError, StageKind};

stage_params! {
    /// `framer`'s params.
    struct FramerParams {
        size: usize = ParamSpec {
            name: "size",
            ty: T::Int {
                min: 1,
                max: 10_000_000,
            },
            default: D::Int(FRAME_SAMPLES as i64),
            doc: "samples per frame",
        },
        rate: u32 = ParamSpec {
            name: "rate",
            ty: T::Int {
                min: 0,
                max: 768_000,
            },
            default: D::Int(MODEL_RATE as i64),
            doc: "required input rate, Hz (0 = any)",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "framer",
    doc: "cuts audio into exact frames (1920 samples = 80 ms at 24 kHz); pads and flags the last",
    params: FramerParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = FramerParams::from_params(p)?;
    Ok(Body::Stage(Box::new(FramerStage {
        framer: Framer::new(p.size),
        rate: p.rate,
        seen_rate: 0,
        origin: None,
    })))
}

struct FramerStage {
    framer: Framer,
    rate: u32,
    seen_rate: u32,
    origin: Option<Instant>,
}

impl Stage for FramerStage {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        let rate = match (self.rate, inputs[0].get(caps::RATE)) {
            (0, r) => r,
            (want, _) => {
                inputs[0]
                    .require(caps::RATE, want as i64, "sample rate (Hz)")
                    .map_err(|e| {
                        CapsError::fix(e, format!("put a `resample` stage (to: {want}) before it"))
                    })?;
                Some(want as i64)
            }
        };
        let mut out = Caps::new().with(caps::SAMPLES, self.framer.size() as i64);
        if let Some(r) = rate {
            out = out.with(caps::RATE, r);
        }
        Ok(vec![out])
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let frame = input.take::<Pcm>()?;
        let rate = frame.data.rate;
        if self.rate != 0 && rate != self.rate {
            return Err(StageError::msg(format!(
                "input is {rate} Hz but this framer expects {} Hz: put a `resample` stage (to: {}) before it",
                self.rate, self.rate
            )));
        }
        self.seen_rate = rate;
        self.origin = Some(frame.meta.origin);
        let origin = frame.meta.origin;
        self.framer.push(frame.data.valid(), |samples| {
            cx.emit(0, origin, Pcm::new(rate, samples))
        })
    }

    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        if let (Some((samples, padded)), Some(origin)) = (self.framer.finish(), self.origin) {
            cx.emit(
                0,
                origin,
                Pcm {
                    rate: self.seen_rate,
                    samples,
                    padded,
                },
            )?;
        }
        Ok(())
    }
}
