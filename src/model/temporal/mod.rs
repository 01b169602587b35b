//! The temporal transformer of one conversation, one step at a time (or, for frames known in
//! advance, a chunk of frames per call: [`TemporalStep::prefill`]), with its KV cache kept
//! where the session computes.
//!
//! The GQA step exists once: [`TemporalBatch`](batch) steps the rows of many conversations in
//! one call (the shared engine's temporal worker), and a conversation of its own on the GQA
//! graph is that batch at one row ([`OneRow`]). Prefill, snapshot and restore live there.
//! [`TemporalStep`] is what a conversation's transformer does, whoever runs it: [`OneRow`],
//! [`OwnTemporal`] or a shared engine's slot ([`TemporalSlot`](crate::model::engine::TemporalSlot)).
//!
//! How the cache is held ([`KvMode`], and the graph's variant):
//!
//! - **Resident, GQA graph** (in place, the batch's): one buffer per layer's K and V, at full
//!   capacity, bound as *both* `past_key_values.*` and `present.*`. The `GroupQueryAttention`
//!   op sees the shared buffer and appends the new row in place; `attention_mask` (per row, the
//!   valid length + 1) tells it how much is valid. Nothing is allocated or copied per step.
//!
//! What only a transformer of its own can express ([`OwnTemporal`]):
//!
//! - **Resident, standard graph** (ping-pong): two buffers per K and V; each step reads a view of
//!   the current length from one and writes a view one row longer into the other. Absolute
//!   `position_ids` are passed, and once the cache holds `context - 1` rows the oldest row is
//!   dropped (an exact 3000-frame attention window), so memory and cost stop growing.
//! - **Fixed shapes** (`fixed_shapes`, `cuda_graph`): the GQA cache bound once at full width,
//!   the mask right-padded, the frame and the outputs in device buffers: what CUDA graph replay
//!   needs.
//! - **Host**: the cache goes through host arrays every step (outputs copied out, then fed back
//!   in as new inputs), as a naive driver does. Kept to measure and to demonstrate what the
//!   resident modes avoid.
//!
//! The RoPE tables of these exports cover `max_positions` (8000) positions; the caller must apply
//! its long-session policy before [`TemporalStep::positions_left`] reaches zero.
//!
//! This module knows the graph contract and ONNX Runtime; it knows nothing of stages, sessions
//! of the server or the engine's scheduling.

mod batch;
mod buffers;
mod own;
mod state;

use std::sync::Arc;

use ort::memory::Allocator;
use ort::value::TensorElementType;

use super::error::ModelError;
use super::pack::{check_temporal, FloatType, Graph, LmGraphInfo, Pack, Variant};
use super::session::{open as open_session, Provider, SessionOptions};
use super::tensors::{element, Buffer, Placement};

pub use self::batch::OneRow;
pub(crate) use self::batch::{BatchRow, TemporalBatch};
pub use self::own::OwnTemporal;
pub use self::state::TemporalState;
pub(crate) use self::state::{state_shape, RowSpan};

/// What a conversation's temporal transformer does, whoever runs it: the GQA batch at one row
/// ([`OneRow`]), a transformer of its own for what only it can express ([`OwnTemporal`]), or a
/// shared engine's slot.
pub trait TemporalStep: Send {
    /// What the graph says about itself.
    fn info(&self) -> &LmGraphInfo;

    /// The execution provider in use.
    fn provider(&self) -> Provider;

    /// What the graph runs on: `cpu f32`, `cuda f16`.
    fn runs_on(&self) -> String {
        self.graph_key()
    }

    /// What names the graph a state is computed on, whoever runs it: the provider and the
    /// cache's float type.
    fn graph_key(&self) -> String {
        format!("{} {}", self.provider().name(), self.info().kv.name())
    }

    /// The conversation's row in a shared engine's batch, when it has one.
    fn slot(&self) -> Option<usize> {
        None
    }

    /// Forgets the conversation (the cache is kept allocated).
    fn reset(&mut self);

