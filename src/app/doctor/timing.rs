//! `duplex doctor --pack DIR --time`: the temporal step's time at a few context lengths, the
//! depformer's frame, the codec's step graphs batched, the shared LM engine's frame for B
//! conversations, and the memory a conversation adds to that engine. Measures and prints;
//! knows no stages or pipelines.

use std::path::Path;
use std::time::Instant;

use crate::model::depformer::Depformer;
use crate::model::mimi_step::StepCodec;
use crate::model::pack::{FloatType, Pack, StepRole};
use crate::model::session::{Provider, SessionOptions};
use crate::model::temporal::{KvMode, TemporalOptions};
use crate::model::ModelError;

/// Contexts (positions in the cache) at which [`step_times`] reports: 3000 is a Moshi LM's
/// whole attention context.
pub const TIMED_CONTEXTS: [usize; 4] = [50, 1000, 2500, 3000];

/// Steps averaged at each context: the ones that fill the cache up to it.
const TIMED_STEPS: usize = 20;

/// The temporal step's mean time (ms) at each of `contexts`, per cache mode: the cache bound
/// where the session computes (`resident`), fed through host arrays every step (`host`), and
/// bound at fixed shapes (`fixed`; `graph` under CUDA, where the step is a captured CUDA graph
/// replayed; GQA graphs only).
/// Steps the pack's temporal graph from an empty cache to the largest context on the layout's
/// initial tokens; a context the pack's positions do not reach is left out, saying so.
///
/// # Errors
///
/// A [`ModelError`] from opening or stepping the graph.
pub fn step_times(
    pack: &Pack,
    provider: Provider,
    contexts: &[usize],
) -> Result<String, ModelError> {
    let frame = pack.manifest.layout().initial;
    let reach = pack.manifest.max_positions;
    let (timed, beyond): (Vec<usize>, Vec<usize>) = contexts
        .iter()
        .partition(|&&c| c >= TIMED_STEPS && c <= reach);
    let contexts = timed.as_slice();
    let last = contexts.iter().copied().max().unwrap_or(0);
    let mut text = format!(
        "temporal step on {} (mean of the {TIMED_STEPS} steps up to each context):\n",
        provider.name()
    );
    if !beyond.is_empty() {
        text.push_str(&format!(
            "  (context {beyond:?} left out: the pack's graphs hold {reach} positions)\n"
        ));
    }
    let mut rows = Vec::new();
    let cuda = matches!(provider, Provider::Cuda { .. });
    // Fixed shapes: under CUDA with graph capture and replay (`cuda_graph: true`).
    let graph_row = if cuda { "graph" } else { "fixed" };
    for (name, kv, fixed) in [
        ("resident", KvMode::Resident, false),
        ("host", KvMode::Host, false),
        (graph_row, KvMode::Resident, true),
    ] {
        // The graph says whether it can be bound at fixed shapes (the resident row is first).
        let standard = rows
            .first()
            .is_some_and(|(_, _, _, v)| *v == crate::model::pack::Variant::Standard);
        if fixed && standard {
            continue;
        }
        let mut t = crate::model::temporal::open(
            pack,
            &TemporalOptions {
                session: SessionOptions {
                    provider,
                    ..SessionOptions::default()
                },
                kv,
                max_positions: last + 1,
                fixed_shapes: fixed,
                cuda_graph: fixed && cuda,
            },
        )?;
        let mut times = Vec::with_capacity(last);
        let mut sink = Vec::new();
        for _ in 0..last {
            let t0 = Instant::now();
            t.step(&frame)?;
            t.read_logits(&mut sink);
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let means: Vec<f64> = contexts
            .iter()
            .map(|&c| times[c - TIMED_STEPS..c].iter().sum::<f64>() / TIMED_STEPS as f64)
            .collect();
        rows.push((name, means, t.runs_on(), t.info().variant));
    }
    for (name, means, runs_on, _) in &rows {
        let cells: Vec<String> = contexts
            .iter()
            .zip(means)
            .map(|(c, m)| format!("context {c}: {m:.3} ms"))
            .collect();
        text.push_str(&format!("  {name:<8} ({runs_on}) {}\n", cells.join(", ")));
    }
    if let [(_, resident, ..), (_, host, ..), ..] = rows.as_slice() {
        let ratios: Vec<String> = resident
            .iter()
            .zip(host)
            .zip(contexts)
            .map(|((r, h), c)| format!("{c}: {:.2}", r / h))
            .collect();
        text.push_str(&format!("  resident / host: {}\n", ratios.join(", ")));
    }
    Ok(text)
}

/// Batch sizes at which [`codec_batch_times`] reports.
pub const CODEC_BATCHES: [usize; 4] = [1, 16, 32, 48];

/// The codec's step graphs as the shared codec runs them, fp32 and (where the pack has them)
/// fp16: for each precision, role and batch size B of `batches`, the median time of one call of
/// B rows against B calls of one row (the codec per session), and their ratio. An empty report
/// when the pack has no step graphs.
///
/// # Errors
///
/// A [`ModelError`] from opening or running a step graph.
pub fn codec_batch_times(
    pack: &Pack,
    provider: Provider,
    batches: &[usize],
) -> Result<String, ModelError> {
    let mut text = String::new();
    for dtype in [FloatType::F32, FloatType::F16] {
        if pack.step_graph(StepRole::Encoder, dtype).is_some() {
            text.push_str(&codec_batch_times_of(pack, provider, dtype, batches)?);
        }
    }
    Ok(text)
}

/// [`codec_batch_times`] for one precision.
fn codec_batch_times_of(
    pack: &Pack,
    provider: Provider,
    dtype: FloatType,
    batches: &[usize],
) -> Result<String, ModelError> {
    let session = SessionOptions {
        provider,
        ..SessionOptions::default()
    };
    let m = &pack.manifest;
    let mut text = format!(
        "codec step graphs ({}) on {}, one call of B rows vs B calls of one row (median of 7):\n",
        dtype.name(),
        provider.name()
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for role in [StepRole::Encoder, StepRole::Decoder] {
        let mut one = StepCodec::open(pack, role, dtype, &session)?;
        let call = |c: &mut StepCodec, rows: usize| -> Result<(), ModelError> {
            match role {
                StepRole::Encoder => drop(c.encode_rows(&vec![0.1; rows * m.frame_size])?),
                StepRole::Decoder => {
                    drop(c.decode_rows(&vec![1; rows * m.codebooks], m.audio_vocab)?)
                }
            }
            Ok(())
        };
        for _ in 0..3 {
            call(&mut one, 1)?;
        }
        let mut cells = Vec::new();
        for &b in batches {
            let mut batch = StepCodec::open_rows(pack, role, dtype, &session, b)?;
            for _ in 0..3 {
                call(&mut batch, b)?;
            }
            let mut together = Vec::new();
            let mut apart = Vec::new();
            for _ in 0..7 {
                let t0 = Instant::now();
                call(&mut batch, b)?;
                together.push(t0.elapsed().as_secs_f64() * 1e3);
                let t0 = Instant::now();
                for _ in 0..b {
                    call(&mut one, 1)?;
                }
                apart.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            let (t, a) = (median(together), median(apart));
            cells.push(format!("B={b}: {t:.2} ms vs {a:.2} ms ({:.2})", t / a));
        }
        text.push_str(&format!(
            "  {:<8} ({}) {}\n",
            match role {
                StepRole::Encoder => "encoder",
                StepRole::Decoder => "decoder",
            },
            one.runs_on(),
            cells.join(", ")
        ));
    }
    Ok(text)
}

/// Frames [`depformer_frame_times`] averages.
const DEPFORMER_FRAMES: usize = 50;

/// One conversation's depformer frame (the agent's channels sampled, the user's provided, as
/// in a conversation): its mean time running every substep and with the user's substeps
/// skipped (what a server runs), on `provider`; plainly bound, and bound as its CUDA graphs
/// need (its plain inputs and output in buffers of their own), under CUDA with each substep
/// captured as a CUDA graph and replayed; and so bound with its audio drawn where the logits
/// are (device sampling). A binding that cannot run says why on its line.
///
/// # Errors
///
/// A [`ModelError`] from opening or running the plainly bound depformer.
pub fn depformer_frame_times(pack: &Pack, provider: Provider) -> Result<String, ModelError> {
    let cuda = matches!(provider, Provider::Cuda { .. });
    let mut text = format!(
        "depformer frame on {} (one conversation, mean of {DEPFORMER_FRAMES}):\n",
        provider.name()
    );
    use crate::model::depformer::DepformerBinding;
    let separate = DepformerBinding {
        separate_io: true,
        device_sampling: false,
    };
    let device = DepformerBinding {
        device_sampling: true,
        ..separate
    };
    let mut host_drawn: Option<Vec<i64>> = None;
    for (label, binding) in [
        ("plain", DepformerBinding::default()),
        (if cuda { "graphs" } else { "separate" }, separate),
        ("device", device),
    ] {
        let opts = SessionOptions {
            provider,
            cuda_graph: binding.separate_io && cuda,
            ..SessionOptions::default()
        };
        match depformer_frame(pack, &opts, binding) {
            Ok((runs_on, every, skipped, tokens)) => {
                // The device's draw against the host's, from the same seed and frames.
                let same = match (&host_drawn, binding.device_sampling) {
                    (Some(host), true) => {
                        match host.iter().zip(&tokens).position(|(a, b)| a != b) {
                            None if host.len() == tokens.len() => ", the host draw's tokens".into(),
                            None => ", not the host draw's number of tokens".into(),
                            Some(i) => format!(
                                ", NOT the host draw's tokens (from token {i} of {})",
                                host.len()
                            ),
                        }
                    }
                    _ => String::new(),
                };
                text.push_str(&format!(
                    "  {label:<8} ({runs_on}) every substep {every:.3} ms, the user's substeps \
                     skipped {skipped:.3} ms ({:.2}){same}\n",
                    skipped / every
                ));
                if !binding.device_sampling {
                    host_drawn = Some(tokens);
                }
            }
            Err(e) if binding.separate_io => text.push_str(&format!("  {label:<8} not run: {e}\n")),
            Err(e) => return Err(e),
        }
    }
    if !cuda {
        text.push_str("  (separate: the binding the CUDA graphs use, its copies included; no capture on a CPU)\n");
    }
    text.push_str(&format!(
        "  (device: {} with the audio drawn where the logits are, `device_sampling: true`)\n",
        if cuda { "graphs" } else { "separate" }
    ));
    Ok(text)
}

/// [`depformer_frame_times`] for one binding: what it runs on, the mean frame with every
/// substep and with the user's skipped, ms, and the tokens of the frames timed.
fn depformer_frame(
    pack: &Pack,
    opts: &SessionOptions,
    binding: crate::model::depformer::DepformerBinding,
) -> Result<(String, f64, f64, Vec<i64>), ModelError> {
    use crate::model::depformer::{DepformerInput, UnusedSubsteps};
    use crate::model::sampling::{Sampler, SamplingParams};
    let mut dep = Depformer::open_with(pack, opts, binding)?;
    let steps = dep.steps();
    let hidden: Vec<f32> = (0..dep.info.hidden_dim)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let vocab = pack.manifest.audio_vocab.max(1);
    let target: Vec<i64> = (0..steps as i64).map(|i| (i * 3 + 1) % vocab).collect();
    let provided: Vec<bool> = (0..steps).map(|i| i >= steps / 2).collect();
    let frame = DepformerInput {
        hidden: &hidden,
        text: 3,
        target: &target,
        provided: &provided,
    };
    let mut out = Vec::new();
    let mut means = [0.0; 2];
    let mut tokens = Vec::with_capacity(2 * DEPFORMER_FRAMES * steps);
    for (k, mode) in [UnusedSubsteps::Run, UnusedSubsteps::Skip]
        .into_iter()
        .enumerate()
    {
        dep.unused = mode;
        let mut sampler = Sampler::new(5);
        // (a CUDA graph is captured after the first runs of each substep)
        for _ in 0..5 {
            dep.run(frame, &mut sampler, SamplingParams::AUDIO, &mut out)?;
        }
        let t0 = Instant::now();
        for _ in 0..DEPFORMER_FRAMES {
            dep.run(frame, &mut sampler, SamplingParams::AUDIO, &mut out)?;
            tokens.extend_from_slice(&out);
        }
        means[k] = t0.elapsed().as_secs_f64() * 1e3 / DEPFORMER_FRAMES as f64;
    }
    Ok((dep.runs_on(), means[0], means[1], tokens))
}

/// Batch sizes at which [`engine_ticks`] reports.
pub const ENGINE_BATCHES: [usize; 6] = [1, 8, 16, 32, 48, 64];

/// Batch sizes at which [`engine_ticks`] reports with device sampling on a CPU (where it only
/// shows that it runs: the round trips it saves are a GPU's).
pub const ENGINE_BATCHES_CPU_DRAWN: [usize; 2] = [1, 8];

/// The shared LM engine on `provider`: for each B of `batches`, B conversations (a thread each,
/// the user's substeps skipped as a server runs them) stepped together through one engine for
/// 20 frames after 5 of warm-up, and the time of one frame of all of them (the slowest
/// conversation's), with how many rows a temporal tick took on average.
///
/// # Errors
///
/// A [`ModelError`] from opening the engine or stepping a conversation.
pub fn engine_ticks(
    pack: &Pack,
    provider: Provider,
    batches: &[usize],
    device_sampling: bool,
) -> Result<String, ModelError> {
    use crate::model::engine::{EngineOptions, SharedLm};
    use std::sync::atomic::Ordering;
    let engine = std::sync::Arc::new(SharedLm::open(
        pack,
        &EngineOptions {
            session: SessionOptions {
                provider,
                ..SessionOptions::default()
            },
            slots: batches.iter().copied().max().unwrap_or(1),
            max_positions: ENGINE_WARM + ENGINE_FRAMES + 8,
            device_sampling,
            ..EngineOptions::default()
        },
    )?);
    let mut cells = Vec::new();
    for &b in batches {
        let ticks0 = engine.stats.temporal_ticks.load(Ordering::Relaxed);
        let barrier = std::sync::Barrier::new(b);
        let times: Vec<Result<f64, ModelError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..b)
                .map(|c| {
                    let (engine, barrier) = (&engine, &barrier);
                    s.spawn(move || timed_conversation(engine, pack, c, barrier))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(ModelError::contract(
                            "engine",
                            "a conversation's thread panicked",
                        ))
                    })
                })
                .collect()
        });
        let mut worst = 0.0f64;
        for t in times {
            worst = worst.max(t?);
        }
        let ticks = engine.stats.temporal_ticks.load(Ordering::Relaxed) - ticks0;
        cells.push(format!(
            "B={b}: {worst:.2} ms per frame of all ({:.1} rows per tick)",
            (b * (ENGINE_WARM + ENGINE_FRAMES)) as f64 / ticks.max(1) as f64
        ));
    }
    let drawn = match (device_sampling, engine.draws_on_device()) {
        (false, _) => "",
        (true, true) => " the audio drawn where the logits are,",
        (true, false) => {
            " the audio drawn on the host (device sampling did not start: see the log),"
        }
    };
    Ok(format!(
        "shared LM engine on {},{drawn} B conversations stepped together (20 frames, user \
         substeps skipped):\n  {}\n",
        provider.name(),
        cells.join(", ")
    ))
}

