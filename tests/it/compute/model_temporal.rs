//! The temporal transformer on the real exported graphs: the resident KV cache (in place for
//! GQA, ping-pong with an exact window for the standard graph) computes exactly what the naive
//! host round trip computes; token ids are checked; positions run out loudly.

use crate::support::packs;

use duplex::model::pack::{Pack, Variant};
use duplex::model::temporal::{KvMode, TemporalOptions};
use duplex::model::ModelError;

fn tokens(t: usize) -> Vec<i64> {
    let mut v = vec![((t * 7919) % 32_001) as i64];
    v.extend((1..17).map(|k| ((t * 31 + k * 97) % 2049) as i64));
    v
}

fn run(pack: &Pack, kv: KvMode, steps: usize) -> (Vec<Vec<f32>>, Vec<usize>) {
    let mut t = duplex::model::temporal::open(
        pack,
        &TemporalOptions {
            kv,
            ..Default::default()
        },
    )
    .unwrap();
    let mut all = Vec::new();
    let mut lens = Vec::new();
    let mut logits = Vec::new();
    for s in 0..steps {
        t.step(&tokens(s)).unwrap();
        t.read_logits(&mut logits);
        all.push(logits.clone());
        lens.push(t.kv_len());
    }
    (all, lens)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

#[test]
fn resident_cache_equals_the_host_round_trip_for_every_variant() {
    for (name, variant, tol) in [
        ("tiny", Variant::Standard, 1e-5),
        ("tiny-gqa", Variant::Gqa, 1e-5),
        ("tiny-gqa-fp16", Variant::Gqa, 1e-2),
    ] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        let (res, lens) = run(&pack, KvMode::Resident, 40);
        let (host, _) = run(&pack, KvMode::Host, 40);
        let t = duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
        assert_eq!(t.info().variant, variant, "{name}");
        assert_eq!(lens.last(), Some(&40));
        let d = max_diff(&res, &host);
        assert!(d <= tol, "{name}: logits differ by {d}");
        // Not a degenerate model: logits vary across steps.
        assert!(max_diff(&res[..1], &res[1..2]) > 1e-3, "{name}");
    }
}

#[test]
fn standard_graph_keeps_an_exact_window() {
    // The same graphs with an 8-frame context: the cache never holds more than 7 rows, both
    // ways of keeping it agree, and the window changes the result (it is really applied).
    let (_d, dir) = packs::variant("tiny", "context: 8\n");
    let small = Pack::open(&dir).unwrap();
    assert_eq!(small.manifest.context, 8);
    let (res, lens) = run(&small, KvMode::Resident, 30);
    let (host, host_lens) = run(&small, KvMode::Host, 30);
    assert_eq!(lens, host_lens);
    assert_eq!(*lens.iter().max().unwrap(), 7);
    let d = max_diff(&res, &host);
    assert!(d <= 1e-5, "windowed logits differ by {d}");
    let full = Pack::open(&packs::pack("tiny")).unwrap();
    let (unwindowed, _) = run(&full, KvMode::Resident, 30);
    assert!(
        max_diff(&res[..7], &unwindowed[..7]) <= 1e-5,
        "same before the window fills"
    );
    assert!(
        max_diff(&res[8..], &unwindowed[8..]) > 1e-4,
        "different once it slides"
    );
}

#[test]
fn token_ids_are_checked_naming_the_channel() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let mut t = duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
    let mut bad = tokens(0);
    bad[5] = 2049;
    let e = t.step(&bad).unwrap_err();
    assert!(matches!(e, ModelError::Token { .. }));
    assert_eq!(
        e.to_string(),
        "temporal: token 2049 on channel 5 (agent audio) is out of range 0..2049"
    );
    let mut bad = tokens(0);
    bad[0] = -1;
    assert!(t
        .step(&bad)
        .unwrap_err()
        .to_string()
        .contains("channel 0 (text)"));
    let mut bad = tokens(0);
    bad[12] = -2;
    assert!(t
        .step(&bad)
        .unwrap_err()
        .to_string()
        .contains("channel 12 (user audio)"));
    // Nothing was run: the state is untouched.
    assert_eq!(t.position(), 0);
}

#[test]
fn positions_run_out_loudly() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let mut t = duplex::model::temporal::open(
        &pack,
        &TemporalOptions {
            max_positions: 5,
            ..Default::default()
        },
    )
    .unwrap();
    for s in 0..5 {
        assert_eq!(t.positions_left(), 5 - s);
        t.step(&tokens(s)).unwrap();
    }
    let e = t.step(&tokens(5)).unwrap_err().to_string();
    assert!(e.contains("no position left"), "{e}");
    t.reset();
    assert_eq!(t.positions_left(), 5);
    t.step(&tokens(0)).unwrap();
}

