//! The receive side's jitter buffer: a call's audio packets (a WebRTC peer's Opus, a SIP
//! call's G.711), as they arrive (in any order, some never), played out in sequence at the
//! sender's pace. Each packet is due a fixed
//! delay after the schedule's anchor (the first packet's arrival), by its RTP timestamp; at its
//! time the buffer hands out the packet, or, when it is missing, the next packet's in-band FEC
//! (when that one is here) or a concealment (Opus PLC). A packet that arrives after its time is
//! late (dropped, counted) and the delay grows by one packet, up to a ceiling; a sender that
//! stops is not concealed for ever: after [`MAX_CONCEAL_RUN`] the buffer waits, and re-anchors
//! on the next packet.
//!
//! Pure logic on (sequence number, timestamp, bytes, instant): no sockets, no codec.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// RTP clock of Opus (always 48 kHz, whatever the coded rate).
pub(crate) const CLOCK: u64 = 48_000;
/// Concealments in a row after which an empty buffer stops (the sender is silent, or gone).
pub(crate) const MAX_CONCEAL_RUN: u32 = 5;
/// Packets held at most (about 2 s): past it the oldest are skipped and the schedule re-anchored.
const MAX_HELD: usize = 100;

/// What to play for the next slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Play {
    /// The slot's own packet.
    Packet(Arc<[u8]>),
    /// The slot's packet (this many RTP ticks) is lost; the next one (given) carries it as
    /// in-band FEC.
    Fec(Arc<[u8]>, u64),
    /// The slot's packet is lost: conceal this many RTP ticks.
    Conceal(u64),
}

/// What the buffer counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    /// Packets that arrived (duplicates included).
    pub received: u64,
    /// Slots whose packet never came in time (recovered by FEC or concealed).
    pub lost: u64,
    /// Lost slots rebuilt from the next packet's FEC.
    pub fec: u64,
    /// Lost slots concealed.
    pub concealed: u64,
    /// Packets that came after their slot was played (dropped).
    pub late: u64,
    /// Packets that came after a later one, still in time.
    pub reordered: u64,
    /// Packets that came twice.
    pub duplicate: u64,
    /// Times the schedule was anchored again (a sender that paused, or ran far ahead).
    pub anchors: u64,
}

struct Held {
    ts: u64,
    data: Arc<[u8]>,
}

/// The next slot to play: its sequence number and the timestamp it is expected at (its own
/// packet's, when that is here).
#[derive(Debug, Clone, Copy)]
struct Slot {
    seq: u64,
    ts: u64,
}

/// A jitter buffer (see the module's documentation).
pub(crate) struct JitterBuffer {
    delay: Duration,
    max_delay: Duration,
    /// The RTP clock, ticks per second.
    clock: u64,
    held: BTreeMap<u64, Held>,
    next: Option<Slot>,
    /// The schedule: the timestamp `.1` plays at `.0`; every other one by its distance.
    anchor: Option<(Instant, u64)>,
    highest: Option<u64>,
    /// The last packet's size, in RTP ticks.
    ticks: u64,
    conceal_run: u32,
    counts: Counts,
}

impl JitterBuffer {
    /// A buffer that plays each packet `delay` after its due arrival, growing the delay (by a
    /// packet per late one) up to `max_delay`.
    pub(crate) fn new(delay: Duration, max_delay: Duration) -> Self {
        Self::with_clock(delay, max_delay, CLOCK)
    }

    /// A buffer as [`new`](Self::new)'s of a stream whose RTP clock runs at `clock` ticks a
    /// second (8,000 for G.711), expecting 20 ms packets until two neighbours say otherwise.
    pub(crate) fn with_clock(delay: Duration, max_delay: Duration, clock: u64) -> Self {
        let clock = clock.max(1);
        JitterBuffer {
            delay,
            max_delay: max_delay.max(delay),
            clock,
            held: BTreeMap::new(),
            next: None,
            anchor: None,
            highest: None,
            ticks: clock / 50,
            conceal_run: 0,
            counts: Counts::default(),
        }
    }

