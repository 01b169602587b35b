//! Sound devices through cpal: listing, choosing by name or pattern, and streams that live on a
//! thread of their own, which reopens them with backoff when the device is lost.
//!
//! A stream's callback talks to the rest of the program only through lock-free rings and
//! atomics (see [`jitter`](super::jitter) for playback). The device thread owns the cpal stream:
//! it opens it, watches for errors reported by cpal's error callback, and either reports the
//! device as failed or, with `reconnect`, tries again after 100 ms, 200 ms, … up to 2 s, handing
//! the new ring endpoints to the stage through a channel. Failures before a stream has run for
//! a second, within a few seconds of opening, are the sound server settling: they are retried
//! quietly, the state saying `Opening` meanwhile, so that the stage drops frames rather than
//! queueing them into a stream that is gone. A stream whose data callbacks stop for seconds
//! without an error is treated as lost too. PulseAudio's ALSA plugin answers a delay query with
//! EIO while it has no timing information (a plugin bug, see [`is_timing_not_ready`]): that is
//! counted (`timing_gaps`), not a loss.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cpal::traits::{DeviceTrait, HostTrait, StreamTrait};

use super::AudioError;

/// Input or output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Capture.
    Input,
    /// Playback.
    Output,
}

impl Direction {
    /// `input` / `output`.
    pub fn name(&self) -> &'static str {
        match self {
            Direction::Input => "input",
            Direction::Output => "output",
        }
    }
}

/// One device as listed by `duplex devices`.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Input or output.
    pub direction: Direction,
    /// Its identifier (what `device:` matches first).
    pub id: String,
    /// Human-readable description.
    pub description: String,
    /// Whether it is the host's default for its direction.
    pub is_default: bool,
    /// The default stream configuration, if it can be queried.
    pub default_config: Option<String>,
    /// Supported configurations.
    pub configs: Vec<String>,
}

fn device_id(d: &cpal::Device) -> String {
    d.id().map(|i| i.to_string()).unwrap_or_else(|_| "?".into())
}

fn device_description(d: &cpal::Device) -> String {
    d.description().map(|x| x.to_string()).unwrap_or_default()
}

fn devices(dir: Direction) -> Vec<cpal::Device> {
    let host = cpal::default_host();
    let list = match dir {
        Direction::Input => host.input_devices().map(|d| d.collect::<Vec<_>>()),
        Direction::Output => host.output_devices().map(|d| d.collect::<Vec<_>>()),
    };
    list.unwrap_or_default()
}

/// Every input and output device of the default host with its configurations.
pub fn list() -> Vec<DeviceInfo> {
    let host = cpal::default_host();
    let mut out = Vec::new();
    for dir in [Direction::Input, Direction::Output] {
        let default = match dir {
            Direction::Input => host.default_input_device(),
            Direction::Output => host.default_output_device(),
        }
        .map(|d| device_id(&d));
        for d in devices(dir) {
            let id = device_id(&d);
            let (default_config, ranges) = match dir {
                Direction::Input => (
                    d.default_input_config().ok(),
                    d.supported_input_configs()
                        .map(|c| c.collect::<Vec<_>>())
                        .unwrap_or_default(),
                ),
                Direction::Output => (
                    d.default_output_config().ok(),
                    d.supported_output_configs()
                        .map(|c| c.collect::<Vec<_>>())
                        .unwrap_or_default(),
                ),
            };
            let default_config = default_config.map(|c| {
                format!(
                    "{} ch, {} Hz, {:?}",
                    c.channels(),
                    c.sample_rate(),
                    c.sample_format()
                )
            });
            let configs = ranges
                .iter()
                .map(|r| {
                    format!(
                        "{} ch, {}-{} Hz, {:?}",
                        r.channels(),
                        r.min_sample_rate(),
                        r.max_sample_rate(),
                        r.sample_format()
                    )
                })
                .collect();
            out.push(DeviceInfo {
                direction: dir,
                is_default: default.as_deref() == Some(id.as_str()),
                description: device_description(&d),
                id,
                default_config,
                configs,
            });
        }
    }
    out
}

