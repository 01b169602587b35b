//! The temporal stage's priming: the voice prompt read and encoded, the persona made a
//! priming script, the graphs warmed up, and the script run (a step each, prefilled in chunks,
//! or restored from the process's cache of primed states). Knows the stage's state, not the
//! params' declarations.

use std::path::Path;
use std::time::Instant;

use crate::audio::{StreamResampler, WavReader};
use crate::model::lm::{persona_tokens, priming_script, ForcedStep};
use crate::model::pack::PackManifest;
use crate::model::tokenizer::Tokenizer;
use crate::observe::names;
use crate::runtime::{Context, StageError, StageResult};

use super::super::codec::clip_is_stepped;
use super::super::model_params::ModelParams;
use super::super::{BuildContext, BuildError, Sampled};
use super::{TemporalParams, TemporalStage};

/// The lowest rate of a voice prompt, Hz: below it there is no voice left to imitate.
pub(crate) const VOICE_MIN_RATE: u32 = 8000;

/// Checks a voice prompt from its WAV header alone, before anything is decoded: a WAV file at
/// [`VOICE_MIN_RATE`] or more, at most `max_seconds` long. Returns its length in 80 ms frames.
///
/// # Errors
///
/// An [`AudioError`](crate::audio::AudioError) naming the file: not a readable WAV, or one
/// unfit for a voice prompt.
pub(crate) fn check_voice(
    path: &Path,
    max_seconds: f64,
) -> Result<usize, crate::audio::AudioError> {
    let r = WavReader::open(path)?;
    let unfit = |detail: String| crate::audio::AudioError::Unfit {
        path: path.into(),
        detail,
    };
    if r.rate() < VOICE_MIN_RATE {
        return Err(unfit(format!(
            "{} Hz; a voice prompt needs {VOICE_MIN_RATE} Hz or more",
            r.rate()
        )));
    }
    let seconds = r.frames() as f64 / r.rate() as f64;
    if seconds > max_seconds {
        return Err(unfit(format!(
            "{seconds:.1} s; a voice prompt may last {max_seconds} s at most (`max_voice_s`)"
        )));
    }
    Ok((seconds / 0.08).ceil() as usize)
}

/// The code frames of a voice prompt WAV, once its header has passed [`check_voice`]: the
/// process's, encoded once per content, pack and codec path.
pub(super) fn voice_codes(
    cx: &BuildContext<'_>,
    path: &Path,
    pack: &crate::model::pack::Pack,
    t: &TemporalParams,
    m: &ModelParams,
) -> Result<std::sync::Arc<Vec<Vec<i64>>>, BuildError> {
    let voice = |e: String| BuildError::invalid(e).key("voice");
    let frames = check_voice(path, t.max_voice_s)
        .map_err(|e| BuildError::invalid(e.to_string()).key("voice"))?;
    let limit = t.max_positions;
    if limit > 0 && frames >= limit {
        return Err(voice(format!(
            "{}: {frames} frames of voice prompt do not fit in `max_positions` ({limit})",
            path.display()
        )));
    }
    let encode = || encode_voice(path, pack, m);
    // Everything that changes the codes: the codec's path (the stateful f32 encoder, or the
    // whole-clip graph) and the device.
    let codec = format!(
        "{} {} {}",
        if clip_is_stepped(pack) {
            "stateful f32"
        } else {
            "whole clip"
        },
        m.execution_provider,
        m.device_id
    );
    let unreadable = |e: String| BuildError::invalid(e).key("voice");
    cx.resources
        .voice_codes(path, pack, &codec, unreadable, encode)
}

