//! The user's turns on a `/v1/realtime` connection, as the server's voice-activity detector hears
//! them (OpenAI's `server_vad` semantics): the detector opened once per server
//! ([`open_detector`]), the connection's `turn_detection` ([`Turns`]), and what the user's
//! speech does: `input_audio_buffer.speech_started` (the agent's open response interrupted,
//! with `interrupt_response`), `speech_stopped` and the turn committed as an item. Knows nothing
//! of the session nor of the client's other events.

use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::deltas::Shared;
use super::events::TurnDetection;
use crate::app::serve::config::ServeConfig;
use crate::app::serve::session::Taken;
use crate::audio::phone::from_pcm16;
use crate::audio::MODEL_RATE;
use crate::config::{ConfigError, ConfigErrorKind};
use crate::model::vad::{Vad, VadEvent, VadSettings, VadStream};

/// Conversations spread over the detector's sessions.
static NEXT_TURN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Opens the voice-activity detector `realtime.vad_model` names, once per server.
///
/// # Errors
///
/// A [`ConfigError`] naming the key when the user named the file and it cannot be opened (the
/// built-in default's absence only leaves the detector off, logged).
pub(in crate::app::serve) fn open_detector(
    cfg: &ServeConfig,
) -> Result<Option<Arc<Vad>>, ConfigError> {
    let Some(path) = &cfg.realtime.vad_model else {
        tracing::info!("realtime: no voice-activity detector (`realtime.vad_model` is empty): clients get no speech events");
        return Ok(None);
    };
    match Vad::open(path) {
        Ok(v) => {
            tracing::info!(model = %path.display(), "realtime: voice-activity detector loaded");
            Ok(Some(Arc::new(v)))
        }
        Err(e) if cfg.realtime.vad_required => Err(ConfigError::new(
            &cfg.file,
            ConfigErrorKind::Read,
            format!("the voice-activity detector: {e}"),
        )
        .key("realtime.vad_model")),
        Err(e) => {
            tracing::warn!("realtime: no voice-activity detector ({e}; `tools/setup.sh` installs it): clients get no speech events");
            Ok(None)
        }
    }
}

/// The user's turns as the voice-activity detector hears them (OpenAI's `server_vad`).
pub(super) struct Turns {
    /// The server's detector (`None`: none).
    vad: Option<Arc<Vad>>,
    /// The client's `turn_detection` is not `null` (on by default, as OpenAI's).
    on: bool,
    settings: VadSettings,
    /// The user's speech ends the agent's response.
    interrupt: bool,
    /// This connection's detector, made at the first audio while on.
    stream: Option<VadStream>,
    /// The item the user's speech under way will be.
    item: Option<String>,
    /// Spreads conversations over the detector's sessions.
    turn: usize,
}

impl Turns {
    /// A connection's turns, with the server's detector (if any): on, with OpenAI's defaults.
    pub(super) fn new(vad: Option<Arc<Vad>>) -> Turns {
        Turns {
            vad,
            on: true,
            settings: VadSettings::default(),
            interrupt: true,
            stream: None,
            item: None,
            turn: NEXT_TURN.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// The `turn_detection` in effect: `server_vad` with its settings, or `null` (turned off,
    /// or the server has no detector).
    pub(super) fn detection(&self) -> Value {
        if !self.on || self.vad.is_none() {
            return Value::Null;
        }
        let s = self.settings;
        json!({
            "type": "server_vad",
            "threshold": s.threshold,
            "prefix_padding_ms": s.prefix_padding_ms,
            "silence_duration_ms": s.silence_duration_ms,
            // The model answers on its own: a response opens at its next frame.
            "create_response": true,
            "interrupt_response": self.interrupt,
            "idle_timeout_ms": null,
        })
    }

    /// Applies a `session.update`'s `turn_detection` (checked as it was parsed).
    pub(super) fn set(&mut self, td: Option<TurnDetection>, cx: &mut Taken<'_>) {
        let Some(td) = td else {
            self.on = false;
            self.stream = None;
            self.item = None;
            return;
        };
        if self.vad.is_none() && cx.first("no_detector") {
            tracing::info!(
                session = cx.id,
                "realtime: turn_detection asked for; this server has no voice-activity detector (`realtime.vad_model`)"
            );
        }
        self.on = true;
        let s = &mut self.settings;
        s.threshold = td.threshold.unwrap_or(s.threshold);
        s.prefix_padding_ms = td.prefix_padding_ms.unwrap_or(s.prefix_padding_ms);
        s.silence_duration_ms = td.silence_duration_ms.unwrap_or(s.silence_duration_ms);
        self.interrupt = td.interrupt_response.unwrap_or(self.interrupt);
        let settings = *s;
        if let Some(stream) = self.stream.as_mut() {
            stream.set(settings);
        }
    }

    /// The user's turns in `pcm` (16-bit 24 kHz, as the session gets it), as events (without
    /// their ids): the speech's start (the agent's open response then ends, with
    /// `interrupt_response`, once the session is `ready`) and its end (the turn then committed
    /// as an item).
    pub(super) fn detect(
        &mut self,
        pcm: &[u8],
        shared: &Mutex<Shared>,
        ready: bool,
        cx: &mut Taken<'_>,
    ) -> Vec<Value> {
        let Some(vad) = self.vad.clone().filter(|_| self.on) else {
            return Vec::new();
        };
        if self.stream.is_none() {
            self.stream = VadStream::new(MODEL_RATE, self.settings, self.turn).ok();
        }
        let Some(stream) = self.stream.as_mut() else {
            return Vec::new();
        };
        let samples: Vec<f32> = from_pcm16(pcm).collect();
        let found = match stream.push(&vad, &samples) {
            Ok(f) => f,
            Err(e) => {
                if cx.first("detector_failed") {
                    tracing::warn!(session = cx.id, "realtime: the voice-activity detector failed ({e}); this session's turns go unreported");
                }
                self.on = false;
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for event in found {
            let Ok(mut s) = shared.lock() else {
                break;
            };
            match event {
                VadEvent::Started { ms } => {
                    let item = s.conv.id("item");
                    self.item = Some(item.clone());
                    if self.interrupt && ready {
                        s.interrupt("turn_detected");
                    }
                    out.push(json!({
                        "type": "input_audio_buffer.speech_started",
                        "audio_start_ms": ms,
                        "item_id": item,
                    }));
                }
                VadEvent::Stopped { ms } => {
                    let item = self.item.take().unwrap_or_else(|| s.conv.id("item"));
                    let committed = s.conv.commit(Some(item.clone()));
                    out.push(json!({
                        "type": "input_audio_buffer.speech_stopped",
                        "audio_end_ms": ms,
                        "item_id": item,
                    }));
                    out.extend(committed);
                }
            }
        }
        out
    }
}
