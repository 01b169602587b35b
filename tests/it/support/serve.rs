//! A `duplex serve` under test: a configuration and session template of its own in a scratch
//! folder, its log, and test clients of the protocol written on independent parts (Python:
//! Kyutai's `sphn` for Ogg/Opus, `aiohttp` for the WebSocket: `tests/clients/moshi_client.py`).
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::daemon::{http_get, root, wait_exit};

pub use super::daemon::wait;
use wait::wait_until;

/// The session template of the tests: the default one, with the user's codes and the agent's
/// tokens logged per session, and silence fed only after `fill_after_ms`.
pub fn template(logs: &Path, fill_after_ms: u32) -> String {
    let text = std::fs::read_to_string(root().join("pipelines/serve.yaml")).unwrap();
    let logs = logs.display();
    let text = text
        .replace(
            "    kind: session_in\n",
            &format!("    kind: session_in\n    fill_after_ms: {fill_after_ms}\n"),
        )
        .replace(
            "links:\n",
            &format!(
                "  user_codes:\n    kind: codes_sink\n    path: {logs}/{{session}}/user.jsonl\n  \
                 agent_tokens:\n    kind: token_sink\n    path: {logs}/{{session}}/agent.jsonl\nlinks:\n  \
                 - encode -> user_codes\n  - temporal.agent -> agent_tokens\n"
            ),
        )
        .replace("models/", &format!("{}/models/", root().display()));
    text
}

