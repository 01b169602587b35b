//! `wav_sink`: writes audio to a WAV file, keeping the header valid on disk as it goes.
//!
//! The header is rewritten at most every `flush_ms` (and at the end), so a process that is
//! killed leaves a readable file with everything up to the last flush. Padding samples of a
//! framed stream are not written. The file is checked at build and created at the first frame
//! ([`OutputFile`]): the rate is the input's.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::audio::{Pcm, WavFormat, WavWriter};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageError, StageResult};

use super::params::stage_params;
use super::{BuildContext, BuildError, OutputFile, StageKind};

stage_params! {
    /// `wav_sink`'s params.
    struct WavSinkParams {
        path: String = ParamSpec {
            name: "path",
            ty: T::OutPath,
            default: D::Required,
            doc: "output file (parent directories are created)",
        },
        format: String = ParamSpec {
            name: "format",
            ty: T::Choice(&WavFormat::NAMES),
            default: D::Str("i16"),
            doc: "sample encoding",
        },
        rate: u32 = ParamSpec {
            name: "rate",
            ty: T::Int {
                min: 0,
                max: 768_000,
            },
            default: D::Int(0),
            doc: "required input rate, Hz (0 = take the input's)",
        },
        flush_ms: u64 = ParamSpec {
            name: "flush_ms",
            ty: T::Int {
                min: 0,
                max: 3_600_000,
            },
            default: D::Int(200),
            doc: "rewrite the header at most this often",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "wav_sink",
    doc: "writes a mono WAV file (header kept valid while writing)",
    params: WavSinkParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = WavSinkParams::from_params(p)?;
    let path = OutputFile::check(p.path.as_str(), "path")?
        .path()
        .to_path_buf();
    Ok(Body::Stage(Box::new(WavSink {
        path,
        format: WavFormat::parse(p.format.as_str()).unwrap_or_default(),
        rate: p.rate,
        flush_every: Duration::from_millis(p.flush_ms),
        writer: None,
        last_flush: Instant::now(),
    })))
}

struct WavSink {
    path: PathBuf,
    format: WavFormat,
    rate: u32,
    flush_every: Duration,
    writer: Option<WavWriter>,
    last_flush: Instant,
}

impl Stage for WavSink {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let frame = input.take::<Pcm>()?;
        if self.writer.is_none() {
            if self.rate != 0 && frame.data.rate != self.rate {
                return Err(StageError::msg(format!(
                    "input is {} Hz but this sink is set to {} Hz: put a `resample` stage before it",
                    frame.data.rate, self.rate
                )));
            }
            self.writer = Some(WavWriter::create(&self.path, frame.data.rate, self.format)?);
            self.rate = frame.data.rate;
            self.last_flush = Instant::now();
        } else if frame.data.rate != self.rate {
            return Err(StageError::msg(format!(
                "input rate changed from {} Hz to {} Hz in the middle of {}",
                self.rate,
                frame.data.rate,
                self.path.display()
            )));
        }
        if let Some(w) = self.writer.as_mut() {
            w.write(frame.data.valid())?;
            if self.last_flush.elapsed() >= self.flush_every {
                w.flush()?;
                self.last_flush = Instant::now();
            }
        }
        Ok(())
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        match self.writer.take() {
            Some(w) => {
                let frames = w.frames();
                w.finalize()?;
                tracing::info!(
                    "wrote {} ({frames} samples, {:.2} s at {} Hz)",
                    self.path.display(),
                    frames as f64 / self.rate.max(1) as f64,
                    self.rate
                );
            }
            None => tracing::warn!(
                "{}: no audio reached this sink; no file written",
                self.path.display()
            ),
        }
        Ok(())
    }
}
