//! The SIP door: every request the stack hands up ([`sip`](super::super::sip)), and each new
//! call admitted as every client is. An `INVITE` is checked in order — the caller's address
//! against `sip.allow` (`403`), its Digest credentials when the server asks for them (`401`
//! with a challenge, then the answer checked), its SDP offer (`400` for what is not SDP, `488`
//! for an offer without PCMU, PCMA or Opus), the server's admission (`503` with `Retry-After` when
//! full, draining or not ready; the caller's address's own limits too, except for a caller in
//! `sip.allow`, a PBX or a trunk that carries many callers) — each refusal counted
//! (`duplex_sip_requests_total`) before any slot is taken. An admitted call gets its RTP
//! ports, rings for `sip.ring_ms` (the caller may `CANCEL`: `487`), and its session starts;
//! the call is answered (`200` with our SDP) once the session is ready, or refused (`500`, or
//! `400` naming a bad `X-Duplex-` param) when it cannot start. A `BYE` from the caller ends
//! the session; a session that ends on its own (its limits, a drain, a caller whose RTP
//! stopped) sends the `BYE`. `OPTIONS` outside a call is answered `200` while the server takes
//! calls, `503` otherwise (a trunk's health probe).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use rsipstack::dialog::dialog::{DialogState, DialogStateSender};
use rsipstack::sip::prelude::HeadersExt;
use rsipstack::sip::{Header, Method, StatusCode};
use rsipstack::transaction::transaction::Transaction;
use tokio_util::sync::CancellationToken;

use super::super::config::SipSettings;
use super::super::sip::media::{self, CallStats, MediaSettings, Sockets};
use super::super::sip::{self, sdp, Endpoint, SipCall};
use super::super::{session, Server};
use crate::observe::names;

/// The methods a call takes.
const ALLOW: &str = "INVITE, ACK, CANCEL, BYE, OPTIONS, INFO";

/// Live calls by Call-ID: what ends each from the signalling's side.
type Calls = Arc<Mutex<HashMap<String, CancellationToken>>>;

/// Serves SIP on `ep` until the process ends.
pub(in crate::app::serve) async fn run(server: Arc<Server>, ep: Endpoint) {
    let Some(settings) = server.cfg.sip.clone() else {
        return;
    };
    let mut incoming = match ep.endpoint.incoming_transactions() {
        Ok(i) => i,
        Err(e) => {
            tracing::error!("sip: the stack has no incoming transactions: {e}");
            return;
        }
    };
    let ep = Arc::new(ep);
    let (states, mut state_rx) = ep.dialogs.new_dialog_state_channel();
    let calls: Calls = Arc::default();
    let serving = ep.clone();
    tokio::spawn(async move { serving.endpoint.serve().await });
    let watched = calls.clone();
    tokio::spawn(async move {
        while let Some(state) = state_rx.recv().await {
            if let DialogState::Terminated(id, reason) = state {
                tracing::debug!(call = %id.call_id, ?reason, "sip: dialog terminated");
                if let Some(t) = watched
                    .lock()
                    .ok()
                    .and_then(|c| c.get(&id.call_id).cloned())
                {
                    t.cancel();
                }
            }
        }
    });
    let secret: Arc<[u8]> = Arc::from(secret());
    while let Some(tx) = incoming.recv().await {
        let in_dialog = tx
            .original
            .to_header()
            .ok()
            .and_then(|t| t.tag().ok().flatten())
            .is_some();
        match tx.original.method {
            Method::Invite if !in_dialog => {
                let call = Invite {
                    server: server.clone(),
                    ep: ep.clone(),
                    settings: settings.clone(),
                    states: states.clone(),
                    calls: calls.clone(),
                    secret: secret.clone(),
                };
                tokio::spawn(call.run(tx));
            }
            Method::Ack => {}
            Method::Options if !in_dialog => {
                tokio::spawn(options(server.clone(), tx));
            }
            _ => {
                let dialogs = ep.dialogs.clone();
                tokio::spawn(async move {
                    let mut tx = tx;
                    match dialogs.match_dialog(&tx) {
                        Some(mut d) => {
                            if let Err(e) = d.handle(&mut tx).await {
                                tracing::debug!("sip: {} in a call: {e}", tx.original.method);
                            }
                        }
                        None if tx.original.method == Method::Register => {
                            answer(&mut tx, 405, vec![allow()]).await;
                        }
                        None => answer(&mut tx, 481, Vec::new()).await,
                    }
                });
            }
        }
    }
}

