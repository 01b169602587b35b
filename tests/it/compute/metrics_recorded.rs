//! The runtime's timings and drop counts reach the `metrics` facade through the recorder
//! observer: with a Prometheus recorder installed (in a process of its own, so that the global
//! recorder and its counts are this test's alone), the rendered text carries the same counts as
//! the run's report.

use crate::support;

use std::time::Duration;

use duplex::runtime::*;
use metrics_exporter_prometheus::PrometheusBuilder;
use support::*;

#[test]
fn drops_frames_and_service_times_are_exported() {
    if !support::in_own_process() {
        support::rerun_alone(
            "compute::metrics_recorded::drops_frames_and_service_times_are_exported",
            Vec::new(),
        );
        return;
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.08, 1.0])
        .unwrap()
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).unwrap();

    let (sink, seen) = Collect::slow(Duration::from_micros(300));
    let report = PipelineBuilder::new()
        .source("src", "count", vec![num("out")], Count::new(200))
        .stage("sink", "collect", vec![num("in")], vec![], sink)
        .link(
            Link::new("src", "sink")
                .capacity(2)
                .overflow(Overflow::DropNewest),
        )
        .observer(std::sync::Arc::new(
            duplex::observe::recorder::Recorder::new(),
        ))
        .build()
        .unwrap()
        .run()
        .unwrap();
    let text = handle.render();
    let dropped = report.edge("src", "sink").unwrap().dropped;
    assert!(dropped > 0);
    assert_eq!(seen.values().len() as u64 + dropped, 200);
    assert_eq!(
        support::metric(
            &text,
            "duplex_edge_dropped_total{edge=\"src.out -> sink.in\"}"
        ),
        dropped as f64
    );
    assert_eq!(
        support::metric(&text, "duplex_stage_frames_total{stage=\"sink\"}"),
        seen.values().len() as f64
    );
    assert_eq!(
        support::metric(&text, "duplex_stage_service_seconds_count{stage=\"sink\"}"),
        seen.values().len() as f64
    );
    assert_eq!(
        support::metric(
            &text,
            "duplex_edge_wait_seconds_count{edge=\"src.out -> sink.in\"}"
        ),
        seen.values().len() as f64
    );
    assert_eq!(
        support::metric(
            &text,
            "duplex_completion_interval_seconds_count{stage=\"sink\"}"
        ),
        seen.values().len() as f64 - 1.0
    );
}
