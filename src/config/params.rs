//! Stage parameters: how a stage kind declares them and how raw YAML values are checked
//! against those declarations.

use std::collections::BTreeMap;
use std::fmt;

use config::{Value, ValueKind};

use super::{ConfigError, ConfigErrorKind};

/// The type (and allowed values) of a param.
#[derive(Debug, Clone, Copy)]
pub enum ParamType {
    /// `true` / `false`.
    Bool,
    /// An integer in `[min, max]`.
    Int {
        /// Smallest allowed.
        min: i64,
        /// Largest allowed.
        max: i64,
    },
    /// A number in `[min, max]` (integers are accepted).
    Float {
        /// Smallest allowed.
        min: f64,
        /// Largest allowed.
        max: f64,
    },
    /// Any string.
    Str,
    /// A file the stage reads.
    Path,
    /// A directory the stage reads (a model pack).
    Dir,
    /// A file the stage writes.
    OutPath,
    /// One of a fixed set of strings.
    Choice(&'static [&'static str]),
    /// A list of integers.
    IntList,
}

impl fmt::Display for ParamType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamType::Bool => f.write_str("bool"),
            ParamType::Int { min, max } => write!(f, "integer {min}..={max}"),
            ParamType::Float { min, max } => write!(f, "number {min}..={max}"),
            ParamType::Str => f.write_str("string"),
            ParamType::Path => f.write_str("path (read)"),
            ParamType::Dir => f.write_str("directory (read)"),
            ParamType::OutPath => f.write_str("path (written)"),
            ParamType::Choice(c) => write!(f, "one of {}", c.join("|")),
            ParamType::IntList => f.write_str("list of integers"),
        }
    }
}

/// A param's default.
#[derive(Debug, Clone, Copy)]
pub enum ParamDefault {
    /// Required: no default.
    Required,
    /// Optional without a value.
    None,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A number.
    Float(f64),
    /// A string (also for paths and choices).
    Str(&'static str),
}

impl fmt::Display for ParamDefault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamDefault::Required => f.write_str("required"),
            ParamDefault::None => f.write_str("unset"),
            ParamDefault::Bool(b) => write!(f, "{b}"),
            ParamDefault::Int(i) => write!(f, "{i}"),
            ParamDefault::Float(x) => write!(f, "{x}"),
            ParamDefault::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// A param declared by a stage kind.
#[derive(Debug, Clone, Copy)]
pub struct ParamSpec {
    /// Key in the pipeline file.
    pub name: &'static str,
    /// Type and allowed values.
    pub ty: ParamType,
    /// Default.
    pub default: ParamDefault,
    /// One line for `duplex stages`.
    pub doc: &'static str,
}

/// A checked param value.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    /// Boolean.
    Bool(bool),
    /// Integer.
    Int(i64),
    /// Number.
    Float(f64),
    /// String, path or choice.
    Str(String),
    /// List of integers.
    IntList(Vec<i64>),
}

impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamValue::Bool(b) => write!(f, "{b}"),
            ParamValue::Int(i) => write!(f, "{i}"),
            ParamValue::Float(x) => write!(f, "{x}"),
            ParamValue::Str(s) => write!(f, "{s}"),
            ParamValue::IntList(v) => write!(f, "{v:?}"),
        }
    }
}

impl ParamValue {
    /// As JSON, typed (a recording's manifest; read back by [`ParamValue::to_config`]).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            ParamValue::Bool(b) => (*b).into(),
            ParamValue::Int(i) => (*i).into(),
            ParamValue::Float(x) => (*x).into(),
            ParamValue::Str(s) => s.clone().into(),
            ParamValue::IntList(v) => v.clone().into(),
        }
    }
}

/// A JSON value as a raw config value, for [`check`] (`None` for what params never hold:
/// objects, nulls, lists of anything but numbers).
pub fn json_to_config(v: &serde_json::Value) -> Option<Value> {
    let kind = match v {
        serde_json::Value::Bool(b) => ValueKind::Boolean(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => ValueKind::I64(i),
            None => ValueKind::Float(n.as_f64()?),
        },
        serde_json::Value::String(s) => ValueKind::String(s.clone()),
        serde_json::Value::Array(a) => {
            ValueKind::Array(a.iter().map(json_to_config).collect::<Option<Vec<_>>>()?)
        }
        _ => return None,
    };
    Some(Value::new(None, kind))
}

