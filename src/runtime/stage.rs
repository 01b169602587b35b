//! The contract between the runtime and a stage.
//!
//! A stage is plain single-threaded code: it receives one frame at a time in
//! [`Stage::process`], emits zero or more frames through the [`Context`], and flushes whatever it
//! buffers in [`Stage::finish`] when its inputs reach end of stream. A [`Source`] has no inputs
//! and is called in a loop until it says [`Flow::Done`]. The runtime, not the stage, moves data,
//! numbers frames, times `process` and applies back-pressure; a stage never sees a thread or a
//! channel.

use std::fmt;
use std::time::{Duration, Instant};

use super::edge::{EdgeRx, EdgeTx, Envelope, SendError, Signals};
use super::frame::{Frame, FrameData, FrameMeta, FrameType, Payload};

/// What a stage returns when it cannot go on.
///
/// Any error type converts into it with `?`. [`StageError::Stopped`] is not a failure: it is how
/// a blocked emit or feedback wait reports that the pipeline is shutting down, and stages should
/// pass it up unchanged.
pub enum StageError {
    /// The pipeline is stopping (or the downstream consumer is gone): end quietly.
    Stopped,
    /// A real failure; the pipeline stops and reports it with the stage name and frame number.
    Failed(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// What came from outside the process (a network peer's stream) is unusable: the pipeline
    /// stops as for a failure, but the fault is the peer's, not the pipeline's, so it is logged
    /// as a warning and reported as [`RunError::StageFailed`](super::RunError) with
    /// `bad_input` set.
    BadInput(Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl StageError {
    /// A failure described by a message.
    pub fn msg(message: impl Into<String>) -> Self {
        StageError::Failed(message.into().into())
    }

    /// A peer's bad input, described by a message.
    pub fn bad_input(message: impl Into<String>) -> Self {
        StageError::BadInput(message.into().into())
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for StageError {
    fn from(e: E) -> Self {
        StageError::Failed(Box::new(e))
    }
}

impl fmt::Debug for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StageError::Stopped => f.write_str("Stopped"),
            StageError::Failed(e) => write!(f, "Failed({e})"),
            StageError::BadInput(e) => write!(f, "BadInput({e})"),
        }
    }
}

impl fmt::Display for StageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StageError::Stopped => f.write_str("pipeline stopping"),
            StageError::Failed(e) | StageError::BadInput(e) => {
                write!(f, "{e}")?;
                let mut src = e.source();
                while let Some(s) = src {
                    write!(f, ": {s}")?;
                    src = s.source();
                }
                Ok(())
            }
        }
    }
}

/// Result of a stage call.
pub type StageResult<T = ()> = Result<T, StageError>;

/// One frame delivered to [`Stage::process`].
pub struct Input {
    /// Index of the input port it arrived on (in the stage's declared input order).
    pub port: usize,
    /// Its metadata.
    pub meta: FrameMeta,
    payload: Payload,
}

impl Input {
    pub(crate) fn new(port: usize, meta: FrameMeta, payload: Payload) -> Self {
        Input {
            port,
            meta,
            payload,
        }
    }

    /// Takes the payload out as a `T`.
    ///
    /// # Errors
    ///
    /// When the payload is not a `T`. The pipeline builder checks link types before start, so
    /// this only happens for a stage whose declared port type disagrees with what it reads.
    pub fn take<T: FrameData>(self) -> StageResult<Frame<T>> {
        let meta = self.meta;
        match self.payload.downcast::<T>() {
            Ok(b) => Ok(Frame { meta, data: *b }),
            Err(_) => Err(StageError::msg(format!(
                "input port {} does not carry {} frames",
                self.port,
                T::NAME
            ))),
        }
    }
}

/// Whether a source has more to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Call `produce` again.
    Continue,
    /// End of stream: the runtime calls `finish`, then closes the outputs.
    Done,
}

/// A stage with at least one input.
pub trait Stage: Send {
    /// Called once when the pipeline starts, before the first frame: warm up, prime. The stage
    /// may emit and pull feedback here (frames emitted here have no input frame).
    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        Ok(())
    }

    /// Handles one frame from a non-feedback input.
    ///
    /// # Errors
    ///
    /// A failure stops the pipeline; the error is reported with the stage name and `input.meta.seq`.
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult;

    /// Called once when every non-feedback input has reached end of stream: emit what is
    /// buffered. Not called when the pipeline aborts.
    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        Ok(())
    }

    /// Before start: what this stage emits on each output (in declared order) given what it
    /// receives on each input (feedback inputs: nothing known). Fewer entries than outputs
    /// leave the rest unknown. The default knows nothing and accepts anything.
    ///
    /// # Errors
    ///
    /// A [`CapsError`](super::CapsError) saying what the stage needs that its inputs do not
    /// give (`samples per frame: needs 1920, gets 960`); the runtime adds the link.
    fn caps(&self, _inputs: &[super::Caps]) -> Result<Vec<super::Caps>, super::CapsError> {
        Ok(Vec::new())
    }
}

/// A stage without inputs.
pub trait Source: Send {
    /// Produces the next frame(s). Sources that pace themselves should wait with
    /// [`Context::sleep_until`], which returns early when the pipeline is asked to stop.
    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow>;

