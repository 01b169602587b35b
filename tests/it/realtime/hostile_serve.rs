//! What a hostile client cannot make `duplex serve` spend: memory, compute beyond real time, a
//! slot after it has gone, the server's secrets, or another client's session. Each attack runs
//! beside a healthy real-time session, through independent clients (`tests/clients/hostile.py`
//! writes its Ogg pages and WebSocket frames by hand; `moshi_client.py` is Kyutai's `sphn`).
//!
//! The memory property: under any of these attacks the server's resident high-water mark grows
//! by less than [`ATTACK_BOUND_MIB`] over what the healthy session alone brought it to.

use crate::support::daemon;
use crate::support::serve;

use std::time::Instant;

use serve::{client, hostile, metric_value_of, speech_wav, Server};

/// What one attacking session may add to the server's peak resident memory, MiB.
const ATTACK_BOUND_MIB: u64 = 64;

/// A server with one healthy real-time session running for `seconds`; returns the server, the
/// session's thread and the peak resident memory once it runs (KiB).
fn with_healthy_session(
    config: &str,
    seconds: f64,
) -> (
    Server,
    std::thread::JoinHandle<serde_json::Value>,
    u64,
    String,
) {
    let server = Server::start(config, 240);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, seconds, 210.0);
    let w = wav.to_str().unwrap().to_string();
    let url = server.url();
    let u = url.clone();
    let healthy = std::thread::spawn(move || client(&u, &["--mode", "kyutai", "--wav", &w]));
    // The healthy session in its steady state (two seconds into its conversation) before the
    // baseline.
    server.wait_sessions_aged(1, 2.0, 30);
    let base = server.peak_rss_kib();
    (server, healthy, base, url)
}

fn assert_healthy(h: &serde_json::Value, seconds: f64) {
    assert!(h["errors"].as_array().unwrap().is_empty(), "{h}");
    let samples = h["samples"].as_i64().unwrap() as f64;
    assert!(
        samples >= (seconds - 0.2) * 24_000.0,
        "the healthy session lost audio: {h}"
    );
}

fn grown_mib(server: &Server, base: u64) -> u64 {
    server.peak_rss_kib().saturating_sub(base) / 1024
}

/// Defects 1 and 3 of the probe: one 1 MiB message of pages of 2-byte packets that each claim
/// 120 ms (the server went to 4.03 GB), the same with 0-byte packets (2.9 GB), and a client
/// sending 60 s of speech at 8 times real time (one session made 272 s of agent audio in 24 s).
/// Each costs what a real-time session costs: what exceeds real time plus the catch-up is
/// skipped undecoded. (A client sending all of it at once is over the message rate: closed.)
#[test]
fn decode_bombs_and_fast_senders_cost_no_more_than_real_time() {
    let (server, healthy, base, url) = with_healthy_session("max_sessions: 4\n", 16.0);
    let bomb = hostile(&url, &["--attack", "bomb", "--hold", "3"]);
    println!("bomb: {bomb}");
    assert!(bomb["bytes"].as_u64().unwrap() > 1_000_000, "{bomb}");
    let after_bomb = grown_mib(&server, base);
    let zeros = hostile(
        &url,
        &["--attack", "zeros", "--size", "262144", "--hold", "3"],
    );
    println!("zeros: {zeros}");
    let after_zeros = grown_mib(&server, base);
    // 60 s of speech at 8 times real time.
    let wav = server.dir.path().join("long.wav");
    speech_wav(&wav, 60.0, 180.0);
    let t0 = Instant::now();
    let fast = client(
        &url,
        &[
            "--mode",
            "kyutai",
            "--wav",
            wav.to_str().unwrap(),
            "--speed",
            "8",
            "--tail",
            "2",
        ],
    );
    let wall = t0.elapsed().as_secs_f64();
    let agent_s = fast["samples"].as_f64().unwrap() / 24_000.0;
    println!(
        "fast sender: {:.1} s of input sent in {:.1} s; {agent_s:.1} s of agent audio in {wall:.1} s",
        60.0,
        fast["sent_s"].as_f64().unwrap()
    );
    let h = healthy.join().unwrap();
    assert_healthy(&h, 16.0);
    let m = server.metrics();
    let refused = metric_value_of(&m, "duplex_session_input_refused_frames_total");
    println!(
        "peak resident growth: bomb {after_bomb} MiB, zeros {after_zeros} MiB, with the fast \
         sender {} MiB; {refused} frames refused",
        grown_mib(&server, base)
    );
    assert!(
        after_bomb < ATTACK_BOUND_MIB && after_zeros < ATTACK_BOUND_MIB,
        "bomb {after_bomb} MiB, zeros {after_zeros} MiB"
    );
    assert!(grown_mib(&server, base) < ATTACK_BOUND_MIB);
    // Paced: no more agent audio than the session's wall time plus the catch-up allowance.
    assert!(
        agent_s <= wall + 1.5,
        "{agent_s:.1} s of agent audio in {wall:.1} s"
    );
    // What the bombs claimed (hours) and the fast sender's excess were refused and counted.
    assert!(refused > 1000.0, "{refused}");
    let log = server.log();
    assert!(log.contains("faster than real time"), "{log}");
}

