//! SDP offer and answer for a SIP call (RFC 3264 over RFC 8866): what a caller offers (where
//! its RTP goes, which formats, telephone events, RTCP multiplexing) and the answer that picks
//! one format of ours, a re-offer's hold and resume (RFC 3264 §8.4, and RFC 2543's `c=0.0.0.0`),
//! and the addresses media must never go to. Pure text: no sockets.

use std::net::{IpAddr, SocketAddr};

use crate::audio::g711::Law;

/// An audio format a call may run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// G.711 at 8 kHz.
    G711(Law),
    /// Opus (RFC 7587: a 48 kHz RTP clock, whatever the coded rate), mono.
    Opus,
}

/// The audio format a call runs in, and its payload type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Codec {
    pub format: Format,
    pub payload_type: u8,
}

impl Codec {
    /// Its name as SDP and the session's status say it.
    pub(crate) fn name(&self) -> &'static str {
        match self.format {
            Format::G711(Law::Mu) => "PCMU",
            Format::G711(Law::A) => "PCMA",
            Format::Opus => "opus",
        }
    }

    /// Its RTP clock, ticks a second.
    pub(crate) fn clock(&self) -> u64 {
        match self.format {
            Format::G711(_) => 8_000,
            Format::Opus => 48_000,
        }
    }

    /// Its `a=rtpmap` encoding.
    fn rtpmap(&self) -> String {
        match self.format {
            Format::Opus => "opus/48000/2".into(),
            _ => format!("{}/8000", self.name()),
        }
    }
}

/// Which way a stream's media goes, as one side says it (RFC 3264 §5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    SendRecv,
    SendOnly,
    RecvOnly,
    Inactive,
}

impl Direction {
    fn parse(s: &str) -> Option<Direction> {
        Some(match s {
            "sendrecv" => Direction::SendRecv,
            "sendonly" => Direction::SendOnly,
            "recvonly" => Direction::RecvOnly,
            "inactive" => Direction::Inactive,
            _ => return None,
        })
    }

    /// Its attribute's name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Direction::SendRecv => "sendrecv",
            Direction::SendOnly => "sendonly",
            Direction::RecvOnly => "recvonly",
            Direction::Inactive => "inactive",
        }
    }

    /// Whether the side that said it sends.
    pub(crate) fn sends(self) -> bool {
        matches!(self, Direction::SendRecv | Direction::SendOnly)
    }

    /// Whether the side that said it receives.
    pub(crate) fn receives(self) -> bool {
        matches!(self, Direction::SendRecv | Direction::RecvOnly)
    }

    /// The answer's direction to an offer of this one (a hold's `sendonly` is answered
    /// `recvonly`: RFC 3264 §6.1).
    pub(crate) fn mirrored(self) -> Direction {
        match self {
            Direction::SendOnly => Direction::RecvOnly,
            Direction::RecvOnly => Direction::SendOnly,
            d => d,
        }
    }
}

/// What a caller offered that a call needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Offer {
    /// Where the caller takes its RTP (`0.0.0.0` in an old-style hold: RFC 2543's).
    pub rtp: SocketAddr,
    /// Where it takes its RTCP (the RTP port's neighbour unless `a=rtcp` or `a=rtcp-mux`).
    pub rtcp: SocketAddr,
    pub rtcp_mux: bool,
    /// The format chosen: the first of the offer's that we speak (PCMU, PCMA, Opus).
    pub codec: Codec,
    /// Every format of ours the offer has, in its order (a re-offer must keep the call's).
    pub ours: Vec<Codec>,
    /// The payload type of `telephone-event/8000`, when offered.
    pub events: Option<u8>,
    /// The caller's direction: it only sends (`sendonly`: a hold), only receives, or neither.
    pub direction: Direction,
}

impl Offer {
    /// Whether the caller wants our media now (it receives, at an address).
    pub(crate) fn wants_media(&self) -> bool {
        self.direction.receives() && !self.rtp.ip().is_unspecified()
    }

    /// Whether the caller sends media now (so that its silence means it is gone).
    pub(crate) fn sends_media(&self) -> bool {
        self.direction.sends() && !self.rtp.ip().is_unspecified()
    }

    /// The answer's direction: the caller's mirrored (and `inactive` for an old-style hold).
    pub(crate) fn answer_direction(&self) -> Direction {
        if self.rtp.ip().is_unspecified() {
            Direction::Inactive
        } else {
            self.direction.mirrored()
        }
    }
}

