//! A SIP call's media: its RTP socket (and RTCP's, unless multiplexed), the caller's packets
//! through a [`JitterBuffer`] at the codec's clock (G.711's 8 kHz, Opus's 48 kHz) to the
//! session as 16-bit PCM at 24 kHz ([`PhoneIn`] for G.711; libopus at 24 kHz, with in-band FEC
//! and concealment for what is lost, for Opus), each paid for from the call's audio budget
//! before it is decoded; the agent's audio (G.711 made by the call's encoder, or 24 kHz samples
//! that Opus encodes here) cut into 20 ms packets and paced out one packet time apart. Only the address the caller's SDP named is heard: packets from anywhere else are
//! counted and dropped. RFC 4733 telephone events become the call's DTMF keys; an RTCP sender
//! report goes out every [`RTCP_EVERY`]. A caller whose RTP stops for the call's `rtp_timeout`
//! ends the call (its stream to the session ends, as a closed socket's would).
//!
//! Knows nothing of SIP's signalling (the door's) nor of the pipeline (the session's): a call's
//! media is a pair of channels to its session.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::Message;
use tokio::net::UdpSocket;

use super::super::rtp::jitter::{JitterBuffer, Play};
use super::super::rtp::{self, TelephoneEvent};
use super::super::session::{AudioBudget, ClientSink, ClientStream};
use super::sdp::{Format, Offer};
use crate::audio::g711;
use crate::audio::phone::PhoneIn;
use crate::observe::names;

/// G.711 bytes of one 20 ms packet.
const PACKET: usize = 160;
/// Samples at 24 kHz of one 20 ms Opus packet.
const OPUS_SAMPLES: usize = 480;
/// Opus bitrate of the agent's audio.
const OPUS_BITRATE: i32 = 32_000;
const PACKET_TIME: Duration = Duration::from_millis(20);
/// Packets queued for sending past which the pacer sends at twice the rate.
const PACE_CATCH_UP: usize = 4;
/// Packets of the agent's audio held for sending at most (2 s): past it the oldest are dropped.
const MAX_QUEUED: usize = 100;
/// How often an RTCP sender report goes out.
pub(crate) const RTCP_EVERY: Duration = Duration::from_secs(5);
/// DTMF keys kept for the session's status.
const MAX_KEYS: usize = 64;
/// Messages of the caller's (20 ms of audio each) that may wait for the session.
const TO_SESSION_QUEUE: usize = 256;

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
    /// The DTMF keys the caller pressed, in order.
    pub keys: Mutex<String>,
    /// The codec's name, the caller's RTP address.
    pub codec: &'static str,
    pub remote: Option<SocketAddr>,
    /// Our RTP address, as the answer gives it.
    pub local: Option<SocketAddr>,
}

impl CallStats {
    pub(crate) fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "kind": "sip",
            "codec": self.codec,
            "remote_rtp": self.remote.map(|r| r.to_string()),
            "local_rtp": self.local.map(|r| r.to_string()),
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

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32))
        .unwrap_or(0)
}

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

/// Starts a call's media: its two halves for the session, and the task whose result says why
/// it ended. `hangup` ends it from the signalling's side.
pub(crate) fn start(
    sockets: Sockets,
    offer: &Offer,
    settings: MediaSettings,
    pacing: Option<(f64, Duration)>,
    stats: Arc<CallStats>,
    hangup: tokio_util::sync::CancellationToken,
) -> (ClientSink, ClientStream, tokio::task::JoinHandle<Ended>) {
    let (to_session, from_media) = tokio::sync::mpsc::channel(TO_SESSION_QUEUE);
    let (to_media, from_session) = tokio::sync::mpsc::channel::<Message>(64);
    let media = Media {
        rtp: sockets.rtp,
        rtcp: sockets.rtcp,
        offer: offer.clone(),
        settings,
        budget: AudioBudget::paced(pacing),
        codec: Codec::new(offer.codec.format),
        jitter: JitterBuffer::with_clock(settings.jitter, settings.max_jitter, offer.codec.clock()),
        stats,
        to_session,
        ssrc: nanos() | 1,
        seq: nanos() as u16,
        ts: nanos(),
        queued: std::collections::VecDeque::new(),
        pending: Vec::new(),
        first: true,
        octets: 0,
        last_event: None,
        refusal_logged: false,
    };
    let task = tokio::spawn(media.run(from_session, hangup));
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
    (sink, stream, task)
}

