//! A SIP call's media as a state machine: packets and the agent's audio in, with the time they
//! came ([`CallMedia::handle_rtp`], [`CallMedia::handle_agent`], …), packets to send, audio for
//! the session and DTMF keys out ([`CallMedia::poll_output`]), and the instant it next needs
//! waking ([`CallMedia::poll_timeout`]), as str0m's `handle_input` / `poll_output`. The socket
//! loop around it ([`super::run`]) is thin; everything a call decides about its media is here,
//! and tested on a simulated clock.
//!
//! **Where media goes** (symmetric RTP, "comedia"): the caller's RTP is taken from the address
//! it actually comes from, and the agent's goes back there. The first packet from an address
//! the call may hear from — the SDP's IP, the signalling's, or one in `sip.allow` (a carrier's
//! media gateway) — latches the call to it; a packet from anywhere else is foreign (counted,
//! dropped). A latched source silent for [`RELATCH`] may be replaced by another allowed one (a
//! NAT that rebinds). Before the first packet nothing is sent unless the SDP's address is the
//! signalling's own or trusted: an INVITE cannot aim RTP at a third party. Our own sockets are
//! never heard from nor sent to.
//!
//! **What the call hears**: packets through the [`JitterBuffer`] at the codec's clock, each paid
//! for from the audio budget before it is decoded ([`Codec`]); RFC 4733 events become keys. A
//! caller that sends (its SDP says so) and stays silent for `rtp_timeout` ends the call; one on
//! hold (`inactive`, `recvonly`, `c=0.0.0.0`) is not expected to send.
//!
//! **What the call says**: the agent's audio cut into 20 ms packets, paced one packet time
//! apart (twice as fast while more than [`PACE_CATCH_UP`] wait, the oldest dropped past
//! [`MAX_QUEUED`]); sent only while the caller receives. An RTCP sender report every
//! [`RTCP_EVERY`].

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::super::super::rtp::jitter::{JitterBuffer, Play};
use super::super::super::rtp::{self, TelephoneEvent};
use super::super::super::session::AudioBudget;
use super::super::sdp::Offer;
use super::codec::Codec;
use super::{CallStats, MediaSettings};
use crate::observe::names;

pub(crate) const PACKET_TIME: Duration = Duration::from_millis(20);
/// Packets queued for sending past which the pacer sends at twice the rate.
pub(crate) const PACE_CATCH_UP: usize = 4;
/// Packets of the agent's audio held for sending at most (2 s): past it the oldest are dropped.
pub(crate) const MAX_QUEUED: usize = 100;
/// How often an RTCP sender report goes out.
pub(crate) const RTCP_EVERY: Duration = Duration::from_secs(5);
/// How long a latched source must be silent before another may take its place.
pub(crate) const RELATCH: Duration = Duration::from_secs(1);

/// Why a call's media ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The session closed it (hung up on our side).
    Session,
    /// The caller sent no RTP for the call's `rtp_timeout`.
    RtpTimeout,
    /// The call was hung up by its signalling (a BYE, a CANCEL).
    HungUp,
}

/// A packet to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Transmit {
    pub to: SocketAddr,
    /// From the RTCP socket (when the call has one).
    pub rtcp: bool,
    pub data: Vec<u8>,
}

/// What the media has for the world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Output {
    Transmit(Transmit),
    /// The caller's audio for the session: 16-bit PCM at 24 kHz, little-endian.
    Audio(Vec<u8>),
    /// A DTMF key the caller pressed.
    Key(char),
}

/// What a call's media starts from.
pub(crate) struct Setup {
    pub offer: Offer,
    pub settings: MediaSettings,
    /// The session's audio budget (`AudioBudget::pacing` of the template).
    pub pacing: Option<(f64, Duration)>,
    /// Where the call's signalling came from.
    pub signalling: IpAddr,
    /// Whether an address is in `sip.allow` (a trunk's media gateway).
    pub trusted: Arc<dyn Fn(IpAddr) -> bool + Send + Sync>,
    /// Our own sockets (never heard from nor sent to).
    pub own: Vec<SocketAddr>,
    /// Seeds the SSRC, the first sequence number and timestamp.
    pub seed: u32,
    pub stats: Arc<CallStats>,
}

