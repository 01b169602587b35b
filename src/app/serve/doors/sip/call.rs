//! An admitted call from ringing to its end: its media and session started, the answer once
//! the session is ready, then its life — the caller's re-offers (hold, resume, a new address),
//! `INFO` DTMF, the session timer — until the caller hangs up or the session ends (then our
//! `BYE`).

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rsipstack::dialog::dialog::TransactionHandle;
use rsipstack::dialog::invite_dialog::InviteDialog;
use rsipstack::sip::{Header, Method, Request, StatusCode};

use super::super::super::sip::media::{self, CallStats, MediaSettings, Running, Setup, Sockets};
use super::super::super::sip::timers::{self, Due, Timer};
use super::super::super::sip::{self as sipmod, sdp, SipCall};
use super::super::super::{session, Admission};
use super::{warning, DialogEvent, Door};
use crate::observe::names;

/// An admitted call.
pub(super) struct Call {
    pub door: Arc<Door>,
    pub dialog: InviteDialog,
    /// The offer in force (the INVITE's, then each taken re-offer's).
    pub offer: sdp::Offer,
    pub announce: IpAddr,
    pub peer: SocketAddr,
    /// Our own sockets (the call's RTP and RTCP, SIP's).
    pub own: Vec<SocketAddr>,
    pub hangup: tokio_util::sync::CancellationToken,
    pub timer: Option<Timer>,
    /// Whether the caller takes UPDATE (our refreshes use it; else a re-INVITE).
    pub caller_allows_update: bool,
    /// Our SDP's session id and version (RFC 4566 `o=`): the id the call's, the version one
    /// more at each answer.
    pub session: u64,
    pub version: u64,
}

/// Our session refresh in flight: its response.
type Refresh =
    Pin<Box<dyn Future<Output = rsipstack::Result<Option<rsipstack::sip::Response>>> + Send>>;

/// Who ended a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EndedBy {
    /// The caller (its BYE, its CANCEL).
    Caller,
    /// Us: the session timer expired.
    Us,
    /// The session ended (its limits, a drain): we hang up.
    Session,
}

impl Call {
    pub(super) async fn run(
        mut self,
        sockets: Sockets,
        headers: Vec<(String, String)>,
        admission: Admission,
        mut events: tokio::sync::mpsc::Receiver<DialogEvent>,
    ) {
        if !self.ring().await {
            tracing::info!(caller = %self.peer, "sip: the caller cancelled while it rang");
            return;
        }
        let port = sockets.port();
        let stats = Arc::new(CallStats::new(
            self.offer.codec.name(),
            SocketAddr::new(self.announce, port),
        ));
        let running = media::start(sockets, self.setup(stats.clone()), self.hangup.clone());
        let Running {
            sink,
            stream,
            offers,
            task,
        } = running;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let proto = SipCall::new(
            sipmod::params_of(&headers),
            self.offer.codec.format,
            stats.clone(),
            ready_tx,
        );
        let refused = proto.refused.clone();
        let server = self.door.server.clone();
        let mut session = tokio::spawn(session::run(
            server,
            (sink, stream),
            self.peer,
            proto,
            admission,
        ));
        // Whether the session's task has been awaited to its end already.
        let mut done = false;
        let answered = tokio::select! {
            r = ready_rx => r.is_ok(),
            _ = self.hangup.cancelled() => false,
            _ = &mut session => {
                done = true;
                false
            }
        };
        let mut by = EndedBy::Caller;
        if answered {
            self.answer(port);
            by = self
                .live(port, &mut session, &mut events, &offers, &stats)
                .await;
            done |= by == EndedBy::Session;
            if by == EndedBy::Session {
                by = EndedBy::Us;
            }
        } else if !self.hangup.is_cancelled() {
            let why = refused.lock().ok().and_then(|r| r.clone());
            let (code, text) = match why {
                Some(t) => (400, t),
                None => (500, "the session could not start".to_string()),
            };
            metrics::counter!(names::SIP_REQUESTS, "method" => "INVITE", "status" => code.to_string())
                .increment(1);
            let _ = self.dialog.reject(Some(StatusCode::from(code)), Some(text));
        }
        if !done {
            let _ = (&mut session).await;
        }
        let ended = task.await.unwrap_or(media::Ended::Session);
        if answered && by == EndedBy::Us {
            tracing::info!(caller = %self.peer, ?ended, "sip: hanging up");
            if let Err(e) = self.dialog.bye().await {
                tracing::debug!("sip: BYE: {e}");
            }
        } else if answered {
            tracing::info!(caller = %self.peer, "sip: the caller hung up");
        }
    }

