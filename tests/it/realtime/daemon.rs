//! `duplex daemon` against a private PulseAudio null sink and the tiny pack: readiness, the
//! control socket, reload on SIGHUP, recovery from a lost device, graceful stop.

use crate::support::daemon;
use crate::support::packs;
use crate::support::pulse;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use daemon::{config_text, http_get, root, wait_exit, Daemon};
use pulse::Pulse;

#[test]
fn check_names_the_file_and_key_of_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    for (text, want) in [
        (
            "input_devise: mic\n",
            "`input_devise`: unknown key (did you mean `input_device`?)",
        ),
        (
            "sampling:\n  seed: -3\n",
            "`sampling.seed`: -3 is out of range",
        ),
        (
            "long_session: forever\n",
            "`long_session`: \"forever\" is not one of",
        ),
        (
            "echo_cancel: maybe\n",
            "`echo_cancel`: \"maybe\" is not one of auto, on, off",
        ),
        (
            "pipeline: /nonexistent.yaml\n",
            "`pipeline`: pipeline file /nonexistent.yaml: No such file",
        ),
        (
            "pack: /nonexistent-pack\n",
            "`pack`: /nonexistent-pack: model pack directory not found",
        ),
        (
            "output_device: no-such-speaker\n",
            "`output_device`: audio output device \"no-such-speaker\": not found",
        ),
    ] {
        let p = dir.path().join("bad.yaml");
        std::fs::write(&p, text).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["daemon", "--check", "--config", p.to_str().unwrap()])
            .current_dir(root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&p.display().to_string()) && err.contains(want),
            "{want}: {err}"
        );
    }
    // The defaults are valid (with a sound server: `--check` opens the devices).
    let pa = Pulse::start();
    let o = pa
        .duplex()
        .args(["daemon", "--check"])
        .env("XDG_CONFIG_HOME", dir.path())
        .current_dir(root())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Regression: `--check` said "ok" for configurations the daemon then refused at start (exit
/// 2), and errors named `pipelines/daemon.yaml` (or `defaults:`) instead of the daemon's file
/// and key. Now `--check` runs every check start-up runs (it builds the pipeline), and each
/// error names the daemon's file, or the variable, and the key.
#[test]
fn check_runs_every_check_that_start_up_runs() {
    let pa = Pulse::start();
    let d = pa.dir();
    let empty_wav = d.join("empty.wav");
    std::fs::write(&empty_wav, b"").unwrap();
    let garbage = d.join("garbage.model");
    std::fs::write(&garbage, b"this is not a SentencePiece model").unwrap();
    let (_swapped_dir, swapped) = packs::variant("tiny-gqa", "");
    for (a, b) in [("temporal", "depformer"), ("depformer", "temporal")] {
        std::fs::remove_file(swapped.join(a)).unwrap();
        std::os::unix::fs::symlink(packs::pack("tiny-gqa").join(b), swapped.join(a)).unwrap();
    }
    let config = d.join("daemon.yaml");
    let check = |extra: &str, env: &[(&str, &str)]| {
        std::fs::write(&config, config_text(d, extra)).unwrap();
        let run = |args: &[&str]| {
            let o = pa
                .duplex()
                .args(args)
                .args(["--config", config.to_str().unwrap()])
                .envs(env.iter().copied())
                .current_dir(root())
                .output()
                .unwrap();
            (
                o.status.code(),
                String::from_utf8_lossy(&o.stderr).to_string(),
            )
        };
        (run(&["daemon", "--check"]), run(&["daemon"]))
    };
    let file = config.display().to_string();
    for (extra, env, lead, want) in [
        (
            "persona_tokens: [10, 99999]\n",
            &[][..],
            file.clone(),
            "`persona_tokens`: persona token 99999 is out of range 0..32000",
        ),
        (
            "persona: \"You are kind.\"\n",
            &[],
            file.clone(),
            "`persona`: `persona` text needs a tokenizer",
        ),
        (
            &format!("voice: {}\n", empty_wav.display()),
            &[],
            file.clone(),
            "`voice`: ",
        ),
        (
            &format!("tokenizer: {}\n", garbage.display()),
            &[],
            file.clone(),
            "`tokenizer`: ",
        ),
        (
            "",
            &[("DUPLEX__PACK", swapped.to_str().unwrap())],
            "environment variable DUPLEX__PACK".into(),
            "`pack`: temporal: missing input `input_frame`",
        ),
        (
            "",
            &[("DUPLEX__PERSONA_TOKENS", "[1, 99999]")],
            "environment variable DUPLEX__PERSONA_TOKENS".into(),
            "`persona_tokens`: persona token 99999 is out of range",
        ),
        (
            "",
            &[("PULSE_SERVER", "unix:/nonexistent/socket")],
            "configs/daemon.yaml (built in): `input_device`".into(),
            "audio input device \"alsa:default\": no usable configuration",
        ),
    ] {
        let ((code, err), (start_code, start_err)) = check(extra, env);
        assert_eq!(code, Some(2), "--check {extra:?} {env:?}: {err}");
        let line = err
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or(&err);
        assert!(
            line.starts_with(&format!("error: {lead}")) && line.contains(want),
            "--check {extra:?} {env:?}: {want}: {err}"
        );
        // The daemon refuses it at start the same way: --check said no more, no less.
        assert_eq!(start_code, Some(2), "{start_err}");
        let start_line = start_err
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or(&start_err);
        assert_eq!(start_line, line);
    }
}

/// Regression: `control_socket:` naming an existing file replaced it with a socket (and
/// removed it at exit), and one in an existing directory set that directory to 0700 for good;
/// `--check` said ok.
#[test]
fn the_control_socket_never_harms_what_is_already_there() {
    use std::os::unix::fs::PermissionsExt;
    let pa = Pulse::start();
    let d = &pa.dir().to_path_buf();
    let precious = d.join("precious.txt");
    std::fs::write(&precious, "keep me").unwrap();
    let config = d.join("daemon.yaml");
    let base = config_text(d, "");
    let with_socket = |sock: &Path| {
        base.lines()
            .filter(|l| !l.starts_with("control_socket:"))
            .chain([format!("control_socket: {}", sock.display()).as_str()])
            .collect::<Vec<_>>()
            .join("\n")
    };
    std::fs::write(&config, with_socket(&precious)).unwrap();
    for args in [&["daemon", "--check"][..], &["daemon"]] {
        let o = pa
            .duplex()
            .args(args)
            .args(["--config", config.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("`control_socket`") && err.contains("is a regular file, not a socket"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&precious).unwrap(), "keep me");
    }
    // An existing directory keeps its mode; the socket in it is private.
    let shared = d.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = shared.join("x.sock");
    // (And a metrics address that is taken: the warning names the daemon's key.)
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = busy.local_addr().unwrap().to_string();
    let text: String = with_socket(&sock)
        .lines()
        .map(|l| {
            if l.starts_with("metrics_address:") {
                format!("metrics_address: \"{taken}\"\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let mut dm = Daemon::start_with_config(pa, &text);
    dm.wait_log("metrics are not exported (set `metrics_address`)");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&shared), 0o755);
    assert_eq!(mode(&sock), 0o600);
    // A second daemon on the same socket is refused, and the first keeps it.
    let o = dm
        .pa
        .duplex()
        .args(["daemon", "--check", "--config", dm.config.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("another daemon is already listening there"),
        "{err}"
    );
    assert!(dm.status().is_some());
    dm.signal("-TERM");
    let status = wait_exit(dm.child.as_mut().unwrap(), Duration::from_secs(10)).unwrap();
    assert_eq!(status.code(), Some(0), "{}", dm.log());
    assert!(!sock.exists(), "its own socket is removed");
    assert_eq!(mode(&shared), 0o755);
    // Directories it creates are private.
    let fresh = d.join("fresh/deeper/x.sock");
    let second = Daemon::start_with_config(Pulse::start(), &with_socket(&fresh));
    assert_eq!(mode(&d.join("fresh")), 0o700);
    assert_eq!(mode(&d.join("fresh/deeper")), 0o700);
    drop(second);
    drop(dm);
}

/// Regression: `duplex ctl` failed outside the checkout (``defaults: `pipeline`: pipeline file
/// pipelines/daemon.yaml not found``) while the daemon ran: finding the socket needed the
/// pipeline file.
#[test]
fn ctl_finds_the_daemon_from_any_directory() {
    let pa = Pulse::start();
    let home = pa.dir().join("config");
    std::fs::create_dir_all(home.join("duplex")).unwrap();
    // The user's file with the default, relative pipeline path and the default socket.
    let text = config_text(pa.dir(), "")
        .lines()
        .filter(|l| !l.starts_with("pipeline:") && !l.starts_with("control_socket:"))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(home.join("duplex/daemon.yaml"), &text).unwrap();
    /// Kills the daemon however the test ends.
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(
        pa.duplex()
            .arg("daemon")
            .env("XDG_CONFIG_HOME", &home)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let elsewhere = tempfile::tempdir().unwrap();
    let ctl = || {
        pa.duplex()
            .args(["ctl", "status"])
            .env("XDG_CONFIG_HOME", &home)
            .current_dir(elsewhere.path())
            .output()
            .unwrap()
    };
    let t0 = Instant::now();
    let out = loop {
        let o = ctl();
        if o.status.success() {
            break String::from_utf8_lossy(&o.stdout).to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(out.contains("\"ok\":true"), "{out}");
}

#[test]
fn daemon_serves_control_reloads_and_stops_cleanly() {
    let mut d = Daemon::start("");
    // status answers and frames flow in real time.
    let f0 = d.frames();
    d.frames_go_on(f0 + 15, "frames flow");
    // The execution provider each graph really runs on.
    let s = d.status().unwrap();
    assert_eq!(s["execution_providers"]["temporal"], "cpu f32", "{s}");
    // The codec on the pack's step graphs (stateful streaming).
    assert_eq!(
        s["execution_providers"]["decode"], "cpu f32 stateful",
        "{s}"
    );
    assert_eq!(s["stages"]["encode"]["model"], "cpu f32 stateful", "{s}");
    assert_eq!(s["stages"]["speaker"]["reconnects"], 0, "{s}");
    assert_eq!(s["stages"]["mic"]["reconnects"], 0, "{s}");
    // Uptime, real-time factor, a verdict for every stage, devices, context length.
    assert!(s["uptime_s"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["realtime_factor"].as_f64().is_some(), "{s}");
    for stage in [
        "mic",
        "framer",
        "encode",
        "temporal",
        "depformer",
        "decode",
        "speaker",
    ] {
        let v = s["verdicts"][stage].as_str().unwrap_or("");
        assert!(
            ["steady", "growth", "contention"].contains(&v),
            "{stage}: {s}"
        );
    }
    assert_eq!(s["stages"]["mic"]["device"], "running", "{s}");
    assert_eq!(s["stages"]["speaker"]["device"], "running", "{s}");
    assert!(
        s["stages"]["temporal"]["context"].as_u64().unwrap() > 0,
        "{s}"
    );
    // The same, as headline figures.
    assert!(s["frames"].as_u64().unwrap() > 0, "{s}");
    assert!(s["context"].as_u64().unwrap() > 0, "{s}");
    assert!(s["realtime_factor"].as_f64().is_some(), "{s}");
    assert_eq!(s["devices"]["input"]["state"], "running", "{s}");
    assert_eq!(s["devices"]["output"]["state"], "running", "{s}");
    assert_eq!(s["execution_providers"]["temporal"], "cpu f32", "{s}");
    assert!(s["verdicts"]["temporal"].is_string(), "{s}");
    assert_eq!(
        (s["muted"].clone(), s["paused"].clone()),
        (false.into(), false.into())
    );
    // The socket is private and refuses garbage without dying.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&d.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let (ok, out) = d.ctl(&["launch", "missiles"]);
    assert!(!ok && out.contains("unknown or malformed command"), "{out}");
    {
        use std::io::Write;
        let mut s = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
        s.write_all(&[0xff, 0xfe, 0x00, b'\n']).unwrap();
        let mut reply = String::new();
        std::io::Read::read_to_string(&mut s, &mut reply).unwrap();
        assert!(reply.contains("\"ok\":false"), "{reply}");
    }
    assert!(d.status().is_some(), "still alive after garbage");
    // A connection that sends nothing is told what to send, not given an OS error.
    {
        let mut s = std::os::unix::net::UnixStream::connect(&d.socket).unwrap();
        let mut reply = String::new();
        std::io::Read::read_to_string(&mut s, &mut reply).unwrap();
        assert!(
            reply.contains("no command within 2 s: send one command per line"),
            "{reply}"
        );
    }
    // mute, pause and resume answer.
    for c in ["mute", "unmute", "pause", "resume", "reset"] {
        assert!(d.ctl(&[c]).0, "{c}");
    }
    assert!(d.ctl(&["mute"]).0);
    assert_eq!(d.status().unwrap()["muted"], true);
    assert!(d.ctl(&["unmute"]).0);
    assert_eq!(d.status().unwrap()["muted"], false);
    // A persona is answered once the LM has applied it, or refused with the reason.
    let (ok, out) = d.ctl(&["persona", "5,6,7"]);
    assert!(ok && out.contains("persona changed"), "{out}");
    let (ok, out) = d.ctl(&["persona", "You are kind."]);
    assert!(!ok && out.contains("needs a tokenizer"), "{out}");
    let (ok, out) = d.ctl(&["persona", "1,2,99999999"]);
    assert!(!ok && out.contains("out of range"), "{out}");
    let (ok, out) = d.ctl(&["reset"]);
    assert!(ok && out.contains("new conversation"), "{out}");
    // The daemon's pipeline primes `cached`: a new conversation with the persona set before
    // restores the state that persona's priming left.
    let priming = |d: &Daemon| d.status().unwrap()["stages"]["temporal"]["priming"].clone();
    assert_eq!(priming(&d), "cached");
    // SIGHUP with a new persona: applied without a restart (primed by chunks: a new state);
    // a reset then restores it, and the state of the start is still kept.
    std::fs::write(
        &d.config,
        config_text(d.pa.dir(), "persona_tokens: [10, 20, 30]\n"),
    )
    .unwrap();
    d.signal("-HUP");
    d.wait_log("persona changed: new conversation, primed again");
    d.wait_status(30, "primed by chunks", |s| {
        s["stages"]["temporal"]["priming"] == "chunked"
    });
    let (ok, out) = d.ctl(&["reset"]);
    assert!(ok && out.contains("new conversation"), "{out}");
    assert_eq!(priming(&d), "cached");
    // Different devices: only the stages that own them move; the models are not loaded again
    // and the conversation goes on.
    let loads = |d: &Daemon| d.log().matches("session ready").count();
    let loads0 = loads(&d);
    assert_eq!(loads0, 4, "{}", d.log());
    let fa = d.frames();
    std::fs::write(
        &d.config,
        config_text(
            d.pa.dir(),
            "persona_tokens: [10, 20, 30]\ninput_device: \"alsa:pulse\"\noutput_device: \"alsa:pulse\"\n",
        ),
    )
    .unwrap();
    d.signal("-HUP");
    d.wait_log("output switched");
    d.wait_log("microphone switched");
    let s = d.status().unwrap();
    assert_eq!(s["stages"]["mic"]["name"], "alsa:pulse", "{s}");
    assert_eq!(s["stages"]["speaker"]["name"], "alsa:pulse", "{s}");
    assert_eq!(s["devices"]["output"]["configured"], "alsa:pulse", "{s}");
    assert_eq!(s["devices"]["output"]["name"], "alsa:pulse", "{s}");
    assert_eq!(s["devices"]["input"]["name"], "alsa:pulse", "{s}");
    assert_eq!(s["ready"], true, "{s}");
    let fb = d.frames();
    assert!(fb >= fa, "frames go on counting: {fa} -> {fb}");
    d.frames_go_on(fb + 15, "frames go on counting");
    assert!(!d.log().contains("restarting the pipeline"), "{}", d.log());
    assert_eq!(loads(&d), loads0, "no model was loaded again");
    // A device that does not exist: rejected, naming it; the running one stays.
    std::fs::write(
        &d.config,
        config_text(
            d.pa.dir(),
            "persona_tokens: [10, 20, 30]\noutput_device: \"no-such-speaker\"\n",
        ),
    )
    .unwrap();
    d.signal("-HUP");
    d.wait_log("reload rejected");
    assert!(d.log().contains("no-such-speaker"), "{}", d.log());
    assert_eq!(
        d.status().unwrap()["devices"]["output"]["name"],
        "alsa:pulse"
    );
    // A directory that is not a pack: rejected before anything is built; the running pipeline
    // goes on.
    let with_pack = |p: &Path| {
        config_text(d.pa.dir(), "").replace(
            &packs::pack("tiny-gqa").display().to_string(),
            &p.display().to_string(),
        )
    };
    let broken = d.pa.dir().join("broken-pack");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(&d.config, with_pack(&broken)).unwrap();
    d.signal("-HUP");
    let needle = format!("`pack`: {}", broken.display());
    d.wait_log(&needle);
    let log = d.log();
    let line = log.lines().find(|l| l.contains(&needle)).unwrap();
    assert!(
        line.contains("reload rejected, keeping the running configuration"),
        "{line}"
    );
    let f3 = d.frames();
    d.frames_go_on(f3, "still running on the old pack");
    assert!(!d.log().contains("restarting the pipeline"), "{}", d.log());
    // A pack whose LM graph is corrupt: refused when the pack is checked, before anything is
    // built; the running pipeline is not touched.
    let corrupt = d.pa.dir().join("corrupt-pack");
    assert!(Command::new("cp")
        .args(["-r"])
        .arg(packs::pack("tiny-gqa"))
        .arg(&corrupt)
        .status()
        .unwrap()
        .success());
    std::fs::write(corrupt.join("temporal/model.onnx"), b"not a graph").unwrap();
    let outcome = d.reload(&with_pack(&corrupt));
    assert!(
        outcome.starts_with("rejected: ") && outcome.contains("not an ONNX model"),
        "{outcome}"
    );
    let f4 = d.frames();
    d.frames_go_on(f4, "still running on the old pack");
    assert!(!d.log().contains("restarting the pipeline"), "{}", d.log());
    let s = d.status().unwrap();
    assert_eq!(
        s["pack"].as_str(),
        Some(packs::pack("tiny-gqa").to_str().unwrap()),
        "the running configuration stays: {s}"
    );
    // A different pack: the new pipeline is built, then replaces the running one.
    let restarts = |d: &Daemon| d.log().matches("restarting the pipeline").count();
    let (r0, l0) = (restarts(&d), loads(&d));
    assert!(!d.log().contains("variant=Standard"));
    std::fs::write(&d.config, with_pack(&packs::pack("tiny"))).unwrap();
    d.signal("-HUP");
    d.wait_log("variant=Standard");
    d.wait_status(30, "ready again on the new pack", |s| {
        s["ready"] == true && restarts(&d) == r0 + 1
    });
    assert_eq!(loads(&d), l0 + 4, "the four graphs of the new pack");
    let fa = d.frames();
    // The new capture stream may stall for a moment when the old one closes.
    d.wait_status(10, "frames flow after the rebuild", |s| {
        s["frames"].as_u64().unwrap_or(0) >= fa + 15
    });
    // An invalid config is rejected and the daemon keeps running.
    std::fs::write(&d.config, "sampling: [this is not a map\n").unwrap();
    d.signal("-HUP");
    d.wait_log("reload rejected, keeping the running configuration");
    let f2 = d.frames();
    d.frames_go_on(f2, "still running");
    // SIGTERM: a clean exit 0 within a bounded time.
    d.signal("-TERM");
    let mut child = d.child.take().unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("did not stop: {}", d.log()));
    assert_eq!(status.code(), Some(0), "{}", d.log());
    assert!(!d.socket.exists(), "the socket is removed");
}

#[test]
fn daemon_recovers_when_the_null_sink_is_unloaded_and_loaded_again() {
    let d = Daemon::start("");
    let out = d.pa.pactl(&["list", "short", "modules"]);
    let modules = String::from_utf8_lossy(&out.stdout).to_string();
    let id = modules
        .lines()
        .find(|l| l.contains("module-null-sink"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_string();
    assert!(d.pa.pactl(&["unload-module", &id]).status.success());
    // The scenario: a second and a half without the sink (not a wait for a state).
    std::thread::sleep(Duration::from_millis(1500));
    assert!(d
        .pa
        .pactl(&["load-module", "module-null-sink", "sink_name=nullsink"])
        .status
        .success());
    assert!(d
        .pa
        .pactl(&["set-default-source", "nullsink.monitor"])
        .status
        .success());
    assert!(d
        .pa
        .pactl(&["set-default-sink", "nullsink"])
        .status
        .success());
    let f0 = d.frames();
    d.frames_go_on(f0 + 15, "frames flow again");
    let s = d.status().unwrap();
    assert_eq!(s["ready"], true);
}

/// The sound server dies and comes back: the daemon keeps answering, reports the devices as
/// down (status, /healthz 503, logs, metrics), reopens them with backoff and talks again.
#[test]
fn daemon_rides_out_a_sound_server_restart_and_healthz_follows() {
    let mut d = Daemon::start("");
    let port = d.metrics_port();
    let (code, body) = http_get(port, "/healthz");
    assert_eq!(code, 200, "{body}");
    let h: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(h["ok"], true, "{h}");
    assert_eq!(h["devices_alive"], true, "{h}");
    let up = |s: &serde_json::Value| {
        ["input", "output"]
            .iter()
            .all(|k| s["devices"][*k]["state"] == "running")
    };
    d.wait_status(10, "devices running", up);
    // Lost once it has been talking (a stream failing in its first second is start-up trouble,
    // retried quietly).
    let f0 = d.frames();
    d.wait_status(15, "frames flow", |s| {
        s["frames"].as_u64().unwrap_or(0) >= f0 + 25
    });
    d.pa.kill();
    // Reported down: a device state other than running (not yet published is not down).
    let down = |s: &serde_json::Value| {
        ["input", "output"].iter().any(|k| {
            s["devices"][*k]["state"]
                .as_str()
                .is_some_and(|v| v != "running")
        })
    };
    d.wait_status(15, "devices reported down", down);
    let (code, body) = http_get(port, "/healthz");
    assert_eq!(code, 503, "{body}");
    let h: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(h["devices_alive"], false, "{h}");
    d.pa.spawn();
    d.wait_status(30, "devices running again", |s| up(s) && s["ready"] == true);
    // A new PulseAudio stream may stall for a second or two before it runs at its rate.
    let f0 = d.frames();
    d.wait_status(15, "frames flow again", |s| {
        s["frames"].as_u64().unwrap_or(0) >= f0 + 25
    });
    let (code, body) = http_get(port, "/healthz");
    assert_eq!(code, 200, "{body}");
    let (_, metrics) = http_get(port, "/metrics");
    let errors: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("duplex_device_errors_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(errors >= 1.0, "device errors counted:\n{metrics}");
    assert!(d.log().contains("audio device reopened"), "{}", d.log());
}

/// SIGTERM while the models are still loading: nothing to drain; exit 0 at once (systemd
/// waits 15 s for a stop, a large pack takes longer to load), the socket removed.
#[test]
fn a_stop_during_start_up_exits_at_once() {
    let pa = Pulse::start();
    let d = pa.dir().to_path_buf();
    let config = d.join("daemon.yaml");
    std::fs::write(&config, config_text(&d, "")).unwrap();
    let log = d.join("daemon.log");
    let mut child = pa
        .duplex()
        .args(["daemon", "--config", config.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let socket = d.join("control.sock");
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20), "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The microphone alone takes a second or two to start: the pipeline is still being built.
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = wait_exit(&mut child, Duration::from_secs(5)).expect("did not exit");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(text.contains("while the pipeline is being built"), "{text}");
    assert!(!socket.exists(), "socket removed");
}

/// The systemd notification protocol: READY=1 once warmed up, WATCHDOG=1 at half the
/// watchdog timeout while frames flow, none while the pipeline is stuck (the sound server
/// frozen with SIGSTOP: the devices look open but nothing moves), again once it moves, and
/// STOPPING=1 on SIGTERM.
#[test]
fn systemd_is_told_ready_fed_the_watchdog_while_frames_flow_and_told_stopping() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // Messages received within `secs`.
    let recv_for = |secs: f64| {
        let mut got = Vec::new();
        let t0 = Instant::now();
        let mut buf = [0u8; 256];
        while t0.elapsed().as_secs_f64() < secs {
            if let Ok(n) = sock.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..n]).to_string());
            }
        }
        got
    };
    let mut d = Daemon::start_with(
        "",
        &[
            ("NOTIFY_SOCKET", path.to_str().unwrap()),
            ("WATCHDOG_USEC", "2000000"),
        ],
    );
    let got = recv_for(3.0);
    assert_eq!(got.first().map(String::as_str), Some("READY=1"), "{got:?}");
    assert!(
        got.iter().filter(|m| *m == "WATCHDOG=1").count() >= 2,
        "{got:?}"
    );
    d.pa.signal("-STOP");
    recv_for(2.5);
    let stuck = recv_for(3.0);
    assert!(!stuck.contains(&"WATCHDOG=1".to_string()), "{stuck:?}");
    d.pa.signal("-CONT");
    let again = recv_for(4.0);
    assert!(
        again.contains(&"WATCHDOG=1".to_string()),
        "{again:?}\n{}",
        d.log()
    );
    d.wait_log("not feeding the watchdog");
    d.wait_log("frames again: feeding the watchdog");
    d.signal("-TERM");
    let end = recv_for(2.0);
    assert!(end.contains(&"STOPPING=1".to_string()), "{end:?}");
    let status = d.child.take().unwrap().wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", d.log());
}

/// Under systemd (stderr is the journal stream named by `JOURNAL_STREAM`) every line carries
/// its syslog priority and no timestamp; anywhere else the usual timestamped lines.
#[test]
fn logs_carry_journal_priorities_when_stderr_is_the_journal() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stderr.log");
    let run = |args: &[&str], journal: Option<String>| {
        let file = std::fs::File::create(&log).unwrap();
        let stream = journal.unwrap_or_else(|| {
            let m = std::fs::metadata(&log).unwrap();
            format!("{}:{}", m.dev(), m.ino())
        });
        let status = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(args)
            .current_dir(root())
            .env("JOURNAL_STREAM", stream)
            .stdout(Stdio::null())
            .stderr(file)
            .status()
            .unwrap();
        (status.code(), std::fs::read_to_string(&log).unwrap())
    };
    let wav = dir.path().join("tone.wav");
    let set = format!("stages.out.path={}", wav.display());
    let tone = [
        "run",
        "pipelines/make-tone.yaml",
        "--set",
        &set,
        "--set",
        "metrics.address=",
    ];
    let (code, text) = run(&tone, None);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        !text.is_empty() && text.lines().all(|l| l.starts_with("<6>")),
        "{text}"
    );
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "bogus: 1\n").unwrap();
    let (code, text) = run(
        &["daemon", "--check", "--config", bad.to_str().unwrap()],
        None,
    );
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.starts_with("<3>error: ") && text.contains("bogus"),
        "{text}"
    );
    // A journal stream that is not our stderr (inherited by a child, say): plain lines.
    let (code, text) = run(&tone, Some("1:2".into()));
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.lines()
            .all(|l| l.starts_with("20") && l.contains(" INFO ")),
        "{text}"
    );
}

/// `(resident, anonymous)` memory of a process in kB: resident includes the pages of mapped
/// files (the ONNX Runtime library, the graphs) faulted in as new code paths run; anonymous is
/// the heap and stacks, where a leak would show.
fn memory_kb(pid: u32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("Rss:"), field("Anonymous:"))
}

/// The unit file, pointed at this checkout as the install steps say, passes
/// `systemd-analyze verify` (unknown keys, bad values and a missing ExecStart binary fail it).
#[test]
fn the_systemd_unit_verifies() {
    let unit = std::fs::read_to_string(root().join("deploy/systemd/duplex.service")).unwrap();
    assert!(unit.contains("Type=notify") && unit.contains("ExecReload=/bin/kill -HUP $MAINPID"));
    let exe = env!("CARGO_BIN_EXE_duplex");
    let unit = unit
        .replace("%h/duplex/target/release/duplex", exe)
        .replace(
            "WorkingDirectory=%h/duplex",
            &format!("WorkingDirectory={}", root().display()),
        );
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
    let verify = |text: &str| {
        let path = dir.path().join("duplex.service");
        std::fs::write(&path, text).unwrap();
        Command::new("systemd-analyze")
            .args(["verify", "--user", path.to_str().unwrap()])
            .env("XDG_RUNTIME_DIR", &run)
            .output()
            .expect("systemd-analyze (run `make setup`)")
    };
    let o = verify(&unit);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.trim().is_empty(), "{err}");
    // The check is real: a misspelt service type is reported.
    let o = verify(&unit.replace("Type=notify", "Type=notfy"));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("notfy"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The daemon at real time after start-up: its clock keeps the machine's, no underrun, and its
/// memory flat. `make soak` runs two minutes, sampled every 10 s, and judges the heap's trend
/// (a leak of 1 MB in two minutes fails). `make test` runs 40 s, sampled every 5 s: what 40 s
/// decide is the rate (within 1 %: a frame read late or early at either end is 0.2 % of 40 s),
/// the underruns, and growth of 4 MB (a frame's buffer of 7.7 KB leaked per frame is 3.8 MB);
/// a slower leak takes the soak's two minutes to tell from the allocator's steps.
#[test]
fn daemon_runs_in_real_time_with_flat_memory_and_no_underruns() {
    let soak = crate::support::soak();
    let (samples, every) = if soak { (12, 10) } else { (8, 5) };
    match in_real_time(samples, every, soak) {
        Ok(()) => {}
        Err(why) => panic!("{why}"),
    }
}

/// A stall of the machine long enough to empty a device's buffer (its 80 ms period and more).
const STALL: Duration = Duration::from_millis(60);

/// A thread that asks to wake every 10 ms and keeps how late it woke when 20 ms or more.
struct StallProbe {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Duration>>,
}

impl StallProbe {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut late = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let due = Instant::now() + Duration::from_millis(10);
                std::thread::sleep(Duration::from_millis(10));
                let l = Instant::now().saturating_duration_since(due);
                if l >= Duration::from_millis(20) {
                    late.push(l);
                }
            }
            late
        });
        StallProbe { stop, thread }
    }

    /// The lateness it saw.
    fn stop(self) -> Vec<Duration> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The Theil-Sen slope of `points` (x, y): the median of the slopes of every pair, which one
