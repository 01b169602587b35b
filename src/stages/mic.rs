//! `mic`: captures a sound device (down-mixed to mono, at its native rate), in chunks stamped
//! with the capture instant of their newest sample. Put `resample` (to: 24000) after it.
//!
//! The `switch` command (a device spec) moves the stage to another device at the next chunk
//! boundary, at the same sample rate if the device has it (else at its own: `resample` follows
//! rate changes), without stopping the pipeline; when the new device cannot be opened the old
//! one is kept, and the reply and the `switch_error` status say why. `mute` and `unmute` send
//! silence instead of what is captured, keeping the clock running.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ringbuf::traits::{Consumer, Observer};

use crate::audio::device::DeviceState;
use crate::audio::live::{open_capture, Capture, CaptureRing};
use crate::audio::{AudioError, Pcm};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::observe::names;
use crate::runtime::{
    Body, Caps, CommandSpec, Context, Endpoint, Flow, PortSpec, Reply, Source, StageError,
    StageResult, StatusSpec,
};

use super::params::stage_params;
use super::{caps, device_status, BuildContext, BuildError, StageKind};

stage_params! {
    /// `mic`'s params.
    struct MicParams {
        device: String = ParamSpec {
            name: "device",
            ty: T::Str,
            default: D::Str("default"),
            doc: "`default`, a device name, or a regular expression",
        },
        rate: i64 = ParamSpec {
            name: "rate",
            ty: T::Int {
                min: 0,
                max: 768_000,
            },
            default: D::Int(0),
            doc: "sample rate to ask for (0 = the device's)",
        },
        chunk_ms: f64 = ParamSpec {
            name: "chunk_ms",
            ty: T::Float {
                min: 1.0,
                max: 1000.0,
            },
            default: D::Float(20.0),
            doc: "samples per frame, in ms",
        },
        reconnect: bool = ParamSpec {
            name: "reconnect",
            ty: T::Bool,
            default: D::Bool(false),
            doc: "reopen the device with backoff when it is lost",
        },
        duration: f64 = ParamSpec {
            name: "duration",
            ty: T::Float { min: 0.0, max: 1e9 },
            default: D::Float(0.0),
            doc: "stop after this many seconds (0 = run until stopped)",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "mic",
    doc: "captures a sound device (mono, native rate); stamps frames with their capture instant",
    params: MicParams::SPECS,
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<Pcm>("out")],
    commands: &[
        CommandSpec {
            name: "switch",
            arg: Some("device"),
            doc: "move to another device at the next chunk (the current one is kept if it fails)",
        },
        CommandSpec {
            name: "mute",
            arg: None,
            doc: "send silence instead of what is captured",
        },
        CommandSpec {
            name: "unmute",
            arg: None,
            doc: "send what is captured again",
        },
    ],
    status: &[
        device_status::NAME,
        device_status::STATE,
        device_status::RECONNECTS,
        StatusSpec {
            name: "muted",
            doc: "silence is sent",
        },
        device_status::SWITCH_ERROR,
    ],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = MicParams::from_params(p)?;
    let rate = match p.rate {
        0 => None,
        r if r < 8000 => {
            return Err(BuildError::invalid(format!(
                "{r} Hz is not an audio rate: give 8000 or more, or 0 for the device's own"
            ))
            .key("rate"))
        }
        r => Some(r as u32),
    };
    let cap = open(p.device.as_str(), rate, p.reconnect)?;
    tracing::info!(
        device = %cap.handle.status().name,
        rate = cap.rate,
        channels = cap.channels,
        "microphone open"
    );
    // Seconds, not samples: a device switch may change the rate.
    let limit = (p.duration > 0.0).then_some(p.duration);
    let labels = [("device", cap.handle.status().name.clone())];
    let control = cx.endpoint();
    control.set("name", cap.handle.status().name.clone());
    control.set("muted", false);
    Ok(Body::Source(Box::new(Mic {
        control,
        muted: false,
        reconnect: p.reconnect,
        position: 0,
        ring: None,
        skip_startup: true,
        chunk_ms: p.chunk_ms,
        consumed: 0,
        consumed_before: 0.0,
        limit,
        last_mark: None,
        published: None,
        published_reconnects: u64::MAX,
        lost: metrics::counter!(names::DEVICE_ERRORS, &labels),
        cap,
    })))
}

/// Opens the capture device (`rate`, or its own) and waits for it to deliver audio at its rate.
fn open(spec: &str, rate: Option<u32>, reconnect: bool) -> Result<Capture, AudioError> {
    let cap = open_capture(spec, rate, reconnect, Duration::from_secs(2))?;
    if !cap.wait_ready(Duration::from_secs(8)) {
        tracing::warn!(device = %cap.handle.status().name, "the device is not delivering audio at its rate yet");
    }
    Ok(cap)
}

struct Mic {
    cap: Capture,
    control: Endpoint,
    muted: bool,
    reconnect: bool,
    /// Position in the current ring's stream (what the callback marks count), which differs
    /// from `consumed` by what was skipped and across reconnects.
    position: u64,
    /// Discard what was captured before the pipeline started.
    skip_startup: bool,
    ring: Option<CaptureRing>,
    chunk_ms: f64,
    /// Samples delivered from the current device.
    consumed: u64,
    /// Seconds delivered from devices before a switch.
    consumed_before: f64,
    /// Seconds to deliver in all.
    limit: Option<f64>,
    last_mark: Option<(u64, Instant)>,
    /// The device state last published (this loop polls every 2 ms: publish changes only).
    published: Option<DeviceState>,
    /// The reconnect count last published (none yet: `u64::MAX`).
    published_reconnects: u64,
    lost: metrics::Counter,
}

impl Mic {
    /// Samples per frame at the current device's rate.
    fn chunk(&self) -> usize {
        ((self.chunk_ms / 1000.0 * self.cap.rate as f64).round() as usize).max(1)
    }

    /// Seconds delivered so far.
    fn seconds(&self) -> f64 {
        self.consumed_before + self.consumed as f64 / self.cap.rate as f64
    }

    /// Moves to device `spec` at the current rate (or the device's own when it lacks it);
    /// keeps the current device when that fails.
    fn switch(&mut self, spec: &str) -> Reply {
        let old = self.cap.handle.status().name.clone();
        let opened = open(spec, Some(self.cap.rate), self.reconnect)
            .or_else(|first| open(spec, None, self.reconnect).map_err(|_| first));
        let cap = match opened {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(device = %old, "keeping the current microphone: {e}");
                self.control.set("switch_error", e.to_string());
                return Err(format!("keeping {old}: {e}"));
            }
        };
        let name = cap.handle.status().name.clone();
        tracing::info!(from = %old, to = %name, rate = cap.rate, "microphone switched");
        self.control.set("switch_error", None::<String>);
        self.control.set("name", name.clone());
        let done = format!("microphone switched to {name} ({} Hz)", cap.rate);
        self.lost = metrics::counter!(names::DEVICE_ERRORS, "device" => name);
        // The old stream closes when its handle drops; what the new one captured while
        // starting is discarded like at start-up.
        self.consumed_before = self.seconds();
        self.consumed = 0;
        self.cap = cap;
        self.ring = None;
        self.last_mark = None;
        self.position = 0;
        self.skip_startup = true;
        Ok(done)
    }

    /// The capture instant of sample `pos` (1-based end position), from the callbacks' marks.
    fn origin(&mut self, end: u64) -> Instant {
        if let Some(r) = self.ring.as_mut() {
            while let Some(&m) = r.marks.try_peek() {
                self.last_mark = Some(m);
                let _ = r.marks.try_pop();
                if m.0 >= end {
                    break;
                }
            }
        }
        match self.last_mark {
            Some((pos, at)) if pos >= end => {
                let back = Duration::from_secs_f64((pos - end) as f64 / self.cap.rate as f64);
                at.checked_sub(back).unwrap_or(at)
            }
            Some((_, at)) => at,
            None => Instant::now(),
        }
    }
}

