//! `duplex serve` replicas behind a real load balancer: Debian's HAProxy with the shipped
//! `deploy/haproxy/haproxy.cfg` (only its addresses changed): three replicas, health on
//! `/readyz`, sessions by least connections.
//!
//! - `duplex loadtest` through the proxy over Kyutai's protocol, the realtime API and WebRTC
//!   admits the sum of the replicas' slots and refuses the next (503), and each WebRTC call it
//!   hangs up through the proxy (at the answer's `Location`: the replica's own prefix,
//!   `webrtc.location_base`) frees its replica's slot at once; an independent stack's call
//!   (aiortc) hung up at another replica finds nothing there (404), through the proxy it is
//!   ended.
//! - A client's forged `X-Forwarded-For` does not move its per-client limit: the replicas key it
//!   on the address the proxy saw.
//! - A replica drained (SIGTERM) behind the proxy is not ready at once, lets its live
//!   conversation run to its end, then exits 0, while a newcomer through the proxy is admitted
//!   by another replica.

use crate::support::daemon;
use crate::support::serve;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serve::{send_to, Server};

/// The replicas' names: each answers its calls' resources under `/replica/NAME`.
const NAMES: [&str; 3] = ["a", "b", "c"];

/// HAProxy in the foreground with the shipped configuration, listening on a free port of its
/// own and balancing over the replicas (their ports, in the order of [`NAMES`]).
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
    fn start(dir: &std::path::Path, replicas: &[Server; 3]) -> Proxy {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let shipped =
            std::fs::read_to_string(daemon::root().join("deploy/haproxy/haproxy.cfg")).unwrap();
        let mut cfg = shipped.replace("bind *:8080", &format!("bind 127.0.0.1:{port}"));
        for (i, r) in replicas.iter().enumerate() {
            let shipped_address = format!("10.0.0.{}:8998", 11 + i);
            assert!(cfg.contains(&shipped_address), "{shipped_address}");
            cfg = cfg.replace(&shipped_address, &format!("127.0.0.1:{}", r.port));
        }
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

    /// Waits until every replica is ready and the proxy has checked them since (one check a
    /// second, one success brings a replica back).
    fn wait_all_up(&self, replicas: &[Server; 3]) {
        for r in replicas {
            crate::support::wait::wait_until(Duration::from_secs(20), "a replica ready", || {
                r.get("/readyz").0 == 200
            });
        }
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(self.send("GET", "/readyz", "").0, 200);
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

/// Three replicas, each with `config` and its own prefix for its calls' resources.
fn replicas(config: &str) -> [Server; 3] {
    NAMES.map(|n| {
        Server::start(
            &format!("{config}webrtc: {{location_base: /replica/{n}}}\n"),
            240,
        )
    })
}

/// A WebSocket upgrade of `/api/chat` sent to the proxy from `source` (an address of this
/// machine's loopback) with `X-Forwarded-For: forged`: the response's status and body. The
/// connection is closed at once (an admitted session ends with it).
fn upgrade_from(source: &str, proxy: u16, forged: &str) -> (u16, String) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    let from: IpAddr = source.parse().unwrap();
    socket.bind(&SocketAddr::new(from, 0).into()).unwrap();
    let to: SocketAddr = ([127, 0, 0, 1], proxy).into();
    socket.connect(&to.into()).unwrap();
    let mut tcp: std::net::TcpStream = socket.into();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        tcp,
        "GET /api/chat HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nX-Forwarded-For: {forged}\r\n\r\n"
    )
    .unwrap();
    // The head, and for a refusal its body (closed after it).
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(n) = tcp.read(&mut chunk) {
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&chunk[..n]);
        if bytes.starts_with(b"HTTP/1.1 101") && bytes.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
}

