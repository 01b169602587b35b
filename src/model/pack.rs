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

use std::path::{Path, PathBuf};

use ort::session::Session;
use ort::value::{TensorElementType, ValueType};
use serde::Deserialize;

use super::error::ModelError;
use super::lmgen::StreamLayout;
use super::onnx::{Elem, GraphFile, Initializer};

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

/// `pack.yaml`: what cannot be read from the graphs. Every field has the PersonaPlex default, so
/// a bare export directory works.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct PackManifest {
    /// A name for logs.
    pub name: String,
    /// Samples per second of the codec (24000).
    pub sample_rate: u32,
    /// Samples per frame (1920).
    pub frame_size: usize,
    /// Audio codebooks per speaker (8).
    pub codebooks: usize,
    /// Text vocabulary (32000); the text embedding table has one more row.
    pub text_vocab: i64,
    /// Audio codebook size (2048); the audio embedding tables have one more row.
    pub audio_vocab: i64,
    /// Per-channel delays.
    pub delays: Vec<usize>,
    /// Initial tokens of the text and audio channels.
    pub initial_tokens: InitialTokens,
    /// Text padding / "zero text" token (3), forced while priming.
    pub text_padding: i64,
    /// Codes of a silent frame.
    pub silence_codes: Vec<i64>,
    /// Codes of the 440 Hz sine frame fed on the user stream while priming.
    pub sine_codes: Vec<i64>,
    /// Attention context of the temporal transformer, in frames (3000).
    pub context: usize,
    /// Positions the RoPE tables cover (8000): the hard limit of a conversation.
    pub max_positions: usize,
    /// SentencePiece model for persona text and transcripts, relative to the pack.
    pub tokenizer: Option<PathBuf>,
    /// What the exporter says it built (checked against the graphs when given): `standard`
    /// or `gqa`.
    pub variant: Option<String>,
    /// `f32` or `f16` (checked against the temporal graph when given).
    pub dtype: Option<String>,
    /// Which codec the pack holds (`tiny`, `full`; informational).
    pub mimi: Option<String>,
    /// Special text tokens (informational).
    pub special_text_ids: Option<std::collections::BTreeMap<String, i64>>,
    /// The temporal transformer's shape (checked against the graph when given).
    pub temporal: Option<LmShape>,
    /// The depformer's shape (checked against the graph when given).
    pub depformer: Option<LmShape>,
    /// The codec strategies the pack has: `window` (the whole-utterance graphs, always),
    /// `stateful` (`mimi_*_step/`), `stateful_f16` (`mimi_*_step_f16/`). Checked against the
    /// folders; when absent, step graphs present in the folders are used all the same.
    pub mimi_streaming: Option<Vec<String>>,
}

/// A transformer's shape as the manifest states it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct LmShape {
    /// Model width.
    pub dim: Option<usize>,
    /// Layers.
    pub layers: Option<usize>,
    /// KV heads.
    pub heads: Option<usize>,
    /// Head size.
    pub head_dim: Option<usize>,
}

/// Every key `pack.yaml` may hold, with the keys of its maps.
const MANIFEST_KEYS: &[(&str, &[&str])] = &[
    ("name", &[]),
    ("variant", &[]),
    ("dtype", &[]),
    ("mimi", &[]),
    ("sample_rate", &[]),
    ("frame_size", &[]),
    ("codebooks", &[]),
    ("text_vocab", &[]),
    ("audio_vocab", &[]),
    ("delays", &[]),
    ("initial_tokens", &["text", "audio"]),
    ("text_padding", &[]),
    ("special_text_ids", &["epad", "bos", "eos", "pad"]),
    ("silence_codes", &[]),
    ("sine_codes", &[]),
    ("context", &[]),
    ("max_positions", &[]),
    ("temporal", &["dim", "layers", "heads", "head_dim"]),
    ("depformer", &["dim", "layers", "heads", "head_dim"]),
    ("tokenizer", &[]),
    ("mimi_streaming", &[]),
];

