//! The depformer: 16 autoregressive substeps per frame predicting the audio codebooks, with
//! teacher forcing of the provided channels and sampling by a seeded [`Sampler`].
//!
//! Its KV cache starts empty every frame and holds at most 16 rows; two buffers per layer are
//! allocated once and used ping-pong through views, so a frame allocates no cache memory.

use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;

use super::error::ModelError;
use super::pack::{check_depformer, Graph, LmGraphInfo, Pack};
use super::sampling::{Sampler, SamplingParams};
use super::session::{open, report, Provider, SessionOptions};
use super::tensors::{
    allocator_at, element, input_placements, kv_placements, placement_of, read_floats,
    write_floats, Buffer, PingPong, Placement,
};

/// What the depformer works from for one frame.
#[derive(Debug, Clone, Copy)]
pub struct DepformerInput<'a> {
    /// The temporal transformer's hidden state.
    pub hidden: &'a [f32],
    /// The frame's text token.
    pub text: i64,
    /// Provided tokens of the audio channels.
    pub target: &'a [i64],
    /// Which are provided.
    pub provided: &'a [bool],
}

impl DepformerInput<'_> {
    /// Checks the frame's sizes: a hidden state of `hidden_dim` values and `steps` targets.
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] saying what it got.
    pub(crate) fn check(&self, hidden_dim: usize, steps: usize) -> Result<(), ModelError> {
        if self.hidden.len() != hidden_dim
            || self.target.len() < steps
            || self.provided.len() < steps
        {
            return Err(ModelError::contract(
                "depformer",
                format!(
                    "hidden of {} values and {} targets, expected {hidden_dim} and {steps}",
                    self.hidden.len(),
                    self.target.len(),
                ),
            ));
        }
        Ok(())
    }
}

/// What to do with the substeps whose tokens are all provided (the user stream's, always; the
/// agent's too while priming forces them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnusedSubsteps {
    /// Run every substep (the reference's way).
    Run,
    /// Skip the graph runs of the trailing substeps whose tokens are provided: nothing reads
    /// what they predict (the provided token is kept, and no later substep attends to them), and
    /// the sampler takes the same draws, so the token streams are the same as `Run`'s.
    Skip,
}

impl UnusedSubsteps {
    /// The names a config gives.
    pub const NAMES: [&'static str; 2] = ["skip", "run"];

    /// From a config name (`skip`, `run`).
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "skip" => Some(UnusedSubsteps::Skip),
            "run" => Some(UnusedSubsteps::Run),
            _ => None,
        }
    }
}

/// The depformer of a pack.
pub struct Depformer {
    binding: IoBinding,
    session: Session,
    /// What the graph says about itself.
    pub info: LmGraphInfo,
    /// The execution provider in use.
    pub provider: Provider,
    kv: PingPong,
    hidden: Buffer,
    prev: Buffer,
    substep: Buffer,
    logits_out: Buffer,
    scratch: Vec<f32>,
    alloc: Allocator,
    /// The KV buffers' allocator: the memory the session reads them from.
    kv_alloc: Allocator,
    wanted: Vec<(String, Placement)>,
    steps: usize,
    text_limit: i64,
    audio_limit: i64,
    /// What is done with the substeps nothing reads.
    pub unused: UnusedSubsteps,
    /// Substeps run and skipped so far.
    pub counts: (u64, u64),
    /// Keep every substep's logits of the last frame in [`logits`](Self::logits) (diagnostics:
    /// comparing runs; off by default).
    pub keep_logits: bool,
    /// The last frame's logits per substep run, when `keep_logits` is set.
    pub logits: Vec<Vec<f32>>,
}

impl Depformer {
    /// What the graph runs on: `cpu f32`, `cuda f16`.
    pub fn runs_on(&self) -> String {
        format!("{} {}", self.provider.name(), self.info.kv.name())
    }

