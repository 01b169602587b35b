//! The graph contract: what each of a pack's graphs must take and give (names, ranks,
//! element types), checked from the ONNX files before any session is built and again on every
//! session ONNX Runtime builds. An error names the graph and the input. Knows nothing of
//! `pack.yaml`.

use ort::session::Session;
use ort::value::{TensorElementType, ValueType};
use serde::Deserialize;

use crate::model::error::ModelError;
use crate::model::onnx::{Elem, GraphFile};

/// Element type of a floating-point tensor in a graph (`f32`, `f16` in `pack.yaml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
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
pub(super) struct Sig {
    /// Element type (None: not a tensor).
    elem: Option<Elem>,
    /// Its name in messages (`float`, `int64`, …).
    elem_name: String,
    /// Dimensions; -1 where free.
    pub(super) shape: Vec<i64>,
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

pub(super) struct Io<'a> {
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

    pub(super) fn from_file(f: &GraphFile, graph: &'a str) -> Self {
        let sig = |v: &crate::model::onnx::ValueInfo| Sig {
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

    pub(super) fn find(&self, output: bool, name: &str) -> Result<&Sig, ModelError> {
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
pub(super) fn check_temporal_io(
    io: &Io<'_>,
    channels: Option<usize>,
) -> Result<LmGraphInfo, ModelError> {
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

pub(super) fn check_depformer_io(io: &Io<'_>) -> Result<LmGraphInfo, ModelError> {
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

pub(super) fn check_mimi_io(io: &Io<'_>, encoder: bool) -> Result<(), ModelError> {
    if encoder {
        io.tensor(false, "waveform", Want::F32, 3)?;
        io.tensor(true, "codes", Want::I64, 3)?;
    } else {
        io.tensor(false, "codes", Want::I64, 3)?;
        io.tensor(true, "waveform", Want::F32, 3)?;
    }
    Ok(())
}
