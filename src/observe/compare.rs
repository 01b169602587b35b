//! Comparing a recording with its headless replay: is a slow live frame the environment's
//! doing or the code's?
//!
//! For every stage both ran: per-frame service quantiles by context bucket, the trend slope
//! and the bimodality of each run (the live diagnosis's own statistics, over the whole run;
//! growth is judged against the noise of a bucket's median rather than of one frame, which a
//! whole run affords), and a verdict in words. Then whether the replay was the same computation: the pack's graphs
//! by hash, the priming scripts, and the LM's token streams step by step (with greedy or
//! seeded sampling they must be equal; the first step that differs is named). Slow frames count
//! as contention when they take a real share of the model's 80 ms frame, as live.
//!
//! Pure code over two [`Recorded`] runs; knows nothing of how they were produced.

use std::fmt::{self, Write as _};

use super::diagnose::{Diagnoser, DiagnosisConfig};
use super::record::Recorded;

/// Most frames one trend/bimodality evaluation looks at (longer runs are sampled evenly).
const MAX_FRAMES: usize = 4096;
/// Context buckets per stage.
const BUCKETS: usize = 4;
/// Growth is judged on runs of at least this many frames (the live diagnosis's window).
const MIN_GROWTH_FRAMES: usize = 256;
/// Growth: the least rise across a whole run that counts, seconds.
const MIN_RISE_S: f64 = 0.000_25;
/// The model's frame period (1920 samples at 24 kHz).
const FRAME_S: f64 = 0.08;

/// What one run of one stage shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Frames timed.
    pub frames: usize,
    /// Per bucket: (first frame, last frame, context range, p50, p90, p99 in seconds).
    pub buckets: Vec<Bucket>,
    /// Theil–Sen slope, seconds per 1000 frames.
    pub slope_per_1k: f64,
    /// Upper cluster centre over the lower's (1 without an upper cluster).
    pub bimodality: f64,
    /// Share of frames in the upper cluster.
    pub slow_share: f64,
    /// The trend test says growth.
    pub growth: bool,
    /// The cluster test says contention.
    pub contention: bool,
}

/// One context bucket of a stage's frames.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Frame indices covered (by position in the run).
    pub frames: (usize, usize),
    /// KV length range, when the stage is the LM's temporal stage.
    pub context: Option<(u64, u64)>,
    /// Quantiles 0.5, 0.9, 0.99 of the service time, seconds.
    pub q: [f64; 3],
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The shape of a series of service times (`context`: the KV length at each frame, if known).
pub fn shape(times: &[f64], context: Option<&[u64]>) -> Shape {
    let n = times.len();
    let mut buckets = Vec::new();
    if n > 0 {
        for b in 0..BUCKETS.min(n) {
            let (lo, hi) = (b * n / BUCKETS.min(n), (b + 1) * n / BUCKETS.min(n));
            let mut v = times[lo..hi].to_vec();
            v.sort_by(f64::total_cmp);
            let ctx = context.and_then(|c| {
                let c = c.get(lo..hi.min(c.len()))?;
                Some((*c.iter().min()?, *c.iter().max()?))
            });
            buckets.push(Bucket {
                frames: (lo, hi.saturating_sub(1)),
                context: ctx,
                q: [quantile(&v, 0.5), quantile(&v, 0.9), quantile(&v, 0.99)],
            });
        }
    }
    let step = n.div_ceil(MAX_FRAMES).max(1);
    let picked: Vec<(f64, f64)> = (0..n).step_by(step).map(|i| (i as f64, times[i])).collect();
    let mut d = Diagnoser::new(DiagnosisConfig {
        window: picked.len().max(2),
        every: usize::MAX,
        ..Default::default()
    });
    // The model's frame: slow frames are contention when they take a real share of it.
    d.set_period(FRAME_S);
    for &(x, y) in &picked {
        d.push(x, y);
    }
    let e = d.evaluate();
    let noise = bucket_noise(&picked, e.slope_per_1k / 1e3);
    Shape {
        frames: n,
        growth: n >= MIN_GROWTH_FRAMES
            && grows(&picked, e.rise, noise)
            // A rise that goes on (the last bucket above the second by a quarter of the rise, or
            // by 3 standard errors of a bucket's median when the rise flattens), not one step at
            // the start.
            && buckets.len() == BUCKETS
            && buckets[BUCKETS - 1].q[0] - buckets[1].q[0] >= (0.25 * e.rise).min(3.0 * noise),
        buckets,
        slope_per_1k: e.slope_per_1k,
        bimodality: e.bimodality,
        slow_share: e.outlier_fraction,
        contention: picked.len() >= 16 && e.contention,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mid = v.len() / 2;
    *v.select_nth_unstable_by(mid, f64::total_cmp).1
}

/// Growth over a whole run: the rise the robust trend predicts is at least [`MIN_RISE_S`], 10 %
/// of the median, and 4 standard errors of a context bucket's median (per-frame noise averages
/// out over a whole run, unlike the live window's 256 frames, whose test is against the noise
/// of one frame).
fn grows(points: &[(f64, f64)], rise: f64, bucket_noise: f64) -> bool {
    let ys: Vec<f64> = points.iter().map(|p| p.1).collect();
    rise >= MIN_RISE_S && rise >= 0.10 * median(ys) && rise >= 4.0 * bucket_noise
}

/// The standard error of a context bucket's median: the robust spread of the detrended times
/// over the square root of a bucket's frames.
fn bucket_noise(points: &[(f64, f64)], slope: f64) -> f64 {
    let level = median(points.iter().map(|&(x, y)| y - slope * x).collect());
    let dev = 1.4826
        * median(
            points
                .iter()
                .map(|&(x, y)| (y - slope * x - level).abs())
                .collect(),
        );
    let per_bucket = (points.len() / BUCKETS).max(1) as f64;
    1.2533 * dev / per_bucket.sqrt()
}

/// What the two runs of one stage say together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// Live was bimodal, headless is not: another job on the device.
    Environment,
    /// Headless grows like live: the code's cost grows with the conversation.
    Code,
    /// Both grow (the code's), and live also had a slow mode headless lacks (the
    /// environment's): two causes at once.
    CodeAndEnvironment,
    /// Live grew, headless does not.
    EnvironmentGrowth,
    /// Headless is bimodal as well.
    BimodalHeadless,
    /// Headless grows though live did not.
    GrowthHeadless,
    /// Flat in both.
    Nothing,
}

