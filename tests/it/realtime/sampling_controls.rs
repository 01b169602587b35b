//! Kyutai's sampling controls on the real graphs (the tiny packs, ONNX Runtime): `pad_mult`,
//! the repetition penalty, the two seeds, `max_steps`. Each text stream is also recomputed
//! outside the LM from the step's text logits with an independent transcription of moshi-core's
//! rule and a sampler of the same seed: the text sampler draws from nothing else.

use crate::support::packs;

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

use duplex::model::depformer::Depformer;
use duplex::model::lm::{
    priming_script, LmLoop, Sampled, SamplingConfig, SamplingHalf, TemporalHalf,
};
use duplex::model::lmgen::LmGen;
use duplex::model::pack::Pack;
use duplex::model::sampling::{Sampler, SamplingParams};
use duplex::model::session::SessionOptions;
use duplex::model::temporal::TemporalOptions;

const PAD: i64 = 3;

fn user_codes(n: usize, seed: u64) -> Vec<Vec<i64>> {
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

fn lm(pack: &Pack, cfg: SamplingConfig) -> LmLoop {
    let so = SessionOptions::default();
    LmLoop {
        temporal: TemporalHalf::new(
            LmGen::new(pack.manifest.layout()),
            duplex::model::temporal::open(pack, &TemporalOptions::default()).unwrap(),
        ),
        sampling: SamplingHalf::new(Depformer::open(pack, &so).unwrap(), cfg),
    }
}

/// One step as the sampling half saw it and answered.
struct Rec {
    logits: Vec<f32>,
    forced: bool,
    tokens: Sampled,
}

/// Warmup, then every step of priming (`persona`, 2 silence frames) and of `users`, recorded.
fn converse(pack: &Pack, cfg: SamplingConfig, persona: &[i64], users: &[Vec<i64>]) -> Vec<Rec> {
    let m = &pack.manifest;
    let mut l = lm(pack, cfg);
    l.warmup(&m.silence_codes, 2).unwrap();
    let script = priming_script(m, None, persona, 2);
    let steps = script
        .iter()
        .map(|s| (s.user.clone(), s.text, s.agent.clone()))
        .chain(users.iter().map(|u| (u.clone(), None, None)));
    let mut out = Vec::new();
    for (user, text, agent) in steps {
        let Some(step) = l.temporal.begin(&user, text, agent.as_deref()).unwrap() else {
            continue;
        };
        let tokens = l.sampling.sample(&step).unwrap();
        l.temporal.commit(&tokens).unwrap();
        out.push(Rec {
            logits: step.text_logits.clone(),
            forced: step.provided[0],
            tokens,
        });
    }
    out
}

/// moshi-core's `apply_repetition_penalty`, transcribed plainly: every text token so far
/// (padding included), walked from the newest, each distinct word penalised once.
fn penalised(logits: &[f32], so_far: &[i64], context: usize, penalty: f32) -> Vec<f32> {
    let mut l = logits.to_vec();
    let mut seen = HashSet::new();
    let mut words = 0;
    for &t in so_far.iter().rev() {
        if t == PAD || t == 0 || t == 32000 {
            continue;
        }
        if words >= context {
            break;
        }
        words += 1;
        if seen.insert(t) {
            if let Some(x) = l.get_mut(t as usize) {
                *x = if *x >= 0.0 {
                    *x / penalty
                } else {
                    *x * penalty
                };
            }
        }
    }
    l
}

/// The words of the window (the last `context` non-padding tokens the agent drew).
fn window(so_far: &[i64], context: usize) -> HashSet<i64> {
    so_far
        .iter()
        .rev()
        .filter(|&&t| t != PAD && t != 0 && t != 32000)
        .take(context)
        .copied()
        .collect()
}

/// The `k` largest logits' ids.
fn top_k(logits: &[f32], k: usize) -> HashSet<i64> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx[..k].iter().map(|&i| i as i64).collect()
}

/// Recomputes the text stream of `run` from its text logits alone: a sampler seeded with the
/// text seed, the penalty over the words drawn so far, then `pad_mult · T` on the padding logit.
/// Asserts it is the stream the LM drew.
fn check_text_stream(run: &[Rec], cfg: &SamplingConfig) {
    let mut s = Sampler::new(cfg.text_seed());
    let mut drawn: Vec<i64> = Vec::new();
    for (i, r) in run.iter().enumerate() {
        if r.forced {
            s.skip(cfg.text);
            continue;
        }
        let mut l = penalised(
            &r.logits,
            &drawn,
            cfg.repetition_penalty_context,
            cfg.repetition_penalty,
        );
        if cfg.text.temperature > 0.0 {
            l[PAD as usize] += cfg.pad_mult * cfg.text.temperature;
        }
        let t = s.sample(&l, cfg.text) as i64;
        assert_eq!(t, r.tokens.text, "step {i}: the reference draws {t}");
        drawn.push(t);
    }
}