/// outlier (a late sample, an allocator's step) does not move and a steady trend does.
fn theil_sen(points: &[(f64, f64)]) -> f64 {
    let mut pairs: Vec<f64> = (0..points.len())
        .flat_map(|i| (i + 1..points.len()).map(move |j| (i, j)))
        .map(|(i, j)| (points[j].1 - points[i].1) / (points[j].0 - points[i].0))
        .collect();
    pairs.sort_by(f64::total_cmp);
    let n = pairs.len();
    if n % 2 == 1 {
        pairs[n / 2]
    } else {
        (pairs[n / 2 - 1] + pairs[n / 2]) / 2.0
    }
}

/// The real-time test: `samples` samples `every` seconds apart after start-up; the heap's trend
/// judged when `trend`. `Err` when the devices were reopened too often to judge the heap.
fn in_real_time(samples: usize, every: u64, trend: bool) -> Result<(), String> {
    let d = Daemon::start("");
    let pid = d.child.as_ref().unwrap().id();
    // After start-up (at least 20 s, and until the heap has settled: a loaded machine warms up
    // for longer), two minutes, sampling memory every 10 s.
    std::thread::sleep(Duration::from_secs(20));
    let mut prev = memory_kb(pid);
    for _ in 0..8 {
        std::thread::sleep(Duration::from_secs(5));
        let now = memory_kb(pid);
        let settled = now.1.abs_diff(prev.1) < 128;
        prev = now;
        if settled {
            break;
        }
    }
    let f0 = d.frames();
    let u0 = d.status().unwrap()["stages"]["speaker"]["underruns"]
        .as_u64()
        .unwrap_or(0);
    // Device reopens (the private sound server fails a stream with EIO now and then under
    // load) are counted with each sample: a new stream's buffers and thread are a step of the
    // heap that is not a leak, so the trend is judged where no device was reopened.
    let reconnects = |d: &Daemon| {
        d.status().map_or(0, |s| {
            ["mic", "speaker"]
                .iter()
                .map(|k| s["stages"][k]["reconnects"].as_u64().unwrap_or(0))
                .sum::<u64>()
        })
    };
    // The machine's own stalls meanwhile (a loaded machine can starve the daemon and the sound
    // server alike): a thread of this process asks to wake every 10 ms and notes how late.
    let probe = StallProbe::start();
    // The daemon's clock against the machine's: (seconds since the first sample, frames).
    let t0 = Instant::now();
    let mut clock = vec![(0.0, f0 as f64)];
    let mut mem = vec![memory_kb(pid)];
    let mut reopened = vec![reconnects(&d)];
    for _ in 0..samples {
        std::thread::sleep(Duration::from_secs(every));
        clock.push((t0.elapsed().as_secs_f64(), d.frames() as f64));
        mem.push(memory_kb(pid));
        reopened.push(reconnects(&d));
    }
    let f1 = d.frames();
    let s = d.status().unwrap();
    let u1 = s["stages"]["speaker"]["underruns"].as_u64().unwrap_or(0);
    let stalls = probe.stop();
    let mb = |kb: u64| kb as f64 / 1024.0;
    let (first, last) = (mem[0], *mem.last().unwrap());
    let rss_growth = mb(last.0) - mb(first.0);
    let anon_growth = mb(last.1) - mb(first.1);
    // A leak is a rate that does not stop: the heap's slope over a minute of samples, as MB
    // per 120 s. Start-up growth (windows and rings filling) levels off
    // within the first; the slope is Theil-Sen's (the median of the pairwise slopes), so one
    // step of the allocator (an arena taking a new chunk) does not move it, and a steady leak
    // does. The slope over the whole run is printed too.
    let slope = |xs: &[(u64, u64)]| {
        let heap: Vec<(f64, f64)> = xs
            .iter()
            .enumerate()
            .map(|(i, m)| (i as f64, mb(m.1)))
            .collect();
        // MB per sample, as MB per 120 s.
        theil_sen(&heap) * 120.0 / every as f64
    };
    // The latest minute of samples without a reopen among them; failing that, the longest
    // stretch of at least five sevenths of a minute.
    let win = (60 / every as usize + 1).min(mem.len());
    let stretch = (0..=mem.len() - win)
        .rev()
        .find(|&i| reopened[i] == reopened[i + win - 1])
        .map(|i| i..i + win)
        .or_else(|| {
            let mut best = 0..0;
            let mut start = 0;
            for i in 1..=mem.len() {
                if i == mem.len() || reopened[i] != reopened[start] {
                    if i - start > best.len() {
                        best = start..i;
                    }
                    start = i;
                }
            }
            (best.len() >= win * 5 / 7).then_some(best)
        })
        .ok_or_else(|| {
            format!("the devices were reopened too often to judge the heap: reopens {reopened:?}")
        })?;
    let anon_trend = slope(&mem[stretch.clone()]);
    let anon_trend_all = slope(&mem);
    eprintln!(
        "{} s at real time: {} agent frames, resident {:.1} -> {:.1} MB ({rss_growth:+.2}), anonymous {:.1} -> {:.1} MB ({anon_growth:+.2}; trend {anon_trend_all:+.2} MB per 120 s over the run, {anon_trend:+.2} over samples {stretch:?}), underruns {u0} -> {u1}, device reopens {reopened:?}, real-time factor {}",
        samples as u64 * every,
        f1 - f0,
        mb(first.0),
        mb(last.0),
        mb(first.1),
        mb(last.1),
        s["realtime_factor"]
    );
    assert!(first.0 > 0 && first.1 > 0, "memory readable: {mem:?}");
    // 12.5 frames a second by the machine's clock (the private sound server's devices run on
    // it): the rate over the two minutes, robust to a late read or a burst of capture (a
    // loaded machine delays both; neither is drift). A real device drifts by well under 0.1 %.
    let fps = theil_sen(&clock);
    assert!(
        (fps / 12.5 - 1.0).abs() < if trend { 0.005 } else { 0.01 },
        "{fps:.3} frames a second, not 12.5: (s, frames) {clock:?}"
    );
    // An underrun is the daemon's unless the machine itself stalled long enough to empty a
    // device's buffer: then it is said, and the environment's.
    let worst = stalls.iter().max().copied().unwrap_or_default();
    if u1 != u0 && worst >= STALL {
        eprintln!(
            "{} underruns after start-up, while the machine stalled: a thread asking to wake every \
             10 ms woke {} times {} ms late or more (at worst {} ms): the environment's",
            u1 - u0,
            stalls.iter().filter(|&&l| l >= STALL).count(),
            STALL.as_millis(),
            worst.as_millis()
        );
    } else {
        assert_eq!(
            u1,
            u0,
            "no underruns after start-up (the machine's worst stall meanwhile: {} ms)",
            worst.as_millis()
        );
    }
    assert!(
        !trend || anon_trend.abs() < 1.0,
        "heap trend over samples {stretch:?} {anon_trend:+.2} MB per 120 s (kB, resident/anonymous): {mem:?}; device reopens {reopened:?}"
    );
    assert!(
        rss_growth.abs() < 4.0,
        "resident (kB, resident/anonymous): {mem:?}"
    );
    Ok(())
}

