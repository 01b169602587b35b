//! Typed reads of an application's settings, each error naming the file (or the variable) and
//! the key.
//!
//! The daemon's and the server's settings (and the `ort:` section every settings file shares,
//! [`ort`](super::ort)) are maps merged from [`layers`](super::layers): the built-in defaults,
//! the user's file, `DUPLEX__…` variables. [`Fields`] reads one table of such a map: a string,
//! a number within a range, a boolean, a list of strings, a nested table, the set of keys it
//! may have (an unknown one is refused with a did-you-mean). Every value remembers its layer,
//! so an error blames the right place: `FILE: `limits.idle_timeout_s`: …`, or
//! `environment variable DUPLEX__LIMITS__IDLE_TIMEOUT_S (over FILE): …`. What the keys mean is
//! the caller's business; this module only reads them.
//!
//! # Examples
//!
//! ```
//! use duplex::config::{fields::Fields, yaml};
//! let map = yaml::parse("max_sessions: 4\nlimits: {idle_timeout_s: 2.5}\n", "serve.yaml",
//!     yaml::Limits::FILES).unwrap();
//! let f = Fields::new("serve.yaml", "configs/serve.yaml (built in)", &map);
//! f.known(&["max_sessions", "limits"]).unwrap();
//! assert_eq!(f.number("max_sessions", 1.0, 100.0).unwrap(), 4.0);
//! let l = f.table("limits").unwrap();
//! assert_eq!(l.number("idle_timeout_s", 0.1, 60.0).unwrap(), 2.5);
//! let e = l.number("idle_timeout_s", 5.0, 60.0).unwrap_err();
//! assert_eq!(e.to_string(), "serve.yaml: `limits.idle_timeout_s`: 2.5 is out of range 5..=60");
//! ```

use config::{Map, Value, ValueKind};

use super::params::{as_bool, as_f64, as_i64, as_string, describe, did_you_mean, ParamType};
use super::{layers, ConfigError, ConfigErrorKind, KindCatalog};

/// Typed reads of one table of an application's merged settings.
#[derive(Debug, Clone)]
pub struct Fields<'a> {
    fname: &'a str,
    defaults: &'a str,
    table: &'a Map<String, Value>,
    prefix: String,
}

impl<'a> Fields<'a> {
    /// The root table of the settings whose user file is `fname` (`defaults` when there is
    /// none) and whose built-in layer is named `defaults` in messages.
    pub fn new(fname: &'a str, defaults: &'a str, table: &'a Map<String, Value>) -> Self {
        Fields {
            fname,
            defaults,
            table,
            prefix: String::new(),
        }
    }

