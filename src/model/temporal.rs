//! The temporal transformer, one step at a time (or, for frames known in advance, a chunk of
//! frames per call: [`Temporal::prefill`]), with its KV cache kept where the session computes.
//!
//! Three ways to hold the cache ([`KvMode`]):
//!
//! - **Resident, GQA graph** (in place): one buffer per layer's K and V, at full capacity, bound
//!   as *both* `past_key_values.*` and `present.*`. The `GroupQueryAttention` op sees the shared
//!   buffer and appends the new row in place; `attention_mask` (a view of the valid length + 1)
//!   tells it how much is valid. Nothing is allocated or copied per step.
//! - **Resident, standard graph** (ping-pong): two buffers per K and V; each step reads a view of
//!   the current length from one and writes a view one row longer into the other. Absolute
//!   `position_ids` are passed, and once the cache holds `context - 1` rows the oldest row is
//!   dropped (an exact 3000-frame attention window), so memory and cost stop growing.
//! - **Host**: the cache goes through host arrays every step (outputs copied out, then fed back
//!   in as new inputs), as a naive driver does. Kept to measure and to demonstrate what the
//!   resident modes avoid.
//!
//! The RoPE tables of these exports cover `max_positions` (8000) positions; the caller must apply
//! its long-session policy before [`Temporal::positions_left`] reaches zero.

use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;

use super::error::ModelError;
use super::pack::{check_temporal, FloatType, Graph, LmGraphInfo, Pack, Variant};
use super::session::{open, report, Provider, SessionOptions};
use super::tensors::{
    allocator_at, element, input_placements, kv_placements, placement_of, read_floats, read_row,
    Buffer, PingPong, Placement,
};

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

/// The inputs and outputs of a fixed-shape step, where the session reads and writes them (the
/// memory of the cache, whose allocator views them); the host copies the frame and the mask in
/// and the hidden state and the logits out.
struct DeviceIo {
    frame: Buffer,
    mask: Buffer,
    hidden: Buffer,
    logits: Buffer,
}

enum Kv {
    InPlace,
    PingPong { cur: usize },
    Host { past: Vec<Buffer> },
}

/// The temporal transformer of a pack.
pub struct Temporal {
    // Field order matters: the binding (which holds views) is dropped before the buffers.
    binding: IoBinding,
    session: Session,
    /// What the graph says about itself.
    pub info: LmGraphInfo,
    /// The execution provider in use.
    pub provider: Provider,
    kv: Kv,
    /// Per layer: K then V; one set in place (GQA), two for ping-pong (standard).
    cache: PingPong,
    frame: Buffer,
    mask: Buffer,
    pos_ids: Option<Buffer>,
    hidden: Buffer,
    logits: Buffer,
    /// Fixed-shape stepping's buffers, when on.
    io: Option<DeviceIo>,
    alloc: Allocator,
    /// The KV buffers' allocator: the memory the session reads them from.
    kv_alloc: Allocator,
    /// Where the session wants each input.
    wanted: Vec<(String, Placement)>,
    channels: usize,
    text_limit: i64,
    audio_limit: i64,
    window: usize,
    capacity: usize,
    len: usize,
    pos: usize,
    /// Prefill's buffers, made at its first use.
    chunk: Option<ChunkIo>,
    /// The row of `chunk`'s outputs that holds the last step's (after a prefill).
    chunk_last: Option<usize>,
}

/// A conversation's temporal state, copied out of its transformer ([`Temporal::snapshot`]):
/// the cache's valid rows and where the conversation stands. Restoring it
/// ([`Temporal::restore`]) puts a transformer exactly where the snapshot was taken: a primed
/// state computed once serves every later conversation with the same priming.
#[derive(Clone)]
pub struct TemporalState {
    pub(crate) len: usize,
    pub(crate) pos: usize,
    /// Per layer's K then V: `heads × len × head_dim` elements, head by head.
    pub(crate) rows: Vec<Vec<u8>>,
    /// What it fits: layers, heads, head_dim, dtype, variant.
    pub(crate) shape: StateShape,
}

impl TemporalState {
    /// Bytes it holds.
    pub fn bytes(&self) -> usize {
        self.rows.iter().map(Vec::len).sum()
    }

    /// Positions it has used.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// A state of `bytes` bytes that fits no graph (for tests of what keeps states).
    #[cfg(test)]
    pub(crate) fn filler(bytes: usize) -> Self {
        TemporalState {
            len: 0,
            pos: 0,
            rows: vec![vec![0; bytes]],
            shape: (0, 0, 0, FloatType::F32, Variant::Gqa),
        }
    }
}

/// What a state fits: the graph's layers, heads, head size, cache dtype and variant.
pub(crate) type StateShape = (usize, usize, usize, FloatType, Variant);

