//! `duplex serve`'s WebRTC signalling (`POST /api/webrtc`, WHIP-style) with offers a real
//! Chromium wrote (`tests/clients/browser.py --offers`): a good offer is answered (201, SDP,
//! `Location`); what is wrong with a bad one is named in a 4xx (not SDP, no audio section, no
//! Opus, the wrong content type, too large, a second offer on a live session, a hang-up of an
//! unknown session), and none of it takes a slot or disturbs a live conversation. The
//! conversation itself is in `tests/it/realtime/browser.rs`; the lossy network in `tests/it/realtime/webrtc_loss.rs`.

use crate::support::daemon;
use crate::support::serve;

use std::process::Command;
use std::time::Duration;

use serve::{metric_value_of, Server};

/// The browser's own offers: (with an audio track, data channel only).
fn chromium_offers(server: &Server) -> (String, String) {
    let dir = server.dir.path().join("offers");
    std::fs::create_dir_all(&dir).unwrap();
    let url = format!("http://127.0.0.1:{}/", server.port);
    serve::browser(&["--url", &url, "--offers", dir.to_str().unwrap()]);
    let read = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap();
    (read("audio.sdp"), read("data.sdp"))
}

/// The offer with every Opus payload type taken out of its audio section (what a client that
/// offers only G.711 sends).
fn without_opus(offer: &str) -> String {
    let opus: Vec<String> = offer
        .lines()
        .filter_map(|l| l.strip_prefix("a=rtpmap:"))
        .filter(|l| l.to_ascii_lowercase().contains("opus/48000"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect();
    assert!(!opus.is_empty(), "the browser offered no Opus: {offer}");
    offer
        .split("\r\n")
        .filter(|l| {
            !opus.iter().any(|pt| {
                l.starts_with(&format!("a=rtpmap:{pt} "))
                    || l.starts_with(&format!("a=fmtp:{pt} "))
                    || l.starts_with(&format!("a=rtcp-fb:{pt} "))
            })
        })
        .map(|l| {
            if l.starts_with("m=audio ") {
                l.split(' ')
                    .filter(|f| !opus.iter().any(|pt| pt == f))
                    .collect::<Vec<_>>()
                    .join(" ")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\r\n")
}

#[test]
fn signalling_answers_a_browsers_offer_and_names_what_is_wrong_with_a_bad_one() {
    let server = Server::start("max_sessions: 2\n", 240);
    let (audio, data_only) = chromium_offers(&server);
    // A conversation of another client runs throughout: nothing below may disturb it.
    let other = serve::client_command(&server.url(), &["--silent", "12", "--tail", "0"])
        .spawn()
        .unwrap();
    server.wait_sessions(1, 30);
    let refused_before = metric_value_of(
        &server.metrics(),
        "duplex_http_requests_refused_total{reason=\"bad_request\"}",
    );

    let bad = |code: u16, r: (u16, String, String), needle: &str| {
        assert_eq!(r.0, code, "{r:?}");
        assert!(r.2.contains(needle), "expected {needle:?} in {r:?}");
    };
    bad(
        400,
        server.post("/api/webrtc", "application/sdp", "{\"type\": \"offer\"}"),
        "not an SDP offer",
    );
    bad(
        400,
        server.post("/api/webrtc", "application/sdp", &data_only),
        "no audio section",
    );
    bad(
        400,
        server.post("/api/webrtc", "application/sdp", &without_opus(&audio)),
        "no Opus",
    );
    bad(
        415,
        server.post("/api/webrtc", "application/json", &audio),
        "application/sdp",
    );
    bad(
        400,
        server.post(
            "/api/webrtc?text_temperature=banana",
            "application/sdp",
            &audio,
        ),
        "text_temperature",
    );
    let huge = format!("{audio}{}", "a=x-padding\r\n".repeat(8000));
    bad(
        413,
        server.post("/api/webrtc", "application/sdp", &huge),
        "larger than 64 KiB",
    );
    bad(
        404,
        server.send("DELETE", "/api/webrtc/0123456789abcdef", "text/plain", ""),
        "no live WebRTC session",
    );
    // None of them took a slot; each was counted.
    assert_eq!(server.sessions().len(), 1);
    let refused = metric_value_of(
        &server.metrics(),
        "duplex_http_requests_refused_total{reason=\"bad_request\"}",
    );
    assert!(
        refused >= refused_before + 6.0,
        "{refused_before} -> {refused}"
    );

    // A good offer: 201, the SDP answer (Opus, our candidate), the session's resource.
    let (code, head, answer) = server.post("/api/webrtc", "application/sdp", &audio);
    assert_eq!(code, 201, "{head}\n{answer}");
    let head_l = head.to_ascii_lowercase();
    assert!(head_l.contains("content-type: application/sdp"), "{head}");
    let location = head
        .lines()
        .find_map(|l| {
            l.strip_prefix("location: ")
                .or_else(|| l.strip_prefix("Location: "))
        })
        .expect("a Location header")
        .trim()
        .to_string();
    assert!(location.starts_with("/api/webrtc/"), "{location}");
    assert!(answer.starts_with("v=0"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("opus/48000"),
        "{answer}"
    );
    assert!(answer.contains("typ host"), "no candidate: {answer}");
    server.wait_sessions(2, 30);
    // A second offer on the live session: refused, the session untouched.
    bad(
        409,
        server.post(&location, "application/sdp", &audio),
        "hang up (DELETE)",
    );
    bad(
        409,
        server.send(
            "PATCH",
            &location,
            "application/trickle-ice-sdpfrag",
            "a=x\r\n",
        ),
        "hang up",
    );
    assert_eq!(server.sessions().len(), 2);
    // Hanging up ends it and frees the slot; the resource is gone at once: a second DELETE is
    // 404, as a third is once the peer is dropped (the second probe: 200 while it lingered).
    assert_eq!(server.send("DELETE", &location, "text/plain", "").0, 200);
    assert_eq!(server.send("DELETE", &location, "text/plain", "").0, 404);
    bad(
        404,
        server.post(&location, "application/sdp", &audio),
        "no live WebRTC session",
    );
    daemon::wait::wait_until(
        Duration::from_secs(20),
        "the hung-up session to end",
        || server.sessions().len() == 1,
    );
    assert_eq!(server.send("DELETE", &location, "text/plain", "").0, 404);
    // The other client's conversation ran on, undisturbed.
    let out = other.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the other client: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert!(
        report["samples"].as_u64().unwrap_or(0) > 4 * 24_000,
        "{report}"
    );
    assert!(report["errors"].as_array().unwrap().is_empty(), "{report}");
}

#[test]
fn a_server_with_webrtc_off_says_so_and_a_bad_webrtc_setting_names_its_key() {
    let server = Server::start("webrtc:\n  enabled: false\n", 240);
    let (code, _, body) = server.post("/api/webrtc", "application/sdp", "v=0\r\n");
    assert_eq!(code, 404);
    assert!(body.contains("webrtc.enabled"), "{body}");
    let (_, defaults) = server.get("/api/defaults");
    let d: serde_json::Value = serde_json::from_str(&defaults).unwrap();
    assert!(d["webrtc"].is_null(), "{d}");

    for (setting, needle) in [
        ("webrtc:\n  address: \"not an address\"\n", "webrtc.address"),
        (
            "webrtc:\n  ice_servers: [\"turn:turn.example.com:3478\"]\n",
            "turn_username",
        ),
        (
            "webrtc:\n  ice_servers: [\"http://x\"]\n",
            "webrtc.ice_servers",
        ),
        (
            "webrtc:\n  public_addresses: [\"0.0.0.0\"]\n",
            "webrtc.public_addresses",
        ),
        (
            "webrtc:\n  jitter_ms: 100\n  max_jitter_ms: 50\n",
            "webrtc.max_jitter_ms",
        ),
        ("webrtc:\n  bogus: 1\n", "bogus"),
        (
            "webrtc:\n  location_base: \"replica a\"\n",
            "webrtc.location_base",
        ),
        (
            "webrtc:\n  location_base: \"ftp://a.example.com\"\n",
            "webrtc.location_base",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("serve.yaml");
        std::fs::write(
            &cfg,
            format!(
                "address: \"127.0.0.1:0\"\npipeline: {}\n{setting}",
                daemon::root().join("pipelines/serve.yaml").display()
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_duplex"))
            .args(["serve", "--check", "--config"])
            .arg(&cfg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{setting}: {err}");
        assert!(
            err.contains(needle),
            "{setting}: expected {needle:?} in {err}"
        );
    }
}
