//! The HTTP endpoint of a duplex process: `/metrics` (Prometheus text format, with explicit
//! histogram buckets) and `/healthz` (readiness and health as JSON, 200 or 503).
//!
//! A small HTTP/1.1 server of our own on a tokio runtime thread, so that both paths share the
//! metrics address; the recorder itself is metrics-exporter-prometheus's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Histogram buckets, in seconds, for every duplex histogram: fine steps around the 80 ms frame
/// budget, with a boundary at exactly 0.08.
pub const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.045, 0.05, 0.055, 0.06, 0.065, 0.07,
    0.075, 0.08, 0.085, 0.09, 0.1, 0.11, 0.12, 0.14, 0.16, 0.2, 0.3, 0.5, 1.0, 2.5,
];

/// Answers `/healthz`: whether the process is healthy, and details.
pub type Health = Arc<dyn Fn() -> (bool, serde_json::Value) + Send + Sync>;

/// Installs the process-wide recorder and serves `/metrics` and `/healthz` on `addr`.
///
/// # Errors
///
/// A message naming the address when it cannot be bound, or when a recorder is already
/// installed.
pub fn install(addr: SocketAddr, health: Option<Health>) -> Result<(), String> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|e| format!("serving metrics on {addr}: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("serving metrics on {addr}: {e}"))?;
    let handle = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| e.to_string())?
        .install_recorder()
        .map_err(|e| format!("serving metrics on {addr}: {e}"))?;
    std::thread::Builder::new()
        .name("duplex:http".into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(serve(listener, handle, health));
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}

async fn serve(listener: std::net::TcpListener, handle: PrometheusHandle, health: Option<Health>) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let handle = handle.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => {
                            n += k;
                            if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                                break;
                            }
                        }
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let (status, ctype, body) = match path.split('?').next().unwrap_or("") {
                "/metrics" => ("200 OK", "text/plain; version=0.0.4", handle.render()),
                "/healthz" => match &health {
                    Some(h) => {
                        let (ok, detail) = h();
                        (
                            if ok {
                                "200 OK"
                            } else {
                                "503 Service Unavailable"
                            },
                            "application/json",
                            detail.to_string(),
                        )
                    }
                    None => ("200 OK", "application/json", "{\"ok\":true}".to_string()),
                },
                _ => (
                    "404 Not Found",
                    "text/plain",
                    "not found: try /metrics or /healthz\n".to_string(),
                ),
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
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
