//! Paths of the tiny packs built by `make setup`, and pack variants made from them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Every graph folder of the tiny packs: the four graphs and Mimi's step graphs.
pub const ALL_GRAPHS: [&str; 8] = [
    "mimi_encoder",
    "mimi_decoder",
    "temporal",
    "depformer",
    "mimi_encoder_step",
    "mimi_decoder_step",
    "mimi_encoder_step_f16",
    "mimi_decoder_step_f16",
];

/// The codec's graph folders (whole-utterance and step graphs).
pub const CODEC_GRAPHS: [&str; 6] = [
    "mimi_encoder",
    "mimi_decoder",
    "mimi_encoder_step",
    "mimi_decoder_step",
    "mimi_encoder_step_f16",
    "mimi_decoder_step_f16",
];

pub fn pack(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name);
    assert!(
        p.join("pack.yaml").is_file(),
        "{} is missing: run `make setup` (it builds the tiny packs)",
        p.display()
    );
    p
}

/// A copy of pack `name` whose graph directories are symlinks to the original and whose
/// pack.yaml gets `extra` appended (later keys win).
pub fn variant(name: &str, extra: &str) -> (tempfile::TempDir, PathBuf) {
    let src = pack(name);
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join(name);
    std::fs::create_dir(&dst).unwrap();
    for g in ALL_GRAPHS {
        std::os::unix::fs::symlink(src.join(g), dst.join(g)).unwrap();
    }
    let mut yaml = std::fs::read_to_string(src.join("pack.yaml")).unwrap();
    // Drop keys that `extra` sets again, with their indented lines.
    for line in extra.lines() {
        if let Some((k, _)) = line.split_once(':') {
            if !line.starts_with(' ') {
                let mut dropping = false;
                yaml = yaml
                    .lines()
                    .filter(|l| {
                        if l.starts_with(&format!("{k}:")) {
                            dropping = true;
                            return false;
                        }
                        if dropping && l.starts_with(' ') {
                            return false;
                        }
                        dropping = false;
                        true
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                yaml.push('\n');
            }
        }
    }
    yaml.push_str(extra);
    std::fs::write(dst.join("pack.yaml"), yaml).unwrap();
    (dir, dst)
}

/// A copy of pack `name` without Mimi's step graphs (`mimi_streaming: [window]`).
pub fn without_step_graphs(name: &str) -> (tempfile::TempDir, PathBuf) {
    let (dir, dst) = variant(name, "mimi_streaming: [window]\n");
    for g in &CODEC_GRAPHS[2..] {
        std::fs::remove_file(dst.join(g)).unwrap();
    }
    (dir, dst)
}

/// A copy of pack `name` whose fp32 step graphs are as built before the `active` input: the
/// same graphs with `active` made inside from the batch size (every row steps on every call),
/// and a `state.json` that names no `active` input.
pub fn without_active_input(name: &str) -> (tempfile::TempDir, PathBuf) {
    const REWRITE: &str = r#"
import json, sys
import onnx
from onnx import TensorProto, helper
src, dst = sys.argv[1], sys.argv[2]
m = onnx.load(src + "/model.onnx", load_external_data=False)
g = m.graph
frame = [i.name for i in g.input if i.name in ("pcm", "codes")][0]
kept = [i for i in g.input if i.name != "active"]
del g.input[:]
g.input.extend(kept)
ones = helper.make_tensor("one", TensorProto.BOOL, [1], [True])
g.node.insert(0, helper.make_node("ConstantOfShape", ["active.batch"], ["active"], value=ones))
g.node.insert(0, helper.make_node("Shape", [frame], ["active.batch"], start=0, end=1))
onnx.save(m, dst + "/model.onnx")
s = json.load(open(src + "/state.json"))
s.pop("active", None)
json.dump(s, open(dst + "/state.json", "w"))
"#;
    let (dir, dst) = variant(name, "");
    let src = pack(name);
    for g in ["mimi_encoder_step", "mimi_decoder_step"] {
        std::fs::remove_file(dst.join(g)).unwrap();
        std::fs::create_dir(dst.join(g)).unwrap();
        // Copied: ONNX Runtime refuses weights that resolve outside the graph's folder.
        std::fs::copy(
            src.join(g).join("model.onnx.data"),
            dst.join(g).join("model.onnx.data"),
        )
        .unwrap();
        let o = std::process::Command::new(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"),
        )
        .args(["-c", REWRITE])
        .arg(src.join(g))
        .arg(dst.join(g))
        .output()
        .expect("run .venv/bin/python (make setup)");
        assert!(
            o.status.success(),
            "rewriting {g}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    (dir, dst)
}

/// A copy of tiny pack `name` quantized by `tools/quantize_pack.py --quantize q` (`int8`,
/// `int4`), shared by every test that only reads it: built once under
/// `target/test-packs/<name>-<q>` and kept while the pack's files and the script are as they
/// were (a stamp lists them), so that the suite quantizes each once, not once per test.
pub fn quantized(name: &str, q: &str) -> PathBuf {
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = pack(name);
    let script = root.join("tools/quantize_pack.py");
    let mut stamp = format!("{q}\n{}\n", std::fs::read_to_string(&script).unwrap().len());
    let mut files: Vec<PathBuf> = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    for f in files.iter().chain([&script]) {
        let m = std::fs::metadata(f).unwrap();
        let at = m
            .modified()
            .unwrap()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        stamp.push_str(&format!("{} {} {}\n", f.display(), m.len(), at.as_nanos()));
    }
    let out = root.join("target/test-packs").join(format!("{name}-{q}"));
    let kept = out.join(".stamp");
    if std::fs::read_to_string(&kept).is_ok_and(|s| s == stamp) {
        return out;
    }
    // Built beside, then moved into place: a test process killed half-way leaves no half pack.
    let _ = std::fs::remove_dir_all(&out);
    let building = out.with_extension(format!("building-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&building);
    std::fs::create_dir_all(building.parent().unwrap()).unwrap();
    let o = std::process::Command::new(root.join(".venv/bin/python"))
        .arg(&script)
        .arg(&src)
        .arg(&building)
        .args(["--quantize", q, "-q"])
        .output()
        .expect(".venv/bin/python (run `make setup`)");
    assert!(
        o.status.success(),
        "quantizing {name} to {q}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::write(building.join(".stamp"), &stamp).unwrap();
    std::fs::rename(&building, &out).unwrap();
    out
}
