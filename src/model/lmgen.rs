//! The LM's token bookkeeping: a ring of delayed token columns, what is forced, what the model
//! sees at each step and which tokens come out. Pure code, no ONNX Runtime.
//!
//! This follows the PersonaPlex convention exactly (see `MOSHI.md`, "One step"): channel 0 is
//! text, channels 1..=8 the agent's audio codebooks, 9..=16 the user's. Each channel `k` is
//! delayed by `delays[k]` steps. A ring of `max_delay + 3` columns holds tokens, `-2` marks a
//! token not generated yet, and a parallel mask marks tokens that were provided (forced) rather
//! than sampled.
//!
//! One step is split in two so that the model calls stay outside:
//!
//! 1. [`LmGen::begin`] writes the forced tokens and returns the model input column and the target
//!    column with its provided flags, or `None` on the very first step (whose input is never
//!    seen);
//! 2. the caller runs the temporal transformer and the depformer, taking provided targets where
//!    they exist (teacher forcing) and sampling the rest;
//! 3. [`LmGen::commit`] stores the sampled tokens and returns the agent frame that is now
//!    complete, once the delays are filled: N user frames give N − 2 agent frames.

use std::fmt;

/// Channel 0: text.
pub const TEXT: usize = 0;
/// Marks a token that has not been generated yet.
pub const UNGENERATED: i64 = -2;

/// The fixed shape of the token streams of a pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamLayout {
    /// Delay of each channel, in steps (`channels()` entries).
    pub delays: Vec<usize>,
    /// Initial token of each channel (text: the text card; audio: the audio card).
    pub initial: Vec<i64>,
    /// Audio codebooks per speaker (8): channels `1..=n` are the agent, `n+1..=2n` the user.
    pub codebooks: usize,
}

impl StreamLayout {
    /// PersonaPlex: 17 channels, delays `[0, 0,1,1,1,1,1,1,1, 0,1,1,1,1,1,1,1]`, initial tokens
    /// 32000 (text) and 2048 (audio).
    pub fn personaplex() -> Self {
        let mut delays = vec![0, 0];
        delays.extend([1; 7]);
        delays.push(0);
        delays.extend([1; 7]);
        let mut initial = vec![32_000];
        initial.extend([2048; 16]);
        StreamLayout {
            delays,
            initial,
            codebooks: 8,
        }
    }

    /// Number of channels (1 + 2 × codebooks).
    pub fn channels(&self) -> usize {
        self.delays.len()
    }

    /// Largest delay.
    pub fn max_delay(&self) -> usize {
        self.delays.iter().copied().max().unwrap_or(0)
    }
}

/// What one step feeds the model, and what it may teacher-force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepIo {
    /// The column the temporal transformer sees (`channels()` tokens).
    pub input: Vec<i64>,
    /// The column being generated: provided tokens where `provided[k]`, else [`UNGENERATED`].
    pub target: Vec<i64>,
    /// Which target tokens are provided (teacher forcing).
    pub provided: Vec<bool>,
}

/// The agent's tokens for one frame, once all their delays have passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentFrame {
    /// Text token of the frame.
    pub text: i64,
    /// The agent's audio codes (`codebooks` of them).
    pub audio: Vec<i64>,
}

/// A mistake in the tokens given to a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LmGenError(pub String);

impl fmt::Display for LmGenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LmGenError {}

/// The ring of delayed tokens of one conversation.
#[derive(Debug, Clone)]
pub struct LmGen {
    layout: StreamLayout,
    ct: usize,
    /// `channels × ct`, channel-major.
    ring: Vec<i64>,
    provided: Vec<bool>,
    offset: usize,
}

impl LmGen {
    /// A fresh state.
    pub fn new(layout: StreamLayout) -> Self {
        let ct = layout.max_delay() + 3;
        let n = layout.channels() * ct;
        LmGen {
            layout,
            ct,
            ring: vec![UNGENERATED; n],
            provided: vec![false; n],
            offset: 0,
        }
    }

    /// The layout.
    pub fn layout(&self) -> &StreamLayout {
        &self.layout
    }

    /// Forgets the conversation.
    pub fn reset(&mut self) {
        self.ring.fill(UNGENERATED);
        self.provided.fill(false);
        self.offset = 0;
    }

    /// Steps taken so far (0 before the first).
    pub fn offset(&self) -> usize {
        self.offset
    }

    fn at(&self, k: usize, col: usize) -> usize {
        k * self.ct + col % self.ct
    }

    fn force(&mut self, k: usize, tok: i64) {
        let i = self.at(k, self.offset + self.layout.delays[k]);
        self.ring[i] = tok;
        self.provided[i] = true;
    }

