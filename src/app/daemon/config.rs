//! The daemon's configuration: where it is read from, what each key means, and every check
//! that start-up, `--check` and a reload run on it before anything is touched.
//!
//! Layers (each over the one before): `configs/daemon.yaml` (built in), the user's file
//! (`--config`, `$XDG_CONFIG_HOME/duplex/daemon.yaml`, `~/.config/duplex/daemon.yaml`),
//! `DUPLEX__…` environment variables. The configuration becomes overrides of the live
//! pipeline file ([`DaemonConfig::sets`]) whose origin is the daemon key they stand for, so a
//! value the pipeline refuses is reported against the daemon's file and key. The keys are read
//! through the configuration layer's one typed reader ([`Fields`]); `ort.library` (the ONNX
//! Runtime library, [`ort`](crate::config::ort)) is set over the pipeline file's like the
//! rest. Knows nothing of how the daemon runs.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use config::{Map, Value, ValueKind};

use crate::config::fields::{ExecutionProvider, Fields};
use crate::config::params::{as_i64, as_string, describe};
pub use crate::config::sampling::Sampling;
use crate::config::{
    layers, ConfigError, ConfigErrorKind, LoadOptions, OrtChoice, Override, PipelineSpec,
};
use crate::stages::{kind, Registry};

/// The echo canceller's stage in the daemon's pipeline file (`echo_cancel` switches it).
pub const AEC_STAGE: &str = "aec";
/// The stages of the daemon's pipeline file its settings reach: the microphone
/// (`input_device`), the speaker (`output_device`), the LM (persona, voice, `max_steps`,
/// `long_session`; its status), and every model stage (`pack`, `execution_provider`).
pub const MIC_STAGE: &str = "mic";
/// See [`MIC_STAGE`].
pub const SPEAKER_STAGE: &str = "speaker";
/// See [`MIC_STAGE`].
pub const LM_STAGE: &str = "temporal";
/// See [`MIC_STAGE`].
pub const MODEL_STAGES: [&str; 4] = ["encode", LM_STAGE, "depformer", "decode"];

/// The defaults (the text of `configs/daemon.yaml`).
pub const DEFAULTS_YAML: &str = include_str!("../../../configs/daemon.yaml");

/// The origin of the built-in defaults in messages.
const DEFAULTS_ORIGIN: &str = "configs/daemon.yaml (built in)";

/// A checked daemon configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct DaemonConfig {
    /// Where the user's settings came from (`defaults` when there is no file).
    pub file: String,
    /// The live pipeline file.
    pub pipeline: PathBuf,
    /// The model pack.
    pub pack: String,
    /// Where the model stages run.
    pub execution_provider: ExecutionProvider,
    /// Input device.
    pub input_device: String,
    /// Output device.
    pub output_device: String,
    /// Persona text.
    pub persona: String,
    /// Persona token ids.
    pub persona_tokens: Vec<i64>,
    /// SentencePiece model.
    pub tokenizer: String,
    /// Voice prompt WAV.
    pub voice: String,
    /// Sampling.
    pub sampling: Sampling,
    /// Long-session policy.
    pub long_session: String,
    /// End the conversation (and the daemon) after this many agent frames; 0 = never.
    pub max_steps: i64,
    /// Echo cancellation: `auto` (on unless the devices are a headset), `on` or `off`.
    pub echo_cancel: String,
    /// `/metrics` and `/healthz`.
    pub metrics_address: Option<std::net::SocketAddr>,
    /// Control socket path.
    pub control_socket: PathBuf,
    /// Whether conversations are recorded (`record`, and `ctl record on|off`).
    pub record: bool,
    /// Where they are recorded.
    pub record_dir: PathBuf,
    /// Primed states loaded at start and saved at exit (`prime_cache_file`).
    pub prime_cache_file: Option<PathBuf>,
    /// The ONNX Runtime library `ort.library` chooses, set over the pipeline file's (`None`:
    /// the pipeline file's, else the search of [`ortlib`](crate::model::ortlib)).
    pub ort_library: Option<OrtChoice>,
    /// Where each key's value came from, in words (`FILE: `persona``, `environment variable
    /// DUPLEX__PACK`), for messages.
    pub origins: BTreeMap<String, String>,
}