/// Why an offer is refused, and with which SIP status: 400 for what is not SDP, 488 (Not
/// Acceptable Here) for an offer we understand and cannot take (no PCMU, PCMA or Opus, an
/// address media must not go to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused {
    pub status: u16,
    pub reason: String,
}

fn refused(status: u16, reason: impl Into<String>) -> Refused {
    Refused {
        status,
        reason: reason.into(),
    }
}

/// An offer's lines as read: the session's address and direction, and its first audio
/// section's.
#[derive(Default)]
struct Lines {
    session_c: Option<IpAddr>,
    session_direction: Option<Direction>,
    audio: Option<Audio>,
}

/// The first `m=audio` section.
#[derive(Default)]
struct Audio {
    port: u16,
    proto: String,
    formats: Vec<u8>,
    c: Option<IpAddr>,
    rtpmap: Vec<(u8, String)>,
    rtcp_port: Option<u16>,
    rtcp_mux: bool,
    direction: Option<Direction>,
}

/// Reads the lines of an SDP body (the sections after the first audio one are skipped: one
/// audio stream is a call, the others are declined by leaving them out).
fn read_lines(text: &str) -> Result<Lines, Refused> {
    let mut l = Lines::default();
    // Where the lines go: the session (before any m=), the first audio section, or nowhere.
    enum At {
        Session,
        Audio,
        Other,
    }
    let mut at = At::Session;
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        let Some((kind, value)) = line.split_once('=') else {
            if line.trim().is_empty() {
                continue;
            }
            return Err(refused(400, format!("an SDP line without `=`: {line:?}")));
        };
        match (kind, &at) {
            ("m", _) => {
                let mut f = value.split_whitespace();
                let (media, port, proto) = (f.next(), f.next(), f.next());
                if media != Some("audio") || l.audio.is_some() {
                    at = At::Other;
                    continue;
                }
                let port = port
                    .and_then(|p| p.split('/').next())
                    .and_then(|p| p.parse::<u16>().ok())
                    .ok_or_else(|| refused(400, format!("a bad m= line: {line:?}")))?;
                l.audio = Some(Audio {
                    port,
                    proto: proto.unwrap_or_default().to_string(),
                    formats: f.filter_map(|p| p.parse::<u8>().ok()).collect(),
                    ..Audio::default()
                });
                at = At::Audio;
            }
            ("c", At::Other) => {}
            ("c", _) => {
                let ip = value
                    .split_whitespace()
                    .nth(2)
                    .and_then(|a| a.split('/').next())
                    .and_then(|a| a.parse::<IpAddr>().ok())
                    .ok_or_else(|| refused(400, format!("a bad c= line: {line:?}")))?;
                match (&at, l.audio.as_mut()) {
                    (At::Audio, Some(a)) => a.c = Some(ip),
                    _ => l.session_c = Some(ip),
                }
            }
            ("a", At::Session) => {
                if let Some(d) = Direction::parse(value) {
                    l.session_direction = Some(d);
                }
            }
            ("a", At::Audio) => {
                if let Some(a) = l.audio.as_mut() {
                    read_attribute(a, value);
                }
            }
            _ => {}
        }
    }
    Ok(l)
}

/// One `a=` line of the audio section.
fn read_attribute(a: &mut Audio, value: &str) {
    let (name, arg) = value.split_once(':').unwrap_or((value, ""));
    match name {
        "rtpmap" => {
            let mut f = arg.split_whitespace();
            if let (Some(pt), Some(enc)) = (f.next().and_then(|p| p.parse::<u8>().ok()), f.next()) {
                a.rtpmap.push((pt, enc.to_ascii_lowercase()));
            }
        }
        "rtcp" => a.rtcp_port = arg.split_whitespace().next().and_then(|p| p.parse().ok()),
        "rtcp-mux" => a.rtcp_mux = true,
        d => {
            if let Some(d) = Direction::parse(d) {
                a.direction = Some(d);
            }
        }
    }
}

impl Audio {
    /// A format's encoding name: its rtpmap's, or its static number's (RFC 3551).
    fn name_of(&self, pt: u8) -> Option<String> {
        self.rtpmap
            .iter()
            .find(|(p, _)| *p == pt)
            .map(|(_, n)| n.clone())
            .or(match pt {
                0 => Some("pcmu/8000".into()),
                8 => Some("pcma/8000".into()),
                _ => None,
            })
    }