/// Defect 2: pings as fast as possible, never read (the server went to 2.38 GB in 10 s), and
/// read (426 MB). The flood closes the session (counted); the write buffer is capped.
#[test]
fn a_ping_flood_closes_its_session_and_memory_stays_bounded() {
    let (server, healthy, base, url) = with_healthy_session("max_sessions: 4\n", 12.0);
    let unread = hostile(&url, &["--attack", "ping-flood", "--hold", "8"]);
    println!("ping flood, never read: {unread}");
    let read = hostile(&url, &["--attack", "ping-flood", "--hold", "8", "--read"]);
    println!("ping flood, read: {read}");
    let grown = grown_mib(&server, base);
    println!("peak resident growth: {grown} MiB");
    assert_eq!(unread["status"], 101, "{unread}");
    assert!(
        read["closed_after_s"].is_number(),
        "a reading ping flood was kept: {read}"
    );
    assert!(grown < ATTACK_BOUND_MIB, "{grown} MiB");
    let h = healthy.join().unwrap();
    assert_healthy(&h, 12.0);
    server.wait_sessions(0, 20);
    let m = server.metrics();
    let floods = metric_value_of(&m, "duplex_session_protocol_errors_total{kind=\"flood\"}");
    assert!(floods >= 1.0, "{m}");
}

/// Defect 4: a 4 KB persona primed one step per token held the slot 8.5 s after its client had
/// gone. Now the client's close stops the priming at the next step, and the persona is bounded
/// in tokens (`limits.max_prompt_tokens`), refused with a message naming the parameter and the
/// operator's setting.
#[test]
fn a_client_that_leaves_while_priming_stops_it_and_long_personas_are_refused() {
    // Each priming step made 8 ms slower, as a real model's would be (the tiny pack primes a
    // thousand steps a second).
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    let text = serve::template(&dir.path().join("sessions"), 240).replace(
        "    kind: depformer\n",
        "    kind: depformer\n    inject_delay: { mode: bimodal, base_ms: 8, jitter_ms: 0, slow_fraction: 0 }\n",
    );
    std::fs::write(&tpl, text).unwrap();
    let server = Server::start_with(
        dir,
        "max_sessions: 1\nlimits:\n  max_prompt_tokens: 5000\n",
        &tpl,
    );
    let persona = "You are a patient assistant who explains things slowly. ".repeat(70);
    assert!(persona.len() > 3900);
    let query = format!("text_prompt={}", persona.replace(' ', "+"));
    let steps = || {
        metric_value_of(
            &server.metrics(),
            "duplex_stage_service_seconds_count{stage=\"depformer\"}",
        )
    };
    let before = steps();
    let r = hostile(
        &server.url(),
        &[
            "--attack",
            "prime-leave",
            "--hold",
            "0.7",
            "--query",
            &query,
        ],
    );
    assert!(
        !r["kinds"].as_array().unwrap().contains(&0.into()),
        "primed already: {r}"
    );
    server.wait_sessions(0, 30);
    let log = server.log();
    let primed = steps() - before;
    println!("the client left after 0.7 s; {primed} priming steps ran");
    assert!(
        log.contains("priming stopped"),
        "the priming was not stopped: {log}"
    );
    // The script is the persona's tokens and more: stopping at the client's close ran a small
    // part of it.
    assert!(primed < 400.0, "{primed} steps ran");
    let (code, _) = server.get("/readyz");
    assert_eq!(code, 200, "the slot is free again");

    // Bounded in tokens: the default server refuses it, naming the parameter, and nothing of
    // its files.
    let strict = Server::start("limits:\n  max_prompt_tokens: 64\n", 240);
    let r = client(
        &strict.url(),
        &["--mode", "web", "--query", &query, "--silent", "0.5"],
    );
    let errors = r["errors"].to_string();
    assert!(
        errors.contains("text_prompt") && errors.contains("at most 64"),
        "{r}"
    );
    // Named as the operator set it, not as the stage's param (row 10 of the second probe).
    assert!(
        errors.contains("limits.max_prompt_tokens") && !errors.contains("max_persona_tokens"),
        "{errors}"
    );
    assert!(!errors.contains('/'), "a server path was shown: {errors}");
}

