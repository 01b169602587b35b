//! The LM against an independent reference (`tools/reference_lm.py`: numpy + onnxruntime, host
//! arrays, argmax), step by step, on every tiny pack variant; and reproducibility of replays.

use crate::support::packs;

use std::path::Path;
use std::process::Command;

fn user_codes(dir: &Path, n: usize, seed: u64) -> std::path::PathBuf {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let frames: Vec<Vec<i64>> = (0..n)
        .map(|_| {
            (0..8)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % 2048) as i64
                })
                .collect()
        })
        .collect();
    let p = dir.join(format!("codes-{seed}.json"));
    std::fs::write(&p, serde_json::to_string(&frames).unwrap()).unwrap();
    p
}

fn replay(pack: &Path, codes: &Path, out: &Path, extra: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["replay", "--pack"])
        .arg(pack)
        .arg("--codes")
        .arg(codes)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out).unwrap()
}

fn reference(pack: &Path, codes: &Path, out: &Path, extra: &[&str]) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("tools/reference_lm.py"))
        .arg(pack)
        .arg(codes)
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out).unwrap()
}

#[test]
fn greedy_tokens_match_the_reference_step_by_step() {
    let dir = tempfile::tempdir().unwrap();
    let codes = user_codes(dir.path(), 40, 1);
    for name in ["tiny", "tiny-gqa", "tiny-gqa-fp16"] {
        let pack = packs::pack(name);
        for (ours, theirs) in [
            (
                vec!["--persona-tokens", "10,20,31999"],
                vec!["--persona", "10,20,31999"],
            ),
            (vec!["--silence-frames", "0"], vec!["--silence-frames", "0"]),
        ] {
            let b = reference(&pack, &codes, &dir.path().join("ref.jsonl"), &theirs);
            // Both depformer modes: every substep run, or those nothing reads skipped; and the
            // priming's frames as prefills (`chunked`) against the reference's steps.
            for (mode, priming) in [("run", "stepped"), ("skip", "stepped"), ("skip", "chunked")] {
                let mut ours = ours.clone();
                ours.extend(["--greedy", "--user-substeps", mode, "--priming", priming]);
                let a = replay(&pack, &codes, &dir.path().join("ours.jsonl"), &ours);
                let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
                assert_eq!(a.len(), b.len(), "{name} {ours:?}: frame counts");
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(x, y, "{name} {ours:?}: first difference at agent frame {i}");
                }
                // Without priming, N user frames give N - 2 agent frames.
                if ours.contains(&"0") {
                    assert_eq!(a.len(), 38, "{name}");
                } else {
                    assert_eq!(a.len(), 40, "{name}: primed, the ring is already full");
                }
            }
        }
    }
}

#[test]
fn replays_are_reproducible_and_the_seed_decides() {
    let dir = tempfile::tempdir().unwrap();
    let codes = user_codes(dir.path(), 30, 2);
    let pack = packs::pack("tiny-gqa");
    let out = |n: &str| dir.path().join(n);
    let g1 = replay(&pack, &codes, &out("g1"), &["--greedy"]);
    let g2 = replay(&pack, &codes, &out("g2"), &["--greedy", "--seed", "9"]);
    assert_eq!(g1, g2, "greedy ignores the seed and is deterministic");
    let s1 = replay(&pack, &codes, &out("s1"), &["--seed", "7"]);
    let s2 = replay(&pack, &codes, &out("s2"), &["--seed", "7"]);
    let s3 = replay(&pack, &codes, &out("s3"), &["--seed", "8"]);
    assert_eq!(s1, s2, "same seed, same tokens");
    // Skipping the substeps nothing reads takes the same draws: the same sampled tokens.
    let r1 = replay(
        &pack,
        &codes,
        &out("r1"),
        &["--seed", "7", "--user-substeps", "run"],
    );
    let k1 = replay(
        &pack,
        &codes,
        &out("k1"),
        &["--seed", "7", "--user-substeps", "skip"],
    );
    assert_eq!(r1, k1, "skip and run, same seed");
    assert_eq!(s1, k1, "skip is the default");
    assert_ne!(s1, s3, "another seed, another voice");
    assert_ne!(s1, g1);
    // The host round trip computes the same tokens as the resident cache.
    let h = replay(&pack, &codes, &out("h"), &["--seed", "7", "--kv", "host"]);
    assert_eq!(s1, h);
}

#[test]
fn a_bare_export_directory_works_with_personaplex_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let src = packs::pack("tiny");
    let bare = dir.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    for g in packs::ALL_GRAPHS {
        std::os::unix::fs::symlink(src.join(g), bare.join(g)).unwrap();
    }
    let codes = user_codes(dir.path(), 10, 3);
    let a = replay(&bare, &codes, &dir.path().join("a"), &["--greedy"]);
    let b = replay(&src, &codes, &dir.path().join("b"), &["--greedy"]);
    assert_eq!(a, b);
}

/// The conformance check again with three conversations of different lengths stepped as one
/// batch of the shared engine (`duplex replay` with several `--codes`): each conversation's
/// stream equals the reference's for it alone.
#[test]
fn batched_replays_match_the_reference_for_each_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let codes: Vec<_> = [(40, 1), (25, 2), (33, 3)]
        .iter()
        .map(|&(n, seed)| user_codes(dir.path(), n, seed))
        .collect();
    for name in ["tiny-gqa", "tiny-gqa-fp16"] {
        let pack = packs::pack(name);
        let refs: Vec<String> = codes
            .iter()
            .map(|c| {
                let out = dir.path().join("ref.jsonl");
                reference(&pack, c, &out, &["--persona", "10,20,31999"])
            })
            .collect();
        // The priming as prefills in the engine, and restored from the process's cache by the
        // conversations that start after one has primed.
        for (mode, priming) in [("run", "stepped"), ("skip", "stepped"), ("skip", "cached")] {
            let out = dir.path().join(format!("batch-{name}-{mode}-{priming}"));
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_duplex"));
            cmd.args(["replay", "--greedy", "--user-substeps", mode])
                .args(["--priming", priming])
                .args(["--persona-tokens", "10,20,31999", "--pack"])
                .arg(&pack)
                .arg("--out")
                .arg(&out);
            for c in &codes {
                cmd.arg("--codes").arg(c);
            }
            let o = cmd.output().unwrap();
            let log = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{log}");
            // They were stepped together: three rows in a tick.
            let max_batch: u64 = log
                .split("max_batch=")
                .nth(1)
                .and_then(|t| t.split_whitespace().next()?.parse().ok())
                .unwrap_or_else(|| panic!("no engine summary: {log}"));
            assert_eq!(max_batch, 3, "{log}");
            for (c, r) in codes.iter().zip(&refs) {
                let stem = c.file_stem().unwrap().to_str().unwrap();
                let ours = std::fs::read_to_string(out.join(format!("{stem}.jsonl"))).unwrap();
                let (a, b): (Vec<&str>, Vec<&str>) = (ours.lines().collect(), r.lines().collect());
                assert_eq!(
                    a.len(),
                    b.len(),
                    "{name} {mode} {priming} {stem}: frame counts"
                );
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(
                        x, y,
                        "{name} {mode} {priming} {stem}: first difference at agent frame {i}"
                    );
                }
            }
        }
    }
}
