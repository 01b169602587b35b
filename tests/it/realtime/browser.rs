//! The browser voice chat served by `duplex serve`, in a real headless Chromium (the Debian
//! package) with a fake microphone fed from a WAV, driven through the DevTools protocol
//! (`tests/clients/browser.py`): a conversation on a desktop and a phone-sized window (audio
//! played, transcript, live panel, no console error, a screenshot kept in
//! `target/test-artifacts/`), a full server and one that goes away, and the page's Ogg/Opus
//! checked against Kyutai's `sphn` both ways.

use crate::support::daemon;
use crate::support::serve;

use std::path::{Path, PathBuf};
use std::process::Command;

use serve::{browser, client_command, speech_wav, token_log, Server};

fn artifacts() -> PathBuf {
    let d = daemon::root().join("target/test-artifacts");
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn page(server: &Server) -> String {
    format!("http://127.0.0.1:{}/", server.port)
}

/// Once the session of the page's conversation `r` has ended: the transcript the page showed
/// is what the session's token log wrote (the frames it received before hanging up).
fn assert_transcript_is_the_token_log(server: &Server, r: &serde_json::Value) {
    let id = r["stats"]["session"].as_u64().unwrap();
    server.wait_sessions(0, 20);
    let log = token_log(&server.session_dir(id).join("agent.jsonl"));
    let logged: String = log
        .iter()
        .map(|l| l["piece"].as_str().unwrap_or(""))
        .collect();
    let shown = r["page"]["transcript"].as_str().unwrap();
    assert!(logged.starts_with(shown), "page {shown:?}, log {logged:?}");
}

/// One conversation in a window of `width` × `height`; returns what the page saw.
fn talk(server: &Server, wav: &Path, width: u32, height: u32, shot: &str) -> serde_json::Value {
    let shot = artifacts().join(shot);
    let r = browser(&[
        "--url",
        &page(server),
        "--wav",
        wav.to_str().unwrap(),
        "--talk",
        "5",
        "--width",
        &width.to_string(),
        "--height",
        &height.to_string(),
        "--screenshot",
        shot.to_str().unwrap(),
        "--transport",
        "websocket",
    ]);
    assert_eq!(r["live"], true, "the call never became live: {r}");
    let s = &r["stats"];
    assert!(
        r["console_errors"].as_array().unwrap().is_empty(),
        "console errors: {r}"
    );
    // Audio was decoded and played by the worklet; the live panel was updated from the server.
    assert!(
        s["decoded_samples"].as_f64().unwrap() > 2.0 * 24_000.0,
        "{s}"
    );
    assert!(s["player"]["played"].as_f64().unwrap() > 24_000.0, "{s}");
    assert!(
        s["sent_packets"].as_f64().unwrap() > 100.0,
        "the microphone was not sent: {s}"
    );
    assert!(s["stats_updates"].as_f64().unwrap() >= 2.0, "{s}");
    assert!(
        s["realtime_factor"].is_number() && s["verdicts"]["temporal"].is_string(),
        "{s}"
    );
    assert!(s["errors"].as_array().unwrap().is_empty(), "{s}");
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "screenshot"
    );
    r
}

#[test]
fn a_conversation_in_the_browser_plays_audio_and_shows_the_transcript_and_the_live_panel() {
    let server = Server::start("max_sessions: 2\nsampling:\n  text_temperature: 4\n", 240);
    let wav = server.dir.path().join("mic.wav");
    speech_wav(&wav, 8.0, 200.0);
    let r = talk(&server, &wav, 1280, 900, "browser-desktop.png");
    assert_transcript_is_the_token_log(&server, &r);
    let player = &r["stats"]["player"];
    eprintln!(
        "desktop: mouth to ear {} ms (rtt {} ms), buffer {} / {} ms, underruns {}",
        r["stats"]["mouth_to_ear_ms"],
        r["stats"]["rtt_ms"],
        player["depth_ms"],
        player["target_ms"],
        player["underruns"]
    );
    // A phone-sized window.
    talk(&server, &wav, 390, 844, "browser-phone.png");
}

