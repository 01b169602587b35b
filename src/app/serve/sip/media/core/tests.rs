//! A call's media on a simulated clock: every instant is given, nothing sleeps, no socket.

use super::*;
use crate::app::serve::sip::sdp::{self, Direction};

const CALLER: &str = "198.51.100.7";
const OURS: &str = "192.0.2.1:20000";

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn offer(ip: &str, port: u16, direction: &str) -> Offer {
    let text = format!(
        "v=0\r\nc=IN IP4 {ip}\r\nm=audio {port} RTP/AVP 0 101\r\na=rtpmap:101 telephone-event/8000\r\na={direction}\r\n"
    );
    sdp::read_offer(text.as_bytes()).unwrap()
}

/// A call from [`CALLER`] whose SDP names `ip:port`, with `trusted` as its allow-list and
/// `rtp_timeout`.
fn call(ip: &str, port: u16, trusted: &'static [&'static str], t0: Instant) -> CallMedia {
    CallMedia::new(
        Setup {
            offer: offer(ip, port, "sendrecv"),
            settings: MediaSettings {
                jitter: Duration::from_millis(40),
                max_jitter: Duration::from_millis(200),
                rtp_timeout: Duration::from_secs(2),
            },
            pacing: Some((1.0, Duration::from_secs(1))),
            signalling: CALLER.parse().unwrap(),
            trusted: Arc::new(move |ip: IpAddr| trusted.iter().any(|t| t.parse() == Ok(ip))),
            own: vec![sa(OURS)],
            seed: 7,
            stats: Arc::new(CallStats::default()),
        },
        t0,
    )
}

/// An RTP packet of 20 ms of G.711 silence, number `n`.
fn pcmu(n: u16) -> Vec<u8> {
    rtp::packet(0, n == 0, n, u32::from(n) * 160, 0x1234, &[0xff; 160])
}

/// Runs the media from `from` to `to` in 1 ms steps, the caller (at `src`, when given) sending
/// a packet every 20 ms and the agent's audio (`agent` bytes of G.711 a 20 ms) coming in;
/// returns what it sent where, and the audio frames it handed the session.
struct Run {
    sent: Vec<(Duration, SocketAddr)>,
    audio: usize,
    keys: String,
}

fn drive(
    m: &mut CallMedia,
    t0: Instant,
    (from, to): (u64, u64),
    src: Option<SocketAddr>,
    agent: usize,
) -> Run {
    let mut r = Run {
        sent: Vec::new(),
        audio: 0,
        keys: String::new(),
    };
    for ms in from..to {
        let now = t0 + Duration::from_millis(ms);
        if ms % 20 == 0 {
            if let Some(s) = src {
                m.handle_rtp(now, s, &pcmu((ms / 20) as u16));
            }
            if agent > 0 {
                m.handle_agent(now, &vec![0x7f; agent]);
            }
        }
        m.handle_timeout(now);
        while let Some(o) = m.poll_output() {
            match o {
                Output::Transmit(t) if !t.rtcp && rtp::parse(&t.data).is_ok() => {
                    r.sent.push((now - t0, t.to))
                }
                Output::Transmit(_) => {}
                Output::Audio(_) => r.audio += 1,
                Output::Key(k) => r.keys.push(k),
            }
        }
        if m.ended().is_some() {
            break;
        }
    }
    r
}

#[test]
fn sip_rtp_is_never_reflected_to_a_third_address() {
    // The INVITE came from the caller; its SDP names a third party.
    let t0 = Instant::now();
    let mut m = call("203.0.113.9", 4000, &[], t0);
    // The agent speaks for a second: nothing goes anywhere, the third address least of all.
    let r = drive(&mut m, t0, (0, 1000), None, 160);
    assert!(r.sent.is_empty(), "{:?}", &r.sent[..3.min(r.sent.len())]);
    // The third party itself sending RTP latches nothing either: it is not the call's.
    let r = drive(&mut m, t0, (1000, 1500), Some(sa("203.0.113.10:4000")), 160);
    assert!(r.sent.is_empty());
    assert!(m.stats.foreign.load(Ordering::Relaxed) >= 20);
}

#[test]
fn sip_symmetric_rtp_answers_where_the_callers_rtp_comes_from() {
    // Behind a NAT: the SDP names a private address, the RTP comes from the caller's public
    // address on another port.
    let t0 = Instant::now();
    let mut m = call("10.0.0.5", 4000, &[], t0);
    let nat = sa("198.51.100.7:61000");
    let r = drive(&mut m, t0, (0, 1000), Some(nat), 160);
    // Heard (50 packets, played after the jitter delay) and answered at the real port only.
    assert!(r.audio >= 45, "{}", r.audio);
    assert!(r.sent.len() >= 45, "{}", r.sent.len());
    assert!(r.sent.iter().all(|(_, to)| *to == nat));
    assert_eq!(m.stats.json()["remote_rtp"], "198.51.100.7:61000");
    // A second source, while the first still speaks, is foreign.
    let before = m.stats.foreign.load(Ordering::Relaxed);
    m.handle_rtp(
        t0 + Duration::from_millis(1001),
        sa("198.51.100.7:62000"),
        &pcmu(9),
    );
    assert_eq!(m.stats.foreign.load(Ordering::Relaxed), before + 1);
    // The NAT rebinds: after RELATCH of silence from the old port, the new one is taken.
    let moved = sa("198.51.100.7:62000");
    let r = drive(&mut m, t0, (2100, 3000), Some(moved), 160);
    assert!(
        r.sent.iter().skip(5).all(|(_, to)| *to == moved),
        "{:?}",
        r.sent
    );
}

