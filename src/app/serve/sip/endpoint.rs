//! SIP's sockets and the stack behind them. rsipstack parses, keeps transactions and dialogs;
//! what reaches it is decided here:
//!
//! - **UDP**: the stack reads through [`Datagrams`], which takes whole datagrams (up to 64 KiB)
//!   and answers a request too large for the stack's 8 KiB buffer `513` (when its head parses)
//!   instead of letting the stack drop it unread.
//! - **TCP**: accepted here, not by the stack: a connection from outside `sip.allow` is closed at
//!   once; each address may hold [`StreamLimits::per_ip`] and everyone together
//!   [`StreamLimits::total`] (kept under half the process's descriptor limit); a connection must
//!   send its first bytes within [`FIRST_BYTES`]; running out of descriptors backs the accept
//!   loop off and is logged once per interval. Only then is the stream handed to the stack.
//! - **Every request** of either goes through the [`Guard`] (its verdict) in the stack's
//!   transport inspector ([`Screen`]): answered statelessly here, dropped, or passed on.
//!
//! Knows nothing of calls or sessions: the door runs them.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rsipstack::sip::{Header, Method, SipMessage};
use rsipstack::transport::{udp::UdpConnection, SipAddr, SipConnection};
use tokio_util::sync::CancellationToken;

use super::guard::{Guard, Verdict};
use crate::app::serve::LogThrottle;
use crate::observe::names;

/// The stack's UDP buffer: a datagram longer than this it cannot read whole.
const STACK_DATAGRAM: usize = 8192;
/// How long a TCP connection may stay silent before its first bytes.
pub(crate) const FIRST_BYTES: Duration = Duration::from_secs(5);
/// How long the accept loop waits when the process is out of descriptors.
const OUT_OF_FDS_PAUSE: Duration = Duration::from_millis(100);

/// How many TCP connections SIP holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamLimits {
    pub per_ip: usize,
    pub total: usize,
}

/// Whether the server takes calls now (for `OPTIONS`), set by the door once it serves.
pub(crate) type Taking = Arc<OnceLock<Box<dyn Fn() -> bool + Send + Sync>>>;

/// The stack's endpoint: its transports, transactions and dialogs, and the guard in front.
pub(crate) struct Endpoint {
    pub(crate) endpoint: rsipstack::transaction::Endpoint,
    pub(crate) dialogs: Arc<rsipstack::dialog::dialog_layer::DialogLayer>,
    /// The UDP address SIP arrives at (TCP's is the same, when it is on).
    pub(crate) local: SocketAddr,
    pub(crate) tcp: bool,
    pub(crate) guard: Arc<Mutex<Guard>>,
    pub(crate) taking: Taking,
    cancel: CancellationToken,
}