/// Where the caller is.
struct Peer {
    /// The SDP's RTP and RTCP addresses.
    offered: SocketAddr,
    offered_rtcp: SocketAddr,
    mux: bool,
    signalling: IpAddr,
    trusted: Arc<dyn Fn(IpAddr) -> bool + Send + Sync>,
    own: Vec<SocketAddr>,
    /// The latched RTP source and when it was last heard.
    rtp: Option<(SocketAddr, Instant)>,
    /// The latched RTCP source.
    rtcp: Option<SocketAddr>,
}

/// An IPv4-mapped IPv6 address as the IPv4 it is.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(crate::app::serve::access::canonical(a.ip()), a.port())
}

impl Peer {
    /// Whether the call may hear from (and so latch to) `ip`.
    fn may_latch(&self, ip: IpAddr) -> bool {
        ip == self.offered.ip() || ip == self.signalling || (self.trusted)(ip)
    }

    /// Whether media may go to the SDP's address before anything came from it.
    fn early(&self) -> bool {
        let ip = self.offered.ip();
        !ip.is_unspecified() && (ip == self.signalling || (self.trusted)(ip))
    }

    /// Takes (or refuses) RTP from `from` at `now`; a new latch is reported.
    fn hear(&mut self, now: Instant, from: SocketAddr) -> Option<bool> {
        if self.own.contains(&from) {
            return None;
        }
        match self.rtp {
            Some((at, _)) if at == from => {
                self.rtp = Some((from, now));
                Some(false)
            }
            Some((_, heard)) if now.saturating_duration_since(heard) < RELATCH => None,
            _ if self.may_latch(from.ip()) => {
                self.rtp = Some((from, now));
                Some(true)
            }
            _ => None,
        }
    }

    /// Takes (or refuses) RTCP from `from` (on the RTCP socket).
    fn hear_rtcp(&mut self, from: SocketAddr) -> bool {
        if self.own.contains(&from) {
            return false;
        }
        if self.rtcp == Some(from) || self.may_latch(from.ip()) {
            self.rtcp = Some(from);
            return true;
        }
        false
    }

    fn rtp_target(&self) -> Option<SocketAddr> {
        self.rtp
            .map(|(a, _)| a)
            .or_else(|| self.early().then_some(self.offered))
    }

    fn rtcp_target(&self) -> Option<SocketAddr> {
        if self.mux {
            return self.rtp_target();
        }
        self.rtcp
            .or_else(|| self.early().then_some(self.offered_rtcp))
    }
}

/// The receive side's running state.
#[derive(Default)]
struct Receive {
    last_seq: Option<u64>,
    /// The first packet's timestamp and its extended value.
    ts_base: Option<(u32, u64)>,
    /// The timestamp of the last telephone event taken (its packets repeat it).
    last_event: Option<u32>,
}

/// The send side's running state.
struct Sending {
    ssrc: u32,
    seq: u16,
    ts: u32,
    first: bool,
    octets: u32,
    sent: u32,
    /// The agent's packets not yet sent.
    queued: VecDeque<Vec<u8>>,
    /// The agent's audio not yet a whole packet.
    pending: Vec<u8>,
    next_send: Instant,
    next_rtcp: Instant,
}

/// Metric handles of a call's media.
struct Counters {
    received: metrics::Counter,
    foreign: metrics::Counter,
    malformed: metrics::Counter,
    other: metrics::Counter,
    sent: metrics::Counter,
    dropped_out: metrics::Counter,
}

impl Counters {
    fn new() -> Self {
        let c = |d: &'static str, o: &'static str| metrics::counter!(names::SIP_RTP_PACKETS, "direction" => d, "outcome" => o);
        Counters {
            received: c("in", "received"),
            foreign: c("in", "foreign"),
            malformed: c("in", "malformed"),
            other: c("in", "other_payload"),
            sent: c("out", "sent"),
            dropped_out: metrics::counter!(names::SESSION_DROPPED, "direction" => "out"),
        }
    }
}

