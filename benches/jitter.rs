//! The playback callback's cost: `JitterBuffer::render` for one 10 ms callback (480 samples at
//! 48 kHz), steady and through underruns, next to a plain copy of the same samples.
//!
//! `cargo bench --bench jitter`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use duplex::audio::jitter::{jitter, JitterConfig};

fn main() {
    let cfg = JitterConfig::new(48_000);
    let (mut w, mut b) = jitter(&cfg);
    let frame = vec![0.1f32; 480];
    let mut out = vec![0.0f32; 480];
    let t0 = Instant::now();
    // Check the result before timing it.
    for _ in 0..20 {
        w.push(&frame, t0);
    }
    b.render(&mut out, t0);
    assert!(out.iter().any(|&v| v > 0.0));

    let n = 200_000;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..n {
            w.push(&frame, t0);
            b.render(black_box(&mut out), t0);
        }
        best = best.min(start.elapsed().as_secs_f64() / n as f64);
    }
    let mut gaps = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        for i in 0..n {
            if i % 7 != 0 {
                w.push(&frame, t0);
            }
            b.render(black_box(&mut out), t0 + Duration::from_millis(i as u64));
        }
        gaps = gaps.min(start.elapsed().as_secs_f64() / n as f64);
    }
    let mut copy = f64::MAX;
    let src = vec![0.1f32; 480];
    for _ in 0..5 {
        let start = Instant::now();
        for _ in 0..n {
            out.copy_from_slice(black_box(&src));
            black_box(&mut out);
        }
        copy = copy.min(start.elapsed().as_secs_f64() / n as f64);
    }
    println!("jitter buffer, one 10 ms callback (480 samples at 48 kHz), push + render:");
    println!("  steady:            {:7.0} ns", best * 1e9);
    println!(
        "  with underruns:    {:7.0} ns (every 7th frame missing)",
        gaps * 1e9
    );
    println!(
        "  plain 480-sample copy: {:5.0} ns; budget of the callback: 10 000 000 ns",
        copy * 1e9
    );
}
