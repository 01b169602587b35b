//! Runtime overhead, measured side by side in one run.
//!
//! 1. A chain of 7 pass-through stages moving 1920-sample frames: per-frame overhead per hop,
//!    against a plain function-call loop over the same 7 pass-through functions. Reported twice:
//!    streaming (frames back to back: the throughput cost) and one frame at a time (the latency
//!    cost, including waking each stage's thread).
//! 2. A chain of 3 stages that each take 20 ms: the completion interval at the sink against the
//!    sum of the stage times (ideal 1/3: stages overlap on different frames).
//!
//! Run with `cargo bench --bench runtime`.

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duplex::runtime::*;

#[derive(Clone)]
struct Block(Vec<f32>);
impl FrameData for Block {
    const NAME: &'static str = "Block";
}

const SAMPLES: usize = 1920;
const STAGES: usize = 7;

struct Src {
    n: u64,
    sent: u64,
    every: Option<Duration>,
}
impl Source for Src {
    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        if self.sent == self.n {
            return Ok(Flow::Done);
        }
        if let Some(d) = self.every {
            cx.sleep_until(Instant::now() + d);
        }
        let mut v = vec![0.0f32; SAMPLES];
        v[0] = self.sent as f32;
        cx.emit(0, Instant::now(), Block(v))?;
        self.sent += 1;
        Ok(Flow::Continue)
    }
}

/// The work of one pass-through stage, shared by the pipeline and the plain loop.
#[inline(never)]
fn pass(mut b: Vec<f32>) -> Vec<f32> {
    b[1] += 1.0;
    black_box(b)
}

struct Pass;
impl Stage for Pass {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Block>()?;
        cx.emit(0, f.meta.origin, Block(pass(f.data.0)))
    }
}

struct Sleep(Duration);
impl Stage for Sleep {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Block>()?;
        std::thread::sleep(self.0);
        cx.emit(0, f.meta.origin, f.data)
    }
}

#[derive(Default)]
struct SinkState {
    count: u64,
    ok: bool,
    latency: Duration,
}
struct Sink(Arc<Mutex<SinkState>>, usize);
impl Stage for Sink {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Block>()?;
        let mut s = self.0.lock().unwrap();
        s.ok &= f.data.0[0] == s.count as f32 && f.data.0[1] == self.1 as f32;
        s.count += 1;
        s.latency += f.meta.origin.elapsed();
        Ok(())
    }
}

fn chain(n: u64, every: Option<Duration>) -> (Duration, SinkState) {
    chain_observed(n, every, None)
}

fn chain_observed(
    n: u64,
    every: Option<Duration>,
    observer: Option<Arc<dyn Observer>>,
) -> (Duration, SinkState) {
    let state = Arc::new(Mutex::new(SinkState {
        ok: true,
        ..Default::default()
    }));
    let port = || vec![PortSpec::new::<Block>("p")];
    let mut b = PipelineBuilder::new().source("src", "src", port(), Src { n, sent: 0, every });
    let mut prev = "src".to_string();
    for i in 0..STAGES {
        let name = format!("pass{i}");
        b = b
            .stage(&name, "pass", port(), port(), Pass)
            .link(Link::new(prev.clone(), name.clone()).capacity(4));
        prev = name;
    }
    b = b
        .stage("sink", "sink", port(), vec![], Sink(state.clone(), STAGES))
        .link(Link::new(prev, "sink").capacity(4));
    if let Some(o) = observer {
        b = b.observer(o);
    }
    let p = b.build().expect("valid chain");
    let t0 = Instant::now();
    p.run().expect("clean run");
    let took = t0.elapsed();
    let s = std::mem::take(&mut *state.lock().unwrap());
    (took, s)
}

fn plain_loop(n: u64) -> Duration {
    let t0 = Instant::now();
    let mut check = 0.0;
    for i in 0..n {
        let mut v = vec![0.0f32; SAMPLES];
        v[0] = i as f32;
        for _ in 0..STAGES {
            v = pass(v);
        }
        check += v[1];
    }
    assert_eq!(check, (n as usize * STAGES) as f32);
    t0.elapsed()
}

