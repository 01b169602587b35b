//! Pipeline files: every validation error names the file, the stage and the key; layering of
//! defaults, environment and `--set` overrides.

use crate::support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use duplex::app;
use duplex::config::{ConfigErrorKind, LoadOptions, Override};
use duplex::runtime::{Body, PortSpec};
use duplex::stages::{Registry, StageKind};

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn no_env() -> LoadOptions {
    LoadOptions {
        sets: vec![],
        env: Some(HashMap::new()),
    }
}

fn validate_err(text: &str) -> (duplex::config::ConfigError, String) {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "p.yaml", text);
    let e = app::validate(&p, &no_env(), &Registry::builtin()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with(&p.display().to_string()),
        "file not named: {msg}"
    );
    (e, msg.replacen(&p.display().to_string(), "p.yaml", 1))
}

const GOOD: &str = r#"
stages:
  tone: { kind: synth_source, duration: 0.1 }
  down: { kind: resample, to: 16000 }
  sink: { kind: null_sink }
links:
  - tone -> down
  - { from: down, to: sink, capacity: 2, overflow: drop_oldest }
"#;

#[test]
fn a_good_file_resolves_to_its_graph() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "p.yaml", GOOD);
    let text = app::validate(&p, &no_env(), &Registry::builtin()).unwrap();
    assert!(text.contains("tone.out -> down.in"), "{text}");
    assert!(text.contains("down.out -> sink.in"), "{text}");
    // link-level settings and the defaults from configs/default.yaml
    let line = text
        .lines()
        .find(|l| l.contains("down.out -> sink.in"))
        .unwrap();
    assert!(
        line.contains("capacity 2") && line.contains("drop_oldest"),
        "{line}"
    );
    let line = text
        .lines()
        .find(|l| l.contains("tone.out -> down.in"))
        .unwrap();
    assert!(
        line.contains("Pcm") && line.contains("capacity 4") && line.contains("block"),
        "{line}"
    );
}

#[test]
fn unknown_stage_kind() {
    let (e, msg) = validate_err("stages:\n  a: { kind: resampel }\n");
    assert_eq!(e.kind, ConfigErrorKind::UnknownKind);
    assert!(
        msg.starts_with(
            "p.yaml: stage `a`: `kind`: unknown stage kind `resampel` (did you mean `resample`?)"
        ),
        "{msg}"
    );
}

#[test]
fn unknown_param() {
    let (e, msg) = validate_err("stages:\n  tone: { kind: synth_source, frequency: 3 }\n");
    assert_eq!(e.kind, ConfigErrorKind::UnknownParam);
    assert!(
        msg.starts_with(
            "p.yaml: stage `tone`: `frequency`: unknown param for a `synth_source` stage"
        ),
        "{msg}"
    );
    assert!(msg.contains("freq"), "{msg}");
}

#[test]
fn mistyped_param() {
    let (e, msg) = validate_err("stages:\n  tone: { kind: synth_source, duration: long }\n");
    assert_eq!(e.kind, ConfigErrorKind::WrongType);
    assert_eq!(
        msg,
        "p.yaml: stage `tone`: `duration`: expected number 0..=10000000, got \"long\" (a string)"
    );
    let (e, msg) = validate_err("stages:\n  d: { kind: resample, to: 5 }\n");
    assert_eq!(e.kind, ConfigErrorKind::OutOfRange);
    assert!(msg.contains("stage `d`: `to`: 5 is out of range"), "{msg}");
}

#[test]
fn missing_required_param() {
    let (e, msg) = validate_err("stages:\n  src: { kind: wav_source }\n");
    assert_eq!(e.kind, ConfigErrorKind::Missing);
    assert!(
        msg.starts_with("p.yaml: stage `src`: `path`: required param missing"),
        "{msg}"
    );
}

#[test]
fn missing_link() {
    let (e, msg) = validate_err(
        "stages:\n  tone: { kind: synth_source }\n  down: { kind: resample }\n  sink: { kind: null_sink }\nlinks:\n  - tone -> down\n",
    );
    assert_eq!(e.kind, ConfigErrorKind::Link);
    assert_eq!(msg, "p.yaml: input `sink.in` is not linked to anything");
}

#[test]
fn dangling_link() {
    let (e, msg) = validate_err(
        "stages:\n  tone: { kind: synth_source }\n  sink: { kind: null_sink }\nlinks:\n  - tone -> sinc\n",
    );
    assert_eq!(e.kind, ConfigErrorKind::Link);
    assert_eq!(
        msg,
        "p.yaml: link `tone -> sinc`: there is no stage named `sinc`"
    );
    let (_, msg) = validate_err(
        "stages:\n  tone: { kind: synth_source }\n  sink: { kind: null_sink }\nlinks:\n  - tone.pcm -> sink\n",
    );
    assert_eq!(
        msg,
        "p.yaml: link `tone.pcm -> sink`: stage `tone` has no output port `pcm` (it has: out)"
    );
}

#[test]
fn cycle_other_than_feedback() {
    let (e, msg) = validate_err(
        "stages:\n  a: { kind: resample }\n  b: { kind: resample }\nlinks:\n  - a -> b\n  - b -> a\n",
    );
    assert_eq!(e.kind, ConfigErrorKind::Link);
    assert!(msg.contains("links form a cycle a -> b -> a"), "{msg}");
    // Marking it feedback does not help when the input is not a feedback input.
    let (_, msg) = validate_err(
        "stages:\n  a: { kind: resample }\n  b: { kind: resample }\nlinks:\n  - a -> b\n  - { from: b, to: a, feedback: true }\n",
    );
    assert!(
        msg.contains(
            "marked `feedback: true` but stage `a` has no feedback input (its inputs: in)"
        ),
        "{msg}"
    );
}

