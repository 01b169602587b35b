//! Ogg/Opus byte streams as the Moshi protocol carries them (24 kHz mono, RFC 7845): a
//! push-based reader that takes the stream in chunks of any size and returns PCM, and a writer
//! that turns PCM into Ogg pages, one 40 ms Opus packet per page.
//!
//! The Ogg framing is the `ogg` crate's page parser and writer, the codec is libopus (the `opus`
//! crate); this module only joins them to the shape of a network stream: bytes arrive split
//! anywhere, the header pages come first, and nothing a peer sends may make it panic or grow
//! without bound. Each packet's duration is read from its table of contents before it is
//! decoded and asked of a [`Budget`]: what the budget refuses is skipped undecoded (counted), so
//! a stream of tiny packets that each claim 120 ms costs what the budget allows, not what the
//! packets claim. Knows nothing of sockets or stages.

use std::borrow::Cow;

use ogg::reading::{BasePacketReader, PageParser};
use ogg::writing::{PacketWriteEndInfo, PacketWriter};

use super::pace::Budget;
use super::AudioError;

/// The rate of every stream here, Hz.
pub const RATE: u32 = 24_000;
/// Samples per Opus packet the writer emits (40 ms at 24 kHz).
pub const PACKET_SAMPLES: usize = 960;
/// The longest Opus packet, in samples per channel at 24 kHz (120 ms).
const MAX_PACKET_SAMPLES: usize = 2880;
/// What a packet of no bytes stands for: a lost 20 ms frame, concealed by the decoder.
const LOST_PACKET_SAMPLES: usize = 480;
/// Ogg granule positions of Opus streams count at 48 kHz.
const GRANULE_PER_SAMPLE: u64 = 48_000 / RATE as u64;

/// What is wrong with a stream a peer sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The bytes are not Ogg pages.
    #[error("not an Ogg stream: {0}")]
    NotOgg(String),
    /// An Ogg page is damaged (checksum, structure).
    #[error("damaged Ogg page {page}: {detail}")]
    BadPage {
        /// Index of the page in the stream.
        page: u64,
        /// What the parser said.
        detail: String,
    },
    /// The Ogg stream does not carry Opus.
    #[error("not an Opus stream: {0}")]
    NotOpus(String),
    /// libopus refused a packet.
    #[error("Opus packet {packet} could not be decoded: {detail}")]
    Decode {
        /// Index of the audio packet.
        packet: u64,
        /// What libopus said.
        detail: String,
    },
}

/// Where the reader is inside the current page.
enum Pending {
    /// Waiting for a 27-byte page header.
    Header,
    /// Waiting for `n` bytes of segment table.
    Segments(PageParser, usize),
    /// Waiting for `n` bytes of page body.
    Body(PageParser, usize),
}

/// Decodes one Ogg/Opus stream pushed in chunks of any size.
pub struct OggOpusReader {
    buf: Vec<u8>,
    pending: Option<Pending>,
    packets: BasePacketReader,
    pages: u64,
    audio_packets: u64,
    serial: Option<u32>,
    decoder: Option<(opus::Decoder, usize)>,
    tags_seen: bool,
    /// Samples still to drop at the start (the encoder's pre-skip), at 24 kHz.
    skip: usize,
    scratch: Vec<f32>,
    refused_packets: u64,
    refused_samples: u64,
}

impl Default for OggOpusReader {
    fn default() -> Self {
        Self::new()
    }
}

impl OggOpusReader {
    /// A reader waiting for the first page.
    pub fn new() -> Self {
        OggOpusReader {
            buf: Vec::new(),
            pending: Some(Pending::Header),
            packets: BasePacketReader::new(),
            pages: 0,
            audio_packets: 0,
            serial: None,
            decoder: None,
            tags_seen: false,
            skip: 0,
            scratch: vec![0.0; MAX_PACKET_SAMPLES * 2],
            refused_packets: 0,
            refused_samples: 0,
        }
    }

    /// Audio packets decoded so far.
    pub fn packets(&self) -> u64 {
        self.audio_packets
    }

    /// Audio packets the budget refused (skipped undecoded), and the samples they stood for.
    pub fn refused(&self) -> (u64, u64) {
        (self.refused_packets, self.refused_samples)
    }

