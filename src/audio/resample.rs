//! Streaming sample-rate conversion (rubato's synchronous FFT resampler) with delay compensation.
//!
//! [`StreamResampler`] takes input in chunks of any size and appends output to a caller's
//! buffer. Its own output is aligned with its input (the filter delay is trimmed at the start
//! and flushed out at the end), so resampling a signal in chunks gives the same samples as
//! resampling it in one call, and `flush` returns exactly `round(n · to / from)` samples in all.
//!
//! # Real-time safety
//!
//! All buffers are allocated in [`StreamResampler::new`]. [`process`](StreamResampler::process)
//! allocates only if the caller's output vector lacks capacity (reserve
//! [`max_output`](StreamResampler::max_output) samples to avoid that); it takes no lock and makes
//! no syscall.

use audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler};

use super::AudioError;

/// A mono streaming resampler.
pub struct StreamResampler {
    from: u32,
    to: u32,
    fft: Option<Fft<f32>>,
    chunk_in: usize,
    fifo: Vec<f32>,
    out_buf: Vec<f32>,
    to_skip: usize,
    delay: usize,
    consumed: u64,
    produced: u64,
}

impl StreamResampler {
    /// A resampler from `from` Hz to `to` Hz processing `chunk` input samples per FFT call (it
    /// buffers until it has that many; 20 ms of input is a good default). Equal rates pass
    /// samples through untouched.
    ///
    /// # Errors
    ///
    /// [`AudioError::Resample`] for a zero rate or chunk, or rates rubato cannot handle.
    pub fn new(from: u32, to: u32, chunk: usize) -> Result<Self, AudioError> {
        let err = |detail: String| AudioError::Resample { from, to, detail };
        if from == 0 || to == 0 {
            return Err(err("sample rates must be positive".into()));
        }
        if chunk == 0 {
            return Err(err("the chunk size must be positive".into()));
        }
        let (fft, chunk_in, out_max, delay) = if from == to {
            (None, chunk, 0, 0)
        } else {
            let fft = Fft::<f32>::new(from as usize, to as usize, chunk, 1, FixedSync::Input)
                .map_err(|e| err(e.to_string()))?;
            let chunk_in = fft.input_frames_next();
            let out_max = fft.output_frames_max();
            let delay = fft.output_delay();
            (Some(fft), chunk_in, out_max, delay)
        };
        Ok(StreamResampler {
            from,
            to,
            fft,
            chunk_in,
            fifo: Vec::with_capacity(chunk_in),
            out_buf: vec![0.0; out_max],
            to_skip: delay,
            delay,
            consumed: 0,
            produced: 0,
        })
    }

    /// Input rate.
    pub fn from_rate(&self) -> u32 {
        self.from
    }

    /// Output rate.
    pub fn to_rate(&self) -> u32 {
        self.to
    }

    /// Algorithmic delay of the filter in output samples (trimmed from the output here; a live
    /// stream still waits this long, plus up to one input chunk, for its samples).
    pub fn delay(&self) -> usize {
        self.delay
    }

    /// Input samples per FFT call.
    pub fn chunk(&self) -> usize {
        self.chunk_in
    }

    /// The most samples one `process` call of `input_len` samples can append.
    pub fn max_output(&self, input_len: usize) -> usize {
        ((input_len + self.chunk_in) as u64 * self.to as u64 / self.from as u64) as usize
            + self.out_buf.len()
            + 1
    }

    /// Resamples `input`, appending every output sample available so far to `out`.
    ///
    /// # Errors
    ///
    /// [`AudioError::Resample`] if rubato rejects a buffer (not expected).
    pub fn process(&mut self, mut input: &[f32], out: &mut Vec<f32>) -> Result<(), AudioError> {
        self.consumed += input.len() as u64;
        if self.fft.is_none() {
            out.extend_from_slice(input);
            self.produced += input.len() as u64;
            return Ok(());
        }
        while !input.is_empty() {
            if self.fifo.is_empty() && input.len() >= self.chunk_in {
                // Whole chunks straight from the input, without a copy.
                let (chunk, rest) = input.split_at(self.chunk_in);
                self.run(chunk, None, out)?;
                input = rest;
                continue;
            }
            let take = (self.chunk_in - self.fifo.len()).min(input.len());
            self.fifo.extend_from_slice(&input[..take]);
            input = &input[take..];
            if self.fifo.len() == self.chunk_in {
                let fifo = std::mem::take(&mut self.fifo);
                let r = self.run(&fifo, None, out);
                self.fifo = fifo;
                self.fifo.clear();
                r?;
            }
        }
        Ok(())
    }

