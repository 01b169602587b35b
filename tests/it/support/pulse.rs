//! A private PulseAudio server with a null sink, for tests that need a real, paced sound device
//! without a sound card. Its monitor is the default source, so capture is a loopback of playback.
//! The server is killed when the handle is dropped.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub struct Pulse {
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Pulse {
    pub fn start() -> Pulse {
        let dir = tempfile::tempdir().unwrap();
        let mut p = Pulse { child: None, dir };
        p.spawn();
        p
    }

    fn runtime(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    /// Starts (or restarts) the server and waits until it answers.
    pub fn spawn(&mut self) {
        let run = self.runtime();
        std::fs::create_dir_all(&run).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        let child = Command::new("pulseaudio")
            .args([
                "-n",
                "--daemonize=no",
                "--exit-idle-time=-1",
                "--disable-shm=yes",
                "-L",
                "module-native-protocol-unix",
                "-L",
                "module-null-sink sink_name=nullsink",
                "-L",
                "module-always-sink",
                // Its own log, so that a stream it fails can be told from one we fail.
                "--log-level=info",
                "--log-time=1",
            ])
            .arg(format!("--log-target=file:{}", self.log_path().display()))
            .envs(self.env())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pulseaudio (run `make setup`)");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(15);
        loop {
            if self.pactl(&["info"]).status.success() {
                break;
            }
            assert!(Instant::now() < end, "pulseaudio did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let o = self.pactl(&["set-default-source", "nullsink.monitor"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }

    /// Sends `sig` (`-STOP`, `-CONT`) to the server.
    pub fn signal(&self, sig: &str) {
        let pid = self
            .child
            .as_ref()
            .expect("server running")
            .id()
            .to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }

    /// Kills the server (as a crash or a restart of the sound server would).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "XDG_RUNTIME_DIR".into(),
                self.runtime().display().to_string(),
            ),
            ("HOME".into(), self.dir.path().display().to_string()),
        ]
    }

    pub fn pactl(&self, args: &[&str]) -> Output {
        Command::new("pactl")
            .args(args)
            .envs(self.env())
            .output()
            .unwrap()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("pulse.log")
    }

    /// The server's own log, its last `n` lines after start-up (stream and module events, at
    /// info level and above), for a test that saw it fail a stream.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = log
            .lines()
            .skip_while(|l| !l.contains("Daemon startup complete"))
            .collect();
        lines[lines.len().saturating_sub(n)..].join(" | ")
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `duplex` with this server's environment.
    pub fn duplex(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_duplex"));
        c.envs(self.env());
        c
    }
}

impl Drop for Pulse {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `playback finished` summary line's fields, as numbers.
pub fn playback_summary(stderr: &str) -> std::collections::HashMap<String, f64> {
    let line = stderr
        .lines()
        .find(|l| l.contains("playback finished"))
        .unwrap_or_else(|| panic!("no playback summary in\n{stderr}"));
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| {
            v.trim_matches('"')
                .parse::<f64>()
                .ok()
                .map(|v| (k.to_string(), v))
        })
        .collect()
}
