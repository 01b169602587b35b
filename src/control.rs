//! Process-wide switches and requests: what a control surface (the daemon's socket, a signal)
//! asks of running stages, and what stages report back.
//!
//! Stages read switches and take requests at frame boundaries; nothing here blocks a stage for
//! longer than an uncontended lock. Keys are `stage.what` (`mic.mute`, `temporal.reset`,
//! `temporal.persona`, `depformer.sampling`). This module knows no stage and no socket.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

#[derive(Default)]
struct Board {
    switches: BTreeMap<String, bool>,
    requests: BTreeMap<String, String>,
    replies: BTreeMap<String, Result<String, String>>,
    status: BTreeMap<String, serde_json::Value>,
}

fn board() -> &'static Mutex<Board> {
    static B: OnceLock<Mutex<Board>> = OnceLock::new();
    B.get_or_init(|| Mutex::new(Board::default()))
}

fn with<T>(f: impl FnOnce(&mut Board) -> T) -> Option<T> {
    board().lock().ok().map(|mut b| f(&mut b))
}

/// Sets a switch (`mic.mute`, `temporal.pause`).
pub fn set(key: &str, on: bool) {
    with(|b| b.switches.insert(key.to_string(), on));
}

/// Reads a switch (false when never set).
pub fn is_set(key: &str) -> bool {
    with(|b| b.switches.get(key).copied().unwrap_or(false)).unwrap_or(false)
}

/// Posts a request with a payload; a newer request replaces an unread one.
pub fn post(key: &str, payload: impl Into<String>) {
    with(|b| b.requests.insert(key.to_string(), payload.into()));
}

/// Posts a request and waits up to `timeout` for the stage that takes it to [`reply`]: `None`
/// when no stage answered in time (the request stays pending until one takes it).
pub fn ask(
    key: &str,
    payload: impl Into<String>,
    timeout: std::time::Duration,
) -> Option<Result<String, String>> {
    with(|b| {
        b.replies.remove(key);
        b.requests.insert(key.to_string(), payload.into());
    });
    let end = std::time::Instant::now() + timeout;
    loop {
        if let Some(r) = with(|b| b.replies.remove(key)).flatten() {
            return Some(r);
        }
        if std::time::Instant::now() >= end {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Answers the request last taken for `key` (see [`ask`]).
pub fn reply(key: &str, result: Result<String, String>) {
    with(|b| b.replies.insert(key.to_string(), result));
}

/// Takes the pending request for `key`, if any.
pub fn take(key: &str) -> Option<String> {
    with(|b| b.requests.remove(key)).flatten()
}

/// Publishes a status value (`temporal.context`, `speaker.underruns`).
pub fn publish(key: &str, value: impl Into<serde_json::Value>) {
    with(|b| b.status.insert(key.to_string(), value.into()));
}

/// Forgets every pending request (a new pipeline is about to start: what the old one was
/// asked no longer applies). Switches are the user's and stay.
pub fn clear_requests() {
    with(|b| {
        b.requests.clear();
        b.replies.clear();
    });
}

/// Every published status value and switch.
pub fn snapshot() -> serde_json::Value {
    with(|b| {
        let mut m = serde_json::Map::new();
        for (k, v) in &b.status {
            m.insert(k.clone(), v.clone());
        }
        for (k, v) in &b.switches {
            m.insert(k.clone(), (*v).into());
        }
        serde_json::Value::Object(m)
    })
    .unwrap_or(serde_json::Value::Null)
}
