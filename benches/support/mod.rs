//! What several benchmarks share: the checkout, packs built on first use, a voice prompt, a
//! client's tone. Not a benchmark itself.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use duplex::audio::opus::OggOpusWriter;

/// The checkout.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The pack `models/NAME`, built by `tools/make_pack.py ARGS` when it is not there.
pub fn pack(name: &str, args: &[&str]) -> PathBuf {
    let dir = root().join("models").join(name);
    if !dir.join("pack.yaml").is_file() {
        eprintln!("building pack {name} ({})", args.join(" "));
        let ok = Command::new(root().join(".venv/bin/python"))
            .arg(root().join("tools/make_pack.py"))
            .args(args)
            .arg("--out")
            .arg(&dir)
            .status()
            .expect("run tools/make_pack.py (make setup first)")
            .success();
        assert!(ok, "building pack {name} failed");
    }
    dir
}

/// `dir`, with the codec's step graphs added when it has none or has them from before the
/// `active` input.
pub fn with_step_graphs(dir: PathBuf) -> PathBuf {
    let current = ["mimi_encoder_step", "mimi_decoder_step_f16"]
        .iter()
        .all(|g| {
            std::fs::read_to_string(dir.join(g).join("state.json"))
                .is_ok_and(|s| s.contains("\"active\""))
        });
    if !current {
        eprintln!("adding step graphs to {}", dir.display());
        let ok = Command::new(root().join(".venv/bin/python"))
            .arg(root().join("tools/make_mimi_step.py"))
            .arg(&dir)
            .arg("-q")
            .status()
            .expect("run tools/make_mimi_step.py (make setup first)")
            .success();
        assert!(ok, "building step graphs for {} failed", dir.display());
    }
    dir
}

/// `models/NAME`: pack `src` quantized by `tools/quantize_pack.py ARGS`, when it is not there.
pub fn quantized(src: &Path, name: &str, args: &[&str]) -> PathBuf {
    let dir = root().join("models").join(name);
    if !dir.join("pack.yaml").is_file() {
        eprintln!(
            "quantizing {} into {name} ({})",
            src.display(),
            args.join(" ")
        );
        let ok = Command::new(root().join(".venv/bin/python"))
            .arg(root().join("tools/quantize_pack.py"))
            .arg(src)
            .arg(&dir)
            .args(args)
            .arg("-q")
            .status()
            .expect("run tools/quantize_pack.py (make setup first)")
            .success();
        assert!(ok, "quantizing {} failed", src.display());
    }
    dir
}

/// Writes a 10 s voice prompt at 24 kHz to `path` (a gliding tone with a little noise).
pub fn voice_wav(path: &Path) {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    let mut seed = 1u32;
    let mut phase = 0.0f64;
    for i in 0..240_000 {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let noise = (seed >> 16) as f64 / 65_536.0 - 0.5;
        phase += std::f64::consts::TAU * (150.0 + 100.0 * (i as f64 / 24_000.0).sin()) / 24_000.0;
        let v = 0.3 * phase.sin() + 0.02 * noise;
        w.write_sample((v * 32_767.0) as i16).unwrap();
    }
    w.finalize().unwrap();
}

/// Frame `k` of a client's tone as the Moshi protocol's audio message (kind 1, Ogg/Opus).
pub fn tone_message(w: &mut OggOpusWriter, k: usize) -> Vec<u8> {
    let pcm: Vec<f32> = (0..1920)
        .map(|i| 0.3 * (((k * 1920 + i) as f32) * 0.06).sin())
        .collect();
    let bytes: Vec<u8> = w.push(&pcm).unwrap().concat();
    let mut m = vec![1u8];
    m.extend_from_slice(&bytes);
    m
}

/// A `duplex serve` child process, killed when dropped.
pub struct Server {
    pub child: std::process::Child,
    pub port: u16,
    /// Its standard error.
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `duplex serve --config CFG` (its `address` port 0) with `RUST_LOG=rust_log`, its
/// standard error in `dir/server.log`, and waits until it listens; `dir` lives as long as it.
pub fn serve(dir: tempfile::TempDir, cfg: &Path, rust_log: &str) -> Server {
    use std::io::{BufRead, BufReader};
    let log = dir.path().join("server.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["serve", "--config"])
        .arg(cfg)
        .current_dir(root())
        .env("RUST_LOG", rust_log)
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut port = 0;
    for line in BufReader::new(out).lines().map_while(Result::ok) {
        if let Some(a) = line.strip_prefix("listening on ") {
            port = a.rsplit(':').next().unwrap().parse().unwrap();
            break;
        }
    }
    assert!(
        port > 0,
        "the server did not start: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    Server {
        child,
        port,
        log,
        _dir: dir,
    }
}
