//! The codec strategy of the Mimi stages: `stateful` (the pack's step graphs, one frame of work
//! per frame, equal to offline coding) or `window` (the whole-utterance graphs re-run on the
//! last `window` frames), chosen by the `streaming` param and logged; and, for `stateful`, a
//! step graph of the stage's own or a slot of the process's shared codec (`engine: shared`).
//!
//! The choice is made once, when the stage opens: the stage then holds an [`Encoder`] or a
//! [`Decoder`], whatever runs it ([`Encode`] and [`Decode`] are what it asks of one).

use crate::model::engine::{CodecOptions, CodecSlot};
use crate::model::mimi::{MimiDecoder, MimiEncoder};
use crate::model::mimi_step::StepCodec;
use crate::model::pack::{FloatType, Pack, StepRole};
use crate::model::ModelError;

use super::model_params::{session_options, CodecParams, ModelParams};
use super::{BuildContext, BuildError};

/// A stateful codec, as opened: a step graph of the stage's own, or a slot of the shared codec.
enum Step {
    Own(Box<StepCodec>),
    Shared(CodecSlot),
}

/// The step graph's precision a stage's params ask for.
fn step_dtype(c: &CodecParams) -> FloatType {
    match c.step_dtype.as_str() {
        "f16" => FloatType::F16,
        _ => FloatType::F32,
    }
}

/// The step graph the stage runs, opened, or None for the window: `stateful` needs the step
/// graphs, `auto` takes them when the pack has them. Logged with the reason.
fn open_step(
    cx: &BuildContext<'_>,
    pack: &Pack,
    (m, c): (&ModelParams, &CodecParams),
    role: StepRole,
) -> Result<Option<Step>, BuildError> {
    let stage = cx.stage;
    let dtype = step_dtype(c);
    let have = pack.step_graph(role, dtype).is_some();
    let shared = c.engine == "shared";
    let chosen = match c.streaming.as_str() {
        "window" if shared => {
            return Err(BuildError::invalid(
                "`engine: shared` needs `streaming: stateful` (or auto): the shared codec steps \
                 the pack's step graphs",
            )
            .key("engine"));
        }
        "window" => false,
        _ if shared && !have => {
            return Err(BuildError::invalid(format!(
                "{}: `engine: shared` needs the pack's {} step graph of precision {} (build it \
                 with python tools/make_mimi_step.py {})",
                pack.dir.display(),
                role.graph(),
                dtype.name(),
                pack.dir.display()
            ))
            .key("engine"));
        }
        "stateful" if !have => {
            return Err(BuildError::invalid(format!(
                "{}: the pack has no {} step graph of precision {} (build it with \
                 tools/make_mimi_step.py {}, or use `streaming: window`)",
                pack.dir.display(),
                role.graph(),
                dtype.name(),
                pack.dir.display()
            ))
            .key("streaming"));
        }
        "stateful" => true,
        _ => have,
    };
    let why = match (c.streaming.as_str(), chosen) {
        ("auto", true) => "the pack has step graphs",
        ("auto", false) => "the pack has no step graphs",
        _ => "asked for",
    };
    tracing::info!(
        stage,
        strategy = if chosen { "stateful" } else { "window" },
        dtype = if chosen { dtype.name() } else { "f32" },
        why,
        engine = c.engine.as_str(),
        "codec streaming"
    );
    if !chosen {
        return Ok(None);
    }
    if !shared {
        return Ok(Some(Step::Own(Box::new(StepCodec::open(
            pack,
            role,
            dtype,
            &session_options(m),
        )?))));
    }
    let opts = CodecOptions {
        session: session_options(m),
        slots: c.slots,
        max_wait: std::time::Duration::from_millis(c.batch_wait_ms),
        ..Default::default()
    };
    let codec = cx.resources.codec(pack, role, dtype, &opts).map_err(|e| {
        let b = BuildError::from(e);
        if b.key.is_none() {
            b.key("engine")
        } else {
            b
        }
    })?;
    // A full codec is a capacity error (retryable), as a full LM engine is.
    let slot = codec.slot().map_err(BuildError::from)?;
    Ok(Some(Step::Shared(slot)))
}