/// The shape of the states a graph's cache holds.
pub(crate) fn state_shape(info: &LmGraphInfo) -> StateShape {
    (
        info.layers,
        info.heads,
        info.head_dim,
        info.kv,
        info.variant,
    )
}

/// Where a conversation's rows lie in KV buffers of host memory (every layer's K and V buffer
/// alike): head `i`'s rows start at element `base + i × stride × head_dim` (`stride`: rows per
/// head in the buffer). A state's rows are the same, compact: `heads × len × head_dim`.
pub(crate) struct RowSpan {
    /// The first head's first element.
    pub base: usize,
    /// Rows from one head's first row to the next's.
    pub stride: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Bytes per element.
    pub elem: usize,
}

impl RowSpan {
    /// Head `head`'s first `len` rows, in bytes.
    fn head(&self, head: usize, len: usize) -> std::ops::Range<usize> {
        let at = (self.base + head * self.stride * self.head_dim) * self.elem;
        at..at + len * self.head_dim * self.elem
    }

    /// The first `len` rows of every head of each buffer, compact (a state's `rows`).
    ///
    /// # Errors
    ///
    /// Why not: a buffer in device memory, or shorter than the span.
    pub fn gather(&self, bufs: &mut [Buffer], len: usize) -> Result<Vec<Vec<u8>>, &'static str> {
        bufs.iter_mut()
            .map(|buf| {
                let all = host_bytes(buf)?;
                let mut out = Vec::with_capacity(self.heads * len * self.head_dim * self.elem);
                for head in 0..self.heads {
                    out.extend_from_slice(all.get(self.head(head, len)).ok_or(TOO_LONG)?);
                }
                Ok(out)
            })
            .collect()
    }

    /// Writes a state's `len` compact rows of every head into each buffer.
    ///
    /// # Errors
    ///
    /// As [`gather`](Self::gather).
    pub fn scatter(
        &self,
        bufs: &mut [Buffer],
        rows: &[Vec<u8>],
        len: usize,
    ) -> Result<(), &'static str> {
        let n = len * self.head_dim * self.elem;
        for (buf, rows) in bufs.iter_mut().zip(rows) {
            let all = host_bytes(buf)?;
            for head in 0..self.heads {
                let src = rows.get(head * n..(head + 1) * n).ok_or(TOO_LONG)?;
                all.get_mut(self.head(head, len))
                    .ok_or(TOO_LONG)?
                    .copy_from_slice(src);
            }
        }
        Ok(())
    }
}

const TOO_LONG: &str = "it is longer than this cache";

/// A KV buffer's bytes, when it is in host memory.
fn host_bytes(buf: &mut Buffer) -> Result<&mut [u8], &'static str> {
    if buf.placement().device != "Cpu" {
        return Err("the cache is in device memory (a state is kept in host memory)");
    }
    Ok(buf.as_bytes())
}

impl std::fmt::Debug for TemporalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemporalState")
            .field("len", &self.len)
            .field("pos", &self.pos)
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
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

/// The KV cache's buffers: two sets for the standard graph's window (it moves between them),
/// one for the GQA graph's (updated in place), none when the cache lives on the host.
fn cache_buffers(
    kv: KvMode,
    info: &LmGraphInfo,
    kv_alloc: &Allocator,
    capacity: usize,
    window: usize,
) -> Result<[Vec<Buffer>; 2], ModelError> {
    let e = ort_err("temporal");
    let (h, d) = (info.heads as i64, info.head_dim as i64);
    let kv_ty = element(info.kv);
    let cache_rows = match (kv, info.variant) {
        (KvMode::Host, _) => 0,
        (KvMode::Resident, Variant::Gqa) => capacity,
        (KvMode::Resident, Variant::Standard) => window.min(capacity),
    };
    let mut bufs: [Vec<Buffer>; 2] = [Vec::new(), Vec::new()];
    let sets = match (kv, info.variant) {
        (KvMode::Resident, Variant::Standard) => 2,
        (KvMode::Resident, Variant::Gqa) => 1,
        (KvMode::Host, _) => 0,
    };
    for set in bufs.iter_mut().take(sets) {
        for _ in 0..2 * info.layers {
            set.push(Buffer::zeros(kv_alloc, kv_ty, &[1, h, cache_rows as i64, d]).map_err(&e)?);
        }
    }
    Ok(bufs)
}