/// Frames each conversation of [`engine_ticks`] steps before it is timed, and timed.
const ENGINE_WARM: usize = 5;
const ENGINE_FRAMES: usize = 20;

/// One conversation of [`engine_ticks`] (`c`: its seed and its user codes): warmed up apart,
/// then timed from the barrier all pass together. Every thread reaches the barrier, even one
/// that failed (it then leaves, and the engine forgets it). Returns ms per frame.
fn timed_conversation(
    engine: &std::sync::Arc<crate::model::engine::SharedLm>,
    pack: &Pack,
    c: usize,
    barrier: &std::sync::Barrier,
) -> Result<f64, ModelError> {
    use crate::model::lm::{LmLoop, SamplingConfig, SamplingHalf, TemporalHalf};
    use crate::model::lmgen::LmGen;
    let codebooks = pack.manifest.codebooks as i64;
    let vocab = pack.manifest.audio_vocab.max(1);
    let user = |t: usize| -> Vec<i64> {
        (0..codebooks)
            .map(|k| ((c * 131 + t * 31) as i64 + k * 97) % vocab)
            .collect()
    };
    let warmed = (|| -> Result<LmLoop, ModelError> {
        let mut depformer = engine.depformer_client();
        depformer.unused = crate::model::depformer::UnusedSubsteps::Skip;
        let mut lm = LmLoop {
            temporal: TemporalHalf::new(
                LmGen::new(pack.manifest.layout()),
                engine.temporal_slot(ENGINE_WARM + ENGINE_FRAMES + 8)?,
            ),
            sampling: SamplingHalf::new(
                depformer,
                SamplingConfig {
                    seed: c as u64,
                    ..Default::default()
                },
            ),
        };
        for t in 0..ENGINE_WARM {
            lm.step(&user(t), None, None)?;
        }
        Ok(lm)
    })();
    barrier.wait();
    let mut lm = warmed?;
    let t0 = Instant::now();
    for t in ENGINE_WARM..ENGINE_WARM + ENGINE_FRAMES {
        lm.step(&user(t), None, None)?;
    }
    Ok(t0.elapsed().as_secs_f64() * 1e3 / ENGINE_FRAMES as f64)
}