#[test]
fn three_replicas_behind_haproxy_admit_the_sum_of_their_slots_over_every_transport() {
    // One slot each; a client's allowance of new sessions per replica is enough for the load
    // tests' (an attempt at a full replica spends one too) and small enough to be spent below.
    let config = "max_sessions: 1\ntrusted_proxies: [\"127.0.0.1\"]\nlimits:\n  \
                  session_burst_per_ip: 8\n  sessions_per_minute_per_ip: 1\n";
    let replicas = replicas(config);
    let proxy = Proxy::start(replicas[0].dir.path(), &replicas);
    let base = format!("http://127.0.0.1:{}", proxy.port);
    // `duplex loadtest` through the proxy, one more session than the replicas' slots, over each
    // transport.
    let mut table = Vec::new();
    for protocol in ["kyutai", "realtime", "webrtc"] {
        proxy.wait_all_up(&replicas);
        let (code, r, err) = super::loadtest::loadtest(&[
            &base,
            "--protocol",
            protocol,
            "--sessions",
            "4",
            "--seconds",
            "2",
            "--json",
        ]);
        let l = &r["levels"][0];
        let ms = |q: &str| l["latency_ms"][q].as_f64().unwrap_or(f64::NAN);
        table.push(format!(
            "{protocol:>9} {:>8} {:>7} {:>7.1} {:>7.1} {:>7.1}",
            l["admitted"],
            l["refused"],
            ms("p50"),
            ms("p90"),
            ms("max")
        ));
        assert_eq!(
            code, 1,
            "{protocol}: the level is refused a session: {r}\n{err}"
        );
        assert_eq!(
            (l["admitted"].as_u64(), l["refused"].as_u64()),
            (Some(3), Some(1)),
            "{protocol}: {r}"
        );
        assert!(
            l["refusal"].as_str().unwrap().contains("HTTP 503"),
            "{protocol}: {r}"
        );
        assert_eq!(l["missing"], 0, "{protocol}: {r}");
        // Every session over (the WebRTC calls hung up through the proxy): every slot free.
        for r in &replicas {
            r.wait_sessions(0, 3);
        }
    }
    eprintln!(
        "through HAProxy, 3 replicas of 1 slot, 4 sessions of 2 s:\n protocol admitted refused  p50 ms  p90 ms  max ms\n{}",
        table.join("\n")
    );

    // An independent stack's call, hung up at a replica that does not hold it: nothing there;
    // through the proxy, at its Location: ended, its slot free at once.
    proxy.wait_all_up(&replicas);
    let (code, head, body) = proxy.send("POST", "/api/webrtc", &aiortc_offer());
    assert_eq!(code, 201, "{head}\n{body}");
    let location = head
        .lines()
        .find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case("location"))
        })
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| panic!("no Location in {head}"));
    let holder = NAMES
        .iter()
        .position(|n| location.starts_with(&format!("/replica/{n}/api/webrtc/")))
        .unwrap_or_else(|| panic!("{location}"));
    replicas[holder].wait_sessions(1, 10);
    let other = &replicas[(holder + 1) % 3];
    let token = location.rsplit('/').next().unwrap();
    let elsewhere = other.send("DELETE", &format!("/api/webrtc/{token}"), "text/plain", "");
    assert_eq!(elsewhere.0, 404, "{elsewhere:?}");
    let (code, head, body) = proxy.send("DELETE", &location, "");
    assert_eq!(code, 200, "DELETE {location}: {head}\n{body}");
    replicas[holder].wait_sessions(0, 5);

    // A client (127.0.0.2) that writes its own X-Forwarded-For, a new address each time: the
    // proxy adds the address it saw, and the replicas key the client's allowance on that one.
    // Its allowance (8 per replica) is spent by 24 sessions at most, however they spread; a
    // forged address believed would make each attempt a new client's.
    proxy.wait_all_up(&replicas);
    let mut statuses = Vec::new();
    let mut refusal = String::new();
    for n in 1..=25 {
        let (code, text) = upgrade_from("127.0.0.2", proxy.port, &format!("203.0.113.{n}"));
        if code == 429 && refusal.is_empty() {
            refusal = text;
        }
        statuses.push(code);
    }
    eprintln!("25 sessions with forged addresses from 127.0.0.2: {statuses:?}");
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
    assert!(refusal.contains("from 127.0.0.2"), "{refusal}");
    // Another client behind the same proxy still has its own allowance.
    let (code, text) = upgrade_from("127.0.0.3", proxy.port, "203.0.113.99");
    assert_eq!(code, 101, "{text}");
    for r in &replicas {
        let log = r.log();
        assert!(
            !log.contains("203.0.113."),
            "a forged address was believed: {log}"
        );
    }
}

#[test]
fn a_replica_drained_behind_haproxy_finishes_its_conversations_while_the_others_take_new_ones() {
    let mut replicas = replicas("max_sessions: 2\n");
    let proxy = Proxy::start(replicas[0].dir.path(), &replicas);
    proxy.wait_all_up(&replicas);
    let wav = replicas[0].dir.path().join("in.wav");
    serve::speech_wav(&wav, 6.0, 190.0);
    let url = format!("ws://127.0.0.1:{}/api/chat", proxy.port);
    // One live conversation through the proxy on each replica (least connections).
    let live: Vec<_> = (0..3)
        .map(|_| {
            let (u, w) = (url.clone(), wav.to_str().unwrap().to_string());
            let c = std::thread::spawn(move || {
                serve::client(&u, &["--mode", "kyutai", "--wav", &w, "--tail", "0.5"])
            });
            std::thread::sleep(Duration::from_millis(300));
            c
        })
        .collect();
    for r in &replicas {
        r.wait_sessions_aged(1, 0.5, 20);
    }
    // Replica a drains: not ready at once, and the proxy sends it nothing new.
    let t0 = std::time::Instant::now();
    replicas[0].signal("TERM");
    crate::support::wait::wait_until(Duration::from_secs(5), "a not ready", || {
        replicas[0].get("/readyz").0 == 503
    });
    let not_ready = t0.elapsed();
    // A new conversation through the proxy while the others have free slots: admitted (if the
    // proxy tries a before its next check, a's 503 sends it on).
    let newcomer = serve::client(&url, &["--silent", "1"]);
    assert!(newcomer.get("refused").is_none(), "{newcomer}");
    // a's live conversation goes on to its end; then a exits 0.
    let status = replicas[0]
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
        "a not ready {:.2} s after SIGTERM; its last conversation ended and it exited {:.2} s \
         after; sessions refused: 0",
        not_ready.as_secs_f64(),
        drained.as_secs_f64()
    );
    let log = replicas[0].log();
    assert!(log.contains("draining"), "{log}");
}
