//! One ONNX Runtime selection for every command, through the real `duplex` binary: `run`,
//! `replay`, `doctor`, `daemon --check` and `serve --check` each honour `ort.library` of their
//! settings file (where they have one) and its `DUPLEX__ORT__LIBRARY` override, refuse a
//! library that does not exist (exit 2, naming the variable or the file and key), and log the
//! library they load with where it came from. The precedence (a setting, then `ORT_DYLIB_PATH`,
//! then the project's `.venv`) is in `src/model/ortlib.rs`.
//!
//! Regression: `DUPLEX__ORT__LIBRARY=/nonexistent` was refused by `run`, refused as an unknown
//! key `ort` by `serve --check` and `daemon --check`, and ignored by `replay` and `doctor`,
//! which loaded the `.venv` library instead.

use crate::support::daemon;
use crate::support::packs;
use crate::support::pulse;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const MISSING: &str = "/nonexistent/libonnxruntime.so";
const VAR: &str = "DUPLEX__ORT__LIBRARY";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `duplex` in the checkout, with no ONNX Runtime setting of the caller's and no user settings
/// files (`home` stands for the home and configuration folders).
fn duplex(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_duplex"));
    c.current_dir(root())
        .env_remove("ORT_DYLIB_PATH")
        .env_remove(VAR)
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("config"));
    c
}

/// Runs with a deadline: a hang is a failure, not a stuck test.
fn output(c: Command) -> Output {
    crate::support::wait::output_within(c, Duration::from_secs(120))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// The `error: …` line of a failed command.
fn error_line(o: &Output) -> String {
    let e = stderr(o);
    e.lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or(&e)
        .to_string()
}

/// Asserts exit 2 and an error line that starts with `lead` and names the missing library.
#[track_caller]
fn refused(o: &Output, lead: &str) {
    let line = error_line(o);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(o));
    assert!(line.starts_with(lead), "expected `{lead}…`: {}", stderr(o));
    assert!(line.contains(MISSING), "{}", stderr(o));
}

/// Asserts success and the log line of the library loaded, with its origin.
#[track_caller]
fn loaded(o: &Output, origin: &str) {
    let e = stderr(o);
    assert!(o.status.success(), "{e}");
    let line = e
        .lines()
        .find(|l| l.contains("loaded ONNX Runtime"))
        .unwrap_or_else(|| panic!("no `loaded ONNX Runtime` line: {e}"));
    assert!(
        line.contains(" INFO ") && line.contains("libonnxruntime.so"),
        "{line}"
    );
    assert!(
        line.ends_with(&format!("origin={origin}")),
        "expected origin={origin}: {line}"
    );
}

/// The project's `.venv` library (what the search finds by default), by its absolute path.
fn venv_lib() -> PathBuf {
    let lib = std::fs::read_dir(root().join(".venv/lib"))
        .expect(".venv is missing: run `make setup`")
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/onnxruntime/capi"))
        .find(|p| p.is_dir())
        .and_then(|capi| {
            std::fs::read_dir(capi)
                .unwrap()
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| {
                    let name = p.file_name().unwrap().to_string_lossy().to_string();
                    name == "libonnxruntime.so" || name.starts_with("libonnxruntime.so.")
                })
        });
    lib.expect("no libonnxruntime in .venv: run `make setup`")
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Two frames of user codes for the LM.
fn codes(dir: &Path) -> PathBuf {
    write(dir, "codes.json", "[[1,2,3,4,5,6,7,8],[1,2,3,4,5,6,7,8]]")
}

/// An LM pipeline on the tiny pack (it loads ONNX Runtime), with `head` at the top.
fn lm_pipeline(dir: &Path, head: &str) -> PathBuf {
    write(
        dir,
        "lm.yaml",
        &format!(
            "{head}metrics: {{ address: \"\" }}\nstages:\n  codes: {{ kind: codes_source, path: {0} }}\n  temporal: {{ kind: temporal, pack: {1} }}\n  depformer: {{ kind: depformer, pack: {1} }}\n  tokens: {{ kind: token_sink, path: {2} }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
            codes(dir).display(),
            packs::pack("tiny-gqa").display(),
            dir.join("tokens.jsonl").display()
        ),
    )
}

#[test]
fn run_honours_the_pipeline_file_the_variable_and_orders_them_over_ort_dylib_path() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = lm_pipeline(d, "");
    let run = |env: &[(&str, &str)]| {
        let mut c = duplex(d);
        c.arg("run").arg(&p).envs(env.iter().copied());
        output(c)
    };
    refused(
        &run(&[(VAR, MISSING)]),
        &format!(
            "error: environment variable {VAR} (over {}): `ort.library`: ONNX Runtime library",
            p.display()
        ),
    );
    // Found by the first model stage: the stage is named, and the variable.
    let o = run(&[("ORT_DYLIB_PATH", MISSING)]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        error_line(&o).ends_with(&format!("{MISSING} (from ORT_DYLIB_PATH) does not exist")),
        "{}",
        stderr(&o)
    );
    loaded(&run(&[]), "project .venv");
    // The variable (an override of the key) beats ORT_DYLIB_PATH, which beats the .venv.
    let lib = venv_lib();
    let lib = lib.to_str().unwrap();
    loaded(
        &run(&[(VAR, lib), ("ORT_DYLIB_PATH", MISSING)]),
        &format!("environment variable {VAR}"),
    );
    loaded(&run(&[("ORT_DYLIB_PATH", lib)]), "ORT_DYLIB_PATH");

    let p = lm_pipeline(d, &format!("ort: {{ library: {MISSING} }}\n"));
    refused(
        &run(&[]),
        &format!(
            "error: {}: `ort.library`: ONNX Runtime library",
            p.display()
        ),
    );
    let p = lm_pipeline(d, &format!("ort: {{ library: {lib} }}\n"));
    loaded(
        &run(&[("ORT_DYLIB_PATH", MISSING)]),
        &format!("{}: `ort.library`", p.display()),
    );
}

