//! A connection's two directions: the [`Writer`] (its own task: the protocol's replies first,
//! then the pipeline's messages once the session is open, each within the stall limit, then
//! the close) and the [`Inflow`] (what every incoming message costs: the message rate, the size
//! limit, the protocol's [`take`](super::Protocol::take) with its audio budget). Knows nothing
//! of the session's pipeline beyond its link.

use std::pin::Pin;
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::{Sink, SinkExt, Stream, StreamExt};

use super::protocol::{AudioBudget, Encoder, Protocol, Taken};
use super::Outcome;
use crate::app::serve::config::Limits;
use crate::observe::names;
use crate::session::Outbound;

/// What the writer is given besides the pipeline's messages.
pub(super) enum Reply {
    /// A message of the protocol's.
    Send(Message),
    /// The session is ready: the pipeline's messages may follow.
    Open,
    /// The end: what the pipeline still has (when the session was open), then these messages,
    /// then a close frame with this code and reason (or the answer to the client's close).
    Finish(Vec<Message>, Option<(u16, String)>),
}

/// Replies that may wait for the client.
pub(super) const REPLY_QUEUE: usize = 64;

/// Why the writer stopped.
pub(super) enum WriterEnd {
    /// It sent what it had, and the end.
    Done,
    /// The client did not take a message within `stall_timeout`.
    Stalled,
    /// The socket failed (the client is gone, or its write buffer is full).
    Gone,
}

/// The writing half of a client's connection: a WebSocket's, or a transport's own (WebRTC's
/// driver, which turns the messages into RTP and data-channel writes).
pub(crate) type ClientSink = Pin<Box<dyn Sink<Message, Error = axum::Error> + Send>>;
/// The reading half of a client's connection; its end is the client's.
pub(crate) type ClientStream = Pin<Box<dyn Stream<Item = Result<Message, axum::Error>> + Send>>;

/// A WebSocket's two halves, as [`run`] takes them.
pub(crate) fn halves(socket: WebSocket) -> (ClientSink, ClientStream) {
    let (sink, stream) = socket.split();
    (Box::pin(sink), Box::pin(stream))
}

/// The writing side of a connection.
pub(super) struct Writer {
    pub(super) sink: ClientSink,
    pub(super) encoder: Box<dyn Encoder>,
    pub(super) stall: Duration,
    pub(super) bytes_out: metrics::Counter,
}

impl Writer {
    /// Sends one message within the stall limit.
    async fn send(&mut self, m: Message) -> Result<(), WriterEnd> {
        let n = match &m {
            Message::Binary(b) => b.len(),
            Message::Text(t) => t.len(),
            _ => 0,
        } as u64;
        match tokio::time::timeout(self.stall, self.sink.send(m)).await {
            Ok(Ok(())) => {
                self.bytes_out.increment(n);
                Ok(())
            }
            Ok(Err(_)) => Err(WriterEnd::Gone),
            Err(_) => Err(WriterEnd::Stalled),
        }
    }

    async fn send_encoded(&mut self, m: Outbound) -> Result<(), WriterEnd> {
        for msg in self.encoder.encode(m) {
            self.send(msg).await?;
        }
        Ok(())
    }

    /// The protocol's replies first, then (once the session is open) the pipeline's messages,
    /// each sent within the stall limit; `ended` fires when the pipeline's outputs have ended.
    pub(super) async fn run(
        mut self,
        mut replies: tokio::sync::mpsc::Receiver<Reply>,
        mut outbound: tokio::sync::mpsc::Receiver<Outbound>,
        ended: tokio::sync::oneshot::Sender<()>,
    ) -> WriterEnd {
        let mut ended = Some(ended);
        let mut open = false;
        let result: Result<(), WriterEnd> = async {
            loop {
                let next = tokio::select! {
                    biased;
                    r = replies.recv() => Err(r),
                    m = outbound.recv(), if open && ended.is_some() => Ok(m),
                };
                match next {
                    Err(Some(Reply::Send(m))) => self.send(m).await?,
                    Err(Some(Reply::Open)) => open = true,
                    Err(Some(Reply::Finish(messages, close))) => {
                        if open {
                            while let Some(m) = outbound.recv().await {
                                self.send_encoded(m).await?;
                            }
                        }
                        for m in messages {
                            self.send(m).await?;
                        }
                        let _ = tokio::time::timeout(Duration::from_secs(2), async {
                            if let Some((code, reason)) = close {
                                let _ = self
                                    .sink
                                    .send(Message::Close(Some(CloseFrame {
                                        code,
                                        reason: reason.into(),
                                    })))
                                    .await;
                            }
                            let _ = self.sink.close().await;
                        })
                        .await;
                        return Ok(());
                    }
                    Err(None) => return Ok(()),
                    Ok(Some(m)) => self.send_encoded(m).await?,
                    Ok(None) => {
                        if let Some(e) = ended.take() {
                            let _ = e.send(());
                        }
                    }
                }
            }
        }
        .await;
        match result {
            Ok(()) => WriterEnd::Done,
            Err(e) => e,
        }
    }
}

