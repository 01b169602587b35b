//! `tools/gpu-check.sh OUT --cpu`: the GPU check's dry run on this machine, with this build,
//! library and packs. Every section runs and reports (a GPU run prints the same, measured
//! there); the token streams it compares agree with themselves on the CPU. And the 7B-shaped
//! pack it carries: built here with its weights declared, not written
//! (`tools/make_pack.py --shapes-only`), refused until `tools/fill_weights.py` writes them,
//! written the same on every run, and refused again when a data file is cut short.

use std::path::Path;
use std::process::Command;

#[test]
fn the_gpu_check_dry_runs_on_the_cpu_and_reports_every_section() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let o = Command::new(root.join("tools/gpu-check.sh"))
        .arg(out.path())
        .arg("--cpu")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(o.status.success(), "{log}");
    let report = std::fs::read_to_string(out.path().join("gpu-check.txt")).unwrap();
    assert!(report.starts_with("# duplex gpu-check, 20"), "{report}");
    assert!(report.contains("mode cpu"), "{report}");
    // The quantized packs' rows: their doctor ran, and timed the step from every context.
    assert_eq!(
        report.matches("\n  ok: the pack loads and runs").count(),
        4,
        "{report}"
    );
    assert!(
        report.matches("resident (cpu f16) context 50: ").count() >= 3,
        "{report}"
    );
    // The whole loop ran at the 7B's shapes too (and the tiny pack's).
    assert_eq!(
        report
            .matches("sink sink: completion interval mean ")
            .count(),
        2,
        "{report}"
    );
    // The shared engine's frame at B = 1/8/16/32/48/64, on the float pack and both quantized.
    assert_eq!(
        report
            .matches("shared LM engine on cpu, B conversations stepped together")
            .count(),
        3,
        "{report}"
    );
    assert!(report.matches(", B=48: ").count() >= 3, "{report}");
    assert!(report.matches(", B=64: ").count() >= 3, "{report}");
    // One conversation's depformer frame, and the codec batched in both precisions.
    for want in [
        "depformer frame on cpu (one conversation, mean of 50):",
        "plain    (cpu f16) every substep ",
        "separate (cpu f16) every substep ",
        "device   (cpu f16) every substep ",
        "codec step graphs (f32) on cpu, one call of B rows",
        "codec step graphs (f16) on cpu, one call of B rows",
    ] {
        assert!(report.contains(want), "missing {want:?} in\n{report}");
    }
    // The audio drawn where the logits are gives the host draw's tokens.
    let drawn: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("  device   ("))
        .collect();
    assert!(!drawn.is_empty(), "{report}");
    for l in drawn {
        assert!(l.ends_with(", the host draw's tokens"), "{l}");
    }
    // And the shared engine so drawing, its frame timed.
    assert!(
        report.contains(
            "shared LM engine on cpu, the audio drawn where the logits are, B conversations \
             stepped together"
        ),
        "{report}"
    );
    // The step timed at the whole context of 3000 as well, in every cache mode of each pack.
    assert!(report.matches(", context 3000: ").count() >= 5, "{report}");
    // The memory a conversation adds to the engine, measured by two probes (a process each),
    // and at least the KV cache its slot holds.
    let memory: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("  1 slot: +"))
        .collect();
    assert_eq!(memory.len(), 3, "{report}");
    for line in memory {
        let per = |key: &str| -> f64 {
            let rest = &line[line.find(key).unwrap() + key.len()..];
            rest.split(" MiB").next().unwrap().trim().parse().unwrap()
        };
        let (measured, kv) = (per("per conversation "), per("by arithmetic: "));
        assert!(kv > 0.0 && measured >= 0.9 * kv, "{line}");
    }
    for want in [
        "## PersonaPlex 7B shapes (7b-gqa-fp16-1l, generated weights)",
        "fill_weights: ",
        "temporal: on cpu f16, 1 layers, 32 heads x 128, hidden 4096, text vocab 32000",
        "depformer: on cpu f16, 1 layers, 16 substeps",
        "mimi step graphs (f32): encoder on cpu f32 stateful, 29 states",
        "## full-duplex pipeline at the 7B's shapes, 25 frames, file to file",
        "providers: ",
        "temporal: on cpu f16",
        "depformer: on cpu f16",
        "mimi: encoder on cpu f32",
        "resident (cpu f16) context 50: ",
        "host     (cpu f16) context 50: ",
        "fixed    (cpu f16) context 50: ",
        "sink sink: completion interval mean ",
        " ms, p99 ",
        "tiny-gqa: 60/60 frames identical",
        "tiny-gqa-fp16: 60/60 frames identical",
        "## the same pack quantized, int8: temporal step times",
        "## the same pack quantized, int4: temporal step times",
        "weights int8 (blocks of 32, 9 MatMuls",
        "weights int4 (blocks of 32, 9 MatMuls, 17 tables",
    ] {
        assert!(report.contains(want), "missing {want:?} in\n{report}");
    }
    // Without the prepared parts, the GPU mode says what to do.
    let o = Command::new(root.join("tools/gpu-check.sh"))
        .arg(out.path().join("gpu"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    if !Path::new("/tmp/duplex-gpu/SHA256SUMS").exists() {
        assert_eq!(o.status.code(), Some(1), "{e}");
        assert!(e.contains("carry the parts first"), "{e}");
    }
}

fn python(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    Command::new(root.join(".venv/bin/python"))
        .args(args)
        .output()
        .unwrap()
}

fn doctor(pack: &Path) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["doctor", "--pack"])
        .arg(pack)
        .output()
        .unwrap();
    (
        o.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

#[test]
fn a_7b_shaped_pack_is_declared_here_and_its_weights_are_written_there() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let pack = dir.path().join("7b");
    let fill = root.join("tools/fill_weights.py");
    let o = python(&[
        root.join("tools/make_pack.py").as_os_str(),
        "--size".as_ref(),
        "7b".as_ref(),
        "--variant".as_ref(),
        "gqa-fp16".as_ref(),
        "--layers".as_ref(),
        "1".as_ref(),
        "--shapes-only".as_ref(),
        "--no-step-graphs".as_ref(),
        "--out".as_ref(),
        pack.as_os_str(),
        "-q".as_ref(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A few MB to carry: the graphs and the list of their weights, no weights.
    let graph = std::fs::metadata(pack.join("temporal/model.onnx"))
        .unwrap()
        .len();
    assert!(graph < 4 << 20, "{graph} bytes");
    assert!(!pack.join("temporal/model.onnx.data").exists());
    let listing: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(pack.join("temporal/weights.json")).unwrap())
            .unwrap();
    let text_emb = listing["weights"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == "embed.text_emb.weight")
        .unwrap();
    assert_eq!(text_emb["shape"], serde_json::json!([32001, 4096]));
    assert_eq!(text_emb["dtype"], "float16");
    // Before the weights are written: refused, naming the file.
    let (code, out) = doctor(&pack);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("temporal/model.onnx.data: missing"), "{out}");
    let o = python(&[fill.as_os_str(), pack.as_os_str(), "--check".as_ref()]);
    assert_eq!(o.status.code(), Some(1));
    // Written: the pack loads and runs at the real width, and a second fill writes the same.
    let o = python(&[fill.as_os_str(), pack.as_os_str()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let sample = |p: &Path| {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(p).unwrap();
        let mut out = Vec::new();
        for at in [0u64, 300 << 20, 900 << 20] {
            let mut b = vec![0u8; 1 << 16];
            f.seek(SeekFrom::Start(at)).unwrap();
            f.read_exact(&mut b).unwrap();
            out.extend(b);
        }
        out
    };
    let data = pack.join("temporal/model.onnx.data");
    let first = sample(&data);
    assert!(first.iter().any(|&b| b != 0));
    let o = python(&[fill.as_os_str(), pack.as_os_str()]);
    assert!(o.status.success());
    assert!(first == sample(&data), "a second fill wrote other bytes");
    let (code, out) = doctor(&pack);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("1 layers, 32 heads x 128, hidden 4096, text vocab 32000; one step finite"),
        "{out}"
    );
    // A data file cut short: the check and the pack both say which.
    let dep = pack.join("depformer/model.onnx.data");
    let len = std::fs::metadata(&dep).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&dep)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let o = python(&[fill.as_os_str(), pack.as_os_str(), "--check".as_ref()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("depformer/model.onnx.data"));
    let (code, out) = doctor(&pack);
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("depformer/model.onnx.data"), "{out}");
    // Not a pack: exit 2.
    let o = python(&[fill.as_os_str(), dir.path().as_os_str()]);
    assert_eq!(o.status.code(), Some(2));
}
