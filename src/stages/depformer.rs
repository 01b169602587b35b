//! `depformer`: samples each step's text token and runs the 16 depformer substeps, from one
//! seeded random stream (text first, then substeps 0..15). Answers every `LmStep` from the
//! temporal stage with the step's tokens, which go back on the feedback link. With `engine:
//! shared` the substeps run in the process's shared engine, batched with the other
//! conversations' (this stage's sampler and settings travel with each frame).

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::model::depformer::{Depformer, UnusedSubsteps};
use crate::model::lm::{DepformerModel, SamplingConfig, SamplingHalf};
use crate::model::sampling::SamplingParams;
use crate::runtime::{Body, CommandSpec, Context, Endpoint, Input, PortSpec, Stage, StageResult};

use super::model_params::{
    model_params, open_pack, session_options, shared_engine, ENGINE_PARAM, MODEL_STATUS,
    SLOTS_PARAM,
};
use super::{BuildContext, BuildError, LmStep, Sampled, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "depformer",
    doc: "samples the text token and the 16 audio codebooks of each step (seeded)",
    params: model_params![
        ParamSpec {
            name: "text_temperature",
            ty: T::Float {
                min: 0.0,
                max: 100.0
            },
            default: D::Float(0.7),
            doc: "0 = greedy"
        },
        ParamSpec {
            name: "text_top_k",
            ty: T::Int {
                min: 0,
                max: 1 << 20
            },
            default: D::Int(25),
            doc: "0 = all"
        },
        ParamSpec {
            name: "audio_temperature",
            ty: T::Float {
                min: 0.0,
                max: 100.0
            },
            default: D::Float(0.8),
            doc: "0 = greedy"
        },
        ParamSpec {
            name: "audio_top_k",
            ty: T::Int {
                min: 0,
                max: 1 << 20
            },
            default: D::Int(250),
            doc: "0 = all"
        },
        ParamSpec {
            name: "greedy",
            ty: T::Bool,
            default: D::Bool(false),
            doc: "argmax everywhere (overrides temperatures)"
        },
        ParamSpec {
            name: "user_substeps",
            ty: T::Choice(&UnusedSubsteps::NAMES),
            default: D::Str("skip"),
            doc: "skip: no graph run for substeps whose tokens are all provided (the user stream's): same tokens, same draws, half the work; run: every substep"
        },
        ENGINE_PARAM,
        SLOTS_PARAM,
        ParamSpec {
            name: "seed",
            ty: T::Int {
                min: 0,
                max: i64::MAX
            },
            default: D::Int(0),
            doc: "random seed: the same seed gives the same voice"
        },
    ],
    inputs: || vec![PortSpec::new::<LmStep>("in")],
    outputs: || vec![PortSpec::new::<Sampled>("tokens")],
    commands: &[CommandSpec {
        name: "sampling",
        arg: Some("text_temperature text_top_k audio_temperature audio_top_k"),
        doc: "new sampling settings, from the next frame",
    }],
    status: &[MODEL_STATUS],
    build,
};

/// The sampling settings from a stage's params.
pub(crate) fn sampling_config(p: &Params) -> SamplingConfig {
    let greedy = p.bool("greedy");
    let params = |t: &str, k: &str| {
        if greedy {
            SamplingParams::GREEDY
        } else {
            SamplingParams {
                temperature: p.float(t) as f32,
                top_k: p.int(k) as usize,
            }
        }
    };
    SamplingConfig {
        text: params("text_temperature", "text_top_k"),
        audio: params("audio_temperature", "audio_top_k"),
        seed: p.int("seed") as u64,
    }
}

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let pack = open_pack(p)?;
    let mut dep: DepformerModel = match shared_engine(&pack, p, usize::MAX)? {
        Some(lm) => lm.depformer_client().into(),
        None => Depformer::open(&pack, &session_options(p))?.into(),
    };
    dep.set_unused(
        UnusedSubsteps::from_name(p.str("user_substeps")).unwrap_or(UnusedSubsteps::Run),
    );
    let control = cx.endpoint();
    control.set("model", dep.runs_on());
    Ok(Body::Stage(Box::new(DepformerStage {
        half: SamplingHalf::new(dep, sampling_config(p)),
        control,
    })))
}

struct DepformerStage {
    half: SamplingHalf,
    control: Endpoint,
}

impl DepformerStage {
    /// `text_temperature text_top_k audio_temperature audio_top_k`.
    fn set_sampling(&mut self, s: &str) -> Result<String, String> {
        let v: Vec<f64> = s
            .split_whitespace()
            .map(|t| t.parse().map_err(|_| format!("{t:?} is not a number")))
            .collect::<Result<_, _>>()?;
        let [tt, tk, at, ak] = v[..] else {
            return Err(format!(
                "expected 4 numbers (text_temperature text_top_k audio_temperature audio_top_k), got {}",
                v.len()
            ));
        };
        if v.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err("sampling settings are numbers of 0 or more".into());
        }
        self.half.config.text = SamplingParams {
            temperature: tt as f32,
            top_k: tk as usize,
        };
        self.half.config.audio = SamplingParams {
            temperature: at as f32,
            top_k: ak as usize,
        };
        tracing::info!(
            text_temperature = tt,
            text_top_k = tk,
            audio_temperature = at,
            audio_top_k = ak,
            "sampling changed"
        );
        Ok("sampling changed".into())
    }
}

impl Stage for DepformerStage {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let step = input.take::<LmStep>()?;
        while let Some(c) = self.control.next_command() {
            let r = self.set_sampling(&c.arg);
            c.reply(r);
        }
        let tokens = self.half.sample(&step.data)?;
        cx.emit(0, step.meta.origin, tokens)
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        let (run, skipped) = self.half.depformer.counts();
        tracing::info!(
            substeps_run = run,
            substeps_skipped = skipped,
            user_substeps = format!("{:?}", self.half.depformer.unused()).to_lowercase(),
            "depformer finished"
        );
        Ok(())
    }
}
