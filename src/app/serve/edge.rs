//! The HTTP edge: the listener's accept loop (each connection counted against its address, a
//! bounded send buffer, the request head due within `limits.handshake_timeout_s`) and the guard
//! in front of every route (the host names served, keys, browser origins, the client's address
//! behind a trusted proxy, the security headers). Knows nothing of sessions beyond admission.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::{access, ServeConfig, Server};
use crate::observe::names;

/// The kernel's send buffer per connection, bytes (about 2 s of the agent's audio).
pub(super) const SEND_BUFFER: usize = 32 * 1024;

/// The security headers of every response.
pub(super) const SECURITY_HEADERS: [(&str, &str); 4] = [
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    (
        "content-security-policy",
        "default-src 'self'; connect-src 'self'; img-src 'self' data:; media-src 'self' blob:; \
         worker-src 'self' blob:; object-src 'none'; base-uri 'none'; form-action 'self'; \
         frame-ancestors 'none'",
    ),
];

/// The client of a request: its address (behind a trusted proxy, the one the proxy forwarded)
/// and the key it presented, when keys are configured and it presented a good one.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client {
    pub(super) ip: IpAddr,
    /// Whether `ip` came from a proxy's header.
    pub(super) forwarded: bool,
    pub(super) key: Option<usize>,
}

/// Whether `path` needs a key (when keys are configured): the API (`/api/`, `/v1/`, and a
/// call's resource under `webrtc.location_base`'s path), and `/metrics` with `protect_metrics`. The page's files, `/healthz` and `/readyz` never do, nor
/// `/twilio/media`, which Twilio's signature guards instead.
pub(super) fn protected(path: &str, cfg: &ServeConfig) -> bool {
    // A call's resource under this replica's prefix (`webrtc.location_base`) is the API too.
    let path = match cfg.webrtc.as_ref().and_then(|w| w.location_path()) {
        Some(p) => path.strip_prefix(p).unwrap_or(path),
        None => path,
    };
    path.starts_with("/api/")
        || path.starts_with("/v1/")
        || (path == "/metrics" && cfg.protect_metrics)
}

/// Every request, before any route: its `Host` must be one this server answers to (an IP
/// address, `localhost`, or a name of `allowed_hosts`: 421 otherwise, so a web page that
/// rebinds its own name to this address reads nothing); a browser's `Origin` must be allowed
/// (403); with keys configured, the API needs one (401, or 429 from the route for a key at its
/// limit). Every refusal is counted by reason and logged at most once per reason per
/// [`LOG_EVERY`], never with the key. Every response gets the security headers.
pub(super) async fn guard(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let cfg = &server.cfg;
    let ip = access::client_ip(
        peer.ip(),
        req.headers(),
        &cfg.trusted_proxies,
        cfg.forwarded_header,
    );
    let host = req
        .headers()
        .get(header::HOST)
        .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    let refuse = |reason: &'static str, status: StatusCode, msg: &'static str| {
        metrics::counter!(names::HTTP_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = server.log_throttle.allow(reason) {
            tracing::info!(client = %ip, reason, held, "refused a request: {msg}");
        }
        let mut r = (status, format!("{msg}\n")).into_response();
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"duplex\""),
            );
        }
        r
    };
    let mut res = 'decided: {
        if host
            .as_deref()
            .is_some_and(|h| !host_allowed(h, &cfg.allowed_hosts))
        {
            break 'decided refuse(
                "host",
                StatusCode::MISDIRECTED_REQUEST,
                "this server does not serve that host name (`allowed_hosts`)",
            );
        }
        let origin = req
            .headers()
            .get(header::ORIGIN)
            .map(|o| String::from_utf8_lossy(o.as_bytes()).into_owned());
        let opens_sessions = matches!(
            req.uri().path(),
            "/api/chat" | "/v1/realtime" | "/api/webrtc"
        );
        if let Some(o) = origin.filter(|_| opens_sessions) {
            if !access::origin_allowed(&o, host.as_deref(), &cfg.allowed_origins) {
                break 'decided refuse(
                    "origin",
                    StatusCode::FORBIDDEN,
                    "a page of this origin may not open sessions here (`allowed_origins`)",
                );
            }
        }
        let mut key = None;
        if cfg.keys.any() && protected(req.uri().path(), cfg) {
            let presented = access::presented(req.headers(), req.uri().query());
            match cfg.keys.check(presented.as_deref()) {
                Ok(i) => key = Some(i),
                Err(d) => {
                    break 'decided refuse(
                        d.reason(),
                        StatusCode::UNAUTHORIZED,
                        match d {
                            access::Denied::Missing => {
                                "a key is needed: the kyutai-api-key header, the auth_id query \
                                 parameter, or Authorization: Bearer"
                            }
                            access::Denied::Unknown => "this key is not accepted here",
                        },
                    )
                }
            }
        }
        req.extensions_mut().insert(Client {
            ip,
            forwarded: ip != peer.ip(),
            key,
        });
        next.run(req).await
    };
    let h = res.headers_mut();
    for (k, v) in SECURITY_HEADERS {
        h.insert(k, header::HeaderValue::from_static(v));
    }
    res
}

