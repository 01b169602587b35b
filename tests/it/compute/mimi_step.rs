//! Stateful streaming Mimi on the step graphs of the tiny packs and of the full-size codec
//! (built by `tools/make_mimi_step.py` from the exporter's offline graphs), through ONNX Runtime
//! and our step codec:
//! frame-by-frame coding equals whole-utterance coding for the first 10 s, and past them equals
//! an offline reference with the codec transformer's 250-frame window; fp16 against fp32; a
//! reset is a fresh stream; two hours of position change nothing; the GEMM-form RVQ gives the
//! broadcast form's codes; a pack without step graphs still runs, on the window; a new
//! conversation restarts the codec's streams; `tools/profile_step.py` accounts for a call's
//! time per operator type.

use crate::support::packs;

use std::path::{Path, PathBuf};
use std::process::Command;

use duplex::model::mimi::{MimiDecoder, MimiEncoder};
use duplex::model::mimi_step::StepCodec;
use duplex::model::pack::{FloatType, Pack, StepRole};
use duplex::model::session::SessionOptions;

const FRAME: usize = 1920;
const RATE: f64 = 24_000.0;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn python(args: &[&str]) {
    let o = Command::new(root().join(".venv/bin/python"))
        .args(args)
        .output()
        .expect("run .venv/bin/python (make setup)");
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Speech-like test signal: a voiced source (a gliding pitch with harmonics) in syllables of
/// 150-300 ms with pauses, formant-like resonances that move, and a little noise. `secs`
/// seconds, whole frames.
fn speechlike(secs: f64, seed: u64) -> Vec<f32> {
    let n = (secs * RATE) as usize / FRAME * FRAME;
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let mut noise = move || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((rng >> 33) as f64 / (1u64 << 31) as f64) - 1.0
    };
    let mut phase = 0.0f64;
    (0..n)
        .map(|i| {
            let t = i as f64 / RATE;
            let syllable = (t * 4.3).fract();
            let envelope = if syllable < 0.7 {
                (std::f64::consts::PI * syllable / 0.7).sin().powi(2)
            } else {
                0.0
            };
            let pitch = 120.0 + 40.0 * (t * 0.9).sin() + 25.0 * (t * 4.3).floor().rem_euclid(3.0);
            phase += 2.0 * std::f64::consts::PI * pitch / RATE;
            let formant = 1.0 + 0.5 * (t * 1.7).sin();
            let voiced: f64 = (1..12)
                .map(|h| {
                    let f = pitch * h as f64;
                    let gain = 1.0 / (1.0 + ((f - 700.0 * formant) / 300.0).powi(2))
                        + 0.5 / (1.0 + ((f - 1800.0 * formant) / 400.0).powi(2));
                    gain * (phase * h as f64).sin()
                })
                .sum();
            (0.25 * envelope * voiced + 0.01 * noise()) as f32
        })
        .collect()
}

fn opts() -> SessionOptions {
    SessionOptions::default()
}

fn step(pack: &Pack, role: StepRole, dtype: FloatType) -> StepCodec {
    StepCodec::open(pack, role, dtype, &opts()).expect("open step graph")
}

fn encode_frames(enc: &mut StepCodec, pcm: &[f32]) -> Vec<Vec<i64>> {
    pcm.chunks_exact(FRAME)
        .map(|f| enc.encode(f).unwrap())
        .collect()
}

fn decode_frames(dec: &mut StepCodec, codes: &[Vec<i64>]) -> Vec<f32> {
    codes
        .iter()
        .flat_map(|c| dec.decode(c, 2048).unwrap())
        .collect()
}

fn offline_codes(pack: &Pack, pcm: &[f32]) -> Vec<Vec<i64>> {
    MimiEncoder::open(pack, &opts(), 1)
        .unwrap()
        .encode(pcm)
        .unwrap()
}

fn offline_wav(pack: &Pack, codes: &[Vec<i64>]) -> Vec<f32> {
    MimiDecoder::open(pack, &opts(), 1)
        .unwrap()
        .decode(codes)
        .unwrap()
}

