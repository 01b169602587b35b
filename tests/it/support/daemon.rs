//! A `duplex daemon` under test: a private PulseAudio, a configuration of its own, its log, its
//! control socket, and helpers to drive and watch it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::packs;
use super::pulse::Pulse;

pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

pub use super::wait;
pub use wait::free_port;

/// `GET path` on 127.0.0.1:port: (status code, body).
pub fn http_get(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new());
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    );
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (code, body)
}

/// The child's exit status, if it exits within `limit`.
pub fn wait_exit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

pub struct Daemon {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub pa: Pulse,
    pub log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn config_text(d: &Path, extra: &str) -> String {
    format!(
        "pipeline: {}\npack: {}\nmetrics_address: \"127.0.0.1:{}\"\ncontrol_socket: {}/control.sock\n{extra}",
        root().join("pipelines/daemon.yaml").display(),
        packs::pack("tiny-gqa").display(),
        free_port(),
        d.display()
    )
}

impl Daemon {
    pub fn start(extra: &str) -> Daemon {
        Daemon::start_with(extra, &[])
    }

    pub fn start_with(extra: &str, env: &[(&str, &str)]) -> Daemon {
        let pa = Pulse::start();
        let text = config_text(pa.dir(), extra);
        Daemon::spawn(pa, &text, env)
    }

    /// Starts a daemon on `pa` with the whole configuration `text`.
    pub fn start_with_config(pa: Pulse, text: &str) -> Daemon {
        Daemon::spawn(pa, text, &[])
    }

    fn spawn(pa: Pulse, text: &str, env: &[(&str, &str)]) -> Daemon {
        let d = pa.dir().to_path_buf();
        let config = d.join("daemon.yaml");
        std::fs::write(&config, text).unwrap();
        let log = d.join("daemon.log");
        let child = pa
            .duplex()
            .args(["daemon", "--config", config.to_str().unwrap()])
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let socket = text
            .lines()
            .find_map(|l| l.strip_prefix("control_socket: "))
            .map(PathBuf::from)
            .unwrap_or_else(|| d.join("control.sock"));
        let dm = Daemon {
            child: Some(child),
            socket,
            config,
            pa,
            log,
        };
        dm.wait_status(60, "not ready", |s| s["ready"] == true);
        dm
    }

    pub fn ctl(&self, cmd: &[&str]) -> (bool, String) {
        let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["ctl", "--socket", self.socket.to_str().unwrap()])
            .args(cmd)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).trim().to_string(),
        )
    }

    pub fn status(&self) -> Option<serde_json::Value> {
        let (ok, out) = self.ctl(&["status"]);
        if !ok {
            return None;
        }
        serde_json::from_str(&out).ok()
    }

    /// The metrics port of the configuration the daemon started with.
    pub fn metrics_port(&self) -> u16 {
        let text = std::fs::read_to_string(&self.config).unwrap();
        text.split("127.0.0.1:")
            .nth(1)
            .and_then(|t| t.split('"').next())
            .and_then(|p| p.parse().ok())
            .unwrap()
    }

    /// Waits up to `secs` for `ok(status)`.
    pub fn wait_status(&self, secs: u64, what: &str, ok: impl Fn(&serde_json::Value) -> bool) {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.status() {
                if ok(&s) {
                    return;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "{what}: {:?}\n{}",
                self.status(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn frames(&self) -> u64 {
        self.status()
            .and_then(|s| s["frames"].as_u64())
            .unwrap_or(0)
    }

    /// Waits until frames flow past `from` (the count [`frames`](Self::frames) gave), failing
    /// with `what` after 20 s.
    pub fn frames_go_on(&self, from: u64, what: &str) {
        self.wait_status(20, what, |s| s["frames"].as_u64().unwrap_or(0) > from);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
    }

    pub fn wait_log(&self, needle: &str) {
        let t0 = Instant::now();
        while !self.log().contains(needle) {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no {needle:?} in\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Writes `text` as the configuration, sends SIGHUP and waits for that reload to finish;
    /// returns how it ended, as `status` reports it (`applied: …`, `rejected: …`).
    pub fn reload(&self, text: &str) -> String {
        let done = |s: &serde_json::Value| s["reloads"]["done"].as_u64().unwrap_or(0);
        let before = self.status().map(|s| done(&s)).unwrap_or(0);
        std::fs::write(&self.config, text).unwrap();
        self.signal("-HUP");
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.status() {
                if done(&s) > before {
                    return s["reloads"]["last"].as_str().unwrap_or("").to_string();
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the reload did not finish\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