fn hot(seed: u64) -> SamplingConfig {
    SamplingConfig {
        text: SamplingParams {
            temperature: 2.0,
            top_k: 25,
        },
        seed,
        ..Default::default()
    }
}

fn pad_share(run: &[Rec]) -> f64 {
    let drawn: Vec<i64> = run
        .iter()
        .filter(|r| !r.forced)
        .map(|r| r.tokens.text)
        .collect();
    drawn.iter().filter(|&&t| t == PAD).count() as f64 / drawn.len() as f64
}

/// `pad_mult` +4 makes the agent pad (stay silent) far more often than 0, and -4 no more
/// often than 0, with the same seeds; each stream is the reference's for its `pad_mult`.
#[test]
fn pad_mult_moves_the_share_of_padding() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let users = user_codes(240, 1);
    let mut shares = Vec::new();
    for pad_mult in [-4.0f32, 0.0, 4.0] {
        let cfg = SamplingConfig { pad_mult, ..hot(3) };
        let run = converse(&pack, cfg, &[], &users);
        assert!(run.iter().filter(|r| !r.forced).count() >= 200);
        check_text_stream(&run, &cfg);
        shares.push(pad_share(&run));
    }
    let [minus, zero, plus] = shares[..] else {
        unreachable!()
    };
    eprintln!("padding share: pad_mult -4 {minus:.3}, 0 {zero:.3}, +4 {plus:.3}");
    assert!(plus > zero + 0.15, "+4: {plus:.3} vs 0: {zero:.3}");
    assert!(minus <= zero, "-4: {minus:.3} vs 0: {zero:.3}");
    assert!(plus > minus + 0.15, "+4: {plus:.3} vs -4: {minus:.3}");
}

/// With the same seeds, penalty 1.5 changes nothing until a step whose top-k candidates (before
/// or after the penalty) hold a word of the window; the penalised stream is the reference's.
#[test]
fn the_repetition_penalty_changes_the_text_only_at_words_of_the_window() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let users = user_codes(240, 2);
    let context = 64;
    let base = SamplingConfig {
        repetition_penalty_context: context,
        ..hot(4)
    };
    let pen = SamplingConfig {
        repetition_penalty: 1.5,
        ..base
    };
    let a = converse(&pack, base, &[], &users);
    let b = converse(&pack, pen, &[], &users);
    check_text_stream(&a, &base);
    check_text_stream(&b, &pen);
    assert_eq!(a.len(), b.len());
    let mut drawn: Vec<i64> = Vec::new();
    let mut touched = 0;
    let mut first = None;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.forced, y.forced);
        if x.forced {
            assert_eq!(x.tokens, y.tokens);
            continue;
        }
        // Same history so far: the same logits.
        assert_eq!(x.logits, y.logits, "step {i}");
        let w = window(&drawn, context);
        let k = base.text.top_k;
        let cands: HashSet<i64> = top_k(&x.logits, k)
            .union(&top_k(&penalised(&x.logits, &drawn, context, 1.5), k))
            .copied()
            .collect();
        let hit = !w.is_disjoint(&cands);
        touched += hit as usize;
        if x.tokens.text != y.tokens.text {
            assert!(
                hit,
                "step {i}: the text changed but no word of the window was a candidate"
            );
            first = Some(i);
            break;
        }
        // The audio sampler is untouched by the penalty.
        assert_eq!(x.tokens.audio, y.tokens.audio, "step {i}");
        drawn.push(x.tokens.text);
    }
    eprintln!("first difference at step {first:?}; steps with a window word among the candidates before it: {touched}");
    first.expect("penalty 1.5 changed the text stream within 240 frames");
}

/// A new conversation starts with an empty history, and forced text (a persona) never enters it.
#[test]
fn the_history_holds_the_words_drawn_in_this_conversation() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let m = &pack.manifest;
    let cfg = SamplingConfig {
        repetition_penalty: 1.5,
        ..hot(5)
    };
    let mut l = lm(&pack, cfg);
    l.warmup(&m.silence_codes, 2).unwrap();
    l.prime(&priming_script(m, None, &[10, 20, 30], 2)).unwrap();
    assert!(l.sampling.history().is_empty(), "persona tokens are forced");
    let mut drawn = Vec::new();
    for u in user_codes(30, 3) {
        if let Some(s) = l.temporal.begin(&u, None, None).unwrap() {
            let t = l.sampling.sample(&s).unwrap();
            drawn.push(t.text);
            l.temporal.commit(&t).unwrap();
        }
    }
    let words: Vec<i64> = drawn.into_iter().filter(|&t| t != PAD && t != 0).collect();
    assert_eq!(l.sampling.history().tokens().collect::<Vec<_>>(), words);
    // A new conversation (reset, persona, long-session re-prime): the history starts empty.
    l.temporal.reset(false);
    l.prime(&priming_script(m, None, &[40], 2)).unwrap();
    assert!(l.sampling.history().is_empty());
}

