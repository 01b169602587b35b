//! Params shared by the model stages, typed ([`ModelParams`]: the pack and the ONNX Runtime
//! session options; [`EngineParams`]: the LM stages' engine; [`CodecParams`]: the Mimi stages'
//! strategy), each declared once, and what they build.

use std::path::PathBuf;

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T};
use crate::model::pack::Pack;
use crate::model::session::{Provider, ReadyHook, SessionOptions};

use super::params::stage_params;
use super::BuildError;
use crate::runtime::StatusSpec;

/// The status key every model stage reports.
pub(super) const MODEL_STATUS: StatusSpec = StatusSpec {
    name: "model",
    doc: "what the graph really runs on: execution provider and dtype (`cpu f32`)",
};

/// The Mimi stages' codec strategy.
pub(super) const STREAMING: ParamSpec = ParamSpec {
    name: "streaming",
    ty: T::Choice(&["auto", "stateful", "window"]),
    default: D::Str("auto"),
    doc: "stateful: the pack's step graphs (one frame of work per frame, equal to offline coding); window: the whole-utterance graphs on the last `window` frames; auto: stateful when the pack has step graphs",
};
pub(super) const STEP_DTYPE: ParamSpec = ParamSpec {
    name: "step_dtype",
    ty: T::Choice(&["f32", "f16"]),
    default: D::Str("f32"),
    doc: "precision of the step graphs (stateful)",
};
pub(super) const WINDOW: ParamSpec = ParamSpec {
    name: "window",
    ty: T::Int { min: 1, max: 2048 },
    default: D::Int(8),
    doc: "frames of left context re-run per frame (window)",
};
pub(super) const CODEC_ENGINE: ParamSpec = ParamSpec {
    name: "engine",
    ty: T::Choice(&["own", "shared"]),
    default: D::Str("own"),
    doc: "own: a step graph of this pipeline's own; shared: the process's codec (weights loaded once, every conversation's frame in one batched call per tick; stateful step graphs with the `active` input)",
};
pub(super) const BATCH_WAIT: ParamSpec = ParamSpec {
    name: "batch_wait_ms",
    ty: T::Int { min: 0, max: 80 },
    default: D::Int(30),
    doc: "how long a shared codec's tick waits for the conversations whose next frame is due (more frames per call, at most this much more latency; the first stage to open the codec decides)",
};

/// Every model stage's pack and session.
pub(super) const PACK: ParamSpec = ParamSpec {
    name: "pack",
    ty: T::Dir,
    default: D::Required,
    doc: "model pack directory",
};
pub(super) const EXECUTION_PROVIDER: ParamSpec = ParamSpec {
    name: "execution_provider",
    ty: T::Choice(&["cpu", "cuda"]),
    default: D::Str("cpu"),
    doc: "where the graph runs",
};
pub(super) const DEVICE_ID: ParamSpec = ParamSpec {
    name: "device_id",
    ty: T::Int { min: 0, max: 64 },
    default: D::Int(0),
    doc: "GPU index (cuda)",
};
pub(super) const ALLOW_FALLBACK: ParamSpec = ParamSpec {
    name: "allow_fallback",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "run on the CPU (with a warning) when cuda cannot take effect",
};
pub(super) const INTRA_THREADS: ParamSpec = ParamSpec {
    name: "intra_threads",
    ty: T::Int { min: 0, max: 256 },
    default: D::Int(1),
    doc: "ONNX Runtime intra-op threads (0 = its default)",
};
pub(super) const SPINNING: ParamSpec = ParamSpec {
    name: "spinning",
    ty: T::Bool,
    default: D::Bool(false),
    doc: "let idle ONNX Runtime threads spin",
};

/// `engine`: the LM stages' choice between sessions of their own and the process's shared
/// engine.
pub(super) const ENGINE_PARAM: ParamSpec = ParamSpec {
    name: "engine",
    ty: T::Choice(&["own", "shared"]),
    default: D::Str("own"),
    doc: "own: graphs of this pipeline's own; shared: the process's engine (weights loaded once, every conversation stepped in one batched call per tick; GQA packs)",
};

/// `slots`: conversations the shared engine holds (the first stage to open it decides).
pub(super) const SLOTS_PARAM: ParamSpec = ParamSpec {
    name: "slots",
    ty: T::Int { min: 0, max: 4096 },
    default: D::Int(0),
    doc: "slots of the shared engine (0 = the conversations the process hosts: `duplex serve`'s `max_sessions`)",
};

