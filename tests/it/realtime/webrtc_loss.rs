//! WebRTC against the WebSocket on a lossy network, in real parts: `duplex serve` in a network
//! namespace behind a veth pair whose end drops packets at random (nftables, both directions,
//! TCP and UDP alike), headless Chromium outside it playing the page with a fake microphone.
//! At 2 % and then 5 % loss, the same page and server hold a 60 s conversation over each
//! transport; the page's own measures are compared: stalls (silence where the agent's audio
//! should play), concealed time, the mouth-to-ear estimate, and the server's late frames.
//!
//! The first measurement (2026-12-03, this 2-core machine): at 2 % loss the WebSocket did not
//! stall (TCP retransmits within its 120 ms playback buffer) but its mouth-to-ear estimate was
//! 191 ms against WebRTC's 133; at 5 % it stalled (92–149 ms) and its buffer grew until its
//! estimate was 454 ms, while WebRTC stayed at 129 ms with no stall, concealing 20 ms blips
//! (2.0 % and 5.5 % of its audio). The criterion, kept since: over WebRTC no stall of 200 ms or
//! more, at most 3 % (at 2 % loss) and 7 % (at 5 %) of the audio concealed, a longest stall
//! shorter than the WebSocket's wherever the WebSocket stalls, and a mouth-to-ear estimate below
//! the WebSocket's at both losses. (A stall is 100 ms windows in a row in which the page played
//! at least 80 % silence or concealment where audio was due.)
//!
//! `make soak` runs both losses for the 60 s of the first measurement. `make test` runs 5 %
//! alone, 30 s per transport: the loss at which the WebSocket stalls and WebRTC must not, which
//! decides the comparison. Thirty seconds decide it: a run carries 1,500 packets of 20 ms each
//! way, so the concealed share's spread from random loss alone (binomial) is 0.56 points, and
//! the bound of 7 % stands 2.7 spreads above the share measured (5.5 %); the WebSocket's stall
//! and its grown buffer show within its first seconds of loss, and the mouth-to-ear estimates
//! differ by hundreds of milliseconds. (At 2 % the bound of 3 % leaves 2.8 spreads at 30 s but
//! none to a loaded machine's underruns: the soak judges it at full length, alone.)
//!
//! Needs root for the namespace: where the system refuses one, the test says so and passes.

use crate::support;
use crate::support::netns;
use crate::support::serve;

use serve::{speech_wav, Server};

/// Seconds each conversation is held (see the module's doc).
fn seconds() -> f64 {
    if support::soak() {
        60.0
    } else {
        30.0
    }
}

/// What one run measured, from the page's samples.
#[derive(Debug)]
struct Run {
    longest_stall_ms: f64,
    concealed_ms: f64,
    underruns: f64,
    mouth_to_ear_ms: f64,
    late_frames: f64,
    played_s: f64,
}

fn conversation(server: &Server, wav: &std::path::Path, transport: &str) -> Run {
    let url = format!("http://{}:{}/", server.host, server.port);
    let talk = seconds().to_string();
    let r = serve::browser(&[
        "--url",
        &url,
        "--wav",
        wav.to_str().unwrap(),
        "--talk",
        &talk,
        "--history",
        "--transport",
        transport,
    ]);
    assert_eq!(
        r["live"], true,
        "{transport}: the call never became live: {r}"
    );
    let s = &r["stats"];
    assert_eq!(s["transport"], transport, "{s}");
    let q = &s["quality"];
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let history = r["history"].as_array().unwrap();
    let m2e: Vec<f64> = history
        .iter()
        .filter_map(|h| h["b"].as_object())
        .map(|b| b.values().filter_map(|v| v.as_f64()).sum())
        .collect();
    // The breakdown of the mouth-to-ear estimate, each part's mean over the run.
    let mut parts: Vec<(String, f64)> = Vec::new();
    for h in history {
        if let Some(b) = h["b"].as_object() {
            for (k, v) in b {
                match parts.iter_mut().find(|p| &p.0 == k) {
                    Some(p) => p.1 += v.as_f64().unwrap_or(0.0) / m2e.len() as f64,
                    None => parts.push((k.clone(), v.as_f64().unwrap_or(0.0) / m2e.len() as f64)),
                }
            }
        }
    }
    eprintln!(
        "{transport}: mouth to ear, mean parts: {parts:?}; server: {}",
        s["server_transport"]
    );
    let played_s = if transport == "webrtc" {
        num(&s["rtc"]["samples_received"]) / 48_000.0
    } else {
        num(&s["player"]["played"]) / 24_000.0
    };
    Run {
        longest_stall_ms: num(&q["longest_stall_ms"]),
        concealed_ms: num(&q["concealed_ms"]),
        underruns: num(&q["underruns"]),
        mouth_to_ear_ms: m2e.iter().sum::<f64>() / m2e.len().max(1) as f64,
        late_frames: num(&s["late_frames"]),
        played_s,
    }
}