impl Source for Mic {
    fn caps(&self) -> Vec<Caps> {
        vec![Caps::new().with(caps::RATE, self.cap.rate as i64)]
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        tracing::info!(
            device = %self.cap.handle.status().name,
            captured_s = format!("{:.2}", self.seconds()),
            capture_delay_ms = format!(
                "{:.1}",
                self.cap.capture_delay_ns.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6
            ),
            overflow = self.cap.overflow.load(std::sync::atomic::Ordering::Relaxed),
            xruns = self
                .cap
                .handle
                .status()
                .xruns
                .load(std::sync::atomic::Ordering::Relaxed),
            "microphone finished"
        );
        Ok(())
    }

    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        loop {
            if let Some(l) = self.limit {
                let left = ((l - self.consumed_before) * self.cap.rate as f64).round() as u64;
                if self.consumed >= left {
                    return Ok(Flow::Done);
                }
            }
            while let Some(c) = self.control.next_command() {
                let r = match c.name {
                    "switch" => self.switch(&c.arg),
                    mute => {
                        self.muted = mute == "mute";
                        self.control.set("muted", self.muted);
                        Ok(if self.muted { "muted" } else { "unmuted" }.into())
                    }
                };
                c.reply(r);
            }
            // A reopened device comes with new rings.
            while let Ok(r) = self.cap.rings.try_recv() {
                if self.ring.is_some() {
                    self.lost.increment(1);
                }
                self.ring = Some(r);
                self.last_mark = None;
                self.position = 0;
            }
            let status = self.cap.handle.status();
            let reconnects = status.reconnects.load(Ordering::Relaxed);
            if self.published_reconnects != reconnects {
                self.published_reconnects = reconnects;
                self.control.set("reconnects", reconnects);
            }
            if self.published != Some(status.state()) {
                self.published = Some(status.state());
                self.control
                    .set("device", format!("{:?}", status.state()).to_lowercase());
            }
            if status.state() == DeviceState::Failed {
                return Err(StageError::msg(format!(
                    "microphone {:?} was lost: {} (set `reconnect: true` to reopen it)",
                    status.name,
                    status.last_error().unwrap_or_default()
                )));
            }
            if self.skip_startup {
                if let Some(r) = self.ring.as_mut() {
                    let n = r.samples.occupied_len();
                    self.position += r.samples.skip(n) as u64;
                    self.skip_startup = false;
                }
            }
            let ready = self
                .ring
                .as_ref()
                .map(|r| r.samples.occupied_len())
                .unwrap_or(0);
            let chunk = self.chunk();
            if ready >= chunk {
                let mut samples = vec![0.0f32; chunk];
                let n = self
                    .ring
                    .as_mut()
                    .map(|r| r.samples.pop_slice(&mut samples))
                    .unwrap_or(0);
                samples.truncate(n);
                if self.muted {
                    samples.fill(0.0);
                }
                self.consumed += n as u64;
                self.position += n as u64;
                let origin = self.origin(self.position);
                cx.emit(0, origin, Pcm::new(self.cap.rate, samples))?;
                return Ok(Flow::Continue);
            }
            if !cx.sleep_until(Instant::now() + Duration::from_millis(2)) {
                return Ok(Flow::Done);
            }
        }
    }
}
