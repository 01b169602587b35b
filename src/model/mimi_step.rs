//! Stateful streaming Mimi: one 1920-sample frame per call on step graphs whose state is
//! explicit, so that one frame costs one frame of work and the stream equals offline coding.
//!
//! A pack's `mimi_encoder_step/` and `mimi_decoder_step/` (and their `_f16` twins, built by
//! `tools/make_mimi_step.py`) each hold a graph and its `state.json`: every state tensor's
//! input and output names, shape without the batch dimension, element type and initial value.
//! Nothing here lists the codec's layers: the manifest does.
//!
//! Each state tensor is allocated once. A state the graph updates in place (the transformer's
//! K/V rings, written by `TensorScatter`) is bound as both input and output, so no call copies
//! it; every other state (conv tails, counters) has two buffers, read from one and written to
//! the other, and the two bindings of every row are built once and alternate. A call writes the
//! frame into a bound input, runs, and reads the bound output: no allocation, no copy of the
//! state (a call over part of the rows copies the small conv tails and counters of the others).
//!
//! A codec opened with [`StepCodec::open_rows`] steps several streams in one call, one batch
//! row each; each row keeps its own state and counters, so a row can start a new stream
//! ([`StepCodec::reset_row`]) while the others go on. Graphs with the `active` input (the
//! manifest's `active`) step only the rows that have a frame and leave the others exactly as
//! they were ([`StepCodec::encode_some`], [`StepCodec::decode_some`]): what a shared codec's
//! tick needs, since its conversations' frames do not all come at once. Such a call runs over
//! the rows from the first stepped to the last alone (views of those rows, bound the first
//! time that span is asked for), so a tick costs the rows in it, not every slot; the copied
//! states of the rows outside are carried over to the set the next call reads.
//!
//! Every state is allocated where the session reads it (ONNX Runtime's own answer per input:
//! device memory under CUDA, reset there through ONNX Runtime's copy), so a call moves only the
//! frame in and the frame out between host and device ([`StepCodec::state_placements`]). States
//! in a device's memory are stepped every row on every call (the flags keep the rows without a
//! frame as they were).
//!
//! This module knows the step graphs' contract, not the stages that use them.

use std::path::Path;

use ort::memory::Allocator;
use ort::session::{IoBinding, Session};
use ort::value::TensorElementType;
use serde::Deserialize;

use super::error::ModelError;
use super::pack::{FloatType, Pack, StepRole};
use super::session::{open, report, Provider, SessionOptions};
use super::tensors::{allocator_at, input_placements, placement_of, Buffer, Placement};

/// `state.json`: what a step graph keeps from call to call.
#[derive(Debug, Clone, Deserialize)]
pub struct StepManifest {
    /// Format version (1).
    pub format: u32,
    /// `encoder` or `decoder`.
    pub role: String,
    /// `f32` or `f16`: the graph's compute precision (PCM stays f32 at its edges).
    pub dtype: String,
    /// Samples per call (1920).
    pub frame_samples: usize,
    /// Codebooks per frame (8).
    pub codebooks: usize,
    /// The codec transformer's attention context, in 25 Hz frames (250).
    pub context: usize,
    /// Slots of each K/V ring.
    pub window: usize,
    /// The encoder's RVQ distance form (`gemm` or `broadcast`).
    pub rvq: Option<String>,
    /// The frame input's name (`pcm` or `codes`).
    pub input: String,
    /// The frame output's name (`codes` or `pcm`).
    pub output: String,
    /// The per-row `active` input (bool, one per batch row): a row whose flag is false keeps
    /// every state bit for bit. Absent in graphs built before it, which step every row on
    /// every call and cannot serve a shared codec.
    #[serde(default)]
    pub active: Option<String>,
    /// Every state tensor.
    pub states: Vec<StateSpec>,
}

/// One state tensor.
#[derive(Debug, Clone, Deserialize)]
pub struct StateSpec {
    /// A name for messages (`encoder.model.0`, `decoder_transformer.3.k`).
    pub name: String,
    /// The graph input it is read from.
    pub input: String,
    /// The graph output its next value is written to.
    pub output: String,
    /// Its shape after the batch dimension.
    pub shape: Vec<i64>,
    /// `f32`, `f16` or `i64`.
    pub dtype: String,
    /// Its value at the start of a stream (`zeros`).
    pub init: String,
    /// Whether the graph writes the next value over the input (bind one buffer to both).
    pub inplace: bool,
}