impl Endpoint {
    /// Binds SIP's UDP socket at `address` (and, with `tcp`, its TCP listener on the same
    /// port, held to `limits`), announcing `public` (behind NAT) in the Via and Contact.
    ///
    /// # Errors
    ///
    /// The socket's error, naming `sip.address`.
    pub(crate) async fn bind(
        address: SocketAddr,
        tcp: Option<StreamLimits>,
        public: Option<IpAddr>,
        guard: Guard,
    ) -> anyhow::Result<Endpoint> {
        let cancel = CancellationToken::new();
        let layer = rsipstack::transport::TransportLayer::new(cancel.clone());
        let external = |port: u16| public.map(|ip| SocketAddr::new(ip, port));
        let socket = std::net::UdpSocket::bind(address)
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
            .and_then(tokio::net::UdpSocket::from_std)
            .map_err(|e| anyhow::anyhow!("binding SIP's UDP {address} (`sip.address`): {e}"))?;
        let local = socket
            .local_addr()
            .map_err(|e| anyhow::anyhow!("SIP's UDP socket at {address}: {e}"))?;
        let guard = Arc::new(Mutex::new(guard));
        let taking: Taking = Arc::default();
        let udp = UdpConnection::from_socket(
            Arc::new(Datagrams {
                socket,
                whole: tokio::sync::Mutex::new(vec![0; 65_536]),
            }),
            external(local.port()),
            Some(cancel.child_token()),
        )
        .await
        .map_err(|e| anyhow::anyhow!("SIP's UDP socket at {address}: {e}"))?;
        layer.add_transport(udp.into());
        let listener =
            match tcp {
                Some(_) => {
                    let at = SocketAddr::new(address.ip(), local.port());
                    Some(tokio::net::TcpListener::bind(at).await.map_err(|e| {
                        anyhow::anyhow!("binding SIP's TCP {at} (`sip.address`): {e}")
                    })?)
                }
                None => None,
            };
        let endpoint = rsipstack::EndpointBuilder::new()
            .with_user_agent(concat!("duplex/", env!("CARGO_PKG_VERSION")))
            .with_transport_inspector(Box::new(Screen {
                guard: guard.clone(),
                taking: taking.clone(),
                throttle: LogThrottle::default(),
            }))
            .with_cancel_token(cancel.clone())
            .with_transport_layer(layer)
            .build();
        if let (Some(listener), Some(limits)) = (listener, tcp) {
            let accept = Accept {
                inner: endpoint.inner.clone(),
                local: SipAddr {
                    r#type: Some(rsipstack::sip::transport::Transport::Tcp),
                    addr: external(local.port()).unwrap_or(local).into(),
                },
                guard: guard.clone(),
                limits: limits.within_fds(),
                held: Arc::default(),
                cancel: cancel.clone(),
            };
            tokio::spawn(accept.run(listener));
        }
        let dialogs = Arc::new(rsipstack::dialog::dialog_layer::DialogLayer::new(
            endpoint.inner.clone(),
        ));
        Ok(Endpoint {
            endpoint,
            dialogs,
            local,
            tcp: tcp.is_some(),
            guard,
            taking,
            cancel,
        })
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl StreamLimits {
    /// The limits, the total kept under half the process's descriptor limit (the rest is the
    /// HTTP side's, the RTP sockets', the models').
    fn within_fds(self) -> StreamLimits {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given; nothing else is touched.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0;
        let half = if ok {
            usize::try_from(lim.rlim_cur / 2).unwrap_or(usize::MAX)
        } else {
            512
        };
        if self.total > half {
            tracing::warn!(
                "sip: tcp_max_connections {} is more than half the descriptor limit: {half} \
                 are taken at most (raise `ulimit -n` for more)",
                self.total
            );
        }
        StreamLimits {
            per_ip: self.per_ip.min(half),
            total: self.total.min(half),
        }
    }
}

/// SIP's TCP listener: who may connect, how many, how soon they speak.
struct Accept {
    inner: rsipstack::transaction::endpoint::EndpointInnerRef,
    local: SipAddr,
    guard: Arc<Mutex<Guard>>,
    limits: StreamLimits,
    held: Arc<Mutex<Held>>,
    cancel: CancellationToken,
}

/// TCP connections held, per address and in all.
#[derive(Default)]
struct Held {
    per_ip: std::collections::HashMap<IpAddr, usize>,
    total: usize,
}

/// A connection's place in [`Held`], given back when dropped.
struct Slot {
    held: Arc<Mutex<Held>>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut h) = self.held.lock() {
            h.total -= 1;
            if let Some(n) = h.per_ip.get_mut(&self.ip) {
                *n -= 1;
                if *n == 0 {
                    h.per_ip.remove(&self.ip);
                }
            }
            metrics::gauge!(names::SIP_TCP_CONNECTIONS).set(h.total as f64);
        }
    }
}

impl Accept {
    async fn run(self, listener: tokio::net::TcpListener) {
        let throttle = LogThrottle::default();
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = self.cancel.cancelled() => return,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    let out = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    if let Some(held) = throttle.allow(if out { "fds" } else { "accept" }) {
                        tracing::warn!(held, "sip: accepting a TCP connection: {e}");
                    }
                    // Out of descriptors, accepting again at once would spin: wait for some.
                    tokio::time::sleep(if out {
                        OUT_OF_FDS_PAUSE
                    } else {
                        Duration::from_millis(5)
                    })
                    .await;
                    continue;
                }
            };
            let ip = peer.ip();
            let refuse = |reason: &'static str| {
                metrics::counter!(names::SIP_SCREENED, "reason" => reason).increment(1);
                if let Some(held) = throttle.allow(reason) {
                    tracing::info!(client = %peer, held, "sip: a TCP connection refused ({reason})");
                }
            };
            let allowed = self.guard.lock().is_ok_and(|g| g.allowed(ip));
            if !allowed {
                refuse("tcp_forbidden");
                continue;
            }
            let Some(slot) = self.take(ip) else {
                refuse("tcp_full");
                continue;
            };
            let (inner, local, cancel) =
                (self.inner.clone(), self.local.clone(), self.cancel.clone());
            tokio::spawn(async move {
                let mut first = [0u8; 1];
                match tokio::time::timeout(FIRST_BYTES, stream.peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => {
                        metrics::counter!(names::SIP_SCREENED, "reason" => "tcp_silent")
                            .increment(1);
                        return;
                    }
                }
                let token = cancel.child_token();
                let conn = match rsipstack::transport::tcp::TcpConnection::from_stream(
                    stream,
                    local,
                    Some(token.clone()),
                ) {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::debug!(client = %peer, "sip: a TCP connection: {e}");
                        return;
                    }
                };
                inner
                    .transport_layer
                    .add_connection(SipConnection::Tcp(conn));
                // The stack cancels the connection's token when it lets the connection go.
                token.cancelled().await;
                drop(slot);
            });
        }
    }

    /// A place for a connection from `ip`, if its address and everyone have room.
    fn take(&self, ip: IpAddr) -> Option<Slot> {
        let mut h = self.held.lock().ok()?;
        let mine = h.per_ip.get(&ip).copied().unwrap_or(0);
        if mine >= self.limits.per_ip || h.total >= self.limits.total {
            return None;
        }
        h.total += 1;
        *h.per_ip.entry(ip).or_insert(0) += 1;
        metrics::gauge!(names::SIP_TCP_CONNECTIONS).set(h.total as f64);
        Some(Slot {
            held: self.held.clone(),
            ip,
        })
    }
}

