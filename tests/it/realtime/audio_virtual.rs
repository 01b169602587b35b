//! The virtual-clock player: headless pipelines paced like a device, with underruns when the
//! pipeline is late and a capture of what was "played".

use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use duplex::audio::WavReader;

use crate::support::pulse;

fn run(dir: &Path, yaml: &str) -> (String, Duration) {
    let p = dir.join("p.yaml");
    std::fs::write(&p, yaml).unwrap();
    let t0 = Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["run", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    (err, t0.elapsed())
}

#[test]
fn a_fed_virtual_player_plays_in_real_time_without_underruns() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let (err, took) = run(
        dir.path(),
        &format!(
            "stages:\n  tone: {{ kind: synth_source, rate: 24000, duration: 2, realtime: true }}\n  out: {{ kind: playback, device: virtual, capture: {d}/played.wav }}\nlinks: [tone -> out]\n"
        ),
    );
    assert!(took >= Duration::from_secs(2));
    let s = pulse::playback_summary(&err);
    assert_eq!(s["underruns"], 0.0, "{err}");
    assert_eq!(s["dropped"], 0.0);
    assert!((s["played_s"] - 2.0).abs() < 0.02, "{s:?}");
    // Mouth to ear is the jitter depth a frame waits behind: under the 120 ms target.
    assert!(
        s["mouth_to_ear_p50_ms"] > 60.0 && s["mouth_to_ear_p50_ms"] < 140.0,
        "{s:?}"
    );
    // The capture holds the tone, behind the start-up buffering.
    let mut r = WavReader::open(&dir.path().join("played.wav")).unwrap();
    let x = r.read_all().unwrap();
    let first = x.iter().position(|v| v.abs() > 0.01).unwrap();
    assert!(
        (2400..=4800).contains(&first),
        "starts after ~120 ms of buffering: {first}"
    );
    let loud = x.iter().filter(|v| v.abs() > 0.01).count();
    assert!(loud > 40_000, "{loud}");
}

/// Emits 20 ms chunks in real time but stalls 150 ms every 10 chunks (a late pipeline).
struct Late {
    n: u32,
    next: Instant,
}

impl duplex::runtime::Source for Late {
    fn produce(
        &mut self,
        cx: &mut duplex::runtime::Context<'_>,
    ) -> duplex::runtime::StageResult<duplex::runtime::Flow> {
        if self.n == 100 {
            return Ok(duplex::runtime::Flow::Done);
        }
        self.n += 1;
        self.next += Duration::from_millis(20);
        if self.n.is_multiple_of(10) {
            self.next += Duration::from_millis(150);
        }
        cx.sleep_until(self.next);
        cx.emit(
            0,
            Instant::now(),
            duplex::audio::Pcm::new(24_000, vec![0.25; 480]),
        )?;
        Ok(duplex::runtime::Flow::Continue)
    }
}

#[test]
fn a_late_pipeline_underruns_and_the_buffer_adapts() {
    use duplex::runtime::*;
    // The global metrics recorder and its counts must be this test's alone: it runs again in a
    // process of its own.
    if !support::in_own_process() {
        support::rerun_alone(
            "realtime::audio_virtual::a_late_pipeline_underruns_and_the_buffer_adapts",
            Vec::new(),
        );
        return;
    }
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&[0.01, 0.08, 0.2, 1.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).unwrap();
    let speaker = support::build_stage(
        "playback",
        "out",
        &[
            ("device", "virtual"),
            ("target_ms", "40"),
            ("max_target_ms", "200"),
        ],
    );
    PipelineBuilder::new()
        .source(
            "late",
            "late",
            vec![PortSpec::new::<duplex::audio::Pcm>("out")],
            Late {
                n: 0,
                next: Instant::now(),
            },
        )
        .node(speaker)
        .link(Link::new("late", "out"))
        .build()
        .unwrap()
        .run()
        .unwrap();
    let text = handle.render();
    let underruns = support::metric(&text, "duplex_playback_underruns_total{device=\"virtual\"}");
    let concealed = support::metric(
        &text,
        "duplex_playback_concealed_samples_total{device=\"virtual\"}",
    );
    let target = support::metric(&text, "duplex_playback_target_seconds{device=\"virtual\"}");
    assert!(underruns >= 3.0, "{text}");
    assert!(concealed >= underruns * 480.0, "{text}");
    // The target grew after the underruns, and stayed under its cap.
    assert!(target > 0.04 && target <= 0.2, "{text}");
    assert!(
        support::metric(
            &text,
            "duplex_frame_latency_seconds_count{path=\"mouth_to_ear\"}"
        ) > 50.0
    );
}

#[test]
fn a_pipeline_ahead_of_the_device_drops_the_oldest() {
    let dir = tempfile::tempdir().unwrap();
    // As fast as possible: 3 s arrive at once, far beyond the buffer's maximum depth.
    let (err, _) = run(
        dir.path(),
        "stages:\n  tone: { kind: synth_source, rate: 24000, duration: 3 }\n  out: { kind: playback, device: virtual }\nlinks: [tone -> out]\n",
    );
    let s = pulse::playback_summary(&err);
    assert!(s["dropped"] > 24_000.0, "{s:?}");
    assert!(s["played_s"] < 1.0, "{s:?}");
}