/// First step at which two runs' text (or audio) differ.
fn first_difference(a: &[Rec], b: &[Rec], audio: bool) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| {
        if audio {
            x.tokens.audio != y.tokens.audio
        } else {
            x.tokens.text != y.tokens.text
        }
    })
}

/// Another audio seed, the same text seed: the audio differs first, and the text only from a
/// later step (the text token is drawn before the substeps, from logits of earlier steps).
/// Another text seed, the same audio seed: the audio differs no earlier than the text.
#[test]
fn the_text_and_audio_seeds_drive_their_own_samplers() {
    let pack = Pack::open(&packs::pack("tiny-gqa")).unwrap();
    let users = user_codes(120, 4);
    let cfg = |text_seed: u64, audio_seed: u64| SamplingConfig {
        text_seed: Some(text_seed),
        audio_seed: Some(audio_seed),
        ..Default::default()
    };
    let base = converse(&pack, cfg(5, 1), &[], &users);
    check_text_stream(&base, &cfg(5, 1));
    let audio = converse(&pack, cfg(5, 2), &[], &users);
    check_text_stream(&audio, &cfg(5, 2));
    let (fa, ft) = (
        first_difference(&base, &audio, true),
        first_difference(&base, &audio, false),
    );
    eprintln!("audio seed changed: audio differs from step {fa:?}, text from step {ft:?}");
    let fa = fa.expect("another audio seed, another voice");
    assert!(ft.is_none_or(|t| t > fa), "text {ft:?}, audio {fa}");
    let text = converse(&pack, cfg(6, 1), &[], &users);
    let (fa, ft) = (
        first_difference(&base, &text, true),
        first_difference(&base, &text, false),
    );
    eprintln!("text seed changed: text differs from step {ft:?}, audio from step {fa:?}");
    let ft = ft.expect("another text seed, other words");
    assert!(fa.is_none_or(|a| a >= ft), "audio {fa:?}, text {ft}");
    // `seed` alone is the default of both: text `seed`, audio `seed ^ AUDIO_SEED_MIX`.
    let by_seed = converse(
        &pack,
        SamplingConfig {
            seed: 9,
            ..Default::default()
        },
        &[],
        &users,
    );
    let explicit = converse(
        &pack,
        cfg(9, 9 ^ SamplingConfig::AUDIO_SEED_MIX),
        &[],
        &users,
    );
    assert!(by_seed
        .iter()
        .zip(&explicit)
        .all(|(x, y)| x.tokens == y.tokens));
}

fn write_codes(dir: &Path, n: usize) -> std::path::PathBuf {
    let p = dir.join("codes.json");
    std::fs::write(&p, serde_json::to_string(&user_codes(n, 6)).unwrap()).unwrap();
    p
}

fn replay(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .arg("replay")
        .args(args)
        .output()
        .unwrap()
}

