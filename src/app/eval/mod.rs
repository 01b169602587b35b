//! `duplex eval`: a pack's full-duplex behaviour on a benchmark's inputs, the way the field
//! measures it (Full-Duplex-Bench v1 / v1.5: one folder per sample, an `input.wav`, the system's
//! time-synchronous `output.wav` beside it).
//!
//! - `duplex eval run`: every `input.wav` (and v1.5's `clean_input.wav`) under `--inputs`,
//!   through each `--pack`, once per `--seed`, offline: one fresh conversation per file (the
//!   file pipeline built in code: resample to the codec's rate, frame, encode, the LM, decode,
//!   resample back), written into a tree that mirrors the inputs'
//!   (`OUT/<pack>/seed-<s>/<sample>/`): `output.wav` at the input's rate and exactly its length,
//!   the token log (`tokens.jsonl`), the transcript (`transcript.txt`: not `output.json`, which
//!   the benchmark's ASR step writes), and links to the sample's input files, so the
//!   benchmark's own scripts run on the tree unchanged; one `run.json` per pack and seed says
//!   what ran (the pack and its graphs' hashes, quantization, persona, seed, sampling,
//!   alignment, frames, real-time factor). A sample whose outputs exist is skipped: a run
//!   stopped half-way resumes. A bar on a terminal, else a line per input, says how far.
//!   With `--server URL` instead of packs ([`served`]): each input through a running server
//!   in real time, a sample flagged where the server's figures say it was not the model alone.
//! - `duplex eval score`: each sample's voice activity, user and agent (Silero VAD on the
//!   ONNX Runtime already loaded, segmented by Silero's own rules at the benchmark's settings),
//!   v1.5's stop and response latency intervals from it, and, where the benchmark's ASR step
//!   wrote `output.json`, v1's pause handling and smooth turn-taking ([`crate::eval::fdb`]):
//!   `duplex_score.json` beside each sample, and a summary per task.
//! - `duplex eval compare` ([`compare`]): packs run on the same inputs and seeds, each against
//!   a base, pair by pair: decisions, latency differences, where the tokens part; a table and
//!   a plot ([`plot`]).
//! - `duplex eval stereo`: the user and the agent of each sample of a run as one two-channel
//!   file on one clock (`stereo.wav`), for listening or for judges that take both sides.
//!
//! Alignment: agent frame *k* covers [*k*·80 ms, (*k*+1)·80 ms) of `output.wav` from its first
//! sample (`personaplex`, how PersonaPlex was scored), or one frame later (`moshi-client`, how
//! Kyutai's WebSocket client writes what it hears); then trimmed or padded with silence to the
//! input's length.
//!
//! Knows the benchmark's file layout and the stage kinds it assembles; nothing of the model.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use config::{Value, ValueKind};

mod compare;
mod plot;
mod served;

pub use compare::{compare, CompareArgs};

use super::replay::{i, int, node_at, s, Plane};
use crate::audio::{WavFormat, WavReader, WavWriter};
use crate::config::{ConfigError, ConfigErrorKind};
use crate::runtime::{Link, PipelineBuilder};
use crate::stages::{kind, Registry};

/// The command, where messages name a flag or a file.
const COMMAND: &str = "duplex eval";

/// The codec's rate and frame.
const CODEC_RATE: u32 = 24_000;
const FRAME: u64 = 1920;

/// `duplex eval …`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum EvalCmd {
    /// Run every `input.wav` under `--inputs` through each pack, offline, writing the
    /// benchmark's layout (`output.wav` beside links to the inputs) under `--out`.
    Run(RunArgs),
    /// Score a run: voice activity of the user and the agent (Silero VAD), v1.5's stop and
    /// response latency intervals, and v1's pause and turn-taking metrics where an ASR
    /// `output.json` is beside the sample.
    Score(ScoreArgs),
    /// Compare packs run on the same inputs and seeds, each against a base: turn-taking
    /// decisions (McNemar's exact test), paired latency differences (bootstrap intervals),
    /// where the token streams part; a table and a plot.
    Compare(CompareArgs),
    /// Write each sample of a run as one two-channel file, the user left and the agent right.
    Stereo(StereoArgs),
}

/// Flags of `duplex eval score`.
#[derive(Debug, Clone, clap::Args)]
pub struct ScoreArgs {
    /// A run's folder (`OUT/<pack>/seed-<s>`, or any folder above its samples).
    pub run: PathBuf,
    /// Silero VAD's ONNX model.
    #[arg(long, default_value = "models/vad/silero_vad.onnx")]
    pub vad: PathBuf,
    /// v1's backchannel reference: the per-sample distributions of the user's Full-Duplex-Bench
    /// checkout (`icc_gt_distribution.json`, `{sample: [weights]}`); each sample named in it
    /// gets the backchannel metric.
    #[arg(long)]
    pub backchannel_reference: Option<PathBuf>,
}