    /// Rows in the KV cache (the attention context of the next step).
    fn kv_len(&self) -> usize;

    /// Positions used since the last reset.
    fn position(&self) -> usize;

    /// Most positions the conversation can take.
    fn capacity(&self) -> usize;

    /// Steps left before the positions this conversation can take run out.
    fn positions_left(&self) -> usize {
        self.capacity().saturating_sub(self.position())
    }

    /// Runs one step on `input` (one token per channel). Read the results with
    /// [`read_hidden`](Self::read_hidden) and [`read_logits`](Self::read_logits).
    ///
    /// # Errors
    ///
    /// Token errors (a bad frame never reaches the graph), [`ModelError::Contract`] when no
    /// position is left, ONNX Runtime errors.
    fn step(&mut self, input: &[i64]) -> Result<(), ModelError>;

    /// Runs `frames` (each one token per channel, all known before the first runs: nothing is
    /// sampled between them, as while priming) in chunks of at most `chunk` frames, one graph
    /// call per chunk, and leaves the conversation where as many [`step`](Self::step)s would
    /// (equal within the float rounding of a different reduction order);
    /// [`read_hidden`](Self::read_hidden) and [`read_logits`](Self::read_logits) then give the
    /// last frame's. Where a chunk cannot be exact it steps.
    ///
    /// # Errors
    ///
    /// Token errors (every frame is checked before any runs), no position left for all of
    /// them, ONNX Runtime errors.
    fn prefill(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError>;

    /// The conversation's state, copied out; `None` where it cannot be (a cache in device
    /// memory, the host-fed and the fixed-shape caches).
    fn snapshot(&mut self) -> Option<TemporalState>;

    /// Puts the conversation where `state` was taken, on a transformer of the same graph
    /// (taken by a transformer of its own or a shared engine's slot).
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] when the state is of another graph, needs more rows than this
    /// cache holds, or this cache cannot take it.
    fn restore(&mut self, state: &Arc<TemporalState>) -> Result<(), ModelError>;

    /// The last step's hidden state, as f32.
    fn read_hidden(&mut self, out: &mut Vec<f32>);

    /// The last step's text logits, as f32.
    fn read_logits(&mut self, out: &mut Vec<f32>);

    /// Every bound KV buffer: its input name, where it is, and where the session wants that
    /// input (the two must agree, or ONNX Runtime copies the cache every step).
    fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        Vec::new()
    }

    /// The fixed-shape binding's buffers: each input or output name, where its buffer is, and
    /// where the session wants it; empty where the binding is not fixed.
    fn io_placements(&self) -> Vec<(String, Placement, Placement)> {
        Vec::new()
    }

    /// First element of row `row` of layer `layer`'s key cache, head 0 (in-place caches in host
    /// memory only): lets tests see that the graph wrote into the bound buffer itself.
    fn key_cache_value(&mut self, _layer: usize, _row: usize) -> Option<f32> {
        None
    }
}

/// A conversation's temporal transformer.
pub type Temporal = Box<dyn TemporalStep>;

/// Opens the pack's temporal graph, checks it, and makes the conversation's transformer: the
/// GQA batch at one row where the cache is resident and the binding free, else a transformer
/// of its own ([`OwnTemporal`]).
///
/// # Errors
///
/// Contract errors naming the input, provider errors, ONNX Runtime errors.
pub fn open(pack: &Pack, opts: &TemporalOptions) -> Result<Temporal, ModelError> {
    let graph = "temporal";
    let channels = pack.manifest.delays.len();
    let fixed = opts.fixed_shapes || opts.cuda_graph;
    if let Some((_, why)) = opts.fixed_shapes_conflict() {
        return Err(ModelError::contract(graph, why));
    }
    if opts.session.provider == Provider::Cpu {
        pack.check_cpu_room(None)?;
    }
    let session_opts = SessionOptions {
        cuda_graph: opts.cuda_graph,
        ..opts.session
    };
    let os = open_session(&pack.graph_path(Graph::Temporal), graph, &session_opts)?;
    let info = check_temporal(&os.session, graph, channels)?;
    if fixed && info.variant == Variant::Standard {
        return Err(ModelError::contract(
            graph,
            "`cuda_graph: true` needs the GroupQueryAttention export (tools/make_pack.py --variant gqa / gqa-fp16, tools/export_pack.py): the standard graph's cache moves between two buffers and its shapes change every step",
        ));
    }
    let capacity = opts.max_positions.min(pack.manifest.max_positions).max(1);
    if opts.kv == KvMode::Resident && info.variant == Variant::Gqa && !fixed {
        let batch = TemporalBatch::new(os, info, graph, 1, capacity, channels)?;
        return Ok(Box::new(OneRow::new(batch, pack, opts)));
    }
    Ok(Box::new(OwnTemporal::new(os, info, pack, opts)?))
}

