//! `duplex serve`'s `/v1/realtime` against the official `openai` SDK's realtime client and a
//! raw WebSocket client (`tests/clients/realtime_client.py`; G.711 made and read by Python's own
//! `audioop`): greedy conversations in PCM16 and μ-law equal `duplex replay`, the μ-law stream
//! is the PCM16 one companded, a voice and a persona are taken, bad events are answered by
//! `error` events naming the field while a session beside them streams on, keys are needed.
//! The user's turns (espeak-ng's speech) are reported by the voice-activity detector where they
//! are, and end the agent's response; `turn_detection: null` turns it off.
//! And `/twilio/media` against a phone call made from Twilio's published message format
//! (`tests/clients/twilio_client.py`): signed, μ-law both ways, marks echoed, the call's
//! `<Parameter>`s taken.

use crate::support::daemon;
use crate::support::serve;

use std::path::Path;
use std::process::{Command, Stdio};

use serve::{read_wav, speech_wav, token_log, Server};

const PERSONA: &str = "You enjoy a good conversation.";

/// Runs the test client `script` (of `tests/clients`) with `args`; returns its report.
fn python_client(server: &Server, script: &str, args: &[&str]) -> serde_json::Value {
    python_client_in(".venv", server, script, args)
}

/// As [`python_client`], with the Python of the virtual environment `venv`.
fn python_client_in(venv: &str, server: &Server, script: &str, args: &[&str]) -> serde_json::Value {
    let out = Command::new(daemon::root().join(venv).join("bin/python"))
        .arg(daemon::root().join("tests/clients").join(script))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Runs the realtime test client against `server` with `args`; returns its report.
fn realtime(server: &Server, args: &[&str]) -> serde_json::Value {
    let url = format!("http://127.0.0.1:{}", server.port);
    python_client(
        server,
        "realtime_client.py",
        &[&["--url", &url], args].concat(),
    )
}

/// The pieces of a session's token log, joined.
fn logged_text(dir: &Path) -> String {
    token_log(&dir.join("agent.jsonl"))
        .iter()
        .map(|l| l["piece"].as_str().unwrap_or("").to_string())
        .collect()
}

/// `duplex replay --greedy` on the session's logged user codes gives its logged tokens.
fn assert_replays(session: &Path, out: &Path) {
    let tok = daemon::root().join("models/tokenizer-tiny.model");
    let persona = ["--persona", PERSONA, "--tokenizer", tok.to_str().unwrap()];
    let frames = serve::assert_replay_matches(session, out, &persona);
    assert!(frames >= 60, "{frames} frames");
}

/// The session's folder of the client's report.
fn session_dir(server: &Server, report: &serde_json::Value) -> std::path::PathBuf {
    let id: u64 = report["session_id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no session id in {report}"));
    server.session_dir(id)
}

/// A zero-phase low-pass (windowed sinc, `cutoff` Hz at `rate`, `2 half + 1` taps), so that
/// signals made at 24 and 8 kHz can be compared in the band both carry.
fn low_pass(x: &[f64], rate: f64, cutoff: f64, half: i64) -> Vec<f64> {
    let fc = cutoff / rate;
    let taps: Vec<f64> = (-half..=half)
        .map(|n| {
            let n = n as f64;
            let sinc = if n == 0.0 {
                2.0 * fc
            } else {
                (std::f64::consts::TAU * fc * n).sin() / (std::f64::consts::PI * n)
            };
            let w = 0.54 + 0.46 * (std::f64::consts::PI * n / half as f64).cos();
            sinc * w
        })
        .collect();
    (0..x.len() as i64)
        .map(|i| {
            taps.iter()
                .enumerate()
                .map(|(k, t)| {
                    let j = i + k as i64 - half;
                    if j >= 0 && (j as usize) < x.len() {
                        t * x[j as usize]
                    } else {
                        0.0
                    }
                })
                .sum()
        })
        .collect()
}

