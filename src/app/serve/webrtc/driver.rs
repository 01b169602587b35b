//! The WebRTC driver: one UDP socket, every peer's [`Rtc`] (str0m, sans-IO: ICE, DTLS-SRTP,
//! RTP, SCTP) on one thread of its own, and the audio conversions between a peer's RTP and its
//! session. Incoming Opus packets go through the peer's [`JitterBuffer`] and libopus (at
//! 24 kHz, with in-band FEC and concealment) to the session as 16-bit PCM, each paid for from
//! the peer's audio budget before it is decoded (its duration read from its table of contents,
//! at the session's pacing, handed over with the peer): a sender whose timestamps crowd its
//! packets together gets no more decoded than real time and the catch-up, the rest skipped
//! undecoded and counted. The session's PCM is
//! cut into 20 ms Opus packets, stamped from the model's frame clock (the RTP timestamp counts
//! the audio made, not the time it was sent) and paced out one packet time apart (a burst after
//! a slow tick leaves at twice that rate until the queue is short again). Text goes both ways
//! on the data channel.
//!
//! A peer ends when its ICE connection is lost, its session closes it, the client hangs up
//! (`DELETE`, once: the peer's token is then no longer live), or it does not connect (ICE and
//! DTLS) within its `connect_timeout`. Knows nothing of HTTP, of sessions' pipelines or of the
//! server's limits: a peer is a pair of channels to its session.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::Message;
use str0m::channel::ChannelId;
use str0m::media::{MediaKind, Mid};
use str0m::net::{Protocol, Receive};
use str0m::{Event, IceConnectionState, Input, Rtc};

use super::super::rtp::jitter::{JitterBuffer, Play, CLOCK};
use super::super::session::AudioBudget;
use crate::observe::names;

/// Samples of one 20 ms packet at the session's 24 kHz.
const PACKET_SAMPLES: usize = 480;
/// RTP ticks of one packet (48 kHz clock).
const PACKET_TICKS: u64 = 960;
/// One packet's time.
const PACKET_TIME: Duration = Duration::from_millis(20);
/// Packets queued for sending past which the pacer sends at twice the rate.
const PACE_CATCH_UP: usize = 4;
/// How long a closing peer keeps running to deliver its last data-channel messages.
const LINGER: Duration = Duration::from_millis(500);
/// Data-channel messages kept for a channel not yet open.
const PENDING_TEXT: usize = 256;
/// Opus bitrate of the agent's audio.
const BITRATE: i32 = 32_000;

/// A peer's counters, read by `/api/sessions` and the page.
#[derive(Debug, Default)]
pub(crate) struct PeerStats {
    pub received: AtomicU64,
    pub lost: AtomicU64,
    pub fec: AtomicU64,
    pub concealed: AtomicU64,
    pub late: AtomicU64,
    pub reordered: AtomicU64,
    pub sent: AtomicU64,
    /// The jitter buffer's current delay, ms.
    pub delay_ms: AtomicU64,
    /// Packets waiting in the jitter buffer.
    pub depth: AtomicU64,
    /// 1 once ICE and DTLS are up.
    pub connected: AtomicU64,
}

impl PeerStats {
    pub(crate) fn json(&self) -> serde_json::Value {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "kind": "webrtc",
            "connected": g(&self.connected) == 1,
            "packets_received": g(&self.received),
            "packets_lost": g(&self.lost),
            "fec_recovered": g(&self.fec),
            "concealed_ms": g(&self.concealed) * 20,
            "late": g(&self.late),
            "reordered": g(&self.reordered),
            "packets_sent": g(&self.sent),
            "jitter_buffer_ms": g(&self.delay_ms),
            "jitter_buffer_packets": g(&self.depth),
        })
    }
}