impl StepManifest {
    /// Reads and checks `dir/state.json`.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] naming the file and what is wrong with it.
    pub fn read(dir: &Path) -> Result<StepManifest, ModelError> {
        let path = dir.join("state.json");
        let bad = |detail: String| ModelError::Pack {
            path: path.clone(),
            detail,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let m: StepManifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if m.format != 1 {
            return Err(bad(format!(
                "format {} (this build reads format 1)",
                m.format
            )));
        }
        for s in &m.states {
            if s.init != "zeros" {
                return Err(bad(format!(
                    "state `{}`: initial value {:?} (only zeros is known)",
                    s.name, s.init
                )));
            }
            if !matches!(s.dtype.as_str(), "f32" | "f16" | "i64") {
                return Err(bad(format!(
                    "state `{}`: element type {:?} (f32, f16 or i64)",
                    s.name, s.dtype
                )));
            }
            if s.shape.iter().any(|&d| d < 0) {
                return Err(bad(format!(
                    "state `{}`: shape {:?} has a negative dimension",
                    s.name, s.shape
                )));
            }
        }
        Ok(m)
    }
}

fn element_of(dtype: &str) -> TensorElementType {
    match dtype {
        "f16" => TensorElementType::Float16,
        "i64" => TensorElementType::Int64,
        _ => TensorElementType::Float32,
    }
}

/// One state tensor's buffers: one when updated in place, else two (read one, write the other).
struct State {
    bufs: Vec<Buffer>,
}

/// Every buffer a call binds.
struct Io {
    states: Vec<State>,
    /// Whether every state is in host memory (else a call runs every row).
    on_host: bool,
    input: Buffer,
    output: Buffer,
    /// The `active` flags (one byte per row), when the graph has them.
    active: Option<Buffer>,
    /// Elements of one row of the frame input and of the output.
    in_row: usize,
    out_row: usize,
}

impl Io {
    /// A binding of rows `lo..lo + n` of every buffer: a call that reads state set `parity`
    /// and writes the other (in-place states: their one buffer).
    fn bind(
        &mut self,
        session: &Session,
        manifest: &StepManifest,
        alloc: &Allocator,
        lo: usize,
        n: usize,
        parity: usize,
    ) -> ort::Result<IoBinding> {
        let batch = n as i64;
        let mut b = session.create_binding()?;
        let shape = |row: &[i64]| {
            let mut v = vec![batch];
            v.extend(row);
            v
        };
        let (in_shape, out_shape) = match manifest.input.as_str() {
            "pcm" => (
                shape(&[1, self.in_row as i64]),
                shape(&[self.out_row as i64, 1]),
            ),
            _ => (
                shape(&[self.in_row as i64, 1]),
                shape(&[1, self.out_row as i64]),
            ),
        };
        let v = self.input.view_at(alloc, lo * self.in_row, &in_shape)?;
        b.bind_input(manifest.input.as_str(), &v)?;
        if let (Some(name), Some(buf)) = (&manifest.active, self.active.as_mut()) {
            let v = buf.view_at(alloc, lo, &[batch])?;
            b.bind_input(name.as_str(), &v)?;
        }
        let v = self.output.view_at(alloc, lo * self.out_row, &out_shape)?;
        b.bind_output(manifest.output.as_str(), v)?;
        for (s, st) in manifest.states.iter().zip(self.states.iter_mut()) {
            let row = s.shape.iter().product::<i64>().max(0) as usize;
            let shape = shape(&s.shape);
            let (r, w) = if s.inplace {
                (0, 0)
            } else {
                (parity, 1 - parity)
            };
            let v = st.bufs[r].view_at(alloc, lo * row, &shape)?;
            b.bind_input(s.input.as_str(), &v)?;
            let v = st.bufs[w].view_at(alloc, lo * row, &shape)?;
            b.bind_output(s.output.as_str(), v)?;
        }
        Ok(b)
    }

