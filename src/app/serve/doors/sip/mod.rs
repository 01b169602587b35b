//! The SIP door: the requests the stack hands up once the guard (`sip/guard.rs`) has let them
//! through, and each call from its `INVITE` to its end.
//!
//! - A new `INVITE` ([`invite`]) is checked in order — its session timer (`422` below our
//!   Min-SE), its Digest credentials when the server asks for them (`401` with a challenge, at
//!   most a few a minute per address; the answer single-use), its SDP offer (`400` for what is
//!   not SDP, `488` for an offer without PCMU, PCMA or Opus or naming an address media must not
//!   go to), the server's admission (`503` with `Retry-After`; the caller's address's own limits
//!   too, except for a caller in `sip.allow`, a trunk that carries many callers) — each refusal
//!   counted (`duplex_sip_requests_total`) before any slot is taken.
//! - An admitted call ([`call`]) gets its RTP ports, rings for `sip.ring_ms` (the caller may
//!   `CANCEL`: `487`), and its session starts; it is answered (`200` with our SDP and its
//!   session timer) once the session is ready, or refused (`500`, or `400` naming a bad
//!   `X-Duplex-` param). While it lives it takes the caller's re-`INVITE`s and `UPDATE`s (hold,
//!   resume, a new media address; `488` for another codec, `491` while an offer of ours is
//!   pending, `500` while one of theirs is), `INFO` DTMF, and keeps its session timer
//!   (refreshing it, or ending a call whose refresh never came). A `BYE` from the caller ends
//!   the session; a session that ends on its own (its limits, a drain, a caller whose RTP
//!   stopped) sends the `BYE`.
//! - In-dialog requests are taken from the call's own party only (the guard), with credentials
//!   when the server asks for them (here).
//!
//! Calls are keyed by their whole dialog id (Call-ID and both tags): another call's Call-ID
//! reaches nothing of this one.

mod call;
mod invite;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use rsipstack::dialog::dialog::{DialogState, DialogStateSender, TransactionHandle};
use rsipstack::dialog::DialogId;
use rsipstack::sip::prelude::HeadersExt;
use rsipstack::sip::{Header, Method, Request, StatusCode};
use rsipstack::transaction::transaction::Transaction;
use tokio_util::sync::CancellationToken;

use super::super::config::SipSettings;
use super::super::sip::digest::Digest;
use super::super::sip::Endpoint;
use super::super::Server;
use crate::observe::names;

/// What a live call hears from its dialog.
pub(super) enum DialogEvent {
    /// A re-INVITE, UPDATE or INFO, answered through the handle.
    Request(Box<Request>, TransactionHandle),
    /// The dialog is confirmed again (the ACK of a re-INVITE came).
    Confirmed,
}

/// A live call, as the door reaches it.
struct CallHandle {
    hangup: CancellationToken,
    events: tokio::sync::mpsc::Sender<DialogEvent>,
}

/// Live calls by their dialog id.
type Calls = Arc<Mutex<HashMap<DialogId, CallHandle>>>;

/// What every call of the door shares.
pub(super) struct Door {
    server: Arc<Server>,
    ep: Arc<Endpoint>,
    settings: SipSettings,
    states: DialogStateSender,
    calls: Calls,
    digest: Option<Digest>,
}

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
    let taking = Arc::downgrade(&server);
    let _ = ep.taking.set(Box::new(move || {
        taking.upgrade().is_some_and(|s| s.accepting())
    }));
    let ep = Arc::new(ep);
    let (states, state_rx) = ep.dialogs.new_dialog_state_channel();
    let calls: Calls = Arc::default();
    let serving = ep.clone();
    tokio::spawn(async move { serving.endpoint.serve().await });
    tokio::spawn(watch(state_rx, calls.clone()));
    // The stack's transactions (live, and finished ones kept for retransmissions), as a gauge.
    let counted = Arc::downgrade(&ep);
    tokio::spawn(async move {
        let gauge = metrics::gauge!(names::SIP_TRANSACTIONS);
        while let Some(ep) = counted.upgrade() {
            let inner = &ep.endpoint.inner;
            gauge.set((inner.transactions.len() + inner.finished_transactions.len()) as f64);
            drop(ep);
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    });
    let digest = settings
        .digest
        .as_ref()
        .map(|(user, password)| Digest::new(user, password, &settings.realm, &secret()));
    let door = Arc::new(Door {
        server,
        ep,
        settings,
        states,
        calls,
        digest,
    });
    while let Some(tx) = incoming.recv().await {
        let in_dialog = tx
            .original
            .to_header()
            .ok()
            .and_then(|t| t.tag().ok().flatten())
            .is_some();
        match tx.original.method {
            Method::Invite if !in_dialog => {
                tokio::spawn(invite::run(door.clone(), tx));
            }
            Method::Ack => {}
            _ => {
                tokio::spawn(in_dialog_request(door.clone(), tx));
            }
        }
    }
}