/// The host cache's round trip after a step: every present comes back to the host and is
/// copied into new arrays that become the next step's inputs (the standard graph keeping an
/// exact window). Returns the rows kept before this step's.
fn host_presents(
    past: &mut [Buffer],
    outputs: &ort::session::SessionOutputs<'_>,
    info: &LmGraphInfo,
    alloc: &Allocator,
    window: usize,
    total: i64,
) -> Result<usize, ModelError> {
    let e = ort_err("temporal");
    let (h, d) = (info.heads as i64, info.head_dim as i64);
    // The naive round trip: every present comes back to the host and is copied into new
    // arrays that become the next step's inputs.
    let kv_ty = element(info.kv);
    // The standard graph keeps an exact window: drop the oldest row once full.
    let keep = match info.variant {
        Variant::Standard => (total as usize).min(window - 1),
        Variant::Gqa => total as usize,
    };
    let skip = total as usize - keep;
    let row = info.head_dim;
    for i in 0..info.layers {
        for (j, kv) in ["key", "value"].iter().enumerate() {
            let name = format!("present.{i}.{kv}");
            let Some(v) = outputs.get(&name) else {
                return Err(ModelError::contract(
                    "temporal",
                    format!("no output `{name}`"),
                ));
            };
            let mut fresh = Buffer::zeros(alloc, kv_ty, &[1, h, keep as i64, d]).map_err(&e)?;
            for head in 0..info.heads {
                let from = (head * total as usize + skip) * row
                    ..(head * total as usize + total as usize) * row;
                let to = head * keep * row..(head + 1) * keep * row;
                if kv_ty == TensorElementType::Float16 {
                    let (_, src) = v.try_extract_tensor::<half::f16>().map_err(&e)?;
                    fresh.as_slice::<half::f16>()[to].copy_from_slice(&src[from]);
                } else {
                    let (_, src) = v.try_extract_tensor::<f32>().map_err(&e)?;
                    fresh.as_slice::<f32>()[to].copy_from_slice(&src[from]);
                }
            }
            past[2 * i + j] = fresh;
        }
    }
    Ok(keep - 1)
}

impl DeviceIo {
    /// The fixed-shape inputs and outputs, where the session reads and writes them.
    fn new(
        session: &ort::session::Session,
        wanted: &[(String, Placement)],
        kv_alloc: &Allocator,
        info: &LmGraphInfo,
        channels: usize,
        capacity: usize,
    ) -> Result<Self, ModelError> {
        let e = ort_err("temporal");
        let at = |name: &str| allocator_at(session, &placement_of(wanted, name));
        let (frame_alloc, mask_alloc) = (
            at("input_frame").map_err(&e)?,
            at("attention_mask").map_err(&e)?,
        );
        let hd = info.hidden_dim as i64;
        Ok(DeviceIo {
            frame: Buffer::zeros(
                &frame_alloc,
                TensorElementType::Int64,
                &[1, channels as i64, 1],
            )
            .map_err(&e)?,
            mask: Buffer::zeros(&mask_alloc, TensorElementType::Int64, &[1, capacity as i64])
                .map_err(&e)?,
            hidden: Buffer::zeros(kv_alloc, element(info.hidden), &[1, 1, hd]).map_err(&e)?,
            logits: Buffer::zeros(kv_alloc, element(info.logits), &[1, 1, info.vocab as i64])
                .map_err(&e)?,
        })
    }
}

impl Temporal {
    /// What the graph runs on: `cpu f32`, `cuda f16`.
    pub fn runs_on(&self) -> String {
        format!("{} {}", self.provider.name(), self.info.kv.name())
    }

