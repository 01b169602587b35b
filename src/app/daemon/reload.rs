//! SIGHUP: the configuration read again and checked whole before anything changes, then
//! applied to the running pipeline (persona, sampling, devices: commands at the next frame) or
//! built as a new pipeline beside it (pack, pipeline, voice, tokenizer, long-session policy,
//! seed). Every reload ends in one line of the log and in `ctl status` (`reloads`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::config::{MIC_STAGE, SPEAKER_STAGE};
use super::{build_pipeline, check_all, lock, may_build_alone, DaemonConfig, Shared};

/// Ends a reload: logs how, and counts it for `status`. `outcome` is a reply, as a command's: what was done, or why not.
pub(super) fn finish_reload(shared: &Shared, outcome: crate::runtime::Reply) {
    let last = match &outcome {
        Ok(done) => {
            tracing::info!("reload applied: {done}");
            format!("applied: {done}")
        }
        Err(why) => {
            tracing::error!("reload rejected, keeping the running configuration: {why}");
            format!("rejected: {why}")
        }
    };
    if let Ok(mut r) = shared.reloads.lock() {
        r.0 += 1;
        r.1 = last;
    }
}

/// A new pack or pipeline: builds the new pipeline beside the running one (models loaded,
/// devices open), then stops the running one and hands the new one over. A configuration the
/// new pipeline refuses is rejected with the running one untouched. Only when the new pipeline
/// lacked something the running one holds (memory for two packs, an exclusive device) is the
/// running one stopped and the new one built alone; when that fails too, the last
/// configuration that ran is built again.
///
/// `for_recording`: built for `ctl record on` alone, so it is not handed over when the
/// recording was switched off while it was built. Returns whether the running pipeline was
/// stopped for a new one.
///
/// Runs on the reload thread, under the reload lock: a SIGHUP during a rebuild waits for it.
pub(super) fn rebuild(shared: &Arc<Shared>, new: DaemonConfig, for_recording: bool) -> bool {
    tracing::warn!("building a new pipeline beside the running one");
    let t0 = Instant::now();
    match build_pipeline(&new, &shared.resources) {
        Ok(built) if !shared.life.stopping() => {
            // The recording's lock, then the configuration's: the order `ctl record` takes them.
            let Ok(record) = shared.record.lock() else {
                return false;
            };
            if for_recording && !record.wanted {
                if let Some(r) = &built.recording {
                    r.discard();
                }
                drop(record);
                finish_reload(
                    shared,
                    Ok("the recording was switched off while its pipeline was built: the running conversation goes on, nothing was recorded".into()),
                );
                return false;
            }
            tracing::info!(
                after_ms = t0.elapsed().as_millis() as u64,
                "new pipeline built; replacing the running one"
            );
            let old = shared.life.replace_with(built);
            if let Ok(mut c) = shared.config.lock() {
                *c = new;
            }
            drop(record);
            if let Some(old) = old {
                old.handle.stop();
            }
            finish_reload(
                shared,
                Ok("new pipeline built beside the running one".into()),
            );
            true
        }
        Ok(_) => false,
        Err(e) if may_build_alone(&e) => {
            tracing::warn!(
                "the new pipeline could not be built beside the running one ({e:#}); stopping the running one and building the new one alone"
            );
            if let Ok(mut c) = shared.config.lock() {
                *c = new;
            }
            // The main loop ends this reload, once it has built (or failed to build) alone.
            if let Some(old) = shared.life.build_alone() {
                old.handle.stop();
            }
            true
        }
        Err(e) => {
            finish_reload(shared, Err(format!("{e:#}")));
            false
        }
    }
}

/// SIGHUP: read the configuration again and check it whole before touching anything; apply
/// persona and sampling at the next frame boundary, move a device stage, or rebuild; reject an
/// invalid configuration and keep running.
pub(super) fn reload(shared: &Arc<Shared>, explicit: Option<PathBuf>) {
    let Ok(_one) = shared.reloading.lock() else {
        return;
    };
    let own = shared.socket.lock().ok().and_then(|s| s.clone());
    let mut new = match check_all(explicit.as_deref(), own.as_deref()) {
        Ok(c) => c,
        Err(e) => return finish_reload(shared, Err(format!("{e:#}"))),
    };
    let Some(cur) = lock(&shared.config) else {
        return;
    };
    // Recording is switched at run time (`ctl record on|off`); the file's `record` applies at
    // start-up.
    new.record = shared.record_state().wanted;
    if new.metrics_address != cur.metrics_address || new.control_socket != cur.control_socket {
        tracing::warn!(
            "reload: `metrics_address` and `control_socket` are bound at start-up; the new values apply after a restart"
        );
        new.metrics_address = cur.metrics_address;
        new.control_socket = cur.control_socket.clone();
    }
    // What the models are built with (the voice and the tokenizer are read when the LM stage
    // is built, a seed starts its random stream, the step cap counts from the start): a rebuild, built beside the running one.
    if new.pack != cur.pack
        || new.execution_provider != cur.execution_provider
        || new.pipeline != cur.pipeline
        || new.voice != cur.voice
        || new.tokenizer != cur.tokenizer
        || new.long_session != cur.long_session
        || new.echo_cancel != cur.echo_cancel
        || new.max_steps != cur.max_steps
        || new.sampling.seeds() != cur.sampling.seeds()
    {
        rebuild(shared, new, false);
        return;
    }
    let live = shared.live();
    // Sent now, applied by the stage at its next frame (not waited for here).
    let send = |stage: Option<&str>, command: &str, arg: &str| {
        let Some(live) = &live else { return };
        let sent = match stage {
            Some(s) => live.send_to(s, command, arg),
            None => live.send(command, arg),
        };
        if let Err(e) = sent {
            tracing::error!("reload: {command}: {e}");
        }
    };
    let mut changed = Vec::new();
    if new.persona != cur.persona || new.persona_tokens != cur.persona_tokens {
        let p = if new.persona_tokens.is_empty() {
            new.persona.clone()
        } else {
            new.persona_tokens
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        send(None, "persona", &p);
        tracing::info!("reload: persona changes at the next frame");
        changed.push("persona");
    }
    if new.sampling != cur.sampling {
        send(None, "sampling", &new.sampling.command_arg());
        tracing::info!("reload: sampling changes at the next frame");
        changed.push("sampling");
    }
    // A new device: only the stage that owns it moves, at its next frame; the models and the
    // conversation are untouched.
    for (what, stage, old, spec) in [
        ("input", MIC_STAGE, &cur.input_device, &new.input_device),
        (
            "output",
            SPEAKER_STAGE,
            &cur.output_device,
            &new.output_device,
        ),
    ] {
        if old != spec {
            tracing::info!("reload: {what} device {old:?} -> {spec:?} at the next frame");
            send(Some(stage), "switch", spec);
            changed.push(what);
        }
    }
    // Checked whole, and applied to the running pipeline: this is now what runs.
    if let Ok(mut g) = shared.last_good.lock() {
        *g = new.clone();
    }
    if let Ok(mut g) = shared.config.lock() {
        *g = new;
    }
    finish_reload(
        shared,
        Ok(if changed.is_empty() {
            "nothing to change".into()
        } else {
            format!("{} at the next frame", changed.join(", "))
        }),
    );
}