/// Defects 5, 6 and 18: a name this server does not serve gets 421 on every endpoint (DNS
/// rebinding), `/api/defaults` does not publish the operator's persona, every response has the
/// security headers, a malformed `Sec-WebSocket-Key` is refused, and the close codes say what
/// happened (1009 too big, 1007 not Ogg/Opus).
#[test]
fn hosts_headers_defaults_keys_and_close_codes() {
    let server = Server::start(
        "allowed_hosts: [voice.example.com]\ntext_prompt: \"SECRET system prompt\"\n",
        240,
    );
    for path in ["/api/sessions", "/metrics", "/api/defaults", "/", "/readyz"] {
        let (code, _, _) = server.request(&format!("GET {path} HTTP/1.1\r\nHost: evil.example"));
        assert_eq!(code, 421, "{path} answered a foreign host");
        let (code, head, _) =
            server.request(&format!("GET {path} HTTP/1.1\r\nHost: voice.example.com"));
        assert_eq!(code, 200, "{path}: {head}");
        let (code, _, _) = server.request(&format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}",
            server.port
        ));
        assert_eq!(code, 200, "{path}");
    }
    let (_, head, body) = server.request("GET / HTTP/1.1\r\nHost: localhost");
    let head = head.to_ascii_lowercase();
    for h in [
        "content-security-policy: default-src 'self'",
        "x-frame-options: deny",
        "x-content-type-options: nosniff",
    ] {
        assert!(head.contains(h), "{h} missing:\n{head}");
    }
    assert!(body.contains("<html"), "{body}");
    let (_, _, defaults) = server.request("GET /api/defaults HTTP/1.1\r\nHost: localhost");
    assert!(!defaults.contains("SECRET"), "{defaults}");
    let d: serde_json::Value = serde_json::from_str(&defaults).unwrap();
    assert_eq!(d["default_persona"], true, "{d}");
    let m = server.metrics();
    assert_eq!(
        metric_value_of(&m, "duplex_http_requests_refused_total{reason=\"host\"}"),
        5.0
    );

    // The upgrade: a malformed key is refused before anything else; a good one gets 101.
    let url = server.url();
    let r = hostile(&url, &["--attack", "upgrade", "--key", "not-a-key"]);
    assert_eq!(r["status"], 400, "{r}");
    let r = hostile(
        &url,
        &["--attack", "upgrade", "--key", "dGhlIHNhbXBsZSBub25jZQ=="],
    );
    assert_eq!(r["status"], 101, "{r}");
    let r = hostile(&url, &["--attack", "upgrade", "--host", "evil.example"]);
    assert_eq!(r["status"], 421, "{r}");

    // Close codes: too big, then not Ogg/Opus.
    let r = client(&url, &["--send-size", "2000000", "--tail", "2"]);
    assert_eq!(r["close_code"], 1009, "{r}");
    let r = client(
        &url,
        &[
            "--send-raw",
            "01deadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeef",
            "--silent",
            "1",
        ],
    );
    assert_eq!(r["close_code"], 1007, "{r}");
    assert!(r["errors"].to_string().contains("not an Ogg stream"), "{r}");
    // A client's bad audio is its fault: a warning at most, never an error line.
    let log = server.log();
    assert!(
        !log.lines()
            .any(|l| l.contains("ERROR") && l.contains("Ogg")),
        "{log}"
    );
}

