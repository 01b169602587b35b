//! The codec strategy of the Mimi stages: `stateful` (the pack's step graphs, one frame of work
//! per frame, equal to offline coding) or `window` (the whole-utterance graphs re-run on the
//! last `window` frames), chosen by the `streaming` param and logged; and, for `stateful`, a
//! step graph of the stage's own or a slot of the process's shared codec (`engine: shared`).

use crate::model::engine::{CodecOptions, CodecSlot};
use crate::model::mimi::{MimiDecoder, MimiEncoder};
use crate::model::mimi_step::StepCodec;
use crate::model::pack::{FloatType, Pack, StepRole};
use crate::model::ModelError;

use super::model_params::{session_options, CodecParams, ModelParams};
use super::{BuildContext, BuildError};

/// A stateful codec: a step graph of the stage's own, or a slot of the shared codec.
pub(super) enum Step {
    Own(Box<StepCodec>),
    Shared(Box<CodecSlot>),
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
    Ok(Some(Step::Shared(Box::new(slot))))
}

impl Step {
    fn runs_on(&self) -> String {
        match self {
            Step::Own(s) => s.runs_on(),
            Step::Shared(s) => s.codec().runs_on(),
        }
    }

    fn reset(&mut self) -> Result<(), ModelError> {
        match self {
            Step::Own(s) => s.reset(),
            Step::Shared(s) => {
                s.reset();
                Ok(())
            }
        }
    }

    /// Whether the first frame of the stage must be paid before the first real one (a shared
    /// codec was warmed when it opened).
    fn needs_warming(&self) -> bool {
        matches!(self, Step::Own(_))
    }
}

/// An encoder of either strategy.
pub(super) enum Encoder {
    Stateful(Step),
    Window(MimiEncoder),
}

impl Encoder {
    pub fn open(
        cx: &BuildContext<'_>,
        pack: &Pack,
        (m, c): (&ModelParams, &CodecParams),
    ) -> Result<Encoder, BuildError> {
        Ok(match open_step(cx, pack, (m, c), StepRole::Encoder)? {
            Some(s) => Encoder::Stateful(s),
            None => Encoder::Window(MimiEncoder::open(pack, &session_options(m), c.window)?),
        })
    }

    pub fn runs_on(&self) -> String {
        match self {
            Encoder::Stateful(s) => s.runs_on(),
            Encoder::Window(w) => format!("{} window", w.runs_on()),
        }
    }

    pub fn push(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        match self {
            Encoder::Stateful(Step::Own(s)) => s.encode(frame),
            Encoder::Stateful(Step::Shared(s)) => s.encode(frame),
            Encoder::Window(w) => w.push(frame),
        }
    }

    pub fn reset(&mut self) -> Result<(), ModelError> {
        match self {
            Encoder::Stateful(s) => s.reset(),
            Encoder::Window(w) => {
                w.reset();
                Ok(())
            }
        }
    }

    /// Whether the stage should pay the graph's first (slow) run before its first frame.
    pub fn needs_warming(&self) -> bool {
        match self {
            Encoder::Stateful(s) => s.needs_warming(),
            Encoder::Window(_) => true,
        }
    }
}

/// A decoder of either strategy.
pub(super) enum Decoder {
    Stateful(Step),
    Window(MimiDecoder),
}

impl Decoder {
    pub fn open(
        cx: &BuildContext<'_>,
        pack: &Pack,
        (m, c): (&ModelParams, &CodecParams),
    ) -> Result<Decoder, BuildError> {
        Ok(match open_step(cx, pack, (m, c), StepRole::Decoder)? {
            Some(s) => Decoder::Stateful(s),
            None => Decoder::Window(MimiDecoder::open(pack, &session_options(m), c.window)?),
        })
    }

    pub fn runs_on(&self) -> String {
        match self {
            Decoder::Stateful(s) => s.runs_on(),
            Decoder::Window(w) => format!("{} window", w.runs_on()),
        }
    }

    pub fn push(&mut self, codes: &[i64], vocab: i64) -> Result<Vec<f32>, ModelError> {
        match self {
            Decoder::Stateful(Step::Own(s)) => s.decode(codes, vocab),
            Decoder::Stateful(Step::Shared(s)) => s.decode(codes),
            Decoder::Window(w) => w.push(codes, vocab),
        }
    }

    pub fn reset(&mut self) -> Result<(), ModelError> {
        match self {
            Decoder::Stateful(s) => s.reset(),
            Decoder::Window(w) => {
                w.reset();
                Ok(())
            }
        }
    }

    /// Whether the stage should pay the graph's first (slow) run before its first frame.
    pub fn needs_warming(&self) -> bool {
        match self {
            Decoder::Stateful(s) => s.needs_warming(),
            Decoder::Window(_) => true,
        }
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
