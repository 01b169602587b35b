//! Reading the YAML a user wrote, at a bounded cost: configuration files and packs' manifests
//! are outside input.
//!
//! A few hundred bytes of nested anchors and aliases can stand for billions of values, and a
//! document nested thousands of levels deep costs time out of proportion to its size. So this
//! module reads a file only if it is a regular file under [`Limits::max_bytes`], and turns the
//! YAML parser's *events* into configuration values itself, counting as it goes: every value,
//! including each copy an alias stands for, is counted against [`Limits::max_values`] before it
//! is made, and nesting is counted against [`Limits::max_depth`]. It also refuses what the
//! configuration crate's own loader would silently accept or report badly: a key given twice in
//! one map (named, with both lines), several documents in one file, tags it does not know.
//!
//! Scalars follow the YAML 1.2 core schema: `null`/`~`/empty, `true`/`false`, integers
//! (decimal, `0x`, `0o`), floats (including `.inf` and `.nan`), everything else a string; quoted
//! and block scalars are always strings. Every value carries the name of the layer it came
//! from (its *origin*), so that an error can say whether a bad value came from the file, the
//! environment or the command line. Knows nothing of what the keys mean: the configuration
//! layer reads pipelines and settings with it, the model layer a pack's `pack.yaml`.

use std::collections::HashMap;
use std::path::Path;

use config::{Map, Value, ValueKind};
use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// What kind of mistake a [`YamlError`] reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum YamlErrorKind {
    /// The file cannot be read (missing, not a regular file, too large).
    Read,
    /// The text is not valid YAML, or costs more than its limits.
    Syntax,
}

/// A file that cannot be read as YAML: which file, what kind of mistake, and the message (with
/// the line where there is one).
#[derive(Debug, Clone)]
pub struct YamlError {
    /// The file (or the origin of the text).
    pub file: String,
    /// What kind of mistake.
    pub kind: YamlErrorKind,
    /// What is wrong.
    pub message: String,
}

impl YamlError {
    fn new(file: &str, kind: YamlErrorKind, message: impl Into<String>) -> Self {
        YamlError {
            file: file.into(),
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for YamlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file, self.message)
    }
}

impl std::error::Error for YamlError {}

/// What one configuration text may cost.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest file, in bytes.
    pub max_bytes: u64,
    /// Deepest nesting of maps and lists.
    pub max_depth: usize,
    /// Most values, counting every copy that an alias stands for.
    pub max_values: usize,
}

impl Limits {
    /// Limits for the files duplex reads: 1 MiB, 64 levels, 100 000 values. A pipeline file
    /// is a few kilobytes and a few hundred values.
    pub const FILES: Limits = Limits {
        max_bytes: 1 << 20,
        max_depth: 64,
        max_values: 100_000,
    };
}

/// Reads `path` as UTF-8 text if it is a regular file no larger than `limits.max_bytes`.
///
/// # Errors
///
/// A [`YamlErrorKind::Read`] error naming the file: missing, not a regular file (a FIFO is
/// refused rather than waited on), too large, not UTF-8.
pub fn read(path: &Path, limits: Limits) -> Result<String, YamlError> {
    let name = path.display().to_string();
    let e = |m: String| YamlError::new(&name, YamlErrorKind::Read, m);
    let bytes =
        crate::files::read_limited(path, limits.max_bytes).map_err(|err| e(err.to_string()))?;
    String::from_utf8(bytes).map_err(|err| {
        e(format!(
            "not UTF-8 text (invalid byte at offset {})",
            err.utf8_error().valid_up_to()
        ))
    })
}

