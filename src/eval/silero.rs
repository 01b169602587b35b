//! Speech segments from Silero VAD's per-chunk probabilities, by the rules of its offline
//! `get_speech_timestamps` at the settings the field's benchmarks call it with (threshold 0.5,
//! speech of at least 250 ms, silences of 100 ms end it, 30 ms of padding each side, no
//! maximum length, 16 kHz, chunks of 512 samples): what Full-Duplex-Bench's metrics receive.
//! The probabilities come from [`Vad::probabilities`](crate::model::vad::Vad::probabilities).
//!
//! Pure functions; knows nothing of files or of ONNX Runtime.

/// Samples per chunk at 16 kHz.
const CHUNK: usize = 512;
/// The rate the rules count in.
const RATE: usize = 16_000;
const THRESHOLD: f32 = 0.5;
/// Speech ends below this (the threshold less 0.15).
const NEG_THRESHOLD: f32 = 0.35;
const MIN_SPEECH: usize = RATE * 250 / 1000;
const MIN_SILENCE: usize = RATE * 100 / 1000;
const PAD: usize = RATE * 30 / 1000;

/// The speech segments `[start, end)` in samples of a stream of `len` samples whose chunks had
/// speech probabilities `probs`.
pub fn segments(probs: &[f32], len: usize) -> Vec<(usize, usize)> {
    let mut found: Vec<(usize, usize)> = Vec::new();
    let mut start: Option<usize> = None;
    // Where the silence that may end the speech began (0: none, as Silero counts it).
    let mut quiet_from = 0usize;
    for (i, &p) in probs.iter().enumerate() {
        let at = CHUNK * i;
        if p >= THRESHOLD && quiet_from != 0 {
            quiet_from = 0;
        }
        let Some(s) = start else {
            if p >= THRESHOLD {
                start = Some(at);
            }
            continue;
        };
        if p < NEG_THRESHOLD {
            if quiet_from == 0 {
                quiet_from = at;
            }
            if at - quiet_from < MIN_SILENCE {
                continue;
            }
            if quiet_from - s > MIN_SPEECH {
                found.push((s, quiet_from));
            }
            start = None;
            quiet_from = 0;
        }
    }
    if let Some(s) = start {
        if len.saturating_sub(s) > MIN_SPEECH {
            found.push((s, len));
        }
    }
    // Padding: each side by 30 ms, or half the silence between two segments closer than 60 ms.
    let n = found.len();
    for i in 0..n {
        if i == 0 {
            found[0].0 = found[0].0.saturating_sub(PAD);
        }
        if i + 1 < n {
            let silence = found[i + 1].0 as i64 - found[i].1 as i64;
            if silence < 2 * PAD as i64 {
                let half = silence.div_euclid(2);
                found[i].1 = (found[i].1 as i64 + half) as usize;
                found[i + 1].0 = (found[i + 1].0 as i64 - half).max(0) as usize;
            } else {
                found[i].1 = (found[i].1 + PAD).min(len);
                found[i + 1].0 = found[i + 1].0.saturating_sub(PAD);
            }
        } else {
            found[i].1 = (found[i].1 + PAD).min(len);
        }
    }
    found
}

/// Segments in seconds as v1.5's timing reads them: samples over 16000, unrounded.
pub fn seconds(segments: &[(usize, usize)]) -> Vec<(f64, f64)> {
    segments
        .iter()
        .map(|&(s, e)| (s as f64 / RATE as f64, e as f64 / RATE as f64))
        .collect()
}

/// Segments in seconds as Silero returns them with `return_seconds` (what v1's backchannel
/// metric reads): rounded to 0.1 s, the end at most the stream's length.
pub fn rounded_seconds(segments: &[(usize, usize)], len: usize) -> Vec<(f64, f64)> {
    let total = len as f64 / RATE as f64;
    segments
        .iter()
        .map(|&(s, e)| {
            (
                super::fdb::round1(s as f64 / RATE as f64).max(0.0),
                super::fdb::round1(e as f64 / RATE as f64).min(total),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Probabilities for chunks: `speech` chunks at 0.9 between `lead` and `tail` silent ones.
    fn probs(lead: usize, speech: usize, tail: usize) -> Vec<f32> {
        let mut v = vec![0.0; lead];
        v.extend(vec![0.9; speech]);
        v.extend(vec![0.0; tail]);
        v
    }

    #[test]
    fn a_stretch_of_speech_is_padded_each_side() {
        // Speech in chunks 10..30 (5120..15360), silence after: it ends where the silence began,
        // once 100 ms of it have passed.
        let p = probs(10, 20, 20);
        assert_eq!(segments(&p, p.len() * CHUNK), [(5120 - 480, 15360 + 480)]);
    }

    #[test]
    fn speech_shorter_than_250_ms_is_dropped_and_a_short_silence_does_not_end_it() {
        // 7 chunks: 3584 samples, under 4000.
        let p = probs(10, 7, 20);
        assert!(segments(&p, p.len() * CHUNK).is_empty());
        // A silence of 3 chunks (1536 samples, under 1600) inside the speech.
        let mut p = probs(10, 10, 3);
        p.extend(probs(0, 10, 20));
        assert_eq!(
            segments(&p, p.len() * CHUNK),
            [(5120 - 480, 33 * 512 + 480)]
        );
    }

    #[test]
    fn probabilities_between_the_thresholds_keep_the_state() {
        // 0.4 neither starts speech nor ends it.
        let mut p = vec![0.4; 10];
        p.extend(vec![0.9; 10]);
        p.extend(vec![0.4; 10]);
        p.extend(vec![0.0; 10]);
        assert_eq!(
            segments(&p, p.len() * CHUNK),
            [(5120 - 480, 30 * 512 + 480)]
        );
    }

    #[test]
    fn a_silence_under_100_ms_between_chunk_starts_joins_two_stretches() {
        // Four silent chunks: the silence is judged at chunk starts, 1536 samples at most (under
        // 1600), so the stretches are one, running to the end of the stream.
        let mut p = probs(2, 10, 4);
        p.extend(probs(0, 10, 0));
        let len = p.len() * CHUNK + 100;
        assert_eq!(segments(&p, len), [(1024 - 480, len)]);
    }

    #[test]
    fn separate_segments_are_padded_and_the_last_runs_to_the_end() {
        // Five silent chunks end the first (6144); the second runs to the end of the stream.
        let mut p = probs(2, 10, 5);
        p.extend(probs(0, 10, 0));
        let len = p.len() * CHUNK + 100;
        let s = segments(&p, len);
        assert_eq!(s, [(1024 - 480, 6144 + 480), (17 * 512 - 480, len)]);
        // As Silero returns seconds: rounded to 0.1 s, the end no later than the stream's.
        assert_eq!(
            rounded_seconds(&s, len),
            [(0.0, 0.4), (0.5, len as f64 / 16000.0)]
        );
        assert_eq!(seconds(&s)[0], (544.0 / 16000.0, 6624.0 / 16000.0));
    }
}
