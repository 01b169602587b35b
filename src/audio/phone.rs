//! Telephone audio as a stream: G.711 bytes at 8 kHz (μ-law or A-law), or 16-bit linear PCM at
//! a provider's rate (8, 16 or 24 kHz), ↔ the model's 24 kHz audio, through
//! [`g711`](super::g711)'s tables and a streaming resampler each way; and 24 kHz samples as
//! 16-bit little-endian PCM. For the transports that carry either (the realtime API, Twilio,
//! SIP, the providers' media streams). Knows nothing of protocols or sockets.

use super::g711::{self, Law};
use super::{AudioError, StreamResampler, MODEL_RATE};

/// G.711's sample rate.
pub const PHONE_RATE: u32 = 8_000;

/// How a telephone stream's samples are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    /// G.711, a byte a sample, at 8 kHz.
    G711(Law),
    /// 16-bit little-endian linear PCM at the stream's rate.
    Linear16,
}

impl Coding {
    /// The rate a stream said to be at `rate` is at (G.711: 8 kHz, whatever it said).
    pub fn rate(&self, rate: u32) -> u32 {
        match self {
            Coding::G711(_) => PHONE_RATE,
            Coding::Linear16 => rate,
        }
    }

    /// Bytes of one sample.
    pub fn bytes_per_sample(&self) -> usize {
        match self {
            Coding::G711(_) => 1,
            Coding::Linear16 => 2,
        }
    }
}

/// Telephone audio in: G.711 bytes at 8 kHz (or linear PCM at its rate) → 16-bit
/// little-endian PCM at 24 kHz, a stream.
pub struct PhoneIn {
    coding: Coding,
    up: Option<StreamResampler>,
}

impl PhoneIn {
    /// A decoder of `law` at 8 kHz, its resampler primed for 20 ms pieces.
    ///
    /// # Errors
    ///
    /// The resampler's, when it cannot be made.
    pub fn new(law: Law) -> Result<Self, AudioError> {
        Self::coded(Coding::G711(law), PHONE_RATE)
    }

    /// A decoder of `coding` at `rate` (G.711 is 8 kHz whatever `rate` says).
    ///
    /// # Errors
    ///
    /// The resampler's, when it cannot be made.
    pub fn coded(coding: Coding, rate: u32) -> Result<Self, AudioError> {
        let rate = coding.rate(rate);
        let up = (rate != MODEL_RATE)
            .then(|| StreamResampler::new(rate, MODEL_RATE, (rate / 50) as usize))
            .transpose()?;
        Ok(PhoneIn { coding, up })
    }

    /// The PCM16 bytes of the next bytes of the stream.
    ///
    /// # Errors
    ///
    /// The resampler's.
    pub fn pcm16(&mut self, bytes: &[u8]) -> Result<Vec<u8>, AudioError> {
        let pcm: Vec<f32> = match self.coding {
            Coding::G711(law) => bytes
                .iter()
                .map(|b| g711::decode(law, *b) as f32 / 32768.0)
                .collect(),
            Coding::Linear16 => from_pcm16(bytes).collect(),
        };
        let Some(up) = self.up.as_mut() else {
            return Ok(to_pcm16(&pcm));
        };
        let mut out = Vec::with_capacity(pcm.len() * 3 + 512);
        up.process(&pcm, &mut out)?;
        Ok(to_pcm16(&out))
    }
}

/// Telephone audio out: the agent's 24 kHz samples → G.711 bytes at 8 kHz, a stream. Clipped
/// first, as the PCM16 stream is, so both carry the same signal.
pub struct PhoneOut {
    coding: Coding,
    down: Option<StreamResampler>,
}

impl PhoneOut {
    /// An encoder of `law`, its resampler primed for 80 ms frames.
    ///
    /// # Errors
    ///
    /// The resampler's, when it cannot be made.
    pub fn new(law: Law) -> Result<Self, AudioError> {
        Self::coded(Coding::G711(law), PHONE_RATE)
    }

    /// An encoder of `coding` at `rate` (G.711 is 8 kHz whatever `rate` says).
    ///
    /// # Errors
    ///
    /// The resampler's, when it cannot be made.
    pub fn coded(coding: Coding, rate: u32) -> Result<Self, AudioError> {
        let rate = coding.rate(rate);
        let down = (rate != MODEL_RATE)
            .then(|| StreamResampler::new(MODEL_RATE, rate, 1920))
            .transpose()?;
        Ok(PhoneOut { coding, down })
    }

    /// The bytes of the next samples (none while the resampler fills).
    pub fn encode(&mut self, samples: &[f32]) -> Vec<u8> {
        let clipped: Vec<f32> = samples.iter().map(|s| s.clamp(-1.0, 1.0)).collect();
        let down = match self.down.as_mut() {
            Some(d) => {
                let mut down = Vec::with_capacity(samples.len() + 1024);
                if d.process(&clipped, &mut down).is_err() {
                    return Vec::new();
                }
                down
            }
            None => clipped,
        };
        match self.coding {
            Coding::G711(law) => down
                .iter()
                .map(|s| g711::encode(law, (s * 32768.0).round().clamp(-32768.0, 32767.0) as i16))
                .collect(),
            Coding::Linear16 => to_pcm16(&down),
        }
    }
}

/// 16-bit little-endian PCM as samples in [-1, 1) (an odd last byte is left out).
pub fn from_pcm16(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(2)
        .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 32768.0)
}

/// Samples as 16-bit little-endian PCM, clipped.
pub fn to_pcm16(samples: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(samples.len() * 2);
    for s in samples {
        let v = (s * 32768.0).round().clamp(-32768.0, 32767.0) as i16;
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}
