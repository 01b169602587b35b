//! `temporal`: the token ring and the temporal transformer. For every user frame it builds the
//! model input, runs the transformer, sends the hidden state and logits to the `depformer` stage
//! and waits for the step's tokens on its feedback input; it emits each completed agent frame.
//!
//! At start it warms the graphs up (silent steps, then a reset and a reseed) and primes the
//! persona and voice: a step each, or with `priming: chunked` the wholly forced steps' frames
//! as prefills, a chunk per graph call, or with `priming: cached` the state a priming with the
//! same pack, graph and frames left, restored from the process's cache (computed by chunks
//! and kept there the first time). Each priming's time is recorded by how its state was made
//! (`duplex_priming_seconds{how}`, and the `priming` and `priming_ms` status values). Before
//! the graph's position limit (or `max_positions`) it applies the long-session policy:
//! `reset_and_reprime` clears the conversation at a frame boundary and primes again; `stop`
//! ends the stream cleanly. `max_steps` (Kyutai's cap of a conversation) ends the stream
//! cleanly too, once that many agent frames have been emitted.
//!
//! With `engine: shared` the transformer is a KV slot of the process's shared engine
//! ([`crate::model::engine`]): the same steps, batched with the other conversations'. Where
//! the process starts its conversations together (the resources' start gate), each waits,
//! primed, for the others before its first frame.
//!
//! Commands, taken at frame boundaries: `persona` (text or token ids: a new conversation primed
//! with it), `reset` (a new conversation), `pause` and `resume` (frames are dropped while
//! paused). Each is answered once applied, or refused with the reason.

mod priming;

pub(crate) use priming::check_voice;
use priming::{persona_of, voice_codes};

use std::path::PathBuf;
use std::time::Instant;

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::model::lm::{priming_script, ForcedStep, TemporalHalf};
use crate::model::lmgen::LmGen;
use crate::model::pack::PackManifest;
use crate::model::temporal::{KvMode, Temporal, TemporalOptions};
use crate::model::tokenizer::{Tokenizer, Transcript};
use crate::observe::names;
use crate::runtime::{
    Body, Caps, CapsError, CommandSpec, Context, Endpoint, Input, PortSpec, Stage, StageError,
    StageResult, StatusSpec,
};

use super::model_params::{
    cuda_graph_needs_own_engine, model_params, open_pack, session_options, shared_engine,
    EngineParams, ModelParams, ENGINE_PARAM, MODEL_STATUS, SLOTS_PARAM,
};
use super::params::stage_params;
use super::{caps, AgentTokens, BuildContext, BuildError, Codes, LmStep, Sampled, StageKind};

const KV: ParamSpec = ParamSpec {
    name: "kv",
    ty: T::Choice(&["resident", "host"]),
    default: D::Str("resident"),
    doc: "KV cache where the session computes, or through host arrays (naive)",
};

const CUDA_GRAPH: ParamSpec = ParamSpec {
    name: "cuda_graph",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "replay a captured CUDA graph every step (execution_provider: cuda, a GQA pack, kv: resident, engine: own)",
};

const MAX_POSITIONS: ParamSpec = ParamSpec {
    name: "max_positions",
    ty: T::Int {
        min: 0,
        max: 1 << 30,
    },
    default: D::Int(0),
    doc: "positions per conversation before the long-session policy (0 = the pack's limit)",
};

const LONG_SESSION: ParamSpec = ParamSpec {
    name: "long_session",
    ty: T::Choice(&["reset_and_reprime", "stop"]),
    default: D::Str("reset_and_reprime"),
    doc: "what to do at the position limit",
};

const MAX_STEPS: ParamSpec = ParamSpec {
    name: "max_steps",
    ty: T::Int {
        min: 0,
        max: 1 << 30,
    },
    default: D::Int(0),
    doc: "end the stream after this many agent frames (0 = no cap; Kyutai's servers cap at 4500)",
};

const PERSONA: ParamSpec = ParamSpec {
    name: "persona",
    ty: T::Str,
    default: D::None,
    doc: "persona text (needs a tokenizer), forced while priming",
};

const PERSONA_TOKENS: ParamSpec = ParamSpec {
    name: "persona_tokens",
    ty: T::IntList,
    default: D::None,
    doc: "persona text as token ids, forced while priming",
};

