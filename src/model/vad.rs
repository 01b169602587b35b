//! Voice activity on a conversation's incoming audio: Silero VAD's ONNX model (v5 and later:
//! inputs `input`, `state`, `sr`; outputs `output`, `stateN`) on the ONNX Runtime the process
//! already loaded, and the hysteresis that turns its per-chunk speech probabilities into the
//! start and the end of each stretch of speech.
//!
//! [`Vad`] is the model, opened once per process and shared: a few ONNX Runtime sessions used
//! in turn (one small call per 32 ms of audio). [`VadStream`] is one
//! conversation's detector: its recurrent state, a 24 → 16 kHz resampler, and where it stands.
//! Knows nothing of the protocols that report what it finds.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ort::session::Session;
use ort::value::Tensor;

use super::error::ModelError;
use super::session::{io_names, open, SessionOptions};
use crate::audio::resample::StreamResampler;

/// The rate the model hears (it also takes 8 kHz; 16 kHz is the better one).
const RATE: u32 = 16_000;
/// Samples per call at 16 kHz (32 ms), and the previous call's tail the model sees before them.
const CHUNK: usize = 512;
const CONTEXT: usize = 64;
/// Sessions kept for the conversations to take in turn.
const POOL: usize = 4;

/// How speech is told from silence: OpenAI's `server_vad` settings, with its defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VadSettings {
    /// The speech probability at which speech starts (0..1); it stops below this less 0.15.
    pub threshold: f32,
    /// Audio before the detected start that counts as the speech's (`audio_start_ms` is that
    /// much earlier).
    pub prefix_padding_ms: u32,
    /// Silence that ends the speech.
    pub silence_duration_ms: u32,
}

impl Default for VadSettings {
    fn default() -> Self {
        VadSettings {
            threshold: 0.5,
            prefix_padding_ms: 300,
            silence_duration_ms: 500,
        }
    }
}

/// What the detector found, in milliseconds of the conversation's audio.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VadEvent {
    /// Speech began (at `ms`, the prefix padding included).
    Started {
        /// Milliseconds of audio before it.
        ms: u64,
    },
    /// Speech ended (at `ms`, the silence that ended it included).
    Stopped {
        /// Milliseconds of audio before it.
        ms: u64,
    },
}

/// Silero VAD, opened once and shared by every conversation.
pub struct Vad {
    path: PathBuf,
    sessions: Vec<Mutex<Session>>,
}

impl std::fmt::Debug for Vad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vad").field("path", &self.path).finish()
    }
}

impl Vad {
    /// Opens the model at `path` on the CPU, checking that it is Silero VAD's.
    ///
    /// # Errors
    ///
    /// The file cannot be loaded as a graph, or its inputs and outputs are not Silero VAD's
    /// (v5 or later); ONNX Runtime is not loaded.
    pub fn open(path: &Path) -> Result<Vad, ModelError> {
        let opts = SessionOptions::default();
        let first = open(path, "voice activity detector", &opts)?.session;
        let (inputs, outputs) = io_names(&first);
        for (kind, have, want) in [
            ("input", &inputs, &["input", "state", "sr"][..]),
            ("output", &outputs, &["output", "stateN"][..]),
        ] {
            if let Some(m) = want.iter().find(|w| !have.iter().any(|h| h == *w)) {
                return Err(ModelError::contract(
                    &format!("voice activity detector ({})", path.display()),
                    format!(
                        "no {kind} `{m}` (it has {}): not Silero VAD v5 or later",
                        have.join(", ")
                    ),
                ));
            }
        }
        // The same graph: the others need no check.
        let mut sessions = vec![Mutex::new(first)];
        for _ in 1..POOL {
            let s = open(path, "voice activity detector", &opts)?.session;
            sessions.push(Mutex::new(s));
        }
        let vad = Vad {
            path: path.to_path_buf(),
            sessions,
        };
        // One call on silence: a graph that loads but cannot run says so now, not mid-call.
        let mut state = vec![0.0; 2 * 128];
        vad.probability(&[0.0; CONTEXT + CHUNK], &mut state, 0)?;
        Ok(vad)
    }

