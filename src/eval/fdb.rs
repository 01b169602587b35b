//! Full-Duplex-Bench's timestamp metrics (v1 pause handling, smooth turn-taking, user
//! interruption without its judge, backchannel; v1.5 stop and response latency intervals),
//! written from their definitions: the same numbers FDB's own functions give for the same word
//! and segment lists, its quirks included (a turn is a span of a second or four words; a
//! backchannel's TOR is the last short segment's; merging in double seconds; Python's rounding).
//! FDB's code is not used (its licence forbids shipping it).
//!
//! Words are ASR word timestamps; segments are voice-activity segments, in seconds. Knows
//! nothing of files, audio or models.

/// One ASR word's times (either may be missing in an ASR's output).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Word {
    /// Start, seconds.
    pub start: Option<f64>,
    /// End, seconds.
    pub end: Option<f64>,
}

/// A voice-activity segment, seconds.
pub type Segment = (f64, f64);

/// Python's `round(x, 3)`: the decimal nearest the exact binary value, ties to even.
pub fn round3(x: f64) -> f64 {
    format!("{x:.3}").parse().unwrap_or(x)
}

/// Python's `round(x, 1)`.
pub fn round1(x: f64) -> f64 {
    format!("{x:.1}").parse().unwrap_or(x)
}

/// Python's `int(round(x * 1000))`: the product rounded, ties to even.
pub fn ms_key(x: f64) -> i64 {
    (x * 1000.0).round_ties_even() as i64
}

/// Whether the model took the turn (TOR, 0 or 1) from its words: none, none; else the span from
/// the first start to the last end decides: a second or more, or under a second with more than
/// three words. `None` where FDB itself fails (a missing time it reads); `null_end_uses_start`
/// is pause handling's leniency for the last word's end.
pub fn take_turn(words: &[Word], null_end_uses_start: bool) -> Option<u8> {
    let (Some(first), Some(last)) = (words.first(), words.last()) else {
        return Some(0);
    };
    let end = match (last.end, null_end_uses_start) {
        (Some(e), _) => e,
        (None, true) => last.start?,
        (None, false) => return None,
    };
    let span = end - first.start?;
    Some(if span < 1.0 {
        u8::from(words.len() > 3)
    } else {
        1
    })
}

/// A turn's outcome: TOR, and where it was taken the latency from `reference` to the first word
/// (`raw`), and as averaged (`latency`: clamped at 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn {
    /// 1 when the model took the turn.
    pub tor: u8,
    /// First word's start minus the reference time.
    pub latency_raw: Option<f64>,
    /// `latency_raw`, negatives as 0.
    pub latency: Option<f64>,
}

/// Smooth turn-taking (`reference`: the end of the user's turn) or user interruption
/// (`reference`: the end of the interruption). `None` where FDB fails on a missing time.
pub fn turn(words: &[Word], reference: f64) -> Option<Turn> {
    let tor = take_turn(words, false)?;
    if tor == 0 {
        return Some(Turn {
            tor,
            latency_raw: None,
            latency: None,
        });
    }
    let raw = words[0].start? - reference;
    Some(Turn {
        tor,
        latency_raw: Some(raw),
        latency: Some(if raw < 0.0 { 0.0 } else { raw }),
    })
}

/// A set's mean TOR and its mean latency over the samples that took the turn (`None` when
/// none did).
pub fn turn_means(turns: &[Turn]) -> (f64, Option<f64>) {
    let tor = turns.iter().map(|t| f64::from(t.tor)).sum::<f64>() / turns.len().max(1) as f64;
    let lat: Vec<f64> = turns.iter().filter_map(|t| t.latency).collect();
    let mean = (!lat.is_empty()).then(|| lat.iter().sum::<f64>() / lat.len() as f64);
    (tor, mean)
}

/// One sample's backchannel outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct Backchannel {
    /// TOR; `None` where the sample has no ASR (FDB keeps the previous sample's).
    pub tor: Option<u8>,
    /// The segments counted as backchannels.
    pub backchannels: Vec<Segment>,
    /// Backchannels per second of output.
    pub freq: f64,
    /// Jensen-Shannon distance of their timing histogram to the reference (1 when none).
    pub jsd: f64,
    /// The output's duration, seconds.
    pub max_end_time: f64,
    /// The histogram's bins and the two distributions compared (empty when none).
    pub n_bins: usize,
    /// The backchannels' distribution over the bins.
    pub pred_distribution: Vec<f64>,
    /// The reference resized to the bins.
    pub gt_resized: Vec<f64>,
}