/// Flags of `duplex eval run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// A model pack (repeatable: each runs the same inputs and seeds).
    #[arg(long, required_unless_present = "server")]
    pub pack: Vec<PathBuf>,
    /// Instead of packs, a running `duplex serve` (`http://host:port`): each input in real
    /// time over its realtime API, a sample flagged where the server dropped, filled or was
    /// late (written under `OUT/<label>/`).
    #[arg(long, conflicts_with_all = ["pack", "greedy"])]
    pub server: Option<String>,
    /// The server's API key, if it wants one.
    #[arg(long, requires = "server")]
    pub key: Option<String>,
    /// The served run's name in the output tree (default `served`).
    #[arg(long, requires = "server")]
    pub label: Option<String>,
    /// The benchmark's inputs: a folder searched for `input.wav` files (a Full-Duplex-Bench
    /// v1 / v1.5 task folder, the whole download, or any folder of samples).
    #[arg(long)]
    pub inputs: PathBuf,
    /// Where the outputs go: `OUT/<pack>/seed-<s>/<sample>/`.
    #[arg(long)]
    pub out: PathBuf,
    /// Sampling seeds, one run per seed (comma-separated; default 0).
    #[arg(long, value_delimiter = ',', default_values_t = [0u64])]
    pub seed: Vec<u64>,
    /// The persona (system prompt) every conversation starts with (needs the pack's tokenizer).
    #[arg(long)]
    pub persona: Option<String>,
    /// Where agent frame k goes in `output.wav`: `personaplex` (from sample 0) or
    /// `moshi-client` (one 80 ms frame later).
    #[arg(long, default_value = "personaplex", value_parser = ["personaplex", "moshi-client"])]
    pub align: String,
    /// Argmax instead of sampling.
    #[arg(long)]
    pub greedy: bool,
    /// Run the samples again even where their outputs exist.
    #[arg(long)]
    pub again: bool,
}

/// Flags of `duplex eval stereo`.
#[derive(Debug, Clone, clap::Args)]
pub struct StereoArgs {
    /// A run's folder (`OUT/<pack>/seed-<s>`, or any folder above its samples).
    pub run: PathBuf,
}

/// One sample: its folder (relative to `--inputs`) and the inputs it holds.
#[derive(Debug, Clone)]
struct Sample {
    rel: PathBuf,
    dir: PathBuf,
    /// `input.wav`, then `clean_input.wav` where the sample has one (v1.5).
    inputs: Vec<&'static str>,
}

/// What an input's outputs are named after: `clean_` for v1.5's `clean_input.wav` (its
/// `clean_output.wav`, `clean_tokens.jsonl`, `clean_transcript.txt`), nothing for `input.wav`.
fn prefix(input: &str) -> &'static str {
    if input == "clean_input.wav" {
        "clean_"
    } else {
        ""
    }
}

fn bad(key: &str, detail: String) -> ConfigError {
    ConfigError::new(COMMAND, ConfigErrorKind::Build, detail).key(key)
}

/// Every folder under `root` that holds an `input.wav`, in path order (links to folders are
/// not followed).
fn samples(root: &Path) -> Result<Vec<Sample>, ConfigError> {
    if !root.is_dir() {
        return Err(bad("--inputs", format!("{}: not a folder", root.display())));
    }
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir)
            .map_err(|e| bad("--inputs", format!("{}: {e}", dir.display())))?;
        let mut subdirs = Vec::new();
        for e in entries.flatten() {
            // A link to a folder is not followed: two links to `.` would walk for ever.
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                subdirs.push(e.path());
            }
        }
        if dir.join("input.wav").is_file() {
            let mut inputs = vec!["input.wav"];
            if dir.join("clean_input.wav").is_file() {
                inputs.push("clean_input.wav");
            }
            let rel = dir.strip_prefix(root).unwrap_or(&dir).to_path_buf();
            found.push(Sample { rel, dir, inputs });
        }
        stack.extend(subdirs);
    }
    found.sort_by(|a, b| a.rel.cmp(&b.rel));
    if found.is_empty() {
        return Err(bad(
            "--inputs",
            format!("{}: no input.wav in it or its folders", root.display()),
        ));
    }
    Ok(found)
}