    /// Takes the next `bytes` of the stream and appends the PCM they complete (24 kHz mono) to
    /// `out`, each audio packet decoded only when `budget` pays for its duration (a packet it
    /// refuses is skipped, counted in [`refused`](Self::refused)). A page split across calls is
    /// kept (at most one page: 64 KiB) until it is whole.
    ///
    /// # Errors
    ///
    /// A [`StreamError`] when the bytes are not an Ogg/Opus stream or are damaged; the reader
    /// is then of no further use.
    pub fn push(
        &mut self,
        bytes: &[u8],
        out: &mut Vec<f32>,
        budget: &mut dyn Budget,
    ) -> Result<(), StreamError> {
        self.buf.extend_from_slice(bytes);
        let mut at = 0;
        loop {
            let state = self.pending.take().unwrap_or(Pending::Header);
            let need = match &state {
                Pending::Header => 27,
                Pending::Segments(_, n) | Pending::Body(_, n) => *n,
            };
            if self.buf.len() - at < need {
                self.pending = Some(state);
                break;
            }
            let chunk = &self.buf[at..at + need];
            at += need;
            self.pending = Some(match state {
                Pending::Header => {
                    if &chunk[..4] != b"OggS" {
                        return Err(StreamError::NotOgg(format!(
                            "page {} starts with {:02x?}, not \"OggS\"",
                            self.pages,
                            &chunk[..4]
                        )));
                    }
                    let mut header = [0u8; 27];
                    header.copy_from_slice(chunk);
                    let (parser, segments) =
                        PageParser::new(header).map_err(|e| self.bad_page(e))?;
                    Pending::Segments(parser, segments)
                }
                Pending::Segments(mut parser, _) => {
                    let body = parser.parse_segments(chunk.to_vec());
                    Pending::Body(parser, body)
                }
                Pending::Body(parser, _) => {
                    let page = parser
                        .parse_packet_data(chunk.to_vec())
                        .map_err(|e| self.bad_page(e))?;
                    self.pages += 1;
                    self.packets.push_page(page).map_err(|e| self.bad_page(e))?;
                    while let Some(p) = self.packets.read_packet() {
                        self.packet(p, out, budget)?;
                    }
                    Pending::Header
                }
            });
        }
        self.buf.drain(..at);
        Ok(())
    }

    fn bad_page(&self, e: ogg::OggReadError) -> StreamError {
        StreamError::BadPage {
            page: self.pages,
            detail: e.to_string(),
        }
    }

    fn packet(
        &mut self,
        p: ogg::Packet,
        out: &mut Vec<f32>,
        budget: &mut dyn Budget,
    ) -> Result<(), StreamError> {
        let serial = *self.serial.get_or_insert(p.stream_serial());
        if p.stream_serial() != serial {
            return Err(StreamError::NotOpus(format!(
                "a second logical stream (serial {}) after {serial}: one mono stream expected",
                p.stream_serial()
            )));
        }
        let Some((decoder, channels)) = self.decoder.as_mut() else {
            return self.head(&p.data);
        };
        if !self.tags_seen {
            if !p.data.starts_with(b"OpusTags") {
                return Err(StreamError::NotOpus(
                    "the second packet is not OpusTags".into(),
                ));
            }
            self.tags_seen = true;
            return Ok(());
        }
        let ch = *channels;
        let index = self.audio_packets + self.refused_packets;
        let bad = move |detail: String| StreamError::Decode {
            packet: index,
            detail,
        };
        // The duration first, from the packet's table of contents: nothing is decoded that the
        // budget does not pay for. No bytes is a lost frame (RFC 7845), concealed for 20 ms.
        let claimed = if p.data.is_empty() {
            LOST_PACKET_SAMPLES
        } else {
            opus::packet::get_nb_samples(&p.data, RATE).map_err(|e| bad(e.to_string()))?
        };
        if claimed > MAX_PACKET_SAMPLES {
            return Err(bad(format!(
                "it claims {claimed} samples, more than Opus's 120 ms"
            )));
        }
        if !budget.take(claimed) {
            self.refused_packets += 1;
            self.refused_samples += claimed as u64;
            return Ok(());
        }
        let n = decoder
            .decode_float(&p.data, &mut self.scratch[..claimed * ch], false)
            .map_err(|e| bad(e.to_string()))?;
        self.audio_packets += 1;
        let frames = self.scratch[..n * ch].chunks_exact(ch);
        let drop = self.skip.min(n);
        self.skip -= drop;
        out.extend(frames.skip(drop).map(|f| f.iter().sum::<f32>() / ch as f32));
        Ok(())
    }

