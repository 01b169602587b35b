//! The telephony providers' media streams, each against a call made from its provider's
//! published format (`tests/clients/provider_client.py`: Telnyx, Plivo, Vonage, Exotel), all
//! four at once on one server: the call's audio both ways in the provider's encoding and
//! framing (μ-law, 16-bit PCM at 16 kHz, Vonage's 20 ms binary frames, Exotel's 320-byte
//! multiples), marks echoed, the pressed key in the session's status, the provider's proof
//! (token, signature, JWT, Basic) required: a call without it refused 403.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::daemon;
use crate::support::serve::{speech_wav, Server};

const PROVIDERS: &str = "providers:\n  telnyx_stream_token: tt-123\n  plivo_auth_token: pl-456\n  \
    plivo_url: wss://voice.example.com/plivo/media\n  vonage_signature_secret: vo-789\n  \
    exotel_credentials: \"KEY:TOKEN\"\n";

/// The provider client's call to `server` as `provider` with `args`: its report.
fn call(server: &Server, provider: &str, args: &[String]) -> std::process::Child {
    Command::new(daemon::root().join(".venv/bin/python"))
        .arg(daemon::root().join("tests/clients/provider_client.py"))
        .args(["--provider", provider, "--url"])
        .arg(format!("ws://127.0.0.1:{}/{provider}/media", server.port))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn report(child: std::process::Child, server: &Server) -> serde_json::Value {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client failed: {stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log()
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

#[test]
fn telnyx_plivo_vonage_and_exotel_calls_stream_both_ways_in_their_own_formats() {
    let server = Server::start(&format!("max_sessions: 4\n{PROVIDERS}"), 500);
    let wav = server.dir.path().join("in.wav");
    speech_wav(&wav, 4.0, 180.0);
    let wav = wav.display().to_string();
    let common = |secret: &str, extra: &[&str]| -> Vec<String> {
        [
            &[
                "--wav",
                wav.as_str(),
                "--listen",
                "1",
                "--dtmf",
                "1",
                "--auth-token",
                secret,
            ][..],
            extra,
        ]
        .concat()
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let calls = [
        ("telnyx", call(&server, "telnyx", &common("tt-123", &[]))),
        (
            "plivo",
            call(
                &server,
                "plivo",
                &common(
                    "pl-456",
                    &[
                        "--signed-url",
                        "wss://voice.example.com/plivo/media",
                        "--encoding",
                        "audio/x-l16",
                        "--rate",
                        "16000",
                    ],
                ),
            ),
        ),
        ("vonage", call(&server, "vonage", &common("vo-789", &[]))),
        ("exotel", call(&server, "exotel", &common("KEY:TOKEN", &[]))),
    ];
    // While they talk, each call's key is in its session's status.
    let t0 = Instant::now();
    let mut pressed = Vec::new();
    while t0.elapsed() < Duration::from_secs(5) && pressed.len() < 4 {
        pressed = server
            .sessions()
            .iter()
            .filter(|s| s["transport"]["dtmf"] == "1")
            .map(|s| {
                s["transport"]["kind"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
    }
    pressed.sort();
    assert_eq!(pressed, ["exotel", "plivo", "telnyx", "vonage"]);
    for (provider, child) in calls {
        let r = report(child, &server);
        eprintln!("{provider}: {r}");
        assert_eq!(r["status"], serde_json::Value::Null, "{r}");
        assert!(r["errors"].as_array().unwrap().is_empty(), "{r}");
        assert!(r["audio_seconds"].as_f64().unwrap() >= 3.0, "{r}");
        assert!(r["rms"].as_f64().unwrap() > 0.01, "{r}");
        // Vonage's frames are 20 ms exactly; Exotel's in multiples of 320 bytes.
        assert_eq!(r["frame_rule_violations"], 0, "{r}");
        // A mark about every second, echoed as the provider echoes them.
        assert!(r["marks"].as_u64().unwrap() >= 3, "{r}");
        assert!(r["echoed"].as_u64().unwrap() >= 2, "{r}");
        if provider != "telnyx" && provider != "vonage" {
            // Exotel's and Plivo's messages carry the call's stream id.
            assert_eq!(r["ids"], serde_json::json!([r["expected_id"]]), "{r}");
        }
    }
    server.wait_sessions(0, 20);
    // Without the provider's proof, or with another's: refused before the upgrade.
    for (provider, secret) in [
        ("telnyx", "tt-999"),
        ("plivo", "pl-999"),
        ("vonage", "vo-999"),
        ("exotel", "KEY:WRONG"),
    ] {
        let mut args = common(
            secret,
            &["--signed-url", "wss://voice.example.com/plivo/media"],
        );
        if provider != "plivo" {
            args.truncate(args.len() - 2);
        }
        let r = report(call(&server, provider, &args), &server);
        assert_eq!(r["status"], 403, "{provider}: {r}");
    }
}