/// The label of each pack in the output tree: its folder's name (two packs of one name are
/// refused: their outputs would mix).
fn pack_labels(packs: &[PathBuf]) -> Result<Vec<String>, ConfigError> {
    let mut labels: Vec<String> = Vec::new();
    for p in packs {
        if !p.join("pack.yaml").is_file() && !p.join("temporal").is_dir() {
            return Err(bad("--pack", format!("{}: not a model pack", p.display())));
        }
        let label = std::fs::canonicalize(p)
            .unwrap_or_else(|_| p.clone())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "pack".into());
        if labels.contains(&label) {
            return Err(bad(
                "--pack",
                format!("two packs are named `{label}`: their outputs would both be under it"),
            ));
        }
        labels.push(label);
    }
    Ok(labels)
}

/// What one conversation ran with, and the process's resources its runs share (a primed state
/// kept for the next conversation of the same pack and persona).
struct Conversation<'a> {
    pack: &'a Path,
    seed: u64,
    persona: Option<&'a str>,
    greedy: bool,
    resources: Arc<crate::resources::Resources>,
}

/// The file pipeline of one input, built in code: `input` → the codec's rate → frames →
/// Mimi → the LM → Mimi → the input's rate → `agent`; the agent's tokens → `tokens`.
fn pipeline(
    c: &Conversation<'_>,
    input: &Path,
    rate: u32,
    agent: &Path,
    tokens: &Path,
) -> Result<PipelineBuilder, ConfigError> {
    let reg = Registry::builtin();
    let plane = Plane {
        resources: c.resources.clone(),
        ..Plane::default()
    };
    let node = |name: &str, kind: &str, raw: Vec<(&str, Value)>| {
        let raw = raw.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        node_at(&reg, &plane, COMMAND, name, kind, raw, None)
    };
    let pack = s(&c.pack.display().to_string());
    let path = |p: &Path| s(&p.display().to_string());
    let mut temporal = vec![("pack", pack.clone())];
    if let Some(t) = c.persona {
        temporal.push(("persona", s(t)));
    }
    let depformer = vec![
        ("pack", pack.clone()),
        ("seed", int(c.seed)),
        ("greedy", Value::new(None, ValueKind::Boolean(c.greedy))),
    ];
    let b = PipelineBuilder::new()
        .origin(COMMAND)
        .node(node("source", "wav_source", vec![("path", path(input))])?)
        .node(node(
            "down",
            "resample",
            vec![("to", i(CODEC_RATE.into()))],
        )?)
        .node(node("framer", "framer", Vec::new())?)
        .node(node("encode", "mimi_encode", vec![("pack", pack.clone())])?)
        .node(node("temporal", kind::TEMPORAL, temporal)?)
        .node(node("depformer", kind::DEPFORMER, depformer)?)
        .node(node("decode", "mimi_decode", vec![("pack", pack)])?)
        .node(node("up", "resample", vec![("to", i(rate.into()))])?)
        .node(node(
            "sink",
            "wav_sink",
            vec![("path", path(agent)), ("format", s("f32"))],
        )?)
        .node(node("tokens", "token_sink", vec![("path", path(tokens))])?)
        .link(Link::new("source", "down"))
        .link(Link::new("down", "framer"))
        .link(Link::new("framer", "encode"))
        .link(Link::new("encode", "temporal.codes"))
        .link(Link::new("temporal.step", "depformer"))
        .link(Link::new("depformer", "temporal.tokens").feedback())
        .link(Link::new("temporal.agent", "decode"))
        .link(Link::new("temporal.agent", "tokens"))
        .link(Link::new("decode", "up"))
        .link(Link::new("up", "sink"));
    Ok(b.control(plane.control))
}

/// `agent` placed on the input's clock: `lead` samples of silence first, then cut or padded
/// with silence to `len` samples.
fn aligned(agent: &[f32], lead: usize, len: usize) -> Vec<f32> {
    let mut out = vec![0.0; len];
    if lead < len {
        let n = agent.len().min(len - lead);
        out[lead..lead + n].copy_from_slice(&agent[..n]);
    }
    out
}

/// The transcript in a token log: the pieces the agent said, as text.
fn transcript(tokens: &str) -> String {
    let mut text = String::new();
    for line in tokens.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(p) = v.get("piece").and_then(|p| p.as_str()) {
            text.push_str(&p.replace('\u{2581}', " "));
        }
    }
    text.trim().to_string()
}

/// What one input gave.
struct Ran {
    frames: usize,
    audio_s: f64,
    wall_s: f64,
}

