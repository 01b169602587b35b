//! `duplex serve` replicas behind a real load balancer: Debian's HAProxy with the shipped
//! `deploy/haproxy/haproxy.cfg` (only its addresses changed), health on `/readyz`, sessions by
//! least connections. WebRTC calls offered through the proxy spread over the replicas, and
//! each hang-up sent through the proxy to the answer's `Location` (the replica's own prefix,
//! `webrtc.location_base`) frees the slot of the replica that holds the call at once; the same
//! hang-up at the other replica finds nothing (404): what the prefix is for. A replica drained
//! (SIGTERM) behind the proxy is not ready at once, lets its live conversation run to its end,
//! then exits 0, while a newcomer through the proxy is admitted by the other replica.

use crate::support::daemon;
use crate::support::serve;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serve::{send_to, Server};

/// HAProxy in the foreground with the shipped configuration, listening on a free port of its
/// own and balancing over `replicas` (`a`, `b`: their ports).
struct Proxy {
    child: Child,
    port: u16,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proxy {
    fn start(dir: &std::path::Path, a: u16, b: u16) -> Proxy {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let shipped =
            std::fs::read_to_string(daemon::root().join("deploy/haproxy/haproxy.cfg")).unwrap();
        let cfg = shipped
            .replace("bind *:8080", &format!("bind 127.0.0.1:{port}"))
            .replace("10.0.0.11:8998", &format!("127.0.0.1:{a}"))
            .replace("10.0.0.12:8998", &format!("127.0.0.1:{b}"));
        assert_ne!(cfg, shipped);
        let path = dir.join("haproxy.cfg");
        std::fs::write(&path, cfg).unwrap();
        let child = Command::new("haproxy")
            .args(["-db", "-f"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("haproxy.log")).unwrap())
            .spawn()
            .expect("haproxy (run `make setup`)");
        crate::support::wait::wait_until(Duration::from_secs(10), "haproxy listening", || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Proxy { child, port }
    }

    fn send(&self, method: &str, path: &str, body: &str) -> (u16, String, String) {
        send_to(
            "127.0.0.1",
            self.port,
            None,
            [method, path, "application/sdp", body],
        )
    }
}

/// An offer of an independent WebRTC stack (aiortc: one audio track, Opus among its codecs).
fn aiortc_offer() -> String {
    let script = "import asyncio\n\
                  from aiortc import RTCPeerConnection\n\
                  async def main():\n    \
                      pc = RTCPeerConnection()\n    \
                      pc.addTransceiver('audio', direction='sendrecv')\n    \
                      await pc.setLocalDescription(await pc.createOffer())\n    \
                      print(pc.localDescription.sdp)\n    \
                      await pc.close()\n\
                  asyncio.run(main())\n";
    let out = Command::new(daemon::root().join(".venv/bin/python"))
        .args(["-c", script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sdp = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = sdp
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect();
    format!("{}\r\n", lines.join("\r\n"))
}

#[test]
fn a_webrtc_call_answered_behind_haproxy_is_hung_up_at_the_replica_that_holds_it() {
    let a = Server::start("webrtc: {location_base: /replica/a}\n", 240);
    let b = Server::start("webrtc: {location_base: /replica/b}\n", 240);
    let proxy = Proxy::start(a.dir.path(), a.port, b.port);
    let offer = aiortc_offer();
    // Both replicas up in the proxy's health checks.
    crate::support::wait::wait_until(Duration::from_secs(20), "the proxy up", || {
        proxy.send("GET", "/readyz", "").0 == 200
    });
    // Four calls offered through the proxy: each answered with its replica's Location; least
    // connections puts two on each (an answered call holds its slot until ICE gives up).
    let mut calls = Vec::new();
    for _ in 0..4 {
        let (code, head, body) = proxy.send("POST", "/api/webrtc", &offer);
        assert_eq!(code, 201, "{head}\n{body}");
        let location = head
            .lines()
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.eq_ignore_ascii_case("location"))
            })
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| panic!("no Location in {head}"));
        calls.push(location);
    }
    eprintln!("calls: {calls:?}");
    let on = |prefix: &str| calls.iter().filter(|c| c.starts_with(prefix)).count();
    assert_eq!(on("/replica/a/api/webrtc/"), 2, "{calls:?}");
    assert_eq!(on("/replica/b/api/webrtc/"), 2, "{calls:?}");
    a.wait_sessions(2, 10);
    b.wait_sessions(2, 10);
    // The same hang-up at the replica that does not hold the call: nothing to hang up there.
    let at_a = calls.iter().find(|c| c.starts_with("/replica/a/")).unwrap();
    let token = at_a.rsplit('/').next().unwrap();
    let elsewhere = b.send("DELETE", &format!("/api/webrtc/{token}"), "text/plain", "");
    assert_eq!(elsewhere.0, 404, "{elsewhere:?}");
    // Through the proxy, each hang-up reaches its replica and frees its slot at once.
    for call in &calls {
        let (code, head, body) = proxy.send("DELETE", call, "");
        assert_eq!(code, 200, "DELETE {call}: {head}\n{body}");
    }
    a.wait_sessions(0, 5);
    b.wait_sessions(0, 5);
}

