//! Running a built pipeline: one OS thread per stage, a supervisor, and shutdown.
//!
//! # Shutdown
//!
//! A run ends in one of three ways:
//!
//! - **End of stream.** Every source returns [`Flow::Done`](super::Flow::Done); each stage sees
//!   its inputs close, calls `finish`, and closes its outputs, so end of stream flows through the
//!   graph and every sink closes its files. All threads are joined.
//! - **Stop request** ([`Running::stop`], e.g. Ctrl-C): sources stop producing and the pipeline
//!   drains as above.
//! - **Failure.** A stage returns an error or panics. Its inputs are dropped (producers upstream
//!   see their consumer gone and stop), its outputs close (stages downstream drain and flush what
//!   they already have, so nothing produced is lost) and sources are asked to stop. If the
//!   pipeline has not drained within [`RunOptions::drain_timeout`], every blocking wait in the
//!   runtime is woken with an abort; threads still running after
//!   [`RunOptions::abort_timeout`] (a stage stuck in its own code) are reported as hung and left
//!   behind rather than hanging the caller.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Select, Sender};

use super::edge::{edge, EdgeRx, Signals};
use super::graph::{Body, Node, ResolvedLink, RunOptions};
use super::stage::{Context, Flow, Input, OutPort, StageError};
use super::stats::{EdgeStats, RunReport, StageStats, StatsRegistry};

/// A validated pipeline, ready to [`start`](Pipeline::start).
pub struct Pipeline {
    pub(crate) nodes: Vec<Node>,
    pub(crate) links: Vec<ResolvedLink>,
    pub(crate) options: RunOptions,
    pub(crate) observers: super::Observers,
    pub(crate) control: super::ControlPlane,
}

/// Why a run failed.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RunError {
    /// A stage returned an error or panicked.
    StageFailed {
        /// Stage name.
        stage: String,
        /// Sequence number of the frame being processed (for a source: of the frame it was
        /// producing), when there was one.
        seq: Option<u64>,
        /// The error, with its causes.
        message: String,
        /// The stage refused what came from outside the process (a peer's stream): the fault
        /// is the peer's ([`StageError::BadInput`]).
        bad_input: bool,
        /// Stages that did not stop in time afterwards.
        hung: Vec<String>,
        /// The stage's own error (none for a panic), to tell its kind by downcasting
        /// ([`StageCause::downcast_ref`]); `message` already says it in words.
        cause: Option<StageCause>,
    },
    /// Stages did not stop within the timeouts after a stop request.
    Hung {
        /// Their names.
        stages: Vec<String>,
    },
    /// A thread could not be started.
    Spawn(String),
    /// The run was aborted (a second stop request, or a drain that did not finish in time)
    /// before everything was delivered.
    Aborted {
        /// Frames that were still queued between stages and were thrown away.
        discarded: u64,
        /// The edges that held them, with their counts.
        edges: Vec<(String, u64)>,
    },
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::StageFailed {
                stage,
                seq,
                message,
                hung,
                bad_input,
                ..
            } => {
                if *bad_input {
                    write!(f, "stage `{stage}` refused its input")?;
                } else {
                    write!(f, "stage `{stage}` failed")?;
                }
                if let Some(s) = seq {
                    write!(f, " at frame {s}")?;
                }
                write!(f, ": {message}")?;
                if !hung.is_empty() {
                    write!(
                        f,
                        " (and stage(s) {} did not stop in time)",
                        hung.join(", ")
                    )?;
                }
                Ok(())
            }
            RunError::Hung { stages } => write!(
                f,
                "stage(s) {} did not stop in time and were left running",
                stages.join(", ")
            ),
            RunError::Spawn(e) => write!(f, "starting a stage thread: {e}"),
            RunError::Aborted { discarded, edges } => {
                write!(f, "aborted: {discarded} queued frame(s) discarded")?;
                if !edges.is_empty() {
                    let list: Vec<String> =
                        edges.iter().map(|(e, n)| format!("{n} on {e}")).collect();
                    write!(f, " ({})", list.join(", "))?;
                }
                write!(f, "; what sinks had written before is kept")
            }
        }
    }
}

impl std::error::Error for RunError {}