impl From<OneRow> for Temporal {
    fn from(t: OneRow) -> Self {
        Box::new(t)
    }
}

impl From<OwnTemporal> for Temporal {
    fn from(t: OwnTemporal) -> Self {
        Box::new(t)
    }
}

/// How the KV cache is held between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvMode {
    /// Bound where the session computes (in place for GQA, ping-pong for the standard graph).
    #[default]
    Resident,
    /// Copied through host arrays every step (naive; for measurement).
    Host,
}

/// Options of the temporal transformer.
#[derive(Debug, Clone, Copy)]
pub struct TemporalOptions {
    /// Session options.
    pub session: SessionOptions,
    /// KV cache handling.
    pub kv: KvMode,
    /// Most positions one conversation may use (clamped to the pack's `max_positions`).
    pub max_positions: usize,
    /// Replay a captured CUDA graph every step (ONNX Runtime's CUDA provider): needs
    /// `fixed_shapes`' binding, which it implies, the GQA graph and the resident cache.
    pub cuda_graph: bool,
    /// Bind every input and output once, at a fixed shape and a fixed address in the memory
    /// the session reads or writes it: the attention mask at full width, right-padded (the
    /// rows past the conversation are masked), the frame and the outputs in device buffers
    /// the host copies to and from. What CUDA graph replay needs; exact on any provider.
    pub fixed_shapes: bool,
}

impl Default for TemporalOptions {
    fn default() -> Self {
        TemporalOptions {
            session: SessionOptions::default(),
            kv: KvMode::Resident,
            max_positions: usize::MAX,
            cuda_graph: false,
            fixed_shapes: false,
        }
    }
}

impl TemporalOptions {
    /// Why these options cannot be bound at fixed shapes as `cuda_graph` asks: the option in
    /// the way (`execution_provider`, `kv`) and what `cuda_graph` needs; `None` when they can.
    /// The graph's own requirement (the GQA export) is checked when it is opened.
    pub fn fixed_shapes_conflict(&self) -> Option<(&'static str, &'static str)> {
        let session = SessionOptions {
            cuda_graph: self.cuda_graph,
            ..self.session
        };
        if let Some(conflict) = session.cuda_graph_conflict() {
            return Some(conflict);
        }
        if (self.cuda_graph || self.fixed_shapes) && self.kv == KvMode::Host {
            return Some((
                "kv",
                "`cuda_graph: true` needs `kv: resident`: a host-fed cache changes shape and address every step",
            ));
        }
        None
    }
}

/// The inputs and outputs of a prefill chunk of up to `frames` frames.
pub(crate) struct ChunkIo {
    pub frames: usize,
    pub frame: Buffer,
    pub pos_ids: Buffer,
    pub hidden: Buffer,
    pub logits: Buffer,
}