/// Runs `input` of `sample` into `dir` (its output, token log and transcript).
fn run_input(
    c: &Conversation<'_>,
    input: &Path,
    dir: &Path,
    align_frames: u64,
) -> anyhow::Result<Ran> {
    let reader = WavReader::open(input)?;
    let (rate, len) = (reader.rate(), reader.frames());
    drop(reader);
    let pre = prefix(&input.file_name().unwrap_or_default().to_string_lossy());
    let (name, tokens_name, said) = (
        format!("{pre}output.wav"),
        format!("{pre}tokens.jsonl"),
        format!("{pre}transcript.txt"),
    );
    let agent = dir.join(format!(".{pre}agent.wav"));
    let tokens = dir.join(format!(".{tokens_name}.partial"));
    let t0 = Instant::now();
    let built = pipeline(c, input, rate, &agent, &tokens)?.build()?;
    let outcome = built.start().wait();
    if let Some(e) = outcome.error {
        return Err(anyhow::Error::new(e).context(format!("running {}", input.display())));
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let samples = WavReader::open(&agent)?.read_all()?;
    let lead = (align_frames * FRAME * u64::from(rate) / u64::from(CODEC_RATE)) as usize;
    let out = aligned(&samples, lead, len as usize);
    let partial = dir.join(format!(".{name}.partial"));
    let mut w = WavWriter::create(&partial, rate, WavFormat::I16)?;
    w.write(&out)?;
    w.finalize()?;
    let log = std::fs::read_to_string(&tokens)
        .with_context(|| format!("reading {}", tokens.display()))?;
    let frames = log.lines().count();
    std::fs::write(dir.join(&said), transcript(&log) + "\n")
        .with_context(|| format!("writing {}", dir.join(&said).display()))?;
    std::fs::rename(&tokens, dir.join(&tokens_name))?;
    let _ = std::fs::remove_file(&agent);
    // Last: the output's presence says the sample is done.
    std::fs::rename(&partial, dir.join(&name))?;
    Ok(Ran {
        frames,
        audio_s: len as f64 / f64::from(rate),
        wall_s,
    })
}

/// Links the sample's own files (its inputs and annotations) into its output folder, so the
/// benchmark's scripts find them beside `output.wav`.
fn link_inputs(sample: &Sample, dir: &Path) -> anyhow::Result<()> {
    for e in std::fs::read_dir(&sample.dir)?.flatten() {
        let p = e.path();
        let name = e.file_name();
        let n = name.to_string_lossy();
        let ours = n.starts_with('.')
            || n.ends_with("output.wav")
            || n == "output.json"
            || n.ends_with("tokens.jsonl")
            || n.ends_with("transcript.txt")
            || n == "duplex_score.json"
            || n == "stereo.wav";
        if !p.is_file() || ours {
            continue;
        }
        let link = dir.join(&name);
        if link.symlink_metadata().is_ok() {
            continue;
        }
        let target = std::fs::canonicalize(&p)?;
        std::os::unix::fs::symlink(&target, &link)
            .with_context(|| format!("linking {}", link.display()))?;
    }
    Ok(())
}

/// `duplex eval run`.
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) for flags, inputs or packs that cannot run; a run error (exit 1)
/// naming the input that failed, the samples done before it kept.
pub fn run(a: &RunArgs) -> anyhow::Result<String> {
    if let Some(url) = &a.server {
        return served::run(a, url, &samples(&a.inputs)?);
    }
    let labels = pack_labels(&a.pack)?;
    let found = samples(&a.inputs)?;
    let chosen = crate::config::ort::from_env(COMMAND, None)?;
    super::load_ort_for(COMMAND, chosen.as_ref())?;
    let align_frames = u64::from(a.align == "moshi-client");
    let inputs: usize = found.iter().map(|s| s.inputs.len()).sum();
    let progress = Progress::new((inputs * a.pack.len() * a.seed.len()) as u64);
    let mut summary = String::new();
    for (pack, label) in a.pack.iter().zip(&labels) {
        let opened = crate::model::pack::Pack::open(pack)?;
        for &seed in &a.seed {
            let root = a.out.join(label).join(format!("seed-{seed}"));
            std::fs::create_dir_all(&root)
                .with_context(|| format!("creating {}", root.display()))?;
            let c = Conversation {
                pack,
                seed,
                persona: a.persona.as_deref(),
                greedy: a.greedy,
                resources: Arc::new(super::process_resources(1)),
            };
            let (mut frames, mut audio_s, mut wall_s, mut ran, mut skipped) = (0, 0.0, 0.0, 0, 0);
            for (k, sample) in found.iter().enumerate() {
                let dir = root.join(&sample.rel);
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                link_inputs(sample, &dir)?;
                for input in &sample.inputs {
                    let done = dir.join(format!("{}output.wav", prefix(input))).is_file();
                    if done && !a.again {
                        skipped += 1;
                        progress.done(String::new);
                        continue;
                    }
                    let r = run_input(&c, &sample.dir.join(input), &dir, align_frames)?;
                    progress.done(|| {
                        format!(
                            "{label} seed {seed} [{}/{}] {}/{}: {} frames, {:.2} x real time",
                            k + 1,
                            found.len(),
                            sample.rel.display(),
                            input,
                            r.frames,
                            r.audio_s / r.wall_s.max(1e-9)
                        )
                    });
                    frames += r.frames;
                    audio_s += r.audio_s;
                    wall_s += r.wall_s;
                    ran += 1;
                }
            }
            let record = serde_json::json!({
                "command": "duplex eval run",
                "pack": {
                    "path": pack.display().to_string(),
                    "name": opened.manifest.name,
                    "quantization": opened.manifest.quantization.as_ref().map(|q| {
                        q.iter().map(|(g, r)| (g.clone(), r.name().to_string()))
                            .collect::<std::collections::BTreeMap<_, _>>()
                    }),
                    "graphs": super::pack_files(&pack.display().to_string()),
                },
                "inputs": a.inputs.display().to_string(),
                "samples": found.len(),
                "persona": a.persona,
                "seed": seed,
                "sampling": if a.greedy {
                    serde_json::json!("greedy")
                } else {
                    serde_json::json!({"text_temperature": 0.7, "text_top_k": 25,
                        "audio_temperature": 0.8, "audio_top_k": 250})
                },
                "align": a.align,
                "frame_ms": 80,
                "this_run": {
                    "inputs_run": ran,
                    "inputs_skipped_as_done": skipped,
                    "frames": frames,
                    "audio_s": audio_s,
                    "wall_s": wall_s,
                    "real_time_factor": if audio_s > 0.0 { wall_s / audio_s } else { 0.0 },
                },
            });
            let file = root.join("run.json");
            std::fs::write(&file, serde_json::to_string_pretty(&record)? + "\n")
                .with_context(|| format!("writing {}", file.display()))?;
            summary.push_str(&format!(
                "{label} seed {seed}: {ran} inputs run ({skipped} done before), {frames} frames, \
                 {audio_s:.1} s of audio in {wall_s:.1} s -> {}\n",
                root.display()
            ));
        }
    }
    Ok(summary)
}