/// `ctl record on`: a new conversation, recorded (its pipeline built beside the running one);
/// `ctl record off`: the recording ends, the conversation goes on; what was recorded replays
/// headless to the same tokens.
#[test]
fn ctl_record_on_records_a_new_conversation_that_replays_and_off_ends_it() {
    let d = Daemon::start("");
    let recs = d.pa.dir().join("recs");
    // Where `record on` records: this config's `record_dir`.
    let text = std::fs::read_to_string(&d.config).unwrap();
    d.reload(&format!("{text}record_dir: {}\n", recs.display()));
    let s = d.status().unwrap();
    assert!(s["recording"].is_null(), "{s}");
    let (ok, out) = d.ctl(&["record", "on"]);
    assert!(ok, "{out}");
    assert!(out.contains("a new conversation, recorded"), "{out}");
    d.wait_status(60, "recording", |s| {
        s["recording"].is_string() && s["ready"] == true
    });
    let dir = PathBuf::from(d.status().unwrap()["recording"].as_str().unwrap());
    assert!(dir.starts_with(&recs), "{}", dir.display());
    let f0 = d.frames();
    d.wait_status(20, "frames flow", |s| {
        s["frames"].as_u64().unwrap_or(0) >= f0 + 30
    });
    let (ok, out) = d.ctl(&["record", "off"]);
    assert!(ok && out.contains("recording stopped"), "{out}");
    assert!(d.status().unwrap()["recording"].is_null());
    // The conversation goes on.
    let f1 = d.frames();
    d.wait_status(20, "frames still flow", |s| {
        s["frames"].as_u64().unwrap_or(0) >= f1 + 10
    });
    let (ok, out) = d.ctl(&["record", "off"]);
    assert!(ok && out.contains("not recording"), "{out}");
    // What was recorded replays: the same tokens, every step.
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["replay", "--recording"])
        .arg(&dir)
        .arg("--out")
        .arg(d.pa.dir().join("replay"))
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line = report
        .lines()
        .find(|l| l.starts_with("tokens: "))
        .unwrap_or_else(|| panic!("{report}"));
    let n: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(
        line.ends_with("steps identical") && n[0] == n[1] && n[0] >= 30,
        "{report}"
    );
}

