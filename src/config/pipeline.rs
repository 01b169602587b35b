//! Loading one pipeline file into a [`PipelineSpec`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use config::{Map, Value, ValueKind};

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
    let text = yaml::read(file, Limits::FILES)?;
    let root = layers::merge(vec![
        yaml::parse(DEFAULTS_YAML, DEFAULTS_ORIGIN, Limits::FILES)?,
        yaml::parse(&text, &fname, Limits::FILES)?,
        layers::env_layer(opts.env.as_ref()),
        layers::override_layer(&fname, &opts.sets)?,
    ]);
    let empty = Map::new();
    let f = Fields::new(&fname, DEFAULTS_ORIGIN, &root);
    if let Some(k) = root.keys().find(|k| !TOP_KEYS.contains(&k.as_str())) {
        let hint = did_you_mean(k, TOP_KEYS.iter().copied());
        return Err(f.err(
            ConfigErrorKind::UnknownKey,
            k,
            format!(
                "unknown top-level key{hint}; expected: {}",
                TOP_KEYS.join(", ")
            ),
        ));
    }

    let defaults = f.table_or("defaults", &empty)?;
    defaults.known(&["capacity", "overflow"])?;
    let link_defaults = (
        defaults.integer("capacity", 1)? as usize,
        parse_overflow(&fname, "defaults.overflow", defaults.get("overflow"))?.unwrap_or_default(),
    );
    let rt = f.table_or("runtime", &empty)?;
    rt.known(&["drain_timeout_ms", "abort_timeout_ms"])?;
    let runtime = RuntimeSettings {
        drain_timeout: Duration::from_millis(rt.integer("drain_timeout_ms", 0)? as u64),
        abort_timeout: Duration::from_millis(rt.integer("abort_timeout_ms", 0)? as u64),
    };
    // ort: the one reader every settings file shares. Checked here, with the layer it came
    // from: it is loaded before anything else.
    let ort_library = super::ort::read(&f)?;
    let metrics = read_metrics(&f.table_or("metrics", &empty)?)?;
    let rs = f.table_or("record", &empty)?;
    rs.known(&["dir", "max_file_kb"])?;
    let dir = rs.string("dir")?;
    let record = RecordSettings {
        dir: (!dir.trim().is_empty()).then(|| PathBuf::from(dir)),
        max_file_bytes: rs.integer("max_file_kb", 4)? as u64 * 1024,
    };
    let stages = read_stages(&fname, &root, catalog)?;
    super::paths::check(&fname, &stages, catalog)?;
    let links = read_links(&fname, &root, link_defaults)?;
    Ok(PipelineSpec {
        description: root.get("description").and_then(as_string),
        file: fname,
        stages,
        links,
        runtime,
        ort_library,
        metrics,
        record,
    })
}

/// The `metrics` section.
fn read_metrics(ms: &Fields<'_>) -> Result<MetricsSettings, ConfigError> {
    ms.known(&["address", "window", "every"])?;
    let address = ms.address("address", "127.0.0.1:9187")?;
    Ok(MetricsSettings {
        address,
        window: ms.integer("window", 16)? as usize,
        every: ms.integer("every", 1)? as usize,
    })
}

/// The `stages` map, each stage's params checked against its kind's.
fn read_stages(
    fname: &str,
    root: &Map<String, Value>,
    catalog: &dyn KindCatalog,
) -> Result<Vec<StageSpec>, ConfigError> {
    let e = |k, m: String| ConfigError::new(fname, k, m);
    match root.get("stages").map(|v| &v.kind) {
        Some(ValueKind::Table(t)) if !t.is_empty() => t
            .iter()
            .map(|(name, v)| read_stage(fname, name, v, catalog))
            .collect(),
        Some(ValueKind::Table(_)) | None | Some(ValueKind::Nil) => Err(e(
            ConfigErrorKind::Missing,
            "the pipeline has no stages: add a `stages:` map of name → {kind, params}".into(),
        )),
        Some(_) => Err(e(
            ConfigErrorKind::WrongType,
            "expected a map of stage name → {kind: …, params…}".into(),
        )
        .key("stages")),
    }
}

