//! The LM step split in two halves that can run in one loop or in two actors joined by a
//! feedback edge, with the same results:
//!
//! - [`TemporalHalf`]: the token ring ([`LmGen`]) and the temporal transformer. `begin` turns a
//!   user frame (and forced tokens while priming) into an [`LmStep`]; `commit` takes the
//!   [`Sampled`] tokens back and returns the agent frame that is complete.
//! - [`SamplingHalf`]: the samplers and the depformer. `sample` draws the text token from the
//!   text sampler (after Kyutai's text controls: repetition penalty, padding multiplier), then
//!   runs the 16 substeps, each drawing from the audio sampler. The two samplers are seeded
//!   independently (`text_seed`, `audio_seed`), as moshi-core's `text_lp` and `audio_lp`.
//!
//! [`LmLoop`] composes them sequentially. [`priming_script`] lists the forced steps that prime a
//! persona and a voice before the conversation; [`TemporalHalf::forced_inputs`] and
//! [`TemporalHalf::begin_forced`] let the wholly forced ones run their temporal frames ahead, as
//! one prefill.

use super::depformer::{Depformer, DepformerInput, UnusedSubsteps};
use super::engine::DepformerClient;
use super::error::ModelError;
use super::lmgen::{AgentFrame, LmGen, StepIo};
use super::sampling::{apply_pad_mult, Sampler, SamplingParams, TextHistory, TextSpecials};
use super::temporal::Temporal;

pub use super::persona::{persona_tokens, priming_script, ForcedStep, PersonaError};

/// What the temporal half hands to the sampling half for one step.
#[derive(Debug, Clone, PartialEq)]
pub struct LmStep {
    /// The temporal transformer's hidden state (f32).
    pub hidden: Vec<f32>,
    /// Text logits.
    pub text_logits: Vec<f32>,
    /// Provided tokens of the column being generated (all channels).
    pub target: Vec<i64>,
    /// Which of them are provided.
    pub provided: Vec<bool>,
    /// Restart both random streams (from their seeds) before this step: sent once, after
    /// warmup.
    pub reseed: bool,
    /// The first step of a new conversation (after warmup, a reset, a new persona, a
    /// long-session re-prime): the sampling half forgets the text history of the last one.
    pub new_conversation: bool,
    /// The conversation's slot in the shared engine, when its temporal half has one: lets the
    /// engine know the depformer request belongs to the same conversation.
    pub slot: Option<usize>,
}

/// The tokens chosen for one step: text, then one per audio channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampled {
    /// Text token (the provided one where text was forced).
    pub text: i64,
    /// One sampled token per audio channel (`2 × codebooks`).
    pub audio: Vec<i64>,
}

/// A depformer of the conversation's own, or a client of the shared engine.
#[allow(clippy::large_enum_variant)]
pub enum DepformerModel {
    /// A session of its own.
    Own(Depformer),
    /// The shared engine's.
    Shared(DepformerClient),
}

impl From<Depformer> for DepformerModel {
    fn from(d: Depformer) -> Self {
        DepformerModel::Own(d)
    }
}

impl From<DepformerClient> for DepformerModel {
    fn from(d: DepformerClient) -> Self {
        DepformerModel::Shared(d)
    }
}

impl DepformerModel {
    /// What the graph runs on.
    pub fn runs_on(&self) -> String {
        match self {
            DepformerModel::Own(d) => d.runs_on(),
            DepformerModel::Shared(d) => d.runs_on(),
        }
    }

    /// Substeps run and skipped so far.
    pub fn counts(&self) -> (u64, u64) {
        match self {
            DepformerModel::Own(d) => d.counts,
            DepformerModel::Shared(d) => d.counts,
        }
    }

    /// What is done with the substeps nothing reads.
    pub fn unused(&self) -> UnusedSubsteps {
        match self {
            DepformerModel::Own(d) => d.unused,
            DepformerModel::Shared(d) => d.unused,
        }
    }

    /// Sets what is done with the substeps nothing reads.
    pub fn set_unused(&mut self, u: UnusedSubsteps) {
        match self {
            DepformerModel::Own(d) => d.unused = u,
            DepformerModel::Shared(d) => d.unused = u,
        }
    }

