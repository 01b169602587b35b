//! The daemon's control socket and the `duplex ctl` client.
//!
//! A Unix socket (mode 0600) taking one command per line and answering one JSON line:
//! `status`, `reset`, `persona <text or ids>`, `mute`, `unmute`, `pause`, `resume`. Anything
//! else, a line too long or not UTF-8 gets `{"ok": false, "error": …}`; nothing a client sends
//! can stop the server. This module reads and answers lines; what a command does is the
//! [`Handler`]'s business (the daemon's, which sends it to its running pipeline).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Commands served at once.
const MAX_CLIENTS: usize = 8;

/// What carries out a command and makes its JSON reply.
pub type Handler = Arc<dyn Fn(Command) -> serde_json::Value + Send + Sync>;

/// A running control socket; dropping it removes the socket.
pub struct ControlServer {
    path: PathBuf,
    /// The socket's inode: only this socket is removed at the end, not whatever replaced it.
    ino: Option<u64>,
    stop: Arc<AtomicBool>,
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop.
        let _ = UnixStream::connect(&self.path);
        let ours = std::fs::symlink_metadata(&self.path).is_ok_and(|m| Some(m.ino()) == self.ino);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// How long a command waits for a stage to apply it (it does at its next frame, 80 ms).
pub const STAGE_ANSWER: Duration = Duration::from_secs(2);

/// The reply to a command a stage applies: its answer, or "pending" when no frame came in time
/// (paused, a device away, the pipeline being rebuilt): the request then applies at the next one.
pub fn applied(answer: Option<Result<String, String>>, pending: &str) -> serde_json::Value {
    match answer {
        Some(Ok(done)) => serde_json::json!({ "ok": true, "done": done }),
        Some(Err(e)) => serde_json::json!({ "ok": false, "error": e }),
        None => serde_json::json!({ "ok": true, "pending": pending }),
    }
}

/// A command of the control socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// The daemon's status.
    Status,
    /// A new conversation.
    Reset,
    /// A new persona: text, or comma-separated token ids.
    Persona(String),
    /// Mute (`true`) or unmute the microphone.
    Mute(bool),
    /// Pause (`true`) or resume the conversation.
    Pause(bool),
    /// Record (`true`: a new, recorded conversation) or stop recording.
    Record(bool),
}

/// Reads one command line.
///
/// # Errors
///
/// A message naming the line (cut to 80 characters) and listing the commands.
pub fn parse(line: &str) -> Result<Command, String> {
    let line = line.trim();
    let (cmd, arg) = line
        .split_once(' ')
        .map(|(a, b)| (a, b.trim()))
        .unwrap_or((line, ""));
    match (cmd, arg) {
        ("status", "") => Ok(Command::Status),
        ("reset", "") => Ok(Command::Reset),
        ("persona", p) if !p.trim_matches('"').is_empty() => {
            Ok(Command::Persona(p.trim_matches('"').to_string()))
        }
        ("mute", "") => Ok(Command::Mute(true)),
        ("unmute", "") => Ok(Command::Mute(false)),
        ("pause", "") => Ok(Command::Pause(true)),
        ("resume", "") => Ok(Command::Pause(false)),
        ("record", "on") => Ok(Command::Record(true)),
        ("record", "off") => Ok(Command::Record(false)),
        _ => Err(format!(
            "unknown or malformed command {:?}; commands: status, reset, persona <text>, mute, unmute, pause, resume, record on|off",
            line.chars().take(80).collect::<String>()
        )),
    }
}

/// Answers one command line.
pub fn answer(line: &str, handler: &Handler) -> serde_json::Value {
    match parse(line) {
        Ok(c) => handler(c),
        Err(e) => serde_json::json!({ "ok": false, "error": e }),
    }
}

fn handle(stream: UnixStream, handler: &Handler) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
    let mut reader = BufReader::new(stream.take(4096));
    let mut buf = Vec::new();
    let reply = match reader.read_until(b'\n', &mut buf) {
        Ok(_) => match std::str::from_utf8(&buf) {
            Ok(line) if buf.len() < 4096 => answer(line, handler),
            Ok(_) => {
                serde_json::json!({ "ok": false, "error": "command too long (4096 bytes at most)" })
            }
            Err(_) => serde_json::json!({ "ok": false, "error": "command is not UTF-8" }),
        },
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            serde_json::json!({ "ok": false, "error": "no command within 2 s: send one command per line, e.g. `status`" })
        }
        Err(e) => serde_json::json!({ "ok": false, "error": format!("reading the command: {e}") }),
    };
    let mut s = reader.into_inner().into_inner();
    let _ = writeln!(s, "{reply}");
    // Read what the client sent beyond the command (a line too long, several lines), a little
    // and briefly: closing with it unread would reset the connection and lose the reply.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = std::io::copy(&mut (&s).take(1 << 20), &mut std::io::sink());
}

