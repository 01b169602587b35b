//! `wav_source`: reads a WAV file (any rate, any PCM format hound reads, any channel count,
//! down-mixed to mono), as fast as possible or paced at real time. Its rate must be one a
//! pipeline can carry (1000 to 768000 Hz, like `resample`'s `to` and `synth_source`'s `rate`):
//! the header says it, so a file that claims 1 Hz is refused before start, not turned into
//! hours of audio.

use std::path::Path;

use crate::audio::{Pcm, WavReader};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, Context, Flow, PortSpec, Source, StageResult};

use super::pacing::Pacer;
use super::params::stage_params;
use super::{caps, BuildContext, BuildError, StageKind};

stage_params! {
    /// `wav_source`'s params.
    struct WavSourceParams {
        path: String = ParamSpec {
            name: "path",
            ty: T::Path,
            default: D::Required,
            doc: "WAV file (relative to the working directory)",
        },
        chunk_ms: f64 = ParamSpec {
            name: "chunk_ms",
            ty: T::Float {
                min: 0.1,
                max: 10_000.0,
            },
            default: D::Float(20.0),
            doc: "samples per frame, in ms",
        },
        realtime: bool = ParamSpec {
            name: "realtime",
            ty: T::Bool,
            default: D::Bool(false),
            doc: "pace frames at real time (else as fast as possible)",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "wav_source",
    doc: "reads a WAV file as mono f32 at its own rate",
    params: WavSourceParams::SPECS,
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build,
};

/// The rates a pipeline carries (`resample`'s `to`, `synth_source`'s `rate`).
const RATES: std::ops::RangeInclusive<u32> = 1000..=768_000;

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = WavSourceParams::from_params(p)?;
    // Opened here, so a missing or bad file is reported before the pipeline starts.
    let reader =
        WavReader::open(Path::new(p.path.as_str())).map_err(|e| BuildError::from(e).key("path"))?;
    let rate = reader.rate();
    if !RATES.contains(&rate) {
        return Err(BuildError::invalid(format!(
            "{}: the header says {rate} Hz, outside {}..={} Hz: not audio this pipeline can \
             carry (resample the file, or fix its header)",
            p.path.as_str(),
            RATES.start(),
            RATES.end()
        ))
        .key("path"));
    }
    let chunk = ((p.chunk_ms / 1000.0 * rate as f64).round() as usize).max(1);
    tracing::debug!(
        path = p.path.as_str(),
        rate,
        channels = reader.channels(),
        frames = reader.frames(),
        "opened WAV input"
    );
    Ok(Body::Source(Box::new(WavSource {
        reader,
        chunk,
        pacer: Pacer::new(p.realtime, rate),
    })))
}

struct WavSource {
    reader: WavReader,
    chunk: usize,
    pacer: Pacer,
}

impl Source for WavSource {
    fn caps(&self) -> Vec<Caps> {
        vec![Caps::new().with(caps::RATE, self.reader.rate() as i64)]
    }

    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        let mut samples = Vec::with_capacity(self.chunk);
        let n = self.reader.read(self.chunk, &mut samples)?;
        if n == 0 {
            return Ok(Flow::Done);
        }
        let Some(origin) = self.pacer.next(n, cx) else {
            return Ok(Flow::Done);
        };
        cx.emit(0, origin, Pcm::new(self.reader.rate(), samples))?;
        Ok(Flow::Continue)
    }
}
