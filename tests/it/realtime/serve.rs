//! `duplex serve` on the Moshi protocol, against clients written on independent parts
//! (Kyutai's `sphn` for Ogg/Opus, `aiohttp` for the WebSocket): the two client behaviours,
//! greedy equality with `duplex replay`, concurrent sessions, admission, bad clients, drain.

use crate::support::daemon;
use crate::support::serve;

use std::time::{Duration, Instant};

use serve::wait::{wait_for, wait_until};
use serve::{assert_replay_matches, client, client_command, speech_wav, token_log, Server};

/// The session id the server gave the client that connected from `port`, from its log.
fn session_of(server: &Server, port: u64) -> u64 {
    let needle = format!("client=127.0.0.1:{port}");
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains("session started") && l.contains(&needle))
        .unwrap_or_else(|| panic!("no session for port {port} in\n{log}"));
    line.split("session=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap()
}

/// The pieces a session's token log holds, per frame.
fn pieces(log: &[serde_json::Value]) -> Vec<String> {
    log.iter()
        .map(|l| l["piece"].as_str().unwrap_or("").to_string())
        .collect()
}

/// The text a client received equals the session's logged pieces for every frame but the last
/// `slack` (processed after the client had gone).
fn assert_text_matches(received: &serde_json::Value, log: &[serde_json::Value], slack: usize) {
    let got: String = received["text"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let p = pieces(log);
    let all: String = p.concat();
    let most: String = p[..p.len().saturating_sub(slack)].concat();
    assert!(
        all.starts_with(&got) && got.len() >= most.len(),
        "received {got:?}, the log says {all:?}"
    );
}

#[test]
fn kyutai_and_web_clients_get_the_reply_and_the_transcript_the_session_logged() {
    // A hot text temperature: the tiny model's random weights then say something.
    let server = Server::start(
        "max_sessions: 2\nsampling:\n  text_temperature: 4\n",
        60_000,
    );
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 6.0, 220.0);
    let w = wav.to_str().unwrap().to_string();
    let url = server.url();
    let (u2, w2) = (url.clone(), w.clone());
    let web = std::thread::spawn(move || {
        client(
            &u2,
            &[
                "--mode",
                "web",
                "--query",
                "text_temperature=3.5&audio_topk=100&worker_auth_id=x",
                "--wav",
                &w2,
            ],
        )
    });
    let kyutai = client(&url, &["--mode", "kyutai", "--wav", &w]);
    let web = web.join().unwrap();
    let input = 6 * 24_000;
    for (name, r) in [("kyutai", &kyutai), ("web", &web)] {
        assert!(r["handshake_s"].is_number(), "{name}: no handshake: {r}");
        assert!(r["errors"].as_array().unwrap().is_empty(), "{name}: {r}");
        // Only the kinds the clients understand.
        for k in r["kinds"].as_object().unwrap().keys() {
            assert!(
                ["0", "1", "2", "4"].contains(&k.as_str()),
                "{name} got kind {k}"
            );
        }
        let samples = r["samples"].as_i64().unwrap();
        let id = session_of(&server, r["local_port"].as_u64().unwrap());
        let log = token_log(&server.session_dir(id).join("agent.jsonl"));
        // One agent frame per user frame; the last (partial) frame is only cut when the
        // stream ends, after the client has gone.
        let frames = log.len() as i64;
        assert!(
            (input / 1920 - 1..=input / 1920 + 1).contains(&frames),
            "{name}: {frames} frames"
        );
        let expect = input - 1920;
        assert!(
            (samples - expect).abs() <= 1920,
            "{name}: {samples} samples back for {input} in (expected {expect} ± 1920)"
        );
        eprintln!(
            "{name}: {samples} samples back, {frames} frames logged, text {}",
            r["text"]
        );
        assert_text_matches(r, &log, 2);
    }
    let m = server.metrics();
    assert!(
        m.contains("duplex_sessions_ended_total{outcome=\"client_closed\"} 2"),
        "{m}"
    );
}

