//! `depformer`: samples each step's text token and runs the 16 depformer substeps, from one
//! seeded random stream (text first, then substeps 0..15). Answers every `LmStep` from the
//! temporal stage with the step's tokens, which go back on the feedback link.

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::model::depformer::Depformer;
use crate::model::lm::{SamplingConfig, SamplingHalf};
use crate::model::sampling::SamplingParams;
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageResult};

use super::model_params::{model_params, open_pack, session_options};
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

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let pack = open_pack(p)?;
    let dep = Depformer::open(&pack, &session_options(p))?;
    Ok(Body::Stage(Box::new(DepformerStage {
        half: SamplingHalf::new(dep, sampling_config(p)),
    })))
}

struct DepformerStage {
    half: SamplingHalf,
}

impl Stage for DepformerStage {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let step = input.take::<LmStep>()?;
        if let Some(s) = crate::control::take("depformer.sampling") {
            // "text_temperature text_top_k audio_temperature audio_top_k"
            let v: Vec<f64> = s
                .split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect();
            if let [tt, tk, at, ak] = v[..] {
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
            }
        }
        let tokens = self.half.sample(&step.data)?;
        cx.emit(0, step.meta.origin, tokens)
    }
}