/// Parses `text` into a map of values whose origin is `origin`; errors name `origin`.
///
/// An empty document is an empty map.
///
/// # Errors
///
/// A [`YamlErrorKind::Syntax`] error with the line: malformed YAML, a root that is not a map,
/// a key given twice, a non-scalar key, several documents, an unknown tag, or more than the
/// limits allow.
pub fn parse(text: &str, origin: &str, limits: Limits) -> Result<Map<String, Value>, YamlError> {
    if text.len() as u64 > limits.max_bytes {
        return Err(YamlError::new(
            origin,
            YamlErrorKind::Syntax,
            format!(
                "{} bytes is more than a configuration may hold ({} bytes)",
                text.len(),
                limits.max_bytes
            ),
        ));
    }
    let root = Loader::new(origin, limits).load(text)?;
    match root {
        None => Ok(Map::new()),
        Some((v, _)) => match v.kind {
            ValueKind::Table(t) => Ok(t),
            ValueKind::Nil => Ok(Map::new()),
            _ => Err(YamlError::new(
                origin,
                YamlErrorKind::Syntax,
                "the file is not a YAML map of `key: value` lines".to_string(),
            )),
        },
    }
}

/// Parses one value written on a command line or in an environment variable: a YAML scalar or
/// flow list (`[1, 2]`, `true`, `0.5`), or the text itself when it is anything else (not YAML,
/// or a map: `a: b` is more likely a string with a colon than a map).
pub fn parse_value(text: &str, origin: &str) -> Value {
    let small = Limits {
        max_bytes: 64 * 1024,
        max_depth: 8,
        max_values: 4096,
    };
    match Loader::new(origin, small).load(text) {
        Ok(Some((v, _))) if !matches!(v.kind, ValueKind::Table(_)) => v,
        _ => Value::new(
            Some(&origin.to_string()),
            ValueKind::String(text.to_string()),
        ),
    }
}

/// A node being built: a list, or a map with its pending key.
enum Open {
    Seq {
        items: Vec<Value>,
        anchor: usize,
        size: usize,
    },
    Map {
        entries: Map<String, Value>,
        lines: HashMap<String, usize>,
        key: Option<(String, usize)>,
        anchor: usize,
        size: usize,
    },
}

struct Loader<'a> {
    origin: &'a str,
    origin_s: String,
    limits: Limits,
    values: usize,
    anchors: HashMap<usize, (Value, usize)>,
    stack: Vec<Open>,
    /// Key path of the open maps, for messages.
    path: Vec<String>,
}

impl<'a> Loader<'a> {
    fn new(origin: &'a str, limits: Limits) -> Self {
        Loader {
            origin,
            origin_s: origin.to_string(),
            limits,
            values: 0,
            anchors: HashMap::new(),
            stack: Vec::new(),
            path: Vec::new(),
        }
    }

    fn err(&self, at: &Marker, m: impl Into<String>) -> YamlError {
        YamlError::new(
            self.origin,
            YamlErrorKind::Syntax,
            format!("line {}: {}", at.line(), m.into()),
        )
    }

    fn count(&mut self, n: usize, at: &Marker) -> Result<(), YamlError> {
        self.values = self.values.saturating_add(n);
        if self.values > self.limits.max_values {
            return Err(self.err(
                at,
                format!(
                    "the document stands for more than {} values (anchors and aliases \
                     multiply what they repeat); a configuration is far smaller",
                    self.limits.max_values
                ),
            ));
        }
        Ok(())
    }