/// The checked params of one stage: every declared param with a value or a default is present.
#[derive(Debug, Clone, Default)]
pub struct Params {
    values: BTreeMap<String, ParamValue>,
    /// Where each value set by a layer other than the file came from (see
    /// [`layers`](super::layers)).
    origins: BTreeMap<String, String>,
}

impl Params {
    /// Params from explicit values (for stages built in code, not from a file).
    pub fn from_pairs<I: IntoIterator<Item = (&'static str, ParamValue)>>(pairs: I) -> Self {
        Params {
            values: pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            origins: BTreeMap::new(),
        }
    }

    /// Where `name`'s value came from when not from the file itself (an environment variable,
    /// a `--set` flag, the daemon's configuration), for messages.
    pub fn origin(&self, name: &str) -> Option<&str> {
        self.origins.get(name).map(String::as_str)
    }

    /// Replaces `from` with `to` in every string value (the server's `{session}` in a session
    /// template).
    pub fn substitute(&mut self, from: &str, to: &str) {
        for v in self.values.values_mut() {
            if let ParamValue::Str(s) = v {
                if s.contains(from) {
                    *s = s.replace(from, to);
                }
            }
        }
    }

    /// The value of `name`, if set.
    pub fn get(&self, name: &str) -> Option<&ParamValue> {
        self.values.get(name)
    }

    /// A boolean param (false when unset).
    pub fn bool(&self, name: &str) -> bool {
        matches!(self.get(name), Some(ParamValue::Bool(true)))
    }

    /// An integer param (0 when unset).
    pub fn int(&self, name: &str) -> i64 {
        match self.get(name) {
            Some(ParamValue::Int(i)) => *i,
            Some(ParamValue::Float(x)) => *x as i64,
            _ => 0,
        }
    }

    /// A number param (0 when unset).
    pub fn float(&self, name: &str) -> f64 {
        match self.get(name) {
            Some(ParamValue::Float(x)) => *x,
            Some(ParamValue::Int(i)) => *i as f64,
            _ => 0.0,
        }
    }

    /// A string param (`""` when unset).
    pub fn str(&self, name: &str) -> &str {
        match self.get(name) {
            Some(ParamValue::Str(s)) => s,
            _ => "",
        }
    }

    /// A string param, `None` when unset or empty.
    pub fn opt_str(&self, name: &str) -> Option<&str> {
        Some(self.str(name)).filter(|s| !s.is_empty())
    }

    /// A list param (empty when unset).
    pub fn int_list(&self, name: &str) -> &[i64] {
        match self.get(name) {
            Some(ParamValue::IntList(v)) => v,
            _ => &[],
        }
    }

