//! Choosing tokens from logits: greedy (argmax) or temperature + top-k, with a seeded generator
//! so that a run is reproducible for a given seed; and Kyutai's two controls of the text stream
//! (`moshi-core`'s `lm_generate_multistream.rs`), applied to the text logits before the draw:
//! the padding multiplier ([`apply_pad_mult`]) and the repetition penalty over the last
//! non-padding text tokens ([`TextHistory::penalize`]).
//!
//! Pure code. [`Sampler::sample`] and [`TextHistory::penalize`] allocate nothing once their
//! scratch space has grown to the vocabulary size (the first call).

/// Temperature and top-k of one stream.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// `<= 0` means greedy.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (0 = all).
    pub top_k: usize,
}

impl SamplingParams {
    /// PersonaPlex text defaults: 0.7 / 25.
    pub const TEXT: SamplingParams = SamplingParams {
        temperature: 0.7,
        top_k: 25,
    };
    /// PersonaPlex audio defaults: 0.8 / 250.
    pub const AUDIO: SamplingParams = SamplingParams {
        temperature: 0.8,
        top_k: 250,
    };
    /// Argmax.
    pub const GREEDY: SamplingParams = SamplingParams {
        temperature: 0.0,
        top_k: 0,
    };

    /// Whether tokens are drawn (`temperature > 0`), not taken by argmax.
    pub fn draws(&self) -> bool {
        self.temperature > 0.0
    }

    /// How many of `n` logits a draw keeps: the `top_k` largest, all when it is 0 or `n` or more.
    pub fn kept(&self, n: usize) -> usize {
        if self.top_k == 0 {
            n
        } else {
            self.top_k.min(n)
        }
    }
}

/// xoshiro256++ seeded through splitmix64: small, fast, and stable across versions of this
/// crate and its dependencies (so a seed means the same voice tomorrow).
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let r = (s[0].wrapping_add(s[3])).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The text tokens that are not words: what the repetition penalty neither counts nor penalises
/// (moshi-core skips `text_pad_token`, `text_eop_token` and `text_start_token`), and the one
/// `pad_mult` weighs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextSpecials {
    /// Padding ("zero text"): 3 in PersonaPlex.
    pub pad: i64,
    /// End of padding (EPAD): 0 in PersonaPlex.
    pub epad: i64,
    /// The text stream's initial token: 32000 in PersonaPlex (never sampled).
    pub start: i64,
}

impl TextSpecials {
    /// PersonaPlex's: 3, 0, 32000.
    pub const PERSONAPLEX: TextSpecials = TextSpecials {
        pad: 3,
        epad: 0,
        start: 32000,
    };

    /// Whether `t` is one of them.
    pub fn contains(&self, t: i64) -> bool {
        t == self.pad || t == self.epad || t == self.start
    }
}

impl Default for TextSpecials {
    fn default() -> Self {
        TextSpecials::PERSONAPLEX
    }
}

/// `pad_mult` as moshi-core applies it: the padding token's probability, after the softmax at
/// temperature `p.temperature`, is multiplied by `exp(pad_mult)`, and top-k then keeps the `k`
/// most probable tokens of the modified distribution (candle's `sample_f` hands the closure the
/// probabilities before its top-k). Multiplying a probability of `softmax(l / T)` by
/// `exp(pad_mult)` is adding `pad_mult · T` to the raw logit, which is what this does (so the
/// top-k of [`Sampler::sample`] ranks the padding token as candle's does).
///
/// Greedy (`temperature <= 0`) is left alone, as moshi-core's `ArgMax` never calls the closure;
/// it is also the limit of `pad_mult · T` as `T → 0`. `pad_mult == 0` changes nothing. A padding
/// id outside `logits` is ignored.
pub fn apply_pad_mult(logits: &mut [f32], pad: i64, pad_mult: f32, p: SamplingParams) {
    if pad_mult == 0.0 || p.temperature <= 0.0 {
        return;
    }
    if let Some(l) = usize::try_from(pad).ok().and_then(|i| logits.get_mut(i)) {
        *l += pad_mult * p.temperature;
    }
}

/// The last text tokens of a conversation that count for the repetition penalty: the words
/// (every token but the [`TextSpecials`]), newest last, at most [`TextHistory::CAPACITY`].
#[derive(Debug, Clone)]
pub struct TextHistory {
    tokens: std::collections::VecDeque<i64>,
    /// Scratch: which ids were penalised in this call (all false between calls).
    seen: Vec<bool>,
}

impl Default for TextHistory {
    fn default() -> Self {
        TextHistory::new()
    }
}

impl TextHistory {
    /// The longest window kept (the largest `repetition_penalty_context`).
    pub const CAPACITY: usize = 4096;

