//! `duplex replay`: the LM on any pack, codes in, tokens out — the `lm-replay` pipeline built
//! from command-line flags instead of a file; or, with `--recording`, a recorded conversation
//! re-run headless through the same LM stages with the same params and inputs (the user codes
//! the model saw; the agent's Mimi decoder too when the live run had one), itself recorded,
//! then compared with the live run
//! ([`compare`](crate::observe::compare)).

use std::path::PathBuf;

use config::{Value, ValueKind};

use crate::config::{params, ConfigError, ConfigErrorKind};
use crate::observe::compare::{self, Comparison};
use crate::observe::record::{Recorded, Recording};
use crate::resources::Resources;
use crate::runtime::{ControlPlane, Link, Node, PipelineBuilder, RunReport};
use crate::stages::{kind, BuildContext, Registry};
use std::sync::Arc;

/// Flags of `duplex replay`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ReplayArgs {
    /// Model pack directory (a bare exporter directory works with PersonaPlex defaults). With
    /// `--recording`: run on this pack instead of the recorded one.
    #[arg(long)]
    pub pack: Option<PathBuf>,
    /// User codes: a JSON array of frames, each an array of 8 ints. Repeat it to run several
    /// conversations as one batch of the shared engine (`--out` is then a folder, with one
    /// `<codes file name>.jsonl` per conversation).
    #[arg(long, conflicts_with = "recording")]
    pub codes: Vec<PathBuf>,
    /// The LM's graphs: `own` (one session per conversation) or `shared` (the process's
    /// engine, every conversation stepped in one batched call). Default: own for one
    /// conversation, shared for several.
    #[arg(long, value_parser = ["own", "shared"])]
    pub engine: Option<String>,
    /// A recording (`record:` of a pipeline): re-run its LM headless and compare.
    #[arg(long)]
    pub recording: Option<PathBuf>,
    /// The execution provider the LM runs on, `cpu` or `cuda` (default: cpu; with
    /// `--recording`, the recorded one).
    #[arg(long, value_parser = ["cpu", "cuda"])]
    pub provider: Option<String>,
    /// With `--recording`: feed frames at real time (80 ms) instead of as fast as possible.
    #[arg(long)]
    pub paced: bool,
    /// Output: one JSON line per agent frame (a folder of them for several `--codes`); with
    /// `--recording`, a new folder for the replay's own recording (timings, LM stream, tokens).
    #[arg(long)]
    pub out: PathBuf,
    /// Sampling seed (the default of `--text-seed` and `--audio-seed`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Seed of the text sampler (default: `--seed`).
    #[arg(long)]
    pub text_seed: Option<u64>,
    /// Seed of the audio sampler (default: derived from `--seed`).
    #[arg(long)]
    pub audio_seed: Option<u64>,
    /// Argmax instead of sampling.
    #[arg(long)]
    pub greedy: bool,
    /// Text temperature (default 0.7; 0 = greedy text).
    #[arg(long)]
    pub text_temperature: Option<f64>,
    /// Multiplies the text padding token's probability by exp(PAD_MULT) before the draw
    /// (positive: the agent speaks less; negative: more). Default 0 (off).
    #[arg(long, allow_hyphen_values = true)]
    pub pad_mult: Option<f64>,
    /// Repetition penalty of the text logits over the last `--repetition-penalty-context`
    /// words (default 1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// Words the repetition penalty looks at (default 64).
    #[arg(long)]
    pub repetition_penalty_context: Option<u64>,
    /// End after this many agent frames (default 0 = no cap).
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Persona text as token ids, comma-separated, forced while priming.
    #[arg(long, value_delimiter = ',')]
    pub persona_tokens: Vec<i64>,
    /// Persona text, tokenized with `--tokenizer` and forced while priming.
    #[arg(long)]
    pub persona: Option<String>,
    /// SentencePiece model for `--persona` and the transcript (the `piece` of each line).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Silence spacer frames while priming (default 6).
    #[arg(long)]
    pub silence_frames: Option<u64>,
    /// How the priming frames run: `stepped` (default, the reference), `chunked` (prefills),
    /// or `cached` (chunked once, then restored for every later conversation of the run with
    /// the same priming).
    #[arg(long, value_parser = ["stepped", "chunked", "cached"])]
    pub priming: Option<String>,
    /// KV cache handling: resident (default) or host.
    #[arg(long)]
    pub kv: Option<String>,
    /// Depformer substeps whose tokens are all provided (the user stream's): skip their graph
    /// runs (default; the same tokens) or run them.
    #[arg(long, value_parser = ["skip", "run"])]
    pub user_substeps: Option<String>,
}