stage_params! {
    /// Every model stage's params: its pack and where its graphs run.
    pub(super) struct ModelParams {
        pack: PathBuf = PACK,
        execution_provider: String = EXECUTION_PROVIDER,
        device_id: i32 = DEVICE_ID,
        allow_fallback: bool = ALLOW_FALLBACK,
        intra_threads: usize = INTRA_THREADS,
        spinning: bool = SPINNING,
    }
}

stage_params! {
    /// The LM stages' engine: their own sessions, or the process's shared engine.
    pub(super) struct EngineParams {
        engine: String = ENGINE_PARAM,
        slots: usize = SLOTS_PARAM,
    }
}

stage_params! {
    /// The Mimi stages' codec strategy and engine.
    pub(super) struct CodecParams {
        streaming: String = STREAMING,
        step_dtype: String = STEP_DTYPE,
        window: usize = WINDOW,
        engine: String = CODEC_ENGINE,
        slots: usize = SLOTS_PARAM,
        batch_wait_ms: u64 = BATCH_WAIT,
    }
}

/// Expands to a `&'static [ParamSpec]` of the given specs followed by [`ModelParams`]'s (the
/// pack and the session every model stage takes).
///
/// `model_params![codec; …]` puts [`CodecParams`]'s first (the Mimi stages').
macro_rules! model_params {
    (codec; $($spec:expr),* $(,)?) => {
        model_params![
            $crate::stages::model_params::STREAMING,
            $crate::stages::model_params::STEP_DTYPE,
            $crate::stages::model_params::WINDOW,
            $crate::stages::model_params::CODEC_ENGINE,
            $crate::stages::model_params::SLOTS_PARAM,
            $crate::stages::model_params::BATCH_WAIT,
            $($spec,)*
        ]
    };
    ($($spec:expr),* $(,)?) => {
        &[
            $($spec,)*
            $crate::stages::model_params::PACK,
            $crate::stages::model_params::EXECUTION_PROVIDER,
            $crate::stages::model_params::DEVICE_ID,
            $crate::stages::model_params::ALLOW_FALLBACK,
            $crate::stages::model_params::INTRA_THREADS,
            $crate::stages::model_params::SPINNING,
        ]
    };
}
pub(super) use model_params;

/// `cuda_graph: true` on a stage of the shared engine is refused, naming `engine`: the engine's
/// batch changes from tick to tick, and a CUDA graph replays one shape.
///
/// # Errors
///
/// [`BuildError`] naming the key.
pub(super) fn cuda_graph_needs_own_engine(
    e: &EngineParams,
    cuda_graph: bool,
) -> Result<(), BuildError> {
    if cuda_graph && e.engine == "shared" {
        return Err(BuildError::invalid(
            "`cuda_graph: true` needs `engine: own`: the shared engine's batch changes from tick to tick",
        )
        .key("engine"));
    }
    Ok(())
}

/// The session options from a model stage's params.
pub(super) fn session_options(m: &ModelParams) -> SessionOptions {
    SessionOptions {
        provider: match m.execution_provider.as_str() {
            "cuda" => Provider::Cuda {
                device_id: m.device_id,
            },
            _ => Provider::Cpu,
        },
        allow_fallback: m.allow_fallback,
        intra_threads: m.intra_threads,
        spinning: m.spinning,
        cuda_graph: false,
        on_ready: Some(ReadyHook(crate::observe::engine::model_info)),
    }
}

/// The `pack` param's pack: the process's (opened once), or opened for this stage alone.
pub(super) fn open_pack(
    cx: &super::BuildContext<'_>,
    m: &ModelParams,
) -> Result<std::sync::Arc<Pack>, BuildError> {
    cx.pack(&m.pack)
}

/// The process's shared engine for the stage's pack when `engine: shared`, else `None`.
pub(super) fn shared_engine(
    cx: &super::BuildContext<'_>,
    pack: &Pack,
    (m, e): (&ModelParams, &EngineParams),
    max_positions: usize,
) -> Result<Option<std::sync::Arc<crate::model::engine::SharedLm>>, BuildError> {
    if e.engine != "shared" {
        return Ok(None);
    }
    let opts = crate::model::engine::EngineOptions {
        session: session_options(m),
        slots: e.slots,
        max_positions,
        ..Default::default()
    };
    cx.resources
        .engine(pack, &opts)
        .map(Some)
        // Its kind kept: a graph the contract refuses is the pack's mistake, ONNX Runtime failing
        // to make a session (memory, the device) is unavailable.
        .map_err(|e| {
            let b = BuildError::from(e);
            if b.key.is_none() {
                b.key("engine")
            } else {
                b
            }
        })
}
