//! `pack.yaml`: what a pack says of itself that cannot be read from its graphs, read at a
//! bounded cost with unknown keys refused (with a suggestion) and names turned into enums once.
//! Knows nothing of sessions; the checks against the graphs are the pack's ([`super::Pack`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::contract::{FloatType, LmGraphInfo, Variant};
use crate::model::error::ModelError;
use crate::model::lmgen::StreamLayout;
use crate::model::onnx::NBits;

/// The temporal graph an exporter says it built: `pack.yaml`'s `variant` (the exporter's names:
/// attention kind, then dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum ExportVariant {
    /// `standard`: plain causal attention.
    #[serde(rename = "standard")]
    Standard,
    /// `gqa`: `GroupQueryAttention`, f32.
    #[serde(rename = "gqa")]
    Gqa,
    /// `gqa-fp16`: `GroupQueryAttention`, f16.
    #[serde(rename = "gqa-fp16")]
    GqaFp16,
}

impl ExportVariant {
    /// The names `pack.yaml` may give.
    pub const NAMES: [&'static str; 3] = ["standard", "gqa", "gqa-fp16"];

    /// Its name in `pack.yaml`.
    pub fn name(&self) -> &'static str {
        match self {
            ExportVariant::Standard => "standard",
            ExportVariant::Gqa => "gqa",
            ExportVariant::GqaFp16 => "gqa-fp16",
        }
    }

    /// The attention the graph has.
    pub fn attention(&self) -> Variant {
        match self {
            ExportVariant::Standard => Variant::Standard,
            ExportVariant::Gqa | ExportVariant::GqaFp16 => Variant::Gqa,
        }
    }
}

/// A codec strategy a pack has: `pack.yaml`'s `mimi_streaming`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MimiStreaming {
    /// `window`: the whole-utterance graphs (always there).
    Window,
    /// `stateful`: the f32 step graphs (`mimi_*_step/`).
    Stateful,
    /// `stateful_f16`: the f16 step graphs (`mimi_*_step_f16/`).
    StatefulF16,
}

impl MimiStreaming {
    /// The names `pack.yaml` may give.
    pub const NAMES: [&'static str; 3] = ["window", "stateful", "stateful_f16"];

    /// Its name in `pack.yaml`.
    pub fn name(&self) -> &'static str {
        match self {
            MimiStreaming::Window => "window",
            MimiStreaming::Stateful => "stateful",
            MimiStreaming::StatefulF16 => "stateful_f16",
        }
    }

    /// The precision of its step graphs; `None` for the window graphs.
    pub fn step_dtype(&self) -> Option<FloatType> {
        match self {
            MimiStreaming::Window => None,
            MimiStreaming::Stateful => Some(FloatType::F32),
            MimiStreaming::StatefulF16 => Some(FloatType::F16),
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
    /// What the exporter says it built (checked against the graphs when given).
    pub variant: Option<ExportVariant>,
    /// The temporal graph's cache precision (checked against the graph when given).
    pub dtype: Option<FloatType>,
    /// Which codec the pack holds (`tiny`, `full`; informational).
    pub mimi: Option<String>,
    /// Special text tokens (informational).
    pub special_text_ids: Option<std::collections::BTreeMap<String, i64>>,
    /// The temporal transformer's shape (checked against the graph when given).
    pub temporal: Option<LmShape>,
    /// The depformer's shape (checked against the graph when given).
    pub depformer: Option<LmShape>,
    /// The codec strategies the pack has. Checked against the folders; when absent, step
    /// graphs present in the folders are used all the same.
    pub mimi_streaming: Option<Vec<MimiStreaming>>,
    /// The graphs whose weights are quantized, and how (`tools/quantize_pack.py` writes it;
    /// checked against the graphs' `MatMulNBits` and `GatherBlockQuantized` nodes).
    pub quantization: Option<std::collections::BTreeMap<String, Quantized>>,
}

/// A graph's weight-only quantization as the manifest states it (`quantization.<graph>`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Quantized {
    /// Bits per weight: 8 or 4.
    pub bits: i64,
    /// Rows per scale.
    pub block_size: i64,
    /// How the scales were chosen (`symmetric`; informational).
    pub scheme: Option<String>,
    /// How many MatMuls were rewritten (`MatMulNBits`).
    pub matmuls: Option<usize>,
    /// How many embedding tables were rewritten (`GatherBlockQuantized`); none when absent.
    pub gathers: Option<usize>,
    /// The MatMuls' `accuracy_level` (4: a CPU multiplies in int8; 0: in float).
    pub accuracy_level: Option<i64>,
}

impl Quantized {
    /// `int8` or `int4`.
    pub fn name(&self) -> String {
        format!("int{}", self.bits)
    }
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

/// The keys of one graph's `quantization` entry.
const QUANTIZED_KEYS: &[&str] = &[
    "bits",
    "block_size",
    "scheme",
    "matmuls",
    "gathers",
    "accuracy_level",
];

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
    (
        "quantization",
        &[
            "temporal",
            "depformer",
            "mimi_encoder_step",
            "mimi_decoder_step",
            "mimi_encoder_step_f16",
            "mimi_decoder_step_f16",
        ],
    ),
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
            quantization: None,
        }
    }
}

