//! `depformer`: samples each step's text token and runs the 16 depformer substeps, with two
//! seeded random streams as Kyutai's `moshi-core` has them: the text sampler (`text_seed`) draws
//! the text token, the audio sampler (`audio_seed`) each substep. Before the text draw, Kyutai's
//! text controls apply: the repetition penalty over the conversation's last words
//! (`repetition_penalty`, `repetition_penalty_context`) and the padding multiplier
//! (`pad_mult`). Answers every `LmStep` from the temporal stage with the step's tokens, which go
//! back on the feedback link. With `engine: shared` the substeps run in the process's shared
//! engine, batched with the other conversations' (this stage's audio sampler and settings
//! travel with each frame). `device_sampling` draws the audio where the logits are (for the
//! shared engine's whole batch: the tokens are the same either way).
//!
//! Command `sampling`, taken at the next frame: `key=value` pairs of the run-time settings
//! ([`RUNTIME_KEYS`]), each checked against its param's range, all applied or none; or the
//! four numbers `text_temperature text_top_k audio_temperature audio_top_k`. A seed given there
//! restarts that sampler's stream at once.

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::model::depformer::{Depformer, DepformerBinding, UnusedSubsteps};
use crate::model::lm::{DepformerModel, SamplingConfig, SamplingHalf};
use crate::model::sampling::SamplingParams;
use crate::model::session::SessionOptions;
use crate::runtime::{
    Body, CommandSpec, Context, Endpoint, Input, PortSpec, Reply, Stage, StageResult,
};

use super::model_params::{
    cuda_graph_needs_own_engine, model_params, open_pack, session_options, shared_engine,
    EngineParams, ModelParams, ENGINE_PARAM, MODEL_STATUS, SLOTS_PARAM,
};
use super::params::stage_params;
use super::{BuildContext, BuildError, LmStep, Sampled, StageKind};

const TEXT_TEMPERATURE: ParamSpec = ParamSpec {
    name: "text_temperature",
    ty: T::Float {
        min: 0.0,
        max: 100.0,
    },
    default: D::Float(0.7),
    doc: "0 = greedy",
};

const TEXT_TOP_K: ParamSpec = ParamSpec {
    name: "text_top_k",
    ty: T::Int {
        min: 0,
        max: 1 << 20,
    },
    default: D::Int(25),
    doc: "0 = all",
};

const AUDIO_TEMPERATURE: ParamSpec = ParamSpec {
    name: "audio_temperature",
    ty: T::Float {
        min: 0.0,
        max: 100.0,
    },
    default: D::Float(0.8),
    doc: "0 = greedy",
};

const AUDIO_TOP_K: ParamSpec = ParamSpec {
    name: "audio_top_k",
    ty: T::Int {
        min: 0,
        max: 1 << 20,
    },
    default: D::Int(250),
    doc: "0 = all",
};

const GREEDY: ParamSpec = ParamSpec {
    name: "greedy",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "argmax everywhere (overrides temperatures; as in moshi-core, a repetition penalty still applies to the text logits, pad_mult does not)",
};

const USER_SUBSTEPS: ParamSpec = ParamSpec {
    name: "user_substeps",
    ty: T::Choice(&UnusedSubsteps::NAMES),
    default: D::Str("skip"),
    doc: "skip: no graph run for substeps whose tokens are all provided (the user stream's): same tokens, same draws, half the work; run: every substep",
};

const CUDA_GRAPH: ParamSpec = ParamSpec {
    name: "cuda_graph",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "capture each substep's call as a CUDA graph and replay it every frame (execution_provider: cuda, engine: own)",
};

const DEVICE_SAMPLING: ParamSpec = ParamSpec {
    name: "device_sampling",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "draw each substep's audio token where the logits are, by a graph of its own (the same seeded stream): no logits come to the host each substep, the frame's tokens come back once (with engine: shared, the engine's whole batch, from its next frame)",
};

const SEED: ParamSpec = ParamSpec {
    name: "seed",
    ty: T::Int {
        min: 0,
        max: i64::MAX
    },
    default: D::Int(0),
    doc: "random seed: the same seed gives the same voice (the default of `text_seed` and `audio_seed`)",
};

const TEXT_SEED: ParamSpec = ParamSpec {
    name: "text_seed",
    ty: T::Int {
        min: -1,
        max: i64::MAX,
    },
    default: D::Int(-1),
    doc: "seed of the text sampler (-1 = `seed`)",
};