impl Cause {
    /// From the live and headless shapes.
    ///
    /// Growth in both is the code's (and a live slow mode that headless lacks is the
    /// environment's as well). Otherwise a live slow mode that headless lacks is the
    /// environment's, even if headless shows a slight growth of its own (it does not explain a
    /// second mode); then growth on one side only, then a slow mode headless has too.
    pub fn of(live: &Shape, headless: &Shape) -> Cause {
        match (live.growth, headless.growth) {
            (true, true) if live.contention && !headless.contention => Cause::CodeAndEnvironment,
            (true, true) => Cause::Code,
            _ if live.contention && !headless.contention => Cause::Environment,
            (true, false) if !headless.contention => Cause::EnvironmentGrowth,
            (false, true) => Cause::GrowthHeadless,
            _ if headless.contention => Cause::BimodalHeadless,
            _ => Cause::Nothing,
        }
    }

    /// The verdict in words.
    pub fn words(&self) -> &'static str {
        match self {
            Cause::Environment => {
                "headless is flat and unimodal while live was bimodal: the live slowdown came \
                 from the environment (contention)"
            }
            Cause::Code => "headless grows like live: the cost is in the code (growth)",
            Cause::CodeAndEnvironment => {
                "headless grows like live: the cost is in the code (growth); and live was \
                 bimodal while headless is unimodal: its slow mode came from the environment \
                 (contention)"
            }
            Cause::EnvironmentGrowth => {
                "live grew but headless is flat: the growth came from the environment, not the \
                 code"
            }
            Cause::BimodalHeadless => {
                "headless is bimodal too: the second mode is in the code or this machine, not \
                 only the live environment"
            }
            Cause::GrowthHeadless => {
                "headless grows though live did not: the cost is in the code (growth), live \
                 was too short or too noisy to show it"
            }
            Cause::Nothing => "flat and unimodal in both: nothing to explain",
        }
    }
}

/// One stage in both runs.
#[derive(Debug, Clone)]
pub struct StageComparison {
    /// Stage name.
    pub name: String,
    /// The live run.
    pub live: Shape,
    /// The headless run.
    pub headless: Shape,
    /// Together.
    pub cause: Cause,
}

/// Whether the replay was the same computation.
#[derive(Debug, Clone, PartialEq)]
pub struct Sameness {
    /// Graph files whose hashes differ (or that only one side has): (file, live, headless).
    pub graphs: Vec<(String, String, String)>,
    /// The priming scripts are equal.
    pub priming_equal: bool,
    /// Steps compared.
    pub compared: usize,
    /// Steps in each run.
    pub lengths: (usize, usize),
    /// The first step whose user codes or agent tokens differ.
    pub diverges_at: Option<usize>,
}

