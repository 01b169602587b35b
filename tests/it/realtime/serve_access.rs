//! Kyutai's protocol exactly, and only those who belong: the handshake is every session's first
//! message, the metadata after it has the shape Kyutai's web client validates, keys are asked
//! for at the HTTP edge (header, `auth_id`, bearer), browser origins are checked, a public
//! address without keys is refused at start, and a reverse proxy's forwarded address is
//! believed only from a trusted proxy. Clients are independent (`aiohttp` + `sphn`, raw HTTP).

use crate::support::daemon;
use crate::support::serve;

use serve::{client, metric_value_of, speech_wav, Server};

/// Kyutai's web client's `ServerInfo` schema (`useServerInfo.ts`), as a list of fields and
/// their JSON types: a metadata message that lacks one, or has one of another type, shows no
/// server info there and logs a console error.
fn assert_kyutai_server_info(meta: &serde_json::Value) {
    let numbers = [
        "text_temperature",
        "text_topk",
        "audio_temperature",
        "audio_topk",
        "pad_mult",
        "repetition_penalty_context",
        "repetition_penalty",
    ];
    for n in numbers {
        assert!(meta[n].is_number(), "{n} is not a number: {meta}");
    }
    for s in ["lm_model_file", "instance_name"] {
        assert!(meta[s].is_string(), "{s} is not a string: {meta}");
    }
    let build = &meta["build_info"];
    for s in [
        "build_timestamp",
        "build_date",
        "git_branch",
        "git_timestamp",
        "git_date",
        "git_hash",
        "git_describe",
        "rustc_host_triple",
        "rustc_version",
        "cargo_target_triple",
    ] {
        assert!(
            build[s].as_str().is_some_and(|v| !v.is_empty()),
            "build_info.{s}: {meta}"
        );
    }
}

/// Every session's first message is the handshake: a client with no query (Kyutai's Python
/// client), a web-like client, one whose session primes for a while, and one whose query is
/// refused (the handshake, then the error). The metadata comes after it, in Kyutai's shape,
/// with the session's own sampling.
#[test]
fn the_handshake_comes_first_then_kyutais_server_info() {
    let dir = tempfile::tempdir().unwrap();
    let tpl = dir.path().join("session.yaml");
    // Each priming step 5 ms slower: a session that primes for a while, as a real model's does.
    let text = serve::template(&dir.path().join("sessions"), 240).replace(
        "    kind: depformer\n",
        "    kind: depformer\n    inject_delay: { mode: bimodal, base_ms: 5, jitter_ms: 0, slow_fraction: 0 }\n",
    );
    std::fs::write(&tpl, text).unwrap();
    let server = Server::start_with(dir, "instance_name: test-box\nmax_sessions: 2\n", &tpl);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 2.0, 200.0);
    let w = wav.to_str().unwrap();
    let url = server.url();
    let persona = "You are a calm assistant. ".repeat(8).replace(' ', "+");
    for (name, args) in [
        ("no query", vec!["--mode", "kyutai", "--wav", w]),
        (
            "web",
            vec![
                "--mode",
                "web",
                "--query",
                "text_temperature=0.5&pad_mult=1.5&repetition_penalty=1.2&repetition_penalty_context=32&text_seed=7&audio_seed=8",
                "--wav",
                w,
            ],
        ),
        (
            "slow priming",
            vec![
                "--mode",
                "web",
                "--query",
                &format!("text_prompt={persona}"),
                "--wav",
                w,
            ],
        ),
    ] {
        let r = client(&url, &args);
        assert_eq!(r["first_kind"], 0, "{name}: {r}");
        let meta = &r["metadata"];
        assert_kyutai_server_info(meta);
        assert_eq!(meta["instance_name"], "test-box", "{name}");
        assert_eq!(meta["server"], "duplex");
        assert!(meta["session"].is_u64(), "{meta}");
        assert!(
            meta["lm_model_file"]
                .as_str()
                .unwrap()
                .ends_with("tiny-gqa/temporal/model.onnx"),
            "{meta}"
        );
        assert!(r["samples"].as_i64().unwrap() > 0, "{name}: {r}");
        if name == "web" {
            assert_eq!(meta["text_temperature"], 0.5);
            assert_eq!(meta["pad_mult"], 1.5);
            assert_eq!(meta["repetition_penalty"], 1.2);
            assert_eq!(meta["repetition_penalty_context"], 32);
            assert_eq!(meta["text_seed"], 7);
            assert_eq!(meta["audio_seed"], 8);
        }
    }
    // max_steps ends the conversation cleanly at the cap: close 1000 with a reason, and the
    // session's token log holds exactly that many agent frames.
    let long = server.dir.path().join("long.wav");
    speech_wav(&long, 5.0, 200.0);
    let r = client(
        &url,
        &[
            "--mode",
            "web",
            "--query",
            "max_steps=20",
            "--wav",
            long.to_str().unwrap(),
        ],
    );
    assert_eq!(r["close_code"], 1000, "{r}");
    let id = r["metadata"]["session"].as_u64().unwrap();
    assert_eq!(r["metadata"]["max_steps"], 20);
    let frames = serve::token_log(&server.session_dir(id).join("agent.jsonl")).len();
    assert_eq!(frames, 20, "session {id}");
    // A refused parameter: the handshake first all the same, then the error naming it.
    let r = client(
        &url,
        &["--mode", "web", "--query", "pad_mult=99", "--silent", "0.5"],
    );
    assert_eq!(r["first_kind"], 0, "{r}");
    let e = r["errors"].to_string();
    assert!(e.contains("pad_mult") && e.contains("out of range"), "{r}");
}