/// How far a run is: a bar on a terminal (inputs done of all, time left, the last input's
/// speed), else a line per input run.
struct Progress(Option<indicatif::ProgressBar>);

impl Progress {
    fn new(total: u64) -> Self {
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return Self(None);
        }
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "duplex eval [{bar:30}] {pos}/{len} inputs, {elapsed} gone, ~{eta} to go  {wide_msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        Self(Some(bar))
    }

    /// One input done (`line`: what it was, empty for one skipped as done before).
    fn done(&self, line: impl FnOnce() -> String) {
        match &self.0 {
            Some(bar) => {
                let l = line();
                if !l.is_empty() {
                    bar.set_message(l);
                }
                bar.inc(1);
            }
            None => {
                let l = line();
                if !l.is_empty() {
                    eprintln!("duplex eval: {l}");
                }
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

/// `duplex eval stereo`: `stereo.wav` beside each `output.wav` under `run` (the user left, the
/// agent right, at the input's rate).
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) for a folder without outputs; an error naming the file that
/// cannot be read or written.
pub fn stereo(a: &StereoArgs) -> anyhow::Result<String> {
    let found = samples_with_output(&a.run)?;
    for dir in &found {
        let (rate, left) = pcm16(&dir.join("input.wav"))?;
        let (agent_rate, right) = pcm16(&dir.join("output.wav"))?;
        if agent_rate != rate {
            return Err(bad(
                "run",
                format!(
                    "{}: output.wav is at {agent_rate} Hz, input.wav at {rate} Hz",
                    dir.display()
                ),
            )
            .into());
        }
        let spec = hound::WavSpec {
            channels: 2,
            sample_rate: rate,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let path = dir.join("stereo.wav");
        let mut w = hound::WavWriter::create(&path, spec)
            .with_context(|| format!("writing {}", path.display()))?;
        for k in 0..left.len().max(right.len()) {
            w.write_sample(left.get(k).copied().unwrap_or(0))?;
            w.write_sample(right.get(k).copied().unwrap_or(0))?;
        }
        w.finalize()?;
    }
    Ok(format!(
        "wrote {} stereo.wav files (user left, agent right) under {}\n",
        found.len(),
        a.run.display()
    ))
}

/// `path`'s samples at 16 kHz, one stream.
fn at_16k(path: &Path) -> anyhow::Result<Vec<f32>> {
    let mut r = WavReader::open(path)?;
    let rate = r.rate();
    resampled(r.read_all()?, rate, 16_000)
}

/// A whole signal `x` at `from` Hz, at `to` Hz (the resampler's delay trimmed: on the same
/// clock).
fn resampled(x: Vec<f32>, from: u32, to: u32) -> anyhow::Result<Vec<f32>> {
    if from == to {
        return Ok(x);
    }
    let mut rs = crate::audio::StreamResampler::new(from, to, 1024)?;
    let mut out = Vec::with_capacity(x.len() * to as usize / from as usize + 1024);
    rs.process(&x, &mut out)?;
    rs.flush(&mut out)?;
    Ok(out)
}

/// An ASR file's words (`{"chunks": [{"text", "timestamp": [start, end]}]}`, as the
/// benchmark's ASR step writes it).
fn asr_words(path: &Path) -> anyhow::Result<Vec<crate::eval::fdb::Word>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| bad("run", format!("{}: not JSON: {e}", path.display())))?;
    let chunks = v["chunks"].as_array().ok_or_else(|| {
        bad(
            "run",
            format!("{}: no `chunks` list (not an ASR output)", path.display()),
        )
    })?;
    Ok(chunks
        .iter()
        .map(|c| crate::eval::fdb::Word {
            start: c["timestamp"][0].as_f64(),
            end: c["timestamp"][1].as_f64(),
        })
        .collect())
}

/// An annotation's first window (`[{"timestamp": [start, end]}]`), if the file is there.
fn window(path: &Path) -> anyhow::Result<Option<(f64, f64)>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| bad("run", format!("{}: not JSON: {e}", path.display())))?;
    let t = &v[0]["timestamp"];
    match (t[0].as_f64(), t[1].as_f64()) {
        (Some(a), Some(b)) => Ok(Some((a, b))),
        _ => Err(bad(
            "run",
            format!("{}: no `[{{\"timestamp\": [start, end]}}]`", path.display()),
        )
        .into()),
    }
}

