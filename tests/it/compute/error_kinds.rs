//! Errors keep their kind through the binary: what cannot be had now (every slot of a shared
//! engine taken) is a run-time failure, exit 1 and retryable; a mistake in the configuration is
//! refused before start, exit 2; each names the stage and the key.

use crate::support::packs;

use std::process::Command;

fn run(dir: &std::path::Path, pipeline: &str) -> (Option<i32>, String) {
    let p = dir.join("p.yaml");
    std::fs::write(&p, pipeline).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .arg("run")
        .arg(&p)
        .current_dir(dir)
        .output()
        .unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn a_full_engine_is_exit_1_and_a_wrong_value_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let codes: Vec<Vec<u32>> = (0..10).map(|i| vec![(i * 7) % 2048; 8]).collect();
    std::fs::write(
        dir.path().join("codes.json"),
        serde_json::to_string(&codes).unwrap(),
    )
    .unwrap();
    let pk = packs::pack("tiny-gqa").display().to_string();
    // Two conversations in one pipeline, on a shared engine of one slot.
    let two = |slots: &str| {
        let mut y = String::from("stages:\n  codes: { kind: codes_source, path: codes.json }\n");
        for i in 1..=2 {
            y += &format!(
                "  t{i}: {{ kind: temporal, pack: {pk}, engine: shared, slots: {slots} }}\n  \
                 d{i}: {{ kind: depformer, pack: {pk}, engine: shared }}\n  \
                 s{i}: {{ kind: token_sink, path: out{i}.jsonl }}\n"
            );
        }
        y += "links:\n";
        for i in 1..=2 {
            y += &format!(
                "  - codes -> t{i}.codes\n  - t{i}.step -> d{i}\n  - {{ from: d{i}, to: t{i}.tokens, feedback: true }}\n  - t{i}.agent -> s{i}\n"
            );
        }
        y + "metrics:\n  address: \"\"\n"
    };
    let (code, err) = run(dir.path(), &two("1"));
    assert_eq!(code, Some(1), "a full engine is not a mistake: {err}");
    assert!(
        err.contains("`t2`") && err.contains("`slots`") && err.contains("all 1 slots"),
        "{err}"
    );
    let (code, err) = run(dir.path(), &two("-1"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("`slots`") && err.contains("out of range"),
        "{err}"
    );
    // With a slot each, it runs.
    let (code, err) = run(dir.path(), &two("2"));
    assert_eq!(code, Some(0), "{err}");
}