    /// Called once after the last `produce` (also when the pipeline is drained early).
    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        Ok(())
    }

    /// Before start: what this source emits on each output (see [`Stage::caps`]).
    fn caps(&self) -> Vec<super::Caps> {
        Vec::new()
    }
}

pub(crate) struct OutPort {
    pub ty: FrameType,
    pub name: &'static str,
    pub next_seq: u64,
    pub edges: Vec<EdgeTx>,
}

/// The stage's view of the runtime while it runs: emit frames, pull feedback, check for stop.
pub struct Context<'a> {
    pub(crate) outputs: &'a mut [OutPort],
    pub(crate) feedback: &'a mut [Option<EdgeRx>],
    pub(crate) signals: &'a Signals,
    pub(crate) blocked: Duration,
    pub(crate) emitted: u64,
}

impl Context<'_> {
    /// Emits `data` on output port `port`, stamped with `origin` (the capture instant of the
    /// newest sample it depends on). Blocks under back-pressure on `block` edges.
    ///
    /// # Errors
    ///
    /// [`StageError::Stopped`] when the pipeline is stopping or every consumer is gone; a failure
    /// when `port` does not exist or does not carry `T` (a bug in the stage).
    pub fn emit<T: FrameData>(&mut self, port: usize, origin: Instant, data: T) -> StageResult {
        let Some(out) = self.outputs.get_mut(port) else {
            return Err(StageError::msg(format!(
                "emit on output port {port}, which does not exist"
            )));
        };
        if !out.ty.is::<T>() {
            return Err(StageError::msg(format!(
                "emit of {} on output `{}`, which carries {}",
                T::NAME,
                out.name,
                out.ty
            )));
        }
        let meta = FrameMeta {
            seq: out.next_seq,
            origin,
        };
        out.next_seq += 1;
        self.emitted += 1;
        let mut payload: Payload = Box::new(data);
        let n = out.edges.len();
        let mut delivered = 0;
        for (i, edge) in out.edges.iter().enumerate() {
            // Fan-out: earlier consumers get clones, the last one takes the original (so a
            // single consumer never costs a copy). A boxed `()` does not allocate.
            let p = if i + 1 == n {
                std::mem::replace(&mut payload, Box::new(()))
            } else {
                out.ty
                    .clone_payload(&payload)
                    .unwrap_or_else(|| Box::new(()))
            };
            let env = Envelope {
                meta,
                payload: p,
                sent_at: Instant::now(),
            };
            match edge.send(env, self.signals) {
                Ok(b) => {
                    self.blocked += b;
                    delivered += 1;
                }
                Err(SendError::Stopped) => return Err(StageError::Stopped),
                // One consumer gone (it failed or finished early): keep serving the others.
                Err(SendError::Disconnected) => {}
            }
        }
        if n > 0 && delivered == 0 {
            return Err(StageError::Stopped);
        }
        Ok(())
    }

    /// Waits for the next frame on feedback input `port` (the one cycle of a pipeline). Returns
    /// `None` when the producer has ended its stream. The wait is not counted as service time.
    ///
    /// # Errors
    ///
    /// [`StageError::Stopped`] when the pipeline aborts while waiting; a failure when `port` is not
    /// a linked feedback input or the frame is not a `T`.
    pub fn recv_feedback<T: FrameData>(&mut self, port: usize) -> StageResult<Option<Frame<T>>> {
        let Some(Some(rx)) = self.feedback.get(port) else {
            return Err(StageError::msg(format!(
                "input port {port} is not a linked feedback input"
            )));
        };
        let t0 = Instant::now();
        let got = crossbeam_channel::select! {
            recv(rx.rx) -> m => m.ok(),
            recv(self.signals.abort) -> _ => return Err(StageError::Stopped),
        };
        self.blocked += t0.elapsed();
        match got {
            None => Ok(None),
            Some(env) => {
                rx.received(&env);
                Input::new(port, env.meta, env.payload)
                    .take::<T>()
                    .map(Some)
            }
        }
    }

    /// Whether the pipeline has been asked to stop (drain or abort). Sources check it between
    /// frames.
    pub fn should_stop(&self) -> bool {
        self.signals
            .drain_flag
            .load(std::sync::atomic::Ordering::Acquire)
            || self
                .signals
                .abort_flag
                .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Runs `wait` (a blocking wait for something outside the pipeline: a network client's
    /// next message) without counting its time as service time.
    pub fn waiting<T>(&mut self, wait: impl FnOnce() -> T) -> T {
        let t0 = Instant::now();
        let r = wait();
        self.blocked += t0.elapsed();
        r
    }

    /// Sleeps until `deadline`, waking early when the pipeline is asked to stop. Returns `false`
    /// when it woke because of a stop request. The sleep is not counted as service time (a paced
    /// source spends most of its time here).
    pub fn sleep_until(&mut self, deadline: Instant) -> bool {
        let t0 = Instant::now();
        let timeout = deadline.saturating_duration_since(t0);
        if timeout.is_zero() {
            return !self.should_stop();
        }
        let woke_for_deadline = crossbeam_channel::select! {
            recv(self.signals.drain) -> _ => false,
            recv(self.signals.abort) -> _ => false,
            default(timeout) => true,
        };
        self.blocked += t0.elapsed();
        woke_for_deadline
    }
}