    /// The identification header: version, channels, pre-skip.
    fn head(&mut self, d: &[u8]) -> Result<(), StreamError> {
        if d.len() < 19 || !d.starts_with(b"OpusHead") {
            let what = if d.starts_with(b"\x01vorbis") {
                "it carries Vorbis".to_string()
            } else if d.starts_with(b"Speex") {
                "it carries Speex".to_string()
            } else if d.starts_with(b"\x7fFLAC") {
                "it carries FLAC".to_string()
            } else {
                format!(
                    "its first packet ({} bytes) is not an OpusHead header",
                    d.len()
                )
            };
            return Err(StreamError::NotOpus(what));
        }
        let version = d[8];
        if version >> 4 != 0 {
            return Err(StreamError::NotOpus(format!(
                "OpusHead version {version} is not supported"
            )));
        }
        let channels = d[9] as usize;
        let mapping = d.get(18).copied().unwrap_or(0);
        if !(1..=2).contains(&channels) || mapping != 0 {
            return Err(StreamError::NotOpus(format!(
                "{channels} channels with mapping family {mapping}: mono or stereo expected"
            )));
        }
        let pre_skip = u16::from_le_bytes([d[10], d[11]]) as u64;
        let ch = if channels == 1 {
            opus::Channels::Mono
        } else {
            opus::Channels::Stereo
        };
        let decoder = opus::Decoder::new(RATE, ch)
            .map_err(|e| StreamError::NotOpus(format!("libopus: {e}")))?;
        self.skip = (pre_skip / GRANULE_PER_SAMPLE) as usize;
        self.decoder = Some((decoder, channels));
        Ok(())
    }
}

/// Encodes 24 kHz mono PCM into an Ogg/Opus stream: the two header pages first, then one page
/// per 40 ms packet.
pub struct OggOpusWriter {
    encoder: opus::Encoder,
    pages: PacketWriter<'static, Vec<u8>>,
    serial: u32,
    pending: Vec<f32>,
    pre_skip: u16,
    /// Samples encoded so far.
    encoded: u64,
    headers_done: bool,
    packet: Vec<u8>,
}

impl OggOpusWriter {
    /// A writer for a stream with serial number `serial`, at `bitrate` bits per second (`None`:
    /// libopus's choice).
    ///
    /// # Errors
    ///
    /// libopus's error when it cannot create the encoder.
    pub fn new(serial: u32, bitrate: Option<i32>) -> Result<Self, AudioError> {
        let mut encoder = opus::Encoder::new(RATE, opus::Channels::Mono, opus::Application::Audio)
            .map_err(|e| codec("libopus encoder", e))?;
        if let Some(b) = bitrate {
            encoder
                .set_bitrate(opus::Bitrate::Bits(b))
                .map_err(|e| codec(format!("libopus bitrate {b}"), e))?;
        }
        let lookahead = encoder.get_lookahead().unwrap_or(0).max(0) as u64;
        Ok(OggOpusWriter {
            encoder,
            pages: PacketWriter::new(Vec::new()),
            serial,
            pending: Vec::with_capacity(PACKET_SAMPLES * 4),
            pre_skip: (lookahead * GRANULE_PER_SAMPLE).min(u16::MAX as u64) as u16,
            encoded: 0,
            headers_done: false,
            packet: vec![0; 4000],
        })
    }

    fn page(&mut self, data: Vec<u8>, granule: u64) -> Result<Vec<u8>, AudioError> {
        self.pages
            .write_packet(
                Cow::Owned(data),
                self.serial,
                PacketWriteEndInfo::EndPage,
                granule,
            )
            .map_err(|e| codec("Ogg page", e))?;
        Ok(std::mem::take(self.pages.inner_mut()))
    }

