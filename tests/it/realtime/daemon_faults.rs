//! Reloads that fail, in every way a configuration can, against a live `duplex daemon` on a
//! private PulseAudio: the daemon never exits, the conversation goes on whenever the running
//! configuration stays valid, and what it falls back to is always the last configuration that
//! ran, never one that was rejected.

use crate::support;
use crate::support::daemon;
use crate::support::packs;

use std::path::{Path, PathBuf};

use daemon::{config_text, Daemon};

/// The configuration text with `pack` instead of the tiny GQA pack.
fn with_pack(d: &Daemon, pack: &Path, extra: &str) -> String {
    config_text(d.pa.dir(), extra).replace(
        &packs::pack("tiny-gqa").display().to_string(),
        &pack.display().to_string(),
    )
}

/// A copy of the tiny GQA pack with its temporal and depformer graphs swapped.
fn swapped_pack(dir: &Path) -> PathBuf {
    let p = dir.join("swapped");
    std::fs::create_dir_all(&p).unwrap();
    let src = packs::pack("tiny-gqa");
    for g in packs::CODEC_GRAPHS {
        std::os::unix::fs::symlink(src.join(g), p.join(g)).unwrap();
    }
    std::os::unix::fs::symlink(src.join("depformer"), p.join("temporal")).unwrap();
    std::os::unix::fs::symlink(src.join("temporal"), p.join("depformer")).unwrap();
    std::fs::copy(src.join("pack.yaml"), p.join("pack.yaml")).unwrap();
    p
}

fn persona(s: &serde_json::Value) -> serde_json::Value {
    s["persona"].clone()
}

/// Waits until the daemon is ready and frames flow on `pack`.
fn running_on(d: &Daemon, pack: &Path) {
    d.wait_status(60, "ready and running", |s| {
        s["ready"] == true && s["pack"].as_str() == Some(pack.to_str().unwrap())
    });
    let f = d.frames();
    d.wait_status(20, "frames flow", |s| {
        s["frames"].as_u64().unwrap_or(0) >= f + 5
    });
}

/// Regression: a persona rejected at reload was kept as the "previous configuration", so a
/// later reload that had to fall back to it could not be built and the daemon exited 2. And a
/// reload to a pack that fails its checks stopped the running pipeline (a 5 s outage and a
/// reset conversation) before finding out.
#[test]
fn a_rejected_reload_is_never_what_the_daemon_falls_back_to() {
    let d = Daemon::start("persona_tokens: [10, 20]\n");
    let gqa = packs::pack("tiny-gqa");
    let tiny = packs::pack("tiny");
    // The persona is refused when the configuration is checked, before anything changes.
    let out = d.reload(&config_text(d.pa.dir(), "persona_tokens: [10, 99999]\n"));
    assert!(
        out.starts_with("rejected: ") && out.contains("persona token 99999 is out of range"),
        "{out}"
    );
    assert_eq!(persona(&d.status().unwrap()), serde_json::json!([10, 20]));
    // The same persona with another pack: refused too, and the daemon goes on.
    let out = d.reload(&with_pack(&d, &tiny, "persona_tokens: [10, 99999]\n"));
    assert!(out.starts_with("rejected: "), "{out}");
    // Swapped graphs: refused when the pack is checked; the running pipeline is untouched.
    let swapped = swapped_pack(d.pa.dir());
    let f0 = d.frames();
    let out = d.reload(&with_pack(&d, &swapped, "persona_tokens: [10, 20]\n"));
    assert!(
        out.starts_with("rejected: ") && out.contains("missing input `input_frame`"),
        "{out}"
    );
    assert!(!d.log().contains("restarting the pipeline"), "{}", d.log());
    d.frames_go_on(f0, "frames went on");
    // A pipeline that cannot be built beside the running one, nor alone (a device that is
    // listed but cannot be opened): back to the last configuration that ran.
    let out = d.reload(&with_pack(
        &d,
        &tiny,
        "persona_tokens: [10, 20]\noutput_device: \"alsa:jack\"\n",
    ));
    assert!(
        out.starts_with("rejected: ")
            && out.contains("going back to the last configuration that ran"),
        "{out}"
    );
    running_on(&d, &gqa);
    let s = d.status().unwrap();
    assert_eq!(persona(&s), serde_json::json!([10, 20]), "{s}");
    assert_eq!(s["devices"]["output"]["configured"], "default", "{s}");
}