impl RunError {
    /// The failed stage's own error, when a stage returned one.
    pub fn cause(&self) -> Option<&StageCause> {
        match self {
            RunError::StageFailed { cause, .. } => cause.as_ref(),
            _ => None,
        }
    }
}

/// The error a stage failed with, kept with its type: a caller tells its kind by downcasting it
/// (a model's error, an I/O error) instead of reading the message. Two are equal when they say
/// the same.
#[derive(Clone)]
pub struct StageCause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl StageCause {
    /// The error, if it is a `T`.
    pub fn downcast_ref<T: std::error::Error + 'static>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }

    /// The error.
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::fmt::Debug for StageCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StageCause({})", self.0)
    }
}

impl std::fmt::Display for StageCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl PartialEq for StageCause {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_string() == other.0.to_string()
    }
}

impl Eq for StageCause {}

/// The first stage failure of a run: stage, frame, message, whether it was bad input, its
/// error.
type Failure = (String, Option<u64>, String, bool, Option<StageCause>);

/// How one actor ended.
enum Exit {
    Finished,
    Stopped,
    Failed {
        seq: Option<u64>,
        message: String,
        bad_input: bool,
        cause: Option<StageCause>,
    },
}

enum Event {
    Exit(usize, Exit),
    StopRequested,
}

/// Fires the run's signals. Cloneable so that a Ctrl-C handler can hold one.
#[derive(Clone)]
pub struct StopHandle {
    inner: Arc<Controller>,
}

struct Controller {
    drain_tx: Mutex<Option<Sender<()>>>,
    abort_tx: Mutex<Option<Sender<()>>>,
    drain_flag: Arc<AtomicBool>,
    abort_flag: Arc<AtomicBool>,
    events: Sender<Event>,
}

impl Controller {
    fn drain(&self) {
        self.drain_flag.store(true, Ordering::Release);
        if let Ok(mut g) = self.drain_tx.lock() {
            g.take();
        }
    }
    fn abort(&self) {
        self.abort_flag.store(true, Ordering::Release);
        self.drain();
        if let Ok(mut g) = self.abort_tx.lock() {
            g.take();
        }
    }
}

impl StopHandle {
    /// Asks the pipeline to stop gracefully: sources stop, everything drains and flushes. If it
    /// has not drained within the drain timeout it is aborted.
    pub fn stop(&self) {
        self.inner.drain();
        let _ = self.inner.events.send(Event::StopRequested);
    }

    /// Aborts at once: every blocked wait returns and stages exit without flushing (sinks still
    /// close their files when dropped).
    pub fn abort(&self) {
        self.inner.abort();
        let _ = self.inner.events.send(Event::StopRequested);
    }
}

/// What belongs to one running pipeline, for whoever drives it (cheap to clone): stop it, send
/// commands to its stages and read their status, and know whether it is ready.
#[derive(Clone)]
pub struct Handle {
    stop: StopHandle,
    control: super::ControlPlane,
    started: Arc<std::sync::atomic::AtomicUsize>,
    stages: usize,
}

impl Handle {
    /// Asks the pipeline to stop gracefully (see [`StopHandle::stop`]).
    pub fn stop(&self) {
        self.stop.stop();
    }

    /// Aborts at once (see [`StopHandle::abort`]).
    pub fn abort(&self) {
        self.stop.abort();
    }

    /// Its stop handle alone.
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Its control plane: commands to its stages, their status.
    pub fn control(&self) -> &super::ControlPlane {
        &self.control
    }

    /// Every stage has started: sources are producing and every stage's `start` (warm-up,
    /// priming) has returned.
    pub fn is_ready(&self) -> bool {
        self.started.load(Ordering::Acquire) >= self.stages
    }
}

/// A running pipeline.
pub struct Running {
    names: Vec<String>,
    handles: Vec<Option<JoinHandle<()>>>,
    events: Receiver<Event>,
    stop: StopHandle,
    stats: StatsRegistry,
    started: Instant,
    options: RunOptions,
    spawn_error: Option<String>,
    handle: Handle,
}