fn keys_server(extra: &str) -> (Server, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.txt");
    serve::write_keys(
        &keys,
        "# test keys\nalpha-key-0123456789abcdef name=alice sessions=1\n\
         sha256:0b8dfdb9f1a0e5be79a6e5d6fef3f4e1d4c8a8c4b6a3ff2c8d7a1e3b5c9d2f4a name=hashed\n",
    );
    let logs = dir.path().join("sessions");
    let tpl = dir.path().join("session.yaml");
    std::fs::write(&tpl, serve::template(&logs, 240)).unwrap();
    let server = Server::start_with(
        dir,
        &format!("keys_file: {}\nmax_sessions: 4\n{extra}", keys.display()),
        &tpl,
    );
    (server, keys)
}

/// Keys at the edge: none or a wrong one is 401 before the upgrade (counted by reason), the
/// right one by header, `auth_id` or bearer is let in, a key at its session limit gets 429,
/// `/metrics` and the API need one while `/healthz`, `/readyz` and the page do not, a foreign
/// page's origin gets 403, and no key appears in the log.
#[test]
fn keys_origins_and_limits_at_the_http_edge() {
    let (mut server, _) = keys_server("allowed_origins: [\"https://app.example.com\"]\n");
    let key = "alpha-key-0123456789abcdef";
    server.key = Some(key.to_string());
    let url = server.url();
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 1.0, 200.0);
    let w = wav.to_str().unwrap();
    let status = |args: &[&str]| -> serde_json::Value {
        let r = client(&url, args);
        r["refused"]["status"].clone()
    };
    assert_eq!(status(&["--silent", "0.1"]), 401);
    assert_eq!(
        status(&[
            "--header",
            "kyutai-api-key:wrong-key-0123456789",
            "--silent",
            "0.1"
        ]),
        401
    );
    for how in [
        vec!["--header", &format!("kyutai-api-key:{key}")],
        vec!["--header", &format!("Authorization:Bearer {key}")],
        vec!["--mode", "web", "--query"],
    ] {
        let mut args: Vec<String> = how.iter().map(|s| s.to_string()).collect();
        if args.last().map(String::as_str) == Some("--query") {
            args.push(format!("auth_id={key}"));
        } else {
            args.extend(["--mode", "kyutai"].map(String::from));
        }
        args.extend(["--wav", w].map(String::from));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = client(&url, &a);
        assert!(r["refused"].is_null(), "{how:?}: {r}");
        assert_eq!(r["first_kind"], 0, "{how:?}: {r}");
    }
    // alice holds one session at most: a second while the first runs gets 429.
    let u = url.clone();
    let k = key.to_string();
    let long = server.dir.path().join("long.wav");
    speech_wav(&long, 6.0, 200.0);
    let l = long.to_str().unwrap().to_string();
    let first = std::thread::spawn(move || {
        client(
            &u,
            &[
                "--header",
                &format!("kyutai-api-key:{k}"),
                "--mode",
                "kyutai",
                "--wav",
                &l,
            ],
        )
    });
    server.wait_sessions(1, 20);
    // /api/sessions needs the key too, and then shows the client and the key's name.
    let (code, _, _) = server.request("GET /api/sessions HTTP/1.1\r\nHost: localhost");
    assert_eq!(code, 401);
    let (code, _, body) = server.request(&format!(
        "GET /api/sessions HTTP/1.1\r\nHost: localhost\r\nkyutai-api-key: {key}"
    ));
    assert_eq!(code, 200);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["sessions"][0]["key"], "alice", "{v}");
    assert!(v["sessions"][0]["client"]
        .as_str()
        .unwrap()
        .starts_with("127.0.0.1:"));
    assert_eq!(
        status(&[
            "--header",
            &format!("kyutai-api-key:{key}"),
            "--silent",
            "0.1"
        ]),
        429
    );
    assert!(first.join().unwrap()["refused"].is_null());

    // A page of another site may not open sessions here, even with a key; the listed one may.
    let with_key = format!("kyutai-api-key:{key}");
    assert_eq!(
        status(&[
            "--header",
            &with_key,
            "--origin",
            "https://evil.example",
            "--silent",
            "0.1"
        ]),
        403
    );
    for origin in [
        "https://app.example.com",
        &format!("http://127.0.0.1:{}", server.port),
    ] {
        let r = client(
            &url,
            &[
                "--header", &with_key, "--origin", origin, "--mode", "kyutai", "--wav", w,
            ],
        );
        assert!(r["refused"].is_null(), "{origin}: {r}");
    }

    // What stays open, and what does not.
    for (path, expect) in [
        ("/healthz", 200),
        ("/readyz", 200),
        ("/", 200),
        ("/metrics", 401),
        ("/api/defaults", 401),
        ("/api/voices", 401),
    ] {
        let (code, _, _) = server.request(&format!("GET {path} HTTP/1.1\r\nHost: localhost"));
        assert_eq!(code, expect, "{path}");
    }
    let (code, _, m) = server.request(&format!(
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}"
    ));
    assert_eq!(code, 200);
    assert!(
        metric_value_of(
            &m,
            "duplex_http_requests_refused_total{reason=\"missing_key\"}"
        ) >= 5.0,
        "{m}"
    );
    assert!(
        metric_value_of(
            &m,
            "duplex_http_requests_refused_total{reason=\"unknown_key\"}"
        ) >= 1.0
    );
    assert!(metric_value_of(&m, "duplex_http_requests_refused_total{reason=\"origin\"}") >= 1.0);
    assert!(metric_value_of(&m, "duplex_sessions_refused_total{reason=\"key_limit\"}") >= 1.0);
    let log = server.log();
    for secret in [key, "wrong-key-0123456789"] {
        assert!(!log.contains(secret), "a key is in the log");
    }
}