/// Runs `f` with this process's stderr (fd 2) captured, and returns what was written there,
/// line by line. The sound libraries cpal loads (alsa-lib, its JACK and PulseAudio plugins)
/// print their own diagnostics straight to fd 2 while devices are enumerated: dozens of lines
/// that say nothing to the user of `duplex devices`. The caller logs them at debug level.
///
/// Only for a moment when no other thread writes to stderr (the `duplex devices` command):
/// whatever is written meanwhile is captured too.
pub fn capture_stderr<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors `pipe` writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return (f(), Vec::new());
    }
    // SAFETY: both descriptors were just created by `pipe` and are owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: duplicating fd 2, which is open for the life of the process (or -1 if closed).
    let saved = unsafe { libc::dup(2) };
    if saved < 0 {
        return (f(), Vec::new());
    }
    // SAFETY: `saved` was just returned by `dup` and is owned by nothing else.
    let saved = unsafe { OwnedFd::from_raw_fd(saved) };
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::fs::File::from(read).read_to_string(&mut text);
        text
    });
    use std::os::fd::AsRawFd;
    // SAFETY: both are open descriptors; fd 2 now points at the pipe.
    unsafe { libc::dup2(write.as_raw_fd(), 2) };
    drop(write);
    let value = f();
    // SAFETY: restores fd 2 from the saved duplicate; this also closes the pipe's last writer,
    // so the reader sees end of file.
    unsafe { libc::dup2(saved.as_raw_fd(), 2) };
    let text = reader.join().unwrap_or_default();
    (value, text.lines().map(str::to_string).collect())
}

/// Why no sound device may be usable, when the reason can be seen: no sound server socket for
/// this user (`; no sound server answers …`, to append to a message). Empty when a server
/// seems to be there.
pub fn server_hint() -> String {
    let runtime = std::env::var_os("XDG_RUNTIME_DIR").map(std::path::PathBuf::from);
    let pulse = std::env::var_os("PULSE_SERVER").is_some()
        || runtime
            .as_ref()
            .is_some_and(|r| r.join("pulse/native").exists() || r.join("pipewire-0").exists());
    if pulse {
        String::new()
    } else {
        format!(
            "; no sound server answers (no PulseAudio or PipeWire socket in {}): start one, or \
             name an ALSA hardware device (`hw:…`)",
            runtime
                .map(|r| r.display().to_string())
                .unwrap_or_else(|| "$XDG_RUNTIME_DIR, which is unset".into())
        )
    }
}

/// Names and sound-server properties that say "headset": the microphone cannot hear the
/// speaker.
const HEADSET: &str =
    r"(?i)head(set|phone)|earbud|earphone|airpods|hands-?free|\bh[sf]p\b|head[_-]unit";

/// Why the devices `input` and `output` (specs as [`find`] takes them) look like a headset, or
/// None: by their names and descriptions, and for a sound server's default route by what the
/// server says of its default sink and source (active port, form factor, Bluetooth profile).
pub fn headset(input: &str, output: &str) -> Option<String> {
    let re = regex::Regex::new(HEADSET).ok()?;
    for (dir, spec) in [(Direction::Output, output), (Direction::Input, input)] {
        if spec == "virtual" {
            continue;
        }
        let Ok((d, id)) = find(dir, spec) else {
            continue;
        };
        let desc = device_description(&d);
        if re.is_match(&id) || re.is_match(&desc) {
            return Some(format!(
                "the {} device {id:?} ({desc}) is a headset",
                dir.name()
            ));
        }
        if ["default", "pulse", "pipewire"]
            .iter()
            .any(|s| id.contains(s))
        {
            if let Some(why) = server_headset(dir, &re) {
                return Some(why);
            }
        }
    }
    None
}

/// What the sound server says of its default sink (or source), when that is a headset.
fn server_headset(dir: Direction, re: &regex::Regex) -> Option<String> {
    let (get, list) = match dir {
        Direction::Output => ("get-default-sink", "sinks"),
        Direction::Input => ("get-default-source", "sources"),
    };
    let name = pactl(&[get])?.trim().to_string();
    let why = headset_in_listing(&pactl(&["list", list])?, &name, re)?;
    Some(format!(
        "the sound server's default {} {name} has {why}",
        dir.name()
    ))
}