    /// Starts a step: forces the user's codes (and, while priming, a text token and the agent's
    /// codes), seeds the initial tokens, and returns what the model should see. Returns `None`
    /// for the very first step, which only initialises the ring.
    ///
    /// # Errors
    ///
    /// When `user` or `agent` does not hold `codebooks` codes.
    pub fn begin(
        &mut self,
        user: &[i64],
        text: Option<i64>,
        agent: Option<&[i64]>,
    ) -> Result<Option<StepIo>, LmGenError> {
        let n = self.layout.codebooks;
        if user.len() != n {
            return Err(LmGenError(format!(
                "user frame has {} codes, expected {n}",
                user.len()
            )));
        }
        if let Some(a) = agent {
            if a.len() != n {
                return Err(LmGenError(format!(
                    "forced agent frame has {} codes, expected {n}",
                    a.len()
                )));
            }
        }
        // 1. forced tokens
        for (q, &c) in user.iter().enumerate() {
            self.force(1 + n + q, c);
        }
        if let Some(t) = text {
            self.force(TEXT, t);
        }
        if let Some(a) = agent {
            for (q, &c) in a.iter().enumerate() {
                self.force(1 + q, c);
            }
        }
        // 2. initial tokens of channels whose delay has not passed yet
        for k in 0..self.layout.channels() {
            if self.offset <= self.layout.delays[k] {
                let i = self.at(k, self.offset);
                self.ring[i] = self.layout.initial[k];
                self.provided[i] = true;
            }
        }
        // 3. the first step only fills column 0 with initial tokens
        if self.offset == 0 {
            for k in 0..self.layout.channels() {
                let i = self.at(k, 0);
                self.ring[i] = self.layout.initial[k];
            }
            self.offset += 1;
            return Ok(None);
        }
        // 4. input = previous column, target = current column
        let (inp, tgt) = (self.offset - 1, self.offset);
        let c = self.layout.channels();
        let mut io = StepIo {
            input: Vec::with_capacity(c),
            target: Vec::with_capacity(c),
            provided: Vec::with_capacity(c),
        };
        for k in 0..c {
            io.input.push(self.ring[self.at(k, inp)]);
            let t = self.at(k, tgt);
            io.target.push(self.ring[t]);
            io.provided.push(self.provided[t]);
        }
        Ok(Some(io))
    }