impl PackManifest {
    /// The text tokens that are not words ([`TextSpecials`](crate::model::sampling::TextSpecials)):
    /// `text_padding`, the `epad` of `special_text_ids` (0 when not given, as PersonaPlex's
    /// tokenizer has it), the initial text token.
    pub fn text_specials(&self) -> crate::model::sampling::TextSpecials {
        crate::model::sampling::TextSpecials {
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

pub(super) fn manifest_error(mf: &Path, key: &str, detail: String) -> ModelError {
    ModelError::Manifest {
        path: mf.to_path_buf(),
        key: key.to_string(),
        detail,
    }
}

/// Reads `pack.yaml`: bounded, unknown keys refused (with a suggestion), types checked.
pub(super) fn read_manifest(mf: &Path) -> Result<PackManifest, ModelError> {
    use crate::yaml::{self, Limits};
    let origin = mf.display().to_string();
    let pack_err = |e: yaml::YamlError| ModelError::Pack {
        path: mf.to_path_buf(),
        detail: e.message,
    };
    let text = yaml::read(mf, Limits::FILES).map_err(pack_err)?;
    let root = yaml::parse(&text, &origin, Limits::FILES).map_err(pack_err)?;
    let names: Vec<&str> = MANIFEST_KEYS.iter().map(|(k, _)| *k).collect();
    let unknown = |key: String, known: &[&str]| {
        let last = key.rsplit('.').next().unwrap_or(&key).to_string();
        let hint = yaml::did_you_mean(&last, known.iter().copied());
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
            if k == "quantization" {
                for (g, q) in t {
                    let config::ValueKind::Table(q) = &q.kind else {
                        continue;
                    };
                    if let Some(qk) = q.keys().find(|qk| !QUANTIZED_KEYS.contains(&qk.as_str())) {
                        return Err(unknown(format!("{k}.{g}.{qk}"), QUANTIZED_KEYS));
                    }
                }
            }
        }
    }
    // The keys whose values are names: an unknown name is named with the key.
    let one_of = |key: &str, v: &config::Value, names: &[&str]| match &v.kind {
        config::ValueKind::String(s) if names.contains(&s.as_str()) => Ok(()),
        config::ValueKind::String(s) => Err(manifest_error(
            mf,
            key,
            format!("{s:?} is not one of {}", names.join(", ")),
        )),
        other => Err(manifest_error(
            mf,
            key,
            format!("expected one of {}, got {other}", names.join(", ")),
        )),
    };
    if let Some(v) = root.get("variant") {
        one_of("variant", v, &ExportVariant::NAMES)?;
    }
    if let Some(v) = root.get("dtype") {
        one_of("dtype", v, &["f32", "f16"])?;
    }
    if let Some(v) = root.get("mimi_streaming") {
        let config::ValueKind::Array(items) = &v.kind else {
            return Err(manifest_error(
                mf,
                "mimi_streaming",
                format!("expected a list of {}", MimiStreaming::NAMES.join(", ")),
            ));
        };
        for it in items {
            one_of("mimi_streaming", it, &MimiStreaming::NAMES)?;
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

/// The quantization the manifest states for `graph` against the graph's quantized nodes
/// (`MatMulNBits`, and `GatherBlockQuantized` for tables): both say none, or both say the same
/// bits and block size, the same counts (MatMuls when stated; tables, none when not stated) and
/// the same `accuracy_level` (when stated).
pub(super) fn check_quantization(
    mf: &Path,
    graph: &str,
    said: Option<&Quantized>,
    nodes: &[NBits],
) -> Result<(), ModelError> {
    let key = format!("quantization.{graph}");
    let op = |gather: bool| {
        if gather {
            "GatherBlockQuantized"
        } else {
            "MatMulNBits"
        }
    };
    let (tables, matmuls): (Vec<&NBits>, Vec<&NBits>) = nodes.iter().partition(|n| n.gather);
    let Some(q) = said else {
        return match nodes.first() {
            None => Ok(()),
            Some(n) => Err(manifest_error(
                mf,
                "quantization",
                format!(
                    "says nothing of the {graph} graph, which has {} {} nodes ({} bits, blocks \
                     of {}): a quantized graph in a float pack's folder?",
                    nodes.iter().filter(|m| m.gather == n.gather).count(),
                    op(n.gather),
                    n.bits,
                    n.block_size
                ),
            )),
        };
    };
    if nodes.is_empty() {
        return Err(manifest_error(
            mf,
            &key,
            format!(
                "says {}, but the {graph} graph has no MatMulNBits node (its weights are float)",
                q.name()
            ),
        ));
    }
    if ![4, 8].contains(&q.bits) {
        return Err(manifest_error(
            mf,
            &format!("{key}.bits"),
            format!("{}: 8 or 4", q.bits),
        ));
    }
    if let Some(n) = nodes
        .iter()
        .find(|n| n.bits != q.bits || n.block_size != q.block_size)
    {
        return Err(manifest_error(
            mf,
            &key,
            format!(
                "says {} bits in blocks of {}, but the {graph} graph has a {} of {} bits in \
                 blocks of {}",
                q.bits,
                q.block_size,
                op(n.gather),
                n.bits,
                n.block_size
            ),
        ));
    }
    for (name, said, has, gather) in [
        ("matmuls", q.matmuls, matmuls.len(), false),
        ("gathers", Some(q.gathers.unwrap_or(0)), tables.len(), true),
    ] {
        if let Some(m) = said.filter(|&m| m != has) {
            return Err(manifest_error(
                mf,
                &format!("{key}.{name}"),
                format!("{m}, but the {graph} graph has {has} {} nodes", op(gather)),
            ));
        }
    }
    if let Some(level) = q.accuracy_level {
        if let Some(n) = matmuls.iter().find(|n| n.accuracy_level != level) {
            return Err(manifest_error(
                mf,
                &format!("{key}.accuracy_level"),
                format!(
                    "{level}, but the {graph} graph has a MatMulNBits of accuracy_level {}",
                    n.accuracy_level
                ),
            ));
        }
    }
    Ok(())
}

/// A shape the manifest states against the one the graph has.
pub(super) fn check_shape(
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
