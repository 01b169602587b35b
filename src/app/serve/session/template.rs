//! The session template as each session gets it: the server's template with the
//! configuration's and the client's params over it, checked once at start (and at a reload),
//! with PCM ends for the transports that convert their own wire format, primed headless at
//! start. Knows nothing of connections or protocols.

use crate::app::serve::config::{ServeConfig, SessionParams};
use crate::config::{self as cfg, ConfigError, PipelineSpec};
use crate::stages::{kind, Registry};

/// The session pipeline's spec for one client: the template the server holds, with the
/// configuration's and the client's params set over it (typed, checked as the file's are; the
/// file is not read again), `{session}` replaced by `id`.
pub(crate) fn session_spec(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    params: &SessionParams,
    id: &str,
) -> Result<PipelineSpec, ConfigError> {
    let sets = cfg.session_overrides(template, registry, params);
    let mut spec = template.with_overrides(registry, &sets)?;
    for s in &mut spec.stages {
        s.params.substitute("{session}", id);
    }
    Ok(spec)
}

/// The session pipeline's spec with the configuration's defaults (no client's params), its
/// `{session}` replaced by `id`.
pub(crate) fn default_spec(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    id: &str,
) -> Result<PipelineSpec, ConfigError> {
    let params = cfg
        .session_params(&[])
        .map_err(|m| ConfigError::new(&cfg.file, cfg::ConfigErrorKind::Build, m))?;
    session_spec(cfg, template, registry, &params, id)
}

/// Builds one session of the template (not started) with the defaults: every stage checked,
/// the models loaded into `resources` (so the first client's session finds them there). For
/// start-up, `--check` and a reload. Returns the shared engines and codecs the session opened,
/// for the server to keep while it serves.
///
/// # Errors
///
/// A [`ConfigError`] naming the template (or the configuration key) at fault.
pub(crate) fn check_template(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    resources: &crate::resources::Resources,
) -> Result<crate::resources::Engines, ConfigError> {
    for (kind, what) in [
        ("session_in", "the client's audio"),
        ("session_audio_out", "the agent's audio for the client"),
    ] {
        if !template.stages.iter().any(|s| s.kind == kind) {
            return Err(ConfigError::new(
                &template.file,
                cfg::ConfigErrorKind::Link,
                format!(
                    "a session template needs a `{kind}` stage ({what}); see pipelines/serve.yaml"
                ),
            ));
        }
    }
    let spec = default_spec(cfg, template, registry, "check")?;
    let (_client, end) = crate::session::link(1, 1);
    let b = crate::app::build_session(&spec, registry, Some(&end), None, resources)?;
    // Held across the drop of the check's pipeline, so that the engines stay open.
    let engines = resources.open_engines();
    b.build()
        .map_err(|e| ConfigError::new(&spec.file, cfg::ConfigErrorKind::Link, e.to_string()))?;
    Ok(engines)
}

/// The template with PCM ends in place of its Ogg/Opus ones, for a transport that converts
/// its own wire format: `session_in → opus_decode` becomes one `session_pcm_in` (named as the
/// decoder, with the silence params of both; unpaced, since the transport pays for its audio
/// before decoding it, at the decoder's pace), `opus_encode → session_audio_out` one
/// `session_pcm_out` (named as the encoder). The model's part of the template is untouched.
///
/// # Errors
///
/// A [`ConfigError`] naming the template when it has no such ends.
pub(crate) fn pcm_ends(
    template: &PipelineSpec,
    registry: &Registry,
) -> Result<PipelineSpec, ConfigError> {
    let stage_of = |end: &str| end.split('.').next().unwrap_or_default().to_string();
    let kind_of = |spec: &PipelineSpec, name: &str| {
        spec.stages
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.kind.clone())
            .unwrap_or_default()
    };
    let missing = |what: &str| {
        ConfigError::new(
            &template.file,
            cfg::ConfigErrorKind::Link,
            format!(
                "the PCM transports (the realtime API, the telephone) need the template's {what}; \
                 see pipelines/serve.yaml"
            ),
        )
    };
    let input = template
        .stages
        .iter()
        .find(|s| s.kind == kind::SESSION_IN)
        .map(|s| s.name.clone())
        .ok_or_else(|| missing("`session_in` stage"))?;
    let decoder = template
        .links
        .iter()
        .find(|l| stage_of(&l.from) == input)
        .map(|l| stage_of(&l.to))
        .filter(|d| kind_of(template, d) == "opus_decode")
        .ok_or_else(|| missing("`session_in` feeding an `opus_decode` stage"))?;
    let spec = template.merge_pair(registry, &input, &decoder, &decoder, kind::SESSION_PCM_IN)?;
    let output = spec
        .stages
        .iter()
        .find(|s| s.kind == kind::SESSION_AUDIO_OUT)
        .map(|s| s.name.clone())
        .ok_or_else(|| missing("`session_audio_out` stage"))?;
    let encoder = spec
        .links
        .iter()
        .find(|l| stage_of(&l.to) == output)
        .map(|l| stage_of(&l.from))
        .filter(|e| kind_of(&spec, e) == kind::OPUS_ENCODE)
        .ok_or_else(|| missing("`opus_encode` stage feeding `session_audio_out`"))?;
    let spec = spec.merge_pair(registry, &encoder, &output, &encoder, kind::SESSION_PCM_OUT)?;
    // The transport paces what it takes (the connection's `AudioBudget`, charged before it
    // decodes anything, with the decoder's `max_speed` and `catch_up_ms`): pacing the same
    // audio twice would refuse a chunk as large as the allowance at the second budget, a
    // moment behind the first.
    spec.with_overrides(
        registry,
        &[cfg::ParamOverride::new(
            decoder,
            "max_speed",
            cfg::ParamValue::Float(0.0),
            "the connection's audio budget (paced before decoding)",
        )],
    )
}

/// Whether a session of `template` keeps its primed state in the process's cache (a
/// `temporal` stage with `priming: cached`).
pub(crate) fn primes_cached(template: &PipelineSpec) -> bool {
    template
        .stages
        .iter()
        .any(crate::stages::read::primes_cached)
}

/// Runs one session of the template with the defaults, headless (no client: nothing comes in,
/// what goes out is dropped), until it is primed, then stops it: the state its priming left is
/// in the process's cache for the first client with the same voice and persona. Returns how
/// long it took.
///
/// # Errors
///
/// The session's build error, or its run's when it ended before it was primed.
pub(crate) fn prime_at_start(
    cfg: &ServeConfig,
    template: &PipelineSpec,
    registry: &Registry,
    resources: &crate::resources::Resources,
) -> anyhow::Result<std::time::Duration> {
    let t0 = std::time::Instant::now();
    let spec = default_spec(cfg, template, registry, "prime")?;
    let (client, end) = crate::session::link(8, 8);
    let b = crate::app::build_session(&spec, registry, Some(&end), None, resources)?;
    let running = b.build()?.start();
    let handle = running.handle();
    let run = std::thread::Builder::new()
        .name("duplex:prime".into())
        .spawn(move || running.wait())?;
    while !handle.is_ready() && !run.is_finished() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let primed = handle.is_ready();
    handle.stop();
    drop(client);
    let outcome = run
        .join()
        .map_err(|_| anyhow::anyhow!("the priming session's thread panicked"))?;
    if !primed {
        outcome.into_result()?;
        anyhow::bail!("the priming session ended before it was primed");
    }
    Ok(t0.elapsed())
}