    /// The settings file errors name.
    pub fn file(&self) -> &'a str {
        self.fname
    }

    /// `k` as errors name it, with the path of this table (`limits.max_steps`).
    pub fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    /// The raw value of `k`, if any (an empty YAML value is `Some(Nil)`).
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.table.get(k)
    }

    /// Whether `k` has a value (neither absent nor empty).
    pub fn is_set(&self, k: &str) -> bool {
        self.get(k)
            .is_some_and(|v| !matches!(v.kind, ValueKind::Nil))
    }

    /// An error about `k`: the file and key, led by the layer its value came from when that is
    /// not the file (a variable, the built-in defaults).
    pub fn err(&self, kind: ConfigErrorKind, k: &str, message: impl Into<String>) -> ConfigError {
        let mut e = ConfigError::new(self.fname, kind, message).key(self.key(k));
        if let Some(v) = self.table.get(k) {
            e = e.from_value(v);
        }
        e
    }

    /// Where `k`'s value came from, in words: `FILE: `key`` (the user's file or the built-in
    /// defaults), or the environment variable.
    pub fn origin(&self, k: &str) -> String {
        let key = self.key(k);
        match self.table.get(k) {
            Some(v) => layers::origin_in(v, self.fname, self.defaults, &key),
            None => format!("{}: `{key}`", self.fname),
        }
    }

    /// The origin of every key of this table and of the tables in it, one level down
    /// (`sampling.seed`), by key path.
    pub fn origins(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (k, v) in self.table {
            out.push((self.key(k), self.origin(k)));
            if let ValueKind::Table(t) = &v.kind {
                let inner = self.nested(k, t);
                for k2 in t.keys() {
                    out.push((inner.key(k2), inner.origin(k2)));
                }
            }
        }
        out
    }

    /// The keys of this table, in the order written.
    pub fn keys(&self) -> Vec<String> {
        self.table.keys().cloned().collect()
    }

    /// Refuses a key that is not one of `keys`, suggesting the closest.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::UnknownKey`] naming the first such key and listing `keys`.
    pub fn known(&self, keys: &[&str]) -> Result<(), ConfigError> {
        for k in self.table.keys() {
            if !keys.contains(&k.as_str()) {
                let hint = did_you_mean(k, keys.iter().copied());
                return Err(self.err(
                    ConfigErrorKind::UnknownKey,
                    k,
                    format!("unknown key{hint}; expected: {}", keys.join(", ")),
                ));
            }
        }
        Ok(())
    }

    /// A string (empty when absent or empty; a number or boolean from the environment is taken
    /// as written).
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] for a list or a map.
    pub fn string(&self, k: &str) -> Result<String, ConfigError> {
        match self.table.get(k) {
            None => Ok(String::new()),
            Some(v) if matches!(v.kind, ValueKind::Nil) => Ok(String::new()),
            Some(v) => as_string(v).ok_or_else(|| {
                self.err(
                    ConfigErrorKind::WrongType,
                    k,
                    format!("expected a string, got {}", describe(v)),
                )
            }),
        }
    }

    /// `v` (this table's `k`) checked as the `kind` stage's param of the same name is, with its
    /// type and range from `catalog`: the daemon's and the server's settings that a stage takes
    /// are the stage's, not a copy.
    ///
    /// # Errors
    ///
    /// Unknown param, wrong type, out of range, each naming the key.
    pub fn param_value(
        &self,
        catalog: &dyn KindCatalog,
        kind: &str,
        k: &str,
        v: &Value,
    ) -> Result<f64, ConfigError> {
        let f = self;
        let ty = catalog
            .params(kind)
            .and_then(|ps| ps.iter().find(|s| s.name == k))
            .map(|s| s.ty)
            .ok_or_else(|| {
                f.err(
                    ConfigErrorKind::UnknownKey,
                    k,
                    format!("the `{kind}` stage has no param `{k}`"),
                )
            })?;
        let (x, min, max) = match ty {
            ParamType::Int { min, max } => {
                let x = as_i64(v).ok_or_else(|| {
                    f.err(
                        ConfigErrorKind::WrongType,
                        k,
                        format!("expected an integer, got {}", describe(v)),
                    )
                })?;
                if !(min..=max).contains(&x) {
                    return Err(f.err(
                        ConfigErrorKind::OutOfRange,
                        k,
                        format!("{x} is out of range {min}..={max}"),
                    ));
                }
                return Ok(x as f64);
            }
            ParamType::Float { min, max } => (as_f64(v), min, max),
            _ => (None, 0.0, 0.0),
        };
        let x = x.ok_or_else(|| {
            f.err(
                ConfigErrorKind::WrongType,
                k,
                format!("expected a number, got {}", describe(v)),
            )
        })?;
        // `contains` is false for NaN, so `.nan` is refused here too.
        if !(min..=max).contains(&x) {
            return Err(f.err(
                ConfigErrorKind::OutOfRange,
                k,
                format!("{x} is out of range {min}..={max}"),
            ));
        }
        Ok(x)
    }

    /// Where models run (`execution_provider`): `None` when absent or empty.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::OutOfRange`] for a name that is not `cpu` or `cuda`.
    pub fn provider(&self, k: &str) -> Result<Option<ExecutionProvider>, ConfigError> {
        let v = self.string(k)?;
        if v.trim().is_empty() {
            return Ok(None);
        }
        ExecutionProvider::from_name(&v).map(Some).ok_or_else(|| {
            self.err(
                ConfigErrorKind::OutOfRange,
                k,
                format!(
                    "{v:?} is not one of {}",
                    ExecutionProvider::NAMES.join(", ")
                ),
            )
        })
    }

    /// A number in `min..=max` (NaN is out of every range).
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::Missing`], [`ConfigErrorKind::WrongType`] or
    /// [`ConfigErrorKind::OutOfRange`].
    pub fn number(&self, k: &str, min: f64, max: f64) -> Result<f64, ConfigError> {
        let v = self.table.get(k).ok_or_else(|| {
            ConfigError::new(self.fname, ConfigErrorKind::Missing, "missing").key(self.key(k))
        })?;
        let x = as_f64(v).ok_or_else(|| {
            self.err(
                ConfigErrorKind::WrongType,
                k,
                format!("expected a number, got {}", describe(v)),
            )
        })?;
        if !(min..=max).contains(&x) {
            return Err(self.err(
                ConfigErrorKind::OutOfRange,
                k,
                format!("{x} is out of range {min}..={max}"),
            ));
        }
        Ok(x)
    }

    /// `true` or `false` (false when absent or empty).
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] for anything else.
    pub fn boolean(&self, k: &str) -> Result<bool, ConfigError> {
        match self.table.get(k) {
            None => Ok(false),
            Some(v) if matches!(v.kind, ValueKind::Nil) => Ok(false),
            Some(v) => as_bool(v).ok_or_else(|| {
                self.err(
                    ConfigErrorKind::WrongType,
                    k,
                    format!("expected true or false, got {}", describe(v)),
                )
            }),
        }
    }

    /// A list of strings, trimmed (from the environment: one string, comma-separated; an empty
    /// one is an empty list). `what` says what the items are, for the message.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] for a map, a list holding one, or an empty entry (`[""]`,
    /// `a,,b`: never what an operator meant).
    pub fn list(&self, k: &str, what: &str) -> Result<Vec<String>, ConfigError> {
        let bad = |v: &Value| {
            self.err(
                ConfigErrorKind::WrongType,
                k,
                format!("expected a list of {what}, got {}", describe(v)),
            )
        };
        let items: Vec<String> = match self.table.get(k) {
            None => Vec::new(),
            Some(v) => match &v.kind {
                ValueKind::Nil => Vec::new(),
                ValueKind::String(list) if list.trim().is_empty() => Vec::new(),
                ValueKind::String(list) => list.split(',').map(str::to_string).collect(),
                ValueKind::Array(a) => a
                    .iter()
                    .map(|x| as_string(x).ok_or_else(|| bad(x)))
                    .collect::<Result<_, _>>()?,
                _ => return Err(bad(v)),
            },
        };
        let items: Vec<String> = items.into_iter().map(|i| i.trim().to_string()).collect();
        if let Some(n) = items.iter().position(String::is_empty) {
            return Err(self.err(
                ConfigErrorKind::WrongType,
                k,
                format!(
                    "entry {} of the list is empty: expected {what} (an empty list is [])",
                    n + 1
                ),
            ));
        }
        Ok(items)
    }

    /// The table `k`, whose keys errors name as `k.key`.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] when `k` is absent or not a map.
    pub fn table(&self, k: &str) -> Result<Fields<'a>, ConfigError> {
        match self.table.get(k).map(|v| &v.kind) {
            Some(ValueKind::Table(t)) => Ok(self.nested(k, t)),
            _ => Err(self.err(ConfigErrorKind::WrongType, k, "expected a map")),
        }
    }

    /// The table `k`, or `None` when `k` is absent or empty.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] when `k` is something else than a map.
    pub fn optional_table(&self, k: &str) -> Result<Option<Fields<'a>>, ConfigError> {
        match self.table.get(k).map(|v| &v.kind) {
            None | Some(ValueKind::Nil) => Ok(None),
            Some(_) => self.table(k).map(Some),
        }
    }

    /// The table `k`, or `empty` (keys still named `k.key`) when `k` is absent or empty.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] when `k` is something else than a map.
    pub fn table_or(
        &self,
        k: &str,
        empty: &'a Map<String, Value>,
    ) -> Result<Fields<'a>, ConfigError> {
        Ok(self
            .optional_table(k)?
            .unwrap_or_else(|| self.nested(k, empty)))
    }

    /// A socket address like `example` (`127.0.0.1:9187`); `None` when empty or absent.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::WrongType`] for anything else.
    pub fn address(
        &self,
        k: &str,
        example: &str,
    ) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        let a = self.string(k)?;
        match a.trim() {
            "" => Ok(None),
            t => t.parse().map(Some).map_err(|err| {
                self.err(
                    ConfigErrorKind::WrongType,
                    k,
                    format!("{a:?} is not an address like {example} ({err})"),
                )
            }),
        }
    }

    /// `value` (this table's `k`, as read) when it is one of `choices`.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::OutOfRange`] listing the choices.
    pub fn one_of(&self, k: &str, value: String, choices: &[&str]) -> Result<String, ConfigError> {
        if choices.contains(&value.as_str()) {
            Ok(value)
        } else {
            Err(self.err(
                ConfigErrorKind::OutOfRange,
                k,
                format!("{value:?} is not one of {}", choices.join(", ")),
            ))
        }
    }

    /// A whole number of at least `min`.
    ///
    /// # Errors
    ///
    /// [`ConfigErrorKind::Missing`], [`ConfigErrorKind::WrongType`] (not an integer) or
    /// [`ConfigErrorKind::OutOfRange`] (`3 is below 4`).
    pub fn integer(&self, k: &str, min: i64) -> Result<i64, ConfigError> {
        let v = self.table.get(k).ok_or_else(|| {
            ConfigError::new(self.fname, ConfigErrorKind::Missing, "missing").key(self.key(k))
        })?;
        match as_i64(v) {
            Some(i) if i >= min => Ok(i),
            Some(i) => Err(self.err(
                ConfigErrorKind::OutOfRange,
                k,
                format!("{i} is below {min}"),
            )),
            None => Err(self.err(
                ConfigErrorKind::WrongType,
                k,
                format!("expected an integer, got {}", describe(v)),
            )),
        }
    }

    fn nested(&self, k: &str, t: &'a Map<String, Value>) -> Fields<'a> {
        Fields {
            fname: self.fname,
            defaults: self.defaults,
            table: t,
            prefix: format!("{}{k}.", self.prefix),
        }
    }
}

