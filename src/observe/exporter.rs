//! The HTTP endpoint of a duplex process: `/metrics` (Prometheus text format, with explicit
//! histogram buckets) and `/healthz` (readiness and health as JSON, 200 or 503), as axum routes
//! that `duplex serve` mounts on its own router and that [`install`] serves alone (for
//! `duplex run` and the daemon) on a thread of its own.
//!
//! The recorder is metrics-exporter-prometheus's, installed once per process.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

/// Histogram buckets, in seconds, for every duplex histogram: fine steps around the 80 ms frame
/// budget, with a boundary at exactly 0.08.
pub const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.045, 0.05, 0.055, 0.06, 0.065, 0.07,
    0.075, 0.08, 0.085, 0.09, 0.1, 0.11, 0.12, 0.14, 0.16, 0.2, 0.3, 0.5, 1.0, 2.5,
];

/// Buckets of session durations, in seconds (one second to two hours).
pub const SESSION_BUCKETS: &[f64] = &[
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];

/// Buckets of priming times, in seconds (a restored state's milliseconds to a real-size
/// model's step-by-step priming).
pub const PRIMING_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
];

/// Answers `/healthz`: whether the process is healthy, and details.
pub type Health = Arc<dyn Fn() -> (bool, serde_json::Value) + Send + Sync>;

/// The process-wide recorder, installed by the first call (later calls return the same one).
///
/// # Errors
///
/// [`ExporterError::Recorder`] when another recorder is already installed.
pub fn recorder() -> Result<PrometheusHandle, ExporterError> {
    static HANDLE: OnceLock<Result<PrometheusHandle, Arc<BuildError>>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets(BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(super::names::SESSION_DURATION.into()),
                        SESSION_BUCKETS,
                    )
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(super::names::PRIMING.into()),
                        PRIMING_BUCKETS,
                    )
                })
                .map_err(Arc::new)?
                .install_recorder()
                .map_err(Arc::new)?;
            // Histograms' summaries are kept bounded by a periodic upkeep.
            let upkeep = handle.clone();
            let _ = std::thread::Builder::new()
                .name("duplex:metrics-upkeep".into())
                .spawn(move || loop {
                    std::thread::sleep(Duration::from_secs(5));
                    upkeep.run_upkeep();
                });
            Ok(handle)
        })
        .clone()
        .map_err(ExporterError::Recorder)
}

/// Why metrics cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ExporterError {
    /// The address cannot be listened on.
    #[error("serving metrics on {addr}: {error}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS's error (in the message).
        error: std::io::Error,
    },
    /// The process's metrics recorder could not be installed (another one is).
    #[error("installing the metrics recorder: {0}")]
    Recorder(#[source] Arc<BuildError>),
    /// The thread serving them could not be started.
    #[error("starting the metrics thread: {0}")]
    Thread(std::io::Error),
}

/// `/metrics` and `/healthz` (`health`: none answers 200 `{"ok":true}`).
pub fn routes(handle: PrometheusHandle, health: Option<Health>) -> axum::Router {
    axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let h = handle.clone();
                async move {
                    (
                        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        h.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            axum::routing::get(move || {
                let health = health.clone();
                async move {
                    match health {
                        Some(h) => {
                            let (ok, detail) = h();
                            let status = if ok {
                                StatusCode::OK
                            } else {
                                StatusCode::SERVICE_UNAVAILABLE
                            };
                            (status, axum::Json(detail)).into_response()
                        }
                        None => axum::Json(serde_json::json!({"ok": true})).into_response(),
                    }
                }
            }),
        )
}

/// A 404 that says where to look.
pub async fn not_found(uri: axum::http::Uri) -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        format!("{uri}: not found (try /metrics or /healthz)\n"),
    )
}

/// Installs the process-wide recorder and serves `/metrics` and `/healthz` on `addr`, on a
/// thread of its own.
///
/// # Errors
///
/// A message naming the address when it cannot be bound, or when a recorder is already
/// installed.
pub fn install(addr: SocketAddr, health: Option<Health>) -> Result<(), ExporterError> {
    let bind = |error| ExporterError::Bind { addr, error };
    let listener = std::net::TcpListener::bind(addr).map_err(bind)?;
    listener.set_nonblocking(true).map_err(bind)?;
    let handle = recorder()?;
    let app = routes(handle, health).fallback(not_found);
    std::thread::Builder::new()
        .name("duplex:http".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!("metrics endpoint on {addr} stopped: {e}");
                }
            });
        })
        .map_err(ExporterError::Thread)?;
    Ok(())
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
