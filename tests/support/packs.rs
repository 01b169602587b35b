//! Paths of the tiny packs built by `make setup`, and pack variants made from them.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Every graph folder of the tiny packs: the four graphs and Mimi's step graphs.
pub const ALL_GRAPHS: [&str; 8] = [
    "mimi_encoder",
    "mimi_decoder",
    "temporal",
    "depformer",
    "mimi_encoder_step",
    "mimi_decoder_step",
    "mimi_encoder_step_f16",
    "mimi_decoder_step_f16",
];

/// The codec's graph folders (whole-utterance and step graphs).
pub const CODEC_GRAPHS: [&str; 6] = [
    "mimi_encoder",
    "mimi_decoder",
    "mimi_encoder_step",
    "mimi_decoder_step",
    "mimi_encoder_step_f16",
    "mimi_decoder_step_f16",
];

pub fn pack(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name);
    assert!(
        p.join("pack.yaml").is_file(),
        "{} is missing: run `make setup` (it builds the tiny packs)",
        p.display()
    );
    p
}

/// A copy of pack `name` whose graph directories are symlinks to the original and whose
/// pack.yaml gets `extra` appended (later keys win).
pub fn variant(name: &str, extra: &str) -> (tempfile::TempDir, PathBuf) {
    let src = pack(name);
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join(name);
    std::fs::create_dir(&dst).unwrap();
    for g in ALL_GRAPHS {
        std::os::unix::fs::symlink(src.join(g), dst.join(g)).unwrap();
    }
    let mut yaml = std::fs::read_to_string(src.join("pack.yaml")).unwrap();
    // Drop keys that `extra` sets again, with their indented lines.
    for line in extra.lines() {
        if let Some((k, _)) = line.split_once(':') {
            if !line.starts_with(' ') {
                let mut dropping = false;
                yaml = yaml
                    .lines()
                    .filter(|l| {
                        if l.starts_with(&format!("{k}:")) {
                            dropping = true;
                            return false;
                        }
                        if dropping && l.starts_with(' ') {
                            return false;
                        }
                        dropping = false;
                        true
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                yaml.push('\n');
            }
        }
    }
    yaml.push_str(extra);
    std::fs::write(dst.join("pack.yaml"), yaml).unwrap();
    (dir, dst)
}

/// A copy of pack `name` without Mimi's step graphs (`mimi_streaming: [window]`).
pub fn without_step_graphs(name: &str) -> (tempfile::TempDir, PathBuf) {
    let (dir, dst) = variant(name, "mimi_streaming: [window]\n");
    for g in &CODEC_GRAPHS[2..] {
        std::fs::remove_file(dst.join(g)).unwrap();
    }
    (dir, dst)
}
