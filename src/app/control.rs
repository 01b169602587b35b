//! The daemon's control socket and the `duplex ctl` client.
//!
//! A Unix socket (mode 0600) taking one command per line and answering one JSON line:
//! `status`, `reset`, `persona <text or ids>`, `mute`, `unmute`, `pause`, `resume`,
//! `record on|off`. Anything else, a line too long or not UTF-8 gets `{"ok": false, "error":
//! …}`; nothing a client sends can stop the server. A few connections are served at once. Each
//! has one deadline for its whole command line, and when all are taken the one that has waited
//! longest for its line gives way to a newcomer, so that clients that connect and send nothing,
//! or a byte now and then, cannot keep `duplex ctl` out; `duplex ctl` tries again for a few
//! seconds when the daemon answers that it is busy (every slot carrying out a command). This
//! module reads and answers lines; what a command does is the [`Handler`]'s business (the
//! daemon's, which sends it to its running pipeline).

use crate::files::FileError;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
pub fn applied(answer: Option<crate::runtime::Reply>, pending: &str) -> serde_json::Value {
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

/// How long a client has to send its whole command line. One deadline for the line, not a
/// timeout per read: a client that sends a byte now and then would otherwise hold one of the
/// [`MAX_CLIENTS`] slots for as long as it likes, and `duplex ctl` would find the daemon busy.
const COMMAND_WITHIN: Duration = Duration::from_secs(2);

/// How long, after the reply, what the client still sends is read and discarded.
const DRAIN_WITHIN: Duration = Duration::from_millis(200);

/// The longest command line, newline included.
const MAX_LINE: usize = 4096;

/// Why no command line came.
enum NoLine {
    TooLong,
    TimedOut,
    Io(std::io::Error),
}

/// Reads one line (up to and including its newline, or what came before the client closed)
/// by `deadline`; what comes after the newline is not read here.
fn read_line_by(s: &UnixStream, deadline: Instant) -> Result<Vec<u8>, NoLine> {
    let mut line = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NoLine::TimedOut);
        }
        s.set_read_timeout(Some(left)).map_err(NoLine::Io)?;
        let n = match (&*s).read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(NoLine::TimedOut)
            }
            Err(e) => return Err(NoLine::Io(e)),
        };
        if n == 0 {
            return Ok(line);
        }
        if let Some(end) = chunk[..n].iter().position(|&b| b == b'\n') {
            line.extend_from_slice(&chunk[..=end]);
            return if line.len() > MAX_LINE {
                Err(NoLine::TooLong)
            } else {
                Ok(line)
            };
        }
        line.extend_from_slice(&chunk[..n]);
        if line.len() >= MAX_LINE {
            return Err(NoLine::TooLong);
        }
    }
}

/// Where a connection being served is: [`READING`] its command line, then [`ANSWERING`] (the
/// command is carried out and answered), then [`DONE`]; or [`CUT`] while reading, by the
/// accept loop making room for a newcomer (then nothing of it is carried out).
type Phase = std::sync::atomic::AtomicU8;
const READING: u8 = 0;
const ANSWERING: u8 = 1;
const DONE: u8 = 2;
const CUT: u8 = 3;

/// How long a connection may wait for its command line before, when every slot is taken, it
/// gives its slot to a newcomer. A client sends its line as it connects.
const GIVE_WAY_AFTER: Duration = Duration::from_millis(250);

/// A connection being served, as the accept loop sees it.
struct Slot {
    since: Instant,
    phase: Arc<Phase>,
    /// A handle on the connection, to cut it.
    stream: UnixStream,
}