/// A call's media. See the module's doc.
pub(crate) struct CallMedia {
    offer: Offer,
    settings: MediaSettings,
    peer: Peer,
    budget: AudioBudget,
    codec: Codec,
    jitter: JitterBuffer,
    rx: Receive,
    /// When the caller's RTP was last heard (or the call, or its last change, began).
    last_rtp: Instant,
    tx: Sending,
    /// The wall clock at `origin`, for RTCP's NTP time.
    origin: (Instant, SystemTime),
    session_open: bool,
    ended: Option<Ended>,
    out: VecDeque<Output>,
    stats: Arc<CallStats>,
    counters: Counters,
    refusal_logged: bool,
}

impl CallMedia {
    pub(crate) fn new(s: Setup, now: Instant) -> CallMedia {
        let offer = s.offer;
        let peer = Peer {
            offered: canonical(offer.rtp),
            offered_rtcp: canonical(offer.rtcp),
            mux: offer.rtcp_mux,
            signalling: crate::app::serve::access::canonical(s.signalling),
            trusted: s.trusted,
            own: s.own.into_iter().map(canonical).collect(),
            rtp: None,
            rtcp: None,
        };
        s.stats
            .set_remote(peer.rtp_target(), offer.answer_direction());
        CallMedia {
            jitter: JitterBuffer::with_clock(
                s.settings.jitter,
                s.settings.max_jitter,
                offer.codec.clock(),
            ),
            codec: Codec::new(offer.codec.format),
            budget: AudioBudget::paced(s.pacing),
            settings: s.settings,
            peer,
            rx: Receive::default(),
            last_rtp: now,
            tx: Sending {
                ssrc: s.seed | 1,
                seq: s.seed as u16,
                ts: s.seed.rotate_left(16),
                first: true,
                octets: 0,
                sent: 0,
                queued: VecDeque::new(),
                pending: Vec::new(),
                next_send: now,
                next_rtcp: now + RTCP_EVERY,
            },
            origin: (now, SystemTime::now()),
            session_open: true,
            ended: None,
            out: VecDeque::new(),
            stats: s.stats,
            counters: Counters::new(),
            refusal_logged: false,
            offer,
        }
    }

    /// Why the media ended, once it has.
    pub(crate) fn ended(&self) -> Option<Ended> {
        self.ended
    }

    /// The next output, if any.
    pub(crate) fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called.
    pub(crate) fn poll_timeout(&self) -> Instant {
        let send = (!self.tx.queued.is_empty()).then_some(self.tx.next_send);
        let silence = self
            .offer
            .sends_media()
            .then_some(self.last_rtp + self.settings.rtp_timeout);
        [Some(self.tx.next_rtcp), send, self.jitter.due(), silence]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(self.tx.next_rtcp)
    }

    /// What is due at `now`: the caller's audio to play, the agent's packets to send, a
    /// sender report, the RTP timeout.
    pub(crate) fn handle_timeout(&mut self, now: Instant) {
        if self.ended.is_some() {
            return;
        }
        if self.offer.sends_media()
            && now.saturating_duration_since(self.last_rtp) >= self.settings.rtp_timeout
        {
            self.ended = Some(Ended::RtpTimeout);
            return;
        }
        self.play(now);
        self.send_due(now);
        if !self.session_open && self.tx.queued.is_empty() {
            self.ended = Some(Ended::Session);
            return;
        }
        if now >= self.tx.next_rtcp {
            self.tx.next_rtcp = now + RTCP_EVERY;
            self.report(now);
        }
    }

