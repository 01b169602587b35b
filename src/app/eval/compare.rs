//! `duplex eval compare`: packs run on the same inputs with the same seeds (one
//! `duplex eval run --out OUT`), each against a base pack, pair by pair (the same sample, the
//! same seed, so the seeded sampler drew the same random numbers for both):
//!
//! - the turn-taking decisions each made (from the voice activity: did the agent answer after
//!   the user's speech ended, did it speak over the user; from the benchmark's ASR where it ran:
//!   pause handling's and smooth turn-taking's TOR), counted by agreement, with McNemar's exact
//!   test on the discordant pairs;
//! - the paired latency differences (response, stop; the ASR's turn-taking latency), their
//!   mean with a bootstrap interval;
//! - where the two token streams first part;
//!
//! per task and seed and per task over all seeds, as a table (printed, `compare.md`), the
//! numbers (`compare.json`) and a plot (`compare.svg`), all in OUT. Samples not scored yet (or
//! run again since) are scored first, as `duplex eval score` does.
//!
//! Knows the run's layout and the scores' fields; the statistics are [`crate::eval::paired`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde_json::{json, Value};

use super::{bad, first_interval, open_vad, samples_with_output, score_sample, task_of};
use crate::eval::paired::{first_divergence, mean_difference, Agreement, MeanDiff};

/// Flags of `duplex eval compare`.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// What `duplex eval run --out` wrote: `OUT/<pack>/seed-<s>/<sample>/`.
    pub out: PathBuf,
    /// The pack the others are compared with (its name under OUT). Default: the one pack
    /// without quantized weights.
    #[arg(long)]
    pub base: Option<String>,
    /// Silero VAD's ONNX model, for samples not scored yet.
    #[arg(long, default_value = "models/vad/silero_vad.onnx")]
    pub vad: PathBuf,
}

/// One pack's run with one seed.
struct Run {
    pack: String,
    seed: u64,
    root: PathBuf,
    quantized: bool,
}

/// The runs under `out`: every `<pack>/seed-<s>` holding a `run.json`.
fn runs(out: &Path) -> anyhow::Result<Vec<Run>> {
    let mut found = Vec::new();
    let packs =
        std::fs::read_dir(out).map_err(|e| bad("out", format!("{}: {e}", out.display())))?;
    for p in packs.flatten() {
        let Ok(seeds) = std::fs::read_dir(p.path()) else {
            continue;
        };
        for s in seeds.flatten() {
            let name = s.file_name().to_string_lossy().into_owned();
            let Some(seed) = name.strip_prefix("seed-").and_then(|n| n.parse().ok()) else {
                continue;
            };
            let record = s.path().join("run.json");
            let Ok(text) = std::fs::read_to_string(&record) else {
                continue;
            };
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| bad("out", format!("{}: not JSON: {e}", record.display())))?;
            found.push(Run {
                pack: p.file_name().to_string_lossy().into_owned(),
                seed,
                root: s.path(),
                quantized: !v["pack"]["quantization"].is_null(),
            });
        }
    }
    found.sort_by(|a, b| (&a.pack, a.seed).cmp(&(&b.pack, b.seed)));
    Ok(found)
}

/// One frame's tokens: the text token and the audio codebooks'.
type Tokens = (Value, Value);

/// A token log's text tokens.
fn text_of(t: &[Tokens]) -> Vec<Value> {
    t.iter().map(|t| t.0.clone()).collect()
}

/// Per pack, where each pair's token streams first part (`None`: identical throughout).
#[derive(Debug, Default)]
pub(super) struct Parting {
    /// Any token.
    pub(super) any: Vec<Option<usize>>,
    /// The text alone.
    pub(super) text: Vec<Option<usize>>,
    /// The frames run (the longest log).
    pub(super) frames: usize,
}

