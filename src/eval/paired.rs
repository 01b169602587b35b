//! Paired comparison of two systems on the same inputs and seeds: whether their binary
//! decisions disagree more one way than the other (McNemar's exact test), how far apart their
//! latencies are (the mean paired difference with a bootstrap interval), and where their token
//! streams first part.
//!
//! Pure arithmetic on numbers already measured; knows nothing of files or of the benchmark.

use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng as _};

/// Two systems' yes/no decisions on the same items, counted by agreement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Agreement {
    /// Both yes.
    pub both: usize,
    /// The first yes, the second no.
    pub first_only: usize,
    /// The first no, the second yes.
    pub second_only: usize,
    /// Both no.
    pub neither: usize,
}

impl Agreement {
    /// Counts `pairs` of (first, second) decisions.
    pub fn of(pairs: impl IntoIterator<Item = (bool, bool)>) -> Self {
        let mut a = Self::default();
        for p in pairs {
            match p {
                (true, true) => a.both += 1,
                (true, false) => a.first_only += 1,
                (false, true) => a.second_only += 1,
                (false, false) => a.neither += 1,
            }
        }
        a
    }

    /// How many items.
    pub fn total(&self) -> usize {
        self.both + self.first_only + self.second_only + self.neither
    }

    /// McNemar's exact two-sided p-value: under the hypothesis that the two systems say yes
    /// equally often, each discordant item is a fair coin, so the smaller discordant count is
    /// binomial(n, ½) with n the discordant items; p = 2·P(X ≤ min), at most 1 (1 when no item
    /// is discordant).
    pub fn mcnemar_p(&self) -> f64 {
        mcnemar_exact(self.first_only, self.second_only)
    }
}

/// McNemar's exact two-sided p-value for `b` and `c` discordant items (see
/// [`Agreement::mcnemar_p`]).
pub fn mcnemar_exact(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    // P(X ≤ k) for X ~ binomial(n, ½), summed in logs so that large n neither overflows nor
    // underflows before the sum.
    let k = b.min(c);
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    let mut ln_choose = 0.0f64; // ln C(n, 0)
    let mut cdf = 0.0;
    for i in 0..=k {
        if i > 0 {
            ln_choose += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        cdf += (ln_choose + ln_half_n).exp();
    }
    (2.0 * cdf).min(1.0)
}

/// The mean of paired differences and its bootstrap percentile interval.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MeanDiff {
    /// How many pairs.
    pub n: usize,
    /// The mean difference (second minus first).
    pub mean: f64,
    /// The median difference.
    pub median: f64,
    /// The interval's low end (2.5 % of the resampled means below it).
    pub low: f64,
    /// Its high end (2.5 % above).
    pub high: f64,
}

/// How many resamples [`mean_difference`] draws.
pub const RESAMPLES: usize = 4000;

/// The mean of `diffs` with a 95 % bootstrap percentile interval ([`RESAMPLES`] resamples of
/// the pairs with replacement, from a fixed seed: the same differences give the same
/// interval). `None` for no pairs.
pub fn mean_difference(diffs: &[f64]) -> Option<MeanDiff> {
    let n = diffs.len();
    if n == 0 {
        return None;
    }
    let mean = diffs.iter().sum::<f64>() / n as f64;
    let mut sorted = diffs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    let mut rng = SmallRng::seed_from_u64(0x6475_706c_6578);
    let mut means: Vec<f64> = (0..RESAMPLES)
        .map(|_| (0..n).map(|_| diffs[rng.random_range(0..n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (RESAMPLES - 1) as f64).round() as usize).min(RESAMPLES - 1)];
    Some(MeanDiff {
        n,
        mean,
        median,
        low: at(0.025),
        high: at(0.975),
    })
}

/// The first position where two sequences differ, `None` where one is the other (a shorter
/// sequence differs from a longer one where it ends).
pub fn first_divergence<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(k) => Some(k),
        None if a.len() == b.len() => None,
        None => Some(a.len().min(b.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcnemars_exact_p_is_twice_the_binomial_tail() {
        // n = 7, min 1: 2·(C(7,0) + C(7,1))/2^7 = 16/128.
        assert!((mcnemar_exact(1, 6) - 0.125).abs() < 1e-12);
        assert!((mcnemar_exact(6, 1) - 0.125).abs() < 1e-12);
        // n = 10, min 2: 2·(1 + 10 + 45)/1024.
        assert!((mcnemar_exact(2, 8) - 112.0 / 1024.0).abs() < 1e-12);
        // n = 5, min 0: 2/32.
        assert!((mcnemar_exact(0, 5) - 0.0625).abs() < 1e-12);
        // Balanced or empty: no evidence.
        assert_eq!(mcnemar_exact(3, 3), 1.0);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        // Large n stays finite: 2·P(X ≤ 400) for n = 1000 is about 2.7e-10.
        let p = mcnemar_exact(400, 600);
        assert!(p > 1e-10 && p < 1e-9, "{p}");
    }

    #[test]
    fn agreement_counts_each_pair_once() {
        let a = Agreement::of([(true, true), (true, false), (false, true), (false, true)]);
        assert_eq!(
            a,
            Agreement {
                both: 1,
                first_only: 1,
                second_only: 2,
                neither: 0
            }
        );
        assert_eq!(a.total(), 4);
        assert_eq!(a.mcnemar_p(), 1.0);
    }

    #[test]
    fn the_bootstrap_interval_holds_the_mean_and_collapses_for_equal_differences() {
        let same = mean_difference(&[0.25; 9]).unwrap();
        assert_eq!((same.mean, same.low, same.high), (0.25, 0.25, 0.25));
        let d: Vec<f64> = (0..40).map(|k| f64::from(k % 7) * 0.01 + 0.1).collect();
        let m = mean_difference(&d).unwrap();
        assert!(m.low < m.mean && m.mean < m.high, "{m:?}");
        // The interval is about ±2 standard errors wide.
        let sd = (d.iter().map(|x| (x - m.mean).powi(2)).sum::<f64>() / 39.0).sqrt();
        let se = sd / 40f64.sqrt();
        assert!(
            ((m.high - m.low) / (4.0 * se) - 1.0).abs() < 0.2,
            "{m:?} se {se}"
        );
        // The same differences, the same interval.
        assert_eq!(mean_difference(&d), Some(m));
        assert_eq!(mean_difference(&[]), None);
    }

    #[test]
    fn divergence_is_the_first_differing_position() {
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_divergence(&[1, 2, 3], &[1, 5, 3]), Some(1));
        assert_eq!(first_divergence(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_divergence::<u8>(&[], &[]), None);
    }
}
