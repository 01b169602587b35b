//! The full duplex pipeline (actors, feedback edge, codec overlap) against a plain sequential
//! loop over the same building blocks: byte-identical tokens and WAV for the same seed and input.
//! Plus the long-session policy and execution providers that refuse to pretend.

use crate::support::packs;

use std::path::Path;
use std::process::Command;

use duplex::audio::{Framer, StreamResampler, Synth, WavFormat, WavReader, WavWriter, Waveform};
use duplex::model::depformer::Depformer;
use duplex::model::lm::{priming_script, LmLoop, SamplingConfig, SamplingHalf, TemporalHalf};
use duplex::model::lmgen::LmGen;
use duplex::model::mimi::{MimiDecoder, MimiEncoder};
use duplex::model::mimi_step::StepCodec;
use duplex::model::pack::{FloatType, Pack, StepRole};
use duplex::model::session::SessionOptions;
use duplex::model::temporal::TemporalOptions;

const SEED: u64 = 5;

fn write_input(path: &Path) {
    let mut s = Synth::new(
        Waveform::Noise {
            amplitude: 0.3,
            seed: 11,
        },
        48_000,
    );
    let mut x = vec![0.0; 48_000 * 4 + 1234];
    s.fill(&mut x);
    let mut w = WavWriter::create(path, 48_000, WavFormat::I16).unwrap();
    w.write(&x).unwrap();
    w.finalize().unwrap();
}

fn pipeline_yaml(dir: &Path, pack: &Path, extra_temporal: &str) -> std::path::PathBuf {
    let d = dir.display();
    let pk = pack.display();
    let text = format!(
        r#"
stages:
  source: {{ kind: wav_source, path: {d}/in.wav }}
  down: {{ kind: resample, to: 24000 }}
  framer: {{ kind: framer }}
  encode: {{ kind: mimi_encode, pack: {pk} }}
  temporal: {{ kind: temporal, pack: {pk}{extra_temporal} }}
  depformer: {{ kind: depformer, pack: {pk}, seed: {SEED} }}
  decode: {{ kind: mimi_decode, pack: {pk} }}
  up: {{ kind: resample, to: 48000 }}
  sink: {{ kind: wav_sink, path: {d}/out.wav }}
  tokens: {{ kind: token_sink, path: {d}/tokens.jsonl }}
links:
  - source -> down
  - down -> framer
  - framer -> encode
  - encode -> temporal.codes
  - temporal.step -> depformer
  - {{ from: depformer, to: temporal.tokens, feedback: true }}
  - temporal.agent -> decode
  - temporal.agent -> tokens
  - decode -> up
  - up -> sink
"#
    );
    let p = dir.join("p.yaml");
    std::fs::write(&p, text).unwrap();
    p
}

/// The codec of either strategy, called directly.
enum Codec {
    Stateful(Box<(StepCodec, StepCodec)>),
    Window(Box<(MimiEncoder, MimiDecoder)>),
}

impl Codec {
    fn encode(&mut self, f: &[f32]) -> Vec<i64> {
        match self {
            Codec::Stateful(c) => c.0.encode(f).unwrap(),
            Codec::Window(w) => w.0.push(f).unwrap(),
        }
    }

    fn decode(&mut self, c: &[i64]) -> Vec<f32> {
        match self {
            Codec::Stateful(s) => s.1.decode(c, 2048).unwrap(),
            Codec::Window(w) => w.1.push(c, 2048).unwrap(),
        }
    }
}

