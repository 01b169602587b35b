//! Files a pipeline reads and writes, checked against each other before anything runs.
//!
//! A sink that writes the file a source reads destroys the input; two sinks on one path lose
//! one stream; a sink inside a model pack overwrites a graph. Each param declares whether its
//! path is read ([`ParamType::Path`], [`ParamType::Dir`]) or written ([`ParamType::OutPath`]),
//! so the check needs no knowledge of stage kinds. Paths are compared as the files they name:
//! symbolic links resolved, hard links by device and inode.

use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use super::params::ParamType;
use super::pipeline::{KindCatalog, StageSpec};
use super::{ConfigError, ConfigErrorKind};

/// What a param's path is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Reads,
    ReadsDir,
    Writes,
}

/// One path named by a param.
struct Use<'a> {
    stage: &'a str,
    key: &'static str,
    role: Role,
    written: &'a str,
    /// Where it resolves to.
    real: PathBuf,
    /// Device and inode, when the file exists.
    id: Option<(u64, u64)>,
}

/// The absolute path `p` stands for: symbolic links resolved as far as the path exists.
fn resolve(p: &Path) -> PathBuf {
    if let Ok(c) = std::fs::canonicalize(p) {
        return c;
    }
    let abs = normalize(&if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    });
    // The longest existing ancestor, canonical, then the rest as written (without `.`/`..`).
    let mut tail = Vec::new();
    let mut head = abs.as_path();
    loop {
        if let Ok(c) = std::fs::canonicalize(head) {
            let mut out = c;
            for part in tail.iter().rev() {
                out.push(part);
            }
            return normalize(&out);
        }
        match (head.parent(), head.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_os_string());
                head = parent;
            }
            _ => return normalize(&abs),
        }
    }
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Refuses a pipeline whose stages would write a file another stage reads or writes, or write
/// inside a directory another stage reads.
///
/// # Errors
///
/// A [`ConfigErrorKind::Conflict`] naming both stages, their keys and the path.
pub fn check(
    file: &str,
    stages: &[StageSpec],
    catalog: &dyn KindCatalog,
) -> Result<(), ConfigError> {
    let mut uses = Vec::new();
    for s in stages {
        let Some(specs) = catalog.params(&s.kind) else {
            continue;
        };
        for spec in specs {
            let role = match spec.ty {
                ParamType::Path => Role::Reads,
                ParamType::Dir => Role::ReadsDir,
                ParamType::OutPath => Role::Writes,
                _ => continue,
            };
            let written = s.params.str(spec.name);
            if written.trim().is_empty() {
                continue;
            }
            let p = Path::new(written);
            uses.push(Use {
                stage: &s.name,
                key: spec.name,
                role,
                written,
                real: resolve(p),
                id: std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino())),
            });
        }
    }
    let same = |a: &Use<'_>, b: &Use<'_>| match (a.id, b.id) {
        (Some(x), Some(y)) => x == y,
        _ => a.real == b.real,
    };
    for (i, w) in uses.iter().enumerate() {
        if w.role != Role::Writes {
            continue;
        }
        for (j, other) in uses.iter().enumerate() {
            if i == j {
                continue;
            }
            let clash = match other.role {
                Role::Reads => same(w, other).then_some("would overwrite the file it reads"),
                Role::Writes if j > i => {
                    same(w, other).then_some("write the same file: one stream would be lost")
                }
                Role::Writes => None,
                Role::ReadsDir => (w.real.starts_with(&other.real) || same(w, other))
                    .then_some("would write inside the directory it reads"),
            };
            let Some(what) = clash else { continue };
            let both = format!(
                "stages `{}` (`{}: {}`) and `{}` (`{}: {}`)",
                w.stage, w.key, w.written, other.stage, other.key, other.written
            );
            let message = match other.role {
                Role::Writes => format!("{both} {what} ({})", w.real.display()),
                _ => format!(
                    "{both}: `{}` {what} ({}); write somewhere else",
                    w.stage,
                    w.real.display()
                ),
            };
            return Err(ConfigError::new(file, ConfigErrorKind::Conflict, message)
                .stage(w.stage)
                .key(w.key));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_through_links_and_dots() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("a.wav");
        std::fs::write(&real, b"x").unwrap();
        let link = dir.path().join("link.wav");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(resolve(&link), std::fs::canonicalize(&real).unwrap());
        let missing = dir.path().join("sub/../new.wav");
        assert_eq!(
            resolve(&missing),
            std::fs::canonicalize(dir.path()).unwrap().join("new.wav")
        );
    }
}