/// SIP's UDP socket as the stack reads it: whole datagrams, the oversized answered here.
struct Datagrams {
    socket: tokio::net::UdpSocket,
    /// One datagram's room (only the stack's one reader uses it).
    whole: tokio::sync::Mutex<Vec<u8>>,
}

#[async_trait::async_trait]
impl rsipstack::platform::net::UdpSocket for Datagrams {
    async fn recv_from(&self, buf: &mut [u8]) -> rsipstack::Result<(usize, SocketAddr)> {
        let mut whole = self.whole.lock().await;
        loop {
            let (n, from) = self.socket.recv_from(&mut whole).await?;
            if n <= buf.len().min(STACK_DATAGRAM) {
                buf[..n].copy_from_slice(&whole[..n]);
                return Ok((n, from));
            }
            metrics::counter!(names::SIP_SCREENED, "reason" => "sip_too_large").increment(1);
            if let Some(r) = too_large(&whole[..n]) {
                let _ = self.socket.send_to(r.to_string().as_bytes(), from).await;
            }
        }
    }

    async fn send_to(&self, buf: &[u8], addr: SocketAddr) -> rsipstack::Result<usize> {
        Ok(self.socket.send_to(buf, addr).await?)
    }

    fn local_addr(&self) -> rsipstack::Result<SocketAddr> {
        Ok(self.socket.local_addr()?)
    }
}

/// The `513 Message Too Large` for a datagram too long for the stack, when its head is a
/// request's (an answer needs its Via, From, To, Call-ID and CSeq).
fn too_large(datagram: &[u8]) -> Option<rsipstack::sip::Response> {
    let end = datagram.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&datagram[..end]).ok()?;
    // The head alone, its body declared empty.
    let head: String = head
        .split("\r\n")
        .filter(|l| {
            let name = l.split(':').next().unwrap_or("").trim();
            !name.eq_ignore_ascii_case("content-length") && !name.eq_ignore_ascii_case("l")
        })
        .map(|l| format!("{l}\r\n"))
        .collect();
    let msg = SipMessage::try_from(format!("{head}Content-Length: 0\r\n\r\n").as_str()).ok()?;
    let SipMessage::Request(req) = msg else {
        return None;
    };
    if req.method == Method::Ack {
        return None;
    }
    let text = format!(
        "{} bytes: this server takes requests of {STACK_DATAGRAM} bytes or less over UDP (use TCP)",
        datagram.len()
    );
    Some(stateless(
        &req,
        513,
        vec![Header::Other(
            "Warning".into(),
            super::guard::warning_value(&text),
        )],
    ))
}

/// A response to `req` made without a transaction: its Via, From, To (with a tag of ours when
/// it has none, the same for a retransmission), Call-ID and CSeq, and `extra`.
pub(crate) fn stateless(
    req: &rsipstack::sip::Request,
    status: u16,
    extra: Vec<Header>,
) -> rsipstack::sip::Response {
    let mut headers = rsipstack::sip::Headers::default();
    for h in req.headers.iter() {
        match h {
            Header::Via(_) | Header::From(_) | Header::CallId(_) | Header::CSeq(_) => {
                headers.push(h.clone())
            }
            Header::To(to) => {
                let mut to = to.clone();
                if !to.tag().is_ok_and(|t| t.is_some()) {
                    let _ = to.mut_tag(stateless_tag(req).into());
                }
                headers.push(Header::To(to));
            }
            _ => {}
        }
    }
    for h in extra {
        headers.push(h);
    }
    headers.push(Header::ContentLength(0.into()));
    rsipstack::sip::Response {
        status_code: rsipstack::sip::StatusCode::from(status),
        headers,
        ..Default::default()
    }
}