pub(super) fn s(v: &str) -> Value {
    Value::new(None, ValueKind::String(v.to_string()))
}

pub(super) fn i(v: i64) -> Value {
    Value::new(None, ValueKind::I64(v))
}

/// An unsigned flag's value as a param value (one past `i64::MAX` stays out of range for the
/// stage's check to name, rather than wrapping).
pub(super) fn int(v: u64) -> Value {
    match i64::try_from(v) {
        Ok(v) => i(v),
        Err(_) => Value::new(None, ValueKind::U64(v)),
    }
}

/// A replayed pipeline's control plane and conversation count, shared by its stages, and the
/// process's resources, shared by every replayed conversation.
#[derive(Default)]
pub(super) struct Plane {
    pub(super) control: ControlPlane,
    pub(super) conversation: crate::stages::Conversation,
    pub(super) resources: Arc<Resources>,
}

fn node(
    reg: &Registry,
    plane: &Plane,
    name: &str,
    kind: &str,
    raw: Vec<(&str, Value)>,
) -> Result<Node, ConfigError> {
    let raw: Vec<(String, Value)> = raw.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    node_at(reg, plane, "duplex replay", name, kind, raw, None)
}

pub(super) fn node_at(
    reg: &Registry,
    plane: &Plane,
    file: &str,
    name: &str,
    kind: &str,
    raw: Vec<(String, Value)>,
    recording: Option<&Recording>,
) -> Result<Node, ConfigError> {
    let Some(k) = reg.get(kind) else {
        return Err(ConfigError::new(
            file,
            ConfigErrorKind::UnknownKind,
            format!("no stage kind `{kind}`"),
        ));
    };
    let p = params::check(file, name, kind, k.params, &raw)?;
    let cx = BuildContext::new(name, file, &plane.control, k, &plane.resources)
        .with_recording(recording)
        .with_conversation(&plane.conversation);
    let body = (k.build)(&cx, &p).map_err(|e| super::build_error(file, name, &p, e))?;
    Ok(Node {
        name: name.into(),
        kind: kind.into(),
        inputs: (k.inputs)(),
        outputs: (k.outputs)(),
        body,
    })
}

/// The output file of each `--codes` file: `--out` itself for one, `--out/<name>.jsonl` for
/// several.
fn outputs(a: &ReplayArgs) -> Result<Vec<PathBuf>, ConfigError> {
    if a.codes.len() < 2 {
        return Ok(vec![a.out.clone()]);
    }
    let bad = |m: String| ConfigError::new("duplex replay", ConfigErrorKind::Build, m);
    std::fs::create_dir_all(&a.out)
        .map_err(|e| bad(format!("`--out` {}: {e}", a.out.display())))?;
    let mut outs: Vec<PathBuf> = Vec::new();
    for c in &a.codes {
        let stem = c
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "codes".into());
        let o = a.out.join(format!("{stem}.jsonl"));
        if outs.contains(&o) {
            return Err(bad(format!(
                "two `--codes` files are named `{stem}`: their outputs would both be {}",
                o.display()
            )));
        }
        outs.push(o);
    }
    Ok(outs)
}