/// A full comparison.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// Stages both runs timed, in the live run's order.
    pub stages: Vec<StageComparison>,
    /// Same computation?
    pub same: Sameness,
    /// The live run's verdict changes, as recorded.
    pub live_verdicts: Vec<serde_json::Value>,
}

fn graph_hashes(r: &Recorded) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    if let Some(packs) = r.manifest["packs"].as_object() {
        for files in packs.values() {
            for (f, v) in files.as_object().into_iter().flatten() {
                if let Some(h) = v["sha256"].as_str() {
                    out.insert(f.clone(), h.to_string());
                }
            }
        }
    }
    out
}

fn sameness(live: &Recorded, replay: &Recorded) -> Sameness {
    let (a, b) = (graph_hashes(live), graph_hashes(replay));
    let mut graphs = Vec::new();
    for f in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
        let (x, y) = (a.get(f), b.get(f));
        if x != y {
            let short = |h: Option<&String>| {
                h.map_or("absent".to_string(), |h| h[..12.min(h.len())].to_string())
            };
            graphs.push((f.clone(), short(x), short(y)));
        }
    }
    let primes = |r: &Recorded| r.primes.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>();
    let compared = live.steps.len().min(replay.steps.len());
    let diverges_at = (0..compared)
        .find(|&i| live.steps[i] != replay.steps[i])
        .or((live.steps.len() != replay.steps.len()).then_some(compared));
    Sameness {
        graphs,
        priming_equal: primes(live) == primes(replay),
        compared,
        lengths: (live.steps.len(), replay.steps.len()),
        diverges_at,
    }
}

fn times(r: &Recorded, stage: &str) -> Vec<f64> {
    r.service
        .get(stage)
        .map(|v| v.iter().map(|&(_, t)| t).collect())
        .unwrap_or_default()
}

fn context(r: &Recorded) -> Vec<u64> {
    r.steps.iter().filter_map(|s| s.kv).collect()
}

/// Compares `live` with its headless `replay`.
pub fn compare(live: &Recorded, replay: &Recorded) -> Comparison {
    let mut stages = Vec::new();
    // A replay names the stages it re-ran (not its own source and sink).
    let replayed: Option<Vec<&str>> = replay.manifest["replayed"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect());
    for name in &live.stages {
        if !replay.service.contains_key(name) || !live.service.contains_key(name) {
            continue;
        }
        if replayed
            .as_ref()
            .is_some_and(|r| !r.contains(&name.as_str()))
        {
            continue;
        }
        let is_temporal = live.stage(name).is_some_and(|s| s["kind"] == "temporal");
        let (lc, hc) = (context(live), context(replay));
        let live_shape = shape(&times(live, name), is_temporal.then_some(&lc[..]));
        let head_shape = shape(&times(replay, name), is_temporal.then_some(&hc[..]));
        stages.push(StageComparison {
            name: name.clone(),
            cause: Cause::of(&live_shape, &head_shape),
            live: live_shape,
            headless: head_shape,
        });
    }
    Comparison {
        stages,
        same: sameness(live, replay),
        live_verdicts: live.verdicts.clone(),
    }
}

impl Comparison {
    /// The verdict of the whole comparison, in words: a divergence first (the replay was not
    /// the same computation), else the LM's temporal stage's cause, else the first stage's.
    pub fn verdict(&self) -> String {
        if !self.same.graphs.is_empty() {
            let tokens = match self.same.diverges_at {
                Some(n) => format!("the streams diverge at frame {n}"),
                None => "the streams agree".to_string(),
            };
            return format!(
                "the replay ran other graphs: a different computation ({tokens}; its timings \
                 say nothing of the live run's)"
            );
        }
        if let Some(n) = self.same.diverges_at {
            let why = if !self.same.priming_equal {
                " (the priming differs)"
            } else {
                ""
            };
            return format!("the streams diverge at frame {n}{why}");
        }
        let lm = self
            .stages
            .iter()
            .find(|s| s.name == "temporal")
            .or(self.stages.first());
        match lm {
            Some(s) => format!("{}: {}", s.name, s.cause.words()),
            None => "no stage was timed in both runs".to_string(),
        }
    }
}

fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