/// 16 random bytes: the key of this process's Digest nonces.
fn secret() -> Vec<u8> {
    use std::io::Read;
    let mut b = vec![0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        b = now_s().to_be_bytes().repeat(2);
    }
    b
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn allow() -> Header {
    Header::Other("Allow".into(), ALLOW.into())
}

/// Answers `tx` with `code` and `headers`, counted.
async fn answer(tx: &mut Transaction, code: u16, headers: Vec<Header>) {
    let method = tx.original.method.to_string();
    metrics::counter!(names::SIP_REQUESTS, "method" => method, "status" => code.to_string())
        .increment(1);
    if let Err(e) = tx.reply_with(StatusCode::from(code), headers, None).await {
        tracing::debug!("sip: answering {code}: {e}");
    }
}

/// A `Warning` header carrying `text` (RFC 3261 §20.43: code 399, miscellaneous).
fn warning(text: &str) -> Header {
    let text = text.replace('"', "'");
    Header::Other("Warning".into(), format!("399 duplex \"{text}\""))
}

/// `OPTIONS` outside a call: whether this server takes calls now.
async fn options(server: Arc<Server>, mut tx: Transaction) {
    let taking = !server.draining.load(std::sync::atomic::Ordering::Acquire)
        && server.ready.load(std::sync::atomic::Ordering::Acquire);
    let accept = Header::Other("Accept".into(), "application/sdp".into());
    if taking {
        answer(&mut tx, 200, vec![allow(), accept]).await;
    } else {
        answer(
            &mut tx,
            503,
            vec![Header::Other("Retry-After".into(), "30".into())],
        )
        .await;
    }
}

/// One new call's handling.
struct Invite {
    server: Arc<Server>,
    ep: Arc<Endpoint>,
    settings: SipSettings,
    states: DialogStateSender,
    calls: Calls,
    secret: Arc<[u8]>,
}

impl Invite {
    /// Refuses the call with `code` (counted as a refused session for `reason`), logged at
    /// most once per reason per interval.
    async fn refuse(
        &self,
        tx: &mut Transaction,
        peer: IpAddr,
        (code, reason): (u16, &'static str),
        text: &str,
        mut headers: Vec<Header>,
    ) {
        metrics::counter!(names::SESSIONS_REFUSED, "reason" => reason).increment(1);
        if let Some(held) = self.server.log_throttle.allow(reason) {
            tracing::info!(caller = %peer, reason, held, "sip: refused a call ({code}): {text}");
        }
        headers.push(warning(text));
        answer(tx, code, headers).await;
    }

    async fn run(self, mut tx: Transaction) {
        let Some(peer) = tx
            .connection
            .as_ref()
            .and_then(|c| c.get_remote_addr())
            .and_then(|a| a.get_socketaddr().ok())
        else {
            return answer(&mut tx, 500, Vec::new()).await;
        };
        let ip = peer.ip();
        let s = &self.settings;
        if !s.allow.is_empty() && !s.allow.iter().any(|c| c.contains(ip)) {
            let text = format!("{ip} is not in sip.allow");
            return self
                .refuse(&mut tx, ip, (403, "sip_forbidden"), &text, Vec::new())
                .await;
        }
        if let Some((user, password)) = &s.digest {
            let now = now_s();
            let ok = tx.original.header_value("Authorization").is_some_and(|h| {
                sip::check_digest(&h, "INVITE", (user, password, &s.realm), &self.secret, now)
            });
            if !ok {
                let c = sip::challenge(&s.realm, &self.secret, now);
                let h = vec![Header::Other("WWW-Authenticate".into(), c)];
                return self
                    .refuse(&mut tx, ip, (401, "sip_auth"), "credentials needed", h)
                    .await;
            }
        }
        let offer = match sdp::read_offer(&tx.original.body) {
            Ok(o) => o,
            Err(r) => {
                metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_sdp").increment(1);
                return self
                    .refuse(
                        &mut tx,
                        ip,
                        (r.status, "sip_bad_offer"),
                        &r.reason,
                        Vec::new(),
                    )
                    .await;
            }
        };
        // A caller in the allow-list is a PBX or a trunk: many callers behind one address, so
        // one address's limits are not its (as for a trusted proxy).
        let carrier = !s.allow.is_empty();
        let Some(conn) = self.server.connect_as(ip, carrier) else {
            let text = format!(
                "{ip} holds its {} connection(s) already (max_connections_per_ip)",
                self.server.cfg.max_connections_per_ip
            );
            let h = vec![Header::Other("Retry-After".into(), "5".into())];
            return self.refuse(&mut tx, ip, (503, "per_ip"), &text, h).await;
        };
        let admission = match self.server.admit_as(ip, carrier) {
            Ok(a) => a,
            Err(r) => {
                // Counted and logged by the admission; SIP's overload answer is 503 with its
                // Retry-After.
                let retry = r
                    .headers()
                    .get(axum::http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("5")
                    .to_string();
                let h = vec![
                    Header::Other("Retry-After".into(), retry),
                    warning("no free session slot"),
                ];
                return answer(&mut tx, 503, h).await;
            }
        };
        let sockets = match Sockets::bind(s.address.ip(), s.rtp_ports, offer.rtcp_mux) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(caller = %peer, "sip: no RTP port for a call: {e}");
                let h = vec![Header::Other("Retry-After".into(), "5".into())];
                return answer(&mut tx, 503, h).await;
            }
        };
        let announce = s
            .public_address
            .unwrap_or_else(|| sip::local_ip_toward(s.address.ip(), ip));
        let tcp = tx.connection.as_ref().is_some_and(|c| c.is_reliable());
        let contact = format!(
            "sip:duplex@{}{}",
            SocketAddr::new(announce, self.ep.local.port()),
            if tcp { ";transport=tcp" } else { "" }
        );
        let contact = rsipstack::sip::Uri::try_from(contact.as_str()).ok();
        let dialog = match self.ep.dialogs.get_or_create_server_invite(
            &tx,
            self.states.clone(),
            None,
            contact,
        ) {
            Ok(d) => d,
            Err(e) => {
                tracing::info!(caller = %peer, "sip: a call's dialog could not be made: {e}");
                return answer(&mut tx, 400, vec![warning(&e.to_string())]).await;
            }
        };
        let id = dialog.id();
        let hangup = CancellationToken::new();
        if let Ok(mut c) = self.calls.lock() {
            c.insert(id.call_id.clone(), hangup.clone());
        }
        let headers: Vec<(String, String)> = tx
            .original
            .headers
            .iter()
            .map(|h| (h.name().to_string(), h.value().to_string()))
            .collect();
        // The INVITE's transaction (100 Trying, a CANCEL, the ACK) runs beside the call.
        let mut driver = dialog.clone();
        tokio::spawn(async move {
            if let Err(e) = driver.handle(&mut tx).await {
                tracing::debug!("sip: an INVITE's transaction: {e}");
            }
        });
        self.call(
            &dialog,
            &offer,
            sockets,
            headers,
            (announce, peer),
            &hangup,
            admission,
        )
        .await;
        if let Ok(mut c) = self.calls.lock() {
            c.remove(&id.call_id);
        }
        drop(conn);
        // The dialog lingers a little for retransmissions of the BYE's answer.
        let dialogs = self.ep.dialogs.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(32)).await;
            dialogs.remove_dialog(&id);
        });
    }

    /// An admitted call from ringing to its end.
    #[allow(clippy::too_many_arguments)]
    async fn call(
        &self,
        dialog: &rsipstack::dialog::invite_dialog::InviteDialog,
        offer: &sdp::Offer,
        sockets: Sockets,
        headers: Vec<(String, String)>,
        (announce, peer): (IpAddr, SocketAddr),
        hangup: &CancellationToken,
        admission: super::super::Admission,
    ) {
        let s = &self.settings;
        if !s.ring.is_zero() {
            let _ = dialog.ringing(None, None);
            tokio::select! {
                _ = tokio::time::sleep(s.ring) => {}
                _ = hangup.cancelled() => {
                    tracing::info!(caller = %peer, "sip: the caller cancelled while it rang");
                    return;
                }
            }
        }
        let port = sockets.port();
        let stats = Arc::new(CallStats {
            codec: offer.codec.name(),
            remote: Some(offer.rtp),
            local: Some(SocketAddr::new(announce, port)),
            ..CallStats::default()
        });
        let settings = MediaSettings {
            jitter: s.jitter,
            max_jitter: s.max_jitter,
            rtp_timeout: s.rtp_timeout,
        };
        let pacing = session::AudioBudget::pacing(&self.server.template());
        let (sink, stream, media_task) = media::start(
            sockets,
            offer,
            settings,
            pacing,
            stats.clone(),
            hangup.clone(),
        );
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let proto = SipCall::new(
            sip::params_of(&headers),
            offer.codec.format,
            stats,
            ready_tx,
        );
        let refused = proto.refused.clone();
        let server = self.server.clone();
        let mut session =
            tokio::spawn(session::run(server, (sink, stream), peer, proto, admission));
        let answered = tokio::select! {
            r = ready_rx => r.is_ok(),
            _ = hangup.cancelled() => false,
            _ = &mut session => false,
        };
        if answered {
            let sdp = sdp::answer(offer, announce, port, now_s());
            let ct = Header::ContentType("application/sdp".into());
            match dialog.accept(Some(vec![ct]), Some(sdp.into_bytes())) {
                Ok(()) => {
                    metrics::counter!(names::SIP_REQUESTS, "method" => "INVITE", "status" => "200")
                        .increment(1);
                    tracing::info!(caller = %peer, rtp = %offer.rtp, codec = offer.codec.name(), "sip: answered a call");
                }
                Err(e) => tracing::info!(caller = %peer, "sip: answering a call: {e}"),
            }
        } else if !hangup.is_cancelled() {
            let why = refused.lock().ok().and_then(|r| r.clone());
            let (code, text) = match why {
                Some(t) => (400, t),
                None => (500, "the session could not start".to_string()),
            };
            metrics::counter!(names::SIP_REQUESTS, "method" => "INVITE", "status" => code.to_string())
                .increment(1);
            let _ = dialog.reject(Some(StatusCode::from(code)), Some(text));
        }
        let _ = (&mut session).await;
        let ended = media_task.await.unwrap_or(media::Ended::Session);
        if answered && !hangup.is_cancelled() {
            tracing::info!(caller = %peer, ?ended, "sip: hanging up");
            if let Err(e) = dialog.bye().await {
                tracing::debug!("sip: BYE: {e}");
            }
        } else if answered {
            tracing::info!(caller = %peer, "sip: the caller hung up");
        }
    }
}
