//! The Prometheus exporter: `/metrics` over HTTP, with explicit histogram buckets.

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusBuilder;

/// Histogram buckets, in seconds, for every duplex histogram: fine steps around the 80 ms frame
/// budget, with a boundary at exactly 0.08.
pub const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.045, 0.05, 0.055, 0.06, 0.065, 0.07,
    0.075, 0.08, 0.085, 0.09, 0.1, 0.11, 0.12, 0.14, 0.16, 0.2, 0.3, 0.5, 1.0, 2.5,
];

/// Serves `/metrics` on `addr` and installs the process-wide recorder.
///
/// # Errors
///
/// A message naming the address when it cannot be bound, or when a recorder is already
/// installed.
pub fn install(addr: SocketAddr) -> Result<(), String> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(BUCKETS)
        .map_err(|e| e.to_string())?
        .install()
        .map_err(|e| format!("serving metrics on {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn buckets_have_a_boundary_at_the_frame_budget_and_fine_steps_around_it() {
        let b = super::BUCKETS;
        assert!(b.windows(2).all(|w| w[0] < w[1]));
        let i = b
            .iter()
            .position(|&v| v == 0.08)
            .expect("0.08 is a boundary");
        assert!(b[i] - b[i - 1] <= 0.005 + 1e-12 && b[i + 1] - b[i] <= 0.005 + 1e-12);
    }
}