const KEYS: &[&str] = &[
    "pipeline",
    "pack",
    "execution_provider",
    "input_device",
    "output_device",
    "persona",
    "persona_tokens",
    "tokenizer",
    "voice",
    "sampling",
    "long_session",
    "max_steps",
    "echo_cancel",
    "metrics_address",
    "control_socket",
    "record",
    "record_dir",
    "prime_cache_file",
    crate::config::ort::SECTION,
];

/// The user's config file: `explicit`, else `$XDG_CONFIG_HOME/duplex/daemon.yaml`, else
/// `~/.config/duplex/daemon.yaml`, when it exists.
pub fn config_path(explicit: Option<&Path>) -> Option<PathBuf> {
    layers::user_file(explicit, "daemon.yaml")
}

/// `$XDG_STATE_HOME/duplex/recordings`, else `~/.local/state/duplex/recordings`.
fn default_recordings() -> PathBuf {
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir);
    state.join("duplex").join("recordings")
}

fn default_socket() -> PathBuf {
    let run = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("duplex-{}", uid())));
    run.join("duplex/control.sock")
}

fn uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(0)
}

/// The layers merged: (file name for messages, root map).
fn layered(
    explicit: Option<&Path>,
    env: Option<&HashMap<String, String>>,
) -> Result<(String, Map<String, Value>), ConfigError> {
    layers::layered(DEFAULTS_YAML, DEFAULTS_ORIGIN, explicit, "daemon.yaml", env)
}

/// The control socket the configuration names, without checking anything else (what
/// `duplex ctl` needs, from any directory, even when other keys are wrong).
///
/// # Errors
///
/// When the configuration file cannot be read or parsed, or `control_socket` is not a string.
pub fn control_socket(
    explicit: Option<&Path>,
    env: Option<&HashMap<String, String>>,
) -> Result<PathBuf, ConfigError> {
    let (fname, root) = layered(explicit, env)?;
    match root.get("control_socket") {
        None => Ok(default_socket()),
        Some(v) => match (&v.kind, as_string(v)) {
            (ValueKind::Nil, _) => Ok(default_socket()),
            (_, Some(s)) if s.trim().is_empty() => Ok(default_socket()),
            (_, Some(s)) => Ok(PathBuf::from(s)),
            (_, None) => Err(ConfigError::new(
                &fname,
                ConfigErrorKind::WrongType,
                format!("expected a path, got {}", describe(v)),
            )
            .key("control_socket")
            .from_value(v)),
        },
    }
}