/// A request within a call (the guard has checked who sent it): with its credentials when the
/// server asks for them, on to the call's dialog.
async fn in_dialog_request(door: Arc<Door>, mut tx: Transaction) {
    let method = tx.original.method;
    if method != Method::Cancel && !door.authorized(&mut tx).await {
        return;
    }
    match door.ep.dialogs.match_dialog(&tx) {
        Some(mut d) => {
            if let Err(e) = d.handle(&mut tx).await {
                tracing::debug!("sip: {method} in a call: {e}");
            }
        }
        None => answer(&mut tx, 481, Vec::new()).await,
    }
}

impl Door {
    /// Whether `tx` carries credentials the server takes (always, when it asks for none);
    /// otherwise it has been answered: `401` with a challenge, or `403` once its address has
    /// had its challenges for the minute.
    async fn authorized(&self, tx: &mut Transaction) -> bool {
        let Some(digest) = &self.digest else {
            return true;
        };
        let now = now_s();
        let uri = tx.original.uri.to_string();
        let method = tx.original.method.to_string();
        let fault = match tx.original.header_value("Authorization") {
            Some(h) => match digest.check(&h, &method, &uri, now) {
                Ok(()) => return true,
                Err(f) => format!("{f:?}").to_lowercase(),
            },
            None => "none".to_string(),
        };
        let ip = peer_of(tx).map(|p| p.ip());
        let may = ip.is_some_and(|ip| {
            self.ep
                .guard
                .lock()
                .is_ok_and(|mut g| g.challenge(Instant::now(), ip))
        });
        let reason = if may {
            "sip_auth"
        } else {
            "sip_auth_throttled"
        };
        if method == "INVITE"
            && tx
                .original
                .to_header()
                .is_ok_and(|t| t.tag().ok().flatten().is_none())
        {
            metrics::counter!(names::SESSIONS_REFUSED, "reason" => reason).increment(1);
        } else {
            metrics::counter!(names::SIP_SCREENED, "reason" => reason).increment(1);
        }
        if let Some(held) = self.server.log_throttle.allow(reason) {
            tracing::info!(caller = ?ip, held, "sip: a {method} without credentials we take ({fault})");
        }
        if may {
            let h = vec![Header::Other(
                "WWW-Authenticate".into(),
                digest.challenge(now),
            )];
            answer(tx, 401, h).await;
        } else {
            answer(tx, 403, vec![warning("too many authentication attempts")]).await;
        }
        false
    }
}

/// Routes what the dialogs say to their calls: a hang-up ends the call; re-INVITEs, UPDATEs
/// and INFOs go to the call; an in-dialog OPTIONS is answered here; what a call does not take
/// (REFER, MESSAGE, NOTIFY, PUBLISH) is refused `405`.
async fn watch(mut states: tokio::sync::mpsc::UnboundedReceiver<DialogState>, calls: Calls) {
    while let Some(state) = states.recv().await {
        let (id, event) = match state {
            DialogState::Terminated(id, reason) => {
                tracing::debug!(call = %id.call_id, ?reason, "sip: dialog terminated");
                if let Some(c) = calls
                    .lock()
                    .ok()
                    .and_then(|c| c.get(&id).map(|c| c.hangup.clone()))
                {
                    c.cancel();
                }
                continue;
            }
            DialogState::Updated(id, req, h) | DialogState::Info(id, req, h) => {
                (id, DialogEvent::Request(Box::new(req), h))
            }
            DialogState::Confirmed(id, _) => (id, DialogEvent::Confirmed),
            DialogState::Options(_, _, h) => {
                tokio::spawn(async move {
                    let _ = h.respond(StatusCode::OK, Some(vec![allow()]), None).await;
                });
                continue;
            }
            DialogState::Refer(_, _, h)
            | DialogState::Message(_, _, h)
            | DialogState::Notify(_, _, h)
            | DialogState::Publish(_, _, h) => {
                tokio::spawn(async move {
                    let _ = h
                        .respond(StatusCode::MethodNotAllowed, Some(vec![allow()]), None)
                        .await;
                });
                continue;
            }
            _ => continue,
        };
        let sender = calls
            .lock()
            .ok()
            .and_then(|c| c.get(&id).map(|c| c.events.clone()));
        let refused = match sender {
            Some(s) => s.try_send(event).err().map(|e| e.into_inner()),
            None => Some(event),
        };
        // A call that is gone (481), or too busy to take it now (500, try again).
        if let Some(DialogEvent::Request(_, h)) = refused {
            tokio::spawn(async move {
                let _ = h
                    .respond(
                        StatusCode::ServerInternalError,
                        Some(vec![Header::Other("Retry-After".into(), "1".into())]),
                        None,
                    )
                    .await;
            });
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
    Header::Other("Allow".into(), super::super::sip::ALLOW.into())
}

/// Where a transaction's request came from.
fn peer_of(tx: &Transaction) -> Option<std::net::SocketAddr> {
    tx.connection
        .as_ref()
        .and_then(|c| c.get_remote_addr())
        .and_then(|a| a.get_socketaddr().ok())
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
    Header::Other(
        "Warning".into(),
        super::super::sip::guard::warning_value(text),
    )
}
