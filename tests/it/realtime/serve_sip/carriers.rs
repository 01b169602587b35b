//! What carriers and PBXs do to a call, each played by sipp against one server at once (the
//! scenarios in `tests/sip/`): a caller behind a NAT whose RTP comes from another address than
//! its SDP's (latched: heard, answered where it is, nothing to the SDP's address); hold
//! (`sendonly` answered `recvonly`), `inactive`, and the resume on a moved port (the agent's audio
//! follows); session timers refreshed (the call outlives its interval) and not (the server ends
//! it); DTMF as SIP INFO; an option the server lacks (420); glare (491). The verdicts are the
//! scenarios' own checks and what the server's status and counters say.

use std::net::UdpSocket;
use std::process::Child;
use std::time::{Duration, Instant};

use super::{free_port, invite, phone_wav, raw, scenario, sip_server, sipp_errors, sipp_on};
use crate::support::serve::metric_value_of;

/// Counts the datagrams `socket` receives until `stop` is set.
fn count(
    socket: UdpSocket,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut buf = [0u8; 2048];
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            if socket.recv(&mut buf).is_ok() {
                n += 1;
            }
        }
        n
    })
}

#[test]
fn sipp_carriers_behind_nat_on_hold_with_session_timers_info_dtmf_and_glare_are_served() {
    let (server, port) = sip_server(
        "  min_se_s: 2\n",
        "max_sessions: 8\nlimits: {sessions_per_minute_per_ip: 600, session_burst_per_ip: 100}\n",
    );
    let dir = server.dir.path().to_path_buf();
    let wav = dir.join("3s.wav");
    phone_wav(&wav, 3.0);
    // The held call speaks for a second only: once it has moved, no RTP of its comes from its
    // old port (where symmetric RTP would answer it).
    let wav1 = dir.join("1s.wav");
    phone_wav(&wav1, 1.0);
    // The NAT's inside address the latch SDP names, and the port the resumed call moves to:
    // each listened on, to count what reaches it.
    let nat_inside = UdpSocket::bind("127.0.0.5:0").unwrap();
    let inside_port = nat_inside.local_addr().unwrap().port().to_string();
    let moved = UdpSocket::bind("127.0.0.1:0").unwrap();
    let moved_port = moved.local_addr().unwrap().port().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let inside_count = count(nat_inside, stop.clone());
    let moved_count = count(moved, stop.clone());
    let set = [
        ("@SDP_IP@", "127.0.0.5"),
        ("@SDP_PORT@", inside_port.as_str()),
        ("@MOVED_PORT@", moved_port.as_str()),
    ];
    let latch_media = free_port();
    let mut runs: Vec<(&str, Child)> = Vec::new();
    for name in [
        "latch", "hold", "timers", "lapse", "glare", "info", "require",
    ] {
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let sc = scenario(&sub, name, if name == "hold" { &wav1 } else { &wav }, &set);
        let media = if name == "latch" {
            latch_media
        } else {
            free_port()
        };
        runs.push((
            name,
            sipp_on(&sub, &sc, port, media, &["-m", "1"])
                .spawn()
                .unwrap(),
        ));
    }
    // While they run: where each call's media goes, which way, its keys.
    let mut seen = std::collections::BTreeSet::new();
    let t0 = Instant::now();
    let mut done = vec![None; runs.len()];
    while done.iter().any(Option::is_none) {
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "sipp runs did not end"
        );
        for s in server.sessions() {
            let t = &s["transport"];
            seen.insert(format!(
                "{} {} {} {}",
                t["remote_rtp"].as_str().unwrap_or("-"),
                t["direction"].as_str().unwrap_or("-"),
                t["dtmf"].as_str().unwrap_or(""),
                u64::from(t["packets_received"].as_u64().unwrap_or(0) > 20)
                    + u64::from(t["packets_sent"].as_u64().unwrap_or(0) > 20),
            ));
        }
        for (i, (_, c)) in runs.iter_mut().enumerate() {
            if done[i].is_none() {
                done[i] = c.try_wait().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    let (inside, moved) = (inside_count.join().unwrap(), moved_count.join().unwrap());
    for ((name, _), st) in runs.iter().zip(&done) {
        let sub = dir.join(name);
        assert!(st.unwrap().success(), "{name}: {}", sipp_errors(&sub));
    }
    let seen: Vec<String> = seen.into_iter().collect();
    // Behind the NAT: latched to where its RTP came from, heard and answered there; nothing
    // went to the address its SDP named.
    let latched = format!("127.0.0.1:{latch_media} sendrecv  2");
    assert!(seen.contains(&latched), "{latched:?} not in {seen:#?}");
    assert_eq!(
        inside, 0,
        "the agent's audio went to the NAT's inside address"
    );
    // Hold and resume: recvonly, then inactive, then the agent's audio at the moved port.
    assert!(seen.iter().any(|s| s.contains(" recvonly ")), "{seen:#?}");
    assert!(seen.iter().any(|s| s.contains(" inactive ")), "{seen:#?}");
    assert!(moved >= 10, "{moved} packets at the moved port");
    // INFO DTMF in the status; its other bodies refused 415.
    assert!(seen.iter().any(|s| s.contains(" 57 ")), "{seen:#?}");
    let m = server.metrics();
    let requests = |method: &str, status: &str| {
        metric_value_of(
            &m,
            &format!("duplex_sip_requests_total{{method=\"{method}\",status=\"{status}\"}}"),
        )
    };
    assert_eq!(requests("INFO", "415"), 1.0, "{m}");
    assert_eq!(requests("INVITE", "420"), 1.0);
    assert_eq!(requests("INVITE", "491"), 1.0);
    // The refreshed call outlived its interval; the other was ended by the server, once.
    let log = server.log();
    assert_eq!(log.matches("the session timer expired").count(), 1, "{log}");
    assert!(requests("UPDATE", "200") >= 3.0);
    // A CSeq of another method than the request's: 400 (sipp cannot send one: by hand).
    let got = raw(
        port,
        &invite(
            "cseq",
            "",
            "v=0\nc=IN IP4 127.0.0.1\nm=audio 4000 RTP/AVP 0\n",
        )
        .replace("CSeq: 1 INVITE", "CSeq: 1 BYE"),
    )
    .unwrap();
    assert!(
        got.starts_with("SIP/2.0 400") && got.contains("CSeq"),
        "{got}"
    );
    server.wait_sessions(0, 10);
}