    /// A datagram on the RTP socket from `from` at `now`.
    pub(crate) fn handle_rtp(&mut self, now: Instant, from: SocketAddr, packet: &[u8]) {
        let from = canonical(from);
        let h = match rtp::parse(packet) {
            Ok(h) => h,
            Err(rtp::NotRtp::Rtcp) => {
                // Multiplexed RTCP: heard like RTP, counted.
                if self.peer.hear_rtcp(from) {
                    self.stats.rtcp_in.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
            Err(_) => {
                self.counters.malformed.increment(1);
                return;
            }
        };
        match self.peer.hear(now, from) {
            None => {
                self.stats.foreign.fetch_add(1, Ordering::Relaxed);
                self.counters.foreign.increment(1);
                return;
            }
            Some(true) => {
                // A new source: its sequence and timestamps start afresh.
                self.rx = Receive::default();
                self.stats
                    .set_remote(self.peer.rtp_target(), self.offer.answer_direction());
            }
            Some(false) => {}
        }
        self.last_rtp = now;
        let payload = &packet[h.payload.0..h.payload.1];
        if Some(h.payload_type) == self.offer.events {
            self.event(h.timestamp, payload);
            return;
        }
        if h.payload_type != self.offer.codec.payload_type {
            // Comfort noise and the like: nothing to hear.
            self.counters.other.increment(1);
            return;
        }
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        self.counters.received.increment(1);
        let seq = extend(self.rx.last_seq, h.seq);
        self.rx.last_seq = Some(self.rx.last_seq.map_or(seq, |l| l.max(seq)));
        let (t0, e0) = *self.rx.ts_base.get_or_insert((h.timestamp, 1 << 32));
        let ts = (e0 as i64 + i64::from(h.timestamp.wrapping_sub(t0) as i32)) as u64;
        let late = self.jitter.counts().late;
        self.jitter.push(seq, ts, Arc::from(payload), now);
        if self.jitter.counts().late > late {
            self.stats.late.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A datagram on the RTCP socket.
    pub(crate) fn handle_rtcp(&mut self, from: SocketAddr, _packet: &[u8]) {
        if self.peer.hear_rtcp(canonical(from)) {
            self.stats.rtcp_in.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The agent's audio from the session: G.711 bytes, or 24 kHz samples as f32 LE (Opus).
    pub(crate) fn handle_agent(&mut self, now: Instant, bytes: &[u8]) {
        if self.tx.queued.is_empty() {
            self.tx.next_send = self.tx.next_send.max(now);
        }
        self.tx.pending.extend_from_slice(bytes);
        self.codec
            .packetize(&mut self.tx.pending, &mut self.tx.queued);
        if self.tx.queued.len() > MAX_QUEUED {
            let over = self.tx.queued.len() - MAX_QUEUED;
            self.tx.queued.drain(..over);
            self.counters.dropped_out.increment(over as u64);
        }
    }

    /// The session has closed: the media ends once the agent's audio left has gone out.
    pub(crate) fn close_session(&mut self) {
        self.session_open = false;
    }

    /// The caller's new offer (a re-INVITE or an UPDATE: a hold, a resume, a new address), in
    /// the call's codec. A new address is latched afresh; an old-style hold (`c=0.0.0.0`) keeps
    /// the old one for the resume.
    pub(crate) fn renegotiate(&mut self, now: Instant, offer: Offer) {
        let to = canonical(offer.rtp);
        if !to.ip().is_unspecified() && to != self.peer.offered {
            self.peer.offered = to;
            self.peer.offered_rtcp = canonical(offer.rtcp);
            self.peer.mux = offer.rtcp_mux;
            self.peer.rtp = None;
            self.peer.rtcp = None;
            self.rx = Receive::default();
            self.jitter = JitterBuffer::with_clock(
                self.settings.jitter,
                self.settings.max_jitter,
                offer.codec.clock(),
            );
        }
        // The caller gets a whole timeout after a change.
        self.last_rtp = now;
        self.offer = offer;
        self.stats
            .set_remote(self.peer.rtp_target(), self.offer.answer_direction());
    }

    /// Hands the session what the jitter buffer has due at `now`: each packet's audio, or what
    /// stands for a lost one (Opus: the next packet's FEC or its concealment; G.711: silence).
    fn play(&mut self, now: Instant) {
        let clock = self.offer.codec.clock();
        while let Some(play) = self.jitter.pop(now) {
            let ticks = match &play {
                Play::Packet(d) => self.codec.ticks(d),
                Play::Fec(_, t) | Play::Conceal(t) => {
                    self.stats.lost.fetch_add(1, Ordering::Relaxed);
                    *t
                }
            };
            if ticks == 0 {
                continue;
            }
            let d = Duration::from_micros(ticks * 1_000_000 / clock);
            if !self.budget.take_at(d, now) {
                if !std::mem::replace(&mut self.refusal_logged, true) {
                    tracing::warn!(
                        caller = %self.offer.rtp,
                        "sip: the caller's audio comes faster than real time: what exceeds the \
                         catch-up allowance is skipped undecoded (counted in {})",
                        names::OPUS_REFUSED
                    );
                }
                continue;
            }
            let pcm = self.codec.decode(&play);
            if !pcm.is_empty() {
                self.out.push_back(Output::Audio(pcm));
            }
        }
    }

    /// Sends the agent's packets due at `now` (to the caller when it listens; else they are
    /// dropped on their schedule).
    fn send_due(&mut self, now: Instant) {
        while now >= self.tx.next_send {
            let Some(payload) = self.tx.queued.pop_front() else {
                return;
            };
            let p = rtp::packet(
                self.offer.codec.payload_type,
                std::mem::take(&mut self.tx.first),
                self.tx.seq,
                self.tx.ts,
                self.tx.ssrc,
                &payload,
            );
            self.tx.seq = self.tx.seq.wrapping_add(1);
            // 20 ms of the codec's clock: the timestamp counts the audio made.
            self.tx.ts = self
                .tx
                .ts
                .wrapping_add((self.offer.codec.clock() / 50) as u32);
            let target = self.offer.wants_media().then(|| self.peer.rtp_target());
            if let Some(Some(to)) = target {
                self.tx.octets = self.tx.octets.wrapping_add(payload.len() as u32);
                self.tx.sent = self.tx.sent.wrapping_add(1);
                self.stats.sent.fetch_add(1, Ordering::Relaxed);
                self.counters.sent.increment(1);
                self.out.push_back(Output::Transmit(Transmit {
                    to,
                    rtcp: false,
                    data: p,
                }));
            }
            let step = if self.tx.queued.len() > PACE_CATCH_UP {
                PACKET_TIME / 2
            } else {
                PACKET_TIME
            };
            self.tx.next_send =
                (self.tx.next_send + step).max(now.checked_sub(PACKET_TIME).unwrap_or(now));
        }
    }

    /// An RTCP sender report, where the caller takes RTCP.
    fn report(&mut self, now: Instant) {
        let Some(to) = self.peer.rtcp_target() else {
            return;
        };
        if !self.offer.wants_media() {
            return;
        }
        let wall = self.origin.1 + now.saturating_duration_since(self.origin.0);
        let sr = rtp::sender_report(self.tx.ssrc, wall, self.tx.ts, self.tx.sent, self.tx.octets);
        self.stats.rtcp_out.fetch_add(1, Ordering::Relaxed);
        self.out.push_back(Output::Transmit(Transmit {
            to,
            rtcp: !self.peer.mux,
            data: sr,
        }));
    }

    /// One RFC 4733 event packet: its key taken once per event (its packets repeat the
    /// timestamp).
    fn event(&mut self, timestamp: u32, payload: &[u8]) {
        let Some(e) = TelephoneEvent::parse(payload) else {
            return;
        };
        if self.rx.last_event == Some(timestamp) {
            return;
        }
        self.rx.last_event = Some(timestamp);
        if let Some(key) = e.key() {
            self.stats.pressed(key);
            self.out.push_back(Output::Key(key));
        }
    }
}

/// Extends a 16-bit sequence number next to the last extended one.
fn extend(last: Option<u64>, seq: u16) -> u64 {
    let Some(last) = last else {
        return u64::from(seq) + (1 << 16);
    };
    let base = last & !0xffff;
    [base.wrapping_sub(1 << 16), base, base + (1 << 16)]
        .into_iter()
        .map(|b| b + u64::from(seq))
        .min_by_key(|c| c.abs_diff(last))
        .unwrap_or(last)
}

#[cfg(test)]
mod tests;