/// Reloads in a row, good and bad interleaved: a new persona, a new pack, a new sampling; a
/// persona out of range, malformed YAML, an unknown key, a device that does not exist, swapped
/// graphs, a corrupt graph, and a pipeline that cannot be built at all. After each the daemon
/// answers and runs the last good configuration; at the end it is the last good one.
///
/// Ten reloads are one of each kind, and the good pack change among them alternates the running
/// pack, so twenty meet every kind of failure on each of the two packs: what decides the
/// criterion (`make test`). `make soak` runs fifty.
#[test]
fn reloads_good_and_bad_leave_the_last_good_configuration_running() {
    let reloads = if support::soak() { 50 } else { 20 };
    let mut d = Daemon::start("persona_tokens: [1, 2]\n");
    let dir = d.pa.dir().to_path_buf();
    let swapped = swapped_pack(&dir);
    let corrupt = dir.join("corrupt");
    std::fs::create_dir_all(&corrupt).unwrap();
    let src = packs::pack("tiny-gqa");
    for g in packs::CODEC_GRAPHS.iter().chain(&["depformer"]) {
        std::os::unix::fs::symlink(src.join(g), corrupt.join(g)).unwrap();
    }
    std::fs::create_dir_all(corrupt.join("temporal")).unwrap();
    std::fs::write(corrupt.join("temporal/model.onnx"), b"\x08\x07garbage").unwrap();
    std::fs::copy(src.join("pack.yaml"), corrupt.join("pack.yaml")).unwrap();
    let packs = [packs::pack("tiny-gqa"), packs::pack("tiny")];
    // The configuration that runs: (pack index, persona).
    let mut good = (0usize, vec![1i64, 2]);
    let text = |d: &Daemon, pack: &Path, extra: &str| with_pack(d, pack, extra);
    let persona_line = |p: &[i64]| {
        format!(
            "persona_tokens: [{}]\n",
            p.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let mut outcomes = Vec::new();
    for i in 0..reloads {
        let cur = &packs[good.0];
        let p = persona_line(&good.1);
        let (config, applied) = match i % 10 {
            0 => {
                let next = vec![i as i64 + 10, 7];
                let c = text(&d, cur, &persona_line(&next));
                good.1 = next;
                (c, true)
            }
            1 => (text(&d, cur, "persona_tokens: [5, 99999]\n"), false),
            2 => ("sampling: [not, a map\n".to_string(), false),
            3 => {
                let other = 1 - good.0;
                let c = text(&d, &packs[other], &p);
                good.0 = other;
                (c, true)
            }
            4 => (text(&d, cur, &format!("{p}persona_tokns: [1]\n")), false),
            5 => (
                text(&d, cur, &format!("{p}output_device: \"no-such-speaker\"\n")),
                false,
            ),
            6 => (text(&d, &swapped, &p), false),
            7 => (
                text(
                    &d,
                    cur,
                    &format!("{p}sampling:\n  text_temperature: 0.{i}\n"),
                ),
                true,
            ),
            8 => (text(&d, &corrupt, &p), false),
            _ => (
                text(
                    &d,
                    &packs[1 - good.0],
                    &format!("{p}output_device: \"alsa:jack\"\n"),
                ),
                false,
            ),
        };
        let out = d.reload(&config);
        assert_eq!(
            out.starts_with("applied: "),
            applied,
            "reload {i}: {out}\n{}",
            d.log()
        );
        running_on(&d, &packs[good.0]);
        let s = d.status().unwrap();
        assert_eq!(
            persona(&s),
            serde_json::json!(good.1),
            "reload {i}: the persona that runs: {s}"
        );
        outcomes.push(out);
    }
    // Every kind happened, and the daemon is still the same process, running the last good
    // configuration with frames flowing.
    let rejected = outcomes
        .iter()
        .filter(|o| o.starts_with("rejected"))
        .count();
    assert_eq!(rejected, reloads * 7 / 10, "{outcomes:#?}");
    assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none());
    let s = d.status().unwrap();
    assert_eq!(s["pack"].as_str(), Some(packs[good.0].to_str().unwrap()));
    assert_eq!(persona(&s), serde_json::json!(good.1));
    assert_eq!(s["reloads"]["done"], reloads, "{s}");
}