/// `--max-steps 50` ends the conversation cleanly at exactly 50 agent frames, saying why.
#[test]
fn max_steps_ends_the_stream_at_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let codes = write_codes(dir.path(), 80);
    let pack = packs::pack("tiny-gqa");
    let out = dir.path().join("out.jsonl");
    let (p, c, o) = (
        pack.to_str().unwrap(),
        codes.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let r = replay(&["--pack", p, "--codes", c, "--out", o, "--max-steps", "50"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "a cap is a clean end: {err}");
    assert!(err.contains("max_steps reached"), "{err}");
    let lines = std::fs::read_to_string(&out).unwrap();
    assert_eq!(lines.lines().count(), 50);
    // Without a cap, every user frame gets an agent frame (primed, the ring is full).
    let r = replay(&["--pack", p, "--codes", c, "--out", o]);
    assert!(r.status.success());
    let all = std::fs::read_to_string(&out).unwrap();
    assert_eq!(all.lines().count(), 80);
    assert!(all.starts_with(&lines), "the cap cuts the same stream");
}

/// The new flags reach the stages, whose ranges name the param at fault (exit 2); `--seed`
/// alone is the default of both seeds.
#[test]
fn replay_flags_are_checked_and_seed_is_the_default_of_both() {
    let dir = tempfile::tempdir().unwrap();
    let codes = write_codes(dir.path(), 30);
    let pack = packs::pack("tiny-gqa");
    let out = dir.path().join("out.jsonl");
    let (p, c, o) = (
        pack.to_str().unwrap(),
        codes.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    for (flag, value, says) in [
        (
            "--pad-mult",
            "11",
            "`pad_mult`: 11 is out of range -10..=10",
        ),
        ("--pad-mult", "-10.5", "`pad_mult`: -10.5 is out of range"),
        (
            "--repetition-penalty",
            "0.5",
            "`repetition_penalty`: 0.5 is out of range 1..=10",
        ),
        (
            "--repetition-penalty-context",
            "5000",
            "`repetition_penalty_context`: 5000 is out of range 0..=4096",
        ),
        (
            "--max-steps",
            "2000000000",
            "`max_steps`: 2000000000 is out of range",
        ),
    ] {
        let r = replay(&[
            "--pack",
            p,
            "--codes",
            c,
            "--out",
            o,
            &format!("{flag}={value}"),
        ]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(says), "{flag} {value}: {err}");
    }
    let run = |extra: &[&str]| {
        let mut a = vec!["--pack", p, "--codes", c, "--out", o];
        a.extend(extra);
        let r = replay(&a);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        std::fs::read_to_string(&out).unwrap()
    };
    let mix = (7 ^ SamplingConfig::AUDIO_SEED_MIX).to_string();
    let by_seed = run(&["--seed", "7"]);
    assert_eq!(by_seed, run(&["--text-seed", "7", "--audio-seed", &mix]));
    assert_ne!(by_seed, run(&["--seed", "7", "--audio-seed", "8"]));
    // Controls at their defaults change nothing.
    assert_eq!(
        by_seed,
        run(&[
            "--seed",
            "7",
            "--pad-mult",
            "0",
            "--repetition-penalty",
            "1",
            "--repetition-penalty-context",
            "10"
        ])
    );
}

/// The depformer's `sampling` command sets the controls of a running conversation from its
/// next frame: a hot text with `pad_mult` +4 pads where it did not before; a value out of range
/// is refused naming the param, and changes nothing.
#[test]
fn the_sampling_command_sets_the_controls_at_the_next_frame() {
    use duplex::config::LoadOptions;
    use duplex::runtime::Value;
    use duplex::stages::Registry;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let codes = write_codes(dir.path(), 100);
    let pack = packs::pack("tiny-gqa");
    let out = dir.path().join("tokens.jsonl");
    let yaml = format!(
        "stages:\n  codes: {{ kind: codes_source, path: {c}, realtime: true }}\n  temporal: {{ kind: temporal, pack: {p} }}\n  depformer: {{ kind: depformer, pack: {p}, seed: 1 }}\n  tokens: {{ kind: token_sink, path: {o} }}\nlinks:\n  - codes -> temporal.codes\n  - temporal.step -> depformer\n  - {{ from: depformer, to: temporal.tokens, feedback: true }}\n  - temporal.agent -> tokens\n",
        c = codes.display(),
        p = pack.display(),
        o = out.display()
    );
    let file = dir.path().join("p.yaml");
    std::fs::write(&file, yaml).unwrap();
    let opts = LoadOptions {
        sets: Vec::new(),
        env: Some(Default::default()),
    };
    let (_spec, builder) = duplex::app::build(&file, &opts, &Registry::builtin()).unwrap();
    let running = builder.build().unwrap().start();
    let h = running.handle();
    let frames = || match h.control().get("temporal", "agent_frames") {
        Some(Value::Int(i)) => i,
        _ => 0,
    };
    let t0 = Instant::now();
    while frames() < 10 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no frames");
        std::thread::sleep(Duration::from_millis(20));
    }
    let send = |arg: &str| {
        h.control()
            .send("depformer", "sampling", arg)
            .unwrap()
            .wait(Duration::from_secs(10))
            .unwrap()
    };
    let e = send("pad_mult=20 text_temperature=2").unwrap_err();
    assert!(e.contains("`pad_mult`: 20 is out of range"), "{e}");
    let before = frames();
    assert_eq!(
        send("text_temperature=2 pad_mult=4").as_deref(),
        Ok("sampling changed")
    );
    let after = frames();
    running.wait().into_result().unwrap();
    let texts: Vec<(i64, i64)> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["frame"].as_i64().unwrap(), v["text"].as_i64().unwrap())
        })
        .collect();
    let share = |r: std::ops::Range<i64>| {
        let sel: Vec<i64> = texts
            .iter()
            .filter(|(i, _)| r.contains(i))
            .map(|x| x.1)
            .collect();
        (
            sel.iter().filter(|&&t| t == PAD).count() as f64 / sel.len() as f64,
            sel.len(),
        )
    };
    // The first frames are what priming left in the ring (padding).
    let (old, n_old) = share(3..before);
    let (new, n_new) = share(after + 1..i64::MAX);
    eprintln!(
        "padding share: {old:.3} of {n_old} frames before the command, {new:.3} of {n_new} after"
    );
    assert!(n_old >= 5 && n_new >= 40, "{n_old} {n_new}");
    assert!(old < 0.1, "{old}");
    assert!(new > 0.15, "{new}");
}