/// Loads and checks the daemon configuration.
///
/// # Errors
///
/// A [`ConfigError`] naming the file (or the environment variable) and the key.
pub fn load_config(
    explicit: Option<&Path>,
    env: Option<HashMap<String, String>>,
) -> Result<DaemonConfig, ConfigError> {
    let (fname, root) = layered(explicit, env.as_ref())?;
    let f = Fields::new(&fname, DEFAULTS_ORIGIN, &root);
    f.known(KEYS)?;
    let origins: BTreeMap<String, String> = f.origins().into_iter().collect();
    let persona_tokens = persona_tokens(&f)?;
    // The depformer's params of the same names, a seed of its own range (no fresh seeds).
    let sampling = Sampling::read(&f.table("sampling")?, &Registry::builtin(), false)?;
    let max_steps = match f.get("max_steps") {
        Some(v) if f.is_set("max_steps") => {
            param_value(&f, kind::TEMPORAL, "max_steps", v)?;
            as_i64(v).unwrap_or_default()
        }
        _ => 0,
    };
    let execution_provider = f
        .provider("execution_provider")?
        .unwrap_or(ExecutionProvider::Cpu);
    let long_session = f.one_of(
        "long_session",
        f.string("long_session")?,
        &["reset_and_reprime", "stop"],
    )?;
    // `on`/`off` or YAML's true/false.
    let echo_cancel = match f.get("echo_cancel").map(|v| &v.kind) {
        None | Some(ValueKind::Nil) => "auto".to_string(),
        Some(ValueKind::Boolean(b)) => if *b { "on" } else { "off" }.to_string(),
        _ => f.string("echo_cancel")?,
    };
    let echo_cancel = f.one_of("echo_cancel", echo_cancel, &["auto", "on", "off"])?;
    let metrics_address = f.address("metrics_address", "127.0.0.1:9187")?;
    let sock = f.string("control_socket")?;
    let record = f.boolean("record")?;
    let record_dir = match f.string("record_dir")?.trim() {
        "" => default_recordings(),
        d => PathBuf::from(d),
    };
    let pipeline = PathBuf::from(f.string("pipeline")?);
    if let Err(err) = crate::files::check_regular(&pipeline) {
        return Err(f.err(
            ConfigErrorKind::Read,
            "pipeline",
            format!("pipeline file {}: {err}", pipeline.display()),
        ));
    }
    let ort_library = crate::config::ort::read(&f)?;
    Ok(DaemonConfig {
        file: fname.clone(),
        pipeline,
        pack: f.string("pack")?,
        execution_provider,
        input_device: f.string("input_device")?,
        output_device: f.string("output_device")?,
        persona: f.string("persona")?,
        persona_tokens,
        tokenizer: f.string("tokenizer")?,
        voice: f.string("voice")?,
        sampling,
        long_session,
        max_steps,
        echo_cancel,
        metrics_address,
        control_socket: if sock.trim().is_empty() {
            default_socket()
        } else {
            PathBuf::from(sock)
        },
        record,
        record_dir,
        prime_cache_file: Some(f.string("prime_cache_file")?)
            .filter(|p| !p.trim().is_empty())
            .map(PathBuf::from),
        ort_library,
        origins,
    })
}

/// `persona_tokens`: a list of integers (from the environment: one string, comma-separated).
fn persona_tokens(f: &Fields<'_>) -> Result<Vec<i64>, ConfigError> {
    const KEY: &str = "persona_tokens";
    let bad = |m: String| f.err(ConfigErrorKind::WrongType, KEY, m);
    let Some(v) = f.get(KEY) else {
        return Ok(Vec::new());
    };
    match &v.kind {
        ValueKind::Nil => Ok(Vec::new()),
        ValueKind::Array(a) => a
            .iter()
            .map(|v| {
                as_i64(v).ok_or_else(|| {
                    bad(format!(
                        "expected integers, like [10, 20], got {}",
                        describe(v)
                    ))
                })
            })
            .collect(),
        ValueKind::String(s) => s
            .split(',')
            .filter(|t| !t.trim().is_empty())
            .map(|t| {
                t.trim().parse().map_err(|_| {
                    bad(format!(
                        "{:?} is not an integer (write a list, like [10, 20], or 10,20)",
                        t.trim()
                    ))
                })
            })
            .collect(),
        _ => Err(bad(format!(
            "expected a list of integers, like [10, 20], got {}",
            describe(v)
        ))),
    }
}

/// `v` checked as the `kind` stage's param `k` is (see [`Fields::param_value`]).
fn param_value(f: &Fields<'_>, kind: &str, k: &str, v: &Value) -> Result<f64, ConfigError> {
    f.param_value(&Registry::builtin(), kind, k, v)
}

impl DaemonConfig {
    /// Where `key`'s value came from, in words.
    pub fn origin(&self, key: &str) -> String {
        self.origins
            .get(key)
            .cloned()
            .unwrap_or_else(|| format!("{}: `{key}`", self.file))
    }

