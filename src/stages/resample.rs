//! `resample`: converts any input rate to the `to` rate (FFT resampler, delay-compensated).
//!
//! The resampler is built for the rate of the first frame; a stream whose rate changes is
//! flushed and continues with a resampler for the new rate. Apart from the output frame itself,
//! nothing is allocated per frame.

use std::time::Instant;

use crate::audio::{Pcm, StreamResampler};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, CapsError, Context, Input, PortSpec, Stage, StageResult};

use super::params::stage_params;
use super::{caps, BuildContext, BuildError, StageKind};

stage_params! {
    /// `resample`'s params.
    struct ResampleParams {
        to: u32 = ParamSpec {
            name: "to",
            ty: T::Int {
                min: 1000,
                max: 768_000,
            },
            default: D::Int(24_000),
            doc: "output rate, Hz",
        },
        chunk_ms: f64 = ParamSpec {
            name: "chunk_ms",
            ty: T::Float {
                min: 1.0,
                max: 1000.0,
            },
            default: D::Float(20.0),
            doc: "input processed per FFT, in ms",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "resample",
    doc: "converts the sample rate (any rate to `to`; FFT, delay-compensated)",
    params: ResampleParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = ResampleParams::from_params(p)?;
    Ok(Body::Stage(Box::new(Resample {
        to: p.to,
        chunk_ms: p.chunk_ms,
        inner: None,
        last_origin: None,
    })))
}

struct Resample {
    to: u32,
    chunk_ms: f64,
    inner: Option<StreamResampler>,
    last_origin: Option<Instant>,
}

impl Resample {
    fn flush(&mut self, cx: &mut Context<'_>) -> StageResult {
        if let (Some(r), Some(origin)) = (self.inner.as_mut(), self.last_origin) {
            let mut out = Vec::with_capacity(r.max_output(0));
            r.flush(&mut out)?;
            if !out.is_empty() {
                cx.emit(0, origin, Pcm::new(self.to, out))?;
            }
        }
        Ok(())
    }
}

impl Stage for Resample {
    fn caps(&self, _inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        Ok(vec![Caps::new().with(caps::RATE, self.to as i64)])
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let frame = input.take::<Pcm>()?;
        let rate = frame.data.rate;
        if self.inner.as_ref().is_some_and(|r| r.from_rate() != rate) {
            self.flush(cx)?;
            self.inner = None;
        }
        if self.inner.is_none() {
            let chunk = ((self.chunk_ms / 1000.0 * rate as f64).round() as usize).max(1);
            let r = StreamResampler::new(rate, self.to, chunk)?;
            tracing::debug!(
                from = rate,
                to = self.to,
                chunk = r.chunk(),
                delay_samples = r.delay(),
                delay_ms = format!("{:.2}", r.delay() as f64 * 1e3 / self.to as f64),
                "resampler ready"
            );
            self.inner = Some(r);
        }
        self.last_origin = Some(frame.meta.origin);
        let Some(r) = self.inner.as_mut() else {
            return Ok(());
        };
        let mut out = Vec::with_capacity(r.max_output(frame.data.samples.len()));
        r.process(frame.data.valid(), &mut out)?;
        if !out.is_empty() {
            cx.emit(0, frame.meta.origin, Pcm::new(self.to, out))?;
        }
        Ok(())
    }

    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        self.flush(cx)
    }
}