/// What one sample of one run did, as compared.
#[derive(Debug, Clone, Default)]
struct Facts {
    /// The agent started speaking after the user's speech ended (a response interval).
    responds: bool,
    /// The agent spoke while the user did.
    overlaps: bool,
    response: Option<f64>,
    stop: Option<f64>,
    /// From the benchmark's ASR, where it ran.
    pause_tor: Option<bool>,
    turn_tor: Option<bool>,
    turn_latency: Option<f64>,
    /// Each frame's tokens; `None` for a served run (the wire carries none).
    tokens: Option<Vec<Tokens>>,
}

fn overlapping(a: &Value, b: &Value) -> bool {
    let spans = |v: &Value| -> Vec<(f64, f64)> {
        v.as_array()
            .map(|l| {
                l.iter()
                    .filter_map(|p| Some((p[0].as_f64()?, p[1].as_f64()?)))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (a, b) = (spans(a), spans(b));
    a.iter()
        .any(|&(s0, e0)| b.iter().any(|&(s1, e1)| s0 < e1 && s1 < e0))
}

/// A sample's facts: its scores (scored now where there are none, or where the output is newer
/// than them) and its token log.
fn facts(
    dir: &Path,
    vad: &mut Option<crate::model::vad::Vad>,
    vad_path: &Path,
) -> anyhow::Result<Facts> {
    let file = dir.join("duplex_score.json");
    let modified = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
    let fresh = match (modified(&file), modified(&dir.join("output.wav"))) {
        (Some(scored), Some(made)) => scored >= made,
        _ => false,
    };
    let score: Value = if fresh {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        serde_json::from_str(&text)
            .map_err(|e| bad("out", format!("{}: not JSON: {e}", file.display())))?
    } else {
        if vad.is_none() {
            *vad = Some(open_vad(vad_path)?);
        }
        score_sample(vad.as_ref().expect("opened above"), dir, None)?
    };
    let log = dir.join("tokens.jsonl");
    let text = match std::fs::read_to_string(&log) {
        Ok(t) => Some(t),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(anyhow::Error::new(e).context(format!("reading {}", log.display()))),
    };
    let mut tokens = Vec::new();
    for (k, line) in text.iter().flat_map(|t| t.lines()).enumerate() {
        let v: Value = serde_json::from_str(line).map_err(|e| {
            bad(
                "out",
                format!("{} line {}: not JSON: {e}", log.display(), k + 1),
            )
        })?;
        tokens.push((v["text"].clone(), v["audio"].clone()));
    }
    let v15 = &score["v1.5"];
    let turn = &score["v1"]["smooth_turn_taking"];
    Ok(Facts {
        responds: v15["response_latency_intervals"]
            .as_array()
            .is_some_and(|l| !l.is_empty()),
        overlaps: overlapping(&v15["user_merged"], &v15["agent_merged"]),
        response: first_interval(&score, "response_latency_intervals"),
        stop: first_interval(&score, "stop_latency_intervals"),
        pause_tor: score["v1"]["pause_handling"]["tor"]
            .as_u64()
            .map(|t| t == 1),
        turn_tor: turn["tor"].as_u64().map(|t| t == 1),
        turn_latency: turn["latency"].as_f64(),
        tokens: text.is_some().then_some(tokens),
    })
}

/// One sample run by both packs with one seed.
struct Pair {
    task: String,
    seed: u64,
    base: Facts,
    other: Facts,
}

/// A group of pairs, reduced.
#[derive(Debug, Clone, serde::Serialize)]
pub(super) struct Row {
    pub(super) pack: String,
    pub(super) task: String,
    /// A seed, or `all`.
    pub(super) seed: String,
    pub(super) pairs: usize,
    pub(super) responds: Agreement,
    pub(super) responds_p: f64,
    pub(super) overlaps: Agreement,
    pub(super) overlaps_p: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) pause_tor: Option<(Agreement, f64)>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) turn_tor: Option<(Agreement, f64)>,
    /// Pack minus base, seconds.
    pub(super) response_latency: Option<MeanDiff>,
    pub(super) stop_latency: Option<MeanDiff>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) turn_latency: Option<MeanDiff>,
    /// Pairs with both token logs (a served run has none).
    pub(super) logged: usize,
    /// Pairs whose token streams are the same throughout.
    pub(super) identical: usize,
    /// The median frame where the others' streams first part (any token).
    pub(super) first_divergence_frame: Option<f64>,
    /// The median frame where their text first parts (the pairs whose text does).
    pub(super) first_text_divergence_frame: Option<f64>,
    /// Each pair's response latency difference, for the plot.
    #[serde(skip)]
    pub(super) response_diffs: Vec<f64>,
}

