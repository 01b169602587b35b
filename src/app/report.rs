//! The per-stage timing table printed at the end of `duplex run`.

use std::fmt::Write;
use std::time::Duration;

use crate::runtime::RunReport;

fn ms(d: Duration) -> String {
    let v = d.as_secs_f64() * 1e3;
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Renders a run's statistics: per stage (frames, service time quantiles in ms, share of wall
/// time busy), per edge (frames, drops, deepest queue, wait quantiles) and per sink (completion
/// interval).
pub fn timing_table(r: &RunReport) -> String {
    let mut s = String::new();
    let wall = r.wall.as_secs_f64().max(1e-9);
    let _ = writeln!(
        s,
        "{:<16} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6}",
        "stage", "frames", "mean ms", "p50 ms", "p90 ms", "p99 ms", "max ms", "busy%"
    );
    for st in &r.stages {
        let h = &st.service;
        let _ = writeln!(
            s,
            "{:<16} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6.1}",
            st.name,
            st.frames,
            ms(h.mean()),
            ms(h.quantile(0.5)),
            ms(h.quantile(0.9)),
            ms(h.quantile(0.99)),
            ms(h.max()),
            100.0 * h.sum().as_secs_f64() / wall
        );
    }
    let _ = writeln!(
        s,
        "\n{:<36} {:>8} {:>8} {:>6} {:>11} {:>11}",
        "edge", "frames", "dropped", "depth", "wait p50 ms", "wait p90 ms"
    );
    for e in &r.edges {
        let _ = writeln!(
            s,
            "{:<36} {:>8} {:>8} {:>6} {:>11} {:>11}",
            e.name,
            e.sent,
            e.dropped,
            format!("{}/{}", e.max_depth, e.capacity),
            ms(e.wait.quantile(0.5)),
            ms(e.wait.quantile(0.9))
        );
    }
    for st in r.stages.iter().filter(|s| s.completion.count() > 0) {
        let c = &st.completion;
        let _ = writeln!(
            s,
            "\nsink {}: completion interval mean {} ms, p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
            st.name,
            ms(c.mean()),
            ms(c.quantile(0.5)),
            ms(c.quantile(0.9)),
            ms(c.quantile(0.99)),
            ms(c.max())
        );
    }
    let _ = writeln!(s, "wall time {:.3} s", r.wall.as_secs_f64());
    s
}