fn write_wav(path: &std::path::Path, rate: u32, seconds: f64) {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for i in 0..(seconds * rate as f64) as usize {
        w.write_sample(((i as f64 * 0.05).sin() * 8000.0) as i16)
            .unwrap();
    }
    w.finalize().unwrap();
}

/// Defects 7, 13 and 16: every voice is checked from its header at start (a 50 Hz WAV took
/// 53 s and 1.15 GB per connection naming it); `/api/voices` lists only the voices that check;
/// a link leading out of the folder is refused (it opened /etc/passwd); a client's error names
/// its voice, never the server's folders.
#[test]
fn voices_are_checked_at_start_and_links_stay_inside_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let voices = dir.path().join("voices");
    std::fs::create_dir(&voices).unwrap();
    write_wav(&voices.join("good.wav"), 24_000, 1.0);
    // 1 MB of 50 Hz audio: hours at the model's rate.
    write_wav(&voices.join("low.wav"), 50, 10_000.0);
    write_wav(&voices.join("long.wav"), 8000, 40.0);
    std::fs::write(voices.join("empty.wav"), b"").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", voices.join("passwd.wav")).unwrap();
    std::os::unix::fs::symlink(voices.join("good.wav"), voices.join("alias.wav")).unwrap();
    let server = Server::start(
        &format!("voices: {}\nlimits:\n  max_voice_s: 30\n", voices.display()),
        240,
    );
    let (code, body) = server.get("/api/voices");
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["voices"], serde_json::json!(["alias.wav", "good.wav"]));
    let url = server.url();
    for (name, expect) in [
        ("low.wav", "not a usable voice"),
        ("long.wav", "not a usable voice"),
        ("empty.wav", "not a usable voice"),
        ("passwd.wav", "no such voice"),
        ("nothere.wav", "no such voice"),
    ] {
        let t0 = Instant::now();
        let r = client(
            &url,
            &[
                "--mode",
                "web",
                "--query",
                &format!("voice_prompt={name}"),
                "--silent",
                "0.3",
            ],
        );
        let errors = r["errors"].to_string();
        assert!(errors.contains(expect), "{name}: {r}");
        assert!(
            !errors.contains(&voices.display().to_string()),
            "{name}: the folder was shown: {errors}"
        );
        println!("{name}: refused in {:.2} s", t0.elapsed().as_secs_f64());
    }
    let r = client(
        &url,
        &[
            "--mode",
            "web",
            "--query",
            "voice_prompt=alias.wav",
            "--silent",
            "0.5",
        ],
    );
    assert!(r["handshake_s"].is_number(), "{r}");
    let log = server.log();
    assert!(log.contains("links outside the voices folder"), "{log}");
}