/// Words touching segment `(a, b)`, each at most once, by FDB's asymmetric borders.
fn words_in(words: &[Word], (a, b): Segment) -> usize {
    words
        .iter()
        .filter(|w| {
            let Some(t0) = w.start else { return false };
            let t1 = match w.end {
                Some(e) => e,
                None if t0 < b => return false,
                None => t0,
            };
            (t0 >= a && t1 <= b) || (t0 <= b && t1 > b) || (t0 <= a && t1 > a)
        })
        .count()
}

/// numpy's `sum` of a float array: pairwise above 8 elements, in blocks of 128 as numpy does.
fn np_sum(v: &[f64]) -> f64 {
    fn pairwise(v: &[f64]) -> f64 {
        if v.len() < 8 {
            return v.iter().fold(0.0, |s, x| s + x);
        }
        if v.len() <= 128 {
            let mut r = [0.0f64; 8];
            r.copy_from_slice(&v[..8]);
            let mut i = 8;
            while i + 8 <= v.len() {
                for k in 0..8 {
                    r[k] += v[i + k];
                }
                i += 8;
            }
            let mut s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
            for x in &v[i..] {
                s += x;
            }
            return s;
        }
        let half = (v.len() / 2) / 8 * 8;
        pairwise(&v[..half]) + pairwise(&v[half..])
    }
    pairwise(v)
}

/// `n` points from 0 to 1 as numpy's `linspace` makes them.
fn linspace01(n: usize) -> Vec<f64> {
    if n < 2 {
        return vec![0.0; n];
    }
    let step = 1.0 / (n - 1) as f64;
    let mut x: Vec<f64> = (0..n).map(|k| k as f64 * step).collect();
    x[n - 1] = 1.0;
    x
}

/// `g` resized to `n` points by linear interpolation (extrapolating), as scipy's `interp1d`.
fn resize(g: &[f64], n: usize) -> Vec<f64> {
    let m = g.len();
    let (xg, xp) = (linspace01(m), linspace01(n));
    xp.iter()
        .map(|&x| {
            let k = xg.partition_point(|&v| v < x).clamp(1, m - 1);
            let (lo, hi) = (k - 1, k);
            (g[hi] - g[lo]) / (xg[hi] - xg[lo]) * (x - xg[lo]) + g[lo]
        })
        .collect()
}

/// scipy's `jensenshannon(p, q)`: the distance, natural logarithm, both renormalised.
fn jensen_shannon(p: &[f64], q: &[f64]) -> f64 {
    let (sp, sq) = (np_sum(p), np_sum(q));
    let p: Vec<f64> = p.iter().map(|v| v / sp).collect();
    let q: Vec<f64> = q.iter().map(|v| v / sq).collect();
    let m: Vec<f64> = p.iter().zip(&q).map(|(a, b)| (a + b) / 2.0).collect();
    let rel = |x: f64, y: f64| {
        if x > 0.0 && y > 0.0 {
            x * (x / y).ln()
        } else if x == 0.0 && y >= 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    };
    let left: Vec<f64> = p.iter().zip(&m).map(|(&a, &b)| rel(a, b)).collect();
    let right: Vec<f64> = q.iter().zip(&m).map(|(&a, &b)| rel(a, b)).collect();
    ((np_sum(&left) + np_sum(&right)) / 2.0).sqrt()
}

/// v1 backchannel on one sample: its VAD `segments` (as FDB's call to Silero returns them),
/// its ASR `words` (`None`: no ASR file), the output's length in samples at `rate`, and the
/// reference distribution `gt` (at least two points).
pub fn backchannel(
    segments: &[Segment],
    words: Option<&[Word]>,
    rate: u32,
    num_samples: u64,
    gt: &[f64],
) -> Backchannel {
    let mut tor = None;
    let mut found = Vec::new();
    if let Some(words) = words {
        tor = Some(0);
        for &(a, b) in segments {
            let d = b - a;
            if d > 3.0 {
                tor = Some(1);
                break;
            }
            let n = words_in(words, (a, b));
            tor = Some(if n > 3 || d >= 1.0 {
                1
            } else {
                u8::from(n > 2)
            });
            found.push((a, b));
        }
    }
    let t = num_samples as f64 / f64::from(rate);
    let freq = found.len() as f64 / t;
    if found.is_empty() {
        return Backchannel {
            tor,
            backchannels: found,
            freq,
            jsd: 1.0,
            max_end_time: t,
            n_bins: 0,
            pred_distribution: Vec::new(),
            gt_resized: Vec::new(),
        };
    }
    let nb = (t / 0.2) as usize + 1;
    let mut h = vec![0.0f64; nb];
    for &(a, b) in &found {
        // (bins past the last are dropped)
        let (lo, hi) = ((a / 0.2) as usize, (b / 0.2) as usize);
        for c in h.iter_mut().take(hi + 1).skip(lo) {
            *c += 1.0;
        }
    }
    let eps: Vec<f64> = h.iter().map(|v| v + 1e-10).collect();
    let s = np_sum(&eps);
    let pred: Vec<f64> = eps.iter().map(|v| v / s).collect();
    let gt_resized = resize(gt, nb);
    let jsd = jensen_shannon(&pred, &gt_resized);
    Backchannel {
        tor,
        backchannels: found,
        freq,
        jsd,
        max_end_time: t,
        n_bins: nb,
        pred_distribution: pred,
        gt_resized,
    }
}

