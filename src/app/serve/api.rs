//! The server's JSON and health endpoints: `/readyz` (whether a session would be admitted
//! now), `/api/defaults` (what the page needs: the defaults, never the persona's text),
//! `/api/voices` and `/api/sessions` (each live session's figures). Read-only.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::Server;

/// `/readyz`: 200 while a session would be admitted now (not draining, the models loaded, a
/// slot free, no shared engine failed), 503 with the reason otherwise.
pub(super) async fn readyz(State(server): State<Arc<Server>>) -> Response {
    let ready = server.ready.load(Ordering::Acquire);
    let draining = server.draining.load(Ordering::Acquire);
    let free = server.free_slots();
    let failed = server.engine_failed();
    let ok = server.accepting() && free > 0;
    let body = json!({
        "ready": ok,
        "engine_failed": failed,
        "models_loaded": ready,
        "draining": draining,
        "sessions": server.taken.load(Ordering::Acquire),
        "capacity": server.capacity,
    });
    if ok {
        (StatusCode::OK, axum::Json(body)).into_response()
    } else {
        let retry = if draining { 30 } else { 5 };
        (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, retry.to_string())],
            axum::Json(body),
        )
            .into_response()
    }
}

/// `/api/defaults`: what a client that sends no query parameters gets. The default persona's
/// text is the operator's (a system prompt): only whether there is one is published.
pub(super) async fn defaults(State(server): State<Arc<Server>>) -> Response {
    let c = &server.cfg;
    axum::Json(json!({
        "text_temperature": c.sampling.text_temperature,
        "text_topk": c.sampling.text_top_k,
        "audio_temperature": c.sampling.audio_temperature,
        "audio_topk": c.sampling.audio_top_k,
        "pad_mult": c.sampling.pad_mult,
        "repetition_penalty": c.sampling.repetition_penalty,
        "repetition_penalty_context": c.sampling.repetition_penalty_context,
        "max_steps": c.max_steps,
        "default_persona": !c.text_prompt.trim().is_empty(),
        "voice_prompt": c.voice_prompt,
        "max_prompt_tokens": c.limits.max_prompt_tokens,
        "webrtc": server.webrtc.as_ref().map(|w| w.page_settings()),
    }))
    .into_response()
}

/// `/api/voices`: the voices a client may name with `voice_prompt` (the WAV files of the voices
/// folder that passed the voice check at start).
pub(super) async fn voices(State(server): State<Arc<Server>>) -> Response {
    axum::Json(json!({ "voices": server.voices })).into_response()
}

/// `/api/sessions`: each live session's figures (its age, frames, latency, verdicts, the
/// transport's counters; the client's address only to a caller with a key, or on loopback).
pub(super) async fn sessions(State(server): State<Arc<Server>>) -> Response {
    use crate::session::LinkStats as L;
    // Clients' addresses only to a caller who presented a key, or on a loopback server.
    let show_clients = server.cfg.keys.any() || server.cfg.address.ip().is_loopback();
    let list: Vec<serde_json::Value> = match server.sessions.lock() {
        Ok(m) => m
            .iter()
            .map(|(id, l)| {
                let status = l.handle.as_ref().map(|h| h.control().status());
                let frames = status
                    .as_ref()
                    .and_then(|s| {
                        s.values()
                            .find_map(|st| st.get("agent_frames").map(|v| v.to_json()))
                    })
                    .unwrap_or(json!(0));
                // How the session's state was primed (cached, chunked, stepped), and how long
                // it took.
                let find = |k: &str| {
                    status
                        .as_ref()
                        .and_then(|s| s.values().find_map(|st| st.get(k).map(|v| v.to_json())))
                };
                let priming = json!({ "how": find("priming"), "ms": find("priming_ms") });
                let verdicts: serde_json::Map<String, serde_json::Value> = l
                    .monitor
                    .as_ref()
                    .map(|m| {
                        m.verdicts()
                            .into_iter()
                            .map(|(s, p)| (s, json!(p.name())))
                            .collect()
                    })
                    .unwrap_or_default();
                json!({
                    "id": id,
                    "client": show_clients.then(|| l.peer.to_string()),
                    "key": l.key,
                    "age_s": l.started.elapsed().as_secs_f64(),
                    "ready": l.handle.as_ref().is_some_and(|h| h.is_ready()),
                    "frames": frames,
                    "priming": priming,
                    "realtime_factor": l.monitor.as_ref().map(|m| m.realtime_factor()),
                    "verdicts": verdicts,
                    "silence_frames": L::get(&l.stats.silence_frames),
                    "dropped_in": L::get(&l.stats.dropped_in),
                    "late_frames": L::get(&l.stats.late_frames),
                    "dropped_out": L::get(&l.stats.dropped_out),
                    "bytes_in": L::get(&l.stats.bytes_in),
                    "bytes_out": L::get(&l.stats.bytes_out),
                    "server_latency_ms": L::get(&l.stats.latency_us) as f64 / 1000.0,
                    "transport": l.transport.as_ref().map(|t| t()),
                })
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    axum::Json(json!({
        "sessions": list,
        "capacity": server.capacity,
        "draining": server.draining.load(Ordering::Acquire),
    }))
    .into_response()
}
