//! Finding `libonnxruntime` and creating the one ONNX Runtime environment of the process.
//!
//! ONNX Runtime is loaded at run time (`ort`'s `load-dynamic`). Every command that loads it
//! (`run`, `validate`, `replay`, `doctor`, `daemon`, `serve`) takes the first of:
//!
//! 1. **the library the command's settings choose** ([`Chosen`]): the key `ort.library`, read
//!    with the layers of the command's settings like every key, the later over the earlier:
//!    1. the settings file's `ort.library`: the pipeline file for `run` and `validate`; for
//!       `daemon`, its settings file's, set over its pipeline file's; for `serve`, its
//!       settings file's (the session template's own, if any, must then name the same
//!       library: one per process);
//!    2. the `DUPLEX__ORT__LIBRARY` environment variable, which overrides that key as every
//!       `DUPLEX__…` variable overrides its key (for `replay` and `doctor`, which have no
//!       settings file, it is the whole setting);
//!    3. the command line: `duplex run --set ort.library=…`, `duplex doctor --ort-lib PATH`;
//! 2. the `ORT_DYLIB_PATH` environment variable;
//! 3. the project's virtual environment: `.venv/lib/python3*/site-packages/onnxruntime/capi/`
//!    under the current directory, or under the checkout the `duplex` binary was built in;
//! 4. the `onnxruntime` package of the active Python (`$VIRTUAL_ENV`, then `python3`).
//!
//! So a configured library (a key or `DUPLEX__ORT__LIBRARY`) beats `ORT_DYLIB_PATH`, which
//! beats the `.venv`. A path that a setting or `ORT_DYLIB_PATH` names and that does not exist
//! is refused, never passed over for the next place: the error names where it came from
//! ([`Origin`]). The library loaded is logged once at INFO, `loaded ONNX Runtime path=…
//! origin=…`, the origin in the same words. When nothing is found the error says what to
//! install.
//!
//! ONNX Runtime allows one environment per process, so [`environment`] creates it once and
//! every later call returns the same one, whatever it asks for: the application layer refuses
//! a later setting that names another library (restart to change it). Reading the settings
//! is the configuration layer's job (`config::ort`); this module only searches and loads.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A library a command was told to use, and who told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chosen<'a> {
    /// The library.
    pub path: &'a Path,
    /// Who chose it, in words (``environment variable DUPLEX__ORT__LIBRARY``,
    /// ``pipelines/x.yaml: `ort.library` ``, ``--ort-lib``): what messages and the log say.
    pub origin: &'a str,
}

/// Where the library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Chosen by the command's settings (a key, its `DUPLEX__…` variable, a flag), in words.
    Setting(String),
    /// `ORT_DYLIB_PATH`.
    EnvVar,
    /// The project's `.venv`.
    ProjectVenv,
    /// The active Python's `onnxruntime` package.
    Python,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Setting(who) => who.as_str(),
            Origin::EnvVar => "ORT_DYLIB_PATH",
            Origin::ProjectVenv => "project .venv",
            Origin::Python => "active Python's onnxruntime",
        })
    }
}

/// Why ONNX Runtime could not be loaded. Install it, or point `ort.library` (or
/// `ORT_DYLIB_PATH`) at it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum OrtLibError {
    /// No library in any of the places searched.
    #[error(
        "ONNX Runtime library not found (searched: {}); install it with `python3 -m pip install \
         onnxruntime==1.31.1` (or run `make setup`, which makes .venv), or set ORT_DYLIB_PATH to \
         the path of libonnxruntime.so",
        searched.join("; ")
    )]
    NotFound {
        /// What was searched, in order.
        searched: Vec<String>,
    },
    /// A path was given (by a setting or by `ORT_DYLIB_PATH`) but does not exist.
    #[error("ONNX Runtime library {} (from {origin}) does not exist", path.display())]
    Missing {
        /// The path.
        path: PathBuf,
        /// Who gave it.
        origin: Origin,
    },
    /// The library exists but could not be loaded or is too old.
    #[error("loading ONNX Runtime from {} (from {origin}): {detail}", path.display())]
    Load {
        /// The path.
        path: PathBuf,
        /// Who gave it.
        origin: Origin,
        /// The loader's error.
        detail: String,
    },
}