/// Builds the replay pipeline of one conversation.
///
/// # Errors
///
/// A [`ConfigError`] naming the flag's stage and the problem (missing pack, bad codes file…).
fn build_one(
    a: &ReplayArgs,
    codes: Option<&std::path::Path>,
    out: &std::path::Path,
    resources: &Arc<Resources>,
) -> Result<PipelineBuilder, ConfigError> {
    let reg = Registry::builtin();
    let missing = |flag: &str| {
        ConfigError::new(
            "duplex replay",
            ConfigErrorKind::Missing,
            format!("`{flag}` is required (or give `--recording DIR`)"),
        )
    };
    let pack = a.pack.as_ref().ok_or_else(|| missing("--pack"))?;
    let codes = codes.ok_or_else(|| missing("--codes"))?;
    let pack = pack.display().to_string();
    let engine = match (&a.engine, a.codes.len()) {
        (Some(e), _) => e.as_str(),
        (None, n) if n > 1 => "shared",
        (None, _) => "own",
    };
    let mut temporal = vec![("pack", s(&pack)), ("engine", s(engine))];
    if !a.persona_tokens.is_empty() {
        temporal.push((
            "persona_tokens",
            Value::new(
                None,
                ValueKind::Array(a.persona_tokens.iter().map(|&t| i(t)).collect()),
            ),
        ));
    }
    if let Some(t) = &a.persona {
        temporal.push(("persona", s(t)));
    }
    if let Some(t) = &a.tokenizer {
        temporal.push(("tokenizer", s(&t.display().to_string())));
    }
    if let Some(n) = a.silence_frames {
        temporal.push(("silence_frames", i(n as i64)));
    }
    if let Some(kv) = &a.kv {
        temporal.push(("kv", s(kv)));
    }
    if let Some(p) = &a.priming {
        temporal.push(("priming", s(p)));
    }
    if let Some(n) = a.max_steps {
        temporal.push(("max_steps", int(n)));
    }
    let mut depformer = vec![
        ("pack", s(&pack)),
        ("engine", s(engine)),
        ("seed", int(a.seed)),
        ("greedy", Value::new(None, ValueKind::Boolean(a.greedy))),
    ];
    // Out of range: the stage's own check names the param.
    for (k, v) in [("text_seed", a.text_seed), ("audio_seed", a.audio_seed)] {
        if let Some(v) = v {
            depformer.push((k, int(v)));
        }
    }
    for (k, v) in [
        ("text_temperature", a.text_temperature),
        ("pad_mult", a.pad_mult),
        ("repetition_penalty", a.repetition_penalty),
    ] {
        if let Some(v) = v {
            depformer.push((k, Value::new(None, ValueKind::Float(v))));
        }
    }
    if let Some(n) = a.repetition_penalty_context {
        depformer.push(("repetition_penalty_context", int(n)));
    }
    if let Some(u) = &a.user_substeps {
        depformer.push(("user_substeps", s(u)));
    }
    if let Some(p) = &a.provider {
        temporal.push(("execution_provider", s(p)));
        depformer.push(("execution_provider", s(p)));
    }
    let plane = Plane {
        resources: resources.clone(),
        ..Plane::default()
    };
    let b = PipelineBuilder::new()
        .origin("duplex replay")
        .node(node(
            &reg,
            &plane,
            "codes",
            "codes_source",
            vec![("path", s(&codes.display().to_string()))],
        )?)
        .node(node(&reg, &plane, "temporal", kind::TEMPORAL, temporal)?)
        .node(node(&reg, &plane, "depformer", kind::DEPFORMER, depformer)?)
        .node(node(
            &reg,
            &plane,
            "tokens",
            "token_sink",
            vec![("path", s(&out.display().to_string()))],
        )?)
        .link(Link::new("codes", "temporal.codes"))
        .link(Link::new("temporal.step", "depformer"))
        .link(Link::new("depformer", "temporal.tokens").feedback())
        .link(Link::new("temporal.agent", "tokens"))
        .control(plane.control);
    Ok(b)
}