    /// The probability of speech in each 32 ms chunk of `samples` (16 kHz, one stream from its
    /// start), as Silero's own offline loop computes them: a fresh state, each chunk after the
    /// 64 samples before it (zeros before the first), the last chunk padded with zeros.
    ///
    /// # Errors
    ///
    /// ONNX Runtime errors.
    pub fn probabilities(&self, samples: &[f32]) -> Result<Vec<f32>, ModelError> {
        let mut state = vec![0.0; 2 * 128];
        let mut window = vec![0.0f32; CONTEXT + CHUNK];
        let mut probs = Vec::with_capacity(samples.len().div_ceil(CHUNK));
        for chunk in samples.chunks(CHUNK) {
            window.copy_within(CHUNK.., 0);
            window[CONTEXT..].fill(0.0);
            window[CONTEXT..CONTEXT + chunk.len()].copy_from_slice(chunk);
            probs.push(self.probability(&window, &mut state, 0)?);
        }
        Ok(probs)
    }

    /// The probability of speech in `window` (the context, then a chunk), updating `state`;
    /// `turn` picks the session tried first.
    fn probability(
        &self,
        window: &[f32],
        state: &mut Vec<f32>,
        turn: usize,
    ) -> Result<f32, ModelError> {
        let graph = "voice activity detector";
        let e = |e: ort::Error| ModelError::ort(graph, e);
        let n = self.sessions.len();
        // The first free session from this conversation's turn on, else wait for its own.
        let free = (0..n).find_map(|i| self.sessions[(turn + i) % n].try_lock().ok());
        let mut guard = match free {
            Some(g) => g,
            None => self.sessions[turn % n]
                .lock()
                .map_err(|_| ModelError::ort(graph, "a session was poisoned"))?,
        };
        let input = Tensor::from_array(([1usize, window.len()], window.to_vec())).map_err(e)?;
        let st = Tensor::from_array(([2usize, 1, 128], std::mem::take(state))).map_err(e)?;
        let sr = Tensor::from_array(((), vec![RATE as i64])).map_err(e)?;
        let out = guard
            .run(ort::inputs!["input" => input, "state" => st, "sr" => sr])
            .map_err(e)?;
        let (_, p) = out["output"].try_extract_tensor::<f32>().map_err(e)?;
        let (_, s) = out["stateN"].try_extract_tensor::<f32>().map_err(e)?;
        if s.len() != 2 * 128 || p.is_empty() {
            return Err(ModelError::contract(
                graph,
                format!(
                    "outputs of {} and {} values, expected 1 and 256",
                    p.len(),
                    s.len()
                ),
            ));
        }
        *state = s.to_vec();
        Ok(p[0])
    }
}

/// One conversation's detector. See the module doc.
pub struct VadStream {
    settings: VadSettings,
    resampler: StreamResampler,
    /// 16 kHz samples waiting for a whole chunk, after the context.
    window: Vec<f32>,
    resampled: Vec<f32>,
    state: Vec<f32>,
    /// 16 kHz samples judged so far.
    judged: u64,
    speaking: bool,
    /// Where the silence that may end the speech began (16 kHz samples).
    quiet_since: Option<u64>,
    turn: usize,
}

impl VadStream {
    /// A detector for audio at `rate` Hz with `settings`; `turn` spreads conversations over the
    /// model's sessions (any number, e.g. the session's id).
    ///
    /// # Errors
    ///
    /// The resampler cannot be made for `rate`.
    pub fn new(
        rate: u32,
        settings: VadSettings,
        turn: usize,
    ) -> Result<Self, crate::audio::AudioError> {
        let mut window = Vec::with_capacity(CONTEXT + CHUNK);
        window.resize(CONTEXT, 0.0);
        Ok(VadStream {
            settings,
            resampler: StreamResampler::new(rate, RATE, (rate / 50) as usize)?,
            window,
            resampled: Vec::new(),
            state: vec![0.0; 2 * 128],
            judged: 0,
            speaking: false,
            quiet_since: None,
            turn,
        })
    }

