//! G.711 telephone audio: μ-law and A-law, one byte per sample at 8 kHz, ↔ 16-bit linear PCM.
//!
//! Written from ITU-T G.711's segment rules: a sign bit, a 3-bit segment (the position of the
//! leading one) and a 4-bit step inside it; μ-law adds a bias of 33 (in 14-bit units) before
//! finding the segment, A-law's first two segments are linear; both invert bits on the wire
//! (μ-law all of them, A-law the even ones). Decoding is a 256-entry table built once. Knows
//! nothing of rates or streams: the callers resample.

use std::sync::OnceLock;

/// The two companding laws of G.711.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Law {
    /// μ-law (North America, Japan; Twilio's media streams).
    Mu,
    /// A-law (the rest of the world).
    A,
}

/// Encodes one 16-bit sample.
pub fn encode(law: Law, sample: i16) -> u8 {
    match law {
        Law::Mu => mu_encode(sample),
        Law::A => a_encode(sample),
    }
}

/// Decodes one byte to a 16-bit sample.
pub fn decode(law: Law, byte: u8) -> i16 {
    static MU: OnceLock<[i16; 256]> = OnceLock::new();
    static A: OnceLock<[i16; 256]> = OnceLock::new();
    let table = match law {
        Law::Mu => MU.get_or_init(|| std::array::from_fn(|b| mu_decode(b as u8))),
        Law::A => A.get_or_init(|| std::array::from_fn(|b| a_decode(b as u8))),
    };
    table[byte as usize]
}

/// The segment of a magnitude: the position of its leading one above bit `floor`, 0..=7.
fn segment(magnitude: u16, floor: u32) -> u8 {
    let top = 15 - magnitude.leading_zeros().min(15);
    top.saturating_sub(floor).min(7) as u8
}

fn mu_encode(sample: i16) -> u8 {
    const BIAS: i32 = 0x84; // 33 in 14-bit units, scaled to 16 bits
    const CLIP: i32 = 32_635;
    let s = sample as i32;
    let sign = if s < 0 { 0x80 } else { 0 };
    let magnitude = (s.abs().min(CLIP) + BIAS) as u16;
    let seg = segment(magnitude, 7);
    let step = ((magnitude >> (seg + 3)) & 0x0F) as u8;
    !(sign | (seg << 4) | step)
}

fn mu_decode(byte: u8) -> i16 {
    let b = !byte;
    let seg = (b >> 4) & 0x07;
    let step = (b & 0x0F) as i32;
    let magnitude = (((step << 3) + 0x84) << seg) - 0x84;
    if b & 0x80 != 0 {
        -magnitude as i16
    } else {
        magnitude as i16
    }
}

fn a_encode(sample: i16) -> u8 {
    let s = sample as i32;
    // A-law's sign bit is set for positive samples; negatives are one's complement.
    let (sign, magnitude) = if s >= 0 {
        (0x80u8, s as u16)
    } else {
        (0u8, (-(s + 1)) as u16)
    };
    let seg = segment(magnitude, 7);
    let step = if seg == 0 {
        ((magnitude >> 4) & 0x0F) as u8
    } else {
        ((magnitude >> (seg + 3)) & 0x0F) as u8
    };
    (sign | (seg << 4) | step) ^ 0x55
}

fn a_decode(byte: u8) -> i16 {
    let b = byte ^ 0x55;
    let seg = (b >> 4) & 0x07;
    let step = (b & 0x0F) as i32;
    let magnitude = if seg == 0 {
        (step << 4) + 8
    } else {
        ((step << 4) + 0x108) << (seg - 1)
    };
    if b & 0x80 != 0 {
        magnitude as i16
    } else {
        -magnitude as i16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_and_the_extremes_have_the_standards_codes() {
        // G.711's tables: μ-law 0 → 0xFF, A-law 0 → 0xD5; full scale → 0x80 / 0xAA.
        assert_eq!(encode(Law::Mu, 0), 0xFF);
        assert_eq!(encode(Law::A, 0), 0xD5);
        assert_eq!(encode(Law::Mu, i16::MAX), 0x80);
        assert_eq!(encode(Law::Mu, i16::MIN), 0x00);
        assert_eq!(encode(Law::A, i16::MAX), 0xAA);
        assert_eq!(encode(Law::A, i16::MIN), 0x2A);
        assert_eq!(decode(Law::Mu, 0xFF), 0);
        assert_eq!(decode(Law::Mu, 0x80), 32_124);
        assert_eq!(decode(Law::Mu, 0x00), -32_124);
        assert_eq!(decode(Law::A, 0xD5), 8);
        assert_eq!(decode(Law::A, 0xAA), 32_256);
        assert_eq!(decode(Law::A, 0x2A), -32_256);
    }

    #[test]
    fn every_code_decodes_to_a_value_that_encodes_to_it_again() {
        for law in [Law::Mu, Law::A] {
            for b in 0..=255u8 {
                let v = decode(law, b);
                let again = encode(law, v);
                // μ-law has two codes for zero (0x7F, "-0", and 0xFF).
                if law == Law::Mu && b == 0x7F {
                    assert_eq!(again, 0xFF);
                } else {
                    assert_eq!(again, b, "{law:?} {b:#04x} -> {v} -> {again:#04x}");
                }
            }
        }
    }

    #[test]
    fn the_error_is_within_a_step_of_the_segment() {
        for law in [Law::Mu, Law::A] {
            for s in (i16::MIN as i32..=i16::MAX as i32).step_by(7) {
                let s = s as i16;
                let back = decode(law, encode(law, s)) as i32;
                let err = (back - s as i32).abs();
                // A segment's step is at most a sixteenth of the values in it.
                assert!(err <= (s as i32).abs() / 16 + 16, "{law:?} {s} -> {back}");
            }
        }
    }
}