const TOKENIZER: ParamSpec = ParamSpec {
    name: "tokenizer",
    ty: T::Path,
    default: D::None,
    doc: "SentencePiece model for `persona` and transcripts (default: the pack's)",
};

const VOICE: ParamSpec = ParamSpec {
    name: "voice",
    ty: T::Path,
    default: D::None,
    doc: "voice prompt WAV (any rate; whole frames are used)",
};

const MAX_PERSONA_TOKENS: ParamSpec = ParamSpec {
    name: "max_persona_tokens",
    ty: T::Int {
        min: 1,
        max: 100_000,
    },
    default: D::Int(1000),
    doc: "the longest persona, in tokens (each costs a priming step); a longer one is refused",
};

const MAX_VOICE_S: ParamSpec = ParamSpec {
    name: "max_voice_s",
    ty: T::Float {
        min: 0.08,
        max: 3600.0,
    },
    default: D::Float(60.0),
    doc: "the longest voice prompt, seconds (checked from the WAV header, before decoding)",
};

const LOG_TRANSCRIPT: ParamSpec = ParamSpec {
    name: "log_transcript",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "log the agent's transcript at INFO, a line per sentence, escaped (off: a transcript is private)",
};

const SILENCE_FRAMES: ParamSpec = ParamSpec {
    name: "silence_frames",
    ty: T::Int { min: 0, max: 1000 },
    default: D::Int(6),
    doc: "silence spacer frames while priming",
};

const PRIMING: ParamSpec = ParamSpec {
    name: "priming",
    ty: T::Choice(&["stepped", "chunked", "cached"]),
    default: D::Str("stepped"),
    doc: "how the priming frames run: one step each (the reference); the wholly forced ones in chunks of `priming_chunk`, one graph call each (in a shared engine, a chunk of the slot's row alone between ticks); or chunked once and then restored from the process's cache of primed states",
};

const PRIMING_CHUNK: ParamSpec = ParamSpec {
    name: "priming_chunk",
    ty: T::Int { min: 2, max: 512 },
    default: D::Int(32),
    doc: "frames per graph call with `priming: chunked` or `cached`",
};

const WARMUP_FRAMES: ParamSpec = ParamSpec {
    name: "warmup_frames",
    ty: T::Int { min: 0, max: 1000 },
    default: D::Int(2),
    doc: "silent steps run (then discarded) before priming",
};