    /// All set params, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &ParamValue)> {
        self.values.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Every param as typed JSON (what a recording's manifest holds).
    pub fn to_json_map(&self) -> serde_json::Map<String, serde_json::Value> {
        self.iter()
            .map(|(k, v)| (k.to_string(), v.to_json()))
            .collect()
    }
}

/// Describes a raw value for messages: `"abc" (a string)`.
pub(crate) fn describe(v: &Value) -> String {
    let what = match &v.kind {
        ValueKind::Nil => return "nothing (null)".into(),
        ValueKind::Boolean(b) => format!("{b} (a bool)"),
        ValueKind::I64(i) => format!("{i} (an integer)"),
        ValueKind::I128(i) => format!("{i} (an integer)"),
        ValueKind::U64(i) => format!("{i} (an integer)"),
        ValueKind::U128(i) => format!("{i} (an integer)"),
        ValueKind::Float(x) => format!("{x} (a number)"),
        ValueKind::String(s) => format!("{s:?} (a string)"),
        ValueKind::Table(_) => "a map".into(),
        ValueKind::Array(_) => "a list".into(),
    };
    what
}

pub(crate) fn as_i64(v: &Value) -> Option<i64> {
    match &v.kind {
        ValueKind::I64(i) => Some(*i),
        ValueKind::I128(i) => i64::try_from(*i).ok(),
        ValueKind::U64(i) => i64::try_from(*i).ok(),
        ValueKind::U128(i) => i64::try_from(*i).ok(),
        ValueKind::Float(x) if x.fract() == 0.0 && x.abs() < 9e15 => Some(*x as i64),
        ValueKind::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

pub(crate) fn as_f64(v: &Value) -> Option<f64> {
    match &v.kind {
        ValueKind::Float(x) => Some(*x),
        ValueKind::String(s) => s.trim().parse().ok(),
        _ => as_i64(v).map(|i| i as f64),
    }
}

pub(crate) fn as_bool(v: &Value) -> Option<bool> {
    match &v.kind {
        ValueKind::Boolean(b) => Some(*b),
        ValueKind::String(s) => match s.trim() {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

pub(crate) fn as_string(v: &Value) -> Option<String> {
    match &v.kind {
        ValueKind::String(s) => Some(s.clone()),
        // Values from the environment may have been parsed as numbers or booleans.
        ValueKind::I64(_) | ValueKind::U64(_) | ValueKind::Float(_) | ValueKind::Boolean(_) => {
            Some(v.to_string())
        }
        _ => None,
    }
}

pub use crate::yaml::did_you_mean;

/// Checks the raw params of one stage against its kind's declarations.
///
/// # Errors
///
/// A [`ConfigError`] naming the file, the stage and the key: unknown param (with a suggestion),
/// wrong type, out of range, or missing required param.
pub fn check(
    file: &str,
    stage: &str,
    kind: &str,
    specs: &[ParamSpec],
    raw: &[(String, Value)],
) -> Result<Params, ConfigError> {
    let err = |key: &str, k: ConfigErrorKind, msg: String, v: &Value| {
        ConfigError::new(file, k, msg)
            .stage(stage)
            .key(key)
            .from_value(v)
    };
    let mut values = BTreeMap::new();
    let mut origins = BTreeMap::new();
    for (key, v) in raw {
        let Some(spec) = specs.iter().find(|s| s.name == key) else {
            let names: Vec<&str> = specs.iter().map(|s| s.name).collect();
            let hint = did_you_mean(key, names.iter().copied());
            return Err(err(
                key,
                ConfigErrorKind::UnknownParam,
                format!(
                    "unknown param for a `{kind}` stage{hint}; its params are: {}",
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(", ")
                    }
                ),
                v,
            ));
        };
        let value = typed(spec, key, v, &err)?;
        values.insert(key.clone(), value);
        if let Some(o) = super::layers::foreign_origin(v, file) {
            origins.insert(key.clone(), o);
        }
    }
    for spec in specs {
        if values.contains_key(spec.name) {
            continue;
        }
        let v = match spec.default {
            ParamDefault::Required => {
                return Err(ConfigError::new(
                    file,
                    ConfigErrorKind::Missing,
                    format!("required param missing ({}: {})", spec.ty, spec.doc),
                )
                .stage(stage)
                .key(spec.name))
            }
            ParamDefault::None => continue,
            ParamDefault::Bool(b) => ParamValue::Bool(b),
            ParamDefault::Int(i) => ParamValue::Int(i),
            ParamDefault::Float(x) => ParamValue::Float(x),
            ParamDefault::Str(s) => ParamValue::Str(s.into()),
        };
        values.insert(spec.name.to_string(), v);
    }
    Ok(Params { values, origins })
}

/// What error a param's value gets: its key, kind, message and value.
type ParamErr<'a> = dyn Fn(&str, ConfigErrorKind, String, &Value) -> ConfigError + 'a;

/// `v`, the param `key`, as `spec` types it: of its type, within its range or choices.
fn typed(
    spec: &ParamSpec,
    key: &str,
    v: &Value,
    err: &ParamErr<'_>,
) -> Result<ParamValue, ConfigError> {
    let wrong = || {
        let hint = match spec.ty {
            ParamType::IntList => " (write a list, like [1, 2, 3], or 1,2,3)",
            _ => "",
        };
        err(
            key,
            ConfigErrorKind::WrongType,
            format!("expected {}, got {}{hint}", spec.ty, describe(v)),
            v,
        )
    };
    let range = |msg: String| err(key, ConfigErrorKind::OutOfRange, msg, v);
    let value = match spec.ty {
        ParamType::Bool => ParamValue::Bool(as_bool(v).ok_or_else(wrong)?),
        ParamType::Int { min, max } => {
            let i = as_i64(v).ok_or_else(wrong)?;
            if i < min || i > max {
                return Err(range(format!("{i} is out of range {min}..={max}")));
            }
            ParamValue::Int(i)
        }
        ParamType::Float { min, max } => {
            let x = as_f64(v).ok_or_else(wrong)?;
            if !x.is_finite() || x < min || x > max {
                return Err(range(format!("{x} is out of range {min}..={max}")));
            }
            ParamValue::Float(x)
        }
        ParamType::Str => ParamValue::Str(as_string(v).ok_or_else(wrong)?),
        ParamType::Path | ParamType::Dir | ParamType::OutPath => {
            let p = as_string(v).ok_or_else(wrong)?;
            // An optional path left empty is unset; a required one must name something.
            if p.trim().is_empty() && matches!(spec.default, ParamDefault::Required) {
                return Err(range(format!("an empty path: name the {}", spec.ty)));
            }
            ParamValue::Str(p)
        }
        ParamType::Choice(choices) => {
            let s = as_string(v).ok_or_else(wrong)?;
            if !choices.contains(&s.as_str()) {
                return Err(range(format!("{s:?} is not one of {}", choices.join(", "))));
            }
            ParamValue::Str(s)
        }
        ParamType::IntList => match &v.kind {
            ValueKind::Array(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, it) in items.iter().enumerate() {
                    out.push(as_i64(it).ok_or_else(|| {
                        err(
                            &format!("{key}[{i}]"),
                            ConfigErrorKind::WrongType,
                            format!("expected an integer, got {}", describe(it)),
                            it,
                        )
                    })?);
                }
                ParamValue::IntList(out)
            }
            // "1,2,3" (how a list arrives from an environment variable)
            ValueKind::String(s) => ParamValue::IntList(
                s.split(',')
                    .filter(|t| !t.trim().is_empty())
                    .map(|t| t.trim().parse::<i64>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| wrong())?,
            ),
            _ => return Err(wrong()),
        },
    };
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[ParamSpec] = &[
        ParamSpec {
            name: "freq",
            ty: ParamType::Float { min: 0.0, max: 1e5 },
            default: ParamDefault::Float(440.0),
            doc: "",
        },
        ParamSpec {
            name: "path",
            ty: ParamType::Path,
            default: ParamDefault::Required,
            doc: "file",
        },
        ParamSpec {
            name: "mode",
            ty: ParamType::Choice(&["a", "b"]),
            default: ParamDefault::Str("a"),
            doc: "",
        },
    ];

    fn v(kind: ValueKind) -> Value {
        Value::new(None, kind)
    }

    #[test]
    fn defaults_fill_in_and_types_convert() {
        let p = check(
            "f.yaml",
            "s",
            "k",
            SPECS,
            &[
                ("path".into(), v(ValueKind::String("x.wav".into()))),
                ("freq".into(), v(ValueKind::I64(1000))),
            ],
        )
        .unwrap();
        assert_eq!(p.float("freq"), 1000.0);
        assert_eq!(p.str("path"), "x.wav");
        assert_eq!(p.str("mode"), "a");
    }

    #[test]
    fn mistakes_are_named() {
        let e = check(
            "f.yaml",
            "s",
            "k",
            SPECS,
            &[("frq".into(), v(ValueKind::I64(1)))],
        )
        .unwrap_err();
        assert_eq!(e.kind, ConfigErrorKind::UnknownParam);
        assert!(e.to_string().contains("did you mean `freq`"), "{e}");
        let e = check(
            "f.yaml",
            "s",
            "k",
            SPECS,
            &[("freq".into(), v(ValueKind::String("loud".into())))],
        )
        .unwrap_err();
        assert_eq!(e.kind, ConfigErrorKind::WrongType);
        assert_eq!(
            e.to_string(),
            "f.yaml: stage `s`: `freq`: expected number 0..=100000, got \"loud\" (a string)"
        );
        let e = check("f.yaml", "s", "k", SPECS, &[]).unwrap_err();
        assert_eq!(e.kind, ConfigErrorKind::Missing);
        assert!(e.to_string().contains("`path`"));
    }
}