    /// Loads the single document of `text`: `None` when there is none.
    fn load(mut self, text: &str) -> Result<Option<(Value, usize)>, YamlError> {
        let mut parser = Parser::new_from_str(text);
        let mut doc: Option<(Value, usize)> = None;
        let mut docs = 0;
        loop {
            let (ev, at) = parser.next_token().map_err(|e| {
                // The parser's own bound on nesting, met while it reads ahead.
                let info = if e.info().contains("recursion limit") {
                    "nested too deep; a configuration is far flatter"
                } else {
                    e.info()
                };
                YamlError::new(
                    self.origin,
                    YamlErrorKind::Syntax,
                    format!(
                        "line {} column {}: {info}",
                        e.marker().line(),
                        e.marker().col() + 1,
                    ),
                )
            })?;
            match ev {
                Event::StreamEnd => break,
                Event::StreamStart | Event::Nothing | Event::DocumentEnd => {}
                Event::DocumentStart => {
                    docs += 1;
                    if docs > 1 {
                        return Err(self.err(
                            &at,
                            "a second YAML document (`---`): a configuration file holds one",
                        ));
                    }
                }
                Event::SequenceStart(anchor, tag) => {
                    self.check_tag(tag.as_ref(), &at, &["seq"])?;
                    self.open(
                        Open::Seq {
                            items: Vec::new(),
                            anchor,
                            size: 1,
                        },
                        &at,
                    )?;
                }
                Event::MappingStart(anchor, tag) => {
                    self.check_tag(tag.as_ref(), &at, &["map"])?;
                    self.open(
                        Open::Map {
                            entries: Map::new(),
                            lines: HashMap::new(),
                            key: None,
                            anchor,
                            size: 1,
                        },
                        &at,
                    )?;
                }
                Event::SequenceEnd | Event::MappingEnd => {
                    let (value, size, anchor) = match self.stack.pop() {
                        Some(Open::Seq {
                            items,
                            anchor,
                            size,
                        }) => (
                            Value::new(Some(&self.origin_s), ValueKind::Array(items)),
                            size,
                            anchor,
                        ),
                        Some(Open::Map {
                            entries,
                            anchor,
                            size,
                            ..
                        }) => {
                            self.path.pop();
                            (
                                Value::new(Some(&self.origin_s), ValueKind::Table(entries)),
                                size,
                                anchor,
                            )
                        }
                        None => return Err(self.err(&at, "unbalanced end of a list or map")),
                    };
                    if anchor > 0 {
                        self.anchors.insert(anchor, (value.clone(), size));
                    }
                    if let Some(done) = self.add(value, size, &at)? {
                        doc = Some(done);
                    }
                }
                Event::Alias(id) => {
                    let Some((value, size)) = self.anchors.get(&id).cloned() else {
                        return Err(self.err(&at, "an alias to an anchor not defined before it"));
                    };
                    // Counted before the copy is kept: this is what bounds an alias bomb.
                    self.count(size, &at)?;
                    if let Some(done) = self.add(value, size, &at)? {
                        doc = Some(done);
                    }
                }
                Event::Scalar(text, style, anchor, tag) => {
                    self.count(1, &at)?;
                    let kind = self.scalar(text, style, tag.as_ref(), &at)?;
                    let value = Value::new(Some(&self.origin_s), kind);
                    if anchor > 0 {
                        self.anchors.insert(anchor, (value.clone(), 1));
                    }
                    if let Some(done) = self.add(value, 1, &at)? {
                        doc = Some(done);
                    }
                }
            }
        }
        Ok(doc)
    }

    fn open(&mut self, node: Open, at: &Marker) -> Result<(), YamlError> {
        self.count(1, at)?;
        if self.stack.len() >= self.limits.max_depth {
            return Err(self.err(
                at,
                format!(
                    "nested deeper than {} levels; a configuration is far flatter",
                    self.limits.max_depth
                ),
            ));
        }
        if let Open::Map { .. } = node {
            let key = match self.stack.last() {
                Some(Open::Map {
                    key: Some((k, _)), ..
                }) => k.clone(),
                Some(Open::Seq { items, .. }) => format!("[{}]", items.len()),
                _ => String::new(),
            };
            self.path.push(key);
        }
        self.stack.push(node);
        Ok(())
    }

