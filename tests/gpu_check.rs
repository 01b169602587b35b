//! `tools/gpu-check.sh OUT --cpu`: the GPU check's dry run on this machine, with this build,
//! library and packs. Every section runs and reports (a GPU run prints the same, measured
//! there); the token streams it compares agree with themselves on the CPU.

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
        3,
        "{report}"
    );
    assert!(
        report.matches("resident (cpu f16) context 50: ").count() >= 3,
        "{report}"
    );
    // The shared engine's frame at B = 1/16/48, on the float pack and on both quantized ones.
    assert_eq!(
        report
            .matches("shared LM engine on cpu, B conversations stepped together")
            .count(),
        3,
        "{report}"
    );
    assert!(report.matches(", B=48: ").count() >= 3, "{report}");
    for want in [
        "providers: ",
        "temporal: on cpu f16",
        "depformer: on cpu f16",
        "mimi: encoder on cpu f32",
        "resident (cpu f16) context 50: ",
        "host     (cpu f16) context 50: ",
        "fixed    (cpu f16) context 50: ",
        "sink sink: completion interval mean ",
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