/// The same work, one call after another, no actors; the codec stateful (the stages' default
/// on packs with step graphs) or on the 8-frame window.
fn sequential(dir: &Path, pack_dir: &Path, stateful: bool) -> String {
    let pack = Pack::open(pack_dir).unwrap();
    let m = pack.manifest.clone();
    let so = SessionOptions::default();
    let mut wav = WavReader::open(&dir.join("in.wav")).unwrap();
    let mut down = StreamResampler::new(48_000, 24_000, 960).unwrap();
    let mut framer = Framer::new(1920);
    let mut codec = if stateful {
        Codec::Stateful(Box::new((
            StepCodec::open(&pack, StepRole::Encoder, FloatType::F32, &so).unwrap(),
            StepCodec::open(&pack, StepRole::Decoder, FloatType::F32, &so).unwrap(),
        )))
    } else {
        Codec::Window(Box::new((
            MimiEncoder::open(&pack, &so, 8).unwrap(),
            MimiDecoder::open(&pack, &so, 8).unwrap(),
        )))
    };
    let mut up = StreamResampler::new(24_000, 48_000, 480).unwrap();
    let temporal = duplex::model::temporal::open(&pack, &TemporalOptions::default()).unwrap();
    let depformer = Depformer::open(&pack, &so).unwrap();
    let mut lm = LmLoop {
        temporal: TemporalHalf::new(LmGen::new(m.layout()), temporal),
        sampling: SamplingHalf::new(
            depformer,
            SamplingConfig {
                seed: SEED,
                ..Default::default()
            },
        ),
    };
    lm.warmup(&m.silence_codes, 2).unwrap();
    lm.prime(&priming_script(&m, None, &[], 6)).unwrap();

    let mut out = WavWriter::create(&dir.join("seq.wav"), 48_000, WavFormat::I16).unwrap();
    let mut lines = String::new();
    let mut index = 0;
    let mut frames = Vec::new();
    let mut pcm = Vec::new();
    loop {
        let mut chunk = Vec::new();
        if wav.read(960, &mut chunk).unwrap() == 0 {
            break;
        }
        pcm.clear();
        down.process(&chunk, &mut pcm).unwrap();
        framer
            .push(&pcm, |f| {
                frames.push(f);
                Ok::<_, ()>(())
            })
            .unwrap();
    }
    pcm.clear();
    down.flush(&mut pcm).unwrap();
    framer
        .push(&pcm, |f| {
            frames.push(f);
            Ok::<_, ()>(())
        })
        .unwrap();
    if let Some((f, _)) = framer.finish() {
        frames.push(f);
    }
    for f in frames {
        let codes = codec.encode(&f);
        if let Some(a) = lm.step(&codes, None, None).unwrap() {
            lines.push_str(&format!(
                "{}\n",
                serde_json::json!({"frame": index, "text": a.text, "audio": a.audio})
            ));
            index += 1;
            let samples = codec.decode(&a.audio);
            let mut o = Vec::new();
            up.process(&samples, &mut o).unwrap();
            out.write(&o).unwrap();
        }
    }
    let mut o = Vec::new();
    up.flush(&mut o).unwrap();
    out.write(&o).unwrap();
    out.finalize().unwrap();
    lines
}

fn run(p: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["run", p.to_str().unwrap()])
        .output()
        .unwrap()
}