fn pairs(v: &[(f64, f64)]) -> serde_json::Value {
    v.iter().map(|&(a, b)| serde_json::json!([a, b])).collect()
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// One task's scores in a run, for the summary.
#[derive(Default)]
struct TaskScores {
    /// Each sample's first response gap (seconds).
    response: Vec<f64>,
    /// Each sample's first stop overlap (seconds).
    stop: Vec<f64>,
    /// Smooth turn-taking, where an ASR was beside the sample.
    turns: Vec<crate::eval::fdb::Turn>,
    /// Pause handling's TOR, likewise.
    pauses: Vec<u8>,
    /// Backchannel frequency, JSD and (where an ASR ran) TOR, where the sample had a reference.
    backchannel: Vec<(f64, f64, Option<u8>)>,
    samples: usize,
}

/// The backchannel reference file: `{sample: [weights]}`, each with two or more weights.
fn backchannel_reference(
    path: &Path,
) -> anyhow::Result<std::collections::BTreeMap<String, Vec<f64>>> {
    let key = "--backchannel-reference";
    // A FIFO or a device would be waited on for ever.
    let meta = std::fs::metadata(path).map_err(|e| bad(key, format!("{}: {e}", path.display())))?;
    if !meta.is_file() {
        return Err(bad(key, format!("{}: not a regular file", path.display())).into());
    }
    let text =
        std::fs::read_to_string(path).map_err(|e| bad(key, format!("{}: {e}", path.display())))?;
    let v: std::collections::BTreeMap<String, Vec<f64>> =
        serde_json::from_str(&text).map_err(|e| {
            bad(
                key,
                format!(
                    "{}: not `{{\"sample\": [weights, ...]}}`: {e}",
                    path.display()
                ),
            )
        })?;
    if let Some((name, _)) = v.iter().find(|(_, w)| w.len() < 2) {
        return Err(bad(
            key,
            format!(
                "{}: sample `{name}` has fewer than two weights",
                path.display()
            ),
        )
        .into());
    }
    Ok(v)
}

/// The task a sample belongs to: the folder above it (`candor_turn_taking` for
/// `candor_turn_taking/12`), or `top` where the sample is directly under the folder scored.
fn task_of(rel: &Path) -> String {
    rel.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "top".into())
}