/// What the encoder stage asks of its codec, whichever strategy and engine.
pub(super) trait Encode: Send {
    /// What the graph runs on (and the strategy, for the window).
    fn runs_on(&self) -> String;
    /// One frame of PCM in, its codes out (the window: those of the last frame).
    fn push(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError>;
    /// Starts a new stream.
    fn reset(&mut self) -> Result<(), ModelError>;
    /// Whether the stage should pay the graph's first (slow) run before its first frame (a
    /// shared codec was warmed when it opened).
    fn needs_warming(&self) -> bool {
        true
    }
}

/// What the decoder stage asks of its codec, whichever strategy and engine.
pub(super) trait Decode: Send {
    /// What the graph runs on (and the strategy, for the window).
    fn runs_on(&self) -> String;
    /// One frame of codes in (each below `vocab`), its PCM out.
    fn push(&mut self, codes: &[i64], vocab: i64) -> Result<Vec<f32>, ModelError>;
    /// Starts a new stream.
    fn reset(&mut self) -> Result<(), ModelError>;
    /// As [`Encode::needs_warming`].
    fn needs_warming(&self) -> bool {
        true
    }
}

/// The encoder stage's codec.
pub(super) type Encoder = Box<dyn Encode>;

/// The decoder stage's codec.
pub(super) type Decoder = Box<dyn Decode>;

/// The encoder the stage's params choose (logged with the reason).
pub(super) fn open_encoder(
    cx: &BuildContext<'_>,
    pack: &Pack,
    (m, c): (&ModelParams, &CodecParams),
) -> Result<Encoder, BuildError> {
    Ok(match open_step(cx, pack, (m, c), StepRole::Encoder)? {
        Some(Step::Own(s)) => s,
        Some(Step::Shared(s)) => Box::new(s),
        None => Box::new(MimiEncoder::open(pack, &session_options(m), c.window)?),
    })
}

/// The decoder the stage's params choose (logged with the reason).
pub(super) fn open_decoder(
    cx: &BuildContext<'_>,
    pack: &Pack,
    (m, c): (&ModelParams, &CodecParams),
) -> Result<Decoder, BuildError> {
    Ok(match open_step(cx, pack, (m, c), StepRole::Decoder)? {
        Some(Step::Own(s)) => s,
        Some(Step::Shared(s)) => Box::new(s),
        None => Box::new(MimiDecoder::open(pack, &session_options(m), c.window)?),
    })
}

impl Encode for StepCodec {
    fn runs_on(&self) -> String {
        StepCodec::runs_on(self)
    }
    fn push(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        self.encode(frame)
    }
    fn reset(&mut self) -> Result<(), ModelError> {
        StepCodec::reset(self)
    }
}

impl Decode for StepCodec {
    fn runs_on(&self) -> String {
        StepCodec::runs_on(self)
    }
    fn push(&mut self, codes: &[i64], vocab: i64) -> Result<Vec<f32>, ModelError> {
        self.decode(codes, vocab)
    }
    fn reset(&mut self) -> Result<(), ModelError> {
        StepCodec::reset(self)
    }
}

impl Encode for CodecSlot {
    fn runs_on(&self) -> String {
        self.codec().runs_on()
    }
    fn push(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        self.encode(frame)
    }
    fn reset(&mut self) -> Result<(), ModelError> {
        CodecSlot::reset(self);
        Ok(())
    }
    fn needs_warming(&self) -> bool {
        false
    }
}

impl Decode for CodecSlot {
    fn runs_on(&self) -> String {
        self.codec().runs_on()
    }
    // The shared codec checks the codes against the pack's vocabulary itself.
    fn push(&mut self, codes: &[i64], _vocab: i64) -> Result<Vec<f32>, ModelError> {
        self.decode(codes)
    }
    fn reset(&mut self) -> Result<(), ModelError> {
        CodecSlot::reset(self);
        Ok(())
    }
    fn needs_warming(&self) -> bool {
        false
    }
}

impl Encode for MimiEncoder {
    fn runs_on(&self) -> String {
        format!("{} window", MimiEncoder::runs_on(self))
    }
    fn push(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        MimiEncoder::push(self, frame)
    }
    fn reset(&mut self) -> Result<(), ModelError> {
        MimiEncoder::reset(self);
        Ok(())
    }
}

impl Decode for MimiDecoder {
    fn runs_on(&self) -> String {
        format!("{} window", MimiDecoder::runs_on(self))
    }
    fn push(&mut self, codes: &[i64], vocab: i64) -> Result<Vec<f32>, ModelError> {
        MimiDecoder::push(self, codes, vocab)
    }
    fn reset(&mut self) -> Result<(), ModelError> {
        MimiDecoder::reset(self);
        Ok(())
    }
}

/// Encodes a whole clip frame by frame with the pack's stateful encoder when it has one (the
/// path the `mimi_encode` stage takes by default), else with the whole-utterance graph in one
/// call. Whole frames only.
pub(super) fn encode_clip(
    pack: &Pack,
    m: &ModelParams,
    pcm: &[f32],
) -> Result<Vec<Vec<i64>>, ModelError> {
    let frame = pack.manifest.frame_size;
    if clip_is_stepped(pack) && pcm.len() >= frame {
        let mut enc =
            StepCodec::open(pack, StepRole::Encoder, FloatType::F32, &session_options(m))?;
        return pcm.chunks_exact(frame).map(|f| enc.encode(f)).collect();
    }
    MimiEncoder::open(pack, &session_options(m), 1)?.encode(pcm)
}

/// Whether [`encode_clip`] takes the pack's stateful f32 encoder (else the whole-clip graph).
pub(super) fn clip_is_stepped(pack: &Pack) -> bool {
    pack.step_graph(StepRole::Encoder, FloatType::F32).is_some()
}