    /// Opens the pack's temporal graph and checks it.
    ///
    /// # Errors
    ///
    /// Contract errors naming the input, provider errors, ONNX Runtime errors.
    pub fn open(pack: &Pack, opts: &TemporalOptions) -> Result<Temporal, ModelError> {
        let graph = "temporal";
        let m = &pack.manifest;
        let channels = m.delays.len();
        let fixed = opts.fixed_shapes || opts.cuda_graph;
        if let Some((_, why)) = opts.fixed_shapes_conflict() {
            return Err(ModelError::contract(graph, why));
        }
        let session_opts = SessionOptions {
            cuda_graph: opts.cuda_graph,
            ..opts.session
        };
        // The dtype is only known once the graph is open; report it after the check.
        let os = open(&pack.graph_path(Graph::Temporal), graph, &session_opts)?;
        let info = check_temporal(&os.session, graph, channels)?;
        if fixed && info.variant == Variant::Standard {
            return Err(ModelError::contract(
                graph,
                "`cuda_graph: true` needs the GroupQueryAttention export (tools/make_pack.py --variant gqa / gqa-fp16, tools/export_pack.py): the standard graph's cache moves between two buffers and its shapes change every step",
            ));
        }
        let e = ort_err(graph);
        let alloc = Allocator::default();
        let wanted = input_placements(&os.session).map_err(&e)?;
        // The GQA cache lives where the session reads it (device memory under CUDA: nothing
        // crosses PCIe per step); the standard graph's window is trimmed on the host, and the
        // host mode is the host.
        let kv_alloc = match (opts.kv, info.variant) {
            (KvMode::Resident, Variant::Gqa) => {
                allocator_at(&os.session, &placement_of(&wanted, "past_key_values.0.key"))
                    .map_err(&e)?
            }
            _ => Allocator::default(),
        };
        let capacity = opts.max_positions.min(m.max_positions).max(1);
        let window = m.context.max(2);
        let bufs = cache_buffers(opts.kv, &info, &kv_alloc, capacity, window)?;
        // Growing mask: all ones, viewed one longer each step. Fixed: ones up to the
        // conversation's length, zeros past it.
        let mut mask = Buffer::zeros(&alloc, TensorElementType::Int64, &[1, capacity as i64 + 1])
            .map_err(&e)?;
        mask.as_slice::<i64>().fill(i64::from(!fixed));
        let io = match fixed {
            true => Some(DeviceIo::new(
                &os.session,
                &wanted,
                &kv_alloc,
                &info,
                channels,
                capacity,
            )?),
            false => None,
        };
        let mut t = Temporal {
            binding: os.session.create_binding().map_err(&e)?,
            kv: match (opts.kv, info.variant) {
                (KvMode::Host, _) => Kv::Host { past: Vec::new() },
                (KvMode::Resident, Variant::Gqa) => Kv::InPlace,
                (KvMode::Resident, Variant::Standard) => Kv::PingPong { cur: 0 },
            },
            cache: PingPong { sets: bufs },
            frame: Buffer::zeros(&alloc, TensorElementType::Int64, &[1, channels as i64, 1])
                .map_err(&e)?,
            mask,
            pos_ids: match info.variant {
                Variant::Standard => {
                    Some(Buffer::zeros(&alloc, TensorElementType::Int64, &[1, 1]).map_err(&e)?)
                }
                Variant::Gqa => None,
            },
            hidden: Buffer::zeros(
                &alloc,
                element(info.hidden),
                &[1, 1, info.hidden_dim as i64],
            )
            .map_err(&e)?,
            logits: Buffer::zeros(&alloc, element(info.logits), &[1, 1, info.vocab as i64])
                .map_err(&e)?,
            io,
            session: os.session,
            provider: os.provider,
            alloc,
            kv_alloc,
            wanted,
            channels,
            text_limit: m.text_vocab + 1,
            audio_limit: m.audio_vocab + 1,
            window,
            capacity,
            len: 0,
            pos: 0,
            chunk: None,
            chunk_last: None,
            info,
        };
        t.bind_fixed()?;
        t.announce(opts, fixed);
        Ok(t)
    }

    /// Says what was opened (and warns when a GPU's cache lives in host memory).
    fn announce(&self, opts: &TemporalOptions, fixed: bool) {
        report(
            &opts.session,
            "temporal",
            self.provider,
            self.info.kv.name(),
        );
        let on_host = self.cache.sets[0]
            .first()
            .is_none_or(|b| b.placement().device == "Cpu");
        if matches!(self.provider, Provider::Cuda { .. }) && on_host {
            tracing::warn!(
                variant = ?self.info.variant,
                kv = ?opts.kv,
                "temporal: the KV cache is in host memory, so every step copies it to the GPU and back (the GQA graph with `kv: resident` keeps it on the device)"
            );
        }
        tracing::info!(
            variant = ?self.info.variant,
            layers = self.info.layers,
            heads = self.info.heads,
            head_dim = self.info.head_dim,
            dtype = self.info.kv.name(),
            kv = ?opts.kv,
            capacity = self.capacity,
            fixed_shapes = fixed,
            cuda_graph = opts.cuda_graph,
            "temporal transformer ready"
        );
    }

