//! The audio draw as an ONNX graph, built here: temperature, top-k and the seeded draw of
//! [`Sampler::sample`](super::sampling::Sampler::sample), for a batch of rows, run where the
//! depformer's logits are (a GPU's memory), so that a substep's token goes to the next substep
//! without a round trip through the host.
//!
//! The random numbers stay the host's: the caller draws each row's uniform from the row's own
//! [`Sampler`](super::sampling::Sampler) (one per substep, as the host draw takes) and passes
//! them in, so a seed means the same stream either way. The graph does the host's arithmetic in
//! `f64`, in the host's order: the kept logits sorted largest first (ties by lower id, as
//! ONNX's `TopK` and the host's sort both order them), `exp((l − max) / T)` summed in that
//! order, and the first token whose running sum exceeds `u · sum`. Where the host subtracts
//! instead of comparing running sums, or an `exp` rounds its last bit differently, a draw can
//! differ only when `u · sum` falls within a few units in the last place of a boundary.
//!
//! Inputs: `logits` `[n, 1, V]` (f32 or f16), `top_k` `[1]` (the largest row's k), `row_k`
//! `[n]` (each row's k, 1 for greedy), `temperature` `[n]` (1 for greedy), `uniform` `[n]`
//! (0 for greedy), `target` `[n]` and `provided` `[n]` (teacher forcing). Outputs: `token`
//! `[n, 1]` (the draw) and `next` `[n, 1]` (what the next substep is fed: the provided token
//! where there is one). Knows nothing of sessions or of the depformer's binding.

use prost::Message;

use super::onnx::proto;

/// ONNX's element type numbers used here.
const FLOAT: i32 = 1;
const BOOL: i32 = 9;
const FLOAT16: i32 = 10;
const DOUBLE: i32 = 11;
const INT64: i32 = 7;

/// The serialized draw graph for logits of `vocab` values, in f16 when `half`.
pub(crate) fn draw_graph(vocab: usize, half: bool) -> Vec<u8> {
    let mut g = Builder::default();
    g.input(
        "logits",
        if half { FLOAT16 } else { FLOAT },
        &[-1, 1, vocab as i64],
    );
    g.input("top_k", INT64, &[1]);
    g.input("row_k", INT64, &[-1]);
    g.input("temperature", DOUBLE, &[-1]);
    g.input("uniform", DOUBLE, &[-1]);
    g.input("target", INT64, &[-1]);
    g.input("provided", BOOL, &[-1]);
    g.int64s("axis1", &[1], &[1]);
    g.int64s("zero1", &[1], &[0]);
    g.int64s("one1", &[1], &[1]);
    g.int64s("last1", &[1], &[-1]);
    g.int64s("end1", &[1], &[i64::MAX]);
    g.int64s("zero", &[], &[0]);
    g.int64s("one", &[], &[1]);
    g.doubles("zero_d", &[], &[0.0]);

    // The logits in f64, one row each: [n, V].
    g.node("Cast", &["logits"], &["wide"], &[("to", DOUBLE as i64)]);
    g.node("Squeeze", &["wide", "axis1"], &["rows"], &[]);
    // The kept logits, largest first (ties: lower id first), and their ids: [n, K].
    g.node(
        "TopK",
        &["rows", "top_k"],
        &["kept", "ids"],
        &[("axis", 1), ("largest", 1), ("sorted", 1)],
    );
    g.node("Slice", &["kept", "zero1", "one1", "axis1"], &["max"], &[]);
    g.node("Sub", &["kept", "max"], &["centred"], &[]);
    g.node("Unsqueeze", &["temperature", "axis1"], &["t"], &[]);
    g.node("Div", &["centred", "t"], &["scaled"], &[]);
    g.node("Exp", &["scaled"], &["weights"], &[]);
    // Each row keeps its own k of the K sorted: the rest weigh nothing.
    g.node("Squeeze", &["top_k"], &["k"], &[]);
    g.node("Range", &["zero", "k", "one"], &["position"], &[]);
    g.node("Unsqueeze", &["row_k", "axis1"], &["rk"], &[]);
    g.node("Less", &["position", "rk"], &["kept_here"], &[]);
    g.node("Where", &["kept_here", "weights", "zero_d"], &["w"], &[]);
    g.node("CumSum", &["w", "one"], &["running"], &[]);
    g.node(
        "Slice",
        &["running", "last1", "end1", "axis1"],
        &["sum"],
        &[],
    );
    g.node("Unsqueeze", &["uniform", "axis1"], &["u"], &[]);
    g.node("Mul", &["u", "sum"], &["point"], &[]);
    // The first position whose running sum exceeds the point (the last kept if none does).
    g.node("LessOrEqual", &["running", "point"], &["passed"], &[]);
    g.node("Cast", &["passed"], &["passed_n"], &[("to", INT64 as i64)]);
    g.node(
        "ReduceSum",
        &["passed_n", "axis1"],
        &["at"],
        &[("keepdims", 1)],
    );
    g.node("Sub", &["rk", "one1"], &["last"], &[]);
    g.node("Min", &["at", "last"], &["at_kept"], &[]);
    g.node(
        "GatherElements",
        &["ids", "at_kept"],
        &["token"],
        &[("axis", 1)],
    );
    g.node("Unsqueeze", &["target", "axis1"], &["forced"], &[]);
    g.node("Unsqueeze", &["provided", "axis1"], &["forcing"], &[]);
    g.node("Where", &["forcing", "forced", "token"], &["next"], &[]);
    g.output("token", INT64, &[-1, 1]);
    g.output("next", INT64, &[-1, 1]);
    g.finish("duplex_audio_draw")
}