impl ChunkIo {
    /// Buffers for chunks of up to `frames` frames of a graph of `channels` input channels.
    pub fn new(
        alloc: &Allocator,
        info: &LmGraphInfo,
        channels: usize,
        frames: usize,
    ) -> ort::Result<ChunkIo> {
        let (s, c) = (frames as i64, channels as i64);
        let (hd, v) = (info.hidden_dim as i64, info.vocab as i64);
        Ok(ChunkIo {
            frames,
            frame: Buffer::zeros(alloc, TensorElementType::Int64, &[1, c, s])?,
            pos_ids: Buffer::zeros(alloc, TensorElementType::Int64, &[1, s])?,
            hidden: Buffer::zeros(alloc, element(info.hidden), &[1, s, hd])?,
            logits: Buffer::zeros(alloc, element(info.logits), &[1, s, v])?,
        })
    }

    /// Writes `frames` as the graph takes a sequence: `[1, channels, n]`, channel-major.
    pub fn fill(&mut self, frames: &[Vec<i64>]) {
        let n = frames.len();
        let f = self.frame.as_slice::<i64>();
        for (t, frame) in frames.iter().enumerate() {
            for (ch, &tok) in frame.iter().enumerate() {
                f[ch * n + t] = tok;
            }
        }
    }
}

fn ort_err(graph: &str) -> impl Fn(ort::Error) -> ModelError + '_ {
    move |e| ModelError::ort(graph, e)
}

/// Bytes per element of a cache.
pub(crate) fn element_bytes(t: FloatType) -> usize {
    match t {
        FloatType::F32 => 4,
        FloatType::F16 => 2,
    }
}

/// The error of a step asked for when a conversation has used all its `pos` positions.
pub(crate) fn no_position_left(pos: usize) -> ModelError {
    ModelError::contract(
        "temporal",
        format!(
            "no position left: the conversation reached {pos} positions (apply a long-session policy before)"
        ),
    )
}

/// What a temporal input frame must be: `channels` tokens, the text one below `text`, the audio
/// ones below `audio` (the pack's embedding tables). Every way of running the transformer
/// checks its frames here, before any reaches a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FrameLimits {
    pub channels: usize,
    pub text: i64,
    pub audio: i64,
}

impl FrameLimits {
    /// The limits of `pack`'s graphs.
    pub fn of(pack: &Pack) -> Self {
        let m = &pack.manifest;
        FrameLimits {
            channels: m.delays.len(),
            text: m.text_vocab + 1,
            audio: m.audio_vocab + 1,
        }
    }

    /// Checks one frame.
    ///
    /// # Errors
    ///
    /// [`ModelError::Token`] naming the channel, [`ModelError::Contract`] for a wrong length.
    pub fn check(&self, input: &[i64]) -> Result<(), ModelError> {
        let channels = self.channels;
        if input.len() != channels {
            return Err(ModelError::contract(
                "temporal",
                format!(
                    "input frame has {} channels, expected {channels}",
                    input.len()
                ),
            ));
        }
        for (k, &v) in input.iter().enumerate() {
            let limit = if k == 0 { self.text } else { self.audio };
            if !(0..limit).contains(&v) {
                let name = if k == 0 {
                    "0 (text)".to_string()
                } else if k <= (channels - 1) / 2 {
                    format!("{k} (agent audio)")
                } else {
                    format!("{k} (user audio)")
                };
                return Err(ModelError::Token {
                    graph: "temporal".into(),
                    channel: name,
                    value: v,
                    limit,
                });
            }
        }
        Ok(())
    }

    /// Checks a step's frame, and that a conversation at `position` with `left` positions left
    /// has one for it.
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check); no position left.
    pub fn check_step(
        &self,
        input: &[i64],
        position: usize,
        left: usize,
    ) -> Result<(), ModelError> {
        self.check(input)?;
        if left == 0 {
            return Err(no_position_left(position));
        }
        Ok(())
    }

    /// Checks every frame of a prefill before any runs, and that the conversation has a position
    /// for each.
    ///
    /// # Errors
    ///
    /// As [`check`](Self::check); no position left for all of them.
    pub fn check_prefill(
        &self,
        frames: &[Vec<i64>],
        position: usize,
        left: usize,
    ) -> Result<(), ModelError> {
        for f in frames {
            self.check(f)?;
        }
        if left < frames.len() {
            return Err(no_position_left(position + left));
        }
        Ok(())
    }
}