stage_params! {
    /// `temporal`'s own params (with the engine's and every model stage's: [`EngineParams`], [`ModelParams`]).
    pub(super) struct TemporalParams {
        kv: String = KV,
        cuda_graph: bool = CUDA_GRAPH,
        max_positions: usize = MAX_POSITIONS,
        long_session: String = LONG_SESSION,
        max_steps: u64 = MAX_STEPS,
        persona: Option<String> = PERSONA,
        persona_tokens: Option<Vec<i64>> = PERSONA_TOKENS,
        tokenizer: Option<PathBuf> = TOKENIZER,
        voice: Option<PathBuf> = VOICE,
        max_persona_tokens: usize = MAX_PERSONA_TOKENS,
        max_voice_s: f64 = MAX_VOICE_S,
        log_transcript: bool = LOG_TRANSCRIPT,
        silence_frames: usize = SILENCE_FRAMES,
        priming: String = PRIMING,
        priming_chunk: usize = PRIMING_CHUNK,
        warmup_frames: usize = WARMUP_FRAMES,
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: super::kind::TEMPORAL,
    doc: "the LM's temporal transformer and token bookkeeping (cycle with `depformer`)",
    params: model_params![
        KV,
        ENGINE_PARAM,
        SLOTS_PARAM,
        CUDA_GRAPH,
        MAX_POSITIONS,
        LONG_SESSION,
        MAX_STEPS,
        PERSONA,
        PERSONA_TOKENS,
        TOKENIZER,
        VOICE,
        MAX_PERSONA_TOKENS,
        MAX_VOICE_S,
        LOG_TRANSCRIPT,
        SILENCE_FRAMES,
        PRIMING,
        PRIMING_CHUNK,
        WARMUP_FRAMES,
    ],
    inputs: || {
        vec![
            PortSpec::new::<Codes>("codes"),
            PortSpec::feedback::<Sampled>("tokens"),
        ]
    },
    outputs: || {
        vec![
            PortSpec::new::<LmStep>("step"),
            PortSpec::new::<AgentTokens>("agent"),
        ]
    },
    commands: &[
        CommandSpec {
            name: "persona",
            arg: Some("persona text, or comma-separated token ids"),
            doc: "a new conversation primed with this persona, at the next frame",
        },
        CommandSpec {
            name: "reset",
            arg: None,
            doc: "a new conversation, primed again, at the next frame",
        },
        CommandSpec {
            name: "pause",
            arg: None,
            doc: "drop user frames (the conversation waits)",
        },
        CommandSpec {
            name: "resume",
            arg: None,
            doc: "take user frames again",
        },
    ],
    status: &[
        MODEL_STATUS,
        StatusSpec {
            name: "agent_frames",
            doc: "agent frames emitted",
        },
        StatusSpec {
            name: "context",
            doc: "rows in the KV cache (the attention context)",
        },
        StatusSpec {
            name: "paused",
            doc: "user frames are dropped",
        },
    ],
    build,
};

/// Where and how the transformer runs, from the params.
fn temporal_options(t: &TemporalParams, m: &ModelParams) -> TemporalOptions {
    TemporalOptions {
        session: session_options(m),
        kv: if t.kv == "host" {
            KvMode::Host
        } else {
            KvMode::Resident
        },
        max_positions: match t.max_positions {
            0 => usize::MAX,
            n => n,
        },
        cuda_graph: t.cuda_graph,
        fixed_shapes: false,
    }
}

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let t = TemporalParams::from_params(p)?;
    let mp = ModelParams::from_params(p)?;
    let e = EngineParams::from_params(p)?;
    let pack = open_pack(cx, &mp)?;
    let m = pack.manifest.clone();
    let voice = match &t.voice {
        Some(v) => Some(voice_codes(cx, v, &pack, &t, &mp)?),
        None => None,
    };
    let tokenizer = match t.tokenizer.clone().or_else(|| pack.tokenizer()) {
        Some(path) => Some(cx.tokenizer(&path)?),
        None => None,
    };
    let persona = persona_of(&t, &m, tokenizer.as_deref())?;
    let script = priming_script(
        &m,
        voice.as_ref().map(|v| v.as_slice()),
        &persona,
        t.silence_frames,
    );
    let opts = temporal_options(&t, &mp);
    if let Some((key, why)) = opts.fixed_shapes_conflict() {
        return Err(BuildError::invalid(why).key(key));
    }
    cuda_graph_needs_own_engine(&e, opts.cuda_graph)?;
    let temporal: Temporal = match shared_engine(cx, &pack, (&mp, &e), opts.max_positions)? {
        Some(lm) => {
            if opts.kv == KvMode::Host {
                return Err(BuildError::invalid(
                    "`kv: host` needs a session of its own: the shared engine keeps every cache resident",
                )
                .key("kv"));
            }
            // A full engine is a capacity error (retryable), not a mistake.
            lm.temporal_slot(opts.max_positions)
                .map_err(|e| BuildError::from(e).key("slots"))?
                .into()
        }
        None => crate::model::temporal::open(&pack, &opts)?,
    };
    let cap = temporal.positions_left();
    if cap <= script.len() + 1 {
        return Err(BuildError::invalid(format!(
            "max_positions ({cap}) must exceed the priming length ({} steps) + 1",
            script.len()
        ))
        .key("max_positions"));
    }
    // What a primed state depends on besides the frames fed (the cache's keys).
    let graph_id = format!("{} kv={:?}", temporal.graph_key(), opts.kv);
    let control = cx.endpoint();
    control.set("model", temporal.runs_on());
    control.set("paused", false);
    Ok(Body::Stage(Box::new(TemporalStage {
        control,
        paused: false,
        half: TemporalHalf::new(LmGen::new(m.layout()), temporal),
        script,
        warmup: t.warmup_frames,
        stop_at_limit: t.long_session == "stop",
        max_steps: t.max_steps,
        index: 0,
        manifest: m,
        tokenizer,
        voice,
        silence_frames: t.silence_frames,
        priming_chunk: (t.priming != "stepped").then_some(t.priming_chunk),
        primed: (t.priming == "cached")
            .then(|| (cx.resources.primed(), pack.dir.clone(), graph_id.clone())),
        prefilled: 0,
        restored: 0,
        transcript: Transcript::new(),
        line: String::new(),
        resets: metrics::counter!(names::LM_RESETS, "stage" => "temporal"),
        context: metrics::gauge!(names::LM_CONTEXT, "stage" => "temporal"),
        rec: cx.recording.map(|r| r.stream("lm")),
        log_transcript: t.log_transcript,
        steps: 0,
        conversation: cx.conversation(),
        start_gate: cx.resources.start_gate(),
    })))
}