/// Scores one sample (its `input.wav` and `output.wav`, and the benchmark's annotations and
/// ASR where they are beside them) and writes them as its `duplex_score.json`.
fn score_sample(
    vad: &crate::model::vad::Vad,
    dir: &Path,
    reference: Option<&[f64]>,
) -> anyhow::Result<serde_json::Value> {
    use crate::eval::{fdb, silero};
    let user16 = at_16k(&dir.join("input.wav"))?;
    let agent16 = at_16k(&dir.join("output.wav"))?;
    let user = silero::seconds(&silero::segments(
        &vad.probabilities(&user16)?,
        user16.len(),
    ));
    let agent = silero::seconds(&silero::segments(
        &vad.probabilities(&agent16)?,
        agent16.len(),
    ));
    let t = fdb::timing(&user, &agent);
    let mut record = serde_json::json!({
        "vad": {"user": pairs(&user), "agent": pairs(&agent)},
        "v1.5": {
            "user_merged": pairs(&t.user_merged),
            "agent_merged": pairs(&t.model_merged),
            "stop_latency_intervals": t.stop,
            "response_latency_intervals": t.response,
        },
    });
    let asr = dir.join("output.json");
    let words = if asr.is_file() {
        Some(asr_words(&asr)?)
    } else {
        None
    };
    if let Some(gt) = reference {
        // As the benchmark reads the output for this metric: the file's samples given to
        // Silero as if at 16 kHz whatever their rate, its segments in seconds rounded to 0.1.
        let mut r = WavReader::open(&dir.join("output.wav"))?;
        let rate = r.rate();
        let raw = r.read_all()?;
        let segs = silero::rounded_seconds(
            &silero::segments(&vad.probabilities(&raw)?, raw.len()),
            raw.len(),
        );
        let b = fdb::backchannel(&segs, words.as_deref(), rate, raw.len() as u64, gt);
        record["v1"]["backchannel"] = serde_json::json!({
            "tor": b.tor,
            "frequency": b.freq,
            "jsd": b.jsd,
            "backchannels": pairs(&b.backchannels),
            "segments_as_read": "the output's samples as if at 16 kHz, rounded to 0.1 s",
        });
    }
    if let Some(words) = words {
        if window(&dir.join("pause.json"))?.is_some() {
            if let Some(tor) = fdb::take_turn(&words, true) {
                record["v1"]["pause_handling"] = serde_json::json!({"tor": tor});
            }
        }
        if let Some((turn_end, _)) = window(&dir.join("turn_taking.json"))? {
            if let Some(turn) = fdb::turn(&words, turn_end) {
                record["v1"]["smooth_turn_taking"] = serde_json::json!({
                    "tor": turn.tor, "latency": turn.latency, "latency_raw": turn.latency_raw});
            }
        }
    }
    let file = dir.join("duplex_score.json");
    std::fs::write(&file, serde_json::to_string_pretty(&record)? + "\n")
        .with_context(|| format!("writing {}", file.display()))?;
    Ok(record)
}

/// The length of a scored sample's first interval of `kind` (`response_latency_intervals`,
/// `stop_latency_intervals`), in seconds.
fn first_interval(score: &serde_json::Value, kind: &str) -> Option<f64> {
    let i = &score["v1.5"][kind][0];
    Some(i[1].as_f64()? - i[0].as_f64()?)
}

/// Opens Silero VAD on the ONNX Runtime the process loads.
fn open_vad(path: &Path) -> anyhow::Result<crate::model::vad::Vad> {
    let chosen = crate::config::ort::from_env(COMMAND, None)?;
    super::load_ort_for(COMMAND, chosen.as_ref())?;
    Ok(crate::model::vad::Vad::open(path)
        .map_err(|e| bad("--vad", format!("{}: {e}", path.display())))?)
}

