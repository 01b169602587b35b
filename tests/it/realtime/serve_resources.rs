//! Sessions that are built once: a server's second and later sessions open no pack, read no
//! template, load no tokenizer and encode no voice prompt (the process's resources hold them,
//! counted in `duplex_resources_loaded_total`); the template is the one in memory until the
//! operator reloads (SIGHUP), and a broken template is refused at the reload with the one in
//! force kept.

use crate::support::packs;
use crate::support::serve;

use std::process::Command;
use std::time::{Duration, Instant};

use serve::{client, metric_value_of, speech_wav, Server};

fn loads(server: &Server) -> [f64; 5] {
    let m = server.metrics();
    ["pack", "tokenizer", "voice", "template", "engine"].map(|w| {
        metric_value_of(
            &m,
            &format!("duplex_resources_loaded_total{{what=\"{w}\"}}"),
        )
    })
}

/// Waits until the log holds `needle`.
fn wait_log(server: &Server, needle: &str) {
    let t0 = Instant::now();
    while !server.log().contains(needle) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no {needle:?} in the log:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn later_sessions_load_nothing_and_the_template_changes_only_at_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let voices = dir.path().join("voices");
    std::fs::create_dir(&voices).unwrap();
    speech_wav(&voices.join("a.wav"), 2.0, 180.0);
    std::fs::copy(voices.join("a.wav"), voices.join("same-as-a.wav")).unwrap();
    speech_wav(&voices.join("b.wav"), 2.0, 240.0);
    let logs = dir.path().join("sessions");
    let tpl = dir.path().join("session.yaml");
    let text = serve::template(&logs, 240);
    std::fs::write(&tpl, &text).unwrap();
    let server = Server::start_with(
        dir,
        &format!(
            "voices: {}\nvoice_prompt: a.wav\ntext_prompt: \"You are kind.\"\nmax_sessions: 2\n",
            voices.display()
        ),
        &tpl,
    );
    // Start-up loaded everything once (its check builds one session of the template).
    let at_start = loads(&server);
    println!("loaded at start (pack, tokenizer, voice, template, engine): {at_start:?}");
    assert!(at_start[0] >= 1.0 && at_start[1] >= 1.0, "{at_start:?}");
    assert_eq!(at_start[2], 1.0, "one voice encoded");
    assert_eq!(at_start[3], 1.0, "the template read once");
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 1.5, 200.0);
    let w = wav.to_str().unwrap();
    let url = server.url();
    for query in [
        "",
        "text_prompt=You+are+kind.",
        "voice_prompt=same-as-a.wav",
        "text_temperature=0.3",
    ] {
        let r = client(&url, &["--mode", "web", "--query", query, "--wav", w]);
        assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
        assert_eq!(r["first_kind"], 0);
    }
    assert_eq!(
        loads(&server),
        at_start,
        "four sessions (the same voice under another name among them) loaded something"
    );
    // Another voice: encoded once, then taken from the resources too.
    for _ in 0..2 {
        client(
            &url,
            &["--mode", "web", "--query", "voice_prompt=b.wav", "--wav", w],
        );
    }
    let after_b = loads(&server);
    assert_eq!(after_b[2], at_start[2] + 1.0, "{after_b:?}");
    assert_eq!(after_b[0], at_start[0], "{after_b:?}");

    // The template edited on disk: the server keeps serving the one in memory...
    // (no user-codes log any more)
    let cut: String = text
        .lines()
        .filter(|l| {
            !l.contains("user_codes") && !l.contains("user.jsonl") && *l != "    kind: codes_sink"
        })
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(cut, text);
    std::fs::write(&tpl, &cut).unwrap();
    let r = client(&url, &["--mode", "web", "--wav", w]);
    let id = r["metadata"]["session"].as_u64().unwrap();
    assert!(
        server.session_dir(id).join("user.jsonl").exists(),
        "session {id} did not use the template in memory"
    );
    // ...until the operator reloads.
    server.signal("HUP");
    wait_log(&server, "reloaded the session template");
    let r = client(&url, &["--mode", "web", "--wav", w]);
    let id = r["metadata"]["session"].as_u64().unwrap();
    assert!(
        !server.session_dir(id).join("user.jsonl").exists(),
        "session {id} after the reload still used the old template"
    );
    assert!(server.session_dir(id).join("agent.jsonl").exists());
    let l = loads(&server);
    assert_eq!(l[3], 2.0, "read at start and at the reload: {l:?}");
    assert_eq!(
        l[0], at_start[0],
        "an unchanged pack is not opened again: {l:?}"
    );

    // A broken template is refused at the reload; the one in force is kept.
    std::fs::write(&tpl, "stages: [this is not a pipeline\n").unwrap();
    server.signal("HUP");
    wait_log(&server, "reload refused");
    let r = client(&url, &["--mode", "web", "--wav", w]);
    assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
    assert!(r["samples"].as_i64().unwrap() > 0, "{r}");
    let m = server.metrics();
    assert_eq!(
        metric_value_of(&m, "duplex_template_reloads_total{result=\"applied\"}"),
        1.0
    );
    assert_eq!(
        metric_value_of(&m, "duplex_template_reloads_total{result=\"rejected\"}"),
        1.0
    );
}