    fn run(
        &mut self,
        slot: Option<usize>,
        frame: DepformerInput<'_>,
        sampler: &mut Sampler,
        params: super::sampling::SamplingParams,
        out: &mut Vec<i64>,
    ) -> Result<(), ModelError> {
        match self {
            DepformerModel::Own(d) => d.run(frame, sampler, params, out),
            DepformerModel::Shared(d) => {
                d.conversation = slot;
                d.run(frame, sampler, params, out)
            }
        }
    }
}

/// The token ring and the temporal transformer.
pub struct TemporalHalf {
    /// Token bookkeeping.
    pub gen: LmGen,
    /// The transformer.
    pub temporal: Temporal,
    pending_reseed: bool,
    pending_new: bool,
}

impl TemporalHalf {
    /// Joins a ring and a transformer.
    pub fn new(gen: LmGen, temporal: impl Into<Temporal>) -> Self {
        TemporalHalf {
            gen,
            temporal: temporal.into(),
            pending_reseed: false,
            pending_new: false,
        }
    }

    /// Forgets the conversation: the next step tells the sampling half that a new one begins
    /// and, with `reseed`, to restart its random streams.
    pub fn reset(&mut self, reseed: bool) {
        self.gen.reset();
        self.temporal.reset();
        self.pending_reseed |= reseed;
        self.pending_new = true;
    }

    /// Starts a step. `None` on the very first step of a conversation (nothing to run).
    ///
    /// # Errors
    ///
    /// Wrong code counts, token ids out of range, ONNX Runtime errors.
    pub fn begin(
        &mut self,
        user: &[i64],
        text: Option<i64>,
        agent: Option<&[i64]>,
    ) -> Result<Option<LmStep>, ModelError> {
        let io = self
            .gen
            .begin(user, text, agent)
            .map_err(|e| ModelError::contract("temporal", e.to_string()))?;
        let Some(StepIo {
            input,
            target,
            provided,
        }) = io
        else {
            return Ok(None);
        };
        self.temporal.step(&input)?;
        let mut step = LmStep {
            hidden: Vec::new(),
            text_logits: Vec::new(),
            target,
            provided,
            reseed: std::mem::take(&mut self.pending_reseed),
            new_conversation: std::mem::take(&mut self.pending_new),
            slot: self.temporal.slot(),
        };
        self.temporal.read_hidden(&mut step.hidden);
        self.temporal.read_logits(&mut step.text_logits);
        Ok(Some(step))
    }

    /// The inputs of the longest run (at most `max`) of `script`'s steps, from the next one on,
    /// that are wholly forced: every token of each step's target column is provided, so that
    /// nothing sampled reaches a later input and every input is known before any runs (worked
    /// out on a copy of the ring; the conversation is not touched). Stops before the very first
    /// step of a conversation (it runs nothing).
    pub fn forced_inputs(&self, script: &[ForcedStep], max: usize) -> Vec<Vec<i64>> {
        let mut gen = self.gen.clone();
        let mut inputs = Vec::new();
        for s in script.iter().take(max) {
            let Ok(Some(io)) = gen.begin(&s.user, s.text, s.agent.as_deref()) else {
                break;
            };
            if io.provided.iter().any(|p| !p) {
                break;
            }
            if gen.commit(io.target[0], &io.target[1..]).is_err() {
                break;
            }
            inputs.push(io.input);
        }
        inputs
    }

    /// Starts a wholly forced step whose temporal frame has already run (in a
    /// [`prefill`](crate::model::temporal::TemporalStep::prefill) of [`forced_inputs`](Self::forced_inputs)): the
    /// ring moves as [`begin`](Self::begin) moves it, and the sampling half gets a step whose
    /// every token is provided (its draws are taken as for any step; no hidden state or
    /// logit is read for a provided token, so a zero hidden state stands in).
    ///
    /// # Errors
    ///
    /// Wrong code counts, or a step that is not wholly forced (the caller's script and the
    /// ring disagree).
    pub fn begin_forced(&mut self, s: &ForcedStep) -> Result<LmStep, ModelError> {
        let io = self
            .gen
            .begin(&s.user, s.text, s.agent.as_deref())
            .map_err(|e| ModelError::contract("temporal", e.to_string()))?
            .filter(|io| io.provided.iter().all(|p| *p))
            .ok_or_else(|| {
                ModelError::contract("temporal", "a prefilled step is not wholly forced")
            })?;
        Ok(LmStep {
            hidden: vec![0.0; self.temporal.info().hidden_dim],
            text_logits: Vec::new(),
            target: io.target,
            provided: io.provided,
            reseed: std::mem::take(&mut self.pending_reseed),
            new_conversation: std::mem::take(&mut self.pending_new),
            slot: self.temporal.slot(),
        })
    }

