//! Layers of configuration and where each value came from.
//!
//! A setting may come from the built-in defaults, the user's file, a `DUPLEX__…` environment
//! variable, or a `--set key=value` on the command line (or, for the daemon, its own
//! configuration file standing in for `--set`). Each layer is a map of values parsed with
//! [`yaml`](super::yaml) whose *origin* names the layer, down to the variable or the flag; the
//! layers are merged key by key, later over earlier, so every value keeps its origin and an
//! error about it can blame the right place. Knows nothing of what the keys mean.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use config::{Map, Value, ValueKind};

use super::{ConfigError, ConfigErrorKind};

/// One `key=value` override with where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// Dotted key path (`stages.source.path`).
    pub key: String,
    /// The value as written (read as a YAML scalar or flow list, else as text).
    pub value: String,
    /// Who set it, for messages (`--set stages.source.path=x.wav`).
    pub origin: String,
}

impl Override {
    /// An override given on the command line as `--set key=value`.
    pub fn set(key: impl Into<String>, value: impl Into<String>) -> Self {
        let (key, value) = (key.into(), value.into());
        Override {
            origin: format!("--set {key}={}", shown(&value)),
            key,
            value,
        }
    }

    /// An override set on behalf of `origin` (e.g. a key of the daemon's configuration file).
    /// (Not `from`: that would stand beside, and shadow, the `From` conversion.)
    pub fn by(origin: impl Into<String>, key: impl Into<String>, value: impl Into<String>) -> Self {
        Override {
            key: key.into(),
            value: value.into(),
            origin: origin.into(),
        }
    }
}

impl From<(String, String)> for Override {
    fn from((key, value): (String, String)) -> Self {
        Override::set(key, value)
    }
}

/// A value as a message shows it: on one line, and short.
fn shown(value: &str) -> String {
    const MAX: usize = 60;
    let one_line = value.chars().all(|c| !c.is_control());
    if one_line && value.chars().count() <= MAX {
        return value.to_string();
    }
    let escaped: String = value.escape_debug().collect();
    let cut: String = escaped.chars().take(MAX).collect();
    format!("{cut}… ({} bytes)", value.len())
}

/// The prefix and separator of environment overrides: `DUPLEX__SECTION__KEY`.
pub const ENV_PREFIX: &str = "DUPLEX__";

/// The layer of `DUPLEX__…` variables from `env` (the process environment when `None`): the
/// rest of each name, lower-cased and split at `__`, is the key path; each value's origin is
/// `environment variable NAME`.
pub fn env_layer(env: Option<&HashMap<String, String>>) -> Map<String, Value> {
    let vars: Vec<(String, String)> = match env {
        Some(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        None => std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect(),
    };
    let mut vars: Vec<_> = vars
        .into_iter()
        .filter(|(k, _)| k.starts_with(ENV_PREFIX) && k.len() > ENV_PREFIX.len())
        .collect();
    vars.sort();
    let mut out = Map::new();
    for (name, text) in vars {
        let origin = format!("environment variable {name}");
        let path: Vec<String> = name[ENV_PREFIX.len()..]
            .split("__")
            .map(|s| s.to_ascii_lowercase())
            .collect();
        let value = super::yaml::parse_value(&text, &origin);
        insert_path(&mut out, &path, value, &origin);
    }
    out
}

/// The layer of `overrides`; `file` names the configuration they apply to, for errors.
///
/// # Errors
///
/// A [`ConfigErrorKind::Syntax`] error for a key that is not a dotted path of names.
pub fn override_layer(
    file: &str,
    overrides: &[Override],
) -> Result<Map<String, Value>, ConfigError> {
    let mut out = Map::new();
    for o in overrides {
        let path: Vec<String> = o.key.split('.').map(str::to_string).collect();
        let valid = |s: &String| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        if !path.iter().all(valid) {
            let mut e = ConfigError::new(
                file,
                ConfigErrorKind::Syntax,
                format!(
                    "{:?} is not a key path: names of letters, digits and `_` joined by single \
                     dots, like `stages.source.path`",
                    o.key
                ),
            );
            e.origin = Some(o.origin.as_str().into());
            return Err(e);
        }
        let value = super::yaml::parse_value(&o.value, &o.origin);
        insert_path(&mut out, &path, value, &o.origin);
    }
    Ok(out)
}

fn insert_path(map: &mut Map<String, Value>, path: &[String], value: Value, origin: &str) {
    let (first, rest) = match path.split_first() {
        Some(p) => p,
        None => return,
    };
    if rest.is_empty() {
        map.insert(first.clone(), value);
        return;
    }
    let entry = map
        .entry(first.clone())
        .or_insert_with(|| Value::new(Some(&origin.to_string()), ValueKind::Table(Map::new())));
    if !matches!(entry.kind, ValueKind::Table(_)) {
        *entry = Value::new(Some(&origin.to_string()), ValueKind::Table(Map::new()));
    }
    if let ValueKind::Table(t) = &mut entry.kind {
        insert_path(t, rest, value, origin);
    }
}

/// Merges `layers` in order: a later map's keys replace an earlier one's, maps merge key by key.
pub fn merge(layers: Vec<Map<String, Value>>) -> Map<String, Value> {
    let mut out = Map::new();
    for layer in layers {
        merge_into(&mut out, layer);
    }
    out
}

fn merge_into(dst: &mut Map<String, Value>, src: Map<String, Value>) {
    for (k, v) in src {
        match dst.get_mut(&k) {
            Some(Value {
                kind: ValueKind::Table(d),
                ..
            }) if matches!(v.kind, ValueKind::Table(_)) => {
                if let ValueKind::Table(s) = v.kind {
                    merge_into(d, s)
                }
            }
            _ => {
                dst.insert(k, v);
            }
        }
    }
}

/// The origin of `v` when it is not `file` itself (a value from the environment, a flag…).
pub fn foreign_origin(v: &Value, file: &str) -> Option<String> {
    v.origin().filter(|o| *o != file).map(str::to_string)
}

/// The user's settings file for an application's `name` (`daemon.yaml`, `serve.yaml`): the
/// explicit one, else `$XDG_CONFIG_HOME/duplex/NAME`, else `~/.config/duplex/NAME`, when it
/// exists.
pub fn user_file(explicit: Option<&Path>, name: &str) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    let xdg = std::env::var_os("XDG_CONFIG_HOME").map(PathBuf::from);
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config"));
    [xdg, home]
        .into_iter()
        .flatten()
        .map(|d| d.join("duplex").join(name))
        .find(|p| p.is_file())
}

