//! Mimi, streaming: one 1920-sample frame in, 8 codes out (and back), on whole-utterance graphs.
//!
//! The exported encoder and decoder take a whole utterance and have no state inputs, but they are
//! strictly prefix-causal: the codes of a prefix equal the first codes of the whole. Streaming
//! therefore re-runs the graph on a rolling window of the last `W` frames and keeps the newest
//! frame's output. Until `W` frames have arrived the window is the true prefix (exact); after
//! that it rolls, which approximates the infinite left context with `W` frames of it.
//!
//! # Cost
//!
//! Each frame costs one run over `min(n, W)` frames: about `W` times the cost of one frame once
//! the window is full (W = 8 by default: ~8 × 9-13 ms per encode on 2 CPU cores at full size).
//! The step graphs of [`super::mimi_step`] make one frame cost one frame.

use ort::session::Session;
use ort::value::Tensor;

use super::error::ModelError;
use super::pack::{check_mimi, Graph, Pack};
use super::session::{open, report, Provider, SessionOptions};

/// Streaming Mimi encoder.
pub struct MimiEncoder {
    session: Session,
    /// The execution provider in use.
    pub provider: Provider,
    frame: usize,
    codebooks: usize,
    window: usize,
    /// The last `window` frames of samples, oldest first.
    buf: Vec<f32>,
}

/// Streaming Mimi decoder.
pub struct MimiDecoder {
    session: Session,
    /// The execution provider in use.
    pub provider: Provider,
    frame: usize,
    codebooks: usize,
    window: usize,
    /// The last `window` frames of codes, oldest first, frame-major.
    codes: Vec<i64>,
    /// Scratch for the graph's codebook-major layout.
    layout: Vec<i64>,
}

fn err(graph: &str) -> impl Fn(ort::Error) -> ModelError + '_ {
    move |e| ModelError::ort(graph, e)
}

impl MimiEncoder {
    /// What the graph runs on: `cpu f32`, `cuda f32`.
    pub fn runs_on(&self) -> String {
        format!("{} f32", self.provider.name())
    }

    /// Opens the pack's encoder with a rolling window of `window` frames (at least 1).
    ///
    /// # Errors
    ///
    /// Contract, provider and ONNX Runtime errors.
    pub fn open(pack: &Pack, opts: &SessionOptions, window: usize) -> Result<Self, ModelError> {
        let os = open(&pack.graph_path(Graph::MimiEncoder), "mimi_encoder", opts)?;
        check_mimi(&os.session, "mimi_encoder", true)?;
        report(opts, "mimi_encoder", os.provider, "f32");
        let frame = pack.manifest.frame_size;
        Ok(MimiEncoder {
            session: os.session,
            provider: os.provider,
            frame,
            codebooks: pack.manifest.codebooks,
            window: window.max(1),
            buf: Vec::with_capacity(window.max(1) * frame),
        })
    }

    /// Encodes a whole clip (whole frames only; a partial last frame is dropped). Returns
    /// `frames × codebooks` codes, frame-major.
    ///
    /// # Errors
    ///
    /// ONNX Runtime errors; a clip shorter than one frame is an error.
    pub fn encode(&mut self, samples: &[f32]) -> Result<Vec<Vec<i64>>, ModelError> {
        let n = samples.len() / self.frame * self.frame;
        if n == 0 {
            return Err(ModelError::contract(
                "mimi_encoder",
                format!(
                    "a clip of {} samples is shorter than one frame ({})",
                    samples.len(),
                    self.frame
                ),
            ));
        }
        run_encoder(&mut self.session, &samples[..n], self.codebooks)
    }

    /// Forgets the stream.
    pub fn reset(&mut self) {
        self.buf.clear();
    }

    /// Encodes the next frame of exactly `frame_size` samples; returns its codes.
    ///
    /// # Errors
    ///
    /// A frame of the wrong size, ONNX Runtime errors.
    pub fn push(&mut self, frame: &[f32]) -> Result<Vec<i64>, ModelError> {
        if frame.len() != self.frame {
            return Err(ModelError::contract(
                "mimi_encoder",
                format!("frame of {} samples, expected {}", frame.len(), self.frame),
            ));
        }
        if self.buf.len() == self.window * self.frame {
            self.buf.drain(..self.frame);
        }
        self.buf.extend_from_slice(frame);
        let mut all = run_encoder(&mut self.session, &self.buf, self.codebooks)?;
        all.pop()
            .ok_or_else(|| ModelError::contract("mimi_encoder", "no codes returned"))
    }
}

