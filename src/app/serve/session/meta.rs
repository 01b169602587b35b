//! What a client is told about its session: the metadata message (Kyutai's `ServerInfo` fields,
//! then duplex's own) and, when its session could not start, a reason in its own words (its
//! parameter, its voice), never the server's paths.

use super::super::config::SessionParams;
use super::super::Server;
use crate::config::ConfigError;

/// What a client is told when its session could not start: its own mistake when it made one
/// (a persona or voice the template's stage refused), else that the server failed, with the
/// session's id to find the details in the log. Never the server's paths.
pub(super) fn for_client(e: &anyhow::Error, id: u64) -> String {
    if let Some(c) = e.downcast_ref::<ConfigError>() {
        let from_client = match c.key.as_deref() {
            Some("persona") | Some("persona_tokens") => Some("text_prompt"),
            Some("voice") => Some("voice_prompt"),
            _ => None,
        };
        if let Some(param) = from_client {
            // The stage's message names the file it read; the client knows its voice by name.
            // The stage's limits are the server's own settings (`session_overrides`): named
            // as the operator wrote them.
            let msg = match param {
                "voice_prompt" => "not a usable voice".to_string(),
                _ => c.message.replace(
                    "`max_persona_tokens`",
                    "the server's `limits.max_prompt_tokens`",
                ),
            };
            return format!("query parameter {param}: {msg}");
        }
    }
    format!("the session could not start: a server error (logged as session {id})")
}

/// The build facts of Kyutai's `build_info`, captured by `build.rs`.
fn build_info() -> serde_json::Value {
    serde_json::json!({
        "build_timestamp": env!("DUPLEX_BUILD_TIMESTAMP"),
        "build_date": env!("DUPLEX_BUILD_DATE"),
        "git_branch": env!("DUPLEX_GIT_BRANCH"),
        "git_timestamp": env!("DUPLEX_GIT_TIMESTAMP"),
        "git_date": env!("DUPLEX_GIT_DATE"),
        "git_hash": env!("DUPLEX_GIT_HASH"),
        "git_describe": env!("DUPLEX_GIT_DESCRIBE"),
        "rustc_host_triple": env!("DUPLEX_RUSTC_HOST_TRIPLE"),
        "rustc_version": env!("DUPLEX_RUSTC_VERSION"),
        "cargo_target_triple": env!("DUPLEX_CARGO_TARGET_TRIPLE"),
    })
}

/// The metadata message (kind 4), sent right after the handshake: the fields of the
/// `ServerInfo` Kyutai's web client validates (the session's sampling, the LM's graph, the
/// instance, the build), then duplex's own (the session id, the server's name and version, the
/// session's other effective settings). `lm_model_file` is the pack's temporal graph under the
/// pack's folder name: what model, not where the server keeps it.
pub(super) fn metadata(server: &Server, params: &SessionParams, id: u64) -> serde_json::Value {
    let sm = &params.sampling;
    let pack = server.cfg.pack.clone().or_else(|| {
        server
            .template()
            .stages
            .iter()
            .find(|s| s.kind == crate::stages::kind::TEMPORAL)
            .and_then(crate::stages::read::pack)
            .map(|p| p.to_string_lossy().into_owned())
    });
    let lm_model_file = pack.map_or_else(
        || "unknown".to_string(),
        |p| {
            let name = std::path::Path::new(&p)
                .file_name()
                .map_or_else(|| p.clone(), |n| n.to_string_lossy().into_owned());
            format!("{name}/temporal/model.onnx")
        },
    );
    serde_json::json!({
        "text_temperature": sm.text_temperature,
        "text_topk": sm.text_top_k,
        "audio_temperature": sm.audio_temperature,
        "audio_topk": sm.audio_top_k,
        "pad_mult": sm.pad_mult,
        "repetition_penalty_context": sm.repetition_penalty_context,
        "repetition_penalty": sm.repetition_penalty,
        "lm_model_file": lm_model_file,
        "instance_name": server.cfg.instance_name,
        "build_info": build_info(),
        "session": id,
        "server": "duplex",
        "version": env!("CARGO_PKG_VERSION"),
        "text_seed": sm.text_seed,
        "audio_seed": sm.audio_seed,
        "max_steps": params.max_steps,
        "persona": !params.text_prompt.trim().is_empty(),
        "voice_prompt": params.voice.as_ref().and_then(|v| v.file_name()).map(|n| n.to_string_lossy().into_owned()),
    })
}