    /// The two header pages (`OpusHead`, `OpusTags`), the first time it is called; nothing
    /// after that. [`push`](Self::push) calls it when nobody has.
    ///
    /// # Errors
    ///
    /// When a page cannot be written (never, into memory).
    pub fn headers(&mut self) -> Result<Vec<Vec<u8>>, AudioError> {
        if self.headers_done {
            return Ok(Vec::new());
        }
        self.headers_done = true;
        let mut head = b"OpusHead".to_vec();
        head.push(1); // version
        head.push(1); // channels
        head.extend_from_slice(&self.pre_skip.to_le_bytes());
        head.extend_from_slice(&RATE.to_le_bytes());
        head.extend_from_slice(&0i16.to_le_bytes()); // output gain
        head.push(0); // mapping family: mono/stereo
        let vendor = concat!("duplex ", env!("CARGO_PKG_VERSION"));
        let mut tags = b"OpusTags".to_vec();
        tags.extend_from_slice(&(vendor.len() as u32).to_le_bytes());
        tags.extend_from_slice(vendor.as_bytes());
        tags.extend_from_slice(&0u32.to_le_bytes()); // no comments
        Ok(vec![self.page(head, 0)?, self.page(tags, 0)?])
    }

    /// Takes PCM (24 kHz mono) and returns the pages of every packet it completes (headers
    /// first on the first call).
    ///
    /// # Errors
    ///
    /// libopus's error for a packet it cannot encode.
    pub fn push(&mut self, pcm: &[f32]) -> Result<Vec<Vec<u8>>, AudioError> {
        let mut pages = self.headers()?;
        self.pending.extend_from_slice(pcm);
        let mut at = 0;
        while self.pending.len() - at >= PACKET_SAMPLES {
            let n = self
                .encoder
                .encode_float(&self.pending[at..at + PACKET_SAMPLES], &mut self.packet)
                .map_err(|e| codec("libopus", e))?;
            at += PACKET_SAMPLES;
            self.encoded += PACKET_SAMPLES as u64;
            let granule = self.pre_skip as u64 + self.encoded * GRANULE_PER_SAMPLE;
            let data = self.packet[..n].to_vec();
            pages.push(self.page(data, granule)?);
        }
        self.pending.drain(..at);
        Ok(pages)
    }

    /// Pads what is left to a whole packet and returns its page (nothing when nothing is left).
    ///
    /// # Errors
    ///
    /// As [`push`](Self::push).
    pub fn flush(&mut self) -> Result<Vec<Vec<u8>>, AudioError> {
        if self.pending.is_empty() {
            return self.headers();
        }
        let pad = PACKET_SAMPLES - self.pending.len() % PACKET_SAMPLES;
        self.push(&vec![0.0; pad])
    }
}

