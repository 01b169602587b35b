//! The shared LM engine: conversations stepped together in one batched call per tick give, each,
//! the tokens it gives alone (greedy and seeded sampling), whatever else is in the batch: joining
//! and leaving at different frames, a slot reused, a reset and a priming while the others talk.
//! Plus slots that run out, and packs that cannot share an engine.

use crate::support::packs;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use duplex::model::depformer::{Depformer, UnusedSubsteps};
use duplex::model::engine::{self, EngineOptions, SharedLm};
use duplex::model::lm::{priming_script, LmLoop, SamplingConfig, SamplingHalf, TemporalHalf};
use duplex::model::lmgen::{AgentFrame, LmGen};
use duplex::model::pack::{Pack, PackManifest};
use duplex::model::sampling::SamplingParams;
use duplex::model::session::SessionOptions;
use duplex::model::temporal::{TemporalOptions, TemporalStep};

/// What a conversation does, in order.
#[derive(Clone)]
enum Op {
    /// Wait (before joining) until conversation `who` has done `steps` steps, or has left.
    After {
        who: usize,
        steps: usize,
    },
    Warmup,
    Prime(Vec<i64>),
    Step(Vec<i64>),
    Reset,
}

fn codes(n: usize, seed: u64) -> Vec<Vec<i64>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            (0..8)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 2048) as i64
                })
                .collect()
        })
        .collect()
}

fn sampling(seed: u64, greedy: bool) -> SamplingConfig {
    if greedy {
        SamplingConfig::greedy(seed)
    } else {
        // Kyutai's text controls on for some conversations, and their own audio seed: the
        // sampling half is the same code on both paths, and the draws stay per conversation.
        let on = seed % 2 == 1;
        SamplingConfig {
            seed,
            audio_seed: on.then_some(seed * 31),
            pad_mult: if on { 1.5 } else { 0.0 },
            repetition_penalty: if on { 1.4 } else { 1.0 },
            repetition_penalty_context: 16,
            ..Default::default()
        }
    }
}

/// Runs `ops` on `lm`; returns every step's output. `progress` counts the steps done.
fn converse(
    lm: &mut LmLoop,
    m: &PackManifest,
    ops: &[Op],
    progress: &[AtomicUsize],
    me: usize,
) -> Vec<Option<AgentFrame>> {
    let mut out = Vec::new();
    for op in ops {
        match op {
            Op::After { who, steps } => {
                while progress[*who].load(Ordering::Acquire) < *steps {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Op::Warmup => lm.warmup(&m.silence_codes, 2).unwrap(),
            Op::Prime(persona) => lm.prime(&priming_script(m, None, persona, 3)).unwrap(),
            Op::Step(u) => {
                out.push(lm.step(u, None, None).unwrap());
                let _ = progress[me].fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                    Some(v.saturating_add(1))
                });
            }
            Op::Reset => lm.temporal.reset(true),
        }
    }
    out
}

fn own(pack: &Pack, cfg: SamplingConfig, unused: UnusedSubsteps) -> LmLoop {
    let so = SessionOptions::default();
    let mut d = Depformer::open(pack, &so).unwrap();
    d.unused = unused;
    LmLoop {
        temporal: TemporalHalf::new(
            LmGen::new(pack.manifest.layout()),
            duplex::model::temporal::open(pack, &TemporalOptions::default()).unwrap(),
        ),
        sampling: SamplingHalf::new(d, cfg),
    }
}

fn shared(lm: &Arc<SharedLm>, pack: &Pack, cfg: SamplingConfig, unused: UnusedSubsteps) -> LmLoop {
    let mut d = lm.depformer_client();
    d.unused = unused;
    LmLoop {
        temporal: TemporalHalf::new(
            LmGen::new(pack.manifest.layout()),
            lm.temporal_slot(usize::MAX).unwrap(),
        ),
        sampling: SamplingHalf::new(d, cfg),
    }
}