/// The result of a run: its statistics, and the error if it failed.
pub struct RunOutcome {
    /// Timing statistics of every stage and edge.
    pub report: RunReport,
    /// `None` when the run ended cleanly.
    pub error: Option<RunError>,
}

impl RunOutcome {
    /// The report, or the error.
    ///
    /// # Errors
    ///
    /// The run's [`RunError`].
    pub fn into_result(self) -> Result<RunReport, RunError> {
        match self.error {
            None => Ok(self.report),
            Some(e) => Err(e),
        }
    }
}

struct Actor {
    index: usize,
    name: String,
    body: Body,
    outputs: Vec<OutPort>,
    inputs: Vec<(usize, EdgeRx)>,
    feedback: Vec<Option<EdgeRx>>,
    stats: Arc<StageStats>,
    signals: Signals,
    observers: super::Observers,
    /// Counts stages that have started (for [`Handle::is_ready`]).
    started: Arc<std::sync::atomic::AtomicUsize>,
}

impl Actor {
    /// A fresh context for one call into the stage.
    fn context(&mut self) -> Context<'_> {
        Context {
            outputs: &mut self.outputs,
            feedback: &mut self.feedback,
            signals: &self.signals,
            blocked: Duration::ZERO,
            emitted: 0,
        }
    }
}

impl Pipeline {
    /// Names of the stages, in declaration order.
    pub fn stage_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// Starts the pipeline and waits until it ends: [`start`](Self::start), then
    /// [`Running::wait`], as a result.
    ///
    /// # Errors
    ///
    /// The run's [`RunError`].
    pub fn run(self) -> Result<RunReport, RunError> {
        self.start().wait().into_result()
    }

