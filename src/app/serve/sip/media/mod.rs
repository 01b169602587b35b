//! A SIP call's media: its sockets (RTP on an even port, RTCP on the next unless multiplexed),
//! the call's counters for `/api/sessions`, and the thin loop that feeds the sockets, the
//! session's audio, the signalling's renegotiations and the clock to [`CallMedia`] (the state
//! machine in [`core`], where every decision about the call's media is: latching, pacing,
//! hold, timeouts) and carries out what it returns. [`codec`] is G.711's and Opus's side of it.
//!
//! Knows nothing of SIP's signalling (the door's) nor of the pipeline (the session's): a call's
//! media is a pair of channels to its session and one from the door.

mod codec;
pub(crate) mod core;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::Message;
use tokio::net::UdpSocket;

use super::super::session::{ClientSink, ClientStream};
use super::sdp::{Direction, Offer};
use crate::observe::names;
pub(crate) use core::{CallMedia, Ended, Output, Setup};

/// DTMF keys kept for the session's status.
const MAX_KEYS: usize = 64;
/// Messages of the caller's (20 ms of audio each) that may wait for the session.
const TO_SESSION_QUEUE: usize = 256;
/// How often a call's DTMF keys are logged at most.
const KEYS_LOGGED_EVERY: Duration = Duration::from_secs(1);

/// What a call's media is set to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MediaSettings {
    pub jitter: Duration,
    pub max_jitter: Duration,
    pub rtp_timeout: Duration,
}

/// A call's counters, read by `/api/sessions`.
#[derive(Debug, Default)]
pub(crate) struct CallStats {
    pub received: AtomicU64,
    pub lost: AtomicU64,
    pub late: AtomicU64,
    pub foreign: AtomicU64,
    pub sent: AtomicU64,
    pub rtcp_in: AtomicU64,
    pub rtcp_out: AtomicU64,
    /// The DTMF keys the caller pressed, in order (the first [`MAX_KEYS`]).
    pub keys: Mutex<String>,
    /// The codec's name.
    pub codec: &'static str,
    /// Where the caller's RTP goes (the latched source, or before it the SDP's address when
    /// media may go there), and our answer's direction.
    pub remote: Mutex<(Option<SocketAddr>, &'static str)>,
    /// Our RTP address, as the answer gives it.
    pub local: Option<SocketAddr>,
    /// Keys not logged yet, and when keys were last logged.
    keys_log: Mutex<(String, u64, Option<Instant>)>,
}

impl CallStats {
    pub(crate) fn new(codec: &'static str, local: SocketAddr) -> CallStats {
        CallStats {
            codec,
            local: Some(local),
            ..CallStats::default()
        }
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (remote, direction) = self.remote.lock().map(|r| *r).unwrap_or((None, "sendrecv"));
        serde_json::json!({
            "kind": "sip",
            "codec": self.codec,
            "remote_rtp": remote.map(|r| r.to_string()),
            "local_rtp": self.local.map(|r| r.to_string()),
            "direction": direction,
            "packets_received": g(&self.received),
            "packets_lost": g(&self.lost),
            "late": g(&self.late),
            "foreign": g(&self.foreign),
            "packets_sent": g(&self.sent),
            "rtcp_received": g(&self.rtcp_in),
            "rtcp_sent": g(&self.rtcp_out),
            "dtmf": self.keys.lock().map(|k| k.clone()).unwrap_or_default(),
        })
    }

    pub(crate) fn set_remote(&self, to: Option<SocketAddr>, ours: Direction) {
        if let Ok(mut r) = self.remote.lock() {
            *r = (to, ours.name());
        }
    }

    /// The caller pressed `key` (RFC 4733 or SIP INFO): counted, kept for the status (the first
    /// [`MAX_KEYS`]).
    pub(crate) fn pressed(&self, key: char) {
        metrics::counter!(names::SIP_DTMF).increment(1);
        if let Ok(mut keys) = self.keys.lock() {
            if keys.len() < MAX_KEYS {
                keys.push(key);
            }
        }
        if let Ok(mut l) = self.keys_log.lock() {
            if l.0.len() < MAX_KEYS {
                l.0.push(key);
            } else {
                l.1 += 1;
            }
        }
    }