#[test]
fn under_packet_loss_webrtc_conceals_blips_where_the_websocket_stalls() {
    let ns = match netns::Netns::create() {
        Ok(ns) => ns,
        Err(why) => {
            eprintln!("skipped: no network namespace here ({why})");
            return;
        }
    };
    let server = Server::start_on(
        &ns.ip,
        Some(ns.exec()),
        "allow_anonymous: true\nmax_sessions: 1\nsampling:\n  text_temperature: 4\n",
        240,
    );
    let wav = server.dir.path().join("mic.wav");
    speech_wav(&wav, seconds() + 10.0, 200.0);
    let mut rows = Vec::new();
    let only = std::env::var("DUPLEX_LOSS_ONLY").ok();
    let losses: Vec<u32> = match &only {
        Some(o) => vec![o.split(':').next().unwrap().parse().unwrap()],
        None if support::soak() => vec![2, 5],
        None => vec![5],
    };
    for loss in losses {
        ns.set_loss(loss);
        for transport in ["websocket", "webrtc"] {
            if only
                .as_ref()
                .is_some_and(|o| o != &format!("{loss}:{transport}"))
            {
                continue;
            }
            let r = conversation(&server, &wav, transport);
            eprintln!(
                "loss {loss} %, {transport:<9}: longest stall {:>5.0} ms, concealed {:>6.0} ms \
                 ({:.1} % of {:.1} s played), underruns {:>3}, mouth to ear {:>5.1} ms, \
                 server late frames {}",
                r.longest_stall_ms,
                r.concealed_ms,
                100.0 * r.concealed_ms / (1000.0 * r.played_s.max(1.0)),
                r.played_s,
                r.underruns,
                r.mouth_to_ear_ms,
                r.late_frames
            );
            server.wait_sessions(0, 30);
            rows.push((loss, transport, r));
        }
    }
    ns.set_loss(0);
    for (loss, transport, r) in &rows {
        assert!(
            r.played_s > seconds() / 2.0,
            "{transport} at {loss} %: the page played only {:.1} s",
            r.played_s
        );
    }
    let mut judged: Vec<u32> = rows.iter().map(|r| r.0).collect();
    judged.dedup();
    for loss in judged {
        let get = |t: &str| &rows.iter().find(|r| r.0 == loss && r.1 == t).unwrap().2;
        let (ws, rtc) = (get("websocket"), get("webrtc"));
        let share = rtc.concealed_ms / (1000.0 * rtc.played_s);
        let most = if loss == 2 { 0.03 } else { 0.07 };
        assert!(
            rtc.longest_stall_ms < 200.0,
            "WebRTC stalled {:.0} ms at {loss} % loss",
            rtc.longest_stall_ms
        );
        assert!(
            share <= most,
            "WebRTC concealed {:.1} % of its audio at {loss} % loss (at most {:.0} %)",
            100.0 * share,
            100.0 * most
        );
        if ws.longest_stall_ms > 0.0 {
            assert!(
                rtc.longest_stall_ms < ws.longest_stall_ms,
                "at {loss} % loss WebRTC stalled {:.0} ms, as long as the WebSocket ({:.0} ms)",
                rtc.longest_stall_ms,
                ws.longest_stall_ms
            );
        }
        assert!(
            rtc.mouth_to_ear_ms < ws.mouth_to_ear_ms,
            "at {loss} % loss WebRTC's mouth to ear ({:.0} ms) is not below the WebSocket's \
             ({:.0} ms)",
            rtc.mouth_to_ear_ms,
            ws.mouth_to_ear_ms
        );
    }
}
