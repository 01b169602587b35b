//! Running the `duplex` command line as a user would, from the checkout's root, with a deadline.

use std::process::{Command, Output};
use std::time::Duration;

use super::daemon::root;

/// `duplex` from the checkout's root, without an `ORT_DYLIB_PATH` of the caller's.
pub fn duplex() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_duplex"));
    c.current_dir(root()).env_remove("ORT_DYLIB_PATH");
    c
}

/// Runs `c` with a deadline of `secs`: a hang is a failure, not a stuck test.
pub fn run_within(c: Command, secs: u64) -> Output {
    super::wait::output_within(c, Duration::from_secs(secs))
}

/// What a command printed on its standard error.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

/// The `error: …` line of a failed command (all it printed when there is none).
pub fn error_line(o: &Output) -> String {
    let e = stderr(o);
    e.lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or(&e)
        .to_string()
}

/// `duplex eval ARGS`, from the checkout's root.
pub fn eval(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_duplex"))
        .arg("eval")
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

/// All a command printed: its standard output, then its standard error.
pub fn printed(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