#[test]
fn the_sdp_address_is_sent_to_at_once_when_the_signalling_came_from_it_or_is_trusted() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    let r = drive(&mut m, t0, (0, 200), None, 160);
    assert!(!r.sent.is_empty());
    assert!(r.sent.iter().all(|(_, to)| *to == sa("198.51.100.7:4000")));
    // A trunk's media gateway in sip.allow, other than its signalling address.
    let mut m = call("203.0.113.20", 4000, &["203.0.113.20"], t0);
    let r = drive(&mut m, t0, (0, 200), None, 160);
    assert!(r.sent.iter().all(|(_, to)| *to == sa("203.0.113.20:4000")));
    assert!(!r.sent.is_empty());
}

#[test]
fn sip_own_rtp_is_never_heard_and_the_call_still_times_out() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    // Our own socket's packets (an SDP that named our port) are not the caller's.
    let r = drive(&mut m, t0, (0, 2100), Some(sa(OURS)), 0);
    assert_eq!(r.audio, 0);
    assert_eq!(m.ended(), Some(Ended::RtpTimeout));
    assert!(m.stats.foreign.load(Ordering::Relaxed) >= 100);
}

#[test]
fn a_silent_caller_ends_the_call_at_its_rtp_timeout_exactly() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    let src = sa("198.51.100.7:4000");
    drive(&mut m, t0, (0, 500), Some(src), 0);
    assert_eq!(m.ended(), None);
    // The last packet came at 480 ms: the call ends 2 s later, not a millisecond before.
    m.handle_timeout(t0 + Duration::from_millis(2479));
    assert_eq!(m.ended(), None);
    assert!(m.poll_timeout() <= t0 + Duration::from_millis(2480));
    m.handle_timeout(t0 + Duration::from_millis(2480));
    assert_eq!(m.ended(), Some(Ended::RtpTimeout));
}

#[test]
fn sip_hold_and_resume_stop_and_restart_our_media_and_a_moved_port_is_followed() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    let src = sa("198.51.100.7:4000");
    let r = drive(&mut m, t0, (0, 500), Some(src), 160);
    assert!(r.sent.len() >= 20);
    // Held (the caller sends music, takes nothing): we send nothing, and still hear it.
    let held = offer(CALLER, 4000, "sendonly");
    assert_eq!(held.answer_direction(), Direction::RecvOnly);
    m.renegotiate(t0 + Duration::from_millis(500), held);
    let r = drive(&mut m, t0, (500, 1500), Some(src), 160);
    assert!(r.sent.is_empty(), "{} sent on hold", r.sent.len());
    assert!(r.audio >= 45);
    assert_eq!(m.stats.json()["direction"], "recvonly");
    // Inactive, silent for ten times the RTP timeout: the call lives.
    m.renegotiate(
        t0 + Duration::from_millis(1500),
        offer(CALLER, 4000, "inactive"),
    );
    let r = drive(&mut m, t0, (1500, 21_500), None, 160);
    assert!(r.sent.is_empty());
    assert_eq!(m.ended(), None);
    // Resumed on another port: latched afresh there, answered there.
    m.renegotiate(
        t0 + Duration::from_millis(21_500),
        offer(CALLER, 5000, "sendrecv"),
    );
    let r = drive(
        &mut m,
        t0,
        (21_500, 22_500),
        Some(sa("198.51.100.7:5000")),
        160,
    );
    assert!(r.sent.len() >= 45, "{}", r.sent.len());
    assert!(r.sent.iter().all(|(_, to)| *to == sa("198.51.100.7:5000")));
    assert!(r.audio >= 40, "{}", r.audio);
    // An old-style hold (c=0.0.0.0) stops our media; the resume goes back to the address.
    m.renegotiate(
        t0 + Duration::from_millis(22_500),
        offer("0.0.0.0", 5000, "sendrecv"),
    );
    let r = drive(&mut m, t0, (22_500, 23_000), None, 160);
    assert!(r.sent.is_empty());
    assert_eq!(m.stats.json()["direction"], "inactive");
    assert_eq!(m.ended(), None);
}

