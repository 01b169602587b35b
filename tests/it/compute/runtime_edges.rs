//! Edges: overflow policies count every drop exactly; fan-out; the feedback edge; links are
//! type-checked and cycles refused before anything starts.

use crate::support;

use std::time::{Duration, Instant};

use duplex::runtime::*;
use support::*;

const N: u64 = 300;

fn run_with_slow_consumer(policy: Overflow) -> (RunReport, Vec<u64>) {
    let (sink, seen) = Collect::slow(Duration::from_micros(300));
    let report = PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(N))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(Link::new("src", "sink").capacity(4).overflow(policy))
        .build()
        .unwrap()
        .run()
        .unwrap();
    (report, seen.values())
}

#[test]
fn block_loses_nothing() {
    let (report, got) = run_with_slow_consumer(Overflow::Block);
    assert_eq!(got, (0..N).collect::<Vec<_>>());
    let e = report.edge("src", "sink").unwrap();
    assert_eq!((e.sent, e.dropped), (N, 0));
    assert!(e.max_depth <= 4);
}

#[test]
fn drop_newest_counts_every_drop_and_keeps_the_oldest() {
    let (report, got) = run_with_slow_consumer(Overflow::DropNewest);
    let e = report.edge("src", "sink").unwrap();
    assert!(
        e.dropped > 0,
        "a fast producer must overflow a slow consumer"
    );
    assert_eq!(got.len() as u64 + e.dropped, N, "received + dropped = sent");
    assert_eq!(e.sent, got.len() as u64);
    assert!(got.windows(2).all(|w| w[0] < w[1]), "order kept");
    // The first frames fill the queue and are kept.
    assert_eq!(&got[..4], &[0, 1, 2, 3]);
}

#[test]
fn drop_oldest_counts_every_drop_and_keeps_the_newest() {
    let (report, got) = run_with_slow_consumer(Overflow::DropOldest);
    let e = report.edge("src", "sink").unwrap();
    assert!(e.dropped > 0);
    assert_eq!(got.len() as u64 + e.dropped, N, "received + dropped = sent");
    assert!(got.windows(2).all(|w| w[0] < w[1]), "order kept");
    // The newest frame always survives.
    assert_eq!(got.last(), Some(&(N - 1)));
}

#[test]
fn fan_out_delivers_a_copy_to_every_consumer() {
    let (a, seen_a) = Collect::new();
    let (b, seen_b) = Collect::new();
    PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(50))
        .stage("a", "collect", vec![num("in")], vec![], a)
        .stage("b", "collect", vec![num("in")], vec![], b)
        .link(Link::new("src", "a"))
        .link(Link::new("src", "b"))
        .build()
        .unwrap()
        .run()
        .unwrap();
    assert_eq!(seen_a.values(), (0..50).collect::<Vec<_>>());
    assert_eq!(seen_b.values(), (0..50).collect::<Vec<_>>());
}

/// The shape of the LM cycle: for every tick, `step` needs the value that `sample` produced for
/// the previous tick (none for the first), and sends its own to `sample`.
struct Step {
    first: bool,
}
impl Stage for Step {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let tick = input.take::<Num>()?;
        let prev = if self.first {
            self.first = false;
            0
        } else {
            match cx.recv_feedback::<Num>(1)? {
                Some(f) => f.data.0,
                None => return Err(StageError::msg("feedback ended early")),
            }
        };
        cx.emit(0, tick.meta.origin, Num(prev * 2 + tick.data.0))
    }
}

#[test]
fn feedback_edge_carries_step_t_into_step_t_plus_1() {
    let (sink, seen) = Collect::new();
    let report = PipelineBuilder::new()
        .source("ticks", "count", vec![num("out")], Count::new(20))
        .stage(
            "step",
            "step",
            vec![num("tick"), PortSpec::feedback::<Num>("prev")],
            vec![num("out")],
            Step { first: true },
        )
        .stage("sample", "add", vec![num("in")], vec![num("out")], Add(1))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(Link::new("ticks", "step.tick"))
        .link(Link::new("step", "sample"))
        .link(Link::new("sample", "step.prev").feedback())
        .link(Link::new("sample", "sink"))
        .build()
        .unwrap()
        .run()
        .unwrap();
    // Reference: the same recurrence in a plain loop.
    let mut want = Vec::new();
    let mut prev = 0;
    for t in 0..20u64 {
        let v = prev * 2 + t;
        prev = v + 1;
        want.push(prev);
    }
    assert_eq!(seen.values(), want);
    // Time waiting for feedback is not service time of `step`.
    let step = report.stage("step").unwrap();
    assert!(step.blocked > Duration::ZERO);
}

fn text_sink() -> impl Stage {
    struct T;
    impl Stage for T {
        fn process(&mut self, _i: Input, _cx: &mut Context<'_>) -> StageResult {
            Ok(())
        }
    }
    T
}

#[test]
fn mismatched_link_types_are_refused_before_start() {
    let err = PipelineBuilder::new()
        .origin("pipelines/x.yaml")
        .source("src", "count", vec![num("out")], Count::new(1))
        .stage(
            "words",
            "text",
            vec![PortSpec::new::<Text>("in")],
            vec![],
            text_sink(),
        )
        .link(Link::new("src", "words"))
        .build()
        .err()
        .unwrap();
    assert!(matches!(*err.kind, GraphErrorKind::TypeMismatch { .. }));
    assert_eq!(
        err.to_string(),
        "pipelines/x.yaml: link `src -> words`: type mismatch: `src.out` emits Num but `words.in` takes Text"
    );
}

#[test]
fn a_cycle_without_a_feedback_link_is_refused() {
    let err = PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(1))
        .stage(
            "a",
            "add",
            vec![num("in"), num("back")],
            vec![num("out")],
            Add(0),
        )
        .stage("b", "add", vec![num("in")], vec![num("out")], Add(0))
        .link(Link::new("src", "a.in"))
        .link(Link::new("a", "b"))
        .link(Link::new("b", "a.back"))
        .build()
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("links form a cycle a -> b -> a"),
        "{err}"
    );
}

#[test]
fn dangling_and_missing_links_are_refused() {
    let e = PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(1))
        .link(Link::new("src", "nowhere"))
        .build()
        .err()
        .unwrap();
    assert_eq!(
        e.to_string(),
        "link `src -> nowhere`: there is no stage named `nowhere`"
    );
    let (sink, _) = Collect::new();
    let e = PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(1))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .build()
        .err()
        .unwrap();
    assert!(
        matches!(*e.kind, GraphErrorKind::UnlinkedInput { .. }),
        "{e}"
    );
    assert_eq!(e.to_string(), "input `sink.in` is not linked to anything");
}

#[test]
fn edge_wait_and_service_time_are_measured() {
    let (sink, _) = Collect::slow(Duration::from_millis(2));
    let t0 = Instant::now();
    let report = PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(30))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(Link::new("src", "sink").capacity(8))
        .build()
        .unwrap()
        .run()
        .unwrap();
    let sink = report.stage("sink").unwrap();
    assert_eq!(sink.frames, 30);
    // The sink sleeps 2 ms per frame: its service time says so, and queued frames waited.
    assert!(sink.service.quantile(0.5) >= Duration::from_millis(2));
    assert!(sink.completion.count() == 29);
    let e = report.edge("src", "sink").unwrap();
    assert_eq!(e.wait.count(), 30);
    assert!(e.wait.max() >= Duration::from_millis(2));
    assert!(report.wall <= t0.elapsed());
}