#[test]
fn echo_cancellation_is_on_by_default_on_open_speakers_reported_and_switched_off_by_a_reload() {
    // The test server's microphone is the speaker's monitor: the worst open-speaker room.
    let d = Daemon::start("");
    d.wait_status(60, "echo canceller running", |s| {
        s["echo_cancel"]["state"] == "cancelling" && s["frames"].as_u64().unwrap_or(0) >= 40
    });
    // The agent's voice (the tiny model's) is cancelled from what the microphone hears.
    d.wait_status(60, "the echo cancelled by 20 dB", |s| {
        s["echo_cancel"]["erle_db"].as_f64().unwrap_or(0.0) >= 20.0
    });
    let s = d.status().unwrap();
    eprintln!("{}", s["echo_cancel"]);
    assert!(s["echo_cancel"]["delay_ms"].is_number(), "{s}");
    let why = s["echo_cancel"]["why"].as_str().unwrap_or_default();
    assert!(why.contains("auto, on"), "{s}");
    assert!(d.log().contains("echo cancellation on"), "{}", d.log());
    // The canceller's state is exported.
    let (code, metrics) = http_get(d.metrics_port(), "/metrics");
    assert_eq!(code, 200);
    for series in [
        "duplex_aec_erle_db",
        "duplex_aec_delay_seconds",
        "duplex_aec_double_talk_ratio",
    ] {
        assert!(
            metrics.contains(&format!("{series}{{stage=\"aec\"}}")),
            "{series}: {metrics}"
        );
    }
    // A reload to `off` rebuilds the pipeline with the canceller passing audio through.
    let text = std::fs::read_to_string(&d.config).unwrap();
    let out = d.reload(&format!("{text}echo_cancel: off\n"));
    assert!(!out.contains("error"), "{out}");
    d.wait_status(60, "echo canceller off", |s| {
        s["echo_cancel"]["state"] == "off" && s["ready"] == true
    });
    assert_eq!(
        d.status().unwrap()["echo_cancel"]["why"],
        "echo_cancel: off"
    );
}

