//! The providers' media-stream doors: `/telnyx/media`, `/plivo/media`, `/vonage/media` and
//! `/exotel/media`, each checking its provider's proof (when its secret is set; refused when
//! the server has keys and it is not) before the session is admitted and run in its
//! [`streams`](super::super::streams) dialect.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Path, State, WebSocketUpgrade};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::super::streams::{exotel, plivo, telnyx, vonage, MediaStream};
use super::super::{Client, Connection, Server};
use super::open_session;
use crate::observe::names;

/// A request's header as text.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The refusal of a call that its provider did not prove its own (403, counted as
/// `signature`), logged at most once per interval.
fn refuse(server: &Server, client: &Client, provider: &str, why: &'static str) -> Response {
    metrics::counter!(names::HTTP_REFUSED, "reason" => "signature").increment(1);
    if let Some(held) = server.log_throttle.allow("signature") {
        tracing::info!(client = %client.ip, held, "refused a {provider} call: {why}");
    }
    (StatusCode::FORBIDDEN, format!("{why}\n")).into_response()
}

/// `Ok` when the provider's secret is set and `check` passes, or when it is not set and the
/// server has no keys.
fn proven(
    server: &Server,
    client: &Client,
    provider: &str,
    secret: Option<&String>,
    check: impl FnOnce(&str) -> bool,
) -> Result<(), Box<Response>> {
    match secret {
        Some(s) if check(s) => Ok(()),
        Some(_) => Err(Box::new(refuse(
            server,
            client,
            provider,
            "not proven the provider's (see providers:)",
        ))),
        None if server.cfg.keys.any() => Err(Box::new(refuse(
            server,
            client,
            provider,
            "this server has keys: the provider's calls need its secret under providers:",
        ))),
        None => Ok(()),
    }
}

/// `GET /{provider}/media`: a call of Telnyx's, Plivo's, Vonage's or Exotel's (`/exotel/media`
/// takes `?sample-rate=16000` or `24000` as the applet's URL says); another name is not found.
#[allow(clippy::too_many_arguments)]
pub(in crate::app::serve) async fn media(
    State(server): State<Arc<Server>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::Extension(client): axum::Extension<Client>,
    axum::Extension(conn): axum::Extension<Arc<Connection>>,
    Path(provider): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    let p = &server.cfg.providers;
    let h = |name: &str| header(&headers, name);
    let s = server.clone();
    match provider.as_str() {
        "telnyx" => {
            let token = p.telnyx_stream_token.as_ref();
            if let Err(r) = proven(&server, &client, "Telnyx", token, |t| {
                telnyx::token_ok(t, h("x-telnyx-streaming-auth-token"))
            }) {
                return *r;
            }
            open_session(
                s,
                peer,
                client,
                conn,
                &headers,
                ws,
                MediaStream::new(telnyx::Telnyx),
            )
        }
        "plivo" => {
            let url = p.plivo_url.clone().unwrap_or_else(|| {
                format!(
                    "wss://{}{uri}",
                    h(header::HOST.as_str()).unwrap_or_default()
                )
            });
            if let Err(r) = proven(
                &server,
                &client,
                "Plivo",
                p.plivo_auth_token.as_ref(),
                |t| {
                    let nonce = h("x-plivo-signature-v3-nonce").unwrap_or_default();
                    plivo::signature_ok(
                        t,
                        &url,
                        nonce,
                        h("x-plivo-signature-v3").unwrap_or_default(),
                    ) && server.plivo_nonces.fresh(nonce, std::time::Instant::now())
                },
            ) {
                return *r;
            }
            open_session(
                s,
                peer,
                client,
                conn,
                &headers,
                ws,
                MediaStream::new(plivo::Plivo),
            )
        }
        "vonage" => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let secret = p.vonage_signature_secret.as_ref();
            if let Err(r) = proven(&server, &client, "Vonage", secret, |k| {
                vonage::jwt_ok(k, h(header::AUTHORIZATION.as_str()), now)
            }) {
                return *r;
            }
            open_session(
                s,
                peer,
                client,
                conn,
                &headers,
                ws,
                MediaStream::new(vonage::Vonage),
            )
        }
        "exotel" => {
            let creds = p.exotel_credentials.as_ref();
            if let Err(r) = proven(&server, &client, "Exotel", creds, |c| {
                exotel::basic_ok(c, h(header::AUTHORIZATION.as_str()))
            }) {
                return *r;
            }
            let rate = super::query_pairs(uri.query().map(str::to_string))
                .into_iter()
                .find(|(k, _)| k == "sample-rate")
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(8000);
            let proto = MediaStream::new(exotel::Exotel { rate });
            open_session(s, peer, client, conn, &headers, ws, proto)
        }
        _ => (StatusCode::NOT_FOUND, "no such route\n").into_response(),
    }
}