/// An application's settings, merged: the built-in `defaults` (named `defaults_origin` in
/// messages), the user's file (see [`user_file`]), the `DUPLEX__…` environment. Returns the
/// name of the user's file for messages (`defaults` when there is none) and the merged map.
///
/// # Errors
///
/// When a layer cannot be read or parsed.
pub fn layered(
    defaults: &str,
    defaults_origin: &str,
    explicit: Option<&Path>,
    name: &str,
    env: Option<&HashMap<String, String>>,
) -> Result<(String, Map<String, Value>), ConfigError> {
    use super::yaml::{self, Limits};
    let path = user_file(explicit, name);
    let fname = path
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "defaults".into());
    let mut parts = vec![yaml::parse(defaults, defaults_origin, Limits::FILES)?];
    if let Some(p) = &path {
        let text = yaml::read(p, Limits::FILES)?;
        parts.push(yaml::parse(&text, &fname, Limits::FILES)?);
    }
    parts.push(env_layer(env));
    Ok((fname, merge(parts)))
}

/// Where a value of an application's settings came from, in words: the file and `key` (the
/// user's `fname` or the built-in `defaults_origin`), or the environment variable.
pub fn origin_in(v: &Value, fname: &str, defaults_origin: &str, key: &str) -> String {
    match v.origin() {
        Some(o) if o == fname || o == defaults_origin => format!("{o}: `{key}`"),
        Some(o) => o.to_string(),
        None => format!("{fname}: `{key}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(text: &str, origin: &str) -> Map<String, Value> {
        super::super::yaml::parse(text, origin, super::super::yaml::Limits::FILES).unwrap()
    }

    #[test]
    fn later_layers_win_and_values_keep_their_origin() {
        let env: HashMap<String, String> = [
            ("DUPLEX__STAGES__SRC__RATE".to_string(), "16000".to_string()),
            ("OTHER".to_string(), "1".to_string()),
        ]
        .into();
        let merged = merge(vec![
            text(
                "stages:\n  src: {kind: synth_source, rate: 8000, freq: 1}\n",
                "f.yaml",
            ),
            env_layer(Some(&env)),
            override_layer("f.yaml", &[Override::set("stages.src.freq", "2")]).unwrap(),
        ]);
        let ValueKind::Table(stages) = &merged["stages"].kind else {
            panic!()
        };
        let ValueKind::Table(src) = &stages["src"].kind else {
            panic!()
        };
        assert_eq!(src["rate"].kind, ValueKind::I64(16000));
        assert_eq!(
            src["rate"].origin(),
            Some("environment variable DUPLEX__STAGES__SRC__RATE")
        );
        assert_eq!(src["freq"].origin(), Some("--set stages.src.freq=2"));
        assert_eq!(src["kind"].origin(), Some("f.yaml"));
        assert_eq!(foreign_origin(&src["kind"], "f.yaml"), None);
        assert!(!merged.contains_key("other"));
    }

    #[test]
    fn a_malformed_key_path_is_refused_naming_the_flag() {
        let e = override_layer("f.yaml", &[Override::set("stages..down", "1")]).unwrap_err();
        assert_eq!(e.origin.as_deref(), Some("--set stages..down=1"));
        assert!(e.to_string().contains("is not a key path"), "{e}");
    }
}