/// Whether `host` (a `Host` header: name or address, maybe with a port) is served: an IP
/// address (no page can rebind one), `localhost` and its subdomains, or a name of `allowed`
/// (`*.example.com` allows the subdomains of example.com).
pub(super) fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let host = host.trim().to_ascii_lowercase();
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return rest
            .split(']')
            .next()
            .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok());
    } else {
        host.rsplit_once(':')
            .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
            .map_or(host.as_str(), |(n, _)| n)
    };
    let name = name.trim_end_matches('.');
    if name.parse::<IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    allowed.iter().any(|a| match a.strip_prefix("*.") {
        Some(domain) => name
            .strip_suffix(domain)
            .is_some_and(|sub| sub.ends_with('.') && sub.len() > 1),
        None => a.trim_end_matches('.') == name,
    })
}

/// Accepts connections until `done`: each one counted against its address's limit (one over
/// it gets 429 and is closed), with small frames sent at once, a bounded kernel send buffer (a
/// client that stops reading is seen within seconds), and the request head due within
/// `limits.handshake_timeout_s` (a connection that never says anything is closed).
pub(super) async fn accept(
    server: &Arc<Server>,
    listener: tokio::net::TcpListener,
    app: axum::Router,
    done: &mut (impl std::future::Future<Output = ()> + Unpin),
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use tower::ServiceExt;
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(server.cfg.limits.handshake_timeout);
    let refuser = server.clone();
    let over_limit = axum::Router::new().fallback(
        move |ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
            let limit = "max_connections_per_ip";
            *refuser.refusal(
                peer.ip(),
                "per_ip",
                StatusCode::TOO_MANY_REQUESTS,
                5,
                format!("too many connections from {} ({limit})", peer.ip()),
            )
        },
    );
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut *done => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let _ = socket2::SockRef::from(&tcp).set_send_buffer_size(SEND_BUFFER);
        // Shared with the session when the connection becomes one: an upgraded connection
        // leaves hyper, and stays counted until the session ends.
        let conn = server.connect(peer.ip()).map(Arc::new);
        let routes = if conn.is_some() {
            app.clone()
        } else {
            over_limit.clone()
        };
        let held = conn.clone();
        let svc = routes.map_request(move |r: hyper::Request<hyper::body::Incoming>| {
            let mut r = r.map(axum::body::Body::new);
            r.extensions_mut().insert(ConnectInfo(peer));
            if let Some(c) = &held {
                r.extensions_mut().insert(c.clone());
            }
            r
        });
        let serving = http
            .clone()
            .keep_alive(conn.is_some())
            .serve_connection(
                TokioIo::new(tcp),
                hyper_util::service::TowerToHyperService::new(svc),
            )
            .with_upgrades();
        let quiet = server.clone();
        tokio::spawn(async move {
            if let Err(e) = serving.await {
                let reason = if e.is_timeout() {
                    "no_request"
                } else {
                    "error"
                };
                metrics::counter!(names::CONNECTIONS_CLOSED, "reason" => reason).increment(1);
                if reason == "no_request" && !quiet.quiet_warned.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        client = %peer,
                        "closed a connection that sent no request within limits.handshake_timeout_s \
                         (further ones are only counted: {})",
                        names::CONNECTIONS_CLOSED
                    );
                } else {
                    tracing::debug!(client = %peer, "connection: {e}");
                }
            }
            drop(conn);
        });
    }
}
