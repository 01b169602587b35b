//! Conversations over WebRTC: WHIP-style signalling (`POST /api/webrtc` with an SDP offer, the
//! answer in the response and the session's resource in `Location`; `DELETE` on it hangs up:
//! the routes are the door's, `doors/webrtc.rs`), one Opus track each way and a data channel
//! for the transcript and the session's status.
//! The media runs on the [`driver`]'s thread and UDP socket; a session is the same as a
//! WebSocket's ([`session::run`]) in the [`WebRtc`] protocol, with PCM ends: the same
//! admission, limits, keys and template.
//!
//! A session starts once its peer has connected (ICE and DTLS), not at the offer: its model's
//! clock does not run before anyone can hear it. The data channel carries JSON:
//! `{"type": "ready", "session": {…metadata…}}` once primed, `{"type": "text", "text": "…"}`
//! per transcript piece, `{"type": "error", "message": "…"}`, and `{"type": "end", "code": …,
//! "reason": "…"}` before the server hangs up.
//!
//! Knows nothing of RTP or codecs (the driver's) nor of the pipeline (the session's).

pub(crate) mod driver;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::ws::Message;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::config::WebRtcSettings;
use super::session::{self, Encoder, Protocol, Taken};
use crate::observe::names;
use crate::session::Outbound;

/// The largest SDP offer taken (a browser's is 3–6 KiB).
pub(in crate::app::serve) const MAX_OFFER_BYTES: usize = 64 * 1024;
/// Messages of the client's (20 ms of audio each) that may wait for the session.
pub(in crate::app::serve) const TO_SESSION_QUEUE: usize = 256;

/// The WebRTC endpoint: the driver and what peers are told.
pub(crate) struct Endpoint {
    pub(in crate::app::serve) driver: driver::Driver,
    /// Host candidates announced in every answer.
    candidates: Vec<SocketAddr>,
    pub(in crate::app::serve) settings: WebRtcSettings,
}

impl Endpoint {
    /// Binds the UDP socket (`udp`) and starts the driver.
    ///
    /// # Errors
    ///
    /// The socket's or the thread's error, naming `webrtc.address`.
    pub(crate) fn start(settings: WebRtcSettings, udp: SocketAddr) -> anyhow::Result<Endpoint> {
        let socket = std::net::UdpSocket::bind(udp)
            .map_err(|e| anyhow::anyhow!("binding UDP {udp} (`webrtc.address`): {e}"))?;
        let local = socket.local_addr()?;
        let candidates = candidates(&settings, local);
        if candidates.is_empty() {
            anyhow::bail!(
                "no address to announce for UDP {local}: set `webrtc.public_addresses` or a \
                 specific `webrtc.address`"
            );
        }
        let driver = driver::Driver::start(socket, candidates.clone())?;
        Ok(Endpoint {
            driver,
            candidates,
            settings,
        })
    }

    /// The UDP address the media arrives at.
    pub(crate) fn local(&self) -> SocketAddr {
        self.driver.local
    }

    /// What `/api/defaults` tells the page: that WebRTC is offered, and its ICE servers.
    pub(crate) fn page_settings(&self) -> serde_json::Value {
        let servers: Vec<serde_json::Value> = self
            .settings
            .ice_servers
            .iter()
            .map(|(url, auth)| match auth {
                Some((u, c)) => serde_json::json!({"urls": url, "username": u, "credential": c}),
                None => serde_json::json!({ "urls": url }),
            })
            .collect();
        serde_json::json!({ "ice_servers": servers })
    }
}

/// The host candidates of a socket at `local`: the configured public addresses, else the
/// socket's own address, else (bound to every interface) the machine's outward address and
/// loopback.
fn candidates(settings: &WebRtcSettings, local: SocketAddr) -> Vec<SocketAddr> {
    if !settings.public_addresses.is_empty() {
        return settings
            .public_addresses
            .iter()
            .map(|(ip, port)| SocketAddr::new(*ip, port.unwrap_or(local.port())))
            .collect();
    }
    if !local.ip().is_unspecified() {
        return vec![local];
    }
    let mut out = Vec::new();
    // The address this machine would send from (no packet is sent).
    let probe = if local.is_ipv4() {
        ("0.0.0.0:0", "192.0.2.1:9")
    } else {
        ("[::]:0", "[2001:db8::1]:9")
    };
    if let Ok(s) = std::net::UdpSocket::bind(probe.0) {
        if s.connect(probe.1).is_ok() {
            if let Ok(a) = s.local_addr() {
                if !a.ip().is_unspecified() && !a.ip().is_loopback() {
                    out.push(SocketAddr::new(a.ip(), local.port()));
                }
            }
        }
    }
    let lo: IpAddr = if local.is_ipv4() {
        std::net::Ipv4Addr::LOCALHOST.into()
    } else {
        std::net::Ipv6Addr::LOCALHOST.into()
    };
    out.push(SocketAddr::new(lo, local.port()));
    out
}