    /// Ends a step with the sampled tokens.
    ///
    /// # Errors
    ///
    /// When `s` has the wrong number of tokens.
    pub fn commit(&mut self, s: &Sampled) -> Result<Option<AgentFrame>, ModelError> {
        self.gen
            .commit(s.text, &s.audio)
            .map_err(|e| ModelError::contract("depformer", e.to_string()))
    }
}

/// The sampling settings of the LM: one struct for the depformer stage's params, its
/// `sampling` command, and the apps that set them (the semantics are moshi-core's
/// `lm_generate_multistream.rs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingConfig {
    /// Text stream.
    pub text: SamplingParams,
    /// Audio streams.
    pub audio: SamplingParams,
    /// The default of both seeds: the text sampler's is `seed`, the audio sampler's is derived
    /// from it ([`audio_seed`](Self::audio_seed)).
    pub seed: u64,
    /// The text sampler's seed; `None`: `seed`.
    pub text_seed: Option<u64>,
    /// The audio sampler's seed; `None`: derived from `seed`.
    pub audio_seed: Option<u64>,
    /// Kyutai's padding multiplier: the text padding token's probability is multiplied by
    /// `exp(pad_mult)` before the draw (positive: the agent speaks less; negative: more).
    /// 0 = off. See [`apply_pad_mult`].
    pub pad_mult: f32,
    /// Kyutai's repetition penalty of the text logits (1 = off). See [`TextHistory::penalize`].
    pub repetition_penalty: f32,
    /// How many of the conversation's last words (non-padding text tokens the agent produced)
    /// the penalty looks at.
    pub repetition_penalty_context: usize,
    /// The text tokens that are not words (the pack's).
    pub specials: TextSpecials,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            text: SamplingParams::TEXT,
            audio: SamplingParams::AUDIO,
            seed: 0,
            text_seed: None,
            audio_seed: None,
            pad_mult: 0.0,
            repetition_penalty: 1.0,
            repetition_penalty_context: 64,
            specials: TextSpecials::PERSONAPLEX,
        }
    }
}

impl SamplingConfig {
    /// XORed into `seed` for the audio sampler's default seed, so that the two samplers do not
    /// draw the same numbers when only `seed` is given ("audio_se" in ASCII).
    pub const AUDIO_SEED_MIX: u64 = 0x6175_6469_6f5f_7365;

    /// The text sampler's seed: `text_seed`, else `seed`.
    pub fn text_seed(&self) -> u64 {
        self.text_seed.unwrap_or(self.seed)
    }

    /// The audio sampler's seed: `audio_seed`, else `seed ^ AUDIO_SEED_MIX`.
    pub fn audio_seed(&self) -> u64 {
        self.audio_seed.unwrap_or(self.seed ^ Self::AUDIO_SEED_MIX)
    }

    /// Greedy everywhere (argmax): what the conformance tests compare.
    pub fn greedy(seed: u64) -> Self {
        SamplingConfig {
            text: SamplingParams::GREEDY,
            audio: SamplingParams::GREEDY,
            seed,
            ..Default::default()
        }
    }
}

/// The samplers and the depformer.
pub struct SamplingHalf {
    /// The depformer.
    pub depformer: DepformerModel,
    /// Sampling settings (may change between steps; a new seed applies at the next reseed,
    /// or at once with [`reseed_text`](Self::reseed_text) / [`reseed_audio`](Self::reseed_audio)).
    pub config: SamplingConfig,
    text_sampler: Sampler,
    audio_sampler: Sampler,
    /// The conversation's words, for the repetition penalty.
    history: TextHistory,
    /// The text logits after the controls (allocated once, when a control is on).
    text_scratch: Vec<f32>,
}

impl SamplingHalf {
    /// Joins a depformer and two samplers seeded from `config` (text: `text_seed()`, audio:
    /// `audio_seed()`).
    pub fn new(depformer: impl Into<DepformerModel>, config: SamplingConfig) -> Self {
        SamplingHalf {
            depformer: depformer.into(),
            text_sampler: Sampler::new(config.text_seed()),
            audio_sampler: Sampler::new(config.audio_seed()),
            config,
            history: TextHistory::new(),
            text_scratch: Vec::new(),
        }
    }

