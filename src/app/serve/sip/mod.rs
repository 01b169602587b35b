//! Phone calls over SIP (RFC 3261) with RTP: duplex answers `INVITE`s itself, on UDP and TCP,
//! as a PBX's or a trunk's far end (it registers nowhere). The SIP stack is `rsipstack` (tokio,
//! RFC 3261's transactions with their retransmissions and timers, dialogs, CANCEL matching);
//! parsing and transactions are its; what reaches it, and what a call is here, are ours:
//!
//! - [`endpoint`]: the sockets (UDP's whole datagrams, TCP's accept with its limits) and the
//!   stack's inspector, which puts every request through the [`guard`] (a sans-IO policy:
//!   stateless answers, the calls' own parties only, each source's allowance);
//! - [`digest`]: credentials (RFC 2617 Digest, answers single-use);
//! - [`sdp`]: the offer and answer, hold and resume, addresses media must never go to;
//! - [`media`]: the call's RTP, a state machine on a clock passed in (symmetric RTP, the
//!   jitter buffer, pacing, timeouts) in a thin socket loop;
//! - [`timers`]: session timers (RFC 4028);
//! - [`SipCall`]: the call's side of its session, the same session as every transport's
//!   through the [`Protocol`] seam, with PCM ends; [`info_key`]: DTMF sent as SIP INFO.
//!
//! The door (`doors/sip/`) admits calls and runs them; this module knows nothing of the server.

pub(crate) mod digest;
pub(crate) mod endpoint;
pub(crate) mod guard;
pub(crate) mod media;
pub(crate) mod sdp;
pub(crate) mod timers;

pub(crate) use endpoint::{Endpoint, StreamLimits};

/// The methods a call takes.
pub(crate) const ALLOW: &str = "INVITE, ACK, CANCEL, BYE, OPTIONS, INFO, UPDATE";

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;

use super::session::{Encoder, Protocol, Taken, TransportStats};
use crate::audio::phone::PhoneOut;
use crate::session::Outbound;

/// The address a caller at `peer` reaches this machine at: `bound` when it is one, else the
/// address the system would send to `peer` from.
pub(crate) fn local_ip_toward(bound: IpAddr, peer: IpAddr) -> IpAddr {
    if !bound.is_unspecified() {
        return bound;
    }
    let any: SocketAddr = if peer.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)))
    } else {
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0))
    };
    std::net::UdpSocket::bind(any)
        .and_then(|s| {
            s.connect(SocketAddr::new(peer, 9))?;
            s.local_addr()
        })
        .map(|a| a.ip())
        .unwrap_or(peer)
}

/// A call's side of its session: the params its INVITE carried, its media's counters, and
/// the moment it is answered (when the session is ready: the caller hears the agent from the
/// first packet, and a call whose session cannot start is refused, not answered and dropped).
pub(crate) struct SipCall {
    pairs: Vec<(String, String)>,
    format: sdp::Format,
    stats: Arc<media::CallStats>,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    /// Why the session refused the call, for the door's answer.
    pub(crate) refused: Arc<Mutex<Option<String>>>,
}

impl SipCall {
    pub(crate) fn new(
        pairs: Vec<(String, String)>,
        format: sdp::Format,
        stats: Arc<media::CallStats>,
        ready: tokio::sync::oneshot::Sender<()>,
    ) -> Self {
        SipCall {
            pairs,
            format,
            stats,
            ready: Some(ready),
            refused: Arc::new(Mutex::new(None)),
        }
    }
}

/// The session's params from an INVITE's `X-Duplex-…` headers (`X-Duplex-Text-Prompt` →
/// `text_prompt`), as `/api/chat`'s query pairs.
pub(crate) fn params_of(headers: &[(String, String)]) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            let n = name.to_ascii_lowercase();
            let n = n.strip_prefix("x-duplex-")?;
            Some((n.replace('-', "_"), value.trim().to_string()))
        })
        .collect()
}

/// The agent's audio for the call's media: G.711 bytes, or (for Opus, which the media encodes
/// in whole packets) the 24 kHz samples as f32 little-endian.
enum CallEncoder {
    G711(Box<Option<PhoneOut>>),
    Opus,
}