/// Why an offer is refused, in the client's words.
pub(in crate::app::serve) fn check_offer(body: &[u8]) -> Result<str0m::change::SdpOffer, String> {
    let text =
        std::str::from_utf8(body).map_err(|_| "the offer is not text (UTF-8)".to_string())?;
    if !text.trim_start().starts_with("v=0") {
        return Err(
            "the body is not an SDP offer (an SDP starts with `v=0`, RFC 8866); send the \
             browser's offer as application/sdp"
                .into(),
        );
    }
    let offer = str0m::change::SdpOffer::from_sdp_string(text)
        .map_err(|e| format!("the offer is not valid SDP: {e}"))?;
    let mut audio = false;
    let mut opus = false;
    let mut in_audio = false;
    for line in text.lines() {
        let l = line.trim();
        if let Some(m) = l.strip_prefix("m=") {
            in_audio = m.starts_with("audio ");
            audio |= in_audio;
        } else if in_audio && l.starts_with("a=rtpmap:") {
            opus |= l
                .split_whitespace()
                .nth(1)
                .is_some_and(|c| c.to_ascii_lowercase().starts_with("opus/48000"));
        }
    }
    if !audio {
        return Err(
            "the offer has no audio section (m=audio): a conversation needs a microphone track \
             (or a recvonly audio transceiver)"
                .into(),
        );
    }
    if !opus {
        return Err(
            "the offer's audio section has no Opus (a=rtpmap:<pt> opus/48000/2): this server \
             speaks Opus only"
                .into(),
        );
    }
    Ok(offer)
}

/// 16 random bytes in hex: a session's resource name, unguessable (whoever knows it may hang
/// the session up, as WHIP has it).
pub(in crate::app::serve) fn token() -> std::io::Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

pub(in crate::app::serve) fn bad(
    status: StatusCode,
    reason: &'static str,
    msg: String,
) -> Response {
    metrics::counter!(names::HTTP_REFUSED, "reason" => reason).increment(1);
    (status, format!("{msg}\n")).into_response()
}

impl Endpoint {
    /// A peer connection for `offer` (Opus only, our host candidates) and its SDP answer.
    pub(in crate::app::serve) fn answer(
        &self,
        offer: str0m::change::SdpOffer,
    ) -> Result<(str0m::Rtc, String), Box<Response>> {
        let mut rtc = str0m::Rtc::builder()
            .clear_codecs()
            .enable_opus(true, false)
            // Every packet as it arrives, in any order: the jitter buffer orders them.
            .set_reordering_size_audio(0)
            .set_stats_interval(None)
            .build(Instant::now());
        for c in &self.candidates {
            match str0m::Candidate::host(*c, "udp") {
                Ok(c) => {
                    rtc.add_local_candidate(c);
                }
                Err(e) => tracing::warn!("webrtc: candidate {c}: {e}"),
            }
        }
        let answer = match rtc.sdp_api().accept_offer(offer) {
            Ok(a) => a.to_sdp_string(),
            Err(e) => {
                return Err(Box::new(bad(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("the offer could not be answered: {e}"),
                )))
            }
        };
        Ok((rtc, answer))
    }
}

/// A session's protocol on the data channel and the media (see the module's documentation).
pub(super) struct WebRtc {
    query: Vec<(String, String)>,
    stats: Arc<driver::PeerStats>,
}

impl WebRtc {
    pub(in crate::app::serve) fn new(
        query: Vec<(String, String)>,
        stats: Arc<driver::PeerStats>,
    ) -> Self {
        WebRtc { query, stats }
    }
}

fn event(v: serde_json::Value) -> Message {
    Message::Text(v.to_string().into())
}

struct WebRtcEncoder;

impl Encoder for WebRtcEncoder {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match m {
            Outbound::Pcm(p) => {
                let bytes: Vec<u8> = p.iter().flat_map(|s| s.to_le_bytes()).collect();
                vec![Message::Binary(bytes.into())]
            }
            Outbound::Text(t) => vec![event(serde_json::json!({"type": "text", "text": t}))],
            // Not made by a template with PCM ends.
            Outbound::Audio(_) => Vec::new(),
        }
    }
}

impl Protocol for WebRtc {
    /// Once the peer has connected (ICE and DTLS): the model's clock does not run, nor does the
    /// agent speak, before anyone can hear it.
    fn may_start(&self) -> bool {
        self.stats
            .connected
            .load(std::sync::atomic::Ordering::Acquire)
            == 1
    }