/// Segments sorted and merged where the gap to the one before is at most `gap` seconds (0.6 for
/// the user, 0.5 for the model in v1.5).
pub fn merge(segments: &[Segment], gap: f64) -> Vec<Segment> {
    let mut s = segments.to_vec();
    s.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut out: Vec<Segment> = Vec::new();
    for (a, b) in s {
        match out.last_mut() {
            Some(last) if a - last.1 <= gap => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Keeps, per key, the first value or the one `better` prefers, in the order keys were first
/// met (a Python dict's).
fn keep_by_key<T: Copy>(
    items: impl Iterator<Item = (i64, T)>,
    better: impl Fn(&T, &T) -> bool,
) -> Vec<T> {
    let mut keys: Vec<i64> = Vec::new();
    let mut vals: Vec<T> = Vec::new();
    for (k, v) in items {
        match keys.iter().position(|&x| x == k) {
            Some(i) if better(&v, &vals[i]) => vals[i] = v,
            Some(_) => {}
            None => {
                keys.push(k);
                vals.push(v);
            }
        }
    }
    vals
}

/// v1.5 stop latency: where the user and the model overlap, the shortest overlap per ending
/// millisecond, by end; `[start, end]` rounded to the millisecond.
pub fn overlaps(user: &[Segment], model: &[Segment]) -> Vec<[f64; 2]> {
    let (mut i, mut j) = (0, 0);
    let mut found = Vec::new();
    while i < user.len() && j < model.len() {
        let s = user[i].0.max(model[j].0);
        let e = user[i].1.min(model[j].1);
        if e > s {
            found.push((s, e));
        }
        if user[i].1 < model[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    let mut kept = keep_by_key(
        found.into_iter().map(|(s, e)| (ms_key(e), (s, e))),
        |v, old| v.1 - v.0 < old.1 - old.0,
    );
    kept.sort_by(|a, b| a.1.total_cmp(&b.1));
    kept.into_iter()
        .map(|(s, e)| [round3(s), round3(e)])
        .collect()
}

/// v1.5 response latency: for each user segment, the first model start after its end (in the
/// model's list order); per response start, the latest user end; by response start.
pub fn response_gaps(user: &[Segment], model: &[Segment]) -> Vec<[f64; 2]> {
    let cands = user.iter().filter_map(|u| {
        let next = model.iter().map(|m| m.0).find(|&s| s > u.1)?;
        Some((ms_key(next), [round3(u.1), round3(next)]))
    });
    let mut kept = keep_by_key(cands, |v, old| v[0] > old[0]);
    kept.sort_by(|a, b| a[1].total_cmp(&b[1]));
    kept
}

/// v1.5 timing of one sample from its raw VAD segments (seconds): both merged, then the stop
/// and response latency intervals.
pub struct Timing {
    /// The user's segments merged (gap 0.6 s).
    pub user_merged: Vec<Segment>,
    /// The model's segments merged (gap 0.5 s).
    pub model_merged: Vec<Segment>,
    /// [`overlaps`] of the merged segments.
    pub stop: Vec<[f64; 2]>,
    /// [`response_gaps`] of the merged segments.
    pub response: Vec<[f64; 2]>,
}

/// [`Timing`] of `user` and `model`.
pub fn timing(user: &[Segment], model: &[Segment]) -> Timing {
    let (u, m) = (merge(user, 0.6), merge(model, 0.5));
    Timing {
        stop: overlaps(&u, &m),
        response: response_gaps(&u, &m),
        user_merged: u,
        model_merged: m,
    }
}
