//! The link between a network session and the pipeline that serves it: two ends made as a
//! pair, one held by whoever speaks to the client (the server's connection task), one handed to
//! the session stages of that pipeline through their build context.
//!
//! Both directions are bounded and never block the side that cannot wait: the connection task
//! offers incoming audio with [`ClientEnd::offer`] (a full queue, in chunks or in bytes, drops
//! the chunk and counts it: a client sending faster than real time), the output stages offer outgoing messages with
//! [`PipelineEnd::offer`] (a full queue, a client that stopped reading, drops them and counts
//! them); the connection task decides when a stall is long enough to close. Knows nothing of
//! WebSocket, HTTP, stages or threads beyond the two queues.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A message for the client.
#[derive(Debug, Clone, PartialEq)]
pub enum Outbound {
    /// A piece of the Ogg/Opus stream (one or more whole pages).
    Audio(Vec<u8>),
    /// Agent audio as 24 kHz PCM, for a transport that encodes it itself (the realtime API,
    /// the telephone).
    Pcm(Vec<f32>),
    /// A piece of the agent's transcript.
    Text(String),
}

/// A frame's server latency past which it is late: two frames' time (160 ms).
pub const LATE: Duration = Duration::from_millis(160);

/// What both ends count.
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Incoming chunks dropped because the pipeline was not taking them.
    pub dropped_in: AtomicU64,
    /// Outgoing messages dropped because the client was not reading.
    pub dropped_out: AtomicU64,
    /// 80 ms frames of silence fed while the client sent nothing.
    pub silence_frames: AtomicU64,
    /// Frames whose server latency passed [`LATE`] (two frames' time).
    pub late_frames: AtomicU64,
    /// Bytes received from the client.
    pub bytes_in: AtomicU64,
    /// Bytes queued for the client.
    pub bytes_out: AtomicU64,
    /// Bytes of the client's audio waiting for the pipeline.
    pub queued_in: AtomicU64,
    /// Set once the client has been told the session is ready: the input stage's idle clock
    /// starts then.
    pub open: AtomicBool,
    /// Server latency (a frame's arrival → its agent audio leaving), smoothed, microseconds.
    pub latency_us: AtomicU64,
}

impl LinkStats {
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Why an offer was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue is full: the message was dropped (and counted).
    Full,
    /// The other end is gone.
    Closed,
}

/// The end held by the connection task.
pub struct ClientEnd {
    inbound: crossbeam_channel::Sender<Vec<u8>>,
    /// Bytes that may wait for the pipeline at most.
    max_queued_in: u64,
    /// Messages for the client, in order.
    pub outbound: tokio::sync::mpsc::Receiver<Outbound>,
    /// The counters of both ends.
    pub stats: Arc<LinkStats>,
}

impl ClientEnd {
    /// Offers a chunk of the client's audio stream to the pipeline.
    ///
    /// # Errors
    ///
    /// [`Refused::Full`] (dropped, counted: the queue holds its chunks or its bytes already) or
    /// [`Refused::Closed`] (the pipeline has ended).
    pub fn offer(&self, chunk: Vec<u8>) -> Result<(), Refused> {
        let n = chunk.len() as u64;
        LinkStats::add(&self.stats.bytes_in, n);
        let queued = LinkStats::get(&self.stats.queued_in);
        if queued > 0 && queued + n > self.max_queued_in {
            LinkStats::add(&self.stats.dropped_in, 1);
            return Err(Refused::Full);
        }
        match self.inbound.try_send(chunk) {
            Ok(()) => {
                LinkStats::add(&self.stats.queued_in, n);
                Ok(())
            }
            Err(crossbeam_channel::TrySendError::Full(_)) => {
                LinkStats::add(&self.stats.dropped_in, 1);
                Err(Refused::Full)
            }
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => Err(Refused::Closed),
        }
    }

    /// Marks the session open (the handshake is sent): the pipeline's input may start feeding
    /// silence when the client is quiet.
    pub fn open(&self) {
        self.stats.open.store(true, Ordering::Release);
    }

    /// Ends the client's input: the pipeline's input stage sees the end of its stream and the
    /// pipeline drains. Outgoing messages keep arriving until it has.
    pub fn close_input(&mut self) {
        let (dead, _) = crossbeam_channel::bounded(0);
        self.inbound = dead;
    }
}

/// The end handed to the session stages of one pipeline.
pub struct PipelineEnd {
    inbound: Mutex<Option<crossbeam_channel::Receiver<Vec<u8>>>>,
    outbound: tokio::sync::mpsc::Sender<Outbound>,
    /// The counters of both ends.
    pub stats: Arc<LinkStats>,
}

impl PipelineEnd {
    /// The client's audio stream, for the one input stage: `None` when it has been taken.
    pub fn take_input(&self) -> Option<Inbound> {
        let rx = self.inbound.lock().ok()?.take()?;
        Some(Inbound {
            rx,
            stats: self.stats.clone(),
        })
    }

    /// A sender of messages for the client (any number of output stages).
    pub fn output(&self) -> Output {
        Output {
            tx: self.outbound.clone(),
            stats: self.stats.clone(),
        }
    }
}

/// The client's audio, as the pipeline's input stage reads it.
pub struct Inbound {
    rx: crossbeam_channel::Receiver<Vec<u8>>,
    /// The link's counters.
    pub stats: Arc<LinkStats>,
}

/// What [`Inbound::recv`] got.
#[derive(Debug)]
pub enum Received {
    /// A chunk of the stream.
    Chunk(Vec<u8>),
    /// Nothing within the timeout.
    Quiet,
    /// The client's input has ended.
    Ended,
}

