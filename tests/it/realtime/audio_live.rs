//! Live audio on a real, paced device: a private PulseAudio server with a null sink, reached
//! through cpal's ALSA host. Playback is captured back from the sink's monitor.

use crate::support;
use crate::support::pulse;

use std::path::Path;
use std::time::{Duration, Instant};

use duplex::audio::WavReader;
use pulse::{playback_summary, Pulse};

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Frequency from interpolated upward zero crossings.
fn frequency(x: &[f32], rate: u32) -> f64 {
    let mut c = Vec::new();
    for i in 1..x.len() {
        if x[i - 1] < 0.0 && x[i] >= 0.0 {
            c.push((i - 1) as f64 + (-x[i - 1] / (x[i] - x[i - 1])) as f64);
        }
    }
    assert!(c.len() > 10, "no tone captured");
    // The median period: a glitch of the sound server (a few ms of the monitor missing or
    // doubled) moves one period, not the frequency; the pipeline's own gaps are the
    // underrun and drop counts, asserted separately.
    let mut periods: Vec<f64> = c.windows(2).map(|w| w[1] - w[0]).collect();
    periods.sort_by(f64::total_cmp);
    rate as f64 / periods[periods.len() / 2]
}

#[test]
fn a_sine_played_is_captured_back_at_its_frequency_in_real_time() {
    // The private PulseAudio sometimes fails a young stream with EIO on a loaded machine (seen
    // up to 1.5 s after it opened): such a run is done again on a fresh server, up to three times
    // in all; any other failure fails the test.
    if !sine_run(true) {
        let test = "realtime::audio_live::a_sine_played_is_captured_back";
        support::retried(test, "the sound server failed the stream with EIO");
        if !sine_run(true) {
            support::retried(test, "the sound server failed the stream with EIO again");
            sine_run(false);
        }
    }
}

