//! What a `model.onnx` file says about itself, read without ONNX Runtime: its inputs and
//! outputs (names, element types, shapes, symbolic dimensions), its initializers (names,
//! shapes, where external data lives) and its weight-only quantized nodes (`MatMulNBits` and
//! `GatherBlockQuantized`: bits, block size, accuracy level).
//!
//! This is what lets a pack be checked when it is opened, before any session is built: the
//! graph contract, `pack.yaml` against the embedding tables and the RoPE tables, and the
//! external weight files against the sizes the graph expects. Only the fields needed are
//! declared (with `prost`, the protobuf library); everything else in the file, weights
//! included, is skipped while decoding. Knows nothing of what the graphs are for.

use std::path::{Path, PathBuf};

use prost::Message;

/// An ONNX element type (`TensorProto.DataType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    /// `float`.
    F32,
    /// `float16`.
    F16,
    /// `double`.
    F64,
    /// `int64`.
    I64,
    /// `int32`.
    I32,
    /// `bool`.
    Bool,
    /// Any other, by its ONNX number.
    Other(i32),
}

impl Elem {
    fn from_onnx(n: i32) -> Self {
        match n {
            1 => Elem::F32,
            10 => Elem::F16,
            11 => Elem::F64,
            7 => Elem::I64,
            6 => Elem::I32,
            9 => Elem::Bool,
            other => Elem::Other(other),
        }
    }

    /// ONNX's name for it (`float`, `float16`, `int64`, …).
    pub fn name(&self) -> String {
        match self {
            Elem::F32 => "float".into(),
            Elem::F16 => "float16".into(),
            Elem::F64 => "double".into(),
            Elem::I64 => "int64".into(),
            Elem::I32 => "int32".into(),
            Elem::Bool => "bool".into(),
            Elem::Other(n) => format!("ONNX type {n}"),
        }
    }
}

/// One dimension of a declared shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(i64),
    /// A named, symbolic size (`batch`, `1920*sequence_len`).
    Symbol(String),
    /// Not given.
    Unknown,
}

impl Dim {
    /// The size when fixed; -1 otherwise (how ONNX Runtime reports a free dimension).
    pub fn value(&self) -> i64 {
        match self {
            Dim::Fixed(n) => *n,
            _ => -1,
        }
    }
}

/// A graph input or output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueInfo {
    /// Its name.
    pub name: String,
    /// Element type; `None` when it is not a tensor.
    pub elem: Option<Elem>,
    /// Declared shape.
    pub dims: Vec<Dim>,
}

/// A weight of the graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Initializer {
    /// Its name.
    pub name: String,
    /// Its shape.
    pub dims: Vec<i64>,
    /// Element type.
    pub elem: Elem,
    /// For external data: the file (relative to the graph), offset and length in bytes.
    pub external: Option<(String, u64, Option<u64>)>,
}

/// A weight-only quantized node (ONNX Runtime's `MatMulNBits`, or `GatherBlockQuantized` for an
/// embedding table): the bits of its weights and the weights that share a scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NBits {
    /// Bits per weight (4 or 8).
    pub bits: i64,
    /// Weights per scale.
    pub block_size: i64,
    /// A MatMul's `accuracy_level` (4: its CPU kernel multiplies in int8); 0 for a table.
    pub accuracy_level: i64,
    /// `GatherBlockQuantized` (a table) rather than `MatMulNBits`.
    pub gather: bool,
}

/// What a `model.onnx` declares.
#[derive(Debug, Clone, Default)]
pub struct GraphFile {
    /// The file.
    pub path: PathBuf,
    /// Graph inputs that are not initializers.
    pub inputs: Vec<ValueInfo>,
    /// Graph outputs.
    pub outputs: Vec<ValueInfo>,
    /// Weights.
    pub initializers: Vec<Initializer>,
    /// Its `MatMulNBits` and `GatherBlockQuantized` nodes, in graph order.
    pub nbits: Vec<NBits>,
}

/// Why a graph file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", path.display())]
pub struct GraphFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub detail: String,
}

/// Graphs whose weights are inside `model.onnx` can be large; beyond this the file is not
/// read for checks (the exporter writes weights to `model.onnx.data`, keeping `model.onnx`
/// small whatever the model's size).
pub const MAX_GRAPH_BYTES: u64 = 512 << 20;