#[test]
fn the_openai_sdk_holds_greedy_conversations_in_pcm16_and_mu_law() {
    let voices = tempfile::tempdir().unwrap();
    speech_wav(&voices.path().join("calm.wav"), 1.0, 150.0);
    let server = Server::start(&format!("voices: {}\n", voices.path().display()), 240);
    let dir = server.dir.path();
    let wav = dir.join("in.wav");
    speech_wav(&wav, 6.0, 180.0);
    let wav = wav.to_str().unwrap();
    let greedy = ["--greedy", "--instructions", PERSONA, "--wav", wav];
    // PCM16 both ways.
    let pcm_out = dir.join("pcm.wav");
    let a = realtime(
        &server,
        &[&greedy[..], &["--save", pcm_out.to_str().unwrap()]].concat(),
    );
    // The same conversation with the agent's audio in μ-law.
    let law_out = dir.join("ulaw.wav");
    let b = realtime(
        &server,
        &[
            &greedy[..],
            &["--output", "g711_ulaw", "--save", law_out.to_str().unwrap()],
        ]
        .concat(),
    );
    // μ-law both ways, with a voice prompt.
    let c = realtime(
        &server,
        &[
            "--wav",
            wav,
            "--input",
            "g711_ulaw",
            "--output",
            "g711_ulaw",
            "--voice",
            "calm.wav",
        ],
    );
    server.wait_sessions(0, 20);
    for r in [&a, &b, &c] {
        assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
        for (event, n) in [("session.created", 1), ("session.updated", 1)] {
            assert_eq!(r["events"][event], n, "{event}: {r}");
        }
        // Responses end at the agent's turns: each that opened closed, but for one open at
        // the hang-up.
        let n = |k: &str| r["events"][k].as_u64().unwrap_or(0);
        assert!(n("response.created") >= 1, "{r}");
        assert!(n("response.created") - n("response.done") <= 1, "{r}");
        assert!(r["audio_seconds"].as_f64().unwrap() >= 4.0, "{r}");
        // The transcript the client got is the session's logged pieces (up to the frames
        // stepped after it had gone).
        let logged = logged_text(&session_dir(&server, r));
        let got = r["text"].as_str().unwrap();
        assert!(logged.starts_with(got), "{got:?} vs {logged:?}");
    }
    assert_eq!(c["updated"]["audio"]["output"]["voice"], "calm.wav", "{c}");
    assert_eq!(
        c["updated"]["audio"]["input"]["format"]["type"], "audio/pcmu",
        "{c}"
    );
    // Greedy over /v1/realtime is what `duplex replay --greedy` gives on the logged codes.
    let (da, db) = (session_dir(&server, &a), session_dir(&server, &b));
    assert_replays(&da, &dir.join("replay-a.jsonl"));
    assert_replays(&db, &dir.join("replay-b.jsonl"));
    // The two greedy sessions heard the same audio and said the same; the μ-law stream,
    // decoded by Python's audioop, is the PCM16 one at 8 kHz, to within G.711's noise.
    let (ta, tb) = (
        token_log(&da.join("agent.jsonl")),
        token_log(&db.join("agent.jsonl")),
    );
    let same = ta.len().min(tb.len());
    assert!(same >= 60);
    assert_eq!(ta[..same], tb[..same]);
    let (ra, pa) = read_wav(&pcm_out);
    let (rb, pb) = read_wav(&law_out);
    assert_eq!((ra, rb), (24_000, 8_000));
    // Filters of the same length in time (12 ms), below where the resampler's band ends.
    let pa: Vec<f64> = low_pass(&pa, 24_000.0, 3_000.0, 144)
        .into_iter()
        .step_by(3)
        .collect();
    let pb = low_pass(&pb, 8_000.0, 3_000.0, 48);
    // Compared over the conversation both received in full, past the filters' edges.
    let n = pa.len().min(pb.len()) - 200;
    let (mut signal, mut noise) = (0.0, 0.0);
    for i in 100..n {
        signal += pa[i] * pa[i];
        noise += (pa[i] - pb[i]).powi(2);
    }
    let snr = 10.0 * (signal / noise).log10();
    assert!(signal > 1e-3, "the agent's audio is silent: {signal}");
    // About 38 dB here; a wrong law or byte order gives less than 0.
    assert!(snr > 25.0, "μ-law vs PCM16: SNR {snr:.1} dB");
    eprintln!("μ-law vs PCM16 at 8 kHz: SNR {snr:.1} dB over {n} samples");
}

