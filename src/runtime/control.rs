//! A pipeline's own control plane: the commands its stages take and the status they report.
//!
//! Each stage kind declares its commands ([`CommandSpec`]) and status keys ([`StatusSpec`]) as
//! it declares its params. Whoever builds a pipeline makes one [`ControlPlane`] for it and gives
//! each stage its own [`Endpoint`]: an inbox the stage reads at frame boundaries without
//! blocking ([`Endpoint::next_command`]), and a status block it updates with a short,
//! uncontended lock ([`Endpoint::set`]). The plane routes a command to the stage it names,
//! checks it against the stage's declaration, and hands back a [`Pending`] reply; it reads every
//! stage's status. Nothing here is process-wide: two pipelines in one process have two planes
//! and cannot see each other's commands or status.
//!
//! The runtime gives commands no meaning; the values of a status are a small closed set
//! ([`Value`]) that any caller can render.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};

/// A command a stage kind takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandSpec {
    /// Its name (`persona`, `mute`).
    pub name: &'static str,
    /// What its argument is, in words; `None` when it takes none.
    pub arg: Option<&'static str>,
    /// One line for `duplex stages`.
    pub doc: &'static str,
}

impl CommandSpec {
    /// How it is written: `name`, or `name <arg>`.
    pub fn usage(&self) -> String {
        match self.arg {
            Some(a) => format!("{} <{a}>", self.name),
            None => self.name.to_string(),
        }
    }
}

/// A status key a stage kind reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusSpec {
    /// Its name (`agent_frames`, `device`).
    pub name: &'static str,
    /// One line for `duplex stages`.
    pub doc: &'static str,
}

/// A status value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Nothing (yet).
    Null,
    /// A switch.
    Bool(bool),
    /// A count.
    Int(i64),
    /// A measure.
    Float(f64),
    /// A name, a state, a message.
    Text(String),
}

impl Value {
    /// The value as JSON (a float that is not finite is `null`).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Value::Null => serde_json::Value::Null,
            Value::Bool(b) => (*b).into(),
            Value::Int(i) => (*i).into(),
            Value::Float(x) => serde_json::Number::from_f64(*x)
                .map(serde_json::Value::Number)
                .unwrap_or(serde_json::Value::Null),
            Value::Text(s) => s.clone().into(),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => f.write_str("null"),
            Value::Bool(b) => write!(f, "{b}"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x}"),
            Value::Text(s) => f.write_str(s),
        }
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl From<u64> for Value {
    fn from(i: u64) -> Self {
        Value::Int(i64::try_from(i).unwrap_or(i64::MAX))
    }
}

impl From<usize> for Value {
    fn from(i: usize) -> Self {
        Value::Int(i64::try_from(i).unwrap_or(i64::MAX))
    }
}

impl From<i64> for Value {
    fn from(i: i64) -> Self {
        Value::Int(i)
    }
}

impl From<f64> for Value {
    fn from(x: f64) -> Self {
        Value::Float(x)
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Text(s)
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Text(s.to_string())
    }
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// What a command's reply is: what was done, or why not.
pub type Reply = Result<String, String>;

/// One command, as the stage receives it.
pub struct Command {
    /// Its name, as declared.
    pub name: &'static str,
    /// Its argument (empty when it takes none).
    pub arg: String,
    reply: Sender<Reply>,
}

impl Command {
    /// Answers the command (whoever sent it may have stopped waiting: that is not an error).
    pub fn reply(self, r: Reply) {
        let _ = self.reply.try_send(r);
    }
}

impl fmt::Debug for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Command({} {:?})", self.name, self.arg)
    }
}

/// Why a command was not delivered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// No stage of that name in this pipeline.
    #[error("no stage `{0}` in this pipeline")]
    NoStage(String),
    /// The stage does not take this command.
    #[error("stage `{stage}` takes no command `{command}` (it takes: {takes})")]
    NoCommand {
        /// The stage.
        stage: String,
        /// The command asked for.
        command: String,
        /// What it takes.
        takes: String,
    },
    /// An argument missing, or given to a command that takes none.
    #[error("`{command}` of stage `{stage}` {problem}")]
    Argument {
        /// The stage.
        stage: String,
        /// The command.
        command: String,
        /// What is wrong.
        problem: String,
    },
    /// The stage's inbox is full (it is not reading: stopped, or stuck).
    #[error("stage `{0}` has too many commands waiting; try again")]
    Busy(String),
    /// The stage has ended.
    #[error("stage `{0}` has ended")]
    Ended(String),
}