#[test]
fn replay_honours_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let codes = codes(d);
    let replay = |env: &[(&str, &str)]| {
        let mut c = duplex(d);
        c.arg("replay")
            .arg("--pack")
            .arg(packs::pack("tiny-gqa"))
            .arg("--codes")
            .arg(&codes)
            .arg("--out")
            .arg(d.join("out.jsonl"))
            .envs(env.iter().copied());
        output(c)
    };
    refused(
        &replay(&[(VAR, MISSING)]),
        &format!("error: environment variable {VAR} (over duplex replay): `ort.library`: "),
    );
    loaded(&replay(&[]), "project .venv");
    let lib = venv_lib();
    loaded(
        &replay(&[(VAR, lib.to_str().unwrap()), ("ORT_DYLIB_PATH", MISSING)]),
        &format!("environment variable {VAR}"),
    );
}

#[test]
fn doctor_honours_the_variable_under_its_flag() {
    let dir = tempfile::tempdir().unwrap();
    let doctor = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = duplex(dir.path());
        c.arg("doctor").args(args).envs(env.iter().copied());
        output(c)
    };
    refused(
        &doctor(&[], &[(VAR, MISSING)]),
        &format!("error: environment variable {VAR} (over duplex doctor): `ort.library`: "),
    );
    refused(&doctor(&["--ort-lib", MISSING], &[]), "error: --ort-lib: ");
    let o = doctor(&[], &[]);
    loaded(&o, "project .venv");
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("(found via project .venv)"),
        "{o:?}"
    );
    let lib = venv_lib();
    let lib = lib.to_str().unwrap();
    let o = doctor(&[], &[(VAR, lib)]);
    loaded(&o, &format!("environment variable {VAR}"));
    assert!(
        String::from_utf8_lossy(&o.stdout)
            .contains(&format!("(found via environment variable {VAR})")),
        "{o:?}"
    );
    // The flag is the command line: over the variable.
    loaded(&doctor(&["--ort-lib", lib], &[(VAR, MISSING)]), "--ort-lib");
}

#[test]
fn daemon_check_honours_its_settings_file_and_the_variable() {
    let pa = pulse::Pulse::start();
    let d = pa.dir();
    let config = d.join("daemon.yaml");
    let check = |extra: &str, env: &[(&str, &str)]| {
        std::fs::write(&config, daemon::config_text(d, extra)).unwrap();
        let mut c = pa.duplex();
        c.current_dir(root())
            .env_remove("ORT_DYLIB_PATH")
            .env_remove(VAR)
            .args(["daemon", "--check", "--config", config.to_str().unwrap()])
            .envs(env.iter().copied());
        output(c)
    };
    refused(
        &check("", &[(VAR, MISSING)]),
        &format!(
            "error: environment variable {VAR} (over {}): `ort.library`: ONNX Runtime library",
            config.display()
        ),
    );
    refused(
        &check(&format!("ort:\n  library: {MISSING}\n"), &[]),
        &format!(
            "error: {}: `ort.library`: ONNX Runtime library",
            config.display()
        ),
    );
    loaded(&check("", &[]), "project .venv");
    // Set over the pipeline file's, with the daemon's file and key as its origin.
    let lib = venv_lib();
    let lib = lib.to_str().unwrap();
    loaded(
        &check(
            &format!("ort:\n  library: {lib}\n"),
            &[("ORT_DYLIB_PATH", MISSING)],
        ),
        &format!("{}: `ort.library`", config.display()),
    );
    loaded(
        &check("", &[(VAR, lib), ("ORT_DYLIB_PATH", MISSING)]),
        &format!("environment variable {VAR}"),
    );
}

#[test]
fn serve_check_honours_its_settings_file_and_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = d.join("serve.yaml");
    let check = |text: &str, env: &[(&str, &str)]| {
        std::fs::write(&cfg, text).unwrap();
        let mut c = duplex(d);
        c.args(["serve", "--check", "--config", cfg.to_str().unwrap()])
            .envs(env.iter().copied());
        output(c)
    };
    refused(
        &check("", &[(VAR, MISSING)]),
        &format!(
            "error: environment variable {VAR} (over {}): `ort.library`: ONNX Runtime library",
            cfg.display()
        ),
    );
    refused(
        &check(&format!("ort:\n  library: {MISSING}\n"), &[]),
        &format!(
            "error: {}: `ort.library`: ONNX Runtime library",
            cfg.display()
        ),
    );
    loaded(&check("", &[]), "project .venv");
    let lib = venv_lib();
    let lib = lib.to_str().unwrap();
    loaded(
        &check(
            &format!("ort:\n  library: {lib}\n"),
            &[("ORT_DYLIB_PATH", MISSING)],
        ),
        &format!("{}: `ort.library`", cfg.display()),
    );
    loaded(
        &check("", &[(VAR, lib), ("ORT_DYLIB_PATH", MISSING)]),
        &format!("environment variable {VAR}"),
    );
}
