//! A public SIP port under attack, each defect of the hostile probe (issue 61's table) a test
//! named after it: TCP connections that would take the server, RTP aimed at a third party or at
//! the server itself, stray requests that would each hold a transaction, a call's ids reused by
//! someone else. What is asserted is what the code decides (connections held, answers, packets
//! that reached an address, the stack's transaction count), never a time or a memory figure.

use std::io::Read;
use std::net::{TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use super::{invite, raw, raw_from, sip_server};
use crate::support::serve::metric_value_of;

/// A call placed by hand from `ip`: its socket, its Call-ID and tags.
struct RawCall {
    socket: UdpSocket,
    call: String,
    tag: String,
    to: String,
    port: u16,
}

/// `text` with `LOCAL` as the socket's address, CRLF lines.
fn wire(socket: &UdpSocket, text: &str) -> Vec<u8> {
    text.replace("LOCAL", &socket.local_addr().unwrap().to_string())
        .replace('\n', "\r\n")
        .into_bytes()
}

/// The next final answer on `socket` (provisional ones skipped), or `None` within 3 s.
fn answer(socket: &UdpSocket) -> Option<String> {
    socket
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut buf = [0u8; 8192];
    loop {
        let n = socket.recv(&mut buf).ok()?;
        let got = String::from_utf8_lossy(&buf[..n]).into_owned();
        if got.starts_with("SIP/2.0 1") || !got.starts_with("SIP/2.0") {
            continue;
        }
        return Some(got);
    }
}

impl RawCall {
    /// An INVITE of Call-ID `call` with the caller's tag `tag` from `ip` to the server's `port`;
    /// its final answer.
    fn place(ip: &str, port: u16, call: &str, tag: &str) -> (RawCall, String) {
        let socket = UdpSocket::bind((ip, 0)).unwrap();
        let rtp = UdpSocket::bind((ip, 0)).unwrap();
        let sdp = format!(
            "v=0\nc=IN IP4 {ip}\nm=audio {} RTP/AVP 0\n",
            rtp.local_addr().unwrap().port()
        );
        let msg = invite(call, "", &sdp).replace(";tag=1", &format!(";tag={tag}"));
        socket
            .send_to(&wire(&socket, &msg), ("127.0.0.1", port))
            .unwrap();
        let got = answer(&socket).unwrap_or_default();
        let to = got
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("to:"))
            .unwrap_or("To: <sip:duplex@127.0.0.1>")
            .trim()
            .to_string();
        let c = RawCall {
            socket,
            call: call.to_string(),
            tag: tag.to_string(),
            to,
            port,
        };
        if got.starts_with("SIP/2.0 200") {
            c.request("ACK", 1, &c.socket);
        }
        (c, got)
    }

    /// Sends `method` of this call's dialog (CSeq `n`) from `from`.
    fn request(&self, method: &str, n: u32, from: &UdpSocket) {
        let msg = format!(
            "{method} sip:duplex@127.0.0.1 SIP/2.0\nVia: SIP/2.0/UDP LOCAL;branch=z9hG4bK{}{method}{n}\n\
             From: <sip:t@LOCAL>;tag={}\n{}\nCall-ID: {}\nCSeq: {n} {method}\nMax-Forwards: 70\n\
             Content-Length: 0\n\n",
            self.call, self.tag, self.to, self.call
        );
        from.send_to(&wire(from, &msg), ("127.0.0.1", self.port))
            .unwrap();
    }
}