fn reduce(pack: &str, task: &str, seed: String, pairs: &[&Pair]) -> Row {
    let agree =
        |f: &dyn Fn(&Facts) -> bool| Agreement::of(pairs.iter().map(|p| (f(&p.base), f(&p.other))));
    let asr = |f: &dyn Fn(&Facts) -> Option<bool>| {
        let both: Vec<(bool, bool)> = pairs
            .iter()
            .filter_map(|p| Some((f(&p.base)?, f(&p.other)?)))
            .collect();
        (!both.is_empty()).then(|| {
            let a = Agreement::of(both);
            (a, a.mcnemar_p())
        })
    };
    let diffs = |f: &dyn Fn(&Facts) -> Option<f64>| -> Vec<f64> {
        pairs
            .iter()
            .filter_map(|p| Some(f(&p.other)? - f(&p.base)?))
            .collect()
    };
    let logged: Vec<(&Vec<Tokens>, &Vec<Tokens>)> = pairs
        .iter()
        .filter_map(|p| Some((p.base.tokens.as_ref()?, p.other.tokens.as_ref()?)))
        .collect();
    let parted: Vec<f64> = logged
        .iter()
        .filter_map(|(a, b)| first_divergence(a, b))
        .map(|k| k as f64)
        .collect();
    let text_parted: Vec<f64> = logged
        .iter()
        .filter_map(|(a, b)| first_divergence(&text_of(a), &text_of(b)))
        .map(|k| k as f64)
        .collect();
    let responds = agree(&|f| f.responds);
    let overlaps = agree(&|f| f.overlaps);
    let response_diffs = diffs(&|f| f.response);
    Row {
        pack: pack.to_string(),
        task: task.to_string(),
        seed,
        pairs: pairs.len(),
        responds,
        responds_p: responds.mcnemar_p(),
        overlaps,
        overlaps_p: overlaps.mcnemar_p(),
        pause_tor: asr(&|f| f.pause_tor),
        turn_tor: asr(&|f| f.turn_tor),
        response_latency: mean_difference(&response_diffs),
        stop_latency: mean_difference(&diffs(&|f| f.stop)),
        turn_latency: mean_difference(&diffs(&|f| f.turn_latency)),
        logged: logged.len(),
        identical: logged.len() - parted.len(),
        first_divergence_frame: super::median(parted),
        first_text_divergence_frame: super::median(text_parted),
        response_diffs,
    }
}

