//! The resampler's, the jitter buffer's and the speaker reference tap's hot paths allocate
//! nothing per frame once built (the output vector is the caller's, reserved up front). Checked with a counting global allocator that
//! counts only on the thread under test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use duplex::audio::{StreamResampler, Synth, Waveform};

struct Counting;

thread_local! {
    static COUNT: Cell<Option<u64>> = const { Cell::new(None) };
}

// SAFETY: forwards to the system allocator; the bookkeeping touches only a thread-local cell.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNT.try_with(|c| {
            if let Some(n) = c.get() {
                c.set(Some(n + 1));
            }
        });
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn count_allocs(f: impl FnOnce()) -> u64 {
    COUNT.with(|c| c.set(Some(0)));
    f();
    COUNT.with(|c| c.replace(None)).unwrap_or(0)
}

#[test]
fn resampler_process_allocates_nothing_per_frame() {
    for (from, to) in [(48_000, 24_000), (24_000, 48_000), (44_100, 24_000)] {
        let mut r = StreamResampler::new(from, to, from as usize / 50).unwrap();
        let mut synth = Synth::new(
            Waveform::Sine {
                freq: 440.0,
                amplitude: 0.5,
            },
            from,
        );
        let mut input = vec![0.0f32; 1000];
        let mut out = Vec::with_capacity(r.max_output(input.len()) * 2);
        // Warm up (first calls may size internal scratch space).
        for _ in 0..3 {
            synth.fill(&mut input);
            r.process(&input, &mut out).unwrap();
            out.clear();
        }
        let n = count_allocs(|| {
            for _ in 0..200 {
                synth.fill(&mut input);
                r.process(&input, &mut out).unwrap();
                assert!(!out.is_empty() || from > to);
                out.clear();
            }
        });
        assert_eq!(n, 0, "{from} -> {to}: {n} allocations in 200 calls");
    }
}

#[test]
fn the_counter_sees_allocations() {
    // Guard against a counter that cannot fail.
    let n = count_allocs(|| {
        let v: Vec<u8> = Vec::with_capacity(std::hint::black_box(64));
        std::hint::black_box(v);
    });
    assert_eq!(n, 1);
}

#[test]
fn jitter_render_allocates_nothing_in_any_state() {
    use duplex::audio::jitter::{jitter, JitterConfig};
    use std::time::{Duration, Instant};
    let mut cfg = JitterConfig::new(48_000);
    cfg.stable = Duration::from_millis(300);
    let (mut w, mut b) = jitter(&cfg);
    let mut out = vec![0.0f32; 480];
    let frame = vec![0.1f32; 960];
    let t0 = Instant::now();
    // Warm up once through every path.
    w.push(&frame, t0);
    b.render(&mut out, t0);
    let n = count_allocs(|| {
        let mut now = t0;
        for i in 0..2000 {
            // Mostly fed, with gaps (underruns, rebuffering, fades), bursts (overflow drops) and
            // long stable stretches (target shrinking).
            if i % 97 < 60 {
                w.push(&frame, now);
            }
            if i % 500 == 0 {
                for _ in 0..40 {
                    w.push(&frame, now);
                }
            }
            b.render(&mut out, now);
            b.render(&mut out, now);
            now += Duration::from_millis(20);
        }
    });
    let s = b.stats().snapshot();
    assert!(
        s.underruns > 0 && s.dropped > 0 && s.played > 0,
        "every path was taken: {s:?}"
    );
    assert_eq!(n, 0, "{n} allocations in 4000 renders");
}

#[test]
fn the_speaker_reference_tap_allocates_nothing_in_the_callback() {
    use duplex::audio::reference::ReferenceTap;
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let tap = Arc::new(ReferenceTap::default());
    let mut reader = tap.reader(24_000);
    let mut w = tap.writer(48_000);
    let frame = vec![0.1f32; 480];
    let t0 = Instant::now();
    w.push(&frame, t0);
    let n = count_allocs(|| {
        // Far more than the ring holds: the full ring's drops are taken too.
        for i in 0..2000u64 {
            w.push(&frame, t0 + Duration::from_millis(10 * i));
        }
    });
    assert!(
        tap.dropped.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the full-ring path was taken"
    );
    let mut got = 0;
    reader.read(|s| got += s.len()).unwrap();
    assert!(got > 0);
    assert_eq!(n, 0, "{n} allocations in 2000 pushes");
}