/// Writes a keys file as an operator must: readable by its owner only (the server refuses keys
/// in the clear that others may read).
pub fn write_keys(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A 24 kHz WAV of `seconds` of a speech-like signal (a tone with a syllable-rate envelope).
pub fn speech_wav(path: &Path, seconds: f64, pitch: f64) {
    let n = (seconds * 24_000.0) as usize;
    let x: Vec<f32> = (0..n)
        .map(|i| {
            let t = i as f64 / 24_000.0;
            let env = 0.5 + 0.5 * (std::f64::consts::TAU * 3.0 * t).sin();
            (0.3 * env * (std::f64::consts::TAU * pitch * t).sin()) as f32
        })
        .collect();
    write_wav_24k(path, &x);
}

/// `samples` (in [-1, 1]) as a 16-bit mono WAV at 24 kHz.
pub fn write_wav_24k(path: &Path, samples: &[f32]) {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: 24_000,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for v in samples {
        w.write_sample((f64::from(v.clamp(-1.0, 1.0)) * 32767.0) as i16)
            .unwrap();
    }
    w.finalize().unwrap();
}

/// A 16-bit WAV's rate and samples in [-1, 1].
pub fn read_wav(path: &Path) -> (u32, Vec<f64>) {
    let mut r = hound::WavReader::open(path).unwrap();
    let rate = r.spec().sample_rate;
    let s = r
        .samples::<i16>()
        .map(|s| s.unwrap() as f64 / 32768.0)
        .collect();
    (rate, s)
}

pub struct Server {
    pub child: Option<Child>,
    pub port: u16,
    pub dir: tempfile::TempDir,
    pub log: PathBuf,
    /// The API key [`get`](Self::get) presents (a server with `keys_file`).
    pub key: Option<String>,
    /// The address it listens on.
    pub host: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Server {
    /// Starts `duplex serve` with `config` (YAML; `address` and `pipeline` are added) and a
    /// template of [`template`]'s shape; waits until it listens.
    pub fn start(config: &str, fill_after_ms: u32) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("sessions");
        let tpl = dir.path().join("session.yaml");
        std::fs::write(&tpl, template(&logs, fill_after_ms)).unwrap();
        Self::start_with(dir, config, &tpl)
    }

    /// As [`start`](Self::start) with a template file of the caller's.
    pub fn start_with(dir: tempfile::TempDir, config: &str, template: &Path) -> Server {
        Self::launch(
            dir,
            config,
            template,
            "127.0.0.1",
            Command::new(env!("CARGO_BIN_EXE_duplex")),
        )
    }

    /// As [`start`](Self::start), listening on `host` (an address of this machine or of a
    /// namespace), the binary run by `launcher` (e.g. `ip netns exec NAME`), or directly when
    /// it is `None`.
    pub fn start_on(
        host: &str,
        launcher: Option<Command>,
        config: &str,
        fill_after_ms: u32,
    ) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("sessions");
        let tpl = dir.path().join("session.yaml");
        std::fs::write(&tpl, template(&logs, fill_after_ms)).unwrap();
        let cmd = match launcher {
            Some(mut c) => {
                c.arg(env!("CARGO_BIN_EXE_duplex"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_duplex")),
        };
        Self::launch(dir, config, &tpl, host, cmd)
    }

    fn launch(
        dir: tempfile::TempDir,
        config: &str,
        template: &Path,
        host: &str,
        mut cmd: Command,
    ) -> Server {
        let cfg = dir.path().join("serve.yaml");
        // The server runs in its own folder: the default detector's relative path is the
        // checkout's.
        let detector = if config.contains("realtime:") {
            String::new()
        } else {
            format!(
                "realtime: {{vad_model: {}}}\n",
                super::daemon::root()
                    .join("models/vad/silero_vad.onnx")
                    .display()
            )
        };
        std::fs::write(
            &cfg,
            format!(
                "address: \"{host}:0\"\npipeline: {}\n{detector}{config}",
                template.display()
            ),
        )
        .unwrap();
        let log = dir.path().join("serve.log");
        let mut child = cmd
            .args(["serve", "--config"])
            .arg(&cfg)
            .current_dir(dir.path())
            .env("RUST_LOG", "info")
            .env_remove("DUPLEX__MAX_SESSIONS")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening on ") {
                    let _ = tx.send(a.rsplit(':').next().unwrap().parse::<u16>().unwrap());
                }
            }
        });
        let port = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(p) => p,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "duplex serve did not listen:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            }
        };
        Server {
            child: Some(child),
            port,
            dir,
            log,
            key: None,
            host: host.to_string(),
        }
    }

    pub fn url(&self) -> String {
        format!("ws://{}:{}/api/chat", self.host, self.port)
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        match &self.key {
            None if self.host == "127.0.0.1" => http_get(self.port, path),
            None => {
                let (code, _, body) =
                    self.request(&format!("GET {path} HTTP/1.1\r\nHost: localhost"));
                (code, body)
            }
            Some(k) => {
                let (code, _, body) = self.request(&format!(
                    "GET {path} HTTP/1.1\r\nHost: localhost\r\nkyutai-api-key: {k}"
                ));
                (code, body)
            }
        }
    }

    pub fn metrics(&self) -> String {
        self.get("/metrics").1
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The folder of session `id`'s logs.
    pub fn session_dir(&self, id: u64) -> PathBuf {
        self.dir.path().join("sessions").join(id.to_string())
    }

    /// The sessions `/api/sessions` lists (none while it does not answer).
    pub fn sessions(&self) -> Vec<serde_json::Value> {
        let (_, body) = self.get("/api/sessions");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["sessions"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until `/api/sessions` lists `n` sessions.
    pub fn wait_sessions(&self, n: usize, secs: u64) {
        let what = format!("{n} sessions listed");
        wait_until(Duration::from_secs(secs), &what, || {
            self.sessions().len() == n
        });
    }

    /// Waits until `/api/sessions` lists `n` sessions, each at least `age_s` seconds old (each
    /// mid-conversation).
    pub fn wait_sessions_aged(&self, n: usize, age_s: f64, secs: u64) {
        let what = format!("{n} sessions listed, each {age_s} s old");
        wait_until(Duration::from_secs(secs), &what, || {
            let listed = self.sessions();
            listed.len() == n
                && listed
                    .iter()
                    .all(|s| s["age_s"].as_f64().is_some_and(|a| a >= age_s))
        });
    }

    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        assert!(Command::new("kill")
            .args([&format!("-{sig}"), &pid])
            .status()
            .unwrap()
            .success());
    }

    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        wait_exit(self.child.as_mut().unwrap(), limit)
    }

    /// Resident memory of the server, KiB.
    pub fn rss_kib(&self) -> u64 {
        self.proc_status_kib("VmRSS:")
    }

    /// The highest resident memory of the server so far (the kernel's high-water mark), KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        self.proc_status_kib("VmHWM:")
    }

    /// CPU time the server has used so far (user and system, all threads), seconds.
    pub fn cpu_seconds(&self) -> f64 {
        let pid = self.child.as_ref().unwrap().id();
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // After the command's closing parenthesis: state is field 3; utime and stime 14 and 15.
        let rest = &s[s.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
        ticks / 100.0
    }

    fn proc_status_kib(&self, field: &str) -> u64 {
        let pid = self.child.as_ref().unwrap().id();
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        s.lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap()
    }

    /// Sends `head` (a request's lines without the final blank line) and returns the status,
    /// the response's head and its body.
    pub fn request(&self, head: &str) -> (u16, String, String) {
        self.exchange(&format!("{head}\r\nConnection: close\r\n\r\n"))
    }

    fn exchange(&self, raw: &str) -> (u16, String, String) {
        exchange(&self.host, self.port, raw)
    }

    /// POSTs `body` as `content_type` to `path`; returns the status, the head and the body.
    pub fn post(&self, path: &str, content_type: &str, body: &str) -> (u16, String, String) {
        self.send("POST", path, content_type, body)
    }

    /// Sends a request with a body (empty: none) by `method`.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: &str,
    ) -> (u16, String, String) {
        send_to(
            &self.host,
            self.port,
            self.key.as_deref(),
            [method, path, content_type, body],
        )
    }
}