/// The deployment's part: a client address opens at most `session_burst_per_ip` sessions at
/// once (50 reconnects in 10 s were all served), refusals are logged once per reason, not once
/// per request, a client's long value is cut in the log, and transcripts are not logged unless
/// asked for.
#[test]
fn new_sessions_are_rate_limited_and_the_log_is_not_amplified() {
    let server = Server::start(
        "max_sessions: 4\nlimits:\n  session_burst_per_ip: 5\n  sessions_per_minute_per_ip: 6\n",
        240,
    );
    let url = server.url();
    let long = "x".repeat(60_000);
    let mut refused = 0;
    for i in 0..12 {
        let q = if i % 2 == 0 {
            format!("voice_prompt={long}")
        } else {
            "text_temperature=lots".to_string()
        };
        let r = client(&url, &["--mode", "web", "--query", &q, "--silent", "0.1"]);
        if r["refused"]["status"] == 429 {
            refused += 1;
            assert!(r["refused"]["retry_after"].is_string(), "{r}");
        }
    }
    assert!((6..=7).contains(&refused), "{refused} of 12 refused");
    let m = server.metrics();
    assert_eq!(
        metric_value_of(&m, "duplex_sessions_refused_total{reason=\"rate\"}"),
        refused as f64
    );
    let log = server.log();
    assert!(log.len() < 20_000, "{} bytes of log", log.len());
    assert_eq!(log.matches("too many new sessions").count(), 1, "{log}");
    assert!(!log.contains(&"x".repeat(100)), "a client's value in full");
    assert!(!log.contains("transcript"), "{log}");
}

/// Transcripts are private: off by default (above), escaped when the operator turns them on.
#[test]
fn transcripts_are_logged_only_when_asked_and_escaped() {
    // A hot text temperature: the tiny model's random weights then say something.
    let server = Server::start(
        "log_transcripts: true\nsampling:\n  text_temperature: 4\n",
        240,
    );
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 6.0, 200.0);
    // Each session draws with a fresh seed, and the random tiny model says nothing printable
    // in some of them (its top 25 text tokens can all lie outside the tiny tokenizer's 400
    // pieces): up to six sessions, until one has said something (three in a row said nothing
    // once in a few dozen runs).
    let mut said = serde_json::Value::Null;
    for _ in 0..6 {
        let r = client(
            &server.url(),
            &[
                "--mode",
                "kyutai",
                "--wav",
                wav.to_str().unwrap(),
                "--tail",
                "1",
            ],
        );
        said = r;
        if !said["text"].as_array().unwrap().is_empty() {
            break;
        }
    }
    assert!(!said["text"].as_array().unwrap().is_empty(), "{said}");
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains("transcript="))
        .unwrap_or_else(|| panic!("no transcript logged:\n{log}"));
    assert!(line.contains("transcript=\""), "not escaped: {line}");
}

/// Defect 7 outside the server: `duplex validate` of a pipeline whose voice prompt is 1 MB of
/// 50 Hz audio took 53 s and 1.04 GB before refusing; a voice is now checked from its header,
/// before anything is decoded or resampled, and a long one is refused on `max_voice_s`.
#[test]
fn a_voice_prompt_is_checked_from_its_header_before_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let root = daemon::root();
    let text = std::fs::read_to_string(root.join("pipelines/duplex-file.yaml"))
        .unwrap()
        .replace("models/", &format!("{}/models/", root.display()))
        .replace("out/", &format!("{}/", dir.path().display()));
    write_wav(&dir.path().join("tone-48k.wav"), 48_000, 1.0);
    for (voice, rate, seconds, extra, expect) in [
        (
            "low.wav",
            50,
            10_000.0,
            "",
            "50 Hz; a voice prompt needs 8000 Hz or more",
        ),
        (
            "long.wav",
            8000,
            20.0,
            "    max_voice_s: 10\n",
            "a voice prompt may last 10 s at most",
        ),
    ] {
        write_wav(&dir.path().join(voice), rate, seconds);
        let p = dir.path().join(format!("{voice}.yaml"));
        let t = text.replace(
            "  temporal:\n    kind: temporal\n",
            &format!(
                "  temporal:\n    kind: temporal\n    voice: {}\n{extra}",
                dir.path().join(voice).display()
            ),
        );
        std::fs::write(&p, t).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
            .arg("validate")
            .arg(&p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{voice}: {err}");
        assert!(
            err.contains(expect) && err.contains("voice"),
            "{voice}: {err}"
        );
    }
}

