//! `inject_delay`: passes audio through after a configurable delay, to reproduce the latency
//! signatures the diagnosis tells apart: `bimodal` (good frames mixed with slow ones, as when
//! another job contends for the GPU) and `ramp` (a cost that grows frame after frame, as when a
//! KV cache is copied every step).

use std::time::Duration;

use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, Context, Input, PortSpec, Stage, StageResult};

use super::{BuildContext, BuildError, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "inject_delay",
    doc: "delays each frame: `bimodal` (contention) or `ramp` (growth) latency signatures",
    params: &[
        ParamSpec {
            name: "mode",
            ty: T::Choice(&["none", "bimodal", "ramp"]),
            default: D::Str("none"),
            doc: "the signature to inject",
        },
        ParamSpec {
            name: "base_ms",
            ty: T::Float {
                min: 0.0,
                max: 10_000.0,
            },
            default: D::Float(20.0),
            doc: "delay of a normal frame",
        },
        ParamSpec {
            name: "jitter_ms",
            ty: T::Float {
                min: 0.0,
                max: 1000.0,
            },
            default: D::Float(1.0),
            doc: "uniform noise added to every delay",
        },
        ParamSpec {
            name: "slow_ms",
            ty: T::Float {
                min: 0.0,
                max: 10_000.0,
            },
            default: D::Float(60.0),
            doc: "bimodal: delay of a slow frame",
        },
        ParamSpec {
            name: "slow_fraction",
            ty: T::Float { min: 0.0, max: 1.0 },
            default: D::Float(0.05),
            doc: "bimodal: share of slow frames",
        },
        ParamSpec {
            name: "ramp_to_ms",
            ty: T::Float {
                min: 0.0,
                max: 10_000.0,
            },
            default: D::Float(60.0),
            doc: "ramp: delay reached after `ramp_frames`",
        },
        ParamSpec {
            name: "ramp_frames",
            ty: T::Int {
                min: 1,
                max: 1 << 30,
            },
            default: D::Int(1500),
            doc: "ramp: frames to go from base to ramp_to",
        },
        ParamSpec {
            name: "seed",
            ty: T::Int {
                min: 0,
                max: i64::MAX,
            },
            default: D::Int(1),
            doc: "random seed",
        },
    ],
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    Ok(Body::Stage(Box::new(InjectDelay {
        mode: p.str("mode").to_string(),
        base: p.float("base_ms") / 1e3,
        jitter: p.float("jitter_ms") / 1e3,
        slow: p.float("slow_ms") / 1e3,
        slow_fraction: p.float("slow_fraction"),
        ramp_to: p.float("ramp_to_ms") / 1e3,
        ramp_frames: p.int("ramp_frames") as f64,
        rng: crate::model::sampling::Rng::new(p.int("seed") as u64),
        n: 0,
    })))
}

struct InjectDelay {
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

impl Stage for InjectDelay {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, String> {
        Ok(inputs.to_vec())
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Pcm>()?;
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
        if d > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(d));
        }
        cx.emit(0, f.meta.origin, f.data)
    }
}