/// A peer as the signalling hands it over.
pub(crate) struct NewPeer {
    pub token: String,
    pub rtc: Rtc,
    /// The session's reading half: the client's audio (PCM16) and data-channel text.
    pub to_session: tokio::sync::mpsc::Sender<Message>,
    pub stats: Arc<PeerStats>,
    pub jitter_delay: Duration,
    pub jitter_max: Duration,
    /// The longest the peer may take to connect (ICE and DTLS) after its answer.
    pub connect_timeout: Duration,
    /// How fast its audio may be decoded: times real time, and the catch-up ahead of it
    /// (`None`: unpaced).
    pub pacing: Option<(f64, Duration)>,
}

pub(crate) enum Command {
    Add(Box<NewPeer>),
    /// The client hung up.
    Hangup(String),
}

/// The handle of the driver's thread.
pub(crate) struct Driver {
    commands: tokio::sync::mpsc::UnboundedSender<Command>,
    outbound: tokio::sync::mpsc::Sender<(String, Message)>,
    /// The tokens of the peers alive, and whether each has been hung up.
    pub live: Arc<Mutex<HashMap<String, bool>>>,
    /// The socket's address.
    pub local: SocketAddr,
}

impl Driver {
    /// Starts the driver on `socket`.
    ///
    /// # Errors
    ///
    /// When the thread or its runtime cannot start.
    pub(crate) fn start(
        socket: std::net::UdpSocket,
        candidates: Vec<SocketAddr>,
    ) -> anyhow::Result<Driver> {
        static CRYPTO: std::sync::Once = std::sync::Once::new();
        CRYPTO.call_once(|| str0m::crypto::from_feature_flags().install_process_default());
        socket.set_nonblocking(true)?;
        let local = socket.local_addr()?;
        let (commands, cmd_rx) = tokio::sync::mpsc::unbounded_channel();
        let (outbound, out_rx) = tokio::sync::mpsc::channel(1024);
        let live = Arc::new(Mutex::new(HashMap::new()));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let l = live.clone();
        std::thread::Builder::new()
            .name("duplex:webrtc".into())
            .spawn(move || {
                rt.block_on(async move {
                    match tokio::net::UdpSocket::from_std(socket) {
                        Ok(s) => drive(s, candidates, cmd_rx, out_rx, l).await,
                        Err(e) => tracing::error!("webrtc: the UDP socket: {e}"),
                    }
                })
            })?;
        Ok(Driver {
            commands,
            outbound,
            live,
            local,
        })
    }

    /// Hands a peer to the driver.
    pub(crate) fn add(&self, peer: NewPeer) -> bool {
        if let Ok(mut l) = self.live.lock() {
            l.insert(peer.token.clone(), false);
        }
        self.commands.send(Command::Add(Box::new(peer))).is_ok()
    }

    /// Hangs up the peer of `token`; `false` when there is none, or it was hung up already.
    pub(crate) fn hangup(&self, token: &str) -> bool {
        let first = self.live.lock().is_ok_and(|mut l| match l.get_mut(token) {
            Some(hung) if !*hung => {
                *hung = true;
                true
            }
            _ => false,
        });
        first && self.commands.send(Command::Hangup(token.into())).is_ok()
    }

    /// Whether the peer of `token` is alive (and not hung up).
    pub(crate) fn is_live(&self, token: &str) -> bool {
        self.live
            .lock()
            .is_ok_and(|l| l.get(token).is_some_and(|hung| !*hung))
    }

    /// The session's writing half for the peer of `token`.
    pub(crate) fn sink(&self, token: String) -> super::super::session::ClientSink {
        let tx = self.outbound.clone();
        Box::pin(futures_util::sink::unfold(
            (tx, token),
            |(tx, token), m: Message| async move {
                tx.send((token.clone(), m))
                    .await
                    .map_err(|_| axum::Error::new("the WebRTC driver has stopped"))?;
                Ok((tx, token))
            },
        ))
    }
}

/// Samples at 24 kHz of `ticks` of the 48 kHz RTP clock, within what libopus decodes at once
/// (2.5 to 120 ms).
fn samples(ticks: u64) -> usize {
    ((ticks / 2) as usize).clamp(60, 2880)
}