/// The second probe's rows 1 and 2: what a client sends is paid for from its encoded size
/// before anything is decoded or resampled, on every transport that converts its audio.
/// Twilio's `media` before `start` (one client with three connections went to 3.65 GB in 12 s)
/// is dropped undecoded and the connection closed at the handshake limit; G.711 and PCM16
/// faster than real time (97 % of a core for one G.711 client) are dropped undecoded beyond
/// real time plus the catch-up: the audio a session takes in is at most its wall time plus the
/// catch-up, whatever comes.
#[test]
fn every_transport_pays_for_audio_before_decoding_it() {
    let (server, healthy, base, url) =
        with_healthy_session("max_sessions: 4\nlimits:\n  handshake_timeout_s: 4\n", 40.0);
    let twilio = url.replace("/api/chat", "/twilio/media");
    let realtime = url.replace("/api/chat", "/v1/realtime");
    let refused = || {
        metric_value_of(
            &server.metrics(),
            "duplex_session_input_refused_frames_total",
        )
    };
    let early = || {
        metric_value_of(
            &server.metrics(),
            "duplex_session_protocol_errors_total{kind=\"early_audio\"}",
        )
    };
    // The healthy session alone, for the CPU figures below.
    let c0 = server.cpu_seconds();
    std::thread::sleep(std::time::Duration::from_secs(4));
    println!(
        "the healthy session alone: server CPU {:.2} s in 4 s",
        server.cpu_seconds() - c0
    );
    // No `start`: a megabyte of base64 μ-law 25 times a second, on three connections at once
    // (the probe's three took the server from 170 MB to 3,654 MB).
    let c0 = server.cpu_seconds();
    let attackers: Vec<_> = (0..3)
        .map(|_| {
            let u = twilio.clone();
            std::thread::spawn(move || {
                hostile(
                    &u,
                    &[
                        "--attack",
                        "twilio",
                        "--no-start",
                        "--size",
                        "750000",
                        "--rate",
                        "25",
                        "--hold",
                        "8",
                    ],
                )
            })
        })
        .collect();
    let results: Vec<serde_json::Value> =
        attackers.into_iter().map(|a| a.join().unwrap()).collect();
    let cpu = server.cpu_seconds() - c0;
    let grown = grown_mib(&server, base);
    let sent: f64 = results.iter().map(|r| r["sent"].as_f64().unwrap()).sum();
    println!(
        "twilio without start, three connections: {sent} messages of 1 MB, each closed {:?} \
         after {:?} s; {} dropped undecoded; server CPU {cpu:.2} s (the healthy session's \
         included); peak growth {grown} MiB",
        results
            .iter()
            .map(|r| r["close_code"].clone())
            .collect::<Vec<_>>(),
        results
            .iter()
            .map(|r| r["closed_after_s"].as_f64().unwrap_or(-1.0))
            .collect::<Vec<_>>(),
        early()
    );
    for r in &results {
        assert_eq!(r["close_code"], 1008, "{r}");
        assert!(r["closed_after_s"].as_f64().unwrap() < 7.5, "{r}");
    }
    assert!(early() >= sent / 2.0, "{results:?}");
    assert!(grown < ATTACK_BOUND_MIB, "{grown} MiB");
    // Sessions that start, then send far faster than real time: megabyte messages, then
    // one-second chunks twenty times a second.
    let cases: [(&str, &str, u64, &[&str]); 6] = [
        (
            "twilio, 1 MB",
            &twilio,
            8000,
            &["--attack", "twilio", "--size", "750000", "--rate", "25"],
        ),
        (
            "twilio, 20x",
            &twilio,
            8000,
            &["--attack", "twilio", "--size", "8000", "--rate", "20"],
        ),
        (
            "realtime g711_ulaw, 1 MB",
            &realtime,
            8000,
            &[
                "--attack",
                "realtime",
                "--format",
                "g711_ulaw",
                "--size",
                "750000",
                "--rate",
                "25",
            ],
        ),
        (
            "realtime g711_alaw, 20x",
            &realtime,
            8000,
            &[
                "--attack",
                "realtime",
                "--format",
                "g711_alaw",
                "--size",
                "8000",
                "--rate",
                "20",
            ],
        ),
        (
            "realtime pcm16, 1 MB",
            &realtime,
            48000,
            &[
                "--attack", "realtime", "--format", "pcm16", "--size", "750000", "--rate", "25",
            ],
        ),
        (
            "realtime pcm16, 20x",
            &realtime,
            48000,
            &[
                "--attack", "realtime", "--format", "pcm16", "--size", "48000", "--rate", "20",
            ],
        ),
    ];
    for (name, url, per_s, args) in cases {
        let before = refused();
        let c0 = server.cpu_seconds();
        let mut a = args.to_vec();
        a.extend(["--hold", "5"]);
        let r = hostile(url, &a);
        let cpu = server.cpu_seconds() - c0;
        let sent_s = r["audio_bytes"].as_f64().unwrap() / per_s as f64;
        let refused_s = (refused() - before) * 0.08;
        let wall = r["sent_for_s"].as_f64().unwrap();
        let taken = sent_s - refused_s;
        println!(
            "{name}: {sent_s:.0} s of audio sent in {wall:.1} s, {refused_s:.1} s dropped \
             undecoded, {taken:.1} s taken; server CPU {cpu:.2} s in those {wall:.1} s (the \
             healthy session's included); peak growth {} MiB",
            grown_mib(&server, base)
        );
        assert!(
            taken <= wall + 1.6,
            "{name}: {taken:.1} s taken in {wall:.1} s: {r}"
        );
        assert!(
            refused_s > 0.5 * sent_s - wall,
            "{name}: {refused_s:.1} s of {sent_s:.0} s dropped"
        );
    }
    let h = healthy.join().unwrap();
    assert_healthy(&h, 40.0);
    let grown = grown_mib(&server, base);
    assert!(grown < ATTACK_BOUND_MIB, "{grown} MiB");
    let log = server.log();
    assert!(log.contains("dropped undecoded"), "{log}");
}