#[test]
fn gqa_appends_in_place_without_allocating() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let mut t = duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
    // Warm up: ONNX Runtime and this module may allocate on the first runs.
    t.step(&tokens(0)).unwrap();
    let before = duplex::model::buffer_allocations();
    for s in 1..30 {
        assert_eq!(
            t.key_cache_value(0, s),
            Some(0.0),
            "row {s} not written yet"
        );
        t.step(&tokens(s)).unwrap();
        // The op wrote the new key row into the very buffer bound as past and present.
        assert_ne!(
            t.key_cache_value(0, s),
            Some(0.0),
            "row {s} written in place"
        );
    }
    assert_eq!(
        duplex::model::buffer_allocations(),
        before,
        "no cache buffer allocated per step"
    );
}

/// What CUDA graph replay needs, on the CPU: every input and output bound once at a fixed
/// shape and address (the mask at full width, right-padded; the frame, the mask and the
/// outputs copied to and from the session's own buffers) computes what the growing binding
/// computes, through a reset too, and positions still run out at the limit.
#[test]
fn fixed_shape_stepping_equals_the_growing_binding() {
    for (name, tol) in [("tiny-gqa", 0.0), ("tiny-gqa-fp16", 1e-2)] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        let run_fixed = |fixed: bool| {
            let mut t = duplex::model::temporal::open(
                &pack,
                &TemporalOptions {
                    fixed_shapes: fixed,
                    max_positions: 64,
                    ..Default::default()
                },
            )
            .unwrap();
            let (mut all, mut logits, mut hidden) = (Vec::new(), Vec::new(), Vec::new());
            for s in 0..100 {
                if s == 30 {
                    t.reset();
                }
                if t.positions_left() == 0 {
                    let e = t.step(&tokens(s)).unwrap_err().to_string();
                    assert!(e.contains("no position left"), "{e}");
                    break;
                }
                t.step(&tokens(s)).unwrap();
                t.read_logits(&mut logits);
                t.read_hidden(&mut hidden);
                let mut row = logits.clone();
                row.extend(&hidden);
                all.push(row);
            }
            (all, t.kv_len())
        };
        let (fixed, len) = run_fixed(true);
        let (growing, glen) = run_fixed(false);
        assert_eq!((fixed.len(), len), (growing.len(), glen), "{name}");
        assert_eq!(len, 64, "{name}: ran to the limit after the reset");
        let d = max_diff(&fixed, &growing);
        eprintln!("{name}: fixed-shape against growing binding, max difference {d:e}");
        assert!(d <= tol, "{name}: differ by {d}");
    }
}

/// `cuda_graph: true` is refused where a CUDA graph cannot apply, saying what it needs.
#[test]
fn cuda_graph_is_refused_where_it_cannot_apply() {
    let err = |pack: &str, opts: TemporalOptions| {
        let pack = Pack::open(&packs::pack(pack)).unwrap();
        match duplex::model::temporal::open(&pack, &opts) {
            Ok(_) => panic!("{pack:?}: opened"),
            Err(e) => e.to_string(),
        }
    };
    let on_cpu = err(
        "tiny-gqa",
        TemporalOptions {
            cuda_graph: true,
            ..Default::default()
        },
    );
    assert!(
        on_cpu.contains("needs `execution_provider: cuda`"),
        "{on_cpu}"
    );
    let host = err(
        "tiny-gqa",
        TemporalOptions {
            fixed_shapes: true,
            kv: KvMode::Host,
            ..Default::default()
        },
    );
    assert!(host.contains("needs `kv: resident`"), "{host}");
    let standard = err(
        "tiny",
        TemporalOptions {
            fixed_shapes: true,
            ..Default::default()
        },
    );
    assert!(
        standard.contains("needs the GroupQueryAttention export"),
        "{standard}"
    );
}