/// Metric handles of the driver.
struct Counters {
    received: metrics::Counter,
    lost: metrics::Counter,
    fec: metrics::Counter,
    concealed: metrics::Counter,
    late: metrics::Counter,
    reordered: metrics::Counter,
    sent: metrics::Counter,
}

impl Counters {
    fn new() -> Self {
        let c = |d: &'static str, o: &'static str| metrics::counter!(names::WEBRTC_PACKETS, "direction" => d, "outcome" => o);
        Counters {
            received: c("in", "received"),
            lost: c("in", "lost"),
            fec: c("in", "fec_recovered"),
            concealed: c("in", "concealed"),
            late: c("in", "late"),
            reordered: c("in", "reordered"),
            sent: c("out", "sent"),
        }
    }
}

/// The label values of [`names::WEBRTC_PACKETS`], for series that exist from the start.
pub(crate) const PACKET_SERIES: [(&str, &str); 7] = [
    ("in", "received"),
    ("in", "lost"),
    ("in", "fec_recovered"),
    ("in", "concealed"),
    ("in", "late"),
    ("in", "reordered"),
    ("out", "sent"),
];

struct Peer {
    token: String,
    rtc: Rtc,
    to_session: Option<tokio::sync::mpsc::Sender<Message>>,
    stats: Arc<PeerStats>,
    audio: Option<Mid>,
    channel: Option<ChannelId>,
    pending_text: VecDeque<String>,
    jitter: JitterBuffer,
    decoder: Option<opus::Decoder>,
    encoder: Option<opus::Encoder>,
    pcm_out: Vec<f32>,
    send_queue: VecDeque<Vec<u8>>,
    next_send: Instant,
    rtp_ts: u64,
    created: Instant,
    connect_timeout: Duration,
    /// What the client's audio may cost before it is decoded (refusals counted by it).
    budget: AudioBudget,
    /// Whether a refusal has been logged (once per peer).
    refusal_logged: bool,
    connected: bool,
    /// When the peer is disconnected and dropped.
    closing: Option<Instant>,
    seen: JitterCounts,
}

/// The jitter buffer's counts as last published.
type JitterCounts = super::super::rtp::jitter::Counts;

impl Peer {
    fn new(p: NewPeer, now: Instant) -> Peer {
        let decoder = opus::Decoder::new(24_000, opus::Channels::Mono)
            .map_err(|e| tracing::error!("webrtc: an Opus decoder: {e}"))
            .ok();
        let encoder = opus::Encoder::new(24_000, opus::Channels::Mono, opus::Application::Voip)
            .map_err(|e| tracing::error!("webrtc: an Opus encoder: {e}"))
            .ok()
            .map(|mut e| {
                let _ = e.set_bitrate(opus::Bitrate::Bits(BITRATE));
                let _ = e.set_inband_fec(true);
                let _ = e.set_packet_loss_perc(5);
                e
            });
        Peer {
            token: p.token,
            rtc: p.rtc,
            to_session: Some(p.to_session),
            stats: p.stats,
            audio: None,
            channel: None,
            pending_text: VecDeque::new(),
            jitter: JitterBuffer::new(p.jitter_delay, p.jitter_max),
            decoder,
            encoder,
            pcm_out: Vec::new(),
            send_queue: VecDeque::new(),
            next_send: now,
            rtp_ts: 0,
            created: now,
            connect_timeout: p.connect_timeout,
            budget: AudioBudget::paced(p.pacing),
            refusal_logged: false,
            connected: false,
            closing: None,
            seen: JitterCounts::default(),
        }
    }

    /// The client is gone (or hung up): its session's input ends; the peer lingers briefly.
    fn client_gone(&mut self, now: Instant, why: &str) {
        if self.to_session.take().is_some() {
            tracing::info!(peer = %self.token, "webrtc: {why}");
        }
        self.closing.get_or_insert(now + LINGER);
    }

    fn finished(&self, now: Instant) -> bool {
        !self.rtc.is_alive() || self.closing.is_some_and(|c| now >= c)
    }

