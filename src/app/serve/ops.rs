//! What the server does in the background while it serves: the engines' figures published
//! together, the metric series that exist from the start, a failed shared engine replaced, the
//! session template reloaded on SIGHUP, and the drain on SIGTERM (sessions finish within
//! `drain_timeout_s`; a second signal closes them at once).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{session, webrtc, Server};
use crate::observe::names;

/// Publishes, every second, what the sessions' private monitors show together: the real-time
/// factor and each stage's utilization as the highest over live sessions, and each stage's
/// verdict as growth or contention when any session shows it (steady when none does).
pub(super) async fn publish_together(server: Arc<Server>) {
    use crate::observe::diagnose::Pattern;
    let rtf = metrics::gauge!(names::REALTIME_FACTOR);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let stages: Vec<String> = server
            .template()
            .stages
            .iter()
            .map(|s| s.name.clone())
            .collect();
        let monitors: Vec<_> = match server.sessions.lock() {
            Ok(m) => m.values().filter_map(|l| l.monitor.clone()).collect(),
            Err(_) => continue,
        };
        rtf.set(
            monitors
                .iter()
                .map(|m| m.realtime_factor())
                .fold(0.0, f64::max),
        );
        for stage in &stages {
            let mut util = 0.0f64;
            let mut seen = [false; 3];
            for m in &monitors {
                if let Some((_, u)) = m.utilizations().into_iter().find(|(n, _)| n == stage) {
                    util = util.max(u);
                }
                if let Some((_, p)) = m.verdicts().into_iter().find(|(n, _)| n == stage) {
                    if let Some(i) = Pattern::ALL.iter().position(|x| *x == p) {
                        seen[i] = true;
                    }
                }
            }
            metrics::gauge!(names::STAGE_UTILIZATION, "stage" => stage.clone()).set(util);
            // ALL is steady, growth, contention.
            let steady = !seen[1] && !seen[2];
            for (i, p) in Pattern::ALL.iter().enumerate() {
                let on = if i == 0 { steady } else { seen[i] };
                metrics::gauge!(names::LATENCY_PATTERN, "stage" => stage.clone(), "pattern" => p.name())
                    .set(if on { 1.0 } else { 0.0 });
            }
        }
    }
}

/// Every session series exists from the start, at zero: rates and alerts need no first event.
pub(super) fn register_series() {
    metrics::counter!(names::SESSIONS_ADMITTED).absolute(0);
    for reason in [
        "full",
        "draining",
        "per_ip",
        "not_ready",
        "rate",
        "key_limit",
    ] {
        metrics::counter!(names::SESSIONS_REFUSED, "reason" => reason).absolute(0);
    }
    for outcome in session::Outcome::ALL {
        metrics::counter!(names::SESSIONS_ENDED, "outcome" => outcome.name()).absolute(0);
    }
    for direction in ["in", "out"] {
        metrics::counter!(names::SESSION_BYTES, "direction" => direction).absolute(0);
        metrics::counter!(names::SESSION_DROPPED, "direction" => direction).absolute(0);
    }
    for kind in session::PROTOCOL_ERRORS {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => kind).absolute(0);
    }
    metrics::counter!(names::SESSION_SILENCE).absolute(0);
    metrics::counter!(names::SESSION_LATE_FRAMES).absolute(0);
    for reason in ["no_request", "error"] {
        metrics::counter!(names::CONNECTIONS_CLOSED, "reason" => reason).absolute(0);
    }
    metrics::counter!(names::SESSION_STALLS).absolute(0);
    for reason in [
        "host",
        "bad_request",
        "origin",
        "missing_key",
        "unknown_key",
        "signature",
    ] {
        metrics::counter!(names::HTTP_REFUSED, "reason" => reason).absolute(0);
    }
    metrics::counter!(names::OPUS_REFUSED).absolute(0);
    for (direction, outcome) in webrtc::driver::PACKET_SERIES {
        metrics::counter!(names::WEBRTC_PACKETS, "direction" => direction, "outcome" => outcome)
            .absolute(0);
    }
    metrics::gauge!(names::WEBRTC_PEERS).set(0.0);
}

