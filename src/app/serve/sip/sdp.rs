//! SDP offer and answer for a SIP call (RFC 3264 over RFC 8866): what a caller offers (where
//! its RTP goes, which formats, telephone events, RTCP multiplexing) and the answer that picks
//! one format of ours. Pure text: no sockets.

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

/// What a caller offered that a call needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Offer {
    /// Where the caller takes its RTP.
    pub rtp: SocketAddr,
    /// Where it takes its RTCP (the RTP port's neighbour unless `a=rtcp` or `a=rtcp-mux`).
    pub rtcp: SocketAddr,
    pub rtcp_mux: bool,
    /// The format chosen: the first of the offer's that we speak (PCMU, PCMA, Opus).
    pub codec: Codec,
    /// The payload type of `telephone-event/8000`, when offered.
    pub events: Option<u8>,
    /// The caller only sends (`a=sendonly`) or only receives (`a=recvonly`), or neither.
    pub direction: &'static str,
}

/// Why an offer is refused, and with which SIP status: 400 for what is not SDP, 488 (Not
/// Acceptable Here) for an offer we understand and cannot take (no PCMU, PCMA or Opus).
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

/// Reads an offer's first audio section (the others are declined by leaving them out: one
/// audio stream is a call).
pub(crate) fn read_offer(body: &[u8]) -> Result<Offer, Refused> {
    let text = std::str::from_utf8(body).map_err(|_| refused(400, "the SDP is not UTF-8"))?;
    if !text.trim_start().starts_with("v=0") {
        return Err(refused(400, "the body is not SDP (it starts with v=0)"));
    }
    let mut session_c: Option<IpAddr> = None;
    let mut media_c: Option<IpAddr> = None;
    let mut audio: Option<(u16, String, Vec<u8>)> = None;
    let mut in_audio = false;
    let mut seen_audio = false;
    let mut rtpmap: Vec<(u8, String)> = Vec::new();
    let mut rtcp_port: Option<u16> = None;
    let mut rtcp_mux = false;
    let mut direction = "sendrecv";
    for line in text.lines() {
        let line = line.trim_end_matches('\r');
        let Some((kind, value)) = line.split_once('=') else {
            if line.trim().is_empty() {
                continue;
            }
            return Err(refused(400, format!("an SDP line without `=`: {line:?}")));
        };
        match kind {
            "m" => {
                in_audio = false;
                let mut f = value.split_whitespace();
                let (media, port, proto) = (f.next(), f.next(), f.next());
                if media == Some("audio") && !seen_audio {
                    seen_audio = true;
                    in_audio = true;
                    let port = port
                        .and_then(|p| p.split('/').next())
                        .and_then(|p| p.parse::<u16>().ok())
                        .ok_or_else(|| refused(400, format!("a bad m= line: {line:?}")))?;
                    let formats = f.filter_map(|p| p.parse::<u8>().ok()).collect();
                    audio = Some((port, proto.unwrap_or_default().to_string(), formats));
                }
            }
            "c" => {
                let ip = value
                    .split_whitespace()
                    .nth(2)
                    .and_then(|a| a.split('/').next())
                    .and_then(|a| a.parse::<IpAddr>().ok())
                    .ok_or_else(|| refused(400, format!("a bad c= line: {line:?}")))?;
                if seen_audio {
                    if in_audio {
                        media_c = Some(ip);
                    }
                } else {
                    session_c = Some(ip);
                }
            }
            "a" if in_audio || !seen_audio => {
                let (name, arg) = value.split_once(':').unwrap_or((value, ""));
                match name {
                    "rtpmap" if in_audio => {
                        let mut f = arg.split_whitespace();
                        if let (Some(pt), Some(enc)) =
                            (f.next().and_then(|p| p.parse::<u8>().ok()), f.next())
                        {
                            rtpmap.push((pt, enc.to_ascii_lowercase()));
                        }
                    }
                    "rtcp" if in_audio => {
                        rtcp_port = arg.split_whitespace().next().and_then(|p| p.parse().ok());
                    }
                    "rtcp-mux" if in_audio => rtcp_mux = true,
                    "sendrecv" => direction = "sendrecv",
                    "sendonly" => direction = "sendonly",
                    "recvonly" => direction = "recvonly",
                    "inactive" => direction = "inactive",
                    _ => {}
                }
            }
            _ => {}
        }
    }
    let Some((port, proto, formats)) = audio else {
        return Err(refused(488, "the offer has no audio stream (m=audio)"));
    };
    if port == 0 {
        return Err(refused(
            488,
            "the offer's audio stream is disabled (port 0)",
        ));
    }
    if proto != "RTP/AVP" && proto != "RTP/AVPF" {
        return Err(refused(
            488,
            format!("the audio stream is {proto}: this server speaks plain RTP (RTP/AVP)"),
        ));
    }
    let ip = media_c
        .or(session_c)
        .ok_or_else(|| refused(400, "the offer says no address (c=)"))?;
    // A format is named by its rtpmap, or by its static number (RFC 3551) when it has none.
    let name_of = |pt: u8| -> Option<String> {
        rtpmap
            .iter()
            .find(|(p, _)| *p == pt)
            .map(|(_, n)| n.clone())
            .or(match pt {
                0 => Some("pcmu/8000".into()),
                8 => Some("pcma/8000".into()),
                _ => None,
            })
    };
    let codec = formats
        .iter()
        .find_map(|&pt| {
            let name = name_of(pt)?;
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
        .ok_or_else(|| {
            let offered: Vec<String> = formats
                .iter()
                .map(|&pt| name_of(pt).unwrap_or_else(|| pt.to_string()))
                .collect();
            refused(
                488,
                format!(
                    "none of the offered formats ({}) is PCMU/8000, PCMA/8000 or opus/48000",
                    offered.join(", ")
                ),
            )
        })?;
    let events = formats
        .iter()
        .copied()
        .find(|&pt| name_of(pt).is_some_and(|n| n == "telephone-event/8000"));
    let rtp = SocketAddr::new(ip, port);
    let rtcp = if rtcp_mux {
        rtp
    } else {
        SocketAddr::new(ip, rtcp_port.unwrap_or(port.saturating_add(1)))
    };
    Ok(Offer {
        rtp,
        rtcp,
        rtcp_mux,
        codec,
        events,
        direction,
    })
}

/// The answer to `offer`: our address and RTP port, the chosen format (and telephone events
/// when offered), 20 ms packets, the direction that mirrors the caller's.
pub(crate) fn answer(offer: &Offer, ip: IpAddr, port: u16, session: u64) -> String {
    let family = if ip.is_ipv4() { "IP4" } else { "IP6" };
    let mut formats = offer.codec.payload_type.to_string();
    if let Some(e) = offer.events {
        formats.push_str(&format!(" {e}"));
    }
    let direction = match offer.direction {
        "sendonly" => "recvonly",
        "recvonly" => "sendonly",
        d => d,
    };
    let mut s = format!(
        "v=0\r\no=duplex {session} {session} IN {family} {ip}\r\ns=duplex\r\nc=IN {family} \
         {ip}\r\nt=0 0\r\nm=audio {port} RTP/AVP {formats}\r\na=rtpmap:{} {}\r\n",
        offer.codec.payload_type,
        offer.codec.rtpmap()
    );
    if offer.codec.format == Format::Opus {
        // Mono both ways, in-band FEC welcome (the jitter buffer rebuilds a lost packet from it).
        s.push_str(&format!(
            "a=fmtp:{} useinbandfec=1;stereo=0;sprop-stereo=0\r\n",
            offer.codec.payload_type
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
    s.push_str(&format!("a={direction}\r\n"));
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
        let a = answer(&o, "198.51.100.1".parse().unwrap(), 20000, 7);
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
        let a = answer(&o, "198.51.100.1".parse().unwrap(), 20000, 7);
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
        assert!(answer(&o, "192.0.2.9".parse().unwrap(), 1, 1).contains("a=recvonly\r\n"));
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
}
