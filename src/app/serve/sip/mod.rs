//! Phone calls over SIP (RFC 3261) with RTP: duplex answers `INVITE`s itself, on UDP and TCP,
//! as a PBX's or a trunk's far end (it registers nowhere). The SIP stack is `rsipstack` (tokio,
//! RFC 3261's transactions with their retransmissions and timers, dialogs, CANCEL matching,
//! UDP and TCP transports): parsing and transactions are its; what a call is here is ours —
//! the offer and answer ([`sdp`]), the call's media ([`media`]: RTP, RTCP, RFC 4733 events,
//! the jitter buffer, G.711 or Opus both ways) and the call's side of its session ([`SipCall`], the
//! same session as every transport's through the [`Protocol`] seam, with PCM ends). The door
//! (`doors/sip.rs`) admits calls and runs them; this module knows nothing of the server.
//!
//! [`Endpoint`] binds the stack's sockets; [`check_digest`] and [`challenge`] are HTTP Digest
//! (RFC 2617, MD5 with `qop=auth`) as SIP uses it, for servers that ask callers for
//! credentials.

pub(crate) mod media;
pub(crate) mod sdp;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;
use rsipstack::transport::{tcp_listener::TcpListenerConnection, udp::UdpConnection};
use tokio_util::sync::CancellationToken;

use super::session::{Encoder, Protocol, Taken, TransportStats};
use crate::audio::phone::PhoneOut;
use crate::session::Outbound;

/// The stack's endpoint: its transports, transactions and dialogs.
pub(crate) struct Endpoint {
    pub(crate) endpoint: rsipstack::transaction::Endpoint,
    pub(crate) dialogs: Arc<rsipstack::dialog::dialog_layer::DialogLayer>,
    /// The UDP address SIP arrives at (TCP's is the same, when it is on).
    pub(crate) local: SocketAddr,
    pub(crate) tcp: bool,
    pub(crate) cancel: CancellationToken,
}