/// Runs the replay to the end.
///
/// # Errors
///
/// Configuration errors (exit code 2) and run errors (exit code 1).
pub fn run(a: &ReplayArgs) -> anyhow::Result<Vec<RunReport>> {
    if a.recording.is_some() {
        return Ok(vec![run_recording(a)?.0]);
    }
    load_ort()?;
    let outs = outputs(a)?;
    // The shared engine holds one slot per conversation; they are fed together, once all have
    // primed (a batch of every conversation, whatever each one's priming took).
    let mut resources = super::process_resources(outs.len());
    resources.start_together(outs.len());
    let resources = Arc::new(resources);
    let mut built = Vec::new();
    for (i, out) in outs.iter().enumerate() {
        built.push(build_one(a, a.codes.get(i).map(|c| c.as_path()), out, &resources)?.build()?);
    }
    // Held to the end, for the summary (an engine closes when its last conversation leaves).
    let engines = resources.engines();
    let running: Vec<_> = built.into_iter().map(|p| p.start()).collect();
    // A signal stops every conversation, not only the first.
    let _signals =
        super::SignalGuard::install_all(running.iter().map(|r| r.stop_handle()).collect());
    let mut reports = Vec::new();
    let mut first_err = None;
    for r in running {
        match r.wait().into_result() {
            Ok(rep) => reports.push(rep),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e.into());
    }
    if outs.len() > 1 || a.engine.as_deref() == Some("shared") {
        for e in &engines {
            let st = &e.stats;
            use std::sync::atomic::Ordering::Relaxed;
            tracing::info!(
                conversations = outs.len(),
                temporal_ticks = st.temporal_ticks.load(Relaxed),
                temporal_steps = st.temporal_rows.load(Relaxed),
                mean_batch = format!("{:.2}", st.mean_temporal_batch()),
                max_batch = st.temporal_max_batch.load(Relaxed),
                depformer_ticks = st.depformer_ticks.load(Relaxed),
                late = st.late.load(Relaxed),
                "shared engine"
            );
        }
    }
    Ok(reports)
}

/// Loads ONNX Runtime before anything else: a replay has no settings file, so the library is
/// `DUPLEX__ORT__LIBRARY`'s, else the search's (`ORT_DYLIB_PATH`, the project's `.venv`…).
fn load_ort() -> anyhow::Result<()> {
    let chosen = crate::config::ort::from_env(COMMAND, None)?;
    super::load_ort_for(COMMAND, chosen.as_ref())?;
    Ok(())
}

/// The command, where messages name a file.
const COMMAND: &str = "duplex replay";

/// A recording's error as a configuration error naming its file.
pub(crate) fn recording_error(e: &crate::observe::record::RecordError) -> ConfigError {
    ConfigError::new(&e.at, ConfigErrorKind::Build, e.what.clone())
}

/// A replay of a recording: the pipeline to run, the replay's own recording, and the live run.
struct FromRecording {
    builder: PipelineBuilder,
    recording: std::sync::Arc<Recording>,
    live: Recorded,
}

/// A recorded stage's params as raw values (for the kind's own check), with `overrides`.
fn recorded_params(
    file: &str,
    stage: &serde_json::Value,
    overrides: &[(&str, Option<Value>)],
) -> Result<Vec<(String, Value)>, ConfigError> {
    let name = stage["name"].as_str().unwrap_or("?");
    let mut raw = Vec::new();
    for (k, v) in stage["params"].as_object().into_iter().flatten() {
        if overrides.iter().any(|(o, v)| o == k && v.is_some()) {
            continue;
        }
        let v = params::json_to_config(v).ok_or_else(|| {
            ConfigError::new(
                file,
                ConfigErrorKind::WrongType,
                format!("recorded value {v} is not a param value; was the manifest edited?"),
            )
            .stage(name)
            .key(k.clone())
        })?;
        raw.push((k.clone(), v));
    }
    for (k, v) in overrides {
        if let Some(v) = v {
            raw.push((k.to_string(), v.clone()));
        }
    }
    Ok(raw)
}