/// The line of `name`'s block in a `pactl list sinks|sources` listing that says "headset".
fn headset_in_listing(listing: &str, name: &str, re: &regex::Regex) -> Option<String> {
    let block = listing
        .split("\n\n")
        .find(|b| b.lines().any(|l| l.trim() == format!("Name: {name}")))?;
    block
        .lines()
        .map(str::trim)
        .filter(|l| {
            l.starts_with("Active Port:")
                || l.starts_with("device.form_factor")
                || l.starts_with("api.bluez5.profile")
                || l.starts_with("bluetooth.protocol")
        })
        .find(|l| re.is_match(l))
        .map(str::to_string)
}

/// `pactl ARGS`' output, or None when it is missing, fails or takes over a second (a stalled
/// server must not hold up start-up; the process is left to finish on its own thread).
fn pactl(args: &[&str]) -> Option<String> {
    let child = std::process::Command::new("pactl")
        .args(args)
        .env("LC_ALL", "C")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(1)) {
        Ok(Ok(o)) if o.status.success() => Some(String::from_utf8_lossy(&o.stdout).into_owned()),
        _ => None,
    }
}

/// Finds a device: `default`, an exact id or description, or else a regular expression matched
/// against both.
///
/// # Errors
///
/// [`AudioError::NoDevice`] naming what was asked for and listing the devices there are.
pub fn find(dir: Direction, spec: &str) -> Result<(cpal::Device, String), AudioError> {
    let host = cpal::default_host();
    let err = |detail: String| AudioError::NoDevice {
        direction: dir.name(),
        name: spec.to_string(),
        detail,
    };
    let all = devices(dir);
    let names = || {
        let v: Vec<String> = all.iter().map(device_id).collect();
        if v.is_empty() {
            "there are none".to_string()
        } else {
            format!("available: {}", v.join(", "))
        }
    };
    if spec == "default" {
        let d = match dir {
            Direction::Input => host.default_input_device(),
            Direction::Output => host.default_output_device(),
        };
        return match d {
            Some(d) => {
                let id = device_id(&d);
                Ok((d, id))
            }
            None => Err(err(format!("no default device ({})", names()))),
        };
    }
    if let Some(d) = all
        .iter()
        .find(|d| device_id(d) == spec || device_description(d) == spec)
    {
        return Ok((d.clone(), device_id(d)));
    }
    let re = regex::Regex::new(spec).map_err(|e| {
        err(format!(
            "not found, and not a valid pattern: {e} ({})",
            names()
        ))
    })?;
    match all
        .iter()
        .find(|d| re.is_match(&device_id(d)) || re.is_match(&device_description(d)))
    {
        Some(d) => Ok((d.clone(), device_id(d))),
        None => Err(err(format!("not found ({})", names()))),
    }
}

/// State of a device thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DeviceState {
    /// Opening.
    Opening = 0,
    /// Streaming.
    Running = 1,
    /// Lost; reopening with backoff.
    Reconnecting = 2,
    /// Lost for good (no `reconnect`), or could not be opened.
    Failed = 3,
    /// Closed on request.
    Closed = 4,
}

/// What a device thread reports.
#[derive(Debug)]
pub struct DeviceStatus {
    state: AtomicU8,
    /// Times the stream reported an error.
    pub errors: AtomicU64,
    /// Buffer under- or overruns the host reported and recovered from itself (a glitch, not a
    /// lost device).
    pub xruns: AtomicU64,
    /// Times PulseAudio's ALSA plugin had no timing information for a delay query yet and
    /// said EIO ([`is_timing_not_ready`]): the stream went on.
    pub timing_gaps: AtomicU64,
    /// Times the stream was reopened after a loss.
    pub reconnects: AtomicU64,
    /// Data callbacks so far (the device thread's sign that a stream is alive).
    pub callbacks: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// The device's id.
    pub name: String,
}

impl DeviceStatus {
    /// The status of device `name`, in `state`, nothing counted yet.
    fn new(name: String, state: DeviceState) -> Self {
        DeviceStatus {
            state: AtomicU8::new(state as u8),
            errors: AtomicU64::new(0),
            xruns: AtomicU64::new(0),
            timing_gaps: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            callbacks: AtomicU64::new(0),
            last_error: Mutex::new(None),
            name,
        }
    }