    fn ticks_to_time(&self, ticks: u64) -> Duration {
        Duration::from_micros(ticks * 1_000_000 / self.clock)
    }

    /// What was counted so far.
    pub(crate) fn counts(&self) -> Counts {
        self.counts
    }

    /// The current target delay.
    pub(crate) fn delay(&self) -> Duration {
        self.delay
    }

    /// Packets waiting.
    pub(crate) fn depth(&self) -> usize {
        self.held.len()
    }

    /// When the timestamp `ts` plays.
    fn time_of(&self, ts: u64) -> Option<Instant> {
        let (at, ts0) = self.anchor?;
        Some(if ts >= ts0 {
            at + self.ticks_to_time(ts - ts0)
        } else {
            at.checked_sub(self.ticks_to_time(ts0 - ts)).unwrap_or(at)
        })
    }

    /// Takes a packet (`seq`: the extended RTP sequence number, `ts`: the extended RTP
    /// timestamp) that arrived at `now`.
    pub(crate) fn push(&mut self, seq: u64, ts: u64, data: Arc<[u8]>, now: Instant) {
        self.counts.received += 1;
        if self.next.is_some_and(|slot| seq < slot.seq) {
            self.counts.late += 1;
            // Played around already: wait one packet longer from now on.
            let grown = (self.delay + self.ticks_to_time(self.ticks)).min(self.max_delay);
            if let Some((at, _)) = self.anchor.as_mut() {
                *at += grown - self.delay;
            }
            self.delay = grown;
            return;
        }
        if self.held.contains_key(&seq) {
            self.counts.duplicate += 1;
            return;
        }
        if self.highest.is_some_and(|h| seq < h) {
            self.counts.reordered += 1;
        }
        self.highest = Some(self.highest.map_or(seq, |h| h.max(seq)));
        // The packet size from two neighbours' timestamps (browsers send 10 to 60 ms).
        let neighbours = [
            self.held
                .range(..seq)
                .next_back()
                .map(|(&s, h)| (seq - s, ts.wrapping_sub(h.ts))),
            self.held
                .range(seq + 1..)
                .next()
                .map(|(&s, h)| (s - seq, h.ts.wrapping_sub(ts))),
        ];
        for (dseq, dts) in neighbours.into_iter().flatten() {
            if dseq == 1 && dts > 0 && dts <= self.clock / 10 {
                self.ticks = dts;
            }
        }
        self.held.insert(seq, Held { ts, data });
        if self.next.is_none() {
            self.next = Some(Slot { seq, ts });
            self.anchor = Some((now + self.delay, ts));
            self.counts.anchors += 1;
            self.conceal_run = 0;
        }
        if self.held.len() > MAX_HELD {
            // Far ahead of the schedule: skip to the oldest packet kept, due now.
            while self.held.len() > MAX_HELD {
                self.held.pop_first();
            }
            if let Some((&first, h)) = self.held.iter().next() {
                self.next = Some(Slot {
                    seq: first,
                    ts: h.ts,
                });
                self.anchor = Some((now, h.ts));
                self.counts.anchors += 1;
            }
        }
    }

    /// When the next slot is due (`None`: nothing is scheduled).
    pub(crate) fn due(&self) -> Option<Instant> {
        let slot = self.next?;
        let ts = self.held.get(&slot.seq).map_or(slot.ts, |h| h.ts);
        self.time_of(ts)
    }

