//! Live capture and playback streams on top of [`device`]: the microphone's
//! ring and the speaker's jitter buffer, plus a virtual-clock player for headless pipelines.
//!
//! # Real-time safety
//!
//! The data callbacks built here allocate nothing, take no lock and make no syscall: capture
//! down-mixes into a lock-free ring sample by sample; playback renders the jitter buffer into a
//! scratch buffer allocated when the stream is built and copies it to every channel.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cpal::traits::DeviceTrait;
use crossbeam_channel::{Receiver, Sender};
use ringbuf::traits::{Producer, Split};
use ringbuf::{HeapCons, HeapRb};

use super::device::{self, DeviceHandle, DeviceStatus, Direction};
use super::jitter::{jitter_with_stats, JitterBuffer, JitterConfig, JitterStats, JitterWriter};
use super::reference::ReferenceTap;
use super::{AudioError, WavWriter};

/// What a capture stream hands to the pipeline: mono samples and, per callback, the position
/// after its last sample with the instant that sample was captured.
pub struct CaptureRing {
    /// Mono samples.
    pub samples: HeapCons<f32>,
    /// `(samples captured so far, capture instant of the last one)`.
    pub marks: HeapCons<(u64, Instant)>,
}

/// An open microphone.
pub struct Capture {
    /// The device thread.
    pub handle: DeviceHandle,
    /// New rings after a reconnect.
    pub rings: Receiver<CaptureRing>,
    /// Sample rate.
    pub rate: u32,
    /// Channels of the device (down-mixed to mono).
    pub channels: u16,
    /// Samples lost because the ring was full.
    pub overflow: Arc<AtomicU64>,
    /// Samples captured so far (all streams of this device).
    pub captured: Arc<AtomicU64>,
    /// Latest delay between a buffer's capture and its callback, in ns (what the host reports).
    pub capture_delay_ns: Arc<AtomicU64>,
}

fn dev_err(dir: Direction, name: &str, detail: String) -> AudioError {
    AudioError::Device {
        direction: dir.name(),
        name: name.to_string(),
        detail,
    }
}

fn unsupported_format(dir: Direction, name: &str, format: cpal::SampleFormat) -> AudioError {
    dev_err(
        dir,
        name,
        format!("sample format {format:?} is not supported (f32 or i16)"),
    )
}

fn pick_config(
    dir: Direction,
    d: &cpal::Device,
    name: &str,
    rate: Option<u32>,
) -> Result<cpal::SupportedStreamConfig, AudioError> {
    let default = match dir {
        Direction::Input => d.default_input_config(),
        Direction::Output => d.default_output_config(),
    }
    .map_err(|e| {
        dev_err(
            dir,
            name,
            format!(
                "no usable configuration: {}{}",
                e.to_string().trim_end_matches('.'),
                super::device::server_hint()
            ),
        )
    })?;
    let Some(rate) = rate else { return Ok(default) };
    let ranges: Vec<cpal::SupportedStreamConfigRange> = match dir {
        Direction::Input => d.supported_input_configs().map(|c| c.collect()),
        Direction::Output => d.supported_output_configs().map(|c| c.collect()),
    }
    .map_err(|e| dev_err(dir, name, e.to_string()))?;
    ranges
        .into_iter()
        .filter(|r| r.min_sample_rate() <= rate && rate <= r.max_sample_rate())
        .find(|r| r.sample_format() == default.sample_format())
        .map(|r| r.with_sample_rate(rate))
        .ok_or_else(|| dev_err(dir, name, format!("does not support {rate} Hz")))
}