/// Where a setting says the models run (`execution_provider` of the daemon's and the server's
/// settings), read once; the stages' own param of the same name takes its [`name`](Self::name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionProvider {
    /// The CPU.
    Cpu,
    /// CUDA (a GPU build of ONNX Runtime).
    Cuda,
}

impl ExecutionProvider {
    /// The names a setting may give.
    pub const NAMES: [&'static str; 2] = ["cpu", "cuda"];

    /// From a setting's name.
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "cpu" => Some(ExecutionProvider::Cpu),
            "cuda" => Some(ExecutionProvider::Cuda),
            _ => None,
        }
    }

    /// Its name, as the stages' `execution_provider` param takes it.
    pub fn name(&self) -> &'static str {
        match self {
            ExecutionProvider::Cpu => "cpu",
            ExecutionProvider::Cuda => "cuda",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const DEFAULTS: &str = "defaults.yaml (built in)";

    fn layered(file: &str, env: &[(&str, &str)]) -> Map<String, Value> {
        let parse = |t: &str, o: &str| {
            super::super::yaml::parse(t, o, super::super::yaml::Limits::FILES).unwrap()
        };
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        layers::merge(vec![
            parse("a: 1\nt: {x: 1, y: [p, q]}\n", DEFAULTS),
            parse(file, "f.yaml"),
            layers::env_layer(Some(&env)),
        ])
    }

    /// Each read names the file and the key path; a value from the environment leads with
    /// the variable.
    #[test]
    fn errors_name_the_file_the_key_and_the_layer() {
        let m = layered("colour: yes-ish\nt: {x: 7}\n", &[("DUPLEX__T__X", "big")]);
        let f = Fields::new("f.yaml", DEFAULTS, &m);
        let e = f.known(&["a", "t"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "f.yaml: `colour`: unknown key; expected: a, t",
            "{e}"
        );
        let e = f.known(&["a", "color", "t"]).unwrap_err();
        assert!(e.to_string().contains("(did you mean `color`?)"), "{e}");
        let e = f.boolean("colour").unwrap_err();
        assert_eq!(
            e.to_string(),
            "f.yaml: `colour`: expected true or false, got \"yes-ish\" (a string)"
        );
        let t = f.table("t").unwrap();
        let e = t.number("x", 0.0, 10.0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "environment variable DUPLEX__T__X (over f.yaml): `t.x`: expected a number, got \"big\" (a string)"
        );
        assert_eq!(t.list("y", "letters").unwrap(), ["p", "q"]);
        assert_eq!(
            t.origin("y"),
            format!("{DEFAULTS}: `t.y`"),
            "a value of the defaults names them"
        );
        assert_eq!(t.origin("x"), "environment variable DUPLEX__T__X");
        assert_eq!(f.origin("colour"), "f.yaml: `colour`");
        let e = f.table("a").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("a"));
        assert!(f.optional_table("nothing").unwrap().is_none());
        let origins: HashMap<String, String> = f.origins().into_iter().collect();
        assert_eq!(origins["t.x"], "environment variable DUPLEX__T__X");
        assert_eq!(origins["colour"], "f.yaml: `colour`");
    }

    /// Empty values read as unset; a list may come from the environment as one string; an
    /// empty entry of a list is refused, naming it.
    #[test]
    fn empty_values_are_unset_and_lists_split_at_commas() {
        let m = layered(
            "s:\nb:\nholes: [a, \"\", c]\n",
            &[
                ("DUPLEX__L", " a, b "),
                ("DUPLEX__E", " "),
                ("DUPLEX__G", "a,,b"),
            ],
        );
        let f = Fields::new("f.yaml", DEFAULTS, &m);
        assert_eq!(f.string("s").unwrap(), "");
        assert!(!f.boolean("b").unwrap());
        assert!(!f.is_set("s") && f.is_set("a"));
        assert_eq!(f.list("l", "names").unwrap(), ["a", "b"]);
        assert!(f.list("e", "names").unwrap().is_empty());
        for k in ["holes", "g"] {
            let e = f.list(k, "names").unwrap_err().to_string();
            assert!(e.contains("entry 2 of the list is empty"), "{e}");
        }
        assert_eq!(
            f.number("missing", 0.0, 1.0).unwrap_err().kind,
            ConfigErrorKind::Missing
        );
    }
}
