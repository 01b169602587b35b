//! The depformer: 16 autoregressive substeps per frame predicting the audio codebooks, with
//! teacher forcing of the provided channels and sampling by a seeded [`Sampler`].
//!
//! Its KV cache starts empty every frame and holds at most 16 rows; two buffers per layer are
//! allocated once and used ping-pong through views, so a frame allocates no cache memory.
//!
//! The step exists once: [`DepformerBatch`] runs the frames of many conversations in one
//! batched call per substep (the shared engine's depformer), and a conversation's own
//! [`Depformer`] is that batch at one row.
//!
//! Under CUDA with `cuda_graph` (the session's option), each substep's call is captured as a
//! CUDA graph of its own and replayed frame after frame: a substep's shapes are the same every
//! frame (its cache views are `substep` rows long, its plain inputs and output `rows` rows),
//! so one graph per (substep, rows), chosen by ONNX Runtime's `gpu_graph_id`, takes the growing
//! binding as it is. The graph's plain inputs and its output then live in buffers of their own
//! where the session computes, bound at the same addresses every frame, fed and read by copies
//! (`separate_io`, which a CPU can run too: the same calls, the same kernels, bit for bit).
//!
//! With device sampling ([`DepformerBinding::device_sampling`]) each substep's audio token is
//! drawn where the logits are, by a small graph of its own, and fed to the next substep from
//! there: a frame sends its inputs and each row's random numbers once and reads its tokens
//! back once, instead of the logits of every substep coming to the host and each token going
//! back.

use ort::memory::Allocator;
use ort::session::{IoBinding, RunOptions, Session};
use ort::value::TensorElementType;

use super::draw_graph::draw_graph;
use super::error::ModelError;
use super::pack::{check_depformer, FloatType, Graph, LmGraphInfo, Pack};
use super::sampling::{Sampler, SamplingParams};
use super::session::{open, open_bytes, report, Provider, SessionOptions};
use super::tensors::{
    allocator_at, element, input_placements, kv_placements, placement_of, read_row, write_row,
    Buffer, PingPong, Placement,
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

/// How a depformer's plain inputs and output are bound, and where its audio tokens are drawn.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DepformerBinding {
    /// The plain inputs and the output in buffers of their own where the session computes
    /// (what a CUDA graph needs; `cuda_graph` in the session options implies it).
    pub separate_io: bool,
    /// Each substep's audio token drawn where the logits are, by a graph of its own
    /// ([`draw_graph`](super::draw_graph)), and fed to the next substep from there: no logits
    /// go to the host, and a frame's tokens come back in one copy. The random numbers are
    /// still each row's own sampler's, so a seed gives the same stream. Implies `separate_io`.
    pub device_sampling: bool,
}

/// Checks a frame before it joins a batch: its sizes (a hidden state of `hidden_dim` values,
/// `steps` targets), its text token and its provided audio tokens against their tables
/// (`text_limit`, `audio_limit` ids), so that a bad frame never reaches a batch.
///
/// # Errors
///
/// [`ModelError::Contract`] for sizes, [`ModelError::Token`] naming the channel.
pub(crate) fn check_frame(
    frame: &DepformerInput<'_>,
    hidden_dim: usize,
    steps: usize,
    text_limit: i64,
    audio_limit: i64,
) -> Result<(), ModelError> {
    frame.check(hidden_dim, steps)?;
    if !(0..text_limit).contains(&frame.text) {
        return Err(token_error(0, frame.text, text_limit, audio_limit));
    }
    for cb in 0..steps {
        let v = frame.target[cb];
        if frame.provided[cb] && !(0..audio_limit).contains(&v) {
            return Err(token_error(cb + 1, v, text_limit, audio_limit));
        }
    }
    Ok(())
}

/// A token outside its table, fed at substep `at` (0: the text token).
fn token_error(at: usize, value: i64, text_limit: i64, audio_limit: i64) -> ModelError {
    let (channel, limit) = if at == 0 {
        ("prev_token (text, substep 0)".to_string(), text_limit)
    } else {
        (
            format!("prev_token (audio channel {at}, substep {at})"),
            audio_limit,
        )
    };
    ModelError::Token {
        graph: "depformer".into(),
        channel,
        value,
        limit,
    }
}