struct TemporalStage {
    control: Endpoint,
    paused: bool,
    half: TemporalHalf,
    script: Vec<ForcedStep>,
    warmup: usize,
    stop_at_limit: bool,
    /// End the stream after this many agent frames (0 = never).
    max_steps: u64,
    /// Agent frames emitted.
    index: u64,
    manifest: PackManifest,
    tokenizer: Option<std::sync::Arc<Tokenizer>>,
    /// Whether the transcript is logged (escaped), a line per sentence.
    log_transcript: bool,
    voice: Option<std::sync::Arc<Vec<Vec<i64>>>>,
    silence_frames: usize,
    /// Frames per prefill call while priming (`priming: chunked`); `None`: one step each.
    priming_chunk: Option<usize>,
    /// Priming frames the last priming ran as prefills.
    prefilled: usize,
    /// `priming: cached`: the process's primed states, and what names this stage's graph in
    /// their recipes (the pack's folder; what the graph runs on).
    primed: Option<(
        std::sync::Arc<crate::resources::PrimeCache>,
        PathBuf,
        String,
    )>,
    /// Priming frames the last priming restored from the cache.
    restored: usize,
    transcript: Transcript,
    /// Transcript text not logged yet.
    line: String,
    resets: metrics::Counter,
    context: metrics::Gauge,
    /// The recording's `lm` stream: every step's inputs as the model saw them.
    rec: Option<crate::observe::record::RecordStream>,
    /// Conversation steps since the last priming (for the recording).
    steps: u64,
    /// The pipeline's conversation count: bumped at every new conversation, so that the codec
    /// stages start new streams.
    conversation: super::Conversation,
    /// Where conversations built to run as one batch wait, primed, for each other.
    start_gate: Option<std::sync::Arc<crate::resources::StartGate>>,
}

impl TemporalStage {
    /// One step through the cycle: temporal here, sampling in the `depformer` stage.
    fn round_trip(
        &mut self,
        cx: &mut Context<'_>,
        origin: Instant,
        user: &[i64],
        text: Option<i64>,
        agent: Option<&[i64]>,
    ) -> StageResult<Option<crate::model::lmgen::AgentFrame>> {
        let context = self.half.temporal.kv_len();
        let t0 = Instant::now();
        let Some(step) = self.half.begin(user, text, agent)? else {
            return Ok(None);
        };
        // Step time by KV length: a cost that grows with the conversation shows up here.
        let bucket = context / 375 * 375;
        metrics::histogram!(
            names::STAGE_SERVICE_BY_CONTEXT,
            "stage" => "temporal",
            "context" => format!("{}-{}", bucket, bucket + 374)
        )
        .record(t0.elapsed().as_secs_f64());
        cx.emit(0, origin, step)?;
        let Some(tokens) = cx.recv_feedback::<Sampled>(1)? else {
            return Err(StageError::msg("the depformer stage ended its stream"));
        };
        Ok(self.half.commit(&tokens.data)?)
    }

