//! `mimi_decode`: the agent's codes → 1920-sample frames at 24 kHz, streaming (rolling window).
//! Runs in its own actor, so decoding frame t overlaps the LM's work on frame t+1.

use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::model::mimi::MimiDecoder;
use crate::runtime::{Body, Caps, Context, Input, PortSpec, Stage, StageResult};

use super::model_params::{model_params, open_pack, session_options, MODEL_STATUS};
use super::{caps, AgentTokens, BuildContext, BuildError, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "mimi_decode",
    doc: "Mimi decoder: the agent's codes -> 1920-sample 24 kHz frames (rolling window)",
    params: model_params![ParamSpec {
        name: "window",
        ty: T::Int { min: 1, max: 2048 },
        default: D::Int(8),
        doc: "frames of left context re-decoded per frame"
    }],
    inputs: || vec![PortSpec::new::<AgentTokens>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[MODEL_STATUS],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let pack = open_pack(p)?;
    let dec = MimiDecoder::open(&pack, &session_options(p), p.int("window") as usize)?;
    cx.endpoint().set("model", dec.runs_on());
    Ok(Body::Stage(Box::new(MimiDecode {
        dec,
        rate: pack.manifest.sample_rate,
        frame: pack.manifest.frame_size,
        silence: pack.manifest.silence_codes.clone(),
        vocab: pack.manifest.audio_vocab,
    })))
}

struct MimiDecode {
    dec: MimiDecoder,
    rate: u32,
    frame: usize,
    silence: Vec<i64>,
    vocab: i64,
}

impl Stage for MimiDecode {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, String> {
        caps::require_codes(&inputs[0], self.silence.len(), self.vocab)?;
        Ok(vec![Caps::new()
            .with(caps::RATE, self.rate as i64)
            .with(caps::SAMPLES, self.frame as i64)])
    }

    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        self.dec.push(&self.silence, self.vocab)?;
        self.dec.reset();
        Ok(())
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<AgentTokens>()?;
        let samples = self.dec.push(&f.data.audio, self.vocab)?;
        cx.emit(0, f.meta.origin, Pcm::new(self.rate, samples))
    }
}