/// Slots of the larger engine [`engine_memory`] opens.
pub const MEMORY_SLOTS: usize = 4;

/// Memory in use, bytes: the device's (CUDA: `cudaMemGetInfo`, total less free, asked through
/// the CUDA runtime ONNX Runtime's CUDA provider loads) or what this process has allocated on
/// the host ([`host_memory_allocated`]).
///
/// # Errors
///
/// What could not be read.
pub fn memory_in_use(provider: Provider) -> anyhow::Result<u64> {
    match provider {
        Provider::Cpu => host_memory_allocated(),
        Provider::Cuda { device_id } => cuda_memory_in_use(device_id),
    }
}

/// What the host memory figure of [`memory_in_use`] counts, in words.
pub const HOST_MEMORY: &str = "memory allocated (malloc's count)";

/// The bytes this process has allocated through the C allocator, which Rust's and ONNX
/// Runtime's allocations both go through (glibc's `mallinfo2`: the heap's chunks in use and
/// the blocks it mapped). Allocated, not resident: a buffer of zeros that was never written
/// counts whole, as it will once a conversation fills it, where the resident set would count
/// only the pages the kernel has committed so far.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn host_memory_allocated() -> anyhow::Result<u64> {
    // SAFETY: mallinfo2 takes no arguments and only reads the allocator's counters.
    let m = unsafe { libc::mallinfo2() };
    Ok((m.uordblks + m.hblkhd) as u64)
}