/// Decodes, resamples and encodes a voice prompt WAV into code frames.
fn encode_voice(
    path: &Path,
    pack: &crate::model::pack::Pack,
    m: &ModelParams,
) -> Result<Vec<Vec<i64>>, BuildError> {
    let voice = |e: String| BuildError::invalid(e).key("voice");
    let mut r = WavReader::open(path).map_err(|e| voice(e.to_string()))?;
    let mut pcm = r.read_all().map_err(|e| voice(e.to_string()))?;
    let rate = pack.manifest.sample_rate;
    if r.rate() != rate {
        let resampling = |e: crate::audio::AudioError| voice(format!("resampling: {e}"));
        let mut rs =
            StreamResampler::new(r.rate(), rate, r.rate() as usize / 50).map_err(resampling)?;
        let mut out = Vec::new();
        rs.process(&pcm, &mut out).map_err(resampling)?;
        rs.flush(&mut out).map_err(resampling)?;
        pcm = out;
    }
    if pcm.len() < pack.manifest.frame_size {
        return Err(voice(format!(
            "{}: the voice prompt is shorter than one frame ({} samples at {rate} Hz)",
            path.display(),
            pack.manifest.frame_size
        )));
    }
    // The path the `mimi_encode` stage takes: the stateful encoder when the pack has one.
    super::super::codec::encode_clip(pack, m, &pcm)
        .map_err(|e| voice(format!("{}: {e}", path.display())))
}

/// The persona the params give (text with the tokenizer, or token ids), within
/// `max_persona_tokens`.
pub(super) fn persona_of(
    t: &TemporalParams,
    m: &PackManifest,
    tokenizer: Option<&Tokenizer>,
) -> Result<Vec<i64>, BuildError> {
    let persona = persona_tokens(
        m,
        tokenizer,
        t.persona.as_deref(),
        t.persona_tokens.as_deref().unwrap_or_default(),
    )
    .map_err(|e| BuildError::invalid(e.to_string()).key(e.key()))?;
    let max_persona = t.max_persona_tokens;
    if persona.len() > max_persona {
        let key = if t.persona.is_some() {
            "persona"
        } else {
            "persona_tokens"
        };
        return Err(BuildError::invalid(format!(
            "the persona is {} tokens; at most {max_persona} (`max_persona_tokens`: each token is a priming step)",
            persona.len()
        ))
        .key(key));
    }
    Ok(persona)
}

impl TemporalStage {
    /// Warms the graphs up (silent steps, then a reset) and primes the conversation.
    pub(super) fn warm_up_and_prime(&mut self, cx: &mut Context<'_>) -> StageResult {
        let silence = self.manifest.silence_codes.clone();
        if let Some(r) = &self.rec {
            r.write(&serde_json::json!({ "warmup": self.warmup, "user": silence }));
        }
        for _ in 0..self.warmup {
            if cx.should_stop() {
                return Ok(());
            }
            self.round_trip(cx, Instant::now(), &silence, None, None)?;
        }
        self.half.reset(true);
        self.prime(cx)?;
        tracing::info!(
            steps = self.script.len(),
            prefilled = self.prefilled,
            restored = self.restored,
            positions_left = self.half.temporal.positions_left(),
            "LM warmed up and primed"
        );
        self.control.set("agent_frames", self.index);
        self.control.set("context", self.half.temporal.kv_len());
        Ok(())
    }

    /// A new persona (text, or comma-separated token ids) replaces the priming script.
    pub(super) fn new_persona(&mut self, persona: &str) -> Result<(), String> {
        let as_ids = persona
            .chars()
            .all(|c| c.is_ascii_digit() || c == ',' || c == ' ');
        let ids: Vec<i64> = if as_ids {
            let tokens = persona
                .split(',')
                .filter(|t| !t.trim().is_empty())
                .map(|t| {
                    t.trim()
                        .parse::<i64>()
                        .map_err(|_| format!("{:?} is not a token id", t.trim()))
                })
                .collect::<Result<Vec<_>, _>>()?;
            persona_tokens(&self.manifest, None, None, &tokens)
        } else {
            persona_tokens(
                &self.manifest,
                self.tokenizer.as_deref(),
                Some(persona),
                &[],
            )
        }
        .map_err(|e| e.to_string())?;
        self.script = priming_script(
            &self.manifest,
            self.voice.as_ref().map(|v| v.as_slice()),
            &ids,
            self.silence_frames,
        );
        Ok(())
    }

    /// Clears the conversation, tells the codec stages (a new stream each), and primes again.
    pub(super) fn new_conversation(&mut self, cx: &mut Context<'_>) -> StageResult {
        self.half.reset(false);
        self.conversation.begin();
        self.prime(cx)
    }

