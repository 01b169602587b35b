//! `inject_delay`: passes audio through after a configurable delay, to reproduce the latency
//! signatures the diagnosis tells apart: `bimodal` (good frames mixed with slow ones, as when
//! another job contends for the GPU) and `ramp` (a cost that grows frame after frame, as when a
//! KV cache is copied every step).
//!
//! The same signatures can be laid on any stage with inputs: its `inject_delay:` option (a map
//! of these params) makes the stage itself slow, inside its own service time, as contention for
//! its device would ([`Signature`], [`delayed`]). That is how a drill reproduces a contended LM
//! step without a second job on the machine.

use std::time::Duration;

use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, CapsError, Context, Input, PortSpec, Stage, StageResult};

use super::params::stage_params;
use super::{BuildContext, BuildError, StageKind};

stage_params! {
    /// `inject_delay`'s params (a stage's, or a stage's `inject_delay:` option).
    pub(crate) struct DelayParams {
        mode: String = ParamSpec {
            name: "mode",
            ty: T::Choice(&["none", "bimodal", "ramp"]),
            default: D::Str("none"),
            doc: "the signature to inject",
        },
        base_ms: f64 = ParamSpec {
            name: "base_ms",
            ty: T::Float {
                min: 0.0,
                max: 10_000.0,
            },
            default: D::Float(20.0),
            doc: "delay of a normal frame",
        },
        jitter_ms: f64 = ParamSpec {
            name: "jitter_ms",
            ty: T::Float {
                min: 0.0,
                max: 1000.0,
            },
            default: D::Float(1.0),
            doc: "uniform noise added to every delay",
        },
        slow_ms: f64 = ParamSpec {
            name: "slow_ms",
            ty: T::Float {
                min: 0.0,
                max: 10_000.0,
            },
            default: D::Float(60.0),
            doc: "bimodal: delay of a slow frame",
        },
        slow_fraction: f64 = ParamSpec {
            name: "slow_fraction",
            ty: T::Float { min: 0.0, max: 1.0 },
            default: D::Float(0.05),
            doc: "bimodal: share of slow frames",
        },
        ramp_to_ms: f64 = ParamSpec {
            name: "ramp_to_ms",
            ty: T::Float {
                min: 0.0,
                max: 10_000.0,
            },
            default: D::Float(60.0),
            doc: "ramp: delay reached after `ramp_frames`",
        },
        ramp_frames: u64 = ParamSpec {
            name: "ramp_frames",
            ty: T::Int {
                min: 1,
                max: 1 << 30,
            },
            default: D::Int(1500),
            doc: "ramp: frames to go from base to ramp_to",
        },
        seed: u64 = ParamSpec {
            name: "seed",
            ty: T::Int {
                min: 0,
                max: i64::MAX,
            },
            default: D::Int(1),
            doc: "random seed",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "inject_delay",
    doc: "delays each frame: `bimodal` (contention) or `ramp` (growth) latency signatures",
    params: DelayParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    Ok(Body::Stage(Box::new(InjectDelay {
        sig: Signature::new(p)?,
    })))
}

/// A latency signature: the delay of each frame in turn.
pub struct Signature {
    mode: String,
    base: f64,
    jitter: f64,
    slow: f64,
    slow_fraction: f64,
    ramp_to: f64,
    ramp_frames: f64,
    rng: crate::model::sampling::Rng,
    n: u64,
}

impl Signature {
    /// From checked `inject_delay` params.
    ///
    /// # Errors
    ///
    /// A param its declaration does not give (see [`super::params`]).
    pub fn new(p: &Params) -> Result<Self, BuildError> {
        let p = DelayParams::from_params(p)?;
        Ok(Signature {
            mode: p.mode,
            base: p.base_ms / 1e3,
            jitter: p.jitter_ms / 1e3,
            slow: p.slow_ms / 1e3,
            slow_fraction: p.slow_fraction,
            ramp_to: p.ramp_to_ms / 1e3,
            ramp_frames: p.ramp_frames as f64,
            rng: crate::model::sampling::Rng::new(p.seed),
            n: 0,
        })
    }

    /// The next frame's delay.
    pub fn next_delay(&mut self) -> Duration {
        let noise = self.jitter * self.rng.next_f64();
        let d = match self.mode.as_str() {
            "bimodal" if self.rng.next_f64() < self.slow_fraction => self.slow + noise,
            "bimodal" => self.base + noise,
            "ramp" => {
                let t = (self.n as f64 / self.ramp_frames).min(1.0);
                self.base + (self.ramp_to - self.base) * t + noise
            }
            _ => 0.0,
        };
        self.n += 1;
        Duration::from_secs_f64(d.max(0.0))
    }

    fn sleep(&mut self) {
        let d = self.next_delay();
        if !d.is_zero() {
            std::thread::sleep(d);
        }
    }
}

struct InjectDelay {
    sig: Signature,
}

impl Stage for InjectDelay {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        Ok(inputs.to_vec())
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Pcm>()?;
        self.sig.sleep();
        cx.emit(0, f.meta.origin, f.data)
    }
}

/// `stage` made slow by `sig` before each frame it processes (inside its service time).
pub fn delayed(stage: Box<dyn Stage>, sig: Signature) -> Box<dyn Stage> {
    Box::new(Delayed { inner: stage, sig })
}

struct Delayed {
    inner: Box<dyn Stage>,
    sig: Signature,
}

impl Stage for Delayed {
    fn start(&mut self, cx: &mut Context<'_>) -> StageResult {
        self.inner.start(cx)
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        self.sig.sleep();
        self.inner.process(input, cx)
    }

    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        self.inner.finish(cx)
    }

    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        self.inner.caps(inputs)
    }
}
