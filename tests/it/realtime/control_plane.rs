//! Two pipelines in one process, each with its own control plane: commands and status of one
//! never reach or change the other, even when both are sent commands at once. The pipelines are
//! the daemon's (microphone on a private PulseAudio → Mimi → LM → Mimi → a virtual speaker).

use crate::support;
use crate::support::packs;
use crate::support::pulse;
use crate::support::wait;

use std::path::Path;
use std::time::Duration;

use duplex::config::{LoadOptions, Override};
use duplex::runtime::{Handle, Value};
use duplex::stages::Registry;
use wait::wait_until;

fn start(name: &str) -> (duplex::runtime::Running, Handle) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let pack = packs::pack("tiny-gqa").display().to_string();
    let mut sets = vec![
        Override::set("stages.speaker.device", "virtual"),
        Override::set("stages.up.to", "24000"),
        Override::set("metrics.address", ""),
    ];
    for s in ["encode", "temporal", "depformer", "decode"] {
        sets.push(Override::set(format!("stages.{s}.pack"), pack.clone()));
    }
    let opts = LoadOptions {
        sets,
        env: Some(Default::default()),
    };
    let (_spec, builder) = duplex::app::build(
        &root.join("pipelines/daemon.yaml"),
        &opts,
        &Registry::builtin(),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let running = builder.build().unwrap().start();
    let handle = running.handle();
    (running, handle)
}

fn int(h: &Handle, stage: &str, key: &str) -> i64 {
    match h.control().get(stage, key) {
        Some(Value::Int(i)) => i,
        other => panic!("{stage}.{key}: {other:?}"),
    }
}

const WAIT: Duration = Duration::from_secs(5);

#[test]
fn two_pipelines_in_one_process_are_independent() {
    // The pipelines run in this process, so the sound server's environment must be the
    // process's: the test runs again in a process of its own with it.
    if !support::in_own_process() {
        let pa = pulse::Pulse::start();
        support::rerun_alone(
            "realtime::control_plane::two_pipelines_in_one_process_are_independent",
            pa.env(),
        );
        return;
    }
    let (ra, a) = start("a");
    let (rb, b) = start("b");
    wait_until(Duration::from_secs(60), "both ready", || {
        a.is_ready() && b.is_ready()
    });
    wait_until(Duration::from_secs(20), "frames flow in both", || {
        int(&a, "temporal", "agent_frames") > 5 && int(&b, "temporal", "agent_frames") > 5
    });

    // Commands to both at once, from many threads: each is answered by its own pipeline.
    let replies: Vec<(char, String, Result<String, String>)> = std::thread::scope(|s| {
        let mut threads = Vec::new();
        for i in 0..4 {
            let (a, b) = (a.clone(), b.clone());
            threads.push(s.spawn(move || {
                let pa = a
                    .control()
                    .send("temporal", "persona", &format!("{},{}", 10 + i, 20 + i))
                    .unwrap();
                let pb = b.control().send("temporal", "reset", "").unwrap();
                vec![
                    ('a', "persona".to_string(), pa.wait(WAIT).unwrap()),
                    ('b', "reset".to_string(), pb.wait(WAIT).unwrap()),
                ]
            }));
        }
        threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect()
    });
    for (who, what, r) in &replies {
        let done = r.as_ref().unwrap_or_else(|e| panic!("{who} {what}: {e}"));
        match what.as_str() {
            "persona" => assert!(done.contains("persona changed"), "{who}: {done}"),
            _ => assert!(done.contains("new conversation"), "{who}: {done}"),
        }
    }
    // A refused persona on one is refused there alone.
    let r = a
        .control()
        .send("temporal", "persona", "1,99999999")
        .unwrap()
        .wait(WAIT)
        .unwrap();
    assert!(r.unwrap_err().contains("out of range"));

    // Mute and pause one: the other is neither muted nor paused, and goes on.
    for (command, key) in [("mute", "muted"), ("pause", "paused")] {
        let stage = if command == "mute" { "mic" } else { "temporal" };
        let r = a
            .control()
            .send(stage, command, "")
            .unwrap()
            .wait(WAIT)
            .unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert_eq!(a.control().get(stage, key), Some(Value::Bool(true)));
        assert_eq!(b.control().get(stage, key), Some(Value::Bool(false)));
    }
    // b's frames are the clock: a step of a's already under way when it paused may still end
    // while b does four; after that, a does none while b does eight.
    let f0 = int(&b, "temporal", "agent_frames");
    wait_until(Duration::from_secs(20), "b goes on", || {
        int(&b, "temporal", "agent_frames") >= f0 + 4
    });
    let (fa, fb, cb) = (
        int(&a, "temporal", "agent_frames"),
        int(&b, "temporal", "agent_frames"),
        int(&b, "temporal", "context"),
    );
    wait_until(Duration::from_secs(20), "b goes on", || {
        int(&b, "temporal", "agent_frames") >= fb + 8
    });
    assert_eq!(int(&a, "temporal", "agent_frames"), fa, "a is paused");
    assert!(
        int(&b, "temporal", "context") > cb,
        "b's conversation was not reset by a's persona"
    );
    // Status keys are each pipeline's own.
    let sa = a.control().status();
    let sb = b.control().status();
    assert_eq!(sa["mic"]["muted"], Value::Bool(true));
    assert_eq!(sb["mic"]["muted"], Value::Bool(false));
    assert_eq!(sa["temporal"]["model"], Value::Text("cpu f32".into()));
    a.control()
        .send("temporal", "resume", "")
        .unwrap()
        .wait(WAIT);
    wait_until(Duration::from_secs(10), "a resumes", || {
        int(&a, "temporal", "agent_frames") > fa + 3
    });

    // Stopping one leaves the other running.
    a.stop();
    assert!(ra.wait().error.is_none());
    let f = int(&b, "temporal", "agent_frames");
    wait_until(Duration::from_secs(10), "b still runs", || {
        int(&b, "temporal", "agent_frames") > f + 5
    });
    b.stop();
    assert!(rb.wait().error.is_none());
}