/// Commands that may wait in a stage's inbox.
const INBOX: usize = 16;

#[derive(Default)]
struct StatusBlock {
    values: Mutex<BTreeMap<&'static str, Value>>,
}

struct StageSide {
    commands: &'static [CommandSpec],
    tx: Sender<Command>,
    status: Arc<StatusBlock>,
}

/// What one stage holds: its inbox and its status block.
pub struct Endpoint {
    rx: Receiver<Command>,
    status: Arc<StatusBlock>,
}

impl Endpoint {
    /// An endpoint that belongs to no plane: no command ever comes, the status is kept but
    /// read by nobody (for stages built outside a pipeline file, in tests and tools).
    pub fn detached() -> Self {
        let (_tx, rx) = crossbeam_channel::bounded(1);
        Endpoint {
            rx,
            status: Arc::new(StatusBlock::default()),
        }
    }

    /// The next command waiting, if any. Never blocks.
    pub fn next_command(&self) -> Option<Command> {
        self.rx.try_recv().ok()
    }

    /// Sets status `key` (a key the stage kind declares). Takes a lock held only by readers
    /// copying the block out.
    pub fn set(&self, key: &'static str, value: impl Into<Value>) {
        if let Ok(mut v) = self.status.values.lock() {
            v.insert(key, value.into());
        }
    }
}

/// A reply on its way.
pub struct Pending {
    rx: Receiver<Reply>,
}

impl Pending {
    /// Waits up to `timeout` for the stage's answer: `None` when none came in time (the command
    /// is still applied when the stage reaches it).
    pub fn wait(&self, timeout: Duration) -> Option<Reply> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => Some(r),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
            // The stage dropped the command without answering: it ended.
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                Some(Err("the stage ended before it applied the command".into()))
            }
        }
    }
}

/// One pipeline's control plane (cheap to clone; every clone is the same plane).
#[derive(Clone, Default)]
pub struct ControlPlane {
    stages: Arc<Mutex<BTreeMap<String, StageSide>>>,
}

impl ControlPlane {
    /// A plane with no stage yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers stage `stage`, which takes `commands`, and returns its endpoint.
    pub fn endpoint(&self, stage: &str, commands: &'static [CommandSpec]) -> Endpoint {
        let (tx, rx) = crossbeam_channel::bounded(INBOX);
        let status = Arc::new(StatusBlock::default());
        if let Ok(mut s) = self.stages.lock() {
            s.insert(
                stage.to_string(),
                StageSide {
                    commands,
                    tx,
                    status: status.clone(),
                },
            );
        }
        Endpoint { rx, status }
    }

