//! What starting one more conversation costs in `duplex serve`'s process, built once per
//! process against built per session, side by side in one run.
//!
//! The server's session template (`pipelines/serve.yaml`, LM on the shared engine) on the pack
//! with the full-size codec (`models/tiny-gqa-mimi-full`), a 10 s voice prompt and a persona:
//! the configuration of a real deployment, on tiny weights. Each mode runs in a child process
//! of its own (so that one mode's freed memory cannot flatter the other's), builds `SESSIONS`
//! session pipelines one after the other and holds them, and reports per session
//!
//! - the build time: template spec → pipeline built (models open, voice prompt encoded),
//!   priming excluded (it runs when a pipeline starts);
//! - the resident memory each session added.
//!
//! Modes: `shared`, the process's one [`Resources`] for every session (what the server does);
//! `per-session`, a fresh `Resources` for each session: every session opens its pack, reads its
//! tokenizer, encodes its voice prompt and opens its engine itself, as sessions were built
//! before `Resources` existed.
//!
//! Run with `cargo bench --bench session_start`.

#[path = "support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use duplex::config::{LoadOptions, Override};
use duplex::resources::Resources;
use duplex::stages::Registry;

const SESSIONS: usize = 4;
const PACK: &str = "models/tiny-gqa-mimi-full";

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .unwrap_or(0.0)
        / 1024.0
}

/// A 10 s voice prompt at 24 kHz.
fn voice(dir: &Path) -> PathBuf {
    let path = dir.join("voice.wav");
    support::voice_wav(&path);
    path
}

/// One mode, in this (child) process: prints `build_ms rss_mib` per session, one line each.
fn child(mode: &str, voice: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pack = root.join(PACK);
    let mut sets = Vec::new();
    for stage in ["encode", "temporal", "depformer", "decode"] {
        sets.push(Override::set(
            format!("stages.{stage}.pack"),
            pack.display().to_string(),
        ));
    }
    sets.push(Override::set(
        "stages.temporal.tokenizer",
        root.join("models/tokenizer-tiny.model")
            .display()
            .to_string(),
    ));
    sets.push(Override::set(
        "stages.temporal.voice",
        voice.display().to_string(),
    ));
    sets.push(Override::set(
        "stages.temporal.persona",
        "You are a patient assistant who answers briefly.",
    ));
    let registry = Registry::builtin();
    let spec = duplex::config::load(
        &root.join("pipelines/serve.yaml"),
        &LoadOptions { sets, env: None },
        &registry,
    )
    .expect("the session template loads");
    let shared = std::sync::Arc::new(Resources::new(SESSIONS));
    let mut held = Vec::new();
    let mut rss = rss_mib();
    for _ in 0..SESSIONS {
        let resources = if mode == "shared" {
            shared.clone()
        } else {
            std::sync::Arc::new(Resources::new(1))
        };
        let (client, end) = duplex::session::link(8, 8);
        let t0 = Instant::now();
        let pipeline = duplex::app::build_session(&spec, &registry, Some(&end), None, &resources)
            .expect("the session builds")
            .build()
            .expect("the session's graph holds");
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        let now = rss_mib();
        println!("{ms:.1} {:.1}", now - rss);
        rss = now;
        held.push((pipeline, client, end, resources));
    }
}

fn run_mode(mode: &str, voice: &Path) -> Vec<(f64, f64)> {
    let out = Command::new(std::env::current_exe().unwrap())
        .env("SESSION_START_MODE", mode)
        .env("SESSION_START_VOICE", voice)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{mode}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace().map(|v| v.parse::<f64>().ok());
            Some((it.next()??, it.next()??))
        })
        .collect()
}

fn main() {
    if let (Ok(mode), Ok(voice)) = (
        std::env::var("SESSION_START_MODE"),
        std::env::var("SESSION_START_VOICE"),
    ) {
        child(&mode, Path::new(&voice));
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    assert!(
        root.join(PACK).join("pack.yaml").is_file(),
        "{PACK} is missing: run `make setup`"
    );
    let dir = tempfile::tempdir().unwrap();
    let voice = voice(dir.path());
    println!(
        "session start on {PACK}, 10 s voice prompt, persona; {SESSIONS} sessions built and held per mode"
    );
    println!(
        "{:<12} {:>14} {:>16} {:>16} {:>18}",
        "mode", "first ms", "later ms (mean)", "first MiB", "later MiB (mean)"
    );
    let mut later = Vec::new();
    for mode in ["per-session", "shared"] {
        let rows = run_mode(mode, &voice);
        assert_eq!(rows.len(), SESSIONS, "{mode}: {rows:?}");
        let n = (rows.len() - 1) as f64;
        let ms = rows[1..].iter().map(|r| r.0).sum::<f64>() / n;
        let mib = rows[1..].iter().map(|r| r.1).sum::<f64>() / n;
        println!(
            "{mode:<12} {:>14.1} {:>16.1} {:>16.1} {:>18.1}",
            rows[0].0, ms, rows[0].1, mib
        );
        later.push((ms, mib));
    }
    let (before, after) = (later[0], later[1]);
    println!(
        "a later session builds {:.1}x faster and adds {:.2}x the memory when the process builds once",
        before.0 / after.0.max(1e-9),
        after.1 / before.1.max(1e-9)
    );
}