/// Whether a control socket can be bound at `path` without harming anything: nothing there, or
/// a socket left by a process that is gone. A file, a directory or a live socket is refused.
///
/// # Errors
///
/// What is there, and what to do.
pub fn check_socket_path(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                Err(format!(
                    "{}: another daemon is already listening there",
                    path.display()
                ))
            } else {
                Ok(())
            }
        }
        Ok(m) => Err(format!(
            "{} exists and is {}, not a socket: refusing to replace it (choose another `control_socket`, or remove it)",
            path.display(),
            crate::files::kind_of(m.file_type())
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // The nearest existing ancestor must be a directory to create it in.
            match path.ancestors().skip(1).find(|a| a.exists()) {
                Some(a) if !a.is_dir() && !a.as_os_str().is_empty() => Err(format!(
                    "{}: {} is not a directory",
                    path.display(),
                    a.display()
                )),
                _ => Ok(()),
            }
        }
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Creates the missing directories above `path`, each private to this user (0700). Existing
/// directories are left as they are: their mode is their owner's business.
fn create_private_dirs(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    let missing: Vec<&Path> = dir.ancestors().take_while(|a| !a.exists()).collect();
    for d in missing.iter().rev() {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(d)
            .or_else(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => Ok(()),
                _ => Err(e),
            })
            .map_err(|e| anyhow::anyhow!("{}: {e}", d.display()))?;
    }
    Ok(())
}

impl ControlServer {
    /// Binds `path` with mode 0600 and serves it on a thread. Missing directories above it are
    /// created private (0700); existing ones are not touched. A stale socket (nothing listens
    /// on it) is replaced; anything else already at `path` is refused.
    ///
    /// # Errors
    ///
    /// When the socket cannot be created (a message naming the path).
    pub fn start(path: &Path, handler: Handler) -> anyhow::Result<ControlServer> {
        check_socket_path(path).map_err(anyhow::Error::msg)?;
        create_private_dirs(path)?;
        if std::fs::symlink_metadata(path).is_ok() {
            // A stale socket, checked above.
            let _ = std::fs::remove_file(path);
        }
        let listener =
            UnixListener::bind(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let ino = {
            use std::os::unix::fs::MetadataExt;
            std::fs::symlink_metadata(path).map(|m| m.ino()).ok()
        };
        let stop = Arc::new(AtomicBool::new(false));
        let sp = stop.clone();
        std::thread::Builder::new()
            .name("duplex:control".into())
            .spawn(move || {
                // A command may wait for a frame boundary: each connection gets a thread, a
                // few at a time, so that `status` answers meanwhile.
                let busy = Arc::new(AtomicUsize::new(0));
                for conn in listener.incoming() {
                    if sp.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(mut s) = conn else { continue };
                    if busy.load(Ordering::Acquire) >= MAX_CLIENTS {
                        let _ = writeln!(
                            s,
                            "{}",
                            serde_json::json!({ "ok": false, "error": "busy: too many commands at once" })
                        );
                        continue;
                    }
                    busy.fetch_add(1, Ordering::AcqRel);
                    let (h, b) = (handler.clone(), busy.clone());
                    let spawned = std::thread::Builder::new()
                        .name("duplex:control-client".into())
                        .spawn(move || {
                            handle(s, &h);
                            b.fetch_sub(1, Ordering::AcqRel);
                        });
                    if spawned.is_err() {
                        busy.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })?;
        tracing::info!(socket = %path.display(), "control socket ready");
        Ok(ControlServer {
            path: path.to_path_buf(),
            ino,
            stop,
        })
    }
}

/// `duplex ctl`: sends one command, returns the reply line.
///
/// # Errors
///
/// When the daemon cannot be reached (a message naming the socket).
pub fn send(path: &Path, command: &str) -> anyhow::Result<String> {
    let mut s = UnixStream::connect(path)
        .map_err(|e| anyhow::anyhow!("{}: {e} (is `duplex daemon` running?)", path.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    writeln!(s, "{command}")?;
    let mut reply = String::new();
    BufReader::new(s).read_line(&mut reply)?;
    Ok(reply.trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_gets_an_error_reply_and_commands_reach_the_handler() {
        let handler: Handler = Arc::new(|c| match c {
            Command::Status => serde_json::json!({ "ok": true, "ready": true }),
            other => serde_json::json!({ "ok": true, "done": format!("{other:?}") }),
        });
        assert_eq!(answer("status\n", &handler)["ready"], true);
        for bad in [
            "",
            "bogus",
            "persona",
            "persona \"\"",
            "mute now",
            "\u{0}\u{1}",
        ] {
            let r = answer(bad, &handler);
            assert_eq!(r["ok"], false, "{bad:?}: {r}");
        }
        assert_eq!(answer("mute", &handler)["done"], "Mute(true)");
        assert_eq!(
            answer(" persona  \"kind\" ", &handler)["done"],
            "Persona(\"kind\")"
        );
    }
}