    /// The next slot's play when it is due at `now`.
    pub(crate) fn pop(&mut self, now: Instant) -> Option<Play> {
        let slot = self.next?;
        if self.due()? > now {
            return None;
        }
        if let Some(h) = self.held.remove(&slot.seq) {
            self.conceal_run = 0;
            self.advance(slot.seq, h.ts);
            return Some(Play::Packet(h.data));
        }
        if self.held.is_empty() && self.conceal_run >= MAX_CONCEAL_RUN {
            // The sender has stopped: wait for its next packet, and anchor on it.
            self.next = None;
            return None;
        }
        self.counts.lost += 1;
        self.conceal_run += 1;
        let play = match self.held.get(&(slot.seq + 1)) {
            Some(h) => {
                self.counts.fec += 1;
                Play::Fec(h.data.clone(), self.ticks)
            }
            None => {
                self.counts.concealed += 1;
                Play::Conceal(self.ticks)
            }
        };
        self.advance(slot.seq, slot.ts);
        Some(play)
    }

    /// The slot after `seq` (played at `ts`): its own packet's timestamp when it is here, else
    /// one packet's size later.
    fn advance(&mut self, seq: u64, ts: u64) {
        let next_ts = self.held.get(&(seq + 1)).map_or(ts + self.ticks, |n| n.ts);
        self.next = Some(Slot {
            seq: seq + 1,
            ts: next_ts,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS20: Duration = Duration::from_millis(20);

    fn pkt(n: u8) -> Arc<[u8]> {
        Arc::from(vec![n; 3])
    }

    /// Plays everything due up to `until`, stepping 1 ms.
    fn drain(jb: &mut JitterBuffer, from: Instant, until: Instant) -> Vec<(u128, Play)> {
        let mut out = Vec::new();
        let mut t = from;
        while t <= until {
            while let Some(p) = jb.pop(t) {
                out.push((t.duration_since(from).as_millis(), p));
            }
            t += Duration::from_millis(1);
        }
        out
    }

    #[test]
    fn packets_in_order_play_a_delay_after_the_first_arrival_one_per_packet_time() {
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(60), Duration::from_millis(200));
        for i in 0..5u64 {
            jb.push(100 + i, 960 * i, pkt(i as u8), t0 + MS20 * i as u32);
        }
        // (The sender's silence after the last one is concealed from 160 ms on.)
        let out = drain(&mut jb, t0, t0 + Duration::from_millis(150));
        let times: Vec<u128> = out.iter().map(|o| o.0).collect();
        assert_eq!(times, vec![60, 80, 100, 120, 140]);
        for (i, (_, p)) in out.iter().enumerate() {
            assert_eq!(*p, Play::Packet(pkt(i as u8)));
        }
        assert_eq!(jb.counts().lost, 0);
    }

    #[test]
    fn a_reordered_packet_in_time_is_played_in_its_place() {
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(60), Duration::from_millis(200));
        jb.push(0, 0, pkt(0), t0);
        jb.push(2, 1920, pkt(2), t0 + MS20 * 2);
        jb.push(1, 960, pkt(1), t0 + MS20 * 3);
        let out = drain(&mut jb, t0, t0 + Duration::from_millis(110));
        let plays: Vec<Play> = out.into_iter().map(|o| o.1).collect();
        assert_eq!(
            plays,
            vec![
                Play::Packet(pkt(0)),
                Play::Packet(pkt(1)),
                Play::Packet(pkt(2))
            ]
        );
        assert_eq!(jb.counts().reordered, 1);
        assert_eq!(jb.counts().lost, 0);
    }

    #[test]
    fn a_lost_packet_is_rebuilt_from_the_next_ones_fec_or_concealed() {
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(60), Duration::from_millis(200));
        // 1 is lost with 2 behind it (FEC); 4 and 5 are lost with nothing behind in time.
        for i in [0u64, 2, 3, 6] {
            jb.push(i, 960 * i, pkt(i as u8), t0 + MS20 * i as u32);
        }
        let out = drain(&mut jb, t0, t0 + Duration::from_millis(190));
        let plays: Vec<Play> = out.into_iter().map(|o| o.1).collect();
        assert_eq!(
            plays,
            vec![
                Play::Packet(pkt(0)),
                Play::Fec(pkt(2), 960),
                Play::Packet(pkt(2)),
                Play::Packet(pkt(3)),
                Play::Conceal(960),
                Play::Fec(pkt(6), 960),
                Play::Packet(pkt(6)),
            ]
        );
        let c = jb.counts();
        assert_eq!((c.lost, c.fec, c.concealed), (3, 2, 1));
    }