    /// The commands that came, applied at this frame boundary and answered.
    fn take_commands(&mut self, cx: &mut Context<'_>) -> StageResult {
        while let Some(c) = self.control.next_command() {
            let r = match c.name {
                "persona" => match self.new_persona(&c.arg) {
                    Ok(()) => {
                        tracing::info!("persona changed: new conversation, primed again");
                        self.new_conversation(cx)?;
                        Ok("persona changed: new conversation, primed again".to_string())
                    }
                    Err(e) => {
                        tracing::error!("persona not changed: {e}");
                        Err(format!("persona not changed: {e}"))
                    }
                },
                "reset" => {
                    tracing::info!("conversation reset on request");
                    self.new_conversation(cx)?;
                    Ok("new conversation, primed again".to_string())
                }
                "pause" | "resume" => {
                    self.paused = c.name == "pause";
                    self.control.set("paused", self.paused);
                    Ok(if self.paused { "paused" } else { "resumed" }.to_string())
                }
                // The control plane passes only the commands the kind declares; one it did not
                // is refused, never taken for another.
                other => Err(format!(
                    "unknown command `{other}`: persona, reset, pause or resume"
                )),
            };
            c.reply(r);
        }
        Ok(())
    }

    /// Logs the transcript's pending line (escaped: a model's text is not the log's markup).
    fn log_line(&mut self) {
        let line = self.line.trim();
        if !line.is_empty() {
            tracing::info!(transcript = ?line, "agent");
        }
        self.line.clear();
    }
}

impl Stage for TemporalStage {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        let m = &self.manifest;
        caps::require_codes(&inputs[0], m.codebooks, m.audio_vocab)?;
        let agent = Caps::new()
            .with(caps::CODEBOOKS, m.codebooks as i64)
            .with(caps::VOCAB, m.audio_vocab);
        Ok(vec![Caps::new(), agent])
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        self.log_line();
        Ok(())
    }

    fn start(&mut self, cx: &mut Context<'_>) -> StageResult {
        let primed = self.warm_up_and_prime(cx);
        if let Some(g) = self.start_gate.take() {
            // A failed priming arrives too: no other conversation waits for it.
            g.arrive();
            if primed.is_ok() {
                g.wait(|| cx.should_stop());
            }
        }
        primed
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Codes>()?;
        self.take_commands(cx)?;
        if self.paused {
            return Ok(());
        }
        if self.half.temporal.positions_left() == 0 {
            if self.stop_at_limit {
                tracing::warn!(
                    positions = self.half.temporal.position(),
                    "long session: position limit reached, ending the stream (long_session: stop)"
                );
                self.resets.increment(1);
                return Err(StageError::Stopped);
            }
            tracing::warn!(
                positions = self.half.temporal.position(),
                "long session: position limit reached, resetting the conversation and priming again"
            );
            self.resets.increment(1);
            self.new_conversation(cx)?;
            tracing::info!(
                steps = self.script.len(),
                prefilled = self.prefilled,
                restored = self.restored,
                "primed again"
            );
        }
        let out = self.round_trip(cx, f.meta.origin, &f.data.0, None, None)?;
        if let Some(r) = &self.rec {
            let agent = out
                .as_ref()
                .map(|a| serde_json::json!({ "text": a.text, "audio": a.audio }));
            r.write(&serde_json::json!({
                "step": self.steps,
                "user": f.data.0,
                "agent": agent,
                "kv": self.half.temporal.kv_len(),
            }));
        }
        self.steps += 1;
        self.context.set(self.half.temporal.kv_len() as f64);
        self.control.set("context", self.half.temporal.kv_len());
        if let Some(a) = out {
            let piece = self
                .tokenizer
                .as_ref()
                .and_then(|t| self.transcript.push(t, a.text));
            if let Some(p) = &piece {
                if self.log_transcript {
                    self.line.push_str(p);
                    if self.line.len() >= 80 || p.ends_with(['.', '!', '?']) {
                        self.log_line();
                    }
                }
            }
            let tokens = AgentTokens {
                index: self.index,
                text: a.text,
                audio: a.audio,
                piece,
            };
            self.index += 1;
            self.control.set("agent_frames", self.index);
            cx.emit(1, f.meta.origin, tokens)?;
            if self.max_steps > 0 && self.index >= self.max_steps {
                tracing::info!(
                    agent_frames = self.index,
                    "max_steps reached: ending the stream (max_steps: {})",
                    self.max_steps
                );
                // Ending here skips `finish`: the transcript's last line is logged now.
                self.log_line();
                return Err(StageError::Stopped);
            }
        }
        Ok(())
    }
}