    /// Starts one thread per stage and returns at once.
    pub fn start(self) -> Running {
        let (drain_tx, drain_rx) = crossbeam_channel::bounded::<()>(0);
        let (abort_tx, abort_rx) = crossbeam_channel::bounded::<()>(0);
        let (ev_tx, ev_rx) = crossbeam_channel::unbounded();
        let signals = Signals {
            drain: drain_rx,
            abort: abort_rx,
            drain_flag: Arc::new(AtomicBool::new(false)),
            abort_flag: Arc::new(AtomicBool::new(false)),
        };
        let stop = StopHandle {
            inner: Arc::new(Controller {
                drain_tx: Mutex::new(Some(drain_tx)),
                abort_tx: Mutex::new(Some(abort_tx)),
                drain_flag: signals.drain_flag.clone(),
                abort_flag: signals.abort_flag.clone(),
                events: ev_tx.clone(),
            }),
        };

        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let handle = Handle {
            stop: stop.clone(),
            control: self.control.clone(),
            started: started.clone(),
            stages: self.nodes.len(),
        };
        let mut actors: Vec<Actor> = Vec::with_capacity(self.nodes.len());
        let mut stage_stats = Vec::new();
        for (i, n) in self.nodes.into_iter().enumerate() {
            let stats = Arc::new(StageStats::default());
            stage_stats.push((n.name.clone(), stats.clone()));
            actors.push(Actor {
                index: i,
                name: n.name,
                outputs: n
                    .outputs
                    .iter()
                    .map(|p| OutPort {
                        ty: p.ty,
                        name: p.name,
                        next_seq: 0,
                        edges: Vec::new(),
                    })
                    .collect(),
                feedback: n.inputs.iter().map(|_| None).collect(),
                inputs: Vec::new(),
                body: n.body,
                stats,
                signals: signals.clone(),
                observers: self.observers.clone(),
                started: started.clone(),
            });
        }
        let stage_names: Vec<String> = actors.iter().map(|a| a.name.clone()).collect();
        let edge_names: Vec<String> = self.links.iter().map(|l| l.name.clone()).collect();
        self.observers
            .each(|o| o.started(&stage_names, &edge_names));
        let mut edge_stats = Vec::new();
        for (index, l) in self.links.iter().enumerate() {
            let st = Arc::new(EdgeStats::default());
            edge_stats.push((l.name.clone(), l.capacity, l.overflow, st.clone()));
            let (tx, rx) = edge(
                l.name.clone(),
                l.capacity,
                l.overflow,
                st,
                (index, self.observers.clone()),
            );
            actors[l.from].outputs[l.from_port].edges.push(tx);
            if l.feedback {
                actors[l.to].feedback[l.to_port] = Some(rx);
            } else {
                actors[l.to].inputs.push((l.to_port, rx));
            }
        }

        let names: Vec<String> = actors.iter().map(|a| a.name.clone()).collect();
        let (handles, spawn_error) = spawn(actors, &ev_tx, &stop);
        Running {
            names,
            handles,
            events: ev_rx,
            stop,
            stats: StatsRegistry {
                stages: stage_stats,
                edges: edge_stats,
            },
            started: Instant::now(),
            options: self.options,
            spawn_error,
            handle,
        }
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

fn record(a: &Actor, elapsed: Duration, blocked: Duration, frames: u64) {
    let service = elapsed.saturating_sub(blocked);
    if let Ok(mut h) = a.stats.service.lock() {
        h.record(service);
    }
    let n = a.stats.frames.fetch_add(frames, Ordering::Relaxed);
    if frames > 0 {
        a.observers.each(|o| {
            o.frames(a.index, frames);
            o.service(a.index, n, service);
        });
    }
    a.stats
        .blocked_ns
        .fetch_add(blocked.as_nanos() as u64, Ordering::Relaxed);
}

fn failure(e: StageError, seq: Option<u64>) -> Exit {
    match e {
        StageError::Stopped => Exit::Stopped,
        e @ (StageError::Failed(_) | StageError::BadInput(_)) => {
            let message = e.to_string();
            let bad_input = matches!(e, StageError::BadInput(_));
            let (StageError::Failed(b) | StageError::BadInput(b)) = e else {
                unreachable!("matched above")
            };
            Exit::Failed {
                seq,
                bad_input,
                message,
                cause: Some(StageCause(Arc::from(b))),
            }
        }
    }
}

fn run_actor(mut a: Actor) -> Exit {
    let mut body = std::mem::replace(&mut a.body, Body::Source(Box::new(Nothing)));
    let exit = match &mut body {
        Body::Source(src) => run_source(&mut a, src.as_mut()),
        Body::Stage(st) => run_stage(&mut a, st.as_mut()),
    };
    // Close outputs (end of stream downstream) and inputs (upstream sees us gone) before the
    // stage itself is dropped, which is where sinks close their files.
    a.outputs.clear();
    a.inputs.clear();
    a.feedback.clear();
    drop(body);
    exit
}

struct Nothing;
impl super::Source for Nothing {
    fn produce(&mut self, _: &mut Context<'_>) -> super::StageResult<Flow> {
        Ok(Flow::Done)
    }
}

fn run_source(a: &mut Actor, src: &mut dyn super::Source) -> Exit {
    a.started.fetch_add(1, Ordering::AcqRel);
    loop {
        let stop = a.signals.drain_flag.load(Ordering::Acquire);
        if stop {
            break;
        }
        let seq = a.outputs.first().map(|o| o.next_seq);
        let mut cx = a.context();
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| src.produce(&mut cx)));
        let elapsed = t0.elapsed();
        let (blocked, emitted) = (cx.blocked, cx.emitted);
        record(a, elapsed, blocked, emitted);
        match r {
            Ok(Ok(Flow::Continue)) => {}
            Ok(Ok(Flow::Done)) => break,
            Ok(Err(e)) => return failure(e, seq),
            Err(p) => {
                return Exit::Failed {
                    seq,
                    bad_input: false,
                    cause: None,
                    message: format!("panicked: {}", panic_message(&p)),
                }
            }
        }
    }
    finish(a, |cx| src.finish(cx))
}