#[test]
fn actors_and_a_sequential_loop_give_byte_identical_tokens_and_audio() {
    // Both codec strategies: stateful (the default on a pack with step graphs) and the window.
    for stateful in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        write_input(&dir.path().join("in.wav"));
        let pack = packs::pack("tiny-gqa");
        let p = pipeline_yaml(dir.path(), &pack, "");
        if !stateful {
            let text = std::fs::read_to_string(&p)
                .unwrap()
                .replace(
                    "kind: mimi_encode,",
                    "kind: mimi_encode, streaming: window,",
                )
                .replace(
                    "kind: mimi_decode,",
                    "kind: mimi_decode, streaming: window,",
                );
            std::fs::write(&p, text).unwrap();
        }
        let o = run(&p);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{err}");
        let strategy = if stateful { "stateful" } else { "window" };
        assert!(
            err.contains(&format!(r#"stage="encode" strategy="{strategy}""#)),
            "{err}"
        );
        let seq_tokens = sequential(dir.path(), &pack, stateful);
        let tokens = std::fs::read_to_string(dir.path().join("tokens.jsonl")).unwrap();
        assert_eq!(
            tokens.lines().count(),
            51,
            "4.03 s at 24 kHz = 51 frames (the last one padded)"
        );
        assert_eq!(tokens, seq_tokens, "{strategy}");
        let a = std::fs::read(dir.path().join("out.wav")).unwrap();
        let b = std::fs::read(dir.path().join("seq.wav")).unwrap();
        assert_eq!(a.len(), b.len());
        assert!(a == b, "WAV files differ ({strategy})");
        // The codec really ran: the output is not silence.
        let (_, pcm) = {
            let mut r = WavReader::open(&dir.path().join("out.wav")).unwrap();
            (r.rate(), r.read_all().unwrap())
        };
        assert!(pcm.iter().any(|v| v.abs() > 1e-3));
    }
}

fn tokens_of(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("tokens.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn long_session_policy_resets_and_reprimes_or_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    write_input(&dir.path().join("in.wav"));
    let pack = packs::pack("tiny-gqa");
    // Priming takes 11 positions (its first step only fills the ring), leaving 19 of 30 per
    // conversation: 51 user frames need two resets.
    let p = pipeline_yaml(dir.path(), &pack, ", max_positions: 30");
    let o = run(&p);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_eq!(
        err.matches("resetting the conversation and priming again")
            .count(),
        2,
        "{err}"
    );
    let t = tokens_of(dir.path());
    assert_eq!(t.len(), 51, "every user frame still gets an agent frame");
    // Right after a reset the agent says what priming left in the ring: padding and silence.
    let silence = serde_json::json!([948, 243, 1178, 546, 1736, 1030, 1978, 2008]);
    let primed = t
        .iter()
        .filter(|f| f["text"] == 3 && f["audio"] == silence)
        .count();
    assert!(primed >= 3, "{primed} primed frames");

    let p = pipeline_yaml(dir.path(), &pack, ", max_positions: 30, long_session: stop");
    let o = run(&p);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "stopping at the limit is a clean end: {err}"
    );
    assert!(
        err.contains("ending the stream (long_session: stop)"),
        "{err}"
    );
    assert_eq!(tokens_of(dir.path()).len(), 19);
    // The audio written so far is a complete file.
    let mut r = WavReader::open(&dir.path().join("out.wav")).unwrap();
    assert!(r.read_all().unwrap().len() >= 17 * 3840);
}

#[test]
fn cuda_on_a_cpu_build_fails_clearly_unless_fallback_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    write_input(&dir.path().join("in.wav"));
    let pack = packs::pack("tiny-gqa");
    let p = pipeline_yaml(dir.path(), &pack, ", execution_provider: cuda");
    let o = run(&p);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("stage `temporal`: `execution_provider`: temporal: execution provider `cuda` is not available"),
        "{err}"
    );
    assert!(err.contains("allow_fallback"), "{err}");
    let p = pipeline_yaml(
        dir.path(),
        &pack,
        ", execution_provider: cuda, allow_fallback: true",
    );
    let o = run(&p);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("running on the CPU because `allow_fallback` is set"),
        "{err}"
    );
    assert!(
        err.contains("graph=\"temporal\" execution_provider=\"cpu\""),
        "{err}"
    );
}

#[test]
fn a_voice_prompt_is_encoded_and_primes_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_input(&d.join("in.wav"));
    // A 0.5 s voice clip at 16 kHz: resampled to 24 kHz, 6 whole frames forced while priming.
    let mut voice = WavWriter::create(&d.join("voice.wav"), 16_000, WavFormat::I16).unwrap();
    let mut s = Synth::new(
        Waveform::Sine {
            freq: 220.0,
            amplitude: 0.4,
        },
        16_000,
    );
    let mut x = vec![0.0; 8000];
    s.fill(&mut x);
    voice.write(&x).unwrap();
    voice.finalize().unwrap();
    let pack = packs::pack("tiny-gqa");
    let plain = {
        let o = run(&pipeline_yaml(d, &pack, ""));
        assert!(o.status.success());
        std::fs::read_to_string(d.join("tokens.jsonl")).unwrap()
    };
    let extra = format!(", voice: {}/voice.wav", d.display());
    let o = run(&pipeline_yaml(d, &pack, &extra));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("LM warmed up and primed steps=18"),
        "6 voice frames + 2 × 6 spacers: {err}"
    );
    let voiced = std::fs::read_to_string(d.join("tokens.jsonl")).unwrap();
    assert_eq!(voiced.lines().count(), plain.lines().count());
    assert_ne!(voiced, plain, "the voice prompt changes the conversation");

    let mut short = WavWriter::create(&d.join("short.wav"), 24_000, WavFormat::I16).unwrap();
    short.write(&[0.1; 1000]).unwrap();
    short.finalize().unwrap();
    let extra = format!(", voice: {}/short.wav", d.display());
    let o = run(&pipeline_yaml(d, &pack, &extra));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("short.wav: the voice prompt is shorter than one frame"),
        "{err}"
    );
}