/// `duplex eval compare`.
///
/// # Errors
///
/// A [`ConfigError`](crate::config::ConfigError) (exit 2) for a folder without runs, a base
/// that is not among them, or packs that share no sample; an error naming the file that cannot
/// be read.
pub fn compare(a: &CompareArgs) -> anyhow::Result<String> {
    let all = runs(&a.out)?;
    let mut packs: Vec<&str> = all.iter().map(|r| r.pack.as_str()).collect();
    packs.dedup();
    if packs.len() < 2 {
        return Err(bad(
            "out",
            format!(
                "{}: {} to compare (`duplex eval run --pack A --pack B --out {}` runs two)",
                a.out.display(),
                match packs.first() {
                    Some(p) => format!("only one pack's runs ({p})"),
                    None => "no runs".into(),
                },
                a.out.display()
            ),
        )
        .into());
    }
    let base = match &a.base {
        Some(b) if packs.contains(&b.as_str()) => b.clone(),
        Some(b) => {
            return Err(bad(
                "--base",
                format!(
                    "no pack `{b}` under {} (there: {})",
                    a.out.display(),
                    packs.join(", ")
                ),
            )
            .into())
        }
        None => {
            let float: Vec<&str> = packs
                .iter()
                .copied()
                .filter(|p| all.iter().any(|r| r.pack == *p && !r.quantized))
                .collect();
            match float.as_slice() {
                [one] => one.to_string(),
                _ => {
                    return Err(bad(
                        "--base",
                        format!(
                            "{}: say which pack is the base (--base): {}",
                            a.out.display(),
                            if float.is_empty() {
                                format!("every pack has quantized weights ({})", packs.join(", "))
                            } else {
                                format!("several have float weights ({})", float.join(", "))
                            }
                        ),
                    )
                    .into())
                }
            }
        }
    };
    let mut vad = None;
    let mut cache: BTreeMap<PathBuf, Facts> = BTreeMap::new();
    let mut get = |dir: &Path| -> anyhow::Result<Facts> {
        if let Some(f) = cache.get(dir) {
            return Ok(f.clone());
        }
        let f = facts(dir, &mut vad, &a.vad)?;
        cache.insert(dir.to_path_buf(), f.clone());
        Ok(f)
    };
    let mut rows = Vec::new();
    let mut divergences: BTreeMap<String, Parting> = BTreeMap::new();
    for other in packs.iter().filter(|p| **p != base) {
        let mut pairs = Vec::new();
        for b in all.iter().filter(|r| r.pack == base) {
            let Some(o) = all.iter().find(|r| r.pack == *other && r.seed == b.seed) else {
                continue;
            };
            let (Ok(bs), Ok(os)) = (samples_with_output(&b.root), samples_with_output(&o.root))
            else {
                continue;
            };
            for dir in &bs {
                let rel = dir.strip_prefix(&b.root).unwrap_or(dir);
                if !os.contains(&o.root.join(rel)) {
                    continue;
                }
                pairs.push(Pair {
                    task: task_of(rel),
                    seed: b.seed,
                    base: get(dir)?,
                    other: get(&o.root.join(rel))?,
                });
            }
        }
        if pairs.is_empty() {
            return Err(bad(
                "out",
                format!(
                    "{}: `{other}` and `{base}` share no sample run with the same seed",
                    a.out.display()
                ),
            )
            .into());
        }
        let d = divergences.entry(other.to_string()).or_default();
        for p in &pairs {
            if let (Some(a), Some(b)) = (&p.base.tokens, &p.other.tokens) {
                d.any.push(first_divergence(a, b));
                d.text.push(first_divergence(&text_of(a), &text_of(b)));
                d.frames = d.frames.max(a.len());
            }
        }
        let mut groups: BTreeMap<(String, Option<u64>), Vec<&Pair>> = BTreeMap::new();
        for p in &pairs {
            groups
                .entry((p.task.clone(), Some(p.seed)))
                .or_default()
                .push(p);
            groups.entry((p.task.clone(), None)).or_default().push(p);
        }
        let seeds: std::collections::BTreeSet<u64> = pairs.iter().map(|p| p.seed).collect();
        for ((task, seed), group) in &groups {
            // One seed: its rows are the task's.
            if seeds.len() == 1 && seed.is_some() {
                continue;
            }
            let seed = seed.map_or("all".to_string(), |s| s.to_string());
            rows.push(reduce(other, task, seed, group));
        }
    }
    let table = table(&base, &rows);
    let md = a.out.join("compare.md");
    std::fs::write(&md, &table).with_context(|| format!("writing {}", md.display()))?;
    let numbers = json!({
        "command": "duplex eval compare",
        "base": base,
        "frame_ms": 80,
        "rows": rows,
        "first_divergence": divergences.iter().map(|(p, d)| (p.clone(), json!({"any": d.any, "text": d.text}))).collect::<serde_json::Map<_, _>>(),
    });
    let js = a.out.join("compare.json");
    std::fs::write(&js, serde_json::to_string_pretty(&numbers)? + "\n")
        .with_context(|| format!("writing {}", js.display()))?;
    let svg = a.out.join("compare.svg");
    super::plot::draw(&svg, &base, &rows, &divergences)
        .with_context(|| format!("drawing {}", svg.display()))?;
    Ok(format!(
        "{table}\nwritten: {}, {}, {}\n",
        md.display(),
        js.display(),
        svg.display()
    ))
}