/// A server of the tests' template with one API key, `key`, and `extra` configuration.
fn with_key(key: &str, extra: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    serve::write_keys(&keys, &format!("{key} name=agent\n"));
    let logs = dir.path().join("sessions");
    let tpl = dir.path().join("session.yaml");
    std::fs::write(&tpl, serve::template(&logs, 240)).unwrap();
    Server::start_with(
        dir,
        &format!("keys_file: {}\n{extra}", keys.display()),
        &tpl,
    )
}

#[test]
fn bad_events_get_errors_naming_the_field_while_a_session_beside_streams_on() {
    let key = "realtime-key-0123456789abcdef";
    let mut server = with_key(key, "");
    server.key = Some(key.to_string());
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 6.0, 200.0);
    // A session streams in real time (its key as the SDK sends it, `Authorization: Bearer`).
    let beside = {
        let (port, wav) = (server.port, wav.to_str().unwrap().to_string());
        std::thread::spawn(move || {
            Command::new(daemon::root().join(".venv/bin/python"))
                .arg(daemon::root().join("tests/clients/realtime_client.py"))
                .args(["--url", &format!("http://127.0.0.1:{port}")])
                .args(["--wav", &wav, "--key", key])
                .output()
                .unwrap()
        })
    };
    // Another client sends one bad event after another (its key in the subprotocol, as a
    // browser's realtime client passes it).
    let big = format!(
        "{{\"type\": \"input_audio_buffer.append\", \"audio\": \"{}\"}}",
        "A".repeat(10 << 20)
    );
    let events = serde_json::to_string(&[
        "this is not JSON".to_string(),
        r#"{"event_id": "e1", "type": "no.such.event"}"#.into(),
        r#"{"event_id": "e2", "session": {}}"#.into(),
        format!(
            r#"{{"event_id": "e3", "type": "session.update", "session": {{"instructions": "{}"}}}}"#,
            "x".repeat(5000)
        ),
        r#"{"event_id": "e4", "type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/mp3"}}}}}"#.into(),
        r#"{"event_id": "e5", "type": "session.update", "session": {"duplex": {"text_temperature": "hot"}}}"#.into(),
        r#"{"event_id": "e6", "type": "input_audio_buffer.append", "audio": "not base64!"}"#.into(),
        r#"{"event_id": "e7", "type": "input_audio_buffer.append", "audio": 12345}"#.into(),
        r#"{"event_id": "e8", "type": "conversation.item.retrieve", "item_id": "no_such_item"}"#
            .into(),
        big,
    ])
    .unwrap();
    let file = server.dir.path().join("events.json");
    std::fs::write(&file, events).unwrap();
    let r = realtime(
        &server,
        &[
            "--mode",
            "raw",
            "--key",
            key,
            "--listen",
            "5",
            "--events",
            &format!("@{}", file.display()),
        ],
    );
    assert_eq!(r["subprotocol"], "realtime", "{r}");
    let errors: Vec<&serde_json::Value> = r["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "error")
        .map(|e| &e["error"])
        .collect();
    let expect = [
        ("invalid_json", None, None),
        ("unknown_event", Some("type"), Some("e1")),
        ("missing_type", Some("type"), Some("e2")),
        ("invalid_value", Some("session.instructions"), Some("e3")),
        (
            "invalid_value",
            Some("session.audio.input.format"),
            Some("e4"),
        ),
        (
            "invalid_value",
            Some("session.duplex.text_temperature"),
            Some("e5"),
        ),
        ("invalid_base64", Some("audio"), Some("e6")),
        ("invalid_value", Some("audio"), Some("e7")),
        ("item_retrieve_invalid_item_id", Some("item_id"), Some("e8")),
        ("event_too_large", None, None),
    ];
    assert_eq!(errors.len(), expect.len(), "{r}");
    for (e, (code, param, id)) in errors.iter().zip(expect) {
        assert_eq!(e["code"], code, "{e}");
        assert_eq!(e["param"].as_str(), param, "{e}");
        assert_eq!(e["event_id"].as_str(), id, "{e}");
        assert!(!e["message"].as_str().unwrap().is_empty(), "{e}");
    }
    assert!(
        errors[3]["message"]
            .as_str()
            .unwrap()
            .contains("instructions"),
        "{}",
        errors[3]
    );
    assert!(
        errors[8]["message"]
            .as_str()
            .unwrap()
            .contains("no_such_item"),
        "{}",
        errors[8]
    );
    // The 10 MB event closed its connection (1009), and only it.
    assert_eq!(r["close"][0], 1009, "{r}");
    let out = beside.join().unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(report["errors"].as_array().unwrap().is_empty(), "{report}");
    assert!(report["audio_seconds"].as_f64().unwrap() >= 4.0, "{report}");
    // Without a key: refused before the upgrade.
    let r = realtime(&server, &["--mode", "raw", "--listen", "1"]);
    assert_eq!(r["status"], 401, "{r}");
    let m = server.metrics();
    assert!(
        serve::metric_value_of(
            &m,
            "duplex_session_protocol_errors_total{kind=\"not_json\"}"
        ) >= 1.0,
        "{m}"
    );
}