/// Elsewhere there is no allocator's count to ask.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn host_memory_allocated() -> anyhow::Result<u64> {
    Err(anyhow::anyhow!(
        "the host's allocated memory is counted only with glibc's allocator"
    ))
}

/// `cudaMemGetInfo` on `device`: total less free (every process's memory on the device).
fn cuda_memory_in_use(device: i32) -> anyhow::Result<u64> {
    type SetDevice = unsafe extern "C" fn(i32) -> i32;
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> i32;
    let mut tried = Vec::new();
    for name in ["libcudart.so.13", "libcudart.so.12", "libcudart.so"] {
        // SAFETY: the CUDA runtime's initialisers have no preconditions; the two symbols are
        // called with the signatures the CUDA runtime API documents.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(lib) => lib,
            Err(e) => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
        };
        let (mut free, mut total) = (0usize, 0usize);
        let code = unsafe {
            let set: libloading::Symbol<SetDevice> = lib
                .get(b"cudaSetDevice\0")
                .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            let get: libloading::Symbol<MemGetInfo> = lib
                .get(b"cudaMemGetInfo\0")
                .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            match set(device) {
                0 => get(&mut free, &mut total),
                code => code,
            }
        };
        if code != 0 {
            return Err(anyhow::anyhow!(
                "{name}: cudaMemGetInfo on device {device} failed (error {code})"
            ));
        }
        return Ok(total.saturating_sub(free) as u64);
    }
    Err(anyhow::anyhow!(
        "no CUDA runtime to ask ({})",
        tried.join("; ")
    ))
}

