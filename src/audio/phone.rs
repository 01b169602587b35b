//! Telephone audio as a stream: G.711 bytes at 8 kHz (μ-law or A-law) ↔ the model's 24 kHz
//! audio, through [`g711`](super::g711)'s tables and a streaming resampler each way; and 24 kHz
//! samples as 16-bit little-endian PCM. For the transports that carry either (the realtime
//! API, Twilio, a SIP gateway). Knows nothing of protocols or sockets.

use super::g711::{self, Law};
use super::{AudioError, StreamResampler, MODEL_RATE};

/// G.711's sample rate.
pub const PHONE_RATE: u32 = 8_000;

/// Telephone audio in: G.711 bytes at 8 kHz → 16-bit little-endian PCM at 24 kHz, a stream.
pub struct PhoneIn {
    law: Law,
    up: StreamResampler,
}

impl PhoneIn {
    /// A decoder of `law`, its resampler primed for 20 ms pieces.
    ///
    /// # Errors
    ///
    /// The resampler's, when it cannot be made.
    pub fn new(law: Law) -> Result<Self, AudioError> {
        let up = StreamResampler::new(PHONE_RATE, MODEL_RATE, 160)?;
        Ok(PhoneIn { law, up })
    }

    /// The PCM16 bytes of the next G.711 bytes of the stream.
    ///
    /// # Errors
    ///
    /// The resampler's.
    pub fn pcm16(&mut self, bytes: &[u8]) -> Result<Vec<u8>, AudioError> {
        let pcm: Vec<f32> = bytes
            .iter()
            .map(|b| g711::decode(self.law, *b) as f32 / 32768.0)
            .collect();
        let mut up = Vec::with_capacity(pcm.len() * 3 + 512);
        self.up.process(&pcm, &mut up)?;
        Ok(to_pcm16(&up))
    }
}

/// Telephone audio out: the agent's 24 kHz samples → G.711 bytes at 8 kHz, a stream. Clipped
/// first, as the PCM16 stream is, so both carry the same signal.
pub struct PhoneOut {
    law: Law,
    down: StreamResampler,
}

impl PhoneOut {
    /// An encoder of `law`, its resampler primed for 80 ms frames.
    ///
    /// # Errors
    ///
    /// The resampler's, when it cannot be made.
    pub fn new(law: Law) -> Result<Self, AudioError> {
        let down = StreamResampler::new(MODEL_RATE, PHONE_RATE, 1920)?;
        Ok(PhoneOut { law, down })
    }

    /// The G.711 bytes of the next samples (none while the resampler fills).
    pub fn encode(&mut self, samples: &[f32]) -> Vec<u8> {
        let clipped: Vec<f32> = samples.iter().map(|s| s.clamp(-1.0, 1.0)).collect();
        let mut down = Vec::with_capacity(samples.len() / 3 + 1024);
        if self.down.process(&clipped, &mut down).is_err() {
            return Vec::new();
        }
        down.iter()
            .map(|s| {
                g711::encode(
                    self.law,
                    (s * 32768.0).round().clamp(-32768.0, 32767.0) as i16,
                )
            })
            .collect()
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