/// `duplex eval score`.
///
/// # Errors
///
/// A [`ConfigError`] (exit 2) for a folder without outputs or a VAD model that does not open;
/// an error naming the file that cannot be read.
pub fn score(a: &ScoreArgs) -> anyhow::Result<String> {
    use crate::eval::fdb;
    let found = samples_with_output(&a.run)?;
    let reference = a
        .backchannel_reference
        .as_deref()
        .map(backchannel_reference)
        .transpose()?;
    let vad = open_vad(&a.vad)?;
    // Per task: response and stop latencies (each sample's first interval), and v1's turns
    // where there was an ASR.
    let mut tasks: std::collections::BTreeMap<String, TaskScores> = Default::default();
    for dir in &found {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let gt = reference.as_ref().and_then(|r| r.get(&name));
        let record = score_sample(&vad, dir, gt.map(Vec::as_slice))?;
        let rel = dir.strip_prefix(&a.run).unwrap_or(dir);
        let entry = tasks.entry(task_of(rel)).or_default();
        entry.samples += 1;
        let bc = &record["v1"]["backchannel"];
        if let (Some(f), Some(j)) = (bc["frequency"].as_f64(), bc["jsd"].as_f64()) {
            entry
                .backchannel
                .push((f, j, bc["tor"].as_u64().map(|t| t as u8)));
        }
        entry
            .response
            .extend(first_interval(&record, "response_latency_intervals"));
        entry
            .stop
            .extend(first_interval(&record, "stop_latency_intervals"));
        if let Some(tor) = record["v1"]["pause_handling"]["tor"].as_u64() {
            entry.pauses.push(tor as u8);
        }
        let turn = &record["v1"]["smooth_turn_taking"];
        if let Some(tor) = turn["tor"].as_u64() {
            entry.turns.push(fdb::Turn {
                tor: tor as u8,
                latency: turn["latency"].as_f64(),
                latency_raw: turn["latency_raw"].as_f64(),
            });
        }
    }
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{:.0} ms", x * 1e3));
    let mut text = format!(
        "{} samples scored under {} (duplex_score.json beside each)\n\
         task: samples; answered: the agent spoke after the user's speech ended (from voice activity: a proxy of the ASR's TOR); v1.5 from voice activity: median response latency (first gap after the user), median stop latency (first overlap); v1 from the ASR where present; backchannel where the reference names the sample\n",
        found.len(),
        a.run.display()
    );
    for (task, t) in &tasks {
        let TaskScores {
            response: resp,
            stop,
            turns,
            pauses,
            backchannel,
            samples: n,
        } = t;
        let mut line = format!(
            "  {task}: {n}; answered {}/{n} (VAD proxy of TOR); response {} ({} samples), stop {} ({} samples)",
            resp.len(),
            ms(median(resp.clone())),
            resp.len(),
            ms(median(stop.clone())),
            stop.len()
        );
        if !turns.is_empty() {
            let (tor, lat) = fdb::turn_means(turns);
            line.push_str(&format!(
                "; smooth turn-taking TOR {tor:.3}, latency {}",
                ms(lat)
            ));
        }
        if !pauses.is_empty() {
            let tor = pauses.iter().map(|&t| f64::from(t)).sum::<f64>() / pauses.len() as f64;
            line.push_str(&format!("; pause handling TOR {tor:.3}"));
        }
        if !backchannel.is_empty() {
            let k = backchannel.len() as f64;
            let freq = backchannel.iter().map(|b| b.0).sum::<f64>() / k;
            let jsd = backchannel.iter().map(|b| b.1).sum::<f64>() / k;
            line.push_str(&format!(
                "; backchannel frequency {freq:.3}/s, JSD {jsd:.3}"
            ));
            let tors: Vec<f64> = backchannel
                .iter()
                .filter_map(|b| b.2.map(f64::from))
                .collect();
            if !tors.is_empty() {
                line.push_str(&format!(
                    ", TOR {:.3}",
                    tors.iter().sum::<f64>() / tors.len() as f64
                ));
            }
        }
        text.push_str(&line);
        text.push('\n');
    }
    Ok(text)
}

/// A WAV's rate and its samples as 16-bit integers: as they are in a mono 16-bit file (the
/// outputs, and most inputs), else down-mixed and quantized.
fn pcm16(path: &Path) -> anyhow::Result<(u32, Vec<i16>)> {
    let mut r = WavReader::open(path)?;
    let rate = r.rate();
    if r.channels() == 1 && r.format() == (16, false) {
        let mut h =
            hound::WavReader::open(path).with_context(|| format!("reading {}", path.display()))?;
        let v = h
            .samples::<i16>()
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("reading {}", path.display()))?;
        return Ok((rate, v));
    }
    let v = r.read_all()?;
    Ok((
        rate,
        v.iter()
            .map(|x| (x * 32768.0).round().clamp(-32768.0, 32767.0) as i16)
            .collect(),
    ))
}

/// The folders under `root` with both `input.wav` and `output.wav`.
fn samples_with_output(root: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let all = samples(root).map_err(|_| {
        bad(
            "run",
            format!(
                "{}: no samples with input.wav and output.wav (a `duplex eval run` folder)",
                root.display()
            ),
        )
    })?;
    let done: Vec<PathBuf> = all
        .into_iter()
        .map(|s| s.dir)
        .filter(|d| d.join("output.wav").is_file())
        .collect();
    if done.is_empty() {
        return Err(bad(
            "run",
            format!(
                "{}: no output.wav yet (run `duplex eval run` first)",
                root.display()
            ),
        ));
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_is_placed_then_cut_or_padded_to_the_input() {
        let agent = [1.0, 2.0, 3.0];
        assert_eq!(aligned(&agent, 0, 2), [1.0, 2.0]);
        assert_eq!(aligned(&agent, 0, 5), [1.0, 2.0, 3.0, 0.0, 0.0]);
        assert_eq!(aligned(&agent, 2, 4), [0.0, 0.0, 1.0, 2.0]);
        assert_eq!(aligned(&agent, 5, 4), [0.0; 4]);
    }

    #[test]
    fn the_transcript_is_the_pieces_said() {
        let log = "{\"frame\":0,\"text\":3,\"audio\":[1]}\n\
                   {\"frame\":1,\"text\":9,\"piece\":\"\u{2581}hello\",\"audio\":[1]}\n\
                   {\"frame\":2,\"text\":10,\"piece\":\"\u{2581}there\",\"audio\":[1]}\n";
        assert_eq!(transcript(log), "hello there");
    }
}
