//! The WebRTC door: `POST /api/webrtc` (a client's SDP offer, admitted as every client is, its
//! session started on the [`webrtc`](super::super::webrtc) endpoint) and a call's resource
//! (`DELETE` hangs up; a second offer is refused).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::super::webrtc::{
    bad, check_offer, driver, token, Endpoint, WebRtc, MAX_OFFER_BYTES, TO_SESSION_QUEUE,
};
use super::super::{session, Admission, Client, Connection, Server};
use crate::observe::names;

/// `POST /api/webrtc`: a client's SDP offer (its query: the session's params, as on
/// `/api/chat`); answered 201 with the SDP answer and the session's `Location`.
pub(in crate::app::serve) async fn offer(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let Some(endpoint) = server.webrtc.as_ref() else {
        return bad(
            StatusCode::NOT_FOUND,
            "bad_request",
            "WebRTC is off on this server (`webrtc.enabled`)".into(),
        );
    };
    let offer = match read_offer(&server, &headers, body).await {
        Ok(o) => o,
        Err(r) => return *r,
    };
    let query = super::query_pairs(query);
    if let Err(m) = server.cfg.session_params(&query) {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_query").increment(1);
        return (StatusCode::BAD_REQUEST, format!("{m}\n")).into_response();
    }
    let peer = if client.forwarded {
        SocketAddr::new(client.ip, 0)
    } else {
        peer
    };
    // The session counts as one of its address's connections while it lasts.
    let Some(conn) = server.connect(client.ip) else {
        return *server.refusal(
            client.ip,
            "per_ip",
            StatusCode::TOO_MANY_REQUESTS,
            5,
            format!(
                "{} holds its {} connection(s) already (max_connections_per_ip)",
                client.ip, server.cfg.max_connections_per_ip
            ),
        );
    };
    let admission = match server.admit_client(&client) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let (rtc, answer) = match endpoint.answer(offer) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let token = match start_call(&server, endpoint, rtc, query, peer, (conn, admission)) {
        Ok(t) => t,
        Err(r) => return *r,
    };
    tracing::info!(client = %peer, peer = %token, "webrtc: answered an offer");
    (
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/sdp".to_string()),
            (
                header::LOCATION,
                format!("{}/api/webrtc/{token}", endpoint.settings.location_base),
            ),
        ],
        answer,
    )
        .into_response()
}

/// Hands a peer answered for `peer` to the driver and runs its session (holding the
/// connection's count and the admission's slot while it lasts); its token, or why not.
fn start_call(
    server: &Arc<Server>,
    endpoint: &Endpoint,
    rtc: str0m::Rtc,
    query: Vec<(String, String)>,
    peer: SocketAddr,
    (conn, admission): (Connection, Admission),
) -> Result<String, Box<Response>> {
    let internal =
        |m: &'static str| Box::new((StatusCode::INTERNAL_SERVER_ERROR, m).into_response());
    let Ok(token) = token() else {
        return Err(internal("no randomness for the session's name\n"));
    };
    let stats = Arc::new(driver::PeerStats::default());
    let (to_session, from_peer) = tokio::sync::mpsc::channel(TO_SESSION_QUEUE);
    let added = endpoint.driver.add(driver::NewPeer {
        token: token.clone(),
        rtc,
        to_session,
        stats: stats.clone(),
        jitter_delay: endpoint.settings.jitter,
        jitter_max: endpoint.settings.max_jitter,
        connect_timeout: server.cfg.limits.handshake_timeout,
        pacing: session::AudioBudget::pacing(&server.template()),
    });
    if !added {
        return Err(internal("the WebRTC driver has stopped\n"));
    }
    let stream: session::ClientStream = Box::pin(futures_util::stream::unfold(
        from_peer,
        |mut rx| async move { rx.recv().await.map(|m| (Ok(m), rx)) },
    ));
    let sink = endpoint.driver.sink(token.clone());
    let proto = WebRtc::new(query, stats);
    let s = server.clone();
    tokio::spawn(async move {
        session::run(s, (sink, stream), peer, proto, admission).await;
        drop(conn);
    });
    Ok(token)
}

/// The offer's body: sent as SDP, within the handshake limit and [`MAX_OFFER_BYTES`], and an
/// offer we can answer (audio, Opus).
async fn read_offer(
    server: &Server,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<str0m::change::SdpOffer, Box<Response>> {
    let refuse = |status, m: String| Box::new(bad(status, "bad_request", m));
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = String::from_utf8_lossy(ct.as_bytes()).to_ascii_lowercase();
        if !ct.starts_with("application/sdp") {
            return Err(refuse(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("the offer must be sent as application/sdp, not {ct}"),
            ));
        }
    }
    // The body is due within the handshake limit, as the head is: a client sending it a byte
    // at a time holds nothing longer.
    let read = tokio::time::timeout(
        server.cfg.limits.handshake_timeout,
        axum::body::to_bytes(body, MAX_OFFER_BYTES),
    )
    .await;
    let Ok(read) = read else {
        return Err(refuse(
            StatusCode::REQUEST_TIMEOUT,
            "the offer did not arrive within limits.handshake_timeout_s".into(),
        ));
    };
    let Ok(body) = read else {
        return Err(refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the offer is larger than {} KiB (or was cut off)",
                MAX_OFFER_BYTES / 1024
            ),
        ));
    };
    check_offer(&body).map_err(|m| refuse(StatusCode::BAD_REQUEST, m))
}

/// The routes of a call's resource: `DELETE` hangs up, a second offer is refused.
pub(in crate::app::serve) fn resource() -> axum::routing::MethodRouter<Arc<Server>> {
    axum::routing::delete(hangup).post(again).patch(again)
}

/// `DELETE /api/webrtc/{token}`: the client hangs up.
pub(super) async fn hangup(
    State(server): State<Arc<Server>>,
    Path(token): Path<String>,
) -> Response {
    match server.webrtc.as_ref() {
        Some(e) if e.driver.hangup(&token) => StatusCode::OK.into_response(),
        _ => unknown(&token),
    }
}

/// `POST` or `PATCH /api/webrtc/{token}`: a second offer on a session (renegotiation, an ICE
/// restart) is not taken.
pub(super) async fn again(
    State(server): State<Arc<Server>>,
    Path(token): Path<String>,
) -> Response {
    match server.webrtc.as_ref() {
        Some(e) if e.driver.is_live(&token) => bad(
            StatusCode::CONFLICT,
            "bad_request",
            "this session has its answer already: hang up (DELETE) and send a new offer to \
             /api/webrtc"
                .into(),
        ),
        _ => unknown(&token),
    }
}

fn unknown(token: &str) -> Response {
    let shown: String = token
        .chars()
        .take(40)
        .filter(|c| c.is_ascii_hexdigit())
        .collect();
    bad(
        StatusCode::NOT_FOUND,
        "bad_request",
        format!("no live WebRTC session {shown:?} (it ended, or never was)"),
    )
}