impl GraphFile {
    /// Reads and decodes `path`. `Ok(None)` when the file is larger than
    /// [`MAX_GRAPH_BYTES`] (weights inside it): there is nothing cheap to check.
    ///
    /// # Errors
    ///
    /// When the file cannot be read or is not an ONNX model.
    pub fn read(path: &Path) -> Result<Option<GraphFile>, GraphFileError> {
        let err = |detail: String| GraphFileError {
            path: path.to_path_buf(),
            detail,
        };
        let len = std::fs::metadata(path)
            .map_err(|e| err(e.to_string()))?
            .len();
        if len > MAX_GRAPH_BYTES {
            return Ok(None);
        }
        let bytes =
            crate::files::read_limited(path, MAX_GRAPH_BYTES).map_err(|e| err(e.to_string()))?;
        let model = proto::Model::decode(bytes.as_slice())
            .map_err(|e| err(format!("not an ONNX model ({e})")))?;
        let Some(graph) = model.graph else {
            return Err(err("not an ONNX model (it holds no graph)".into()));
        };
        if graph.node.is_empty() && graph.output.is_empty() {
            return Err(err("not an ONNX model (its graph is empty)".into()));
        }
        let info = |v: &proto::ValueInfo| {
            let tensor = v.r#type.as_ref().and_then(|t| t.tensor_type.as_ref());
            ValueInfo {
                name: v.name.clone(),
                elem: tensor.map(|t| Elem::from_onnx(t.elem_type)),
                dims: tensor
                    .and_then(|t| t.shape.as_ref())
                    .map(|s| {
                        s.dim
                            .iter()
                            .map(|d| match &d.value {
                                Some(proto::DimValue::Value(n)) => Dim::Fixed(*n),
                                Some(proto::DimValue::Param(p)) => Dim::Symbol(p.clone()),
                                None => Dim::Unknown,
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            }
        };
        let initializers: Vec<Initializer> = graph
            .initializer
            .iter()
            .map(|t| {
                let ext = |k: &str| {
                    t.external_data
                        .iter()
                        .find(|e| e.key == k)
                        .map(|e| e.value.clone())
                };
                Initializer {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    elem: Elem::from_onnx(t.data_type),
                    external: (t.data_location == 1).then(|| {
                        (
                            ext("location").unwrap_or_default(),
                            ext("offset").and_then(|o| o.parse().ok()).unwrap_or(0),
                            ext("length").and_then(|l| l.parse().ok()),
                        )
                    }),
                }
            })
            .collect();
        let is_weight = |name: &str| initializers.iter().any(|i| i.name == name);
        Ok(Some(GraphFile {
            path: path.to_path_buf(),
            inputs: graph
                .input
                .iter()
                .filter(|v| !is_weight(&v.name))
                .map(info)
                .collect(),
            outputs: graph.output.iter().map(info).collect(),
            initializers,
            nbits: graph
                .node
                .iter()
                .filter(|n| n.op_type == "MatMulNBits" || n.op_type == "GatherBlockQuantized")
                .map(|n| {
                    let int = |name: &str, default: i64| {
                        n.attribute
                            .iter()
                            .find(|a| a.name == name)
                            .map_or(default, |a| a.i)
                    };
                    // (The defaults when an attribute is not given are the operators'
                    // specification's: 4 bits, and a table's blocks of 128.)
                    let gather = n.op_type == "GatherBlockQuantized";
                    NBits {
                        bits: int("bits", 4),
                        block_size: int("block_size", if gather { 128 } else { 0 }),
                        accuracy_level: int("accuracy_level", 0),
                        gather,
                    }
                })
                .collect(),
        }))
    }

    /// The initializer called `name`.
    pub fn initializer(&self, name: &str) -> Option<&Initializer> {
        self.initializers.iter().find(|i| i.name == name)
    }

    /// Checks that every external weight lies inside its file.
    ///
    /// # Errors
    ///
    /// The first weight whose file is missing or too short, naming both.
    pub fn check_external_data(&self) -> Result<(), GraphFileError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let mut sizes: Vec<(String, Option<u64>)> = Vec::new();
        for init in &self.initializers {
            let Some((file, offset, length)) = &init.external else {
                continue;
            };
            let size = match sizes.iter().find(|(f, _)| f == file) {
                Some((_, s)) => *s,
                None => {
                    let s = std::fs::metadata(dir.join(file)).ok().map(|m| m.len());
                    sizes.push((file.clone(), s));
                    s
                }
            };
            let err = |detail: String| GraphFileError {
                path: dir.join(file),
                detail,
            };
            let Some(size) = size else {
                return Err(err(format!(
                    "missing: it holds the weight `{}` of {}",
                    init.name,
                    self.path.display()
                )));
            };
            let end = offset + length.unwrap_or(0);
            if end > size {
                return Err(err(format!(
                    "{size} bytes, but the weight `{}` of {} ends at byte {end}: the file is cut short",
                    init.name,
                    self.path.display()
                )));
            }
        }
        Ok(())
    }
}

/// The subset of `onnx.proto` that is read here, and written by the graphs duplex builds itself
/// ([`draw_graph`](super::draw_graph)); field numbers as in the ONNX specification. Weights'
/// bytes (`raw_data`) are not declared, so decoding a pack's graph skips them.
pub(crate) mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Model {
        #[prost(int64, tag = "1")]
        pub ir_version: i64,
        #[prost(message, optional, tag = "7")]
        pub graph: Option<Graph>,
        #[prost(message, repeated, tag = "8")]
        pub opset_import: Vec<OpsetId>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct OpsetId {
        #[prost(string, tag = "1")]
        pub domain: String,
        #[prost(int64, tag = "2")]
        pub version: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Graph {
        #[prost(message, repeated, tag = "1")]
        pub node: Vec<Node>,
        #[prost(string, tag = "2")]
        pub name: String,
        #[prost(message, repeated, tag = "5")]
        pub initializer: Vec<Tensor>,
        #[prost(message, repeated, tag = "11")]
        pub input: Vec<ValueInfo>,
        #[prost(message, repeated, tag = "12")]
        pub output: Vec<ValueInfo>,
    }

    /// Its operator, its values and its integer attributes (a graph without nodes is not a
    /// model).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Node {
        #[prost(string, repeated, tag = "1")]
        pub input: Vec<String>,
        #[prost(string, repeated, tag = "2")]
        pub output: Vec<String>,
        #[prost(string, tag = "4")]
        pub op_type: String,
        #[prost(message, repeated, tag = "5")]
        pub attribute: Vec<Attribute>,
    }

    /// An integer attribute (`type` 2, `INT`).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Attribute {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(int64, tag = "3")]
        pub i: i64,
        #[prost(int32, tag = "20")]
        pub r#type: i32,
    }

    /// A tensor's description; small constants carry their values in `int64_data` or
    /// `double_data`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Tensor {
        #[prost(int64, repeated, tag = "1")]
        pub dims: Vec<i64>,
        #[prost(int32, tag = "2")]
        pub data_type: i32,
        #[prost(int64, repeated, tag = "7")]
        pub int64_data: Vec<i64>,
        #[prost(string, tag = "8")]
        pub name: String,
        #[prost(double, repeated, tag = "10")]
        pub double_data: Vec<f64>,
        #[prost(message, repeated, tag = "13")]
        pub external_data: Vec<Entry>,
        #[prost(int32, tag = "14")]
        pub data_location: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Entry {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueInfo {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, optional, tag = "2")]
        pub r#type: Option<Type>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Type {
        #[prost(message, optional, tag = "1")]
        pub tensor_type: Option<TensorType>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorType {
        #[prost(int32, tag = "1")]
        pub elem_type: i32,
        #[prost(message, optional, tag = "2")]
        pub shape: Option<Shape>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Shape {
        #[prost(message, repeated, tag = "1")]
        pub dim: Vec<Dimension>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dimension {
        #[prost(oneof = "DimValue", tags = "1, 2")]
        pub value: Option<DimValue>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum DimValue {
        #[prost(int64, tag = "1")]
        Value(i64),
        #[prost(string, tag = "2")]
        Param(String),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_not_a_model() {
        let dir = tempfile::tempdir().unwrap();
        for (bytes, want) in [
            (&b"not a graph"[..], "not an ONNX model"),
            (&b""[..], "not an ONNX model"),
            (&[0xff; 64][..], "not an ONNX model"),
        ] {
            let p = dir.path().join("model.onnx");
            std::fs::write(&p, bytes).unwrap();
            let e = GraphFile::read(&p).unwrap_err().to_string();
            assert!(e.contains("model.onnx") && e.contains(want), "{e}");
        }
    }
}
