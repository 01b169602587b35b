//! A temporal transformer of the conversation's own, for what the GQA batch at one row cannot
//! express: the standard graph's attention window (ping-pong buffers), the host-fed cache (for
//! measurement), and fixed shapes (the GQA cache bound once at full width, the mask
//! right-padded, inputs and outputs at fixed device addresses: what CUDA graph replay needs).

use std::sync::Arc;

use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;

use super::buffers::{cache_buffers, host_presents, DeviceIo};
use super::{
    element_bytes, ort_err, state_shape, ChunkIo, FrameLimits, KvMode, RowSpan, TemporalOptions,
    TemporalState, TemporalStep,
};
use crate::model::error::ModelError;
use crate::model::pack::{FloatType, LmGraphInfo, Pack, Variant};
use crate::model::session::{report, OpenSession, Provider};
use crate::model::tensors::{
    allocator_at, element, input_placements, kv_placements, placement_of, read_floats, read_row,
    Buffer, PingPong, Placement,
};

enum Kv {
    InPlace,
    PingPong { cur: usize },
    Host { past: Vec<Buffer> },
}

/// A temporal transformer of the conversation's own (see the module's doc for what it holds
/// that the batch cannot).
pub struct OwnTemporal {
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
    limits: FrameLimits,
    window: usize,
    capacity: usize,
    len: usize,
    pos: usize,
    /// Prefill's buffers, made at its first use.
    chunk: Option<ChunkIo>,
    /// The row of `chunk`'s outputs that holds the last step's (after a prefill).
    chunk_last: Option<usize>,
}

impl OwnTemporal {
    /// The transformer on an opened and checked graph (`open` chose it: the standard graph,
    /// the host-fed cache, or fixed shapes on the GQA graph).
    ///
    /// # Errors
    ///
    /// ONNX Runtime errors (allocation included).
    pub(super) fn new(
        os: OpenSession,
        info: LmGraphInfo,
        pack: &Pack,
        opts: &TemporalOptions,
    ) -> Result<OwnTemporal, ModelError> {
        let graph = "temporal";
        let m = &pack.manifest;
        let channels = m.delays.len();
        let fixed = opts.fixed_shapes || opts.cuda_graph;
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
        let mut t = OwnTemporal {
            binding: os.session.create_binding().map_err(&e)?,
            kv: match (opts.kv, info.variant) {
                (KvMode::Host, _) => Kv::Host { past: Vec::new() },
                // GQA with a resident cache comes here only for fixed shapes.
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
            limits: FrameLimits::of(pack),
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
                .view(&self.kv_alloc, &[1, self.limits.channels as i64, 1])
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
            .view(&self.alloc, &[1, self.limits.channels as i64, 1])
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
            let row = self.info.head_dim * if self.info.kv == FloatType::F16 { 2 } else { 4 };
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
        let (c, cap) = (self.limits.channels as i64, self.capacity as i64);
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

    /// Where a state's rows live: the rows per head of the buffers that hold them now, and
    /// which set; `None` for the caches a state cannot be taken from.
    fn state_layout(&self) -> Option<(usize, usize)> {
        match self.kv {
            // A view of the current length: rows laid out compactly, head after head.
            Kv::PingPong { cur } => Some((self.len, cur)),
            // Fixed shapes (the batch at one row takes states of the GQA graph), host-fed.
            Kv::InPlace | Kv::Host { .. } => None,
        }
    }

    /// One graph call on `frames` (at most `chunk`, fitting the cache).
    fn run_chunk(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        let e = ort_err("temporal");
        let (n, c) = (frames.len(), self.limits.channels);
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

impl TemporalStep for OwnTemporal {
    fn info(&self) -> &LmGraphInfo {
        &self.info
    }

    fn provider(&self) -> Provider {
        self.provider
    }

    fn reset(&mut self) {
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

    fn kv_len(&self) -> usize {
        self.len
    }

    fn position(&self) -> usize {
        self.pos
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn step(&mut self, input: &[i64]) -> Result<(), ModelError> {
        self.limits
            .check_step(input, self.pos, self.positions_left())?;
        let e = ort_err("temporal");
        self.chunk_last = None;
        self.frame.as_slice::<i64>()[..self.limits.channels].copy_from_slice(input);
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

    fn prefill(&mut self, frames: &[Vec<i64>], chunk: usize) -> Result<(), ModelError> {
        self.limits
            .check_prefill(frames, self.pos, self.positions_left())?;
        // Where a chunk cannot be exact it steps: the fixed-shape and host-fed caches, and the
        // standard graph's frames past its attention window (a chunk would attend to rows the
        // window drops).
        let chunk = chunk.max(1);
        let chunked = self.io.is_none() && !matches!(self.kv, Kv::Host { .. }) && chunk > 1;
        let mut at = 0;
        while at < frames.len() {
            // The window's rows, before any would be dropped.
            let room = (self.window - 1).saturating_sub(self.len);
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

    fn snapshot(&mut self) -> Option<TemporalState> {
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

    fn restore(&mut self, state: &Arc<TemporalState>) -> Result<(), ModelError> {
        let bad = |why: &str| ModelError::contract("temporal", format!("restoring a state: {why}"));
        if state.shape != state_shape(&self.info) {
            return Err(bad("it is of another graph"));
        }
        // Empty, and a ping-pong cache back on its first set.
        self.reset();
        let Some((_, set)) = self.state_layout() else {
            return Err(bad("this cache cannot take one"));
        };
        // Compact at the state's length, inside the window.
        if state.len > self.window - 1 {
            return Err(bad("it is longer than the attention window"));
        }
        let rows_cap = state.len;
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

    fn read_hidden(&mut self, out: &mut Vec<f32>) {
        match (self.chunk_last, self.chunk.as_mut()) {
            (Some(r), Some(c)) => read_row(&mut c.hidden, r, self.info.hidden_dim, out),
            _ => read_floats(&mut self.hidden, self.info.hidden_dim, out),
        }
    }

    fn read_logits(&mut self, out: &mut Vec<f32>) {
        match (self.chunk_last, self.chunk.as_mut()) {
            (Some(r), Some(c)) => read_row(&mut c.logits, r, self.info.vocab, out),
            _ => read_floats(&mut self.logits, self.info.vocab, out),
        }
    }

    fn cache_placements(&self) -> Vec<(String, Placement, Placement)> {
        kv_placements(&self.cache.sets[0], self.info.layers, &self.wanted)
    }

    fn io_placements(&self) -> Vec<(String, Placement, Placement)> {
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

    fn key_cache_value(&mut self, layer: usize, row: usize) -> Option<f32> {
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
            FloatType::F32 => buf.as_slice::<f32>().get(idx).copied(),
            FloatType::F16 => buf.as_slice::<half::f16>().get(idx).map(|v| v.to_f32()),
        }
    }
}