fn overlap() -> (f64, f64, f64) {
    let state = Arc::new(Mutex::new(SinkState {
        ok: true,
        ..Default::default()
    }));
    let port = || vec![PortSpec::new::<Block>("p")];
    let n = 40;
    let report = PipelineBuilder::new()
        .source(
            "src",
            "src",
            port(),
            Src {
                n,
                sent: 0,
                every: None,
            },
        )
        .stage(
            "s1",
            "sleep",
            port(),
            port(),
            Sleep(Duration::from_millis(20)),
        )
        .stage(
            "s2",
            "sleep",
            port(),
            port(),
            Sleep(Duration::from_millis(20)),
        )
        .stage(
            "s3",
            "sleep",
            port(),
            port(),
            Sleep(Duration::from_millis(20)),
        )
        .stage("sink", "sink", port(), vec![], Sink(state.clone(), 0))
        .link(Link::new("src", "s1"))
        .link(Link::new("s1", "s2"))
        .link(Link::new("s2", "s3"))
        .link(Link::new("s3", "sink"))
        .build()
        .expect("valid chain")
        .run()
        .expect("clean run");
    assert_eq!(state.lock().unwrap().count, n);
    let sum: f64 = ["s1", "s2", "s3"]
        .iter()
        .map(|s| report.stage(s).unwrap().service.mean().as_secs_f64())
        .sum();
    let interval = report
        .stage("sink")
        .unwrap()
        .completion
        .quantile(0.5)
        .as_secs_f64();
    (interval, sum, interval / sum)
}

fn main() {
    let hops = (STAGES + 1) as f64;
    let n = 20_000;
    // Check the result before timing it.
    let (_, s) = chain(200, None);
    assert!(
        s.ok && s.count == 200,
        "chain delivers every frame in order"
    );

    println!(
        "runtime benchmark: {STAGES} pass-through stages, {SAMPLES}-sample f32 frames, {hops} hops"
    );
    let mut best_stream = f64::MAX;
    let mut best_loop = f64::MAX;
    for _ in 0..3 {
        let (t, s) = chain(n, None);
        assert!(s.ok && s.count == n);
        best_stream = best_stream.min(t.as_secs_f64() / n as f64);
        best_loop = best_loop.min(plain_loop(n).as_secs_f64() / n as f64);
    }
    let per_hop_stream = (best_stream - best_loop) / hops;
    println!(
        "  streaming:      {:8.2} µs/frame through the pipeline vs {:6.2} µs/frame plain loop -> overhead {:6.2} µs per hop per frame (ratio {:.1}x)",
        best_stream * 1e6,
        best_loop * 1e6,
        per_hop_stream * 1e6,
        best_stream / best_loop
    );

    let m = 500;
    let (_, s) = chain(m, Some(Duration::from_millis(2)));
    assert!(s.ok && s.count == m);
    let lat = s.latency.as_secs_f64() / m as f64;
    println!(
        "  one at a time:  {:8.2} µs source-to-sink latency -> {:6.2} µs per hop per frame (thread wake-ups included)",
        lat * 1e6,
        lat / hops * 1e6
    );

    // 3. Recording (`record.dir`): the same streaming chain with a recording attached.
    let dir = std::env::temp_dir().join(format!("duplex-bench-record-{}", std::process::id()));
    let (mut on, mut off) = (f64::MAX, f64::MAX);
    let mut bytes_per_frame = 0.0;
    for _ in 0..3 {
        let (t, _) = chain(n, None);
        off = off.min(t.as_secs_f64() / n as f64);
        let rec = Arc::new(
            duplex::observe::record::Recording::create(&dir, serde_json::json!({}), 1 << 30)
                .expect("recording"),
        );
        let (t, s) = chain_observed(n, None, Some(rec.clone()));
        assert!(s.ok && s.count == n);
        on = on.min(t.as_secs_f64() / n as f64);
        rec.finish();
        assert_eq!(rec.skipped(), 0, "the recording dropped events");
        let size: u64 = std::fs::read_dir(rec.dir())
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        bytes_per_frame = size as f64 / n as f64;
        let _ = std::fs::remove_dir_all(rec.dir());
    }
    let _ = std::fs::remove_dir_all(&dir);
    // A conversation: 12.5 frames per second through a pipeline of this size (9 stages, 8 links).
    let per_hour = bytes_per_frame * 12.5 * 3600.0;
    println!(
        "  recording:      {:8.2} µs/frame recorded vs {:6.2} µs/frame not -> +{:.2} µs per frame ({:.2} µs per stage); {:.0} bytes per frame -> {:.0} MB per hour at 12.5 frames/s",
        on * 1e6,
        off * 1e6,
        (on - off) * 1e6,
        (on - off) * 1e6 / hops,
        bytes_per_frame,
        per_hour / 1e6
    );

    let (interval, sum, ratio) = overlap();
    println!(
        "  overlap: 3 stages x 20 ms: completion interval {:.1} ms vs sum of stage times {:.1} ms -> ratio {:.3} (ideal 0.333)",
        interval * 1e3,
        sum * 1e3,
        ratio
    );
}
