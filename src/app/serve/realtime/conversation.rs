//! The realtime API's conversation as its clients keep it: items with ids, and responses that
//! open and close around the agent's audio. A full-duplex model speaks when it chooses, so a
//! response is a stretch of its output: one opens when the session is ready, or at the model's
//! next frame after the last one closed; it closes `completed` when the agent's utterance in
//! it has ended ([`TURN_END_FRAMES`] without a word after one; [`LISTEN_MAX_FRAMES`] when it
//! said none: the agent listens) or the client asks for a new one (`response.create`), and
//! `cancelled` at an interruption (the client's `response.cancel`, the user's speech). The
//! frameworks run one response at a time and queue what they ask for behind it, so every
//! response ends. Each response has one assistant message item with one audio part, announced as
//! OpenAI's server announces it (`response.created`, `response.output_item.added`,
//! `conversation.item.added`, `response.content_part.added`, the deltas, then the `…done`
//! events and `response.done` with its status and usage), so that the frameworks' bookkeeping
//! (Pipecat's, LiveKit's) finds what it expects.
//!
//! Pure bookkeeping: it makes events (JSON, without `event_id`), sends nothing, and knows
//! nothing of the session or the socket.

use serde_json::{json, Value};

use super::Names;

/// Items kept for `conversation.item.retrieve`, `.delete` and `.truncate`: the newest.
const KEPT_ITEMS: usize = 256;

/// The agent's frames (80 ms) without a word that end its utterance, and its response.
pub(super) const TURN_END_FRAMES: u32 = 8;
/// The frames of a response in which the agent says nothing (it listens) before it closes.
pub(super) const LISTEN_MAX_FRAMES: u32 = 25;

/// An open response.
#[derive(Debug, Clone)]
struct Open {
    id: String,
    item: String,
    /// The transcript so far (the agent's words, as said).
    transcript: String,
    /// What the client's `response.create` gave as `metadata` (echoed), or the session's id.
    metadata: Value,
    /// Audio deltas sent.
    frames: u64,
    /// Audio deltas since the last word (or since the start).
    quiet: u32,
    /// A word has been said in it.
    said: bool,
}

/// The conversation of one connection. See the module doc.
#[derive(Debug)]
pub(super) struct Conversation {
    /// Which names the events use.
    pub(super) names: Names,
    stamp: String,
    next_id: u64,
    items: Vec<(String, Value)>,
    response: Option<Open>,
    /// The metadata of every response the server opens of its own accord.
    pub(super) metadata: Value,
    /// When the last response closed.
    pub(super) closed_at: Option<std::time::Instant>,
}

impl Conversation {
    pub(super) fn new(names: Names, stamp: String) -> Self {
        Conversation {
            names,
            stamp,
            next_id: 0,
            items: Vec::new(),
            response: None,
            metadata: json!({}),
            closed_at: None,
        }
    }