/// With no keys, a loopback server is open as before; any other address is refused at start
/// (exit 2 naming the setting) unless `allow_anonymous: true` says so.
#[test]
fn a_public_address_without_keys_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("serve.yaml");
    let template = daemon::root().join("pipelines/serve.yaml");
    for (extra, code) in [("", 2), ("allow_anonymous: true\n", 0)] {
        std::fs::write(
            &cfg,
            format!(
                "address: \"0.0.0.0:0\"\npipeline: {}\n{extra}",
                template.display()
            ),
        )
        .unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["serve", "--check", "--config"])
            .arg(&cfg)
            .current_dir(daemon::root())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{extra}: {err}");
        if code == 2 {
            assert!(
                err.contains("address")
                    && err.contains("allow_anonymous")
                    && err.contains("keys_file"),
                "{err}"
            );
        }
    }
}

/// Behind a reverse proxy: `X-Forwarded-For` (the header `forwarded_header` names) is believed
/// only from `trusted_proxies`, so the per-address limits and `/api/sessions` see the real
/// client; from anyone else it is ignored, and so is a header the proxy does not write.
#[test]
fn forwarded_addresses_are_believed_only_from_trusted_proxies() {
    let server = Server::start(
        "trusted_proxies: [\"127.0.0.1\"]\nmax_sessions: 8\nlimits:\n  session_burst_per_ip: 2\n  sessions_per_minute_per_ip: 1\n",
        240,
    );
    let url = server.url();
    let from = |ip: &str| -> serde_json::Value {
        client(
            &url,
            &[
                "--header",
                &format!("X-Forwarded-For:198.51.100.1, {ip}"),
                "--silent",
                "0.1",
            ],
        )
    };
    assert!(from("203.0.113.5")["refused"].is_null());
    assert!(from("203.0.113.5")["refused"].is_null());
    // Its allowance is spent; another client behind the same proxy still has its own.
    assert_eq!(from("203.0.113.5")["refused"]["status"], 429);
    assert!(from("203.0.113.6")["refused"].is_null());
    // IPv6 clients count by their /64.
    assert!(from("2001:db8:1:2::1")["refused"].is_null());
    assert!(from("2001:db8:1:2::2")["refused"].is_null());
    assert_eq!(from("2001:db8:1:2::3")["refused"]["status"], 429);
    // A client's own `Forwarded` is passed through by nginx and Caddy, which write only
    // `X-Forwarded-For`: never read (the second probe's row 3: seven of seven sessions were
    // admitted where the burst allowed two, each with a forged address).
    let forged = |n: u32| -> serde_json::Value {
        client(
            &url,
            &[
                "--header",
                &format!("Forwarded:for=192.0.2.{n}"),
                "--header",
                "X-Forwarded-For:203.0.113.7",
                "--silent",
                "0.1",
            ],
        )
    };
    let statuses: Vec<serde_json::Value> = (1..=5)
        .map(|n| forged(n)["refused"]["status"].clone())
        .collect();
    println!("five sessions with forged Forwarded addresses: {statuses:?}");
    assert!(statuses[..2].iter().all(|s| s.is_null()), "{statuses:?}");
    assert!(statuses[2..].iter().all(|s| *s == 429), "{statuses:?}");
    let log = server.log();
    assert!(log.contains("203.0.113.5"), "{log}");
    assert!(
        !log.contains("192.0.2."),
        "a forged address was believed: {log}"
    );

    // A server that trusts no proxy ignores the header: the client is the peer.
    let plain = Server::start("max_sessions: 8\n", 240);
    let wav = plain.dir.path().join("in.wav");
    speech_wav(&wav, 3.0, 200.0);
    let u = plain.url();
    let w = wav.to_str().unwrap().to_string();
    let t = std::thread::spawn(move || {
        client(
            &u,
            &[
                "--header",
                "X-Forwarded-For:203.0.113.9",
                "--mode",
                "kyutai",
                "--wav",
                &w,
            ],
        )
    });
    plain.wait_sessions(1, 20);
    let (_, body) = plain.get("/api/sessions");
    assert!(
        body.contains("127.0.0.1:") && !body.contains("203.0.113.9"),
        "{body}"
    );
    t.join().unwrap();
}