const AUDIO_SEED: ParamSpec = ParamSpec {
    name: "audio_seed",
    ty: T::Int {
        min: -1,
        max: i64::MAX,
    },
    default: D::Int(-1),
    doc: "seed of the audio sampler (-1 = derived from `seed`: seed XOR 0x617564696f5f7365)",
};

const PAD_MULT: ParamSpec = ParamSpec {
    name: "pad_mult",
    ty: T::Float {
        min: -10.0,
        max: 10.0
    },
    default: D::Float(0.0),
    doc: "the text padding token's probability is multiplied by exp(pad_mult) before the draw: positive, the agent speaks less; negative, more (0 = off; not in greedy)",
};

const REPETITION_PENALTY: ParamSpec = ParamSpec {
    name: "repetition_penalty",
    ty: T::Float {
        min: 1.0,
        max: 10.0
    },
    default: D::Float(1.0),
    doc: "text logits of the tokens among the last `repetition_penalty_context` words are divided by it (>= 0) or multiplied (< 0), each token once (1 = off)",
};

const REPETITION_PENALTY_CONTEXT: ParamSpec = ParamSpec {
    name: "repetition_penalty_context",
    ty: T::Int {
        min: 0,
        max: REPETITION_CONTEXT_MAX
    },
    default: D::Int(64),
    doc: "how many of the conversation's last words (non-padding text tokens the agent produced) the repetition penalty looks at",
};

stage_params! {
    /// `depformer`'s own params (with the engine's and every model stage's: [`EngineParams`], [`ModelParams`]).
    pub(super) struct DepformerParams {
        text_temperature: f32 = TEXT_TEMPERATURE,
        text_top_k: usize = TEXT_TOP_K,
        audio_temperature: f32 = AUDIO_TEMPERATURE,
        audio_top_k: usize = AUDIO_TOP_K,
        greedy: bool = GREEDY,
        user_substeps: String = USER_SUBSTEPS,
        cuda_graph: bool = CUDA_GRAPH,
        device_sampling: bool = DEVICE_SAMPLING,
        seed: u64 = SEED,
        text_seed: i64 = TEXT_SEED,
        audio_seed: i64 = AUDIO_SEED,
        pad_mult: f32 = PAD_MULT,
        repetition_penalty: f32 = REPETITION_PENALTY,
        repetition_penalty_context: usize = REPETITION_PENALTY_CONTEXT,
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: super::kind::DEPFORMER,
    doc: "samples the text token and the 16 audio codebooks of each step (seeded)",
    params: model_params![
        TEXT_TEMPERATURE,
        TEXT_TOP_K,
        AUDIO_TEMPERATURE,
        AUDIO_TOP_K,
        GREEDY,
        USER_SUBSTEPS,
        CUDA_GRAPH,
        DEVICE_SAMPLING,
        ENGINE_PARAM,
        SLOTS_PARAM,
        SEED,
        TEXT_SEED,
        AUDIO_SEED,
        PAD_MULT,
        REPETITION_PENALTY,
        REPETITION_PENALTY_CONTEXT,
    ],
    inputs: || vec![PortSpec::new::<LmStep>("in")],
    outputs: || vec![PortSpec::new::<Sampled>("tokens")],
    commands: &[CommandSpec {
        name: "sampling",
        arg: Some("key=value … (text_temperature text_top_k audio_temperature audio_top_k pad_mult repetition_penalty repetition_penalty_context text_seed audio_seed), or the four numbers text_temperature text_top_k audio_temperature audio_top_k"),
        doc: "new sampling settings, from the next frame (a seed restarts its sampler)",
    }],
    status: &[MODEL_STATUS],
    build,
};

/// The largest `repetition_penalty_context`: the words a conversation's history keeps.
const REPETITION_CONTEXT_MAX: i64 = crate::model::sampling::TextHistory::CAPACITY as i64;

/// The settings the `sampling` command takes, in its `key=value` form.
pub(crate) const RUNTIME_KEYS: [&str; 9] = [
    "text_temperature",
    "text_top_k",
    "audio_temperature",
    "audio_top_k",
    "pad_mult",
    "repetition_penalty",
    "repetition_penalty_context",
    "text_seed",
    "audio_seed",
];

/// A seed param: -1 = the default (from `seed`).
fn seed_of(v: i64) -> Option<u64> {
    u64::try_from(v).ok()
}

/// The sampling settings from a stage's params.
fn sampling_config(d: &DepformerParams) -> SamplingConfig {
    let params = |temperature: f32, top_k: usize| {
        if d.greedy {
            SamplingParams::GREEDY
        } else {
            SamplingParams { temperature, top_k }
        }
    };
    SamplingConfig {
        text: params(d.text_temperature, d.text_top_k),
        audio: params(d.audio_temperature, d.audio_top_k),
        seed: d.seed,
        text_seed: seed_of(d.text_seed),
        audio_seed: seed_of(d.audio_seed),
        pad_mult: d.pad_mult,
        repetition_penalty: d.repetition_penalty,
        repetition_penalty_context: d.repetition_penalty_context,
        ..SamplingConfig::default()
    }
}

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let d = DepformerParams::from_params(p)?;
    let m = ModelParams::from_params(p)?;
    let e = EngineParams::from_params(p)?;
    let opts = SessionOptions {
        cuda_graph: d.cuda_graph,
        ..session_options(&m)
    };
    if let Some((key, why)) = opts.cuda_graph_conflict() {
        return Err(BuildError::invalid(why).key(key));
    }
    cuda_graph_needs_own_engine(&e, opts.cuda_graph)?;
    let binding = DepformerBinding {
        separate_io: false,
        device_sampling: d.device_sampling,
    };
    let pack = open_pack(cx, &m)?;
    let mut dep: DepformerModel = match shared_engine(cx, &pack, (&m, &e), usize::MAX)? {
        Some(lm) => {
            // (the engine's whole batch: the same tokens for every conversation on it)
            if binding.device_sampling {
                lm.want_device_sampling();
            }
            lm.depformer_client().into()
        }
        None => Depformer::open_with(&pack, &opts, binding)?.into(),
    };
    let unused = UnusedSubsteps::from_name(&d.user_substeps).ok_or_else(|| {
        BuildError::invalid(format!(
            "`user_substeps: {}`: one of {}",
            d.user_substeps,
            UnusedSubsteps::NAMES.join(", ")
        ))
        .key("user_substeps")
    })?;
    dep.set_unused(unused);
    let control = cx.endpoint();
    control.set("model", dep.runs_on());
    let mut config = sampling_config(&d);
    config.specials = pack.manifest.text_specials();
    Ok(Body::Stage(Box::new(DepformerStage {
        half: SamplingHalf::new(dep, config),
        control,
    })))
}