/// A reload from pack A to pack B with `engine: shared`: the new pipeline opens B's engine and
/// A's is freed with the pipeline that used it (one engine open before and after, two opened in
/// all), while frames go on flowing.
#[test]
fn a_reload_to_another_pack_frees_the_old_packs_shared_engine() {
    let pa = Pulse::start();
    let dir = pa.dir().to_path_buf();
    // The daemon's pipeline with both LM stages on the process's shared engine.
    let text = std::fs::read_to_string(root().join("pipelines/daemon.yaml")).unwrap();
    let shared = text
        .replace(
            "    kind: temporal\n",
            "    kind: temporal\n    engine: shared\n",
        )
        .replace(
            "    kind: depformer\n",
            "    kind: depformer\n    engine: shared\n",
        );
    assert_eq!(shared.matches("engine: shared").count(), 2);
    let pipeline = dir.join("shared.yaml");
    std::fs::write(&pipeline, shared).unwrap();
    let port = daemon::free_port();
    let config = |pack: &Path| {
        format!(
            "pipeline: {}\npack: {}\nmetrics_address: \"127.0.0.1:{port}\"\ncontrol_socket: {}/control.sock\n",
            pipeline.display(),
            pack.display(),
            dir.display()
        )
    };
    let a = packs::pack("tiny-gqa");
    // Pack B: the same graphs in another folder (another engine).
    let (_keep, b) = packs::variant("tiny-gqa", "name: pack-b\n");
    let mut d = Daemon::start_with_config(pa, &config(&a));
    let metrics = || http_get(port, "/metrics").1;
    let value = |text: &str, prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let wait_for = |what: &str, ok: &dyn Fn(&str) -> bool| {
        let t0 = Instant::now();
        loop {
            let m = metrics();
            if ok(&m) {
                return m;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{what}\n{m}\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    let engines = "duplex_engines_open ";
    let opened = "duplex_resources_loaded_total{what=\"engine\"}";
    wait_for("one engine open for pack A", &|m| {
        value(m, engines) == Some(1.0) && value(m, opened) == Some(1.0)
    });
    assert!(d.log().contains("shared LM engine ready"), "{}", d.log());
    let outcome = d.reload(&config(&b));
    assert!(!outcome.starts_with("rejected"), "{outcome}\n{}", d.log());
    assert_eq!(d.status().unwrap()["pack"], b.to_str().unwrap());
    // B's engine was opened, A's closed with the pipeline that held it.
    wait_for("A's engine freed, B's open", &|m| {
        value(m, engines) == Some(1.0) && value(m, opened) == Some(2.0)
    });
    d.wait_log("shared LM engine closed: its last conversation left");
    let fa = d.frames();
    d.wait_status(15, "frames flow on pack B", |s| {
        s["frames"].as_u64().unwrap_or(0) >= fa + 15
    });
    d.signal("-TERM");
    let mut child = d.child.take().unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("did not stop: {}", d.log()));
    assert_eq!(status.code(), Some(0), "{}", d.log());
}

/// `prime_cache_file`: the daemon saves the states it primed when it stops, and the next start
/// loads them: its first conversation restores its primed state instead of computing it.
#[test]
fn primed_states_are_kept_across_a_restart_in_a_file() {
    let pa = Pulse::start();
    let file = pa.dir().join("primed.states");
    let extra = format!(
        "persona_tokens: [10, 20, 30]\nprime_cache_file: {}\n",
        file.display()
    );
    let text = config_text(pa.dir(), &extra);
    let mut d = Daemon::start_with_config(pa, &text);
    d.wait_status(30, "primed", |s| {
        s["stages"]["temporal"]["priming"] == "chunked"
    });
    d.signal("-TERM");
    let mut child = d.child.take().unwrap();
    let status = wait_exit(&mut child, Duration::from_secs(10))
        .unwrap_or_else(|| panic!("did not stop: {}", d.log()));
    assert_eq!(status.code(), Some(0), "{}", d.log());
    assert!(d.log().contains("primed states saved"), "{}", d.log());
    assert!(file.is_file());
    // Started again: the state comes from the file.
    let pa = std::mem::replace(&mut d.pa, Pulse::start());
    drop(d);
    let d = Daemon::start_with_config(pa, &text);
    assert!(d.log().contains("primed states loaded"), "{}", d.log());
    d.wait_status(30, "primed", |s| {
        s["stages"]["temporal"]["priming"].is_string()
    });
    assert_eq!(
        d.status().unwrap()["stages"]["temporal"]["priming"],
        "cached",
        "{}",
        d.log()
    );
}