#[test]
fn the_page_says_when_the_server_is_full_and_when_it_goes_away() {
    let server = Server::start("max_sessions: 1\n", 240);
    let wav = server.dir.path().join("mic.wav");
    speech_wav(&wav, 4.0, 200.0);
    let url = page(&server);
    let wav = wav.to_str().unwrap();
    let state = |state: &str, transport: &str, extra: &[&str]| {
        let mut args = vec![
            "--url",
            &url,
            "--wav",
            wav,
            "--expect-state",
            state,
            "--talk",
            "20",
            "--transport",
            transport,
        ];
        args.extend_from_slice(extra);
        browser(&args)
    };
    // Full: the page says so and retries; once the holder leaves, its retry gets in (the
    // WebSocket's upgrade refused, or the WebRTC offer answered 503).
    for transport in ["websocket", "webrtc"] {
        let mut holder = client_command(&server.url(), &["--silent", "30", "--tail", "0"])
            .spawn()
            .unwrap();
        server.wait_sessions(1, 20);
        let holder_pid = holder.id().to_string();
        let r = state(
            "full",
            transport,
            &["--then-kill", &holder_pid, "--then-state", "live"],
        );
        assert_eq!(r["reached"], true, "{transport}: {r}");
        assert!(
            r["message"].as_str().unwrap().contains("full"),
            "{transport}: {r}"
        );
        assert_eq!(
            r["then_reached"], true,
            "{transport}: the retry did not get in: {r}"
        );
        let _ = holder.wait();
        server.wait_sessions(0, 20);
    }

    // The user refuses the microphone: said so, nothing connects.
    let r = state("error", "auto", &["--deny-mic"]);
    assert_eq!(r["reached"], true, "{r}");
    assert!(
        r["message"]
            .as_str()
            .unwrap()
            .contains("microphone was refused"),
        "{r}"
    );

    // A server that goes away mid-session: the page says so and offers to reconnect.
    // The same over WebRTC (no socket to close: ICE's consent checks go unanswered).
    for transport in ["websocket", "webrtc"] {
        let mut gone = Server::start("max_sessions: 1\n", 240);
        let pid = gone.child.as_ref().unwrap().id().to_string();
        let r = browser(&[
            "--url",
            &page(&gone),
            "--wav",
            wav,
            "--talk",
            "2",
            "--stop-server-pid",
            &pid,
            "--transport",
            transport,
        ]);
        assert_eq!(r["lost"], true, "{transport}: {r}");
        assert_eq!(r["page"]["connect"], "Reconnect", "{transport}: {r}");
        assert!(
            r["page"]["message"].as_str().unwrap().contains("lost"),
            "{transport}: {r}"
        );
        let _ = gone.wait_exit(std::time::Duration::from_secs(5));
    }
}

