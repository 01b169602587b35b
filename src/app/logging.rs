//! Where logs go: stderr, human-readable on a terminal, and in the journal's own terms when
//! systemd connects stderr to the journal (`JOURNAL_STREAM` names stderr's device and inode):
//! each line starts with its syslog priority (`<3>` error, `<4>` warning, `<6>` info,
//! `<7>` debug) and carries no timestamp, since the journal adds its own. `journalctl -p warning`
//! then shows exactly the warnings and errors. Knows nothing of what is logged.

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::registry::LookupSpan;

/// True when stderr is the journal stream systemd set up for this process.
pub fn stderr_is_journal() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.to_str().and_then(|s| s.split_once(':')) else {
        return false;
    };
    let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
        return false;
    };
    dev.parse() == Ok(meta.dev()) && ino.parse() == Ok(meta.ino())
}

/// The syslog priority of a level.
fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Prefixes each event with its priority and lets `inner` write the rest.
struct Journal<F> {
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for Journal<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "<{}>", priority(event.metadata().level()))?;
        self.inner.format_event(ctx, writer, event)
    }
}

/// Installs the global subscriber with `filter` (tracing-subscriber syntax).
pub fn init(filter: &str) {
    // The SIP stack logs every datagram at INFO: its warnings are what an operator reads
    // (a filter that names it keeps its own choice).
    let filter = if filter.contains("rsipstack") {
        filter.to_string()
    } else if filter.trim().is_empty() {
        "rsipstack=warn".to_string()
    } else {
        format!("{filter},rsipstack=warn")
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_target(false);
    if stderr_is_journal() {
        let inner = format::Format::default()
            .without_time()
            .with_level(false)
            .with_target(false)
            .with_ansi(false);
        builder
            .with_ansi(false)
            .event_format(Journal { inner })
            .init();
    } else {
        builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    }
}

/// Writes the final error of a command to stderr (with the error priority in the journal).
/// A stderr that cannot be written is ignored: there is nowhere left to say it.
pub fn final_error(message: &str) {
    use std::io::Write;
    let prefix = if stderr_is_journal() { "<3>" } else { "" };
    let _ = writeln!(std::io::stderr(), "{prefix}error: {message}");
}

/// Writes a command's report to stderr, ignoring a stderr that cannot be written (the
/// report is a courtesy; the outcome is in the exit code).
pub fn report(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(priority(&Level::ERROR), 3);
        assert_eq!(priority(&Level::WARN), 4);
        assert_eq!(priority(&Level::INFO), 6);
        assert_eq!(priority(&Level::DEBUG), 7);
        assert_eq!(priority(&Level::TRACE), 7);
    }
}
