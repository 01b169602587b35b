//! Why a pipeline cannot be built: [`GraphError`], naming the pipeline's origin, the stages,
//! ports and frame types. Knows nothing of how the checks are made.

use std::fmt;

/// Why a pipeline cannot be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GraphErrorKind {
    /// The pipeline has no stages.
    Empty,
    /// Two stages share a name.
    DuplicateStage(String),
    /// A link names a stage that does not exist.
    UnknownStage {
        /// The link as written.
        link: String,
        /// The missing stage.
        stage: String,
    },
    /// A link names a port the stage does not have.
    UnknownPort {
        /// The link as written.
        link: String,
        /// Stage.
        stage: String,
        /// `input` or `output`.
        dir: &'static str,
        /// The missing port.
        port: String,
        /// The ports it has.
        available: Vec<String>,
    },
    /// A link leaves the port implicit but the stage has several.
    AmbiguousPort {
        /// The link as written.
        link: String,
        /// Stage.
        stage: String,
        /// `input` or `output`.
        dir: &'static str,
        /// Candidates.
        ports: Vec<String>,
    },
    /// A link joins ports of different frame types.
    TypeMismatch {
        /// The link as written.
        link: String,
        /// Producer `stage.port`.
        from: String,
        /// What it emits.
        from_type: String,
        /// Consumer `stage.port`.
        to: String,
        /// What it takes.
        to_type: String,
    },
    /// An input port has no link.
    UnlinkedInput {
        /// `stage.port`.
        port: String,
    },
    /// An output port has no link.
    UnlinkedOutput {
        /// `stage.port`.
        port: String,
    },
    /// An input port has more than one link.
    InputLinkedTwice {
        /// `stage.port`.
        port: String,
    },
    /// Links form a cycle not closed by a feedback link.
    Cycle {
        /// Stage names along the cycle, first repeated at the end.
        path: Vec<String>,
    },
    /// `feedback: true` on a link to a normal input, or a normal link to a feedback input.
    Feedback {
        /// The link as written.
        link: String,
        /// What is wrong.
        reason: String,
    },
    /// A link with capacity 0.
    ZeroCapacity {
        /// The link as written.
        link: String,
    },
    /// A stage cannot take what a link brings it (known before start, see
    /// [`Caps`](super::Caps)).
    Caps {
        /// The link, as `from.port -> to.port` (the stage's first input when several).
        link: String,
        /// The consuming stage.
        stage: String,
        /// What it needs and what it gets.
        reason: super::super::CapsError,
    },
}

/// A pipeline that cannot be built, with where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphError {
    /// The file (or other origin) of the pipeline, if known.
    pub origin: Option<String>,
    /// What is wrong.
    pub kind: Box<GraphErrorKind>,
}

impl fmt::Display for GraphError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(o) = &self.origin {
            write!(f, "{o}: ")?;
        }
        use GraphErrorKind::*;
        match &*self.kind {
            Empty => write!(f, "the pipeline has no stages"),
            DuplicateStage(s) => write!(f, "two stages are named `{s}`"),
            UnknownStage { link, stage } => {
                write!(f, "link `{link}`: there is no stage named `{stage}`")
            }
            UnknownPort {
                link,
                stage,
                dir,
                port: _,
                available,
            } if available.is_empty() => write!(
                f,
                "link `{link}`: stage `{stage}` has no {dir} port: it {}",
                if *dir == "input" {
                    "is a source, nothing can be linked into it"
                } else {
                    "is a sink, it emits nothing"
                }
            ),
            UnknownPort {
                link,
                stage,
                dir,
                port,
                available,
            } => write!(
                f,
                "link `{link}`: stage `{stage}` has no {dir} port `{port}` (it has: {})",
                list_or_none(available)
            ),
            AmbiguousPort {
                link,
                stage,
                dir,
                ports,
            } => write!(
                f,
                "link `{link}`: stage `{stage}` has several {dir} ports ({}): name one, as in `{stage}.{}`",
                ports.join(", "),
                ports.first().map(String::as_str).unwrap_or("port")
            ),
            TypeMismatch {
                link,
                from,
                from_type,
                to,
                to_type,
            } => write!(
                f,
                "link `{link}`: type mismatch: `{from}` emits {from_type} but `{to}` takes {to_type}"
            ),
            UnlinkedInput { port } => write!(f, "input `{port}` is not linked to anything"),
            UnlinkedOutput { port } => write!(
                f,
                "output `{port}` is not linked to anything (link it to a `null_sink` to discard it)"
            ),
            InputLinkedTwice { port } => write!(
                f,
                "input `{port}` has more than one link (an input takes one stream)"
            ),
            Cycle { path } => write!(
                f,
                "links form a cycle {}: only a link marked `feedback: true` into a feedback input may close a cycle",
                path.join(" -> ")
            ),
            Feedback { link, reason } => write!(f, "link `{link}`: {reason}"),
            ZeroCapacity { link } => write!(f, "link `{link}`: capacity must be at least 1"),
            Caps {
                link,
                stage,
                reason,
            } => write!(f, "link `{link}`: stage `{stage}` cannot take these frames: {reason}"),
        }
    }
}

impl std::error::Error for GraphError {}

pub(super) fn list_or_none(v: &[String]) -> String {
    if v.is_empty() {
        "none".to_string()
    } else {
        v.join(", ")
    }
}