    /// An error about the daemon's `key`: it names the daemon's file and the key, led by the
    /// layer the value came from when that is not the file (the built-in defaults, a variable).
    pub fn error(&self, key: &str, kind: ConfigErrorKind, message: String) -> ConfigError {
        let mut err = ConfigError::new(&self.file, kind, message).key(key);
        let origin = self.origin(key);
        if !origin.starts_with(&format!("{}: ", self.file)) {
            err.origin = Some(origin.into());
        }
        err
    }

    /// The overrides of the pipeline file this configuration stands for, each blaming the
    /// daemon key it comes from.
    pub fn sets(&self) -> Vec<Override> {
        let set = |daemon_key: &str, key: &str, value: String| {
            Override::by(self.origin(daemon_key), key, value)
        };
        let mut v = vec![
            set(
                "input_device",
                &format!("stages.{MIC_STAGE}.device"),
                self.input_device.clone(),
            ),
            set(
                "output_device",
                &format!("stages.{SPEAKER_STAGE}.device"),
                self.output_device.clone(),
            ),
            set(
                "long_session",
                &format!("stages.{LM_STAGE}.long_session"),
                self.long_session.clone(),
            ),
            set(
                "max_steps",
                &format!("stages.{LM_STAGE}.max_steps"),
                self.max_steps.to_string(),
            ),
            // The daemon serves metrics itself.
            Override::by("duplex daemon", "metrics.address", String::new()),
        ];
        for s in MODEL_STAGES {
            v.push(set("pack", &format!("stages.{s}.pack"), self.pack.clone()));
            v.push(set(
                "execution_provider",
                &format!("stages.{s}.execution_provider"),
                self.execution_provider.name().to_string(),
            ));
        }
        for (k, val) in [
            ("persona", &self.persona),
            ("tokenizer", &self.tokenizer),
            ("voice", &self.voice),
        ] {
            if !val.is_empty() {
                // Quoted: a persona text is text, whatever YAML would make of it.
                let quoted = format!("'{}'", val.replace('\'', "''"));
                v.push(set(k, &format!("stages.{LM_STAGE}.{k}"), quoted));
            }
        }
        if !self.persona_tokens.is_empty() {
            let t: Vec<String> = self.persona_tokens.iter().map(|t| t.to_string()).collect();
            v.push(set(
                "persona_tokens",
                &format!("stages.{LM_STAGE}.persona_tokens"),
                format!("[{}]", t.join(", ")),
            ));
        }
        for (k, val) in self.sampling.params() {
            v.push(set(
                &format!("sampling.{k}"),
                &format!("stages.depformer.{k}"),
                val.to_string(),
            ));
        }
        if self.record {
            v.push(set(
                "record_dir",
                "record.dir",
                self.record_dir.display().to_string(),
            ));
        }
        if let Some(lib) = &self.ort_library {
            // Quoted: a path is text, whatever YAML would make of it.
            let quoted = format!("'{}'", lib.path.display().to_string().replace('\'', "''"));
            v.push(Override::by(lib.origin.clone(), "ort.library", quoted));
        }
        v
    }

    /// The live pipeline's spec with this configuration's overrides, for checking: `auto`
    /// counts as on without probing the devices (the pipeline that runs is built from
    /// [`pipeline_spec_with`](Self::pipeline_spec_with) and [`echo_decision`](Self::echo_decision),
    /// which probes them once).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] blaming the daemon key when the pipeline refuses one of its values.
    pub fn pipeline_spec(&self) -> Result<PipelineSpec, ConfigError> {
        let unprobed = self.echo_cancel != "off";
        self.pipeline_spec_with(&(unprobed, format!("echo_cancel: {}", self.echo_cancel)))
    }