    /// A fresh id with `prefix` (`resp`, `item`).
    pub(super) fn id(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}_{}_{}", self.stamp, self.next_id)
    }

    /// The id of the last item, if any.
    fn last_item(&self) -> Option<String> {
        self.items.last().map(|(id, _)| id.clone())
    }

    fn keep(&mut self, id: String, item: Value) {
        self.items.retain(|(i, _)| *i != id);
        self.items.push((id, item));
        if self.items.len() > KEPT_ITEMS {
            self.items.remove(0);
        }
    }

    /// Whether a response is open.
    #[cfg(test)]
    pub(super) fn responding(&self) -> bool {
        self.response.is_some()
    }

    /// The item added (GA: `conversation.item.added` then `.done`; beta:
    /// `conversation.item.created`), after `previous`.
    fn item_events(&self, previous: Option<String>, item: &Value, done: bool) -> Vec<Value> {
        let mut out = Vec::new();
        if self.names != Names::Beta {
            out.push(json!({"type": "conversation.item.added", "previous_item_id": previous, "item": item}));
            if done {
                out.push(json!({"type": "conversation.item.done", "previous_item_id": previous, "item": item}));
            }
        }
        if self.names != Names::Ga {
            out.push(json!({"type": "conversation.item.created", "previous_item_id": previous, "item": item}));
        }
        out
    }

    /// Adds an item of the client's (`conversation.item.create`), completed, with its id or a
    /// fresh one; returns its id and the events that announce it.
    pub(super) fn add(
        &mut self,
        mut item: Value,
        previous: Option<String>,
    ) -> (String, Vec<Value>) {
        let id = match item.get("id").and_then(Value::as_str) {
            Some(id) if !id.is_empty() => id.to_string(),
            _ => self.id("item"),
        };
        item["id"] = json!(id);
        item["object"] = json!("realtime.item");
        item["status"] = json!("completed");
        let previous = previous.or_else(|| self.last_item());
        let events = self.item_events(previous, &item, true);
        self.keep(id.clone(), item);
        (id, events)
    }

    /// The user's audio up to now, committed as an item (`input_audio_buffer.committed` and the
    /// item's events), with the id given (the one the detector announced) or a fresh one.
    pub(super) fn commit(&mut self, id: Option<String>) -> Vec<Value> {
        let previous = self.last_item();
        let id = id.unwrap_or_else(|| self.id("item"));
        let item = json!({
            "id": id, "object": "realtime.item", "type": "message", "status": "completed",
            "role": "user", "content": [{"type": "input_audio", "transcript": null}],
        });
        let mut out = vec![json!({
            "type": "input_audio_buffer.committed",
            "previous_item_id": previous,
            "item_id": id,
        })];
        out.extend(self.item_events(previous, &item, true));
        self.keep(id, item);
        out
    }

    /// The item `id`, when it is kept.
    pub(super) fn item(&self, id: &str) -> Option<&Value> {
        self.items.iter().find(|(i, _)| i == id).map(|(_, v)| v)
    }

    /// Forgets the item `id`; whether it was kept.
    pub(super) fn delete(&mut self, id: &str) -> bool {
        let before = self.items.len();
        self.items.retain(|(i, _)| i != id);
        before != self.items.len()
    }

    /// Opens a response (see the module doc): its `metadata` is echoed in `response.created`.
    pub(super) fn open(&mut self, metadata: Option<Value>) -> Vec<Value> {
        let metadata = metadata.unwrap_or_else(|| self.metadata.clone());
        let id = self.id("resp");
        let item = self.id("item");
        let previous = self.last_item();
        let message = json!({
            "id": item, "object": "realtime.item", "type": "message", "status": "in_progress",
            "role": "assistant", "content": [],
        });
        let mut out = vec![
            json!({"type": "response.created", "response": {
                "id": id, "object": "realtime.response", "status": "in_progress",
                "status_details": null, "output": [], "output_modalities": ["audio"],
                "metadata": metadata, "usage": null,
            }}),
            json!({"type": "response.output_item.added", "response_id": id, "output_index": 0, "item": message}),
        ];
        out.extend(self.item_events(previous, &message, false));
        out.push(json!({
            "type": "response.content_part.added", "response_id": id, "item_id": item,
            "output_index": 0, "content_index": 0, "part": {"type": "audio", "transcript": ""},
        }));
        self.keep(item.clone(), message);
        self.response = Some(Open {
            id,
            item,
            transcript: String::new(),
            metadata,
            frames: 0,
            quiet: 0,
            said: false,
        });
        out
    }

    /// Closes the open response with `status` (`completed`, `cancelled` for `reason`:
    /// `client_cancelled`, `turn_detected`); nothing when none is open.
    pub(super) fn close(&mut self, status: &str, reason: Option<&str>) -> Vec<Value> {
        let Some(r) = self.response.take() else {
            return Vec::new();
        };
        self.closed_at = Some(std::time::Instant::now());
        let (id, item) = (&r.id, &r.item);
        let part = json!({"type": "audio", "transcript": r.transcript});
        let done = json!({
            "id": item, "object": "realtime.item", "type": "message",
            "status": if status == "completed" { "completed" } else { "incomplete" },
            "role": "assistant",
            "content": [{"type": "output_audio", "transcript": r.transcript}],
        });
        let at = |t: &str| json!({"type": t, "response_id": id, "item_id": item, "output_index": 0, "content_index": 0});
        let mut out = Vec::new();
        for (ga, beta) in [
            ("response.output_audio.done", "response.audio.done"),
            (
                "response.output_audio_transcript.done",
                "response.audio_transcript.done",
            ),
        ] {
            for t in self.spelled(ga, beta) {
                let mut e = at(t);
                if ga.ends_with("transcript.done") {
                    e["transcript"] = json!(r.transcript);
                }
                out.push(e);
            }
        }
        let mut part_done = at("response.content_part.done");
        part_done["part"] = part;
        out.push(part_done);
        out.push(json!({"type": "response.output_item.done", "response_id": id, "output_index": 0, "item": done}));
        if self.names != Names::Beta {
            let previous = self
                .items
                .iter()
                .rev()
                .skip_while(|(i, _)| i != item)
                .nth(1)
                .map(|(i, _)| i.clone());
            out.push(json!({"type": "conversation.item.done", "previous_item_id": previous, "item": done}));
        }
        let details = match status {
            "cancelled" => {
                json!({"type": "cancelled", "reason": reason.unwrap_or("client_cancelled")})
            }
            _ => Value::Null,
        };
        // Audio tokens: the agent's frames (one per 80 ms, a token per codebook in the model;
        // counted here as frames, the unit a client can check against the audio it got).
        let tokens = json!({"cached_tokens": 0, "text_tokens": 0, "audio_tokens": r.frames, "image_tokens": 0});
        out.push(json!({"type": "response.done", "response": {
            "id": id, "object": "realtime.response", "status": status,
            "status_details": details, "output": [done], "output_modalities": ["audio"],
            "metadata": r.metadata,
            "usage": {
                "total_tokens": r.frames, "input_tokens": 0, "output_tokens": r.frames,
                "input_token_details": {"cached_tokens": 0, "text_tokens": 0, "audio_tokens": 0, "image_tokens": 0},
                "output_token_details": tokens,
            },
        }}));
        self.keep(item.clone(), done);
        out
    }

    /// The names of one event under the connection's spelling.
    fn spelled<'a>(&self, ga: &'a str, beta: &'a str) -> Vec<&'a str> {
        match self.names {
            Names::Ga => vec![ga],
            Names::Beta => vec![beta],
            Names::Both => vec![ga, beta],
        }
    }

    /// A delta of the agent's (`audio`: base64 in the output format; else transcript text),
    /// opening a response first when none is open.
    pub(super) fn delta(&mut self, audio: bool, delta: String) -> Vec<Value> {
        let mut out = Vec::new();
        if self.response.is_none() {
            out = self.open(None);
        }
        let Some(r) = self.response.as_mut() else {
            return out;
        };
        if audio {
            r.frames += 1;
            r.quiet += 1;
        } else {
            r.transcript.push_str(&delta);
            r.quiet = 0;
            r.said = true;
        }
        let ended = audio
            && if r.said {
                r.quiet >= TURN_END_FRAMES
            } else {
                r.quiet >= LISTEN_MAX_FRAMES
            };
        let (id, item) = (r.id.clone(), r.item.clone());
        let (ga, beta) = if audio {
            ("response.output_audio.delta", "response.audio.delta")
        } else {
            (
                "response.output_audio_transcript.delta",
                "response.audio_transcript.delta",
            )
        };
        for t in self.spelled(ga, beta) {
            out.push(json!({
                "type": t, "response_id": id, "item_id": item, "output_index": 0,
                "content_index": 0, "delta": delta,
            }));
        }
        // The agent's turn ended with this frame: the next one opens the next response.
        if ended {
            out.extend(self.close("completed", None));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(events: &[Value]) -> Vec<&str> {
        events.iter().filter_map(|e| e["type"].as_str()).collect()
    }

    #[test]
    fn a_response_opens_at_the_first_delta_and_closes_with_its_status_and_transcript() {
        let mut c = Conversation::new(Names::Ga, "t".into());
        let first = c.delta(true, "AAAA".into());
        assert_eq!(
            types(&first),
            [
                "response.created",
                "response.output_item.added",
                "conversation.item.added",
                "response.content_part.added",
                "response.output_audio.delta"
            ]
        );
        let rid = first[0]["response"]["id"].as_str().unwrap().to_string();
        assert_eq!(first[4]["response_id"], rid.as_str());
        c.delta(false, "hel".into());
        c.delta(false, "lo".into());
        assert!(c.responding());
        let done = c.close("cancelled", Some("turn_detected"));
        assert_eq!(
            types(&done),
            [
                "response.output_audio.done",
                "response.output_audio_transcript.done",
                "response.content_part.done",
                "response.output_item.done",
                "conversation.item.done",
                "response.done"
            ]
        );
        assert_eq!(done[1]["transcript"], "hello");
        let r = &done[5]["response"];
        assert_eq!(r["id"], rid.as_str());
        assert_eq!(r["status"], "cancelled");
        assert_eq!(r["status_details"]["type"], "cancelled");
        assert_eq!(r["status_details"]["reason"], "turn_detected");
        assert_eq!(r["usage"]["output_tokens"], 1);
        assert!(!c.responding());
        assert!(
            c.close("completed", None).is_empty(),
            "nothing open: nothing closed"
        );
        // The next delta opens a new response, with a new id.
        let next = c.delta(true, "AAAA".into());
        assert_ne!(next[0]["response"]["id"], rid.as_str());
    }

    #[test]
    fn a_response_completes_when_the_agents_utterance_ends_or_it_has_listened_long() {
        let mut c = Conversation::new(Names::Ga, "t".into());
        let done = |c: &mut Conversation, audio: bool| {
            c.delta(audio, "x".into())
                .iter()
                .any(|e| e["type"] == "response.done")
        };
        // A word, then frames without one: the response completes with the last of them.
        assert!(!done(&mut c, true));
        assert!(!done(&mut c, false));
        for _ in 1..TURN_END_FRAMES {
            assert!(!done(&mut c, true));
        }
        assert!(done(&mut c, true));
        assert!(!c.responding());
        // A word keeps it going; with none at all it ends after the listening stretch.
        for _ in 1..LISTEN_MAX_FRAMES {
            assert!(!done(&mut c, true));
        }
        assert!(done(&mut c, true));
    }

    #[test]
    fn items_get_ids_and_can_be_retrieved_and_deleted() {
        let mut c = Conversation::new(Names::Beta, "t".into());
        let (id, ev) = c.add(
            json!({"type": "message", "role": "system", "content": []}),
            None,
        );
        assert_eq!(types(&ev), ["conversation.item.created"]);
        assert_eq!(c.item(&id).unwrap()["status"], "completed");
        let (own, ev) = c.add(
            json!({"id": "mine", "type": "message", "role": "user"}),
            None,
        );
        assert_eq!(own, "mine");
        assert_eq!(ev[0]["previous_item_id"], id.as_str());
        let committed = c.commit(None);
        assert_eq!(committed[0]["type"], "input_audio_buffer.committed");
        assert!(committed[0]["item_id"].is_string());
        assert_eq!(committed[0]["previous_item_id"], "mine");
        assert!(c.delete("mine"));
        assert!(!c.delete("mine"));
        assert!(c.item("mine").is_none());
    }
}