impl Default for PackManifest {
    fn default() -> Self {
        let l = StreamLayout::personaplex();
        PackManifest {
            name: "personaplex".into(),
            sample_rate: 24_000,
            frame_size: 1920,
            codebooks: 8,
            text_vocab: 32_000,
            audio_vocab: 2048,
            delays: l.delays,
            initial_tokens: InitialTokens::default(),
            text_padding: 3,
            silence_codes: vec![948, 243, 1178, 546, 1736, 1030, 1978, 2008],
            sine_codes: vec![430, 1268, 381, 1611, 1095, 1495, 56, 472],
            context: 3000,
            max_positions: 8000,
            tokenizer: None,
            variant: None,
            dtype: None,
            mimi: None,
            special_text_ids: None,
            temporal: None,
            depformer: None,
            mimi_streaming: None,
        }
    }
}

impl PackManifest {
    /// The text tokens that are not words ([`TextSpecials`](super::sampling::TextSpecials)):
    /// `text_padding`, the `epad` of `special_text_ids` (0 when not given, as PersonaPlex's
    /// tokenizer has it), the initial text token.
    pub fn text_specials(&self) -> super::sampling::TextSpecials {
        super::sampling::TextSpecials {
            pad: self.text_padding,
            epad: self
                .special_text_ids
                .as_ref()
                .and_then(|m| m.get("epad").copied())
                .unwrap_or(0),
            start: self.initial_tokens.text,
        }
    }

    /// The token streams' layout.
    pub fn layout(&self) -> StreamLayout {
        let mut initial = vec![self.initial_tokens.text];
        initial.extend(std::iter::repeat_n(
            self.initial_tokens.audio,
            2 * self.codebooks,
        ));
        StreamLayout {
            delays: self.delays.clone(),
            initial,
            codebooks: self.codebooks,
        }
    }
}

/// Initial token of the text channel and of the audio channels.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct InitialTokens {
    /// Text (32000).
    pub text: i64,
    /// Audio (2048).
    pub audio: i64,
}