    /// [`pipeline_spec`](Self::pipeline_spec) with the echo canceller on or off as `echo`
    /// (from [`echo_decision`](Self::echo_decision)) says.
    ///
    /// # Errors
    ///
    /// As [`pipeline_spec`](Self::pipeline_spec).
    pub fn pipeline_spec_with(&self, echo: &(bool, String)) -> Result<PipelineSpec, ConfigError> {
        let load = |sets| {
            let opts = LoadOptions {
                sets,
                env: Some(HashMap::new()),
            };
            crate::config::load(&self.pipeline, &opts, &Registry::builtin())
        };
        let spec = load(self.sets()).map_err(|e| self.blame_the_file(e, || load(Vec::new())))?;
        let has_aec = spec.stages.iter().any(|s| s.name == AEC_STAGE);
        let (enabled, why) = echo;
        if !has_aec {
            if self.echo_cancel == "on" {
                return Err(ConfigError::new(
                    &self.file,
                    ConfigErrorKind::Conflict,
                    format!(
                        "`on` needs an `{AEC_STAGE}` stage in the pipeline file {}",
                        self.pipeline.display()
                    ),
                )
                .key("echo_cancel"));
            }
            return Ok(spec);
        }
        let mut sets = self.sets();
        sets.push(Override::by(
            format!("{} ({why})", self.origin("echo_cancel")),
            format!("stages.{AEC_STAGE}.enabled"),
            enabled.to_string(),
        ));
        load(sets)
    }

    /// `e`, an error loading the pipeline file with this configuration's values set over it,
    /// led by the file when the fault is the file's: the daemon's values blamed for a stage the
    /// file gets wrong the same way on its own (`alone` loads it so), or for a stage that has
    /// no `kind` (the daemon sets params, never a kind: the file lacks the stage, or its kind).
    fn blame_the_file(
        &self,
        e: ConfigError,
        alone: impl FnOnce() -> Result<PipelineSpec, ConfigError>,
    ) -> ConfigError {
        let Some(origin) = e.origin.clone() else {
            return e;
        };
        let no_kind = e.kind == ConfigErrorKind::Missing && e.key.is_none() && e.stage.is_some();
        match alone() {
            Err(own)
                if no_kind
                    || (own.kind, &own.stage, &own.key, &own.message)
                        == (e.kind, &e.stage, &e.key, &e.message) =>
            {
                own
            }
            Ok(_) if no_kind => {
                let mut named: Vec<String> = Vec::new();
                for o in self.sets() {
                    let mut parts = o.key.split('.');
                    if let (Some("stages"), Some(stage)) = (parts.next(), parts.next()) {
                        if !named.iter().any(|n| n == stage) {
                            named.push(stage.to_string());
                        }
                    }
                }
                ConfigError::new(
                    &e.file,
                    ConfigErrorKind::Missing,
                    format!(
                        "no such stage in this file, but the daemon sets its params ({origin}): \
                         a daemon's pipeline names its stages {} (see pipelines/daemon.yaml)",
                        named.join(", ")
                    ),
                )
                .stage(e.stage.clone().unwrap_or_default())
            }
            _ => e,
        }
    }

    /// Whether echo cancellation runs, and why (for the log and `ctl status`).
    pub fn echo_decision(&self) -> (bool, String) {
        match self.echo_cancel.as_str() {
            "on" => (true, "echo_cancel: on".into()),
            "off" => (false, "echo_cancel: off".into()),
            _ => match crate::audio::device::headset(&self.input_device, &self.output_device) {
                Some(why) => (false, format!("echo_cancel: auto, off: {why}")),
                None => (
                    true,
                    "echo_cancel: auto, on: the devices are not a headset".into(),
                ),
            },
        }
    }
}