/// The second probe's rows 4, 6, 7 and 8: operator settings that cannot be what was meant are
/// refused by `--check` and at start (exit 2, naming the key), before anything is served: a keys
/// file with no key (the server started open), keys in the clear that others may read, a
/// Twilio URL that is not TLS, origins and hosts that are not ones, a fractional count, a
/// primed-state file that is a FIFO (the start hung) or in a missing folder (the states were
/// lost at exit). A key listed twice is a warning.
#[test]
fn settings_that_cannot_be_meant_are_refused_before_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let template = daemon::root().join("pipelines/serve.yaml");
    let file = |name: &str, text: &str, mode: u32| {
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p.display().to_string()
    };
    let empty = file("empty-keys", "", 0o600);
    let comments = file("comment-keys", "# keys go here\n\n   # none yet\n", 0o600);
    let readable = file("readable-keys", "alpha-key-0123456789abcdef\n", 0o644);
    let digests = file(
        "digest-keys",
        "sha256:0b8dfdb9f1a0e5be79a6e5d6fef3f4e1d4c8a8c4b6a3ff2c8d7a1e3b5c9d2f4a name=a\n",
        0o644,
    );
    let twice = file(
        "twice-keys",
        "alpha-key-0123456789abcdef name=first\nalpha-key-0123456789abcdef name=again\n",
        0o600,
    );
    let fifo = d.join("primed.fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let cases: Vec<(String, i32, &[&str])> = vec![
        (format!("keys_file: {empty}"), 2, &["keys_file", "no key"]),
        (
            format!("keys_file: {comments}"),
            2,
            &["keys_file", "no key"],
        ),
        (
            format!("keys_file: {readable}"),
            2,
            &["keys_file", "chmod 600"],
        ),
        (format!("keys_file: {digests}"), 0, &[]),
        (
            format!("keys_file: {twice}"),
            0,
            &["listed twice", "again", "first"],
        ),
        (
            "twilio_url: http://voice.example.com/twilio/media".into(),
            2,
            &["twilio_url", "wss://"],
        ),
        (
            "allowed_origins: [\"not a url\"]".into(),
            2,
            &["allowed_origins", "not a url"],
        ),
        ("allowed_origins: [\"\"]".into(), 2, &["allowed_origins"]),
        ("allowed_hosts: [\"\"]".into(), 2, &["allowed_hosts"]),
        (
            "prime_cache_mb: 1.5".into(),
            2,
            &["prime_cache_mb", "whole number"],
        ),
        (
            format!("prime_cache_file: {}", fifo.display()),
            2,
            &["prime_cache_file", "not a regular file"],
        ),
        (
            format!(
                "prime_cache_file: {}/no/such/folder/primed.bin",
                d.display()
            ),
            2,
            &["prime_cache_file", "does not exist"],
        ),
        (
            "forwarded_header: x-real-ip".into(),
            2,
            &["forwarded_header", "x-forwarded-for"],
        ),
        // A detector the user named must be there, and be Silero VAD's.
        (
            format!("realtime: {{vad_model: {}/no-vad.onnx}}", d.display()),
            2,
            &["realtime.vad_model", "no-vad.onnx"],
        ),
        (
            "realtime: {vad_model: models/tiny/mimi_encoder/model.onnx}".into(),
            2,
            &["realtime.vad_model", "not Silero VAD"],
        ),
        (
            "realtime: {voices: {marin: calm.wav}}".into(),
            2,
            &["realtime.voices.marin", "no voices folder"],
        ),
    ];
    let cfg = d.join("serve.yaml");
    for (extra, code, needles) in cases {
        std::fs::write(&cfg, format!("pipeline: {}\n{extra}\n", template.display())).unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["serve", "--check", "--config"])
            .arg(&cfg)
            .current_dir(daemon::root())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let status = daemon::wait_exit(&mut child, std::time::Duration::from_secs(60))
            .unwrap_or_else(|| panic!("{extra}: --check did not end"));
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(code), "{extra}: {err}");
        for n in needles {
            assert!(err.contains(n), "{extra}: {n:?} not in {err}");
        }
        if code == 2 {
            println!("{extra}\n  -> {}", err.trim());
        }
    }
}