    /// The offered formats we speak, in the offer's order.
    fn ours(&self) -> Vec<Codec> {
        self.formats
            .iter()
            .filter_map(|&pt| {
                let name = self.name_of(pt)?;
                let format = match name.split('/').take(2).collect::<Vec<_>>()[..] {
                    ["pcmu", "8000"] => Format::G711(Law::Mu),
                    ["pcma", "8000"] => Format::G711(Law::A),
                    ["opus", "48000"] => Format::Opus,
                    _ => return None,
                };
                Some(Codec {
                    format,
                    payload_type: pt,
                })
            })
            .collect()
    }

    fn events(&self) -> Option<u8> {
        self.formats.iter().copied().find(|&pt| {
            self.name_of(pt)
                .is_some_and(|n| n == "telephone-event/8000")
        })
    }
}

/// Reads an offer's first audio section.
pub(crate) fn read_offer(body: &[u8]) -> Result<Offer, Refused> {
    let text = std::str::from_utf8(body).map_err(|_| refused(400, "the SDP is not UTF-8"))?;
    if !text.trim_start().starts_with("v=0") {
        return Err(refused(400, "the body is not SDP (it starts with v=0)"));
    }
    let lines = read_lines(text)?;
    let Some(audio) = lines.audio else {
        return Err(refused(488, "the offer has no audio stream (m=audio)"));
    };
    if audio.port == 0 {
        return Err(refused(
            488,
            "the offer's audio stream is disabled (port 0)",
        ));
    }
    if audio.proto != "RTP/AVP" && audio.proto != "RTP/AVPF" {
        return Err(refused(
            488,
            format!(
                "the audio stream is {}: this server speaks plain RTP (RTP/AVP)",
                audio.proto
            ),
        ));
    }
    let ip = audio
        .c
        .or(lines.session_c)
        .ok_or_else(|| refused(400, "the offer says no address (c=)"))?;
    let ours = audio.ours();
    let codec = *ours.first().ok_or_else(|| {
        let offered: Vec<String> = audio
            .formats
            .iter()
            .map(|&pt| audio.name_of(pt).unwrap_or_else(|| pt.to_string()))
            .collect();
        refused(
            488,
            format!(
                "none of the offered formats ({}) is PCMU/8000, PCMA/8000 or opus/48000",
                offered.join(", ")
            ),
        )
    })?;
    let rtp = SocketAddr::new(ip, audio.port);
    let rtcp = if audio.rtcp_mux {
        rtp
    } else {
        SocketAddr::new(ip, audio.rtcp_port.unwrap_or(audio.port.saturating_add(1)))
    };
    Ok(Offer {
        rtp,
        rtcp,
        rtcp_mux: audio.rtcp_mux,
        codec,
        events: audio.events(),
        ours,
        direction: audio
            .direction
            .or(lines.session_direction)
            .unwrap_or(Direction::SendRecv),
    })
}