    /// Restarts both random streams from the configured seeds.
    pub fn reseed(&mut self) {
        self.reseed_text();
        self.reseed_audio();
    }

    /// Restarts the text sampler's random stream from `config.text_seed()`.
    pub fn reseed_text(&mut self) {
        self.text_sampler.reseed(self.config.text_seed());
    }

    /// Restarts the audio sampler's random stream from `config.audio_seed()`.
    pub fn reseed_audio(&mut self) {
        self.audio_sampler.reseed(self.config.audio_seed());
    }

    /// The words the repetition penalty looks at (oldest first).
    pub fn history(&self) -> &TextHistory {
        &self.history
    }

    /// Chooses the step's tokens: the text token, then the 16 depformer substeps.
    ///
    /// The text token: where text is forced (priming) the provided one, with the text
    /// sampler's draw taken all the same; else a draw from the text logits after the
    /// repetition penalty (greedy included, as moshi-core applies it before its sampler) and
    /// `pad_mult` (sampling only). A drawn word joins the history; a new conversation starts an
    /// empty one.
    ///
    /// # Errors
    ///
    /// Token ids out of range, ONNX Runtime errors.
    pub fn sample(&mut self, step: &LmStep) -> Result<Sampled, ModelError> {
        if step.new_conversation {
            self.history.clear();
        }
        if step.reseed {
            self.reseed();
        }
        let c = &self.config;
        let text = if step.provided.first() == Some(&true) {
            // One draw, as `sample` takes: the stream stays where it would be.
            self.text_sampler.skip(c.text);
            step.target[0]
        } else {
            let penalise = c.repetition_penalty != 1.0 && c.repetition_penalty_context > 0;
            let pad = c.pad_mult != 0.0 && c.text.temperature > 0.0;
            let logits: &[f32] = if penalise || pad {
                self.text_scratch.clear();
                self.text_scratch.extend_from_slice(&step.text_logits);
                self.history.penalize(
                    &mut self.text_scratch,
                    c.repetition_penalty_context,
                    c.repetition_penalty,
                );
                apply_pad_mult(&mut self.text_scratch, c.specials.pad, c.pad_mult, c.text);
                &self.text_scratch
            } else {
                &step.text_logits
            };
            let t = self.text_sampler.sample(logits, c.text) as i64;
            self.history.push(t, &c.specials);
            t
        };
        let mut audio = Vec::with_capacity(step.target.len().saturating_sub(1));
        let frame = DepformerInput {
            hidden: &step.hidden,
            text,
            target: step.target.get(1..).unwrap_or(&[]),
            provided: step.provided.get(1..).unwrap_or(&[]),
        };
        self.depformer.run(
            step.slot,
            frame,
            &mut self.audio_sampler,
            self.config.audio,
            &mut audio,
        )?;
        Ok(Sampled { text, audio })
    }
}

/// Both halves in one sequential loop.
pub struct LmLoop {
    /// Temporal half.
    pub temporal: TemporalHalf,
    /// Sampling half.
    pub sampling: SamplingHalf,
}

impl LmLoop {
    /// One step: user codes (and forced tokens) in, the agent frame completed by this step out.
    ///
    /// # Errors
    ///
    /// As the halves.
    pub fn step(
        &mut self,
        user: &[i64],
        text: Option<i64>,
        agent: Option<&[i64]>,
    ) -> Result<Option<AgentFrame>, ModelError> {
        match self.temporal.begin(user, text, agent)? {
            None => Ok(None),
            Some(s) => {
                let sampled = self.sampling.sample(&s)?;
                self.temporal.commit(&sampled)
            }
        }
    }

    /// Runs `frames` steps of silence through both graphs, then resets and reseeds.
    ///
    /// # Errors
    ///
    /// As [`step`](Self::step).
    pub fn warmup(&mut self, silence: &[i64], frames: usize) -> Result<(), ModelError> {
        for _ in 0..frames {
            self.step(silence, None, None)?;
        }
        self.temporal.reset(true);
        Ok(())
    }

    /// Runs a priming script (outputs discarded).
    ///
    /// # Errors
    ///
    /// As [`step`](Self::step).
    pub fn prime(&mut self, script: &[ForcedStep]) -> Result<(), ModelError> {
        for s in script {
            self.step(&s.user, s.text, s.agent.as_deref())?;
        }
        Ok(())
    }
}