/// Prefill: frames known in advance (priming) run in chunks, one graph call each, and leave
/// the conversation where stepping them one by one does: the last frame's logits, every later
/// step's, the cache length and the position agree within float rounding, for the standard
/// graph (ping-pong cache, chunks kept inside the attention window), GQA f32 and GQA f16 (in
/// place), from an empty cache and after steps already taken.
#[test]
fn prefill_in_chunks_equals_stepping_frame_by_frame() {
    for (name, tol) in [("tiny", 1e-4), ("tiny-gqa", 1e-4), ("tiny-gqa-fp16", 2e-2)] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        let open = || duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
        let frames: Vec<Vec<i64>> = (0..60).map(tokens).collect();
        // Stepping: 3 steps, 45 frames, 12 steps after.
        let mut stepped = open();
        let mut want = Vec::new();
        let mut logits = Vec::new();
        for f in &frames {
            stepped.step(f).unwrap();
            stepped.read_logits(&mut logits);
            want.push(logits.clone());
        }
        // The same with the 45 frames in the middle prefilled in chunks of 16 (16, 16, 13).
        let mut chunked = open();
        let mut got = Vec::new();
        for f in &frames[..3] {
            chunked.step(f).unwrap();
            chunked.read_logits(&mut logits);
            got.push(logits.clone());
        }
        chunked.prefill(&frames[3..48], 16).unwrap();
        assert_eq!(chunked.kv_len(), 48, "{name}");
        assert_eq!(chunked.position(), 48, "{name}");
        chunked.read_logits(&mut logits);
        let last = max_diff(&[logits.clone()], &want[47..48]);
        assert!(
            last <= tol,
            "{name}: the prefill's last logits differ by {last}"
        );
        for f in &frames[48..] {
            chunked.step(f).unwrap();
            chunked.read_logits(&mut logits);
            got.push(logits.clone());
        }
        let mut steps_want = want[..3].to_vec();
        steps_want.extend_from_slice(&want[48..]);
        let d = max_diff(&got, &steps_want);
        assert!(
            d <= tol,
            "{name}: the steps after the prefill differ by {d}"
        );
        println!("{name}: prefill last-frame logits differ by {last:.3e}, later steps by {d:.3e}");
        // A prefill from an empty cache, in one chunk.
        let mut one = open();
        one.prefill(&frames[..20], 32).unwrap();
        one.read_logits(&mut logits);
        let d = max_diff(&[logits.clone()], &want[19..20]);
        assert!(d <= tol, "{name}: a prefill from empty differs by {d}");
        // A bad frame is refused before anything runs.
        let mut bad = frames[..4].to_vec();
        bad[2][0] = 99_999;
        let mut t = open();
        assert!(matches!(t.prefill(&bad, 16), Err(ModelError::Token { .. })));
        assert_eq!(t.position(), 0, "{name}: nothing ran");
    }
}

/// The standard graph's window: a prefill that crosses it keeps stepping past it, so that it
/// still equals stepping (a chunk would attend to rows the window drops).
#[test]
fn prefill_across_the_standard_window_equals_stepping() {
    let (_d, dir) = packs::variant("tiny", "context: 8\n");
    let small = Pack::open(&dir).unwrap();
    let open = || duplex::model::temporal::open(&small, &TemporalOptions::default()).unwrap();
    let frames: Vec<Vec<i64>> = (0..20).map(tokens).collect();
    let mut a = open();
    let mut logits = Vec::new();
    for f in &frames {
        a.step(f).unwrap();
    }
    a.read_logits(&mut logits);
    let want = logits.clone();
    let mut b = open();
    b.prefill(&frames, 16).unwrap();
    b.read_logits(&mut logits);
    assert_eq!(a.kv_len(), b.kv_len());
    assert_eq!(b.kv_len(), 7);
    let d = max_diff(&[logits], &[want]);
    assert!(d <= 1e-4, "logits differ by {d}");
}

/// A snapshot restored into another transformer of the same graph puts it exactly where the
/// first one was: every later step's logits are bit for bit the same (standard ping-pong and
/// GQA in place, f32 and f16); a state of another graph is refused.
#[test]
fn a_restored_state_steps_exactly_as_the_original() {
    for name in ["tiny", "tiny-gqa", "tiny-gqa-fp16"] {
        let pack = Pack::open(&packs::pack(name)).unwrap();
        let open = || duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
        let frames: Vec<Vec<i64>> = (0..40).map(tokens).collect();
        for (steps, chunk) in [(23, 32), (10, 1)] {
            let mut a = open();
            a.prefill(&frames[..steps], chunk).unwrap();
            let state = std::sync::Arc::new(a.snapshot().expect("a resident cache gives a state"));
            assert_eq!(state.position(), steps);
            let mut b = open();
            // A transformer that has stepped before: the restore replaces its conversation.
            b.step(&frames[39]).unwrap();
            b.restore(&state).unwrap();
            assert_eq!((b.kv_len(), b.position()), (a.kv_len(), a.position()));
            let (mut la, mut lb) = (Vec::new(), Vec::new());
            for f in &frames[steps..steps + 8] {
                a.step(f).unwrap();
                b.step(f).unwrap();
                a.read_logits(&mut la);
                b.read_logits(&mut lb);
                assert_eq!(la, lb, "{name}: restored after {steps} frames");
            }
        }
    }
    let mut gqa = duplex::model::temporal::open(
        &Pack::open(&packs::pack("tiny-gqa")).unwrap(),
        &TemporalOptions::default(),
    )
    .unwrap();
    let mut std = duplex::model::temporal::open(
        &Pack::open(&packs::pack("tiny")).unwrap(),
        &TemporalOptions::default(),
    )
    .unwrap();
    std.step(&tokens(0)).unwrap();
    let s = std::sync::Arc::new(std.snapshot().unwrap());
    let e = gqa.restore(&s).unwrap_err().to_string();
    assert!(e.contains("another graph"), "{e}");
}
