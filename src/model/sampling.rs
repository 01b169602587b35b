//! Choosing tokens from logits: greedy (argmax) or temperature + top-k, with a seeded generator
//! so that a run is reproducible for a given seed.
//!
//! Pure code. [`Sampler::sample`] allocates nothing once its scratch space has grown to the
//! vocabulary size (the first call).

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
        if p.temperature > 0.0 {
            self.rng.next_f64();
        }
    }

    /// Picks a token: argmax when `temperature <= 0`, else a draw from the softmax of the
    /// `top_k` largest logits divided by the temperature. Always consumes exactly one random
    /// number when not greedy, so the random stream advances the same way whatever the logits.
    pub fn sample(&mut self, logits: &[f32], p: SamplingParams) -> usize {
        if p.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        self.scratch.clear();
        self.scratch.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (if v.is_nan() { f32::NEG_INFINITY } else { v }, i as u32)),
        );
        // Largest first, then by index: a canonical order for the draw.
        let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = if p.top_k == 0 || p.top_k >= self.scratch.len() {
            self.scratch.len()
        } else {
            self.scratch.select_nth_unstable_by(p.top_k - 1, order);
            p.top_k
        };
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
        let mut u = self.rng.next_f64() * sum;
        for (j, &pj) in self.probs.iter().enumerate() {
            if u < pj {
                return kept[j].1 as usize;
            }
            u -= pj;
        }
        kept[k - 1].1 as usize
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