/// Runs the Twilio-like client with `args`; returns its report.
fn phone_call(server: &Server, args: &[&str]) -> serde_json::Value {
    let url = format!("ws://127.0.0.1:{}/twilio/media", server.port);
    python_client(
        server,
        "twilio_client.py",
        &[&["--url", &url], args].concat(),
    )
}

#[test]
fn a_signed_twilio_call_streams_mu_law_both_ways_with_its_marks_echoed() {
    let signed = "wss://voice.example.com/twilio/media";
    let server = with_key(
        "api-key-0123456789abcdef",
        &format!("twilio_auth_token: twilio-token-42\ntwilio_url: {signed}\n"),
    );
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 6.0, 180.0);
    let wav = wav.to_str().unwrap();
    // The TwiML's <Parameter>s set the persona and greedy sampling.
    let parameters = serde_json::json!({
        "text_prompt": PERSONA,
        "text_temperature": "0",
        "audio_temperature": "0",
    })
    .to_string();
    let r = phone_call(
        &server,
        &[
            "--wav",
            wav,
            "--token",
            "twilio-token-42",
            "--signed-url",
            signed,
            "--parameters",
            &parameters,
        ],
    );
    assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
    assert_eq!(r["status"], serde_json::Value::Null, "{r}");
    eprintln!("the call: {r}");
    // Every message carried the call's streamSid.
    assert_eq!(
        r["sids"],
        serde_json::json!(["MZ0123456789abcdef0123456789abcdef"]),
        "{r}"
    );
    assert!(r["audio_seconds"].as_f64().unwrap() >= 4.0, "{r}");
    assert!(r["rms"].as_f64().unwrap() > 0.01, "{r}");
    // A mark about every second of audio, each echoed once played; played in time, nothing
    // was cleared.
    let marks = r["marks"].as_u64().unwrap();
    assert!(marks >= 4, "{r}");
    assert!(r["echoed"].as_u64().unwrap() + 3 >= marks, "{r}");
    assert_eq!(r["clears"], 0, "{r}");
    server.wait_sessions(0, 20);
    // The call hung up (`stop`): the session ended as a client's close.
    assert!(server.log().contains("client_closed"), "{}", server.log());
    // Greedy, with the persona of the <Parameter>s: what `duplex replay` gives.
    let sessions = server.dir.path().join("sessions");
    // The session's folder is named by its id (beside the start-up's `check` and `prime`).
    let session = std::fs::read_dir(&sessions)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.parse::<u64>().is_ok())
        })
        .unwrap_or_else(|| panic!("no session in {}", sessions.display()));
    assert_replays(&session, &server.dir.path().join("replay.jsonl"));
    // Not signed for this URL, or signed with another token: refused before the upgrade.
    for token in ["another-token", ""] {
        let r = phone_call(
            &server,
            &["--wav", wav, "--token", token, "--signed-url", signed],
        );
        assert_eq!(r["status"], 403, "{r}");
    }
    let r = phone_call(
        &server,
        &[
            "--wav",
            wav,
            "--token",
            "twilio-token-42",
            "--signed-url",
            "wss://elsewhere.example.com/twilio/media",
        ],
    );
    assert_eq!(r["status"], 403, "{r}");
}

