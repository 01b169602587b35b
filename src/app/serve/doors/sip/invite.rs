//! A new call's `INVITE`: its checks in order, each refusal answered and counted before any
//! slot is taken, then the call's slot, ports and dialog, and the call itself ([`super::call`]).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rsipstack::sip::Header;
use rsipstack::transaction::transaction::Transaction;
use tokio_util::sync::CancellationToken;

use super::super::super::sip::media::Sockets;
use super::super::super::sip::{self, sdp, timers};
use super::call::Call;
use super::{answer, peer_of, warning, CallHandle, Door};
use crate::observe::names;

/// How many of a call's in-dialog requests may wait for it.
const EVENTS_QUEUE: usize = 16;

/// A refusal: its status, the reason it is counted under, what the caller is told, and more
/// headers.
struct Refusal {
    code: u16,
    reason: &'static str,
    text: String,
    headers: Vec<Header>,
}

fn refusal(code: u16, reason: &'static str, text: impl Into<String>) -> Refusal {
    Refusal {
        code,
        reason,
        text: text.into(),
        headers: Vec::new(),
    }
}

fn retry_after(secs: &str) -> Header {
    Header::Other("Retry-After".into(), secs.into())
}

/// Handles one new `INVITE`: its checks, its slot and ports, its dialog, the call.
pub(super) async fn run(door: Arc<Door>, mut tx: Transaction) {
    let Some(peer) = peer_of(&tx) else {
        return answer(&mut tx, 500, Vec::new()).await;
    };
    let Some((timer, offer)) = checked(&door, &mut tx, peer).await else {
        return;
    };
    let Some(admitted) = admit(&door, &mut tx, peer, &offer).await else {
        return;
    };
    let Some((dialog, contact)) = dialog(&door, &mut tx, peer).await else {
        return;
    };
    let id = dialog.id();
    if let Ok(mut g) = door.ep.guard.lock() {
        g.answered(&id.call_id, &id.remote_tag, &id.local_tag);
    }
    let hangup = CancellationToken::new();
    let (events_tx, events) = tokio::sync::mpsc::channel(EVENTS_QUEUE);
    if let Ok(mut c) = door.calls.lock() {
        let handle = CallHandle {
            hangup: hangup.clone(),
            events: events_tx,
        };
        c.insert(id.clone(), handle);
    }
    let headers: Vec<(String, String)> = tx
        .original
        .headers
        .iter()
        .map(|h| (h.name().to_string(), h.value().to_string()))
        .collect();
    let caller_allows_update = tx.original.headers.iter().any(|h| {
        h.name().eq_ignore_ascii_case("Allow")
            && h.value()
                .split(',')
                .any(|m| m.trim().eq_ignore_ascii_case("UPDATE"))
    });
    // The INVITE's transaction (100 Trying, a CANCEL, the ACK) runs beside the call.
    let mut driver = dialog.clone();
    tokio::spawn(async move {
        if let Err(e) = driver.handle(&mut tx).await {
            tracing::debug!("sip: an INVITE's transaction: {e}");
        }
    });
    let Admitted {
        conn,
        admission,
        sockets,
        own,
    } = admitted;
    let call = Call {
        door: door.clone(),
        dialog,
        offer,
        announce: contact,
        peer,
        own,
        hangup,
        timer,
        caller_allows_update,
        session: super::now_s(),
        version: 1,
    };
    call.run(sockets, headers, admission, events).await;
    if let Ok(mut c) = door.calls.lock() {
        c.remove(&id);
    }
    if let Ok(mut g) = door.ep.guard.lock() {
        g.ended(Instant::now(), &id.call_id, &id.remote_tag);
    }
    drop(conn);
    // The dialog lingers a little for retransmissions of the BYE's answer.
    let dialogs = door.ep.dialogs.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(32)).await;
        dialogs.remove_dialog(&id);
    });
}

/// The INVITE's session timer and offer, once its checks pass (each refusal answered here):
/// the timer's interval, the caller's credentials, the offer.
async fn checked(
    door: &Door,
    tx: &mut Transaction,
    peer: SocketAddr,
) -> Option<(Option<timers::Timer>, sdp::Offer)> {
    let timer = match timers::negotiate(&tx.original, door.settings.timer_limits(), Instant::now())
    {
        Ok(t) => t,
        Err(small) => {
            let min = small.min_se.as_secs().to_string();
            let h = vec![Header::Other("Min-SE".into(), min)];
            let r = refusal(422, "sip_bad_offer", "the session interval is too small");
            refuse(door, tx, peer.ip(), Refusal { headers: h, ..r }).await;
            return None;
        }
    };
    if !door.authorized(tx).await {
        return None;
    }
    match offer(tx, peer.ip()) {
        Ok(o) => Some((timer, o)),
        Err(r) => {
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_sdp").increment(1);
            refuse(door, tx, peer.ip(), r).await;
            None
        }
    }
}

/// What an admitted call holds: its connection and session slot, its RTP sockets, and our
/// own addresses (media must never go to them).
struct Admitted {
    conn: super::super::super::Connection,
    admission: super::super::super::Admission,
    sockets: Sockets,
    own: Vec<SocketAddr>,
}