    fn params(&mut self, cfg: &super::ServeConfig) -> Result<super::config::SessionParams, String> {
        cfg.session_params(&self.query)
    }

    fn ready(&mut self, meta: &serde_json::Value) -> Vec<Message> {
        vec![event(serde_json::json!({"type": "ready", "session": meta}))]
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        match m {
            // Paid for by the driver before it decoded it (the peer's budget).
            Message::Binary(b) => cx.offer(b.to_vec()),
            // The page says nothing on the data channel; whatever it sends is ignored.
            Message::Text(_) if cx.first("text") => {
                tracing::info!(
                    session = cx.id,
                    "ignored a data-channel message (logged once per session)"
                );
            }
            _ => {}
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(WebRtcEncoder)
    }

    fn refusal(&self, text: &str) -> Vec<Message> {
        vec![event(serde_json::json!({"type": "error", "message": text}))]
    }

    fn failure(&self, text: &str) -> Vec<Message> {
        self.refusal(text)
    }

    fn pcm(&self) -> bool {
        true
    }

    fn transport(&self) -> Option<session::TransportStats> {
        let s = self.stats.clone();
        Some(Arc::new(move || s.json()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHROME_OFFER: &str = "v=0\r\no=- 4611731400430051336 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n\
a=group:BUNDLE 0\r\na=msid-semantic: WMS\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111 0\r\nc=IN IP4 0.0.0.0\r\n\
a=rtcp:9 IN IP4 0.0.0.0\r\na=ice-ufrag:abcd\r\na=ice-pwd:abcdefghijklmnopqrstuvwx\r\n\
a=fingerprint:sha-256 01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF:01:23:45:67:89:AB:CD:EF\r\n\
a=setup:actpass\r\na=mid:0\r\na=sendrecv\r\na=rtcp-mux\r\na=rtpmap:111 opus/48000/2\r\n\
a=fmtp:111 minptime=10;useinbandfec=1\r\na=rtpmap:0 PCMU/8000\r\na=ssrc:1 cname:x\r\n";

    #[test]
    fn an_offer_needs_sdp_an_audio_section_and_opus() {
        assert!(check_offer(CHROME_OFFER.as_bytes()).is_ok());
        let e = check_offer(b"{\"type\": \"offer\"}").unwrap_err();
        assert!(e.contains("not an SDP offer"), "{e}");
        let e = check_offer(&[0xff, 0xfe]).unwrap_err();
        assert!(e.contains("not text"), "{e}");
        let pcmu_only = CHROME_OFFER
            .replace("111 0\r\n", "0\r\n")
            .replace("a=rtpmap:111 opus/48000/2\r\n", "")
            .replace("a=fmtp:111 minptime=10;useinbandfec=1\r\n", "");
        let e = check_offer(pcmu_only.as_bytes()).unwrap_err();
        assert!(e.contains("no Opus"), "{e}");
        let video = CHROME_OFFER
            .replace(
                "m=audio 9 UDP/TLS/RTP/SAVPF 111 0",
                "m=video 9 UDP/TLS/RTP/SAVPF 96",
            )
            .replace("a=rtpmap:111 opus/48000/2", "a=rtpmap:96 VP8/90000");
        let e = check_offer(video.as_bytes()).unwrap_err();
        assert!(e.contains("no audio section"), "{e}");
    }

    #[test]
    fn tokens_are_32_hex_digits_and_differ() {
        let a = token().unwrap();
        let b = token().unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn candidates_are_the_public_addresses_else_the_socket_else_outward_and_loopback() {
        let s = |public: Vec<(IpAddr, Option<u16>)>| WebRtcSettings {
            address: "0.0.0.0:0".parse().unwrap(),
            public_addresses: public,
            ice_servers: Vec::new(),
            jitter: std::time::Duration::from_millis(40),
            max_jitter: std::time::Duration::from_millis(200),
            location_base: String::new(),
        };
        let local: SocketAddr = "0.0.0.0:5000".parse().unwrap();
        let nat = s(vec![
            ("203.0.113.7".parse().unwrap(), None),
            ("198.51.100.1".parse().unwrap(), Some(40000)),
        ]);
        assert_eq!(
            candidates(&nat, local),
            vec![
                "203.0.113.7:5000".parse().unwrap(),
                "198.51.100.1:40000".parse().unwrap()
            ]
        );
        let one: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert_eq!(candidates(&s(vec![]), one), vec![one]);
        let all = candidates(&s(vec![]), local);
        assert_eq!(all.last(), Some(&"127.0.0.1:5000".parse().unwrap()));
        assert!(all
            .iter()
            .all(|a| a.port() == 5000 && !a.ip().is_unspecified()));
    }
}