/// Rows 5, 9 and 12, and the doors the probe did not reach: a connection that is not a
/// conversation yet (Twilio before `start`, the realtime API before its first audio), or a
/// request whose head or offer comes a byte a second, is closed at
/// `limits.handshake_timeout_s`, and only
/// audio keeps a call from its idle limit (a `mark` every 5 s held a slot for good); an error
/// repeats a client's `event_id` cut short and always answers (a 100 KB one was echoed whole,
/// a 1 MB one got nothing); a text frame that is not UTF-8 closes with 1007 (it was 1005).
#[test]
fn handshakes_time_out_only_audio_keeps_a_call_and_replies_stay_short() {
    let server = Server::start(
        "max_sessions: 4\nlimits:\n  handshake_timeout_s: 3\n  idle_timeout_s: 4\n",
        240,
    );
    let url = server.url();
    let twilio = url.replace("/api/chat", "/twilio/media");
    let realtime = url.replace("/api/chat", "/v1/realtime");
    for (name, url, args) in [
        ("twilio marks before start", &twilio, vec!["--no-start"]),
        ("twilio marks after start", &twilio, vec![]),
        ("realtime updates only", &realtime, vec![]),
    ] {
        let mut a = vec![
            "--attack",
            name.split(' ').next().unwrap(),
            "--marks",
            "--every",
            "1",
            "--hold",
            "15",
        ];
        a.extend(args);
        let r = hostile(url, &a);
        println!("{name}: {r}");
        let after = r["closed_after_s"].as_f64().unwrap_or(f64::MAX);
        assert!(after < 10.0, "{name}: held past the limits: {r}");
        assert_ne!(r["close_code"], 1005, "{name}: {r}");
    }
    server.wait_sessions(0, 20);
    let (code, _) = server.get("/readyz");
    assert_eq!(code, 200);
    for size in ["100000", "1000000"] {
        let r = hostile(&realtime, &["--attack", "event-id", "--size", size]);
        let reply = r["reply"].as_str().unwrap_or_default();
        println!(
            "event_id of {size} characters: a reply of {} bytes",
            r["reply_bytes"]
        );
        assert!(
            reply.contains("unknown_event") && reply.contains("eeee"),
            "{r}"
        );
        assert!(r["reply_bytes"].as_u64().unwrap() < 1000, "{r}");
    }
    // Slowloris: a request's head a byte a second on each door, and an offer's body so.
    for path in ["/v1/realtime", "/twilio/media", "/api/chat"] {
        let r = hostile(&url, &["--attack", "slow", "--path", path, "--hold", "20"]);
        println!("{path}, its head a byte a second: {r}");
        assert!(
            r["closed_after_s"].as_f64().is_some_and(|t| t < 10.0),
            "{path}: {r}"
        );
    }
    let r = hostile(
        &url,
        &[
            "--attack",
            "slow",
            "--path",
            "/api/webrtc",
            "--body",
            "4000",
            "--hold",
            "20",
        ],
    );
    println!("/api/webrtc, its offer a byte a second: {r}");
    assert_eq!(r["status"], 408, "{r}");
    assert!(
        r["closed_after_s"].as_f64().is_some_and(|t| t < 10.0),
        "{r}"
    );
    let r = hostile(&url, &["--attack", "bad-utf8"]);
    println!("a text frame that is not UTF-8: {r}");
    assert_eq!(r["close_code"], 1007, "{r}");
    let m = server.metrics();
    assert!(
        metric_value_of(
            &m,
            "duplex_session_protocol_errors_total{kind=\"bad_utf8\"}"
        ) >= 1.0
    );
}

