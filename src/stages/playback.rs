//! `playback`: plays audio on a sound device through a jitter buffer, or on a virtual clock
//! (`device: virtual`) for headless pipelines. Reports depth, target, underruns, concealed and
//! dropped samples, and mouth-to-ear latency (capture instant of a frame → the instant its first
//! sample reaches the device).
//!
//! What it plays (after the jitter buffer) is the reference of the pipeline's `aec` stages that
//! name this stage, each stream with the instant its samples are played.
//!
//! The `switch` command (a device spec, or `virtual`) moves the stage to another device at the
//! next frame, at the same sample rate, without stopping the pipeline; when the new device
//! cannot be opened the old one is kept, and the reply and the `switch_error` status say why.
//!
//! The virtual player's `capture` file is checked at build and created when the pipeline
//! starts ([`OutputFile`]): a pipeline that is only validated, or refused, leaves it as it was.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::audio::device::DeviceState;
use crate::audio::jitter::{JitterConfig, JitterWriter};
use crate::audio::live::{open_playback, open_virtual, Player};
use crate::audio::reference::ReferenceTap;
use crate::audio::{Pcm, WavFormat, WavWriter};
use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::observe::names;
use crate::runtime::{
    Body, Caps, CapsError, CommandSpec, Context, Endpoint, Input, LatencyHistogram, PortSpec,
    Reply, Stage, StageError, StageResult, StatusSpec,
};

use super::params::stage_params;
use super::{caps, device_status, BuildContext, BuildError, OutputFile, StageKind};