fn finish(a: &mut Actor, f: impl FnOnce(&mut Context<'_>) -> super::StageResult) -> Exit {
    if a.signals.abort_flag.load(Ordering::Acquire) {
        return Exit::Stopped;
    }
    let mut cx = a.context();
    match catch_unwind(AssertUnwindSafe(|| f(&mut cx))) {
        Ok(Ok(())) => Exit::Finished,
        Ok(Err(e)) => failure(e, None),
        Err(p) => Exit::Failed {
            seq: None,
            bad_input: false,
            cause: None,
            message: format!("panicked while flushing: {}", panic_message(&p)),
        },
    }
}

fn run_stage(a: &mut Actor, st: &mut dyn super::Stage) -> Exit {
    let mut cx = a.context();
    match catch_unwind(AssertUnwindSafe(|| st.start(&mut cx))) {
        Ok(Ok(())) => {
            a.started.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Err(e)) => return failure(e, None),
        Err(p) => {
            return Exit::Failed {
                seq: None,
                bad_input: false,
                cause: None,
                message: format!("panicked while starting: {}", panic_message(&p)),
            }
        }
    }
    let inputs = std::mem::take(&mut a.inputs);
    let mut sel = Select::new();
    for (_, rx) in &inputs {
        sel.recv(&rx.rx);
    }
    // A handle of our own, so that the selector does not borrow the actor.
    let abort = a.signals.abort.clone();
    let abort_idx = sel.recv(&abort);
    let mut open = inputs.len();
    let mut last_done: Option<Instant> = None;
    let mut exit = None;
    while open > 0 {
        let op = sel.select();
        let i = op.index();
        if i == abort_idx {
            let _ = op.recv(&abort);
            exit = Some(Exit::Stopped);
            break;
        }
        let (port, rx) = &inputs[i];
        let env = match op.recv(&rx.rx) {
            Ok(env) => env,
            Err(_) => {
                sel.remove(i);
                open -= 1;
                continue;
            }
        };
        rx.received(&env);
        let seq = env.meta.seq;
        let input = Input::new(*port, env.meta, env.payload);
        let mut cx = a.context();
        let t0 = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| st.process(input, &mut cx)));
        let now = Instant::now();
        let blocked = cx.blocked;
        record(a, now - t0, blocked, 1);
        // Sinks: the interval between completed frames (the pipeline's throughput).
        if a.outputs.is_empty() {
            if let Some(prev) = last_done {
                let d = now - prev;
                if let Ok(mut c) = a.stats.completion.lock() {
                    c.record(d);
                }
                a.observers.each(|o| o.completion(a.index, d));
            }
            last_done = Some(now);
        }
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                exit = Some(failure(e, Some(seq)));
                break;
            }
            Err(p) => {
                exit = Some(Exit::Failed {
                    seq: Some(seq),
                    bad_input: false,
                    cause: None,
                    message: format!("panicked: {}", panic_message(&p)),
                });
                break;
            }
        }
    }
    drop(sel);
    drop(inputs);
    match exit {
        Some(e) => e,
        None => finish(a, |cx| st.finish(cx)),
    }
}

/// How a run ended, in its order of precedence: threads that could not be spawned, the first
/// stage that failed, stages left behind, an abort (with what it discarded), or well (`None`).
fn run_error(
    spawn_error: Option<String>,
    failed: Option<Failure>,
    hung: Vec<String>,
    aborting: bool,
    report: &RunReport,
) -> Option<RunError> {
    if let Some(e) = spawn_error {
        Some(RunError::Spawn(e))
    } else if let Some((stage, seq, message, bad_input, cause)) = failed {
        Some(RunError::StageFailed {
            stage,
            seq,
            message,
            bad_input,
            hung,
            cause,
        })
    } else if !hung.is_empty() {
        Some(RunError::Hung { stages: hung })
    } else if aborting {
        let edges: Vec<(String, u64)> = report
            .edges
            .iter()
            .filter(|e| e.queued > 0)
            .map(|e| (e.name.clone(), e.queued))
            .collect();
        Some(RunError::Aborted {
            discarded: edges.iter().map(|(_, n)| n).sum(),
            edges,
        })
    } else {
        None
    }
}