impl Endpoint {
    /// Binds SIP's UDP socket at `address` (and, with `tcp`, its TCP listener on the same
    /// port), announcing `public` (behind NAT) in the Via and Contact.
    ///
    /// # Errors
    ///
    /// The socket's error, naming `sip.address`.
    pub(crate) async fn bind(
        address: SocketAddr,
        tcp: bool,
        public: Option<IpAddr>,
    ) -> anyhow::Result<Endpoint> {
        let cancel = CancellationToken::new();
        let layer = rsipstack::transport::TransportLayer::new(cancel.clone());
        let external = |port: u16| public.map(|ip| SocketAddr::new(ip, port));
        let udp = UdpConnection::create_connection(
            address,
            external(address.port()),
            Some(cancel.child_token()),
        )
        .await
        .map_err(|e| anyhow::anyhow!("binding SIP's UDP {address} (`sip.address`): {e}"))?;
        let local = udp
            .get_addr()
            .get_socketaddr()
            .map_err(|e| anyhow::anyhow!("SIP's UDP socket at {address}: {e}"))?;
        layer.add_transport(udp.into());
        if tcp {
            let at = SocketAddr::new(address.ip(), local.port());
            // The stack binds its listener when it starts serving: a taken port is found here.
            std::net::TcpListener::bind(at)
                .map_err(|e| anyhow::anyhow!("binding SIP's TCP {at} (`sip.address`): {e}"))?;
            let listener = TcpListenerConnection::new(at, external(at.port()))
                .await
                .map_err(|e| anyhow::anyhow!("SIP's TCP listener at {at}: {e}"))?;
            layer.inner.add_listener(listener.into());
        }
        let endpoint = rsipstack::EndpointBuilder::new()
            .with_user_agent(concat!("duplex/", env!("CARGO_PKG_VERSION")))
            .with_transport_inspector(Box::new(Screen))
            .with_cancel_token(cancel.clone())
            .with_transport_layer(layer)
            .build();
        let dialogs = Arc::new(rsipstack::dialog::dialog_layer::DialogLayer::new(
            endpoint.inner.clone(),
        ));
        Ok(Endpoint {
            endpoint,
            dialogs,
            local,
            tcp,
            cancel,
        })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Requests the stack cannot take (a mandatory header missing: RFC 3261 §8.1.1, an INVITE's
/// Contact among them) are answered
/// `400` here, counted (`duplex_sip_requests_total{status="400"}` and the protocol errors'
/// `sip_malformed`), and go no further; the stack would drop them with a warning each, which
/// a sender of many would turn into a flood of the log. (What is not SIP at all the transport
/// drops unanswered, as RFC 3261 allows.)
struct Screen;

/// The headers every request carries (RFC 3261 §8.1.1).
const MANDATORY: [&str; 5] = ["Via", "From", "To", "Call-ID", "CSeq"];

#[async_trait::async_trait]
impl rsipstack::transaction::endpoint::TransportEventInspector for Screen {
    async fn handle(
        &self,
        event: rsipstack::transport::TransportEvent,
    ) -> Option<rsipstack::transport::TransportEvent> {
        use rsipstack::sip::{Header, SipMessage};
        let rsipstack::transport::TransportEvent::Incoming(SipMessage::Request(req), conn, from) =
            &event
        else {
            return Some(event);
        };
        let has = |name: &str| {
            req.headers
                .iter()
                .any(|h| h.name().eq_ignore_ascii_case(name))
        };
        let mut missing: Vec<&str> = MANDATORY.into_iter().filter(|h| !has(h)).collect();
        // An INVITE also says where the call's requests go (§8.1.1.8).
        if req.method == rsipstack::sip::Method::Invite && !has("Contact") && !has("m") {
            missing.push("Contact");
        }
        if missing.is_empty() {
            return Some(event);
        }
        let method = req.method.to_string();
        metrics::counter!(crate::observe::names::SIP_REQUESTS, "method" => method.clone(), "status" => "400")
            .increment(1);
        metrics::counter!(crate::observe::names::SESSION_PROTOCOL_ERRORS, "kind" => "sip_malformed")
            .increment(1);
        tracing::debug!(from = %from, "sip: a {method} without {}: 400", missing.join(", "));
        // An answer needs a Via to go back by; without one there is no one to tell.
        if has("Via") && !matches!(req.method, rsipstack::sip::Method::Ack) {
            let mut headers = rsipstack::sip::Headers::default();
            for h in req.headers.iter() {
                if MANDATORY.iter().any(|m| h.name().eq_ignore_ascii_case(m)) {
                    headers.push(h.clone());
                }
            }
            headers.push(Header::Other(
                "Warning".into(),
                format!("399 duplex \"the request has no {}\"", missing.join(", ")),
            ));
            headers.push(Header::ContentLength(0.into()));
            let resp = rsipstack::sip::Response {
                status_code: rsipstack::sip::StatusCode::BadRequest,
                headers,
                ..Default::default()
            };
            let dest = (!conn.is_reliable()).then_some(from);
            if let Err(e) = conn.send(resp.into(), dest).await {
                tracing::debug!("sip: answering a malformed request: {e}");
            }
        }
        None
    }
}

/// The address a caller at `peer` reaches this machine at: `bound` when it is one, else the
/// address the system would send to `peer` from.
pub(crate) fn local_ip_toward(bound: IpAddr, peer: IpAddr) -> IpAddr {
    if !bound.is_unspecified() {
        return bound;
    }
    let any: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    } else {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    };
    std::net::UdpSocket::bind(any)
        .and_then(|s| {
            s.connect(SocketAddr::new(peer, 9))?;
            s.local_addr()
        })
        .map(|a| a.ip())
        .unwrap_or(peer)
}

/// A call's side of its session: the params its INVITE carried, its media's counters, and
/// the moment it is answered (when the session is ready: the caller hears the agent from the
/// first packet, and a call whose session cannot start is refused, not answered and dropped).
pub(crate) struct SipCall {
    pairs: Vec<(String, String)>,
    format: sdp::Format,
    stats: Arc<media::CallStats>,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    /// Why the session refused the call, for the door's answer.
    pub(crate) refused: Arc<Mutex<Option<String>>>,
}

impl SipCall {
    pub(crate) fn new(
        pairs: Vec<(String, String)>,
        format: sdp::Format,
        stats: Arc<media::CallStats>,
        ready: tokio::sync::oneshot::Sender<()>,
    ) -> Self {
        SipCall {
            pairs,
            format,
            stats,
            ready: Some(ready),
            refused: Arc::new(Mutex::new(None)),
        }
    }
}

/// The session's params from an INVITE's `X-Duplex-…` headers (`X-Duplex-Text-Prompt` →
/// `text_prompt`), as `/api/chat`'s query pairs.
pub(crate) fn params_of(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            let n = name.to_ascii_lowercase();
            let n = n.strip_prefix("x-duplex-")?;
            Some((n.replace('-', "_"), value.trim().to_string()))
        })
        .collect()
}

