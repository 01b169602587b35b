//! The upgrade routes: `/api/chat` (Kyutai's protocol), `/v1/realtime` (the realtime API) and
//! `/twilio/media` (Twilio's signature checked first), each admitting its client and handing
//! the socket to [`session::run`](super::session) in its transport's protocol; WebRTC's
//! offer and hang-up (`webrtc.rs`); SIP's calls (`sip/`); the providers' media streams
//! (`streams.rs`). The doors know the server (admission, limits, keys); the
//! transports they hand clients to do not.

pub(super) mod sip;
pub(super) mod streams;
pub(super) mod webrtc;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, RawQuery, State, WebSocketUpgrade};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::streams::{twilio, MediaStream};
use super::{kyutai, realtime, session, Client, Connection, Server};
use crate::observe::names;

/// What may wait in a WebSocket's own write buffer when the client does not read (pongs,
/// close frames, the last messages): past it a write fails and the session ends.
pub(super) const WRITE_BUFFER_MAX: usize = 256 * 1024;

/// `GET /api/chat`: Kyutai's protocol ([`kyutai`]); the query is the session's params.
pub(super) async fn chat(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    RawQuery(query): RawQuery,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let query = query_pairs(query);
    let proto = kyutai::Kyutai::new(query);
    open_session(server, peer, client, conn, &headers, ws, proto)
}

/// `GET /v1/realtime`: the OpenAI Realtime API ([`realtime`]); `event_names=ga|beta|both` in
/// the query chooses the server events' names (the API's `model` parameter is ignored).
pub(super) async fn realtime_chat(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    RawQuery(query): RawQuery,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let names = match query_pairs(query)
        .into_iter()
        .find(|(k, _)| k == "event_names")
        .map(|(_, v)| realtime::Names::parse(&v))
        .transpose()
    {
        Ok(n) => n,
        Err(m) => {
            metrics::counter!(names::HTTP_REFUSED, "reason" => "bad_request").increment(1);
            return (StatusCode::BAD_REQUEST, format!("{m}\n")).into_response();
        }
    };
    let proto = realtime::Realtime::new(server.cfg.clone(), names, server.vad.clone());
    // Browsers name the API's subprotocol (and pass their key in another one).
    let ws = ws.protocols(["realtime"]);
    open_session(server, peer, client, conn, &headers, ws, proto)
}

/// `GET /twilio/media`: a phone call through Twilio's Media Streams ([`twilio`]). Twilio
/// presents no key of ours: with `twilio_auth_token` the request must carry Twilio's signature;
/// a server with keys and no token refuses calls.
pub(super) async fn twilio_media(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let cfg = &server.cfg;
    let refuse = |status: StatusCode, reason: &'static str, msg: &'static str| {
        metrics::counter!(names::HTTP_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = server.log_throttle.allow(reason) {
            tracing::info!(client = %client.ip, reason, held, "refused a call: {msg}");
        }
        (status, format!("{msg}\n")).into_response()
    };
    match &cfg.twilio_auth_token {
        Some(token) => {
            let url = cfg.twilio_url.clone().unwrap_or_else(|| {
                let host = headers
                    .get(header::HOST)
                    .map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
                    .unwrap_or_default();
                format!("wss://{host}{uri}")
            });
            let signature = headers
                .get("x-twilio-signature")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if !twilio::signature_ok(token, &url, signature) {
                return refuse(
                    StatusCode::FORBIDDEN,
                    "signature",
                    "not signed by Twilio for this URL (X-Twilio-Signature, `twilio_url`)",
                );
            }
        }
        None if cfg.keys.any() => {
            return refuse(
                StatusCode::FORBIDDEN,
                "signature",
                "this server has keys: calls need `twilio_auth_token` to be checked",
            );
        }
        None => {}
    }
    let server = server.clone();
    open_session(
        server,
        peer,
        client,
        conn,
        &headers,
        ws,
        MediaStream::new(twilio::Twilio),
    )
}

/// A query's pairs, the empty names left out.
pub(super) fn query_pairs(query: Option<String>) -> Vec<(String, String)> {
    query
        .map(|q| {
            url_pairs(&q)
                .into_iter()
                .filter(|(k, _)| !k.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// Admits a WebSocket client (its key's and address's limits, the server's capacity) and runs
/// its session in `proto`.
pub(super) fn open_session<P: session::Protocol>(
    server: Arc<Server>,
    peer: SocketAddr,
    client: Client,
    conn: Arc<Connection>,
    headers: &axum::http::HeaderMap,
    ws: WebSocketUpgrade,
    proto: P,
) -> Response {
    // RFC 6455 4.1: the key is 16 random bytes in base64; anything else is not a WebSocket
    // client.
    let key = headers.get(header::SEC_WEBSOCKET_KEY).map(|k| k.as_bytes());
    if !key.is_some_and(websocket_key_ok) {
        metrics::counter!(names::HTTP_REFUSED, "reason" => "bad_request").increment(1);
        return (
            StatusCode::BAD_REQUEST,
            "Sec-WebSocket-Key must be 16 bytes in base64 (RFC 6455)\n",
        )
            .into_response();
    }
    // Behind a proxy, the client's address (its port is the proxy's business: 0).
    let peer = if client.forwarded {
        SocketAddr::new(client.ip, 0)
    } else {
        peer
    };
    let admission = match server.admit_client(&client) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let limit = server.cfg.limits.max_message_bytes;
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .max_write_buffer_size(WRITE_BUFFER_MAX)
        .on_failed_upgrade(move |e| tracing::info!(client = %peer, "WebSocket upgrade failed: {e}"))
        .on_upgrade(move |socket| async move {
            session::run(server, session::halves(socket), peer, proto, admission).await;
            drop(conn);
        })
}

/// A `Sec-WebSocket-Key` as RFC 6455 has it: 16 bytes in base64, so 22 characters of the
/// alphabet and `==`.
pub(super) fn websocket_key_ok(key: &[u8]) -> bool {
    let b64 = |c: &u8| c.is_ascii_alphanumeric() || *c == b'+' || *c == b'/';
    key.len() == 24 && key[..22].iter().all(b64) && &key[22..] == b"=="
}

/// `k=v&k2=v2`, percent-decoded (`+` is a space).
pub(super) fn url_pairs(q: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(q.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}