/// A persona of the server's: forced while priming, in the primed state's key.
const PERSONA: &str = "You enjoy a good conversation.";

#[test]
fn greedy_sessions_give_the_tokens_replay_gives_on_the_same_user_codes() {
    let server = Server::start(
        &format!("text_prompt: \"{PERSONA}\"\nsampling:\n  text_temperature: 0\n  audio_temperature: 0\nrecord:\n  dir: recordings\n"),
        60_000,
    );
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 4.0, 180.0);
    let r = client(
        &server.url(),
        &["--mode", "kyutai", "--wav", wav.to_str().unwrap()],
    );
    let id = session_of(&server, r["local_port"].as_u64().unwrap());
    let dir = server.session_dir(id);
    // The session has fully ended (its logs are complete) once it is no longer listed.
    server.wait_sessions(0, 20);
    // Replayed with the priming stepped, one step per frame (the reference): the session's
    // chunked priming gave the same conversation.
    let tok = daemon::root().join("models/tokenizer-tiny.model");
    let persona = ["--persona", PERSONA, "--tokenizer", tok.to_str().unwrap()];
    let frames = assert_replay_matches(&dir, &server.dir.path().join("replay.jsonl"), &persona);
    assert!(frames >= 45, "{frames} frames");
    // A second session, another voice: its primed state is the first's, restored from the
    // process's cache (the default template's `priming: cached`); `/api/sessions` says so
    // while it runs, and its conversation is still the one stepped priming gives.
    let wav2 = server.dir.path().join("in2.wav");
    speech_wav(&wav2, 4.0, 240.0);
    let second = {
        let (url, w) = (server.url(), wav2.to_str().unwrap().to_string());
        std::thread::spawn(move || client(&url, &["--mode", "kyutai", "--wav", &w]))
    };
    let shown = wait_for(
        Duration::from_secs(30),
        "the session's priming listed",
        || {
            let first = server.sessions().first().cloned()?;
            Some(first["priming"].clone()).filter(|p| p["how"].is_string())
        },
    );
    assert_eq!(shown["how"], "cached", "{shown}");
    assert!(shown["ms"].as_i64().is_some(), "{shown}");
    let r2 = second.join().unwrap();
    assert!(r2["errors"].as_array().unwrap().is_empty(), "{r2}");
    server.wait_sessions(0, 20);
    let id2 = session_of(&server, r2["local_port"].as_u64().unwrap());
    let out2 = server.dir.path().join("replay2.jsonl");
    let frames2 = assert_replay_matches(&server.session_dir(id2), &out2, &persona);
    assert!(frames2 >= 45, "{frames2} frames");
    let m = server.metrics();
    let value = |name: &str, label: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with(name) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    // Computed once, by the server's priming at start (`prime_at_start`); both sessions
    // restored it.
    for (name, label, n) in [
        ("duplex_prime_cache_total", "result=\"miss\"", 1.0),
        ("duplex_priming_seconds_count", "how=\"chunked\"", 1.0),
        ("duplex_prime_cache_total", "result=\"hit\"", 2.0),
        ("duplex_priming_seconds_count", "how=\"cached\"", 2.0),
    ] {
        assert_eq!(value(name, label), n, "{name}{{{label}}}: {m}");
    }
    assert!(
        server
            .log()
            .contains("primed the default session's state at start"),
        "{}",
        server.log()
    );
    assert!(value("duplex_prime_cache_bytes", "") > 0.0, "{m}");
    // The session was recorded (`record.dir`): its recording replays to the same tokens.
    let recs = server.dir.path().join("recordings");
    let rec = std::fs::read_dir(&recs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_str().unwrap().ends_with(&format!("-s{id}")))
        .unwrap_or_else(|| panic!("no recording of session {id} in {}", recs.display()));
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["replay", "--recording"])
        .arg(&rec)
        .arg("--out")
        .arg(server.dir.path().join("replay-rec"))
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&st.stdout);
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    assert!(report.contains("graphs: the same"), "{report}");
    // The LM and the agent's decoder were replayed and compared, stage by stage.
    for stage in ["temporal", "depformer", "decode"] {
        assert!(report.contains(&format!("stage {stage} (")), "{report}");
    }
    let line = report
        .lines()
        .find(|l| l.starts_with("tokens: ") && l.ends_with(" steps identical"))
        .unwrap_or_else(|| panic!("{report}"));
    let n: Vec<usize> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(n[0] == n[1] && n[0] >= frames, "{report}");
}