/// Checks a run-time value against the range of the param of the same name.
fn checked(key: &str, v: f64) -> Result<f64, String> {
    let Some(spec) = KIND.params.iter().find(|s| s.name == key) else {
        return Err(format!(
            "unknown setting `{key}`; expected one of: {}",
            RUNTIME_KEYS.join(", ")
        ));
    };
    let ok = match spec.ty {
        T::Float { min, max } => (min..=max).contains(&v),
        T::Int { min, max } => v.fract() == 0.0 && (min as f64..=max as f64).contains(&v),
        _ => false,
    };
    if !ok {
        let range = match spec.ty {
            T::Float { min, max } => format!("a number in {min}..={max}"),
            T::Int { min, max } => format!("an integer in {min}..={max}"),
            _ => String::new(),
        };
        return Err(format!("`{key}`: {v} is out of range (expected {range})"));
    }
    Ok(v)
}

/// The `sampling` command's argument as (key, value) pairs, every value checked.
fn parse_sampling(s: &str) -> Result<Vec<(&'static str, f64)>, String> {
    let number = |t: &str| -> Result<f64, String> {
        t.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .ok_or_else(|| format!("{t:?} is not a number"))
    };
    let words: Vec<&str> = s.split_whitespace().collect();
    if words.is_empty() {
        return Err(format!(
            "no settings: give key=value pairs of {}",
            RUNTIME_KEYS.join(", ")
        ));
    }
    let mut out = Vec::new();
    if words.iter().all(|w| !w.contains('=')) {
        // The four positional numbers.
        if words.len() != 4 {
            return Err(format!(
                "expected 4 numbers (text_temperature text_top_k audio_temperature audio_top_k) or key=value pairs, got {} words",
                words.len()
            ));
        }
        for (k, w) in RUNTIME_KEYS[..4].iter().zip(&words) {
            out.push((*k, checked(k, number(w)?)?));
        }
        return Ok(out);
    }
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            return Err(format!("{w:?} is not key=value"));
        };
        let Some(key) = RUNTIME_KEYS.iter().find(|r| **r == k) else {
            return Err(format!(
                "unknown setting `{k}`; expected one of: {}",
                RUNTIME_KEYS.join(", ")
            ));
        };
        let v = number(v).map_err(|e| format!("`{key}`: {e}"))?;
        out.push((*key, checked(key, v)?));
    }
    Ok(out)
}

