//! `duplex serve` replicas behind a real load balancer: Debian's HAProxy with the shipped
//! `deploy/haproxy/haproxy.cfg` (only its addresses changed), health on `/readyz`, sessions by
//! least connections. WebRTC calls offered through the proxy spread over the replicas, and
//! each hang-up sent through the proxy to the answer's `Location` (the replica's own prefix,
//! `webrtc.location_base`) frees the slot of the replica that holds the call at once; the same
//! hang-up at the other replica finds nothing (404): what the prefix is for.

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