    /// A message of the session's.
    fn session_says(&mut self, m: Message, now: Instant) {
        match m {
            Message::Binary(b) => {
                self.pcm_out.extend(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
                let mut packet = [0u8; 1500];
                while self.pcm_out.len() >= PACKET_SAMPLES {
                    let frame: Vec<f32> = self.pcm_out.drain(..PACKET_SAMPLES).collect();
                    let Some(enc) = self.encoder.as_mut() else {
                        continue;
                    };
                    match enc.encode_float(&frame, &mut packet) {
                        Ok(n) => self.send_queue.push_back(packet[..n].to_vec()),
                        Err(e) => tracing::warn!(peer = %self.token, "webrtc: Opus encode: {e}"),
                    }
                }
            }
            Message::Text(t) => self.text(t.to_string()),
            Message::Close(frame) => {
                let (code, reason) = frame
                    .map(|f| (f.code, f.reason.to_string()))
                    .unwrap_or((1000, String::new()));
                self.text(
                    serde_json::json!({"type": "end", "code": code, "reason": reason}).to_string(),
                );
                self.to_session = None;
                self.closing.get_or_insert(now + LINGER);
            }
            _ => {}
        }
    }

    fn text(&mut self, t: String) {
        if let Some(cid) = self.channel {
            if let Some(mut ch) = self.rtc.channel(cid) {
                if ch.write(false, t.as_bytes()).is_ok() {
                    return;
                }
            }
        }
        if self.pending_text.len() >= PENDING_TEXT {
            self.pending_text.pop_front();
        }
        self.pending_text.push_back(t);
    }

    /// Whether `ticks` of the client's audio may be decoded at `now` (what the budget refuses
    /// it counts; the first refusal is logged).
    fn afford(&mut self, ticks: u64, now: Instant) -> bool {
        let d = Duration::from_micros(ticks * 1_000_000 / CLOCK);
        if self.budget.take_at(d, now) {
            return true;
        }
        if !std::mem::replace(&mut self.refusal_logged, true) {
            tracing::warn!(
                peer = %self.token,
                "webrtc: the client's audio comes faster than real time: what exceeds the \
                 catch-up allowance is skipped undecoded (counted in {})",
                names::OPUS_REFUSED
            );
        }
        false
    }

    /// Plays what the jitter buffer has due, sends what the pacer lets out, and runs the
    /// peer's state machine; returns when it wants to be woken.
    fn service(&mut self, now: Instant, socket: &tokio::net::UdpSocket, c: &Counters) -> Instant {
        // The client's audio, due now.
        while let Some(play) = self.jitter.pop(now) {
            let ticks = match &play {
                // From the packet's table of contents (unreadable: nothing to decode).
                Play::Packet(d) => {
                    opus::packet::get_nb_samples(d, CLOCK as u32).unwrap_or(0) as u64
                }
                Play::Fec(_, t) | Play::Conceal(t) => *t,
            };
            if !self.afford(ticks, now) {
                continue;
            }
            let mut pcm = [0i16; 5760];
            let n = match (&play, self.decoder.as_mut()) {
                (_, None) => 0,
                // RTP padding (a sender's bandwidth probe) holds a sequence number and no audio.
                (Play::Packet(d), _) if d.is_empty() => 0,
                (Play::Packet(d), Some(dec)) => dec.decode(d, &mut pcm, false).unwrap_or(0),
                (Play::Fec(d, ticks), Some(dec)) => dec
                    .decode(d, &mut pcm[..samples(*ticks)], true)
                    .unwrap_or(0),
                (Play::Conceal(ticks), Some(dec)) => dec
                    .decode(&[], &mut pcm[..samples(*ticks)], false)
                    .unwrap_or(0),
            };
            if n > 0 {
                if let Some(tx) = &self.to_session {
                    let bytes: Vec<u8> = pcm[..n].iter().flat_map(|s| s.to_le_bytes()).collect();
                    // A full queue is the session's business (it counts its drops).
                    let _ = tx.try_send(Message::Binary(bytes.into()));
                }
            }
        }
        self.publish(c);
        // The agent's audio, paced.
        if let Some(mid) = self.audio {
            if self.next_send + 2 * PACKET_TIME < now {
                self.next_send = now;
            }
            while self.next_send <= now {
                let Some(packet) = self.send_queue.pop_front() else {
                    break;
                };
                if let Ok(true) =
                    crate::app::rtc::write_opus(&mut self.rtc, mid, now, self.rtp_ts, &packet)
                {
                    self.stats.sent.fetch_add(1, Ordering::Relaxed);
                    c.sent.increment(1);
                }
                self.rtp_ts += PACKET_TICKS;
                let step = if self.send_queue.len() > PACE_CATCH_UP {
                    PACKET_TIME / 2
                } else {
                    PACKET_TIME
                };
                self.next_send += step;
            }
        } else {
            // Nobody to send to yet: what the agent said meanwhile is not kept.
            self.send_queue.clear();
        }
        // The state machine: transmits, events (what they make it write goes out at once), its
        // next timeout.
        let mut wake = now + Duration::from_millis(100);
        loop {
            let mut events = Vec::new();
            match crate::app::rtc::poll(&mut self.rtc, socket, wake, |e| events.push(e)) {
                Ok(w) => wake = w,
                Err(e) => {
                    tracing::info!(peer = %self.token, "webrtc: {e}");
                    self.rtc.disconnect();
                    self.client_gone(now, "the peer failed");
                    break;
                }
            }
            if events.is_empty() {
                break;
            }
            for e in events {
                self.event(e, now);
            }
        }
        if !self.connected && now.duration_since(self.created) > self.connect_timeout {
            self.client_gone(
                now,
                "the peer did not connect within limits.handshake_timeout_s",
            );
        }
        if let Some(d) = self.jitter.due() {
            wake = wake.min(d);
        }
        if self.audio.is_some() && !self.send_queue.is_empty() {
            wake = wake.min(self.next_send);
        }
        if let Some(c) = self.closing {
            wake = wake.min(c);
        }
        wake
    }

    fn event(&mut self, e: Event, now: Instant) {
        match e {
            Event::IceConnectionStateChange(IceConnectionState::Disconnected) => {
                self.client_gone(now, "the connection was lost (ICE)");
            }
            Event::Connected => {
                self.connected = true;
                self.stats.connected.store(1, Ordering::Release);
                tracing::info!(peer = %self.token, "webrtc: connected");
            }
            Event::MediaAdded(m) if m.kind == MediaKind::Audio && self.audio.is_none() => {
                self.audio = Some(m.mid);
            }
            Event::MediaData(d) if Some(d.mid) == self.audio => {
                let seq = **d.seq_range.start();
                self.jitter.push(seq, d.time.numer(), d.data.clone(), now);
            }
            Event::ChannelOpen(cid, _) => {
                self.channel = Some(cid);
                let pending: Vec<String> = self.pending_text.drain(..).collect();
                for t in pending {
                    self.text(t);
                }
            }
            Event::ChannelData(d) if !d.binary => {
                if let Some(tx) = &self.to_session {
                    let t = String::from_utf8_lossy(&d.data).into_owned();
                    let _ = tx.try_send(Message::Text(t.into()));
                }
            }
            Event::ChannelClose(cid) if Some(cid) == self.channel => self.channel = None,
            _ => {}
        }
    }

    /// Adds the jitter buffer's new counts to the metrics and the peer's stats.
    fn publish(&mut self, c: &Counters) {
        let now = self.jitter.counts();
        let s = &self.stats;
        let step = |seen: u64, n: u64, a: &AtomicU64, m: &metrics::Counter| {
            if n > seen {
                a.fetch_add(n - seen, Ordering::Relaxed);
                m.increment(n - seen);
            }
        };
        step(self.seen.received, now.received, &s.received, &c.received);
        step(self.seen.lost, now.lost, &s.lost, &c.lost);
        step(self.seen.fec, now.fec, &s.fec, &c.fec);
        step(
            self.seen.concealed,
            now.concealed,
            &s.concealed,
            &c.concealed,
        );
        step(self.seen.late, now.late, &s.late, &c.late);
        step(
            self.seen.reordered,
            now.reordered,
            &s.reordered,
            &c.reordered,
        );
        self.seen = now;
        s.delay_ms
            .store(self.jitter.delay().as_millis() as u64, Ordering::Relaxed);
        s.depth.store(self.jitter.depth() as u64, Ordering::Relaxed);
    }
}

/// The local candidate a datagram from `source` came to: the socket may be bound to every
/// interface, and ICE takes a request only on a candidate's address.
fn destination(source: SocketAddr, candidates: &[SocketAddr]) -> Option<SocketAddr> {
    candidates
        .iter()
        .find(|c| {
            c.is_ipv4() == source.is_ipv4() && c.ip().is_loopback() == source.ip().is_loopback()
        })
        .or_else(|| candidates.iter().find(|c| c.is_ipv4() == source.is_ipv4()))
        .or(candidates.first())
        .copied()
}

async fn drive(
    socket: tokio::net::UdpSocket,
    candidates: Vec<SocketAddr>,
    mut commands: tokio::sync::mpsc::UnboundedReceiver<Command>,
    mut outbound: tokio::sync::mpsc::Receiver<(String, Message)>,
    live: Arc<Mutex<HashMap<String, bool>>>,
) {
    let counters = Counters::new();
    let peers_gauge = metrics::gauge!(names::WEBRTC_PEERS);
    let mut peers: Vec<Peer> = Vec::new();
    let mut buf = vec![0u8; 2048];
    loop {
        let now = Instant::now();
        let mut wake = now + Duration::from_secs(1);
        for p in &mut peers {
            wake = wake.min(p.service(now, &socket, &counters));
        }
        let before = peers.len();
        peers.retain_mut(|p| {
            let done = p.finished(now);
            if done {
                p.rtc.disconnect();
                p.to_session = None;
                if let Ok(mut l) = live.lock() {
                    l.remove(&p.token);
                }
                tracing::info!(peer = %p.token, "webrtc: peer closed");
            }
            !done
        });
        if peers.len() != before {
            peers_gauge.set(peers.len() as f64);
        }
        tokio::select! {
            r = socket.recv_from(&mut buf) => {
                let now = Instant::now();
                match r {
                    Ok((n, source)) => {
                        let contents = buf[..n].try_into();
                        if let (Ok(contents), Some(destination)) = (contents, destination(source, &candidates)) {
                            let input = Input::Receive(now, Receive {
                                proto: Protocol::Udp,
                                source,
                                destination,
                                contents,
                            });
                            if let Some(p) = peers.iter_mut().find(|p| p.rtc.accepts(&input)) {
                                if let Err(e) = p.rtc.handle_input(input) {
                                    tracing::debug!(peer = %p.token, "webrtc: input: {e}");
                                }
                            }
                        }
                    }
                    Err(e) => tracing::debug!("webrtc: receive: {e}"),
                }
            }
            c = commands.recv() => match c {
                Some(Command::Add(p)) => {
                    peers.push(Peer::new(*p, now));
                    peers_gauge.set(peers.len() as f64);
                }
                Some(Command::Hangup(token)) => {
                    if let Some(p) = peers.iter_mut().find(|p| p.token == token) {
                        p.client_gone(now, "the client hung up");
                    }
                }
                None => return,
            },
            m = outbound.recv() => {
                if let Some((token, m)) = m {
                    if let Some(p) = peers.iter_mut().find(|p| p.token == token) {
                        p.session_says(m, Instant::now());
                    }
                }
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        let now = Instant::now();
        for p in &mut peers {
            if p.rtc.is_alive() {
                let _ = p.rtc.handle_input(Input::Timeout(now));
            }
        }
    }
}