    /// Rings for `sip.ring_ms`; false when the caller cancelled meanwhile.
    async fn ring(&self) -> bool {
        let ring = self.door.settings.ring;
        if ring.is_zero() {
            return true;
        }
        let _ = self.dialog.ringing(None, None);
        tokio::select! {
            _ = tokio::time::sleep(ring) => true,
            _ = self.hangup.cancelled() => false,
        }
    }

    /// The media's start.
    fn setup(&self, stats: Arc<CallStats>) -> Setup {
        let s = &self.door.settings;
        let allow = s.allow.clone();
        Setup {
            offer: self.offer.clone(),
            settings: MediaSettings {
                jitter: s.jitter,
                max_jitter: s.max_jitter,
                rtp_timeout: s.rtp_timeout,
            },
            pacing: session::AudioBudget::pacing(&self.door.server.template()),
            signalling: self.peer.ip(),
            trusted: Arc::new(move |ip| allow.iter().any(|c| c.contains(ip))),
            own: self.own.clone(),
            seed: media::nanos(),
            stats,
        }
    }

    /// Our SDP for the offer in force.
    fn sdp(&mut self, port: u16) -> Vec<u8> {
        let v = self.version;
        self.version += 1;
        sdp::answer(&self.offer, self.announce, port, self.session, v).into_bytes()
    }

    /// The 200 of the INVITE: our SDP, the session timer.
    fn answer(&mut self, port: u16) {
        let mut headers = vec![Header::ContentType("application/sdp".into())];
        if let Some(t) = &self.timer {
            headers.extend(t.headers().into_iter().map(|(n, v)| Header::Other(n, v)));
        }
        let body = self.sdp(port);
        match self.dialog.accept(Some(headers), Some(body)) {
            Ok(()) => {
                metrics::counter!(names::SIP_REQUESTS, "method" => "INVITE", "status" => "200")
                    .increment(1);
                tracing::info!(caller = %self.peer, rtp = %self.offer.rtp, codec = self.offer.codec.name(), "sip: answered a call");
            }
            Err(e) => tracing::info!(caller = %self.peer, "sip: answering a call: {e}"),
        }
    }