/// Pipecat's own `OpenAIRealtimeLLMService` (from `.venv-agents`, as its users install it),
/// pointed at `/v1/realtime` in a headless pipeline: the minimal pipeline with the microphone
/// open from the start; and the one `pipecat init` generates (a system message in a context,
/// an `LLMRunFrame`) with a locally driven turn that interrupts the agent. Each holds its call
/// with audio back for its whole length, no `error` event, and every server event parsed by
/// Pipecat's own models.
/// A 24 kHz WAV at `path` of silences and espeak-ng's sentences, in `parts` order (`Err`:
/// seconds of silence, `Ok`: a sentence); returns where each sentence's sound starts and ends,
/// in seconds (its first and last sample over -30 dBFS).
fn spoken_wav(path: &Path, parts: &[Result<&str, f64>]) -> Vec<(f64, f64)> {
    let mut all: Vec<f32> = Vec::new();
    let mut spans = Vec::new();
    for part in parts {
        match part {
            Err(seconds) => all.extend(std::iter::repeat_n(0.0, (seconds * 24_000.0) as usize)),
            Ok(text) => {
                let said = path.with_extension("say.wav");
                let ok = Command::new("espeak-ng")
                    .args(["-s", "160", "-w", said.to_str().unwrap(), text])
                    .status()
                    .expect("espeak-ng (run `make setup`)");
                assert!(ok.success());
                let mut r = hound::WavReader::open(&said).unwrap();
                let rate = r.spec().sample_rate;
                let x: Vec<f32> = r
                    .samples::<i16>()
                    .map(|s| f32::from(s.unwrap()) / 32768.0)
                    .collect();
                let mut y = Vec::new();
                let mut rs = duplex::audio::StreamResampler::new(rate, 24_000, 480).unwrap();
                rs.process(&x, &mut y).unwrap();
                rs.flush(&mut y).unwrap();
                let loud = |v: &&f32| v.abs() > 0.03;
                let first = y.iter().position(|v| loud(&v)).unwrap();
                let last = y.len() - y.iter().rev().position(|v| loud(&v)).unwrap();
                let at = all.len();
                spans.push((
                    (at + first) as f64 / 24_000.0,
                    (at + last) as f64 / 24_000.0,
                ));
                all.extend(y);
            }
        }
    }
    serve::write_wav_24k(path, &all);
    spans
}

/// Runs an agent framework's test client `script` (in `.venv-agents`) on `wav` against the
/// server's `/v1/realtime` with `extra` arguments; returns its report, checked for `error`
/// events and for `problems` (the report's lists of what the framework failed at).
fn agent_client(
    server: &Server,
    script: &str,
    wav: &Path,
    extra: &[&str],
    problems: &[&str],
) -> serde_json::Value {
    let url = format!("ws://127.0.0.1:{}/v1/realtime", server.port);
    let args = [
        &["--url", url.as_str(), "--wav", wav.to_str().unwrap()],
        extra,
    ]
    .concat();
    let r = python_client_in(".venv-agents", server, script, &args);
    eprintln!("{script} {extra:?}: {r}");
    for k in std::iter::once(&"errors").chain(problems) {
        assert_eq!(r[k], serde_json::json!([]), "{k}: {r}");
    }
    r
}