/// One conversation's frame in a [`DepformerBatch`]: what it brings and what it gets back.
pub(crate) struct DepformerRow {
    pub hidden: Vec<f32>,
    pub text: i64,
    pub target: Vec<i64>,
    pub provided: Vec<bool>,
    pub sampler: Sampler,
    pub params: SamplingParams,
    pub unused: UnusedSubsteps,
    /// The frame's tokens, one per substep.
    pub out: Vec<i64>,
    /// Substeps run and skipped in this frame.
    pub counts: (u64, u64),
    /// Every substep's logits, when kept.
    pub logits: Option<Vec<Vec<f32>>>,
    pub error: Option<ModelError>,
}

impl DepformerRow {
    /// An empty row.
    pub fn new() -> Self {
        DepformerRow {
            hidden: Vec::new(),
            text: 0,
            target: Vec::new(),
            provided: Vec::new(),
            sampler: Sampler::new(0),
            params: SamplingParams::GREEDY,
            unused: UnusedSubsteps::Run,
            out: Vec::new(),
            counts: (0, 0),
            logits: None,
            error: None,
        }
    }

    /// Copies a conversation's frame in (its sizes checked before, with [`check_frame`]),
    /// with its sampler (taken: a batch row draws from it) and its settings; its logits are
    /// kept when `logits` is given (the conversation's buffer, reused).
    pub fn load(
        &mut self,
        frame: DepformerInput<'_>,
        steps: usize,
        sampler: &mut Sampler,
        params: SamplingParams,
        unused: UnusedSubsteps,
        logits: Option<Vec<Vec<f32>>>,
    ) {
        self.hidden.clear();
        self.hidden.extend_from_slice(frame.hidden);
        self.text = frame.text;
        self.target.clear();
        self.target.extend_from_slice(&frame.target[..steps]);
        self.provided.clear();
        self.provided.extend_from_slice(&frame.provided[..steps]);
        self.sampler = std::mem::replace(sampler, Sampler::new(0));
        self.params = params;
        self.unused = unused;
        self.logits = logits;
        self.error = None;
    }

    /// Gives the sampler back to the conversation.
    pub fn return_sampler(&mut self, sampler: &mut Sampler) {
        *sampler = std::mem::replace(&mut self.sampler, Sampler::new(0));
    }

