//! From a checkpoint in Kyutai's format to a running pack: `tools/make_checkpoint.py` writes a
//! tiny PersonaPlex-layout checkpoint (Kyutai's tensor names, fused QKV with interleaved RoPE
//! rows, per-substep depformer weights, Mimi's codebook statistics, bfloat16, `config.json`),
//! `tools/export_pack.py` turns it into a pack with the real exporter and checks it with
//! `duplex doctor --pack`, `tools/check_export.py` compares the pack's LM graphs with an
//! independent numpy implementation of Kyutai's LM reading the checkpoint, and the pack runs
//! the full-duplex pipeline. Bad checkpoints are refused before anything is built, naming the
//! file and the tensor or key.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python(script: &str, args: &[&str]) -> Output {
    Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tools").join(script))
        .args(args)
        // The load check runs this build of duplex.
        .env(
            "PATH",
            Path::new(env!("CARGO_BIN_EXE_duplex")).parent().unwrap(),
        )
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn checkpoint(dir: &Path, extra: &[&str]) -> PathBuf {
    let ck = dir.join("checkpoint");
    let tok = root().join("models/tokenizer-tiny.model");
    let mut args = vec![ck.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap()];
    args.extend(extra);
    let o = python("make_checkpoint.py", &args);
    assert!(o.status.success(), "{}", text(&o));
    ck
}

/// Every quantization option at once (int8 LM weights are the one left out).
const EVERY_QUANTIZATION: &[&str] = &[
    "--quantize",
    "int4",
    "--quantize-depformer",
    "int4",
    "--quantize-codec",
    "int8",
];

fn export(ck: &Path, out: &Path, provider: &str) -> Output {
    export_with(ck, out, provider, &[])
}

fn export_with(ck: &Path, out: &Path, provider: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        ck.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--provider",
        provider,
        "--duplex",
        env!("CARGO_BIN_EXE_duplex"),
    ];
    args.extend(extra);
    python("export_pack.py", &args)
}

/// 2 s of a 440 Hz tone at 24 kHz.
fn tone(path: &Path) {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for i in 0..48_000 {
        let v = (2.0 * std::f64::consts::PI * 440.0 * i as f64 / 24_000.0).sin() * 0.3;
        w.write_sample((v * 32767.0) as i16).unwrap();
    }
    w.finalize().unwrap();
}

/// `pipelines/duplex-file.yaml` on `pack` with `wav` in, in `dir` as `name`: the token log and
/// the agent's samples at 48 kHz.
fn run_pipeline(dir: &Path, pack: &Path, wav: &Path, name: &str) -> (String, u32) {
    let (agent, tokens) = (
        dir.join(format!("{name}.wav")),
        dir.join(format!("{name}.jsonl")),
    );
    let yaml = std::fs::read_to_string(root().join("pipelines/duplex-file.yaml"))
        .unwrap()
        .replace("models/tiny-gqa", pack.to_str().unwrap())
        .replace("out/tone-48k.wav", wav.to_str().unwrap())
        .replace("out/agent-48k.wav", agent.to_str().unwrap())
        .replace("out/agent-tokens.jsonl", tokens.to_str().unwrap());
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, yaml).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .arg("run")
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let samples = hound::WavReader::open(&agent).unwrap().duration();
    (std::fs::read_to_string(tokens).unwrap(), samples)
}

