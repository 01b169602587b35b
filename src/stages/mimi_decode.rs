//! `mimi_decode`: the agent's codes → 1920-sample frames at 24 kHz, streaming: on the pack's
//! step graphs (`streaming: stateful`, the default when it has them) or on a rolling window of
//! the whole-utterance graph; with `engine: shared`, in a slot of the process's shared decoder.
//! Runs in its own actor, so decoding frame t overlaps the LM's work on frame t+1. A new
//! conversation starts a new stream at the next frame.

use crate::audio::Pcm;
use crate::config::Params;
use crate::runtime::{Body, Caps, CapsError, Context, Input, PortSpec, Stage, StageResult};

use super::codec::{open_decoder, Decoder};
use super::model_params::{model_params, open_pack, CodecParams, ModelParams, MODEL_STATUS};
use super::{caps, AgentTokens, BuildContext, BuildError, Conversation, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "mimi_decode",
    doc: "Mimi decoder: the agent's codes -> 1920-sample 24 kHz frames (stateful step graphs, or a rolling window)",
    params: model_params![codec;],
    inputs: || vec![PortSpec::new::<AgentTokens>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[MODEL_STATUS],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let (m, c) = (ModelParams::from_params(p)?, CodecParams::from_params(p)?);
    let pack = open_pack(cx, &m)?;
    let dec = open_decoder(cx, &pack, (&m, &c))?;
    cx.endpoint().set("model", dec.runs_on());
    let conversation = cx.conversation();
    Ok(Body::Stage(Box::new(MimiDecode {
        dec,
        rate: pack.manifest.sample_rate,
        frame: pack.manifest.frame_size,
        silence: pack.manifest.silence_codes.clone(),
        vocab: pack.manifest.audio_vocab,
        seen: conversation.current(),
        conversation,
    })))
}

struct MimiDecode {
    dec: Decoder,
    rate: u32,
    frame: usize,
    silence: Vec<i64>,
    vocab: i64,
    conversation: Conversation,
    /// The conversation the stream belongs to.
    seen: u64,
}

impl Stage for MimiDecode {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        caps::require_codes(&inputs[0], self.silence.len(), self.vocab)?;
        Ok(vec![Caps::new()
            .with(caps::RATE, self.rate as i64)
            .with(caps::SAMPLES, self.frame as i64)])
    }

    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        if self.dec.needs_warming() {
            self.dec.push(&self.silence, self.vocab)?;
        }
        self.dec.reset()?;
        Ok(())
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<AgentTokens>()?;
        let now = self.conversation.current();
        if now != self.seen {
            self.seen = now;
            self.dec.reset()?;
            tracing::info!("new conversation: a new decoder stream");
        }
        let samples = self.dec.push(&f.data.audio, self.vocab)?;
        cx.emit(0, f.meta.origin, Pcm::new(self.rate, samples))
    }
}
