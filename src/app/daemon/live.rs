//! The running pipeline as the daemon sees it: its handle (stop, commands, readiness, the
//! stages' status) and its monitor (verdicts, real-time factor); what `ctl status`,
//! `/healthz` and the watchdog read, and where the control socket's commands go.
//!
//! The daemon's pipeline file names its device stages `mic` and `speaker`, its LM stage
//! `temporal` and its echo canceller `aec` (the configuration's overrides name them too);
//! commands go to whichever stage declares them.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::config::{AEC_STAGE as AEC, LM_STAGE, MIC_STAGE, SPEAKER_STAGE};
use crate::observe::monitor::Monitor;
use crate::runtime::{ControlError, Handle, Pending, Value};

/// One running pipeline.
#[derive(Clone)]
pub(super) struct Live {
    pub handle: Handle,
    pub monitor: Arc<Monitor>,
    /// The conversation's recording, when it is recorded.
    pub recording: Option<Arc<crate::observe::record::Recording>>,
    /// Why echo cancellation is on or off.
    pub echo: String,
}

/// A status value as JSON.
pub(super) fn json(v: &Value) -> serde_json::Value {
    v.to_json()
}

impl Live {
    /// Every stage's status.
    pub fn stages(&self) -> BTreeMap<String, BTreeMap<&'static str, Value>> {
        self.handle.control().status()
    }

    /// The LM's agent frames so far.
    pub fn frames(&self) -> Option<u64> {
        match self.handle.control().get(LM_STAGE, "agent_frames") {
            Some(Value::Int(i)) => u64::try_from(i).ok(),
            _ => None,
        }
    }

    /// No device stage reports its device as anything but running (one that has not reported
    /// yet is not down).
    pub fn devices_running(&self) -> bool {
        self.stages().values().all(|s| match s.get("device") {
            Some(Value::Text(state)) => state == "running",
            _ => true,
        })
    }

    /// Sends `command` to the one stage that takes it.
    ///
    /// # Errors
    ///
    /// When no stage takes it, or the stage cannot take it now.
    pub fn send(&self, command: &str, arg: &str) -> Result<Pending, String> {
        let plane = self.handle.control();
        let stages = plane.stages_taking(command);
        let Some(stage) = stages.first() else {
            return Err(format!(
                "no stage of the running pipeline takes `{command}`"
            ));
        };
        plane
            .send(stage, command, arg)
            .map_err(|e: ControlError| e.to_string())
    }

    /// Sends `command` to stage `stage`.
    ///
    /// # Errors
    ///
    /// When the stage does not take it, or cannot take it now.
    pub fn send_to(&self, stage: &str, command: &str, arg: &str) -> Result<Pending, String> {
        self.handle
            .control()
            .send(stage, command, arg)
            .map_err(|e| e.to_string())
    }

    /// The status block: headline figures of the pipeline, then every stage's status.
    pub fn status(&self) -> serde_json::Value {
        let stages = self.stages();
        let get = |stage: &str, key: &str| {
            stages
                .get(stage)
                .and_then(|s| s.get(key))
                .map(json)
                .unwrap_or(serde_json::Value::Null)
        };
        let by_stage = |key: &str| -> serde_json::Map<String, serde_json::Value> {
            stages
                .iter()
                .filter_map(|(n, s)| Some((n.clone(), json(s.get(key)?))))
                .collect()
        };
        let verdicts: serde_json::Map<String, serde_json::Value> = self
            .monitor
            .verdicts()
            .into_iter()
            .map(|(n, p)| (n, p.name().into()))
            .collect();
        serde_json::json!({
            "frames": get(LM_STAGE, "agent_frames"),
            "context": get(LM_STAGE, "context"),
            "realtime_factor": (self.monitor.realtime_factor() * 1000.0).round() / 1000.0,
            "devices": {
                "input": { "name": get(MIC_STAGE, "name"), "state": get(MIC_STAGE, "device") },
                "output": { "name": get(SPEAKER_STAGE, "name"), "state": get(SPEAKER_STAGE, "device") },
            },
            "echo_cancel": {
                "state": get(AEC, "state"),
                "why": self.echo,
                "erle_db": get(AEC, "erle_db"),
                "delay_ms": get(AEC, "delay_ms"),
                "double_talk": get(AEC, "double_talk"),
            },
            "execution_providers": by_stage("model"),
            "verdicts": verdicts,
            "stages": stages
                .iter()
                .map(|(n, s)| {
                    let m: serde_json::Map<String, serde_json::Value> =
                        s.iter().map(|(k, v)| (k.to_string(), json(v))).collect();
                    (n.clone(), serde_json::Value::Object(m))
                })
                .collect::<serde_json::Map<_, _>>(),
        })
    }
}
