//! The echo canceller's cost and the latency it adds.
//!
//! 1. CPU per 10 ms block at 24 kHz (`audio::echo::Canceller` on a simulated room: speech-like
//!    reference, 40 ms echo path), as a share of one core; and the latency it adds (how long
//!    a captured sample waits inside the stage for its 10 ms block to fill).
//! 2. ERLE by echo path length, AEC3's own delay search alone and with the coarse search.
//! 3. Mouth-to-ear on a loopback through a private PulseAudio (when `pulseaudio` is installed):
//!    `mic → resample → [aec] → resample → playback`, with and without the stage, side by side.
//!
//! `cargo bench --bench aec`.

#[path = "../tests/it/support/pulse.rs"]
mod pulse;

use std::time::{Duration, Instant};

use duplex::audio::echo::{Canceller, CancellerConfig};

const RATE: usize = 24_000;

/// Noise shaped into 150 ms syllables of pseudo-random loudness.
fn babble(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    let mut lp = 0.0f32;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let white = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            lp = 0.7 * lp + 0.3 * white;
            let syl = (i / 3600) as u64;
            let h = (syl.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 59) as f32;
            lp * h / 31.0 * (std::f32::consts::PI * (i % 3600) as f32 / 3600.0).sin()
        })
        .collect()
}

/// Runs the room through a canceller with capture frames of `frame` samples: (seconds of CPU
/// per 10 ms block, ERLE over the last 5 s, each frame's wait inside the stage in seconds).
fn room(frame: usize) -> (f64, f64, Vec<f64>) {
    room_with(frame, 40, CancellerConfig::new(RATE as u32))
}

/// [`room`] with an echo path of `delay_ms` and the canceller's settings `cfg`.
fn room_with(frame: usize, delay_ms: usize, cfg: CancellerConfig) -> (f64, f64, Vec<f64>) {
    let seconds = 20;
    let n = RATE * seconds;
    let far = babble(n, 3);
    let d = RATE * delay_ms / 1000;
    let mic: Vec<f32> = (0..n)
        .map(|i| if i >= d { 0.5 * far[i - d] } else { 0.0 })
        .collect();
    let t0 = Instant::now() + Duration::from_secs(3600);
    let at = |i: usize| t0 + Duration::from_secs_f64(i as f64 / RATE as f64);
    let mut c = Canceller::new(cfg);
    let mut out = Vec::with_capacity(n);
    let mut pushed = 0;
    let mut spent = Duration::ZERO;
    let mut held = Vec::new();
    for f in 0..n / frame {
        // The reference is rendered 30 ms before it plays.
        while pushed + 240 <= ((f + 1) * frame + 720).min(n) {
            c.push_reference(&far[pushed..pushed + 240]);
            c.set_reference_clock((pushed as u64, at(pushed)));
            pushed += 240;
        }
        let r = f * frame..(f + 1) * frame;
        let start = Instant::now();
        let last = c.process(&mic[r.clone()], at(r.end - 1), &mut out);
        spent += start.elapsed();
        // What waits in the stage: from the newest sample in to the newest sample out (not
        // at the end, where the last blocks wait for a reference that never comes).
        if f + 5 >= n / frame {
            continue;
        }
        held.push(match last {
            Some(l) => at(r.end - 1).duration_since(l).as_secs_f64(),
            None => frame as f64 / RATE as f64,
        });
    }
    let p = |x: &[f32]| x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
    let tail = out.len() - RATE * 5..out.len();
    let erle = 10.0 * (p(&mic[tail.clone()]) / p(&out[tail]).max(1e-20)).log10();
    (spent.as_secs_f64() / (n / 240) as f64, erle, held)
}

fn cpu() {
    let mut best = f64::MAX;
    let mut erle = 0.0;
    for _ in 0..3 {
        let (t, e, _) = room(480);
        best = best.min(t);
        erle = e;
    }
    println!(
        "aec: {:.1} µs per 10 ms block at 24 kHz = {:.2} % of one core; ERLE over the last 5 s \
         {erle:.1} dB",
        best * 1e6,
        best / 0.010 * 100.0,
    );
    for frame in [480, 360, 441] {
        let (_, _, mut held) = room(frame);
        held.sort_by(f64::total_cmp);
        let q = |f: f64| held[((held.len() - 1) as f64 * f) as usize] * 1e3;
        println!(
            "aec: added latency with {:.1} ms input frames: p50 {:.1} ms, max {:.1} ms",
            frame as f64 * 1e3 / RATE as f64,
            q(0.5),
            q(1.0)
        );
    }
}

/// ERLE by echo path length, AEC3 alone (no coarse search) and with it.
fn paths() {
    let mut alone = Vec::new();
    let mut coarse = Vec::new();
    for ms in [100, 300, 500, 560, 800, 1200] {
        let mut cfg = CancellerConfig::new(RATE as u32);
        coarse.push(format!("{ms} ms {:.1}", room_with(480, ms, cfg).1));
        cfg.max_delay = Duration::ZERO;
        alone.push(format!("{ms} ms {:.1}", room_with(480, ms, cfg).1));
    }
    println!(
        "aec: ERLE (dB, last 5 s of 20) by echo path, AEC3 alone: {}",
        alone.join(", ")
    );
    println!(
        "aec: the same with the coarse search: {}",
        coarse.join(", ")
    );
}

fn mouth_to_ear() {
    if std::process::Command::new("pulseaudio")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("mouth-to-ear: skipped (no pulseaudio; `make setup` installs it)");
        return;
    }
    let pa = pulse::Pulse::start();
    let mut p50 = Vec::new();
    for with in [false, true] {
        let (chain, links) = if with {
            (
                "  aec: { kind: aec, reference: speaker }\n",
                "  - down -> aec\n  - aec -> up\n",
            )
        } else {
            ("", "  - down -> up\n")
        };
        let yaml = format!(
            "stages:
  mic: {{ kind: mic, device: default, duration: 8 }}
  down: {{ kind: resample, to: 24000 }}
{chain}  up: {{ kind: resample, to: 48000 }}
  speaker: {{ kind: playback, device: default }}
links:
  - mic -> down
{links}  - up -> speaker
"
        );
        let file = pa.dir().join("loop.yaml");
        std::fs::write(&file, yaml).unwrap();
        let o = pa
            .duplex()
            .args(["run", file.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{log}");
        let s = pulse::playback_summary(&log);
        p50.push((s["mouth_to_ear_p50_ms"], s["mouth_to_ear_p90_ms"]));
    }
    println!(
        "mouth-to-ear on a PulseAudio loopback: without aec p50 {:.1} ms (p90 {:.1}), with aec p50 \
         {:.1} ms (p90 {:.1}): {:+.1} ms",
        p50[0].0,
        p50[0].1,
        p50[1].0,
        p50[1].1,
        p50[1].0 - p50[0].0
    );
}

fn main() {
    cpu();
    paths();
    mouth_to_ear();
}