/// Everything that can be checked without loading a model or opening a device, on a loaded
/// configuration: the pipeline file with its overrides, the control socket's path, the pack
/// (its four graphs against the contract and `pack.yaml` against the graphs), the persona
/// against the pack's vocabulary, the tokenizer and voice files, and that the devices exist.
/// `own_socket` is the socket this process serves already (on a reload), which is not in the
/// way of itself.
///
/// # Errors
///
/// A [`ConfigError`] naming the daemon's file (or variable) and key.
pub fn check_static(
    c: &DaemonConfig,
    own_socket: Option<&Path>,
) -> Result<PipelineSpec, ConfigError> {
    let spec = c.pipeline_spec()?;
    let e = |key: &str, kind, m: String| c.error(key, kind, m);
    if own_socket != Some(c.control_socket.as_path()) {
        crate::app::control::check_socket_path(&c.control_socket)
            .map_err(|err| e("control_socket", ConfigErrorKind::Conflict, err.to_string()))?;
    }
    let pack = crate::model::pack::Pack::open(Path::new(&c.pack))
        .map_err(|err| e("pack", ConfigErrorKind::Read, err.to_string()))?;
    let tokenizer_path = if c.tokenizer.is_empty() {
        pack.tokenizer()
    } else {
        Some(PathBuf::from(&c.tokenizer))
    };
    let tokenizer = match &tokenizer_path {
        Some(p) => Some(
            crate::model::tokenizer::Tokenizer::open(p)
                .map_err(|err| e("tokenizer", ConfigErrorKind::Read, err.to_string()))?,
        ),
        None => None,
    };
    let text = (!c.persona.is_empty()).then_some(c.persona.as_str());
    crate::model::lm::persona_tokens(&pack.manifest, tokenizer.as_ref(), text, &c.persona_tokens)
        .map_err(|err| e(err.key(), ConfigErrorKind::OutOfRange, err.to_string()))?;
    if !c.voice.is_empty() {
        crate::audio::WavReader::open(Path::new(&c.voice))
            .map_err(|err| e("voice", ConfigErrorKind::Read, err.to_string()))?;
    }
    use crate::audio::device::{find, Direction};
    for (key, dir, device) in [
        ("input_device", Direction::Input, &c.input_device),
        ("output_device", Direction::Output, &c.output_device),
    ] {
        if device != "virtual" {
            find(dir, device).map_err(|err| e(key, ConfigErrorKind::Read, err.to_string()))?;
        }
    }
    Ok(spec)
}

