//! Model packs: a directory in the exporter's layout, an optional `pack.yaml`, and the checks
//! that every graph matches the contract before anything runs.
//!
//! ```text
//! <pack>/mimi_encoder/model.onnx (+ model.onnx.data)
//! <pack>/mimi_decoder/model.onnx
//! <pack>/temporal/model.onnx
//! <pack>/depformer/model.onnx
//! <pack>/pack.yaml            optional; PersonaPlex defaults otherwise
//! ```
//!
//! Sizes (layers, heads, head dim, dtype, variant) are read from the graphs' inputs, never
//! assumed. [`Pack::open`] checks the whole pack before any session is built, reading the graph
//! files themselves ([`onnx`](super::onnx)): every graph against the contract, external weights
//! against their files, and `pack.yaml` (known keys only) against the graphs. The same contract
//! checks run again on each session ONNX Runtime builds. A missing file, a wrong input name, dtype
//! or rank, or a graph of the wrong kind is an error that names the graph and the input; a
//! manifest value is named by its key.

//!
//! - [`manifest`]: `pack.yaml`, its keys and names.
//! - [`contract`]: what each graph must take and give.

pub mod contract;
pub mod manifest;

use std::path::{Path, PathBuf};

pub use self::contract::{
    check_depformer, check_mimi, check_temporal, FloatType, LmGraphInfo, Variant,
};
use self::contract::{check_depformer_io, check_mimi_io, check_temporal_io, Io};
use self::manifest::{check_quantization, check_shape, manifest_error, read_manifest};
pub use self::manifest::{
    ExportVariant, InitialTokens, LmShape, MimiStreaming, PackManifest, Quantized,
};
use super::error::ModelError;
use super::onnx::{GraphFile, Initializer};

/// The four graphs of a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Graph {
    /// Mimi encoder: waveform → codes.
    MimiEncoder,
    /// Mimi decoder: codes → waveform.
    MimiDecoder,
    /// Temporal transformer.
    Temporal,
    /// Depformer.
    Depformer,
}

impl Graph {
    /// Directory name in the pack.
    pub fn dir(&self) -> &'static str {
        match self {
            Graph::MimiEncoder => "mimi_encoder",
            Graph::MimiDecoder => "mimi_decoder",
            Graph::Temporal => "temporal",
            Graph::Depformer => "depformer",
        }
    }
}

/// An opened pack directory.
#[derive(Debug, Clone)]
pub struct Pack {
    /// The directory.
    pub dir: PathBuf,
    /// Its manifest (defaults when there is no `pack.yaml`).
    pub manifest: PackManifest,
}