/// A kind registered by an application: emits numbers, not audio.
fn counter_kind() -> StageKind {
    StageKind {
        name: "counter",
        doc: "numbers",
        params: &[],
        inputs: Vec::new,
        outputs: || vec![PortSpec::new::<support::Num>("out")],
        commands: &[],
        status: &[],
        build: |_, _| Ok(Body::Source(Box::new(support::Count::new(3)))),
    }
}

#[test]
fn type_mismatch_names_file_stages_and_types() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "p.yaml",
        "stages:\n  n: { kind: counter }\n  up: { kind: resample }\n  sink: { kind: null_sink }\nlinks:\n  - n -> up\n  - up -> sink\n",
    );
    let mut reg = Registry::builtin();
    reg.register(counter_kind());
    let e = app::validate(&p, &no_env(), &reg).unwrap_err();
    assert_eq!(e.kind, ConfigErrorKind::Link);
    assert_eq!(
        e.to_string(),
        format!(
            "{}: link `n -> up`: type mismatch: `n.out` emits Num but `up.in` takes Pcm",
            p.display()
        )
    );
    // A null_sink takes any type.
    let p2 = write(
        dir.path(),
        "q.yaml",
        "stages:\n  n: { kind: counter }\n  sink: { kind: null_sink }\nlinks:\n  - n -> sink\n",
    );
    assert!(app::validate(&p2, &no_env(), &reg).is_ok());
}

#[test]
fn unknown_keys_and_bad_links() {
    let (e, msg) = validate_err("stage:\n  a: { kind: null_sink }\n");
    assert_eq!(e.kind, ConfigErrorKind::UnknownKey);
    assert!(
        msg.contains("`stage`: unknown top-level key (did you mean `stages`?)"),
        "{msg}"
    );
    let (_, msg) = validate_err(
        "stages:\n  tone: { kind: synth_source }\n  sink: { kind: null_sink }\nlinks:\n  - { from: tone, to: sink, overflow: drop_all }\n",
    );
    assert!(
        msg.contains(
            "`links[0].overflow`: overflow policy must be one of block, drop_oldest, drop_newest"
        ),
        "{msg}"
    );
    let (_, msg) = validate_err(
        "stages:\n  tone: { kind: synth_source }\n  sink: { kind: null_sink }\nlinks:\n  - { from: tone, to: sink, capacity: 0 }\n",
    );
    assert!(
        msg.contains("`links[0]`: `capacity` must be at least 1"),
        "{msg}"
    );
    let (e, _) = validate_err("stages:\n  a: [1, 2\n");
    assert_eq!(e.kind, ConfigErrorKind::Syntax);
}

#[test]
fn environment_and_set_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "p.yaml", GOOD);
    let env: HashMap<String, String> = [
        ("DUPLEX__DEFAULTS__CAPACITY".to_string(), "16".to_string()),
        ("DUPLEX__STAGES__DOWN__TO".to_string(), "8000".to_string()),
    ]
    .into();
    let opts = LoadOptions {
        sets: vec![],
        env: Some(env.clone()),
    };
    let text = app::validate(&p, &opts, &Registry::builtin()).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("tone.out -> down.in"))
        .unwrap();
    assert!(line.contains("capacity 16"), "{line}");
    let (spec, _) = app::build(&p, &opts, &Registry::builtin()).unwrap();
    assert_eq!(spec.stages[1].params.int("to"), 8000);
    // --set wins over the environment.
    let opts = LoadOptions {
        sets: vec![Override::set("stages.down.to", "12000")],
        env: Some(env),
    };
    let (spec, _) = app::build(&p, &opts, &Registry::builtin()).unwrap();
    assert_eq!(spec.stages[1].params.int("to"), 12000);
    // A mistyped value from the environment is reported as such: the variable leads.
    let opts = LoadOptions {
        sets: vec![],
        env: Some([("DUPLEX__STAGES__DOWN__TO".to_string(), "fast".to_string())].into()),
    };
    let e = app::validate(&p, &opts, &Registry::builtin()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "environment variable DUPLEX__STAGES__DOWN__TO (over {}): stage `down`: `to`: expected integer 1000..=768000, got \"fast\" (a string)",
            p.display()
        )
    );
}

#[test]
fn a_stage_that_cannot_be_built_names_its_file() {
    let (e, msg) = validate_err(
        "stages:\n  src: { kind: wav_source, path: /nonexistent/in.wav }\n  sink: { kind: null_sink }\nlinks: [src -> sink]\n",
    );
    assert_eq!(e.kind, ConfigErrorKind::Build);
    assert!(
        msg.starts_with("p.yaml: stage `src`: `path`: /nonexistent/in.wav: No such file"),
        "{msg}"
    );
}

#[test]
fn an_inject_delay_option_is_checked_like_the_stage_of_that_name() {
    let (e, msg) = validate_err(
        "stages:\n  d: { kind: resample, to: 16000, inject_delay: { mode: sideways } }\n",
    );
    assert_eq!(e.kind, ConfigErrorKind::OutOfRange);
    assert_eq!(
        msg,
        "p.yaml: stage `d.inject_delay`: `mode`: \"sideways\" is not one of none, bimodal, ramp"
    );
    let (_, msg) = validate_err(
        "stages:\n  d: { kind: resample, to: 16000, inject_delay: { slow_ms: -1 } }\n",
    );
    assert!(msg.contains("stage `d.inject_delay`: `slow_ms`"), "{msg}");
    let (_, msg) = validate_err("stages:\n  d: { kind: resample, to: 16000, inject_delay: 5 }\n");
    assert_eq!(
        msg,
        "p.yaml: stage `d`: `inject_delay`: expected a map of `inject_delay` params (mode, base_ms, …), got 5 (an integer)"
    );
}