impl fmt::Display for Comparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.stages {
            writeln!(
                f,
                "stage {} ({} live frames, {} headless)",
                s.name, s.live.frames, s.headless.frames
            )?;
            writeln!(
                f,
                "  {:<13} {:<13} {:>26} {:>26}",
                "frames", "context", "live p50/p90/p99 ms", "headless p50/p90/p99 ms"
            )?;
            for (i, lb) in s.live.buckets.iter().enumerate() {
                let hb = s.headless.buckets.get(i);
                let ctx = lb
                    .context
                    .map_or("-".to_string(), |(a, b)| format!("{a}-{b}"));
                let q = |b: &Bucket| format!("{} / {} / {}", ms(b.q[0]), ms(b.q[1]), ms(b.q[2]));
                let mut row = String::new();
                let _ = write!(
                    row,
                    "  {:<13} {:<13} {:>26} {:>26}",
                    format!("{}-{}", lb.frames.0, lb.frames.1),
                    ctx,
                    q(lb),
                    hb.map_or("-".to_string(), q)
                );
                writeln!(f, "{row}")?;
            }
            let shape = |x: &Shape| {
                format!(
                    "slope {:+.3} ms/1k frames, bimodality {:.2} ({:.1} % slow)",
                    x.slope_per_1k * 1e3,
                    x.bimodality,
                    x.slow_share * 100.0
                )
            };
            writeln!(f, "  live:     {}", shape(&s.live))?;
            writeln!(f, "  headless: {}", shape(&s.headless))?;
            writeln!(f, "  => {}", s.cause.words())?;
        }
        if !self.live_verdicts.is_empty() {
            let shown: Vec<String> = self
                .live_verdicts
                .iter()
                .take(6)
                .map(|v| {
                    format!(
                        "{} {}→{} at frame {}",
                        v["stage"].as_str().unwrap_or("?"),
                        v["from"].as_str().unwrap_or("?"),
                        v["to"].as_str().unwrap_or("?"),
                        v["frame"]
                    )
                })
                .collect();
            let more = self.live_verdicts.len().saturating_sub(shown.len());
            let more = if more > 0 {
                format!(", and {more} more")
            } else {
                String::new()
            };
            writeln!(f, "live verdict changes: {}{more}", shown.join(", "))?;
        }
        let same = &self.same;
        if same.graphs.is_empty() {
            writeln!(f, "graphs: the same (SHA-256 of every model.onnx)")?;
        } else {
            for (g, a, b) in &same.graphs {
                writeln!(f, "graphs: {g} differs (live {a}, headless {b})")?;
            }
        }
        writeln!(
            f,
            "priming: {}",
            if same.priming_equal {
                "the same scripts"
            } else {
                "different scripts"
            }
        )?;
        match same.diverges_at {
            None => writeln!(
                f,
                "tokens: {} of {} steps identical",
                same.compared, same.lengths.0
            )?,
            Some(n) => writeln!(
                f,
                "tokens: identical for {n} steps, then differ (live {} steps, headless {})",
                same.lengths.0, same.lengths.1
            )?,
        }
        writeln!(f, "verdict: {}", self.verdict())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(n: usize, f: impl Fn(usize) -> f64) -> Vec<f64> {
        (0..n).map(f).collect()
    }

    #[test]
    fn causes_follow_the_shapes() {
        let noise = |i: usize| 0.010 + 0.0002 * ((i * 7919) % 13) as f64 / 13.0;
        let flat = shape(&series(600, noise), None);
        let bimodal = shape(
            &series(600, |i| noise(i) + if i % 10 == 3 { 0.030 } else { 0.0 }),
            None,
        );
        let growing = shape(&series(600, |i| noise(i) + i as f64 * 0.0001), None);
        assert!(!flat.growth && !flat.contention, "{flat:?}");
        assert!(bimodal.contention && !bimodal.growth, "{bimodal:?}");
        assert!(growing.growth, "{growing:?}");
        assert_eq!(Cause::of(&bimodal, &flat), Cause::Environment);
        // A slight headless growth does not explain a live second mode.
        assert_eq!(Cause::of(&bimodal, &growing), Cause::Environment);
        assert_eq!(Cause::of(&growing, &growing), Cause::Code);
        let both = shape(
            &series(600, |i| {
                noise(i) + i as f64 * 0.0001 + if i % 10 == 3 { 0.030 } else { 0.0 }
            }),
            None,
        );
        assert!(both.growth && both.contention, "{both:?}");
        assert_eq!(Cause::of(&both, &growing), Cause::CodeAndEnvironment);
        assert_eq!(Cause::of(&growing, &flat), Cause::EnvironmentGrowth);
        assert_eq!(Cause::of(&bimodal, &bimodal), Cause::BimodalHeadless);
        assert_eq!(Cause::of(&flat, &flat), Cause::Nothing);
        // Quantiles by bucket: the growing series' last bucket is the slowest.
        let b = &growing.buckets;
        assert_eq!(b.len(), 4);
        assert!(b[3].q[0] > b[0].q[0] + 0.04, "{b:?}");
    }
}