    /// Opens the pack's depformer and checks it.
    ///
    /// # Errors
    ///
    /// Contract errors naming the input, provider errors, ONNX Runtime errors.
    pub fn open(pack: &Pack, opts: &SessionOptions) -> Result<Depformer, ModelError> {
        let graph = "depformer";
        let m = &pack.manifest;
        let os = open(&pack.graph_path(Graph::Depformer), graph, opts)?;
        let info = check_depformer(&os.session, graph)?;
        let e = |err: ort::Error| ModelError::ort(graph, err);
        let alloc = Allocator::default();
        let wanted = input_placements(&os.session).map_err(e)?;
        let kv_alloc = allocator_at(&os.session, &placement_of(&wanted, "past_key_values.0.key"))
            .map_err(e)?;
        let steps = 2 * m.codebooks;
        let (h, d) = (info.heads as i64, info.head_dim as i64);
        let kv = element(info.kv);
        let mut bufs: [Vec<Buffer>; 2] = [Vec::new(), Vec::new()];
        for set in bufs.iter_mut() {
            for _ in 0..2 * info.layers {
                set.push(Buffer::zeros(&kv_alloc, kv, &[1, h, steps as i64, d]).map_err(e)?);
            }
        }
        let mut dep = Depformer {
            binding: os.session.create_binding().map_err(e)?,
            hidden: Buffer::zeros(
                &alloc,
                element(info.hidden),
                &[1, 1, info.hidden_dim as i64],
            )
            .map_err(e)?,
            prev: Buffer::zeros(&alloc, TensorElementType::Int64, &[1, 1]).map_err(e)?,
            substep: Buffer::zeros(&alloc, TensorElementType::Int64, &[]).map_err(e)?,
            logits_out: Buffer::zeros(&alloc, element(info.logits), &[1, 1, info.vocab as i64])
                .map_err(e)?,
            scratch: Vec::with_capacity(info.vocab),
            session: os.session,
            provider: os.provider,
            kv: PingPong { sets: bufs },
            alloc,
            kv_alloc,
            wanted,
            steps,
            text_limit: m.text_vocab + 1,
            audio_limit: m.audio_vocab + 1,
            unused: UnusedSubsteps::Run,
            counts: (0, 0),
            keep_logits: false,
            logits: Vec::new(),
            info,
        };
        let hd = dep.info.hidden_dim as i64;
        let v = dep.hidden.view(&dep.alloc, &[1, 1, hd]).map_err(e)?;
        dep.binding.bind_input("hidden", &v).map_err(e)?;
        let v = dep.prev.view(&dep.alloc, &[1, 1]).map_err(e)?;
        dep.binding.bind_input("prev_token", &v).map_err(e)?;
        let v = dep.substep.view(&dep.alloc, &[]).map_err(e)?;
        dep.binding.bind_input("substep_index", &v).map_err(e)?;
        let vocab = dep.info.vocab as i64;
        let v = dep.logits_out.view(&dep.alloc, &[1, 1, vocab]).map_err(e)?;
        dep.binding.bind_output("logits", v).map_err(e)?;
        report("depformer", dep.provider, dep.info.kv.name());
        Ok(dep)
    }

    /// Every KV buffer: its input name, where it is, and where the session wants that input.
    pub fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        kv_placements(
            self.kv.sets.iter().flatten(),
            self.info.layers,
            &self.wanted,
        )
    }

    /// Substeps per frame (16).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Generates the audio tokens of one frame into `out`.
    ///
    /// `frame.text` is the frame's text token (fed at substep 0); `frame.target` /
    /// `frame.provided` hold the audio channels' provided tokens (teacher forcing: a provided
    /// token, not the sampled one, is fed to the next substep). Writes the sampled token of every
    /// substep, one random draw each, in order; with [`UnusedSubsteps::Skip`], the trailing
    /// substeps whose tokens are all provided are not run: their draw is taken without logits and
    /// their provided token written in place of a sample nothing would read.
    ///
    /// # Errors
    ///
    /// [`ModelError::Token`] for an id outside its table, ONNX Runtime errors.
    pub fn run(
        &mut self,
        frame: DepformerInput<'_>,
        sampler: &mut Sampler,
        params: SamplingParams,
        out: &mut Vec<i64>,
    ) -> Result<(), ModelError> {
        let DepformerInput {
            hidden,
            text,
            target,
            provided,
        } = frame;
        let e = |err: ort::Error| ModelError::ort("depformer", err);
        frame.check(self.info.hidden_dim, self.steps)?;
        write_floats(&mut self.hidden, hidden);
        let (h, d) = (self.info.heads as i64, self.info.head_dim as i64);
        out.clear();
        self.logits.clear();
        let mut prev = text;
        // Substeps from `needed` on predict only provided tokens, and no substep before them
        // attends to their cache rows.
        let needed = match self.unused {
            UnusedSubsteps::Run => self.steps,
            UnusedSubsteps::Skip => (0..self.steps)
                .rev()
                .find(|&cb| !provided[cb])
                .map_or(0, |cb| cb + 1),
        };
        for cb in 0..self.steps {
            let (limit, channel) = if cb == 0 {
                (self.text_limit, "prev_token (text, substep 0)".to_string())
            } else {
                (
                    self.audio_limit,
                    format!("prev_token (audio channel {cb}, substep {cb})"),
                )
            };
            if !(0..limit).contains(&prev) {
                return Err(ModelError::Token {
                    graph: "depformer".into(),
                    channel,
                    value: prev,
                    limit,
                });
            }
            if cb >= needed {
                sampler.skip(params);
                out.push(target[cb]);
                prev = target[cb];
                self.counts.1 += 1;
                continue;
            }
            self.counts.0 += 1;
            self.prev.as_slice::<i64>()[0] = prev;
            self.substep.as_slice::<i64>()[0] = cb as i64;
            self.kv
                .bind(&mut self.binding, &self.kv_alloc, cb % 2, h, cb as i64, d)
                .map_err(e)?;
            drop(self.session.run_binding(&self.binding).map_err(e)?);
            read_floats(&mut self.logits_out, self.info.vocab, &mut self.scratch);
            if self.keep_logits {
                self.logits.push(self.scratch.clone());
            }
            let tok = sampler.sample(&self.scratch, params) as i64;
            out.push(tok);
            prev = if provided[cb] { target[cb] } else { tok };
        }
        Ok(())
    }
}