#[test]
fn shared_engine_sessions_give_the_replay_tokens_and_its_slots_bound_admission() {
    // Every session's LM in the process's shared engine (the default template's), here with
    // two slots: the server admits two sessions although `max_sessions` allows three.
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    let text = serve::template(&dir.path().join("sessions"), 60_000).replace(
        "    kind: temporal\n    engine: shared\n",
        "    kind: temporal\n    engine: shared\n    slots: 2\n",
    );
    assert!(
        text.contains("slots: 2"),
        "the template's temporal stage moved"
    );
    std::fs::write(&tpl, text).unwrap();
    let server = Server::start_with(
        dir,
        "max_sessions: 3\nsampling:\n  text_temperature: 0\n  audio_temperature: 0\n",
        &tpl,
    );
    let (code, body) = server.get("/readyz");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["capacity"], 2, "{body}");
    let threads: Vec<_> = [170.0, 230.0]
        .iter()
        .enumerate()
        .map(|(i, pitch)| {
            let wav = server.dir.path().join(format!("in{i}.wav"));
            speech_wav(&wav, 5.0, *pitch);
            let url = server.url();
            std::thread::spawn(move || {
                client(&url, &["--mode", "kyutai", "--wav", wav.to_str().unwrap()])
            })
        })
        .collect();
    server.wait_sessions(2, 30);
    let refused = client(&server.url(), &["--silent", "1"]);
    assert_eq!(refused["refused"]["status"], 503, "{refused}");
    let results: Vec<serde_json::Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    server.wait_sessions(0, 20);
    for r in &results {
        assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
        let id = session_of(&server, r["local_port"].as_u64().unwrap());
        let dir = server.session_dir(id);
        let out = server.dir.path().join(format!("replay-{id}.jsonl"));
        // Replayed alone, on graphs of its own.
        let frames = assert_replay_matches(&dir, &out, &["--engine", "own"]);
        assert!(frames >= 55, "session {id}: {frames} frames");
    }
    let m = server.metrics();
    assert_eq!(
        serve::metric_value_of(&m, "duplex_engine_slots"),
        2.0,
        "{m}"
    );
    assert_eq!(
        serve::metric_value_of(&m, "duplex_engine_slots_used"),
        0.0,
        "{m}"
    );
    assert_eq!(
        serve::metric_value_of(&m, "duplex_sessions_capacity"),
        2.0,
        "{m}"
    );
    assert!(
        // Frames stepped (the sessions' frames share ticks: the shared encoder lines them up).
        serve::metric_value_of(&m, "duplex_engine_batch_size_sum{engine=\"temporal\"}") >= 110.0,
        "{m}"
    );
    assert!(
        m.contains("duplex_engine_tick_seconds_bucket{engine=\"temporal\",context=\"0-374\""),
        "{m}"
    );
    // The codec was shared too (the default template's): one encoder and one decoder, a slot
    // per session the server admits, every frame of both sessions through them.
    for engine in ["codec_encoder", "codec_decoder"] {
        let series = |name: &str| format!("{name}{{engine=\"{engine}\"}}");
        assert_eq!(
            serve::metric_value_of(&m, &series("duplex_codec_engines_open")),
            1.0,
            "{m}"
        );
        assert_eq!(
            serve::metric_value_of(&m, &series("duplex_codec_slots")),
            3.0,
            "{m}"
        );
        assert_eq!(
            serve::metric_value_of(&m, &series("duplex_codec_slots_used")),
            0.0,
            "{m}"
        );
        assert!(
            serve::metric_value_of(&m, &series("duplex_engine_batch_size_sum")) >= 110.0,
            "{m}"
        );
    }
}

