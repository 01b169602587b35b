//! The load test's WebRTC client, on str0m (the server's own WebRTC stack, here in the offering
//! role): the offer (`POST /api/webrtc`: one audio track each way and a data channel), ICE and
//! DTLS to the answer's candidates, the user's audio as 20 ms Opus packets in real time from the
//! `ready` on the data channel, the agent's audio counted as its packets come (each packet's
//! length read from its table of contents, nothing decoded), and the hang-up (`DELETE` on the
//! answer's `Location`, through the address the offer went to: a proxy routes it back to the
//! replica that holds the call). Knows nothing of the server's insides: only the wire.

use anyhow::anyhow;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::http::{header, HeaderMap, Method, Request, StatusCode, Uri};
use str0m::change::{SdpAnswer, SdpPendingOffer};
use str0m::media::{Direction, MediaKind, Mid};
use str0m::net::{Protocol as Net, Receive};
use str0m::{Candidate, Event, Input, Rtc};

use super::{chunk, seen, LoadtestArgs, Seen};
use crate::audio::FRAME_SAMPLES;

/// Samples of one 20 ms packet at 24 kHz.
const PACKET_SAMPLES: usize = 480;
/// RTP ticks of one packet (Opus's 48 kHz clock).
const PACKET_TICKS: u64 = 960;
/// One packet's time.
const PACKET_TIME: Duration = Duration::from_millis(20);
/// Packets of one model frame.
const PACKETS_PER_FRAME: u32 = (FRAME_SAMPLES / PACKET_SAMPLES) as u32;
/// The user's audio bitrate (a browser's voice: 32 kb/s).
const BITRATE: i32 = 32_000;
/// The longest a session may take to be ready (as over the WebSockets).
const READY_WITHIN: Duration = Duration::from_secs(120);
/// The largest answer or error body read.
const MAX_BODY: usize = 64 * 1024;

/// One client over WebRTC: offers, waits for its session to be ready, streams `seconds` of
/// `pcm` in real time and times the agent's frames; hangs up whatever happened once answered.
pub(super) async fn talk(url: &str, pcm: &[f32], args: &LoadtestArgs) -> anyhow::Result<Seen> {
    let endpoint: Uri = url.parse().map_err(|e| anyhow!("{url}: {e}"))?;
    let mut rtc = Rtc::builder()
        .clear_codecs()
        .enable_opus(true, false)
        .set_stats_interval(None)
        .build(Instant::now());
    let mut sdp = rtc.sdp_api();
    let mid = sdp.add_media(MediaKind::Audio, Direction::SendRecv, None, None, None);
    sdp.add_channel("duplex".into());
    let (offer, pending) = sdp.apply().ok_or_else(|| anyhow!("str0m made no offer"))?;
    let (status, headers, body) = http(
        Method::POST,
        &endpoint,
        offer.to_sdp_string(),
        args.key.as_deref(),
    )
    .await?;
    if status != StatusCode::CREATED {
        return Err(anyhow!("HTTP {status}: {}", body.trim()));
    }
    let resource = headers
        .get(header::LOCATION)
        .and_then(|l| l.to_str().ok())
        .ok_or_else(|| anyhow!("the answer has no Location"))
        .and_then(|l| resolve(&endpoint, l))?;
    let call = Call::new(rtc, mid, pending, &body).await;
    let seen = match call {
        Ok(call) => call.run(pcm, args).await,
        Err(e) => Err(e),
    };
    // Hung up through the same address, whatever happened: the slot is freed at once.
    let hangup = http(
        Method::DELETE,
        &resource,
        String::new(),
        args.key.as_deref(),
    )
    .await;
    let seen = seen?;
    match hangup {
        Ok((StatusCode::OK, _, _)) => Ok(seen),
        Ok((status, _, body)) => Err(anyhow!("the hang-up: HTTP {status}: {}", body.trim())),
        Err(e) => Err(anyhow!("the hang-up: {e}")),
    }
}