/// Five conversations: A talks throughout; B joins after A's 10th step and leaves early; C is
/// reset and primed again half-way while the others talk; D joins after B has left (and gets
/// its slot); E has no persona and the longest run.
fn scenario() -> Vec<Vec<Op>> {
    let steps = |n: usize, seed: u64| codes(n, seed).into_iter().map(Op::Step);
    let mut a = vec![Op::Warmup, Op::Prime(vec![10, 20, 31999])];
    a.extend(steps(60, 1));
    let mut b = vec![
        Op::After { who: 0, steps: 10 },
        Op::Warmup,
        Op::Prime(vec![7]),
    ];
    b.extend(steps(18, 2));
    let mut c = vec![Op::Warmup, Op::Prime(vec![5, 6])];
    c.extend(steps(25, 3));
    c.extend([Op::Reset, Op::Prime(vec![400, 401, 402])]);
    c.extend(steps(25, 4));
    let mut d = vec![
        Op::After {
            who: 1,
            steps: usize::MAX,
        },
        Op::Warmup,
        Op::Prime(vec![]),
    ];
    d.extend(steps(30, 5));
    let mut e = vec![Op::Warmup, Op::Prime(vec![])];
    e.extend(steps(80, 6));
    vec![a, b, c, d, e]
}

/// Each conversation alone on graphs of its own, then all together on `lm`.
fn check_batched_equals_alone(
    lm: &Arc<SharedLm>,
    pack: &Pack,
    greedy: bool,
    unused: UnusedSubsteps,
) {
    let ops = scenario();
    let m = &pack.manifest;
    let none: Vec<AtomicUsize> = (0..ops.len())
        .map(|_| AtomicUsize::new(usize::MAX))
        .collect();
    let alone: Vec<Vec<Option<AgentFrame>>> = ops
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let mut l = own(pack, sampling(100 + i as u64, greedy), unused);
            converse(&mut l, m, o, &none, i)
        })
        .collect();
    let before = lm.stats.temporal_max_batch.load(Ordering::Relaxed);
    let progress: Arc<Vec<AtomicUsize>> =
        Arc::new((0..ops.len()).map(|_| AtomicUsize::new(0)).collect());
    let start = Arc::new(Barrier::new(ops.len()));
    let together: Vec<Vec<Option<AgentFrame>>> = std::thread::scope(|s| {
        let hs: Vec<_> = ops
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let (progress, start) = (progress.clone(), start.clone());
                s.spawn(move || {
                    start.wait();
                    // A conversation claims its slot when it starts.
                    let mut ops = o.clone();
                    let wait: Vec<Op> = ops
                        .iter()
                        .take_while(|op| matches!(op, Op::After { .. }))
                        .cloned()
                        .collect();
                    ops.drain(..wait.len());
                    converse_after(&wait, &progress);
                    let mut l = shared(lm, pack, sampling(100 + i as u64, greedy), unused);
                    let out = converse(&mut l, m, &ops, &progress, i);
                    // Left (its slot given back): whoever waits for it may go on.
                    drop(l);
                    progress[i].store(usize::MAX, Ordering::Release);
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.len(), t.len(), "conversation {i}: step counts");
        for (k, (x, y)) in a.iter().zip(t).enumerate() {
            assert_eq!(
                x, y,
                "conversation {i} (greedy: {greedy}, {unused:?}): first difference at step {k}"
            );
        }
        assert!(
            a.iter().filter(|f| f.is_some()).count() > 10,
            "conversation {i} spoke"
        );
    }
    let max = lm.stats.temporal_max_batch.load(Ordering::Relaxed);
    assert!(
        max.max(before) >= 3,
        "the conversations were stepped together (most in one tick: {max})"
    );
}

fn converse_after(wait: &[Op], progress: &[AtomicUsize]) {
    for op in wait {
        if let Op::After { who, steps } = op {
            while progress[*who].load(Ordering::Acquire) < *steps {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn open_engine(pack: &Pack, slots: usize) -> Arc<SharedLm> {
    std::sync::Arc::new(
        engine::SharedLm::open(
            pack,
            &EngineOptions {
                slots,
                max_positions: 1000,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

#[test]
fn batched_conversations_equal_each_alone_gqa_fp32() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let lm = open_engine(&pack, 6);
    for (greedy, unused) in [
        (true, UnusedSubsteps::Run),
        (true, UnusedSubsteps::Skip),
        (false, UnusedSubsteps::Skip),
        (false, UnusedSubsteps::Run),
    ] {
        check_batched_equals_alone(&lm, &pack, greedy, unused);
    }
    // The engine drawing the audio where the logits are: the same streams again.
    assert!(!lm.draws_on_device());
    lm.want_device_sampling();
    for (greedy, unused) in [(false, UnusedSubsteps::Skip), (false, UnusedSubsteps::Run)] {
        check_batched_equals_alone(&lm, &pack, greedy, unused);
    }
    assert!(lm.draws_on_device(), "the engine took device sampling up");
    assert_eq!(lm.free_slots(), 6, "every slot given back");
    drop(lm);
    // A process's resources hold one engine per pack: the weights are loaded once, whatever
    // the conversations; the last one to leave frees it.
    let res = duplex::resources::Resources::new(6);
    let opts = EngineOptions {
        max_positions: 1000,
        ..Default::default()
    };
    let a = res.engine(&pack, &opts).unwrap();
    let b = res.engine(&pack, &opts).unwrap();
    assert!(Arc::ptr_eq(&a, &b), "the same engine for the same pack");
    assert_eq!(a.slots, 6, "the process's slot count");
    assert_eq!(res.engines().len(), 1);
    drop((a, b));
    assert!(
        res.engines().is_empty(),
        "the engine outlived its last user"
    );
    let c = res.engine(&pack, &opts).unwrap();
    assert_eq!(
        res.loads.engines.load(Ordering::Relaxed),
        2,
        "opened again once freed"
    );
    drop(c);
}

/// fp16 kernels may accumulate in another order for a batch than for one row: the temporal's
/// text logits and the depformer's logits of four conversations stepped together, on the same
/// inputs as each alone, differ by little, and where the greedy token differs it was a near-tie.
#[test]
fn batched_fp16_differs_only_by_near_ties() {
    let pack = Pack::open(&packs::pack("tiny-gqa-fp16")).unwrap();
    let lm = open_engine(&pack, 6);
    let steps = 120;
    let results: Vec<(f32, usize, Vec<f32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4u64)
            .map(|i| {
                let (lm, pack) = (&lm, &pack);
                s.spawn(move || {
                    let mut alone =
                        duplex::model::temporal::open(pack, &TemporalOptions::default()).unwrap();
                    let mut slot = lm.temporal_slot(usize::MAX).unwrap();
                    let mut dep_alone = Depformer::open(pack, &SessionOptions::default()).unwrap();
                    dep_alone.keep_logits = true;
                    let mut dep = lm.depformer_client();
                    dep.keep_logits = true;
                    dep.conversation = Some(slot.slot());
                    let (mut a, mut b, mut hidden) = (Vec::new(), Vec::new(), Vec::new());
                    let (mut ga, mut gb) = (
                        duplex::model::sampling::Sampler::new(0),
                        duplex::model::sampling::Sampler::new(0),
                    );
                    let provided: Vec<bool> = (0..16).map(|cb| cb >= 8).collect();
                    let (mut oa, mut ob) = (Vec::new(), Vec::new());
                    let (mut max_diff, mut flips, mut margins) = (0f32, 0, Vec::new());
                    // Conversations of different lengths: row i starts 7 i frames in.
                    for (k, c) in codes(steps, 40 + i).into_iter().enumerate() {
                        let mut frame = vec![(k as i64 * 31 + i as i64) % 32000];
                        frame.extend(&c);
                        frame.extend(c.iter().map(|x| (x * 7 + 3) % 2048));
                        alone.step(&frame).unwrap();
                        slot.step(&frame).unwrap();
                        alone.read_logits(&mut a);
                        slot.read_logits(&mut b);
                        let top = |v: &[f32]| duplex::model::sampling::argmax(v);
                        let mut compare = |a: &[f32], b: &[f32]| {
                            for (x, y) in a.iter().zip(b) {
                                max_diff = max_diff.max((x - y).abs());
                            }
                            if top(a) != top(b) {
                                flips += 1;
                                let mut sorted = a.to_vec();
                                sorted.sort_by(|x, y| y.total_cmp(x));
                                margins.push(sorted[0] - sorted[1]);
                                return false;
                            }
                            true
                        };
                        compare(&a, &b);
                        // The depformer on the same hidden state, text and provided tokens.
                        alone.read_hidden(&mut hidden);
                        let input = duplex::model::depformer::DepformerInput {
                            hidden: &hidden,
                            text: frame[0],
                            target: &frame[1..],
                            provided: &provided,
                        };
                        let g = SamplingParams::GREEDY;
                        dep_alone.run(input, &mut ga, g, &mut oa).unwrap();
                        dep.run(input, &mut gb, g, &mut ob).unwrap();
                        // Up to the first flip (later substeps are fed different tokens).
                        for (x, y) in dep_alone.logits.iter().zip(&dep.logits) {
                            if !compare(x, y) {
                                break;
                            }
                        }
                        if k == 0 {
                            std::thread::sleep(Duration::from_millis(7 * i));
                        }
                    }
                    (max_diff, flips, margins)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let max_diff = results.iter().map(|r| r.0).fold(0f32, f32::max);
    let flips: usize = results.iter().map(|r| r.1).sum();
    let margins: Vec<f32> = results.iter().flat_map(|r| r.2.clone()).collect();
    println!(
        "fp16 batched vs alone: max |logit difference| {max_diff:.4}, greedy flips {flips} in {} frames (text + 16 substeps each), margins {margins:?}",
        4 * steps
    );
    assert!(max_diff < 0.1, "logits differ by {max_diff}");
    // At most one token in a hundred frames.
    assert!(
        flips * 100 <= 4 * steps,
        "{flips} flips in {} frames",
        4 * steps
    );
    assert!(
        margins.iter().all(|m| *m <= 2.0 * max_diff),
        "a flip that was no near-tie: margins {margins:?}, differences up to {max_diff}"
    );
}

#[test]
fn slots_run_out_and_come_back() {
    // A copy of the pack: an engine of its own, with two slots.
    let (_keep, dir) = packs::variant("tiny-gqa", "");
    let pack = Pack::open(&dir).unwrap();
    let lm = open_engine(&pack, 2);
    let a = lm.temporal_slot(usize::MAX).unwrap();
    let b = lm.temporal_slot(usize::MAX).unwrap();
    assert_ne!(a.slot(), b.slot());
    let err = lm.temporal_slot(usize::MAX).err().expect("a third slot");
    assert!(err.to_string().contains("all 2 slots"), "{err}");
    assert_eq!(lm.free_slots(), 0);
    let freed = a.slot();
    drop(a);
    assert_eq!(lm.free_slots(), 1);
    assert_eq!(lm.temporal_slot(usize::MAX).unwrap().slot(), freed);
}

#[test]
fn a_bad_frame_is_refused_before_the_batch() {
    let (_keep, dir) = packs::variant("tiny-gqa", "");
    let pack = Pack::open(&dir).unwrap();
    let lm = open_engine(&pack, 2);
    let mut bad = lm.temporal_slot(usize::MAX).unwrap();
    let mut good = lm.temporal_slot(usize::MAX).unwrap();
    let mut frame = vec![0i64; 17];
    frame[12] = 5000;
    let err = bad.step(&frame).unwrap_err().to_string();
    assert!(err.contains("channel 12 (user audio)"), "{err}");
    assert_eq!(bad.kv_len(), 0, "nothing ran for it");
    good.step(&[0; 17]).unwrap();
    assert_eq!(good.kv_len(), 1);
}

#[test]
fn a_standard_pack_cannot_share_an_engine() {
    let dir = tempfile::tempdir().unwrap();
    let codes_path = dir.path().join("c.json");
    std::fs::write(&codes_path, serde_json::to_string(&codes(5, 1)).unwrap()).unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["replay", "--engine", "shared", "--pack"])
        .arg(packs::pack("tiny"))
        .arg("--codes")
        .arg(&codes_path)
        .arg("--out")
        .arg(dir.path().join("o.jsonl"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("GQA") && err.contains("engine"), "{err}");
    assert!(!Path::new(&dir.path().join("o.jsonl")).exists());
}

#[test]
fn a_slot_runs_out_of_positions_alone_and_a_reset_gives_them_back() {
    let (_keep, dir) = packs::variant("tiny-gqa", "");
    let pack = Pack::open(&dir).unwrap();
    let lm = open_engine(&pack, 2);
    let mut short = lm.temporal_slot(12).unwrap();
    let mut long = lm.temporal_slot(usize::MAX).unwrap();
    for _ in 0..12 {
        short.step(&[0; 17]).unwrap();
        long.step(&[0; 17]).unwrap();
    }
    assert_eq!(short.positions_left(), 0);
    let err = short.step(&[0; 17]).unwrap_err().to_string();
    assert!(err.contains("no position left"), "{err}");
    // The other conversation goes on; the short one starts again after a reset.
    long.step(&[0; 17]).unwrap();
    assert_eq!(long.kv_len(), 13);
    short.reset();
    short.step(&[0; 17]).unwrap();
    assert_eq!((short.kv_len(), short.positions_left()), (1, 11));
}

/// Temporal input frames (17 channels) of tokens valid in every table.
fn frames17(n: usize, seed: u64) -> Vec<Vec<i64>> {
    codes(n, seed)
        .into_iter()
        .zip(codes(n, seed + 1))
        .enumerate()
        .map(|(t, (a, b))| {
            let mut f = vec![(t as i64 * 97 + seed as i64) % 32000];
            f.extend(a);
            f.extend(b);
            f
        })
        .collect()
}

fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Priming in a shared engine: a slot's prefill chunks (its row alone, between ticks, while
/// another slot steps a conversation of its own) leave it where stepping the same frames does;
/// the other conversation's logits are those it gets alone. A state taken from a slot and
/// restored into another slot, or into a transformer of its own, steps bit for bit as the
/// slot it was taken from; a state of another graph is refused.
#[test]
fn a_slot_primes_by_chunks_between_ticks_and_its_state_moves_between_slots_and_own() {
    let (_keep, dir) = packs::variant("tiny-gqa", "");
    let pack = Pack::open(&dir).unwrap();
    let lm = open_engine(&pack, 3);
    let prime = frames17(70, 3);
    let talk = frames17(40, 9);
    // The reference: the priming stepped, in a slot of its own.
    let mut stepped = lm.temporal_slot(usize::MAX).unwrap();
    for f in &prime {
        stepped.step(f).unwrap();
    }
    let (mut want, mut got) = (Vec::new(), Vec::new());
    stepped.read_logits(&mut want);
    // The same frames as chunks of 16 while another slot talks.
    let talker = {
        let lm = lm.clone();
        let talk = talk.clone();
        std::thread::spawn(move || {
            let mut s = lm.temporal_slot(usize::MAX).unwrap();
            let mut out = Vec::new();
            let mut l = Vec::new();
            for f in &talk {
                s.step(f).unwrap();
                s.read_logits(&mut l);
                out.push(l.clone());
            }
            out
        })
    };
    let mut chunked = lm.temporal_slot(usize::MAX).unwrap();
    // Something stepped before: a prefill after a reset starts a new conversation.
    chunked.step(&talk[0]).unwrap();
    chunked.reset();
    chunked.prefill(&prime, 16).unwrap();
    assert_eq!(chunked.position(), prime.len());
    chunked.read_logits(&mut got);
    let d = largest_difference(&want, &got);
    assert!(d <= 1e-4, "the prefilled slot's logits differ by {d}");
    let during = talker.join().unwrap();
    // The talker, alone in a fresh engine.
    let alone = open_engine(&pack, 1);
    let mut s = alone.temporal_slot(usize::MAX).unwrap();
    let mut l = Vec::new();
    for (f, o) in talk.iter().zip(&during) {
        s.step(f).unwrap();
        s.read_logits(&mut l);
        let d = largest_difference(&l, o);
        assert!(
            d <= 1e-4,
            "the talker's logits moved by {d} while a slot primed"
        );
    }
    drop(s);
    // The prefilled rows are in the slot: its next steps are the stepped slot's.
    for f in &talk[20..25] {
        stepped.step(f).unwrap();
        chunked.step(f).unwrap();
        stepped.read_logits(&mut want);
        chunked.read_logits(&mut got);
        let d = largest_difference(&want, &got);
        assert!(d <= 1e-4, "after a prefill, a step's logits differ by {d}");
    }
    // The chunked slot's state, into another slot and into a transformer of its own.
    let state = std::sync::Arc::new(chunked.snapshot().expect("slots in host memory"));
    assert_eq!(state.position(), prime.len() + 5);
    drop(stepped);
    let mut other = lm.temporal_slot(usize::MAX).unwrap();
    other.step(&talk[1]).unwrap();
    other.restore(&state).unwrap();
    assert_eq!(other.position(), prime.len() + 5);
    let mut own = duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
    own.restore(&state).unwrap();
    let (mut a, mut b, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for f in &talk[..10] {
        chunked.step(f).unwrap();
        other.step(f).unwrap();
        own.step(f).unwrap();
        chunked.read_logits(&mut a);
        other.read_logits(&mut b);
        own.read_logits(&mut c);
        assert_eq!(a, b, "a state restored into another slot");
        let d = largest_difference(&a, &c);
        assert!(d <= 1e-4, "a slot's state in a transformer of its own: {d}");
    }
    // A standard graph's state is refused, naming why.
    let std_pack = Pack::open(&packs::pack("tiny")).unwrap();
    let mut std_own =
        duplex::model::temporal::open(&std_pack, &TemporalOptions::default()).unwrap();
    std_own.step(&prime[0]).unwrap();
    let foreign = std::sync::Arc::new(std_own.snapshot().unwrap());
    let e = other.restore(&foreign).unwrap_err().to_string();
    assert!(e.contains("another graph"), "{e}");
}