/// One LM stage of a recording, replayed: its name, kind and recorded params.
struct Replayed {
    name: String,
    kind: &'static str,
    raw: Vec<(String, Value)>,
}

fn build_from_recording(a: &ReplayArgs) -> Result<FromRecording, ConfigError> {
    let dir = a.recording.as_deref().unwrap_or(std::path::Path::new("."));
    let file = dir.join("manifest.json").display().to_string();
    let bad = |m: String| ConfigError::new(&file, ConfigErrorKind::Build, m);
    let live = Recorded::open(dir).map_err(|m| recording_error(&m))?;
    let lm_stage = |kind: &str| {
        live.stage_of_kind(kind).cloned().ok_or_else(|| {
            bad(format!(
                "the recording has no `{kind}` stage: only the LM (temporal, depformer) is replayed"
            ))
        })
    };
    let (temporal, depformer) = (lm_stage(kind::TEMPORAL)?, lm_stage(kind::DEPFORMER)?);
    if live.steps.is_empty() {
        return Err(bad(format!(
            "{}: no LM steps recorded (the conversation had not started); nothing to replay",
            dir.join("lm.jsonl").display()
        )));
    }
    let codes_path = write_codes(&a.out, &live)?;
    let overrides = [
        ("pack", a.pack.as_ref().map(|p| s(&p.display().to_string()))),
        ("execution_provider", a.provider.as_deref().map(s)),
    ];
    let stage = |v: &serde_json::Value, kind: &'static str, default: &str| {
        Ok::<_, ConfigError>(Replayed {
            name: v["name"].as_str().unwrap_or(default).to_string(),
            kind,
            raw: recorded_params(&file, v, &overrides)?,
        })
    };
    let mut stages = vec![
        stage(&temporal, kind::TEMPORAL, "temporal")?,
        stage(&depformer, kind::DEPFORMER, "depformer")?,
    ];
    // The agent's codec, when the live run decoded the agent's tokens: the same work per frame.
    if let Some(d) = live.stage_of_kind("mimi_decode") {
        stages.push(stage(d, "mimi_decode", "decode")?);
    }
    let recording = std::sync::Arc::new(record_replay(a, dir, &file, &codes_path, &stages)?);
    let builder = replay_pipeline(a, &file, &codes_path, stages, &recording)?;
    Ok(FromRecording {
        builder,
        recording,
        live,
    })
}

/// The user codes as the model saw them, into `out/codes.json`.
fn write_codes(out: &std::path::Path, live: &Recorded) -> Result<PathBuf, ConfigError> {
    let failed = |m: String| ConfigError::new("duplex replay", ConfigErrorKind::Build, m);
    std::fs::create_dir_all(out).map_err(|e| failed(format!("`--out` {}: {e}", out.display())))?;
    let codes_path = out.join("codes.json");
    let codes: Vec<&serde_json::Value> = live.steps.iter().map(|s| &s.user).collect();
    std::fs::write(
        &codes_path,
        serde_json::to_string(&codes).unwrap_or_default(),
    )
    .map_err(|e| failed(format!("{}: {e}", codes_path.display())))?;
    Ok(codes_path)
}