/// The sessions a server admits are bounded by the shared codec's slots as by the LM's: a
/// template whose encoder has 2 slots serves 2 sessions although `max_sessions` allows 5.
#[test]
fn the_shared_codecs_slots_bound_admission() {
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    let text = serve::template(&dir.path().join("sessions"), 60_000).replace(
        "    kind: mimi_encode\n    engine: shared\n",
        "    kind: mimi_encode\n    engine: shared\n    slots: 2\n",
    );
    assert!(text.contains("slots: 2"), "the template's encoder moved");
    std::fs::write(&tpl, text).unwrap();
    let cfg = dir.path().join("serve.yaml");
    std::fs::write(
        &cfg,
        format!(
            "address: \"127.0.0.1:0\"\npipeline: {}\nmax_sessions: 5\n",
            tpl.display()
        ),
    )
    .unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["serve", "--check", "--config", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("would serve 2 sessions"), "{out}\n{err}");
    assert!(
        err.contains("a shared engine or codec has fewer slots than `max_sessions`"),
        "{err}"
    );
}

/// Frames the framer → encoder edges dropped, summed over sessions.
fn dropped_frames(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("duplex_edge_dropped_total") && l.contains("framer"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn four_concurrent_sessions_keep_up_and_stay_independent() {
    // One seed for all: only the persona differs between sessions, so two sessions with the
    // same persona must agree token for token, whatever the others do.
    let server = Server::start(
        "max_sessions: 4\nsampling:\n  seed: 7\n  text_temperature: 4\n",
        60_000,
    );
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 6.0, 200.0);
    let w = wav.to_str().unwrap().to_string();
    let personas = [
        ("text_prompt=You+are+a+pirate.", "6"),
        ("text_prompt=You+are+a+pirate.", "6"),
        ("text_prompt=You+are+a+careful+librarian.", "6"),
        // Leaves after 2 s: the others must not notice.
        ("text_prompt=You+are+in+a+hurry.", "2"),
    ];
    let threads: Vec<_> = personas
        .iter()
        .map(|(q, secs)| {
            let (url, w, q, secs) = (server.url(), w.clone(), q.to_string(), secs.to_string());
            std::thread::spawn(move || {
                client(
                    &url,
                    &[
                        "--mode",
                        "web",
                        "--query",
                        &q,
                        "--wav",
                        &w,
                        "--seconds",
                        &secs,
                        // A player with a 500 ms buffer: real time, with room for noise.
                        "--playout-ms",
                        "500",
                    ],
                )
            })
        })
        .collect();
    let results: Vec<serde_json::Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    server.wait_sessions(0, 20);
    let logs: Vec<Vec<serde_json::Value>> = results
        .iter()
        .map(|r| {
            let id = session_of(&server, r["local_port"].as_u64().unwrap());
            token_log(&server.session_dir(id).join("agent.jsonl"))
        })
        .collect();
    let tokens = |l: &[serde_json::Value]| -> Vec<(serde_json::Value, serde_json::Value)> {
        l.iter()
            .take(70)
            .map(|f| (f["text"].clone(), f["audio"].clone()))
            .collect()
    };
    for (i, r) in results.iter().take(3).enumerate() {
        assert!(r["errors"].as_array().unwrap().is_empty(), "{i}: {r}");
        let samples = r["samples"].as_i64().unwrap();
        assert!(
            samples >= 6 * 24_000 - 2 * 1920,
            "session {i} fell behind: {samples} samples"
        );
        assert!(logs[i].len() >= 70, "session {i}: {} frames", logs[i].len());
        assert_eq!(r["underruns"], 0, "session {i} ran dry at the client: {r}");
    }
    assert_eq!(
        tokens(&logs[0]),
        tokens(&logs[1]),
        "same persona, same seed, same input"
    );
    assert_ne!(
        tokens(&logs[0]),
        tokens(&logs[2]),
        "another persona, another conversation"
    );
    assert!(
        logs[3].len() < 40,
        "the short session ran {} frames",
        logs[3].len()
    );
    let m = server.metrics();
    assert_eq!(dropped_frames(&m), 0.0, "a session lost frames:\n{m}");
    assert!(
        m.contains("duplex_sessions_ended_total{outcome=\"client_closed\"} 4"),
        "{m}"
    );
}

#[test]
fn admission_refuses_beyond_max_sessions_with_503_and_readyz_follows() {
    let server = Server::start(
        // The quiet connection must outlive a loaded machine's Python start-up.
        "max_sessions: 2\nmax_connections_per_ip: 3\nlimits:\n  idle_timeout_s: 60\n  handshake_timeout_s: 120\n",
        240,
    );
    assert_eq!(server.get("/readyz").0, 200);
    assert_eq!(server.get("/healthz").0, 200);
    // Two clients that hold their session (sending nothing: the server feeds silence).
    let holders: Vec<_> = [30.0, 30.0]
        .iter()
        .map(|s| {
            let mut c = client_command(&server.url(), &["--silent", &s.to_string(), "--tail", "0"]);
            c.spawn().unwrap()
        })
        .collect();
    server.wait_sessions(2, 20);
    // Two sessions and this request are the address's limit: a request right after another
    // may still find the previous connection counted for a moment, so wait that out.
    let settled = |path: &str| {
        let what = format!("{path} answered within the address's limit");
        wait_for(Duration::from_secs(20), &what, || {
            Some(server.get(path)).filter(|r| r.0 != 429)
        })
    };
    let (code, body) = settled("/readyz");
    assert_eq!(code, 503, "{body}");
    let refused = client(&server.url(), &["--silent", "1"]);
    assert_eq!(refused["refused"]["status"], 503, "{refused}");
    assert!(
        refused["refused"]["retry_after"].as_str().is_some(),
        "{refused}"
    );
    let m = settled("/metrics").1;
    assert!(
        m.contains("duplex_sessions_refused_total{reason=\"full\"} 1"),
        "{m}"
    );
    let (_, list) = settled("/api/sessions");
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    for s in v["sessions"].as_array().unwrap() {
        assert!(
            s["age_s"].as_f64().unwrap() > 0.0 && s["verdicts"].is_object(),
            "{s}"
        );
        assert!(s["silence_frames"].as_u64().is_some(), "{s}");
    }
    // Beyond the per-address limit (two sessions and a quiet connection make three), 429 for
    // any request, a session's or not.
    // No request of ours may still be counted when the quiet connection arrives: the server
    // counts the two sessions and the scrape that asks.
    wait_until(Duration::from_secs(20), "only the sessions counted", || {
        let m = settled("/metrics").1;
        serve::metric_value_of(&m, "duplex_connections_open") == 3.0
    });
    // A connection that arrives while one of our requests is still counted is over the limit
    // and not counted itself (it waits for a request that never comes): then another is made.
    // Counted, it makes every other request of the address a 429, three times in a row.
    let quiet = wait_for(
        Duration::from_secs(60),
        "a quiet connection counted",
        || {
            let q = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
            let mut in_a_row = 0;
            for _ in 0..40 {
                if server.get("/healthz").0 == 429 {
                    in_a_row += 1;
                    if in_a_row == 3 {
                        return Some(q);
                    }
                } else {
                    in_a_row = 0;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            None
        },
    );
    let over = client(&server.url(), &["--silent", "0.2"]);
    assert_eq!(over["refused"]["status"], 429, "{over}");
    drop(quiet);
    wait_until(
        Duration::from_secs(20),
        "the closed connection no longer counted",
        || server.get("/healthz").0 == 200,
    );
    // The last /healthz may still be counted for a moment: wait that out too.
    let m = settled("/metrics").1;
    assert!(
        serve::metric_value_of(&m, "duplex_sessions_refused_total{reason=\"per_ip\"}") >= 2.0,
        "{m}"
    );
    // The first holder leaves (killed: its connection drops): a slot is free again.
    let mut holders = holders;
    let _ = holders[0].kill();
    let _ = holders[0].wait();
    server.wait_sessions(1, 20);
    assert_eq!(server.get("/readyz").0, 200);
    let admitted = client(&server.url(), &["--silent", "0.5", "--tail", "0.5"]);
    assert!(admitted["handshake_s"].is_number(), "{admitted}");
    let _ = holders[1].kill();
    let _ = holders[1].wait();
}

#[test]
fn bad_clients_are_refused_alone_and_the_healthy_session_never_notices() {
    let server = Server::start(
        "max_sessions: 12\nmax_connections_per_ip: 400\nlimits:\n  idle_timeout_s: 2\n  stall_timeout_s: 2\n  handshake_timeout_s: 1\n",
        240,
    );
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 14.0, 210.0);
    let w = wav.to_str().unwrap().to_string();
    let url = server.url();
    let (u, w2) = (url.clone(), w.clone());
    let healthy = std::thread::spawn(move || client(&u, &["--mode", "kyutai", "--wav", &w2]));
    server.wait_sessions(1, 20);
    let rss0 = server.rss_kib();
    // 200 connections that never say anything.
    let idle: Vec<_> = (0..200)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap())
        .collect();

    let error_of = |r: &serde_json::Value| -> String {
        r["errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap().to_string())
            .collect()
    };
    // Garbage where the Ogg stream should be.
    let r = client(
        &url,
        &[
            "--send-raw",
            "01deadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeef",
            "--silent",
            "1",
        ],
    );
    assert!(error_of(&r).contains("not an Ogg stream"), "{r}");
    // A damaged page in the middle of a good stream.
    let r = client(
        &url,
        &[
            "--mode",
            "kyutai",
            "--wav",
            &w,
            "--seconds",
            "2",
            "--corrupt",
        ],
    );
    assert!(error_of(&r).contains("damaged Ogg page"), "{r}");
    // An Ogg stream of another codec.
    let r = client(&url, &["--vorbis", "--silent", "1"]);
    assert!(error_of(&r).contains("Vorbis"), "{r}");
    // An unknown kind is ignored: the session goes on.
    let r = client(
        &url,
        &[
            "--send-raw",
            "09aabb",
            "--mode",
            "kyutai",
            "--wav",
            &w,
            "--seconds",
            "1",
        ],
    );
    assert!(
        error_of(&r).is_empty() && r["samples"].as_i64().unwrap() > 0,
        "{r}"
    );
    // A truncated page, then gone.
    let r = client(&url, &["--truncate", "--tail", "0.3"]);
    assert!(r["handshake_s"].is_number(), "{r}");
    // 100 MB in one message: closed, never buffered.
    let r = client(&url, &["--send-size", "100000000", "--tail", "1"]);
    assert!(r["close_code"].as_i64().is_some(), "{r}");
    // Never sends: fed silence, then closed at the idle timeout.
    let r = client(&url, &["--silent", "6", "--tail", "0"]);
    assert_eq!(r["close_code"], 1000, "{r}");
    assert!(
        r["samples"].as_i64().unwrap() > 0,
        "the model's clock kept running: {r}"
    );
    // Never reads: closed once it has stalled for the stall timeout.
    let out = client_command(&url, &["--never-read", "20"])
        .output()
        .unwrap();
    let nr: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        nr["closed_after_s"].as_f64().is_some(),
        "a client that never reads was kept: {nr}"
    );
    // Killed mid-session.
    let admitted = || serve::metric_value_of(&server.metrics(), "duplex_sessions_admitted_total");
    let before = admitted();
    let mut doomed = client_command(&url, &["--mode", "kyutai", "--wav", &w, "--seconds", "5"])
        .spawn()
        .unwrap();
    // Mid-session: admitted, and a second into its conversation.
    wait_until(
        Duration::from_secs(30),
        "the doomed session a second in",
        || {
            admitted() > before
                && server
                    .sessions()
                    .iter()
                    .any(|s| s["age_s"].as_f64().is_some_and(|a| a >= 1.0))
        },
    );
    let _ = doomed.kill();
    let _ = doomed.wait();

    // The quiet connections were closed (they never sent a request), the healthy one was not.
    for mut c in idle.iter().take(3) {
        use std::io::Read;
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(
            c.read(&mut b).ok(),
            Some(0),
            "a connection that said nothing was kept"
        );
    }
    let h = healthy.join().unwrap();
    assert!(h["errors"].as_array().unwrap().is_empty(), "{h}");
    let samples = h["samples"].as_i64().unwrap();
    assert!(
        samples >= 14 * 24_000 - 2 * 1920,
        "the healthy session lost audio: {samples}"
    );
    drop(idle);
    server.wait_sessions(0, 20);
    let grown = server.rss_kib().saturating_sub(rss0);
    assert!(grown < 150 * 1024, "resident memory grew by {grown} KiB");
    let m = server.metrics();
    for needle in [
        "duplex_session_protocol_errors_total{kind=\"unknown_kind\"}",
        "duplex_session_protocol_errors_total{kind=\"too_large\"}",
        "duplex_session_client_stalls_total",
        "duplex_sessions_ended_total{outcome=\"idle\"}",
        "duplex_sessions_ended_total{outcome=\"failed\"}",
        "duplex_sessions_ended_total{outcome=\"stalled\"}",
        "duplex_connections_closed_total{reason=\"no_request\"} 2",
    ] {
        assert!(m.contains(needle), "{needle} not counted:\n{m}");
    }
    // Each case is logged once, not once per message.
    let log = server.log();
    assert_eq!(log.matches("unknown kind").count(), 1, "{log}");
    assert_eq!(log.matches("sent no request").count(), 1, "{log}");
}

#[test]
fn sigterm_drains_live_sessions_then_exits_0() {
    let mut server = Server::start("max_sessions: 4\ndrain_timeout_s: 2\n", 240);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 20.0, 190.0);
    let w = wav.to_str().unwrap().to_string();
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let (u, w) = (server.url(), w.clone());
            std::thread::spawn(move || {
                client(&u, &["--mode", "kyutai", "--wav", &w, "--tail", "0"])
            })
        })
        .collect();
    server.wait_sessions_aged(2, 0.5, 20);
    let t0 = Instant::now();
    server.signal("TERM");
    wait_until(Duration::from_secs(10), "not ready while draining", || {
        server.get("/readyz").0 == 503
    });
    let refused = client(&server.url(), &["--silent", "1"]);
    assert_eq!(refused["refused"]["status"], 503, "{refused}");
    let status = server
        .wait_exit(Duration::from_secs(20))
        .expect("exits after the drain");
    assert!(status.success(), "{status:?}");
    let took = t0.elapsed();
    for c in clients {
        let r = c.join().unwrap();
        assert_eq!(r["close_code"], 1001, "closed cleanly by the server: {r}");
        assert!(r["samples"].as_i64().unwrap() > 24_000, "{r}");
    }
    assert!(
        took >= Duration::from_secs(2),
        "closed before drain_timeout: {took:?}"
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("draining"), "{log}");
}