    /// Carries the state of the rows outside `lo..lo + n` over to the set the next call reads
    /// (a call over those rows alone leaves the other rows' copied states in the set it read).
    fn carry_outside(&mut self, manifest: &StepManifest, lo: usize, n: usize, parity: usize) {
        for (s, st) in manifest.states.iter().zip(self.states.iter_mut()) {
            if st.bufs.len() < 2 {
                continue;
            }
            let row = s.shape.iter().product::<i64>().max(0) as usize * st.bufs[0].element_bytes();
            let (a, b) = st.bufs.split_at_mut(1);
            let (read, write) = if parity == 0 {
                (&mut a[0], &mut b[0])
            } else {
                (&mut b[0], &mut a[0])
            };
            let (read, write) = (read.as_bytes(), write.as_bytes());
            let total = read.len().min(write.len());
            for range in [0..(lo * row).min(total), ((lo + n) * row).min(total)..total] {
                write[range.clone()].copy_from_slice(&read[range]);
            }
        }
    }
}

/// A step graph with its state: the codec side of one stream, or of `rows` streams stepped
/// together (one batch row each, every row a frame per call).
pub struct StepCodec {
    /// Bindings of a part of the rows (`lo`, `n`), made when a call first needs them; both
    /// binding sets are dropped before the buffers they view.
    spans: std::collections::HashMap<(usize, usize), [IoBinding; 2]>,
    /// Two bindings of every row built once: even calls read set 0 and write set 1, odd calls
    /// the reverse.
    bindings: [IoBinding; 2],
    session: Session,
    io: Io,
    alloc: Allocator,
    /// Where the session reads each input.
    wanted: Vec<(String, Placement)>,
    parity: usize,
    graph: &'static str,
    /// What the graph says about itself.
    pub manifest: StepManifest,
    /// The execution provider in use.
    pub provider: Provider,
    /// The compute precision.
    pub dtype: FloatType,
    /// Calls since the last reset.
    pub frames: u64,
    /// Streams (batch rows) stepped per call.
    pub rows: usize,
}

impl StepManifest {
    /// Whether this step graph fits `pack`: its direction for `role`, frame size, codebooks.
    fn check_fits(&self, dir: &Path, pack: &Pack, role: StepRole) -> Result<(), ModelError> {
        let graph = role.graph();
        let manifest = self;
        let m = &pack.manifest;
        let (want_in, want_out) = match role {
            StepRole::Encoder => ("pcm", "codes"),
            StepRole::Decoder => ("codes", "pcm"),
        };
        if manifest.input != want_in
            || manifest.output != want_out
            || manifest.frame_samples != m.frame_size
            || manifest.codebooks != m.codebooks
        {
            return Err(ModelError::Pack {
                path: dir.join("state.json"),
                detail: format!(
                    "a {graph} of {} samples and {} codebooks ({} -> {}) does not fit this pack \
                     ({} samples, {} codebooks, {want_in} -> {want_out})",
                    manifest.frame_samples,
                    manifest.codebooks,
                    manifest.input,
                    manifest.output,
                    m.frame_size,
                    m.codebooks
                ),
            });
        }
        Ok(())
    }
}

/// The graph's inputs and outputs must be the manifest's, no more, no less.
fn check_names(session: &Session, manifest: &StepManifest, graph: &str) -> Result<(), ModelError> {
    let (inputs, outputs) = super::session::io_names(session);
    let mut want_inputs: Vec<String> = manifest.states.iter().map(|s| s.input.clone()).collect();
    want_inputs.push(manifest.input.clone());
    want_inputs.extend(manifest.active.clone());
    let mut want_outputs: Vec<String> = manifest.states.iter().map(|s| s.output.clone()).collect();
    want_outputs.push(manifest.output.clone());
    for (kind, have, want) in [
        ("input", &inputs, &want_inputs),
        ("output", &outputs, &want_outputs),
    ] {
        if let Some(missing) = want.iter().find(|n| !have.contains(n)) {
            return Err(ModelError::contract(
                graph,
                format!("state.json names {kind} `{missing}`, which the graph does not have"),
            ));
        }
        if let Some(extra) = have.iter().find(|n| !want.contains(n)) {
            return Err(ModelError::contract(
                graph,
                format!("the graph's {kind} `{extra}` is not in state.json"),
            ));
        }
    }
    Ok(())
}

/// Every state's buffers (two unless updated in place), `batch` rows each, where the session
/// reads them (device memory under CUDA: only the frame in and the frame out cross to the
/// host), at zero.
fn state_buffers(
    session: &Session,
    wanted: &[(String, Placement)],
    manifest: &StepManifest,
    batch: i64,
) -> ort::Result<Vec<State>> {
    let mut states = Vec::with_capacity(manifest.states.len());
    for s in &manifest.states {
        let mut shape = vec![batch];
        shape.extend(&s.shape);
        let n = if s.inplace { 1 } else { 2 };
        let at = allocator_at(session, &placement_of(wanted, &s.input))?;
        let mut bufs = (0..n)
            .map(|_| Buffer::zeros(&at, element_of(&s.dtype), &shape))
            .collect::<ort::Result<Vec<_>>>()?;
        for b in bufs.iter_mut().filter(|b| !b.on_host()) {
            // Device memory comes as the device gives it: a state starts at zero.
            let n = b.capacity;
            b.zero_at(&at, 0, n)?;
        }
        states.push(State { bufs });
    }
    Ok(states)
}

impl StepCodec {
    /// What the graph runs on: `cpu f32 stateful`.
    pub fn runs_on(&self) -> String {
        format!("{} {} stateful", self.provider.name(), self.dtype.name())
    }