/// One stage: its name, kind, params and `inject_delay` option.
fn read_stage(
    fname: &str,
    name: &str,
    v: &Value,
    catalog: &dyn KindCatalog,
) -> Result<StageSpec, ConfigError> {
    let e = |k, m: String, at: &Value| {
        ConfigError::new(fname, k, m)
            .stage(name.to_string())
            .from_value(at)
    };
    if !valid_name(name) {
        return Err(e(
            ConfigErrorKind::UnknownKey,
            "stage names use lowercase letters, digits and `_`, starting with a letter (so \
             that DUPLEX__STAGES__<NAME>__<PARAM> can override them)"
                .into(),
            v,
        ));
    }
    let ValueKind::Table(t) = &v.kind else {
        return Err(e(
            ConfigErrorKind::WrongType,
            format!("expected a map with `kind` and params, got {}", describe(v)),
            v,
        ));
    };
    let Some(kind_v) = t.get("kind") else {
        return Err(e(ConfigErrorKind::Missing, "missing `kind`".into(), v));
    };
    let Some(kind) = as_string(kind_v) else {
        return Err(e(
            ConfigErrorKind::WrongType,
            format!("`kind` must be a string, got {}", describe(kind_v)),
            kind_v,
        ));
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
            kind_v,
        )
        .key("kind"));
    };
    let raw: Vec<(String, Value)> = t
        .iter()
        .filter(|(k, _)| k.as_str() != "kind" && k.as_str() != INJECT_KEY)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let params = check(fname, name, &kind, specs, &raw)?;
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
                    v,
                )
                .key(INJECT_KEY));
            };
            let raw: Vec<(String, Value)> =
                it.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let label = format!("{name}.{INJECT_KEY}");
            Some(check(fname, &label, INJECT_KEY, specs, &raw)?)
        }
    };
    Ok(StageSpec {
        name: name.to_string(),
        kind,
        params,
        inject,
    })
}

/// The `links` list, with the `defaults` section's capacity and overflow policy.
fn read_links(
    fname: &str,
    root: &Map<String, Value>,
    defaults: (usize, Overflow),
) -> Result<Vec<LinkSpec>, ConfigError> {
    match root.get("links").map(|v| &v.kind) {
        Some(ValueKind::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| read_link(fname, i, v, defaults))
            .collect(),
        None | Some(ValueKind::Nil) => Ok(vec![]),
        Some(_) => Err(ConfigError::new(
            fname,
            ConfigErrorKind::WrongType,
            "expected a list of links (`- from: a` / `to: b`, or `- a -> b`)",
        )
        .key("links")),
    }
}

/// The `i`-th link: `a -> b`, or a map with `from`, `to` and its own options.
fn read_link(
    fname: &str,
    i: usize,
    v: &Value,
    (def_capacity, def_overflow): (usize, Overflow),
) -> Result<LinkSpec, ConfigError> {
    let key = format!("links[{i}]");
    let le = |k, m: String| ConfigError::new(fname, k, m).key(key.clone()).from_value(v);
    let t = match &v.kind {
        ValueKind::String(s) => {
            let Some((a, b)) = s.split_once("->") else {
                return Err(le(
                    ConfigErrorKind::Link,
                    format!("{s:?} is not a link: write `from -> to`"),
                ));
            };
            return Ok(LinkSpec {
                from: a.trim().to_string(),
                to: b.trim().to_string(),
                capacity: def_capacity,
                overflow: def_overflow,
                feedback: false,
            });
        }
        ValueKind::Table(t) => t,
        _ => {
            return Err(le(
                ConfigErrorKind::WrongType,
                format!("expected a link, got {}", describe(v)),
            ))
        }
    };
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
                    format!("`{k}` must be `stage` or `stage.port`, got {}", describe(v)),
                )
            }),
        }
    };
    let capacity = match t.get("capacity").map(|v| (v, as_i64(v))) {
        None => def_capacity,
        Some((_, Some(c))) if c >= 1 => c as usize,
        Some((_, Some(c))) => {
            return Err(le(
                ConfigErrorKind::OutOfRange,
                format!("`capacity` must be at least 1, got {c}"),
            ))
        }
        Some((v, None)) => {
            return Err(le(
                ConfigErrorKind::WrongType,
                format!("`capacity` must be an integer, got {}", describe(v)),
            ))
        }
    };
    let feedback = match t.get("feedback") {
        None => false,
        Some(v) => as_bool(v).ok_or_else(|| {
            le(
                ConfigErrorKind::WrongType,
                format!("`feedback` must be true or false, got {}", describe(v)),
            )
        })?,
    };
    Ok(LinkSpec {
        from: endpoint("from")?,
        to: endpoint("to")?,
        capacity,
        overflow: parse_overflow(fname, &format!("{key}.overflow"), t.get("overflow"))?
            .unwrap_or(def_overflow),
        feedback,
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