/// Loads the configuration and runs [`check_static`] on it.
///
/// # Errors
///
/// As [`load_config`] and [`check_static`].
pub fn check_all(
    explicit: Option<&Path>,
    own_socket: Option<&Path>,
) -> Result<DaemonConfig, ConfigError> {
    let c = load_config(explicit, None)?;
    check_static(&c, own_socket)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stages_the_settings_reach_are_in_the_daemons_pipeline_with_their_kinds() {
        let text = std::fs::read_to_string("pipelines/daemon.yaml").unwrap();
        let doc = &yaml_rust2::YamlLoader::load_from_str(&text).unwrap()[0];
        let kind_of = |stage: &str| doc["stages"][stage]["kind"].as_str().map(str::to_string);
        for (stage, want) in [
            (MIC_STAGE, "mic"),
            (SPEAKER_STAGE, kind::PLAYBACK),
            (LM_STAGE, kind::TEMPORAL),
            (AEC_STAGE, "aec"),
            (MODEL_STAGES[0], "mimi_encode"),
            (MODEL_STAGES[2], kind::DEPFORMER),
            (MODEL_STAGES[3], "mimi_decode"),
        ] {
            assert_eq!(kind_of(stage).as_deref(), Some(want), "stage {stage}");
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Option<HashMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// Defaults, then the user's file, then `DUPLEX__…` variables, each over the one before.
    #[test]
    fn layers_defaults_file_and_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("daemon.yaml");
        let pipeline = concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines/daemon.yaml");
        std::fs::write(
            &file,
            format!(
                "pipeline: {pipeline}\ninput_device: from-file\noutput_device: from-file\nsampling:\n  seed: 3\n"
            ),
        )
        .unwrap();
        let c = load_config(
            Some(&file),
            env(&[
                ("DUPLEX__INPUT_DEVICE", "from-env"),
                ("DUPLEX__SAMPLING__SEED", "7"),
            ]),
        )
        .unwrap();
        assert_eq!(c.input_device, "from-env");
        assert_eq!(c.output_device, "from-file");
        assert_eq!(c.sampling.seed, Some(7));
        // Untouched sampling keys keep their defaults.
        assert_eq!(c.sampling.text_top_k, 25);
        assert_eq!(c.long_session, "reset_and_reprime");
        assert_eq!(c.file, file.display().to_string());
        assert_eq!(
            c.origin("input_device"),
            "environment variable DUPLEX__INPUT_DEVICE"
        );
        assert_eq!(
            c.origin("output_device"),
            format!("{}: `output_device`", file.display())
        );
        // A bad value from the environment names the variable, the file and the key.
        let e = load_config(Some(&file), env(&[("DUPLEX__SAMPLING__SEED", "soon")])).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("sampling.seed"), "{e}");
        assert!(
            e.to_string()
                .starts_with("environment variable DUPLEX__SAMPLING__SEED (over "),
            "{e}"
        );
        assert!(e.to_string().contains("daemon.yaml"), "{e}");
        // And one the daemon does not know.
        let e = load_config(Some(&file), env(&[("DUPLEX__INPUT_DEVISE", "x")])).unwrap_err();
        assert!(e.to_string().contains("did you mean `input_device`"), "{e}");
        assert_eq!(
            e.origin.as_deref(),
            Some("environment variable DUPLEX__INPUT_DEVISE")
        );
    }

    /// The configuration becomes overrides of the pipeline file's stages, each blaming its key.
    #[test]
    fn the_configuration_becomes_pipeline_overrides() {
        let c = load_config(None, env(&[("DUPLEX__PERSONA_TOKENS", "1,2,3")])).unwrap();
        let sets: HashMap<String, Override> =
            c.sets().into_iter().map(|o| (o.key.clone(), o)).collect();
        assert_eq!(sets["stages.temporal.persona_tokens"].value, "[1, 2, 3]");
        assert_eq!(
            sets["stages.temporal.persona_tokens"].origin,
            "environment variable DUPLEX__PERSONA_TOKENS"
        );
        assert_eq!(sets["stages.encode.pack"].value, c.pack);
        assert_eq!(
            sets["stages.encode.pack"].origin,
            "configs/daemon.yaml (built in): `pack`"
        );
        assert_eq!(sets["stages.speaker.device"].value, c.output_device);
        assert_eq!(
            sets["metrics.address"].value, "",
            "the daemon serves metrics itself"
        );
        // Every model stage runs where `execution_provider` says.
        let c = load_config(None, env(&[("DUPLEX__EXECUTION_PROVIDER", "cuda")])).unwrap();
        let sets: HashMap<String, Override> =
            c.sets().into_iter().map(|o| (o.key.clone(), o)).collect();
        for s in MODEL_STAGES {
            let o = &sets[&format!("stages.{s}.execution_provider")];
            assert_eq!(o.value, "cuda");
            assert_eq!(o.origin, "environment variable DUPLEX__EXECUTION_PROVIDER");
        }
        let e = load_config(None, env(&[("DUPLEX__EXECUTION_PROVIDER", "gpu")])).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("execution_provider"), "{e}");
        assert!(
            e.to_string().contains("\"gpu\" is not one of cpu, cuda"),
            "{e}"
        );
    }

    /// Kyutai's controls and the step cap: the depformer's and the temporal's params, checked
    /// with their ranges, set over the pipeline, and applied live by the `sampling` command.
    #[test]
    fn sampling_controls_and_max_steps_are_the_stages_params() {
        let c = load_config(None, env(&[])).unwrap();
        let s = c.sampling;
        assert_eq!(
            (
                s.pad_mult,
                s.repetition_penalty,
                s.repetition_penalty_context
            ),
            (0.0, 1.0, 64)
        );
        assert_eq!((s.text_seed, s.audio_seed, c.max_steps), (None, None, 0));
        let c = load_config(
            None,
            env(&[
                ("DUPLEX__SAMPLING__PAD_MULT", "-2.5"),
                ("DUPLEX__SAMPLING__REPETITION_PENALTY", "1.3"),
                ("DUPLEX__SAMPLING__AUDIO_SEED", "9007199254740993"),
                ("DUPLEX__MAX_STEPS", "50"),
            ]),
        )
        .unwrap();
        let sets: HashMap<String, Override> =
            c.sets().into_iter().map(|o| (o.key.clone(), o)).collect();
        assert_eq!(sets["stages.depformer.pad_mult"].value, "-2.5");
        assert_eq!(
            sets["stages.depformer.pad_mult"].origin,
            "environment variable DUPLEX__SAMPLING__PAD_MULT"
        );
        assert_eq!(sets["stages.depformer.repetition_penalty"].value, "1.3");
        // Past 2^53, exactly.
        assert_eq!(
            sets["stages.depformer.audio_seed"].value,
            "9007199254740993"
        );
        assert_eq!(sets["stages.depformer.text_seed"].value, "-1");
        assert_eq!(sets["stages.temporal.max_steps"].value, "50");
        assert_eq!(
            c.sampling.command_arg(),
            "text_temperature=0.7 text_top_k=25 audio_temperature=0.8 audio_top_k=250 \
             pad_mult=-2.5 repetition_penalty=1.3 repetition_penalty_context=64"
        );
        // The pipeline takes every value the daemon sets.
        c.pipeline_spec().unwrap();
        for (var, value, key, says) in [
            (
                "DUPLEX__SAMPLING__PAD_MULT",
                "12",
                "sampling.pad_mult",
                "12 is out of range -10..=10",
            ),
            (
                "DUPLEX__SAMPLING__REPETITION_PENALTY",
                "0.9",
                "sampling.repetition_penalty",
                "0.9 is out of range 1..=10",
            ),
            (
                "DUPLEX__SAMPLING__REPETITION_PENALTY_CONTEXT",
                "2.5",
                "sampling.repetition_penalty_context",
                "expected an integer",
            ),
            (
                "DUPLEX__SAMPLING__TEXT_SEED",
                "-2",
                "sampling.text_seed",
                "-2 is out of range -1..=",
            ),
            (
                "DUPLEX__MAX_STEPS",
                "-1",
                "max_steps",
                "-1 is out of range 0..=",
            ),
        ] {
            let e = load_config(None, env(&[(var, value)])).unwrap_err();
            assert_eq!(e.key.as_deref(), Some(key), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    /// `ort.library` (here from its variable) is set over the pipeline file's, naming the
    /// daemon's layer; a missing library is refused naming the variable and the key.
    #[test]
    fn ort_library_is_set_over_the_pipeline_file() {
        let lib = std::env::current_exe().unwrap();
        let lib = lib.to_str().unwrap();
        let c = load_config(None, env(&[("DUPLEX__ORT__LIBRARY", lib)])).unwrap();
        let spec = c.pipeline_spec().unwrap();
        let chosen = spec.ort_library.unwrap();
        assert_eq!(chosen.path, PathBuf::from(lib));
        assert_eq!(chosen.origin, "environment variable DUPLEX__ORT__LIBRARY");
        assert!(load_config(None, env(&[]))
            .unwrap()
            .pipeline_spec()
            .unwrap()
            .ort_library
            .is_none());
        let e = load_config(None, env(&[("DUPLEX__ORT__LIBRARY", "/nonexistent.so")])).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("ort.library"), "{e}");
        assert!(
            e.to_string()
                .starts_with("environment variable DUPLEX__ORT__LIBRARY (over defaults): "),
            "{e}"
        );
    }

    /// `duplex ctl` finds the socket from any directory: the pipeline file is not needed.
    #[test]
    fn the_control_socket_is_found_without_the_pipeline_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("daemon.yaml");
        std::fs::write(
            &file,
            "pipeline: /nonexistent/daemon.yaml\ncontrol_socket: /run/x/control.sock\n",
        )
        .unwrap();
        assert!(load_config(Some(&file), env(&[])).is_err());
        assert_eq!(
            control_socket(Some(&file), env(&[]).as_ref()).unwrap(),
            PathBuf::from("/run/x/control.sock")
        );
    }
}