impl Inbound {
    /// The next chunk, waiting at most `timeout`.
    pub fn recv(&self, timeout: Duration) -> Received {
        match self.rx.recv_timeout(timeout) {
            Ok(c) => {
                self.stats
                    .queued_in
                    .fetch_sub(c.len() as u64, Ordering::Relaxed);
                Received::Chunk(c)
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Received::Quiet,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Received::Ended,
        }
    }

    /// Whether the client has been told the session is ready.
    pub fn is_open(&self) -> bool {
        self.stats.open.load(Ordering::Acquire)
    }

    /// Counts a frame of silence fed in the client's place.
    pub fn count_silence(&self) {
        LinkStats::add(&self.stats.silence_frames, 1);
    }
}

/// Sends messages for the client without ever blocking.
#[derive(Clone)]
pub struct Output {
    tx: tokio::sync::mpsc::Sender<Outbound>,
    stats: Arc<LinkStats>,
}

impl Output {
    /// Records the server latency of a frame (smoothed over about 16 frames; a frame later
    /// than [`LATE`] counted).
    pub fn latency(&self, d: Duration) {
        if d > LATE {
            LinkStats::add(&self.stats.late_frames, 1);
        }
        let now = d.as_micros().min(u64::MAX as u128) as u64;
        let old = self.stats.latency_us.load(Ordering::Relaxed);
        let new = if old == 0 {
            now
        } else {
            old - old / 16 + now / 16
        };
        self.stats.latency_us.store(new, Ordering::Relaxed);
    }

    /// Offers a message.
    ///
    /// # Errors
    ///
    /// [`Refused::Full`] (dropped, counted: the client is not reading) or [`Refused::Closed`]
    /// (the connection is gone).
    pub fn offer(&self, m: Outbound) -> Result<(), Refused> {
        let n = match &m {
            Outbound::Audio(b) => b.len(),
            Outbound::Pcm(p) => 2 * p.len(),
            Outbound::Text(t) => t.len(),
        } as u64;
        match self.tx.try_send(m) {
            Ok(()) => {
                LinkStats::add(&self.stats.bytes_out, n);
                Ok(())
            }
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                LinkStats::add(&self.stats.dropped_out, 1);
                Err(Refused::Full)
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => Err(Refused::Closed),
        }
    }
}

/// A linked pair: `inbound` chunks may wait for the pipeline, `outbound` messages for the
/// client.
pub fn link(inbound: usize, outbound: usize) -> (ClientEnd, PipelineEnd) {
    link_bounded(inbound, u64::MAX, outbound)
}

/// A linked pair whose inbound queue holds at most `inbound` chunks and `inbound_bytes` bytes
/// (a chunk larger than that alone is still taken into an empty queue).
pub fn link_bounded(
    inbound: usize,
    inbound_bytes: u64,
    outbound: usize,
) -> (ClientEnd, PipelineEnd) {
    let (itx, irx) = crossbeam_channel::bounded(inbound.max(1));
    let (otx, orx) = tokio::sync::mpsc::channel(outbound.max(1));
    let stats = Arc::new(LinkStats::default());
    (
        ClientEnd {
            inbound: itx,
            max_queued_in: inbound_bytes,
            outbound: orx,
            stats: stats.clone(),
        },
        PipelineEnd {
            inbound: Mutex::new(Some(irx)),
            outbound: otx,
            stats,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_queues_drop_and_count_and_never_block() {
        let (mut client, pipe) = link(2, 1);
        let input = pipe.take_input().unwrap();
        assert!(pipe.take_input().is_none(), "one input stage only");
        assert_eq!(client.offer(vec![1]), Ok(()));
        assert_eq!(client.offer(vec![2]), Ok(()));
        assert_eq!(client.offer(vec![3]), Err(Refused::Full));
        assert_eq!(LinkStats::get(&client.stats.dropped_in), 1);
        let out = pipe.output();
        assert_eq!(out.offer(Outbound::Text("a".into())), Ok(()));
        assert_eq!(out.offer(Outbound::Text("b".into())), Err(Refused::Full));
        assert_eq!(LinkStats::get(&client.stats.dropped_out), 1);
        assert!(matches!(input.recv(Duration::ZERO), Received::Chunk(c) if c == [1]));
        client.close_input();
        assert!(matches!(input.recv(Duration::ZERO), Received::Chunk(c) if c == [2]));
        assert!(matches!(
            input.recv(Duration::from_millis(1)),
            Received::Ended
        ));
        assert_eq!(
            client.outbound.try_recv().ok(),
            Some(Outbound::Text("a".into()))
        );
    }

    #[test]
    fn the_inbound_queue_is_bounded_in_bytes_too() {
        let (client, pipe) = link_bounded(100, 1000, 1);
        let input = pipe.take_input().unwrap();
        // One chunk larger than the bound alone is taken into an empty queue; nothing after it.
        assert_eq!(client.offer(vec![0; 1500]), Ok(()));
        assert_eq!(client.offer(vec![0; 1]), Err(Refused::Full));
        assert!(matches!(input.recv(Duration::ZERO), Received::Chunk(c) if c.len() == 1500));
        assert_eq!(LinkStats::get(&client.stats.queued_in), 0);
        for _ in 0..4 {
            assert_eq!(client.offer(vec![0; 250]), Ok(()));
        }
        assert_eq!(client.offer(vec![0; 1]), Err(Refused::Full));
        assert_eq!(LinkStats::get(&client.stats.queued_in), 1000);
        assert_eq!(LinkStats::get(&client.stats.dropped_in), 2);
        assert!(matches!(input.recv(Duration::ZERO), Received::Chunk(_)));
        assert_eq!(client.offer(vec![0; 250]), Ok(()));
    }
}