/// The call's resource: `location` (a path, or an absolute URL) against the offer's address.
fn resolve(endpoint: &Uri, location: &str) -> anyhow::Result<Uri> {
    let uri: Uri = location
        .parse()
        .map_err(|e| anyhow!("the answer's Location {location:?}: {e}"))?;
    if uri.authority().is_some() {
        return Ok(uri);
    }
    let mut parts = endpoint.clone().into_parts();
    parts.path_and_query = uri.into_parts().path_and_query;
    Uri::from_parts(parts).map_err(|e| anyhow!("the answer's Location {location:?}: {e}"))
}

/// One HTTP/1.1 request (the key as `Authorization: Bearer`): its status, headers and body.
pub(crate) async fn http(
    method: Method,
    uri: &Uri,
    body: String,
    key: Option<&str>,
) -> anyhow::Result<(StatusCode, HeaderMap, String)> {
    let authority = uri.authority().ok_or_else(|| anyhow!("{uri}: no host"))?;
    let address = format!(
        "{}:{}",
        authority.host(),
        authority.port_u16().unwrap_or(80)
    );
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| anyhow!("{address}: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(header::HOST, authority.as_str())
            .header(header::CONTENT_TYPE, "application/sdp");
        if let Some(k) = key {
            req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let req = req.body(axum::body::Body::from(body))?;
        let resp = sender.send_request(req).await?;
        let (head, incoming) = resp.into_parts();
        let bytes = axum::body::to_bytes(axum::body::Body::new(incoming), MAX_BODY).await?;
        Ok((
            head.status,
            head.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        ))
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .map_err(|_| anyhow!("no answer within 30 s"))?
}

/// The first host candidate of an answer: where the server's media is.
fn candidate(answer: &str) -> Option<SocketAddr> {
    answer.lines().find_map(|l| {
        // a=candidate:FOUNDATION COMPONENT udp PRIORITY ADDRESS PORT typ host
        let f: Vec<&str> = l.strip_prefix("a=candidate:")?.split_whitespace().collect();
        if f.len() < 8 || !f[2].eq_ignore_ascii_case("udp") {
            return None;
        }
        Some(SocketAddr::new(f[4].parse().ok()?, f[5].parse().ok()?))
    })
}

/// A connected call: the peer, its socket and its audio track.
struct Call {
    rtc: Rtc,
    socket: tokio::net::UdpSocket,
    local: SocketAddr,
    mid: Mid,
}

impl Call {
    /// Takes the answer: a socket on the address that reaches the server's candidate, announced
    /// as this peer's own.
    async fn new(
        mut rtc: Rtc,
        mid: Mid,
        pending: SdpPendingOffer,
        answer: &str,
    ) -> anyhow::Result<Call> {
        let remote =
            candidate(answer).ok_or_else(|| anyhow!("the answer names no UDP candidate"))?;
        // The address the system routes to the server's candidate from (no packet is sent).
        let probe = std::net::UdpSocket::bind(SocketAddr::new(
            if remote.is_ipv4() {
                std::net::Ipv4Addr::UNSPECIFIED.into()
            } else {
                std::net::Ipv6Addr::UNSPECIFIED.into()
            },
            0,
        ))
        .and_then(|s| s.connect(remote).and_then(|()| s.local_addr()))
        .map_err(|e| anyhow!("no route to the server's media at {remote}: {e}"))?;
        let socket = tokio::net::UdpSocket::bind(SocketAddr::new(probe.ip(), 0))
            .await
            .map_err(|e| anyhow!("a UDP socket: {e}"))?;
        let local = socket.local_addr()?;
        let host = Candidate::host(local, "udp").map_err(|e| anyhow!("candidate {local}: {e}"))?;
        rtc.add_local_candidate(host);
        let answer =
            SdpAnswer::from_sdp_string(answer).map_err(|e| anyhow!("the server's answer: {e}"))?;
        rtc.sdp_api()
            .accept_answer(pending, answer)
            .map_err(|e| anyhow!("the server's answer: {e}"))?;
        Ok(Call {
            rtc,
            socket,
            local,
            mid,
        })
    }

    /// Streams `seconds` of `pcm` from the session's `ready`, then waits for the last answers.
    async fn run(mut self, pcm: &[f32], args: &LoadtestArgs) -> anyhow::Result<Seen> {
        let mut s = Stream::new(pcm, args)?;
        let tail = args.tail();
        let offered = Instant::now();
        let mut buf = vec![0u8; 2048];
        loop {
            let now = Instant::now();
            s.send_due(&mut self, now)?;
            // The peer's state machine: what it sends, what happened, when to wake it.
            let mut events = Vec::new();
            let mut wake = crate::app::rtc::poll(
                &mut self.rtc,
                &self.socket,
                now + Duration::from_millis(100),
                |e| events.push(e),
            )
            .map_err(|e| anyhow!("WebRTC: {e}"))?;
            for e in events {
                if s.event(e, self.mid)? {
                    return self.seen(s, args);
                }
            }
            let over = match s.t0 {
                _ if !self.rtc.is_alive() => true,
                None if now.duration_since(offered) > READY_WITHIN => {
                    return Err(anyhow!("not ready within {} s", READY_WITHIN.as_secs()));
                }
                None => false,
                Some(t0) => s.sent == s.packets && now >= s.due(t0) + tail,
            };
            if over {
                return self.seen(s, args);
            }
            if let Some(at) = s.next_packet() {
                wake = wake.min(at);
            }
            self.wait(wake, &mut buf).await;
        }
    }

    /// Until a datagram comes (handed to the peer) or `wake`; then the peer's timeouts.
    async fn wait(&mut self, wake: Instant, buf: &mut [u8]) {
        tokio::select! {
            r = self.socket.recv_from(buf) => {
                if let Ok((n, source)) = r {
                    if let Ok(contents) = buf[..n].try_into() {
                        let input = Input::Receive(Instant::now(), Receive {
                            proto: Net::Udp,
                            source,
                            destination: self.local,
                            contents,
                        });
                        let _ = self.rtc.handle_input(input);
                    }
                }
            }
            _ = tokio::time::sleep_until(wake.into()) => {}
        }
        let _ = self.rtc.handle_input(Input::Timeout(Instant::now()));
    }

    /// Sends one packet of the user's audio, stamped `ticks` on the RTP clock.
    fn write(&mut self, data: &[u8], ticks: u64, now: Instant) -> anyhow::Result<()> {
        match crate::app::rtc::write_opus(&mut self.rtc, self.mid, now, ticks, data) {
            Ok(true) => Ok(()),
            Ok(false) => Err(anyhow!("the answer took no Opus")),
            Err(e) => Err(anyhow!("WebRTC: {e}")),
        }
    }

    /// What the client saw, once the session was ready (else why it was not).
    fn seen(&mut self, s: Stream<'_>, args: &LoadtestArgs) -> anyhow::Result<Seen> {
        self.rtc.disconnect();
        let t0 =
            s.t0.ok_or_else(|| anyhow!("the connection failed before the session was ready"))?;
        // Frame k is whole once its last packet has gone, at t0 + k · 80 ms + 60 ms.
        let whole = t0 + PACKET_TIME * (PACKETS_PER_FRAME - 1);
        Ok(seen(&s.arrivals, whole, s.frames, args.buffer_ms))
    }
}

/// The user's side of a call: its audio, sent in real time from the session's `ready`, and the
/// agent's, counted as it comes.
struct Stream<'a> {
    pcm: &'a [f32],
    encoder: opus::Encoder,
    /// Model frames to send, and their packets.
    frames: usize,
    packets: usize,
    /// When the session said it was ready: the first packet's time.
    t0: Option<Instant>,
    sent: usize,
    /// The agent's samples so far (at 24 kHz), and when each of its frames was whole.
    samples: usize,
    arrivals: Vec<Instant>,
}

impl<'a> Stream<'a> {
    fn new(pcm: &'a [f32], args: &LoadtestArgs) -> anyhow::Result<Stream<'a>> {
        let mut encoder = opus::Encoder::new(24_000, opus::Channels::Mono, opus::Application::Voip)
            .map_err(|e| anyhow!("an Opus encoder: {e}"))?;
        let _ = encoder.set_bitrate(opus::Bitrate::Bits(BITRATE));
        let frames = args.frames();
        Ok(Stream {
            pcm,
            encoder,
            frames,
            packets: frames * PACKETS_PER_FRAME as usize,
            t0: None,
            sent: 0,
            samples: 0,
            arrivals: Vec::new(),
        })
    }

    /// When the next packet is due after `t0`.
    fn due(&self, t0: Instant) -> Instant {
        t0 + PACKET_TIME * self.sent as u32
    }

    /// When the next packet is due, while some are left to send.
    fn next_packet(&self) -> Option<Instant> {
        self.t0
            .filter(|_| self.sent < self.packets)
            .map(|t0| self.due(t0))
    }

    /// Sends the packets due at `now` on `call`.
    fn send_due(&mut self, call: &mut Call, now: Instant) -> anyhow::Result<()> {
        let mut packet = [0u8; 1500];
        while self.next_packet().is_some_and(|at| at <= now) {
            let samples = chunk(self.pcm, self.sent, PACKET_SAMPLES);
            let n = self
                .encoder
                .encode_float(&samples, &mut packet)
                .map_err(|e| anyhow!("Opus: {e}"))?;
            call.write(&packet[..n], self.sent as u64 * PACKET_TICKS, now)?;
            self.sent += 1;
        }
        Ok(())
    }

    /// Takes one of the peer's events; `true` when the server ended the session after it was
    /// ready (what came, came), an error when it refused or ended it before.
    fn event(&mut self, e: Event, mid: Mid) -> anyhow::Result<bool> {
        match e {
            // What the agent said before the user's first packet answers none of them.
            Event::MediaData(d) if d.mid == mid && self.t0.is_some() => {
                self.samples += opus::packet::get_nb_samples(&d.data, 24_000).unwrap_or(0);
                let now = Instant::now();
                while self.arrivals.len() < self.samples / FRAME_SAMPLES {
                    self.arrivals.push(now);
                }
            }
            Event::ChannelData(d) if !d.binary => {
                let v: serde_json::Value = serde_json::from_slice(&d.data).unwrap_or_default();
                match (v["type"].as_str(), self.t0) {
                    (Some("ready"), None) => self.t0 = Some(Instant::now()),
                    (Some("error"), None) => {
                        return Err(anyhow!("{}", v["message"].as_str().unwrap_or("error")));
                    }
                    (Some("end"), Some(_)) => return Ok(true),
                    (Some("end"), None) => {
                        let r = v["reason"].as_str().unwrap_or("ended");
                        return Err(anyhow!("ended before it was ready: {r}"));
                    }
                    _ => {}
                }
            }
            _ => {}
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_is_resolved_against_the_offers_address() {
        let offer: Uri = "http://proxy:8080/api/webrtc".parse().unwrap();
        assert_eq!(
            resolve(&offer, "/replica/a/api/webrtc/abc").unwrap(),
            "http://proxy:8080/replica/a/api/webrtc/abc"
        );
        assert_eq!(
            resolve(&offer, "http://a:8998/api/webrtc/abc").unwrap(),
            "http://a:8998/api/webrtc/abc"
        );
    }

    #[test]
    fn the_answers_first_udp_candidate_is_where_its_media_goes() {
        let answer = "v=0\r\na=candidate:1 1 tcp 2130706431 10.0.0.9 9 typ host\r\n\
                      a=candidate:2 1 udp 2130706431 127.0.0.1 40000 typ host\r\n\
                      a=candidate:3 1 udp 2130706431 10.0.0.1 40000 typ host\r\n";
        assert_eq!(candidate(answer), Some("127.0.0.1:40000".parse().unwrap()));
        assert_eq!(candidate("v=0\r\n"), None);
    }
}