/// Applies checked settings to `c`; says which seeds changed (text, audio).
fn apply_sampling(c: &mut SamplingConfig, settings: &[(&str, f64)]) -> (bool, bool) {
    let mut reseed = (false, false);
    for &(k, v) in settings {
        match k {
            "text_temperature" => c.text.temperature = v as f32,
            "text_top_k" => c.text.top_k = v as usize,
            "audio_temperature" => c.audio.temperature = v as f32,
            "audio_top_k" => c.audio.top_k = v as usize,
            "pad_mult" => c.pad_mult = v as f32,
            "repetition_penalty" => c.repetition_penalty = v as f32,
            "repetition_penalty_context" => c.repetition_penalty_context = v as usize,
            "text_seed" => {
                c.text_seed = seed_of(v as i64);
                reseed.0 = true;
            }
            "audio_seed" => {
                c.audio_seed = seed_of(v as i64);
                reseed.1 = true;
            }
            _ => {}
        }
    }
    reseed
}

struct DepformerStage {
    half: SamplingHalf,
    control: Endpoint,
}

impl DepformerStage {
    /// The `sampling` command: all the settings applied, or none.
    fn set_sampling(&mut self, s: &str) -> Reply {
        let settings = parse_sampling(s)?;
        let (text, audio) = apply_sampling(&mut self.half.config, &settings);
        if text {
            self.half.reseed_text();
        }
        if audio {
            self.half.reseed_audio();
        }
        let c = &self.half.config;
        tracing::info!(
            text_temperature = c.text.temperature,
            text_top_k = c.text.top_k,
            audio_temperature = c.audio.temperature,
            audio_top_k = c.audio.top_k,
            pad_mult = c.pad_mult,
            repetition_penalty = c.repetition_penalty,
            repetition_penalty_context = c.repetition_penalty_context,
            text_seed = c.text_seed(),
            audio_seed = c.audio_seed(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampling_command_takes_four_numbers_or_checked_pairs() {
        let four = parse_sampling("0.5 10 0.9 100").unwrap();
        assert_eq!(
            four,
            vec![
                ("text_temperature", 0.5),
                ("text_top_k", 10.0),
                ("audio_temperature", 0.9),
                ("audio_top_k", 100.0)
            ]
        );
        let pairs = parse_sampling("pad_mult=-2.5 repetition_penalty=1.5 text_seed=7").unwrap();
        let mut c = SamplingConfig::default();
        assert_eq!(apply_sampling(&mut c, &pairs), (true, false));
        assert_eq!(
            (c.pad_mult, c.repetition_penalty, c.text_seed),
            (-2.5, 1.5, Some(7))
        );
        // -1: back to the default, from `seed`.
        let mut c = SamplingConfig {
            seed: 4,
            ..SamplingConfig::default()
        };
        apply_sampling(&mut c, &parse_sampling("audio_seed=-1").unwrap());
        assert_eq!(c.audio_seed(), 4 ^ SamplingConfig::AUDIO_SEED_MIX);
        for (bad, says) in [
            ("pad_mult=11", "`pad_mult`: 11 is out of range"),
            (
                "repetition_penalty=0.5",
                "`repetition_penalty`: 0.5 is out of range",
            ),
            (
                "repetition_penalty_context=1.5",
                "`repetition_penalty_context`: 1.5",
            ),
            ("repetition_penalty_context=5000", "out of range"),
            ("text_seed=-2", "`text_seed`: -2 is out of range"),
            ("pad_mult=x", "`pad_mult`: \"x\" is not a number"),
            ("pad_mul=1", "unknown setting `pad_mul`"),
            ("0.5 10 0.9", "expected 4 numbers"),
            (
                "0.5 10 -0.9 100",
                "`audio_temperature`: -0.9 is out of range",
            ),
            ("pad_mult=nan", "not a number"),
            ("", "no settings"),
        ] {
            let e = parse_sampling(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        // What the daemon sends on a reload (`Sampling::command_arg`).
        let daemon = "text_temperature=0.7 text_top_k=25 audio_temperature=0.8 audio_top_k=250 \
                      pad_mult=-2.5 repetition_penalty=1.3 repetition_penalty_context=64";
        assert_eq!(parse_sampling(daemon).unwrap().len(), 7);
        // Every run-time key is a param of the stage, with a range.
        for k in RUNTIME_KEYS {
            assert!(KIND.params.iter().any(|s| s.name == k), "{k}");
        }
    }
}
