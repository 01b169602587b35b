//! The daemon's recording switch (`ctl record on|off`): a new conversation, recorded, on a
//! pipeline built beside the running one; or the running recording stopped, or one still
//! starting cancelled. Knows the daemon's shared state, not how pipelines are built.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{lock, reload, Shared};
use crate::config::ConfigErrorKind;

/// See [`Shared::record`].
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RecordState {
    /// Conversations are to be recorded: the configuration's `record` at start-up, then the
    /// last `ctl record on|off`. Every pipeline is built, and started, as it says.
    pub(super) wanted: bool,
    /// A `record on`'s pipeline is being built, or is built and not started yet.
    pub(super) starting: bool,
}

impl Shared {
    /// `record on`: a new conversation, recorded, on a pipeline built beside the running one
    /// (a recording starts with the LM's warm-up and priming, so that it replays); `record
    /// off`: the running conversation's recording stops, the conversation goes on, and a
    /// recording still starting is cancelled (its folder deleted, nothing kept). Each reply says
    /// which of these happened.
    pub(super) fn record(self: &Arc<Self>, on: bool) -> serde_json::Value {
        let Ok(mut state) = self.record.lock() else {
            return serde_json::json!({ "ok": false, "error": "recording state lock poisoned" });
        };
        let reply = self.record_locked(&mut state, on);
        for m in [&self.config, &self.last_good] {
            if let Ok(mut c) = m.lock() {
                c.record = state.wanted;
            }
        }
        reply
    }

    /// [`Shared::record`] under the recording's lock.
    fn record_locked(self: &Arc<Self>, state: &mut RecordState, on: bool) -> serde_json::Value {
        match (on, self.recording()) {
            (true, Some(r)) => {
                state.wanted = true;
                serde_json::json!({
                    "ok": true,
                    "done": format!("already recording into {}", r.dir().display()),
                })
            }
            (true, None) if state.starting => {
                state.wanted = true;
                serde_json::json!({
                    "ok": true,
                    "done": "a recording is already starting (its pipeline is being built)",
                })
            }
            (true, None) => {
                let Some(c) = lock(&self.config) else {
                    return serde_json::json!({ "ok": false, "error": "configuration lock poisoned" });
                };
                // Checked now, so that a folder that cannot be made is said in the reply.
                if let Err(e) = std::fs::create_dir_all(&c.record_dir) {
                    return serde_json::json!({
                        "ok": false,
                        "error": c.error(
                            "record_dir",
                            ConfigErrorKind::Build,
                            format!("recordings go under {}: {e}", c.record_dir.display()),
                        ).to_string(),
                    });
                }
                let shared = self.clone();
                let spawned = std::thread::Builder::new()
                    .name("duplex:record".into())
                    .spawn(move || start_recording(&shared));
                if let Err(e) = spawned {
                    return serde_json::json!({ "ok": false, "error": format!("record: {e}") });
                }
                state.wanted = true;
                state.starting = true;
                serde_json::json!({
                    "ok": true,
                    "done": format!(
                        "a new conversation, recorded into a new folder under {}, once its pipeline is built beside the running one",
                        c.record_dir.display()
                    ),
                })
            }
            (false, Some(r)) => {
                state.wanted = false;
                r.stop();
                tracing::info!(dir = %r.dir().display(), "recording stopped");
                serde_json::json!({
                    "ok": true,
                    "done": format!("recording stopped: {}", r.dir().display()),
                })
            }
            (false, None) if state.starting => {
                state.wanted = false;
                tracing::info!("the recording that was starting is cancelled");
                serde_json::json!({
                    "ok": true,
                    "done": "the recording that was starting is cancelled: nothing is recorded",
                })
            }
            (false, None) => {
                state.wanted = false;
                serde_json::json!({ "ok": true, "done": "not recording" })
            }
        }
    }
}

/// The thread of a `record on`: once no reload runs, builds the configuration in force again,
/// recorded, beside the running pipeline, and hands the new one over unless the recording was
/// cancelled meanwhile; then waits for the main loop to start it (or another), and says the
/// recording is no longer starting.
fn start_recording(shared: &Arc<Shared>) {
    let done = |shared: &Shared| {
        if let Ok(mut s) = shared.record.lock() {
            s.starting = false;
        }
    };
    let Ok(_one) = shared.reloading.lock() else {
        return done(shared);
    };
    // Meanwhile an `off` may have cancelled it, or a reload started a recorded pipeline.
    let go = shared
        .record
        .lock()
        .is_ok_and(|s| s.wanted && shared.recording().is_none());
    let Some(mut new) = lock(&shared.config).filter(|_| go) else {
        return done(shared);
    };
    new.record = true;
    let starts = shared.life.starts();
    if reload::rebuild(shared, new, true) {
        let t0 = Instant::now();
        while shared.life.starts() == starts
            && !shared.life.stopping()
            && t0.elapsed() < Duration::from_secs(600)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    done(shared);
}
