//! Supervision: a failing, panicking or stuck stage stops the pipeline in bounded time with an
//! error naming the stage and frame; stop requests drain; end of stream flushes every stage.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use duplex::runtime::*;
use support::wait::wait_until;
use support::*;

fn fast_options() -> RunOptions {
    RunOptions {
        drain_timeout: Duration::from_millis(400),
        abort_timeout: Duration::from_millis(400),
    }
}

/// Fails (or panics) when it sees frame `at`.
struct FailAt {
    at: u64,
    panic: bool,
}
impl Stage for FailAt {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Num>()?;
        if f.data.0 == self.at {
            if self.panic {
                panic!("boom at {}", f.data.0);
            }
            // A typed error: the run's error keeps it, to be told by its type.
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("cannot handle value {}", f.data.0),
            )
            .into());
        }
        cx.emit(0, f.meta.origin, f.data)
    }
}

fn failing_pipeline(panic: bool, source: Count) -> (RunOutcome, std::sync::Arc<Seen>, Duration) {
    let (sink, seen) = Collect::new();
    let t0 = Instant::now();
    let out = PipelineBuilder::new()
        .options(fast_options())
        .source("src", "count", vec![num("out")], source)
        .stage(
            "bad",
            "fail",
            vec![num("in")],
            vec![num("out")],
            FailAt { at: 5, panic },
        )
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(Link::new("src", "bad"))
        .link(Link::new("bad", "sink"))
        .build()
        .unwrap()
        .start()
        .wait();
    (out, seen, t0.elapsed())
}

#[test]
fn stage_error_stops_the_pipeline_naming_stage_and_frame() {
    let (out, seen, took) = failing_pipeline(false, Count::new(1000));
    let err = out.error.expect("run must fail");
    match &err {
        RunError::StageFailed {
            stage, seq, hung, ..
        } => {
            assert_eq!(stage, "bad");
            assert_eq!(*seq, Some(5));
            assert!(hung.is_empty());
        }
        e => panic!("unexpected {e:?}"),
    }
    assert_eq!(
        err.to_string(),
        "stage `bad` failed at frame 5: cannot handle value 5"
    );
    // The stage's own error is kept with its type, not only its words.
    let cause = err.cause().expect("the stage's error is kept");
    let io = cause
        .downcast_ref::<std::io::Error>()
        .expect("it is the stage's io::Error");
    assert_eq!(io.kind(), std::io::ErrorKind::InvalidData);
    // Nothing produced before the failure is lost: the sink got frames 0..5 and flushed.
    assert_eq!(seen.values(), vec![0, 1, 2, 3, 4]);
    assert!(seen.finished());
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn stage_panic_stops_the_pipeline_naming_stage_and_frame() {
    let (out, seen, took) = failing_pipeline(true, Count::new(1000));
    let err = out.error.expect("run must fail");
    let msg = err.to_string();
    assert!(
        msg.starts_with("stage `bad` failed at frame 5: panicked: boom at 5"),
        "{msg}"
    );
    assert!(err.cause().is_none(), "a panic has no error to keep");
    assert_eq!(seen.values(), vec![0, 1, 2, 3, 4]);
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn failure_stops_an_endless_paced_source() {
    let (out, _seen, took) =
        failing_pipeline(false, Count::forever(Some(Duration::from_millis(2))));
    assert!(matches!(out.error, Some(RunError::StageFailed { .. })));
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// Blocks in `process` until released (a stage stuck in its own code).
struct Stuck {
    release: mpsc::Receiver<()>,
    entered: Arc<AtomicBool>,
}
impl Stage for Stuck {
    fn process(&mut self, _input: Input, _cx: &mut Context<'_>) -> StageResult {
        self.entered.store(true, Ordering::SeqCst);
        let _ = self.release.recv();
        Ok(())
    }
}

#[test]
fn producer_blocked_on_a_full_edge_is_woken_by_stop_and_stuck_stage_is_reported() {
    let (tx, rx) = mpsc::channel();
    let entered = Arc::new(AtomicBool::new(false));
    let running = PipelineBuilder::new()
        .options(fast_options())
        .source("src", "count", vec![num("out")], Count::forever(None))
        .stage(
            "stuck",
            "stuck",
            vec![num("in")],
            vec![],
            Stuck {
                release: rx,
                entered: entered.clone(),
            },
        )
        .link(Link::new("src", "stuck").capacity(1))
        .build()
        .unwrap()
        .start();
    wait_until(
        Duration::from_secs(20),
        "the stuck stage to take a frame",
        || entered.load(Ordering::SeqCst),
    );
    // The consumer is inside `process`; the source fills the edge and blocks on it.
    let stop = running.stop_handle();
    let t0 = Instant::now();
    stop.stop();
    let out = running.wait();
    let took = t0.elapsed();
    match out.error {
        Some(RunError::Hung { stages }) => assert_eq!(stages, vec!["stuck".to_string()]),
        e => panic!("expected the stuck stage to be reported, got {e:?}"),
    }
    // drain timeout + abort timeout, with slack for a loaded machine
    assert!(took < Duration::from_secs(4), "took {took:?}");
    assert!(out.report.stage("src").unwrap().frames >= 1);
    let _ = tx.send(());
}

#[test]
fn stop_drains_a_slow_pipeline_and_joins_every_thread() {
    let (sink, seen) = Collect::slow(Duration::from_millis(20));
    let running = PipelineBuilder::new()
        .options(fast_options())
        .source("src", "count", vec![num("out")], Count::forever(None))
        .stage("add", "add", vec![num("in")], vec![num("out")], Add(0))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(Link::new("src", "add").capacity(2))
        .link(Link::new("add", "sink").capacity(2))
        .build()
        .unwrap()
        .start();
    wait_until(
        Duration::from_secs(20),
        "frames to reach the slow sink",
        || seen.values().len() >= 3,
    );
    running.stop_handle().stop();
    let report = running
        .wait()
        .into_result()
        .expect("a drained stop is a clean end");
    let got = seen.values();
    assert!(seen.finished(), "the sink was flushed");
    // Everything the source emitted reached the sink: drained, not dropped.
    assert_eq!(got.len() as u64, report.stage("src").unwrap().frames);
    assert_eq!(got, (0..got.len() as u64).collect::<Vec<_>>());
}

/// Sums its input and emits the sum only at end of stream.
struct SumAtEnd(u64);
impl Stage for SumAtEnd {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        self.0 += input.take::<Num>()?.data.0;
        Ok(())
    }
    fn finish(&mut self, cx: &mut Context<'_>) -> StageResult {
        cx.emit(0, Instant::now(), Num(self.0))
    }
}

#[test]
fn end_of_stream_flows_through_and_every_stage_flushes() {
    let (sink, seen) = Collect::new();
    PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(101))
        .stage("a", "add", vec![num("in")], vec![num("out")], Add(1))
        .stage("sum", "sum", vec![num("in")], vec![num("out")], SumAtEnd(0))
        .stage("b", "add", vec![num("in")], vec![num("out")], Add(0))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(Link::new("src", "a"))
        .link(Link::new("a", "sum"))
        .link(Link::new("sum", "b"))
        .link(Link::new("b", "sink"))
        .build()
        .unwrap()
        .run()
        .unwrap();
    assert_eq!(seen.values(), vec![(1..=101).sum::<u64>()]);
    assert!(seen.finished());
}
