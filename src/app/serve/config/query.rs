//! What a client may choose of its session, and how: the query parameters of `/api/chat` (and
//! the same names from the realtime API's `session.update` and a call's `<Parameter>`s), each
//! checked against its range and the operator's limits ([`SessionParams`]), then set over the
//! session template's stages as overrides naming where each came from. Knows nothing of
//! sockets or of the template's file.

use std::collections::HashMap;
use std::path::PathBuf;

use super::{Sampling, ServeConfig};
use crate::config::{ParamOverride, PipelineSpec};
use crate::stages::kind;

/// The largest seed (integers up to 2^53 are exact in every JSON reader).
const SEED_MAX: f64 = 9_007_199_254_740_991.0;

/// The widest `pad_mult` (the depformer stage's range): e^±10 already makes padding all but
/// certain or impossible.
const PAD_MULT_MAX: f64 = 10.0;

/// The strongest repetition penalty.
const REPETITION_PENALTY_MAX: f64 = 10.0;

/// The longest repetition context, tokens.
const CONTEXT_MAX: f64 = 4096.0;

/// A client's choices for its session, from the query string of `/api/chat` over the
/// configuration's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionParams {
    /// Sampling.
    pub sampling: Sampling,
    /// Steps after which the conversation ends (0: none): the server's `limits.max_steps`, or
    /// fewer when the client asks.
    pub max_steps: i64,
    /// Persona text.
    pub text_prompt: String,
    /// Voice prompt file, resolved inside the voices folder.
    pub voice: Option<PathBuf>,
    /// The origin of each value that the client chose (`query text_temperature=0.5`).
    pub chosen: HashMap<&'static str, String>,
}

