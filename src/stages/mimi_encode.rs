//! `mimi_encode`: 1920-sample frames at 24 kHz → the user's codes, streaming (rolling window).

use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::model::mimi::MimiEncoder;
use crate::runtime::{Body, Caps, Context, Input, PortSpec, Stage, StageError, StageResult};

use super::model_params::{model_params, open_pack, session_options, MODEL_STATUS};
use super::{caps, BuildContext, BuildError, Codes, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "mimi_encode",
    doc: "Mimi encoder: 1920-sample 24 kHz frames -> codes (rolling window of `window` frames)",
    params: model_params![ParamSpec {
        name: "window",
        ty: T::Int { min: 1, max: 2048 },
        default: D::Int(8),
        doc: "frames of left context re-encoded per frame"
    }],
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Codes>("out")],
    commands: &[],
    status: &[MODEL_STATUS],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let pack = open_pack(p)?;
    let enc = MimiEncoder::open(&pack, &session_options(p), p.int("window") as usize)?;
    cx.endpoint().set("model", enc.runs_on());
    Ok(Body::Stage(Box::new(MimiEncode {
        enc,
        rate: pack.manifest.sample_rate,
        frame: pack.manifest.frame_size,
        codebooks: pack.manifest.codebooks,
        vocab: pack.manifest.audio_vocab,
    })))
}

struct MimiEncode {
    enc: MimiEncoder,
    rate: u32,
    frame: usize,
    codebooks: usize,
    vocab: i64,
}

impl Stage for MimiEncode {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, String> {
        caps::require_pcm(&inputs[0], self.rate, Some(self.frame))?;
        Ok(vec![Caps::new()
            .with(caps::CODEBOOKS, self.codebooks as i64)
            .with(caps::VOCAB, self.vocab)])
    }

    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        // The first run of a graph is slow: pay it before the first real frame.
        self.enc.push(&vec![0.0; self.frame])?;
        self.enc.reset();
        Ok(())
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Pcm>()?;
        if f.data.rate != self.rate || f.data.samples.len() != self.frame {
            return Err(StageError::msg(format!(
                "expects {}-sample frames at {} Hz, got {} samples at {} Hz: put `resample` (to: {}) and `framer` (size: {}) before it",
                self.frame,
                self.rate,
                f.data.samples.len(),
                f.data.rate,
                self.rate,
                self.frame
            )));
        }
        let codes = self.enc.push(&f.data.samples)?;
        cx.emit(0, f.meta.origin, Codes(codes))
    }
}
