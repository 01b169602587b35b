//! Test signals: silence, sine, white noise. Deterministic for a given seed.

/// What a [`Synth`] generates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Waveform {
    /// Zeros.
    Silence,
    /// A sine of `freq` Hz with peak `amplitude`.
    Sine {
        /// Frequency in Hz.
        freq: f64,
        /// Peak amplitude in `[0, 1]`.
        amplitude: f32,
    },
    /// Uniform white noise with peak `amplitude`, reproducible from `seed`.
    Noise {
        /// Peak amplitude in `[0, 1]`.
        amplitude: f32,
        /// Seed of the generator.
        seed: u64,
    },
}

/// A signal generator with a sample counter, so chunked generation equals one-shot generation.
#[derive(Debug, Clone)]
pub struct Synth {
    waveform: Waveform,
    rate: u32,
    n: u64,
    state: u64,
}

impl Synth {
    /// A generator at `rate` Hz.
    pub fn new(waveform: Waveform, rate: u32) -> Self {
        let seed = match waveform {
            Waveform::Noise { seed, .. } => seed,
            _ => 0,
        };
        Synth {
            waveform,
            rate,
            n: 0,
            // splitmix64 of the seed; never zero.
            state: splitmix(seed) | 1,
        }
    }

    /// Fills `out` with the next samples.
    ///
    /// # Real-time safety
    ///
    /// No allocation, no lock, no syscall.
    pub fn fill(&mut self, out: &mut [f32]) {
        match self.waveform {
            Waveform::Silence => out.fill(0.0),
            Waveform::Sine { freq, amplitude } => {
                let w = std::f64::consts::TAU * freq / self.rate as f64;
                for (i, s) in out.iter_mut().enumerate() {
                    // Phase from the absolute sample index: no drift over long runs.
                    let k = (self.n + i as u64) % (self.rate as u64 * 1000).max(1);
                    *s = amplitude * (w * k as f64).sin() as f32;
                }
            }
            Waveform::Noise { amplitude, .. } => {
                for s in out.iter_mut() {
                    // xorshift64*
                    let mut x = self.state;
                    x ^= x >> 12;
                    x ^= x << 25;
                    x ^= x >> 27;
                    self.state = x;
                    let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
                    *s = amplitude * ((r as f32 / (1u32 << 23) as f32) - 1.0);
                }
            }
        }
        self.n += out.len() as u64;
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(w: Waveform, chunks: &[usize]) -> Vec<f32> {
        let mut s = Synth::new(w, 48_000);
        let mut v = Vec::new();
        for &c in chunks {
            let mut buf = vec![0.0; c];
            s.fill(&mut buf);
            v.extend(buf);
        }
        v
    }

    #[test]
    fn chunked_equals_one_shot() {
        for w in [
            Waveform::Sine {
                freq: 440.0,
                amplitude: 0.5,
            },
            Waveform::Noise {
                amplitude: 0.3,
                seed: 7,
            },
        ] {
            let one = all(w, &[4801]);
            let many = all(w, &[1, 7, 1920, 2873]);
            assert_eq!(one, many);
        }
    }

    #[test]
    fn sine_has_its_level_and_noise_stays_in_range() {
        let v = all(
            Waveform::Sine {
                freq: 1000.0,
                amplitude: 0.5,
            },
            &[48_000],
        );
        let rms = (v.iter().map(|x| (x * x) as f64).sum::<f64>() / v.len() as f64).sqrt();
        assert!((rms - 0.5 / 2f64.sqrt()).abs() < 1e-3, "rms {rms}");
        let n = all(
            Waveform::Noise {
                amplitude: 0.3,
                seed: 1,
            },
            &[48_000],
        );
        assert!(n.iter().all(|x| x.abs() <= 0.3));
        let mean = n.iter().map(|&x| x as f64).sum::<f64>() / n.len() as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert_ne!(
            n,
            all(
                Waveform::Noise {
                    amplitude: 0.3,
                    seed: 2
                },
                &[48_000]
            )
        );
    }
}