/// A To tag for a stateless answer: the same for every retransmission of the request.
fn stateless_tag(req: &rsipstack::sip::Request) -> String {
    use sha2::Digest;
    let via = req
        .headers
        .iter()
        .find(|h| matches!(h, Header::Via(_)))
        .map(|h| h.value().to_string())
        .unwrap_or_default();
    let d = sha2::Sha256::digest(via.as_bytes());
    d[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// The stack's transport inspector: every incoming request through the [`Guard`].
struct Screen {
    guard: Arc<Mutex<Guard>>,
    taking: Taking,
    throttle: LogThrottle,
}

#[async_trait::async_trait]
impl rsipstack::transaction::endpoint::TransportEventInspector for Screen {
    async fn handle(
        &self,
        event: rsipstack::transport::TransportEvent,
    ) -> Option<rsipstack::transport::TransportEvent> {
        let rsipstack::transport::TransportEvent::Incoming(SipMessage::Request(req), conn, from) =
            &event
        else {
            return Some(event);
        };
        let Ok(source) = from.get_socketaddr() else {
            return None;
        };
        let taking = || self.taking.get().is_some_and(|f| f());
        let verdict = match self.guard.lock() {
            Ok(mut g) => g.check(Instant::now(), req, source.ip(), &taking),
            Err(_) => Verdict::Drop("sip_internal"),
        };
        let method = req.method.to_string();
        let (reason, reply) = match verdict {
            Verdict::Pass => return Some(event),
            Verdict::Drop(reason) => (reason, None),
            Verdict::Answer(s) => {
                let extra = s
                    .headers
                    .into_iter()
                    .map(|(n, v)| Header::Other(n, v))
                    .collect();
                (s.reason, Some((s.status, stateless(req, s.status, extra))))
            }
        };
        metrics::counter!(names::SIP_SCREENED, "reason" => reason).increment(1);
        if reason == "sip_malformed" {
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "sip_malformed")
                .increment(1);
        }
        if reason != "sip_options" {
            if let Some(held) = self.throttle.allow(reason) {
                tracing::info!(from = %source, held, "sip: a {method} not taken ({reason})");
            }
        }
        if let Some((status, resp)) = reply {
            metrics::counter!(names::SIP_REQUESTS, "method" => method, "status" => status.to_string())
                .increment(1);
            let dest = (!conn.is_reliable()).then_some(from);
            if let Err(e) = conn.send(resp.into(), dest).await {
                tracing::debug!("sip: a stateless answer: {e}");
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sip_udp_too_large_is_answered_513_when_its_head_is_a_request() {
        let body = "x".repeat(9000);
        let msg = format!(
            "INVITE sip:duplex@192.0.2.1 SIP/2.0\r\nVia: SIP/2.0/UDP 198.51.100.7:5060;branch=z9hG4bKbig\r\n\
             From: <sip:c@198.51.100.7>;tag=a\r\nTo: <sip:duplex@192.0.2.1>\r\nCall-ID: big\r\n\
             CSeq: 1 INVITE\r\nContact: <sip:c@198.51.100.7>\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let r = too_large(msg.as_bytes()).unwrap();
        let text = r.to_string();
        assert!(text.starts_with("SIP/2.0 513"), "{text}");
        assert!(text.contains("Call-ID: big"), "{text}");
        assert!(text.contains("branch=z9hG4bKbig"), "{text}");
        assert!(text.contains(";tag="), "{text}");
        assert!(text.contains("use TCP"), "{text}");
        // Garbage, or an ACK, gets nothing.
        assert!(too_large(&[b'x'; 9000]).is_none());
        let ack = msg
            .replace("INVITE sip", "ACK sip")
            .replace("1 INVITE", "1 ACK");
        assert!(too_large(ack.as_bytes()).is_none());
    }

    #[test]
    fn a_stateless_answer_keeps_its_tag_across_retransmissions() {
        let msg = "OPTIONS sip:duplex@192.0.2.1 SIP/2.0\r\nVia: SIP/2.0/UDP 198.51.100.7:5060;branch=z9hG4bKo\r\n\
                   From: <sip:c@198.51.100.7>;tag=a\r\nTo: <sip:duplex@192.0.2.1>\r\nCall-ID: o\r\n\
                   CSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n";
        let SipMessage::Request(req) = SipMessage::try_from(msg).unwrap() else {
            unreachable!()
        };
        let a = stateless(&req, 200, Vec::new()).to_string();
        let b = stateless(&req, 200, Vec::new()).to_string();
        assert_eq!(a, b);
        assert!(a.contains("To: <sip:duplex@192.0.2.1>;tag="), "{a}");
    }
}