    /// Binds what stays bound for the life of the session.
    fn bind_fixed(&mut self) -> Result<(), ModelError> {
        let e = ort_err("temporal");
        if let Some(io) = self.io.as_mut() {
            let (hd, v) = (self.info.hidden_dim as i64, self.info.vocab as i64);
            let frame = io
                .frame
                .view(&self.kv_alloc, &[1, self.channels as i64, 1])
                .map_err(&e)?;
            self.binding.bind_input("input_frame", &frame).map_err(&e)?;
            let mask = io
                .mask
                .view(&self.kv_alloc, &[1, self.capacity as i64])
                .map_err(&e)?;
            self.binding
                .bind_input("attention_mask", &mask)
                .map_err(&e)?;
            let hidden = io.hidden.view(&self.kv_alloc, &[1, 1, hd]).map_err(&e)?;
            self.binding.bind_output("hidden", hidden).map_err(&e)?;
            let logits = io.logits.view(&self.kv_alloc, &[1, 1, v]).map_err(&e)?;
            self.binding
                .bind_output("text_logits", logits)
                .map_err(&e)?;
            return self.bind_in_place();
        }
        let frame = self
            .frame
            .view(&self.alloc, &[1, self.channels as i64, 1])
            .map_err(&e)?;
        self.binding.bind_input("input_frame", &frame).map_err(&e)?;
        if let Some(p) = self.pos_ids.as_mut() {
            let v = p.view(&self.alloc, &[1, 1]).map_err(&e)?;
            self.binding.bind_input("position_ids", &v).map_err(&e)?;
        }
        let hd = self.info.hidden_dim as i64;
        let hidden = self.hidden.view(&self.alloc, &[1, 1, hd]).map_err(&e)?;
        self.binding.bind_output("hidden", hidden).map_err(&e)?;
        let v = self.info.vocab as i64;
        let logits = self.logits.view(&self.alloc, &[1, 1, v]).map_err(&e)?;
        self.binding
            .bind_output("text_logits", logits)
            .map_err(&e)?;
        self.bind_in_place()
    }

    /// Binds the in-place cache as both past and present (GQA, resident).
    fn bind_in_place(&mut self) -> Result<(), ModelError> {
        let e = ort_err("temporal");
        if let Kv::InPlace = self.kv {
            let rows = self.capacity as i64;
            for i in 0..self.info.layers {
                for (j, kv) in ["key", "value"].iter().enumerate() {
                    let shape = [1, self.info.heads as i64, rows, self.info.head_dim as i64];
                    let buf = &mut self.cache.sets[0][2 * i + j];
                    let past = buf.view(&self.kv_alloc, &shape).map_err(&e)?;
                    let present = buf.view(&self.kv_alloc, &shape).map_err(&e)?;
                    self.binding
                        .bind_input(format!("past_key_values.{i}.{kv}"), &past)
                        .map_err(&e)?;
                    self.binding
                        .bind_output(format!("present.{i}.{kv}"), present)
                        .map_err(&e)?;
                }
            }
        }
        Ok(())
    }

    /// Forgets the conversation (the cache is kept allocated).
    pub fn reset(&mut self) {
        self.len = 0;
        self.pos = 0;
        self.chunk_last = None;
        if self.io.is_some() {
            self.mask.as_slice::<i64>().fill(0);
        }
        if let Kv::PingPong { cur } = &mut self.kv {
            *cur = 0;
        }
        if let Kv::Host { past } = &mut self.kv {
            past.clear();
        }
    }

    /// Rows in the KV cache (the attention context of the next step).
    pub fn kv_len(&self) -> usize {
        self.len
    }

    /// Positions used since the last reset.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Steps left before the positions this state can take run out.
    pub fn positions_left(&self) -> usize {
        self.capacity.saturating_sub(self.pos)
    }

    /// Checks token ids against the embedding tables.
    ///
    /// # Errors
    ///
    /// [`ModelError::Token`] naming the channel.
    pub fn validate(&self, input: &[i64]) -> Result<(), ModelError> {
        validate_frame(input, self.channels, self.text_limit, self.audio_limit)
    }

    /// Runs one step on `input` (one token per channel). Read the results with
    /// [`read_hidden`](Self::read_hidden) and [`read_logits`](Self::read_logits).
    ///
    /// # Errors
    ///
    /// Token errors, [`ModelError::Contract`] when no position is left, ONNX Runtime errors.
    pub fn step(&mut self, input: &[i64]) -> Result<(), ModelError> {
        self.validate(input)?;
        if self.positions_left() == 0 {
            return Err(no_position_left(self.pos));
        }
        let e = ort_err("temporal");
        self.chunk_last = None;
        self.frame.as_slice::<i64>()[..self.channels].copy_from_slice(input);
        if let Some(p) = self.pos_ids.as_mut() {
            p.as_slice::<i64>()[0] = self.pos as i64;
        }
        let total = self.len as i64 + 1;
        if self.io.is_some() {
            self.mask.as_slice::<i64>()[self.len] = 1;
            return self.step_fixed();
        }
        let mask = self.mask.view(&self.alloc, &[1, total]).map_err(&e)?;
        self.binding
            .bind_input("attention_mask", &mask)
            .map_err(&e)?;
        let (h, d) = (self.info.heads as i64, self.info.head_dim as i64);
        match &mut self.kv {
            Kv::InPlace => {}
            Kv::PingPong { cur } => {
                self.cache
                    .bind(&mut self.binding, &self.alloc, *cur, h, self.len as i64, d)
                    .map_err(&e)?;
            }
            Kv::Host { past } => {
                let kv_ty = element(self.info.kv);
                if past.is_empty() {
                    for _ in 0..2 * self.info.layers {
                        past.push(Buffer::zeros(&self.alloc, kv_ty, &[1, h, 0, d]).map_err(&e)?);
                    }
                }
                let cpu = self.alloc.memory_info().clone();
                for i in 0..self.info.layers {
                    for (j, kv) in ["key", "value"].iter().enumerate() {
                        let p = &mut past[2 * i + j];
                        let v = p
                            .view(&self.alloc, &[1, h, self.len as i64, d])
                            .map_err(&e)?;
                        self.binding
                            .bind_input(format!("past_key_values.{i}.{kv}"), &v)
                            .map_err(&e)?;
                        self.binding
                            .bind_output_to_device(format!("present.{i}.{kv}"), &cpu)
                            .map_err(&e)?;
                    }
                }
            }
        }
        let outputs = self.session.run_binding(&self.binding).map_err(&e)?;
        if let Kv::Host { past } = &mut self.kv {
            self.len = host_presents(past, &outputs, &self.info, &self.alloc, self.window, total)?;
        }
        drop(outputs);
        self.len += 1;
        self.pos += 1;
        self.flip_window();
        Ok(())
    }

