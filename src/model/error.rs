//! The model layer's error type: what is wrong, in which graph (and input or channel).

use std::path::PathBuf;

/// What went wrong in the model layer. Messages name the graph (and the input or channel).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// ONNX Runtime could not be loaded: install it or point `ORT_DYLIB_PATH` at it.
    #[error(transparent)]
    Runtime(#[from] super::ortlib::OrtLibError),
    /// A pack directory or one of its files is missing or unreadable.
    #[error("{}: {detail}", path.display())]
    Pack {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A value in `pack.yaml` is malformed, unknown, or does not match the graphs. Fix the
    /// manifest, or export the pack again.
    #[error("{}: `{key}`: {detail}", path.display())]
    Manifest {
        /// The manifest.
        path: PathBuf,
        /// The key at fault.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// A graph does not match the contract (wrong input name, dtype, rank, or the wrong kind of
    /// graph). Rebuild the pack with the exporter.
    #[error("{graph}: {detail}")]
    Contract {
        /// Graph (`temporal`, `depformer`, …) and file.
        graph: String,
        /// What does not match.
        detail: String,
    },
    /// A token id outside the table it indexes.
    #[error("{graph}: token {value} on channel {channel} is out of range 0..{limit}")]
    Token {
        /// Graph about to run.
        graph: String,
        /// Channel (0 = text, 1..=8 agent, 9..=16 user) or input name.
        channel: String,
        /// The id.
        value: i64,
        /// Table size.
        limit: i64,
    },
    /// The execution provider asked for cannot take effect.
    #[error("{graph}: execution provider `{provider}` is not available: {detail}")]
    Provider {
        /// Graph.
        graph: String,
        /// Provider asked for.
        provider: String,
        /// Why, and what to do.
        detail: String,
    },
    /// ONNX Runtime refused a graph file as invalid (an unknown operator, a malformed graph):
    /// export the pack again.
    #[error("{graph}: {detail}")]
    Invalid {
        /// Graph and file.
        graph: String,
        /// ONNX Runtime's message.
        detail: String,
    },
    /// Every slot of a shared engine is taken: the same configuration builds once a
    /// conversation has left.
    #[error("{graph}: {detail}")]
    Busy {
        /// Graph.
        graph: String,
        /// What is full.
        detail: String,
    },
    /// ONNX Runtime failed while creating or running a session (out of memory, a device
    /// failure): the same graph may load another time.
    #[error("{graph}: {detail}")]
    Ort {
        /// Graph.
        graph: String,
        /// ONNX Runtime's message.
        detail: String,
    },
}

impl ModelError {
    pub(crate) fn ort(graph: &str, e: impl std::fmt::Display) -> Self {
        ModelError::Ort {
            graph: graph.to_string(),
            detail: e.to_string(),
        }
    }

    pub(crate) fn contract(graph: &str, detail: impl Into<String>) -> Self {
        ModelError::Contract {
            graph: graph.to_string(),
            detail: detail.into(),
        }
    }
}

impl From<super::onnx::GraphFileError> for ModelError {
    /// A graph file that cannot be read, or whose weights are not all there: the pack's fault,
    /// naming the file.
    fn from(e: super::onnx::GraphFileError) -> Self {
        ModelError::Pack {
            path: e.path,
            detail: e.detail,
        }
    }
}
