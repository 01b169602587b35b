//! The PCM buffer that audio stages exchange.

/// Sample rate of the model side of a pipeline (Mimi): 24 kHz.
pub const MODEL_RATE: u32 = 24_000;
/// Samples in one model frame at [`MODEL_RATE`]: 1920 = 80 ms = one model step.
pub const FRAME_SAMPLES: usize = 1920;

/// A chunk of mono `f32` audio in `[-1, 1]` at a known sample rate.
#[derive(Debug, Clone, PartialEq)]
pub struct Pcm {
    /// Samples per second.
    pub rate: u32,
    /// Mono samples.
    pub samples: Vec<f32>,
    /// Number of zero samples appended at the end to complete a fixed-size frame (only the
    /// last frame of a stream, produced by a framer, has padding).
    pub padded: usize,
}

impl Pcm {
    /// A chunk without padding.
    pub fn new(rate: u32, samples: Vec<f32>) -> Self {
        Pcm {
            rate,
            samples,
            padded: 0,
        }
    }

    /// The real (unpadded) samples.
    pub fn valid(&self) -> &[f32] {
        &self.samples[..self.samples.len() - self.padded.min(self.samples.len())]
    }

    /// Duration in seconds, padding included.
    pub fn duration_secs(&self) -> f64 {
        self.samples.len() as f64 / self.rate.max(1) as f64
    }
}