#[test]
fn the_pages_ogg_opus_is_read_by_sphn_and_the_page_plays_what_sphn_writes() {
    let server = Server::start("max_sessions: 1\n", 240);
    let dir = server.dir.path();
    let wav = dir.join("tone.wav");
    speech_wav(&wav, 2.0, 300.0);
    // sphn writes a stream, the page decodes it.
    let py = daemon::root().join(".venv/bin/python");
    let ogg = dir.join("sphn.ogg");
    let st = Command::new(&py)
        .args([
            "-c",
            "import sys, sphn, numpy as np\n\
             pcm, _ = sphn.read(sys.argv[1], sample_rate=24000)\n\
             w = sphn.OpusStreamWriter(24000)\n\
             out = bytes(w.append_pcm(np.asarray(pcm, dtype=np.float32).reshape(-1)))\n\
             open(sys.argv[2], 'wb').write(out)",
        ])
        .arg(&wav)
        .arg(&ogg)
        .status()
        .unwrap();
    assert!(st.success());
    let page_ogg = dir.join("page.ogg");
    let r = browser(&[
        "--url",
        &page(&server),
        "--encode-wav",
        wav.to_str().unwrap(),
        "--encode-out",
        page_ogg.to_str().unwrap(),
        "--decode",
        ogg.to_str().unwrap(),
    ]);
    assert!(r["console_errors"].as_array().unwrap().is_empty(), "{r}");
    let decoded = &r["decoded"];
    let n = decoded["samples"].as_f64().unwrap();
    assert!(
        (n - 48_000.0).abs() <= 1920.0,
        "the page decoded {n} samples of sphn's 2 s: {r}"
    );
    let rms = decoded["rms"].as_f64().unwrap();
    assert!(rms > 0.05, "the page decoded silence: {r}");
    // The page writes a stream, sphn reads it.
    let out = Command::new(&py)
        .args([
            "-c",
            "import sys, sphn, numpy as np\n\
             r = sphn.OpusStreamReader(24000)\n\
             pcm = r.append_bytes(open(sys.argv[1], 'rb').read())\n\
             pcm = np.asarray(pcm if pcm is not None else [], dtype=np.float32)\n\
             print(len(pcm), float(np.sqrt(np.mean(pcm ** 2))) if len(pcm) else 0.0)",
        ])
        .arg(&page_ogg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "sphn refused the page's stream: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut it = text.split_whitespace();
    let n: f64 = it.next().unwrap().parse().unwrap();
    let rms: f64 = it.next().unwrap().parse().unwrap();
    assert!(
        (n - 48_000.0).abs() <= 2400.0,
        "sphn read {n} samples of the page's 2 s"
    );
    assert!(
        rms > 0.05,
        "sphn read silence from the page's stream ({rms})"
    );
}

#[test]
fn a_conversation_over_webrtc_carries_audio_both_ways_and_its_hang_up_frees_the_slot() {
    let server = Server::start("max_sessions: 1\nsampling:\n  text_temperature: 4\n", 240);
    let wav = server.dir.path().join("mic.wav");
    speech_wav(&wav, 8.0, 200.0);
    let shot = artifacts().join("browser-webrtc.png");
    let r = browser(&[
        "--url",
        &page(&server),
        "--wav",
        wav.to_str().unwrap(),
        "--talk",
        "6",
        "--transport",
        "webrtc",
        "--screenshot",
        shot.to_str().unwrap(),
    ]);
    assert_eq!(r["live"], true, "the call never became live: {r}");
    assert!(
        r["console_errors"].as_array().unwrap().is_empty(),
        "console errors: {r}"
    );
    let s = &r["stats"];
    assert_eq!(s["transport"], "webrtc", "{s}");
    assert_eq!(r["page"]["transport"], "WebRTC (UDP)", "{r}");
    assert!(s["errors"].as_array().unwrap().is_empty(), "{s}");
    // The browser received and played the agent's audio (its own jitter buffer and decoder):
    // about 50 packets a second of talk, not silence.
    let rtc = &s["rtc"];
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    assert!(num(&rtc["packets_received"]) > 150.0, "{rtc}");
    assert!(num(&rtc["samples_received"]) > 2.0 * 48_000.0, "{rtc}");
    assert!(
        num(&rtc["audio_energy"]) > 0.0,
        "the agent's audio was silent: {rtc}"
    );
    // The server received the microphone through its jitter buffer.
    let server_side = &s["server_transport"];
    assert_eq!(server_side["kind"], "webrtc", "{s}");
    assert!(
        num(&server_side["packets_received"]) > 150.0,
        "{server_side}"
    );
    assert!(num(&server_side["packets_sent"]) > 150.0, "{server_side}");
    // The page's live panel shows loss and jitter from getStats().
    assert!(r["page"]["loss"].as_str().unwrap().contains('%'), "{r}");
    assert_transcript_is_the_token_log(&server, &r);
    // The hang-up (DELETE on the session's resource) freed the slot and the peer.
    let m = server.metrics();
    assert_eq!(
        serve::metric_value_of(&m, "duplex_sessions_ended_total{outcome=\"client_closed\"}"),
        1.0,
        "{m}"
    );
    daemon::wait::wait_until(
        std::time::Duration::from_secs(20),
        "the WebRTC peer to be dropped",
        || serve::metric_value_of(&server.metrics(), "duplex_webrtc_peers") == 0.0,
    );
    assert_eq!(server.get("/readyz").0, 200);
    eprintln!(
        "webrtc: mouth to ear {} ms ({}), browser buffer {} ms",
        s["mouth_to_ear_ms"], s["breakdown"], rtc["buffer_ms"]
    );
}
