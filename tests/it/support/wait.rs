//! Waiting for a state, not for a time. A test polls its condition until it holds, or fails
//! naming what it waited for once a deadline passes; the deadline is generous (a loaded machine
//! is slow, not wrong), and a fast machine does not wait it out.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Polls `cond` (every 10 ms) until it holds; panics naming `what` after `deadline`.
pub fn wait_until(deadline: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    wait_for(deadline, what, || cond().then_some(()))
}

/// Polls `f` (every 10 ms) until it gives a value; panics naming `what` after `deadline`.
pub fn wait_for<T>(deadline: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < deadline, "waited {deadline:?} for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` to its end (no standard input; its output captured), failing the test with what
/// it printed if it runs past `deadline`: a hang is a failure, not a stuck test.
pub fn output_within(mut cmd: Command, deadline: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let late = finished.recv_timeout(deadline).is_err();
        if late {
            // SAFETY: kill(2) on the child's pid, which is not reaped (and so not reused)
            // until `wait_with_output` below returns.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        late
    });
    let o = child.wait_with_output().unwrap();
    let _ = done.send(());
    assert!(
        !watchdog.join().unwrap(),
        "still running after {deadline:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// A free TCP port on loopback (for a pipeline's `metrics.address`).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The frames stage `stage` has done, from the `/metrics` of a `duplex run` on `port` (`None`
/// while it does not answer).
pub fn stage_frames(port: u16, stage: &str) -> Option<u64> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let series = format!("duplex_stage_frames_total{{stage=\"{stage}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}
