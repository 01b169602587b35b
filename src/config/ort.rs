//! The `ort:` section every settings file shares: which ONNX Runtime library a command loads.
//!
//! A pipeline file, the daemon's settings and the server's settings all accept
//!
//! ```yaml
//! ort:
//!   library: /opt/onnxruntime/lib/libonnxruntime.so   # empty = discover it
//! ```
//!
//! read here, once, through [`Fields`], like every other key: the layers of the file apply
//! (`DUPLEX__ORT__LIBRARY` overrides it, and `duplex run --set ort.library=…` overrides both),
//! and the value remembers the layer it came from. Commands that have no settings file
//! (`duplex replay`, `duplex doctor`) read the same key from the environment alone
//! ([`from_env`]). A path that is not a regular file is refused here, before anything runs,
//! naming the key and its layer. What happens when no layer sets it (`ORT_DYLIB_PATH`, the
//! project's `.venv`, …) is [`ortlib`](crate::model::ortlib)'s business, which documents the
//! whole precedence; this module loads nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::fields::Fields;
use super::{layers, ConfigError, ConfigErrorKind};

/// The section's name.
pub const SECTION: &str = "ort";

/// The keys of the section.
pub const KEYS: &[&str] = &["library"];

/// The environment variable that overrides `ort.library` in every settings file.
pub const ENV_VAR: &str = "DUPLEX__ORT__LIBRARY";

/// The ONNX Runtime library a command's settings chose, and who chose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrtChoice {
    /// The library's path, as written.
    pub path: PathBuf,
    /// Who chose it, in words: ``FILE: `ort.library` ``, ``environment variable
    /// DUPLEX__ORT__LIBRARY``, ``--set ort.library=…``, ``--ort-lib``. What the log line of
    /// the loaded library says.
    pub origin: String,
    /// The settings file whose key it is (or the flag), for errors.
    file: String,
    /// The key (`ort.library`), when it is one.
    key: Option<String>,
    /// The layer that set it when it is not `file` itself.
    over: Option<String>,
}

impl OrtChoice {
    /// A library named by a command-line flag (`--ort-lib`), unchecked.
    pub fn flag(flag: &str, path: &Path) -> Self {
        OrtChoice {
            path: path.to_path_buf(),
            origin: flag.to_string(),
            file: flag.to_string(),
            key: None,
            over: None,
        }
    }

    /// An error about this choice: the settings file and key, led by the layer that set it
    /// (`environment variable DUPLEX__ORT__LIBRARY (over FILE): `ort.library`: …`).
    pub fn error(&self, kind: ConfigErrorKind, message: impl Into<String>) -> ConfigError {
        let mut e = ConfigError::new(&self.file, kind, message);
        e.key = self.key.clone();
        e.origin = self.over.as_deref().map(Into::into);
        e
    }

    /// Checks that the path is an existing regular file.
    ///
    /// # Errors
    ///
    /// A [`ConfigErrorKind::Read`] error naming the key and its layer.
    pub fn check(&self) -> Result<(), ConfigError> {
        crate::files::check_regular(&self.path).map_err(|err| {
            let hint = if self.key.is_some() {
                " (empty = discover it)"
            } else {
                ""
            };
            self.error(
                ConfigErrorKind::Read,
                format!("ONNX Runtime library {}: {err}{hint}", self.path.display()),
            )
        })
    }
}

/// `ort.library` of the settings `root` (the root table of a settings file, with its layers),
/// checked: `None` when no layer sets it, or sets it empty.
///
/// # Errors
///
/// A [`ConfigError`] naming the file (or the variable) and the key: `ort` that is not a map,
/// an unknown key in it, a `library` that is not a string or not a regular file.
pub fn read(root: &Fields<'_>) -> Result<Option<OrtChoice>, ConfigError> {
    let Some(ort) = root.optional_table(SECTION)? else {
        return Ok(None);
    };
    ort.known(KEYS)?;
    let lib = ort.string("library").map_err(|mut e| {
        e.message = e.message.replace("expected a string", "expected a path");
        e
    })?;
    if lib.trim().is_empty() {
        return Ok(None);
    }
    let v = ort.get("library");
    let over = v.and_then(|v| layers::foreign_origin(v, root.file()));
    let chosen = OrtChoice {
        path: PathBuf::from(lib),
        origin: ort.origin("library"),
        file: root.file().to_string(),
        key: Some(ort.key("library")),
        over,
    };
    chosen.check()?;
    Ok(Some(chosen))
}

/// `ort.library` from the `DUPLEX__…` environment alone (the process's when `env` is `None`),
/// for a command without a settings file; `command` stands for the file in messages
/// (`duplex replay`). Other `DUPLEX__` variables are not this command's and are ignored.
///
/// # Errors
///
/// As [`read`].
pub fn from_env(
    command: &str,
    env: Option<&HashMap<String, String>>,
) -> Result<Option<OrtChoice>, ConfigError> {
    let mut layer = layers::env_layer(env);
    layer.retain(|k, _| k == SECTION);
    read(&Fields::new(command, command, &layer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The variable is the key; a missing library is refused naming both; empty is unset.
    #[test]
    fn the_environment_sets_the_key_and_a_missing_library_is_named() {
        let e = from_env("duplex replay", Some(&env(&[(ENV_VAR, "/nonexistent.so")]))).unwrap_err();
        assert_eq!(
            e.to_string(),
            "environment variable DUPLEX__ORT__LIBRARY (over duplex replay): `ort.library`: \
             ONNX Runtime library /nonexistent.so: No such file or directory (os error 2) \
             (empty = discover it)"
        );
        assert_eq!(e.kind, ConfigErrorKind::Read);
        assert!(from_env("x", Some(&env(&[(ENV_VAR, "")])))
            .unwrap()
            .is_none());
        assert!(from_env("x", Some(&env(&[("DUPLEX__OTHER", "1")])))
            .unwrap()
            .is_none());
        let e = from_env("x", Some(&env(&[("DUPLEX__ORT__LIBARY", "/a")]))).unwrap_err();
        assert!(e.to_string().contains("did you mean `library`"), "{e}");
        let file = std::env::current_exe().unwrap();
        let ok = from_env("x", Some(&env(&[(ENV_VAR, file.to_str().unwrap())])))
            .unwrap()
            .unwrap();
        assert_eq!(ok.path, file);
        assert_eq!(ok.origin, "environment variable DUPLEX__ORT__LIBRARY");
    }

    /// In a file, the origin is the file and key.
    #[test]
    fn a_file_names_itself_and_the_key() {
        let m = super::super::yaml::parse(
            "ort: {library: /nonexistent.so}\n",
            "p.yaml",
            super::super::yaml::Limits::FILES,
        )
        .unwrap();
        let e = read(&Fields::new("p.yaml", "d", &m)).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("p.yaml: `ort.library`: ONNX Runtime library /nonexistent.so: "),
            "{e}"
        );
        let file = std::env::current_exe().unwrap();
        let text = format!("ort: {{library: {}}}\n", file.display());
        let m =
            super::super::yaml::parse(&text, "p.yaml", super::super::yaml::Limits::FILES).unwrap();
        let ok = read(&Fields::new("p.yaml", "d", &m)).unwrap().unwrap();
        assert_eq!(ok.origin, "p.yaml: `ort.library`");
        let m = super::super::yaml::parse("ort: 3\n", "p.yaml", super::super::yaml::Limits::FILES)
            .unwrap();
        let e = read(&Fields::new("p.yaml", "d", &m)).unwrap_err();
        assert_eq!(e.to_string(), "p.yaml: `ort`: expected a map");
    }
}