/// What opening a shared LM engine of `slots` slots, each slot's KV cache sized for the pack's
/// whole context, adds to the memory in use ([`memory_in_use`]), bytes; and the bytes of
/// temporal KV cache a slot holds by arithmetic. Meant for a process of its own (`duplex doctor
/// --memory-probe`): memory freed earlier in a process is reused and hides what is added.
///
/// # Errors
///
/// A [`ModelError`] from opening the pack or the engine; what could not be read.
pub fn memory_probe(dir: &Path, provider: Provider, slots: usize) -> anyhow::Result<(u64, usize)> {
    use crate::model::engine::{EngineOptions, SharedLm};
    let pack = Pack::open(dir)?;
    let m = &pack.manifest;
    let before = memory_in_use(provider)?;
    let engine = SharedLm::open(
        &pack,
        &EngineOptions {
            session: SessionOptions {
                provider,
                ..SessionOptions::default()
            },
            slots,
            max_positions: m.context.min(m.max_positions).max(1),
            ..EngineOptions::default()
        },
    )?;
    let after = memory_in_use(provider)?;
    Ok((after.saturating_sub(before), engine.kv_bytes_per_slot()))
}

/// The memory one conversation adds to the shared LM engine at the pack's whole context: an
/// engine of one slot and one of `slots` are each opened in a process of their own (this
/// binary's `doctor --memory-probe`), and the difference of what they add, over the added
/// slots, is a conversation's (beside its temporal KV cache by arithmetic: what the
/// allocator adds to it shows as the difference). Activations while stepping are not in it
/// (a frame's, not a conversation's).
pub fn engine_memory(dir: &Path, provider: Provider, slots: usize) -> String {
    let slots = slots.max(2);
    let probe = |n: usize| -> anyhow::Result<(u64, usize)> {
        let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("this binary: {e}"))?;
        let o = std::process::Command::new(exe)
            .args(["doctor", "--provider", provider.name(), "--memory-probe"])
            .arg(n.to_string())
            .arg("--pack")
            .arg(dir)
            .output()
            .map_err(|e| anyhow::anyhow!("the probe: {e}"))?;
        let stdout = String::from_utf8_lossy(&o.stdout);
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("memory-probe: "))
            .and_then(|v| {
                let (a, k) = v.split_once(' ')?;
                Some((a.parse().ok()?, k.parse().ok()?))
            })
            .ok_or_else(|| {
                let err = String::from_utf8_lossy(&o.stderr);
                let last = err
                    .lines()
                    .rev()
                    .find(|l| !l.contains(" INFO "))
                    .unwrap_or("");
                anyhow::anyhow!("the probe of {n} slots said nothing ({}): {last}", o.status)
            })
    };
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let what = match provider {
        Provider::Cpu => HOST_MEMORY,
        Provider::Cuda { .. } => "device memory",
    };
    let line = match (probe(1), probe(slots)) {
        (Ok((a, kv)), Ok((b, _))) => format!(
            "  1 slot: +{:.1} MiB, {slots} slots: +{:.1} MiB; per conversation {:.1} MiB \
             (its temporal KV cache by arithmetic: {:.1} MiB)",
            mib(a as f64),
            mib(b as f64),
            mib((b as f64 - a as f64) / (slots - 1) as f64),
            mib(kv as f64)
        ),
        (Err(e), _) | (_, Err(e)) => format!("  not measured: {e}"),
    };
    format!(
        "shared LM engine on {}, {what} per conversation at the pack's whole context:\n{line}\n",
        provider.name()
    )
}