    /// After a run: the frame's tokens into `out`, its counts added to `counts`, its logits
    /// (when kept) into `logits`; the row's error, if it failed.
    pub fn unload(
        &mut self,
        out: &mut Vec<i64>,
        counts: &mut (u64, u64),
        logits: &mut Vec<Vec<f32>>,
    ) -> Result<(), ModelError> {
        counts.0 += self.counts.0;
        counts.1 += self.counts.1;
        if let Some(l) = self.logits.take() {
            *logits = l;
        }
        out.clear();
        out.extend_from_slice(&self.out);
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The depformer graph with buffers for up to `rows` frames: one batched graph call per
/// substep for every frame given. Rows are ordered by how many substeps they need (with
/// [`UnusedSubsteps::Skip`], the trailing substeps whose tokens are all provided are not run),
/// so each substep's rows are a prefix of the previous one's. Every row brings its own sampler:
/// the draws of a conversation are taken in its own order (text, substeps 0..15), whatever
/// else is in the batch.
pub(crate) struct DepformerBatch {
    // Field order matters: the binding (which holds views) is dropped before the buffers.
    binding: IoBinding,
    session: Session,
    pub info: LmGraphInfo,
    pub provider: Provider,
    kv: PingPong,
    /// The plain inputs and the output in host memory, where rows are written and read.
    host: PlainIo,
    alloc: Allocator,
    kv_alloc: Allocator,
    wanted: Vec<(String, Placement)>,
    rows: usize,
    steps: usize,
    text_limit: i64,
    audio_limit: i64,
    /// The batch size the plain inputs and the output are bound at.
    bound: Option<usize>,
    scratch: Vec<f32>,
    /// The plain inputs and the output in buffers of their own where the session computes
    /// (`separate_io`, and always with a CUDA graph), fed from and read into the host ones.
    io: Option<PlainIo>,
    /// With a CUDA graph: the run options that choose each (substep, rows) call's graph.
    graphs: Option<RunOptions>,
    /// With device sampling: the draw's session and buffers.
    draw: Option<DeviceDraw>,
}

/// A buffer the frame is written to (or read from) on the host, and the one a session reads
/// (or writes) where it wants it.
struct Staged {
    host: Buffer,
    dev: Buffer,
    alloc: Allocator,
}

impl Staged {
    /// `elems` zeroed elements of `ty` on each side: the host's, and the session's from `alloc`.
    fn zeros(alloc: Allocator, ty: TensorElementType, elems: usize) -> ort::Result<Staged> {
        let shape = [elems as i64];
        Ok(Staged {
            host: Buffer::zeros(&Allocator::default(), ty, &shape)?,
            dev: Buffer::zeros(&alloc, ty, &shape)?,
            alloc,
        })
    }

    /// The host side's first `n` elements over the session's.
    fn upload(&mut self, n: usize) -> ort::Result<()> {
        (self.host).copy_prefix_to(
            &Allocator::default(),
            &mut self.dev,
            &self.alloc,
            &[n as i64],
        )
    }

    /// The session's first `n` elements over the host side's.
    fn download(&mut self, n: usize) -> ort::Result<()> {
        (self.dev).copy_prefix_to(
            &self.alloc,
            &mut self.host,
            &Allocator::default(),
            &[n as i64],
        )
    }

    /// A view of the session's side: `shape` from element `at`.
    fn view(&mut self, at: usize, shape: &[i64]) -> ort::Result<ort::value::DynTensor> {
        self.dev.view_at(&self.alloc, at, shape)
    }
}

/// The audio draw where the depformer's logits are: its session, its binding, and a frame's
/// inputs (per row: k and temperature; per substep and row, at `substep * rows + row`: the
/// uniform, the provided token and whether it is provided) and tokens.
struct DeviceDraw {
    // Field order matters: the binding (which holds views) is dropped before the buffers.
    binding: IoBinding,
    session: Session,
    top_k: Staged,
    row_k: Staged,
    temperature: Staged,
    uniform: Staged,
    target: Staged,
    provided: Staged,
    tokens: Staged,
}

impl DeviceDraw {
    /// The draw for `info`'s logits, on `opts`' provider, for `rows` rows of `steps` substeps.
    fn open(
        info: &LmGraphInfo,
        graph: &str,
        opts: &SessionOptions,
        rows: usize,
        steps: usize,
    ) -> Result<DeviceDraw, ModelError> {
        let name = format!("{graph} draw");
        let bytes = draw_graph(info.vocab, info.logits == FloatType::F16);
        let opts = SessionOptions {
            cuda_graph: false,
            on_ready: None,
            ..*opts
        };
        let session = open_bytes(&bytes, &name, &opts)?.session;
        let e = |err: ort::Error| ModelError::ort(&name, err);
        let wanted = input_placements(&session).map_err(e)?;
        let staged = |input: &str, ty: TensorElementType, elems: usize| {
            let alloc = allocator_at(&session, &placement_of(&wanted, input))?;
            Staged::zeros(alloc, ty, elems)
        };
        use TensorElementType::{Bool, Float64, Int64};
        let all = rows * steps;
        Ok(DeviceDraw {
            top_k: staged("top_k", Int64, 1).map_err(e)?,
            row_k: staged("row_k", Int64, rows).map_err(e)?,
            temperature: staged("temperature", Float64, rows).map_err(e)?,
            uniform: staged("uniform", Float64, all).map_err(e)?,
            target: staged("target", Int64, all).map_err(e)?,
            provided: staged("provided", Bool, all).map_err(e)?,
            // (where the logits are)
            tokens: staged("logits", Int64, all).map_err(e)?,
            binding: session.create_binding().map_err(e)?,
            session,
        })
    }

    /// Writes a frame's inputs for the rows in `order` (a batch of `stride` rows), taking each
    /// row's draws from its own sampler (one per substep when it samples, as the host draw
    /// does), and sends them where the session reads them.
    fn load(
        &mut self,
        rows: &mut [&mut DepformerRow],
        order: &[usize],
        stride: usize,
        steps: usize,
        vocab: usize,
    ) -> ort::Result<()> {
        let mut widest = 1;
        for (r, &i) in order.iter().enumerate() {
            let j = &mut *rows[i];
            let p = j.params;
            let (k, t) = if p.draws() {
                (p.kept(vocab), p.temperature as f64)
            } else {
                (1, 1.0)
            };
            widest = widest.max(k);
            self.row_k.host.as_slice::<i64>()[r] = k as i64;
            self.temperature.host.as_slice::<f64>()[r] = t;
            for cb in 0..steps {
                let at = cb * stride + r;
                self.uniform.host.as_slice::<f64>()[at] = j.sampler.take_draw(p).unwrap_or(0.0);
                self.target.host.as_slice::<i64>()[at] = j.target[cb];
                self.provided.host.as_slice::<bool>()[at] = j.provided[cb];
            }
        }
        self.top_k.host.as_slice::<i64>()[0] = widest as i64;
        let all = stride * steps;
        self.top_k.upload(1)?;
        self.row_k.upload(stride)?;
        self.temperature.upload(stride)?;
        self.uniform.upload(all)?;
        self.target.upload(all)?;
        self.provided.upload(all)
    }

    /// Draws substep `cb`'s tokens for the first `n` rows from `logits` (`[n, 1, vocab]`):
    /// each into the frame's tokens, and what the next substep is fed into `next` (`[n, 1]`).
    fn run(
        &mut self,
        cb: usize,
        n: usize,
        stride: usize,
        logits: &ort::value::DynTensor,
        next: ort::value::DynTensor,
    ) -> ort::Result<()> {
        let (at, rows) = (cb * stride, n as i64);
        let b = &mut self.binding;
        b.bind_input("logits", logits)?;
        b.bind_input("top_k", &self.top_k.view(0, &[1])?)?;
        b.bind_input("row_k", &self.row_k.view(0, &[rows])?)?;
        b.bind_input("temperature", &self.temperature.view(0, &[rows])?)?;
        b.bind_input("uniform", &self.uniform.view(at, &[rows])?)?;
        b.bind_input("target", &self.target.view(at, &[rows])?)?;
        b.bind_input("provided", &self.provided.view(at, &[rows])?)?;
        b.bind_output("token", self.tokens.view(at, &[rows, 1])?)?;
        b.bind_output("next", next)?;
        drop(self.session.run_binding(&self.binding)?);
        Ok(())
    }
}

/// The depformer's plain inputs and its output, for up to a batch of rows.
struct PlainIo {
    hidden: Buffer,
    prev: Buffer,
    substep: Buffer,
    logits: Buffer,
}

impl PlainIo {
    /// Zeroed buffers for `rows` rows of `info`'s graph, in `alloc`'s memory.
    fn zeros(alloc: &Allocator, info: &LmGraphInfo, rows: i64) -> ort::Result<PlainIo> {
        Ok(PlainIo {
            hidden: Buffer::zeros(
                alloc,
                element(info.hidden),
                &[rows, 1, info.hidden_dim as i64],
            )?,
            prev: Buffer::zeros(alloc, TensorElementType::Int64, &[rows, 1])?,
            substep: Buffer::zeros(alloc, TensorElementType::Int64, &[])?,
            logits: Buffer::zeros(alloc, element(info.logits), &[rows, 1, info.vocab as i64])?,
        })
    }
}

impl DepformerBatch {
    /// Opens the pack's depformer (`graph` names it in messages) with buffers for `rows`
    /// frames.
    ///
    /// # Errors
    ///
    /// Contract errors naming the input, provider errors, ONNX Runtime errors.
    pub fn open(
        pack: &Pack,
        graph: &str,
        opts: &SessionOptions,
        rows: usize,
    ) -> Result<DepformerBatch, ModelError> {
        Self::open_with(pack, graph, opts, rows, DepformerBinding::default())
    }

    /// [`open`](Self::open) with `binding`: the plain inputs and the output in buffers of their
    /// own where the session computes (always with `cuda_graph`, which needs the CUDA
    /// provider), the audio drawn there.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open); [`ModelError::Contract`] for `cuda_graph` off CUDA, and for
    /// device sampling of logits wider than the audio table.
    pub fn open_with(
        pack: &Pack,
        graph: &str,
        opts: &SessionOptions,
        rows: usize,
        binding: DepformerBinding,
    ) -> Result<DepformerBatch, ModelError> {
        if let Some((_, why)) = opts.cuda_graph_conflict() {
            return Err(ModelError::contract(graph, why));
        }
        let m = &pack.manifest;
        let os = open(&pack.graph_path(Graph::Depformer), graph, opts)?;
        let info = check_depformer(&os.session, graph)?;
        let e = |err: ort::Error| ModelError::ort(graph, err);
        let alloc = Allocator::default();
        let wanted = input_placements(&os.session).map_err(e)?;
        let kv_alloc = allocator_at(&os.session, &placement_of(&wanted, "past_key_values.0.key"))
            .map_err(e)?;
        let steps = 2 * m.codebooks;
        let rows = rows.max(1);
        let (s, h, d) = (rows as i64, info.heads as i64, info.head_dim as i64);
        let mut sets: [Vec<Buffer>; 2] = [Vec::new(), Vec::new()];
        for set in sets.iter_mut() {
            for _ in 0..2 * info.layers {
                set.push(
                    Buffer::zeros(&kv_alloc, element(info.kv), &[s, h, steps as i64, d])
                        .map_err(e)?,
                );
            }
        }
        let io = if binding.separate_io || opts.cuda_graph {
            Some(PlainIo::zeros(&kv_alloc, &info, s).map_err(e)?)
        } else {
            None
        };
        // (not when the session fell back to the CPU: `allow_fallback`)
        let graphs = if opts.cuda_graph && matches!(os.provider, Provider::Cuda { .. }) {
            Some(RunOptions::new().map_err(e)?)
        } else {
            None
        };
        let mut b = DepformerBatch {
            io,
            graphs,
            draw: None,
            binding: os.session.create_binding().map_err(e)?,
            host: PlainIo::zeros(&alloc, &info, s).map_err(e)?,
            session: os.session,
            provider: os.provider,
            kv: PingPong { sets },
            alloc,
            kv_alloc,
            wanted,
            rows,
            steps,
            text_limit: m.text_vocab + 1,
            audio_limit: m.audio_vocab + 1,
            bound: None,
            scratch: Vec::with_capacity(info.vocab),
            info,
        };
        if binding.device_sampling {
            b.draw_on_device(graph, opts)?;
        }
        report(opts, graph, b.provider, b.info.kv.name());
        Ok(b)
    }

    /// From the next frame on, draws the audio where the logits are (device sampling: see
    /// [`DepformerBinding`]), the plain inputs and output in buffers of their own there; the
    /// draw's session opened with `opts`, named after `graph`. The tokens stay the same.
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] for logits wider than the audio table; ONNX Runtime's.
    pub fn draw_on_device(&mut self, graph: &str, opts: &SessionOptions) -> Result<(), ModelError> {
        if self.draw.is_some() {
            return Ok(());
        }
        // Every token drawn is fed on as it is: it must be in the audio table.
        if self.info.vocab as i64 > self.audio_limit {
            return Err(ModelError::contract(
                graph,
                format!(
                    "device sampling feeds each drawn token on unchecked: logits of {} values \
                     are wider than the audio table of {}",
                    self.info.vocab, self.audio_limit
                ),
            ));
        }
        let draw = DeviceDraw::open(&self.info, graph, opts, self.rows, self.steps)?;
        if self.io.is_none() {
            let rows = self.rows as i64;
            let io = PlainIo::zeros(&self.kv_alloc, &self.info, rows)
                .map_err(|e| ModelError::ort(graph, e))?;
            self.io = Some(io);
            // (bound again, to those buffers, at the next substep)
            self.bound = None;
        }
        self.draw = Some(draw);
        Ok(())
    }

    /// Substeps per frame (16).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Every KV buffer: its input name, where it is, and where the session wants that input.
    pub fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        kv_placements(
            self.kv.sets.iter().flatten(),
            self.info.layers,
            &self.wanted,
        )
    }