/// Opens an input device (`default`, an exact name or a pattern) at its native configuration
/// (or `rate`), down-mixed to mono.
///
/// # Errors
///
/// [`AudioError::Device`] naming the device, and listing those available when it is missing.
pub fn open_capture(
    spec: &str,
    rate: Option<u32>,
    reconnect: bool,
    ring: Duration,
) -> Result<Capture, AudioError> {
    let (dev, name) = device::find(Direction::Input, spec)?;
    let cfg = pick_config(Direction::Input, &dev, &name, rate)?;
    let (rate, channels, format) = (cfg.sample_rate(), cfg.channels(), cfg.sample_format());
    // One slot, newest wins: after several restarts only the live stream's ring is handed over.
    let (tx, rx) = crossbeam_channel::bounded::<CaptureRing>(1);
    let stale = rx.clone();
    let overflow = Arc::new(AtomicU64::new(0));
    let ov = overflow.clone();
    let captured = Arc::new(AtomicU64::new(0));
    let cap_count = captured.clone();
    let capture_delay_ns = Arc::new(AtomicU64::new(0));
    let delay_ns = capture_delay_ns.clone();
    let spec = spec.to_string();
    let mut first = Some(dev);
    let opener: device::Opener =
        Box::new(move |lost: Arc<AtomicBool>, status: Arc<DeviceStatus>| {
            let dev = match first.take() {
                Some(d) => d,
                None => device::find(Direction::Input, &spec)?.0,
            };
            let cap = (rate as f64 * ring.as_secs_f64()) as usize;
            let (mut prod, cons) = HeapRb::<f32>::new(cap.max(1024)).split();
            let (mut mprod, mcons) = HeapRb::<(u64, Instant)>::new(4096).split();
            let mut pos = 0u64;
            let ch = channels as usize;
            let ov = ov.clone();
            let cap_count = cap_count.clone();
            let delay_ns = delay_ns.clone();
            let config = cpal::StreamConfig {
                channels,
                sample_rate: rate,
                buffer_size: buffer_size(rate),
            };
            let mut push = move |frames: &mut dyn Iterator<Item = f32>,
                                 n: usize,
                                 info: &cpal::InputCallbackInfo| {
                let now = Instant::now();
                for v in frames {
                    if prod.try_push(v).is_err() {
                        ov.fetch_add(1, Ordering::Relaxed);
                    }
                }
                pos += n as u64;
                cap_count.fetch_add(n as u64, Ordering::Relaxed);
                // The newest sample was captured at capture + n / rate, on the stream's clock; map it
                // onto ours through the callback instant.
                let ts = info.timestamp();
                let behind = ts.callback.duration_since(ts.capture);
                delay_ns.store(behind.as_nanos() as u64, Ordering::Relaxed);
                let newest = Duration::from_secs_f64(n.saturating_sub(1) as f64 / rate as f64);
                let origin = (now + newest).checked_sub(behind).unwrap_or(now);
                let _ = mprod.try_push((pos, origin));
            };
            let beat = status.clone();
            let beat16 = status.clone();
            let err = device::error_callback(status, lost);
            let stream = match format {
                cpal::SampleFormat::F32 => dev.build_input_stream::<f32, _, _>(
                    config,
                    move |data: &[f32], info: &cpal::InputCallbackInfo| {
                        beat.beat();
                        let n = data.len() / ch;
                        let mut it = data
                            .chunks_exact(ch)
                            .map(|f| f.iter().sum::<f32>() / ch as f32);
                        push(&mut it, n, info);
                    },
                    err,
                    None,
                ),
                cpal::SampleFormat::I16 => dev.build_input_stream::<i16, _, _>(
                    config,
                    move |data: &[i16], info: &cpal::InputCallbackInfo| {
                        beat16.beat();
                        let n = data.len() / ch;
                        let mut it = data.chunks_exact(ch).map(|f| {
                            f.iter().map(|&v| v as f32).sum::<f32>() / (32768.0 * ch as f32)
                        });
                        push(&mut it, n, info);
                    },
                    err,
                    None,
                ),
                other => return Err(unsupported_format(Direction::Input, &spec, other)),
            }
            .map_err(|e| dev_err(Direction::Input, &spec, format!("opening the stream: {e}")))?;
            while stale.try_recv().is_ok() {}
            let _ = tx.try_send(CaptureRing {
                samples: cons,
                marks: mcons,
            });
            Ok(stream)
        });
    let handle = device::spawn(name, opener, reconnect)?;
    Ok(Capture {
        handle,
        rings: rx,
        rate,
        channels,
        overflow,
        captured,
        capture_delay_ns,
    })
}

/// Waits until `count` advances at close to `per_sec` events per second over 200 ms.
fn wait_steady(timeout: Duration, count: impl Fn() -> u64, per_sec: u64) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        let c0 = count();
        std::thread::sleep(Duration::from_millis(200));
        if count() - c0 >= per_sec / 5 * 7 / 10 {
            return true;
        }
    }
    false
}

impl Capture {
    /// Waits until samples arrive at the device's real rate (see [`Player::wait_ready`]), then
    /// discards what was captured while starting. Returns false on timeout.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        wait_steady(
            timeout,
            || self.captured.load(Ordering::Relaxed),
            self.rate as u64,
        )
    }
}

/// Where played audio goes: a real device, or a virtual clock.
pub struct Player {
    /// New writers after a reconnect (the first one is there after opening).
    pub writers: Receiver<JitterWriter>,
    /// Jitter statistics (kept across reconnects).
    pub stats: Arc<JitterStats>,
    /// Sample rate the player takes.
    pub rate: u32,
    /// Device name (`virtual` for the virtual clock).
    pub name: String,
    /// The device thread (None for the virtual clock).
    pub device: Option<DeviceHandle>,
    virtual_clock: Option<VirtualClock>,
    /// Hands the virtual clock the file to write what it plays to (None for a device).
    capture: Option<Sender<WavWriter>>,
}

