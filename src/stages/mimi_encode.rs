//! `mimi_encode`: 1920-sample frames at 24 kHz → the user's codes, streaming: on the pack's step
//! graphs (`streaming: stateful`, the default when it has them) or on a rolling window of the
//! whole-utterance graph; with `engine: shared`, in a slot of the process's shared encoder (one
//! batched call per tick for every conversation). A new conversation (the LM stage's reset or
//! re-prime) starts a new stream at the next frame.

use crate::audio::Pcm;
use crate::config::Params;
use crate::runtime::{
    Body, Caps, CapsError, Context, Input, PortSpec, Stage, StageError, StageResult,
};

use super::codec::{open_encoder, Encoder};
use super::model_params::{model_params, open_pack, CodecParams, ModelParams, MODEL_STATUS};
use super::{caps, BuildContext, BuildError, Codes, Conversation, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "mimi_encode",
    doc: "Mimi encoder: 1920-sample 24 kHz frames -> codes (stateful step graphs, or a rolling window)",
    params: model_params![codec;],
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Codes>("out")],
    commands: &[],
    status: &[MODEL_STATUS],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let (m, c) = (ModelParams::from_params(p)?, CodecParams::from_params(p)?);
    let pack = open_pack(cx, &m)?;
    let enc = open_encoder(cx, &pack, (&m, &c))?;
    cx.endpoint().set("model", enc.runs_on());
    let conversation = cx.conversation();
    Ok(Body::Stage(Box::new(MimiEncode {
        enc,
        rate: pack.manifest.sample_rate,
        frame: pack.manifest.frame_size,
        codebooks: pack.manifest.codebooks,
        vocab: pack.manifest.audio_vocab,
        seen: conversation.current(),
        conversation,
    })))
}

struct MimiEncode {
    enc: Encoder,
    rate: u32,
    frame: usize,
    codebooks: usize,
    vocab: i64,
    conversation: Conversation,
    /// The conversation the stream belongs to.
    seen: u64,
}

impl Stage for MimiEncode {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        caps::require_pcm(&inputs[0], self.rate, Some(self.frame))?;
        Ok(vec![Caps::new()
            .with(caps::CODEBOOKS, self.codebooks as i64)
            .with(caps::VOCAB, self.vocab)])
    }

    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        // The first run of a graph is slow: pay it before the first real frame (a shared
        // codec paid it when it opened).
        if self.enc.needs_warming() {
            self.enc.push(&vec![0.0; self.frame])?;
        }
        self.enc.reset()?;
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
        let now = self.conversation.current();
        if now != self.seen {
            self.seen = now;
            self.enc.reset()?;
            tracing::info!("new conversation: a new encoder stream");
        }
        let codes = self.enc.push(&f.data.samples)?;
        cx.emit(0, f.meta.origin, Codes(codes))
    }
}