#[test]
fn the_users_turns_are_detected_where_they_are_and_end_the_agents_response() {
    let server = Server::start("", 240);
    let wav = server.dir.path().join("talk.wav");
    let spans = spoken_wav(
        &wav,
        &[
            Err(1.5),
            Ok("Hello there, I would like to book a table for two."),
            Err(2.0),
            Ok("Tomorrow at eight, please."),
            Err(1.5),
        ],
    );
    let wav = wav.to_str().unwrap();
    let (on, off) = std::thread::scope(|s| {
        let on = s.spawn(|| realtime(&server, &["--wav", wav, "--listen", "1"]));
        let off = s.spawn(|| {
            realtime(
                &server,
                &["--wav", wav, "--listen", "1", "--turn-detection", "null"],
            )
        });
        (on.join().unwrap(), off.join().unwrap())
    });
    eprintln!(
        "speech at {spans:?}\non: {}\noff: {}",
        on["turns"], off["turns"]
    );
    assert_eq!(on["errors"], serde_json::json!([]), "{on}");
    let td = &on["updated"]["audio"]["input"]["turn_detection"];
    assert_eq!(td["type"], "server_vad", "{on}");
    assert_eq!(td["silence_duration_ms"], 500, "{on}");
    // Each sentence: started (its prefix padding, 300 ms, before the speech), stopped (500 ms
    // of silence after it), committed, under one item id of its own.
    let turns = on["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3 * spans.len(), "{on}");
    let mut ids = Vec::new();
    for (turn, (start, end)) in turns.chunks(3).zip(&spans) {
        let kinds: Vec<&str> = turn.iter().map(|t| t[0].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "input_audio_buffer.speech_started",
                "input_audio_buffer.speech_stopped",
                "input_audio_buffer.committed"
            ],
            "{on}"
        );
        let ms = |i: usize| turn[i][1].as_f64().unwrap() / 1000.0;
        assert!(
            (ms(0) - (start - 0.3)).abs() <= 0.25,
            "started at {} s for speech at {start} s: {on}",
            ms(0)
        );
        assert!(
            ms(1) >= end + 0.5 - 0.25 && ms(1) <= end + 0.5 + 0.4,
            "stopped at {} s for speech ending at {end} s: {on}",
            ms(1)
        );
        assert!(turn.iter().all(|t| t[2] == turn[0][2]), "{on}");
        ids.push(turn[0][2].clone());
    }
    assert_ne!(ids[0], ids[1]);
    // The second sentence comes long after the session was ready: it ended the agent's
    // response then open.
    let done = on["done"].as_array().unwrap();
    assert!(
        done.contains(&serde_json::json!(["cancelled", "turn_detected"])),
        "{on}"
    );
    // Turned off: no turns, no response ended by one; the agent's audio all the way.
    assert_eq!(off["errors"], serde_json::json!([]), "{off}");
    assert_eq!(off["turns"], serde_json::json!([]), "{off}");
    assert!(off["updated"]["audio"]["input"]
        .get("turn_detection")
        .is_none_or(|t| t.is_null()));
    assert!(
        !off["done"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|d| d[1] == "turn_detected"),
        "{off}"
    );
}

#[test]
fn pipecat_holds_conversations_over_v1_realtime() {
    let server = Server::start("", 240);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 10.0, 200.0);
    let run = |extra: &[&str]| {
        agent_client(
            &server,
            "pipecat_client.py",
            &wav,
            extra,
            &["parse_failures"],
        )
    };
    let minimal = run(&["--seconds", "6"]);
    // The call's audio, but for the session's start (priming) and what was still on its way.
    assert!(
        minimal["audio_seconds"].as_f64().unwrap() >= 4.0,
        "{minimal}"
    );
    // Responses end at the agent's turns: each that opened closed, but for one open at the
    // hang-up.
    let opened = |r: &serde_json::Value, k: &str| r["received"][k].as_u64().unwrap_or(0);
    let open_at_end = opened(&minimal, "response.created") - opened(&minimal, "response.done");
    assert!(open_at_end <= 1, "{minimal}");
    let init = run(&["--seconds", "8", "--context", "--interrupt-at", "3"]);
    assert!(init["audio_seconds"].as_f64().unwrap() >= 6.0, "{init}");
    // Its `response.create` started the session's response (when it came before the session
    // was ready), or completed that one and opened another; every one that closed said so,
    // and one may be open at the end. The interruption's truncation was answered.
    assert_eq!(init["sent"]["response.create"], 1, "{init}");
    let count = |k: &str| init["received"][k].as_u64().unwrap_or(0);
    assert!(
        count("response.created") - count("response.done") <= 1,
        "{init}"
    );
    assert_eq!(
        count("response.done"),
        count("response.output_item.done"),
        "{init}"
    );
    assert_eq!(count("conversation.item.truncated"), 1, "{init}");
}