/// Each actor on a thread of its own, its exit (or its panic) reported as an event. A thread
/// that cannot be spawned aborts the run and is said.
fn spawn(
    actors: Vec<Actor>,
    ev_tx: &crossbeam_channel::Sender<Event>,
    stop: &StopHandle,
) -> (Vec<Option<std::thread::JoinHandle<()>>>, Option<String>) {
    let mut handles = Vec::with_capacity(actors.len());
    let mut spawn_error = None;
    for a in actors {
        let tx = ev_tx.clone();
        let index = a.index;
        let res = std::thread::Builder::new()
            .name(format!("duplex:{}", a.name))
            .spawn(move || {
                let exit = match catch_unwind(AssertUnwindSafe(|| run_actor(a))) {
                    Ok(e) => e,
                    Err(p) => Exit::Failed {
                        seq: None,
                        bad_input: false,
                        cause: None,
                        message: format!("panicked: {}", panic_message(&p)),
                    },
                };
                let _ = tx.send(Event::Exit(index, exit));
            });
        match res {
            Ok(h) => handles.push(Some(h)),
            Err(e) => {
                spawn_error = Some(e.to_string());
                handles.push(None);
                stop.abort();
            }
        }
    }
    (handles, spawn_error)
}

impl Running {
    /// A handle that can stop the run from another thread (a signal handler, a control socket).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// The pipeline's handle: stop, control plane, readiness.
    pub fn handle(&self) -> Handle {
        self.handle.clone()
    }

    /// Statistics so far.
    pub fn snapshot(&self) -> RunReport {
        self.stats.snapshot(self.started.elapsed())
    }

    /// Waits for the end of the run (see the module docs for how it ends) and joins every thread
    /// that stopped.
    pub fn wait(mut self) -> RunOutcome {
        let n = self.names.len();
        let mut done = vec![false; n];
        for (i, h) in self.handles.iter().enumerate() {
            if h.is_none() {
                done[i] = true;
            }
        }
        let mut failed: Option<Failure> = None;
        // Deadline of the current shutdown phase: draining, then aborting.
        let mut deadline: Option<Instant> = None;
        let mut aborting = false;
        let mut hung = Vec::new();
        if self.spawn_error.is_some() {
            aborting = true;
            deadline = Some(Instant::now() + self.options.abort_timeout);
        }
        while done.iter().any(|d| !d) {
            let ev = match deadline {
                None => self
                    .events
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => self.events.recv_deadline(d),
            };
            match ev {
                Ok(Event::Exit(i, exit)) => {
                    done[i] = true;
                    if let Some(h) = self.handles[i].take() {
                        let _ = h.join();
                    }
                    match exit {
                        Exit::Failed {
                            seq,
                            message,
                            bad_input,
                            cause,
                        } => {
                            if bad_input {
                                tracing::warn!(stage = %self.names[i], "stage refused its input: {message}");
                            } else {
                                tracing::error!(stage = %self.names[i], "stage failed: {message}");
                            }
                            if failed.is_none() {
                                failed =
                                    Some((self.names[i].clone(), seq, message, bad_input, cause));
                                self.stop.inner.drain();
                                if deadline.is_none() {
                                    deadline = Some(Instant::now() + self.options.drain_timeout);
                                }
                            }
                        }
                        Exit::Finished | Exit::Stopped => {}
                    }
                }
                Ok(Event::StopRequested) => {
                    if self.stop.inner.abort_flag.load(Ordering::Acquire) {
                        if !aborting {
                            aborting = true;
                            deadline = Some(Instant::now() + self.options.abort_timeout);
                        }
                    } else if deadline.is_none() {
                        deadline = Some(Instant::now() + self.options.drain_timeout);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    let waiting: Vec<String> = (0..n)
                        .filter(|&i| !done[i])
                        .map(|i| self.names[i].clone())
                        .collect();
                    if aborting {
                        hung = waiting;
                        tracing::error!(
                            "stage(s) {} did not stop within {:?} of the abort; leaving them behind",
                            hung.join(", "),
                            self.options.abort_timeout
                        );
                        break;
                    }
                    tracing::warn!(
                        "pipeline did not drain within {:?} (waiting for {}): aborting",
                        self.options.drain_timeout,
                        waiting.join(", ")
                    );
                    self.stop.inner.abort();
                    aborting = true;
                    deadline = Some(Instant::now() + self.options.abort_timeout);
                }
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        // Wake anything still blocked on a signal, even after a clean end.
        self.stop.inner.abort();
        let report = self.stats.snapshot(self.started.elapsed());
        let error = run_error(self.spawn_error.take(), failed, hung, aborting, &report);
        RunOutcome { report, error }
    }
}
