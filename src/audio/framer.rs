//! Cutting a stream into fixed-size frames (1920 samples = 80 ms at 24 kHz for the model).

/// Accumulates samples and hands out frames of exactly `size` samples.
pub struct Framer {
    size: usize,
    buf: Vec<f32>,
}

impl Framer {
    /// A framer producing `size`-sample frames.
    ///
    /// # Panics
    ///
    /// If `size` is 0 (the stage validates its parameter first).
    pub fn new(size: usize) -> Self {
        assert!(size > 0, "frame size must be positive");
        Framer {
            size,
            buf: Vec::with_capacity(size),
        }
    }

    /// Frame size in samples.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Samples waiting for a complete frame.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Appends `input` and calls `emit` with every frame it completes, in order. Each frame is
    /// a new vector of exactly `size` samples.
    ///
    /// # Errors
    ///
    /// The first error returned by `emit` (the remaining input is then dropped).
    pub fn push<E>(
        &mut self,
        mut input: &[f32],
        mut emit: impl FnMut(Vec<f32>) -> Result<(), E>,
    ) -> Result<(), E> {
        while !input.is_empty() {
            if self.buf.is_empty() && input.len() >= self.size {
                let (frame, rest) = input.split_at(self.size);
                emit(frame.to_vec())?;
                input = rest;
                continue;
            }
            let take = (self.size - self.buf.len()).min(input.len());
            self.buf.extend_from_slice(&input[..take]);
            input = &input[take..];
            if self.buf.len() == self.size {
                let frame = std::mem::replace(&mut self.buf, Vec::with_capacity(self.size));
                emit(frame)?;
            }
        }
        Ok(())
    }

    /// Ends the stream: the last partial frame padded with zeros to `size`, with the number of
    /// padding samples; `None` when nothing is pending.
    pub fn finish(&mut self) -> Option<(Vec<f32>, usize)> {
        if self.buf.is_empty() {
            return None;
        }
        let padded = self.size - self.buf.len();
        let mut frame = std::mem::replace(&mut self.buf, Vec::with_capacity(self.size));
        frame.resize(self.size, 0.0);
        Some((frame, padded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Complete frames, then the padded last frame (if any).
    type Framed = (Vec<Vec<f32>>, Option<(Vec<f32>, usize)>);

    fn collect(chunks: &[usize], total: usize, size: usize) -> Framed {
        let x: Vec<f32> = (0..total).map(|i| i as f32).collect();
        let mut f = Framer::new(size);
        let mut frames = Vec::new();
        let mut pos = 0;
        for &c in chunks.iter().cycle() {
            if pos >= total {
                break;
            }
            let end = (pos + c).min(total);
            f.push(&x[pos..end], |fr| {
                frames.push(fr);
                Ok::<_, ()>(())
            })
            .unwrap();
            pos = end;
        }
        (frames, f.finish())
    }

    #[test]
    fn frames_are_exact_and_independent_of_chunking() {
        let (a, last_a) = collect(&[5000], 5000, 1920);
        for chunks in [[1usize].as_slice(), &[7, 1920, 13], &[1920], &[1931]] {
            let (b, last_b) = collect(chunks, 5000, 1920);
            assert_eq!(a, b);
            assert_eq!(last_a, last_b);
        }
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|f| f.len() == 1920));
        assert_eq!(a[1][0], 1920.0);
        let (last, padded) = last_a.unwrap();
        assert_eq!((last.len(), padded), (1920, 2 * 1920 + 1920 - 5000));
        assert_eq!(last[5000 - 3840 - 1], 4999.0);
        assert_eq!(last[1919], 0.0);
    }

    #[test]
    fn exact_multiple_leaves_nothing_to_pad() {
        let (a, last) = collect(&[100], 3840, 1920);
        assert_eq!(a.len(), 2);
        assert!(last.is_none());
    }
}
