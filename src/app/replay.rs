//! `duplex replay`: the LM on any pack, codes in, tokens out — the `lm-replay` pipeline built
//! from command-line flags instead of a file.

use std::path::PathBuf;

use config::{Value, ValueKind};

use crate::config::{params, ConfigError, ConfigErrorKind};
use crate::runtime::{ControlPlane, Link, Node, PipelineBuilder, RunReport};
use crate::stages::{BuildContext, Registry};

/// Flags of `duplex replay`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ReplayArgs {
    /// Model pack directory (a bare exporter directory works with PersonaPlex defaults).
    #[arg(long)]
    pub pack: PathBuf,
    /// User codes: a JSON array of frames, each an array of 8 ints.
    #[arg(long)]
    pub codes: PathBuf,
    /// Output: one JSON line per agent frame.
    #[arg(long)]
    pub out: PathBuf,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Argmax instead of sampling.
    #[arg(long)]
    pub greedy: bool,
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
    /// KV cache handling: resident (default) or host.
    #[arg(long)]
    pub kv: Option<String>,
}

fn s(v: &str) -> Value {
    Value::new(None, ValueKind::String(v.to_string()))
}

fn i(v: i64) -> Value {
    Value::new(None, ValueKind::I64(v))
}

fn node(
    reg: &Registry,
    plane: &ControlPlane,
    name: &str,
    kind: &str,
    raw: Vec<(&str, Value)>,
) -> Result<Node, ConfigError> {
    let file = "duplex replay";
    let Some(k) = reg.get(kind) else {
        return Err(ConfigError::new(
            file,
            ConfigErrorKind::UnknownKind,
            format!("no stage kind `{kind}`"),
        ));
    };
    let raw: Vec<(String, Value)> = raw.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let p = params::check(file, name, kind, k.params, &raw)?;
    let body = (k.build)(&BuildContext::new(name, file, plane, k), &p)
        .map_err(|e| super::build_error(file, name, &p, e))?;
    Ok(Node {
        name: name.into(),
        kind: kind.into(),
        inputs: (k.inputs)(),
        outputs: (k.outputs)(),
        body,
    })
}

/// Builds the replay pipeline.
///
/// # Errors
///
/// A [`ConfigError`] naming the flag's stage and the problem (missing pack, bad codes file…).
pub fn build(a: &ReplayArgs) -> Result<PipelineBuilder, ConfigError> {
    let reg = Registry::builtin();
    let pack = a.pack.display().to_string();
    let mut temporal = vec![("pack", s(&pack))];
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
    let depformer = vec![
        ("pack", s(&pack)),
        ("seed", i(a.seed as i64)),
        ("greedy", Value::new(None, ValueKind::Boolean(a.greedy))),
    ];
    let plane = ControlPlane::new();
    let b = PipelineBuilder::new()
        .origin("duplex replay")
        .node(node(
            &reg,
            &plane,
            "codes",
            "codes_source",
            vec![("path", s(&a.codes.display().to_string()))],
        )?)
        .node(node(&reg, &plane, "temporal", "temporal", temporal)?)
        .node(node(&reg, &plane, "depformer", "depformer", depformer)?)
        .node(node(
            &reg,
            &plane,
            "tokens",
            "token_sink",
            vec![("path", s(&a.out.display().to_string()))],
        )?)
        .link(Link::new("codes", "temporal.codes"))
        .link(Link::new("temporal.step", "depformer"))
        .link(Link::new("depformer", "temporal.tokens").feedback())
        .link(Link::new("temporal.agent", "tokens"))
        .control(plane);
    Ok(b)
}

/// Runs the replay to the end.
///
/// # Errors
///
/// Configuration errors (exit code 2) and run errors (exit code 1).
pub fn run(a: &ReplayArgs) -> anyhow::Result<RunReport> {
    let p = build(a)?.build()?;
    let running = p.start();
    let _signals = super::SignalGuard::install(running.stop_handle());
    Ok(running.wait().into_result()?)
}
