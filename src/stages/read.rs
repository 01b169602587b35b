//! What the apps read of a checked stage's params, through its kind's typed params (never by
//! name): a model stage's pack, whether a `temporal` stage primes `cached`, an `opus_decode`
//! stage's pacing. Another kind (or params its struct does not take) gives `None` / `false`.
//! Knows the stages' typed params; nothing of the apps that ask.

use std::path::PathBuf;

use crate::config::StageSpec;

/// A model stage's pack (`temporal`, `depformer`, `mimi_encode`, `mimi_decode`).
pub fn pack(s: &StageSpec) -> Option<PathBuf> {
    let model = [
        super::kind::TEMPORAL,
        super::depformer::KIND.name,
        super::mimi_encode::KIND.name,
        super::mimi_decode::KIND.name,
    ];
    if !model.contains(&s.kind.as_str()) {
        return None;
    }
    super::model_params::ModelParams::from_params(&s.params)
        .ok()
        .map(|m| m.pack)
}

/// Whether a `temporal` stage keeps its primed state in the process's cache
/// (`priming: cached`).
pub fn primes_cached(s: &StageSpec) -> bool {
    s.kind == super::kind::TEMPORAL
        && super::temporal::TemporalParams::from_params(&s.params)
            .is_ok_and(|t| t.priming == "cached")
}

/// An `opus_decode` stage's pacing: how many times real time (0: unpaced) and the
/// catch-up allowed ahead of it, in milliseconds.
pub fn decoder_pacing(s: &StageSpec) -> Option<(f64, u64)> {
    if s.kind != super::kind::OPUS_DECODE {
        return None;
    }
    super::opus::DecodeParams::from_params(&s.params)
        .ok()
        .map(|d| (d.max_speed, d.catch_up_ms))
}
