//! The codec strategy of the Mimi stages: `stateful` (the pack's step graphs, one frame of work
//! per frame, equal to offline coding) or `window` (the whole-utterance graphs re-run on the
//! last `window` frames), chosen by the `streaming` param and logged.

use crate::config::Params;
use crate::model::mimi::{MimiDecoder, MimiEncoder};
use crate::model::mimi_step::StepCodec;
use crate::model::pack::{FloatType, Pack, StepRole};
use crate::model::ModelError;

use super::model_params::session_options;
use super::BuildError;

/// The step graph's precision a stage's params ask for.
fn step_dtype(p: &Params) -> FloatType {
    match p.str("step_dtype") {
        "f16" => FloatType::F16,
        _ => FloatType::F32,
    }
}

/// The step graph the stage runs, opened, or None for the window: `stateful` needs the step
/// graphs, `auto` takes them when the pack has them. Logged with the reason.
fn open_step(
    pack: &Pack,
    p: &Params,
    role: StepRole,
    stage: &str,
) -> Result<Option<Box<StepCodec>>, BuildError> {
    let dtype = step_dtype(p);
    let have = pack.step_graph(role, dtype).is_some();
    let chosen = match p.str("streaming") {
        "window" => false,
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
    let why = match (p.str("streaming"), chosen) {
        ("auto", true) => "the pack has step graphs",
        ("auto", false) => "the pack has no step graphs",
        _ => "asked for",
    };
    tracing::info!(
        stage,
        strategy = if chosen { "stateful" } else { "window" },
        dtype = if chosen { dtype.name() } else { "f32" },
        why,
        "codec streaming"
    );
    if !chosen {
        return Ok(None);
    }
    Ok(Some(Box::new(StepCodec::open(
        pack,
        role,
        dtype,
        &session_options(p),
    )?)))
}

/// An encoder of either strategy.
pub(super) enum Encoder {
    Stateful(Box<StepCodec>),
    Window(MimiEncoder),
}

impl Encoder {
    pub fn open(pack: &Pack, p: &Params, stage: &str) -> Result<Encoder, BuildError> {
        Ok(match open_step(pack, p, StepRole::Encoder, stage)? {
            Some(s) => Encoder::Stateful(s),
            None => Encoder::Window(MimiEncoder::open(
                pack,
                &session_options(p),
                p.int("window") as usize,
            )?),
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
            Encoder::Stateful(s) => s.encode(frame),
            Encoder::Window(w) => w.push(frame),
        }
    }

    pub fn reset(&mut self) {
        match self {
            Encoder::Stateful(s) => s.reset(),
            Encoder::Window(w) => w.reset(),
        }
    }
}

/// A decoder of either strategy.
pub(super) enum Decoder {
    Stateful(Box<StepCodec>),
    Window(MimiDecoder),
}

impl Decoder {
    pub fn open(pack: &Pack, p: &Params, stage: &str) -> Result<Decoder, BuildError> {
        Ok(match open_step(pack, p, StepRole::Decoder, stage)? {
            Some(s) => Decoder::Stateful(s),
            None => Decoder::Window(MimiDecoder::open(
                pack,
                &session_options(p),
                p.int("window") as usize,
            )?),
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
            Decoder::Stateful(s) => s.decode(codes, vocab),
            Decoder::Window(w) => w.push(codes, vocab),
        }
    }

    pub fn reset(&mut self) {
        match self {
            Decoder::Stateful(s) => s.reset(),
            Decoder::Window(w) => w.reset(),
        }
    }
}

/// Encodes a whole clip frame by frame with the pack's stateful encoder when it has one (the
/// path the `mimi_encode` stage takes by default), else with the whole-utterance graph in one
/// call. Whole frames only.
pub(super) fn encode_clip(
    pack: &Pack,
    p: &Params,
    pcm: &[f32],
) -> Result<Vec<Vec<i64>>, ModelError> {
    let frame = pack.manifest.frame_size;
    if pack.step_graph(StepRole::Encoder, FloatType::F32).is_some() && pcm.len() >= frame {
        let mut enc =
            StepCodec::open(pack, StepRole::Encoder, FloatType::F32, &session_options(p))?;
        return pcm.chunks_exact(frame).map(|f| enc.encode(f)).collect();
    }
    MimiEncoder::open(pack, &session_options(p), 1)?.encode(pcm)
}