    /// With separate I/O: each of the graph's plain inputs and its output, where its buffer
    /// is and where the session wants it (the output: where the cache is); empty without.
    pub fn io_placements(&self) -> Vec<(String, Placement, Placement)> {
        let Some(io) = &self.io else {
            return Vec::new();
        };
        let at = |name: &str| placement_of(&self.wanted, name);
        vec![
            ("hidden".into(), io.hidden.placement(), at("hidden")),
            ("prev_token".into(), io.prev.placement(), at("prev_token")),
            (
                "substep_index".into(),
                io.substep.placement(),
                at("substep_index"),
            ),
            (
                "logits".into(),
                io.logits.placement(),
                at("past_key_values.0.key"),
            ),
        ]
    }

    /// Checks a frame before it joins a batch (see [`check_frame`]).
    ///
    /// # Errors
    ///
    /// [`ModelError::Contract`] for sizes, [`ModelError::Token`] naming the channel.
    pub fn check(&self, frame: &DepformerInput<'_>) -> Result<(), ModelError> {
        check_frame(
            frame,
            self.info.hidden_dim,
            self.steps,
            self.text_limit,
            self.audio_limit,
        )
    }

    /// Generates the audio tokens of every row's frame (checked with [`check`](Self::check)):
    /// each row's `out` gets one token per substep, its sampler one draw per substep in order.
    /// A sampled token outside the audio table fails its row alone (`error`).
    ///
    /// # Errors
    ///
    /// ONNX Runtime errors (every row's frame is then undone), more rows than the batch holds.
    pub fn run(&mut self, rows: &mut [&mut DepformerRow]) -> Result<(), ModelError> {
        let e = |err: ort::Error| ModelError::ort("depformer", err);
        if rows.len() > self.rows {
            return Err(ModelError::contract(
                "depformer",
                format!("{} frames for a batch of {}", rows.len(), self.rows),
            ));
        }
        let steps = self.steps;
        // Substeps each row needs; rows in decreasing order of it.
        let needed: Vec<usize> = rows
            .iter()
            .map(|j| match j.unused {
                UnusedSubsteps::Run => steps,
                UnusedSubsteps::Skip => (0..steps)
                    .rev()
                    .find(|&cb| !j.provided[cb])
                    .map_or(0, |cb| cb + 1),
            })
            .collect();
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by(|&a, &b| needed[b].cmp(&needed[a]));
        let mut prev: Vec<i64> = order.iter().map(|&i| rows[i].text).collect();
        for (r, &i) in order.iter().enumerate() {
            write_row(&mut self.host.hidden, r, &rows[i].hidden);
            let j = &mut *rows[i];
            j.out.clear();
            j.counts = (0, 0);
            j.error = None;
            if let Some(l) = j.logits.as_mut() {
                l.clear();
            }
        }
        let vocab = self.info.vocab;
        let hd = self.info.hidden_dim as i64;
        let (host, dev) = (&self.alloc, &self.kv_alloc);
        if let Some(io) = self.io.as_mut() {
            let shape = [rows.len() as i64, 1, hd];
            (self.host.hidden)
                .copy_prefix_to(host, &mut io.hidden, dev, &shape)
                .map_err(e)?;
        }
        if let Some(draw) = self.draw.as_mut() {
            draw.load(rows, &order, self.rows, steps, vocab)
                .map_err(e)?;
        }
        let keeps_logits = rows.iter().any(|j| j.logits.is_some());
        let limits = (steps, self.text_limit, self.audio_limit);
        for cb in 0..steps {
            let n = order.iter().filter(|&&i| needed[i] > cb).count();
            if n > 0 {
                self.substep(cb, n, &prev, keeps_logits).map_err(e)?;
            }
            for (r, &i) in order.iter().enumerate() {
                let j = &mut *rows[i];
                if r < n {
                    if let Some(l) = j.logits.as_mut() {
                        read_row(&mut self.host.logits, r, vocab, &mut self.scratch);
                        l.push(self.scratch.clone());
                    }
                    if self.draw.is_some() {
                        continue;
                    }
                    if j.logits.is_none() {
                        read_row(&mut self.host.logits, r, vocab, &mut self.scratch);
                    }
                    let tok = j.sampler.sample(&self.scratch, j.params) as i64;
                    prev[r] = Self::record(j, cb, tok, limits);
                } else if self.draw.is_none() {
                    j.sampler.skip(j.params);
                    j.out.push(j.target[cb]);
                    prev[r] = j.target[cb];
                    j.counts.1 += 1;
                }
            }
        }
        if let Some(draw) = self.draw.as_mut() {
            draw.tokens.download(steps * self.rows).map_err(e)?;
            for cb in 0..steps {
                for (r, &i) in order.iter().enumerate() {
                    let j = &mut *rows[i];
                    if needed[i] > cb {
                        let tok = draw.tokens.host.as_slice::<i64>()[cb * self.rows + r];
                        // (its checks, as the host draw's; the graph fed it on already)
                        Self::record(j, cb, tok, limits);
                    } else {
                        j.out.push(j.target[cb]);
                        j.counts.1 += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Substep `cb`'s graph call for the first `n` rows (in the run's order): their previous
    /// tokens fed (unless the device's draw fed them), the call, and its logits drawn on the
    /// device or brought to the host.
    fn substep(
        &mut self,
        cb: usize,
        n: usize,
        prev: &[i64],
        keeps_logits: bool,
    ) -> Result<(), ort::Error> {
        let (h, d) = (self.info.heads as i64, self.info.head_dim as i64);
        let vocab = self.info.vocab;
        self.bind_rows(n)?;
        // With device sampling, the draw of the substep before fed this one.
        let feed = self.draw.is_none() || cb == 0;
        if feed {
            self.host.prev.as_slice::<i64>()[..n].copy_from_slice(&prev[..n]);
        }
        self.host.substep.as_slice::<i64>()[0] = cb as i64;
        if let Some(io) = self.io.as_mut() {
            let (host, dev) = (&self.alloc, &self.kv_alloc);
            if feed {
                (self.host.prev).copy_prefix_to(host, &mut io.prev, dev, &[n as i64, 1])?;
            }
            (self.host.substep).copy_prefix_to(host, &mut io.substep, dev, &[])?;
        }
        self.kv.bind_batch(
            &mut self.binding,
            &self.kv_alloc,
            cb % 2,
            n as i64,
            h,
            cb as i64,
            d,
        )?;
        match self.graphs.as_mut() {
            // One captured graph per (substep, rows): ids from 1 (0 is the default).
            Some(ro) => {
                let id = 1 + cb * self.rows + (n - 1);
                ro.set("gpu_graph_id", id.to_string())?;
                drop(self.session.run_binding_with_options(&self.binding, ro)?);
            }
            None => drop(self.session.run_binding(&self.binding)?),
        }
        if let Some(io) = self.io.as_mut() {
            let (host, dev) = (&self.alloc, &self.kv_alloc);
            if let Some(draw) = self.draw.as_mut() {
                let logits = io.logits.view(dev, &[n as i64, 1, vocab as i64])?;
                let next = io.prev.view(dev, &[n as i64, 1])?;
                draw.run(cb, n, self.rows, &logits, next)?;
            }
            if self.draw.is_none() || keeps_logits {
                (io.logits).copy_prefix_to(
                    dev,
                    &mut self.host.logits,
                    host,
                    &[n as i64, 1, vocab as i64],
                )?;
            }
        }
        Ok(())
    }

    /// Records substep `cb`'s drawn token `tok` in a row: its output, its count, and what the
    /// next substep is fed (the provided token where there is one; a token outside the audio
    /// table fails the row, and 0 is fed meanwhile: the row's output is refused anyway).
    /// `limits`: the substeps, the text and the audio table's sizes.
    fn record(j: &mut DepformerRow, cb: usize, tok: i64, limits: (usize, i64, i64)) -> i64 {
        let (steps, text_limit, audio_limit) = limits;
        j.out.push(tok);
        j.counts.0 += 1;
        let fed = if j.provided[cb] { j.target[cb] } else { tok };
        if cb + 1 < steps && !(0..audio_limit).contains(&fed) {
            if j.error.is_none() {
                j.error = Some(token_error(cb + 1, fed, text_limit, audio_limit));
            }
            return 0;
        }
        fed
    }

    /// Binds the plain inputs and the output at `n` rows, when they are bound at another size.
    fn bind_rows(&mut self, n: usize) -> ort::Result<()> {
        if self.bound == Some(n) {
            return Ok(());
        }
        let bn = n as i64;
        let hd = self.info.hidden_dim as i64;
        let (a, b) = match self.io.as_mut() {
            Some(io) => (&self.kv_alloc, io),
            None => (&self.alloc, &mut self.host),
        };
        let v = b.hidden.view(a, &[bn, 1, hd])?;
        self.binding.bind_input("hidden", &v)?;
        let v = b.prev.view(a, &[bn, 1])?;
        self.binding.bind_input("prev_token", &v)?;
        let v = b.substep.view(a, &[])?;
        self.binding.bind_input("substep_index", &v)?;
        let v = b.logits.view(a, &[bn, 1, self.info.vocab as i64])?;
        self.binding.bind_output("logits", v)?;
        self.bound = Some(n);
        Ok(())
    }
}

/// The depformer of a pack, for one conversation: a [`DepformerBatch`] of one row.
pub struct Depformer {
    batch: DepformerBatch,
    row: DepformerRow,
    /// What the graph says about itself.
    pub info: LmGraphInfo,
    /// The execution provider in use.
    pub provider: Provider,
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
        Self::open_with(pack, opts, DepformerBinding::default())
    }

    /// [`open`](Self::open) with `binding`: the graph's plain inputs and output in buffers of
    /// their own where the session computes (what a CUDA graph needs; `cuda_graph` in `opts`
    /// implies it and captures each substep's call), the audio drawn there.
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open); [`ModelError::Contract`] for `cuda_graph` off CUDA.
    pub fn open_with(
        pack: &Pack,
        opts: &SessionOptions,
        binding: DepformerBinding,
    ) -> Result<Depformer, ModelError> {
        let batch = DepformerBatch::open_with(pack, "depformer", opts, 1, binding)?;
        Ok(Depformer {
            info: batch.info.clone(),
            provider: batch.provider,
            batch,
            row: DepformerRow::new(),
            unused: UnusedSubsteps::Run,
            counts: (0, 0),
            keep_logits: false,
            logits: Vec::new(),
        })
    }

    /// With separate I/O ([`open_with`](Self::open_with)): where the graph's plain inputs and
    /// output are, and where the session wants them; empty without.
    pub fn io_placements(&self) -> Vec<(String, Placement, Placement)> {
        self.batch.io_placements()
    }

    /// Every KV buffer: its input name, where it is, and where the session wants that input.
    pub fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        self.batch.cache_placements()
    }

    /// Substeps per frame (16).
    pub fn steps(&self) -> usize {
        self.batch.steps()
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
        self.batch.check(&frame)?;
        let steps = self.batch.steps();
        let logits = self.keep_logits.then(|| std::mem::take(&mut self.logits));
        let row = &mut self.row;
        row.load(frame, steps, sampler, params, self.unused, logits);
        let ran = self.batch.run(&mut [&mut *row]);
        row.return_sampler(sampler);
        ran?;
        row.unload(out, &mut self.counts, &mut self.logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch of rows with their own sampling (a top-k, all the vocabulary, greedy, a top-1),
    /// provided tokens and substeps, drawn where the logits are: the same tokens, counts and
    /// kept logits as the host draw, frame after frame, and each row's random stream left where
    /// the host's leaves it.
    #[test]
    fn device_sampling_draws_what_the_host_draws_row_by_row() {
        let params = [
            SamplingParams::AUDIO,
            SamplingParams {
                temperature: 1.7,
                top_k: 0,
            },
            SamplingParams::GREEDY,
            SamplingParams {
                temperature: 0.9,
                top_k: 1,
            },
        ];
        let n = params.len();
        for name in ["tiny-gqa", "tiny-gqa-fp16"] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("models")
                .join(name);
            let pack = Pack::open(&dir).unwrap();
            let opts = SessionOptions::default();
            let mut host = DepformerBatch::open(&pack, "depformer", &opts, n).unwrap();
            let device = DepformerBinding {
                separate_io: false,
                device_sampling: true,
            };
            let mut dev = DepformerBatch::open_with(&pack, "depformer", &opts, n, device).unwrap();
            let steps = host.steps();
            let mut a: Vec<DepformerRow> = (0..n).map(|_| DepformerRow::new()).collect();
            let mut b: Vec<DepformerRow> = (0..n).map(|_| DepformerRow::new()).collect();
            let mut samplers: Vec<(Sampler, Sampler)> = (0..n as u64)
                .map(|i| (Sampler::new(40 + i), Sampler::new(40 + i)))
                .collect();
            let mut sampled = 0;
            for f in 0..30usize {
                for r in 0..n {
                    let hidden: Vec<f32> = (0..host.info.hidden_dim)
                        .map(|i| (((i * 37 + f * 11 + r * 5) % 101) as f32 / 50.0 - 1.0) * 3.0)
                        .collect();
                    let target: Vec<i64> = (0..steps)
                        .map(|i| ((i * 131 + f * 17 + r) % 2048) as i64)
                        .collect();
                    // Row r: its last (r + f) % 9 + 4 substeps provided.
                    let from = steps.saturating_sub((r + f) % 9 + 4);
                    let provided: Vec<bool> = (0..steps).map(|i| i >= from).collect();
                    let frame = DepformerInput {
                        hidden: &hidden,
                        text: ((f + r) % 7) as i64,
                        target: &target,
                        provided: &provided,
                    };
                    let unused = if (f + r) % 3 == 0 {
                        UnusedSubsteps::Run
                    } else {
                        UnusedSubsteps::Skip
                    };
                    let keep = (r == 1).then(Vec::new);
                    let (sa, sb) = &mut samplers[r];
                    a[r].load(frame, steps, sa, params[r], unused, keep.clone());
                    b[r].load(frame, steps, sb, params[r], unused, keep);
                }
                host.run(&mut a.iter_mut().collect::<Vec<_>>()).unwrap();
                dev.run(&mut b.iter_mut().collect::<Vec<_>>()).unwrap();
                for r in 0..n {
                    let (x, y) = (&a[r], &b[r]);
                    assert_eq!(x.out, y.out, "{name}: frame {f}, row {r}");
                    assert_eq!(x.counts, y.counts, "{name}: frame {f}, row {r}");
                    assert!(x.error.is_none() && y.error.is_none());
                    assert_eq!(x.logits, y.logits, "{name}: frame {f}, row {r}");
                    sampled += x.counts.0;
                    let (sa, sb) = &mut samplers[r];
                    a[r].return_sampler(sa);
                    b[r].return_sampler(sb);
                }
            }
            assert!(sampled > 1000, "{sampled} substeps drawn");
            for (r, (sa, sb)) in samplers.iter_mut().enumerate() {
                assert_eq!(
                    sa.take_draw(SamplingParams::AUDIO),
                    sb.take_draw(SamplingParams::AUDIO),
                    "{name}: row {r}'s stream"
                );
            }
        }
    }
}