#[test]
fn livekit_agents_hold_conversations_over_v1_realtime() {
    let server = Server::start("", 240);
    let wav = server.dir.path().join("talk.wav");
    spoken_wav(
        &wav,
        &[
            Err(1.5),
            Ok("Hello there, I would like to book a table for two."),
            Err(6.0),
        ],
    );
    let run = |extra: &[&str]| {
        let problems = ["handler_failures", "error_logs"];
        let r = agent_client(&server, "livekit_client.py", &wav, extra, &problems);
        assert!(r.get("client_failure").is_none(), "{r}");
        // Every reply the agent asked for was answered by a response echoing its request.
        for f in r["generate_reply"]["plugin_future"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(f["outcome"], "response.created", "{r}");
        }
        r
    };
    // The agent as most are written: a chat context with a system message, a greeting at the
    // start; and one that asks for a reply mid-call, after the user's turn, then is barged in on.
    let (greets, mid) = std::thread::scope(|s| {
        let greets = s.spawn(|| run(&["--seconds", "8", "--generate-reply", "--chat-ctx"]));
        let mid = s.spawn(|| {
            run(&[
                "--seconds",
                "10",
                "--generate-reply",
                "5",
                "--interrupt-at",
                "8",
            ])
        });
        (greets.join().unwrap(), mid.join().unwrap())
    });
    let seconds = |r: &serde_json::Value| r["audio_seconds"].as_f64().unwrap();
    // The call's audio, but for the session's start and what an interruption held back.
    assert!(seconds(&greets) >= 8.0 - 2.5, "{greets}");
    assert!(seconds(&mid) >= 10.0 - 2.5, "{mid}");
    let instructions = greets["last_session_updated"]["instructions"]
        .as_str()
        .unwrap();
    assert!(instructions.contains("Greet them by name"), "{greets}");
    for (r, call) in [(&greets, 8.0), (&mid, 10.0)] {
        assert_eq!(
            r["generate_reply"]["plugin_future"]
                .as_array()
                .map(Vec::len),
            Some(1),
            "{r}"
        );
        let count = |side: &str, k: &str| r[side][k].as_u64().unwrap_or(0);
        // Every response that opened closed, but for the one open at the hang-up.
        let (opened, closed) = (
            count("received", "response.created"),
            count("received", "response.done"),
        );
        assert!(opened == closed || opened == closed + 1, "{r}");
        // Every truncation was answered (but one sent at the hang-up itself). A barge-in on
        // audio not yet played deletes the item instead.
        let before_end = r["truncates"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["at"].as_f64().unwrap() < call - 0.2)
            .count() as u64;
        assert!(
            count("sent", "conversation.item.truncate") + count("sent", "conversation.item.delete")
                >= 1,
            "{r}"
        );
        assert!(
            count("received", "conversation.item.truncated") >= before_end,
            "{r}"
        );
        assert!(
            count("received", "input_audio_buffer.speech_started") >= 1,
            "{r}"
        );
    }
    assert_eq!(mid["interrupt"]["outcome"], "done", "{mid}");
    // Responses end at the agent's turns too, not only at interruptions: the mid-call reply
    // was sent when one did.
    assert!(
        mid["response_done"]["completed/None"].as_u64().unwrap_or(0) >= 1,
        "{mid}"
    );
}
