//! `GET /api/chat`: Kyutai's protocol (docs/PROTOCOL.md), binary messages whose first byte is
//! their kind: 0 handshake (always the first message, as soon as the session is primed, also
//! before an error), 4 metadata (right after it: Kyutai's `ServerInfo` fields and duplex's own,
//! the session id among them), 1 audio, 2 text, 5 error are sent; 1 is read, 3 (control) and
//! unknown kinds are ignored (counted, logged once). The session's template keeps its Ogg/Opus
//! ends: the client's audio goes to `opus_decode` as it came. Knows the session only through
//! its [`Protocol`] seam.

use axum::extract::ws::Message;

use super::config::ServeConfig;
use super::session::{Encoder, Protocol, Taken};
use crate::observe::names;
use crate::session::Outbound;

/// Kinds of the protocol's messages.
const HANDSHAKE: u8 = 0;
const AUDIO: u8 = 1;
const TEXT: u8 = 2;
const CONTROL: u8 = 3;
const METADATA: u8 = 4;
const ERROR: u8 = 5;

fn message(kind: u8, payload: &[u8]) -> Message {
    let mut v = Vec::with_capacity(payload.len() + 1);
    v.push(kind);
    v.extend_from_slice(payload);
    Message::Binary(v.into())
}

/// Kyutai's protocol (docs/PROTOCOL.md): binary messages whose first byte is their kind.
pub(crate) struct Kyutai {
    query: Vec<(String, String)>,
}

impl Kyutai {
    pub(crate) fn new(query: Vec<(String, String)>) -> Self {
        Kyutai { query }
    }
}

struct KyutaiEncoder;

impl Encoder for KyutaiEncoder {
    fn encode(&mut self, m: Outbound) -> Vec<Message> {
        match m {
            Outbound::Audio(b) => vec![message(AUDIO, &b)],
            Outbound::Text(t) => vec![message(TEXT, t.as_bytes())],
            // Not made by an Ogg/Opus template's pipeline.
            Outbound::Pcm(_) => Vec::new(),
        }
    }
}

impl Protocol for Kyutai {
    fn params(&mut self, cfg: &ServeConfig) -> Result<super::config::SessionParams, String> {
        cfg.session_params(&self.query).inspect_err(|_| {
            metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => "bad_query").increment(1);
        })
    }

    fn ready(&mut self, meta: &serde_json::Value) -> Vec<Message> {
        // The 9-byte handshake (kind 0, protocol version 0, model version 0) first, always;
        // then the metadata.
        vec![
            message(HANDSHAKE, &[0; 8]),
            message(METADATA, meta.to_string().as_bytes()),
        ]
    }

    fn take(&mut self, m: Message, cx: &mut Taken<'_>) {
        let id = cx.id;
        match m {
            Message::Binary(b) => match b.first() {
                Some(&AUDIO) => cx.offer(b[1..].to_vec()),
                Some(&CONTROL) => {}
                k => {
                    cx.protocol_error("unknown_kind");
                    if cx.first("kind") {
                        tracing::info!(
                            session = id,
                            "ignored a message of unknown kind {k:?} (logged once per session)"
                        );
                    }
                }
            },
            Message::Text(_) => {
                cx.protocol_error("not_binary");
                if cx.first("text") {
                    tracing::info!(
                        session = id,
                        "ignored a text message: the protocol is binary (logged once per session)"
                    );
                }
            }
            _ => {}
        }
    }

    fn encoder(&self) -> Box<dyn Encoder> {
        Box::new(KyutaiEncoder)
    }

    fn refusal(&self, text: &str) -> Vec<Message> {
        // The handshake first: a client written against Kyutai's Python server takes the first
        // message as one.
        vec![message(HANDSHAKE, &[0; 8]), message(ERROR, text.as_bytes())]
    }

    fn failure(&self, text: &str) -> Vec<Message> {
        vec![message(ERROR, text.as_bytes())]
    }

    fn bad_audio(&self) -> (u16, &'static str) {
        (1007, "the audio is not a usable Ogg/Opus stream")
    }
}