impl Encoder for CallEncoder {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match self {
            CallEncoder::G711(phone) => super::session::phone_bytes(phone, m)
                .map(|b| vec![Message::Binary(b.into())])
                .unwrap_or_default(),
            CallEncoder::Opus => match m {
                Outbound::Pcm(p) => {
                    let bytes: Vec<u8> = p.iter().flat_map(|s| s.to_le_bytes()).collect();
                    vec![Message::Binary(bytes.into())]
                }
                // A call carries no text; the transcript is in the session's logs.
                _ => Vec::new(),
            },
        }
    }
}

impl Protocol for SipCall {
    fn params(&mut self, cfg: &super::ServeConfig) -> Result<super::config::SessionParams, String> {
        cfg.session_params(&self.pairs)
            .map_err(|m| m.replace("query parameter", "X-Duplex- header"))
    }

    fn ready(&mut self, _meta: &serde_json::Value) -> Vec<Message> {
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(());
        }
        Vec::new()
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        // Paid for by the call's media before it was decoded.
        if let Message::Binary(b) = m {
            cx.offer(b.to_vec());
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(match self.format {
            sdp::Format::G711(law) => CallEncoder::G711(Box::new(PhoneOut::new(law).ok())),
            sdp::Format::Opus => CallEncoder::Opus,
        })
    }

    fn refusal(&self, text: &str) -> Vec<Message> {
        if let Ok(mut r) = self.refused.lock() {
            r.get_or_insert_with(|| text.to_string());
        }
        Vec::new()
    }

    fn pcm(&self) -> bool {
        true
    }

    fn transport(&self) -> Option<TransportStats> {
        let s = self.stats.clone();
        Some(Arc::new(move || s.json()))
    }
}

/// The DTMF key an INFO carries (`application/dtmf-relay`'s `Signal=5`, or `application/dtmf`'s
/// bare `5`): one of `0-9 * # A-D`, or `None`.
pub(crate) fn info_key(content_type: &str, body: &[u8]) -> Option<char> {
    let text = std::str::from_utf8(body).ok()?;
    let kind = content_type.split(';').next()?.trim().to_ascii_lowercase();
    let signal = match kind.as_str() {
        "application/dtmf-relay" => text.lines().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            k.trim().eq_ignore_ascii_case("signal").then(|| v.trim())
        })?,
        "application/dtmf" => text.trim(),
        _ => return None,
    };
    let mut chars = signal.chars();
    let (Some(c), None) = (chars.next(), chars.next()) else {
        // RFC 2833's event numbers 10 and 11 in relays that write them so.
        return match signal {
            "10" => Some('*'),
            "11" => Some('#'),
            _ => None,
        };
    };
    let c = c.to_ascii_uppercase();
    matches!(c, '0'..='9' | '*' | '#' | 'A'..='D').then_some(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sip_info_dtmf_is_read_from_both_bodies() {
        assert_eq!(
            info_key("application/dtmf-relay", b"Signal=5\r\nDuration=160\r\n"),
            Some('5')
        );
        assert_eq!(
            info_key("Application/DTMF-Relay; x=1", b"signal= #\r\n"),
            Some('#')
        );
        assert_eq!(info_key("application/dtmf", b"a"), Some('A'));
        assert_eq!(
            info_key("application/dtmf-relay", b"Signal=11\r\n"),
            Some('#')
        );
        // Nothing else is a key: a word, a line break, another body.
        assert_eq!(info_key("application/dtmf", b"12"), None);
        assert_eq!(info_key("application/dtmf-relay", b"Signal=\n5"), None);
        assert_eq!(info_key("text/plain", b"5"), None);
        assert_eq!(info_key("application/dtmf", b"E"), None);
    }

    #[test]
    fn x_duplex_headers_are_the_sessions_params() {
        let h = vec![
            ("X-Duplex-Text-Prompt".to_string(), " be brief ".to_string()),
            ("x-duplex-seed".to_string(), "3".to_string()),
            ("User-Agent".to_string(), "baresip".to_string()),
        ];
        assert_eq!(
            params_of(&h),
            vec![
                ("text_prompt".to_string(), "be brief".to_string()),
                ("seed".to_string(), "3".to_string())
            ]
        );
    }
}