fn handle(s: UnixStream, handler: &Handler, phase: &Phase) {
    let line = read_line_by(&s, Instant::now() + COMMAND_WITHIN);
    if phase
        .compare_exchange(READING, ANSWERING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // Cut to make room: what it sent may be half a command, never carried out.
        return;
    }
    let reply = match line {
        Ok(buf) => match std::str::from_utf8(&buf) {
            Ok(line) => answer(line, handler),
            Err(_) => serde_json::json!({ "ok": false, "error": "command is not UTF-8" }),
        },
        Err(NoLine::TooLong) => {
            serde_json::json!({ "ok": false, "error": format!("command too long ({MAX_LINE} bytes at most)") })
        }
        Err(NoLine::TimedOut) => serde_json::json!({
            "ok": false,
            "error": format!(
                "no command within {} s: send one command per line, e.g. `status`",
                COMMAND_WITHIN.as_secs()
            ),
        }),
        Err(NoLine::Io(e)) => {
            serde_json::json!({ "ok": false, "error": format!("reading the command: {e}") })
        }
    };
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let _ = writeln!(&s, "{reply}");
    // Read what the client sent beyond the command (a line too long, several lines), a little
    // and briefly: closing with it unread would reset the connection and lose the reply.
    let _ = s.shutdown(std::net::Shutdown::Write);
    let deadline = Instant::now() + DRAIN_WITHIN;
    let mut sink = [0u8; 4096];
    let mut drained = 0usize;
    while drained < 1 << 20 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match (&s).read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

/// The longest path a Unix socket may have (`sun_path` holds 108 bytes with the final NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Whether a control socket can be bound at `path` without harming anything: nothing there, or
/// a socket left by a process that is gone. A file, a directory or a live socket is refused.
/// When nothing is there, it is checked as [`ControlServer::start`] would do it: its folders
/// created (under the nearest existing one) and a socket bound, under a probe's name that is
/// removed at once, so that a place where sockets cannot be made (`/proc`, a read-only file
/// system, a folder of someone else's) is refused here, not when the daemon starts.
///
/// # Errors
///
/// A [`FileError`]: what is there, and what to do.
pub fn check_socket_path(path: &Path) -> Result<(), FileError> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                Err(FileError::new(
                    path.display(),
                    "another daemon is already listening there",
                ))
            } else {
                Ok(())
            }
        }
        Ok(m) => Err(FileError::new(
            path.display(),
            format!(
                "exists and is {}, not a socket: refusing to replace it (choose another `control_socket`, or remove it)",
                crate::files::kind_of(m.file_type())
            ),
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let len = path.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return Err(FileError::new(
                    path.display(),
                    format!("{len} bytes is longer than a Unix socket's path may be ({MAX_SOCKET_PATH}): choose a shorter one"),
                ));
            }
            let here = |a: &Path| -> PathBuf {
                if a.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    a.to_path_buf()
                }
            };
            let parent = here(path.parent().unwrap_or(Path::new("")));
            // The nearest existing ancestor must be a directory to create it in.
            let Some(dir) = path.ancestors().skip(1).map(here).find(|a| a.exists()) else {
                return Ok(());
            };
            if !dir.is_dir() {
                return Err(FileError::new(
                    path.display(),
                    format!("{} is not a directory", dir.display()),
                ));
            }
            probe(path, &dir, dir == parent)
        }
        Err(e) => Err(FileError::new(path.display(), e)),
    }
}