    /// Adds a finished value to the open node; returns it when it is the document's root.
    fn add(
        &mut self,
        value: Value,
        size: usize,
        at: &Marker,
    ) -> Result<Option<(Value, usize)>, YamlError> {
        let dotted = self.dotted();
        match self.stack.last_mut() {
            None => Ok(Some((value, size))),
            Some(Open::Seq {
                items, size: total, ..
            }) => {
                items.push(value);
                *total += size;
                Ok(None)
            }
            Some(Open::Map {
                entries,
                lines,
                key,
                size: total,
                ..
            }) => {
                *total += size;
                match key.take() {
                    Some((k, line)) => {
                        entries.insert(k.clone(), value);
                        lines.insert(k, line);
                        Ok(None)
                    }
                    None => {
                        let k = match &value.kind {
                            ValueKind::String(s) => s.clone(),
                            ValueKind::Nil => "null".to_string(),
                            ValueKind::Table(_) | ValueKind::Array(_) => {
                                return Err(YamlError::new(
                                    self.origin,
                                    YamlErrorKind::Syntax,
                                    format!(
                                        "line {}: a key must be a plain word, not a list or a map",
                                        at.line()
                                    ),
                                ))
                            }
                            _ => value.to_string(),
                        };
                        if let Some(first) = lines.get(&k) {
                            let full = if dotted.is_empty() {
                                k.clone()
                            } else {
                                format!("{dotted}.{k}")
                            };
                            return Err(YamlError::new(
                                self.origin,
                                YamlErrorKind::Syntax,
                                format!(
                                    "line {}: `{full}` is given twice (first at line {first}); \
                                     a map holds each key once",
                                    at.line()
                                ),
                            ));
                        }
                        *key = Some((k, at.line()));
                        Ok(None)
                    }
                }
            }
        }
    }

    fn dotted(&self) -> String {
        self.path
            .iter()
            .filter(|p| !p.is_empty())
            .cloned()
            .collect::<Vec<_>>()
            .join(".")
    }

    fn check_tag(&self, tag: Option<&Tag>, at: &Marker, allowed: &[&str]) -> Result<(), YamlError> {
        match tag {
            None => Ok(()),
            Some(t) if is_core(t) && allowed.contains(&t.suffix.as_str()) => Ok(()),
            Some(t) => Err(self.err(
                at,
                format!(
                    "tag `{}{}` is not supported here (plain YAML values only)",
                    if is_core(t) { "!!" } else { &t.handle },
                    t.suffix
                ),
            )),
        }
    }

    fn scalar(
        &self,
        text: String,
        style: TScalarStyle,
        tag: Option<&Tag>,
        at: &Marker,
    ) -> Result<ValueKind, YamlError> {
        if let Some(t) = tag {
            self.check_tag(Some(t), at, &["str", "int", "float", "bool", "null"])?;
            let bad = || {
                self.err(
                    at,
                    format!("{text:?} is not a valid `!!{}` value", t.suffix),
                )
            };
            return match t.suffix.as_str() {
                "str" => Ok(ValueKind::String(text)),
                "null" => Ok(ValueKind::Nil),
                "bool" => match resolve_plain(&text) {
                    ValueKind::Boolean(b) => Ok(ValueKind::Boolean(b)),
                    _ => Err(bad()),
                },
                "int" => match resolve_plain(&text) {
                    ValueKind::I64(i) => Ok(ValueKind::I64(i)),
                    _ => Err(bad()),
                },
                _ => match resolve_plain(&text) {
                    ValueKind::I64(i) => Ok(ValueKind::Float(i as f64)),
                    ValueKind::Float(x) => Ok(ValueKind::Float(x)),
                    _ => Err(bad()),
                },
            };
        }
        Ok(match style {
            TScalarStyle::Plain => resolve_plain(&text),
            _ => ValueKind::String(text),
        })
    }
}

fn is_core(t: &Tag) -> bool {
    t.handle == "tag:yaml.org,2002:" || t.handle == "!!"
}