impl ServeConfig {
    /// The session's choices: the configuration's defaults with the client's query parameters
    /// over them. Unknown parameters are ignored (Kyutai's and NVIDIA's clients send some of
    /// their own).
    ///
    /// # Errors
    ///
    /// A message for the client naming the parameter and what it must be.
    pub fn session_params(&self, query: &[(String, String)]) -> Result<SessionParams, String> {
        let mut p = SessionParams {
            sampling: self.sampling,
            max_steps: self.max_steps,
            text_prompt: self.text_prompt.clone(),
            voice: None,
            chosen: HashMap::new(),
        };
        let mut voice = self.voice_prompt.clone();
        for (k, v) in query {
            let num = |min: f64, max: f64| -> Result<f64, String> {
                let x: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("query parameter {k}={}: not a number", shown(v)))?;
                if !(min..=max).contains(&x) {
                    return Err(format!(
                        "query parameter {k}={}: out of range {min}..={max}",
                        shown(v)
                    ));
                }
                Ok(x)
            };
            let name: &'static str = match k.as_str() {
                "text_temperature" => {
                    p.sampling.text_temperature = num(0.0, 100.0)?;
                    "text_temperature"
                }
                "text_topk" => {
                    p.sampling.text_top_k = num(0.0, 1e6)? as i64;
                    "text_topk"
                }
                "audio_temperature" => {
                    p.sampling.audio_temperature = num(0.0, 100.0)?;
                    "audio_temperature"
                }
                "audio_topk" => {
                    p.sampling.audio_top_k = num(0.0, 1e6)? as i64;
                    "audio_topk"
                }
                "pad_mult" => {
                    p.sampling.pad_mult = num(-PAD_MULT_MAX, PAD_MULT_MAX)?;
                    "pad_mult"
                }
                "repetition_penalty" => {
                    p.sampling.repetition_penalty = num(1.0, REPETITION_PENALTY_MAX)?;
                    "repetition_penalty"
                }
                "repetition_penalty_context" => {
                    p.sampling.repetition_penalty_context = num(0.0, CONTEXT_MAX)? as i64;
                    "repetition_penalty_context"
                }
                "text_seed" => {
                    p.sampling.text_seed = Some(num(0.0, SEED_MAX)? as u64);
                    "text_seed"
                }
                "audio_seed" => {
                    p.sampling.audio_seed = Some(num(0.0, SEED_MAX)? as u64);
                    "audio_seed"
                }
                // The server's own limit bounds it.
                "max_steps" => {
                    let asked = num(1.0, 1e9)? as i64;
                    let cap = self.max_steps;
                    p.max_steps = if cap > 0 { asked.min(cap) } else { asked };
                    "max_steps"
                }
                "text_prompt" => {
                    if v.len() > 4096 {
                        return Err(format!(
                            "query parameter text_prompt: {} bytes, at most 4096",
                            v.len()
                        ));
                    }
                    p.text_prompt = strip_system_tags(v);
                    "text_prompt"
                }
                "voice_prompt" => {
                    voice = v.clone();
                    "voice_prompt"
                }
                _ => continue,
            };
            p.chosen.insert(name, format!("query {k}={}", shown(v)));
        }
        if !voice.trim().is_empty() {
            p.voice = Some(self.voice_path(voice.trim())?);
        }
        Ok(p)
    }

    /// The params that turn the session template into this session's pipeline, typed: the
    /// pack and execution provider of every model stage, the sampling, persona and voice, each
    /// with its origin (the configuration key or the query parameter). Model stages are the
    /// kinds that take a `pack`.
    pub fn session_overrides(
        &self,
        spec: &PipelineSpec,
        catalog: &dyn crate::config::KindCatalog,
        p: &SessionParams,
    ) -> Vec<ParamOverride> {
        use crate::config::ParamValue::Str;
        let mut sets = Vec::new();
        let origin = |query: &str, key: &str| {
            p.chosen
                .get(query)
                .cloned()
                .unwrap_or_else(|| self.origin(key))
        };
        for s in &spec.stages {
            let name = &s.name;
            let mut set = |param, value, origin: String| {
                sets.push(ParamOverride::new(name.clone(), param, value, origin))
            };
            let model = catalog
                .params(&s.kind)
                .is_some_and(|ps| ps.iter().any(|x| x.name == "pack"));
            if model {
                if let Some(pack) = &self.pack {
                    set("pack", Str(pack.clone()), self.origin("pack"));
                }
                if let Some(ep) = &self.execution_provider {
                    set(
                        "execution_provider",
                        Str(ep.name().to_string()),
                        self.origin("execution_provider"),
                    );
                }
            }
            let sm = &p.sampling;
            match s.kind.as_str() {
                kind::DEPFORMER => {
                    for (param, value, o) in self.sampling_overrides(sm, &origin) {
                        set(param, value, o);
                    }
                }
                kind::TEMPORAL => {
                    for (param, value, o) in self.temporal_overrides(p, &origin) {
                        set(param, value, o);
                    }
                }
                _ => {}
            }
        }
        sets
    }

    /// The depformer's sampling params: each with its origin.
    fn sampling_overrides(
        &self,
        sm: &Sampling,
        origin: &dyn Fn(&str, &str) -> String,
    ) -> Vec<(&'static str, crate::config::ParamValue, String)> {
        use crate::config::ParamValue::{Float, Int};
        let mut out = Vec::new();
        for (param, query, value) in [
            (
                "text_temperature",
                "text_temperature",
                Float(sm.text_temperature),
            ),
            ("text_top_k", "text_topk", Int(sm.text_top_k)),
            (
                "audio_temperature",
                "audio_temperature",
                Float(sm.audio_temperature),
            ),
            ("audio_top_k", "audio_topk", Int(sm.audio_top_k)),
            ("pad_mult", "pad_mult", Float(sm.pad_mult)),
            (
                "repetition_penalty",
                "repetition_penalty",
                Float(sm.repetition_penalty),
            ),
            (
                "repetition_penalty_context",
                "repetition_penalty_context",
                Int(sm.repetition_penalty_context),
            ),
        ] {
            let key = format!("sampling.{}", query.replace("topk", "top_k"));
            out.push((param, value, origin(query, &key)));
        }
        // `seed` (the configuration's, or fresh per session) is the default of
        // both samplers' seeds; a seed of the client's or the configuration's for
        // one sampler is that sampler's.
        let seed = sm.seed.unwrap_or_else(|| u64::from(rand::random::<u32>()));
        out.push((
            "seed",
            Int((seed & SEED_MAX as u64) as i64),
            origin("seed", "sampling.seed"),
        ));
        for (param, seed) in [("text_seed", sm.text_seed), ("audio_seed", sm.audio_seed)] {
            if let Some(seed) = seed {
                out.push((
                    param,
                    Int((seed & SEED_MAX as u64) as i64),
                    origin(param, &format!("sampling.{param}")),
                ));
            }
        }
        out
    }

    /// The temporal stage's limits and the client's persona and voice: each with its origin.
    fn temporal_overrides(
        &self,
        p: &SessionParams,
        origin: &dyn Fn(&str, &str) -> String,
    ) -> Vec<(&'static str, crate::config::ParamValue, String)> {
        use crate::config::ParamValue::{Bool, Float, Int, Str};
        let mut out = Vec::new();
        if p.max_steps > 0 {
            out.push((
                "max_steps",
                Int(p.max_steps),
                origin("max_steps", "limits.max_steps"),
            ));
        }
        out.push((
            "max_persona_tokens",
            Int(self.limits.max_prompt_tokens as i64),
            self.origin("limits.max_prompt_tokens"),
        ));
        out.push((
            "max_voice_s",
            Float(self.limits.max_voice_s),
            self.origin("limits.max_voice_s"),
        ));
        out.push((
            "log_transcript",
            Bool(self.log_transcripts),
            self.origin("log_transcripts"),
        ));
        if !p.text_prompt.trim().is_empty() {
            out.push((
                "persona",
                Str(p.text_prompt.clone()),
                origin("text_prompt", "text_prompt"),
            ));
        }
        if let Some(v) = &p.voice {
            out.push((
                "voice",
                Str(v.display().to_string()),
                origin("voice_prompt", "voice_prompt"),
            ));
        }
        out
    }
}

/// PersonaPlex's clients wrap the persona in `<system>` tags; the model stage adds its own.
fn strip_system_tags(v: &str) -> String {
    let t = v.trim();
    let t = t.strip_prefix("<system>").unwrap_or(t);
    let t = t.strip_suffix("<system>").unwrap_or(t);
    t.trim().to_string()
}

/// A client's value as the server repeats it (in a reply or a log line): at most 40
/// characters, control characters escaped.
pub(crate) fn shown(v: &str) -> String {
    let cut: String = v.chars().take(40).collect();
    let escaped: String = cut.escape_debug().collect();
    if v.chars().count() > 40 {
        format!("{escaped}…")
    } else {
        escaped
    }
}
