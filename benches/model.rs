//! Model-side benchmarks, each measured side by side in one run:
//!
//! 1. Temporal step time at KV length 50, 1000 and 2500 on the `small` pack (dim 512, 4 layers,
//!    8 heads × 64), resident cache vs the naive host round trip, for the GQA and the standard
//!    graph; and cache-buffer allocations per step.
//! 2. Resident memory over 6000 LM frames (tiny packs): flat once the context window is full.
//! 3. End-to-end frames per second of the full duplex pipeline on the tiny pack and with a
//!    full-size Mimi, and the completion interval against the sum of stage times; with the
//!    full-size Mimi, the window codec with every depformer substep against the stateful codec
//!    with the user stream's substeps skipped.
//! 4. The depformer's time per frame on the `small` pack with every substep run against the
//!    user stream's substeps skipped (`user_substeps: skip`), same tokens checked.
//! 5. The shared LM engine on the `small` pack: the time of one frame of B conversations
//!    stepped in batched ticks against the same B conversations stepped one after another on
//!    graphs of their own (B = 1, 2, 4, 8, 16), the tokens checked equal; and resident memory
//!    for 1 and 16 conversations both ways.
//!
//! 6. Full-size Mimi per frame: the stateful step graphs (fp32 and fp16) against the 8-frame
//!    rolling window, encoder and decoder.
//! 7. Priming's temporal frames on the `small` pack: 300 known frames stepped one by one
//!    against prefilled in chunks of 32 (`Temporal::prefill`), GQA and standard, the last
//!    frame's logits checked equal; and a whole priming (10 s voice prompt, 100-token persona,
//!    spacers: 237 steps) through the pipeline, `priming: stepped` against `chunked`, the
//!    conversation's tokens checked equal (greedy).
//!
//! 8. The full-size Mimi, B streams per tick: one call of B rows against B calls of one row.
//! 9. Quantized packs (`tools/quantize_pack.py`): the temporal step at KV length 50 and 1000 on
//!    the `small` LM, fp32 against int8 and int4, with the resident memory of each pack's LM
//!    (measured in a child process per pack) and its depformer frame; the full-size Mimi's
//!    step graphs fp32 against `--quantize-codec int8`, encode and decode, with the decoder's
//!    SNR; and the whole full-duplex loop (150 frames of silence, as fast as possible, full-size
//!    codec + tiny LM) with the int8 codec against the fp32 one.
//!
//! 10. One pack of your own, whatever its size (`pack-step PACK`, not in the default run): its
//!     temporal step at KV length 50 and 3000, the cache filled between them by prefill in
//!     chunks of 64 (a 7B stepped one frame at a time to 3000 on a CPU would take an hour), and
//!     one conversation's depformer frame, each the median of 10.
//!
//! `cargo bench --bench model [temporal|memory|e2e|depformer|engine|codec|prefill|codec-batch|quantized]`,
//! `cargo bench --bench model pack-step PACK`. Packs that are missing are built with `tools/make_pack.py`.

#[path = "support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use duplex::model::depformer::Depformer;
use duplex::model::lm::{LmLoop, SamplingConfig, SamplingHalf, TemporalHalf};
use duplex::model::lmgen::LmGen;
use duplex::model::pack::Pack;
use duplex::model::session::SessionOptions;
use duplex::model::temporal::{KvMode, TemporalOptions};

use support::{pack, quantized, root, with_step_graphs};