    /// Ends the stream: appends the remaining output, so that the total output of this
    /// resampler is `round(total_input · to / from)` samples. The resampler can then be reused
    /// for a new stream.
    ///
    /// # Errors
    ///
    /// As [`process`](Self::process).
    pub fn flush(&mut self, out: &mut Vec<f32>) -> Result<(), AudioError> {
        let expected =
            (self.consumed as u128 * self.to as u128 + self.from as u128 / 2) / self.from as u128;
        let expected = expected as u64;
        if self.fft.is_some() {
            // Zero-padded chunks push the tail (and the filter delay) out.
            let mut fifo = std::mem::take(&mut self.fifo);
            let mut guard = 0;
            while self.produced < expected && guard < 64 {
                fifo.resize(self.chunk_in, 0.0);
                self.run(&fifo, Some(expected), out)?;
                fifo.clear();
                guard += 1;
            }
            self.fifo = fifo;
            self.fifo.clear();
        }
        self.reset();
        Ok(())
    }

    /// Forgets all state (buffered input, filter history).
    pub fn reset(&mut self) {
        if let Some(f) = self.fft.as_mut() {
            f.reset();
        }
        self.fifo.clear();
        self.to_skip = self.delay;
        self.consumed = 0;
        self.produced = 0;
    }

    fn run(
        &mut self,
        chunk: &[f32],
        limit: Option<u64>,
        out: &mut Vec<f32>,
    ) -> Result<(), AudioError> {
        let (from, to) = (self.from, self.to);
        let err = |detail: String| AudioError::Resample { from, to, detail };
        let Some(fft) = self.fft.as_mut() else {
            return Ok(());
        };
        let input = InterleavedSlice::new(chunk, 1, chunk.len()).map_err(|e| err(e.to_string()))?;
        let cap = self.out_buf.len();
        let mut output = InterleavedSlice::new_mut(&mut self.out_buf[..], 1, cap)
            .map_err(|e| err(e.to_string()))?;
        let (_, n) = fft
            .process_into_buffer(&input, &mut output, None)
            .map_err(|e| err(e.to_string()))?;
        let skip = self.to_skip.min(n);
        self.to_skip -= skip;
        let mut produced = &self.out_buf[skip..n];
        if let Some(limit) = limit {
            let room = limit.saturating_sub(self.produced) as usize;
            produced = &produced[..produced.len().min(room)];
        }
        out.extend_from_slice(produced);
        self.produced += produced.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::{Synth, Waveform};

    fn sine(rate: u32, freq: f64, secs: f64) -> Vec<f32> {
        let mut s = Synth::new(
            Waveform::Sine {
                freq,
                amplitude: 0.5,
            },
            rate,
        );
        let mut v = vec![0.0; (rate as f64 * secs) as usize];
        s.fill(&mut v);
        v
    }

    fn run(r: &mut StreamResampler, x: &[f32], chunks: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for c in x.chunks(chunks) {
            r.process(c, &mut out).unwrap();
        }
        r.flush(&mut out).unwrap();
        out
    }

    #[test]
    fn streaming_equals_offline_for_any_chunking() {
        let x = sine(48_000, 440.0, 0.5);
        let mut r = StreamResampler::new(48_000, 24_000, 960).unwrap();
        let whole = run(&mut r, &x, x.len());
        assert_eq!(whole.len(), 12_000);
        for chunk in [1, 7, 1920, 997] {
            let got = run(&mut r, &x, chunk);
            assert_eq!(got.len(), whole.len(), "chunk {chunk}");
            let maxdiff = got
                .iter()
                .zip(&whole)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(maxdiff < 1e-5, "chunk {chunk}: max diff {maxdiff}");
        }
    }

    #[test]
    fn output_is_aligned_with_input() {
        // A sine resampled 48k -> 24k must line up with the same sine generated at 24k.
        let x = sine(48_000, 300.0, 0.25);
        let mut r = StreamResampler::new(48_000, 24_000, 960).unwrap();
        let y = run(&mut r, &x, 480);
        let want = sine(24_000, 300.0, 0.25);
        let mid = &y[1000..5000];
        let maxdiff = mid
            .iter()
            .zip(&want[1000..5000])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(maxdiff < 1e-2, "max diff {maxdiff}");
    }

    #[test]
    fn odd_rates_and_passthrough() {
        let x = sine(44_100, 1000.0, 0.3);
        let mut r = StreamResampler::new(44_100, 24_000, 882).unwrap();
        assert_eq!(run(&mut r, &x, 500).len(), 7200);
        let mut same = StreamResampler::new(24_000, 24_000, 480).unwrap();
        let y = run(&mut same, &x, 333);
        assert_eq!(y, x);
        assert!(StreamResampler::new(0, 24_000, 10).is_err());
    }
}