    /// Sends `command` (with `arg`) to stage `stage`.
    ///
    /// # Errors
    ///
    /// A [`ControlError`] when there is no such stage or command, the argument does not fit, or
    /// the stage cannot take it now.
    pub fn send(&self, stage: &str, command: &str, arg: &str) -> Result<Pending, ControlError> {
        let stages = self
            .stages
            .lock()
            .map_err(|_| ControlError::Ended(stage.into()))?;
        let side = stages
            .get(stage)
            .ok_or_else(|| ControlError::NoStage(stage.into()))?;
        let Some(spec) = side.commands.iter().find(|c| c.name == command) else {
            return Err(ControlError::NoCommand {
                stage: stage.into(),
                command: command.into(),
                takes: if side.commands.is_empty() {
                    "none".into()
                } else {
                    side.commands
                        .iter()
                        .map(|c| c.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            });
        };
        let problem = match (spec.arg, arg.trim().is_empty()) {
            (Some(what), true) => Some(format!("needs an argument: {what}")),
            (None, false) => Some("takes no argument".to_string()),
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(ControlError::Argument {
                stage: stage.into(),
                command: command.into(),
                problem,
            });
        }
        let (reply, rx) = crossbeam_channel::bounded(1);
        let cmd = Command {
            name: spec.name,
            arg: arg.trim().to_string(),
            reply,
        };
        match side.tx.try_send(cmd) {
            Ok(()) => Ok(Pending { rx }),
            Err(TrySendError::Full(_)) => Err(ControlError::Busy(stage.into())),
            Err(TrySendError::Disconnected(_)) => Err(ControlError::Ended(stage.into())),
        }
    }

    /// The stages that take `command`, in name order.
    pub fn stages_taking(&self, command: &str) -> Vec<String> {
        self.stages
            .lock()
            .map(|s| {
                s.iter()
                    .filter(|(_, side)| side.commands.iter().any(|c| c.name == command))
                    .map(|(n, _)| n.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every stage's status, by stage name.
    pub fn status(&self) -> BTreeMap<String, BTreeMap<&'static str, Value>> {
        let Ok(stages) = self.stages.lock() else {
            return BTreeMap::new();
        };
        stages
            .iter()
            .map(|(n, side)| {
                let values = side
                    .status
                    .values
                    .lock()
                    .map(|v| v.clone())
                    .unwrap_or_default();
                (n.clone(), values)
            })
            .collect()
    }

    /// One status value of one stage.
    pub fn get(&self, stage: &str, key: &str) -> Option<Value> {
        let stages = self.stages.lock().ok()?;
        let side = stages.get(stage)?;
        let v = side.status.values.lock().ok()?;
        v.get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TAKES: &[CommandSpec] = &[
        CommandSpec {
            name: "persona",
            arg: Some("text"),
            doc: "",
        },
        CommandSpec {
            name: "reset",
            arg: None,
            doc: "",
        },
    ];

    #[test]
    fn commands_reach_their_stage_only_and_are_answered() {
        let a = ControlPlane::new();
        let b = ControlPlane::new();
        let ea = a.endpoint("temporal", TAKES);
        let eb = b.endpoint("temporal", TAKES);
        let p = a.send("temporal", "persona", "kind").unwrap();
        assert!(eb.next_command().is_none(), "the other plane sees nothing");
        let c = ea.next_command().unwrap();
        assert_eq!((c.name, c.arg.as_str()), ("persona", "kind"));
        c.reply(Ok("done".into()));
        assert_eq!(p.wait(Duration::from_secs(1)), Some(Ok("done".into())));
        ea.set("agent_frames", 3u64);
        assert_eq!(a.get("temporal", "agent_frames"), Some(Value::Int(3)));
        assert_eq!(b.get("temporal", "agent_frames"), None);
    }

    #[test]
    fn what_a_stage_does_not_take_is_refused() {
        let a = ControlPlane::new();
        let e = a.endpoint("temporal", TAKES);
        assert!(matches!(
            a.send("temporal", "mute", ""),
            Err(ControlError::NoCommand { .. })
        ));
        assert!(matches!(
            a.send("mic", "mute", ""),
            Err(ControlError::NoStage(_))
        ));
        assert!(matches!(
            a.send("temporal", "persona", " "),
            Err(ControlError::Argument { .. })
        ));
        assert!(matches!(
            a.send("temporal", "reset", "now"),
            Err(ControlError::Argument { .. })
        ));
        for _ in 0..INBOX {
            a.send("temporal", "reset", "").unwrap();
        }
        assert!(matches!(
            a.send("temporal", "reset", ""),
            Err(ControlError::Busy(_))
        ));
        // A command dropped unanswered (the stage ended) is said so.
        let p = {
            let a2 = ControlPlane::new();
            let e2 = a2.endpoint("x", TAKES);
            let p = a2.send("x", "reset", "").unwrap();
            drop(e2.next_command());
            p
        };
        assert!(matches!(p.wait(Duration::from_millis(10)), Some(Err(_))));
        drop(e);
        assert!(matches!(
            a.send("temporal", "reset", ""),
            Err(ControlError::Ended(_)) | Err(ControlError::Busy(_))
        ));
    }
}