    /// An empty history (its ring allocated once, here).
    pub fn new() -> Self {
        TextHistory {
            tokens: std::collections::VecDeque::with_capacity(Self::CAPACITY),
            seen: Vec::new(),
        }
    }

    /// Forgets every token (a new conversation).
    pub fn clear(&mut self) {
        self.tokens.clear();
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens held, oldest first.
    pub fn tokens(&self) -> impl Iterator<Item = i64> + '_ {
        self.tokens.iter().copied()
    }

    /// Adds a text token of the conversation; padding and the other specials are not kept.
    pub fn push(&mut self, token: i64, specials: &TextSpecials) {
        if specials.contains(token) {
            return;
        }
        if self.tokens.len() == Self::CAPACITY {
            self.tokens.pop_front();
        }
        self.tokens.push_back(token);
    }

    /// moshi-core's `apply_repetition_penalty`: each distinct token among the last `context`
    /// words (repeats count toward `context`) has its logit divided by `penalty` when it is
    /// `>= 0`, multiplied by it when negative; once, however often it occurs. `penalty == 1`
    /// or `context == 0` changes nothing. Ids outside `logits` are ignored.
    pub fn penalize(&mut self, logits: &mut [f32], context: usize, penalty: f32) {
        if penalty == 1.0 || context == 0 {
            return;
        }
        if self.seen.len() < logits.len() {
            self.seen.resize(logits.len(), false);
        }
        let (tokens, seen) = (&self.tokens, &mut self.seen);
        let n = logits.len();
        let index = |t: i64| usize::try_from(t).ok().filter(|&i| i < n);
        for i in tokens.iter().rev().take(context).filter_map(|&t| index(t)) {
            if seen[i] {
                continue;
            }
            seen[i] = true;
            let l = &mut logits[i];
            if *l >= 0.0 {
                *l /= penalty;
            } else {
                *l *= penalty;
            }
        }
        for i in tokens.iter().rev().take(context).filter_map(|&t| index(t)) {
            seen[i] = false;
        }
    }
}

/// Index of the largest logit; the first one on ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best
}

/// Samples token ids from logits with a seeded generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    rng: Rng,
    scratch: Vec<(f32, u32)>,
    probs: Vec<f64>,
}