/// WebRTC, the last transport of the memory and CPU property: an independent peer (aiortc)
/// whose microphone runs eight times faster than real time. Its packets overflow the jitter
/// buffer, whose re-anchoring then makes each one due on arrival; the peer's budget pays for
/// each packet's duration (from its table of contents) before it is decoded, so the session
/// decodes real time and the catch-up, the rest skipped undecoded and counted.
#[test]
fn a_webrtc_peer_faster_than_real_time_costs_real_time() {
    let (server, healthy, base, url) = with_healthy_session("max_sessions: 4\n", 16.0);
    let refused = || {
        metric_value_of(
            &server.metrics(),
            "duplex_session_input_refused_frames_total",
        )
    };
    let before = refused();
    let c0 = server.cpu_seconds();
    let u = url.clone();
    let attack = std::thread::spawn(move || {
        hostile(&u, &["--attack", "webrtc", "--speed", "8", "--hold", "8"])
    });
    // The WebRTC session's audio as its pipeline took it (decoded PCM16, 48,000 bytes a
    // second), and its age, as /api/sessions tells them while it lasts.
    let mut taken = (0.0f64, 0.0f64);
    while !attack.is_finished() {
        for s in server.sessions() {
            if s["transport"]["kind"] == "webrtc" {
                taken = (
                    s["bytes_in"].as_f64().unwrap() / 48_000.0,
                    s["age_s"].as_f64().unwrap(),
                );
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let r = attack.join().unwrap();
    let cpu = server.cpu_seconds() - c0;
    assert_eq!(r["status"], 201, "{r}");
    assert_eq!(r["state"], "connected", "{r}");
    let sent_s = r["frames"].as_f64().unwrap() * 0.02;
    let wall = r["sent_for_s"].as_f64().unwrap();
    let refused_s = (refused() - before) * 0.08;
    let grown = grown_mib(&server, base);
    let (decoded, age) = taken;
    println!(
        "webrtc at 8x: {sent_s:.1} s of audio sent in {wall:.1} s; the session took {decoded:.1} \
         s in its {age:.1} s, {refused_s:.1} s skipped undecoded; server CPU {cpu:.2} s (the \
         healthy session's included); peak growth {grown} MiB"
    );
    // Asked for 8x; on a loaded machine the peer gets less, and twice real time already says
    // what is asserted below.
    assert!(sent_s > 2.0 * wall, "the peer did not send fast: {r}");
    assert!(decoded > 1.0, "nothing was heard: {r}");
    assert!(decoded <= age + 1.5, "{decoded:.1} s decoded in {age:.1} s");
    assert!(refused_s > 1.0, "{refused_s:.1} s skipped");
    assert!(grown < ATTACK_BOUND_MIB, "{grown} MiB");
    let h = healthy.join().unwrap();
    assert_healthy(&h, 16.0);
}