/// The library in use.
#[derive(Debug, Clone)]
pub struct OrtLibrary {
    /// Its path.
    pub path: PathBuf,
    /// How it was found.
    pub origin: Origin,
}

fn lib_in_capi(dir: &Path) -> Option<PathBuf> {
    let capi = dir.join("capi");
    let exact = capi.join("libonnxruntime.so");
    if exact.exists() {
        return Some(exact);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&capi)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libonnxruntime.so.") || n == "libonnxruntime.dylib")
        })
        .collect();
    found.sort();
    found.pop()
}

fn in_venv(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    let mut pys: Vec<PathBuf> = std::fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"))
        })
        .collect();
    pys.sort();
    pys.iter()
        .rev()
        .find_map(|py| lib_in_capi(&py.join("site-packages").join("onnxruntime")))
}

/// Finds the library without loading it: `chosen` when given, else the search of the
/// [module documentation](self).
///
/// # Errors
///
/// [`OrtLibError::Missing`] when a chosen or `ORT_DYLIB_PATH` path does not exist,
/// [`OrtLibError::NotFound`] when nothing is found anywhere (the message lists where it looked).
pub fn find(chosen: Option<Chosen<'_>>) -> Result<OrtLibrary, OrtLibError> {
    let mut searched = Vec::new();
    if let Some(c) = chosen {
        let origin = Origin::Setting(c.origin.to_string());
        return if c.path.exists() {
            Ok(OrtLibrary {
                path: c.path.into(),
                origin,
            })
        } else {
            Err(OrtLibError::Missing {
                path: c.path.into(),
                origin,
            })
        };
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.exists() {
            Ok(OrtLibrary {
                path: p,
                origin: Origin::EnvVar,
            })
        } else {
            Err(OrtLibError::Missing {
                path: p,
                origin: Origin::EnvVar,
            })
        };
    }
    searched.push("ORT_DYLIB_PATH (unset)".to_string());
    let mut venvs = vec![PathBuf::from(".venv")];
    // The checkout the binary lives in: target/<profile>/duplex -> ../../.venv
    if let Ok(exe) = std::env::current_exe() {
        for anc in exe.ancestors().skip(1).take(4) {
            venvs.push(anc.join(".venv"));
        }
    }
    for v in &venvs {
        if let Some(p) = in_venv(v) {
            return Ok(OrtLibrary {
                path: p,
                origin: Origin::ProjectVenv,
            });
        }
    }
    searched.push(format!(
        "project venvs {}",
        venvs
            .iter()
            .map(|v| v.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        if let Some(p) = in_venv(Path::new(&v)) {
            return Ok(OrtLibrary {
                path: p,
                origin: Origin::Python,
            });
        }
        searched.push(format!("$VIRTUAL_ENV {}", Path::new(&v).display()));
    }
    let py = std::process::Command::new("python3")
        .args([
            "-c",
            "import onnxruntime, os; print(os.path.dirname(onnxruntime.__file__))",
        ])
        .stderr(std::process::Stdio::null())
        .output();
    if let Ok(out) = py {
        if out.status.success() {
            let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if let Some(p) = lib_in_capi(Path::new(&dir)) {
                return Ok(OrtLibrary {
                    path: p,
                    origin: Origin::Python,
                });
            }
        }
    }
    searched.push("python3's onnxruntime package (not installed)".to_string());
    Err(OrtLibError::NotFound { searched })
}

static ENV: OnceLock<Result<(OrtLibrary, ort::environment::Environment), OrtLibError>> =
    OnceLock::new();

/// Loads ONNX Runtime (once per process) and returns the library in use.
///
/// The first call decides: later calls return the first result whatever `chosen` they pass
/// (compare [`OrtLibrary::path`] to refuse a different choice).
///
/// # Errors
///
/// As [`find`], plus [`OrtLibError::Load`] when the file cannot be loaded or is older than 1.31.
pub fn environment(chosen: Option<Chosen<'_>>) -> Result<&'static OrtLibrary, OrtLibError> {
    let r = ENV.get_or_init(|| {
        let lib = find(chosen)?;
        let load_err = |detail: String| OrtLibError::Load {
            path: lib.path.clone(),
            origin: lib.origin.clone(),
            detail,
        };
        let builder = ort::init_from(&lib.path).map_err(|e| load_err(e.to_string()))?;
        // ONNX Runtime's own messages go through our logging (its default sink writes
        // colour codes to stderr whether or not it is a terminal, and bypasses the journal's
        // priorities).
        let env = builder
            .with_name("duplex")
            .with_logger(std::sync::Arc::new(
                |level: ort::logging::LogLevel,
                 category: &str,
                 _id: &str,
                 at: &str,
                 message: &str| {
                    use ort::logging::LogLevel as L;
                    match level {
                        L::Fatal | L::Error => {
                            tracing::error!(target: "onnxruntime", category, at, "{message}")
                        }
                        L::Warning if optimizer_note(message) => {
                            tracing::debug!(target: "onnxruntime", category, at, "{message}")
                        }
                        L::Warning => {
                            tracing::warn!(target: "onnxruntime", category, at, "{message}")
                        }
                        // Its INFO narrates every graph transformation: detail, not news.
                        L::Info => {
                            tracing::debug!(target: "onnxruntime", category, at, "{message}")
                        }
                        L::Verbose => {
                            tracing::debug!(target: "onnxruntime", category, at, "{message}")
                        }
                    }
                },
            ))
            .build()
            .map_err(|e| load_err(e.to_string()))?;
        // Warnings and errors unless `ORT_LOG` asks for more (its INFO level narrates every
        // graph transformation of every session).
        use ort::logging::LogLevel;
        env.set_log_level(match std::env::var("ORT_LOG").as_deref() {
            Ok("verbose") => LogLevel::Verbose,
            Ok("info") => LogLevel::Info,
            Ok("error") => LogLevel::Error,
            Ok("fatal") => LogLevel::Fatal,
            _ => LogLevel::Warning,
        });
        tracing::info!(path = %lib.path.display(), origin = %lib.origin, "loaded ONNX Runtime");
        Ok((lib, env))
    });
    match r {
        Ok((lib, _)) => Ok(lib),
        Err(e) => Err(e.clone()),
    }
}

/// The process-wide ONNX Runtime environment, after [`environment`] succeeded.
pub fn env() -> Option<&'static ort::environment::Environment> {
    match ENV.get() {
        Some(Ok((_, env))) => Some(env),
        _ => None,
    }
}

/// ONNX Runtime's build string (version, commit), after [`environment`] succeeded.
pub fn build_info() -> Option<&'static str> {
    match ENV.get() {
        Some(Ok(_)) => Some(ort::info()),
        _ => None,
    }
}

/// A warning of ONNX Runtime's graph optimizer that says nothing is wrong: a node it could not
/// fold at load time (no CPU kernel for its type, as for an fp16 `Sqrt` of an fp16 graph on the
/// CPU) runs when the graph runs, as it would have without the optimizer. Logged at debug, so
/// that every fp16 session opened on a CPU does not warn.
fn optimizer_note(message: &str) -> bool {
    message.starts_with("Could not find a CPU kernel and hence can't constant fold")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chosen_missing_path_is_named_with_who_chose_it() {
        let e = find(Some(Chosen {
            path: Path::new("/nonexistent/libonnxruntime.so"),
            origin: "environment variable DUPLEX__ORT__LIBRARY",
        }))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "ONNX Runtime library /nonexistent/libonnxruntime.so (from environment variable \
             DUPLEX__ORT__LIBRARY) does not exist"
        );
    }
}
