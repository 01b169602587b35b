//! The client's events about the conversation ([`conversation`](super::conversation)):
//! responses asked for and cancelled, items created, retrieved, deleted and truncated; each
//! answered as OpenAI answers it. Knows the connection's shared state, not the socket.

use axum::extract::ws::Message;
use serde_json::{json, Value};

use super::super::config::shown;
use super::super::session::Taken;
use super::{Conversation, Phase, Realtime};

/// How long after a response closed a `response.cancel` is taken as meant for it: the
/// frameworks cancel at a barge-in, sometimes twice, while the server may have closed the
/// response already (the user's speech, the agent's turn's end).
const CANCEL_LATE: std::time::Duration = std::time::Duration::from_secs(2);

/// `metadata` with the server's own keys added (the session's id).
pub(super) fn merged(mut metadata: Value, own: &Value) -> Value {
    if let (Value::Object(m), Value::Object(o)) = (&mut metadata, own) {
        for (k, v) in o {
            m.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    metadata
}

impl Realtime {
    /// The error for an item id this conversation does not have.
    fn no_item(
        &mut self,
        cx: &mut Taken<'_>,
        code: &str,
        item_id: &str,
        client_event: Option<&str>,
    ) -> Message {
        let m = format!("Item with item_id not found: {}", shown(item_id));
        self.refuse(cx, "bad_event", code, &m, Some("item_id"), client_event)
    }

    /// The events `f` makes of the conversation, as messages.
    pub(super) fn conversation(
        &mut self,
        f: impl FnOnce(&mut Conversation) -> Vec<Value>,
    ) -> Vec<Message> {
        let events = match self.shared.lock() {
            Ok(mut s) => f(&mut s.conv),
            Err(_) => Vec::new(),
        };
        events.into_iter().map(|v| self.event(v)).collect()
    }

    /// `response.create`: before the session is ready, it starts the session (its first
    /// response echoes `metadata`); after, the open response completes and a new one opens,
    /// echoing `metadata`, at the model's next frame.
    pub(super) fn create_response(&mut self, metadata: Option<Value>) -> Vec<Message> {
        if self.phase != Phase::Ready {
            self.ask();
            self.first_metadata = metadata;
            return Vec::new();
        }
        if let Ok(mut s) = self.shared.lock() {
            let own = s.conv.metadata.clone();
            let mut events = s.conv.close("completed", None);
            events.extend(
                s.conv
                    .open(Some(metadata.map_or(own.clone(), |m| merged(m, &own)))),
            );
            s.pending.extend(events);
        }
        Vec::new()
    }

    /// `conversation.item.create`: the item kept with an id, and announced. A system or
    /// developer message's text joins the persona while the session has not started; after,
    /// it is kept and said to take no effect (the model was primed). A user's text is kept:
    /// the model hears audio only.
    pub(super) fn create_item(
        &mut self,
        item: Value,
        previous: Option<String>,
        cx: &mut Taken<'_>,
    ) -> Vec<Message> {
        let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
        if matches!(role, "system" | "developer") {
            let text: Vec<&str> = item
                .get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|c| c.get("text").and_then(Value::as_str))
                .collect();
            let text = text.join("\n");
            if !text.trim().is_empty() && self.waiting() {
                let persona = match self.instructions.trim() {
                    "" => text,
                    p => format!("{p}\n{text}"),
                };
                let mut pairs = self.pairs.clone();
                pairs.retain(|(k, _)| k != "text_prompt");
                pairs.push(("text_prompt".into(), persona.clone()));
                if self.cfg.session_params(&pairs).is_ok() {
                    self.pairs = pairs;
                    self.instructions = persona;
                } else if cx.first("persona_item_refused") {
                    tracing::info!(session = cx.id, "realtime: a {role} message would make the persona too long; kept as an item only");
                }
            } else if !text.trim().is_empty() && cx.first("persona_item_late") {
                tracing::info!(session = cx.id, "realtime: a {role} message after the conversation started is kept as an item; the persona stays (the model was primed with it)");
            }
        }
        self.conversation(|c| c.add(item, previous).1)
    }

    /// `response.cancel`: the open response closes `cancelled` (its events sent in order
    /// with the deltas), and the rest of the agent's utterance is held back. With none open
    /// because one has just closed (an interruption under way, or within [`CANCEL_LATE`]), the
    /// cancel meant that one, which its `response.done` answers; with none at all, the error
    /// the frameworks take as the answer it is.
    pub(super) fn cancel_response(&mut self, client_event: Option<&str>) -> Vec<Message> {
        let answered = self
            .shared
            .lock()
            .map(|mut s| {
                s.interrupt("client_cancelled")
                    || s.hold.is_some()
                    || s.conv.closed_at.is_some_and(|t| t.elapsed() < CANCEL_LATE)
            })
            .unwrap_or(false);
        if answered {
            return Vec::new();
        }
        vec![self.error(
            "response_cancel_not_active",
            "Cancellation failed: no active response found",
            None,
            client_event,
        )]
    }

    /// `conversation.item.retrieve`.
    pub(super) fn retrieve_item(
        &mut self,
        item_id: &str,
        cx: &mut Taken<'_>,
        client_event: Option<&str>,
    ) -> Vec<Message> {
        let found = self
            .shared
            .lock()
            .ok()
            .and_then(|s| s.conv.item(item_id).cloned());
        match found {
            Some(item) => {
                vec![self.event(json!({"type": "conversation.item.retrieved", "item": item}))]
            }
            None => vec![self.no_item(cx, "item_retrieve_invalid_item_id", item_id, client_event)],
        }
    }

    /// `conversation.item.delete`.
    pub(super) fn delete_item(
        &mut self,
        item_id: &str,
        cx: &mut Taken<'_>,
        client_event: Option<&str>,
    ) -> Vec<Message> {
        if self.shared.lock().is_ok_and(|mut s| s.conv.delete(item_id)) {
            return vec![
                self.event(json!({"type": "conversation.item.deleted", "item_id": item_id}))
            ];
        }
        vec![self.no_item(cx, "item_delete_invalid_item_id", item_id, client_event)]
    }

    /// `conversation.item.truncate`: what the client played of an item of the agent's, for its
    /// bookkeeping; the model has heard the user interrupt it already.
    pub(super) fn truncate_item(
        &mut self,
        item_id: &str,
        content_index: u64,
        audio_end_ms: u64,
        cx: &mut Taken<'_>,
        client_event: Option<&str>,
    ) -> Vec<Message> {
        if self
            .shared
            .lock()
            .is_ok_and(|s| s.conv.item(item_id).is_some())
        {
            return vec![self.event(json!({
                "type": "conversation.item.truncated",
                "item_id": item_id,
                "content_index": content_index,
                "audio_end_ms": audio_end_ms,
            }))];
        }
        vec![self.no_item(cx, "item_truncate_invalid_item_id", item_id, client_event)]
    }
}