/// The replay's own recording in `--out`: its manifest names what it replays, with each
/// stage's typed params (defaults filled in).
fn record_replay(
    a: &ReplayArgs,
    dir: &std::path::Path,
    file: &str,
    codes_path: &std::path::Path,
    stages: &[Replayed],
) -> Result<Recording, ConfigError> {
    let reg = Registry::builtin();
    let pack = stages[0]
        .raw
        .iter()
        .find(|(k, _)| k == "pack")
        .and_then(|(_, v)| v.clone().into_string().ok())
        .unwrap_or_default();
    let mut listed = vec![
        serde_json::json!({ "name": "codes", "kind": "codes_source", "params": { "path": codes_path.display().to_string() } }),
    ];
    for st in stages {
        let specs = reg.get(st.kind).map(|k| k.params).unwrap_or(&[]);
        let typed = params::check(file, &st.name, st.kind, specs, &st.raw)?.to_json_map();
        listed.push(serde_json::json!({ "name": st.name, "kind": st.kind, "params": typed }));
    }
    let manifest = serde_json::json!({
        "pipeline": "duplex replay",
        "replay_of": dir.display().to_string(),
        "paced": a.paced,
        "replayed": stages.iter().map(|s| s.name.clone()).collect::<Vec<_>>(),
        "stages": listed,
        "packs": { pack.clone(): super::pack_files(&pack) },
    });
    Recording::create_at(&a.out, manifest, u64::MAX / 2).map_err(|e| {
        ConfigError::new("duplex replay", ConfigErrorKind::Build, e.to_string()).key("--out")
    })
}

/// codes → temporal ⇄ depformer → tokens, and the agent's decoder when the live run had one.
fn replay_pipeline(
    a: &ReplayArgs,
    file: &str,
    codes_path: &std::path::Path,
    stages: Vec<Replayed>,
    recording: &Recording,
) -> Result<PipelineBuilder, ConfigError> {
    let reg = Registry::builtin();
    let plane = Plane::default();
    let rec = Some(recording);
    let node = |name: &str, kind: &str, raw: Vec<(String, Value)>| {
        node_at(&reg, &plane, file, name, kind, raw, rec)
    };
    let codes_raw = vec![
        ("path".to_string(), s(&codes_path.display().to_string())),
        (
            "realtime".to_string(),
            Value::new(None, ValueKind::Boolean(a.paced)),
        ),
    ];
    let tokens_raw = vec![(
        "path".to_string(),
        s(&a.out.join("tokens.jsonl").display().to_string()),
    )];
    let tname = stages[0].name.clone();
    let dname = stages[1].name.clone();
    let mut stages = stages.into_iter();
    let mut lm = || {
        let st = stages.next().expect("a temporal and a depformer stage");
        node(&st.name, st.kind, st.raw)
    };
    let mut builder = PipelineBuilder::new()
        .origin("duplex replay")
        .node(node("codes", "codes_source", codes_raw)?)
        .node(lm()?)
        .node(lm()?)
        .node(node("tokens", "token_sink", tokens_raw)?)
        .link(Link::new("codes", format!("{tname}.codes")))
        .link(Link::new(format!("{tname}.step"), dname.clone()))
        .link(Link::new(dname, format!("{tname}.tokens")).feedback())
        .link(Link::new(format!("{tname}.agent"), "tokens"));
    // The agent's decoder, when the live run had one.
    for st in stages {
        builder = builder
            .node(node(&st.name, st.kind, st.raw)?)
            .node(node("decoded", "null_sink", Vec::new())?)
            .link(Link::new(format!("{tname}.agent"), st.name.clone()))
            .link(Link::new(st.name, "decoded"));
    }
    Ok(builder.control(plane.control))
}

/// Replays `--recording` headless into `--out` and compares the two runs.
///
/// # Errors
///
/// A [`ConfigError`] for a bad recording or flags (exit code 2), a run error (exit code 1).
pub fn run_recording(a: &ReplayArgs) -> anyhow::Result<(RunReport, Comparison)> {
    load_ort()?;
    let FromRecording {
        builder,
        recording,
        live,
    } = build_from_recording(a)?;
    let p = builder.observer(recording.clone()).build()?;
    let running = p.start();
    let _signals = super::SignalGuard::install(running.stop_handle());
    let report = running.wait().into_result()?;
    recording.finish();
    let replay = Recorded::open(recording.dir()).map_err(anyhow::Error::msg)?;
    let c = compare::compare(&live, &replay);
    Ok((report, c))
}