#[test]
fn a_kyutai_checkpoint_exports_to_a_pack_equal_to_the_reference_that_runs_a_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(dir.path(), &[]);
    for (provider, tol) in [("cpu", "1e-5"), ("cuda", "5e-3")] {
        let pack = dir.path().join(format!("pack-{provider}"));
        let o = export(&ck, &pack, provider);
        let log = text(&o);
        assert!(o.status.success(), "{log}");
        // What it built, and the load check by duplex itself.
        assert!(log.contains("temporal 2 layers x 64 (4 heads)"), "{log}");
        assert!(log.contains("16 steps"), "{log}");
        assert!(log.contains("ok: the pack loads and runs"), "{log}");
        let variant = if provider == "cpu" {
            "variant gqa, dtype f32"
        } else {
            "variant gqa-fp16, dtype f16"
        };
        assert!(log.contains(variant), "{log}");
        let manifest = std::fs::read_to_string(pack.join("pack.yaml")).unwrap();
        assert!(
            manifest.contains("tokenizer: tokenizer.model"),
            "{manifest}"
        );
        assert!(pack.join("tokenizer.model").is_file());

        // The graphs compute what Kyutai's LM computes from the checkpoint's own tensors.
        let o = python(
            "check_export.py",
            &[ck.to_str().unwrap(), pack.to_str().unwrap(), "--tol", tol],
        );
        let report = text(&o);
        eprintln!("{provider}: {report}");
        assert!(o.status.success(), "{report}");
        assert!(report.contains("argmax agrees 96/96"), "{report}");
    }

    // The fp32 pack runs the full-duplex pipeline, frame for frame as a pack made by
    // tools/make_pack.py does: as many token lines and as much agent audio.
    let wav = dir.path().join("tone.wav");
    tone(&wav);
    let run = |pack: &Path, name: &str| run_pipeline(dir.path(), pack, &wav, name);
    let (tokens, samples) = run(&dir.path().join("pack-cpu"), "exported");
    let (made_tokens, made_samples) = run(&root().join("models/tiny-gqa"), "made");
    assert!(tokens.lines().count() >= 20, "{tokens}");
    assert_eq!(tokens.lines().count(), made_tokens.lines().count());
    assert_eq!(samples, made_samples, "agent audio at 48 kHz");
    assert_ne!(tokens, made_tokens, "different weights, different tokens");

    // Exported quantized (every option at once): it says what it did, passes duplex's own load
    // check, and runs the same pipeline frame for frame.
    let q = dir.path().join("pack-quantized");
    let o = export_with(&ck, &q, "cpu", EVERY_QUANTIZATION);
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    for said in [
        "temporal: 9 MatMuls and 17 gathered weights in 4 bits",
        "depformer: 8 gathered weights in 4 bits",
        "mimi_decoder_step: ",
        "ok: the pack loads and runs",
    ] {
        assert!(log.contains(said), "missing {said:?} in {log}");
    }
    // Each long step said what it was doing, and the float pack it was made from is gone: OUT
    // is the only pack written.
    assert!(
        log.contains("temporal: ") && log.contains(" weights quantized ("),
        "no progress of the quantizer in {log}"
    );
    let mut beside: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("pack-quantized"))
        .collect();
    beside.sort();
    assert_eq!(beside, ["pack-quantized"]);
    let (q_tokens, q_samples) = run(&q, "quantized");
    assert_eq!(q_tokens.lines().count(), tokens.lines().count());
    assert_eq!(q_samples, samples, "agent audio at 48 kHz");
}

#[test]
fn bad_checkpoints_are_refused_naming_the_file_and_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(dir.path(), &[]);
    let out = dir.path().join("pack");

    // A missing file: exit 2, and the exact download command for the missing piece.
    let tok = ck.join("tokenizer_spm_32k_3.model");
    std::fs::rename(&tok, dir.path().join("spm")).unwrap();
    let o = export(&ck, &out, "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("missing tokenizer_spm_32k_3.model")
            && e.contains(
                "hf download nvidia/personaplex-7b-v1 --include 'tokenizer_spm_32k_3.model' --local-dir"
            ),
        "{e}"
    );
    std::fs::rename(dir.path().join("spm"), &tok).unwrap();

    // No config.json: the published 7B sizes are assumed, and these tensors are not them.
    std::fs::rename(ck.join("config.json"), dir.path().join("config.json")).unwrap();
    let o = export(&ck, &out, "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("the published 7B sizes: dim is 4096 but"), "{e}");
    assert!(e.contains("model.safetensors has 64"), "{e}");

    // A config the graphs cannot implement, named with its key.
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        ck.join("config.json"),
        cfg.replace(
            "\"depformer_pos_emb\": \"none\"",
            "\"depformer_pos_emb\": \"rope\"",
        ),
    )
    .unwrap();
    let o = export(&ck, &out, "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("config.json: depformer_pos_emb = 'rope'; the exporter's graphs need 'none'"),
        "{e}"
    );
    std::fs::write(ck.join("config.json"), &cfg).unwrap();

    // A file that is not safetensors.
    let lm = ck.join("model.safetensors");
    let good = std::fs::read(&lm).unwrap();
    std::fs::write(&lm, b"not a checkpoint").unwrap();
    let o = export(&ck, &out, "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("model.safetensors: not a safetensors file"),
        "{e}"
    );
    std::fs::write(&lm, &good).unwrap();
    assert!(
        !out.exists(),
        "nothing was written for a refused checkpoint"
    );

    // The exporter's tracebacks, each one line and exit 2 before any work: a count of heads of
    // zero, an output no file can be written under, a FIFO where a checkpoint file goes.
    std::fs::write(
        ck.join("config.json"),
        cfg.replace("\"num_heads\": 4", "\"num_heads\": 0"),
    )
    .unwrap();
    let o = export(&ck, &out, "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("num_heads is 0: a count of heads") && !e.contains("Traceback"),
        "{e}"
    );
    std::fs::write(ck.join("config.json"), &cfg).unwrap();
    let o = export(&ck, Path::new("/proc/duplex-pack"), "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("/proc/duplex-pack: cannot write in /proc") && !e.contains("Traceback"),
        "{e}"
    );
    std::fs::rename(&lm, dir.path().join("lm")).unwrap();
    let fifo = std::process::Command::new("mkfifo")
        .arg(&lm)
        .status()
        .unwrap();
    assert!(fifo.success());
    let o = export(&ck, &out, "cpu");
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("model.safetensors: not a regular file"), "{e}");
    std::fs::remove_file(&lm).unwrap();
    std::fs::rename(dir.path().join("lm"), &lm).unwrap();

    // A pack that does not load: `duplex doctor --pack` exits 2 naming it.
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(broken.join("temporal")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["doctor", "--pack"])
        .arg(&broken)
        .output()
        .unwrap();
    let e = text(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("the pack does not load") && e.contains("missing mimi_encoder graph"),
        "{e}"
    );
}

