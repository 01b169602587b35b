//! Model packs that do not match the contract are refused with errors naming the graph and the
//! input: a missing graph, a graph of the wrong kind, a renamed input, a wrong dtype. Each is
//! refused twice over: when the pack is opened (read from the files) and when a session is
//! built (what ONNX Runtime reports). A `pack.yaml` that disagrees with its graphs is refused
//! when the pack is opened, naming the key.

use crate::support::packs;

use std::path::Path;
use std::process::Command;

use duplex::model::depformer::Depformer;
use duplex::model::pack::{Pack, PackManifest};
use duplex::model::session::SessionOptions;
use duplex::model::temporal::TemporalOptions;

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

/// The pack without the checks of `Pack::open`, to reach the session-side checks.
fn unchecked(dir: &Path) -> Pack {
    Pack {
        dir: dir.to_path_buf(),
        manifest: PackManifest::default(),
    }
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
    let want = "temporal: missing input `input_frame` (it has: hidden, prev_token, substep_index";
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(e.starts_with(want), "{e}");
    let e = duplex::model::temporal::open(&unchecked(&pack), &TemporalOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with(want), "{e}");
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
    let want = "temporal: missing input `attention_mask` (it has: input_frame, mask,";
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(e.starts_with(want), "{e}");
    let e = duplex::model::temporal::open(&unchecked(&pack), &TemporalOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with(want), "{e}");
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
    let want = "depformer: input `prev_token` has type int32, expected int64";
    assert_eq!(Pack::open(&pack).unwrap_err().to_string(), want);
    let e = Depformer::open(&unchecked(&pack), &SessionOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert_eq!(e, want);
}

#[test]
fn a_bad_manifest_is_named() {
    let (_d, pack) = packs::variant("tiny", "silence_codes: [1, 2, 3]\n");
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(
        e.contains("pack.yaml: `silence_codes`: must hold 8 codes in 0..2048"),
        "{e}"
    );
    let (_d, pack) = packs::variant("tiny", "delays: [0, 1]\n");
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(e.contains("`delays`: has 2 entries, expected 17"), "{e}");
}

/// The manifest's names (`variant`, `dtype`, `mimi_streaming`) are read into enums once: an
/// unknown one is refused naming the key and the names there are; a known one is checked
/// against the graphs.
#[test]
fn the_manifests_names_are_read_once_and_refused_naming_the_key() {
    for (extra, key, want) in [
        (
            "variant: gqa-fp8\n",
            "variant",
            "\"gqa-fp8\" is not one of standard, gqa, gqa-fp16",
        ),
        ("variant: 3\n", "variant", "expected one of standard, gqa"),
        ("dtype: f64\n", "dtype", "\"f64\" is not one of f32, f16"),
        (
            "dtype: f16\n",
            "dtype",
            "\"f16\", but the temporal graph's cache is f32",
        ),
        (
            "mimi_streaming: [window, statefull]\n",
            "mimi_streaming",
            "\"statefull\" is not one of window, stateful, stateful_f16",
        ),
        (
            "mimi_streaming: stateful\n",
            "mimi_streaming",
            "expected a list of window, stateful, stateful_f16",
        ),
    ] {
        let (_d, dir) = packs::variant("tiny-gqa", extra);
        let e = Pack::open(&dir).unwrap_err().to_string();
        let at = format!("{}: `{key}`: ", dir.join("pack.yaml").display());
        assert!(e.starts_with(&at) && e.contains(want), "{extra:?}: {e}");
    }
    let (_d, dir) = packs::variant(
        "tiny-gqa",
        "variant: gqa\ndtype: f32\nmimi_streaming: [window, stateful]\n",
    );
    let p = Pack::open(&dir).unwrap();
    assert_eq!(
        p.manifest.variant,
        Some(duplex::model::pack::ExportVariant::Gqa)
    );
    assert_eq!(p.manifest.dtype, Some(duplex::model::pack::FloatType::F32));
    assert_eq!(
        p.manifest.mimi_streaming,
        Some(vec![
            duplex::model::pack::MimiStreaming::Window,
            duplex::model::pack::MimiStreaming::Stateful
        ])
    );
}

/// Regression: these values were accepted when the pack was opened and failed later (at the
/// first frame, after 33 s at frame 7989 with a raw ONNX Runtime message, or with
/// `std::bad_alloc`), with exit code 1 and without naming `pack.yaml`.
#[test]
fn manifest_values_that_disagree_with_the_graphs_are_refused_naming_the_key() {
    for (pack, extra, key, want) in [
        (
            "tiny",
            "text_vocab: 100\n",
            "text_vocab",
            "whose text logits are 32000 wide",
        ),
        (
            "tiny",
            "initial_tokens:\n  text: 99999\n  audio: 2048\n",
            "initial_tokens.text",
            "outside the text table 0..=32000",
        ),
        (
            "tiny",
            "text_padding: 50000\n",
            "text_padding",
            "is not a text token",
        ),
        ("tiny", "frame_size: 0\n", "frame_size", "0 samples"),
        (
            "tiny",
            "frame_size: 960\n",
            "frame_size",
            "the codec's frames are 1920 samples",
        ),
        (
            "tiny-gqa",
            "max_positions: 9000\n",
            "max_positions",
            "more than the temporal graph's RoPE table covers (8000)",
        ),
        (
            "tiny",
            "max_positions: 1e8\n",
            "max_positions",
            "RoPE table",
        ),
        (
            "tiny",
            "audio_vocab: -1\n",
            "audio_vocab",
            "at least one token",
        ),
        (
            "tiny",
            "audio_vocab: 4096\n",
            "audio_vocab",
            "does not match the temporal graph",
        ),
        (
            "tiny",
            "text_vocb: 32000\n",
            "text_vocb",
            "did you mean `text_vocab`?",
        ),
        (
            "tiny",
            "temporal:\n  layerz: 2\n",
            "temporal.layerz",
            "did you mean `layers`?",
        ),
        (
            "tiny",
            "variant: gqa\n",
            "variant",
            "the temporal graph is the standard variant",
        ),
        (
            "tiny",
            "sample_rate: 7\n",
            "sample_rate",
            "not a codec rate",
        ),
        ("tiny", "codebooks: [8]\n", "codebooks", "expected"),
    ] {
        let (_d, dir) = packs::variant(pack, extra);
        let e = Pack::open(&dir).unwrap_err().to_string();
        let at = format!("{}: `{key}`: ", dir.join("pack.yaml").display());
        assert!(e.starts_with(&at) && e.contains(want), "{extra:?}: {e}");
    }
}

/// Regression: a pack with its temporal and depformer graphs swapped passed every check made
/// before sessions were built.
#[test]
fn swapped_graphs_are_refused_when_the_pack_is_opened() {
    let (_d, pack) = packs::variant("tiny", "");
    for (a, b) in [("temporal", "depformer"), ("depformer", "temporal")] {
        std::fs::remove_file(pack.join(a)).unwrap();
        std::os::unix::fs::symlink(packs::pack("tiny").join(b), pack.join(a)).unwrap();
    }
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(
        e.starts_with("temporal: missing input `input_frame`"),
        "{e}"
    );
}

/// Weights cut short are named with their file, before ONNX Runtime reads them.
#[test]
fn a_truncated_weights_file_is_named() {
    let (_d, pack) = packs::variant("tiny", "");
    std::fs::remove_file(pack.join("depformer")).unwrap();
    std::fs::create_dir(pack.join("depformer")).unwrap();
    let src = packs::pack("tiny").join("depformer");
    std::fs::copy(src.join("model.onnx"), pack.join("depformer/model.onnx")).unwrap();
    let data = std::fs::read(src.join("model.onnx.data")).unwrap();
    std::fs::write(
        pack.join("depformer/model.onnx.data"),
        &data[..data.len() / 2],
    )
    .unwrap();
    let e = Pack::open(&pack).unwrap_err().to_string();
    assert!(
        e.contains("depformer/model.onnx.data") && e.contains("the file is cut short"),
        "{e}"
    );
}

/// A bad pack given to a command is a configuration error: exit 2, naming `pack.yaml`.
#[test]
fn a_bad_manifest_stops_a_command_before_it_starts() {
    let (_d, pack) = packs::variant("tiny", "text_vocab: 100\n");
    let dir = tempfile::tempdir().unwrap();
    let codes = dir.path().join("codes.json");
    std::fs::write(&codes, "[[1, 2, 3, 4, 5, 6, 7, 8]]").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["replay", "--pack"])
        .arg(&pack)
        .arg("--codes")
        .arg(&codes)
        .arg("--out")
        .arg(dir.path().join("out.jsonl"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("pack.yaml: `text_vocab`: 100 does not match"),
        "{err}"
    );
}

#[test]
fn a_half_precision_pack_too_big_for_the_cpu_is_refused_before_onnx_runtime_is_asked() {
    // On the CPU provider ONNX Runtime widens a float fp16 temporal graph's weights to fp32 as
    // the session is built: a 7B's 13 GiB become 26, and the kernel kills the process with no
    // word. The pack's files say how much it will need; a machine without it is told so.
    let half = Pack::open(&packs::pack("tiny-gqa-fp16")).unwrap();
    let need = half.cpu_widened_bytes();
    let files: u64 = std::fs::read_dir(half.dir.join("temporal"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(need, 2 * files);
    half.check_cpu_room(Some(need)).unwrap();
    let err = half.check_cpu_room(Some(need - 1)).unwrap_err().to_string();
    for want in [
        half.dir.display().to_string(),
        "widens its temporal weights to fp32".into(),
        "execution_provider: cuda".into(),
        "--quantize int8 / int4".into(),
    ] {
        assert!(err.contains(&want), "{want:?} not in {err}");
    }
    // Nothing is widened where the weights are fp32 already.
    let full = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    assert_eq!(full.cpu_widened_bytes(), 0);
    full.check_cpu_room(Some(0)).unwrap();
}