#[test]
fn the_agents_audio_is_paced_one_packet_time_apart_and_its_excess_dropped() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    // Ten packets at once: the first goes at once, the backlog twice as fast until four are
    // left, then one each 20 ms.
    m.handle_agent(t0, &[0x7f; 1600]);
    let r = drive(&mut m, t0, (0, 400), None, 0);
    let at: Vec<u64> = r.sent.iter().map(|(t, _)| t.as_millis() as u64).collect();
    assert_eq!(at, [0, 10, 20, 30, 40, 50, 70, 90, 110, 130]);
    // Three seconds at once: all but the last two seconds' worth are dropped.
    let t1 = t0 + Duration::from_secs(1);
    m.handle_agent(t1, &vec![0x7f; 160 * 150]);
    let r = drive(&mut m, t1, (0, 5000), Some(sa("198.51.100.7:4000")), 0);
    assert_eq!(r.sent.len(), MAX_QUEUED);
    // Sequence numbers and timestamps follow on.
    let mut m = call(CALLER, 4000, &[], t0);
    m.handle_agent(t0, &[0x7f; 480]);
    let mut seq = Vec::new();
    for ms in 0..100 {
        m.handle_timeout(t0 + Duration::from_millis(ms));
        while let Some(o) = m.poll_output() {
            if let Output::Transmit(t) = o {
                let h = rtp::parse(&t.data).unwrap();
                seq.push((h.seq, h.timestamp, h.marker));
            }
        }
    }
    assert_eq!(seq.len(), 3);
    assert_eq!(seq[1].0, seq[0].0.wrapping_add(1));
    assert_eq!(seq[2].1, seq[0].1.wrapping_add(320));
    assert!(seq[0].2 && !seq[1].2);
}

#[test]
fn lost_packets_are_concealed_and_a_twenty_times_sender_is_held_to_real_time() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    let src = sa("198.51.100.7:4000");
    // Every fifth packet lost: each slot is still played (silence for the lost).
    for n in 0..50u16 {
        let now = t0 + Duration::from_millis(20 * u64::from(n));
        if n % 5 != 4 {
            m.handle_rtp(now, src, &pcmu(n));
        }
        m.handle_timeout(now);
    }
    // The last slot is due at 980 ms and the 40 ms delay.
    m.handle_timeout(t0 + Duration::from_millis(1030));
    let mut audio = 0;
    while let Some(o) = m.poll_output() {
        if matches!(o, Output::Audio(_)) {
            audio += 1;
        }
    }
    assert_eq!(audio, 50);
    assert_eq!(m.stats.lost.load(Ordering::Relaxed), 10);
    // A caller sending 20 s of audio in one second: at most a second's catch-up beyond real
    // time is decoded.
    let t1 = t0 + Duration::from_secs(10);
    let mut m = call(CALLER, 4000, &[], t1);
    let mut audio = 0;
    for n in 0..1000u16 {
        let now = t1 + Duration::from_millis(u64::from(n));
        m.handle_rtp(now, src, &pcmu(n));
        m.handle_timeout(now);
        while let Some(o) = m.poll_output() {
            if matches!(o, Output::Audio(_)) {
                audio += 1;
            }
        }
    }
    m.handle_timeout(t1 + Duration::from_secs(3));
    while let Some(o) = m.poll_output() {
        if matches!(o, Output::Audio(_)) {
            audio += 1;
        }
    }
    // One second's catch-up (50) and the seconds that passed (3 s: 150), of the 1000 sent.
    assert!(audio <= 200, "{audio} packets decoded");
    assert!(audio >= 50, "{audio}");
}

#[test]
fn sip_rfc4733_events_are_one_key_each_and_logged_at_most_once_a_second() {
    let t0 = Instant::now();
    let mut m = call(CALLER, 4000, &[], t0);
    let src = sa("198.51.100.7:4000");
    // An event's packets repeat its timestamp: one key.
    for i in 0..3u16 {
        let p = rtp::packet(101, i == 0, i, 800, 0x1234, &[5, 0x0a, 0, 160]);
        m.handle_rtp(t0, src, &p);
    }
    // A flood of distinct events: 10,000 keys in a second.
    for i in 0..10_000u32 {
        let now = t0 + Duration::from_micros(100 * u64::from(i));
        let p = rtp::packet(
            101,
            true,
            (i + 3) as u16,
            1000 + i,
            0x1234,
            &[1, 0x8a, 0, 160],
        );
        m.handle_rtp(now, src, &p);
    }
    let mut keys = String::new();
    while let Some(o) = m.poll_output() {
        if let Output::Key(k) = o {
            keys.push(k);
        }
    }
    assert!(keys.starts_with("51"));
    assert_eq!(keys.len(), 10_001);
    // The status keeps the first 64; the log says them once, then the rest a second later.
    assert_eq!(m.stats.json()["dtmf"].as_str().unwrap().len(), 64);
    let (first, more) = m.stats.keys_to_log(t0, false).unwrap();
    assert_eq!((first.len(), more), (64, 10_001 - 64));
    m.stats.pressed('9');
    assert_eq!(
        m.stats.keys_to_log(t0 + Duration::from_millis(999), false),
        None
    );
    assert_eq!(
        m.stats.keys_to_log(t0 + Duration::from_secs(1), false),
        Some(("9".to_string(), 0))
    );
}