    fn prime(&mut self, cx: &mut Context<'_>) -> StageResult {
        if let Some(r) = &self.rec {
            let steps: Vec<serde_json::Value> = self
                .script
                .iter()
                .map(|s| serde_json::json!({ "user": s.user, "text": s.text, "agent": s.agent }))
                .collect();
            r.write(
                &serde_json::json!({ "prime": steps, "position": self.half.temporal.position() }),
            );
        }
        self.steps = 0;
        self.prefilled = 0;
        self.restored = 0;
        let started = Instant::now();
        let script = std::mem::take(&mut self.script);
        // A pipeline asked to stop (its client gone) stops priming at the next step.
        let mut r = Ok(());
        let mut at = 0;
        while at < script.len() {
            if cx.should_stop() {
                break;
            }
            // The wholly forced steps from here, prefilled in chunks when asked to (all of them
            // from an empty cache when the primed state may come from the cache).
            let whole = self.primed.is_some() && self.half.temporal.position() == 0;
            let run = match self.priming_chunk {
                Some(_) if whole => self.half.forced_inputs(&script[at..], usize::MAX),
                Some(chunk) => self.half.forced_inputs(&script[at..], chunk),
                None => Vec::new(),
            };
            let done = if run.len() >= 2 {
                self.prefilled(cx, &script[at..at + run.len()], &run)
            } else {
                let s = &script[at];
                self.round_trip(cx, Instant::now(), &s.user, s.text, s.agent.as_deref())
                    .map(|_| 1)
            };
            match done {
                Ok(n) => at += n,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        let whole = at == script.len();
        self.script = script;
        if r.is_ok() && whole {
            // How the state was made: restored (even in part), prefilled, or stepped.
            let how = if self.restored > 0 {
                "cached"
            } else if self.prefilled > 0 {
                "chunked"
            } else {
                "stepped"
            };
            let seconds = started.elapsed().as_secs_f64();
            metrics::histogram!(names::PRIMING, "stage" => "temporal", "how" => how)
                .record(seconds);
            self.control.set("priming", how);
            self.control
                .set("priming_ms", (seconds * 1000.0).round() as i64);
        }
        r
    }

    /// Wholly forced priming steps whose temporal frames run as one prefill: the frames in
    /// one call (chunks of `priming_chunk`), then each step's round trip through the sampling
    /// half as [`round_trip`](Self::round_trip) makes it, minus the temporal step. Returns the
    /// steps done: fewer when the pipeline is asked to stop (its client gone), which is
    /// looked at between chunks and between steps.
    fn prefilled(
        &mut self,
        cx: &mut Context<'_>,
        steps: &[ForcedStep],
        inputs: &[Vec<i64>],
    ) -> StageResult<usize> {
        let chunk = self.priming_chunk.unwrap_or(1);
        // From an empty cache, the state these frames leave is the cache's to give or keep
        // (a transformer of its own or a shared engine's slot: the same graph's state).
        let key = self
            .primed
            .as_ref()
            .filter(|_| self.half.temporal.position() == 0)
            .map(|(cache, pack, graph)| {
                let recipe = crate::resources::PrimeRecipe {
                    pack: pack.clone(),
                    graph: graph.clone(),
                    chunk,
                    frames: inputs.to_vec(),
                };
                (cache.clone(), recipe.key(), recipe)
            });
        let restored = match &key {
            Some((cache, k, _)) => match cache.get(k) {
                Some(state) if state.position() == inputs.len() => {
                    self.half.temporal.restore(&state)?;
                    true
                }
                _ => false,
            },
            None => false,
        };
        if restored {
            self.restored += inputs.len();
        } else {
            for part in inputs.chunks(chunk.max(1)) {
                if cx.should_stop() {
                    return Ok(0);
                }
                self.half.temporal.prefill(part, chunk)?;
            }
            self.prefilled += inputs.len();
            if let Some((cache, k, recipe)) = key {
                if let Some(state) = self.half.temporal.snapshot() {
                    cache.put(k, state, Some(recipe));
                }
            }
        }
        for (done, s) in steps.iter().enumerate() {
            if cx.should_stop() {
                return Ok(done);
            }
            let step = self.half.begin_forced(s)?;
            cx.emit(0, Instant::now(), step)?;
            let Some(tokens) = cx.recv_feedback::<Sampled>(1)? else {
                return Err(StageError::msg("the depformer stage ended its stream"));
            };
            self.half.commit(&tokens.data)?;
        }
        Ok(steps.len())
    }
}