fn tokens(t: usize) -> Vec<i64> {
    let mut v = vec![((t * 7919) % 32_000) as i64];
    v.extend((1..17).map(|k| ((t * 31 + k * 97) % 2048) as i64));
    v
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Median step time over 25 steps starting at each KV length.
fn step_times(pack: &Pack, kv: KvMode, lengths: &[usize]) -> (Vec<Duration>, u64) {
    let mut t = duplex::model::temporal::open(
        pack,
        &TemporalOptions {
            kv,
            ..Default::default()
        },
    )
    .expect("open temporal");
    let mut out = Vec::new();
    let mut s = 0;
    let allocs_before = duplex::model::buffer_allocations();
    let mut allocs = 0;
    for &len in lengths {
        while t.kv_len() < len {
            t.step(&tokens(s)).unwrap();
            s += 1;
        }
        let a0 = duplex::model::buffer_allocations();
        let mut times = Vec::new();
        for _ in 0..25 {
            let t0 = Instant::now();
            t.step(&tokens(s)).unwrap();
            times.push(t0.elapsed());
            s += 1;
        }
        allocs = (duplex::model::buffer_allocations() - a0) / 25;
        out.push(median(times));
    }
    let _ = allocs_before;
    (out, allocs)
}

/// The median time of `n` depformer frames on `hidden`, the channels marked in `provided`
/// given (`target`'s tokens), the others sampled.
fn dep_frame_time(
    dep: &mut Depformer,
    hidden: &[f32],
    target: &[i64],
    provided: &[bool],
    n: usize,
) -> Duration {
    use duplex::model::depformer::DepformerInput;
    use duplex::model::sampling::{Sampler, SamplingParams};
    let frame = DepformerInput {
        hidden,
        text: 3,
        target,
        provided,
    };
    let mut sampler = Sampler::new(5);
    let mut out = Vec::new();
    median(
        (0..n)
            .map(|_| {
                let t0 = Instant::now();
                dep.run(frame, &mut sampler, SamplingParams::AUDIO, &mut out)
                    .unwrap();
                t0.elapsed()
            })
            .collect(),
    )
}

/// Section 10: `pack`'s temporal step at KV length 50 and 3000 (the cache filled by prefill)
/// and its depformer frame.
fn pack_step_bench(dir: &Path) {
    let pack = Pack::open(dir).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "\n== the temporal step of {} at KV length 50 and 3000 ==",
        dir.display()
    );
    let mut t = duplex::model::temporal::open(
        &pack,
        &TemporalOptions {
            max_positions: 3100,
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut medians = Vec::new();
    for len in [50usize, 3000] {
        let gap: Vec<Vec<i64>> = (t.kv_len()..len).map(tokens).collect();
        let t0 = Instant::now();
        t.prefill(&gap, 64).unwrap();
        let fill = t0.elapsed();
        let mut times = Vec::new();
        for i in 0..10 {
            let t0 = Instant::now();
            t.step(&tokens(len + i)).unwrap();
            times.push(t0.elapsed());
        }
        let m = median(times);
        println!(
            "  KV {len:>4}: step {:>9.1} ms (median of 10; {} frames prefilled before, in {:.1} s)",
            m.as_secs_f64() * 1e3,
            gap.len(),
            fill.as_secs_f64()
        );
        medians.push(m);
    }
    println!(
        "  KV 3000 / KV 50: {:.2}",
        medians[1].as_secs_f64() / medians[0].as_secs_f64()
    );
    use duplex::model::depformer::UnusedSubsteps;
    let mut dep =
        Depformer::open(&pack, &SessionOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let steps = dep.steps();
    let mut hidden = Vec::new();
    t.read_hidden(&mut hidden);
    let target: Vec<i64> = (0..steps as i64).map(|i| i * 3 + 1).collect();
    let provided: Vec<bool> = (0..steps).map(|i| i >= steps / 2).collect();
    let mut per = Vec::new();
    for mode in [UnusedSubsteps::Run, UnusedSubsteps::Skip] {
        dep.unused = mode;
        per.push(dep_frame_time(&mut dep, &hidden, &target, &provided, 10).as_secs_f64() * 1e3);
    }
    println!(
        "  depformer frame: every substep {:.1} ms, the user's skipped {:.1} ms (medians of 10)",
        per[0], per[1]
    );
}

fn temporal_bench() {
    println!("\n1. temporal step time by KV length, small pack (dim 512, 4 layers, 8 heads x 64), 1 thread");
    let lengths = [50, 1000, 2500];
    for (name, variant) in [("small-gqa", "gqa"), ("small", "standard")] {
        let dir = pack(name, &["--size", "small", "--variant", variant]);
        let p = Pack::open(&dir).unwrap();
        let (res, res_allocs) = step_times(&p, KvMode::Resident, &lengths);
        let (host, host_allocs) = step_times(&p, KvMode::Host, &lengths);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for (i, l) in lengths.iter().enumerate() {
            println!(
                "   {variant:<8} kv {l:>4}: resident {:7.3} ms   host round trip {:7.3} ms",
                ms(res[i]),
                ms(host[i])
            );
        }
        let inc_res = ms(res[2]) - ms(res[0]);
        let inc_host = ms(host[2]) - ms(host[0]);
        println!(
            "   {variant:<8} increase 50 -> 2500: resident {inc_res:+.3} ms, host {inc_host:+.3} ms -> ratio {:.2} (target <= 0.33)",
            inc_res / inc_host
        );
        println!(
            "   {variant:<8} cache-buffer allocations per step: resident {res_allocs}, host {host_allocs}"
        );
    }
}

fn rss_mb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / 1e6
}

fn memory_bench() {
    println!("\n2. resident memory over 6000 LM frames (tiny packs, resident cache, warmed up)");
    for name in ["tiny-gqa", "tiny"] {
        let p = Pack::open(&pack(name, &[])).unwrap();
        let so = SessionOptions::default();
        let m = p.manifest.clone();
        let mut lm = LmLoop {
            temporal: TemporalHalf::new(
                LmGen::new(m.layout()),
                duplex::model::temporal::open(&p, &TemporalOptions::default()).unwrap(),
            ),
            sampling: SamplingHalf::new(
                Depformer::open(&p, &so).unwrap(),
                SamplingConfig::default(),
            ),
        };
        let mut marks = Vec::new();
        let t0 = Instant::now();
        for s in 0..6000 {
            let user: Vec<i64> = tokens(s)[9..].to_vec();
            lm.step(&user, None, None).unwrap();
            if (s + 1) % 1000 == 0 {
                marks.push((s + 1, rss_mb(), lm.temporal.temporal.kv_len()));
            }
        }
        let line: Vec<String> = marks
            .iter()
            .map(|(s, mb, kv)| format!("{s}: {mb:.1} MB (kv {kv})"))
            .collect();
        println!("   {name:<9} {}", line.join(", "));
        let full = marks
            .iter()
            .find(|(s, _, _)| *s >= 3000)
            .map(|m| m.1)
            .unwrap_or(0.0);
        let last = marks.last().map(|m| m.1).unwrap_or(0.0);
        println!(
            "   {name:<9} after the window is full (3000 -> 6000 frames): {:+.1} MB; {:.2} ms per LM frame",
            last - full,
            t0.elapsed().as_secs_f64() * 1e3 / 6000.0
        );
    }
}

fn e2e_bench() {
    println!("\n3. end-to-end: full duplex pipeline on a 12 s input, as fast as possible");
    let dir = tempfile_dir();
    // 12 s of noise at 48 kHz as input.
    let input = dir.join("in.wav");
    let mut s = duplex::audio::Synth::new(
        duplex::audio::Waveform::Noise {
            amplitude: 0.3,
            seed: 1,
        },
        48_000,
    );
    let mut x = vec![0.0; 48_000 * 12];
    s.fill(&mut x);
    let mut w =
        duplex::audio::WavWriter::create(&input, 48_000, duplex::audio::WavFormat::I16).unwrap();
    w.write(&x).unwrap();
    w.finalize().unwrap();
    let set = duplex::config::Override::set;
    let before = || {
        vec![
            set("stages.encode.streaming", "window"),
            set("stages.decode.streaming", "window"),
            set("stages.depformer.user_substeps", "run"),
        ]
    };
    let mut intervals = Vec::new();
    for (label, name, args, sets) in [
        ("tiny pack", "tiny-gqa", vec![], vec![]),
        (
            "full Mimi, window + every substep",
            "small-gqa-fullmimi",
            vec!["--size", "small", "--variant", "gqa", "--mimi", "full"],
            before(),
        ),
        (
            "full Mimi, stateful + user substeps skipped",
            "small-gqa-fullmimi",
            vec!["--size", "small", "--variant", "gqa", "--mimi", "full"],
            vec![],
        ),
    ] {
        let p = with_step_graphs(pack(name, &args));
        let file = file_pipeline(&dir, &p, &input);
        let report = duplex::app::run_file(&file, &sets).expect("pipeline runs");
        let (frames, fps, interval, per_stage) =
            loop_figures(&report, &["encode", "temporal", "depformer", "decode"]);
        let sum: f64 = ["encode", "temporal", "depformer", "decode"]
            .iter()
            .map(|s| {
                let st = report.stage(s).unwrap();
                st.service.sum().as_secs_f64() / frames as f64
            })
            .sum();
        println!(
            "   {label:<44} {fps:6.1} frames/s ({:.2}x real time); per frame ms: {}; completion interval p50 {:.2} ms vs sum of stage times {:.2} ms -> {:.2}",
            fps * 0.08,
            per_stage.join(", "),
            interval * 1e3,
            sum * 1e3,
            interval / sum
        );
        intervals.push(interval);
    }
    println!(
        "   full Mimi: completion interval stateful + skip / window + every substep: {:.2} ms / {:.2} ms = {:.2} (target <= 0.35; real time is 80 ms)",
        intervals[2] * 1e3,
        intervals[1] * 1e3,
        intervals[2] / intervals[1]
    );
}

/// Of a 12 s file pipeline's report: its frames (150, checked), frames per second, the sink's
/// completion interval p50 (s), and `stages`' service time per frame (`"name ms"`).
fn loop_figures(
    report: &duplex::runtime::RunReport,
    stages: &[&str],
) -> (usize, f64, f64, Vec<String>) {
    let frames = report.stage("temporal").unwrap().frames;
    assert_eq!(frames, 150, "12 s = 150 frames");
    let fps = frames as f64 / report.wall.as_secs_f64();
    let interval = report
        .stage("sink")
        .unwrap()
        .completion
        .quantile(0.5)
        .as_secs_f64();
    let per = stages
        .iter()
        .map(|s| {
            let st = report.stage(s).unwrap();
            format!(
                "{s} {:.2}",
                st.service.sum().as_secs_f64() * 1e3 / frames as f64
            )
        })
        .collect();
    (frames as usize, fps, interval, per)
}

/// The pack, with Mimi's step graphs added (`tools/make_mimi_step.py`) if it was built without.
/// `pipelines/duplex-file.yaml` on pack `p` and `input`, writing into `dir` (`agent.wav`,
/// `tokens.jsonl`): its path.
fn file_pipeline(dir: &Path, p: &Path, input: &Path) -> PathBuf {
    let yaml = std::fs::read_to_string(root().join("pipelines/duplex-file.yaml"))
        .unwrap()
        .replace("models/tiny-gqa", p.to_str().unwrap())
        .replace("out/tone-48k.wav", input.to_str().unwrap())
        .replace("out/agent-48k.wav", dir.join("agent.wav").to_str().unwrap())
        .replace(
            "out/agent-tokens.jsonl",
            dir.join("tokens.jsonl").to_str().unwrap(),
        );
    let file = dir.join("p.yaml");
    std::fs::write(&file, yaml).unwrap();
    file
}

/// The pack with the full-size codec's step graphs, the session options of the codec
/// benchmarks, and a noise source (seeded).
fn full_codec(seed: u64) -> (Pack, SessionOptions, duplex::audio::Synth) {
    let dir = with_step_graphs(pack(
        "small-gqa-fullmimi",
        &["--size", "small", "--variant", "gqa", "--mimi", "full"],
    ));
    let noise = duplex::audio::Synth::new(
        duplex::audio::Waveform::Noise {
            amplitude: 0.2,
            seed,
        },
        24_000,
    );
    (Pack::open(&dir).unwrap(), SessionOptions::default(), noise)
}

fn codec_bench() {
    use duplex::model::mimi::{MimiDecoder, MimiEncoder};
    use duplex::model::mimi_step::StepCodec;
    use duplex::model::pack::{FloatType, StepRole};
    println!(
        "\n6. full-size Mimi per 80 ms frame, 1 thread: stateful step graphs vs the 8-frame window"
    );
    let (p, so, mut noise) = full_codec(3);
    let frames: Vec<Vec<f32>> = (0..40)
        .map(|_| {
            let mut f = vec![0.0; 1920];
            noise.fill(&mut f);
            f
        })
        .collect();
    let time = |f: &mut dyn FnMut(usize)| {
        // Warm up (and fill the window) on the first 10 frames, time the next 30.
        for i in 0..10 {
            f(i);
        }
        median(
            (10..40)
                .map(|i| {
                    let t0 = Instant::now();
                    f(i);
                    t0.elapsed()
                })
                .collect(),
        )
    };
    let mut window = MimiEncoder::open(&p, &so, 8).unwrap();
    let mut codes = Vec::new();
    let enc_window = time(&mut |i| {
        let c = window.push(&frames[i]).unwrap();
        if codes.len() < 40 {
            codes.push(c);
        }
    });
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut results = Vec::new();
    for dtype in [FloatType::F32, FloatType::F16] {
        let mut step = StepCodec::open(&p, StepRole::Encoder, dtype, &so).unwrap();
        let allocs0 = duplex::model::buffer_allocations();
        let enc_step = time(&mut |i| {
            step.encode(&frames[i]).unwrap();
        });
        let allocs = duplex::model::buffer_allocations() - allocs0;
        let mut wdec = MimiDecoder::open(&p, &so, 8).unwrap();
        let dec_window = time(&mut |i| {
            wdec.push(&codes[i], 2048).unwrap();
        });
        let mut sdec = StepCodec::open(&p, StepRole::Decoder, dtype, &so).unwrap();
        let dec_step = time(&mut |i| {
            sdec.decode(&codes[i], 2048).unwrap();
        });
        results.push((dtype, enc_step, dec_step, dec_window, allocs));
    }
    for (dtype, enc_step, dec_step, dec_window, allocs) in results {
        println!(
            "   {:<3} encode: stateful {:6.2} ms vs window {:6.2} ms -> {:.2} (target <= 0.30); decode: stateful {:6.2} ms vs window {:6.2} ms -> {:.2} (target <= 0.30); buffers allocated while stepping: {allocs}",
            dtype.name(),
            ms(enc_step),
            ms(enc_window),
            enc_step.as_secs_f64() / enc_window.as_secs_f64(),
            ms(dec_step),
            ms(dec_window),
            dec_step.as_secs_f64() / dec_window.as_secs_f64(),
        );
    }
}

fn depformer_bench() {
    use duplex::model::depformer::{DepformerInput, UnusedSubsteps};
    use duplex::model::sampling::{Sampler, SamplingParams};
    println!("\n4. depformer per frame, small pack: every substep vs the user stream's skipped");
    let p = Pack::open(&pack("small-gqa", &["--size", "small", "--variant", "gqa"])).unwrap();
    let mut dep = Depformer::open(&p, &SessionOptions::default()).unwrap();
    let steps = dep.steps();
    let hidden: Vec<f32> = (0..dep.info.hidden_dim)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let target: Vec<i64> = (0..steps as i64).map(|i| i * 3 + 1).collect();
    // A conversation: the agent's channels sampled, the user's provided.
    let provided: Vec<bool> = (0..steps).map(|i| i >= steps / 2).collect();
    let frame = DepformerInput {
        hidden: &hidden,
        text: 3,
        target: &target,
        provided: &provided,
    };
    let n = 200;
    let mut per = Vec::new();
    let mut outs = Vec::new();
    for mode in [UnusedSubsteps::Run, UnusedSubsteps::Skip] {
        dep.unused = mode;
        let mut sampler = Sampler::new(5);
        let mut out = Vec::new();
        let mut all = Vec::new();
        for _ in 0..10 {
            dep.run(frame, &mut sampler, SamplingParams::AUDIO, &mut out)
                .unwrap();
        }
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            for _ in 0..n {
                dep.run(frame, &mut sampler, SamplingParams::AUDIO, &mut out)
                    .unwrap();
                all.extend(out[..steps / 2].iter().copied());
            }
            best = best.min(t0.elapsed().as_secs_f64() / n as f64);
        }
        per.push(best);
        outs.push(all);
    }
    assert_eq!(outs[0], outs[1], "skip changed the agent's tokens");
    println!(
        "   run every substep {:.3} ms, skip the user's {:.3} ms per frame: ratio {:.2} (the agent's tokens identical over {} frames)",
        per[0] * 1e3,
        per[1] * 1e3,
        per[1] / per[0],
        outs[0].len() / (steps / 2)
    );
}

fn tempfile_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("duplex-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn main() {
    if let Err(e) = duplex::model::ortlib::environment(None) {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let which = std::env::args().nth(1).unwrap_or_default();
    let all = which.is_empty() || which == "--bench";
    if all || which == "temporal" {
        temporal_bench();
    }
    if all || which == "memory" {
        memory_bench();
    }
    if all || which == "e2e" {
        e2e_bench();
    }
    if all || which == "depformer" {
        depformer_bench();
    }
    if all || which == "engine" {
        engine_bench();
    }
    if all || which == "codec" {
        codec_bench();
    }
    if all || which == "prefill" {
        prefill_bench();
    }
    if all || which == "codec-batch" {
        codec_batch_bench();
    }
    if all || which == "quantized" {
        quantized_bench();
    }
    if which == "pack-step" {
        pack_step_bench(Path::new(
            &std::env::args()
                .nth(2)
                .expect("cargo bench --bench model pack-step PACK"),
        ));
    }
    if which == "lm-rss" {
        // (A child of `quantized_bench`: the LM of one pack, opened and stepped alone.)
        lm_rss(Path::new(&std::env::args().nth(2).expect("lm-rss PACK")));
    }
}

/// Opens pack `dir`'s temporal transformer (with a cache of 100 positions, so that what is
/// measured is the weights and the runtime, not a cache that is the same in every pack) and
/// depformer, steps them 20 frames, and prints the resident memory they added (MB), as
/// `rss <MB>`.
fn lm_rss(dir: &Path) {
    use duplex::model::depformer::DepformerInput;
    use duplex::model::sampling::{Sampler, SamplingParams};
    let before = rss_mb();
    let p = Pack::open(dir).unwrap();
    let mut t = duplex::model::temporal::open(
        &p,
        &TemporalOptions {
            max_positions: 100,
            ..Default::default()
        },
    )
    .unwrap();
    t.step(&tokens(0)).unwrap();
    let temporal = rss_mb() - before;
    let mut dep = Depformer::open(&p, &SessionOptions::default()).unwrap();
    let steps = dep.steps();
    let target = vec![1i64; steps];
    let provided = vec![false; steps];
    let mut sampler = Sampler::new(1);
    let mut out = Vec::new();
    let mut hidden = Vec::new();
    for s in 0..20 {
        t.step(&tokens(s)).unwrap();
        t.read_hidden(&mut hidden);
        let frame = DepformerInput {
            hidden: &hidden,
            text: 3,
            target: &target,
            provided: &provided,
        };
        dep.run(frame, &mut sampler, SamplingParams::AUDIO, &mut out)
            .unwrap();
    }
    println!("rss {temporal:.1} {:.1}", rss_mb() - before);
}

/// The resident memory of pack `dir`'s temporal transformer, and of its whole LM, from a child
/// process of this benchmark (MB).
fn child_rss(dir: &Path) -> (f64, f64) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("lm-rss")
        .arg(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("rss "))
        .and_then(|v| {
            let mut it = v.split_whitespace().map(|x| x.parse().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or_else(|| {
            panic!(
                "lm-rss {}: {text}{}",
                dir.display(),
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

fn quantized_bench() {
    use duplex::model::mimi_step::StepCodec;
    use duplex::model::pack::{FloatType, StepRole};
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "\n9. quantized packs (tools/quantize_pack.py, blocks of 32, accuracy level 4), 1 thread"
    );
    let float = with_step_graphs(pack(
        "small-gqa-fullmimi",
        &["--size", "small", "--variant", "gqa", "--mimi", "full"],
    ));
    let packs = [
        ("fp32", float.clone()),
        (
            "int8",
            quantized(&float, "small-gqa-fullmimi-int8", &["--quantize", "int8"]),
        ),
        (
            "int4",
            quantized(&float, "small-gqa-fullmimi-int4", &["--quantize", "int4"]),
        ),
        (
            "int4, depformer int4",
            quantized(
                &float,
                "small-gqa-fullmimi-int4-dep4",
                &["--quantize", "int4", "--quantize-depformer", "int4"],
            ),
        ),
    ];
    println!("   small LM (dim 512, 4 layers, 8 heads x 64, text vocab 32000): temporal step median of 25 at each KV length; depformer frame (every substep, sampled); LM resident memory (weights and runtime: a 100-position cache), the median of three child processes");
    let lengths = [50, 1000];
    let mut rows = Vec::new();
    for (name, dir) in &packs {
        let p = Pack::open(dir).unwrap();
        let (times, _) = step_times(&p, KvMode::Resident, &lengths);
        let mut dep = Depformer::open(&p, &SessionOptions::default()).unwrap();
        let steps = dep.steps();
        let hidden: Vec<f32> = (0..dep.info.hidden_dim)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let target = vec![1i64; steps];
        let provided = vec![false; steps];
        let dep_time = dep_frame_time(&mut dep, &hidden, &target, &provided, 60);
        // (The median of three children: a process's resident memory varies from run to run.)
        let mut runs: Vec<(f64, f64)> = (0..3).map(|_| child_rss(dir)).collect();
        runs.sort_by(|a, b| a.1.total_cmp(&b.1));
        let rss = runs[1];
        let weights = match (p.quantized("temporal"), p.quantized("depformer")) {
            (None, None) => "float".to_string(),
            (t, d) => [("temporal", t), ("depformer", d)]
                .iter()
                .filter_map(|(g, q)| q.map(|q| format!("{g} {}", q.name())))
                .collect::<Vec<_>>()
                .join(", "),
        };
        rows.push((name, times, dep_time, rss));
        let (_, t, d, r) = rows.last().unwrap();
        println!(
            "   {name:<20} ({weights:<29}) temporal kv 50 {:6.3} ms, kv 1000 {:6.3} ms; depformer frame {:6.3} ms; resident: temporal {:6.1} MB, LM {:6.1} MB",
            ms(t[0]),
            ms(t[1]),
            ms(*d),
            r.0,
            r.1
        );
    }
    let f = &rows[0];
    for r in &rows[1..] {
        println!(
            "   {} / fp32: temporal step kv 50 {:.2}, kv 1000 {:.2}; depformer frame {:.2}; resident: temporal {:.2}, LM {:.2}{}",
            r.0,
            r.1[0].as_secs_f64() / f.1[0].as_secs_f64(),
            r.1[1].as_secs_f64() / f.1[1].as_secs_f64(),
            r.2.as_secs_f64() / f.2.as_secs_f64(),
            r.3 .0 / f.3 .0,
            r.3 .1 / f.3 .1,
            if r.0.starts_with("int4") {
                " (targets: step <= 0.5, resident <= 0.3)"
            } else {
                ""
            }
        );
    }

    // The full-size codec, fp32 against int8 step graphs.
    let codec8 = quantized(
        &float,
        "small-gqa-fullmimi-codec8",
        &["--quantize-codec", "int8"],
    );
    let so = SessionOptions::default();
    let mut noise = duplex::audio::Synth::new(
        duplex::audio::Waveform::Noise {
            amplitude: 0.2,
            seed: 3,
        },
        24_000,
    );
    let frames: Vec<Vec<f32>> = (0..50)
        .map(|_| {
            let mut f = vec![0.0; 1920];
            noise.fill(&mut f);
            f
        })
        .collect();
    let mut codes = Vec::new();
    let mut results = Vec::new();
    for dir in [&float, &codec8] {
        let p = Pack::open(dir).unwrap();
        let mut enc = StepCodec::open(&p, StepRole::Encoder, FloatType::F32, &so).unwrap();
        let mut dec = StepCodec::open(&p, StepRole::Decoder, FloatType::F32, &so).unwrap();
        let mut enc_t = Vec::new();
        let mut got = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let t0 = Instant::now();
            let c = enc.encode(f).unwrap();
            if i >= 10 {
                enc_t.push(t0.elapsed());
            }
            got.push(c);
        }
        if codes.is_empty() {
            codes = got.clone();
        }
        // Both decoders decode the float encoder's codes.
        let mut dec_t = Vec::new();
        let mut pcm = Vec::new();
        for (i, c) in codes.iter().enumerate() {
            let t0 = Instant::now();
            let x = dec.decode(c, 2048).unwrap();
            if i >= 10 {
                dec_t.push(t0.elapsed());
            }
            pcm.extend(x);
        }
        results.push((median(enc_t), median(dec_t), got, pcm));
    }
    let (f, q) = (&results[0], &results[1]);
    let signal: f64 = f.3.iter().map(|&x| (x as f64).powi(2)).sum();
    let noise_e: f64 =
        f.3.iter()
            .zip(&q.3)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum();
    let snr = 10.0 * (signal / noise_e.max(1e-30)).log10();
    let same =
        f.2.iter()
            .flatten()
            .zip(q.2.iter().flatten())
            .filter(|(a, b)| a == b)
            .count();
    let total = f.2.iter().flatten().count();
    println!(
        "   full-size Mimi step graphs, median of 40 frames: encode fp32 {:6.2} ms, int8 {:6.2} ms -> {:.2}; decode fp32 {:6.2} ms, int8 {:6.2} ms -> {:.2} (target <= 0.5) at {snr:.1} dB SNR (target >= 30); encoder codes equal {:.3}",
        ms(f.0),
        ms(q.0),
        q.0.as_secs_f64() / f.0.as_secs_f64(),
        ms(f.1),
        ms(q.1),
        q.1.as_secs_f64() / f.1.as_secs_f64(),
        same as f64 / total as f64
    );

    // The whole loop: 150 frames of silence, full-size codec + tiny LM, as fast as possible.
    let tiny_full = with_step_graphs(pack(
        "tiny-gqa-mimi-full",
        &["--size", "tiny", "--variant", "gqa", "--mimi", "full"],
    ));
    let tiny_codec8 = quantized(
        &tiny_full,
        "tiny-gqa-mimi-full-codec8",
        &["--quantize-codec", "int8"],
    );
    let dir = tempfile_dir();
    let input = dir.join("silence.wav");
    let mut w =
        duplex::audio::WavWriter::create(&input, 48_000, duplex::audio::WavFormat::I16).unwrap();
    w.write(&vec![0.0; 48_000 * 12]).unwrap();
    w.finalize().unwrap();
    let mut loops = Vec::new();
    for (label, p) in [("fp32 codec", &tiny_full), ("int8 codec", &tiny_codec8)] {
        let file = file_pipeline(&dir, p, &input);
        let report = duplex::app::run_file(&file, &[]).expect("pipeline runs");
        let (_, fps, interval, per) = loop_figures(&report, &["encode", "decode"]);
        println!(
            "   whole loop, tiny LM + full-size Mimi, {label}: {fps:6.1} frames/s, completion interval p50 {:.2} ms; per frame ms: {}",
            interval * 1e3,
            per.join(", ")
        );
        loops.push(interval);
    }
    println!(
        "   whole loop, int8 codec / fp32 codec: completion interval {:.2}",
        loops[1] / loops[0]
    );
}

/// One batched step call of B streams against B calls of one stream, full-size codec.
fn codec_batch_bench() {
    use duplex::model::mimi_step::StepCodec;
    use duplex::model::pack::{FloatType, StepRole};
    println!("\n8. full-size Mimi, B streams per 80 ms tick, 1 thread: one call of B rows vs B calls of one row");
    let (p, so, mut noise) = full_codec(5);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{:>8} {:>3} {:>16} {:>16} {:>8}",
        "graph", "B", "B calls of 1 ms", "1 call of B ms", "ratio"
    );
    for role in [StepRole::Encoder, StepRole::Decoder] {
        let mut one = StepCodec::open(&p, role, FloatType::F32, &so).unwrap();
        for b in [1usize, 4, 8, 16] {
            let mut batch = StepCodec::open_rows(&p, role, FloatType::F32, &so, b).unwrap();
            let pcm: Vec<f32> = {
                let mut f = vec![0.0; 1920 * b];
                noise.fill(&mut f);
                f
            };
            let codes: Vec<i64> = (0..8 * b).map(|i| ((i * 97) % 2048) as i64).collect();
            let mut tick_one = || match role {
                StepRole::Encoder => {
                    for r in 0..b {
                        one.encode(&pcm[r * 1920..(r + 1) * 1920]).unwrap();
                    }
                }
                StepRole::Decoder => {
                    for r in 0..b {
                        one.decode(&codes[r * 8..(r + 1) * 8], 2048).unwrap();
                    }
                }
            };
            let separate = time_ticks(&mut tick_one);
            let mut tick_batch = || match role {
                StepRole::Encoder => drop(batch.encode_rows(&pcm).unwrap()),
                StepRole::Decoder => drop(batch.decode_rows(&codes, 2048).unwrap()),
            };
            let together = time_ticks(&mut tick_batch);
            println!(
                "{:>8} {b:>3} {:>16.1} {:>16.1} {:>7.2}x",
                match role {
                    StepRole::Encoder => "encoder",
                    StepRole::Decoder => "decoder",
                },
                ms(separate),
                ms(together),
                together.as_secs_f64() / separate.as_secs_f64()
            );
        }
    }
}

/// The median of 15 ticks after 5 to warm up.
fn time_ticks(f: &mut dyn FnMut()) -> Duration {
    for _ in 0..5 {
        f();
    }
    median(
        (0..15)
            .map(|_| {
                let t0 = Instant::now();
                f();
                t0.elapsed()
            })
            .collect(),
    )
}

fn prefill_bench() {
    println!("\n7. 300 known frames (priming) through the temporal graph, small pack, 1 thread: stepped vs prefilled in chunks of 32");
    let frames: Vec<Vec<i64>> = (0..300).map(tokens).collect();
    for (name, variant) in [("small-gqa", "gqa"), ("small", "standard")] {
        let dir = pack(name, &["--size", "small", "--variant", variant]);
        let p = Pack::open(&dir).unwrap();
        let open = || duplex::model::temporal::open(&p, &TemporalOptions::default()).unwrap();
        let (mut stepped, mut chunked) = (Vec::new(), Vec::new());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let mut t = open();
            let t0 = Instant::now();
            for f in &frames {
                t.step(f).unwrap();
            }
            stepped.push(t0.elapsed());
            t.read_logits(&mut a);
            let mut t = open();
            let t0 = Instant::now();
            t.prefill(&frames, 32).unwrap();
            chunked.push(t0.elapsed());
            t.read_logits(&mut b);
        }
        let d = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        let (s, c) = (median(stepped), median(chunked));
        println!(
            "   {variant:<8} stepped {:8.1} ms   chunked {:8.1} ms   -> {:.2}x the stepped time (last logits differ by {d:.1e})",
            s.as_secs_f64() * 1e3,
            c.as_secs_f64() * 1e3,
            c.as_secs_f64() / s.as_secs_f64()
        );
    }
    priming_bench();
}

/// A whole priming through the pipeline (`duplex run` in process): the same run with no
/// priming script is subtracted, so what is left is the priming's own time.
fn priming_bench() {
    println!("   a whole priming through the pipeline, small pack (GQA), 10 s voice prompt + 100-token persona + 2 x 6 spacers = 237 steps, greedy:");
    let dir = tempfile_dir();
    let sr = 24_000;
    let write = |path: &Path, seconds: f64, amp: f32| {
        let mut s = duplex::audio::Synth::new(
            duplex::audio::Waveform::Sine {
                freq: 190.0,
                amplitude: amp,
            },
            sr,
        );
        let mut x = vec![0.0; (seconds * sr as f64) as usize];
        s.fill(&mut x);
        let mut w =
            duplex::audio::WavWriter::create(path, sr, duplex::audio::WavFormat::I16).unwrap();
        w.write(&x).unwrap();
        w.finalize().unwrap();
    };
    let (input, voice) = (dir.join("in.wav"), dir.join("voice.wav"));
    write(&input, 0.8, 0.3);
    write(&voice, 10.0, 0.4);
    let p = pack("small-gqa", &["--size", "small", "--variant", "gqa"]);
    let file = file_pipeline(&dir, &p, &input);
    let set = |k: &str, v: &str| duplex::config::Override::set(k, v);
    let persona: Vec<String> = (0..100).map(|i| (200 + 97 * i).to_string()).collect();
    let primed = |mode: &str| {
        vec![
            set("stages.depformer.greedy", "true"),
            set("stages.temporal.voice", voice.to_str().unwrap()),
            set(
                "stages.temporal.persona_tokens",
                &format!("[{}]", persona.join(", ")),
            ),
            set("stages.temporal.priming", mode),
        ]
    };
    let bare = vec![
        set("stages.depformer.greedy", "true"),
        set("stages.temporal.silence_frames", "0"),
    ];
    let mut times = std::collections::HashMap::new();
    let mut tokens = std::collections::HashMap::new();
    for _ in 0..3 {
        for (label, sets) in [
            ("none", bare.clone()),
            ("stepped", primed("stepped")),
            ("chunked", primed("chunked")),
        ] {
            let t0 = Instant::now();
            duplex::app::run_file(&file, &sets).expect("pipeline runs");
            times
                .entry(label)
                .or_insert_with(Vec::new)
                .push(t0.elapsed());
            tokens.insert(
                label,
                std::fs::read_to_string(dir.join("tokens.jsonl")).unwrap(),
            );
        }
    }
    assert_eq!(
        tokens["stepped"], tokens["chunked"],
        "chunked priming changed the conversation"
    );
    let ms = |l: &str| median(times[l].clone()).as_secs_f64() * 1e3;
    let (none, stepped, chunked) = (ms("none"), ms("stepped"), ms("chunked"));
    println!(
        "   priming stepped {:8.1} ms   chunked {:8.1} ms   -> {:.2}x (runs {stepped:.0}, {chunked:.0} and {none:.0} ms without priming; tokens equal)",
        stepped - none,
        chunked - none,
        (chunked - none) / (stepped - none)
    );
}

fn own_lm(p: &Pack, seed: u64) -> LmLoop {
    let so = SessionOptions::default();
    LmLoop {
        temporal: TemporalHalf::new(
            LmGen::new(p.manifest.layout()),
            duplex::model::temporal::open(
                p,
                &TemporalOptions {
                    max_positions: 300,
                    ..Default::default()
                },
            )
            .unwrap(),
        ),
        sampling: SamplingHalf::new(
            Depformer::open(p, &so).unwrap(),
            SamplingConfig {
                seed,
                ..Default::default()
            },
        ),
    }
}

fn shared_lm(e: &std::sync::Arc<duplex::model::engine::SharedLm>, p: &Pack, seed: u64) -> LmLoop {
    let mut d = e.depformer_client();
    d.unused = duplex::model::depformer::UnusedSubsteps::Skip;
    LmLoop {
        temporal: TemporalHalf::new(
            LmGen::new(p.manifest.layout()),
            e.temporal_slot(300).unwrap(),
        ),
        sampling: SamplingHalf::new(
            d,
            SamplingConfig {
                seed,
                ..Default::default()
            },
        ),
    }
}

/// The user codes of conversation `c` at frame `t`.
fn user(c: usize, t: usize) -> Vec<i64> {
    (0..8)
        .map(|k| ((t * 131 + c * 977 + k * 61) % 2048) as i64)
        .collect()
}

fn engine_bench() {
    use duplex::model::engine::{self, EngineOptions};
    println!("\n5. shared LM engine, small pack (GQA fp32), sampled, user substeps skipped both ways, 1 thread per graph");
    let p = Pack::open(&pack("small-gqa", &["--size", "small", "--variant", "gqa"])).unwrap();
    let frames = 30;
    let warm = 5;
    let rss0 = rss_mb();
    let e = std::sync::Arc::new(
        engine::SharedLm::open(
            &p,
            &EngineOptions {
                slots: 16,
                max_positions: 300,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let rss_engine = rss_mb();
    // Resident memory: 16 conversations on the engine, then 1 and 16 on graphs of their own.
    let mut held: Vec<LmLoop> = Vec::new();
    held.push(shared_lm(&e, &p, 0));
    let rss_shared1 = rss_mb();
    for c in 1..16 {
        held.push(shared_lm(&e, &p, c as u64));
    }
    let rss_shared16 = rss_mb();
    drop(held);
    let mut own: Vec<LmLoop> = vec![own_lm(&p, 0)];
    let rss_own1 = rss_mb();
    for c in 1..16 {
        own.push(own_lm(&p, c as u64));
    }
    let rss_own16 = rss_mb();
    for l in own.iter_mut() {
        l.sampling
            .depformer
            .set_unused(duplex::model::depformer::UnusedSubsteps::Skip);
    }
    println!(
        "   memory: engine open (weights once + 16 KV slots of 300 positions) +{:.0} MB; conversations on it: 1st +{:.1} MB, 16 in all +{:.1} MB",
        rss_engine - rss0,
        rss_shared1 - rss_engine,
        rss_shared16 - rss_engine
    );
    println!(
        "   memory: graphs of their own: 1 conversation +{:.0} MB, 16 conversations +{:.0} MB ({:.0} MB per extra conversation)",
        rss_own1 - rss_shared16,
        rss_own16 - rss_shared16,
        (rss_own16 - rss_own1) / 15.0
    );
    for b in [1usize, 2, 4, 8, 16] {
        // One after another on graphs of their own.
        let mut seq_out = vec![Vec::new(); b];
        let mut seq_time = Duration::ZERO;
        for l in own.iter_mut().take(b) {
            l.temporal.reset(true);
        }
        for t in 0..warm + frames {
            let t0 = Instant::now();
            for (c, l) in own.iter_mut().take(b).enumerate() {
                seq_out[c].push(l.step(&user(c, t), None, None).unwrap());
            }
            if t >= warm {
                seq_time += t0.elapsed();
            }
        }
        // Together on the engine: one thread per conversation.
        let ticks0 = e
            .stats
            .temporal_ticks
            .load(std::sync::atomic::Ordering::Relaxed);
        let barrier = std::sync::Barrier::new(b);
        let (shared_time, shared_out): (Vec<Duration>, Vec<Vec<_>>) = std::thread::scope(|s| {
            let hs: Vec<_> = (0..b)
                .map(|c| {
                    let (e, p, barrier) = (&e, &p, &barrier);
                    s.spawn(move || {
                        let mut l = shared_lm(e, p, c as u64);
                        let mut out = Vec::new();
                        let mut t0 = Instant::now();
                        for t in 0..warm + frames {
                            if t == warm {
                                barrier.wait();
                                t0 = Instant::now();
                            }
                            out.push(l.step(&user(c, t), None, None).unwrap());
                        }
                        (t0.elapsed(), out)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).unzip()
        });
        let ticks = e
            .stats
            .temporal_ticks
            .load(std::sync::atomic::Ordering::Relaxed)
            - ticks0;
        assert_eq!(seq_out, shared_out, "batch {b}: the engine's tokens differ");
        let shared = shared_time.into_iter().max().unwrap().as_secs_f64() * 1e3 / frames as f64;
        let seq = seq_time.as_secs_f64() * 1e3 / frames as f64;
        println!(
            "   batch {b:>2}: engine {shared:7.2} ms per frame of all ({:.1} rows per temporal tick)   one after another {seq:7.2} ms   ratio {:.2}{}",
            (b * (warm + frames)) as f64 / ticks.max(1) as f64,
            shared / seq,
            if b == 16 { " (target <= 0.30)" } else { "" }
        );
    }
}