/// `x` seconds as milliseconds, signed.
fn ms(x: f64) -> String {
    format!("{:+.0}", x * 1e3)
}

fn diff_cell(d: &Option<MeanDiff>) -> String {
    match d {
        Some(d) => format!("{} [{}, {}] (n={})", ms(d.mean), ms(d.low), ms(d.high), d.n),
        None => "-".into(),
    }
}

fn agree_cell(a: &Agreement, p: f64) -> String {
    format!(
        "{}/{}/{}/{} p={}",
        a.both,
        a.first_only,
        a.second_only,
        a.neither,
        if p >= 0.001 {
            format!("{p:.3}")
        } else {
            format!("{p:.1e}")
        }
    )
}

/// The rows as a Markdown table, with a legend.
fn table(base: &str, rows: &[Row]) -> String {
    let mut t = format!(
        "Each pack against `{base}`, pair by pair (the same sample and seed).\n\n\
         Decisions: both / {base} only / pack only / neither, and McNemar's exact p on the \
         discordant pairs. *answers*: the agent speaks after the user's speech ends; *talks \
         over*: it speaks while the user does (both from voice activity: proxies of the ASR's \
         TOR). Latencies: pack minus {base}, mean in ms [95 % bootstrap interval] (pairs where \
         both have one). Tokens: pairs identical throughout, and the median 80 ms frame where \
         the others first part: any token, and the text.\n\n\
         | pack | task | seed | pairs | answers | talks over | Δ response ms | Δ stop ms | tokens identical | first parts at |\n\
         |---|---|---|---|---|---|---|---|---|---|\n"
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {}/{} | {} |\n",
            r.pack,
            r.task,
            r.seed,
            r.pairs,
            agree_cell(&r.responds, r.responds_p),
            agree_cell(&r.overlaps, r.overlaps_p),
            diff_cell(&r.response_latency),
            diff_cell(&r.stop_latency),
            r.identical,
            r.logged,
            match (r.first_divergence_frame, r.first_text_divergence_frame) {
                (None, _) => "-".to_string(),
                (Some(any), text) => format!(
                    "{:.2} s; text {}",
                    any * 0.08,
                    text.map_or("never".into(), |t| format!("{:.2} s", t * 0.08))
                ),
            },
        ));
    }
    let asr: Vec<&Row> = rows
        .iter()
        .filter(|r| r.pause_tor.is_some() || r.turn_tor.is_some() || r.turn_latency.is_some())
        .collect();
    if !asr.is_empty() {
        t.push_str(
            "\nFrom the benchmark's ASR (`output.json`), where it ran on both:\n\n\
             | pack | task | seed | pause handling TOR | smooth turn-taking TOR | Δ turn-taking latency ms |\n\
             |---|---|---|---|---|---|\n",
        );
        for r in asr {
            let cell =
                |x: &Option<(Agreement, f64)>| x.map_or("-".into(), |(a, p)| agree_cell(&a, p));
            t.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} |\n",
                r.pack,
                r.task,
                r.seed,
                cell(&r.pause_tor),
                cell(&r.turn_tor),
                diff_cell(&r.turn_latency)
            ));
        }
    }
    t
}