    /// Opens the pack's `role` step graph of precision `dtype`.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] when the pack has no such graph or its manifest is wrong,
    /// contract errors when the graph disagrees with its manifest, provider and ONNX Runtime
    /// errors.
    pub fn open(
        pack: &Pack,
        role: StepRole,
        dtype: FloatType,
        opts: &SessionOptions,
    ) -> Result<StepCodec, ModelError> {
        Self::open_rows(pack, role, dtype, opts, 1)
    }

    /// As [`open`](Self::open), for `rows` streams stepped together: every state, the frame
    /// input and the output have `rows` batch rows ([`encode_rows`](Self::encode_rows),
    /// [`decode_rows`](Self::decode_rows), [`reset_row`](Self::reset_row)).
    ///
    /// # Errors
    ///
    /// As [`open`](Self::open).
    pub fn open_rows(
        pack: &Pack,
        role: StepRole,
        dtype: FloatType,
        opts: &SessionOptions,
        rows: usize,
    ) -> Result<StepCodec, ModelError> {
        let graph = role.graph();
        let rows = rows.max(1);
        let batch = rows as i64;
        let Some(dir) = pack.step_graph(role, dtype) else {
            return Err(ModelError::Pack {
                path: pack.dir.clone(),
                detail: format!(
                    "no {graph} graph of precision {} (build it with tools/make_mimi_step.py)",
                    dtype.name()
                ),
            });
        };
        let manifest = StepManifest::read(&dir)?;
        manifest.check_fits(&dir, pack, role)?;
        let m = &pack.manifest;
        let os = open(&dir.join("model.onnx"), graph, opts)?;
        let e = |err: ort::Error| ModelError::ort(graph, err);
        check_names(&os.session, &manifest, graph)?;
        let alloc = Allocator::default();
        let wanted = input_placements(&os.session).map_err(e)?;
        let states = state_buffers(&os.session, &wanted, &manifest, batch).map_err(e)?;
        let pcm = (
            TensorElementType::Float32,
            vec![batch, 1, m.frame_size as i64],
        );
        let codes = (TensorElementType::Int64, vec![batch, m.codebooks as i64, 1]);
        let ((in_ty, in_shape), (out_ty, out_shape)) = match role {
            StepRole::Encoder => (pcm, codes),
            StepRole::Decoder => (codes, pcm),
        };
        let input = Buffer::zeros(&alloc, in_ty, &in_shape).map_err(e)?;
        let output = Buffer::zeros(&alloc, out_ty, &out_shape).map_err(e)?;
        let active = match &manifest.active {
            Some(_) => {
                let mut b = Buffer::zeros(&alloc, TensorElementType::Bool, &[batch]).map_err(e)?;
                b.as_bytes().fill(1);
                Some(b)
            }
            None => None,
        };
        let mut io = Io {
            on_host: states.iter().all(|st| st.bufs.iter().all(Buffer::on_host)),
            states,
            input,
            output,
            active,
            in_row: in_shape[1..].iter().product::<i64>() as usize,
            out_row: out_shape[1..].iter().product::<i64>() as usize,
        };
        let bindings = [
            io.bind(&os.session, &manifest, &alloc, 0, rows, 0)
                .map_err(e)?,
            io.bind(&os.session, &manifest, &alloc, 0, rows, 1)
                .map_err(e)?,
        ];
        let dtype_name = dtype.name();
        report(opts, graph, os.provider, dtype_name);
        tracing::debug!(
            graph,
            states = manifest.states.len(),
            in_place = manifest.states.iter().filter(|s| s.inplace).count(),
            "step graph bound"
        );
        Ok(StepCodec {
            spans: std::collections::HashMap::new(),
            wanted,
            bindings,
            session: os.session,
            io,
            alloc,
            parity: 0,
            graph,
            provider: os.provider,
            dtype,
            frames: 0,
            rows,
            manifest,
        })
    }

