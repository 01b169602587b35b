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
//! assumed. A missing file, a wrong input name, dtype or rank, or a graph of the wrong kind is an
//! error that names the graph and the input.

use std::path::{Path, PathBuf};

use ort::session::Session;
use ort::value::{TensorElementType, ValueType};
use serde::Deserialize;

use super::error::ModelError;
use super::lmgen::StreamLayout;

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
}

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
        }
    }
}

impl PackManifest {
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
    /// Opens `dir`: checks that it holds the four graphs and reads `pack.yaml` if present.
    ///
    /// # Errors
    ///
    /// [`ModelError::Pack`] naming the missing directory or file, or the bad manifest key.
    pub fn open(dir: &Path) -> Result<Pack, ModelError> {
        let err = |path: &Path, detail: String| ModelError::Pack {
            path: path.to_path_buf(),
            detail,
        };
        if !dir.is_dir() {
            return Err(err(dir, "model pack directory not found".into()));
        }
        for g in [
            Graph::MimiEncoder,
            Graph::MimiDecoder,
            Graph::Temporal,
            Graph::Depformer,
        ] {
            let p = dir.join(g.dir()).join("model.onnx");
            if !p.is_file() {
                return Err(err(
                    &p,
                    format!("missing {} graph (a pack holds mimi_encoder/, mimi_decoder/, temporal/ and depformer/, each with model.onnx)", g.dir()),
                ));
            }
        }
        let mf = dir.join("pack.yaml");
        let manifest = if mf.is_file() {
            let text = std::fs::read_to_string(&mf).map_err(|e| err(&mf, e.to_string()))?;
            let m: PackManifest = config::Config::builder()
                .add_source(config::File::from_str(&text, config::FileFormat::Yaml))
                .build()
                .and_then(|c| c.try_deserialize())
                .map_err(|e| err(&mf, e.to_string()))?;
            m
        } else {
            PackManifest::default()
        };
        let l = manifest.layout();
        if manifest.delays.len() != 1 + 2 * manifest.codebooks {
            return Err(err(
                &mf,
                format!(
                    "`delays` has {} entries, expected {} (1 text + 2 × {} codebooks)",
                    manifest.delays.len(),
                    1 + 2 * manifest.codebooks,
                    manifest.codebooks
                ),
            ));
        }
        for (key, v) in [
            ("silence_codes", &manifest.silence_codes),
            ("sine_codes", &manifest.sine_codes),
        ] {
            if v.len() != manifest.codebooks
                || v.iter().any(|&c| c < 0 || c >= manifest.audio_vocab)
            {
                return Err(err(
                    &mf,
                    format!(
                        "`{key}` must hold {} codes in 0..{}",
                        manifest.codebooks, manifest.audio_vocab
                    ),
                ));
            }
        }
        debug_assert_eq!(l.channels(), manifest.delays.len());
        Ok(Pack {
            dir: dir.to_path_buf(),
            manifest,
        })
    }

    /// Path of a graph's `model.onnx`.
    pub fn graph_path(&self, g: Graph) -> PathBuf {
        self.dir.join(g.dir()).join("model.onnx")
    }

    /// The tokenizer path, if the manifest names one (relative to the pack).
    pub fn tokenizer(&self) -> Option<PathBuf> {
        self.manifest.tokenizer.as_ref().map(|t| self.dir.join(t))
    }
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

/// ONNX's name of an element type (`float`, `float16`, `int64`, …).
fn type_name(ty: TensorElementType) -> String {
    match ty {
        TensorElementType::Float32 => "float".into(),
        TensorElementType::Float16 => "float16".into(),
        TensorElementType::Float64 => "double".into(),
        TensorElementType::Int64 => "int64".into(),
        TensorElementType::Int32 => "int32".into(),
        TensorElementType::Int16 => "int16".into(),
        TensorElementType::Int8 => "int8".into(),
        TensorElementType::Uint8 => "uint8".into(),
        TensorElementType::Bool => "bool".into(),
        other => format!("{other}"),
    }
}

fn describe(v: &ValueType) -> String {
    match v {
        ValueType::Tensor { ty, shape, .. } => format!("{} {:?}", type_name(*ty), &shape[..]),
        other => format!("{other:?}"),
    }
}

struct Io<'a> {
    graph: &'a str,
    inputs: Vec<(String, ValueType)>,
    outputs: Vec<(String, ValueType)>,
}

impl<'a> Io<'a> {
    fn of(session: &Session, graph: &'a str) -> Self {
        Io {
            graph,
            inputs: session
                .inputs()
                .iter()
                .map(|o| (o.name().to_string(), o.dtype().clone()))
                .collect(),
            outputs: session
                .outputs()
                .iter()
                .map(|o| (o.name().to_string(), o.dtype().clone()))
                .collect(),
        }
    }

    fn names(list: &[(String, ValueType)]) -> String {
        list.iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn find(&self, output: bool, name: &str) -> Result<&ValueType, ModelError> {
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
        let ValueType::Tensor { ty, shape, .. } = v else {
            return Err(ModelError::contract(
                self.graph,
                format!("{what} `{name}` is {}, expected a tensor", describe(v)),
            ));
        };
        let float = match ty {
            TensorElementType::Float32 => Some(FloatType::F32),
            TensorElementType::Float16 => Some(FloatType::F16),
            _ => None,
        };
        let ok = match want {
            Want::I64 => *ty == TensorElementType::Int64,
            Want::Float => float.is_some(),
            Want::F32 => float == Some(FloatType::F32),
        };
        if !ok {
            return Err(ModelError::contract(
                self.graph,
                format!(
                    "{what} `{name}` has type {}, expected {}",
                    type_name(*ty),
                    want.name()
                ),
            ));
        }
        if shape.len() != rank {
            return Err(ModelError::contract(
                self.graph,
                format!(
                    "{what} `{name}` has rank {} ({:?}), expected {rank}",
                    shape.len(),
                    &shape[..]
                ),
            ));
        }
        Ok((shape.to_vec(), float))
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
    let io = Io::of(session, graph);
    let (frame, _) = io.tensor(false, "input_frame", Want::I64, 3)?;
    if frame[1] > 0 && frame[1] as usize != channels {
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
    let (layers, heads, head_dim, kv) = kv_layers(&io)?;
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
    let io = Io::of(session, graph);
    let (hs, hidden) = io.tensor(false, "hidden", Want::Float, 3)?;
    io.tensor(false, "prev_token", Want::I64, 2)?;
    io.tensor(false, "substep_index", Want::I64, 0)?;
    let (layers, heads, head_dim, kv) = kv_layers(&io)?;
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
    let io = Io::of(session, graph);
    if encoder {
        io.tensor(false, "waveform", Want::F32, 3)?;
        io.tensor(true, "codes", Want::I64, 3)?;
    } else {
        io.tensor(false, "codes", Want::I64, 3)?;
        io.tensor(true, "waveform", Want::F32, 3)?;
    }
    Ok(())
}