/// `duplex serve` with `args`, in `dir`: (exit code, stdout, stderr).
fn serve_cmd(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
        .arg("serve")
        .args(args)
        .current_dir(dir)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_validates_everything_and_bad_settings_name_their_file_key_or_variable() {
    let root = daemon::root();
    let (code, out, err) = serve_cmd(root, &["--check"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("ok: "), "{out}");

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("serve.yaml");
    let tpl = root.join("pipelines/serve.yaml");
    let write = |extra: &str| {
        std::fs::write(&cfg, format!("pipeline: {}\n{extra}", tpl.display())).unwrap();
    };
    let c = cfg.to_str().unwrap();
    let check = |env: &[(&str, &str)]| serve_cmd(root, &["--config", c, "--check"], env);

    write("max_sesions: 3\n");
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(c) && err.contains("max_sesions") && err.contains("max_sessions"),
        "{err}"
    );

    write("");
    let (code, _, err) = check(&[("DUPLEX__LIMITS__IDLE_TIMEOUT_S", "soon")]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("DUPLEX__LIMITS__IDLE_TIMEOUT_S"), "{err}");

    write("pack: /nonexistent/pack\n");
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("/nonexistent/pack") && err.contains("`pack`"),
        "{err}"
    );

    write("voice_prompt: ../secret.wav\n");
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("voice_prompt"), "{err}");

    write("record:\n  dir: /proc/no/recordings\n");
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("{c}: `record.dir`: /proc/no/recordings: ")),
        "{err}"
    );

    // A template that is not a session's.
    std::fs::write(
        &cfg,
        format!(
            "pipeline: {}\n",
            root.join("pipelines/make-tone.yaml").display()
        ),
    )
    .unwrap();
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("session_in"), "{err}");

    // A template stage with a bad value names the template and the stage.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&tpl)
            .unwrap()
            .replace("kind: opus_encode", "kind: opus_encode\n    bitrate: -5")
            .replace("models/", &format!("{}/models/", root.display())),
    )
    .unwrap();
    std::fs::write(&cfg, format!("pipeline: {}\n", bad.display())).unwrap();
    let (code, _, err) = check(&[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("bad.yaml") && err.contains("opus_out") && err.contains("bitrate"),
        "{err}"
    );

    // A busy address is a run-time failure (exit 1) that names it.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    write(&format!("address: \"{addr}\"\n"));
    let (code, _, err) = serve_cmd(root, &["--config", c], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&addr) && err.contains("address"), "{err}");
}