/// Refuses an address media must never be sent to (488, with why): multicast, broadcast, the
/// unspecified address (outside a hold), and privileged ports (below 1024: no RTP stack sits
/// there, a service someone else runs does). The server's own addresses are the door's to
/// refuse (it knows its sockets).
pub(crate) fn vet(offer: &Offer, hold_allowed: bool) -> Result<(), Refused> {
    let ip = crate::app::serve::access::canonical(offer.rtp.ip());
    let why = match ip {
        _ if ip.is_unspecified() => (!hold_allowed).then_some("is unspecified"),
        _ if ip.is_multicast() => Some("is multicast"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("is the broadcast address"),
        _ => None,
    }
    .or(
        (offer.rtp.port() < 1024 || (!offer.rtcp_mux && offer.rtcp.port() < 1024))
            .then_some("is on a privileged port (below 1024)"),
    );
    match why {
        Some(why) => Err(refused(
            488,
            format!(
                "the offer's media address {} {why}: media is not sent there",
                offer.rtp
            ),
        )),
        None => Ok(()),
    }
}

/// The answer to `offer` in `codec` (the call's, for a re-offer): our address and RTP port,
/// telephone events when offered, 20 ms packets, the direction that mirrors the caller's;
/// `version` counts our answers within the call (RFC 4566's `o=` version).
pub(crate) fn answer(offer: &Offer, ip: IpAddr, port: u16, session: u64, version: u64) -> String {
    let family = if ip.is_ipv4() { "IP4" } else { "IP6" };
    let codec = offer.codec;
    let mut formats = codec.payload_type.to_string();
    if let Some(e) = offer.events {
        formats.push_str(&format!(" {e}"));
    }
    let mut s = format!(
        "v=0\r\no=duplex {session} {version} IN {family} {ip}\r\ns=duplex\r\nc=IN {family} \
         {ip}\r\nt=0 0\r\nm=audio {port} RTP/AVP {formats}\r\na=rtpmap:{} {}\r\n",
        codec.payload_type,
        codec.rtpmap()
    );
    if codec.format == Format::Opus {
        // Mono both ways, in-band FEC welcome (the jitter buffer rebuilds a lost packet from it).
        s.push_str(&format!(
            "a=fmtp:{} useinbandfec=1;stereo=0;sprop-stereo=0\r\n",
            codec.payload_type
        ));
    }
    if let Some(e) = offer.events {
        s.push_str(&format!(
            "a=rtpmap:{e} telephone-event/8000\r\na=fmtp:{e} 0-15\r\n"
        ));
    }
    s.push_str("a=ptime:20\r\n");
    if offer.rtcp_mux {
        s.push_str("a=rtcp-mux\r\n");
    }
    s.push_str(&format!("a={}\r\n", offer.answer_direction().name()));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An offer as baresip makes one (Opus first, then G.711, telephone events).
    const OFFER: &str = "v=0\r\no=- 1 2 IN IP4 192.0.2.10\r\ns=-\r\nc=IN IP4 192.0.2.10\r\n\
t=0 0\r\nm=audio 4000 RTP/AVP 96 8 0 101\r\na=rtpmap:96 opus/48000/2\r\n\
a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=sendrecv\r\n";

    #[test]
    fn an_offer_gives_its_address_its_first_format_of_ours_and_its_events() {
        // Opus, first in the offer, is taken, mono with in-band FEC.
        let o = read_offer(OFFER.as_bytes()).unwrap();
        assert_eq!(o.codec.format, Format::Opus);
        let a = answer(&o, "198.51.100.1".parse().unwrap(), 20000, 7, 1);
        assert!(a.contains("m=audio 20000 RTP/AVP 96 101\r\n"), "{a}");
        assert!(a.contains("a=rtpmap:96 opus/48000/2\r\n"), "{a}");
        assert!(
            a.contains("a=fmtp:96 useinbandfec=1;stereo=0;sprop-stereo=0\r\n"),
            "{a}"
        );
        // Without it, the first G.711 format.
        let o = read_offer(
            OFFER
                .replace("RTP/AVP 96 8 0 101", "RTP/AVP 8 0 101")
                .replace("a=rtpmap:96 opus/48000/2\r\n", "")
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(o.rtp, "192.0.2.10:4000".parse().unwrap());
        assert_eq!(o.rtcp, "192.0.2.10:4001".parse().unwrap());
        assert_eq!(
            o.codec,
            Codec {
                format: Format::G711(Law::A),
                payload_type: 8
            }
        );
        assert_eq!(o.events, Some(101));
        let a = answer(&o, "198.51.100.1".parse().unwrap(), 20000, 7, 1);
        assert!(a.contains("c=IN IP4 198.51.100.1\r\n"), "{a}");
        assert!(a.contains("m=audio 20000 RTP/AVP 8 101\r\n"), "{a}");
        assert!(a.contains("a=rtpmap:8 PCMA/8000\r\n"), "{a}");
        assert!(a.contains("a=rtpmap:101 telephone-event/8000\r\n"), "{a}");
        // Static payload types need no rtpmap; a media-level c= wins; rtcp-mux is kept.
        let o = read_offer(
            b"v=0\nc=IN IP4 192.0.2.1\nm=audio 5000 RTP/AVP 0\nc=IN IP4 192.0.2.2\na=rtcp-mux\na=sendonly\n",
        )
        .unwrap();
        assert_eq!(o.codec.format, Format::G711(Law::Mu));
        assert_eq!(o.rtp, "192.0.2.2:5000".parse().unwrap());
        assert_eq!(o.rtcp, o.rtp);
        assert!(answer(&o, "192.0.2.9".parse().unwrap(), 1, 1, 1).contains("a=recvonly\r\n"));
    }

    #[test]
    fn offers_we_cannot_take_are_refused_with_the_right_status() {
        let status = |b: &str| read_offer(b.as_bytes()).unwrap_err().status;
        assert_eq!(status("hello"), 400);
        assert_eq!(status("v=0\r\nm=audio 4000 RTP/AVP 0\r\n"), 400);
        assert_eq!(status("v=0\r\nc=IN IP4 nowhere\r\n"), 400);
        assert_eq!(
            status("v=0\r\nc=IN IP4 192.0.2.1\r\nm=video 4000 RTP/AVP 96\r\n"),
            488
        );
        assert_eq!(
            status("v=0\r\nc=IN IP4 192.0.2.1\r\nm=audio 0 RTP/AVP 0\r\n"),
            488
        );
        assert_eq!(
            status("v=0\r\nc=IN IP4 192.0.2.1\r\nm=audio 4000 RTP/SAVP 0\r\n"),
            488
        );
        let e = read_offer(
            b"v=0\r\nc=IN IP4 192.0.2.1\r\nm=audio 4000 RTP/AVP 97 9\r\na=rtpmap:97 speex/16000\r\n",
        )
        .unwrap_err();
        assert_eq!(e.status, 488);
        assert!(e.reason.contains("speex/16000, 9"), "{}", e.reason);
    }

    #[test]
    fn sip_reflection_targets_are_refused_488() {
        let at = |c: &str, port: u16| {
            let o = read_offer(
                format!("v=0\r\nc=IN IP4 {c}\r\nm=audio {port} RTP/AVP 0\r\n").as_bytes(),
            )
            .unwrap();
            vet(&o, false).map_err(|r| (r.status, r.reason))
        };
        assert!(at("198.51.100.7", 4000).is_ok());
        for (c, port, why) in [
            ("224.0.0.251", 4000, "multicast"),
            ("255.255.255.255", 4000, "broadcast"),
            ("0.0.0.0", 4000, "unspecified"),
            ("198.51.100.7", 1, "privileged"),
            ("198.51.100.7", 1023, "privileged"),
        ] {
            let (status, reason) = at(c, port).unwrap_err();
            assert_eq!(status, 488, "{c}:{port}");
            assert!(reason.contains(why), "{reason}");
        }
        // RTCP on the port above a privileged one is refused too; IPv6 multicast as well.
        let o = read_offer(b"v=0\r\nc=IN IP6 ff02::1\r\nm=audio 4000 RTP/AVP 0\r\n").unwrap();
        assert_eq!(vet(&o, false).unwrap_err().status, 488);
        // In a re-offer, 0.0.0.0 is an old-style hold: taken, answered inactive.
        let o = read_offer(b"v=0\r\nc=IN IP4 0.0.0.0\r\nm=audio 4000 RTP/AVP 0\r\n").unwrap();
        assert!(vet(&o, true).is_ok());
        assert_eq!(o.answer_direction(), Direction::Inactive);
        assert!(!o.wants_media() && !o.sends_media());
    }

    #[test]
    fn sip_hold_is_answered_with_the_mirrored_direction() {
        let o = |d: &str| {
            read_offer(
                format!("v=0\r\nc=IN IP4 192.0.2.1\r\nm=audio 4000 RTP/AVP 0\r\na={d}\r\n")
                    .as_bytes(),
            )
            .unwrap()
        };
        for (offered, answered) in [
            ("sendonly", "recvonly"),
            ("recvonly", "sendonly"),
            ("inactive", "inactive"),
            ("sendrecv", "sendrecv"),
        ] {
            let a = answer(&o(offered), "192.0.2.9".parse().unwrap(), 20000, 1, 2);
            assert!(a.contains(&format!("a={answered}\r\n")), "{offered}: {a}");
            assert!(a.contains("o=duplex 1 2 IN IP4"), "{a}");
        }
        // A session-level direction holds unless the media says otherwise.
        let s =
            read_offer(b"v=0\r\nc=IN IP4 192.0.2.1\r\na=sendonly\r\nm=audio 4000 RTP/AVP 0 8\r\n")
                .unwrap();
        assert_eq!(s.direction, Direction::SendOnly);
        assert_eq!(s.ours.len(), 2);
    }
}