fn assert_same_codes(streamed: &[Vec<i64>], offline: &[Vec<i64>]) {
    assert_eq!(streamed.len(), offline.len());
    let differing: Vec<usize> = (0..streamed.len())
        .filter(|&t| streamed[t] != offline[t])
        .collect();
    assert!(
        differing.is_empty(),
        "frames whose codes differ: {differing:?}"
    );
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn snr_db(reference: &[f32], x: &[f32]) -> f64 {
    let s: f64 = reference.iter().map(|v| (*v as f64).powi(2)).sum();
    let e: f64 = reference
        .iter()
        .zip(x)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    10.0 * (s / e.max(1e-30)).log10()
}

fn tiny() -> Pack {
    Pack::open(&packs::pack("tiny")).unwrap()
}

/// The pack with the exporter's offline codec graphs given the 250-frame window
/// (`tools/mimi_window_reference.py`).
fn windowed_reference(dir: &Path) -> PathBuf {
    let out = dir.join("windowed");
    python(&[
        root()
            .join("tools/mimi_window_reference.py")
            .to_str()
            .unwrap(),
        packs::pack("tiny").to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    out
}

#[test]
fn streaming_equals_offline_for_the_first_ten_seconds() {
    let pack = tiny();
    let pcm = speechlike(9.0, 1);
    let offline = offline_codes(&pack, &pcm);
    let mut enc = step(&pack, StepRole::Encoder, FloatType::F32);
    let streamed = encode_frames(&mut enc, &pcm);
    assert_eq!(streamed.len(), 112);
    assert_same_codes(&streamed, &offline);
    // Not a constant: the codes follow the signal.
    let distinct: std::collections::HashSet<&Vec<i64>> = streamed.iter().collect();
    assert!(
        distinct.len() > 50,
        "{} distinct code frames",
        distinct.len()
    );

    let wav_offline = offline_wav(&pack, &offline);
    let mut dec = step(&pack, StepRole::Decoder, FloatType::F32);
    let wav = decode_frames(&mut dec, &offline);
    let d = max_diff(&wav, &wav_offline);
    let peak = wav_offline.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    eprintln!(
        "9 s: 112 frames of codes identical; waveform max difference {d:.2e} (peak {peak:.2})"
    );
    assert!(peak > 0.1, "peak {peak}");
    assert!(d < 1e-4, "waveform differs by {d}");
}

#[test]
fn past_ten_seconds_streaming_equals_the_windowed_offline_reference() {
    let dir = tempfile::tempdir().unwrap();
    let reference = Pack::open(&windowed_reference(dir.path())).unwrap();
    let pack = tiny();
    let pcm = speechlike(30.0, 2);
    let offline = offline_codes(&reference, &pcm);
    let mut enc = step(&pack, StepRole::Encoder, FloatType::F32);
    let streamed = encode_frames(&mut enc, &pcm);
    assert_eq!(streamed.len(), 375);
    assert_same_codes(&streamed, &offline);
    let wav_offline = offline_wav(&reference, &offline);
    let mut dec = step(&pack, StepRole::Decoder, FloatType::F32);
    let wav = decode_frames(&mut dec, &offline);
    let d = max_diff(&wav, &wav_offline);
    // The reference is not the unwindowed graph: past 10 s that one differs.
    let unwindowed = offline_codes(&pack, &pcm);
    let late_differ = (125..375).filter(|&t| unwindowed[t] != offline[t]).count();
    eprintln!(
        "30 s: 375 frames identical to the windowed reference; waveform max difference {d:.2e}; \
         the unwindowed graph differs on {late_differ} of the 250 frames past 10 s"
    );
    assert!(d < 1e-4, "waveform differs by {d}");
    assert!(late_differ > 25, "{late_differ}");
}

#[test]
fn fp16_step_graphs_agree_with_fp32() {
    let pack = tiny();
    let pcm = speechlike(9.0, 3);
    let c32 = encode_frames(&mut step(&pack, StepRole::Encoder, FloatType::F32), &pcm);
    let mut e16 = step(&pack, StepRole::Encoder, FloatType::F16);
    assert_eq!(e16.runs_on(), "cpu f16 stateful");
    let c16 = encode_frames(&mut e16, &pcm);
    let same = (0..c32.len()).filter(|&t| c32[t] == c16[t]).count();
    let agree = same as f64 / c32.len() as f64;
    let w32 = decode_frames(&mut step(&pack, StepRole::Decoder, FloatType::F32), &c32);
    let w16 = decode_frames(&mut step(&pack, StepRole::Decoder, FloatType::F16), &c32);
    let snr = snr_db(&w32, &w16);
    eprintln!(
        "fp16 against fp32: codes equal on {same} of {} frames ({:.1} %), decoded SNR {snr:.1} dB",
        c32.len(),
        agree * 100.0
    );
    assert!(agree >= 0.9, "codes agree on {:.1} %", agree * 100.0);
    assert!(snr >= 40.0, "SNR {snr:.1} dB");
}

#[test]
fn after_a_reset_the_next_frames_equal_a_fresh_streams() {
    let pack = tiny();
    let a = speechlike(4.0, 4);
    let b = speechlike(3.0, 5);
    let mut enc = step(&pack, StepRole::Encoder, FloatType::F32);
    let mut dec = step(&pack, StepRole::Decoder, FloatType::F32);
    let codes_a = encode_frames(&mut enc, &a);
    let _ = decode_frames(&mut dec, &codes_a);
    // Without a reset the stream carries the past: the codes of `b` differ from a fresh start.
    let mut carried = step(&pack, StepRole::Encoder, FloatType::F32);
    encode_frames(&mut carried, &a);
    let carried_b = encode_frames(&mut carried, &b);
    enc.reset().unwrap();
    dec.reset().unwrap();
    assert_eq!(enc.counter("encoder_transformer.position"), Some(0));
    let after = encode_frames(&mut enc, &b);
    let fresh = encode_frames(&mut step(&pack, StepRole::Encoder, FloatType::F32), &b);
    assert_eq!(after, fresh);
    assert_ne!(
        carried_b, fresh,
        "the state is real: a carried stream differs"
    );
    let wav_after = decode_frames(&mut dec, &fresh);
    let wav_fresh = decode_frames(&mut step(&pack, StepRole::Decoder, FloatType::F32), &fresh);
    assert_eq!(wav_after, wav_fresh);
}

#[test]
fn two_hours_of_position_change_nothing() {
    // 90 000 frames of 80 ms (2 h) are 180 000 transformer frames.
    let pack = tiny();
    let pcm = speechlike(12.0, 6);
    let at_zero = encode_frames(&mut step(&pack, StepRole::Encoder, FloatType::F32), &pcm);
    let mut late = step(&pack, StepRole::Encoder, FloatType::F32);
    late.set_position(180_000).unwrap();
    let at_late = encode_frames(&mut late, &pcm);
    assert_eq!(
        late.counter("encoder_transformer.position"),
        Some(180_000 + 2 * 150)
    );
    assert_eq!(at_zero, at_late);
    let w0 = decode_frames(
        &mut step(&pack, StepRole::Decoder, FloatType::F32),
        &at_zero,
    );
    let mut dl = step(&pack, StepRole::Decoder, FloatType::F32);
    dl.set_position(180_000).unwrap();
    let wl = decode_frames(&mut dl, &at_zero);
    let d = max_diff(&w0, &wl);
    eprintln!("at position 180000 (2 h): 150 frames of codes identical, waveform within {d:.2e}");
    assert!(d < 1e-4, "{d}");
}

#[test]
fn the_gemm_rvq_gives_the_broadcast_forms_codes() {
    let (_keep, copy) = packs::without_step_graphs("tiny");
    python(&[
        root().join("tools/make_mimi_step.py").to_str().unwrap(),
        copy.to_str().unwrap(),
        "--dtype",
        "f32",
        "--rvq",
        "broadcast",
        "-q",
    ]);
    let broadcast = Pack::open(&copy).unwrap();
    let pack = tiny();
    let mut g = step(&pack, StepRole::Encoder, FloatType::F32);
    let mut b = step(&broadcast, StepRole::Encoder, FloatType::F32);
    assert_eq!(g.manifest.rvq.as_deref(), Some("gemm"));
    assert_eq!(b.manifest.rvq.as_deref(), Some("broadcast"));
    for seed in [7, 8] {
        let pcm = speechlike(9.0, seed);
        assert_eq!(encode_frames(&mut g, &pcm), encode_frames(&mut b, &pcm));
        g.reset().unwrap();
        b.reset().unwrap();
    }
}

fn run_pipeline(pack: &Path, dir: &Path, secs: f64, extra: &[&str]) -> std::process::Output {
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let input = out.join("in.wav");
    let mut w =
        duplex::audio::WavWriter::create(&input, 24_000, duplex::audio::WavFormat::I16).unwrap();
    w.write(&speechlike(secs, 9)).unwrap();
    w.finalize().unwrap();
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .current_dir(root())
        .args(["run", "pipelines/duplex-file.yaml"])
        .args([
            "--set",
            &format!("stages.encode.pack={}", pack.display()),
            "--set",
            &format!("stages.temporal.pack={}", pack.display()),
            "--set",
            &format!("stages.depformer.pack={}", pack.display()),
            "--set",
            &format!("stages.decode.pack={}", pack.display()),
            "--set",
            &format!("stages.source.path={}", input.display()),
            "--set",
            &format!("stages.sink.path={}", out.join("agent.wav").display()),
            "--set",
            &format!("stages.tokens.path={}", out.join("tokens.jsonl").display()),
        ])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn the_pipeline_logs_its_strategy_and_a_pack_without_step_graphs_runs_on_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let o = run_pipeline(&packs::pack("tiny-gqa"), dir.path(), 2.0, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(r#"codec streaming stage="encode" strategy="stateful" dtype="f32" why="the pack has step graphs""#),
        "{err}"
    );
    assert!(
        err.contains(r#"stage="decode" strategy="stateful""#),
        "{err}"
    );

    let (_keep, bare) = packs::without_step_graphs("tiny-gqa");
    let o = run_pipeline(&bare, dir.path(), 2.0, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(r#"codec streaming stage="encode" strategy="window" dtype="f32" why="the pack has no step graphs""#),
        "{err}"
    );
    // Asking for the step graphs of a pack that has none is refused before start.
    let o = run_pipeline(
        &bare,
        dir.path(),
        2.0,
        &["--set", "stages.encode.streaming=stateful"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("streaming"), "{err}");
    assert!(err.contains("tools/make_mimi_step.py"), "{err}");
    // A pack.yaml that lists step graphs the folders lack is refused, naming the folder.
    let (_keep2, lying) = packs::variant("tiny-gqa", "mimi_streaming: [window, stateful]\n");
    std::fs::remove_file(lying.join("mimi_decoder_step")).unwrap();
    let o = run_pipeline(&lying, dir.path(), 2.0, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("mimi_decoder_step"), "{err}");
}

#[test]
fn a_new_conversation_starts_new_codec_streams() {
    // The long-session policy re-primes every ~28 frames at 40 positions: each new conversation
    // restarts the encoder's and the decoder's streams.
    let dir = tempfile::tempdir().unwrap();
    let o = run_pipeline(
        &packs::pack("tiny-gqa"),
        dir.path(),
        6.0,
        &["--set", "stages.temporal.max_positions=40"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let resets = err
        .matches("resetting the conversation and priming again")
        .count();
    let enc = err
        .matches("new conversation: a new encoder stream")
        .count();
    let dec = err
        .matches("new conversation: a new decoder stream")
        .count();
    assert!(resets >= 2, "{resets} resets\n{err}");
    // The encoder runs ahead of the LM (its channel holds a few frames): a reset in the last
    // frames of the input may come after its last frame.
    assert!(
        (resets - 1..=resets).contains(&enc),
        "{enc} of {resets}\n{err}"
    );
    assert!(
        (resets - 1..=resets).contains(&dec),
        "{dec} of {resets}\n{err}"
    );
}

#[test]
fn at_the_real_codecs_size_streaming_equals_offline_and_fp16_agrees() {
    // The full-size Mimi (random weights, the published shapes) with the tiny LM.
    let pack = Pack::open(&packs::pack("tiny-gqa-mimi-full")).unwrap();
    let pcm = speechlike(6.0, 10);
    let offline = offline_codes(&pack, &pcm);
    let mut enc = step(&pack, StepRole::Encoder, FloatType::F32);
    assert_eq!(enc.manifest.states.len(), 29);
    let streamed = encode_frames(&mut enc, &pcm);
    assert_same_codes(&streamed, &offline);
    let wav_offline = offline_wav(&pack, &offline);
    let wav = decode_frames(
        &mut step(&pack, StepRole::Decoder, FloatType::F32),
        &offline,
    );
    let d = max_diff(&wav, &wav_offline);
    let c16 = encode_frames(&mut step(&pack, StepRole::Encoder, FloatType::F16), &pcm);
    let same = (0..c16.len()).filter(|&t| c16[t] == offline[t]).count();
    let w16 = decode_frames(
        &mut step(&pack, StepRole::Decoder, FloatType::F16),
        &offline,
    );
    let snr = snr_db(&wav, &w16);
    eprintln!(
        "full-size Mimi, 6 s: {} frames of codes identical, waveform within {d:.2e}; fp16 codes \
         equal on {same} of {} frames, decoded SNR {snr:.1} dB",
        streamed.len(),
        c16.len()
    );
    assert!(d < 1e-4, "waveform differs by {d}");
    assert!(
        same as f64 >= 0.9 * c16.len() as f64,
        "{same} of {}",
        c16.len()
    );
    assert!(snr >= 40.0, "SNR {snr:.1} dB");
}

/// Several streams stepped together, one batch row each (`StepCodec::open_rows`): every row's
/// codes are those of its stream coded alone and its decoded samples within 1e-6 of them, for
/// 10 s on the tiny and the full-size codec, with one row restarted mid-stream
/// (`reset_row`): that row then equals a fresh stream and the others do not notice.
#[test]
// Frame `t` of every row: the index is the time, not a walk over one sequence.
#[allow(clippy::needless_range_loop)]
fn streams_stepped_together_equal_each_stream_alone() {
    const ROWS: usize = 3;
    let full = Pack::open(&packs::pack("tiny-gqa-mimi-full")).unwrap();
    for (name, pack, secs) in [("tiny", tiny(), 10.0), ("full-size", full, 10.0)] {
        let streams: Vec<Vec<f32>> = (0..ROWS).map(|r| speechlike(secs, 11 + r as u64)).collect();
        let frames = streams[0].len() / FRAME;
        // Row 1 starts a new stream at frame `restart` (its input from then on is stream 1
        // from its beginning again).
        let restart = frames / 2;
        let input = |r: usize, t: usize| -> &[f32] {
            let t = if r == 1 && t >= restart {
                t - restart
            } else {
                t
            };
            &streams[r][t * FRAME..(t + 1) * FRAME]
        };
        // Alone.
        let mut alone_codes: Vec<Vec<Vec<i64>>> = Vec::new();
        let mut alone_pcm: Vec<Vec<f32>> = Vec::new();
        for r in 0..ROWS {
            let mut enc = step(&pack, StepRole::Encoder, FloatType::F32);
            let mut dec = step(&pack, StepRole::Decoder, FloatType::F32);
            let mut codes = Vec::new();
            let mut pcm = Vec::new();
            for t in 0..frames {
                if r == 1 && t == restart {
                    enc.reset().unwrap();
                    dec.reset().unwrap();
                }
                let c = enc.encode(input(r, t)).unwrap();
                pcm.extend(dec.decode(&c, 2048).unwrap());
                codes.push(c);
            }
            alone_codes.push(codes);
            alone_pcm.push(pcm);
        }
        // Together.
        let open = |role| StepCodec::open_rows(&pack, role, FloatType::F32, &opts(), ROWS).unwrap();
        let (mut enc, mut dec) = (open(StepRole::Encoder), open(StepRole::Decoder));
        let mut pcm: Vec<Vec<f32>> = vec![Vec::new(); ROWS];
        for t in 0..frames {
            if t == restart {
                enc.reset_row(1).unwrap();
                dec.reset_row(1).unwrap();
            }
            let batch: Vec<f32> = (0..ROWS).flat_map(|r| input(r, t).to_vec()).collect();
            let codes = enc.encode_rows(&batch).unwrap();
            for r in 0..ROWS {
                assert_eq!(
                    &codes[r * 8..(r + 1) * 8],
                    &alone_codes[r][t][..],
                    "{name}: row {r}, frame {t}"
                );
            }
            let out = dec.decode_rows(&codes, 2048).unwrap();
            for r in 0..ROWS {
                pcm[r].extend_from_slice(&out[r * FRAME..(r + 1) * FRAME]);
            }
        }
        for r in 0..ROWS {
            let d = max_diff(&pcm[r], &alone_pcm[r]);
            assert!(d <= 1e-6, "{name}: row {r}'s samples differ by {d}");
        }
    }
    // A wrong number of rows is refused, naming it.
    let mut enc =
        StepCodec::open_rows(&tiny(), StepRole::Encoder, FloatType::F32, &opts(), 2).unwrap();
    let e = enc.encode(&[0.0; FRAME]).unwrap_err().to_string();
    assert!(e.contains("2 rows of 1920"), "{e}");
}

/// One stream of a batched schedule: it holds `slot` from tick `join` on, codes `frames`
/// frames of its clip, has no frame at the ticks `idle` picks, and (when `restart` is some)
/// starts its clip over at that frame of its own.
struct Scheduled {
    slot: usize,
    join: usize,
    frames: usize,
    restart: Option<usize>,
    idle: fn(usize) -> bool,
    clip: Vec<f32>,
}

impl Scheduled {
    /// The clip's frame for the stream's `k`-th frame.
    fn frame(&self, k: usize) -> &[f32] {
        let k = match self.restart {
            Some(r) if k >= r => k - r,
            _ => k,
        };
        &self.clip[k * FRAME..(k + 1) * FRAME]
    }
}

/// A shared codec's tick steps only the rows that have a frame (the step graphs' `active`
/// input): on the tiny and the full-size codec, streams that join and leave at different
/// ticks, skip ticks, restart mid-stream and reuse a slot give, row by row, the codes of each
/// stream coded alone and samples within 1e-6 of its own decoding; a row left out of a call
/// keeps every state byte, and a slot nobody uses stays at its initial state.
#[test]
fn rows_left_out_of_a_call_keep_their_state_and_every_stream_equals_itself_alone() {
    const SLOTS: usize = 4;
    let full = Pack::open(&packs::pack("tiny-gqa-mimi-full")).unwrap();
    for (name, pack) in [("tiny", tiny()), ("full-size", full)] {
        let streams = [
            // 10 s, idle at every third tick.
            Scheduled {
                slot: 0,
                join: 0,
                frames: 125,
                restart: None,
                idle: |t| t % 3 == 1,
                clip: speechlike(10.0, 21),
            },
            // Joins late, leaves early: its slot is reused by the fourth stream.
            Scheduled {
                slot: 1,
                join: 7,
                frames: 60,
                restart: None,
                idle: |t| t % 5 == 0,
                clip: speechlike(5.0, 22),
            },
            // Restarts its clip at its 40th frame (a new conversation).
            Scheduled {
                slot: 2,
                join: 20,
                frames: 110,
                restart: Some(40),
                idle: |t| t % 7 == 3,
                clip: speechlike(10.0, 23),
            },
            Scheduled {
                slot: 1,
                join: 100,
                frames: 70,
                restart: None,
                idle: |_| false,
                clip: speechlike(6.0, 24),
            },
        ];
        // Alone: each stream on a codec of its own.
        let alone: Vec<(Vec<Vec<i64>>, Vec<f32>)> = streams
            .iter()
            .map(|s| {
                let mut enc = step(&pack, StepRole::Encoder, FloatType::F32);
                let mut dec = step(&pack, StepRole::Decoder, FloatType::F32);
                let (mut codes, mut pcm) = (Vec::new(), Vec::new());
                for k in 0..s.frames {
                    if s.restart == Some(k) {
                        enc.reset().unwrap();
                        dec.reset().unwrap();
                    }
                    let c = enc.encode(s.frame(k)).unwrap();
                    pcm.extend(dec.decode(&c, 2048).unwrap());
                    codes.push(c);
                }
                (codes, pcm)
            })
            .collect();
        // Together, one tick at a time.
        let open =
            |role| StepCodec::open_rows(&pack, role, FloatType::F32, &opts(), SLOTS).unwrap();
        let (mut enc, mut dec) = (open(StepRole::Encoder), open(StepRole::Decoder));
        assert!(enc.steps_some_rows() && dec.steps_some_rows());
        let unused = enc.row_state(3);
        assert!(unused.iter().all(|b| *b == 0));
        let mut done = vec![0usize; streams.len()];
        let mut codes_out: Vec<Vec<Vec<i64>>> = vec![Vec::new(); streams.len()];
        let mut pcm_out: Vec<Vec<f32>> = vec![Vec::new(); streams.len()];
        let (mut idle_checks, mut ticks) = (0, 0);
        for t in 0.. {
            if done.iter().zip(&streams).all(|(d, s)| *d == s.frames) {
                break;
            }
            let mut active = [false; SLOTS];
            let mut who = [None; SLOTS];
            let mut pcm_in = vec![0.0f32; SLOTS * FRAME];
            for (i, s) in streams.iter().enumerate() {
                if t < s.join || done[i] == s.frames || (s.idle)(t) {
                    continue;
                }
                if done[i] == 0 || s.restart == Some(done[i]) {
                    enc.reset_row(s.slot).unwrap();
                    dec.reset_row(s.slot).unwrap();
                }
                active[s.slot] = true;
                who[s.slot] = Some(i);
                pcm_in[s.slot * FRAME..(s.slot + 1) * FRAME].copy_from_slice(s.frame(done[i]));
            }
            let before: Vec<Option<(Vec<u8>, Vec<u8>)>> = (0..SLOTS)
                .map(|r| (!active[r]).then(|| (enc.row_state(r), dec.row_state(r))))
                .collect();
            let codes = enc.encode_some(&pcm_in, Some(&active)).unwrap();
            // The codes of idle rows are meaningless: the decoder gets zeros there.
            let mut codes_in = vec![0i64; SLOTS * 8];
            for r in (0..SLOTS).filter(|r| active[*r]) {
                codes_in[r * 8..(r + 1) * 8].copy_from_slice(&codes[r * 8..(r + 1) * 8]);
            }
            let pcm = dec.decode_some(&codes_in, Some(&active), 2048).unwrap();
            ticks += 1;
            for r in 0..SLOTS {
                if let Some((e, d)) = &before[r] {
                    assert!(
                        enc.row_state(r) == *e && dec.row_state(r) == *d,
                        "{name}: row {r}, left out of tick {t}, changed"
                    );
                    idle_checks += 1;
                }
                if let Some(i) = who[r] {
                    codes_out[i].push(codes[r * 8..(r + 1) * 8].to_vec());
                    pcm_out[i].extend_from_slice(&pcm[r * FRAME..(r + 1) * FRAME]);
                    done[i] += 1;
                }
            }
        }
        assert_eq!(enc.row_state(3), unused, "{name}: the unused slot");
        for (i, (codes, pcm)) in alone.iter().enumerate() {
            assert_same_codes(&codes_out[i], codes);
            let d = max_diff(&pcm_out[i], pcm);
            assert!(d <= 1e-6, "{name}: stream {i}'s samples differ by {d}");
        }
        eprintln!(
            "{name}: {ticks} ticks, {idle_checks} rows left out and unchanged, 4 streams equal alone"
        );
    }
    // A graph without the `active` input cannot leave a row out, and says how to rebuild it.
    let (_keep, old) = packs::without_active_input("tiny");
    let old = Pack::open(&old).unwrap();
    let mut enc =
        StepCodec::open_rows(&old, StepRole::Encoder, FloatType::F32, &opts(), 2).unwrap();
    assert!(!enc.steps_some_rows());
    enc.encode_rows(&[0.0; 2 * FRAME]).unwrap();
    let e = enc
        .encode_some(&[0.0; 2 * FRAME], Some(&[true, false]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("active") && e.contains("make_mimi_step.py"),
        "{e}"
    );
}

/// The shared codec engine (`SharedCodec`), on its own threads, with conversations on threads
/// of theirs that come and go at their own pace: the 9 s clip's codes equal the offline
/// encoder's, the 30 s clip's equal the windowed offline reference's, a third conversation
/// leaves halfway and a fourth takes its slot, and every decoded stream is within 1e-6 of the
/// same codes decoded alone. Ticks batched more than one row.
#[test]
fn the_shared_codec_engine_codes_every_conversation_as_if_alone() {
    use duplex::model::engine::{CodecOptions, SharedCodec};
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let reference = Pack::open(&windowed_reference(dir.path())).unwrap();
    let pack = tiny();
    let opts = CodecOptions {
        slots: 3,
        ..Default::default()
    };
    let enc = Arc::new(SharedCodec::open(&pack, StepRole::Encoder, FloatType::F32, &opts).unwrap());
    let dec = Arc::new(SharedCodec::open(&pack, StepRole::Decoder, FloatType::F32, &opts).unwrap());
    let clips = [
        speechlike(9.0, 1),
        speechlike(30.0, 2),
        speechlike(4.0, 3),
        speechlike(8.0, 4),
    ];
    let run = |clip: Vec<f32>, pause_every: usize, stop_after: Option<usize>| {
        let (enc, dec) = (enc.clone(), dec.clone());
        std::thread::spawn(move || {
            let mut e = enc.slot().unwrap();
            let mut d = dec.slot().unwrap();
            let rows = (e.row(), d.row());
            let (mut codes, mut pcm) = (Vec::new(), Vec::new());
            for (k, f) in clip.chunks_exact(FRAME).enumerate() {
                if stop_after == Some(k) {
                    break;
                }
                if k % pause_every == pause_every - 1 {
                    std::thread::sleep(std::time::Duration::from_millis(7));
                }
                let c = e.encode(f).unwrap();
                pcm.extend(d.decode(&c).unwrap());
                codes.push(c);
            }
            (codes, pcm, rows)
        })
    };
    let a = run(clips[0].clone(), 4, None);
    let b = run(clips[1].clone(), 5, None);
    let c = run(clips[2].clone(), 3, Some(25));
    let (c_codes, c_pcm, c_rows) = c.join().unwrap();
    // The third conversation has left: the fourth takes its slot.
    let d4 = run(clips[3].clone(), 6, None);
    let (a_codes, a_pcm, _) = a.join().unwrap();
    let (b_codes, b_pcm, _) = b.join().unwrap();
    let (d_codes, d_pcm, d_rows) = d4.join().unwrap();
    assert_eq!(
        c_rows, d_rows,
        "the fourth conversation reuses the third's slot"
    );
    assert_same_codes(&a_codes, &offline_codes(&pack, &clips[0]));
    assert_same_codes(&b_codes, &offline_codes(&reference, &clips[1]));
    for (name, clip, codes, pcm, n) in [
        ("9 s", &clips[0], &a_codes, &a_pcm, 112),
        ("30 s", &clips[1], &b_codes, &b_pcm, 375),
        ("leaving", &clips[2], &c_codes, &c_pcm, 25),
        ("reusing", &clips[3], &d_codes, &d_pcm, 100),
    ] {
        assert_eq!(codes.len(), n, "{name}");
        let mut e = step(&pack, StepRole::Encoder, FloatType::F32);
        let alone: Vec<Vec<i64>> = clip
            .chunks_exact(FRAME)
            .take(n)
            .map(|f| e.encode(f).unwrap())
            .collect();
        assert_same_codes(codes, &alone);
        let mut d = step(&pack, StepRole::Decoder, FloatType::F32);
        let d_alone = decode_frames(&mut d, codes);
        let diff = max_diff(pcm, &d_alone);
        assert!(diff <= 1e-6, "{name}: decoded samples differ by {diff}");
    }
    let s = &enc.stats;
    eprintln!(
        "encoder: {} ticks, mean batch {:.2}, max {}",
        s.ticks.load(std::sync::atomic::Ordering::Relaxed),
        s.mean_batch(),
        s.max_batch.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        s.max_batch.load(std::sync::atomic::Ordering::Relaxed) >= 2,
        "no tick batched two conversations"
    );
    assert_eq!(enc.free_slots(), 3, "every slot was given back");
}

/// `engine: shared` on the Mimi stages: a pipeline runs on the process's shared codec (logged,
/// and its output the same as on codecs of its own); on a pack whose step graphs were built
/// before the `active` input it is refused before start (exit 2), naming the pack and the
/// command that rebuilds them; and `streaming: window` cannot be shared.
#[test]
fn a_shared_codec_runs_a_pipeline_and_a_pack_that_cannot_batch_is_refused_before_start() {
    let dir = tempfile::tempdir().unwrap();
    let shared = [
        "--set",
        "stages.encode.engine=shared",
        "--set",
        "stages.decode.engine=shared",
        "--set",
        "stages.depformer.text_temperature=0",
        "--set",
        "stages.depformer.audio_temperature=0",
    ];
    let o = run_pipeline(&packs::pack("tiny-gqa"), dir.path(), 3.0, &shared);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("shared codec ready"), "{err}");
    let tokens = |d: &Path| std::fs::read_to_string(d.join("out/tokens.jsonl")).unwrap();
    let shared_tokens = tokens(dir.path());
    let own: Vec<&str> = shared[4..].to_vec();
    let o = run_pipeline(&packs::pack("tiny-gqa"), dir.path(), 3.0, &own);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Greedy, the same codes in: the same tokens out.
    assert!(shared_tokens.lines().count() >= 30, "{shared_tokens}");
    assert_eq!(shared_tokens, tokens(dir.path()));

    let (_keep, old) = packs::without_active_input("tiny-gqa");
    let o = run_pipeline(&old, dir.path(), 2.0, &shared);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&old.display().to_string()) && err.contains("tools/make_mimi_step.py"),
        "{err}"
    );
    assert!(err.contains("active"), "{err}");
    // The same pack on codecs of their own still runs.
    let o = run_pipeline(&old, dir.path(), 2.0, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let o = run_pipeline(
        &packs::pack("tiny-gqa"),
        dir.path(),
        2.0,
        &[
            "--set",
            "stages.encode.engine=shared",
            "--set",
            "stages.encode.streaming=window",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("engine") && err.contains("stateful"), "{err}");
}

/// `tools/profile_step.py`: both roles' step graphs profiled at each batch size, per operator
/// type, the kernels' time within the call's wall time; a bad batch list is refused (exit 2).
#[test]
fn the_step_profiler_accounts_for_a_calls_time_per_operator_type() {
    let o = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tools/profile_step.py"))
        .arg(root().join("models/tiny-gqa"))
        .args([
            "--batch", "1,4", "--calls", "5", "--nodes", "3", "--min-ms", "0",
        ])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for role in ["mimi_encoder_step", "mimi_decoder_step"] {
        let section = &out[out.find(role).unwrap_or_else(|| panic!("{role}: {out}"))..];
        let rows: Vec<Vec<f64>> = section
            .lines()
            .skip(2)
            .take_while(|l| !l.starts_with("slowest"))
            .map(|l| {
                l.split_whitespace()
                    .rev()
                    .take(4)
                    .map(|v| v.parse::<f64>().unwrap())
                    .collect()
            })
            .collect();
        let (wall, ops) = rows.split_last().unwrap();
        // Every operator type is listed (`--min-ms 0`), the codec's convolutions among them,
        // whatever their share of the time on this machine.
        assert!(ops.len() >= 3 && section.contains("\nConv "), "{section}");
        assert!(!section.contains("other types)"), "{section}");
        // Per column (B=4 per row, B=4 per call, B=1 per row, B=1 per call: reversed), the
        // operators' time is accounted inside the wall time of a call (one thread: kernels do
        // not overlap). How much of the wall time they fill is the machine's business (a busy
        // machine stretches the gaps between kernels), not the profiler's: not asserted.
        for c in 0..4 {
            let sum: f64 = ops.iter().map(|r| r[c]).sum();
            assert!(
                sum > 0.0 && sum <= wall[c] * 1.05,
                "{c}: {sum} vs {wall:?}\n{section}"
            );
        }
        // Per row at B = 4 is per call over 4.
        assert!(
            (wall[0] * 4.0 - wall[1]).abs() < 0.02 + wall[1] * 0.01,
            "{wall:?}"
        );
        assert!(
            section.contains("slowest nodes at B=4 (ms per call):"),
            "{section}"
        );
    }
    let o = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tools/profile_step.py"))
        .arg(root().join("models/tiny-gqa"))
        .args(["--batch", "1,x"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--batch '1,x'"));
}
