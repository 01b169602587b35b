//! Phone calls over SIP against real user agents from Debian: `baresip` places calls that hear
//! the agent and are heard (its own decoder's dump of what it received; the session's token log
//! replayed), hung up by the caller and by the server; `sipp` (`sip-tester`) plays the edges —
//! a flood beyond capacity (503 with Retry-After, none of the admitted dropped), DTMF (RFC
//! 4733) in the session's status, a CANCEL while the call rings, a caller that vanishes without
//! a BYE (hung up by RTP timeout, over TCP) while RTP from an address the call did not
//! negotiate is ignored; and malformed SIP and SDP, each answered with its status, counted,
//! holding no slot. [`carriers`]: what carriers and PBXs do (NAT, hold, session timers, INFO
//! DTMF, glare); [`hostile`]: what a public SIP port gets (the hostile probe's table).

mod carriers;
mod hostile;

use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::daemon;
use crate::support::serve::{self, metric_value_of, read_wav, Server};

/// A port free on loopback for both UDP and TCP (SIP takes both).
fn free_port() -> u16 {
    loop {
        let u = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = u.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A server taking SIP calls on a port of its own; `extra`: more of its configuration (a
/// `sip_extra` is added under `sip:`).
fn sip_server(sip_extra: &str, extra: &str) -> (Server, u16) {
    let port = free_port();
    let cfg = format!(
        "{extra}sip:\n  enabled: true\n  address: \"127.0.0.1:{port}\"\n  rtp_ports: \"\"\n{sip_extra}"
    );
    (Server::start(&cfg, 500), port)
}

/// `seconds` of a speech-like signal as a 16-bit WAV at `rate` (baresip's file source).
fn pcm_wav(path: &Path, seconds: f64, rate: u32) {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for s in speech(seconds, rate) {
        w.write_sample(s).unwrap();
    }
    w.finalize().unwrap();
}

/// `seconds` of a tone at 180 Hz under a syllable-rate envelope, at `rate`.
fn speech(seconds: f64, rate: u32) -> Vec<i16> {
    let n = (seconds * f64::from(rate)) as usize;
    (0..n)
        .map(|i| {
            let t = i as f64 / f64::from(rate);
            let env = 0.5 + 0.5 * (std::f64::consts::TAU * 3.0 * t).sin();
            (9000.0 * env * (std::f64::consts::TAU * 180.0 * t).sin()) as i16
        })
        .collect()
}

/// `seconds` of the speech-like signal as an 8 kHz μ-law WAV (format 7, for sipp's RTP
/// streams).
fn phone_wav(path: &Path, seconds: f64) {
    let data: Vec<u8> = speech(seconds, 8000).iter().map(|s| ulaw(*s)).collect();
    let (format, bits) = (7u16, 8u16);
    let mut w = Vec::new();
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    let block = bits / 8;
    for v in [format, 1] {
        w.extend_from_slice(&v.to_le_bytes());
    }
    w.extend_from_slice(&8000u32.to_le_bytes());
    w.extend_from_slice(&(8000 * u32::from(block)).to_le_bytes());
    for v in [block, bits] {
        w.extend_from_slice(&v.to_le_bytes());
    }
    w.extend_from_slice(b"data");
    w.extend_from_slice(&(data.len() as u32).to_le_bytes());
    w.extend_from_slice(&data);
    std::fs::write(path, w).unwrap();
}

/// G.711 μ-law of one sample (ITU-T G.711's segment encoding, written out here so that the
/// caller's audio is not made by the server's own tables).
fn ulaw(s: i16) -> u8 {
    let sign: u8 = if s < 0 { 0x80 } else { 0 };
    let mag = i32::from(s).unsigned_abs().min(32635) + 0x84;
    let exp = (0..8u32)
        .rev()
        .find(|e| mag & (0x80 << e) != 0)
        .unwrap_or(0);
    let mant = (mag >> (exp + 3)) & 0x0f;
    !(sign | (exp << 4) as u8 | mant as u8)
}

/// A WAV's length in seconds (whatever its channels) and its samples in [-1, 1].
fn heard(path: &Path) -> (f64, Vec<f64>) {
    let spec = hound::WavReader::open(path).unwrap().spec();
    let (rate, x) = read_wav(path);
    let secs = x.len() as f64 / f64::from(rate) / f64::from(spec.channels);
    (secs, x)
}

fn rms(x: &[f64]) -> f64 {
    (x.iter().map(|v| v * v).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

/// A baresip that calls `sip:duplex@127.0.0.1:port` from `listen` in `codec` (baresip's name:
/// `PCMU`, `opus/48000/2`), speaking `seconds` of a speech-like signal (a WAV at the codec's
/// rate: baresip's file source does not resample), dumping what it hears and sends into
/// `dir/dump`, and quitting after `seconds`.
fn baresip(dir: &Path, listen: u16, port: u16, seconds: u32, codec: &str) -> Child {
    let rate: u32 = if codec.starts_with("opus") {
        48_000
    } else {
        8_000
    };
    std::fs::create_dir_all(dir).unwrap();
    let wav = dir.join("caller.wav");
    pcm_wav(&wav, f64::from(seconds), rate);
    let cfg = dir.join("cfg");
    std::fs::create_dir_all(&cfg).unwrap();
    std::fs::create_dir_all(dir.join("dump")).unwrap();
    std::fs::write(
        cfg.join("config"),
        format!(
            "poll_method epoll\nsip_listen 127.0.0.1:{listen}\nnet_interface 127.0.0.1\n\
             audio_player aubridge,nil\naudio_source aufile,{}\naudio_alert aubridge,nil\n\
             ausrc_srate {rate}\nauplay_srate {rate}\nausrc_channels 1\nauplay_channels 1\n\
             module_path /usr/lib/baresip/modules\nmodule g711.so\nmodule opus.so\n\
             module aufile.so\nmodule aubridge.so\nmodule sndfile.so\n\
             snd_path {}\nmodule_tmp account.so\nmodule_app menu.so\n",
            wav.display(),
            dir.join("dump").display()
        ),
    )
    .unwrap();
    std::fs::write(
        cfg.join("accounts"),
        format!("<sip:caller@127.0.0.1>;regint=0;audio_codecs={codec}\n"),
    )
    .unwrap();
    std::fs::write(cfg.join("contacts"), "").unwrap();
    Command::new("baresip")
        .arg("-f")
        .arg(&cfg)
        .args(["-e", &format!("/dial sip:duplex@127.0.0.1:{port}")])
        .args(["-t", &seconds.to_string()])
        .stdout(std::fs::File::create(dir.join("baresip.out")).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("baresip (tools/setup.sh --test installs it)")
}

/// The WAV baresip's dump holds of `which` (`dec`: what it heard; `enc`: what it sent).
fn dumped(dir: &Path, which: &str) -> PathBuf {
    std::fs::read_dir(dir.join("dump"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(&format!("-{which}.wav")))
        .unwrap_or_else(|| panic!("baresip dumped no {which} audio in {}", dir.display()))
}

/// The sessions' folders (named by their ids) the server logged.
fn session_dirs(server: &Server) -> Vec<PathBuf> {
    let sessions = server.dir.path().join("sessions");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&sessions)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.parse::<u64>().is_ok())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_baresip_call_hears_the_agent_is_heard_and_either_side_hangs_up() {
    // Greedy by default, so that the token log can be replayed; calls end at 6 s.
    let (server, port) = sip_server(
        "",
        "sampling: {text_temperature: 0, audio_temperature: 0}\nlimits: {max_session_s: 6}\n",
    );
    // The first caller hangs up after 4 s; the second would stay 10 s: the server ends its
    // call at 6 s.
    let first = server.dir.path().join("first");
    let second = server.dir.path().join("second");
    let t0 = Instant::now();
    // The first in μ-law, the second in Opus.
    let mut a = baresip(&first, free_port(), port, 4, "PCMU");
    let mut b = baresip(&second, free_port(), port, 10, "opus/48000/2");
    assert!(a.wait().unwrap().success());
    assert!(b.wait().unwrap().success());
    eprintln!("both calls over in {:.1} s", t0.elapsed().as_secs_f64());
    server.wait_sessions(0, 10);
    let log = server.log();
    for dir in [&first, &second] {
        let out = std::fs::read_to_string(dir.join("baresip.out")).unwrap();
        assert!(out.contains("Call established"), "{out}");
        // It heard the agent: its own decoder's output, seconds of it, not silence.
        let (secs, heard) = heard(&dumped(dir, "dec"));
        eprintln!(
            "{}: heard {secs:.1} s, rms {:.3}",
            dir.display(),
            rms(&heard)
        );
        assert!(secs >= 3.0, "{secs} s");
        assert!(rms(&heard) > 0.01, "silent");
    }
    // The first hung up (its BYE ended the session); the server hung up on the second at its
    // session's limit, before the caller would have.
    let (secs, _) = heard(&dumped(&second, "dec"));
    assert!(
        secs < 8.0,
        "the second call lasted {secs} s: not hung up by the server"
    );
    assert!(log.contains("sip: the caller hung up"), "{log}");
    assert!(log.contains("sip: hanging up"), "{log}");
    assert!(
        log.contains("codec=\"PCMU\"") && log.contains("codec=\"opus\""),
        "{log}"
    );
    // It was heard: every packet it sent arrived from the address its offer gave, and the
    // session took its audio (no silence filled in while it spoke).
    let m = server.metrics();
    let received = metric_value_of(
        &m,
        "duplex_sip_rtp_packets_total{direction=\"in\",outcome=\"received\"}",
    );
    assert!(received >= 0.9 * 50.0 * 10.0, "{received} packets\n{m}");
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_sip_rtp_packets_total{direction=\"in\",outcome=\"foreign\"}"
        ),
        0.0
    );
    assert!(
        metric_value_of(&m, "duplex_session_silence_frames_total") <= 4.0,
        "{m}"
    );
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"200\"}"
        ),
        2.0
    );
    // The transcript is the token log: each call's session replays, token for token, from
    // the codes of what it heard.
    let dirs = session_dirs(&server);
    assert_eq!(dirs.len(), 2, "{dirs:?}");
    for (i, s) in dirs.iter().enumerate() {
        let frames = serve::assert_replay_matches(
            s,
            &server.dir.path().join(format!("replay{i}.jsonl")),
            &[],
        );
        assert!(frames >= 36, "{frames} frames");
    }
}

/// `tests/sip/NAME.xml` with `@WAV@` set to `wav` (and each `(@KEY@, value)` of `set`),
/// written into `dir`.
fn scenario(dir: &Path, name: &str, wav: &Path, set: &[(&str, &str)]) -> PathBuf {
    let mut text = std::fs::read_to_string(daemon::root().join(format!("tests/sip/{name}.xml")))
        .unwrap()
        .replace("@WAV@", &wav.display().to_string());
    for (k, v) in set {
        text = text.replace(k, v);
    }
    let path = dir.join(format!("{name}.xml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs sipp on `scenario` against the server's SIP port; `args`: its call counts and
/// transport. Its exit status is 0 only when every call followed the scenario.
fn sipp(dir: &Path, scenario: &Path, port: u16, args: &[&str]) -> Command {
    sipp_on(dir, scenario, port, free_port(), args)
}

/// As [`sipp`], its media (RTP) on port `media`.
fn sipp_on(dir: &Path, scenario: &Path, port: u16, media: u16, args: &[&str]) -> Command {
    let mut c = Command::new("sipp");
    c.arg("-sf")
        .arg(scenario)
        .args(["-i", "127.0.0.1", "-mp"])
        .arg(media.to_string())
        .args(["-p", &free_port().to_string()])
        .args(["-nostdin", "-trace_err", "-timeout", "30s"])
        .args(args)
        .arg(format!("127.0.0.1:{port}"))
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

fn sipp_errors(dir: &Path) -> String {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("_errors.log"))
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .collect()
}

/// Sends `msg` (its lines joined by CRLF; `LOCAL` is the sender's address) to the server's
/// SIP port over UDP; its final answer (provisional ones skipped), or `None` when none came.
fn raw(port: u16, msg: &str) -> Option<String> {
    raw_from("127.0.0.1", port, msg)
}

/// As [`raw`], sent from `ip` (an address of loopback's).
fn raw_from(ip: &str, port: u16, msg: &str) -> Option<String> {
    let s = UdpSocket::bind((ip, 0)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let local = s.local_addr().unwrap();
    let text = msg
        .replace("LOCAL", &local.to_string())
        .replace('\n', "\r\n");
    s.send_to(text.as_bytes(), ("127.0.0.1", port)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.recv(&mut buf).ok()?;
        let got = String::from_utf8_lossy(&buf[..n]).into_owned();
        if !got.starts_with("SIP/2.0 1") {
            return Some(got);
        }
    }
}

fn invite(call: &str, headers: &str, body: &str) -> String {
    let body = body.replace('\n', "\r\n");
    format!(
        "INVITE sip:duplex@127.0.0.1 SIP/2.0\nVia: SIP/2.0/UDP LOCAL;branch=z9hG4bK{call}\n\
         From: <sip:t@LOCAL>;tag=1\nTo: <sip:duplex@127.0.0.1>\nCall-ID: {call}\n\
         CSeq: 1 INVITE\nContact: <sip:t@LOCAL>\nMax-Forwards: 70\n{headers}Content-Type: application/sdp\n\
         Content-Length: {}\n\n{body}",
        body.len()
    )
}

#[test]
fn sipp_floods_cancels_and_vanishes_and_malformed_requests_each_get_their_answer() {
    let (server, port) = sip_server(
        "  ring_ms: 800\n  rtp_timeout_s: 2\n",
        "max_sessions: 2\nlimits: {sessions_per_minute_per_ip: 600, session_burst_per_ip: 100}\n",
    );
    let dir = server.dir.path().to_path_buf();
    let wav3 = dir.join("3s.wav");
    phone_wav(&wav3, 3.0);
    let wav1 = dir.join("1s.wav");
    phone_wav(&wav1, 1.0);
    let metric = |series: &str| metric_value_of(&server.metrics(), series);

    // Malformed SIP and SDP: each answered with its status and counted, no slot taken.
    let sdp = "v=0\nc=IN IP4 127.0.0.1\nm=audio 4000 RTP/AVP 0\n";
    let cases = [
        (invite("m1", "", "hello"), "400", "not SDP"),
        (
            invite(
                "m2",
                "",
                "v=0\nc=IN IP4 127.0.0.1\nm=audio 4000 RTP/AVP 97 9\na=rtpmap:97 speex/16000\n",
            ),
            "488",
            "PCMU/8000, PCMA/8000 or opus/48000",
        ),
        (
            invite("m3", "", &sdp.replace("RTP/AVP", "RTP/SAVP")),
            "488",
            "plain RTP",
        ),
        (
            invite("m4", "", sdp).replace("Call-ID: m4\n", ""),
            "400",
            "no Call-ID",
        ),
        (
            invite("m5", "", sdp).replace("CSeq: 1 INVITE\n", ""),
            "400",
            "no CSeq",
        ),
        (
            invite("m7", "", sdp).replace("Contact: <sip:t@LOCAL>\n", ""),
            "400",
            "no Contact",
        ),
        // A param the session refuses: 400 naming it, once the session would have started.
        (
            invite("m6", "X-Duplex-Text-Temperature: hot\n", sdp),
            "400",
            "text_temperature",
        ),
    ];
    for (msg, status, why) in &cases {
        let got = raw(port, msg).unwrap_or_else(|| panic!("no answer to {msg}"));
        assert!(got.starts_with(&format!("SIP/2.0 {status}")), "{got}");
        assert!(got.contains(why), "{got}");
    }
    // Garbage is no SIP: dropped unanswered.
    assert_eq!(raw(port, "not sip at all\n\n"), None);
    let m = server.metrics();
    assert!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"400\"}"
        ) >= 3.0,
        "{m}"
    );
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"488\"}"
        ),
        2.0
    );
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_session_protocol_errors_total{kind=\"sip_malformed\"}"
        ),
        3.0
    );
    assert_eq!(metric_value_of(&m, "duplex_sessions_active"), 0.0);
    // OPTIONS, a trunk's keep-alive: 200 while the server takes calls.
    let options = raw(
        port,
        "OPTIONS sip:duplex@127.0.0.1 SIP/2.0\nVia: SIP/2.0/UDP LOCAL;branch=z9hG4bKo1\n\
         From: <sip:t@LOCAL>;tag=1\nTo: <sip:duplex@127.0.0.1>\nCall-ID: o1\nCSeq: 1 OPTIONS\n\
         Max-Forwards: 70\nContent-Length: 0\n\n",
    )
    .unwrap();
    assert!(options.starts_with("SIP/2.0 200"), "{options}");
    assert!(options.contains("INVITE"), "{options}");

    // Six callers at once on two slots: two answered, four refused 503 with Retry-After
    // (sipp checks it), none of the admitted dropped; the admitted press 1.
    let flood = scenario(&dir, "flood", &wav3, &[]);
    let admitted_before = metric("duplex_sessions_admitted_total");
    let mut sp = sipp(&dir, &flood, port, &["-m", "6", "-r", "100", "-l", "6"])
        .spawn()
        .unwrap();
    // While they talk, their keys are in their sessions' status.
    let t0 = Instant::now();
    let mut keys = Vec::new();
    while t0.elapsed() < Duration::from_secs(6) {
        keys = server
            .sessions()
            .iter()
            .filter_map(|s| s["transport"]["dtmf"].as_str().map(str::to_string))
            .filter(|k| !k.is_empty())
            .collect();
        if keys.len() == 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(sp.wait().unwrap().success(), "{}", sipp_errors(&dir));
    assert_eq!(keys, ["1", "1"], "the calls' DTMF in /api/sessions");
    server.wait_sessions(0, 10);
    let m = server.metrics();
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"503\"}"
        ),
        4.0,
        "{m}"
    );
    assert_eq!(
        metric_value_of(&m, "duplex_sessions_admitted_total") - admitted_before,
        2.0
    );
    assert_eq!(
        metric_value_of(&m, "duplex_sessions_refused_total{reason=\"full\"}"),
        4.0
    );
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_session_dropped_messages_total{direction=\"in\"}"
        ),
        0.0
    );
    let received = metric_value_of(
        &m,
        "duplex_sip_rtp_packets_total{direction=\"in\",outcome=\"received\"}",
    );
    assert!(
        received >= 2.0 * 140.0,
        "{received} packets of the admitted calls' 300"
    );
    assert_eq!(metric_value_of(&m, "duplex_sip_dtmf_total"), 2.0);
    let log = server.log();
    assert_eq!(log.matches("sip: the caller hung up").count(), 2, "{log}");

    // A caller that gives up while the call rings: 487, and its slot is free again.
    let cancel = scenario(&dir, "cancel", &wav1, &[]);
    let st = sipp(&dir, &cancel, port, &["-m", "1"]).status().unwrap();
    assert!(st.success(), "{}", sipp_errors(&dir));
    server.wait_sessions(0, 10);
    assert!(server.log().contains("cancelled while it rang"));

    // A caller (over TCP) that vanishes after a second of audio: no BYE, no more RTP. RTP from
    // an address the call did not negotiate (another host: 127.0.0.2) keeps nothing alive: the
    // server hangs up after its RTP timeout (sipp answers the BYE).
    let vanish = scenario(&dir, "vanish", &wav1, &[]);
    let mut sp = sipp(&dir, &vanish, port, &["-m", "1", "-t", "t1"])
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let local_rtp = loop {
        let s = server.sessions();
        if let Some(a) = s
            .first()
            .and_then(|s| s["transport"]["local_rtp"].as_str().map(str::to_string))
        {
            break a;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no call");
        std::thread::sleep(Duration::from_millis(50));
    };
    let foreign = UdpSocket::bind("127.0.0.2:0").unwrap();
    let answered = Instant::now();
    for i in 0..150u16 {
        let mut p = vec![0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7];
        p[2..4].copy_from_slice(&i.to_be_bytes());
        p[4..8].copy_from_slice(&(u32::from(i) * 160).to_be_bytes());
        p.extend_from_slice(&[0xff; 160]);
        let _ = foreign.send_to(&p, &local_rtp);
        std::thread::sleep(Duration::from_millis(20));
        if sp.try_wait().unwrap().is_some() {
            break;
        }
    }
    assert!(sp.wait().unwrap().success(), "{}", sipp_errors(&dir));
    let lasted = answered.elapsed().as_secs_f64();
    eprintln!("the vanished caller was hung up on {lasted:.1} s after its call was seen");
    // A second of audio, then the 2 s timeout.
    assert!(lasted >= 2.0, "{lasted} s");
    let log = server.log();
    assert!(log.contains("ended=RtpTimeout"), "{log}");
    let m = server.metrics();
    assert!(
        metric_value_of(
            &m,
            "duplex_sip_rtp_packets_total{direction=\"in\",outcome=\"foreign\"}"
        ) >= 50.0,
        "{m}"
    );
    server.wait_sessions(0, 10);
}

#[test]
fn a_server_that_asks_for_credentials_answers_only_allowed_callers_that_have_them() {
    // One connection and one new session a minute per address: an allow-listed caller (a
    // PBX, a trunk) carries many callers, and is held to neither.
    let (server, port) = sip_server(
        "  allow: [\"127.0.0.1\"]\n  digest_username: trunk\n  digest_password: s3cret\n  \
         realm: duplex-test\n",
        "max_connections_per_ip: 1\n\
         limits: {sessions_per_minute_per_ip: 1, session_burst_per_ip: 1}\n",
    );
    let dir = server.dir.path().to_path_buf();
    let wav1 = dir.join("1s.wav");
    phone_wav(&wav1, 1.0);
    let sdp = "v=0\nc=IN IP4 127.0.0.1\nm=audio 4000 RTP/AVP 0\n";
    // From an address outside the allow-list (loopback's 127.0.0.2): 403, whatever it says.
    let got = raw_from("127.0.0.2", port, &invite("a1", "", sdp)).unwrap();
    assert!(got.starts_with("SIP/2.0 403"), "{got}");
    assert!(got.contains("not in sip.allow"), "{got}");
    // Without credentials: challenged.
    let got = raw(port, &invite("a2", "", sdp)).unwrap();
    assert!(got.starts_with("SIP/2.0 401"), "{got}");
    assert!(
        got.contains("WWW-Authenticate: Digest realm=\"duplex-test\""),
        "{got}"
    );
    // sipp answers the challenge (its own Digest code): with the password, the calls go
    // through, two at once from the one address; with another, it is challenged again and
    // fails.
    let good = scenario(
        &dir,
        "auth",
        &wav1,
        &[("@USER@", "trunk"), ("@PASSWORD@", "s3cret")],
    );
    let st = sipp(&dir, &good, port, &["-m", "2", "-l", "2", "-r", "100"])
        .status()
        .unwrap();
    assert!(st.success(), "{}", sipp_errors(&dir));
    let bad = scenario(
        &dir,
        "auth",
        &wav1,
        &[("@USER@", "trunk"), ("@PASSWORD@", "guess")],
    );
    let st = sipp(&dir, &bad, port, &["-m", "1"]).status().unwrap();
    assert!(!st.success());
    server.wait_sessions(0, 10);
    let m = server.metrics();
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"200\"}"
        ),
        2.0,
        "{m}"
    );
    assert_eq!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"403\"}"
        ),
        1.0
    );
    assert!(
        metric_value_of(
            &m,
            "duplex_sip_requests_total{method=\"INVITE\",status=\"401\"}"
        ) >= 3.0
    );
    assert_eq!(metric_value_of(&m, "duplex_sessions_admitted_total"), 2.0);
}