/// A shared engine that failed is replaced: its sessions have ended with an error, `/healthz`
/// and `/readyz` say 503 meanwhile, and one session of the template is built again to open a
/// fresh engine (the next client's session would open one too). Also keeps
/// [`names::SESSIONS_ACCEPTING`] up to date (every half second; at once when a drain begins).
pub(super) async fn recover_engines(server: Arc<Server>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let accepting = metrics::gauge!(names::SESSIONS_ACCEPTING);
    loop {
        tick.tick().await;
        accepting.set(if server.accepting() { 1.0 } else { 0.0 });
        if !server.engine_failed() {
            continue;
        }
        let s = server.clone();
        let r = tokio::task::spawn_blocking(move || {
            let template = s.template();
            session::check_template(&s.cfg, &template, &s.registry, &s.resources)
        })
        .await;
        match r {
            Ok(Ok(engines)) => {
                if let Ok(mut e) = server.engines.lock() {
                    *e = engines;
                }
                tracing::warn!("a fresh shared engine replaces the one that failed");
            }
            Ok(Err(e)) => tracing::error!("the failed engine could not be replaced yet: {e}"),
            Err(e) => tracing::error!("replacing the failed engine: {e}"),
        }
    }
}

/// SIGHUP: the session template is read and checked again; new sessions get it, live ones keep
/// theirs. A template that fails is refused (logged, counted) and the one in force is kept.
pub(super) async fn reload_on_hangup(server: Arc<Server>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("no SIGHUP handler: the session template is read at start only");
        return;
    };
    while hup.recv().await.is_some() {
        let s = server.clone();
        let t0 = Instant::now();
        let r = tokio::task::spawn_blocking(move || s.reload_template()).await;
        match r {
            Ok(Ok(())) => {
                metrics::counter!(names::RELOADS, "result" => "applied").increment(1);
                tracing::info!(
                    template = %server.cfg.pipeline.display(),
                    "reloaded the session template in {:.2} s: new sessions get it",
                    t0.elapsed().as_secs_f64()
                );
            }
            Ok(Err(e)) => {
                metrics::counter!(names::RELOADS, "result" => "rejected").increment(1);
                tracing::error!("reload refused, the session template in force is kept: {e}");
            }
            Err(e) => tracing::error!("reload failed: {e}"),
        }
    }
}

/// SIGINT/SIGTERM: stop admitting, let sessions run up to `drain_timeout`, close them, and
/// end the server. A second signal closes them at once.
pub(super) async fn drain_on_signal(server: Arc<Server>, done: tokio::sync::oneshot::Sender<()>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("signal handlers could not be installed: SIGTERM ends the server at once");
        return;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
    server.draining.store(true, Ordering::Release);
    metrics::gauge!(names::SESSIONS_ACCEPTING).set(0.0);
    let live = server.taken.load(Ordering::Acquire);
    let timeout = server.cfg.drain_timeout;
    tracing::warn!(
        sessions = live,
        "draining: no new sessions; live ones may run {:.0} s (signal again to close them now)",
        timeout.as_secs_f64()
    );
    let all_ended = async {
        while server.taken.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        _ = all_ended => {}
        _ = tokio::time::sleep(timeout) => {
            tracing::warn!("drain timeout: closing the live sessions");
        }
        _ = int.recv() => tracing::warn!("second signal: closing the live sessions now"),
        _ = term.recv() => tracing::warn!("second signal: closing the live sessions now"),
    }
    let _ = server.close_all.send(true);
    // Sessions close their sockets and pipelines; give them a bounded time.
    let closed = async {
        while server.taken.load(Ordering::Acquire) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .is_err()
    {
        tracing::error!("sessions did not close within 10 s; exiting anyway");
    }
    let _ = done.send(());
}