fn run_encoder(
    session: &mut Session,
    samples: &[f32],
    codebooks: usize,
) -> Result<Vec<Vec<i64>>, ModelError> {
    let e = err("mimi_encoder");
    let input = Tensor::from_array(([1usize, 1, samples.len()], samples.to_vec())).map_err(&e)?;
    let outputs = session.run(ort::inputs!["waveform" => input]).map_err(&e)?;
    let (shape, data) = outputs["codes"].try_extract_tensor::<i64>().map_err(&e)?;
    if shape.len() != 3 || shape[1] as usize != codebooks {
        return Err(ModelError::contract(
            "mimi_encoder",
            format!(
                "output `codes` has shape {:?}, expected [1, {codebooks}, frames]",
                &shape[..]
            ),
        ));
    }
    let frames = shape[2] as usize;
    Ok((0..frames)
        .map(|t| (0..codebooks).map(|q| data[q * frames + t]).collect())
        .collect())
}

impl MimiDecoder {
    /// What the graph runs on: `cpu f32`, `cuda f32`.
    pub fn runs_on(&self) -> String {
        format!("{} f32", self.provider.name())
    }

    /// Opens the pack's decoder with a rolling window of `window` frames (at least 1).
    ///
    /// # Errors
    ///
    /// Contract, provider and ONNX Runtime errors.
    pub fn open(pack: &Pack, opts: &SessionOptions, window: usize) -> Result<Self, ModelError> {
        let os = open(&pack.graph_path(Graph::MimiDecoder), "mimi_decoder", opts)?;
        check_mimi(&os.session, "mimi_decoder", false)?;
        report(opts, "mimi_decoder", os.provider, "f32");
        Ok(MimiDecoder {
            session: os.session,
            provider: os.provider,
            frame: pack.manifest.frame_size,
            codebooks: pack.manifest.codebooks,
            window: window.max(1),
            codes: Vec::new(),
            layout: Vec::new(),
        })
    }

    /// Forgets the stream.
    pub fn reset(&mut self) {
        self.codes.clear();
    }

    /// Decodes a whole utterance's codes (frame-major) in one call; returns its samples.
    ///
    /// # Errors
    ///
    /// Codes of the wrong count, ONNX Runtime errors.
    pub fn decode(&mut self, frames: &[Vec<i64>]) -> Result<Vec<f32>, ModelError> {
        if let Some(f) = frames.iter().find(|f| f.len() != self.codebooks) {
            return Err(ModelError::contract(
                "mimi_decoder",
                format!("{} codes, expected {}", f.len(), self.codebooks),
            ));
        }
        self.layout.clear();
        for q in 0..self.codebooks {
            self.layout.extend(frames.iter().map(|f| f[q]));
        }
        self.run_layout(frames.len(), None)
    }

    /// Runs the graph on `frames` frames of codes in `layout` (codebook-major); returns the
    /// last `last` samples of its output (all of it for None).
    fn run_layout(&mut self, frames: usize, last: Option<usize>) -> Result<Vec<f32>, ModelError> {
        let e = err("mimi_decoder");
        let input = Tensor::from_array(([1usize, self.codebooks, frames], self.layout.clone()))
            .map_err(&e)?;
        let outputs = self
            .session
            .run(ort::inputs!["codes" => input])
            .map_err(&e)?;
        let (_, wav) = outputs["waveform"]
            .try_extract_tensor::<f32>()
            .map_err(&e)?;
        let n = last.unwrap_or(wav.len());
        if wav.len() < n {
            return Err(ModelError::contract(
                "mimi_decoder",
                format!(
                    "output `waveform` has {} samples, expected at least {n}",
                    wav.len()
                ),
            ));
        }
        Ok(wav[wav.len() - n..].to_vec())
    }

    /// Decodes the next frame's codes; returns its `frame_size` samples.
    ///
    /// # Errors
    ///
    /// Codes of the wrong count or out of range, ONNX Runtime errors.
    pub fn push(&mut self, codes: &[i64], audio_vocab: i64) -> Result<Vec<f32>, ModelError> {
        if codes.len() != self.codebooks {
            return Err(ModelError::contract(
                "mimi_decoder",
                format!("{} codes, expected {}", codes.len(), self.codebooks),
            ));
        }
        if let Some((q, &c)) = codes
            .iter()
            .enumerate()
            .find(|(_, &c)| !(0..audio_vocab).contains(&c))
        {
            return Err(ModelError::Token {
                graph: "mimi_decoder".into(),
                channel: format!("codebook {q}"),
                value: c,
                limit: audio_vocab,
            });
        }
        if self.codes.len() == self.window * self.codebooks {
            self.codes.drain(..self.codebooks);
        }
        self.codes.extend_from_slice(codes);
        let frames = self.codes.len() / self.codebooks;
        self.layout.clear();
        for q in 0..self.codebooks {
            self.layout
                .extend((0..frames).map(|t| self.codes[t * self.codebooks + q]));
        }
        self.run_layout(frames, Some(self.frame))
    }
}