#[test]
fn skipping_the_substeps_nothing_reads_or_drawing_on_the_device_keeps_streams_identical() {
    let dir = tempfile::tempdir().unwrap();
    write_input(&dir.path().join("in.wav"));
    let pack = packs::pack("tiny-gqa");
    // A persona primes with forced agent codes: every substep of those steps is provided.
    let p = pipeline_yaml(dir.path(), &pack, ", persona_tokens: [5, 17, 33, 2]");
    for greedy in [false, true] {
        let mut streams = Vec::new();
        // (and with the audio drawn where the logits are, by the conversation's own depformer
        // and by the shared engine: the same streams again)
        let modes = [
            ("run", false, "own"),
            ("skip", false, "own"),
            ("skip", true, "own"),
            ("skip", true, "shared"),
        ];
        for (mode, device, engine) in modes {
            let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
                .args(["run", p.to_str().unwrap()])
                .args(["--set", &format!("stages.depformer.user_substeps={mode}")])
                .args(["--set", &format!("stages.depformer.greedy={greedy}")])
                .args([
                    "--set",
                    &format!("stages.depformer.device_sampling={device}"),
                ])
                .args(["--set", &format!("stages.depformer.engine={engine}")])
                .args(["--set", &format!("stages.temporal.engine={engine}")])
                .env("RUST_LOG", "info")
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr).to_string();
            assert!(o.status.success(), "{err}");
            assert_eq!(
                err.contains("the shared engine draws the audio where the logits are"),
                engine == "shared",
                "{err}"
            );
            let line = err
                .lines()
                .find(|l| l.contains("depformer finished"))
                .unwrap_or_else(|| panic!("no depformer summary\n{err}"))
                .to_string();
            let count = |k: &str| -> u64 {
                line.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{k} in {line}"))
            };
            let (run, skipped) = (count("substeps_run"), count("substeps_skipped"));
            match mode {
                "run" => assert_eq!(skipped, 0, "{line}"),
                // At least the 8 user substeps of every step, and whole priming steps.
                _ => assert!(skipped > run, "{line}"),
            }
            streams.push((tokens_of(dir.path()), run + skipped));
        }
        assert_eq!(streams[0].1, streams[1].1, "the same number of substeps");
        assert_eq!(streams[0].0.len(), 51);
        assert_eq!(
            streams[0].0, streams[1].0,
            "greedy {greedy}: skip changed the tokens"
        );
        assert_eq!(
            streams[1], streams[2],
            "greedy {greedy}: the device's draw changed the tokens"
        );
        assert_eq!(
            streams[1].0, streams[3].0,
            "greedy {greedy}: the shared engine's device draw changed the tokens"
        );
    }
}

/// `priming: chunked`: the wholly forced priming frames (voice prompt, spacers, persona) run as
/// prefills, a chunk per graph call, and the conversation that follows is the one stepped
/// priming gives, token for token: greedy on the standard graph, GQA f32 and GQA f16 and on a
/// shared engine's slot (which steps its frames, through the same forced path); sampled (seed
/// 5) where the prefill is exact, GQA f16 and the shared slot. (On f32 graphs a chunk's
/// reduction order moves logits by about 1e-6, which a sampled draw can meet at a boundary
/// after tens of frames; `tests/it/compute/model_temporal.rs` bounds the difference.)
#[test]
fn chunked_priming_gives_the_conversation_stepped_priming_gives() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_input(&d.join("in.wav"));
    // A 1 s voice clip: 12 frames forced while priming.
    let mut voice = WavWriter::create(&d.join("voice.wav"), 24_000, WavFormat::I16).unwrap();
    let mut s = Synth::new(
        Waveform::Sine {
            freq: 180.0,
            amplitude: 0.4,
        },
        24_000,
    );
    let mut x = vec![0.0; 24_000];
    s.fill(&mut x);
    voice.write(&x).unwrap();
    voice.finalize().unwrap();
    let persona: Vec<String> = (0..40).map(|i| (100 + 37 * i).to_string()).collect();
    let base = format!(
        ", voice: {}/voice.wav, persona_tokens: [{}]",
        d.display(),
        persona.join(", ")
    );
    for (name, engine, greedy) in [
        ("tiny", "", true),
        ("tiny-gqa", "", true),
        ("tiny-gqa-fp16", "", true),
        ("tiny-gqa-fp16", "", false),
        ("tiny-gqa", ", engine: shared", true),
        ("tiny-gqa", ", engine: shared", false),
    ] {
        let pack = packs::pack(name);
        let mut streams = Vec::new();
        for (mode, chunk) in [("stepped", 32), ("chunked", 16)] {
            let extra = format!("{base}{engine}, priming: {mode}, priming_chunk: {chunk}");
            let p = pipeline_yaml(d, &pack, &extra);
            if greedy {
                let text = std::fs::read_to_string(&p).unwrap();
                let text = text.replace(
                    &format!("seed: {SEED} }}"),
                    &format!("seed: {SEED}, greedy: true }}"),
                );
                assert!(text.contains("greedy: true"));
                std::fs::write(&p, text).unwrap();
            }
            let o = run(&p);
            let err = String::from_utf8_lossy(&o.stderr);
            let what = format!("{name}{engine} greedy={greedy} {mode}");
            assert!(o.status.success(), "{what}: {err}");
            // 12 voice frames + 6 spacers + 40 persona tokens + 6 spacers.
            assert!(err.contains("steps=64"), "{err}");
            let prefilled = err
                .split("prefilled=")
                .nth(1)
                .and_then(|t| t.split_whitespace().next())
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("no prefilled count: {err}"));
            if mode == "stepped" {
                assert_eq!(prefilled, 0, "{what}");
            } else {
                // Every step but the conversation's first (it runs nothing) is wholly forced.
                assert!(prefilled >= 60, "{what}: {prefilled} prefilled");
            }
            streams.push(std::fs::read_to_string(d.join("tokens.jsonl")).unwrap());
        }
        assert!(streams[0].lines().count() > 20, "{name}");
        assert_eq!(
            streams[0], streams[1],
            "{name}{engine} greedy={greedy}: chunked priming changed the conversation"
        );
    }
}

