//! Weight-only quantized packs (`tools/quantize_pack.py`: ONNX Runtime's own quantizer writes
//! the temporal transformer's MatMuls as `MatMulNBits`, its embedding tables in int4 as
//! `GatherBlockQuantized`, and Mimi's step graphs' MatMuls in int8): int8 and int4 copies of the
//! tiny packs open, say what they are, and step exactly as the independent reference steps
//! them; one quantized layer is numpy's dequantize-then-multiply; a pack with an int8 codec
//! runs the full-duplex pipeline and passes the codec's quality gate; a `pack.yaml` that
//! disagrees with its graphs is refused, naming the key; the gate fails a damaged pack; the
//! pack tools name a malformed manifest, codes file or weights listing, and paths that are not
//! what they need (a file for a folder, a FIFO, a missing graph) (exit 2, no traceback).

use crate::support::packs;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python(script: &str, args: &[&std::ffi::OsStr]) -> Output {
    Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tools").join(script))
        .args(args)
        .output()
        .expect(".venv/bin/python (run `make setup`)")
}

/// A quantized copy of `pack` in `dir`, its LM in `q` (`int8`, `int4`).
fn quantized(dir: &Path, pack: &str, q: &str) -> PathBuf {
    quantized_with(dir, pack, &format!("{pack}-{q}"), &["--quantize", q])
}