/// The core schema's reading of a plain scalar.
fn resolve_plain(s: &str) -> ValueKind {
    match s {
        "" | "~" | "null" | "Null" | "NULL" => return ValueKind::Nil,
        "true" | "True" | "TRUE" => return ValueKind::Boolean(true),
        "false" | "False" | "FALSE" => return ValueKind::Boolean(false),
        ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
            return ValueKind::Float(f64::INFINITY)
        }
        "-.inf" | "-.Inf" | "-.INF" => return ValueKind::Float(f64::NEG_INFINITY),
        ".nan" | ".NaN" | ".NAN" => return ValueKind::Float(f64::NAN),
        _ => {}
    }
    let (sign, digits) = match s.as_bytes().first() {
        Some(b'-') => (-1i64, &s[1..]),
        Some(b'+') => (1, &s[1..]),
        _ => (1, s),
    };
    let radix = if let Some(h) = digits.strip_prefix("0x") {
        Some((h, 16))
    } else {
        digits.strip_prefix("0o").map(|o| (o, 8))
    };
    if let Some((body, radix)) = radix {
        if !body.is_empty() && sign == 1 && s.as_bytes()[0] != b'+' {
            if let Ok(v) = i64::from_str_radix(body, radix) {
                return ValueKind::I64(v);
            }
        }
        return ValueKind::String(s.to_string());
    }
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return match s.parse::<i64>() {
            Ok(v) => ValueKind::I64(v),
            // Too large for an integer: keep the number as a float, as the core schema's
            // reading of it is a number, and let the range checks name the key.
            Err(_) => s
                .parse::<f64>()
                .map(ValueKind::Float)
                .unwrap_or_else(|_| ValueKind::String(s.to_string())),
        };
    }
    if is_float(digits) {
        if let Ok(x) = s.parse::<f64>() {
            return ValueKind::Float(x);
        }
    }
    ValueKind::String(s.to_string())
}

/// `\.[0-9]+|[0-9]+(\.[0-9]*)?` followed by an optional exponent.
fn is_float(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    let int_digits = b.iter().take_while(|c| c.is_ascii_digit()).count();
    i += int_digits;
    let mut frac_digits = 0;
    if i < b.len() && b[i] == b'.' {
        i += 1;
        frac_digits = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        i += frac_digits;
    }
    if int_digits == 0 && frac_digits == 0 {
        return false;
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        if i < b.len() && (b[i] == b'-' || b[i] == b'+') {
            i += 1;
        }
        let exp = b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
        if exp == 0 {
            return false;
        }
        i += exp;
    }
    i == b.len()
}

/// ` (did you mean `x`?)` when one of `candidates` is a likely typo of `word`, else nothing:
/// what every "unknown key" message ends with.
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    suggest(word, candidates)
        .map(|s| format!(" (did you mean `{s}`?)"))
        .unwrap_or_default()
}