/// The call's connection, slot and ports, or its refusal answered (`503` with `Retry-After`;
/// `488` for an offer naming one of the ports just bound).
async fn admit(
    door: &Door,
    tx: &mut Transaction,
    peer: SocketAddr,
    offer: &sdp::Offer,
) -> Option<Admitted> {
    // A caller in the allow-list is a PBX or a trunk: many callers behind one address, so
    // one address's limits are not its (as for a trusted proxy).
    let carrier = !door.settings.allow.is_empty();
    let ip = peer.ip();
    let Some(conn) = door.server.connect_as(ip, carrier) else {
        let text = format!(
            "{ip} holds its {} connection(s) already (max_connections_per_ip)",
            door.server.cfg.max_connections_per_ip
        );
        let r = Refusal {
            headers: vec![retry_after("5")],
            ..refusal(503, "per_ip", text)
        };
        refuse(door, tx, ip, r).await;
        return None;
    };
    let admission = match door.server.admit_as(ip, carrier) {
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
            let h = vec![retry_after(&retry), warning("no free session slot")];
            answer(tx, 503, h).await;
            return None;
        }
    };
    let s = &door.settings;
    let sockets = match Sockets::bind(s.address.ip(), s.rtp_ports, offer.rtcp_mux) {
        Ok(x) => x,
        Err(e) => {
            tracing::warn!(caller = %peer, "sip: no RTP port for a call: {e}");
            let h = vec![retry_after("5"), warning("no RTP port is free")];
            answer(tx, 503, h).await;
            return None;
        }
    };
    // Media to one of our own sockets would be heard as the caller's.
    let own: Vec<SocketAddr> = sockets
        .addresses()
        .into_iter()
        .chain([door.ep.local])
        .collect();
    if own
        .iter()
        .any(|a| same_socket(*a, offer.rtp) || same_socket(*a, offer.rtcp))
    {
        let text = format!(
            "the offer's media address {} is this server's own",
            offer.rtp
        );
        refuse(door, tx, ip, refusal(488, "sip_bad_offer", text)).await;
        return None;
    }
    Some(Admitted {
        conn,
        admission,
        sockets,
        own,
    })
}

/// The call's dialog, with our Contact (on the address the caller reaches us at, or
/// `sip.public_address`), and that address; or `400` when the stack cannot make one.
async fn dialog(
    door: &Door,
    tx: &mut Transaction,
    peer: SocketAddr,
) -> Option<(rsipstack::dialog::invite_dialog::InviteDialog, IpAddr)> {
    let s = &door.settings;
    let announce = s
        .public_address
        .unwrap_or_else(|| sip::local_ip_toward(s.address.ip(), peer.ip()));
    let tcp = tx.connection.as_ref().is_some_and(|c| c.is_reliable());
    let contact = format!(
        "sip:duplex@{}{}",
        SocketAddr::new(announce, door.ep.local.port()),
        if tcp { ";transport=tcp" } else { "" }
    );
    let contact = rsipstack::sip::Uri::try_from(contact.as_str()).ok();
    match door
        .ep
        .dialogs
        .get_or_create_server_invite(tx, door.states.clone(), None, contact)
    {
        Ok(d) => Some((d, announce)),
        Err(e) => {
            tracing::info!(caller = %peer, "sip: a call's dialog could not be made: {e}");
            answer(tx, 400, vec![warning(&e.to_string())]).await;
            None
        }
    }
}

/// The INVITE's offer, taken only where media may go.
fn offer(tx: &Transaction, caller: IpAddr) -> Result<sdp::Offer, Refusal> {
    let to_refusal = |r: sdp::Refused| refusal(r.status, "sip_bad_offer", r.reason);
    let offer = sdp::read_offer(&tx.original.body).map_err(to_refusal)?;
    sdp::vet(&offer, false).map_err(to_refusal)?;
    // An address of this machine named by a caller elsewhere: the call would talk to the
    // server itself (its own RTP, a service beside it).
    let ip = offer.rtp.ip();
    if is_local(ip) && !is_local(caller) {
        let text = format!(
            "the offer's media address {} is this server's own",
            offer.rtp
        );
        return Err(refusal(488, "sip_bad_offer", text));
    }
    Ok(offer)
}

/// Whether `ip` is an address of this machine (a socket can be bound to it).
pub(super) fn is_local(ip: IpAddr) -> bool {
    !ip.is_unspecified() && std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// Whether `a` and `b` are one socket (an unspecified address of ours stands for all).
pub(super) fn same_socket(ours: SocketAddr, theirs: SocketAddr) -> bool {
    ours.port() == theirs.port()
        && (ours.ip() == theirs.ip() || (ours.ip().is_unspecified() && is_local(theirs.ip())))
}

/// Refuses the call with its refusal (counted as a refused session for its reason), logged at
/// most once per reason per interval.
async fn refuse(door: &Door, tx: &mut Transaction, caller: IpAddr, r: Refusal) {
    metrics::counter!(names::SESSIONS_REFUSED, "reason" => r.reason).increment(1);
    if let Some(held) = door.server.log_throttle.allow(r.reason) {
        tracing::info!(caller = %caller, reason = r.reason, held, "sip: refused a call ({}): {}", r.code, r.text);
    }
    let mut headers = r.headers;
    headers.push(warning(&r.text));
    answer(tx, r.code, headers).await;
}