    #[test]
    fn a_late_packet_is_dropped_and_the_delay_grows_by_one_packet() {
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(40), Duration::from_millis(60));
        jb.push(0, 0, pkt(0), t0);
        let out = drain(&mut jb, t0, t0 + Duration::from_millis(70));
        assert_eq!(out.len(), 2, "{out:?}"); // 0 at 40 ms, 1 concealed at 60 ms
        jb.push(1, 960, pkt(1), t0 + Duration::from_millis(70));
        assert_eq!(jb.counts().late, 1);
        assert_eq!(jb.delay(), Duration::from_millis(60));
        // Twice: the ceiling holds.
        jb.push(1, 960, pkt(1), t0 + Duration::from_millis(71));
        assert_eq!(jb.delay(), Duration::from_millis(60));
        // The next slot moved one packet later: 80 ms + 20 ms.
        jb.push(2, 1920, pkt(2), t0 + Duration::from_millis(72));
        let out = drain(
            &mut jb,
            t0 + Duration::from_millis(72),
            t0 + Duration::from_millis(110),
        );
        assert_eq!(out, vec![(28, Play::Packet(pkt(2)))]);
    }

    #[test]
    fn a_sender_that_stops_is_concealed_briefly_then_the_next_packet_anchors_again() {
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(40), Duration::from_millis(200));
        jb.push(0, 0, pkt(0), t0);
        let out = drain(&mut jb, t0, t0 + Duration::from_millis(1000));
        assert_eq!(out.len(), 1 + MAX_CONCEAL_RUN as usize, "{out:?}");
        assert_eq!(jb.due(), None);
        let t1 = t0 + Duration::from_millis(1000);
        jb.push(50, 48_000, pkt(50), t1);
        assert_eq!(jb.due(), Some(t1 + Duration::from_millis(40)));
        assert_eq!(jb.counts().anchors, 2);
    }

    #[test]
    fn under_random_loss_and_changing_packet_sizes_the_depth_stays_put_over_a_minute() {
        // Browsers switch between 10 and 20 ms packets: the schedule follows the timestamps,
        // so a lost packet of either size leaves the depth where it was.
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(40), Duration::from_millis(200));
        let mut rng = 12345u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) % 100
        };
        let (mut ts, mut played, mut depths) = (0u64, 0, Vec::new());
        for i in 0..4000u64 {
            let size = if (i / 300) % 2 == 0 { 960 } else { 480 };
            let t = t0 + jb.ticks_to_time(ts);
            if next() >= 5 {
                jb.push(i, 1_000_000 + ts, pkt(0), t);
            }
            while jb.pop(t).is_some() {
                played += 1;
            }
            depths.push(jb.depth());
            ts += size;
        }
        assert!(played >= 3990, "{played}");
        let most = depths[3000..].iter().copied().max().unwrap();
        assert!(most <= 8, "the buffer grew to {most} packets");
        assert_eq!(jb.counts().anchors, 1);
    }

    #[test]
    fn duplicates_are_counted_once_and_a_runaway_sender_is_bounded() {
        let t0 = Instant::now();
        let mut jb = JitterBuffer::new(Duration::from_millis(40), Duration::from_millis(200));
        jb.push(0, 0, pkt(0), t0);
        jb.push(0, 0, pkt(0), t0);
        assert_eq!(jb.counts().duplicate, 1);
        for i in 1..1000u64 {
            jb.push(i, 960 * i, pkt(0), t0);
        }
        assert!(jb.depth() <= MAX_HELD);
        assert_eq!(jb.pop(t0).map(|_| ()), Some(()), "re-anchored to now");
    }
}
