//! Loading one pipeline file into a [`PipelineSpec`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use config::{Value, ValueKind};

use super::fields::Fields;
use super::layers::{self, Override};
use super::params::{as_bool, as_i64, as_string, check, describe, did_you_mean, ParamSpec, Params};
use super::yaml::{self, Limits};
use super::{ConfigError, ConfigErrorKind, DEFAULTS_ORIGIN, DEFAULTS_YAML};
use crate::runtime::Overflow;

/// What the loader needs to know about stage kinds: their names and params.
pub trait KindCatalog {
    /// The params of `kind`, or `None` when there is no such kind.
    fn params(&self, kind: &str) -> Option<&[ParamSpec]>;
    /// Every kind name, for error messages.
    fn kind_names(&self) -> Vec<&str>;
}

/// One stage as declared in the file, with checked params.
#[derive(Debug, Clone)]
pub struct StageSpec {
    /// Name (the key under `stages:`).
    pub name: String,
    /// Kind.
    pub kind: String,
    /// Checked params, defaults filled in.
    pub params: Params,
    /// Its `inject_delay:` option: the params of an `inject_delay` latency signature laid on the
    /// stage itself (drills and tests of the diagnosis).
    pub inject: Option<Params>,
}

/// The per-stage option that lays a latency signature on any stage.
pub const INJECT_KEY: &str = "inject_delay";

/// One link as declared in the file, defaults filled in.
#[derive(Debug, Clone)]
pub struct LinkSpec {
    /// `stage` or `stage.port`.
    pub from: String,
    /// `stage` or `stage.port`.
    pub to: String,
    /// Queue capacity in frames.
    pub capacity: usize,
    /// Overflow policy.
    pub overflow: Overflow,
    /// Closes the pipeline's one cycle.
    pub feedback: bool,
}

/// Supervisor settings.
#[derive(Debug, Clone, Copy)]
pub struct RuntimeSettings {
    /// Drain grace after a failure or stop request.
    pub drain_timeout: Duration,
    /// Wait after an abort before threads are reported hung.
    pub abort_timeout: Duration,
}

/// A pipeline file, loaded and checked.
#[derive(Debug, Clone)]
pub struct PipelineSpec {
    /// The file, as given.
    pub file: String,
    /// Its `description`, if any.
    pub description: Option<String>,
    /// Stages in file order.
    pub stages: Vec<StageSpec>,
    /// Links in file order.
    pub links: Vec<LinkSpec>,
    /// Supervisor settings.
    pub runtime: RuntimeSettings,
    /// `ort.library`, when a layer sets it: the ONNX Runtime library this pipeline loads, and
    /// who chose it.
    pub ort_library: Option<super::OrtChoice>,
    /// The `metrics` section.
    pub metrics: MetricsSettings,
    /// The `record` section.
    pub record: RecordSettings,
}

/// Whether and where a run is recorded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordSettings {
    /// The folder recordings go under; `None` = no recording.
    pub dir: Option<PathBuf>,
    /// Timings files rotate at this size, bytes.
    pub max_file_bytes: u64,
}

/// Where metrics are served and how latency is diagnosed.
#[derive(Debug, Clone, Copy)]
pub struct MetricsSettings {
    /// `/metrics` address; `None` = no exporter.
    pub address: Option<std::net::SocketAddr>,
    /// Diagnosis window, frames.
    pub window: usize,
    /// Diagnosis evaluated every this many frames.
    pub every: usize,
}

/// Extra layers over the file.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `key=value` overrides (highest priority), e.g. `stages.src.path=in.wav`, each with where
    /// it came from.
    pub sets: Vec<Override>,
    /// Environment to read `DUPLEX__…` overrides from; `None` reads the process environment.
    pub env: Option<HashMap<String, String>>,
}

/// The top-level keys of a pipeline file.
pub const TOP_KEYS: &[&str] = &[
    "description",
    "stages",
    "links",
    "defaults",
    "runtime",
    "ort",
    "metrics",
    "record",
];