/// The agent's audio for the call's media: G.711 bytes, or (for Opus, which the media encodes
/// in whole packets) the 24 kHz samples as f32 little-endian.
enum CallEncoder {
    G711(Box<Option<PhoneOut>>),
    Opus,
}

impl Encoder for CallEncoder {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match self {
            CallEncoder::G711(phone) => super::session::phone_bytes(phone, m)
                .map(|b| vec![Message::Binary(b.into())])
                .unwrap_or_default(),
            CallEncoder::Opus => match m {
                Outbound::Pcm(p) => {
                    let bytes: Vec<u8> = p.iter().flat_map(|s| s.to_le_bytes()).collect();
                    vec![Message::Binary(bytes.into())]
                }
                // A call carries no text; the transcript is in the session's logs.
                _ => Vec::new(),
            },
        }
    }
}

impl Protocol for SipCall {
    fn params(&mut self, cfg: &super::ServeConfig) -> Result<super::config::SessionParams, String> {
        cfg.session_params(&self.pairs)
            .map_err(|m| m.replace("query parameter", "X-Duplex- header"))
    }

    fn ready(&mut self, _meta: &serde_json::Value) -> Vec<Message> {
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(());
        }
        Vec::new()
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        // Paid for by the call's media before it was decoded.
        if let Message::Binary(b) = m {
            cx.offer(b.to_vec());
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(match self.format {
            sdp::Format::G711(law) => CallEncoder::G711(Box::new(PhoneOut::new(law).ok())),
            sdp::Format::Opus => CallEncoder::Opus,
        })
    }

    fn refusal(&self, text: &str) -> Vec<Message> {
        if let Ok(mut r) = self.refused.lock() {
            r.get_or_insert_with(|| text.to_string());
        }
        Vec::new()
    }

    fn pcm(&self) -> bool {
        true
    }

    fn transport(&self) -> Option<TransportStats> {
        let s = self.stats.clone();
        Some(Arc::new(move || s.json()))
    }
}