/// A copy of `pack` in `dir/name`, quantized by `tools/quantize_pack.py ARGS`.
fn quantized_with(dir: &Path, pack: &str, name: &str, args: &[&str]) -> PathBuf {
    let out = dir.join(name);
    let mut all = vec![
        packs::pack(pack).into_os_string(),
        out.clone().into_os_string(),
    ];
    all.extend(args.iter().map(Into::into));
    all.push("-q".into());
    let all: Vec<&std::ffi::OsStr> = all.iter().map(|a| a.as_os_str()).collect();
    let o = python("quantize_pack.py", &all);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

fn duplex(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(args)
        .output()
        .unwrap()
}

/// 40 frames of user codes.
fn codes(dir: &Path) -> PathBuf {
    let frames: Vec<Vec<i64>> = (0..40)
        .map(|t| (0..8).map(|k| (t * 131 + k * 977) % 2048).collect())
        .collect();
    let p = dir.join("codes.json");
    std::fs::write(&p, serde_json::to_string(&frames).unwrap()).unwrap();
    p
}

fn replay(pack: &Path, codes: &Path, out: &Path) -> Vec<serde_json::Value> {
    let o = duplex(&[
        "replay".as_ref(),
        "--pack".as_ref(),
        pack.as_os_str(),
        "--codes".as_ref(),
        codes.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
        "--greedy".as_ref(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    lines(out)
}

/// `duplex doctor --pack PACK` (which must pass): its line for graph folder `graph`.
fn doctor_line(pack: &Path, graph: &str) -> String {
    let o = duplex(&["doctor".as_ref(), "--pack".as_ref(), pack.as_os_str()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out.lines()
        .find(|l| l.trim_start().starts_with(&format!("{graph} ")))
        .unwrap_or_else(|| panic!("no {graph} line in {out}"))
        .to_string()
}

/// Greedy, step by step, `duplex replay` on `pack` against what the independent reference
/// (numpy and ONNX Runtime, no duplex code) computes on the same graphs: equal; ours.
fn steps_as_the_reference(pack: &Path, codes: &Path, dir: &Path) -> Vec<serde_json::Value> {
    let ours = replay(pack, codes, &dir.join("ours.jsonl"));
    let theirs = dir.join("ref.jsonl");
    let o = python(
        "reference_lm.py",
        &[pack.as_os_str(), codes.as_os_str(), theirs.as_os_str()],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        ours,
        lines(&theirs),
        "{}: our steps against the reference's",
        pack.display()
    );
    ours
}

fn lines(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn int8_and_int4_packs_open_say_what_they_are_and_step_as_the_reference_does() {
    let dir = tempfile::tempdir().unwrap();
    let codes = codes(dir.path());
    for (pack, q, bits, tables) in [
        ("tiny-gqa", "int8", 8, ""),
        ("tiny-gqa", "int4", 4, ", gathers: 17"),
        ("tiny-gqa-fp16", "int8", 8, ""),
    ] {
        let qp = if pack == "tiny-gqa" {
            packs::quantized(pack, q)
        } else {
            quantized(dir.path(), pack, q)
        };
        // The manifest says it (int4 takes the 17 embedding tables too); doctor reports it and
        // runs every graph.
        let manifest = std::fs::read_to_string(qp.join("pack.yaml")).unwrap();
        assert!(
            manifest.contains(&format!(
                "temporal: {{bits: {bits}, block_size: 32, scheme: symmetric, matmuls: 9{tables}, \
                 accuracy_level: 4}}"
            )),
            "{manifest}"
        );
        let line = doctor_line(&qp, "temporal");
        assert!(
            line.contains(&format!(
                "weights {q} (blocks of 32, 9 MatMuls{}, int8 arithmetic on a CPU)",
                if tables.is_empty() { "" } else { ", 17 tables" }
            )),
            "{line}"
        );
        // Smaller on disk than the float graph it came from.
        let size = |p: &Path| {
            std::fs::metadata(p.join("temporal/model.onnx.data"))
                .unwrap()
                .len()
        };
        assert!(size(&qp) < size(&packs::pack(pack)), "{pack} {q}");
        // Greedy, step by step, exactly what the independent reference computes on the same
        // quantized graphs.
        let steps = dir.path().join(format!("{pack}-{q}-steps"));
        std::fs::create_dir(&steps).unwrap();
        let ours = steps_as_the_reference(&qp, &codes, &steps);
        assert_eq!(ours.len(), 40, "{pack} {q}");
        // Against the float pack: the quantized weights are not the float ones, and not noise.
        let float = replay(&packs::pack(pack), &codes, &dir.path().join("float.jsonl"));
        let same = ours
            .iter()
            .zip(&float)
            .filter(|(a, b)| a["text"] == b["text"])
            .count();
        eprintln!("{pack} {q}: {same} of 40 text tokens as the float pack's");
    }
}

#[test]
fn an_int4_depformer_says_so_steps_as_the_reference_does_and_is_gated() {
    let dir = tempfile::tempdir().unwrap();
    let codes = codes(dir.path());
    let float = packs::pack("tiny-gqa");
    let q = quantized_with(
        dir.path(),
        "tiny-gqa",
        "dep4",
        &["--quantize-depformer", "int4"],
    );
    let manifest = std::fs::read_to_string(q.join("pack.yaml")).unwrap();
    assert!(
        manifest.contains(
            "  depformer: {bits: 4, block_size: 32, scheme: symmetric, matmuls: 0, gathers: 8}"
        ),
        "{manifest}"
    );
    let line = doctor_line(&q, "depformer");
    assert!(
        line.contains("weights int4 (blocks of 32, 8 tables)"),
        "{line}"
    );
    steps_as_the_reference(&q, &codes, dir.path());
    // The gate sees the depformer's loss and nothing else: the temporal is the float one.
    let (code, r) = gate(&q, &float);
    eprintln!("depformer int4: {r}");
    assert_eq!(r["text_agreement"], 1.0, "{r}");
    let audio = r["audio_agreement"].as_f64().unwrap();
    assert!(audio > 0.5 && audio < 1.0, "{r}");
    assert_eq!(code, Some(if r["passed"] == true { 0 } else { 1 }));
}

#[test]
fn a_quantized_layer_is_numpys_dequantize_then_multiply() {
    for (q, bits) in [("int8", 8), ("int4", 4)] {
        let qp = packs::quantized("tiny-gqa", q);
        let o = python(
            "check_quantized.py",
            &[qp.as_os_str(), packs::pack("tiny-gqa").as_os_str()],
        );
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{q}: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let r: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(r["bits"], bits, "{r}");
        // In float arithmetic, numpy's dequantized weights times the input; at the pack's
        // accuracy level 4, the same with the input rounded to 8 bits per block, and that
        // rounding is visible against the float input.
        assert!(
            r["ort_vs_numpy_relative_error"].as_f64().unwrap() < 1e-4,
            "{r}"
        );
        assert_eq!(r["accuracy_level"], 4, "{r}");
        assert!(
            r["ort_at_level_vs_numpy_relative_error"].as_f64().unwrap() < 1e-4,
            "{r}"
        );
        assert!(
            r["ort_at_level_vs_float_input_relative_error"]
                .as_f64()
                .unwrap()
                > 1e-4,
            "{r}"
        );
        assert!(
            r["weight_error_beyond_one_step"].as_f64().unwrap() <= 0.0,
            "{r}"
        );
        // Rounded to the nearest step: only a weight clipped at its block's largest magnitude
        // is more than half a step off (one in a block at most).
        assert!(
            r["weights_beyond_half_a_step"].as_f64().unwrap() <= 1.0 / 32.0,
            "{r}"
        );
        // An int8 weight is closer to the float one than an int4 weight.
        let rms = r["weight_relative_rms_error"].as_f64().unwrap();
        assert!(rms > 0.0 && rms < if bits == 8 { 0.01 } else { 0.2 }, "{r}");
    }
}

#[test]
fn a_manifest_that_disagrees_with_its_graphs_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let q8 = quantized(dir.path(), "tiny-gqa", "int8");
    let manifest = std::fs::read_to_string(q8.join("pack.yaml")).unwrap();
    let doctor = |pack: &Path| {
        let o = duplex(&["doctor".as_ref(), "--pack".as_ref(), pack.as_os_str()]);
        (
            o.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    };
    let line =
        "  temporal: {bits: 8, block_size: 32, scheme: symmetric, matmuls: 9, accuracy_level: 4}";
    assert!(manifest.contains(line), "{manifest}");
    for (edit, key, says) in [
        (String::new(), "quantization", "MatMulNBits nodes"),
        (
            line.replace("bits: 8", "bits: 4"),
            "quantization.temporal",
            "of 8 bits",
        ),
        (
            line.replace("block_size: 32", "block_size: 64"),
            "quantization.temporal",
            "in blocks of 32",
        ),
        (
            line.replace("matmuls: 9", "matmuls: 8"),
            "quantization.temporal.matmuls",
            "9 MatMulNBits",
        ),
        (
            line.replace("bits: 8", "bitz: 8"),
            "quantization.temporal.bitz",
            "unknown key",
        ),
        (
            format!("{line}\n{}", line.replace("temporal", "depformer")),
            "quantization.depformer",
            "no MatMulNBits node",
        ),
        (
            line.replace("accuracy_level: 4", "accuracy_level: 0"),
            "quantization.temporal.accuracy_level",
            "accuracy_level 4",
        ),
        (
            line.replace("matmuls: 9", "matmuls: 9, gathers: 17"),
            "quantization.temporal.gathers",
            "0 GatherBlockQuantized",
        ),
        (
            format!("{line}\n{}", line.replace("temporal", "mimi_decoder_step")),
            "quantization.mimi_decoder_step",
            "no MatMulNBits node",
        ),
    ] {
        let text = if edit.is_empty() {
            manifest.replace(&format!("quantization:\n{line}\n"), "")
        } else {
            manifest.replace(line, &edit)
        };
        assert_ne!(text, manifest);
        std::fs::write(q8.join("pack.yaml"), text).unwrap();
        let (code, out) = doctor(&q8);
        assert_ne!(code, Some(0), "{edit:?} was taken:\n{out}");
        assert!(
            out.contains("pack.yaml") && out.contains(key) && out.contains(says),
            "{edit:?}: {out}"
        );
    }
    std::fs::write(q8.join("pack.yaml"), &manifest).unwrap();
    assert_eq!(doctor(&q8).0, Some(0));
}

/// `tools/quality_gate.py QUANTIZED FLOAT --json`: (exit code, report).
fn gate(quantized: &Path, float: &Path) -> (Option<i32>, serde_json::Value) {
    let o = python(
        "quality_gate.py",
        &[quantized.as_os_str(), float.as_os_str(), "--json".as_ref()],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    let report = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("{e}: {out}{}", String::from_utf8_lossy(&o.stderr)));
    (o.status.code(), report)
}

#[test]
fn the_quality_gate_passes_int8_measures_int4_worse_and_fails_a_damaged_pack() {
    let dir = tempfile::tempdir().unwrap();
    let float = packs::pack("tiny-gqa");
    let q8 = packs::quantized("tiny-gqa", "int8");
    let q4 = packs::quantized("tiny-gqa", "int4");
    let (code8, r8) = gate(&q8, &float);
    eprintln!("int8: {r8}");
    assert_eq!(code8, Some(0), "{r8}");
    assert_eq!(r8["passed"], true);
    // Deterministic: the same figures again.
    assert_eq!(gate(&q8, &float).1, r8);
    // The float pack against itself: everything agrees.
    let (code, same) = gate(&float, &float);
    assert_eq!(code, Some(0), "{same}");
    assert_eq!(same["text_agreement"], 1.0);
    assert_eq!(same["audio_agreement"], 1.0);
    assert!(same["text_kl"].as_f64().unwrap().abs() < 1e-9, "{same}");
    // Four bits lose more than eight; the exit code is the verdict.
    let (code4, r4) = gate(&q4, &float);
    eprintln!("int4: {r4}");
    let kl = |r: &serde_json::Value| r["text_kl"].as_f64().unwrap();
    assert!(kl(&r4) > kl(&r8), "int4 {r4}\nint8 {r8}");
    assert_eq!(code4, Some(if r4["passed"] == true { 0 } else { 1 }));
    // A damaged pack (the int8 pack's scales zeroed) fails, naming what.
    let damaged = damaged_copy(&q8, &dir.path().join("damaged"), "temporal");
    let (code, bad) = gate(&damaged, &float);
    assert_eq!(code, Some(1), "{bad}");
    assert_eq!(bad["passed"], false);
    assert!(
        bad["failed"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("text_kl")),
        "{bad}"
    );
    // Bad arguments: exit 2 before anything runs.
    let o = python(
        "quality_gate.py",
        &[dir.path().as_os_str(), float.as_os_str()],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a pack"));
}

/// A copy of pack `src` at `dst` whose `graph` has every `MatMulNBits` scale zeroed.
fn damaged_copy(src: &Path, dst: &Path, graph: &str) -> PathBuf {
    std::fs::create_dir(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let p = entry.unwrap().path();
        let to = dst.join(p.file_name().unwrap());
        if p.is_dir() {
            std::fs::create_dir(&to).unwrap();
            for f in std::fs::read_dir(&p).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
            }
        } else {
            std::fs::copy(&p, &to).unwrap();
        }
    }
    let o = Command::new(root().join(".venv/bin/python"))
        .args([
            "-c",
            "import sys, onnx, numpy as np\n\
             from onnx import numpy_helper\n\
             m = onnx.load(sys.argv[1])\n\
             scales = {n.input[2] for n in m.graph.node if n.op_type == 'MatMulNBits'}\n\
             for t in m.graph.initializer:\n\
             \x20   if t.name in scales:\n\
             \x20       t.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(t)), t.name))\n\
             onnx.save_model(m, sys.argv[1], save_as_external_data=True, all_tensors_to_one_file=True, location='model.onnx.data', size_threshold=1024)\n",
        ])
        .arg(dst.join(graph).join("model.onnx"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dst.to_path_buf()
}

#[test]
fn an_int8_codec_runs_the_pipeline_passes_its_gate_and_a_damaged_one_fails() {
    let dir = tempfile::tempdir().unwrap();
    let name = "tiny-gqa-mimi-full";
    let float = packs::pack(name);
    let q = quantized_with(dir.path(), name, "codec8", &["--quantize-codec", "int8"]);
    // The manifest says which step graphs, and doctor reports them and runs them.
    let manifest = std::fs::read_to_string(q.join("pack.yaml")).unwrap();
    for (graph, n) in [("mimi_encoder_step", 54), ("mimi_decoder_step", 55)] {
        assert!(
            manifest.contains(&format!(
                "  {graph}: {{bits: 8, block_size: 64, scheme: symmetric, matmuls: {n}, \
                 accuracy_level: 4}}"
            )),
            "{manifest}"
        );
    }
    assert!(
        manifest.contains("name: tiny-gqa-mimi-full-codec8"),
        "{manifest}"
    );
    let line = doctor_line(&q, "mimi_decoder_step");
    assert!(
        line.contains("weights int8 (blocks of 64, 55 MatMuls"),
        "{line}"
    );
    // Smaller on disk than the float step graph it came from.
    let size = |p: &Path| {
        std::fs::metadata(p.join("mimi_decoder_step/model.onnx.data"))
            .unwrap()
            .len()
    };
    assert!(
        size(&q) * 2 < size(&float),
        "{} vs {}",
        size(&q),
        size(&float)
    );

    // The full-duplex pipeline runs on it, on the stateful strategy, and its output is sound.
    let input = dir.path().join("in.wav");
    let mut w =
        duplex::audio::WavWriter::create(&input, 24_000, duplex::audio::WavFormat::I16).unwrap();
    let tone: Vec<f32> = (0..24_000 * 3)
        .map(|i| 0.3 * (i as f32 * 0.05).sin())
        .collect();
    w.write(&tone).unwrap();
    w.finalize().unwrap();
    let agent = dir.path().join("agent.wav");
    let set = |k: &str, v: &Path| ["--set".to_string(), format!("{k}={}", v.display())];
    let mut args: Vec<String> = vec!["run".into(), "pipelines/duplex-file.yaml".into()];
    for stage in ["encode", "temporal", "depformer", "decode"] {
        args.extend(set(&format!("stages.{stage}.pack"), &q));
    }
    args.extend(set("stages.source.path", &input));
    args.extend(set("stages.sink.path", &agent));
    args.extend(set("stages.tokens.path", &dir.path().join("tokens.jsonl")));
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .current_dir(root())
        .args(&args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains(r#"strategy="stateful" dtype="f32""#), "{err}");
    let mut r = hound::WavReader::open(&agent).unwrap();
    let samples: Vec<i16> = r.samples::<i16>().map(Result::unwrap).collect();
    // 3 s in, 3 s out (at the sink's 48 kHz), not silent.
    assert!(samples.len() >= 48_000 * 3 - 3840, "{}", samples.len());
    assert!(samples.iter().any(|&v| v != 0));

    // The gate measures the codec alone (only the codec is quantized) and passes it.
    let (code, r) = gate(&q, &float);
    eprintln!("codec int8: {r}");
    assert_eq!(code, Some(0), "{r}");
    assert!(r.get("text_agreement").is_none(), "{r}");
    let snr = r["decoder_snr_db"].as_f64().unwrap();
    assert!((30.0..100.0).contains(&snr), "{r}");
    assert!(r["first_code_agreement"].as_f64().unwrap() >= 0.9, "{r}");
    assert!(r["code_agreement"].as_f64().unwrap() < 1.0, "{r}");
    // The decoder's scales zeroed: the gate fails it on the SNR.
    let damaged = damaged_copy(&q, &dir.path().join("damaged"), "mimi_decoder_step");
    let (code, bad) = gate(&damaged, &float);
    assert_eq!(code, Some(1), "{bad}");
    assert!(
        bad["failed"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("decoder_snr")),
        "{bad}"
    );
}

/// A malformed manifest or list given to the pack tools is named in one line (the tool, the
/// file, what is wrong and where), exit 2, no traceback, and nothing written.
#[test]
fn the_pack_tools_name_a_malformed_manifest_or_list_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = packs::pack("tiny-gqa");
    let refused = |o: &Output, want: &[&str]| {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(!err.contains("Traceback"), "{err}");
        for w in want {
            assert!(err.contains(w), "{w:?} not in {err}");
        }
    };
    // A pack whose pack.yaml is not YAML: the gate and the quantizer name it; no DST is made.
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(broken.join("pack.yaml"), "name: [unclosed\n").unwrap();
    let gate = |a: &Path, b: &Path, extra: &[&str]| {
        let mut args = vec![a.as_os_str(), b.as_os_str()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        python("quality_gate.py", &args)
    };
    let yaml = format!("{}: not YAML: ", broken.join("pack.yaml").display());
    refused(
        &gate(&broken, &tiny, &[]),
        &["quality_gate: ", &yaml, "(line 2, column 1)"],
    );
    let dst = dir.path().join("dst");
    let o = python(
        "quantize_pack.py",
        &[
            broken.as_os_str(),
            dst.as_os_str(),
            "--quantize".as_ref(),
            "int8".as_ref(),
        ],
    );
    refused(&o, &["quantize_pack: ", &yaml]);
    assert!(!dst.exists() && !dir.path().join("dst.partial").exists());
    // The quantizer's other refusals before it writes: a bad value, a folder that is no pack.
    let tiny_os = tiny.as_os_str();
    for (args, want) in [
        (
            vec![
                tiny_os,
                dst.as_os_str(),
                "--quantize".as_ref(),
                "int8".as_ref(),
                "--block-size".as_ref(),
                "12".as_ref(),
            ],
            "quantize_pack: --block-size 12: a power of two, 16 or more".to_string(),
        ),
        (
            vec![
                dir.path().as_os_str(),
                dst.as_os_str(),
                "--quantize".as_ref(),
                "int8".as_ref(),
            ],
            format!(
                "quantize_pack: {}: not a pack (no pack.yaml)",
                dir.path().display()
            ),
        ),
    ] {
        refused(&python("quantize_pack.py", &args), &[&want]);
        assert!(!dst.exists() && !dir.path().join("dst.partial").exists());
    }

    // The gate's --codes: missing, not JSON, a frame of the wrong size.
    let codes = dir.path().join("codes.json");
    let c = codes.to_str().unwrap();
    refused(&gate(&tiny, &tiny, &["--codes", c]), &[c, ": no such file"]);
    std::fs::write(&codes, "[[1, 2,").unwrap();
    refused(
        &gate(&tiny, &tiny, &["--codes", c]),
        &[c, ": not JSON: ", "(line 1, column 8)"],
    );
    std::fs::write(&codes, "[[1, 2, 3]]").unwrap();
    refused(
        &gate(&tiny, &tiny, &["--codes", c]),
        &[": frame 0: expected 8 codes from 0 to 2047, found [1, 2, 3]"],
    );

    // A step graph's state.json that is not a manifest (the rest of the pack as it was).
    let odd = dir.path().join("odd");
    std::fs::create_dir(&odd).unwrap();
    for e in std::fs::read_dir(&tiny).unwrap().flatten() {
        if e.file_name() != "mimi_encoder_step" {
            std::os::unix::fs::symlink(e.path(), odd.join(e.file_name())).unwrap();
        }
    }
    let step = odd.join("mimi_encoder_step");
    std::fs::create_dir(&step).unwrap();
    std::os::unix::fs::symlink(
        tiny.join("mimi_encoder_step/model.onnx"),
        step.join("model.onnx"),
    )
    .unwrap();
    std::fs::write(step.join("state.json"), "[1, 2]").unwrap();
    let state = format!(
        "{}: expected a JSON object, found list",
        step.join("state.json").display()
    );
    refused(&gate(&odd, &tiny, &["--frames", "10"]), &[&state]);

    // fill_weights: a listing that is not JSON, and one whose weight lacks its fields.
    let shapes = dir.path().join("shapes");
    std::fs::create_dir_all(shapes.join("temporal")).unwrap();
    std::fs::write(shapes.join("pack.yaml"), "name: x\n").unwrap();
    let listing = shapes.join("temporal/weights.json");
    std::fs::write(&listing, "{\"format\": 1,").unwrap();
    let fill = || python("fill_weights.py", &[shapes.as_os_str()]);
    let named = format!("fill_weights: {}: ", listing.display());
    refused(&fill(), &[&named, "not JSON: "]);
    std::fs::write(
        &listing,
        r#"{"format": 1, "data": "model.onnx.data", "bytes": 8, "weights": [{"name": "w"}]}"#,
    )
    .unwrap();
    refused(
        &fill(),
        &[
            &named,
            "weight 0: expected name, dtype, shape, offset, length and fill",
        ],
    );
    assert!(!shapes.join("temporal/model.onnx.data").exists());
}

/// What a careless operator gives the pack tools besides a malformed manifest (the second
/// hostile probe): a folder that is a file, a pack without its graph, a FIFO where a file was
/// meant (a FIFO made the gate wait for ever), a destination that is a file, a tokenizer that is
/// not one, a graph cut short, an output under /proc. Each is refused in one line naming the tool and the path, exit 2, no traceback, no
/// hang, nothing written.
#[test]
fn the_pack_tools_refuse_paths_that_are_not_what_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tiny = packs::pack("tiny-gqa");
    let file = d.join("file.bin");
    std::fs::write(&file, [7u8; 4096]).unwrap();
    let fifo = d.join("fifo");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let no_graph = d.join("no-graph");
    std::fs::create_dir(&no_graph).unwrap();
    std::fs::copy(tiny.join("pack.yaml"), no_graph.join("pack.yaml")).unwrap();
    // A pack whose temporal graph was cut short (a copy that did not finish).
    let cut = d.join("cut");
    std::fs::create_dir(&cut).unwrap();
    for e in std::fs::read_dir(&tiny).unwrap().flatten() {
        if e.file_name() != "temporal" {
            std::os::unix::fs::symlink(e.path(), cut.join(e.file_name())).unwrap();
        }
    }
    std::fs::create_dir(cut.join("temporal")).unwrap();
    for e in std::fs::read_dir(tiny.join("temporal")).unwrap().flatten() {
        std::os::unix::fs::symlink(e.path(), cut.join("temporal").join(e.file_name())).unwrap();
    }
    let graph = cut.join("temporal/model.onnx");
    let whole = std::fs::read(&graph).unwrap();
    std::fs::remove_file(&graph).unwrap();
    std::fs::write(&graph, &whole[..whole.len() / 3]).unwrap();
    let os = |p: &Path| p.as_os_str().to_owned();
    let s = |t: &str| std::ffi::OsString::from(t);
    let cases: Vec<(&str, Vec<std::ffi::OsString>, String)> = vec![
        (
            "quantize_pack.py",
            vec![os(&cut), os(&d.join("q")), s("--quantize"), s("int8")],
            format!("quantize_pack: {}: not a whole ONNX graph", graph.display()),
        ),
        (
            "quantize_pack.py",
            vec![os(&tiny), s("/proc/duplex-q"), s("--quantize"), s("int8")],
            "quantize_pack: /proc/duplex-q: cannot write in /proc".to_string(),
        ),
        (
            "make_checkpoint.py",
            vec![s("/proc/duplex-ck")],
            "make_checkpoint: /proc/duplex-ck: cannot write in /proc".to_string(),
        ),
        (
            "check_quantized.py",
            vec![os(&file), os(&tiny)],
            format!("check_quantized: {}: not a folder", file.display()),
        ),
        (
            "check_quantized.py",
            vec![os(&no_graph), os(&tiny)],
            format!(
                "check_quantized: {}: no such file",
                no_graph.join("temporal/model.onnx").display()
            ),
        ),
        (
            "quality_gate.py",
            vec![os(&no_graph), os(&tiny)],
            format!(
                "quality_gate: {}: no such file",
                no_graph.join("temporal/model.onnx").display()
            ),
        ),
        (
            "quality_gate.py",
            vec![os(&tiny), os(&tiny), s("--codes"), os(&fifo)],
            format!("quality_gate: {}: not a regular file", fifo.display()),
        ),
        (
            "quantize_pack.py",
            vec![os(&tiny), os(&file), s("--quantize"), s("int8")],
            format!(
                "quantize_pack: {} exists and is not a folder",
                file.display()
            ),
        ),
        (
            "check_export.py",
            vec![os(&d.join("nope")), os(&tiny)],
            format!("check_export: {}: no such folder", d.join("nope").display()),
        ),
        (
            "make_checkpoint.py",
            vec![os(&d.join("ck")), s("--tokenizer"), os(&fifo)],
            format!("make_checkpoint: {}: not a regular file", fifo.display()),
        ),
        (
            "make_checkpoint.py",
            vec![os(&d.join("ck")), s("--tokenizer"), os(&file)],
            format!(
                "make_checkpoint: {}: not a SentencePiece model",
                file.display()
            ),
        ),
        (
            "make_pack.py",
            vec![s("--out"), os(&file)],
            "exists and is not a folder".to_string(),
        ),
    ];
    for (tool, args, want) in cases {
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let mut child = Command::new(root().join(".venv/bin/python"))
            .arg(root().join("tools").join(tool))
            .args(&refs)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let done =
            crate::support::daemon::wait_exit(&mut child, std::time::Duration::from_secs(120));
        if done.is_none() {
            let _ = child.kill();
            panic!("{tool} {args:?}: no answer in 120 s");
        }
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{tool} {args:?}: {err}");
        assert!(!err.contains("Traceback"), "{tool}: {err}");
        assert!(err.contains(&want), "{tool}: {want:?} not in {err}");
    }
    assert!(!d.join("ck").exists(), "a refused checkpoint was begun");
    assert!(!d.join("q").exists() && !d.join("q.partial").exists());
    assert_eq!(
        std::fs::read(&file).unwrap(),
        [7u8; 4096],
        "a file was overwritten"
    );
}