    /// The keys pressed since they were last logged, when [`KEYS_LOGGED_EVERY`] has passed
    /// (or `flush`): at most one line a second per call, however fast keys come.
    pub(crate) fn keys_to_log(&self, now: Instant, flush: bool) -> Option<(String, u64)> {
        let mut l = self.keys_log.lock().ok()?;
        if l.0.is_empty() && l.1 == 0 {
            return None;
        }
        if !flush
            && l.2
                .is_some_and(|t| now.saturating_duration_since(t) < KEYS_LOGGED_EVERY)
        {
            return None;
        }
        l.2 = Some(now);
        Some((std::mem::take(&mut l.0), std::mem::take(&mut l.1)))
    }
}

/// A call's sockets: RTP on an even port, RTCP on the next (none when the caller multiplexes).
pub(crate) struct Sockets {
    pub rtp: UdpSocket,
    pub rtcp: Option<UdpSocket>,
}

impl Sockets {
    /// The RTP port.
    pub(crate) fn port(&self) -> u16 {
        self.rtp.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    /// Our own addresses (RTP's and RTCP's).
    pub(crate) fn addresses(&self) -> Vec<SocketAddr> {
        std::iter::once(&self.rtp)
            .chain(self.rtcp.as_ref())
            .filter_map(|s| s.local_addr().ok())
            .collect()
    }

    /// Binds the sockets on `ip`, on an even port in `range` (RTCP on the odd one above it), or
    /// on any port the system gives when `range` is `None`.
    pub(crate) fn bind(
        ip: IpAddr,
        range: Option<(u16, u16)>,
        mux: bool,
    ) -> std::io::Result<Sockets> {
        let open = |port: u16| -> std::io::Result<UdpSocket> {
            let s = std::net::UdpSocket::bind(SocketAddr::new(ip, port))?;
            s.set_nonblocking(true)?;
            UdpSocket::from_std(s)
        };
        let Some((lo, hi)) = range else {
            let rtp = open(0)?;
            let rtcp = if mux { None } else { Some(open(0)?) };
            return Ok(Sockets { rtp, rtcp });
        };
        let lo = lo + lo % 2;
        let pairs = u32::from(hi.saturating_sub(lo)) / 2 + 1;
        // Start somewhere new each call, so that a port just freed is not taken again at once.
        let start = nanos() % pairs;
        for i in 0..pairs {
            let port = lo as u32 + 2 * ((start + i) % pairs);
            let Ok(port) = u16::try_from(port) else {
                continue;
            };
            let Ok(rtp) = open(port) else { continue };
            if mux {
                return Ok(Sockets { rtp, rtcp: None });
            }
            if let Ok(rtcp) = open(port.wrapping_add(1)) {
                return Ok(Sockets {
                    rtp,
                    rtcp: Some(rtcp),
                });
            }
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("every RTP port in {lo}-{hi} is taken (`sip.rtp_ports`)"),
        ))
    }
}

/// Some bits of the clock: where a call's ports, SSRC and sequence numbers start.
pub(crate) fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
        .unwrap_or(0)
}

/// A call's running media: its two halves for the session, where the door sends the caller's
/// new offers, and the task whose result says why it ended.
pub(crate) struct Running {
    pub sink: ClientSink,
    pub stream: ClientStream,
    pub offers: tokio::sync::mpsc::UnboundedSender<Offer>,
    pub task: tokio::task::JoinHandle<Ended>,
}

