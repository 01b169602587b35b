//! `aec`: cancels the speaker's echo in the microphone's signal (WebRTC AEC3 through
//! [`crate::audio::echo`]), with what the `playback` stage named `reference` really played as
//! the reference, aligned on the devices' timestamps. Put it after the microphone's `resample`
//! (to: 24000) and before the framer.
//!
//! `enabled: false` passes the microphone through untouched (and asks the player for nothing).
//! The ERLE, the echo path's delay and the share of double talk are status keys and metrics.

use std::time::{Duration, Instant};

use crate::audio::echo::{Canceller, CancellerConfig, EchoStats};
use crate::audio::reference::ReferenceReader;
use crate::audio::Pcm;
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::observe::names;
use crate::runtime::{
    Body, Caps, CapsError, Context, Endpoint, Input, PortSpec, Stage, StageError, StageResult,
    StatusSpec,
};

use super::params::stage_params;
use super::{caps, BuildContext, BuildError, StageKind};

stage_params! {
    /// `aec`'s params.
    struct AecParams {
        reference: String = ParamSpec {
            name: "reference",
            ty: T::Str,
            default: D::Str("speaker"),
            doc: "the playback stage whose output is the echo's source",
        },
        enabled: bool = ParamSpec {
            name: "enabled",
            ty: T::Bool,
            default: D::Bool(true),
            doc: "false: pass the microphone through untouched",
        },
        rate: u32 = ParamSpec {
            name: "rate",
            ty: T::Int {
                min: 8000,
                max: 48_000,
            },
            default: D::Int(24_000),
            doc: "input rate, Hz (a multiple of 100: 10 ms blocks)",
        },
        lead_ms: f64 = ParamSpec {
            name: "lead_ms",
            ty: T::Float {
                min: 0.0,
                max: 200.0,
            },
            default: D::Float(20.0),
            doc: "margin for timestamp errors: the reference handed with a block was played this much later",
        },
        extra_delay_ms: f64 = ParamSpec {
            name: "extra_delay_ms",
            ty: T::Float {
                min: 0.0,
                max: 3000.0,
            },
            default: D::Float(0.0),
            doc: "a known echo delay the devices do not report (a Bluetooth speaker)",
        },
        max_delay_ms: f64 = ParamSpec {
            name: "max_delay_ms",
            ty: T::Float {
                min: 0.0,
                max: 3000.0,
            },
            default: D::Float(1500.0),
            doc: "the longest echo path searched for (beyond AEC3's own ~0.5 s the reference is delayed)",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "aec",
    doc: "cancels the speaker's echo in the microphone signal (AEC3; reference: a playback stage)",
    params: AecParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[],
    status: &[
        StatusSpec {
            name: "state",
            doc: "`cancelling`, `waiting for the reference` or `off`",
        },
        StatusSpec {
            name: "erle_db",
            doc: "echo return loss enhancement over the recent single talk, dB",
        },
        StatusSpec {
            name: "delay_ms",
            doc: "the echo path's delay past the devices, ms",
        },
        StatusSpec {
            name: "double_talk",
            doc: "share of recent speaker-active blocks in which the user talks too",
        },
    ],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = AecParams::from_params(p)?;
    let rate = p.rate;
    if !rate.is_multiple_of(100) {
        return Err(BuildError::invalid(format!(
            "{rate} Hz has no whole 10 ms block: give a multiple of 100 (24000)"
        ))
        .key("rate"));
    }
    let control = cx.endpoint();
    let enabled = p.enabled;
    control.set(
        "state",
        if enabled {
            "waiting for the reference"
        } else {
            "off"
        },
    );
    let reference = p.reference.as_str();
    let reader = match (enabled, cx.taps) {
        (false, _) => None,
        (true, Some(t)) => Some(t.read(reference, cx.stage).reader(rate)),
        (true, None) => {
            return Err(BuildError::invalid(format!(
                "`reference: {reference}` needs the playback stage of the same pipeline"
            ))
            .key("reference"))
        }
    };
    let ms = |v: f64| Duration::from_secs_f64(v / 1000.0);
    let cfg = CancellerConfig {
        rate,
        lead: ms(p.lead_ms),
        extra_delay: ms(p.extra_delay_ms),
        max_delay: ms(p.max_delay_ms),
    };
    let m = AecMetrics::new(cx.stage);
    Ok(Body::Stage(Box::new(Aec {
        rate,
        canceller: reader.as_ref().map(|_| Canceller::new(cfg)),
        reader,
        control,
        out: Vec::with_capacity(rate as usize),
        last_origin: None,
        published: Instant::now(),
        reported: EchoStats::default(),
        m,
    })))
}

struct AecMetrics {
    erle: metrics::Gauge,
    delay: metrics::Gauge,
    double_talk: metrics::Gauge,
    realigns: metrics::Counter,
}

impl AecMetrics {
    fn new(stage: &str) -> Self {
        let labels = [("stage", stage.to_string())];
        AecMetrics {
            erle: metrics::gauge!(names::AEC_ERLE, &labels),
            delay: metrics::gauge!(names::AEC_DELAY, &labels),
            double_talk: metrics::gauge!(names::AEC_DOUBLE_TALK, &labels),
            realigns: metrics::counter!(names::AEC_REALIGNS, &labels),
        }
    }
}

struct Aec {
    rate: u32,
    reader: Option<ReferenceReader>,
    canceller: Option<Canceller>,
    control: Endpoint,
    out: Vec<f32>,
    last_origin: Option<Instant>,
    published: Instant,
    reported: EchoStats,
    m: AecMetrics,
}

impl Aec {
    /// Status and metrics, once a second.
    fn publish(&mut self) {
        let (Some(c), Some(r)) = (self.canceller.as_ref(), self.reader.as_ref()) else {
            return;
        };
        if self.published.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.published = Instant::now();
        let s = c.stats();
        let state = if r.connected() {
            "cancelling"
        } else {
            "waiting for the reference"
        };
        self.control.set("state", state);
        if let Some(e) = s.erle_db {
            let e = (e * 10.0).round() / 10.0;
            self.control.set("erle_db", e);
            self.m.erle.set(e);
        }
        if let Some(d) = s.delay_ms {
            self.control.set("delay_ms", d.round());
            self.m.delay.set(d / 1e3);
        }
        let dt = (s.double_talk * 1000.0).round() / 1000.0;
        self.control.set("double_talk", dt);
        self.m.double_talk.set(dt);
        self.m
            .realigns
            .increment(s.realigns.saturating_sub(self.reported.realigns));
        self.reported = s;
    }
}

impl Stage for Aec {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        inputs[0]
            .require(caps::RATE, self.rate as i64, "sample rate (Hz)")
            .map_err(|e| {
                let fix = format!("put a `resample` stage (to: {}) before it", self.rate);
                CapsError::fix(e, fix)
            })?;
        Ok(vec![Caps::new().with(caps::RATE, self.rate as i64)])
    }

    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let frame = input.take::<Pcm>()?;
        if frame.data.rate != self.rate {
            return Err(StageError::msg(format!(
                "input is {} Hz but this canceller runs at {} Hz: put a `resample` stage (to: {}) \
                 before it",
                frame.data.rate, self.rate, self.rate
            )));
        }
        let (Some(c), Some(r)) = (self.canceller.as_mut(), self.reader.as_mut()) else {
            let origin = frame.meta.origin;
            return cx.emit(0, origin, frame.data);
        };
        r.read(|s| c.push_reference(s))?;
        if let Some(clock) = r.clock() {
            c.set_reference_clock(clock);
        }
        self.last_origin = Some(frame.meta.origin);
        self.out.clear();
        if let Some(at) = c.process(frame.data.valid(), frame.meta.origin, &mut self.out) {
            cx.emit(0, at, Pcm::new(self.rate, self.out.clone()))?;
        }
        self.publish();
        Ok(())
    }

    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        // What is left of the last block goes out as it is (nothing captured is lost).
        if let (Some(c), Some(at)) = (self.canceller.as_mut(), self.last_origin) {
            let rest = c.take_pending();
            if !rest.is_empty() {
                cx.emit(0, at, Pcm::new(self.rate, rest))?;
            }
            let s = c.stats();
            tracing::info!(
                erle_db = s.erle_db.map(|e| format!("{e:.1}")).unwrap_or_default(),
                delay_ms = s.delay_ms.map(|d| format!("{d:.0}")).unwrap_or_default(),
                coarse_delay_ms = format!("{:.0}", s.coarse_delay_ms),
                double_talk = format!("{:.3}", s.double_talk),
                realigns = s.realigns,
                late_reference = s.late_reference,
                blocks = s.blocks,
                "echo canceller finished"
            );
        }
        Ok(())
    }
}