/// One run of the sine test; false when the sound server failed the stream with EIO and
/// `may_retry`.
fn sine_run(may_retry: bool) -> bool {
    let pa = Pulse::start();
    let d = pa.dir().display();
    let p = write(
        pa.dir(),
        "p.yaml",
        &format!(
            r#"
stages:
  tone: {{ kind: synth_source, rate: 48000, freq: 440, amplitude: 0.5, duration: 4, realtime: true }}
  speaker: {{ kind: playback, device: default }}
  mic: {{ kind: mic, device: default, duration: 4.5 }}
  rec: {{ kind: wav_sink, path: {d}/captured.wav }}
links: [tone -> speaker, mic -> rec]
"#
        ),
    );
    let t0 = Instant::now();
    let o = pa
        .duplex()
        .args(["run", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if may_retry && !o.status.success() && err.contains("I/O error (5)") {
        return false;
    }
    assert!(o.status.success(), "{err}");
    assert!(
        t0.elapsed() >= Duration::from_secs(4),
        "a real device paces playback"
    );
    let s = playback_summary(&err);
    assert_eq!(s["underruns"], 0.0, "{err}");
    assert_eq!(s["dropped"], 0.0, "{err}");
    assert!((s["played_s"] - 4.0).abs() < 0.05, "{s:?}\n{err}");
    // Captured from the sink's monitor: the whole tone, at 440 Hz and its level.
    let mut r = WavReader::open(&pa.dir().join("captured.wav")).unwrap();
    let rate = r.rate();
    let x = r.read_all().unwrap();
    let loud: Vec<usize> = (0..x.len()).filter(|&i| x[i].abs() > 0.05).collect();
    let (first, last) = (loud[0], *loud.last().unwrap());
    let heard = (last - first) as f64 / rate as f64;
    assert!((heard - 4.0).abs() < 0.05, "heard {heard} s of tone");
    let mid = &x[first + 4800..last - 4800];
    let f = frequency(mid, rate);
    assert!((f / 440.0 - 1.0).abs() < 0.01, "captured {f} Hz");
    let rms = (mid.iter().map(|v| (v * v) as f64).sum::<f64>() / mid.len() as f64).sqrt();
    assert!((rms / (0.5 / 2f64.sqrt()) - 1.0).abs() < 0.02, "rms {rms}");
    true
}

#[test]
fn a_live_loopback_pipeline_runs_in_real_time() {
    let pa = Pulse::start();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let o = pa
        .duplex()
        .args([
            "run",
            root.join("pipelines/loopback.yaml").to_str().unwrap(),
        ])
        .args(["--set", "stages.mic.duration=4"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{err}");
    let s = playback_summary(&err);
    assert_eq!(s["underruns"], 0.0, "{err}");
    assert!(s["played_s"] > 3.5, "{s:?}\n{err}");
    // Mouth to ear: capture instant -> playback instant, through the resamplers and framer.
    let m2e = s["mouth_to_ear_p50_ms"];
    // A frame's first sample plays once the jitter buffer has drained to it: the depth before
    // the push (target 120 ms less one 80 ms frame, at least) plus the device's own buffering.
    assert!(m2e > 40.0 && m2e < 400.0, "mouth to ear {m2e} ms");
    eprintln!("loopback mouth to ear p50: {m2e} ms");
    eprintln!(
        "{}",
        err.lines()
            .filter(|l| l.contains("finished"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // 4 s at 24 kHz: 50 frames of 1920 reach the upsampler.
    let up = out.lines().find(|l| l.starts_with("up ")).unwrap();
    let frames: u64 = up.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!((49..=51).contains(&frames), "{out}");
}

#[test]
fn a_missing_device_is_named_with_the_devices_there_are() {
    let pa = Pulse::start();
    let p = write(
        pa.dir(),
        "p.yaml",
        "stages:\n  mic: { kind: mic, device: \"no such mic\" }\n  sink: { kind: null_sink }\nlinks: [mic -> sink]\n",
    );
    let o = pa
        .duplex()
        .args(["run", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "stage `mic`: `device`: audio input device \"no such mic\": not found (available:"
        ),
        "{err}"
    );
    assert!(err.contains("alsa:default"), "{err}");
}

fn lost_device_run(reconnect: bool) -> (std::process::Output, Pulse) {
    device_fault_run(reconnect, |pa| {
        pa.kill();
        std::thread::sleep(Duration::from_millis(1000));
        pa.spawn();
    })
}

/// Plays a 12 s tone; `fault` runs on the sound server 2 s after the pipeline starts playing.
/// The private PulseAudio sometimes fails a young stream with EIO on a loaded machine (seen up
/// to 1.5 s after it opened, see the sine test): a run that such a failure ended before the
/// fault was applied is done again on a fresh server, up to three times in all.
fn device_fault_run(reconnect: bool, fault: impl Fn(&mut Pulse)) -> (std::process::Output, Pulse) {
    for attempt in 1..=3 {
        match device_fault_try(reconnect, &fault) {
            Ok(run) => return run,
            Err(early) if attempt < 3 => support::retried(
                "realtime::audio_live::device_fault_run",
                &format!(
                    "the sound server failed the stream before the fault; once more on a \
                     fresh server: {}",
                    early
                        .lines()
                        .rev()
                        .find(|l| l.contains("I/O error"))
                        .unwrap_or("")
                ),
            ),
            Err(early) => panic!("the sound server failed the stream three times:\n{early}"),
        }
    }
    unreachable!("the last attempt returns or panics")
}

/// One run of [`device_fault_run`]; `Err(log)` when the pipeline had already failed with EIO
/// before the fault.
fn device_fault_try(
    reconnect: bool,
    fault: &impl Fn(&mut Pulse),
) -> Result<(std::process::Output, Pulse), String> {
    let mut pa = Pulse::start();
    let p = write(
        pa.dir(),
        "p.yaml",
        &format!(
            r#"
stages:
  tone: {{ kind: synth_source, rate: 48000, duration: 12, realtime: true }}
  speaker: {{ kind: playback, device: default, reconnect: {reconnect} }}
links: [tone -> speaker]
"#
        ),
    );
    let mut child = pa
        .duplex()
        .args(["run", p.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The log is read as it comes, to know when the pipeline plays.
    let (open_tx, open_rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            if line.contains("playback open") {
                let _ = open_tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    // Once the pipeline plays and the stream has settled (a loaded machine can take seconds to
    // start one), the sound server goes away and comes back.
    let _ = open_rx.recv_timeout(Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let failed_before = child.try_wait().unwrap().is_some_and(|s| !s.success());
    if !failed_before {
        fault(&mut pa);
    }
    let status = child.wait().unwrap();
    let stderr = reader.join().unwrap();
    if failed_before && stderr.contains("I/O error (5)") {
        return Err(stderr);
    }
    Ok((
        std::process::Output {
            status,
            stdout: Vec::new(),
            stderr: stderr.into_bytes(),
        },
        pa,
    ))
}

#[test]
fn a_lost_device_is_reopened_when_reconnect_is_set() {
    let (o, _pa) = lost_device_run(true);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("audio device lost; reopening"), "{err}");
    assert!(err.contains("audio device reopened"), "{err}");
    let s = playback_summary(&err);
    assert!(
        s["lost_frames"] > 0.0,
        "frames are dropped while the device is away: {s:?}"
    );
    assert!(s["dropped"] > 0.0, "{s:?}");
    assert!(s["played_s"] > 4.0, "playback resumed: {s:?}");
}

#[test]
fn a_lost_device_stops_the_pipeline_without_reconnect() {
    let (o, _pa) = lost_device_run(false);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("stage `speaker` failed"), "{err}");
    assert!(
        err.contains("was lost") && err.contains("set `reconnect: true`"),
        "{err}"
    );
}

#[test]
fn a_frozen_sound_server_is_reported_as_a_stalled_device() {
    // SIGSTOP: the stream stays open and reports nothing; its callbacks just stop.
    let (o, _pa) = device_fault_run(false, |pa| {
        pa.signal("-STOP");
        std::thread::sleep(Duration::from_secs(5));
        pa.signal("-CONT");
    });
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("output device \"alsa:default\" was lost: no audio callback for 3.")
            && err.contains("the stream stalled"),
        "{err}"
    );
}