/// Collects a graph's pieces.
#[derive(Default)]
struct Builder {
    graph: proto::Graph,
}

impl Builder {
    fn value(name: &str, elem: i32, shape: &[i64]) -> proto::ValueInfo {
        let dim = shape
            .iter()
            .enumerate()
            .map(|(i, &d)| proto::Dimension {
                value: Some(if d < 0 {
                    proto::DimValue::Param(format!("{name}_{i}"))
                } else {
                    proto::DimValue::Value(d)
                }),
            })
            .collect();
        proto::ValueInfo {
            name: name.into(),
            r#type: Some(proto::Type {
                tensor_type: Some(proto::TensorType {
                    elem_type: elem,
                    shape: Some(proto::Shape { dim }),
                }),
            }),
        }
    }

    fn input(&mut self, name: &str, elem: i32, shape: &[i64]) {
        self.graph.input.push(Self::value(name, elem, shape));
    }

    fn output(&mut self, name: &str, elem: i32, shape: &[i64]) {
        self.graph.output.push(Self::value(name, elem, shape));
    }

    fn int64s(&mut self, name: &str, dims: &[i64], values: &[i64]) {
        self.graph.initializer.push(proto::Tensor {
            dims: dims.to_vec(),
            data_type: INT64,
            int64_data: values.to_vec(),
            name: name.into(),
            ..Default::default()
        });
    }

    fn doubles(&mut self, name: &str, dims: &[i64], values: &[f64]) {
        self.graph.initializer.push(proto::Tensor {
            dims: dims.to_vec(),
            data_type: DOUBLE,
            double_data: values.to_vec(),
            name: name.into(),
            ..Default::default()
        });
    }

    fn node(&mut self, op: &str, inputs: &[&str], outputs: &[&str], ints: &[(&str, i64)]) {
        self.graph.node.push(proto::Node {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            op_type: op.into(),
            attribute: ints
                .iter()
                .map(|&(name, i)| proto::Attribute {
                    name: name.into(),
                    i,
                    r#type: 2,
                })
                .collect(),
        });
    }

    fn finish(mut self, name: &str) -> Vec<u8> {
        self.graph.name = name.into();
        proto::Model {
            // IR 10, opset 21: what ONNX Runtime 1.20 on reads.
            ir_version: 10,
            graph: Some(self.graph),
            opset_import: vec![proto::OpsetId {
                domain: String::new(),
                version: 21,
            }],
        }
        .encode_to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_graph_reads_back_with_its_contract() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("draw.onnx");
        std::fs::write(&path, draw_graph(64, true)).unwrap();
        let g = crate::model::onnx::GraphFile::read(&path).unwrap().unwrap();
        let names: Vec<&str> = g.inputs.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "logits",
                "top_k",
                "row_k",
                "temperature",
                "uniform",
                "target",
                "provided"
            ]
        );
        let outs: Vec<&str> = g.outputs.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(outs, ["token", "next"]);
    }
}