    /// Starts a new stream in batch row `row` alone: its state back to its initial value, the
    /// other rows' untouched.
    ///
    /// # Errors
    ///
    /// ONNX Runtime's copy, for states in a device's memory.
    pub fn reset_row(&mut self, row: usize) -> Result<(), ModelError> {
        if row >= self.rows {
            return Ok(());
        }
        let (graph, alloc) = (self.graph, &self.alloc);
        for (s, st) in self.manifest.states.iter().zip(self.io.states.iter_mut()) {
            let n = s.shape.iter().product::<i64>().max(0) as usize;
            for b in &mut st.bufs {
                b.zero_at(alloc, row * n, n)
                    .map_err(|e| ModelError::ort(graph, e))?;
            }
        }
        Ok(())
    }

    /// Starts a new stream: every state back to its initial value.
    ///
    /// # Errors
    ///
    /// ONNX Runtime's copy, for states in a device's memory.
    pub fn reset(&mut self) -> Result<(), ModelError> {
        let (graph, alloc) = (self.graph, &self.alloc);
        for st in &mut self.io.states {
            for b in &mut st.bufs {
                let n = b.capacity;
                b.zero_at(alloc, 0, n)
                    .map_err(|e| ModelError::ort(graph, e))?;
            }
        }
        self.parity = 0;
        self.frames = 0;
        Ok(())
    }

    /// One call over rows `lo..lo + n` alone; the other rows keep their state.
    fn run_span(&mut self, lo: usize, n: usize) -> Result<(), ModelError> {
        let graph = self.graph;
        let e = |err| ModelError::ort(graph, err);
        // States in a device's memory: every call runs every row (no carry-over to do there).
        let (lo, n) = if self.io.on_host {
            (lo, n)
        } else {
            (0, self.rows)
        };
        let binding = if lo == 0 && n == self.rows {
            &self.bindings[self.parity]
        } else {
            if !self.spans.contains_key(&(lo, n)) {
                // A few spans recur (the rows the conversations hold): keep a bounded few.
                if self.spans.len() >= 64 {
                    self.spans.clear();
                }
                let (io, m, a) = (&mut self.io, &self.manifest, &self.alloc);
                let set = [
                    io.bind(&self.session, m, a, lo, n, 0).map_err(e)?,
                    io.bind(&self.session, m, a, lo, n, 1).map_err(e)?,
                ];
                self.spans.insert((lo, n), set);
            }
            &self.spans[&(lo, n)][self.parity]
        };
        drop(self.session.run_binding(binding).map_err(e)?);
        if n < self.rows {
            self.io.carry_outside(&self.manifest, lo, n, self.parity);
        }
        self.parity ^= 1;
        self.frames += 1;
        Ok(())
    }

    /// The rows a call with these flags must cover: from the first row stepped to the last
    /// (`None`: all rows; `Some((0, 0))`: none).
    fn span_of(&self, active: Option<&[bool]>) -> (usize, usize) {
        match active {
            None => (0, self.rows),
            Some(a) => match (a.iter().position(|x| *x), a.iter().rposition(|x| *x)) {
                (Some(lo), Some(hi)) => (lo, hi + 1 - lo),
                _ => (0, 0),
            },
        }
    }

    /// Encodes the next frame of exactly `frame_samples` samples (encoder graphs of one row);
    /// returns its codes.
    ///
    /// # Errors
    ///
    /// A frame of the wrong size, a decoder graph, ONNX Runtime errors.
    pub fn encode(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        self.encode_rows(frame)
    }