/// `priming: cached`: the first priming prefills and keeps the primed state; the re-primings of
/// the long-session policy restore it instead of running the frames, and the conversation is
/// the one chunked priming gives, token for token (sampled), on the standard graph and on GQA
/// f32 and f16. The user's codes come from a file: a codec restarts its stream at a new
/// conversation when its own thread sees it, so audio-fed runs differ after a re-prime.
#[test]
fn a_cached_primed_state_gives_the_conversation_priming_gives() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let frames: Vec<String> = (0..60)
        .map(|t| {
            let f: Vec<String> = (0..8)
                .map(|q| ((t * 131 + q * 577) % 2048).to_string())
                .collect();
            format!("[{}]", f.join(","))
        })
        .collect();
    std::fs::write(d.join("user.json"), frames.join("\n")).unwrap();
    let persona: Vec<String> = (0..12).map(|i| (300 + 53 * i).to_string()).collect();
    for (name, engine) in [
        ("tiny", ""),
        ("tiny-gqa", ""),
        ("tiny-gqa-fp16", ""),
        ("tiny-gqa", ", engine: shared"),
    ] {
        let pack = packs::pack(name);
        let pk = pack.display();
        let mut streams = Vec::new();
        for mode in ["chunked", "cached", "chunked"] {
            let text = format!(
                r#"
stages:
  user: {{ kind: codes_source, path: {dd}/user.json }}
  temporal: {{ kind: temporal, pack: {pk}, max_positions: 40, persona_tokens: [{persona}], priming: {mode}{engine} }}
  depformer: {{ kind: depformer, pack: {pk}, seed: {SEED}{engine} }}
  tokens: {{ kind: token_sink, path: {dd}/tokens.jsonl }}
links:
  - user -> temporal.codes
  - temporal.step -> depformer
  - {{ from: depformer, to: temporal.tokens, feedback: true }}
  - temporal.agent -> tokens
"#,
                dd = d.display(),
                persona = persona.join(", ")
            );
            let p = d.join("p.yaml");
            std::fs::write(&p, text).unwrap();
            let o = run(&p);
            let err = String::from_utf8_lossy(&o.stderr);
            let name = format!("{name}{engine}");
            assert!(o.status.success(), "{name} {mode}: {err}");
            let agains: Vec<&str> = err.lines().filter(|l| l.contains("primed again")).collect();
            assert!(agains.len() >= 2, "{name} {mode}: re-primed: {err}");
            for l in &agains {
                // 6 spacers + 12 persona tokens + 6 spacers: all but the first step forced.
                let (prefilled, restored) = if mode == "cached" { (0, 23) } else { (23, 0) };
                assert!(
                    l.contains(&format!("prefilled={prefilled}"))
                        && l.contains(&format!("restored={restored}")),
                    "{name} {mode}: {l}"
                );
            }
            streams.push(std::fs::read_to_string(d.join("tokens.jsonl")).unwrap());
        }
        assert_eq!(streams[0].lines().count(), 60, "{name}{engine}");
        assert_eq!(
            streams[0], streams[2],
            "{name}{engine}: a run is reproducible"
        );
        assert_eq!(
            streams[0], streams[1],
            "{name}{engine}: the restored state changed the conversation"
        );
    }
}