#[test]
fn a_voice_prompt_names_a_file_of_the_voices_folder_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let voices = dir.path().join("voices");
    std::fs::create_dir(&voices).unwrap();
    speech_wav(&voices.join("calm.wav"), 1.0, 150.0);
    let server = Server::start(&format!("voices: {}\n", voices.display()), 240);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 1.0, 200.0);
    let w = wav.to_str().unwrap();
    let r = client(
        &server.url(),
        &[
            "--mode",
            "web",
            "--query",
            "voice_prompt=calm.wav",
            "--wav",
            w,
        ],
    );
    assert!(
        r["handshake_s"].is_number() && r["samples"].as_i64().unwrap() > 0,
        "{r}"
    );
    // Primed with the voice: 12 frames of it besides the usual warm-up and spacers.
    let log = server.log();
    let steps: Vec<u64> = log
        .lines()
        .filter_map(|l| {
            l.split("primed steps=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect();
    // The server's own priming at start (the defaults: no voice), then the client's.
    assert_eq!(steps.len(), 2, "{log}");
    assert_eq!(steps[1], steps[0] + 12, "{log}");
    for bad in ["missing.wav", "../voices/calm.wav", "%2Fetc%2Fpasswd"] {
        let r = client(
            &server.url(),
            &[
                "--mode",
                "web",
                "--query",
                &format!("voice_prompt={bad}"),
                "--wav",
                w,
            ],
        );
        let errors = r["errors"].to_string();
        assert!(errors.contains("voice prompt"), "{bad}: {r}");
        // The handshake comes first in every session (docs/PROTOCOL.md), then the error: no audio.
        assert_eq!(r["first_kind"], 0, "{bad}: {r}");
        assert_eq!(r["samples"], 0, "{bad}: a session started: {r}");
    }
}
