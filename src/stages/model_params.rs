//! Params shared by the model stages: the pack and the ONNX Runtime session options.

use std::path::Path;

use crate::config::Params;
use crate::model::pack::Pack;
use crate::model::session::{Provider, ReadyHook, SessionOptions};

use super::BuildError;
use crate::runtime::StatusSpec;

/// The status key every model stage reports.
pub(super) const MODEL_STATUS: StatusSpec = StatusSpec {
    name: "model",
    doc: "what the graph really runs on: execution provider and dtype (`cpu f32`)",
};

/// Expands to a `&'static [ParamSpec]` of the given specs followed by the pack and session
/// params every model stage takes.
///
/// `model_params![codec; …]` adds the codec strategy's params first (`streaming`,
/// `step_dtype`, `window`: the Mimi stages').
macro_rules! model_params {
    (codec; $($spec:expr),* $(,)?) => {
        model_params![
            ParamSpec {
                name: "streaming",
                ty: T::Choice(&["auto", "stateful", "window"]),
                default: D::Str("auto"),
                doc: "stateful: the pack's step graphs (one frame of work per frame, equal to offline coding); window: the whole-utterance graphs on the last `window` frames; auto: stateful when the pack has step graphs",
            },
            ParamSpec {
                name: "step_dtype",
                ty: T::Choice(&["f32", "f16"]),
                default: D::Str("f32"),
                doc: "precision of the step graphs (stateful)",
            },
            ParamSpec {
                name: "window",
                ty: T::Int { min: 1, max: 2048 },
                default: D::Int(8),
                doc: "frames of left context re-run per frame (window)",
            },
            ParamSpec {
                name: "engine",
                ty: T::Choice(&["own", "shared"]),
                default: D::Str("own"),
                doc: "own: a step graph of this pipeline's own; shared: the process's codec (weights loaded once, every conversation's frame in one batched call per tick; stateful step graphs with the `active` input)",
            },
            $crate::stages::model_params::SLOTS_PARAM,
            ParamSpec {
                name: "batch_wait_ms",
                ty: T::Int { min: 0, max: 80 },
                default: D::Int(30),
                doc: "how long a shared codec's tick waits for the conversations whose next frame is due (more frames per call, at most this much more latency; the first stage to open the codec decides)",
            },
            $($spec,)*
        ]
    };
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

/// `cuda_graph: true` on a stage of the shared engine is refused, naming `engine`: the engine's
/// batch changes from tick to tick, and a CUDA graph replays one shape.
///
/// # Errors
///
/// [`BuildError`] naming the key.
pub(super) fn cuda_graph_needs_own_engine(p: &Params, cuda_graph: bool) -> Result<(), BuildError> {
    if cuda_graph && p.str("engine") == "shared" {
        return Err(BuildError::invalid(
            "`cuda_graph: true` needs `engine: own`: the shared engine's batch changes from tick to tick",
        )
        .key("engine"));
    }
    Ok(())
}

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
        cuda_graph: false,
        on_ready: Some(ReadyHook(crate::observe::engine::model_info)),
    }
}

/// The `pack` param's pack: the process's (opened once), or opened for this stage alone.
pub(super) fn open_pack(
    cx: &super::BuildContext<'_>,
    p: &Params,
) -> Result<std::sync::Arc<Pack>, BuildError> {
    cx.pack(Path::new(p.str("pack")))
}

/// `engine`: the LM stages' choice between sessions of their own and the process's shared
/// engine.
pub(super) const ENGINE_PARAM: crate::config::ParamSpec = crate::config::ParamSpec {
    name: "engine",
    ty: crate::config::ParamType::Choice(&["own", "shared"]),
    default: crate::config::ParamDefault::Str("own"),
    doc: "own: graphs of this pipeline's own; shared: the process's engine (weights loaded once, every conversation stepped in one batched call per tick; GQA packs)",
};

/// `slots`: conversations the shared engine holds (the first stage to open it decides).
pub(super) const SLOTS_PARAM: crate::config::ParamSpec = crate::config::ParamSpec {
    name: "slots",
    ty: crate::config::ParamType::Int { min: 0, max: 4096 },
    default: crate::config::ParamDefault::Int(0),
    doc: "slots of the shared engine (0 = the conversations the process hosts: `duplex serve`'s `max_sessions`)",
};

/// The process's shared engine for the stage's pack when `engine: shared`, else `None`.
pub(super) fn shared_engine(
    cx: &super::BuildContext<'_>,
    pack: &Pack,
    p: &Params,
    max_positions: usize,
) -> Result<Option<std::sync::Arc<crate::model::engine::SharedLm>>, BuildError> {
    if p.str("engine") != "shared" {
        return Ok(None);
    }
    let opts = crate::model::engine::EngineOptions {
        session: session_options(p),
        slots: p.int("slots") as usize,
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