/// `duplex prime` writes the state a session of the server's template primes with its default
/// voice and persona; a server that loads the file (`prime_cache_file`) starts warm (its own
/// priming at start restores, nothing is computed), saves the states it computed meanwhile at
/// exit, and a server of another pack refuses the file, naming both packs.
#[test]
fn primed_states_go_to_a_file_and_a_restarted_server_starts_warm() {
    let dir = tempfile::tempdir().unwrap();
    let voices = dir.path().join("voices");
    std::fs::create_dir(&voices).unwrap();
    speech_wav(&voices.join("a.wav"), 2.0, 180.0);
    let tpl = dir.path().join("session.yaml");
    std::fs::write(&tpl, serve::template(&dir.path().join("sessions"), 240)).unwrap();
    let states = dir.path().join("primed.states");
    let settings = format!(
        "pipeline: {}\nvoices: {}\nvoice_prompt: a.wav\ntext_prompt: \"You are kind.\"\nprime_cache_file: {}\n",
        tpl.display(),
        voices.display(),
        states.display()
    );
    let cfg = dir.path().join("prime.yaml");
    std::fs::write(&cfg, &settings).unwrap();
    let prime = || {
        Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["prime", "--config"])
            .arg(&cfg)
            .arg("--out")
            .arg(&states)
            .output()
            .unwrap()
    };
    let o = prime();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(said.contains("holds 1 primed states (1 new)"), "{said}");
    // Again: the file's state is restored, nothing new.
    let o = prime();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("holds 1 primed states (0 new)"), "{said}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("restored="),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    let server_dir = tempfile::tempdir().unwrap();
    let mut server = Server::start_with(
        server_dir,
        &settings.replace(&format!("pipeline: {}\n", tpl.display()), ""),
        &tpl,
    );
    wait_log(&server, "primed states loaded");
    let m = server.metrics();
    let value = |m: &str, label: &str| {
        metric_value_of(
            m,
            &format!("duplex_prime_cache_total{{result=\"{label}\"}}"),
        )
    };
    assert_eq!(value(&m, "miss"), 0.0, "the server computed a state: {m}");
    assert_eq!(value(&m, "hit"), 1.0, "its priming at start restored: {m}");
    // A session with another persona computes a state of its own...
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 1.0, 200.0);
    let r = client(
        &server.url(),
        &[
            "--mode",
            "web",
            "--query",
            "text_prompt=You+are+brief.",
            "--wav",
            wav.to_str().unwrap(),
        ],
    );
    assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
    assert_eq!(value(&server.metrics(), "miss"), 1.0);
    // ...which the server saves with the one it loaded when it stops.
    server.signal("TERM");
    let st = server.wait_exit(Duration::from_secs(60));
    assert!(st.is_some_and(|s| s.success()), "{st:?}\n{}", server.log());
    assert!(
        server.log().contains("primed states saved"),
        "{}",
        server.log()
    );
    let o = prime();
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("holds 2 primed states (0 new)"), "{said}");

    // Another pack's server refuses the file, naming both packs, before it serves (exit 2).
    let other = settings.clone() + &format!("pack: {}\n", packs::pack("tiny-gqa-fp16").display());
    std::fs::write(&cfg, other).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_duplex"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("prime_cache_file")
            && err.contains("primed on pack tiny-gqa ")
            && err.contains("tiny-gqa-fp16"),
        "{err}"
    );
}