/// Writes `raw` (a whole request) to `host:port` and reads the response to its end: the
/// status, the head and the body.
pub fn exchange(host: &str, port: u16, raw: &str) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect((host, port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(raw.as_bytes()).unwrap();
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (h, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = h
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, h.to_string(), b.to_string())
}

/// Sends `[method, path, content type, body]` (an empty body: none) to `host:port`, with `key`
/// when given; returns the status, the head and the body.
pub fn send_to(host: &str, port: u16, key: Option<&str>, req: [&str; 4]) -> (u16, String, String) {
    let [method, path, content_type, body] = req;
    let key = key
        .map(|k| format!("kyutai-api-key: {k}\r\n"))
        .unwrap_or_default();
    exchange(
        host,
        port,
        &format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{key}Content-Type: {content_type}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
}

/// Runs the page in headless Chromium (`tests/clients/browser.py` with `args`) and returns
/// what it printed (one JSON object).
pub fn browser(args: &[&str]) -> serde_json::Value {
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/clients/browser.py"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "browser {args:?}: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("browser output is not JSON ({e}): {text}"))
}

/// The test client's command (`args` after `--url`).
pub fn client_command(url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(root().join(".venv/bin/python"));
    c.arg(root().join("tests/clients/moshi_client.py"))
        .args(["--url", url])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Runs the hostile client (`tests/clients/hostile.py`, `args` after `--url`) to its end and
/// returns what it saw.
pub fn hostile(url: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("tests/clients/hostile.py"))
        .args(["--url", url])
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "hostile client {args:?} failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("hostile client output is not JSON ({e}): {text}"))
}

/// Runs the test client to its end and returns what it saw.
pub fn client(url: &str, args: &[&str]) -> serde_json::Value {
    let out = client_command(url, args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client {args:?} failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(text.lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("client output is not JSON ({e}): {text}"))
}

/// The agent's token log of a session: (text pieces joined per frame, frames).
/// Replays a session's logged user codes (`duplex replay --greedy` and `extra`, on the tiny
/// pack) into `out` and checks every frame's tokens equal those the session logged; returns the
/// number of frames.
pub fn assert_replay_matches(session: &Path, out: &Path, extra: &[&str]) -> usize {
    let st = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["replay", "--greedy", "--pack"])
        .arg(root().join("models/tiny-gqa"))
        .arg("--codes")
        .arg(session.join("user.jsonl"))
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let live = token_log(&session.join("agent.jsonl"));
    let replayed = token_log(out);
    assert_eq!(live.len(), replayed.len(), "{}", session.display());
    for (i, (a, b)) in live.iter().zip(&replayed).enumerate() {
        assert_eq!(
            (&a["text"], &a["audio"]),
            (&b["text"], &b["audio"]),
            "{}: frame {i} differs",
            session.display()
        );
    }
    live.len()
}

pub fn token_log(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The value of the series `name` (with its labels as rendered) in a Prometheus rendering, 0
/// when absent.
pub fn metric_value_of(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.rsplit_once(' ').map(|x| x.0) == Some(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}