impl Sampler {
    /// A sampler seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Sampler {
            rng: Rng::new(seed),
            scratch: Vec::new(),
            probs: Vec::new(),
        }
    }

    /// Restarts the random stream from `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = Rng::new(seed);
    }

    /// Takes the random draw [`sample`](Self::sample) would take with `p` (one when not
    /// greedy), without logits: for a token whose value is not used, so that the tokens after
    /// it are drawn as if it had been.
    pub fn skip(&mut self, p: SamplingParams) {
        self.take_draw(p);
    }

    /// Takes the random number [`sample`](Self::sample) would draw with `p`: a uniform in
    /// `[0, 1)` when not greedy, nothing when greedy. For a draw made elsewhere from this stream
    /// (the depformer's device sampling).
    pub fn take_draw(&mut self, p: SamplingParams) -> Option<f64> {
        p.draws().then(|| self.rng.next_f64())
    }

    /// Picks a token: argmax when `temperature <= 0`, else a draw from the softmax of the
    /// `top_k` largest logits divided by the temperature. Always consumes exactly one random
    /// number when not greedy, so the random stream advances the same way whatever the logits.
    pub fn sample(&mut self, logits: &[f32], p: SamplingParams) -> usize {
        if !p.draws() || logits.is_empty() {
            return argmax(logits);
        }
        let (k, sum) = self.prepare(logits, p);
        let kept = &self.scratch[..k];
        let mut u = self.rng.next_f64() * sum;
        for (j, &pj) in self.probs.iter().enumerate() {
            if u < pj {
                return kept[j].1 as usize;
            }
            u -= pj;
        }
        kept[k - 1].1 as usize
    }

    /// Fills `scratch[..k]` with the kept (logit, id) pairs in draw order and `probs` with their
    /// unnormalised weights; returns `k` and the weights' sum. `temperature > 0`, `logits` not
    /// empty.
    fn prepare(&mut self, logits: &[f32], p: SamplingParams) -> (usize, f64) {
        self.scratch.clear();
        self.scratch.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (if v.is_nan() { f32::NEG_INFINITY } else { v }, i as u32)),
        );
        // Largest first, then by index: a canonical order for the draw.
        let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = p.kept(self.scratch.len());
        if k < self.scratch.len() {
            self.scratch.select_nth_unstable_by(k - 1, order);
        }
        let kept = &mut self.scratch[..k];
        kept.sort_unstable_by(order);
        let max = kept[0].0 as f64;
        let t = p.temperature as f64;
        self.probs.clear();
        let mut sum = 0.0;
        for &(v, _) in kept.iter() {
            let e = ((v as f64 - max) / t).exp();
            sum += e;
            self.probs.push(e);
        }
        (k, sum)
    }

    /// The distribution [`sample`](Self::sample) draws from (id, probability), without drawing.
    #[cfg(test)]
    fn distribution(&mut self, logits: &[f32], p: SamplingParams) -> Vec<(usize, f64)> {
        let (k, sum) = self.prepare(logits, p);
        (0..k)
            .map(|j| (self.scratch[j].1 as usize, self.probs[j] / sum))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skipped_draw_leaves_the_stream_where_a_sample_would() {
        let logits: Vec<f32> = (0..300).map(|i| ((i * 31) % 300) as f32 / 40.0).collect();
        for p in [SamplingParams::AUDIO, SamplingParams::GREEDY] {
            let (mut a, mut b) = (Sampler::new(9), Sampler::new(9));
            let mut ta = Vec::new();
            let mut tb = Vec::new();
            for i in 0..64 {
                ta.push(a.sample(&logits, p));
                if i % 3 == 1 {
                    b.skip(p);
                    tb.push(ta[i]);
                } else {
                    tb.push(b.sample(&logits, p));
                }
            }
            assert_eq!(ta, tb, "{p:?}");
        }
    }

    /// moshi-core's `apply_repetition_penalty`, transcribed as plainly as it reads there: the
    /// whole list of text tokens (padding included), walked from the newest, a set of those seen.
    fn moshi_penalty(
        logits: &[f32],
        all: &[i64],
        sp: &TextSpecials,
        context: usize,
        penalty: f32,
    ) -> Vec<f32> {
        let mut logits = logits.to_vec();
        if penalty == 1.0 {
            return logits;
        }
        let mut seen = std::collections::HashSet::new();
        let mut non_pad = 0;
        for &t in all.iter().rev() {
            if t == sp.pad || t == sp.epad || t == sp.start {
                continue;
            }
            if non_pad >= context {
                break;
            }
            non_pad += 1;
            if seen.contains(&t) {
                continue;
            }
            seen.insert(t);
            if let Some(l) = logits.get_mut(t as usize) {
                if *l >= 0.0 {
                    *l /= penalty
                } else {
                    *l *= penalty
                }
            }
        }
        logits
    }

    #[test]
    fn the_repetition_penalty_equals_moshi_cores() {
        let sp = TextSpecials::PERSONAPLEX;
        let mut rng = Rng::new(5);
        for case in 0..200 {
            let vocab = 40;
            let logits: Vec<f32> = (0..vocab)
                .map(|_| (rng.next_f64() * 6.0 - 3.0) as f32)
                .collect();
            // Few distinct words, many repeats, much padding (ids 0 and 3), ids past the
            // logits too.
            let n = (rng.next_u64() % 120) as usize;
            let all: Vec<i64> = (0..n)
                .map(|_| match rng.next_u64() % 10 {
                    0..=3 => 3,
                    4 => 0,
                    5 => 45,
                    _ => (rng.next_u64() % 12) as i64 + 4,
                })
                .collect();
            let mut h = TextHistory::new();
            for &t in &all {
                h.push(t, &sp);
            }
            assert!(h.tokens().all(|t| !sp.contains(t)));
            for context in [0, 1, 3, 8, 32, 64, 200] {
                for penalty in [1.0f32, 1.3, 2.0, 0.8] {
                    let want = moshi_penalty(&logits, &all, &sp, context, penalty);
                    let mut got = logits.clone();
                    h.penalize(&mut got, context, penalty);
                    assert_eq!(
                        got, want,
                        "case {case}, context {context}, penalty {penalty}"
                    );
                    // The scratch marks are cleared: a second call penalises again, alike.
                    let mut again = logits.clone();
                    h.penalize(&mut again, context, penalty);
                    assert_eq!(again, want);
                }
            }
        }
        // A cleared history penalises nothing.
        let mut h = TextHistory::new();
        h.push(7, &sp);
        h.clear();
        let mut l = vec![1.0f32; 10];
        h.penalize(&mut l, 64, 2.0);
        assert_eq!(l, vec![1.0; 10]);
    }

    #[test]
    fn the_history_keeps_the_last_capacity_words() {
        let sp = TextSpecials::PERSONAPLEX;
        let mut h = TextHistory::new();
        for t in 0..(TextHistory::CAPACITY as i64 + 100) {
            h.push(t + 4, &sp);
        }
        assert_eq!(h.len(), TextHistory::CAPACITY);
        assert_eq!(h.tokens().next(), Some(104));
    }

    /// candle's `sample_f` with moshi-core's closure: softmax at the temperature, the padding
    /// probability times `exp(pad_mult)`, the `k` most probable kept, renormalised.
    fn candle_pad_mult(logits: &[f32], pad: usize, pad_mult: f32, p: SamplingParams) -> Vec<f64> {
        let t = p.temperature as f64;
        let max = logits.iter().fold(f64::MIN, |m, &v| m.max(v as f64));
        let mut prs: Vec<f64> = logits
            .iter()
            .map(|&v| ((v as f64 - max) / t).exp())
            .collect();
        let sum: f64 = prs.iter().sum();
        prs.iter_mut().for_each(|x| *x /= sum);
        prs[pad] *= (pad_mult as f64).exp();
        let mut idx: Vec<usize> = (0..prs.len()).collect();
        idx.sort_by(|&a, &b| prs[b].total_cmp(&prs[a]));
        let keep = &idx[..p.top_k.min(prs.len())];
        let kept: f64 = keep.iter().map(|&i| prs[i]).sum();
        let mut out = vec![0.0; prs.len()];
        for &i in keep {
            out[i] = prs[i] / kept;
        }
        out
    }

    #[test]
    fn pad_mult_equals_candles_probability_multiplier() {
        let mut rng = Rng::new(11);
        let mut s = Sampler::new(0);
        let pad = 3;
        for case in 0..100 {
            let logits: Vec<f32> = (0..60)
                .map(|_| (rng.next_f64() * 8.0 - 4.0) as f32)
                .collect();
            for pad_mult in [-4.0f32, -0.5, 0.0, 1.0, 4.0] {
                for p in [
                    SamplingParams {
                        temperature: 0.7,
                        top_k: 5,
                    },
                    SamplingParams {
                        temperature: 1.3,
                        top_k: 60,
                    },
                ] {
                    let want = candle_pad_mult(&logits, pad, pad_mult, p);
                    let mut l = logits.clone();
                    apply_pad_mult(&mut l, pad as i64, pad_mult, p);
                    let mut got = vec![0.0; l.len()];
                    for (i, q) in s.distribution(&l, p) {
                        got[i] = q;
                    }
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() < 1e-5,
                            "case {case} pad_mult {pad_mult} {p:?}: token {i}: {a} vs {b}"
                        );
                    }
                }
            }
        }
        // Greedy and pad_mult 0 leave the logits as they are.
        let mut l = vec![0.5f32, 1.0, 2.0, 1.5];
        apply_pad_mult(&mut l, 3, 4.0, SamplingParams::GREEDY);
        apply_pad_mult(&mut l, 3, 0.0, SamplingParams::TEXT);
        apply_pad_mult(&mut l, 99, 4.0, SamplingParams::TEXT);
        assert_eq!(l, vec![0.5, 1.0, 2.0, 1.5]);
    }

    #[test]
    fn argmax_takes_the_first_maximum_and_ignores_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
        let mut s = Sampler::new(1);
        assert_eq!(s.sample(&[0.1, 0.9, 0.2], SamplingParams::GREEDY), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_is_respected() {
        let logits: Vec<f32> = (0..2048)
            .map(|i| ((i * 7919) % 2048) as f32 / 300.0)
            .collect();
        let p = SamplingParams::AUDIO;
        let mut a = Sampler::new(42);
        let mut b = Sampler::new(42);
        let xs: Vec<usize> = (0..200).map(|_| a.sample(&logits, p)).collect();
        let ys: Vec<usize> = (0..200).map(|_| b.sample(&logits, p)).collect();
        assert_eq!(xs, ys);
        let mut c = Sampler::new(43);
        let zs: Vec<usize> = (0..200).map(|_| c.sample(&logits, p)).collect();
        assert_ne!(xs, zs);
        // Only the 250 largest logits can be drawn.
        let mut sorted = logits.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let threshold = sorted[249];
        assert!(xs.iter().all(|&i| logits[i] >= threshold));
    }

    #[test]
    fn frequencies_follow_the_tempered_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), f32::NEG_INFINITY];
        let mut s = Sampler::new(7);
        let n = 40_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(
                &logits,
                SamplingParams {
                    temperature: 1.0,
                    top_k: 0,
                },
            )] += 1;
        }
        let p1 = counts[1] as f64 / n as f64;
        assert!((p1 - 2.0 / 3.0).abs() < 0.01, "p1 = {p1}");
        assert_eq!(counts[2], 0);
        // Temperature 0.5 squares the odds: 4:1.
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(
                &logits,
                SamplingParams {
                    temperature: 0.5,
                    top_k: 2,
                },
            )] += 1;
        }
        let p1 = counts[1] as f64 / n as f64;
        assert!((p1 - 0.8).abs() < 0.01, "p1 = {p1}");
    }
}
