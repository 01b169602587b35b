//! Params shared by the model stages: the pack and the ONNX Runtime session options.

use std::path::Path;

use crate::config::Params;
use crate::model::pack::Pack;
use crate::model::session::{Provider, SessionOptions};

use super::BuildError;
use crate::runtime::StatusSpec;

/// The status key every model stage reports.
pub(super) const MODEL_STATUS: StatusSpec = StatusSpec {
    name: "model",
    doc: "what the graph really runs on: execution provider and dtype (`cpu f32`)",
};

/// Expands to a `&'static [ParamSpec]` of the given specs followed by the pack and session
/// params every model stage takes.
macro_rules! model_params {
    ($($spec:expr),* $(,)?) => {
        &[
            $($spec,)*
            ParamSpec { name: "pack", ty: T::Dir, default: D::Required, doc: "model pack directory" },
            ParamSpec { name: "execution_provider", ty: T::Choice(&["cpu", "cuda"]), default: D::Str("cpu"), doc: "where the graph runs" },
            ParamSpec { name: "device_id", ty: T::Int { min: 0, max: 64 }, default: D::Int(0), doc: "GPU index (cuda)" },
            ParamSpec { name: "allow_fallback", ty: T::Bool, default: D::Bool(false), doc: "run on the CPU (with a warning) when cuda cannot take effect" },
            ParamSpec { name: "intra_threads", ty: T::Int { min: 0, max: 256 }, default: D::Int(1), doc: "ONNX Runtime intra-op threads (0 = its default)" },
            ParamSpec { name: "spinning", ty: T::Bool, default: D::Bool(false), doc: "let idle ONNX Runtime threads spin" },
        ]
    };
}
pub(super) use model_params;

/// The session options from a model stage's params.
pub(super) fn session_options(p: &Params) -> SessionOptions {
    SessionOptions {
        provider: match p.str("execution_provider") {
            "cuda" => Provider::Cuda {
                device_id: p.int("device_id") as i32,
            },
            _ => Provider::Cpu,
        },
        allow_fallback: p.bool("allow_fallback"),
        intra_threads: p.int("intra_threads") as usize,
        spinning: p.bool("spinning"),
    }
}

/// Opens the `pack` param's directory.
pub(super) fn open_pack(p: &Params) -> Result<Pack, BuildError> {
    Ok(Pack::open(Path::new(p.str("pack")))?)
}