    /// The answered call until it ends: the caller's requests, the session timer.
    async fn live(
        &mut self,
        port: u16,
        session: &mut tokio::task::JoinHandle<()>,
        events: &mut tokio::sync::mpsc::Receiver<DialogEvent>,
        offers: &tokio::sync::mpsc::UnboundedSender<sdp::Offer>,
        stats: &CallStats,
    ) -> EndedBy {
        // Whether a re-INVITE of the caller's is answered and not yet ACKed.
        let mut theirs_pending = false;
        // Our refresh in flight, and whether it carries an offer (a re-INVITE).
        let mut ours: Option<(Refresh, bool)> = None;
        let mut retry_at: Option<Instant> = None;
        loop {
            let deadline = match (&self.timer, &ours) {
                (Some(t), None) => Some(retry_at.unwrap_or_else(|| t.deadline())),
                _ => None,
            };
            let timer = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            let refreshed = async {
                match ours.as_mut() {
                    Some((f, _)) => f.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut *session => return EndedBy::Session,
                _ = self.hangup.cancelled() => return EndedBy::Caller,
                e = events.recv() => match e {
                    Some(DialogEvent::Confirmed) => theirs_pending = false,
                    Some(DialogEvent::Request(req, h)) => {
                        let reoffer = req.method == Method::Invite;
                        let glare = ours.as_ref().is_some_and(|(_, offer)| *offer);
                        let taken = self
                            .in_dialog(port, *req, h, offers, stats, (theirs_pending, glare))
                            .await;
                        theirs_pending |= reoffer && taken;
                    }
                    None => return EndedBy::Caller,
                },
                r = refreshed => {
                    ours = None;
                    match self.refreshed(r) {
                        Some(again) => retry_at = again,
                        None => return self.expire(),
                    }
                }
                _ = timer => {
                    let Some(t) = self.timer else { continue };
                    let now = Instant::now();
                    retry_at = None;
                    match t.due(now) {
                        None => {}
                        Some(Due::Refresh) if now < t.refreshed + t.interval => {
                            ours = Some(self.refresh(port, t));
                        }
                        Some(_) => return self.expire(),
                    }
                }
            }
        }
    }

    /// The session timer has run out: the call is ended.
    fn expire(&self) -> EndedBy {
        tracing::info!(caller = %self.peer, "sip: the session timer expired: the call is ended");
        self.hangup.cancel();
        EndedBy::Us
    }

    /// Our refresh of the session (we are the refresher): an UPDATE without a body when the
    /// caller takes UPDATE, else a re-INVITE with our SDP (an offer: a caller's re-offer
    /// meanwhile is a glare, `491`).
    fn refresh(&mut self, port: u16, t: Timer) -> (Refresh, bool) {
        let se = Header::Other(
            "Session-Expires".into(),
            format!("{};refresher=uas", t.interval.as_secs()),
        );
        let dialog = self.dialog.clone();
        if self.caller_allows_update {
            (
                Box::pin(async move { dialog.update(Some(vec![se]), None).await }),
                false,
            )
        } else {
            let body = self.sdp(port);
            let ct = Header::ContentType("application/sdp".into());
            (
                Box::pin(async move { dialog.reinvite(Some(vec![se, ct]), Some(body)).await }),
                true,
            )
        }
    }

    /// Our refresh's outcome: taken (the timer restarts), a glare (`491`: tried again within
    /// 2 s, RFC 3261 §14.1), or refused; `None` when the call must end (the caller says the
    /// call is gone, `408`/`481`, or nothing answered: RFC 4028 §10).
    fn refreshed(
        &mut self,
        r: rsipstack::Result<Option<rsipstack::sip::Response>>,
    ) -> Option<Option<Instant>> {
        let now = Instant::now();
        let code = match &r {
            Ok(Some(resp)) => u16::from(resp.status_code.clone()),
            _ => 408,
        };
        match code {
            200..=299 => {
                if let Some(t) = self.timer.as_mut() {
                    t.refreshed = now;
                }
                Some(None)
            }
            491 => Some(Some(
                now + Duration::from_millis(u64::from(media::nanos() % 2000)),
            )),
            408 | 481 => None,
            // Refused otherwise: tried again in a few seconds while the session lasts.
            _ => Some(Some(now + Duration::from_secs(5))),
        }
    }

    /// A re-INVITE, UPDATE or INFO of the caller's, answered; true when a re-offer was taken.
    async fn in_dialog(
        &mut self,
        port: u16,
        req: Request,
        h: TransactionHandle,
        offers: &tokio::sync::mpsc::UnboundedSender<sdp::Offer>,
        stats: &CallStats,
        pending: (bool, bool),
    ) -> bool {
        let (code, headers, body, taken) = match req.method {
            Method::Info => {
                let (code, h) = self.info(&req, stats);
                (code, h, None, false)
            }
            Method::Invite | Method::Update => match self.reoffer(port, &req, offers, pending) {
                Ok((headers, body)) => (200, headers, body, true),
                Err((code, headers)) => (code, headers, None, false),
            },
            _ => (405, vec![super::allow()], None, false),
        };
        metrics::counter!(names::SIP_REQUESTS, "method" => req.method.to_string(), "status" => code.to_string())
            .increment(1);
        if let Err(e) = h.respond(StatusCode::from(code), Some(headers), body).await {
            tracing::debug!("sip: answering a {} in a call: {e}", req.method);
        }
        taken
    }

    /// An INFO: a DTMF key (RFC 2976 with `application/dtmf-relay` or `application/dtmf`) into
    /// the call's status, 200; any other body 415.
    fn info(&self, req: &Request, stats: &CallStats) -> (u16, Vec<Header>) {
        let kind = req
            .headers
            .iter()
            .find(|h| h.name().eq_ignore_ascii_case("Content-Type") || h.name() == "c")
            .map(|h| h.value().to_string())
            .unwrap_or_default();
        match sipmod::info_key(&kind, &req.body) {
            Some(key) => {
                stats.pressed(key);
                (200, Vec::new())
            }
            None if req.body.is_empty() => (200, Vec::new()),
            None => (
                415,
                vec![Header::Other(
                    "Accept".into(),
                    "application/dtmf-relay, application/dtmf".into(),
                )],
            ),
        }
    }

    /// A re-INVITE's or UPDATE's offer (or a bare refresh): taken, its answer and the
    /// refreshed timer's headers; or refused with a status.
    #[allow(clippy::type_complexity)]
    fn reoffer(
        &mut self,
        port: u16,
        req: &Request,
        offers: &tokio::sync::mpsc::UnboundedSender<sdp::Offer>,
        (theirs_pending, ours_pending): (bool, bool),
    ) -> Result<(Vec<Header>, Option<Vec<u8>>), (u16, Vec<Header>)> {
        let now = Instant::now();
        let has_offer = !req.body.is_empty();
        if ours_pending && (has_offer || req.method == Method::Invite) {
            // Glare: our re-INVITE's offer is unanswered (RFC 3261 §14.2, RFC 3311 §5.2).
            return Err((491, Vec::new()));
        }
        if theirs_pending && req.method == Method::Invite {
            // RFC 3261 §14.2: a second re-INVITE before the first is done.
            return Err((500, vec![Header::Other("Retry-After".into(), "1".into())]));
        }
        let timer =
            timers::negotiate(req, self.door.settings.timer_limits(), now).map_err(|small| {
                let min = small.min_se.as_secs().to_string();
                (422, vec![Header::Other("Min-SE".into(), min)])
            })?;
        let mut headers = Vec::new();
        if has_offer {
            let offer = self.take_reoffer(&req.body)?;
            let _ = offers.send(offer.clone());
            tracing::info!(caller = %self.peer, rtp = %offer.rtp, direction = offer.direction.name(), "sip: the caller's media changed");
            self.offer = offer;
        }
        // A refresh (with or without an offer) restarts the timer; a caller that stops asking
        // for one has none.
        if let Some(t) = timer {
            self.timer = Some(t);
        }
        if let Some(t) = &self.timer {
            headers.extend(t.headers().into_iter().map(|(n, v)| Header::Other(n, v)));
        }
        // An answer to an offer; an offerless re-INVITE gets ours as the offer.
        let body = (has_offer || req.method == Method::Invite).then(|| self.sdp(port));
        if body.is_some() {
            headers.push(Header::ContentType("application/sdp".into()));
        }
        Ok((headers, body))
    }

    /// A re-offer the call can take: SDP, an address media may go to (a hold's `0.0.0.0`
    /// too), the call's codec among its formats.
    fn take_reoffer(&self, body: &[u8]) -> Result<sdp::Offer, (u16, Vec<Header>)> {
        let refuse = |code: u16, text: &str| (code, vec![warning(text)]);
        let mut offer = sdp::read_offer(body).map_err(|r| refuse(r.status, &r.reason))?;
        sdp::vet(&offer, true).map_err(|r| refuse(r.status, &r.reason))?;
        if self
            .own
            .iter()
            .any(|a| super::invite::same_socket(*a, offer.rtp))
        {
            return Err(refuse(
                488,
                "the offer's media address is this server's own",
            ));
        }
        let format = self.offer.codec.format;
        let Some(codec) = offer.ours.iter().find(|c| c.format == format).copied() else {
            let text = format!(
                "the call runs in {}: a change of codec is not taken",
                self.offer.codec.name()
            );
            return Err(refuse(488, &text));
        };
        offer.codec = codec;
        Ok(offer)
    }
}