/// Loads and checks a pipeline file.
///
/// # Errors
///
/// A [`ConfigError`] naming the file, and the stage and key where it applies.
pub fn load(
    file: &Path,
    opts: &LoadOptions,
    catalog: &dyn KindCatalog,
) -> Result<PipelineSpec, ConfigError> {
    let fname = file.display().to_string();
    let e = |k, m: String| ConfigError::new(&fname, k, m);
    let text = yaml::read(file, Limits::FILES)?;
    let root = layers::merge(vec![
        yaml::parse(DEFAULTS_YAML, DEFAULTS_ORIGIN, Limits::FILES)?,
        yaml::parse(&text, &fname, Limits::FILES)?,
        layers::env_layer(opts.env.as_ref()),
        layers::override_layer(&fname, &opts.sets)?,
    ]);

    for k in root.keys() {
        if !TOP_KEYS.contains(&k.as_str()) {
            let hint = did_you_mean(k, TOP_KEYS.iter().copied());
            return Err(e(
                ConfigErrorKind::UnknownKey,
                format!(
                    "unknown top-level key{hint}; expected: {}",
                    TOP_KEYS.join(", ")
                ),
            )
            .key(k.clone())
            .from_value(&root[k]));
        }
    }

    let section = |name: &str| -> Result<Vec<(String, Value)>, ConfigError> {
        match root.get(name).map(|v| &v.kind) {
            None | Some(ValueKind::Nil) => Ok(vec![]),
            Some(ValueKind::Table(t)) => {
                Ok(t.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            }
            Some(_) => Err(e(ConfigErrorKind::WrongType, "expected a map".into())
                .key(name)
                .from_value(&root[name])),
        }
    };
    let int_key =
        |sec: &str, entries: &[(String, Value)], key: &str, min: i64| -> Result<i64, ConfigError> {
            let Some((_, v)) = entries.iter().find(|(k, _)| k == key) else {
                return Err(
                    e(ConfigErrorKind::Missing, "missing".into()).key(format!("{sec}.{key}"))
                );
            };
            match as_i64(v) {
                Some(i) if i >= min => Ok(i),
                Some(i) => Err(
                    e(ConfigErrorKind::OutOfRange, format!("{i} is below {min}"))
                        .key(format!("{sec}.{key}"))
                        .from_value(v),
                ),
                None => Err(e(
                    ConfigErrorKind::WrongType,
                    format!("expected an integer, got {}", describe(v)),
                )
                .key(format!("{sec}.{key}"))
                .from_value(v)),
            }
        };
    let only_keys =
        |sec: &str, entries: &[(String, Value)], allowed: &[&str]| -> Result<(), ConfigError> {
            for (k, v) in entries {
                if !allowed.contains(&k.as_str()) {
                    let hint = did_you_mean(k, allowed.iter().copied());
                    return Err(e(
                        ConfigErrorKind::UnknownKey,
                        format!("unknown key{hint}; expected: {}", allowed.join(", ")),
                    )
                    .key(format!("{sec}.{k}"))
                    .from_value(v));
                }
            }
            Ok(())
        };

    // defaults
    let defaults = section("defaults")?;
    only_keys("defaults", &defaults, &["capacity", "overflow"])?;
    let def_capacity = int_key("defaults", &defaults, "capacity", 1)? as usize;
    let def_overflow = parse_overflow(
        &fname,
        "defaults.overflow",
        defaults
            .iter()
            .find(|(k, _)| k == "overflow")
            .map(|(_, v)| v),
    )?
    .unwrap_or_default();

    // runtime
    let rt = section("runtime")?;
    only_keys("runtime", &rt, &["drain_timeout_ms", "abort_timeout_ms"])?;
    let runtime = RuntimeSettings {
        drain_timeout: Duration::from_millis(int_key("runtime", &rt, "drain_timeout_ms", 0)? as u64),
        abort_timeout: Duration::from_millis(int_key("runtime", &rt, "abort_timeout_ms", 0)? as u64),
    };

    // ort: the one reader every settings file shares. Checked here, with the layer it came
    // from: it is loaded before anything else.
    let ort_library = super::ort::read(&Fields::new(&fname, DEFAULTS_ORIGIN, &root))?;

    // metrics
    let ms = section("metrics")?;
    only_keys("metrics", &ms, &["address", "window", "every"])?;
    let address_v = ms.iter().find(|(k, _)| k == "address").map(|(_, v)| v);
    let address = match address_v.and_then(|v| Some((v, as_string(v)?))) {
        None => None,
        Some((_, a)) if a.trim().is_empty() => None,
        Some((v, a)) => Some(a.trim().parse::<std::net::SocketAddr>().map_err(|err| {
            e(
                ConfigErrorKind::WrongType,
                format!("{a:?} is not an address like 127.0.0.1:9187 ({err}); empty disables the exporter"),
            )
            .key("metrics.address")
            .from_value(v)
        })?),
    };
    let metrics = MetricsSettings {
        address,
        window: int_key("metrics", &ms, "window", 16)? as usize,
        every: int_key("metrics", &ms, "every", 1)? as usize,
    };

    // record
    let rs = section("record")?;
    only_keys("record", &rs, &["dir", "max_file_kb"])?;
    let record = RecordSettings {
        dir: rs
            .iter()
            .find(|(k, _)| k == "dir")
            .and_then(|(_, v)| as_string(v))
            .filter(|d| !d.trim().is_empty())
            .map(PathBuf::from),
        max_file_bytes: int_key("record", &rs, "max_file_kb", 4)? as u64 * 1024,
    };

    let description = root.get("description").and_then(as_string);

    // stages
    let stages_raw = match root.get("stages").map(|v| &v.kind) {
        Some(ValueKind::Table(t)) if !t.is_empty() => t.clone(),
        Some(ValueKind::Table(_)) | None | Some(ValueKind::Nil) => {
            return Err(e(
                ConfigErrorKind::Missing,
                "the pipeline has no stages: add a `stages:` map of name → {kind, params}".into(),
            ))
        }
        Some(_) => {
            return Err(e(
                ConfigErrorKind::WrongType,
                "expected a map of stage name → {kind: …, params…}".into(),
            )
            .key("stages"))
        }
    };
    let mut stages = Vec::with_capacity(stages_raw.len());
    for (name, v) in stages_raw.iter() {
        if !valid_name(name) {
            return Err(e(
                ConfigErrorKind::UnknownKey,
                "stage names use lowercase letters, digits and `_`, starting with a letter (so \
                 that DUPLEX__STAGES__<NAME>__<PARAM> can override them)"
                    .into(),
            )
            .stage(name.clone())
            .from_value(v));
        }
        let ValueKind::Table(t) = &v.kind else {
            return Err(e(
                ConfigErrorKind::WrongType,
                format!("expected a map with `kind` and params, got {}", describe(v)),
            )
            .stage(name.clone())
            .from_value(v));
        };
        let Some(kind_v) = t.get("kind") else {
            return Err(e(ConfigErrorKind::Missing, "missing `kind`".into())
                .stage(name.clone())
                .from_value(v));
        };
        let Some(kind) = as_string(kind_v) else {
            return Err(e(
                ConfigErrorKind::WrongType,
                format!("`kind` must be a string, got {}", describe(kind_v)),
            )
            .stage(name.clone())
            .from_value(kind_v));
        };
        let Some(specs) = catalog.params(&kind) else {
            let names = catalog.kind_names();
            let hint = did_you_mean(&kind, names.iter().copied());
            return Err(e(
                ConfigErrorKind::UnknownKind,
                format!(
                    "unknown stage kind `{kind}`{hint}; `duplex stages` lists them: {}",
                    names.join(", ")
                ),
            )
            .stage(name.clone())
            .key("kind")
            .from_value(kind_v));
        };
        let raw: Vec<(String, Value)> = t
            .iter()
            .filter(|(k, _)| k.as_str() != "kind" && k.as_str() != INJECT_KEY)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let params = check(&fname, name, &kind, specs, &raw)?;
        let inject = match (t.get(INJECT_KEY), catalog.params(INJECT_KEY)) {
            (None, _) | (_, None) => None,
            (Some(v), Some(specs)) => {
                let ValueKind::Table(it) = &v.kind else {
                    return Err(e(
                        ConfigErrorKind::WrongType,
                        format!(
                            "expected a map of `inject_delay` params (mode, base_ms, …), got {}",
                            describe(v)
                        ),
                    )
                    .stage(name.clone())
                    .key(INJECT_KEY)
                    .from_value(v));
                };
                let raw: Vec<(String, Value)> =
                    it.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                let label = format!("{name}.{INJECT_KEY}");
                Some(check(&fname, &label, INJECT_KEY, specs, &raw)?)
            }
        };
        stages.push(StageSpec {
            name: name.clone(),
            kind,
            params,
            inject,
        });
    }

    super::paths::check(&fname, &stages, catalog)?;

    // links
    let links_raw = match root.get("links").map(|v| &v.kind) {
        Some(ValueKind::Array(a)) => a.clone(),
        None | Some(ValueKind::Nil) => vec![],
        Some(_) => {
            return Err(e(
                ConfigErrorKind::WrongType,
                "expected a list of links (`- from: a` / `to: b`, or `- a -> b`)".into(),
            )
            .key("links"))
        }
    };
    let mut links = Vec::with_capacity(links_raw.len());
    for (i, v) in links_raw.iter().enumerate() {
        let key = format!("links[{i}]");
        let le = |k, m: String| e(k, m).key(key.clone()).from_value(v);
        let link = match &v.kind {
            ValueKind::String(s) => {
                let Some((a, b)) = s.split_once("->") else {
                    return Err(le(
                        ConfigErrorKind::Link,
                        format!("{s:?} is not a link: write `from -> to`"),
                    ));
                };
                LinkSpec {
                    from: a.trim().to_string(),
                    to: b.trim().to_string(),
                    capacity: def_capacity,
                    overflow: def_overflow,
                    feedback: false,
                }
            }
            ValueKind::Table(t) => {
                for k in t.keys() {
                    if !["from", "to", "capacity", "overflow", "feedback"].contains(&k.as_str()) {
                        return Err(le(
                            ConfigErrorKind::UnknownKey,
                            format!("unknown key `{k}`; a link has: from, to, capacity, overflow, feedback"),
                        ));
                    }
                }
                let endpoint = |k: &str| -> Result<String, ConfigError> {
                    match t.get(k) {
                        None => Err(le(ConfigErrorKind::Missing, format!("missing `{k}`"))),
                        Some(v) => as_string(v).filter(|s| !s.is_empty()).ok_or_else(|| {
                            le(
                                ConfigErrorKind::WrongType,
                                format!(
                                    "`{k}` must be `stage` or `stage.port`, got {}",
                                    describe(v)
                                ),
                            )
                        }),
                    }
                };
                let capacity = match t.get("capacity") {
                    None => def_capacity,
                    Some(v) => match as_i64(v) {
                        Some(c) if c >= 1 => c as usize,
                        Some(c) => {
                            return Err(le(
                                ConfigErrorKind::OutOfRange,
                                format!("`capacity` must be at least 1, got {c}"),
                            ))
                        }
                        None => {
                            return Err(le(
                                ConfigErrorKind::WrongType,
                                format!("`capacity` must be an integer, got {}", describe(v)),
                            ))
                        }
                    },
                };
                let overflow =
                    parse_overflow(&fname, &format!("{key}.overflow"), t.get("overflow"))?
                        .unwrap_or(def_overflow);
                let feedback = match t.get("feedback") {
                    None => false,
                    Some(v) => as_bool(v).ok_or_else(|| {
                        le(
                            ConfigErrorKind::WrongType,
                            format!("`feedback` must be true or false, got {}", describe(v)),
                        )
                    })?,
                };
                LinkSpec {
                    from: endpoint("from")?,
                    to: endpoint("to")?,
                    capacity,
                    overflow,
                    feedback,
                }
            }
            _ => {
                return Err(le(
                    ConfigErrorKind::WrongType,
                    format!("expected a link, got {}", describe(v)),
                ))
            }
        };
        links.push(link);
    }

    Ok(PipelineSpec {
        file: fname,
        description,
        stages,
        links,
        runtime,
        ort_library,
        metrics,
        record,
    })
}

fn valid_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next().is_some_and(|f| f.is_ascii_lowercase())
        && c.all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_')
}

fn parse_overflow(
    file: &str,
    key: &str,
    v: Option<&Value>,
) -> Result<Option<Overflow>, ConfigError> {
    let Some(v) = v else { return Ok(None) };
    let s = as_string(v).unwrap_or_default();
    s.parse::<Overflow>().map(Some).map_err(|_| {
        ConfigError::new(
            file,
            ConfigErrorKind::OutOfRange,
            format!(
                "overflow policy must be one of {}, got {}",
                Overflow::NAMES.join(", "),
                describe(v)
            ),
        )
        .key(key)
    })
}