    /// Encodes the next frame of every row at once: `frames` holds `rows` frames of
    /// `frame_samples` samples, row after row; returns `rows` × `codebooks` codes, row after
    /// row.
    ///
    /// # Errors
    ///
    /// Frames of the wrong size, a decoder graph, ONNX Runtime errors.
    pub fn encode_rows(&mut self, frames: &[f32]) -> Result<Vec<i64>, ModelError> {
        self.encode_some(frames, None)
    }

    /// Whether the graph can step some rows and leave the others as they were (its manifest
    /// names the `active` input).
    pub fn steps_some_rows(&self) -> bool {
        self.io.active.is_some()
    }

    /// Sets which rows the next call steps (`None`: all). A graph without the `active` input
    /// steps all rows or refuses.
    fn set_active(&mut self, active: Option<&[bool]>) -> Result<(), ModelError> {
        match (active, self.io.active.as_mut()) {
            (None, Some(buf)) => buf.as_bytes().fill(1),
            (None, None) => {}
            (Some(a), _) if a.len() != self.rows => {
                return Err(ModelError::contract(
                    self.graph,
                    format!("{} row flags for {} rows", a.len(), self.rows),
                ))
            }
            (Some(a), Some(buf)) => {
                for (b, &on) in buf.as_bytes().iter_mut().zip(a) {
                    *b = u8::from(on);
                }
            }
            (Some(a), None) if a.iter().all(|&on| on) => {}
            (Some(_), None) => {
                return Err(ModelError::contract(
                    self.graph,
                    "this step graph has no `active` input: it cannot leave a row out of a call \
                     (rebuild the pack's step graphs with tools/make_mimi_step.py)",
                ))
            }
        }
        Ok(())
    }

    /// As [`encode_rows`](Self::encode_rows), stepping only the rows whose flag in `active` is
    /// set (`None`: all): the others keep their state, and their codes in the result are
    /// meaningless. Their frames are read but do not matter.
    ///
    /// # Errors
    ///
    /// As [`encode_rows`](Self::encode_rows); flags for another number of rows; rows left out
    /// on a graph without the `active` input.
    pub fn encode_some(
        &mut self,
        frames: &[f32],
        active: Option<&[bool]>,
    ) -> Result<Vec<i64>, ModelError> {
        if self.manifest.input != "pcm" {
            return Err(ModelError::contract(self.graph, "not an encoder"));
        }
        let want = self.rows * self.manifest.frame_samples;
        if frames.len() != want {
            return Err(ModelError::contract(
                self.graph,
                format!(
                    "{} samples, expected {} ({} rows of {})",
                    frames.len(),
                    want,
                    self.rows,
                    self.manifest.frame_samples
                ),
            ));
        }
        self.set_active(active)?;
        self.io.input.as_slice::<f32>().copy_from_slice(frames);
        let (lo, n) = self.span_of(active);
        if n > 0 {
            self.run_span(lo, n)?;
        }
        Ok(self.io.output.as_slice::<i64>().to_vec())
    }

    /// Decodes the next frame's codes (decoder graphs of one row); returns its samples.
    ///
    /// # Errors
    ///
    /// Codes of the wrong count or out of `0..audio_vocab`, an encoder graph, ONNX Runtime
    /// errors.
    pub fn decode(&mut self, codes: &[i64], audio_vocab: i64) -> Result<Vec<f32>, ModelError> {
        self.decode_rows(codes, audio_vocab)
    }

    /// Decodes the next frame of every row at once: `codes` holds `rows` × `codebooks` codes,
    /// row after row; returns `rows` frames of samples, row after row.
    ///
    /// # Errors
    ///
    /// Codes of the wrong count or out of `0..audio_vocab`, an encoder graph, ONNX Runtime
    /// errors.
    pub fn decode_rows(&mut self, codes: &[i64], audio_vocab: i64) -> Result<Vec<f32>, ModelError> {
        self.decode_some(codes, None, audio_vocab)
    }