impl Default for InitialTokens {
    fn default() -> Self {
        InitialTokens {
            text: 32_000,
            audio: 2048,
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
    /// codebook count and frame size with the codec, `max_positions` with the RoPE table.
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
        pack.check_step_graphs(&mf)?;
        pack.check_graphs(&mf)?;
        pack.check_relations(&mf)?;
        Ok(pack)
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
        let m = &self.manifest;
        let bad = |key: &str, detail: String| manifest_error(mf, key, detail);
        let read = |g: Graph| -> Result<Option<GraphFile>, ModelError> {
            let path = self.graph_path(g);
            let file = GraphFile::read(&path).map_err(|e| ModelError::Pack {
                path: e.path,
                detail: e.detail,
            })?;
            if let Some(f) = &file {
                f.check_external_data().map_err(|e| ModelError::Pack {
                    path: e.path,
                    detail: e.detail,
                })?;
            }
            Ok(file)
        };
        let rows =
            |f: &GraphFile, name: &str| f.initializer(name).and_then(|i| i.dims.first().copied());

        if let Some(f) = read(Graph::Temporal)? {
            let io = Io::from_file(&f, "temporal");
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
            if let Some(r) = rows(&f, "embed.text_emb.weight") {
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
            if let Some(v) = m.variant.as_deref() {
                // The exporter's names: standard, gqa, gqa-fp16 (attention kind, then dtype).
                let said = match v {
                    "standard" => Variant::Standard,
                    "gqa" | "gqa-fp16" => Variant::Gqa,
                    other => {
                        return Err(bad(
                            "variant",
                            format!("{other:?} is not one of standard, gqa, gqa-fp16"),
                        ))
                    }
                };
                if said != info.variant {
                    return Err(bad(
                        "variant",
                        format!(
                            "{v:?}, but the temporal graph is the {} variant",
                            match info.variant {
                                Variant::Gqa => "gqa",
                                Variant::Standard => "standard",
                            }
                        ),
                    ));
                }
            }
            if let Some(d) = m.dtype.as_deref().filter(|d| *d != info.kv.name()) {
                return Err(bad(
                    "dtype",
                    format!(
                        "{d:?}, but the temporal graph's cache is {}",
                        info.kv.name()
                    ),
                ));
            }
            check_shape(mf, "temporal", m.temporal.as_ref(), &info)?;
        }
        if let Some(f) = read(Graph::Depformer)? {
            let info = check_depformer_io(&Io::from_file(&f, "depformer"))?;
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
            if let Some(r) = rows(&f, "text_emb.weight") {
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
        }
        for (g, encoder) in [(Graph::MimiEncoder, true), (Graph::MimiDecoder, false)] {
            let Some(f) = read(g)? else { continue };
            let io = Io::from_file(&f, g.dir());
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
        }
        Ok(())
    }

    /// Path of a graph's `model.onnx`.
    pub fn graph_path(&self, g: Graph) -> PathBuf {
        self.dir.join(g.dir()).join("model.onnx")
    }

    /// The folder of the `role` step graph of precision `dtype` (`f32`, `f16`), when the pack
    /// has it: `mimi_encoder_step/`, `mimi_decoder_step_f16/`, … (with `model.onnx` and
    /// `state.json`).
    pub fn step_graph(&self, role: StepRole, dtype: FloatType) -> Option<PathBuf> {
        let dir = self.dir.join(step_dir(role, dtype));
        (dir.join("model.onnx").is_file() && dir.join("state.json").is_file()).then_some(dir)
    }

    /// `pack.yaml`'s `mimi_streaming` against the folders: a strategy it lists must be there.
    fn check_step_graphs(&self, mf: &Path) -> Result<(), ModelError> {
        let Some(listed) = &self.manifest.mimi_streaming else {
            return Ok(());
        };
        for s in listed {
            let dtype = match s.as_str() {
                "window" => continue,
                "stateful" => FloatType::F32,
                "stateful_f16" => FloatType::F16,
                other => {
                    return Err(manifest_error(
                        mf,
                        "mimi_streaming",
                        format!("unknown strategy {other:?}: window, stateful or stateful_f16"),
                    ))
                }
            };
            for role in [StepRole::Encoder, StepRole::Decoder] {
                if self.step_graph(role, dtype).is_none() {
                    let dir = self.dir.join(step_dir(role, dtype));
                    return Err(ModelError::Pack {
                        path: dir,
                        detail: format!(
                            "pack.yaml lists `{s}` but this folder has no model.onnx and \
                             state.json (build them with tools/make_mimi_step.py)"
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
}

fn step_dir(role: StepRole, dtype: FloatType) -> String {
    match dtype {
        FloatType::F32 => role.graph().to_string(),
        FloatType::F16 => format!("{}_f16", role.graph()),
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

fn manifest_error(mf: &Path, key: &str, detail: String) -> ModelError {
    ModelError::Manifest {
        path: mf.to_path_buf(),
        key: key.to_string(),
        detail,
    }
}

/// Reads `pack.yaml`: bounded, unknown keys refused (with a suggestion), types checked.
fn read_manifest(mf: &Path) -> Result<PackManifest, ModelError> {
    use crate::config::yaml::{self, Limits};
    let origin = mf.display().to_string();
    let pack_err = |e: crate::config::ConfigError| ModelError::Pack {
        path: mf.to_path_buf(),
        detail: e.message,
    };
    let text = yaml::read(mf, Limits::FILES).map_err(pack_err)?;
    let root = yaml::parse(&text, &origin, Limits::FILES).map_err(pack_err)?;
    let names: Vec<&str> = MANIFEST_KEYS.iter().map(|(k, _)| *k).collect();
    let unknown = |key: String, known: &[&str]| {
        let last = key.rsplit('.').next().unwrap_or(&key).to_string();
        let hint = crate::config::params::did_you_mean(&last, known.iter().copied());
        manifest_error(
            mf,
            &key,
            format!("unknown key{hint}; a pack.yaml holds: {}", known.join(", ")),
        )
    };
    for (k, v) in &root {
        let Some((_, sub)) = MANIFEST_KEYS.iter().find(|(n, _)| n == k) else {
            return Err(unknown(k.clone(), &names));
        };
        if let config::ValueKind::Table(t) = &v.kind {
            if let Some(sk) = t.keys().find(|sk| !sub.contains(&sk.as_str())) {
                return Err(unknown(format!("{k}.{sk}"), sub));
            }
        }
    }
    config::Value::new(None, config::ValueKind::Table(root))
        .try_deserialize::<PackManifest>()
        .map_err(|e| match e {
            config::ConfigError::Type {
                unexpected,
                expected,
                key,
                ..
            } => manifest_error(
                mf,
                key.as_deref().unwrap_or("?"),
                format!("expected {expected}, got {unexpected}"),
            ),
            other => ModelError::Pack {
                path: mf.to_path_buf(),
                detail: other.to_string(),
            },
        })
}

/// A shape the manifest states against the one the graph has.
fn check_shape(
    mf: &Path,
    graph: &str,
    said: Option<&LmShape>,
    info: &LmGraphInfo,
) -> Result<(), ModelError> {
    let Some(s) = said else { return Ok(()) };
    // Heads are not compared: the graph shows the KV heads, which grouped-query attention
    // makes fewer than the attention heads a manifest may state. The depformer's `dim` is
    // its own width, not the hidden state it takes.
    let dim = (graph == "temporal").then_some(info.hidden_dim);
    for (key, said, has) in [
        ("layers", s.layers, Some(info.layers)),
        ("head_dim", s.head_dim, Some(info.head_dim)),
        ("dim", s.dim, dim),
    ] {
        let Some(has) = has else { continue };
        if let Some(v) = said.filter(|&v| v != has) {
            return Err(manifest_error(
                mf,
                &format!("{graph}.{key}"),
                format!("{v}, but the {graph} graph has {has}"),
            ));
        }
    }
    Ok(())
}

/// Element type of a floating-point tensor in a graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatType {
    /// 32-bit.
    F32,
    /// 16-bit.
    F16,
}

impl FloatType {
    /// `f32` / `f16`.
    pub fn name(&self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::F16 => "f16",
        }
    }
}

/// Which temporal graph a pack holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// Plain causal attention with `position_ids`.
    Standard,
    /// `GroupQueryAttention` with rotary inside; position = valid length.
    Gqa,
}

/// What a temporal or depformer graph says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmGraphInfo {
    /// Graph name for messages.
    pub graph: String,
    /// Standard or GQA (temporal only; depformers are `Standard`).
    pub variant: Variant,
    /// Layers (pairs of `past_key_values.{i}.key|value`).
    pub layers: usize,
    /// KV heads.
    pub heads: usize,
    /// Head dim.
    pub head_dim: usize,
    /// KV element type.
    pub kv: FloatType,
    /// Element type of `hidden` (input of the depformer, output of the temporal).
    pub hidden: FloatType,
    /// Hidden size of the temporal transformer (the `hidden` tensor's last dim).
    pub hidden_dim: usize,
    /// Logits' element type.
    pub logits: FloatType,
    /// Logits' last dim (text vocab for the temporal, audio vocab for the depformer).
    pub vocab: usize,
}

/// A graph input or output as the contract checks see it, from ONNX Runtime or from the file.
struct Sig {
    /// Element type (None: not a tensor).
    elem: Option<Elem>,
    /// Its name in messages (`float`, `int64`, …).
    elem_name: String,
    /// Dimensions; -1 where free.
    shape: Vec<i64>,
}

impl Sig {
    fn describe(&self) -> String {
        format!("{} {:?}", self.elem_name, self.shape)
    }
}

fn elem_of(ty: TensorElementType) -> Elem {
    match ty {
        TensorElementType::Float32 => Elem::F32,
        TensorElementType::Float16 => Elem::F16,
        TensorElementType::Float64 => Elem::F64,
        TensorElementType::Int64 => Elem::I64,
        TensorElementType::Int32 => Elem::I32,
        TensorElementType::Bool => Elem::Bool,
        _ => Elem::Other(-1),
    }
}

fn sig_of(v: &ValueType) -> Sig {
    match v {
        ValueType::Tensor { ty, shape, .. } => {
            let elem = elem_of(*ty);
            Sig {
                elem_name: match elem {
                    Elem::Other(_) => format!("{ty}"),
                    e => e.name(),
                },
                elem: Some(elem),
                shape: shape.to_vec(),
            }
        }
        other => Sig {
            elem: None,
            elem_name: format!("{other:?}"),
            shape: Vec::new(),
        },
    }
}

struct Io<'a> {
    graph: &'a str,
    inputs: Vec<(String, Sig)>,
    outputs: Vec<(String, Sig)>,
}

impl<'a> Io<'a> {
    fn of(session: &Session, graph: &'a str) -> Self {
        Io {
            graph,
            inputs: session
                .inputs()
                .iter()
                .map(|o| (o.name().to_string(), sig_of(o.dtype())))
                .collect(),
            outputs: session
                .outputs()
                .iter()
                .map(|o| (o.name().to_string(), sig_of(o.dtype())))
                .collect(),
        }
    }

    fn from_file(f: &GraphFile, graph: &'a str) -> Self {
        let sig = |v: &super::onnx::ValueInfo| Sig {
            elem: v.elem,
            elem_name: v
                .elem
                .map(|e| e.name())
                .unwrap_or_else(|| "not a tensor".into()),
            shape: v.dims.iter().map(|d| d.value()).collect(),
        };
        Io {
            graph,
            inputs: f.inputs.iter().map(|v| (v.name.clone(), sig(v))).collect(),
            outputs: f.outputs.iter().map(|v| (v.name.clone(), sig(v))).collect(),
        }
    }

    fn names(list: &[(String, Sig)]) -> String {
        list.iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn find(&self, output: bool, name: &str) -> Result<&Sig, ModelError> {
        let list = if output { &self.outputs } else { &self.inputs };
        list.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .ok_or_else(|| {
                ModelError::contract(
                    self.graph,
                    format!(
                        "missing {} `{name}` (it has: {}); is this the right graph?",
                        if output { "output" } else { "input" },
                        Self::names(list)
                    ),
                )
            })
    }

    /// Checks element type (exact, or any float) and rank; returns the shape.
    fn tensor(
        &self,
        output: bool,
        name: &str,
        want: Want,
        rank: usize,
    ) -> Result<(Vec<i64>, Option<FloatType>), ModelError> {
        let v = self.find(output, name)?;
        let what = if output { "output" } else { "input" };
        let Some(elem) = v.elem else {
            return Err(ModelError::contract(
                self.graph,
                format!("{what} `{name}` is {}, expected a tensor", v.describe()),
            ));
        };
        let float = match elem {
            Elem::F32 => Some(FloatType::F32),
            Elem::F16 => Some(FloatType::F16),
            _ => None,
        };
        let ok = match want {
            Want::I64 => elem == Elem::I64,
            Want::Float => float.is_some(),
            Want::F32 => float == Some(FloatType::F32),
        };
        if !ok {
            return Err(ModelError::contract(
                self.graph,
                format!(
                    "{what} `{name}` has type {}, expected {}",
                    v.elem_name,
                    want.name()
                ),
            ));
        }
        if v.shape.len() != rank {
            return Err(ModelError::contract(
                self.graph,
                format!(
                    "{what} `{name}` has rank {} ({:?}), expected {rank}",
                    v.shape.len(),
                    &v.shape[..]
                ),
            ));
        }
        Ok((v.shape.clone(), float))
    }
}

#[derive(Clone, Copy)]
enum Want {
    I64,
    Float,
    F32,
}

impl Want {
    fn name(&self) -> &'static str {
        match self {
            Want::I64 => "int64",
            Want::Float => "float or float16",
            Want::F32 => "float",
        }
    }
}

fn known(graph: &str, name: &str, dim: i64, what: &str) -> Result<usize, ModelError> {
    if dim > 0 {
        Ok(dim as usize)
    } else {
        Err(ModelError::contract(
            graph,
            format!("`{name}` has no fixed {what}"),
        ))
    }
}

fn kv_layers(io: &Io<'_>) -> Result<(usize, usize, usize, FloatType), ModelError> {
    let mut layers = 0;
    let mut geom: Option<(usize, usize, FloatType)> = None;
    while io
        .inputs
        .iter()
        .any(|(n, _)| n == &format!("past_key_values.{layers}.key"))
    {
        for kv in ["key", "value"] {
            let name = format!("past_key_values.{layers}.{kv}");
            let (shape, ft) = io.tensor(false, &name, Want::Float, 4)?;
            let h = known(io.graph, &name, shape[1], "head count")?;
            let d = known(io.graph, &name, shape[3], "head dim")?;
            let ft = ft.unwrap_or(FloatType::F32);
            match geom {
                None => geom = Some((h, d, ft)),
                Some(g) if g != (h, d, ft) => {
                    return Err(ModelError::contract(
                        io.graph,
                        format!(
                        "`{name}` is {ft:?} [_, {h}, _, {d}], unlike layer 0 ({:?} [_, {}, _, {}])",
                        g.2, g.0, g.1
                    ),
                    ))
                }
                Some(_) => {}
            }
            io.tensor(true, &format!("present.{layers}.{kv}"), Want::Float, 4)?;
        }
        layers += 1;
    }
    match geom {
        Some((h, d, ft)) => Ok((layers, h, d, ft)),
        None => Err(ModelError::contract(
            io.graph,
            format!(
                "missing input `past_key_values.0.key` (it has: {}); is this the right graph?",
                Io::names(&io.inputs)
            ),
        )),
    }
}

/// Checks a temporal graph against the contract.
///
/// # Errors
///
/// [`ModelError::Contract`] naming the graph and the input or output.
pub fn check_temporal(
    session: &Session,
    graph: &str,
    channels: usize,
) -> Result<LmGraphInfo, ModelError> {
    check_temporal_io(&Io::of(session, graph), Some(channels))
}

/// `channels`: the token channels the caller expects, when it checks them itself (`None`).
fn check_temporal_io(io: &Io<'_>, channels: Option<usize>) -> Result<LmGraphInfo, ModelError> {
    let graph = io.graph;
    let (frame, _) = io.tensor(false, "input_frame", Want::I64, 3)?;
    if let Some(channels) = channels.filter(|&c| frame[1] > 0 && frame[1] as usize != c) {
        return Err(ModelError::contract(
            graph,
            format!(
                "input `input_frame` has {} channels, expected {channels}",
                frame[1]
            ),
        ));
    }
    io.tensor(false, "attention_mask", Want::I64, 2)?;
    let variant = if io.inputs.iter().any(|(n, _)| n == "position_ids") {
        io.tensor(false, "position_ids", Want::I64, 2)?;
        Variant::Standard
    } else {
        Variant::Gqa
    };
    let (layers, heads, head_dim, kv) = kv_layers(io)?;
    let (hs, hidden) = io.tensor(true, "hidden", Want::Float, 3)?;
    let (ls, logits) = io.tensor(true, "text_logits", Want::Float, 3)?;
    Ok(LmGraphInfo {
        graph: graph.into(),
        variant,
        layers,
        heads,
        head_dim,
        kv,
        hidden: hidden.unwrap_or(FloatType::F32),
        hidden_dim: known(graph, "hidden", hs[2], "hidden size")?,
        logits: logits.unwrap_or(FloatType::F32),
        vocab: known(graph, "text_logits", ls[2], "vocabulary size")?,
    })
}

/// Checks a depformer graph against the contract.
///
/// # Errors
///
/// [`ModelError::Contract`] naming the graph and the input or output.
pub fn check_depformer(session: &Session, graph: &str) -> Result<LmGraphInfo, ModelError> {
    check_depformer_io(&Io::of(session, graph))
}

fn check_depformer_io(io: &Io<'_>) -> Result<LmGraphInfo, ModelError> {
    let graph = io.graph;
    let (hs, hidden) = io.tensor(false, "hidden", Want::Float, 3)?;
    io.tensor(false, "prev_token", Want::I64, 2)?;
    io.tensor(false, "substep_index", Want::I64, 0)?;
    let (layers, heads, head_dim, kv) = kv_layers(io)?;
    let (ls, logits) = io.tensor(true, "logits", Want::Float, 3)?;
    Ok(LmGraphInfo {
        graph: graph.into(),
        variant: Variant::Standard,
        layers,
        heads,
        head_dim,
        kv,
        hidden: hidden.unwrap_or(FloatType::F32),
        hidden_dim: known(graph, "hidden", hs[2], "hidden size")?,
        logits: logits.unwrap_or(FloatType::F32),
        vocab: known(graph, "logits", ls[2], "vocabulary size")?,
    })
}

/// Checks a Mimi encoder (`waveform` f32 → `codes` i64) or decoder (`codes` → `waveform`).
///
/// # Errors
///
/// [`ModelError::Contract`] naming the graph and the input or output.
pub fn check_mimi(session: &Session, graph: &str, encoder: bool) -> Result<(), ModelError> {
    check_mimi_io(&Io::of(session, graph), encoder)
}

fn check_mimi_io(io: &Io<'_>, encoder: bool) -> Result<(), ModelError> {
    if encoder {
        io.tensor(false, "waveform", Want::F32, 3)?;
        io.tensor(true, "codes", Want::I64, 3)?;
    } else {
        io.tensor(false, "codes", Want::I64, 3)?;
        io.tensor(true, "waveform", Want::F32, 3)?;
    }
    Ok(())
}
