//! The writer's side of a `/v1/realtime` connection: the agent's audio (PCM16 or G.711) and
//! transcript as delta events of the open response ([`Deltas`]), after the events the protocol
//! queued for them ([`Shared`]: a response closed, a new one opened), and the rest of an
//! interrupted utterance held back ([`Hold`]) until it ends. Knows nothing of the client's
//! events nor of the session.

use std::sync::{Arc, Mutex};

use axum::extract::ws::Message;
use base64::Engine as _;
use serde_json::{json, Value};

use super::conversation::Conversation;
use super::events::Format;
use crate::app::serve::session::Encoder;
use crate::audio::phone::{to_pcm16, PhoneOut};
use crate::session::Outbound;

/// After an interruption (`response.cancel`, `output_audio_buffer.clear`, or the user's speech
/// when `interrupt_response` is on), the agent's audio is held back until its utterance ends:
/// this many frames (80 ms each) without a word of its transcript ...
const HOLD_QUIET_FRAMES: u32 = 3;
/// ... or this many frames at most (the model, which heard the user, usually stops on its own).
const HOLD_MAX_FRAMES: u32 = 25;

/// The agent's audio held back after an interruption: frames held, and frames since its last
/// word.
#[derive(Debug, Default)]
pub(super) struct Hold {
    frames: u32,
    quiet: u32,
}

/// What the encoder shares with the protocol.
pub(super) struct Shared {
    pub(super) output: Format,
    /// The items and the open response, and the names the events use.
    pub(super) conv: Conversation,
    /// Events to send before the agent's next delta (a response closed at the client's
    /// request, a new one opened): sent in order with the deltas, by the writer.
    pub(super) pending: Vec<Value>,
    /// The agent's audio held back after an interruption.
    pub(super) hold: Option<Hold>,
}

impl Shared {
    /// Closes the open response as `cancelled` for `reason`, and holds the agent's audio back
    /// until its utterance ends; whether a response was open.
    pub(super) fn interrupt(&mut self, reason: &str) -> bool {
        let done = self.conv.close("cancelled", Some(reason));
        let any = !done.is_empty();
        self.pending.extend(done);
        if any {
            self.hold = Some(Hold::default());
        }
        any
    }
}

/// The writer's side: the agent's audio and transcript as delta events.
pub(super) struct Deltas {
    shared: Arc<Mutex<Shared>>,
    /// G.711 output's encoder, and the format it was made for.
    phone: Option<(Format, PhoneOut)>,
    next_event: u64,
}

impl Deltas {
    /// The writer's side of the connection that shares `shared`.
    pub(super) fn new(shared: Arc<Mutex<Shared>>) -> Deltas {
        Deltas {
            shared,
            phone: None,
            next_event: 0,
        }
    }

    /// The events waiting for the writer, then the delta's (a response opened first when none
    /// is).
    fn events(&mut self, audio: bool, delta: String) -> Vec<Message> {
        let events = match self.shared.lock() {
            Ok(mut s) => {
                let mut out = std::mem::take(&mut s.pending);
                let held = match s.hold.as_mut() {
                    Some(h) => {
                        if audio {
                            h.frames += 1;
                            h.quiet += 1;
                        } else {
                            h.quiet = 0;
                        }
                        h.quiet <= HOLD_QUIET_FRAMES && h.frames < HOLD_MAX_FRAMES
                    }
                    None => false,
                };
                // The rest of the interrupted utterance is not sent.
                if held {
                    return messages(&mut self.next_event, out);
                }
                s.hold = None;
                out.extend(s.conv.delta(audio, delta));
                out
            }
            Err(_) => return Vec::new(),
        };
        messages(&mut self.next_event, events)
    }
}

/// The writer's `events` as messages, each with an `event_id` from its count `next`.
fn messages(next: &mut u64, events: Vec<Value>) -> Vec<Message> {
    events
        .into_iter()
        .map(|mut v| {
            *next += 1;
            v["event_id"] = json!(format!("event_duplex_out_{next}"));
            Message::Text(v.to_string().into())
        })
        .collect()
}

impl Encoder for Deltas {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match m {
            Outbound::Pcm(samples) => {
                let format = self.shared.lock().map_or(Format::Pcm16, |s| s.output);
                let bytes = match format {
                    Format::Pcm16 => to_pcm16(&samples),
                    Format::G711(law) => {
                        if self.phone.as_ref().map(|(f, _)| *f) != Some(format) {
                            self.phone = PhoneOut::new(law).ok().map(|p| (format, p));
                        }
                        match self.phone.as_mut() {
                            Some((_, p)) => p.encode(&samples),
                            None => return Vec::new(),
                        }
                    }
                };
                if bytes.is_empty() {
                    return Vec::new();
                }
                let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
                self.events(true, b64)
            }
            Outbound::Text(t) => self.events(false, t),
            // Not made by a template with PCM ends.
            Outbound::Audio(_) => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Names;
    use super::*;

    fn deltas() -> Deltas {
        Deltas::new(Arc::new(Mutex::new(Shared {
            output: Format::Pcm16,
            conv: Conversation::new(Names::Ga, "t".into()),
            pending: Vec::new(),
            hold: None,
        })))
    }

    fn types(messages: &[Message]) -> Vec<String> {
        messages
            .iter()
            .filter_map(|m| match m {
                Message::Text(t) => serde_json::from_str::<Value>(t.as_str()).ok(),
                _ => None,
            })
            .filter_map(|v| v["type"].as_str().map(str::to_string))
            .collect()
    }

    #[test]
    fn an_interruption_holds_the_agents_audio_back_until_its_utterance_ends() {
        let mut d = deltas();
        assert!(types(&d.events(true, "AA".into())).contains(&"response.output_audio.delta".into()));
        assert!(d.shared.lock().unwrap().interrupt("client_cancelled"));
        // The cancelled response's close goes out with the next frame, which is held back.
        let next = types(&d.events(true, "AA".into()));
        assert_eq!(next.last().map(String::as_str), Some("response.done"));
        assert!(!next.iter().any(|t| t.ends_with(".delta")));
        // Words keep the utterance going: held.
        for _ in 0..3 {
            assert!(types(&d.events(false, "word".into())).is_empty());
            assert!(types(&d.events(true, "AA".into())).is_empty());
        }
        // Then frames without a word (the one after the last word was the first): the
        // utterance ended; the next frame opens a response.
        for _ in 1..HOLD_QUIET_FRAMES {
            assert!(types(&d.events(true, "AA".into())).is_empty());
        }
        let back = types(&d.events(true, "AA".into()));
        assert_eq!(back.first().map(String::as_str), Some("response.created"));
        assert_eq!(
            back.last().map(String::as_str),
            Some("response.output_audio.delta")
        );
        // Nothing open: nothing to interrupt, nothing held.
        let mut idle = deltas();
        assert!(!idle.shared.lock().unwrap().interrupt("turn_detected"));
        assert!(!types(&idle.events(true, "AA".into())).is_empty());
    }

    #[test]
    fn a_hold_ends_after_its_longest_even_while_the_agent_talks_on() {
        let mut d = deltas();
        d.events(true, "AA".into());
        d.shared.lock().unwrap().interrupt("turn_detected");
        let mut held = 0;
        loop {
            d.events(false, "word".into());
            if types(&d.events(true, "AA".into()))
                .iter()
                .any(|t| t.ends_with("audio.delta"))
            {
                break;
            }
            held += 1;
            assert!(held <= HOLD_MAX_FRAMES, "held for ever");
        }
        assert_eq!(held + 1, HOLD_MAX_FRAMES);
    }
}