/// Binds a socket in `dir` (in a folder made there first, when the socket's own folder is still
/// to be created), under a probe's name, and removes what it made.
fn probe(path: &Path, dir: &Path, parent_exists: bool) -> Result<(), FileError> {
    use std::os::unix::fs::DirBuilderExt;
    let name = format!(".duplex-probe-{}", std::process::id());
    let (folder, sock) = if parent_exists {
        (None, dir.join(&name))
    } else {
        let folder = dir.join(&name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&folder)
            .or_else(|e| match e.kind() {
                // Left by a process of the same id that was killed while probing.
                std::io::ErrorKind::AlreadyExists if folder.is_dir() => Ok(()),
                _ => Err(e),
            })
            .map_err(|e| {
                FileError::new(
                    path.display(),
                    format!("its folder cannot be created in {}: {e}", dir.display()),
                )
            })?;
        (Some(folder.clone()), folder.join("s"))
    };
    let bound = if sock.as_os_str().len() > MAX_SOCKET_PATH {
        // The probe's name is longer than the socket's: nothing learnt.
        Ok(())
    } else {
        use std::os::unix::fs::FileTypeExt;
        if std::fs::symlink_metadata(&sock).is_ok_and(|m| m.file_type().is_socket()) {
            let _ = std::fs::remove_file(&sock);
        }
        UnixListener::bind(&sock).map(|l| {
            drop(l);
            let _ = std::fs::remove_file(&sock);
        })
    };
    if let Some(f) = folder {
        let _ = std::fs::remove_dir(f);
    }
    bound.map_err(|e| {
        FileError::new(
            path.display(),
            format!("a socket cannot be created in {}: {e}", dir.display()),
        )
    })
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
        check_socket_path(path)?;
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
                // few at a time, so that `status` answers meanwhile. When all are taken, the
                // connection that has waited longest for its command line (a client that sends
                // nothing, or a byte now and then) gives way to the newcomer.
                let mut slots: Vec<Slot> = Vec::with_capacity(MAX_CLIENTS);
                for conn in listener.incoming() {
                    if sp.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(mut s) = conn else { continue };
                    slots.retain(|c| c.phase.load(Ordering::Acquire) != DONE);
                    if slots.len() >= MAX_CLIENTS {
                        let idle = slots
                            .iter()
                            .enumerate()
                            .filter(|(_, c)| {
                                c.phase.load(Ordering::Acquire) == READING
                                    && c.since.elapsed() >= GIVE_WAY_AFTER
                            })
                            .min_by_key(|(_, c)| c.since)
                            .map(|(i, _)| i)
                            .filter(|&i| {
                                slots[i]
                                    .phase
                                    .compare_exchange(
                                        READING,
                                        CUT,
                                        Ordering::AcqRel,
                                        Ordering::Acquire,
                                    )
                                    .is_ok()
                            });
                        match idle {
                            Some(i) => {
                                let cut = slots.swap_remove(i);
                                let _ = cut.stream.shutdown(std::net::Shutdown::Both);
                            }
                            None => {
                                let _ = writeln!(
                                    s,
                                    "{}",
                                    serde_json::json!({ "ok": false, "error": "busy: too many commands at once" })
                                );
                                continue;
                            }
                        }
                    }
                    let Ok(handle_on) = s.try_clone() else {
                        continue;
                    };
                    let phase = Arc::new(Phase::new(READING));
                    let (h, p) = (handler.clone(), phase.clone());
                    let spawned = std::thread::Builder::new()
                        .name("duplex:control-client".into())
                        .spawn(move || {
                            handle(s, &h, &p);
                            p.store(DONE, Ordering::Release);
                        });
                    if spawned.is_ok() {
                        slots.push(Slot {
                            since: Instant::now(),
                            phase,
                            stream: handle_on,
                        });
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

/// How long `duplex ctl` tries again while the daemon answers that it is busy (every
/// connection it serves is cut within [`COMMAND_WITHIN`] of its start, or answered).
const BUSY_RETRY: Duration = Duration::from_secs(4);

/// `duplex ctl`: sends one command, returns the reply line. A `busy` reply is tried again for
/// a few seconds.
///
/// # Errors
///
/// When the daemon cannot be reached (a message naming the socket).
pub fn send(path: &Path, command: &str) -> anyhow::Result<String> {
    let t0 = Instant::now();
    loop {
        let mut s = UnixStream::connect(path).map_err(|e| {
            anyhow::anyhow!("{}: {e} (is `duplex daemon` running?)", path.display())
        })?;
        // A busy daemon answers at once and closes: what the client writes meanwhile may fail.
        let reply = exchange(&mut s, command);
        let busy = match &reply {
            Ok(r) => serde_json::from_str::<serde_json::Value>(r)
                .ok()
                .and_then(|v| v["error"].as_str().map(|e| e.starts_with("busy")))
                .unwrap_or(false),
            Err(_) => true,
        };
        if !busy || t0.elapsed() >= BUSY_RETRY {
            return reply.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends the command line, reads the reply line.
fn exchange(s: &mut UnixStream, command: &str) -> std::io::Result<String> {
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