stage_params! {
    /// `device`'s params.
    struct PlaybackParams {
        device: String = ParamSpec {
            name: "device",
            ty: T::Str,
            default: D::Str("default"),
            doc: "`default`, a device name, a regular expression, or `virtual`",
        },
        rate: i64 = ParamSpec {
            name: "rate",
            ty: T::Int {
                min: 0,
                max: 768_000,
            },
            default: D::Int(0),
            doc: "sample rate (0 = the device's; `virtual`: 24000)",
        },
        target_ms: f64 = ParamSpec {
            name: "target_ms",
            ty: T::Float {
                min: 0.0,
                max: 5000.0,
            },
            default: D::Float(120.0),
            doc: "jitter buffer target depth",
        },
        max_target_ms: f64 = ParamSpec {
            name: "max_target_ms",
            ty: T::Float {
                min: 0.0,
                max: 10000.0,
            },
            default: D::Float(480.0),
            doc: "cap of the adaptive target",
        },
        period_ms: f64 = ParamSpec {
            name: "period_ms",
            ty: T::Float {
                min: 1.0,
                max: 1000.0,
            },
            default: D::Float(10.0),
            doc: "`virtual`: the clock's period",
        },
        capture: Option<String> = ParamSpec {
            name: "capture",
            ty: T::OutPath,
            default: D::None,
            doc: "`virtual`: write what is played to this WAV file",
        },
        reconnect: bool = ParamSpec {
            name: "reconnect",
            ty: T::Bool,
            default: D::Bool(false),
            doc: "reopen the device with backoff when it is lost",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: super::kind::PLAYBACK,
    doc: "plays audio on a sound device (or `virtual`) through an adaptive jitter buffer",
    params: PlaybackParams::SPECS,
    inputs: || vec![PortSpec::new::<Pcm>("in")],
    outputs: Vec::new,
    commands: &[CommandSpec {
        name: "switch",
        arg: Some("device, or virtual"),
        doc: "move to another device at the next frame (the current one is kept if it fails)",
    }],
    status: &[
        device_status::NAME,
        device_status::STATE,
        device_status::RECONNECTS,
        StatusSpec {
            name: "underruns",
            doc: "times the jitter buffer ran dry",
        },
        StatusSpec {
            name: "depth_ms",
            doc: "audio queued in the jitter buffer",
        },
        device_status::SWITCH_ERROR,
    ],
    build,
};

fn build(cx: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = PlaybackParams::from_params(p)?;
    let mut cfg = JitterConfig::new(24_000);
    cfg.target = Duration::from_secs_f64(p.target_ms / 1000.0);
    if p.max_target_ms < p.target_ms {
        return Err(BuildError::invalid(format!(
            "{} ms is below `target_ms` ({} ms): the jitter buffer may grow from its target up \
             to this, not shrink",
            p.max_target_ms, p.target_ms
        ))
        .key("max_target_ms"));
    }
    cfg.max_target = Duration::from_secs_f64(p.max_target_ms / 1000.0);
    cfg.max_depth = cfg
        .max_depth
        .max(cfg.max_target + Duration::from_millis(120));
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
    let opener = Opener {
        jitter: cfg,
        reconnect: p.reconnect,
        period: Duration::from_secs_f64(p.period_ms / 1000.0),
        tap: cx.taps.map(|t| t.provide(cx.stage)),
    };
    let capture = match p.capture.as_deref() {
        Some(_) if p.device.as_str() != "virtual" => {
            return Err(BuildError::invalid(format!(
                "only the virtual player writes what it plays: set `device: virtual`, or remove \
                 `capture` (device is {:?})",
                p.device.as_str()
            ))
            .key("capture"))
        }
        Some(path) => Some(OutputFile::check(path, "capture")?),
        None => None,
    };
    let player = opener.open(p.device.as_str(), rate)?;
    let m = PlaybackMetrics::new(&player.name);
    let control = cx.endpoint();
    control.set("name", player.name.clone());
    Ok(Body::Stage(Box::new(Playback {
        control,
        writer: None,
        latency: LatencyHistogram::new(),
        m_latency: metrics::histogram!(names::FRAME_LATENCY, "path" => "mouth_to_ear"),
        m,
        last: Default::default(),
        lost_frames: 0,
        opener,
        player,
        capture,
    })))
}

/// How this stage opens players (at build, and again on a switch).
struct Opener {
    jitter: JitterConfig,
    reconnect: bool,
    period: Duration,
    /// What is played goes to the pipeline's `aec` stages that name this one.
    tap: Option<Arc<ReferenceTap>>,
}

impl Opener {
    fn open(&self, device: &str, rate: Option<u32>) -> Result<Player, crate::audio::AudioError> {
        let player = if device == "virtual" {
            open_virtual(
                rate.unwrap_or(24_000),
                self.period,
                self.jitter,
                self.tap.clone(),
            )
        } else {
            open_playback(device, rate, self.reconnect, self.jitter, self.tap.clone())
        }?;
        if player.device.is_some() && !player.wait_ready(Duration::from_secs(8)) {
            tracing::warn!(device = %player.name, "the device is not pulling audio at its rate yet");
        }
        tracing::info!(device = %player.name, rate = player.rate, "playback open");
        Ok(player)
    }
}

/// The per-device series.
struct PlaybackMetrics {
    depth: metrics::Gauge,
    target: metrics::Gauge,
    underruns: metrics::Counter,
    concealed: metrics::Counter,
    dropped: metrics::Counter,
}

impl PlaybackMetrics {
    fn new(device: &str) -> Self {
        let labels = [("device", device.to_string())];
        PlaybackMetrics {
            depth: metrics::gauge!(names::PLAYBACK_DEPTH, &labels),
            target: metrics::gauge!(names::PLAYBACK_TARGET, &labels),
            underruns: metrics::counter!(names::PLAYBACK_UNDERRUNS, &labels),
            concealed: metrics::counter!(names::PLAYBACK_CONCEALED, &labels),
            dropped: metrics::counter!(names::PLAYBACK_DROPPED, &labels),
        }
    }
}

struct Playback {
    player: Player,
    control: Endpoint,
    opener: Opener,
    writer: Option<JitterWriter>,
    latency: LatencyHistogram,
    m_latency: metrics::Histogram,
    m: PlaybackMetrics,
    last: crate::audio::jitter::JitterSnapshot,
    lost_frames: u64,
    /// `capture`: where the virtual player writes what it plays, from the start on.
    capture: Option<OutputFile>,
}

impl Playback {
    /// Moves to device `spec` at the current rate; keeps the current device when that fails.
    fn switch(&mut self, spec: &str) -> Reply {
        let old = self.player.name.clone();
        match self.opener.open(spec, Some(self.player.rate)) {
            Ok(player) => {
                tracing::info!(from = %old, to = %player.name, rate = player.rate, "output switched");
                self.control.set("switch_error", None::<String>);
                self.control.set("name", player.name.clone());
                let done = format!("output switched to {} ({} Hz)", player.name, player.rate);
                self.observe();
                self.m = PlaybackMetrics::new(&player.name);
                // The new player counts from zero; what the old one still held is not played.
                let mut old_player = std::mem::replace(&mut self.player, player);
                old_player.close();
                self.writer = None;
                self.last = Default::default();
                Ok(done)
            }
            Err(e) => {
                tracing::error!(device = %old, "keeping the current output: {e}");
                self.control.set("switch_error", e.to_string());
                Err(format!("keeping {old}: {e}"))
            }
        }
    }

    fn observe(&mut self) {
        if let Some(w) = self.writer.as_mut() {
            let (h, m) = (&mut self.latency, &self.m_latency);
            w.drain_latencies(|d| {
                h.record(d);
                m.record(d.as_secs_f64());
            });
        }
        let s = self.player.stats.snapshot();
        let rate = self.player.rate as f64;
        self.m.depth.set(s.depth as f64 / rate);
        self.m.target.set(s.target as f64 / rate);
        self.m
            .underruns
            .increment(s.underruns.saturating_sub(self.last.underruns));
        self.m
            .concealed
            .increment(s.concealed.saturating_sub(self.last.concealed));
        self.m
            .dropped
            .increment(s.dropped.saturating_sub(self.last.dropped));
        self.last = s;
        self.control.set("underruns", s.underruns);
        self.control
            .set("depth_ms", (s.depth as f64 / rate * 1e3).round());
    }
}

impl Stage for Playback {
    fn caps(&self, inputs: &[Caps]) -> Result<Vec<Caps>, CapsError> {
        caps::require_pcm(&inputs[0], self.player.rate, None)
            .map_err(|e| CapsError::Other(format!("device {:?}: {e}", self.player.name)))?;
        Ok(Vec::new())
    }

    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        if let Some(file) = &self.capture {
            file.create_folders()?;
            let wav = WavWriter::create(file.path(), self.player.rate, WavFormat::F32)?;
            self.player.capture_to(wav)?;
        }
        Ok(())
    }

    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Pcm>()?;
        while let Some(c) = self.control.next_command() {
            let r = self.switch(&c.arg);
            c.reply(r);
        }
        while let Ok(w) = self.player.writers.try_recv() {
            self.writer = Some(w);
        }
        if f.data.rate != self.player.rate {
            return Err(StageError::msg(format!(
                "input is {} Hz but device {:?} plays {} Hz: put a `resample` stage (to: {}) before it",
                f.data.rate, self.player.name, self.player.rate, self.player.rate
            )));
        }
        if let Some(status) = self.player.status() {
            self.control
                .set("device", format!("{:?}", status.state()).to_lowercase());
            self.control
                .set("reconnects", status.reconnects.load(Ordering::Relaxed));
            match status.state() {
                DeviceState::Failed => {
                    return Err(StageError::msg(format!(
                        "output device {:?} was lost: {} (set `reconnect: true` to reopen it)",
                        status.name,
                        status.last_error().unwrap_or_default()
                    )))
                }
                DeviceState::Reconnecting | DeviceState::Opening => {
                    // Dropped and counted, not queued without bound.
                    self.lost_frames += 1;
                    self.m.dropped.increment(f.data.valid().len() as u64);
                    return Ok(());
                }
                _ => {}
            }
        }
        if let Some(w) = self.writer.as_mut() {
            w.push(f.data.valid(), f.meta.origin);
        }
        self.observe();
        Ok(())
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        // Let the queue play out, then stop the clock.
        self.player.stats.ending.store(true, Ordering::Release);
        let rate = self.player.rate as f64;
        let left = self.player.stats.snapshot().depth as f64 / rate;
        let deadline = Instant::now() + Duration::from_secs_f64(left) + Duration::from_millis(300);
        while self.player.stats.snapshot().depth > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.observe();
        let (xruns, timing_gaps) = self
            .player
            .status()
            .map(|d| {
                (
                    d.xruns.load(Ordering::Relaxed),
                    d.timing_gaps.load(Ordering::Relaxed),
                )
            })
            .unwrap_or((0, 0));
        self.player.close();
        let s = self.player.stats.snapshot();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::info!(
            device = %self.player.name,
            played_s = format!("{:.2}", s.played as f64 / rate),
            underruns = s.underruns,
            concealed = s.concealed,
            dropped = s.dropped,
            lost_frames = self.lost_frames,
            xruns,
            timing_gaps,
            target_ms = format!("{:.0}", s.target as f64 / rate * 1e3),
            device_delay_ms = format!(
                "{:.1}",
                self.player.stats.device_delay_ns.load(Ordering::Relaxed) as f64 / 1e6
            ),
            mouth_to_ear_p50_ms = format!("{:.1}", ms(self.latency.quantile(0.5))),
            mouth_to_ear_p90_ms = format!("{:.1}", ms(self.latency.quantile(0.9))),
            "playback finished"
        );
        Ok(())
    }
}