    /// As [`decode_rows`](Self::decode_rows), stepping only the rows whose flag in `active` is
    /// set (`None`: all): the others keep their state, and their samples in the result are
    /// meaningless. Their codes are read, so they must be in range (zeros will do).
    ///
    /// # Errors
    ///
    /// As [`decode_rows`](Self::decode_rows); flags for another number of rows; rows left out
    /// on a graph without the `active` input.
    pub fn decode_some(
        &mut self,
        codes: &[i64],
        active: Option<&[bool]>,
        audio_vocab: i64,
    ) -> Result<Vec<f32>, ModelError> {
        if self.manifest.input != "codes" {
            return Err(ModelError::contract(self.graph, "not a decoder"));
        }
        let q = self.manifest.codebooks;
        if codes.len() != self.rows * q {
            return Err(ModelError::contract(
                self.graph,
                format!(
                    "{} codes, expected {} ({} rows of {q})",
                    codes.len(),
                    self.rows * q,
                    self.rows
                ),
            ));
        }
        if let Some((i, &c)) = codes
            .iter()
            .enumerate()
            .find(|(_, &c)| !(0..audio_vocab).contains(&c))
        {
            return Err(ModelError::Token {
                graph: self.graph.into(),
                channel: format!("codebook {}", i % q),
                value: c,
                limit: audio_vocab,
            });
        }
        self.set_active(active)?;
        self.io.input.as_slice::<i64>().copy_from_slice(codes);
        let (lo, n) = self.span_of(active);
        if n > 0 {
            self.run_span(lo, n)?;
        }
        Ok(self.io.output.as_slice::<f32>().to_vec())
    }

    /// The value of an i64 state (a counter) by name, for diagnostics and tests.
    pub fn counter(&mut self, name: &str) -> Option<i64> {
        let i = self.manifest.states.iter().position(|s| s.name == name)?;
        let st = &mut self.io.states[i];
        if st.bufs[0].ty != TensorElementType::Int64 {
            return None;
        }
        // The current value is in the set the next call reads.
        let r = if st.bufs.len() == 1 { 0 } else { self.parity };
        let b = st.bufs[r].read_at(&self.alloc, 0, 1).ok()?;
        Some(i64::from_le_bytes(b.try_into().ok()?))
    }

    /// The bytes of row `row`'s whole state as the next call reads it (every state tensor in
    /// the manifest's order): how tests show that a row left out of a call kept its state bit
    /// for bit.
    pub fn row_state(&mut self, row: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let (parity, alloc) = (self.parity, &self.alloc);
        for (s, st) in self.manifest.states.iter().zip(self.io.states.iter_mut()) {
            let r = if st.bufs.len() == 1 { 0 } else { parity };
            let n = s.shape.iter().product::<i64>().max(0) as usize;
            if let Ok(bytes) = st.bufs[r].read_at(alloc, row * n, n) {
                out.extend_from_slice(&bytes);
            }
        }
        out
    }

    /// Every state buffer against where the session reads it: `(input name, where the buffer
    /// is, where the session wants it)`.
    pub fn state_placements(&self) -> Vec<(String, Placement, Placement)> {
        let mut out = Vec::new();
        for (s, st) in self.manifest.states.iter().zip(&self.io.states) {
            for b in &st.bufs {
                out.push((
                    s.input.clone(),
                    b.placement(),
                    placement_of(&self.wanted, &s.input),
                ));
            }
        }
        out
    }

    /// Sets every i64 state called `*.position` to `value` (a stream that started `value`
    /// transformer frames ago, with nothing valid in its window): how tests show that hours of
    /// stream do not move the results.
    ///
    /// # Errors
    ///
    /// ONNX Runtime's copy, for states in a device's memory.
    pub fn set_position(&mut self, value: i64) -> Result<(), ModelError> {
        let (parity, alloc, graph) = (self.parity, &self.alloc, self.graph);
        for (s, st) in self.manifest.states.iter().zip(self.io.states.iter_mut()) {
            if s.name.ends_with(".position") && st.bufs[0].ty == TensorElementType::Int64 {
                let r = if st.bufs.len() == 1 { 0 } else { parity };
                let b = &mut st.bufs[r];
                let bytes: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), b.capacity)
                    .flatten()
                    .collect();
                b.write_at(alloc, 0, &bytes)
                    .map_err(|e| ModelError::ort(graph, e))?;
            }
        }
        Ok(())
    }
}