impl Pack {
    /// Opens `dir` and checks it whole, before any session is built: the four graphs exist and
    /// match the contract (read from the files, not from ONNX Runtime), their external weight
    /// files are complete, and `pack.yaml` (when present) holds only known keys with values
    /// that agree with the graphs: vocabularies with the logits and the embedding tables, the
    /// codebook count and frame size with the codec, `max_positions` with the RoPE table, the
    /// stated quantization with the graphs' quantized nodes (the step graphs' too).
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] naming the missing directory or file, [`ModelError::Manifest`]
    /// naming `pack.yaml` and the key, [`ModelError::Contract`] naming the graph and input.
    pub fn open(dir: &Path) -> Result<Pack, ModelError> {
        let err = |path: &Path, detail: String| ModelError::Pack {
            path: path.to_path_buf(),
            detail,
        };
        if !dir.is_dir() {
            return Err(err(dir, "model pack directory not found".into()));
        }
        for g in Graph::ALL {
            let p = dir.join(g.dir()).join("model.onnx");
            if !p.is_file() {
                return Err(err(
                    &p,
                    format!("missing {} graph (a pack holds mimi_encoder/, mimi_decoder/, temporal/ and depformer/, each with model.onnx)", g.dir()),
                ));
            }
        }
        let mf = dir.join("pack.yaml");
        let manifest = if mf.exists() {
            read_manifest(&mf)?
        } else {
            PackManifest::default()
        };
        let pack = Pack {
            dir: dir.to_path_buf(),
            manifest,
        };
        pack.check_manifest(&mf)?;
        pack.check_step_graphs()?;
        pack.check_graphs(&mf)?;
        pack.check_relations(&mf)?;
        Ok(pack)
    }

    /// How `graph`'s weights are quantized (`pack.yaml`'s `quantization`, checked against the
    /// graph when the pack was opened); `None` for float weights.
    pub fn quantized(&self, graph: &str) -> Option<&manifest::Quantized> {
        self.manifest.quantization.as_ref()?.get(graph)
    }

    /// The manifest's values on their own.
    fn check_manifest(&self, mf: &Path) -> Result<(), ModelError> {
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        if !(8000..=384_000).contains(&m.sample_rate) {
            return Err(bad(
                "sample_rate",
                format!(
                    "{} Hz is not a codec rate (Mimi runs at 24000)",
                    m.sample_rate
                ),
            ));
        }
        if m.frame_size == 0 {
            return Err(bad(
                "frame_size",
                "0 samples: a frame holds the samples of one model step (1920)".into(),
            ));
        }
        if !(1..=64).contains(&m.codebooks) {
            return Err(bad(
                "codebooks",
                format!("{} is not in 1..=64", m.codebooks),
            ));
        }
        for (key, v) in [("text_vocab", m.text_vocab), ("audio_vocab", m.audio_vocab)] {
            if v < 1 {
                return Err(bad(
                    key,
                    format!("{v}: a vocabulary holds at least one token"),
                ));
            }
        }
        if m.delays.len() != 1 + 2 * m.codebooks {
            return Err(bad(
                "delays",
                format!(
                    "has {} entries, expected {} (1 text + 2 × {} codebooks)",
                    m.delays.len(),
                    1 + 2 * m.codebooks,
                    m.codebooks
                ),
            ));
        }
        if let Some(d) = m.delays.iter().find(|&&d| d > 64) {
            return Err(bad(
                "delays",
                format!("a delay of {d} steps is not a Moshi layout"),
            ));
        }
        Ok(())
    }

    /// The manifest's values that depend on each other (checked after the vocabularies have
    /// been checked against the graphs, so that a wrong vocabulary is named as such).
    fn check_relations(&self, mf: &Path) -> Result<(), ModelError> {
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        if !(0..=m.text_vocab).contains(&m.initial_tokens.text) {
            return Err(bad(
                "initial_tokens.text",
                format!(
                    "{} is outside the text table 0..={} (the last row, {}, is the initial token)",
                    m.initial_tokens.text, m.text_vocab, m.text_vocab
                ),
            ));
        }
        if !(0..=m.audio_vocab).contains(&m.initial_tokens.audio) {
            return Err(bad(
                "initial_tokens.audio",
                format!(
                    "{} is outside the audio tables 0..={}",
                    m.initial_tokens.audio, m.audio_vocab
                ),
            ));
        }
        if !(0..m.text_vocab).contains(&m.text_padding) {
            return Err(bad(
                "text_padding",
                format!(
                    "{} is not a text token (0..{})",
                    m.text_padding, m.text_vocab
                ),
            ));
        }
        for (key, v) in [
            ("silence_codes", &m.silence_codes),
            ("sine_codes", &m.sine_codes),
        ] {
            if v.len() != m.codebooks || v.iter().any(|&c| c < 0 || c >= m.audio_vocab) {
                return Err(bad(
                    key,
                    format!("must hold {} codes in 0..{}", m.codebooks, m.audio_vocab),
                ));
            }
        }
        if m.context == 0 {
            return Err(bad(
                "context",
                "0 frames: the model attends to at least one".into(),
            ));
        }
        if m.max_positions <= m.delays.iter().copied().max().unwrap_or(0) + 1 {
            return Err(bad(
                "max_positions",
                format!(
                    "{} positions leave no room for a conversation",
                    m.max_positions
                ),
            ));
        }
        debug_assert_eq!(m.layout().channels(), m.delays.len());
        Ok(())
    }

    /// The graphs against the contract and the manifest, from the files themselves.
    fn check_graphs(&self, mf: &Path) -> Result<(), ModelError> {
        let read = |g: Graph| -> Result<Option<GraphFile>, ModelError> {
            let path = self.graph_path(g);
            let file = GraphFile::read(&path)?;
            if let Some(f) = &file {
                f.check_external_data()?;
            }
            Ok(file)
        };
        if let Some(f) = read(Graph::Temporal)? {
            self.check_temporal_file(mf, &f)?;
        }
        if let Some(f) = read(Graph::Depformer)? {
            self.check_depformer_file(mf, &f)?;
        }
        for (g, encoder) in [(Graph::MimiEncoder, true), (Graph::MimiDecoder, false)] {
            if let Some(f) = read(g)? {
                self.check_mimi_file(mf, g, encoder, &f)?;
            }
        }
        Ok(())
    }

    /// The temporal graph against the manifest: token channels, vocabularies, embedding
    /// tables, RoPE table, variant, cache type, shape and quantization.
    fn check_temporal_file(&self, mf: &Path, f: &GraphFile) -> Result<(), ModelError> {
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        let io = Io::from_file(f, "temporal");
        let info = check_temporal_io(&io, None)?;
        let channels = io.find(false, "input_frame")?.shape[1];
        if channels > 0 && channels as usize != 1 + 2 * m.codebooks {
            return Err(bad(
                "codebooks",
                format!(
                    "{} codebooks make {} token channels, but the temporal graph takes {channels}",
                    m.codebooks,
                    1 + 2 * m.codebooks
                ),
            ));
        }
        if info.vocab as i64 != m.text_vocab {
            return Err(bad(
                "text_vocab",
                format!(
                    "{} does not match the temporal graph, whose text logits are {} wide",
                    m.text_vocab, info.vocab
                ),
            ));
        }
        self.check_temporal_tables(mf, f)?;
        if let Some(cos) = f
            .initializers
            .iter()
            .find(|i| i.name.ends_with("rotary_emb.cos_cache"))
        {
            let table = cos.dims.first().copied().unwrap_or(0);
            if m.max_positions as i64 > table {
                return Err(bad(
                    "max_positions",
                    format!(
                        "{} positions are more than the temporal graph's RoPE table covers ({table})",
                        m.max_positions
                    ),
                ));
            }
        }
        if let Some(v) = m.variant.filter(|v| v.attention() != info.variant) {
            return Err(bad(
                "variant",
                format!(
                    "{:?}, but the temporal graph is the {} variant",
                    v.name(),
                    match info.variant {
                        Variant::Gqa => "gqa",
                        Variant::Standard => "standard",
                    }
                ),
            ));
        }
        if let Some(d) = m.dtype.filter(|d| *d != info.kv) {
            return Err(bad(
                "dtype",
                format!(
                    "{:?}, but the temporal graph's cache is {}",
                    d.name(),
                    info.kv.name()
                ),
            ));
        }
        check_shape(mf, "temporal", m.temporal.as_ref(), &info)?;
        check_quantization(mf, "temporal", self.quantized("temporal"), &f.nbits)?;
        Ok(())
    }

    /// The temporal graph's embedding tables against the manifest's vocabularies: text and
    /// audio, each with its initial token.
    fn check_temporal_tables(&self, mf: &Path, f: &GraphFile) -> Result<(), ModelError> {
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        if let Some(r) = table_rows(f, "embed.text_emb.weight") {
            if r != m.text_vocab + 1 {
                return Err(bad(
                    "text_vocab",
                    format!("{} does not match the temporal graph's text embedding table ({r} rows: the vocabulary and the initial token)", m.text_vocab),
                ));
            }
        }
        let audio: Vec<&Initializer> = f
            .initializers
            .iter()
            .filter(|i| i.name.starts_with("embed.emb.") && i.name.ends_with(".weight"))
            .collect();
        if !audio.is_empty() && audio.len() != 2 * m.codebooks {
            return Err(bad(
                "codebooks",
                format!(
                    "{} codebooks need {} audio embedding tables; the temporal graph has {}",
                    m.codebooks,
                    2 * m.codebooks,
                    audio.len()
                ),
            ));
        }
        if let Some(t) = audio
            .iter()
            .find(|t| t.dims.first() != Some(&(m.audio_vocab + 1)))
        {
            return Err(bad(
                "audio_vocab",
                format!(
                    "{} does not match the temporal graph's audio embedding table `{}` ({} rows: the codebook and the initial token)",
                    m.audio_vocab,
                    t.name,
                    t.dims.first().copied().unwrap_or(0)
                ),
            ));
        }
        Ok(())
    }

    /// The depformer graph against the manifest: vocabularies, embedding tables, shape and
    /// quantization.
    fn check_depformer_file(&self, mf: &Path, f: &GraphFile) -> Result<(), ModelError> {
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        let info = check_depformer_io(&Io::from_file(f, "depformer"))?;
        if info.vocab as i64 != m.audio_vocab {
            return Err(bad(
                "audio_vocab",
                format!(
                    "{} does not match the depformer graph, whose logits are {} wide",
                    m.audio_vocab, info.vocab
                ),
            ));
        }
        if let Some(t) = f.initializer("audio_emb") {
            if t.dims.get(1) != Some(&(m.audio_vocab + 1)) {
                return Err(bad(
                    "audio_vocab",
                    format!(
                        "{} does not match the depformer's audio embedding tables ({:?})",
                        m.audio_vocab, t.dims
                    ),
                ));
            }
        }
        if let Some(r) = table_rows(f, "text_emb.weight") {
            if r != m.text_vocab + 1 {
                return Err(bad(
                    "text_vocab",
                    format!(
                        "{} does not match the depformer's text embedding table ({r} rows)",
                        m.text_vocab
                    ),
                ));
            }
        }
        check_shape(mf, "depformer", m.depformer.as_ref(), &info)?;
        check_quantization(mf, "depformer", self.quantized("depformer"), &f.nbits)?;
        Ok(())
    }

    /// A Mimi graph against the manifest: codebooks, their size, and (the decoder) the samples
    /// a frame makes.
    fn check_mimi_file(
        &self,
        mf: &Path,
        g: Graph,
        encoder: bool,
        f: &GraphFile,
    ) -> Result<(), ModelError> {
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        let io = Io::from_file(f, g.dir());
        check_mimi_io(&io, encoder)?;
        let codes = io.find(encoder, "codes")?;
        if let Some(&n) = codes.shape.get(1).filter(|&&n| n > 0) {
            if n as usize != m.codebooks {
                return Err(bad(
                    "codebooks",
                    format!(
                        "{} does not match the {} graph, which has {n}",
                        m.codebooks,
                        g.dir()
                    ),
                ));
            }
        }
        if let Some(t) = f
            .initializers
            .iter()
            .find(|i| i.name.ends_with("_codebook.embedding.weight"))
        {
            if t.dims.first() != Some(&m.audio_vocab) {
                return Err(bad(
                    "audio_vocab",
                    format!(
                        "{} does not match the {} graph's codebooks ({} entries)",
                        m.audio_vocab,
                        g.dir(),
                        t.dims.first().copied().unwrap_or(0)
                    ),
                ));
            }
        }
        // The decoder's output length is written `N*sequence_len`: N samples per frame.
        if !encoder {
            let hop = f
                .outputs
                .iter()
                .find(|o| o.name == "waveform")
                .and_then(|o| o.dims.get(2))
                .and_then(|d| match d {
                    super::onnx::Dim::Symbol(s) => {
                        s.split_once('*')?.0.trim().parse::<usize>().ok()
                    }
                    _ => None,
                });
            if let Some(hop) = hop.filter(|&h| h != m.frame_size) {
                return Err(bad(
                    "frame_size",
                    format!(
                        "{} samples, but the codec's frames are {hop} samples (one model step)",
                        m.frame_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Bytes of memory ONNX Runtime's CPU provider makes for this pack's temporal graph beyond
    /// its files, estimated from them: a half-precision graph whose MatMul weights are float
    /// (a pack exported for a GPU) has them widened to fp32 as the session is built, since the
    /// CPU provider multiplies in fp32: twice the graph's weights, held while it is open. Zero
    /// for fp32 and for quantized temporal graphs (their weights stay as written).
    pub fn cpu_widened_bytes(&self) -> u64 {
        if self.manifest.dtype != Some(FloatType::F16) || self.quantized("temporal").is_some() {
            return 0;
        }
        2 * self.folder_bytes(Graph::Temporal.dir())
    }

    /// Bytes of the files in the pack's `folder` (a graph and its external weights; 0 when it
    /// cannot be read).
    pub fn folder_bytes(&self, folder: &str) -> u64 {
        std::fs::read_dir(self.dir.join(folder))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .filter(|m| m.is_file())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Refuses, before ONNX Runtime is asked, a temporal graph the CPU provider would have to
    /// widen into more memory than `available` bytes (the system's, when `None`: Linux's
    /// `MemAvailable`; no check where it cannot be read): ONNX Runtime would otherwise build
    /// the session until the kernel kills the process, with no message.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] naming the pack, the memory it needs and has, and what runs instead.
    pub fn check_cpu_room(&self, available: Option<u64>) -> Result<(), ModelError> {
        let need = self.cpu_widened_bytes();
        let Some(available) = available.or_else(mem_available) else {
            return Ok(());
        };
        if need <= available {
            return Ok(());
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        Err(ModelError::Pack {
            path: self.dir.clone(),
            detail: format!(
                "a half-precision pack (exported for a GPU) on the CPU provider: ONNX Runtime widens \
                 its temporal weights to fp32, about {:.1} GiB, and this machine has {:.1} GiB \
                 available; run it with the CUDA provider (`--provider cuda`, `execution_provider: cuda` \
                 in a pipeline), or export a pack for the CPU \
                 (tools/export_pack.py --provider cpu, or --quantize int8 / int4)",
                gib(need),
                gib(available)
            ),
        })
    }

    /// Path of a graph's `model.onnx`.
    pub fn graph_path(&self, g: Graph) -> PathBuf {
        self.dir.join(g.dir()).join("model.onnx")
    }

    /// The folder of the `role` step graph of precision `dtype` (`f32`, `f16`), when the pack
    /// has it: `mimi_encoder_step/`, `mimi_decoder_step_f16/`, … (with `model.onnx` and
    /// `state.json`).
    pub fn step_graph(&self, role: StepRole, dtype: FloatType) -> Option<PathBuf> {
        let dir = self.dir.join(role.dir(dtype));
        (dir.join("model.onnx").is_file() && dir.join("state.json").is_file()).then_some(dir)
    }

    /// Whether the pack's `role` step graph of precision `dtype` can step some batch rows and
    /// leave the others exactly as they were (its `state.json` names the `active` input): what
    /// a shared codec needs. `false` when the pack has no such graph.
    ///
    /// # Errors
    ///
    /// The graph's `state.json` cannot be read or is wrong.
    pub fn step_graph_batches(&self, role: StepRole, dtype: FloatType) -> Result<bool, ModelError> {
        match self.step_graph(role, dtype) {
            Some(dir) => Ok(super::mimi_step::StepManifest::read(&dir)?.active.is_some()),
            None => Ok(false),
        }
    }

    /// `pack.yaml`'s `mimi_streaming` against the folders: a strategy it lists must be there,
    /// and every step graph's `state.json` must read (what it says of its batch rows is
    /// [`step_graph_batches`](Self::step_graph_batches)).
    fn check_step_graphs(&self) -> Result<(), ModelError> {
        let mf = self.dir.join("pack.yaml");
        for dtype in [FloatType::F32, FloatType::F16] {
            for role in [StepRole::Encoder, StepRole::Decoder] {
                self.step_graph_batches(role, dtype)?;
                let name = role.dir(dtype);
                let said = self.quantized(&name);
                match self.step_graph(role, dtype) {
                    Some(dir) => {
                        let nodes = GraphFile::read(&dir.join("model.onnx"))?
                            .map(|f| f.nbits)
                            .unwrap_or_default();
                        check_quantization(&mf, &name, said, &nodes)?;
                    }
                    None if said.is_some() => {
                        return Err(manifest_error(
                            &mf,
                            &format!("quantization.{name}"),
                            format!("names a graph this pack does not have ({name}/)"),
                        ));
                    }
                    None => {}
                }
            }
        }
        let Some(listed) = &self.manifest.mimi_streaming else {
            return Ok(());
        };
        for s in listed {
            let Some(dtype) = s.step_dtype() else {
                continue;
            };
            for role in [StepRole::Encoder, StepRole::Decoder] {
                if self.step_graph(role, dtype).is_none() {
                    let dir = self.dir.join(role.dir(dtype));
                    return Err(ModelError::Pack {
                        path: dir,
                        detail: format!(
                            "pack.yaml lists `{}` but this folder has no model.onnx and \
                             state.json (build them with tools/make_mimi_step.py)",
                            s.name()
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// The tokenizer path, if the manifest names one (relative to the pack).
    pub fn tokenizer(&self) -> Option<PathBuf> {
        self.manifest.tokenizer.as_ref().map(|t| self.dir.join(t))
    }
}

/// Which side of the codec a step graph is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRole {
    /// Samples to codes.
    Encoder,
    /// Codes to samples.
    Decoder,
}

impl StepRole {
    /// `mimi_encoder_step`, `mimi_decoder_step`: the graph's name in messages.
    pub fn graph(&self) -> &'static str {
        match self {
            StepRole::Encoder => "mimi_encoder_step",
            StepRole::Decoder => "mimi_decoder_step",
        }
    }

    /// The folder of its step graph of precision `dtype` in a pack: `mimi_encoder_step`,
    /// `mimi_decoder_step_f16`, … (also its key under `pack.yaml`'s `quantization`).
    pub fn dir(&self, dtype: FloatType) -> String {
        match dtype {
            FloatType::F32 => self.graph().to_string(),
            FloatType::F16 => format!("{}_f16", self.graph()),
        }
    }
}

impl Graph {
    /// The four graphs of a pack.
    pub const ALL: [Graph; 4] = [
        Graph::MimiEncoder,
        Graph::MimiDecoder,
        Graph::Temporal,
        Graph::Depformer,
    ];
}

/// The rows of initializer `name` (an embedding table's entries), when the graph has it.
fn table_rows(f: &GraphFile, name: &str) -> Option<i64> {
    f.initializer(name).and_then(|i| i.dims.first().copied())
}

/// The system's available memory (Linux's `MemAvailable`), when it can be read.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