    /// The standard graph's window after a step: the buffers swap, and once the window is
    /// full the newest `window - 1` rows are copied into the other buffer.
    fn flip_window(&mut self) {
        let Kv::PingPong { cur } = &mut self.kv else {
            return;
        };
        *cur = 1 - *cur;
        if self.len > self.window - 1 {
            // Keep the newest `window - 1` rows: copy them into the other buffer.
            let keep = self.window - 1;
            let (a, b) = self.cache.sets.split_at_mut(1);
            let (src, dst) = if *cur == 0 {
                (&mut a[0], &mut b[0])
            } else {
                (&mut b[0], &mut a[0])
            };
            let row = self.info.head_dim
                * if self.info.kv == super::pack::FloatType::F16 {
                    2
                } else {
                    4
                };
            for (s, t) in src.iter_mut().zip(dst.iter_mut()) {
                let sp = s.tensor.data_ptr_mut().cast::<u8>();
                let tp = t.tensor.data_ptr_mut().cast::<u8>();
                for head in 0..self.info.heads {
                    // SAFETY: source rows `[1, len)` of each head and destination rows
                    // `[0, keep)` lie inside buffers of `window` rows per head.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            sp.add((head * self.len + 1) * row),
                            tp.add(head * keep * row),
                            keep * row,
                        )
                    };
                }
            }
            *cur = 1 - *cur;
            self.len = keep;
        }
    }

    /// A fixed-shape step: the frame and the mask copied to where the session reads them, the
    /// run (a CUDA graph replay once captured), the hidden state and logits copied back.
    fn step_fixed(&mut self) -> Result<(), ModelError> {
        let e = ort_err("temporal");
        let Some(io) = self.io.as_mut() else {
            return Ok(());
        };
        let (c, cap) = (self.channels as i64, self.capacity as i64);
        let (hd, v) = (self.info.hidden_dim as i64, self.info.vocab as i64);
        let (host, dev) = (&self.alloc, &self.kv_alloc);
        self.frame
            .copy_prefix_to(host, &mut io.frame, dev, &[1, c, 1])
            .map_err(&e)?;
        self.mask
            .copy_prefix_to(host, &mut io.mask, dev, &[1, cap])
            .map_err(&e)?;
        self.session.run_binding(&self.binding).map_err(&e)?;
        io.hidden
            .copy_prefix_to(dev, &mut self.hidden, host, &[1, 1, hd])
            .map_err(&e)?;
        io.logits
            .copy_prefix_to(dev, &mut self.logits, host, &[1, 1, v])
            .map_err(&e)?;
        self.len += 1;
        self.pos += 1;
        Ok(())
    }

    /// First element of row `row` of layer `layer`'s key cache, head 0 (resident caches only):
    /// lets tests see that the graph wrote into the bound buffer itself.
    pub fn key_cache_value(&mut self, layer: usize, row: usize) -> Option<f32> {
        let rows = match self.kv {
            Kv::InPlace => self.capacity,
            _ => return None,
        };
        let buf = self.cache.sets[0].get_mut(2 * layer)?;
        if buf.placement().device != "Cpu" {
            return None;
        }
        let idx = row.min(rows - 1) * self.info.head_dim;
        match self.info.kv {
            super::pack::FloatType::F32 => buf.as_slice::<f32>().get(idx).copied(),
            super::pack::FloatType::F16 => buf.as_slice::<half::f16>().get(idx).map(|v| v.to_f32()),
        }
    }

    /// The fixed-shape binding's buffers (with `fixed_shapes` or `cuda_graph`): each input or
    /// output name, where its buffer is, and where the session wants it (for the outputs, the
    /// memory the cache is in); empty otherwise.
    pub fn io_placements(&self) -> Vec<(String, Placement, Placement)> {
        let Some(io) = &self.io else {
            return Vec::new();
        };
        let cache = placement_of(&self.wanted, "past_key_values.0.key");
        vec![
            (
                "input_frame".into(),
                io.frame.placement(),
                placement_of(&self.wanted, "input_frame"),
            ),
            (
                "attention_mask".into(),
                io.mask.placement(),
                placement_of(&self.wanted, "attention_mask"),
            ),
            ("hidden".into(), io.hidden.placement(), cache.clone()),
            ("text_logits".into(), io.logits.placement(), cache),
        ]
    }

    /// Every bound KV buffer: its input name, where it is, and where the session wants that
    /// input (the two must agree, or ONNX Runtime copies the cache every step).
    pub fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        kv_placements(&self.cache.sets[0], self.info.layers, &self.wanted)
    }

    /// The last step's hidden state, as f32.
    pub fn read_hidden(&mut self, out: &mut Vec<f32>) {
        match (self.chunk_last, self.chunk.as_mut()) {
            (Some(r), Some(c)) => read_row(&mut c.hidden, r, self.info.hidden_dim, out),
            _ => read_floats(&mut self.hidden, self.info.hidden_dim, out),
        }
    }

    /// The last step's text logits, as f32.
    pub fn read_logits(&mut self, out: &mut Vec<f32>) {
        match (self.chunk_last, self.chunk.as_mut()) {
            (Some(r), Some(c)) => read_row(&mut c.logits, r, self.info.vocab, out),
            _ => read_floats(&mut self.logits, self.info.vocab, out),
        }
    }

    /// The conversation's state, copied out; `None` where it cannot be (the host-fed and the
    /// fixed-shape caches, a cache in device memory).
    pub fn snapshot(&mut self) -> Option<TemporalState> {
        let (rows_cap, set) = self.state_layout()?;
        let rows = self
            .row_span(rows_cap)
            .gather(&mut self.cache.sets[set], self.len)
            .ok()?;
        Some(TemporalState {
            len: self.len,
            pos: self.pos,
            rows,
            shape: state_shape(&self.info),
        })
    }

    /// Where the rows lie in buffers of `rows_cap` rows per head.
    fn row_span(&self, rows_cap: usize) -> RowSpan {
        RowSpan {
            base: 0,
            stride: rows_cap,
            heads: self.info.heads,
            head_dim: self.info.head_dim,
            elem: element_bytes(self.info.kv),
        }
    }

    /// Puts the conversation where `state` was taken (on a transformer of the same graph).
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] when the state is of another shape, needs more rows than this
    /// transformer holds, or this transformer's cache cannot take it (host-fed, fixed-shape,
    /// device memory).
    pub fn restore(&mut self, state: &TemporalState) -> Result<(), ModelError> {
        let bad = |why: &str| ModelError::contract("temporal", format!("restoring a state: {why}"));
        if state.shape != state_shape(&self.info) {
            return Err(bad("it is of another graph"));
        }
        // Empty, and a ping-pong cache back on its first set.
        self.reset();
        let (rows_cap, set) = match self.state_layout() {
            Some((_, set)) if matches!(self.kv, Kv::PingPong { .. }) => {
                // Compact at the state's length, inside the window.
                if state.len > self.window - 1 {
                    return Err(bad("it is longer than the attention window"));
                }
                (state.len, set)
            }
            Some(l) => l,
            None => return Err(bad("this cache cannot take one")),
        };
        if state.len > rows_cap || state.pos > self.capacity {
            return Err(bad("it is longer than this cache"));
        }
        self.row_span(rows_cap)
            .scatter(&mut self.cache.sets[set], &state.rows, state.len)
            .map_err(bad)?;
        self.len = state.len;
        self.pos = state.pos;
        Ok(())
    }

    /// Where a state's rows live: the rows per head of the buffers that hold them now, and
    /// which set; `None` for the caches a state cannot be taken from.
    fn state_layout(&self) -> Option<(usize, usize)> {
        if self.io.is_some() {
            return None;
        }
        match self.kv {
            // At full capacity, in place.
            Kv::InPlace => Some((self.capacity, 0)),
            // A view of the current length: rows laid out compactly, head after head.
            Kv::PingPong { cur } => Some((self.len, cur)),
            Kv::Host { .. } => None,
        }
    }

    /// Runs `frames` (each one token per channel, all known before the first runs: nothing is
    /// sampled between them, as while priming) in chunks of at most `chunk` frames, one graph
    /// call per chunk, and leaves the conversation where as many [`step`](Self::step)s would
    /// (equal within the float rounding of a different reduction order);
    /// [`read_hidden`](Self::read_hidden) and [`read_logits`](Self::read_logits) then give the
    /// last frame's. Where a chunk cannot be exact it steps: the fixed-shape and host-fed
    /// caches, and the standard graph's frames past its attention window (a chunk would attend
    /// to rows the window drops).
    ///
    /// # Errors
    ///
    /// Token errors (every frame is checked before any runs), no position left for all of
    /// them, ONNX Runtime errors.
    pub fn prefill(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        for f in frames {
            self.validate(f)?;
        }
        if self.positions_left() < frames.len() {
            return Err(no_position_left(self.pos + self.positions_left()));
        }
        let chunk = chunk.max(1);
        let chunked = self.io.is_none() && !matches!(self.kv, Kv::Host { .. }) && chunk > 1;
        let mut at = 0;
        while at < frames.len() {
            let room = match self.kv {
                // The in-place cache holds `capacity` rows.
                Kv::InPlace => self.capacity - self.len,
                // The window's rows, before any would be dropped.
                _ => (self.window - 1).saturating_sub(self.len),
            };
            let n = chunk.min(frames.len() - at).min(room);
            if !chunked || n < 2 {
                self.step(&frames[at])?;
                at += 1;
                continue;
            }
            self.run_chunk(&frames[at..at + n], chunk)?;
            at += n;
        }
        Ok(())
    }

    /// One graph call on `frames` (at most `chunk`, fitting the cache).
    fn run_chunk(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        let e = ort_err("temporal");
        let (n, c) = (frames.len(), self.channels);
        if self.chunk.as_ref().is_none_or(|io| io.frames < chunk) {
            let io = ChunkIo::new(&self.alloc, &self.info, c, chunk).map_err(&e)?;
            self.chunk = Some(io);
        }
        let Some(io) = self.chunk.as_mut() else {
            return Ok(());
        };
        io.fill(frames);
        let a = &self.alloc;
        let s = n as i64;
        let v = io.frame.view(a, &[1, c as i64, s]).map_err(&e)?;
        self.binding.bind_input("input_frame", &v).map_err(&e)?;
        let total = (self.len + n) as i64;
        let v = self.mask.view(a, &[1, total]).map_err(&e)?;
        self.binding.bind_input("attention_mask", &v).map_err(&e)?;
        if self.pos_ids.is_some() {
            let p = io.pos_ids.as_slice::<i64>();
            for (t, x) in p[..n].iter_mut().enumerate() {
                *x = (self.pos + t) as i64;
            }
            let v = io.pos_ids.view(a, &[1, s]).map_err(&e)?;
            self.binding.bind_input("position_ids", &v).map_err(&e)?;
        }
        let (hd, vocab) = (self.info.hidden_dim as i64, self.info.vocab as i64);
        let v = io.hidden.view(a, &[1, s, hd]).map_err(&e)?;
        self.binding.bind_output("hidden", v).map_err(&e)?;
        let v = io.logits.view(a, &[1, s, vocab]).map_err(&e)?;
        self.binding.bind_output("text_logits", v).map_err(&e)?;
        let (h, d) = (self.info.heads as i64, self.info.head_dim as i64);
        if let Kv::PingPong { cur } = self.kv {
            // Past: the `len` rows of one set; present: `len + n` rows of the other.
            self.cache
                .bind_growing(
                    &mut self.binding,
                    &self.kv_alloc,
                    cur,
                    1,
                    h,
                    self.len as i64,
                    s,
                    d,
                )
                .map_err(&e)?;
        }
        let ran = self.session.run_binding(&self.binding).map(drop);
        // The step's own bindings again, whatever happened.
        let rebound = self.bind_fixed();
        ran.map_err(&e)?;
        rebound?;
        if let Kv::PingPong { cur } = &mut self.kv {
            *cur = 1 - *cur;
        }
        self.len += n;
        self.pos += n;
        self.chunk_last = Some(n - 1);
        Ok(())
    }
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

/// Checks a temporal input frame: `channels` tokens, the text one below `text_limit`, the audio
/// ones below `audio_limit`.
///
/// # Errors
///
/// [`ModelError::Token`] naming the channel, [`ModelError::Contract`] for a wrong length.
pub(crate) fn validate_frame(
    input: &[i64],
    channels: usize,
    text_limit: i64,
    audio_limit: i64,
) -> Result<(), ModelError> {
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
        let limit = if k == 0 { text_limit } else { audio_limit };
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