/// Starts a call's media on `sockets` from `setup`; `hangup` ends it from the signalling's
/// side.
pub(crate) fn start(
    sockets: Sockets,
    setup: Setup,
    hangup: tokio_util::sync::CancellationToken,
) -> Running {
    let (to_session, from_media) = tokio::sync::mpsc::channel(TO_SESSION_QUEUE);
    let (to_media, from_session) = tokio::sync::mpsc::channel::<Message>(64);
    let (offers, new_offers) = tokio::sync::mpsc::unbounded_channel();
    let caller = setup.offer.rtp;
    let stats = setup.stats.clone();
    let media = CallMedia::new(setup, Instant::now());
    let ends = Ends {
        from_session,
        offers: new_offers,
        hangup,
        to_session,
        stats,
        caller,
    };
    let task = tokio::spawn(run(media, sockets, ends));
    let sink: ClientSink = Box::pin(futures_util::sink::unfold(
        to_media,
        |tx, m: Message| async move {
            tx.send(m)
                .await
                .map_err(|_| axum::Error::new("the call's media has ended"))?;
            Ok(tx)
        },
    ));
    let stream: ClientStream = Box::pin(futures_util::stream::unfold(
        from_media,
        |mut rx| async move { rx.recv().await.map(|m| (Ok(m), rx)) },
    ));
    Running {
        sink,
        stream,
        offers,
        task,
    }
}

/// What the loop talks to besides the sockets.
struct Ends {
    from_session: tokio::sync::mpsc::Receiver<Message>,
    offers: tokio::sync::mpsc::UnboundedReceiver<Offer>,
    hangup: tokio_util::sync::CancellationToken,
    to_session: tokio::sync::mpsc::Sender<Message>,
    stats: Arc<CallStats>,
    caller: SocketAddr,
}

/// The socket loop: each input to the media with the time it came, each output carried out.
async fn run(mut media: CallMedia, sockets: Sockets, mut ends: Ends) -> Ended {
    let mut buf = vec![0u8; 2048];
    let mut rtcp_buf = vec![0u8; 2048];
    let mut session_open = true;
    let ended = loop {
        let now = Instant::now();
        media.handle_timeout(now);
        carry_out(&mut media, &sockets, &ends).await;
        log_keys(&ends, now, false);
        if let Some(e) = media.ended() {
            break e;
        }
        let wake = media.poll_timeout().max(now + Duration::from_millis(1));
        let rtcp_recv = async {
            match &sockets.rtcp {
                Some(s) => s.recv_from(&mut rtcp_buf).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = ends.hangup.cancelled() => break Ended::HungUp,
            m = ends.from_session.recv(), if session_open => match m {
                Some(Message::Binary(b)) => media.handle_agent(Instant::now(), &b),
                Some(Message::Close(_)) | None => {
                    session_open = false;
                    media.close_session();
                }
                Some(_) => {}
            },
            r = sockets.rtp.recv_from(&mut buf) => {
                if let Ok((n, from)) = r {
                    media.handle_rtp(Instant::now(), from, &buf[..n]);
                }
            }
            r = rtcp_recv => {
                if let Ok((n, from)) = r {
                    media.handle_rtcp(from, &rtcp_buf[..n]);
                }
            }
            Some(offer) = ends.offers.recv() => media.renegotiate(Instant::now(), offer),
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
    };
    log_keys(&ends, Instant::now(), true);
    ended
}

/// Sends what the media has to send and hands the session its audio.
async fn carry_out(media: &mut CallMedia, sockets: &Sockets, ends: &Ends) {
    while let Some(o) = media.poll_output() {
        match o {
            Output::Transmit(t) => {
                let socket = match (&sockets.rtcp, t.rtcp) {
                    (Some(s), true) => s,
                    _ => &sockets.rtp,
                };
                let _ = socket.send_to(&t.data, t.to).await;
            }
            Output::Audio(pcm) => {
                // A full queue is the session's business (it counts its drops).
                let _ = ends.to_session.try_send(Message::Binary(pcm.into()));
            }
            Output::Key(_) => {}
        }
    }
}

/// Logs the keys pressed since the last line, at most once a second per call.
fn log_keys(ends: &Ends, now: Instant, flush: bool) {
    if let Some((keys, more)) = ends.stats.keys_to_log(now, flush) {
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        tracing::info!(caller = %ends.caller, "sip: the caller pressed {keys}{more}");
    }
}
