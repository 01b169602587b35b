//! Build facts for the server's metadata message (the `build_info` of Kyutai's protocol): when
//! it was built, from which commit, by which compiler, for which target. Each is an environment
//! variable the crate reads with `env!`; a fact that cannot be known here is "unknown".

use std::process::Command;

fn run(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian.
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn main() {
    let unknown = || "unknown".to_string();
    // Reproducible builds set SOURCE_DATE_EPOCH; otherwise, now.
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
    let (y, m, d) = civil(secs.div_euclid(86_400));
    let t = secs.rem_euclid(86_400);
    let date = format!("{y:04}-{m:02}-{d:02}");
    let timestamp = format!("{date}T{:02}:{:02}:{:02}Z", t / 3600, t % 3600 / 60, t % 60);
    let git_timestamp = run("git", &["log", "-1", "--format=%cI"]);
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let verbose = run(&rustc, &["-vV"]).unwrap_or_default();
    let field = |name: &str| {
        verbose
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
    };
    let facts = [
        ("DUPLEX_BUILD_TIMESTAMP", timestamp),
        ("DUPLEX_BUILD_DATE", date),
        (
            "DUPLEX_GIT_BRANCH",
            run("git", &["rev-parse", "--abbrev-ref", "HEAD"]).unwrap_or_else(unknown),
        ),
        (
            "DUPLEX_GIT_DATE",
            git_timestamp
                .as_deref()
                .and_then(|t| t.get(..10))
                .map_or_else(unknown, str::to_string),
        ),
        (
            "DUPLEX_GIT_TIMESTAMP",
            git_timestamp.unwrap_or_else(unknown),
        ),
        (
            "DUPLEX_GIT_HASH",
            run("git", &["rev-parse", "HEAD"]).unwrap_or_else(unknown),
        ),
        (
            "DUPLEX_GIT_DESCRIBE",
            run("git", &["describe", "--always", "--dirty"]).unwrap_or_else(unknown),
        ),
        (
            "DUPLEX_RUSTC_HOST_TRIPLE",
            field("host:").unwrap_or_else(unknown),
        ),
        (
            "DUPLEX_RUSTC_VERSION",
            field("release:").unwrap_or_else(unknown),
        ),
        (
            "DUPLEX_CARGO_TARGET_TRIPLE",
            std::env::var("TARGET").unwrap_or_else(|_| unknown()),
        ),
    ];
    for (k, v) in facts {
        println!("cargo:rustc-env={k}={v}");
    }
    // Built again when the commit changes (HEAD moves, or the branch it names does), not on
    // every edit.
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    if let Some(git) = run("git", &["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={git}/HEAD");
        if let Some(r) = run("git", &["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={git}/{r}");
        }
    }
}