fn md5_hex(s: &str) -> String {
    use md5::Digest;
    md5::Md5::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A nonce for a challenge: the time it was made and a MAC of it with `secret`, so that the
/// server keeps no state and knows its own nonces (and their age) when they come back.
pub(crate) fn nonce(secret: &[u8], now_s: u64) -> String {
    use hmac::Mac;
    let mut mac = match hmac::Hmac::<sha1::Sha1>::new_from_slice(secret) {
        Ok(m) => m,
        Err(_) => return format!("{now_s:x}"),
    };
    mac.update(&now_s.to_be_bytes());
    let tag: String = mac.finalize().into_bytes()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{now_s:x}.{tag}")
}

/// How long a nonce is good for.
const NONCE_LIFE_S: u64 = 300;

/// The `WWW-Authenticate` value of a 401 for `realm`.
pub(crate) fn challenge(realm: &str, secret: &[u8], now_s: u64) -> String {
    format!(
        "Digest realm=\"{realm}\", nonce=\"{}\", algorithm=MD5, qop=\"auth\"",
        nonce(secret, now_s)
    )
}

/// The `name="value"` (or `name=value`) pairs of a Digest header.
fn digest_params(header: &str) -> Option<Vec<(String, String)>> {
    let rest = header.trim().strip_prefix("Digest")?.trim();
    let mut out = Vec::new();
    let mut s = rest;
    while !s.is_empty() {
        let (name, after) = s.split_once('=')?;
        let after = after.trim_start();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (&q[..end], &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim(), &after[end..])
        };
        out.push((name.trim().to_ascii_lowercase(), value.to_string()));
        s = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(out)
}

/// Whether an `Authorization` header answers one of our challenges (made with `secret`, not
/// older than [`NONCE_LIFE_S`]) for `method` with `user`'s `password` in `realm`.
pub(crate) fn check_digest(
    header: &str,
    method: &str,
    (user, password, realm): (&str, &str, &str),
    secret: &[u8],
    now_s: u64,
) -> bool {
    use subtle::ConstantTimeEq;
    let Some(p) = digest_params(header) else {
        return false;
    };
    let get = |k: &str| p.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let (Some(u), Some(r), Some(n), Some(uri), Some(response)) = (
        get("username"),
        get("realm"),
        get("nonce"),
        get("uri"),
        get("response"),
    ) else {
        return false;
    };
    if u != user || r != realm {
        return false;
    }
    let Some(made) = n
        .split_once('.')
        .and_then(|(t, _)| u64::from_str_radix(t, 16).ok())
    else {
        return false;
    };
    if made > now_s || now_s - made > NONCE_LIFE_S || nonce(secret, made) != n {
        return false;
    }
    let ha1 = md5_hex(&format!("{user}:{realm}:{password}"));
    let ha2 = md5_hex(&format!("{method}:{uri}"));
    let want = match get("qop") {
        Some(qop) => {
            let (Some(nc), Some(cnonce)) = (get("nc"), get("cnonce")) else {
                return false;
            };
            md5_hex(&format!("{ha1}:{n}:{nc}:{cnonce}:{qop}:{ha2}"))
        }
        None => md5_hex(&format!("{ha1}:{n}:{ha2}")),
    };
    want.as_bytes()
        .ct_eq(response.to_ascii_lowercase().as_bytes())
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_answer_is_checked_against_our_own_nonce() {
        // RFC 2617 §3.5's worked example, with our nonce in place of the RFC's.
        let secret = b"s3cret";
        let now = 1_000_000;
        let n = nonce(secret, now);
        let (user, pass, realm) = ("Mufasa", "Circle Of Life", "testrealm@host.com");
        let uri = "sip:duplex@127.0.0.1";
        let ha1 = md5_hex(&format!("{user}:{realm}:{pass}"));
        let ha2 = md5_hex(&format!("INVITE:{uri}"));
        let resp = md5_hex(&format!("{ha1}:{n}:00000001:0a4f113b:auth:{ha2}"));
        let header = format!(
            "Digest username=\"{user}\", realm=\"{realm}\", nonce=\"{n}\", uri=\"{uri}\", \
             qop=auth, nc=00000001, cnonce=\"0a4f113b\", response=\"{resp}\", algorithm=MD5"
        );
        let creds = (user, pass, realm);
        assert!(check_digest(&header, "INVITE", creds, secret, now + 10));
        // The wrong password, method, age or server secret.
        assert!(!check_digest(
            &header,
            "INVITE",
            (user, "x", realm),
            secret,
            now
        ));
        assert!(!check_digest(&header, "BYE", creds, secret, now));
        assert!(!check_digest(&header, "INVITE", creds, secret, now + 301));
        assert!(!check_digest(&header, "INVITE", creds, b"other", now));
        assert!(!check_digest("Basic abc", "INVITE", creds, secret, now));
        // RFC 2617's own MD5 of its example's HA1.
        assert_eq!(ha1, "939e7578ed9e3c518a452acee763bce9");
        assert!(challenge(realm, secret, now).contains("qop=\"auth\""));
    }

    #[test]
    fn x_duplex_headers_are_the_sessions_params() {
        let h = vec![
            ("X-Duplex-Text-Prompt".to_string(), " be brief ".to_string()),
            ("x-duplex-seed".to_string(), "3".to_string()),
            ("User-Agent".to_string(), "baresip".to_string()),
        ];
        assert_eq!(
            params_of(&h),
            vec![
                ("text_prompt".to_string(), "be brief".to_string()),
                ("seed".to_string(), "3".to_string())
            ]
        );
    }
}