/// The reading side of a connection: what every incoming message costs and where it goes.
pub(super) struct Inflow {
    id: u64,
    limits: Limits,
    /// Every message, pings included, is paid from this.
    rate: crate::audio::pace::TokenBucket,
    pub(super) last_heard: Instant,
    warned: std::collections::HashSet<&'static str>,
    bytes_in: metrics::Counter,
    replies: tokio::sync::mpsc::Sender<Reply>,
    /// The close code and reason when the client broke a rule.
    pub(super) close: Option<(u16, &'static str)>,
    budget: AudioBudget,
}

impl Inflow {
    pub(super) fn new(
        id: u64,
        limits: Limits,
        replies: tokio::sync::mpsc::Sender<Reply>,
        budget: AudioBudget,
    ) -> Self {
        let per_s = limits.max_messages_per_s;
        Inflow {
            budget,
            id,
            limits,
            rate: crate::audio::pace::TokenBucket::new(per_s, 2.0 * per_s),
            last_heard: Instant::now(),
            warned: Default::default(),
            bytes_in: metrics::counter!(names::SESSION_BYTES, "direction" => "in"),
            replies,
            close: None,
        }
    }

    fn protocol_error(&mut self, kind: &'static str) {
        metrics::counter!(names::SESSION_PROTOCOL_ERRORS, "kind" => kind).increment(1);
    }

    /// Queues replies for the client; when its queue is full (it does not read), they are
    /// dropped: the writer closes a stalled client.
    pub(super) fn reply(&self, messages: Vec<Message>) {
        for m in messages {
            let _ = self.replies.try_send(Reply::Send(m));
        }
    }

    /// Takes one message (or the end of the stream); returns how the session ends when it does.
    pub(super) fn take(
        &mut self,
        m: Option<Result<Message, axum::Error>>,
        proto: &mut dyn Protocol,
        client: &crate::session::ClientEnd,
    ) -> Option<Outcome> {
        let id = self.id;
        let m = match m {
            None | Some(Ok(Message::Close(_))) => return Some(Outcome::ClientClosed),
            Some(Err(e)) => {
                use tungstenite::Error as WsError;
                let inner = e.into_inner();
                let e = inner.downcast_ref::<WsError>();
                if matches!(e, Some(WsError::Utf8(_))) {
                    self.protocol_error("bad_utf8");
                    tracing::info!(session = id, "closed: a text message that is not UTF-8");
                    self.close = Some((1007, "a text message that is not UTF-8"));
                    return Some(Outcome::Failed);
                }
                if matches!(e, Some(WsError::Capacity(_))) {
                    self.protocol_error("too_large");
                    tracing::warn!(
                        session = id,
                        "closed: a message over limits.max_message_bytes ({})",
                        self.limits.max_message_bytes
                    );
                    self.reply(proto.too_large(self.limits.max_message_bytes));
                    self.close = Some((1009, "message too large"));
                    return Some(Outcome::Failed);
                }
                tracing::info!(session = id, "connection lost");
                return Some(Outcome::ClientClosed);
            }
            Some(Ok(m)) => m,
        };
        if !self.rate.take_at(1.0, Instant::now()) {
            self.protocol_error("flood");
            tracing::warn!(
                session = id,
                "closed: more than limits.max_messages_per_s ({}) messages a second",
                self.limits.max_messages_per_s
            );
            self.close = Some((1008, "too many messages"));
            return Some(Outcome::Failed);
        }
        let n = match &m {
            Message::Binary(b) => b.len(),
            Message::Text(t) => t.len(),
            // Pings are answered by the WebSocket layer (one pong pending at most); they count
            // against the message rate above.
            _ => return None,
        };
        self.bytes_in.increment(n as u64);
        let mut cx = Taken {
            client,
            id,
            replies: Vec::new(),
            close: None,
            heard: false,
            end: false,
            warned: &mut self.warned,
            budget: &mut self.budget,
        };
        proto.take(m, &mut cx);
        let Taken {
            replies,
            close,
            heard,
            end,
            ..
        } = cx;
        if heard {
            self.last_heard = Instant::now();
        }
        self.reply(replies);
        if close.is_some() {
            self.close = close;
            return Some(Outcome::Failed);
        }
        end.then_some(Outcome::ClientClosed)
    }
}