/// Every graph input of the pack at `dir`: graph → input → (dtype, dims), read by onnx.
fn inputs(dir: &Path) -> serde_json::Map<String, serde_json::Value> {
    let script = r#"
import json, os, sys, onnx
out = {}
for g in sorted(os.listdir(sys.argv[1])):
    p = os.path.join(sys.argv[1], g, "model.onnx")
    if os.path.isfile(p):
        m = onnx.load(p, load_external_data=False)
        out[g] = {i.name: [onnx.TensorProto.DataType.Name(i.type.tensor_type.elem_type),
                           [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]]
                  for i in m.graph.input}
print(json.dumps(out))
"#;
    let o = Command::new(root().join(".venv/bin/python"))
        .args(["-c", script])
        .arg(dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    match serde_json::from_slice(&o.stdout).unwrap() {
        serde_json::Value::Object(m) => m,
        v => panic!("{v}"),
    }
}

#[test]
fn the_7b_at_one_layer_exports_with_every_quantization_runs_and_has_the_7bs_inputs() {
    // PersonaPlex-7B's checkpoint at its real widths, one temporal and one depformer layer (1.9
    // GB): what the real export meets (the 4096-wide temporal, its 17 embedding tables and
    // text head, the 16-step depformer at 1024, the full Mimi), without 15 GB.
    // The exports (tools/prepare-7b-test.sh): made before by `tools/test.sh` (DUPLEX_TEST_7B),
    // else here.
    let tmp = tempfile::tempdir().unwrap();
    let made = std::env::var_os("DUPLEX_TEST_7B")
        .map(std::path::PathBuf::from)
        .filter(|d| d.join("done").is_file());
    let dir = match made {
        Some(d) => d,
        None => {
            let d = tmp.path().join("7b");
            let o = Command::new(root().join("tools/prepare-7b-test.sh"))
                .arg(&d)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", text(&o));
            d
        }
    };
    let want = inputs(&dir.join("7b-shapes"));
    let wav = tmp.path().join("tone.wav");
    tone(&wav);
    for name in ["int4", "int8"] {
        // Exported for a GPU (fp16) and quantized: what the exporter and the quantizer said,
        // then duplex's own load check on this CPU.
        let pack = dir.join(name);
        let export = std::fs::read_to_string(dir.join("export.log")).unwrap();
        assert!(
            export.contains("temporal 1 layers x 4096 (32 heads), depformer 1 x 1024, 16 steps"),
            "{export}"
        );
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap();
        for said in [" weights quantized (", &format!("wrote {}", pack.display())] {
            assert!(log.contains(said), "{name}: {said:?} not in {log}");
        }
        let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["doctor", "--pack"])
            .arg(&pack)
            .output()
            .unwrap();
        assert!(
            o.status.success() && text(&o).contains("ok: the pack loads and runs"),
            "{name}: {}",
            text(&o)
        );
        let got = inputs(&pack);
        let graphs: Vec<&String> = got.keys().collect();
        assert_eq!(graphs, want.keys().collect::<Vec<_>>(), "{name}: graphs");
        for (graph, ins) in &got {
            let all = want[graph].as_object().unwrap();
            for (input, spec) in ins.as_object().unwrap() {
                assert_eq!(
                    Some(spec),
                    all.get(input),
                    "{name}: {graph}: input {input} against the 7B's"
                );
            }
            // The 7B has the other 31 layers' caches, and nothing else the export lacks.
            for input in all
                .keys()
                .filter(|i| !ins.as_object().unwrap().contains_key(*i))
            {
                let layer: usize = input
                    .strip_prefix("past_key_values.")
                    .and_then(|r| r.split('.').next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("{name}: {graph}: the export lacks {input}"));
                assert!(layer >= 1, "{name}: {graph}: the export lacks {input}");
            }
        }
    }
    // The int4 pack (the one that fits a small card) steps a conversation on the CPU: a few
    // frames through the whole pipeline, as many token lines as frames.
    let short = tmp.path().join("short.wav");
    {
        let mut r = hound::WavReader::open(&wav).unwrap();
        let spec = r.spec();
        let mut w = hound::WavWriter::create(&short, spec).unwrap();
        for s in r.samples::<i16>().take(1920 * 4) {
            w.write_sample(s.unwrap()).unwrap();
        }
        w.finalize().unwrap();
    }
    let (lines, _) = run_pipeline(tmp.path(), &dir.join("int4"), &short, "int4-run");
    assert_eq!(lines.lines().count(), 4, "{lines}");
}