    /// New settings, from the next chunk on.
    pub fn set(&mut self, settings: VadSettings) {
        self.settings = settings;
    }

    /// Whether speech is under way.
    #[cfg(test)]
    fn speaking(&self) -> bool {
        self.speaking
    }

    /// Hears `samples` (in [-1, 1], at the stream's rate); returns what began or ended in them.
    ///
    /// # Errors
    ///
    /// The model failed to run (the caller may go on without it).
    pub fn push(&mut self, vad: &Vad, samples: &[f32]) -> Result<Vec<VadEvent>, ModelError> {
        self.resampled.clear();
        self.resampler
            .process(samples, &mut self.resampled)
            .map_err(|e| ModelError::ort("voice activity detector", e))?;
        let mut events = Vec::new();
        let mut at = 0;
        while at < self.resampled.len() {
            let take = (CONTEXT + CHUNK - self.window.len()).min(self.resampled.len() - at);
            self.window
                .extend_from_slice(&self.resampled[at..at + take]);
            at += take;
            if self.window.len() < CONTEXT + CHUNK {
                break;
            }
            let p = vad.probability(&self.window, &mut self.state, self.turn)?;
            self.window.drain(..CHUNK);
            let start = self.judged;
            self.judged += CHUNK as u64;
            events.extend(self.judge(p, start));
        }
        Ok(events)
    }

    fn ms(samples: u64) -> u64 {
        samples * 1000 / RATE as u64
    }

    /// The hysteresis: speech starts at a chunk at or over the threshold, and ends after
    /// `silence_duration_ms` of chunks under it less 0.15.
    fn judge(&mut self, p: f32, start: u64) -> Option<VadEvent> {
        let s = self.settings;
        if p >= s.threshold {
            self.quiet_since = None;
            if !self.speaking {
                self.speaking = true;
                let ms = Self::ms(start).saturating_sub(s.prefix_padding_ms as u64);
                return Some(VadEvent::Started { ms });
            }
            return None;
        }
        if !self.speaking || p >= (s.threshold - 0.15).max(0.01) {
            return None;
        }
        let since = *self.quiet_since.get_or_insert(start);
        let end = start + CHUNK as u64;
        if Self::ms(end - since) >= s.silence_duration_ms as u64 {
            self.speaking = false;
            self.quiet_since = None;
            return Some(VadEvent::Stopped { ms: Self::ms(end) });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream() -> VadStream {
        VadStream::new(24_000, VadSettings::default(), 0).unwrap()
    }

    #[test]
    fn speech_starts_over_the_threshold_and_ends_after_the_silence() {
        let mut s = stream();
        let chunk = CHUNK as u64;
        // 32 ms chunks: quiet, then speech from chunk 20 (640 ms), quiet from chunk 40.
        let mut events = Vec::new();
        for i in 0..80u64 {
            let p = if (20..40).contains(&i) { 0.9 } else { 0.05 };
            events.extend(s.judge(p, i * chunk));
        }
        assert_eq!(
            events,
            [
                VadEvent::Started { ms: 640 - 300 },
                // Silence from 1280 ms; 500 ms of it end the speech at the chunk that reaches it.
                VadEvent::Stopped { ms: 1280 + 512 }
            ]
        );
    }

    #[test]
    fn a_dip_shorter_than_the_silence_or_between_the_thresholds_does_not_end_speech() {
        let mut s = stream();
        let chunk = CHUNK as u64;
        let mut events = Vec::new();
        for i in 0..60u64 {
            let p = match i {
                0..=9 => 0.9,
                10..=14 => 0.1, // 160 ms under: too short
                15..=19 => 0.9,
                20..=49 => 0.4, // under the threshold, over it less 0.15: still speech
                _ => 0.9,
            };
            events.extend(s.judge(p, i * chunk));
        }
        assert_eq!(events, [VadEvent::Started { ms: 0 }]);
        assert!(s.speaking());
    }
}