impl Player {
    /// Waits until the device pulls audio at its real rate (sound servers can stall a new
    /// stream for a second or more), so that the pipeline's first frames are not queued behind
    /// a stalled device. Returns false on timeout.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        wait_steady(timeout, || self.stats.renders.load(Ordering::Relaxed), 100)
    }

    /// The device status, for real devices.
    pub fn status(&self) -> Option<&Arc<DeviceStatus>> {
        self.device.as_ref().map(|d| d.status())
    }

    /// Makes the virtual clock write what it plays to `wav`, from its next period on, until it
    /// stops (then the file is finalized). Given once; the file is the caller's to create, so
    /// that it is created when the pipeline starts, not when the player is opened.
    ///
    /// # Errors
    ///
    /// [`AudioError::Device`] when this player is a sound device, or already has a file.
    pub fn capture_to(&self, wav: WavWriter) -> Result<(), AudioError> {
        let refused = |detail: &str| AudioError::Device {
            direction: "output",
            name: self.name.clone(),
            detail: detail.into(),
        };
        match &self.capture {
            Some(tx) => tx
                .try_send(wav)
                .map_err(|_| refused("already writes a capture file, or has stopped")),
            None => Err(refused(
                "only the virtual player writes a capture of what it plays",
            )),
        }
    }
}

/// Opens an output device with a jitter buffer (mono, copied to every channel). When `tap` has
/// a reader, every stream hands it what it plays, with the instant it is played.
///
/// # Errors
///
/// [`AudioError::Device`] naming the device.
pub fn open_playback(
    spec: &str,
    rate: Option<u32>,
    reconnect: bool,
    jitter_cfg: JitterConfig,
    tap: Option<Arc<ReferenceTap>>,
) -> Result<Player, AudioError> {
    let (dev, name) = device::find(Direction::Output, spec)?;
    let cfg = pick_config(Direction::Output, &dev, &name, rate)?;
    let (rate, channels, format) = (cfg.sample_rate(), cfg.channels(), cfg.sample_format());
    let jcfg = JitterConfig { rate, ..jitter_cfg };
    let stats = Arc::new(JitterStats::default());
    // One slot, newest wins: after several restarts only the live stream's writer is handed over.
    let (tx, rx) = crossbeam_channel::bounded::<JitterWriter>(1);
    let stale = rx.clone();
    let st = stats.clone();
    let spec = spec.to_string();
    let mut first = Some(dev);
    let opener: device::Opener =
        Box::new(move |lost: Arc<AtomicBool>, status: Arc<DeviceStatus>| {
            let dev = match first.take() {
                Some(d) => d,
                None => device::find(Direction::Output, &spec)?.0,
            };
            let (writer, mut buf) = jitter_with_stats(&jcfg, st.clone());
            let mut reference = tap.as_ref().map(|t| t.writer(rate));
            let stats_cb = st.clone();
            let ch = channels as usize;
            let mut scratch = vec![0.0f32; 16_384];
            let config = cpal::StreamConfig {
                channels,
                sample_rate: rate,
                buffer_size: buffer_size(rate),
            };
            let mut render = move |frames: usize,
                                   info: &cpal::OutputCallbackInfo,
                                   put: &mut dyn FnMut(usize, f32)| {
                let ts = info.timestamp();
                let ahead = ts.playback.duration_since(ts.callback);
                stats_cb
                    .device_delay_ns
                    .store(ahead.as_nanos() as u64, Ordering::Relaxed);
                let now = Instant::now() + ahead;
                let mut done = 0;
                while done < frames {
                    let n = (frames - done).min(scratch.len());
                    buf.render(&mut scratch[..n], now);
                    if let Some(r) = reference.as_mut() {
                        let offset = Duration::from_secs_f64(done as f64 / rate as f64);
                        r.push(&scratch[..n], now + offset);
                    }
                    for (i, &v) in scratch[..n].iter().enumerate() {
                        put(done + i, v);
                    }
                    done += n;
                }
            };
            let beat = status.clone();
            let beat16 = status.clone();
            let err = device::error_callback(status, lost);
            let stream = match format {
                cpal::SampleFormat::F32 => dev.build_output_stream::<f32, _, _>(
                    config,
                    move |data: &mut [f32], info: &cpal::OutputCallbackInfo| {
                        beat.beat();
                        let frames = data.len() / ch;
                        render(frames, info, &mut |i, v| {
                            for c in &mut data[i * ch..(i + 1) * ch] {
                                *c = v;
                            }
                        });
                    },
                    err,
                    None,
                ),
                cpal::SampleFormat::I16 => dev.build_output_stream::<i16, _, _>(
                    config,
                    move |data: &mut [i16], info: &cpal::OutputCallbackInfo| {
                        beat16.beat();
                        let frames = data.len() / ch;
                        render(frames, info, &mut |i, v| {
                            let s = (v * 32768.0).round().clamp(-32768.0, 32767.0) as i16;
                            for c in &mut data[i * ch..(i + 1) * ch] {
                                *c = s;
                            }
                        });
                    },
                    err,
                    None,
                ),
                other => return Err(unsupported_format(Direction::Output, &spec, other)),
            }
            .map_err(|e| dev_err(Direction::Output, &spec, format!("opening the stream: {e}")))?;
            while stale.try_recv().is_ok() {}
            let _ = tx.try_send(writer);
            Ok(stream)
        });
    let handle = device::spawn(name.clone(), opener, reconnect)?;
    Ok(Player {
        writers: rx,
        stats,
        rate,
        name,
        device: Some(handle),
        virtual_clock: None,
        capture: None,
    })
}