#[test]
fn a_replica_drained_behind_haproxy_finishes_its_conversations_while_the_other_takes_new_ones() {
    let mut a = Server::start(
        "max_sessions: 2\nwebrtc: {location_base: /replica/a}\n",
        240,
    );
    let b = Server::start(
        "max_sessions: 2\nwebrtc: {location_base: /replica/b}\n",
        240,
    );
    let proxy = Proxy::start(a.dir.path(), a.port, b.port);
    crate::support::wait::wait_until(Duration::from_secs(20), "the proxy up", || {
        proxy.send("GET", "/readyz", "").0 == 200
    });
    let wav = a.dir.path().join("in.wav");
    serve::speech_wav(&wav, 6.0, 190.0);
    let url = format!("ws://127.0.0.1:{}/api/chat", proxy.port);
    // One live conversation through the proxy on each replica (least connections).
    let live: Vec<_> = (0..2)
        .map(|_| {
            let (u, w) = (url.clone(), wav.to_str().unwrap().to_string());
            let c = std::thread::spawn(move || {
                serve::client(&u, &["--mode", "kyutai", "--wav", &w, "--tail", "0.5"])
            });
            std::thread::sleep(Duration::from_millis(300));
            c
        })
        .collect();
    a.wait_sessions_aged(1, 0.5, 20);
    b.wait_sessions_aged(1, 0.5, 20);
    // Replica a drains: not ready at once, and the proxy sends it nothing new.
    let t0 = std::time::Instant::now();
    a.signal("TERM");
    crate::support::wait::wait_until(Duration::from_secs(5), "a not ready", || {
        a.get("/readyz").0 == 503
    });
    let not_ready = t0.elapsed();
    // A new conversation through the proxy while b has its free slot: admitted, by b.
    let newcomer = serve::client(&url, &["--silent", "1"]);
    assert!(newcomer.get("refused").is_none(), "{newcomer}");
    // a's live conversation goes on to its end; then a exits 0.
    let status = a
        .wait_exit(Duration::from_secs(30))
        .expect("a exits after its drain");
    let drained = t0.elapsed();
    assert!(status.success(), "{status:?}");
    for c in live {
        let r = c.join().unwrap();
        assert!(r.get("refused").is_none(), "{r}");
        // The whole call's audio came back (6 s sent; the agent answers each 80 ms frame).
        assert!(r["samples"].as_i64().unwrap() > 5 * 24_000, "{r}");
    }
    eprintln!(
        "a not ready {:.2} s after SIGTERM; its last conversation ended and it exited {:.2} s after",
        not_ready.as_secs_f64(),
        drained.as_secs_f64()
    );
    let log = std::fs::read_to_string(&a.log).unwrap();
    assert!(log.contains("draining"), "{log}");
}
