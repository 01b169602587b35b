//! ONNX Runtime discovery from the command line: found in the project's .venv, and a clear
//! message (no panic) when it is nowhere; a healthy fp16 pack checked without warnings.

use std::process::Command;

/// `duplex doctor ARGS` in the checkout, finding ONNX Runtime as a user there would.
fn doctor_here(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_duplex"));
    c.arg("doctor")
        .args(args)
        .env_remove("ORT_DYLIB_PATH")
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

#[test]
fn doctor_finds_the_project_venv() {
    let out = doctor_here(&[]).output().unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        s.contains("libonnxruntime.so") && s.contains("project .venv"),
        "{s}"
    );
    assert!(s.contains("ORT Build Info"), "{s}");
    // The providers the loaded library offers, as it lists them; CUDA refused with the reason.
    let providers = s
        .lines()
        .find_map(|l| l.strip_prefix("providers: "))
        .unwrap_or_else(|| panic!("{s}"));
    assert!(providers.contains("CPUExecutionProvider"), "{s}");
    let cuda = s
        .lines()
        .find_map(|l| l.strip_prefix("cuda: "))
        .unwrap_or_else(|| panic!("{s}"));
    // This machine has the CPU-only library (and the test binary may be built without CUDA).
    assert!(
        cuda.starts_with("not available: ")
            && (cuda.contains("--features cuda") || cuda.contains("onnxruntime-gpu")),
        "{s}"
    );
}

#[test]
fn doctor_says_what_to_install_when_nothing_is_found() {
    // A copy of the binary outside the checkout, no venv, no python3 on PATH.
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("duplex");
    std::fs::copy(env!("CARGO_BIN_EXE_duplex"), &exe).unwrap();
    let out = Command::new(&exe)
        .arg("doctor")
        .env_remove("ORT_DYLIB_PATH")
        .env_remove("VIRTUAL_ENV")
        .env("PATH", dir.path())
        .current_dir(dir.path())
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{e}");
    assert!(e.contains("ONNX Runtime library not found"), "{e}");
    assert!(e.contains("pip install onnxruntime==1.31.1"), "{e}");
    assert!(!e.contains("panicked"), "{e}");

    let out = Command::new(&exe)
        .arg("doctor")
        .env("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    // A path that a setting names and that is missing is a configuration error.
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("/nonexistent/libonnxruntime.so (from ORT_DYLIB_PATH) does not exist"),
        "{e}"
    );
}

/// A healthy fp16 pack checked on the CPU warns of nothing: ONNX Runtime's optimizer notes
/// (a node it could not fold at load time, such as the fp16 codec's `Sqrt`) are logged at debug,
/// and its real warnings still reach the log.
#[test]
fn a_healthy_fp16_pack_is_checked_without_warnings() {
    let pack = ["--pack", "models/tiny-gqa-fp16"];
    let out = doctor_here(&pack).env_remove("RUST_LOG").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("mimi step graphs (f16): encoder on cpu f16"),
        "{err}"
    );
    assert!(!err.contains(" WARN "), "{err}");
    // At debug, the note is there: it was moved, not lost.
    let out = doctor_here(&pack)
        .env("RUST_LOG", "onnxruntime=debug")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("can't constant fold"), "{err}");
}