/// The closest of `candidates` to `word`, if it is close enough to be a likely typo.
fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    fn dist(a: &str, b: &str) -> usize {
        let b: Vec<char> = b.chars().collect();
        let mut prev: Vec<usize> = (0..=b.len()).collect();
        for (i, ca) in a.chars().enumerate() {
            let mut cur = vec![i + 1];
            for (j, cb) in b.iter().enumerate() {
                let sub = prev[j] + usize::from(ca != *cb);
                cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
            }
            prev = cur;
        }
        prev[b.len()]
    }
    candidates
        .into_iter()
        .map(|c| (dist(word, c), c))
        .filter(|(d, c)| *d <= (c.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Map<String, Value>, YamlError> {
        parse(text, "t.yaml", Limits::FILES)
    }

    #[test]
    fn scalars_follow_the_core_schema() {
        let m = load(
            "a: 1\nb: -2.5\nc: true\nd: ~\ne: hello\nf: '1'\ng: .inf\nh: .nan\ni: 0x1f\nj: 1e3\nk: 1.2.3\n",
        )
        .unwrap();
        let kind = |k: &str| m[k].kind.clone();
        assert_eq!(kind("a"), ValueKind::I64(1));
        assert_eq!(kind("b"), ValueKind::Float(-2.5));
        assert_eq!(kind("c"), ValueKind::Boolean(true));
        assert_eq!(kind("d"), ValueKind::Nil);
        assert_eq!(kind("e"), ValueKind::String("hello".into()));
        assert_eq!(kind("f"), ValueKind::String("1".into()));
        assert_eq!(kind("g"), ValueKind::Float(f64::INFINITY));
        assert!(matches!(kind("h"), ValueKind::Float(x) if x.is_nan()));
        assert_eq!(kind("i"), ValueKind::I64(31));
        assert_eq!(kind("j"), ValueKind::Float(1000.0));
        assert_eq!(kind("k"), ValueKind::String("1.2.3".into()));
        assert_eq!(m["a"].origin(), Some("t.yaml"));
    }

    #[test]
    fn aliases_are_expanded_within_the_budget() {
        let m = load("base: &b {x: 1, y: [1, 2]}\ncopy: *b\n").unwrap();
        assert_eq!(m["copy"].to_string(), m["base"].to_string());
        // 9 levels of 9-fold aliases: 9^9 values from 200 bytes.
        let mut bomb = String::from("l0: &l0 [x, x, x, x, x, x, x, x, x]\n");
        for i in 1..9 {
            let p = i - 1;
            bomb.push_str(&format!(
                "l{i}: &l{i} [*l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}]\n"
            ));
        }
        let e = load(&bomb).unwrap_err().to_string();
        assert!(
            e.starts_with("t.yaml: line ") && e.contains("more than 100000 values"),
            "{e}"
        );
    }

    #[test]
    fn nesting_is_bounded() {
        // Ours (64 levels) or the parser's own, met while it reads ahead: both are named.
        let deep = format!("a: {}{}\n", "[".repeat(5000), "]".repeat(5000));
        let e = load(&deep).unwrap_err().to_string();
        assert!(e.contains("nested too deep"), "{e}");
        let deeper_than_ours = format!("a: {}{}\n", "[".repeat(70), "]".repeat(70));
        let e = load(&deeper_than_ours).unwrap_err().to_string();
        assert!(e.contains("nested deeper than 64 levels"), "{e}");
        let mut block = String::new();
        for i in 0..100 {
            block.push_str(&format!("{}k{i}:\n", " ".repeat(i)));
        }
        let e = load(&block).unwrap_err().to_string();
        assert!(e.contains("nested"), "{e}");
        let ok = format!("a: {}{}\n", "[".repeat(60), "]".repeat(60));
        load(&ok).unwrap();
    }

    #[test]
    fn a_key_given_twice_is_named_with_both_lines() {
        let e = load("stages:\n  source: {kind: a}\n  source: {kind: b}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "t.yaml: line 3: `stages.source` is given twice (first at line 2); a map holds each key once"
        );
    }

    #[test]
    fn other_mistakes_are_named() {
        for (text, want) in [
            ("a: 1\n---\nb: 2\n", "a second YAML document"),
            ("- 1\n- 2\n", "not a YAML map"),
            ("a: !!binary aGk=\n", "tag `!!binary` is not supported"),
            ("a: !custom 1\n", "tag `!custom` is not supported"),
            ("? [1, 2]\n: 3\n", "a key must be a plain word"),
            ("a: *nothing\n", "line 1"),
            ("a: [1, 2\n", "line 2"),
        ] {
            let e = load(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        assert!(load("").unwrap().is_empty());
        assert!(load("# only a comment\n").unwrap().is_empty());
    }

    #[test]
    fn command_line_values_read_as_flow_yaml_or_text() {
        let v = parse_value("[1, 2]", "--set");
        assert!(matches!(v.kind, ValueKind::Array(ref a) if a.len() == 2));
        assert_eq!(parse_value("0.5", "--set").kind, ValueKind::Float(0.5));
        assert_eq!(
            parse_value("in file.wav", "--set").kind,
            ValueKind::String("in file.wav".into())
        );
        assert_eq!(
            parse_value("[unclosed", "--set").kind,
            ValueKind::String("[unclosed".into())
        );
        assert_eq!(parse_value("x", "--set").origin(), Some("--set"));
    }
}
