//! RTP as the media transports use it: the receive side's [`jitter`] buffer (WebRTC's Opus, a
//! SIP call's G.711) and the wire of plain RTP (RFC 3550: the fixed header, an RTCP sender
//! report) and of RFC 4733's telephone events, which a SIP call carries without str0m. Pure
//! logic on bytes: no sockets, no codecs.

pub(crate) mod jitter;

/// An RTP packet's fixed header and where its payload lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub marker: bool,
    pub payload_type: u8,
    pub seq: u16,
    pub timestamp: u32,
    pub ssrc: u32,
    /// The payload's start and end in the packet (CSRCs, extension and padding skipped).
    pub payload: (usize, usize),
}

/// Why bytes are not an RTP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotRtp {
    /// Shorter than what its header says.
    Short,
    /// Not version 2.
    Version,
    /// An RTCP packet (payload types 72–76 with the marker: RFC 5761's rule).
    Rtcp,
}

/// Reads an RTP packet's header (RFC 3550 §5.1).
pub(crate) fn parse(b: &[u8]) -> Result<Header, NotRtp> {
    if b.len() < 12 {
        return Err(NotRtp::Short);
    }
    if b[0] >> 6 != 2 {
        return Err(NotRtp::Version);
    }
    if (200..=204).contains(&b[1]) {
        return Err(NotRtp::Rtcp);
    }
    let padding = b[0] & 0x20 != 0;
    let extension = b[0] & 0x10 != 0;
    let csrcs = usize::from(b[0] & 0x0f);
    let mut start = 12 + 4 * csrcs;
    if extension {
        let words = b.get(start + 2..start + 4).ok_or(NotRtp::Short)?;
        start += 4 + 4 * usize::from(u16::from_be_bytes([words[0], words[1]]));
    }
    let mut end = b.len();
    if padding {
        end = end
            .checked_sub(usize::from(*b.last().ok_or(NotRtp::Short)?))
            .ok_or(NotRtp::Short)?;
    }
    if start > end {
        return Err(NotRtp::Short);
    }
    Ok(Header {
        marker: b[1] & 0x80 != 0,
        payload_type: b[1] & 0x7f,
        seq: u16::from_be_bytes([b[2], b[3]]),
        timestamp: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
        ssrc: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
        payload: (start, end),
    })
}

/// An RTP packet of `payload`.
pub(crate) fn packet(
    payload_type: u8,
    marker: bool,
    seq: u16,
    timestamp: u32,
    ssrc: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut p = Vec::with_capacity(12 + payload.len());
    p.push(0x80);
    p.push(payload_type & 0x7f | if marker { 0x80 } else { 0 });
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend_from_slice(&timestamp.to_be_bytes());
    p.extend_from_slice(&ssrc.to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// An RTCP sender report (RFC 3550 §6.4.1) without report blocks: what was sent, and when by
/// the wall clock, so that the far end can measure the round trip and keep the media in sync.
pub(crate) fn sender_report(
    ssrc: u32,
    now: std::time::SystemTime,
    rtp_ts: u32,
    packets: u32,
    octets: u32,
) -> Vec<u8> {
    // NTP time: seconds since 1900, and the fraction as 32 bits.
    let since = now
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = (since.as_secs() + 2_208_988_800) as u32;
    let frac = ((u64::from(since.subsec_nanos()) << 32) / 1_000_000_000) as u32;
    let mut p = Vec::with_capacity(28);
    p.extend_from_slice(&[0x80, 200, 0, 6]);
    for w in [ssrc, secs, frac, rtp_ts, packets, octets] {
        p.extend_from_slice(&w.to_be_bytes());
    }
    p
}

/// One RFC 4733 telephone-event payload: the event (0–9, `*` 10, `#` 11, A–D 12–15), whether
/// it has ended, and its duration so far in RTP ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TelephoneEvent {
    pub event: u8,
    pub end: bool,
    pub duration: u16,
}

impl TelephoneEvent {
    /// Reads a payload (4 bytes; RFC 4733 §2.3).
    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        let b = b.get(..4)?;
        Some(TelephoneEvent {
            event: b[0],
            end: b[1] & 0x80 != 0,
            duration: u16::from_be_bytes([b[2], b[3]]),
        })
    }

    /// The DTMF key of the event, if it is one.
    pub(crate) fn key(&self) -> Option<char> {
        Some(match self.event {
            0..=9 => char::from(b'0' + self.event),
            10 => '*',
            11 => '#',
            12..=15 => char::from(b'A' + self.event - 12),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packet_reads_back_and_what_is_not_rtp_says_why() {
        let p = packet(8, true, 65535, 0xdead_beef, 7, &[1, 2, 3]);
        let h = parse(&p).unwrap();
        assert_eq!(
            (h.marker, h.payload_type, h.seq, h.timestamp, h.ssrc),
            (true, 8, 65535, 0xdead_beef, 7)
        );
        assert_eq!(&p[h.payload.0..h.payload.1], &[1, 2, 3]);
        // Two CSRCs, a one-word extension and two bytes of padding around a 2-byte payload.
        let mut q = vec![0x80 | 0x20 | 0x10 | 2, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 9];
        q.extend_from_slice(&[0; 8]);
        q.extend_from_slice(&[0xbe, 0xde, 0, 1, 0, 0, 0, 0]);
        q.extend_from_slice(&[5, 6, 0, 2]);
        let h = parse(&q).unwrap();
        assert_eq!(&q[h.payload.0..h.payload.1], &[5, 6]);
        assert_eq!(parse(&q[..11]), Err(NotRtp::Short));
        assert_eq!(parse(&[0x40; 12]), Err(NotRtp::Version));
        let sr = sender_report(7, std::time::SystemTime::now(), 160, 1, 160);
        assert_eq!(parse(&sr), Err(NotRtp::Rtcp));
        assert_eq!(sr.len(), 28);
        // A padding count larger than the packet.
        let mut bad = packet(0, false, 1, 1, 1, &[]);
        bad[0] |= 0x20;
        bad.push(200);
        assert_eq!(parse(&bad), Err(NotRtp::Short));
    }

    #[test]
    fn telephone_events_name_their_keys() {
        let e = TelephoneEvent::parse(&[11, 0x80 | 10, 0x03, 0x20]).unwrap();
        assert_eq!((e.key(), e.end, e.duration), (Some('#'), true, 800));
        assert_eq!(
            TelephoneEvent::parse(&[5, 0, 0, 0]).unwrap().key(),
            Some('5')
        );
        assert_eq!(
            TelephoneEvent::parse(&[13, 0, 0, 0]).unwrap().key(),
            Some('B')
        );
        assert_eq!(TelephoneEvent::parse(&[16, 0, 0, 0]).unwrap().key(), None);
        assert_eq!(TelephoneEvent::parse(&[1, 2, 3]), None);
    }
}