    /// The current state.
    pub fn state(&self) -> DeviceState {
        match self.state.load(Ordering::Acquire) {
            0 => DeviceState::Opening,
            1 => DeviceState::Running,
            2 => DeviceState::Reconnecting,
            3 => DeviceState::Failed,
            _ => DeviceState::Closed,
        }
    }

    fn set(&self, s: DeviceState) {
        self.state.store(s as u8, Ordering::Release);
    }

    /// The last error reported, if any.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().ok().and_then(|g| g.clone())
    }

    /// Called by a stream's data callback, every time (one atomic increment).
    pub fn beat(&self) {
        self.callbacks.fetch_add(1, Ordering::Relaxed);
    }

    fn error(&self, e: String) {
        if let Ok(mut g) = self.last_error.lock() {
            *g = Some(e);
        }
    }
}

/// A running device thread; dropping it closes the stream and joins the thread.
pub struct DeviceHandle {
    status: Arc<DeviceStatus>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DeviceHandle {
    /// The device's status.
    pub fn status(&self) -> &Arc<DeviceStatus> {
        &self.status
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Builds one stream; called again after a loss. Its error callback must be
/// [`error_callback`] with the `lost` flag and status given.
pub type Opener =
    Box<dyn FnMut(Arc<AtomicBool>, Arc<DeviceStatus>) -> Result<cpal::Stream, AudioError> + Send>;

/// How long after opening a device its stream's failures are retried as start-up trouble.
const STARTUP: Duration = Duration::from_secs(6);
/// A stream without a data callback for this long is treated as lost.
const STALL: Duration = Duration::from_secs(3);
/// The same while starting (a stream that never calls back is restarted sooner).
const STALL_STARTING: Duration = Duration::from_millis(2500);

/// Starts a device thread running streams made by `open`. Waits for the first open: its error
/// is returned as is (a device missing at start is a configuration error, not a loss).
///
/// # Errors
///
/// The first [`Opener`] call's error.
pub fn spawn(name: String, mut open: Opener, reconnect: bool) -> Result<DeviceHandle, AudioError> {
    let status = Arc::new(DeviceStatus::new(name.clone(), DeviceState::Opening));
    let stop = Arc::new(AtomicBool::new(false));
    let (first_tx, first_rx) = crossbeam_channel::bounded::<Result<(), AudioError>>(1);
    let st = status.clone();
    let sp = stop.clone();
    let thread = std::thread::Builder::new()
        .name(format!("duplex:device:{name}"))
        .spawn(move || {
            let mut first = Some(first_tx);
            let spawned = Instant::now();
            // Until a stream has run for a second, failures are the sound server still settling
            // (PulseAudio's ALSA plugin fails new streams with EIO for a while under load):
            // retried quietly with a short backoff for up to `STARTUP`, not reported as losses.
            let mut settled = false;
            let mut startup_backoff = Duration::from_millis(50);
            let mut backoff = Duration::from_millis(100);
            let sleep = |d: Duration| {
                let end = Instant::now() + d;
                while Instant::now() < end && !sp.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            };
            while !sp.load(Ordering::Acquire) {
                let lost = Arc::new(AtomicBool::new(false));
                let result = open(lost.clone(), st.clone()).and_then(|s| {
                    s.play().map_err(|e| AudioError::Device {
                        direction: "",
                        name: st.name.clone(),
                        detail: format!("starting the stream: {e}"),
                    })?;
                    Ok(s)
                });
                match result {
                    Ok(stream) => {
                        if let Some(tx) = first.take() {
                            let _ = tx.send(Ok(()));
                        } else if settled {
                            st.reconnects.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(device = %st.name, "audio device reopened");
                        } else {
                            tracing::debug!(device = %st.name, "stream restarted while starting");
                        }
                        st.set(DeviceState::Running);
                        backoff = Duration::from_millis(100);
                        let ran = watch(&st, &sp, &lost, settled);
                        drop(stream);
                        if sp.load(Ordering::Acquire) {
                            break;
                        }
                        st.errors.fetch_add(1, Ordering::Relaxed);
                        // Settled: its callbacks ran for a second.
                        settled |= ran;
                    }
                    Err(e) => {
                        if let Some(tx) = first.take() {
                            // A device that cannot be opened at all is a configuration error.
                            st.set(DeviceState::Failed);
                            let _ = tx.send(Err(e));
                            return;
                        }
                        st.errors.fetch_add(1, Ordering::Relaxed);
                        st.error(e.to_string());
                    }
                }
                if !settled && spawned.elapsed() < STARTUP {
                    // Frames meanwhile are dropped and counted by the stage (not queued into a
                    // stream that is gone).
                    st.set(DeviceState::Opening);
                    tracing::debug!(device = %st.name, error = ?st.last_error(), "stream failed while starting; retrying");
                    sleep(startup_backoff);
                    startup_backoff = (startup_backoff * 2).min(Duration::from_millis(800));
                    continue;
                }
                settled = true;
                if !reconnect {
                    tracing::error!(device = %st.name, error = ?st.last_error(), "audio device lost");
                    st.set(DeviceState::Failed);
                    return;
                }
                if st.state() != DeviceState::Reconnecting {
                    tracing::warn!(device = %st.name, error = ?st.last_error(), "audio device lost; reopening");
                    st.set(DeviceState::Reconnecting);
                }
                sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            st.set(DeviceState::Closed);
        })
        .map_err(|e| AudioError::Device {
            direction: "",
            name: name.clone(),
            detail: format!("starting its thread: {e}"),
        })?;
    let handle = DeviceHandle {
        status,
        stop,
        thread: Some(thread),
    };
    match first_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(AudioError::Device {
            direction: "",
            name,
            detail: "its thread ended before opening the stream".into(),
        }),
    }
}

/// Watches a running stream until it is stopped, lost, or stalls (no callback for [`STALL`],
/// or [`STALL_STARTING`] before it has run and the device has settled): a stream whose
/// callbacks stop without an error (a sound server that stalls it) is as lost as one that
/// reports one. Returns whether its callbacks ran for a second.
fn watch(st: &DeviceStatus, stop: &AtomicBool, lost: &AtomicBool, settled: bool) -> bool {
    let opened = Instant::now();
    let (mut beats, mut beat_at) = (st.callbacks.load(Ordering::Relaxed), opened);
    let mut first_beat = None;
    while !stop.load(Ordering::Acquire) && !lost.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(20));
        let now = st.callbacks.load(Ordering::Relaxed);
        if now != beats {
            (beats, beat_at) = (now, Instant::now());
            first_beat.get_or_insert(beat_at);
        } else {
            let ran =
                first_beat.is_some_and(|t| beat_at.duration_since(t) >= Duration::from_secs(1));
            let limit = if settled || ran {
                STALL
            } else {
                STALL_STARTING
            };
            if beat_at.elapsed() >= limit {
                st.error(format!(
                    "no audio callback for {:.1} s: the stream stalled",
                    beat_at.elapsed().as_secs_f64()
                ));
                break;
            }
        }
    }
    first_beat.is_some_and(|t| beat_at.duration_since(t) >= Duration::from_secs(1))
}

/// Whether `e` is PulseAudio's ALSA plugin answering a delay query (`snd_pcm_avail_delay`, which
/// cpal makes every period) with EIO because libpulse has no timing information for the stream
/// yet. The plugin means to wait for it: it compares `pa_stream_get_latency`'s result with
/// `PA_ERR_NODATA`, but libpulse returns the error negated (`-PA_ERR_NODATA`), so "not yet" reads
/// as a failure. Timing information is missing until the server's first timing reply, late on a
/// loaded machine (a new stream's EIO in its first seconds), and for a moment after the stream
/// underruns or its buffer is reset (the EIO at a run's last frame). Nothing is wrong with the
/// stream; the next query has the timing.
fn is_timing_not_ready(e: &cpal::Error) -> bool {
    e.kind() == cpal::ErrorKind::BackendError && {
        let msg = e.to_string();
        msg.contains("'snd_pcm_avail_delay'") && msg.contains("(5)'")
    }
}

/// Records the error of a stream's error callback and flags the stream as lost; counts an xrun
/// (which the host recovers from) instead.
pub fn error_callback(
    status: Arc<DeviceStatus>,
    lost: Arc<AtomicBool>,
) -> impl FnMut(cpal::Error) + Send + 'static {
    move |e: cpal::Error| {
        // cpal calls this from its stream thread (outside the data callback): no logging here.
        match e.kind() {
            // The host prepares the stream again by itself: a glitch, counted, not a loss.
            cpal::ErrorKind::Xrun => {
                status.xruns.fetch_add(1, Ordering::Relaxed);
            }
            // Audio still plays, without real-time priority.
            cpal::ErrorKind::RealtimeDenied => {}
            // The stream is fine and cpal polls it again; one that is really gone stops calling
            // back and the device thread's stall check finds it.
            _ if is_timing_not_ready(&e) => {
                status.timing_gaps.fetch_add(1, Ordering::Relaxed);
                // cpal polls again at once, and the plugin answers the same until the timing
                // reply is in (hundreds of times in a second on a loaded machine, each taking
                // the plugin's lock the reply needs): a millisecond's pause lets it in.
                std::thread::sleep(Duration::from_millis(1));
            }
            _ => {
                status.error(e.to_string());
                lost.store(true, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pulse_plugins_missing_timing_is_told_from_a_failed_stream() {
        let alsa = |func: &str, errno: &str| {
            cpal::Error::with_message(
                cpal::ErrorKind::BackendError,
                format!("ALSA function '{func}' failed with error '{errno}'"),
            )
        };
        assert!(is_timing_not_ready(&alsa(
            "snd_pcm_avail_delay",
            "I/O error (5)"
        )));
        // Any other function's EIO, another errno, another kind: a failure.
        assert!(!is_timing_not_ready(&alsa(
            "snd_pcm_writei",
            "I/O error (5)"
        )));
        assert!(!is_timing_not_ready(&alsa(
            "snd_pcm_avail_delay",
            "Bad file descriptor (77)"
        )));
        assert!(!is_timing_not_ready(&cpal::Error::from(
            cpal::ErrorKind::DeviceNotAvailable
        )));
        // The callback counts it and leaves the stream running.
        let status = Arc::new(DeviceStatus::new("test".into(), DeviceState::Running));
        let lost = Arc::new(AtomicBool::new(false));
        let mut cb = error_callback(status.clone(), lost.clone());
        cb(alsa("snd_pcm_avail_delay", "I/O error (5)"));
        assert_eq!(status.timing_gaps.load(Ordering::Relaxed), 1);
        assert!(!lost.load(Ordering::Acquire));
        cb(alsa("snd_pcm_writei", "I/O error (5)"));
        assert!(lost.load(Ordering::Acquire));
    }

    #[test]
    fn headsets_are_told_by_name_and_by_what_the_sound_server_lists() {
        let re = regex::Regex::new(HEADSET).unwrap();
        for name in [
            "bluez_output.00_1B_66_AA_BB_CC.headset-head-unit",
            "Jabra Evolve 40 Headset Mono",
            "USB Headphones",
            "AirPods Pro",
            "bluez_source.00_1B.handsfree_head_unit",
        ] {
            assert!(re.is_match(name), "{name}");
        }
        for name in [
            "alsa:default",
            "alsa_output.pci-0000_00_1f.3.analog-stereo",
            "Built-in Audio Analog Stereo",
            "HDA Intel PCH, HDMI 0",
            "nullsink",
        ] {
            assert!(!re.is_match(name), "{name}");
        }
        let listing =
            "Sink #0\n\tState: RUNNING\n\tName: speakers\n\tActive Port: analog-output-speaker\n\
                       \n\tProperties:\n\t\tdevice.form_factor = \"internal\"\n\n\
                       Sink #1\n\tName: jack\n\tActive Port: analog-output-headphones\n";
        assert_eq!(headset_in_listing(listing, "speakers", &re), None);
        assert_eq!(
            headset_in_listing(listing, "jack", &re).as_deref(),
            Some("Active Port: analog-output-headphones")
        );
        assert_eq!(headset_in_listing(listing, "missing", &re), None);
    }
}
