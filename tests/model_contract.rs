//! Model packs that do not match the contract are refused with errors naming the graph and the
//! input: a missing graph, a graph of the wrong kind, a renamed input, a wrong dtype.

#[path = "support/packs.rs"]
mod packs;

use std::path::Path;
use std::process::Command;

use duplex::model::depformer::Depformer;
use duplex::model::pack::Pack;
use duplex::model::session::SessionOptions;
use duplex::model::temporal::{Temporal, TemporalOptions};

/// Rewrites `graph` of pack `name` with a Python/onnx snippet editing `m` (the ModelProto).
fn edited(name: &str, graph: &str, edit: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let (dir, pack) = packs::variant(name, "");
    let link = pack.join(graph);
    let target = std::fs::read_link(&link).unwrap();
    std::fs::remove_file(&link).unwrap();
    std::fs::create_dir(&link).unwrap();
    let script = format!(
        r#"
import onnx, sys
m = onnx.load(sys.argv[1])
{edit}
onnx.save(m, sys.argv[2], save_as_external_data=True, location="model.onnx.data")
"#
    );
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(root.join(".venv/bin/python"))
        .args(["-c", &script])
        .arg(target.join("model.onnx"))
        .arg(link.join("model.onnx"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (dir, pack)
}

#[test]
fn a_missing_graph_is_named() {
    let (_d, pack) = packs::variant("tiny", "");
    std::fs::remove_file(pack.join("mimi_decoder")).unwrap();
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(
        e.contains("mimi_decoder/model.onnx: missing mimi_decoder graph"),
        "{e}"
    );
    let e = Pack::open(Path::new("/nonexistent/pack"))
        .unwrap_err()
        .to_string();
    assert_eq!(e, "/nonexistent/pack: model pack directory not found");
}

#[test]
fn a_graph_of_the_wrong_kind_is_named() {
    let (_d, pack) = packs::variant("tiny", "");
    std::fs::remove_file(pack.join("temporal")).unwrap();
    std::os::unix::fs::symlink(packs::pack("tiny").join("depformer"), pack.join("temporal"))
        .unwrap();
    let pack = Pack::open(&pack).unwrap();
    let e = Temporal::open(&pack, &TemporalOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with(
            "temporal: missing input `input_frame` (it has: hidden, prev_token, substep_index"
        ),
        "{e}"
    );
    assert!(e.contains("is this the right graph?"), "{e}");
}

#[test]
fn a_renamed_input_is_named() {
    let (_d, pack) = edited(
        "tiny",
        "temporal",
        r#"
old, new = "attention_mask", "mask"
for i in m.graph.input:
    if i.name == old: i.name = new
for n in m.graph.node:
    for k, x in enumerate(n.input):
        if x == old: n.input[k] = new
"#,
    );
    let pack = Pack::open(&pack).unwrap();
    let e = Temporal::open(&pack, &TemporalOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with("temporal: missing input `attention_mask` (it has: input_frame, mask,"),
        "{e}"
    );
}

#[test]
fn a_wrong_dtype_is_named() {
    let (_d, pack) = edited(
        "tiny",
        "depformer",
        // prev_token becomes int32, cast back to int64 inside, so ONNX Runtime loads the graph
        // and only the contract check can object.
        r#"
for n in m.graph.node:
    for k, x in enumerate(n.input):
        if x == "prev_token": n.input[k] = "prev_token_i64"
m.graph.node.insert(0, onnx.helper.make_node("Cast", ["prev_token"], ["prev_token_i64"], to=onnx.TensorProto.INT64))
for i in m.graph.input:
    if i.name == "prev_token": i.type.tensor_type.elem_type = onnx.TensorProto.INT32
"#,
    );
    let pack = Pack::open(&pack).unwrap();
    let e = Depformer::open(&pack, &SessionOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        e,
        "depformer: input `prev_token` has type int32, expected int64"
    );
}

#[test]
fn a_bad_manifest_is_named() {
    let (_d, pack) = packs::variant("tiny", "silence_codes: [1, 2, 3]\n");
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(
        e.contains("pack.yaml: `silence_codes` must hold 8 codes in 0..2048"),
        "{e}"
    );
    let (_d, pack) = packs::variant("tiny", "delays: [0, 1]\n");
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(e.contains("`delays` has 2 entries, expected 17"), "{e}");
}