#[test]
fn sip_tcp_connections_are_capped_per_address_and_in_total() {
    let (server, port) = sip_server(
        "  tcp_connections_per_ip: 4\n  tcp_max_connections: 6\n",
        "",
    );
    let open = |ip: &str, n: usize| -> Vec<TcpStream> {
        (0..n)
            .filter_map(|_| {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                    .unwrap();
                s.bind(
                    &format!("{ip}:0")
                        .parse::<std::net::SocketAddr>()
                        .unwrap()
                        .into(),
                )
                .unwrap();
                s.connect(
                    &format!("127.0.0.1:{port}")
                        .parse::<std::net::SocketAddr>()
                        .unwrap()
                        .into(),
                )
                .ok()?;
                Some(s.into())
            })
            .collect()
    };
    // Held: a read that would block (closed ones read their end at once).
    let alive = |c: &TcpStream, wait: u64| {
        c.set_read_timeout(Some(Duration::from_millis(wait)))
            .unwrap();
        let mut r = c;
        let mut b = [0u8; 1];
        matches!(r.read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut)
    };
    let held = |conns: &[TcpStream]| conns.iter().filter(|c| alive(c, 300)).count();
    let a = open("127.0.0.1", 10);
    std::thread::sleep(Duration::from_millis(300));
    let b = open("127.0.0.2", 5);
    std::thread::sleep(Duration::from_millis(300));
    // Four from the first address, the two left in all from the second.
    assert_eq!(held(&a), 4);
    assert_eq!(held(&b), 2);
    let m = server.metrics();
    assert_eq!(
        metric_value_of(&m, "duplex_sip_tcp_connections"),
        6.0,
        "{m}"
    );
    assert_eq!(
        metric_value_of(&m, "duplex_sip_screened_total{reason=\"tcp_full\"}"),
        9.0
    );
    // A held connection speaks SIP (OPTIONS answered over it); the silent ones are closed
    // after 5 s without a byte, and their places freed.
    let mut talker = a.iter().find(|c| alive(c, 50)).unwrap();
    let local = talker.local_addr().unwrap();
    use std::io::Write;
    talker
        .write_all(
            format!(
                "OPTIONS sip:duplex@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/TCP {local};branch=z9hG4bKt1\r\n\
                 From: <sip:t@{local}>;tag=1\r\nTo: <sip:duplex@127.0.0.1>\r\nCall-ID: t1\r\n\
                 CSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n"
            )
            .as_bytes(),
        )
        .unwrap();
    talker
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut buf = [0u8; 2048];
    let n = talker.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("SIP/2.0 200"));
    let t0 = Instant::now();
    while metric_value_of(&server.metrics(), "duplex_sip_tcp_connections") > 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "silent connections kept"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        metric_value_of(
            &server.metrics(),
            "duplex_sip_screened_total{reason=\"tcp_silent\"}"
        ),
        5.0
    );
    // From outside sip.allow, a connection is closed at once.
    let (allowing, aport) = sip_server("  allow: [\"127.0.0.1\"]\n", "");
    let inside = TcpStream::connect(("127.0.0.1", aport)).unwrap();
    assert!(alive(&inside, 300));
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(
        &"127.0.0.2:0"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    s.connect(
        &format!("127.0.0.1:{aport}")
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    let mut outside: TcpStream = s.into();
    outside
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert!(matches!(outside.read(&mut buf), Ok(0) | Err(_)));
    assert_eq!(
        metric_value_of(
            &allowing.metrics(),
            "duplex_sip_screened_total{reason=\"tcp_forbidden\"}"
        ),
        1.0
    );
    drop(inside);
}

#[test]
fn sip_rtp_is_never_reflected_and_never_aimed_at_the_server() {
    let (server, port) = sip_server("", "");
    // An INVITE naming a third party's address (127.0.0.9) from 127.0.0.1: answered, and not
    // one packet reaches the third party.
    let third = UdpSocket::bind("127.0.0.9:0").unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let sdp = format!(
        "v=0\nc=IN IP4 127.0.0.9\nm=audio {} RTP/AVP 0\n",
        third.local_addr().unwrap().port()
    );
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.send_to(&wire(&s, &invite("refl", "", &sdp)), ("127.0.0.1", port))
        .unwrap();
    let got = answer(&s).unwrap();
    assert!(got.starts_with("SIP/2.0 200"), "{got}");
    let t0 = Instant::now();
    let mut reached = 0;
    let mut buf = [0u8; 2048];
    while t0.elapsed() < Duration::from_secs(2) {
        if third.recv(&mut buf).is_ok() {
            reached += 1;
        }
    }
    assert_eq!(reached, 0, "RTP reached the third address");
    assert!(server.sessions()[0]["transport"]["remote_rtp"].is_null());
    // Addresses media must never go to: 488 with a Warning saying why.
    for (c, p, why) in [
        ("224.0.0.1", "4000", "multicast"),
        ("255.255.255.255", "4000", "broadcast"),
        ("0.0.0.0", "4000", "unspecified"),
        ("127.0.0.1", "1", "privileged"),
        ("127.0.0.1", &port.to_string(), "this server's own"),
    ] {
        let sdp = format!("v=0\nc=IN IP4 {c}\nm=audio {p} RTP/AVP 0\n");
        let got = raw(port, &invite(&format!("bad{c}{p}"), "", &sdp)).unwrap();
        assert!(got.starts_with("SIP/2.0 488"), "{c}:{p}: {got}");
        assert!(
            got.contains("Warning: 399 duplex") && got.contains(why),
            "{got}"
        );
    }
}

#[test]
fn sip_stray_requests_are_answered_statelessly_and_hold_no_transaction() {
    let (server, port) = sip_server("", "");
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let r = s.try_clone().unwrap();
    r.set_read_timeout(Some(Duration::from_millis(1000)))
        .unwrap();
    let reader = std::thread::spawn(move || {
        let mut answers = std::collections::BTreeMap::<String, usize>::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.recv(&mut buf) {
            let first = String::from_utf8_lossy(&buf[..n])
                .lines()
                .next()
                .unwrap_or("")
                .to_string();
            *answers.entry(first).or_default() += 1;
        }
        answers
    });
    // 1,500 out-of-dialog requests, each a new transaction to the stack before: OPTIONS,
    // REGISTER and BYEs of no call, from one address.
    let mut sent = 0u32;
    for i in 0..1500 {
        let method = ["OPTIONS", "REGISTER", "BYE"][i % 3];
        let to = if method == "BYE" { ";tag=x" } else { "" };
        let msg = format!(
            "{method} sip:duplex@127.0.0.1 SIP/2.0\nVia: SIP/2.0/UDP LOCAL;branch=z9hG4bKs{i}\n\
             From: <sip:t@LOCAL>;tag=1\nTo: <sip:duplex@127.0.0.1>{to}\nCall-ID: s{i}\n\
             CSeq: 1 {method}\nMax-Forwards: 70\nContent-Length: 0\n\n"
        );
        s.send_to(&wire(&s, &msg), ("127.0.0.1", port)).unwrap();
        sent += 1;
        if i % 50 == 49 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    // What came back (read as it came: a socket's buffer holds fewer than a thousand).
    let answers = reader.join().unwrap();
    assert!(
        answers.keys().any(|k| k.starts_with("SIP/2.0 200")),
        "{answers:?}"
    );
    assert!(
        answers.keys().any(|k| k.starts_with("SIP/2.0 405")),
        "{answers:?}"
    );
    assert!(
        answers.keys().any(|k| k.starts_with("SIP/2.0 481")),
        "{answers:?}"
    );
    // The source's allowance (1,000 in 32 s) answered, each without a transaction; the rest
    // dropped unanswered.
    std::thread::sleep(Duration::from_millis(1500));
    let m = server.metrics();
    let screened =
        |r: &str| metric_value_of(&m, &format!("duplex_sip_screened_total{{reason=\"{r}\"}}"));
    assert_eq!(
        screened("sip_options") + screened("sip_stray"),
        1000.0,
        "{m}"
    );
    assert_eq!(screened("sip_throttled"), f64::from(sent - 1000));
    assert_eq!(metric_value_of(&m, "duplex_sip_transactions"), 0.0, "{m}");
    // Another address is not held to the first's allowance.
    let got = raw_from(
        "127.0.0.2",
        port,
        "OPTIONS sip:duplex@127.0.0.1 SIP/2.0\nVia: SIP/2.0/UDP LOCAL;branch=z9hG4bKo2\n\
         From: <sip:t@LOCAL>;tag=1\nTo: <sip:duplex@127.0.0.1>\nCall-ID: o2\nCSeq: 1 OPTIONS\n\
         Max-Forwards: 70\nContent-Length: 0\n\n",
    )
    .unwrap();
    assert!(got.starts_with("SIP/2.0 200"), "{got}");
}

#[test]
fn sip_calls_are_keyed_by_their_whole_dialog_id_and_answer_only_their_party() {
    let (server, port) = sip_server("", "");
    let (victim, got) = RawCall::place("127.0.0.1", port, "shared-id", "a");
    assert!(got.starts_with("SIP/2.0 200"), "{got}");
    server.wait_sessions(1, 10);
    // The victim's Call-ID and tag from another address: refused, no call made.
    let (_, got) = RawCall::place("127.0.0.2", port, "shared-id", "a");
    assert!(got.starts_with("SIP/2.0 403"), "{got}");
    // The same Call-ID with its own tag: a call of its own.
    let (attacker, got) = RawCall::place("127.0.0.2", port, "shared-id", "b");
    assert!(got.starts_with("SIP/2.0 200"), "{got}");
    server.wait_sessions(2, 10);
    // A BYE forged for the victim's dialog from the attacker's address: refused.
    victim.request("BYE", 2, &attacker.socket);
    let forged = answer(&attacker.socket).unwrap();
    assert!(forged.starts_with("SIP/2.0 403"), "{forged}");
    // The attacker hangs up its own call: the victim's goes on.
    attacker.request("BYE", 2, &attacker.socket);
    assert!(answer(&attacker.socket).unwrap().starts_with("SIP/2.0 200"));
    server.wait_sessions(1, 10);
    // The victim's own BYE ends its session.
    victim.request("BYE", 2, &victim.socket);
    assert!(answer(&victim.socket).unwrap().starts_with("SIP/2.0 200"));
    server.wait_sessions(0, 10);
    let m = server.metrics();
    assert!(
        metric_value_of(&m, "duplex_sip_screened_total{reason=\"sip_forged\"}") >= 2.0,
        "{m}"
    );
}