    /// Ends a step started by a `begin` that returned `Some`: stores `text` and `audio` (one
    /// token per audio channel, `2 × codebooks` of them) where nothing was provided, and returns
    /// the agent frame completed by this step, if any.
    ///
    /// # Errors
    ///
    /// When `audio` has the wrong length.
    pub fn commit(&mut self, text: i64, audio: &[i64]) -> Result<Option<AgentFrame>, LmGenError> {
        let c = self.layout.channels();
        if audio.len() != c - 1 {
            return Err(LmGenError(format!(
                "{} audio tokens, expected {}",
                audio.len(),
                c - 1
            )));
        }
        let (inp, tgt) = (self.offset - 1, self.offset);
        // 8. the input column is consumed; fill what was not provided in the target column
        for k in 0..c {
            let i = self.at(k, inp);
            self.provided[i] = false;
        }
        for k in 0..c {
            let t = self.at(k, tgt);
            if !self.provided[t] {
                self.ring[t] = if k == TEXT { text } else { audio[k - 1] };
            }
        }
        // 9. delayed output
        let max_delay = self.layout.max_delay();
        if self.offset <= max_delay {
            self.offset += 1;
            return Ok(None);
        }
        let col = |k: usize| self.ring[self.at(k, self.offset - max_delay + self.layout.delays[k])];
        let frame = AgentFrame {
            text: col(TEXT),
            audio: (1..=self.layout.codebooks).map(col).collect(),
        };
        self.offset += 1;
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(t: i64) -> Vec<i64> {
        (0..8).map(|q| 100 * t + q).collect()
    }

    /// Plays `n` steps where the "model" samples `1000 * step + k` on channel k.
    fn run(n: usize) -> (Vec<Option<StepIo>>, Vec<AgentFrame>) {
        let mut g = LmGen::new(StreamLayout::personaplex());
        let mut ios = Vec::new();
        let mut out = Vec::new();
        for t in 0..n {
            let io = g.begin(&user(t as i64), None, None).unwrap();
            if let Some(io) = &io {
                let step = g.offset() as i64;
                let text = if io.provided[0] {
                    io.target[0]
                } else {
                    1000 * step
                };
                let audio: Vec<i64> = (1..17).map(|k| 1000 * step + k as i64).collect();
                if let Some(f) = g.commit(text, &audio).unwrap() {
                    out.push(f);
                }
            }
            ios.push(io);
        }
        (ios, out)
    }

    #[test]
    fn n_user_frames_give_n_minus_2_agent_frames() {
        for n in [1, 2, 3, 10] {
            assert_eq!(run(n).1.len(), n.saturating_sub(2), "n = {n}");
        }
    }

    #[test]
    fn first_input_is_all_initial_tokens_and_user_codes_arrive_delayed() {
        let (ios, _) = run(4);
        assert!(ios[0].is_none());
        let io1 = ios[1].as_ref().unwrap();
        // Step 1 sees column 0: every channel's initial token.
        let mut want = vec![32_000];
        want.extend([2048; 16]);
        assert_eq!(io1.input, want);
        // Its target: channel 9 (delay 0) holds user frame 1's first code; the delay-1 channels
        // of both speakers still hold their initial token (provided): the first user frame is
        // never seen. Text and the agent's semantic code are to be generated.
        assert_eq!(io1.target[9], 100);
        assert!(io1.provided[9]);
        for k in (2..=8).chain(10..=16) {
            assert_eq!(
                (io1.target[k], io1.provided[k]),
                (2048, true),
                "channel {k}"
            );
        }
        assert!(!io1.provided[0] && !io1.provided[1]);
        // Step 2 sees step 1's sampled text and agent semantic token, and user frame 1.
        let io2 = ios[2].as_ref().unwrap();
        assert_eq!(io2.input[0], 1000);
        assert_eq!(io2.input[1], 1001);
        assert_eq!(io2.input[9], 100);
        assert_eq!(io2.input[10], 2048);
        // ... and targets user frame 1's delayed codes.
        assert_eq!(io2.target[10], 101);
        let io3 = ios[3].as_ref().unwrap();
        assert_eq!(io3.input[10], 101);
    }

    #[test]
    fn outputs_realign_the_delayed_channels() {
        let (_, out) = run(6);
        // Agent frame i: text and semantic code sampled at step i+1, the acoustic codes (delay
        // 1) sampled one step later.
        for (i, f) in out.iter().enumerate() {
            let s = i as i64 + 1;
            assert_eq!(f.text, 1000 * s);
            assert_eq!(f.audio[0], 1000 * s + 1);
            for q in 1..8 {
                assert_eq!(f.audio[q], 1000 * (s + 1) + 1 + q as i64, "frame {i} q {q}");
            }
        }
    }

    #[test]
    fn forced_text_and_agent_codes_are_teacher_forced() {
        let mut g = LmGen::new(StreamLayout::personaplex());
        let agent: Vec<i64> = (0..8).map(|q| 500 + q).collect();
        assert!(g.begin(&user(0), Some(3), Some(&agent)).unwrap().is_none());
        let io = g.begin(&user(1), Some(7), Some(&agent)).unwrap().unwrap();
        assert!(io.provided[0] && io.target[0] == 7);
        assert!(io.provided[1] && io.target[1] == 500);
        // The model's own choices are ignored where tokens are provided.
        let f = g.commit(9999, &[9999; 16]).unwrap();
        assert!(f.is_none());
        let io = g.begin(&user(2), Some(8), Some(&agent)).unwrap().unwrap();
        assert_eq!(io.input[0], 7);
        assert_eq!(io.input[1], 500);
        // The acoustic codes forced at step 1 were replaced by initial tokens (delay 1).
        assert_eq!(io.input[2], 2048);
        let f = g.commit(9999, &[9999; 16]).unwrap().unwrap();
        assert_eq!(f.text, 7);
        assert_eq!(f.audio, agent);
        let io = g.begin(&user(3), None, None).unwrap().unwrap();
        assert_eq!(io.input[2], 501);
    }

    #[test]
    fn reset_starts_over_and_bad_lengths_are_errors() {
        let mut g = LmGen::new(StreamLayout::personaplex());
        for t in 0..5 {
            if g.begin(&user(t), None, None).unwrap().is_some() {
                g.commit(1, &[2; 16]).unwrap();
            }
        }
        g.reset();
        assert_eq!(g.offset(), 0);
        assert!(g.begin(&user(0), None, None).unwrap().is_none());
        assert!(g.begin(&[1, 2], None, None).is_err());
        let io = g.begin(&user(1), None, None).unwrap();
        assert!(io.is_some());
        assert!(g.commit(1, &[2; 3]).is_err());
    }
}
