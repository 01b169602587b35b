//! A shared engine that fails mid-conversation (the fault drill
//! `DUPLEX_DRILL_ENGINE_PANIC_AT_TICK`: its thread panics at that temporal tick): its session
//! ends with an error message and a close, `/healthz` and `/readyz` say 503 until a fresh engine
//! replaces it, the server never exits, and the next session talks.

use crate::support::serve;

use std::time::{Duration, Instant};

use serve::{client, metric_value_of, speech_wav, Server};

#[test]
fn a_failed_engine_ends_its_sessions_and_a_fresh_one_replaces_it() {
    // The drill's variable reaches this server alone (through `env`, not this process's).
    let mut with_drill = std::process::Command::new("env");
    with_drill.arg("DUPLEX_DRILL_ENGINE_PANIC_AT_TICK=40");
    let mut server = Server::start_on("127.0.0.1", Some(with_drill), "max_sessions: 2\n", 240);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 6.0, 200.0);
    let w = wav.to_str().unwrap();
    let r = client(&server.url(), &["--mode", "kyutai", "--wav", w]);
    assert_eq!(r["close_code"], 1011, "{r}");
    let errors = r["errors"].to_string();
    assert!(
        errors.contains("server error") && !errors.contains('/'),
        "{r}"
    );
    // The health endpoints said so, then a fresh engine replaced the failed one.
    let t0 = Instant::now();
    let mut saw_503 = false;
    loop {
        let (code, body) = server.get("/healthz");
        if code == 503 {
            saw_503 = true;
            assert!(body.contains("\"engine_failed\":true"), "{body}");
        } else if code == 200 && server.log().contains("a fresh shared engine replaces") {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no fresh engine: {}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.log();
    assert!(
        saw_503 || log.contains("the shared LM engine failed"),
        "{log}"
    );
    assert_eq!(
        log.matches("the shared LM engine failed").count(),
        1,
        "logged once"
    );
    let (code, _) = server.get("/readyz");
    assert_eq!(code, 200);
    // The next session talks, on the fresh engine.
    let r = client(&server.url(), &["--mode", "kyutai", "--wav", w]);
    assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
    assert!(r["samples"].as_i64().unwrap() >= 5 * 24_000, "{r}");
    let m = server.metrics();
    assert_eq!(metric_value_of(&m, "duplex_engine_failures_total"), 1.0);
    assert!(
        server.wait_exit(Duration::from_millis(10)).is_none(),
        "the server exited"
    );
}