struct Media {
    rtp: UdpSocket,
    rtcp: Option<UdpSocket>,
    offer: Offer,
    settings: MediaSettings,
    budget: AudioBudget,
    codec: Codec,
    jitter: JitterBuffer,
    stats: Arc<CallStats>,
    to_session: tokio::sync::mpsc::Sender<Message>,
    ssrc: u32,
    seq: u16,
    ts: u32,
    /// The agent's packets not yet sent.
    queued: std::collections::VecDeque<Vec<u8>>,
    /// The agent's audio not yet a whole packet: G.711 bytes, or 24 kHz samples as f32 LE.
    pending: Vec<u8>,
    first: bool,
    octets: u32,
    /// The timestamp of the last telephone event taken (its packets repeat it).
    last_event: Option<u32>,
    refusal_logged: bool,
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

impl Media {
    async fn run(
        mut self,
        mut from_session: tokio::sync::mpsc::Receiver<Message>,
        hangup: tokio_util::sync::CancellationToken,
    ) -> Ended {
        let c = Counters::new();
        let mut buf = vec![0u8; 2048];
        let mut rtcp_buf = vec![0u8; 2048];
        let mut last_rtp = Instant::now();
        let mut last_seq: Option<u64> = None;
        let mut ts_base: Option<(u32, u64)> = None;
        let mut next_send = Instant::now();
        let mut next_rtcp = Instant::now() + RTCP_EVERY;
        let mut session_open = true;
        loop {
            let now = Instant::now();
            if now.duration_since(last_rtp) >= self.settings.rtp_timeout {
                return Ended::RtpTimeout;
            }
            self.play(now);
            // Once the session has closed, the agent's audio left (less than a packet of it is
            // dropped).
            if !session_open && self.queued.is_empty() {
                return Ended::Session;
            }
            // The agent's audio: a packet every 20 ms, twice as often while the queue is long.
            if now >= next_send {
                if let Some(payload) = self.queued.pop_front() {
                    self.send_packet(payload, &c).await;
                    let step = if self.queued.len() > PACE_CATCH_UP {
                        PACKET_TIME / 2
                    } else {
                        PACKET_TIME
                    };
                    next_send = (next_send + step).max(now - PACKET_TIME);
                } else {
                    next_send = now + PACKET_TIME / 4;
                }
            }
            if now >= next_rtcp {
                next_rtcp = now + RTCP_EVERY;
                self.send_report().await;
            }
            let wake = [
                Some(next_send),
                Some(next_rtcp),
                self.jitter.due(),
                Some(last_rtp + self.settings.rtp_timeout),
            ]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + PACKET_TIME)
            .max(now + Duration::from_millis(1));
            let rtcp_recv = async {
                match &self.rtcp {
                    Some(s) => s.recv_from(&mut rtcp_buf).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = hangup.cancelled() => return Ended::HungUp,
                m = from_session.recv(), if session_open => match m {
                    Some(Message::Binary(b)) => {
                        self.pending.extend_from_slice(&b);
                        self.packetize();
                        if self.queued.len() > MAX_QUEUED {
                            let over = self.queued.len() - MAX_QUEUED;
                            self.queued.drain(..over);
                            metrics::counter!(names::SESSION_DROPPED, "direction" => "out")
                                .increment(over as u64);
                        }
                    }
                    Some(Message::Close(_)) | None => session_open = false,
                    Some(_) => {}
                },
                r = self.rtp.recv_from(&mut buf) => {
                    let Ok((n, from)) = r else { continue };
                    let now = Instant::now();
                    if from != self.offer.rtp {
                        self.stats.foreign.fetch_add(1, Ordering::Relaxed);
                        c.foreign.increment(1);
                        continue;
                    }
                    let packet = &buf[..n];
                    let h = match rtp::parse(packet) {
                        Ok(h) => h,
                        Err(rtp::NotRtp::Rtcp) => {
                            self.stats.rtcp_in.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        Err(_) => {
                            c.malformed.increment(1);
                            continue;
                        }
                    };
                    last_rtp = now;
                    let payload = &packet[h.payload.0..h.payload.1];
                    if Some(h.payload_type) == self.offer.events {
                        self.event(h.timestamp, payload);
                        continue;
                    }
                    if h.payload_type != self.offer.codec.payload_type {
                        // Comfort noise and the like: nothing to hear.
                        c.other.increment(1);
                        continue;
                    }
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                    c.received.increment(1);
                    let seq = extend(last_seq, h.seq);
                    last_seq = Some(last_seq.map_or(seq, |l| l.max(seq)));
                    // The timestamp extended from the first packet's.
                    let (t0, e0) = *ts_base.get_or_insert((h.timestamp, 1 << 32));
                    let ts = (e0 as i64 + i64::from(h.timestamp.wrapping_sub(t0) as i32)) as u64;
                    let late = self.jitter.counts().late;
                    self.jitter.push(seq, ts, Arc::from(payload), now);
                    if self.jitter.counts().late > late {
                        self.stats.late.fetch_add(1, Ordering::Relaxed);
                    }
                }
                r = rtcp_recv => {
                    if r.is_ok() {
                        self.stats.rtcp_in.fetch_add(1, Ordering::Relaxed);
                    }
                }
                _ = tokio::time::sleep_until(wake.into()) => {}
            }
        }
    }

    /// Hands the session what the jitter buffer has due at `now`: each packet's audio, or what
    /// stands for a lost one (Opus: the next packet's FEC or its concealment; G.711 has none of
    /// its own: silence).
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
                // A full queue is the session's business (it counts its drops).
                let _ = self.to_session.try_send(Message::Binary(pcm.into()));
            }
        }
    }

    /// Cuts what the session sent into whole packets (Opus: encoded here).
    fn packetize(&mut self) {
        match &mut self.codec {
            Codec::G711 { .. } => {
                let whole = self.pending.len() / PACKET * PACKET;
                for p in self
                    .pending
                    .drain(..whole)
                    .collect::<Vec<_>>()
                    .chunks(PACKET)
                {
                    self.queued.push_back(p.to_vec());
                }
            }
            Codec::Opus { encoder, .. } => {
                let frame = OPUS_SAMPLES * 4;
                let whole = self.pending.len() / frame * frame;
                let bytes: Vec<u8> = self.pending.drain(..whole).collect();
                let mut packet = [0u8; 1500];
                for f in bytes.chunks(frame) {
                    let samples: Vec<f32> = f
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    let Some(enc) = encoder.as_mut() else {
                        continue;
                    };
                    if let Ok(n) = enc.encode_float(&samples, &mut packet) {
                        self.queued.push_back(packet[..n].to_vec());
                    }
                }
            }
        }
    }

    /// One RFC 4733 event packet: its key taken once per event (its packets repeat the
    /// timestamp).
    fn event(&mut self, timestamp: u32, payload: &[u8]) {
        let Some(e) = TelephoneEvent::parse(payload) else {
            return;
        };
        if self.last_event == Some(timestamp) {
            return;
        }
        self.last_event = Some(timestamp);
        let Some(key) = e.key() else { return };
        metrics::counter!(names::SIP_DTMF).increment(1);
        tracing::info!(caller = %self.offer.rtp, "sip: the caller pressed {key}");
        if let Ok(mut keys) = self.stats.keys.lock() {
            if keys.len() < MAX_KEYS {
                keys.push(key);
            }
        }
    }

    async fn send_packet(&mut self, payload: Vec<u8>, c: &Counters) {
        let p = rtp::packet(
            self.offer.codec.payload_type,
            std::mem::take(&mut self.first),
            self.seq,
            self.ts,
            self.ssrc,
            &payload,
        );
        self.seq = self.seq.wrapping_add(1);
        // 20 ms of the codec's clock: the timestamp counts the audio made.
        self.ts = self.ts.wrapping_add((self.offer.codec.clock() / 50) as u32);
        self.octets = self.octets.wrapping_add(payload.len() as u32);
        let listens = self.offer.direction != "sendonly" && self.offer.direction != "inactive";
        if listens && self.rtp.send_to(&p, self.offer.rtp).await.is_ok() {
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
            c.sent.increment(1);
        }
    }

    async fn send_report(&mut self) {
        let sent = self.stats.sent.load(Ordering::Relaxed) as u32;
        let sr = rtp::sender_report(
            self.ssrc,
            std::time::SystemTime::now(),
            self.ts,
            sent,
            self.octets,
        );
        let socket = self.rtcp.as_ref().unwrap_or(&self.rtp);
        if socket.send_to(&sr, self.offer.rtcp).await.is_ok() {
            self.stats.rtcp_out.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A call's codec on the receive side (and Opus's encoder on the send side).
enum Codec {
    G711 {
        law: g711::Law,
        phone: Option<Box<PhoneIn>>,
    },
    Opus {
        decoder: Option<opus::Decoder>,
        encoder: Option<opus::Encoder>,
    },
}

impl Codec {
    fn new(format: Format) -> Codec {
        match format {
            Format::G711(law) => Codec::G711 {
                law,
                phone: PhoneIn::new(law).ok().map(Box::new),
            },
            Format::Opus => Codec::Opus {
                decoder: opus::Decoder::new(24_000, opus::Channels::Mono).ok(),
                encoder: opus::Encoder::new(24_000, opus::Channels::Mono, opus::Application::Voip)
                    .ok()
                    .map(|mut e| {
                        let _ = e.set_bitrate(opus::Bitrate::Bits(OPUS_BITRATE));
                        let _ = e.set_inband_fec(true);
                        e
                    }),
            },
        }
    }

    /// A packet's length in RTP ticks (Opus: from its table of contents).
    fn ticks(&self, packet: &[u8]) -> u64 {
        match self {
            Codec::G711 { .. } => packet.len() as u64,
            Codec::Opus { .. } => opus::packet::get_nb_samples(packet, 48_000).unwrap_or(0) as u64,
        }
    }

    /// The 24 kHz PCM16 bytes of what the jitter buffer hands out.
    fn decode(&mut self, play: &Play) -> Vec<u8> {
        match self {
            Codec::G711 { law, phone } => {
                let bytes = match play {
                    Play::Packet(d) => d.to_vec(),
                    Play::Fec(_, t) | Play::Conceal(t) => {
                        vec![g711::encode(*law, 0); (*t as usize).min(8 * PACKET)]
                    }
                };
                phone
                    .as_mut()
                    .and_then(|p| p.pcm16(&bytes).ok())
                    .unwrap_or_default()
            }
            Codec::Opus { decoder, .. } => {
                let Some(dec) = decoder.as_mut() else {
                    return Vec::new();
                };
                // Ticks of the 48 kHz clock → samples at 24 kHz, within libopus's 2.5–120 ms.
                let samples = |t: u64| ((t / 2) as usize).clamp(60, 2880);
                let mut pcm = [0i16; 2880];
                let n = match play {
                    Play::Packet(d) => dec.decode(d, &mut pcm, false),
                    Play::Fec(d, t) => dec.decode(d, &mut pcm[..samples(*t)], true),
                    Play::Conceal(t) => dec.decode(&[], &mut pcm[..samples(*t)], false),
                }
                .unwrap_or(0);
                pcm[..n].iter().flat_map(|s| s.to_le_bytes()).collect()
            }
        }
    }
}

/// Metric handles of a call's media.
struct Counters {
    received: metrics::Counter,
    foreign: metrics::Counter,
    malformed: metrics::Counter,
    other: metrics::Counter,
    sent: metrics::Counter,
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_extend_across_the_wrap_and_back() {
        let a = extend(None, 65534);
        let b = extend(Some(a), 65535);
        let c = extend(Some(b), 0);
        let d = extend(Some(c), 1);
        assert_eq!((b - a, c - b, d - c), (1, 1, 1));
        // A late packet from before the wrap stays before it.
        assert_eq!(extend(Some(d), 65533), a - 1);
    }
}