struct VirtualClock {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), AudioError>>>,
}

impl Drop for VirtualClock {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Err(e)) => tracing::error!("virtual player: {e}"),
                Err(_) => tracing::error!("virtual player thread panicked"),
                Ok(Ok(())) => {}
            }
        }
    }
}

/// A player without a sound card: a real-time timer thread pulls the jitter buffer every
/// `period`, like a device would, handing what it "plays" to `tap` and, once it is given one
/// ([`Player::capture_to`]), writing it to a WAV file.
///
/// # Errors
///
/// [`AudioError::Device`] when the clock's thread cannot be started.
pub fn open_virtual(
    rate: u32,
    period: Duration,
    jitter_cfg: JitterConfig,
    tap: Option<Arc<ReferenceTap>>,
) -> Result<Player, AudioError> {
    let jcfg = JitterConfig { rate, ..jitter_cfg };
    let stats = Arc::new(JitterStats::default());
    let (writer, buf) = jitter_with_stats(&jcfg, stats.clone());
    let mut reference = tap.as_ref().map(|t| t.writer(rate));
    let (tx, rx): (Sender<JitterWriter>, Receiver<JitterWriter>) = crossbeam_channel::bounded(1);
    let _ = tx.send(writer);
    let (capture, captures) = crossbeam_channel::bounded::<WavWriter>(1);
    let mut wav: Option<WavWriter> = None;
    let stop = Arc::new(AtomicBool::new(false));
    let sp = stop.clone();
    let n = ((rate as f64 * period.as_secs_f64()).round() as usize).max(1);
    let thread = std::thread::Builder::new()
        .name("duplex:virtual-player".into())
        .spawn(move || {
            let mut buf: JitterBuffer = buf;
            let mut scratch = vec![0.0f32; n];
            let start = Instant::now();
            let mut tick = 0u64;
            while !sp.load(Ordering::Acquire) {
                tick += 1;
                let due = start + period.mul_f64(tick as f64);
                if let Some(d) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
                let now = Instant::now();
                buf.render(&mut scratch, now);
                if let Some(r) = reference.as_mut() {
                    r.push(&scratch, now);
                }
                if wav.is_none() {
                    wav = captures.try_recv().ok();
                }
                if let Some(w) = wav.as_mut() {
                    w.write(&scratch)?;
                }
            }
            if let Some(w) = wav.take() {
                w.finalize()?;
            }
            Ok(())
        })
        .map_err(|e| AudioError::Device {
            direction: "output",
            name: "virtual".into(),
            detail: e.to_string(),
        })?;
    Ok(Player {
        writers: rx,
        stats,
        rate,
        name: "virtual".into(),
        device: None,
        virtual_clock: Some(VirtualClock {
            stop,
            thread: Some(thread),
        }),
        capture: Some(capture),
    })
}

impl Player {
    /// Stops the virtual clock (and finishes its capture file). Real devices stop on drop.
    pub fn close(&mut self) {
        self.virtual_clock.take();
        self.device.take();
    }
}

/// 10 ms device buffers: regular callbacks from the first second on (the default lets some
/// hosts start with one very large buffer).
fn buffer_size(rate: u32) -> cpal::BufferSize {
    cpal::BufferSize::Fixed(rate / 100)
}