/// An encoder's or writer's refusal.
fn codec(what: impl Into<String>, e: impl std::fmt::Display) -> AudioError {
    AudioError::Codec {
        what: what.into(),
        detail: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::pace::{RealTime, Unlimited};
    use std::time::Duration;

    fn tone(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| 0.5 * (i as f32 * 440.0 * std::f32::consts::TAU / RATE as f32).sin())
            .collect()
    }

    fn encode(pcm: &[f32]) -> Vec<Vec<u8>> {
        let mut w = OggOpusWriter::new(7, None).unwrap();
        let mut pages = w.push(pcm).unwrap();
        pages.extend(w.flush().unwrap());
        pages
    }

    #[test]
    fn one_second_is_two_header_pages_and_25_packets_and_comes_back_whole() {
        let pages = encode(&tone(24_000));
        assert_eq!(pages.len(), 27);
        assert!(pages[0].windows(8).any(|w| w == b"OpusHead"));
        let mut r = OggOpusReader::new();
        let mut out = Vec::new();
        for p in &pages {
            r.push(p, &mut out, &mut Unlimited).unwrap();
        }
        assert_eq!(r.packets(), 25);
        // The pre-skip is dropped: what comes back is the input, delayed by nothing more.
        let skipped = 24_000 - out.len();
        assert!((1..400).contains(&skipped), "{} samples back", out.len());
        let energy: f32 = out.iter().map(|x| x * x).sum::<f32>() / out.len() as f32;
        assert!((0.08..0.17).contains(&energy), "energy {energy}");
    }

    #[test]
    fn chunking_of_the_bytes_does_not_matter() {
        let bytes: Vec<u8> = encode(&tone(9600)).concat();
        let whole = {
            let mut r = OggOpusReader::new();
            let mut out = Vec::new();
            r.push(&bytes, &mut out, &mut Unlimited).unwrap();
            out
        };
        for size in [1, 7, 200, 5000] {
            let mut r = OggOpusReader::new();
            let mut out = Vec::new();
            for c in bytes.chunks(size) {
                r.push(c, &mut out, &mut Unlimited).unwrap();
            }
            assert_eq!(out, whole, "chunks of {size}");
        }
    }

    #[test]
    fn garbage_a_damaged_page_and_other_codecs_are_refused_by_name() {
        let mut out = Vec::new();
        let e = OggOpusReader::new()
            .push(&[0x42; 100], &mut out, &mut Unlimited)
            .unwrap_err();
        assert!(matches!(e, StreamError::NotOgg(_)), "{e}");

        let mut bytes = encode(&tone(4800)).concat();
        let last = bytes.len() - 3;
        bytes[last] ^= 0xff;
        let e = OggOpusReader::new()
            .push(&bytes, &mut out, &mut Unlimited)
            .unwrap_err();
        assert!(matches!(e, StreamError::BadPage { .. }), "{e}");

        let mut w = PacketWriter::new(Vec::new());
        w.write_packet(
            b"\x01vorbis\0\0\0\0\x01".to_vec(),
            1,
            PacketWriteEndInfo::EndPage,
            0,
        )
        .unwrap();
        let e = OggOpusReader::new()
            .push(&w.into_inner(), &mut out, &mut Unlimited)
            .unwrap_err();
        assert_eq!(e, StreamError::NotOpus("it carries Vorbis".into()));
    }

    /// The header pages of a mono stream, then `pages` pages of `per_page` copies of `packet`.
    fn stream_of(packet: &[u8], per_page: usize, pages: usize) -> Vec<u8> {
        let mut w = PacketWriter::new(Vec::new());
        let mut head = b"OpusHead".to_vec();
        head.extend_from_slice(&[1, 1, 0, 0, 0xc0, 0x5d, 0, 0, 0, 0, 0]);
        w.write_packet(head, 9, PacketWriteEndInfo::EndPage, 0)
            .unwrap();
        w.write_packet(
            b"OpusTags\0\0\0\0\0\0\0\0".to_vec(),
            9,
            PacketWriteEndInfo::EndPage,
            0,
        )
        .unwrap();
        for page in 0..pages {
            for i in 0..per_page {
                let end = if i + 1 == per_page {
                    PacketWriteEndInfo::EndPage
                } else {
                    PacketWriteEndInfo::NormalPacket
                };
                w.write_packet(packet.to_vec(), 9, end, (page * per_page + i) as u64)
                    .unwrap();
            }
        }
        w.into_inner()
    }

    /// Two bytes that claim 120 ms (two 60 ms frames of nothing), 255 to a page: what the
    /// packets claim is hours, what is decoded is what the budget pays for, and the rest is
    /// counted, not decoded.
    #[test]
    fn packets_that_claim_more_than_the_budget_are_skipped_undecoded() {
        let bomb = [0x1b, 0x02];
        assert_eq!(opus::packet::get_nb_samples(&bomb, RATE).unwrap(), 2880);
        let bytes = stream_of(&bomb, 255, 400);
        assert!(bytes.len() < 1 << 20, "{} bytes: one message", bytes.len());
        let mut r = OggOpusReader::new();
        let mut out = Vec::new();
        let mut budget = RealTime::new(RATE, 1.0, Duration::from_secs(1));
        r.push(&bytes, &mut out, &mut budget).unwrap();
        // At most the one-second allowance comes out of one message (one packet may straddle
        // the time it took to parse it).
        assert!(out.len() <= 24_000 + 2880, "{} samples decoded", out.len());
        let (packets, samples) = r.refused();
        assert!(packets >= 255 * 400 - 10, "{packets} refused");
        assert_eq!(
            samples + out.len() as u64 + r.skip as u64,
            255 * 400 * 2880,
            "every claimed sample is decoded or counted"
        );
    }

    /// A packet of no bytes is a lost 20 ms frame, not the decoder's 120 ms maximum.
    #[test]
    fn an_empty_packet_is_a_twenty_millisecond_loss() {
        let bytes = stream_of(&[], 255, 4);
        let mut r = OggOpusReader::new();
        let mut out = Vec::new();
        r.push(&bytes, &mut out, &mut Unlimited).unwrap();
        assert_eq!(out.len() + r.skip, 255 * 4 * 480);
    }
}
