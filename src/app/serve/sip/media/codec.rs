//! A call's codec: G.711 (through [`PhoneIn`]'s 8 → 24 kHz) or Opus (libopus at 24 kHz, its
//! in-band FEC and concealment for what is lost) on the receive side, and what the agent's audio
//! becomes on the send side (G.711 bytes made by the session's encoder, cut here into 20 ms
//! packets; Opus encoded here from 24 kHz samples). Pure computation: no sockets, no clock.

use std::collections::VecDeque;

use super::super::super::rtp::jitter::Play;
use super::super::sdp::Format;
use crate::audio::g711;
use crate::audio::phone::PhoneIn;

/// G.711 bytes of one 20 ms packet.
pub(super) const PACKET: usize = 160;
/// Samples at 24 kHz of one 20 ms Opus packet.
const OPUS_SAMPLES: usize = 480;
/// Opus bitrate of the agent's audio.
const OPUS_BITRATE: i32 = 32_000;

/// A call's codec, both ways.
pub(super) enum Codec {
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
    pub(super) fn new(format: Format) -> Codec {
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
    pub(super) fn ticks(&self, packet: &[u8]) -> u64 {
        match self {
            Codec::G711 { .. } => packet.len() as u64,
            Codec::Opus { .. } => opus::packet::get_nb_samples(packet, 48_000).unwrap_or(0) as u64,
        }
    }

    /// The 24 kHz PCM16 bytes of what the jitter buffer hands out.
    pub(super) fn decode(&mut self, play: &Play) -> Vec<u8> {
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

    /// Cuts `pending` (G.711 bytes, or 24 kHz samples as f32 little-endian for Opus) into
    /// whole packets at the end of `queued`; less than a packet stays in `pending`.
    pub(super) fn packetize(&mut self, pending: &mut Vec<u8>, queued: &mut VecDeque<Vec<u8>>) {
        match self {
            Codec::G711 { .. } => {
                let whole = pending.len() / PACKET * PACKET;
                queued.extend(
                    pending
                        .drain(..whole)
                        .collect::<Vec<_>>()
                        .chunks(PACKET)
                        .map(<[u8]>::to_vec),
                );
            }
            Codec::Opus { encoder, .. } => {
                let frame = OPUS_SAMPLES * 4;
                let whole = pending.len() / frame * frame;
                let bytes: Vec<u8> = pending.drain(..whole).collect();
                let Some(enc) = encoder.as_mut() else {
                    return;
                };
                let mut packet = [0u8; 1500];
                for f in bytes.chunks(frame) {
                    let samples: Vec<f32> = f
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    if let Ok(n) = enc.encode_float(&samples, &mut packet) {
                        queued.push_back(packet[..n].to_vec());
                    }
                }
            }
        }
    }
}
