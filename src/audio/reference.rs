//! The speaker's reference signal for echo cancellation: what a playback stream really handed
//! to its device (after the jitter buffer, silence of underruns included), with the instant each
//! callback's first sample is played, carried from the device callback to an `aec` stage.
//!
//! A [`ReferenceTap`] is shared by the two ends of one pipeline ([`Taps`] pairs them by the
//! playback stage's name). Every stream a player opens (and reopens after a reconnect or a
//! switch) takes a [`TapWriter`] of its own; the reading side ([`ReferenceReader`]) picks up the
//! newest one, resamples it to the canceller's rate and maps positions to instants.
//!
//! # Real-time safety
//!
//! [`TapWriter::push`] is called from the output callback: it copies into lock-free rings
//! allocated when the stream is built, takes no lock, makes no syscall, and drops (counting)
//! what does not fit. Nothing here knows about stages or the canceller.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use ringbuf::traits::{Consumer, Observer, Producer, Split};
use ringbuf::{HeapCons, HeapProd, HeapRb};

use super::{AudioError, StreamResampler};

/// Seconds of reference a stream's ring holds (the reader drains it every frame).
const RING_SECONDS: f64 = 2.0;

/// One stream's reference as the reader receives it.
struct TapRing {
    rate: u32,
    samples: HeapCons<f32>,
    /// `(position of the callback's first sample, the instant it is played)`.
    marks: HeapCons<(u64, Instant)>,
}

/// The link between one player and its readers.
pub struct ReferenceTap {
    tx: Sender<TapRing>,
    rx: Receiver<TapRing>,
    /// Whether a reader exists (a player without one does not fill rings for nobody); read by
    /// the callbacks, as readers may be built after the player.
    claimed: Arc<AtomicBool>,
    /// Samples dropped because a ring was full (the reader fell behind by seconds).
    pub dropped: Arc<AtomicU64>,
}

impl Default for ReferenceTap {
    fn default() -> Self {
        // One slot, newest wins: after several reopenings only the live stream's ring is read.
        let (tx, rx) = crossbeam_channel::bounded(1);
        ReferenceTap {
            tx,
            rx,
            claimed: Arc::new(AtomicBool::new(false)),
            dropped: Arc::new(AtomicU64::new(0)),
        }
    }
}

impl ReferenceTap {
    /// Whether a reader has claimed this tap.
    pub fn claimed(&self) -> bool {
        self.claimed.load(Ordering::Acquire)
    }

    /// A writer for a new stream at `rate` (its ring replaces the previous stream's). It
    /// writes nothing while no reader exists.
    pub fn writer(&self, rate: u32) -> TapWriter {
        let cap = ((rate as f64 * RING_SECONDS) as usize).max(4096);
        let (prod, cons) = HeapRb::<f32>::new(cap).split();
        let (mprod, mcons) = HeapRb::<(u64, Instant)>::new(1024).split();
        while self.rx.try_recv().is_ok() {}
        let _ = self.tx.try_send(TapRing {
            rate,
            samples: cons,
            marks: mcons,
        });
        TapWriter {
            samples: prod,
            marks: mprod,
            pos: 0,
            claimed: self.claimed.clone(),
            dropped: self.dropped.clone(),
        }
    }

    /// The reading side, resampling to `rate`; marks the tap claimed.
    pub fn reader(self: &Arc<Self>, rate: u32) -> ReferenceReader {
        self.claimed.store(true, Ordering::Release);
        ReferenceReader {
            tap: self.clone(),
            rate,
            ring: None,
            resampler: None,
            scratch: vec![0.0; 4096],
            out: Vec::with_capacity(8192),
            base: 0,
            written: 0,
            clock: None,
        }
    }
}

/// The callback's end of one stream's reference.
pub struct TapWriter {
    samples: HeapProd<f32>,
    marks: HeapProd<(u64, Instant)>,
    /// Position of the next sample in the ring (what was dropped is not counted, so that a
    /// mark always names the instant of the ring sample it points at).
    pos: u64,
    claimed: Arc<AtomicBool>,
    dropped: Arc<AtomicU64>,
}

impl TapWriter {
    /// Appends what a callback hands to the device, whose first sample is played at `play`.
    /// Real-time safe.
    pub fn push(&mut self, samples: &[f32], play: Instant) {
        if !self.claimed.load(Ordering::Relaxed) {
            return;
        }
        let _ = self.marks.try_push((self.pos, play));
        let n = self.samples.push_slice(samples);
        if n < samples.len() {
            self.dropped
                .fetch_add((samples.len() - n) as u64, Ordering::Relaxed);
        }
        self.pos += n as u64;
    }
}

/// The reference as a reader sees it: samples at its rate on one position line across streams,
/// and the latest `(position, play instant)` pair.
pub struct ReferenceReader {
    tap: Arc<ReferenceTap>,
    rate: u32,
    ring: Option<TapRing>,
    resampler: Option<StreamResampler>,
    scratch: Vec<f32>,
    out: Vec<f32>,
    /// Position (at `rate`) where the current stream's position 0 falls.
    base: u64,
    /// Samples produced so far (at `rate`): the position after the newest one.
    written: u64,
    clock: Option<(u64, Instant)>,
}

impl ReferenceReader {
    /// The position after the newest sample read so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// The latest `(position, instant it is played)` pair, at the reader's rate.
    pub fn clock(&self) -> Option<(u64, Instant)> {
        self.clock
    }

    /// Whether a stream has been seen.
    pub fn connected(&self) -> bool {
        self.ring.is_some()
    }

    /// Reads what arrived, resampled, into `sink` (called with consecutive slices).
    ///
    /// # Errors
    ///
    /// When the device rate cannot be resampled to the reader's.
    pub fn read(&mut self, mut sink: impl FnMut(&[f32])) -> Result<(), AudioError> {
        while let Ok(r) = self.tap.rx.try_recv() {
            // A new stream starts where the old one's samples end (what it had not handed over
            // is lost with it).
            self.base = self.written;
            self.resampler = if r.rate == self.rate {
                None
            } else {
                Some(StreamResampler::new(
                    r.rate,
                    self.rate,
                    (r.rate / 100) as usize,
                )?)
            };
            self.ring = Some(r);
        }
        let Some(ring) = self.ring.as_mut() else {
            return Ok(());
        };
        let ratio = self.rate as f64 / ring.rate as f64;
        while let Some((pos, at)) = ring.marks.try_pop() {
            let p = self.base + (pos as f64 * ratio).round() as u64;
            self.clock = Some((p, at));
        }
        while ring.samples.occupied_len() > 0 {
            let n = ring.samples.pop_slice(&mut self.scratch);
            match self.resampler.as_mut() {
                None => {
                    self.written += n as u64;
                    sink(&self.scratch[..n]);
                }
                Some(r) => {
                    self.out.clear();
                    r.process(&self.scratch[..n], &mut self.out)?;
                    self.written += self.out.len() as u64;
                    sink(&self.out);
                }
            }
        }
        Ok(())
    }
}

/// The instant position `pos` is played, from a `(position, instant)` pair at `rate`.
pub fn instant_of(clock: (u64, Instant), pos: u64, rate: u32) -> Instant {
    let (p, at) = clock;
    if pos >= p {
        at + Duration::from_secs_f64((pos - p) as f64 / rate as f64)
    } else {
        let back = Duration::from_secs_f64((p - pos) as f64 / rate as f64);
        at.checked_sub(back).unwrap_or(at)
    }
}

/// The position played at `t`, from a `(position, instant)` pair at `rate` (saturating at 0).
pub fn position_at(clock: (u64, Instant), t: Instant, rate: u32) -> u64 {
    let (p, at) = clock;
    if t >= at {
        p + (t.duration_since(at).as_secs_f64() * rate as f64).round() as u64
    } else {
        let back = (at.duration_since(t).as_secs_f64() * rate as f64).round() as u64;
        p.saturating_sub(back)
    }
}

/// The taps of one pipeline, by playback stage name; each pipeline has its own.
#[derive(Default)]
pub struct Taps {
    inner: Mutex<HashMap<String, TapEntry>>,
}

#[derive(Default)]
struct TapEntry {
    tap: Arc<ReferenceTap>,
    /// Whether a playback stage of that name provides it.
    provided: bool,
    /// The stages reading it.
    readers: Vec<String>,
}

impl Taps {
    /// The tap of playback stage `name`, provided by that stage.
    pub fn provide(&self, name: &str) -> Arc<ReferenceTap> {
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.entry(name.to_string()).or_default();
        e.provided = true;
        e.tap.clone()
    }

    /// The tap of playback stage `name`, read by stage `reader`.
    pub fn read(&self, name: &str, reader: &str) -> Arc<ReferenceTap> {
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let e = m.entry(name.to_string()).or_default();
        e.readers.push(reader.to_string());
        e.tap.clone()
    }

    /// `(reader, tap name)` of every reader whose tap no stage provides.
    pub fn unprovided(&self) -> Vec<(String, String)> {
        let m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<(String, String)> = m
            .iter()
            .filter(|(_, e)| !e.provided)
            .flat_map(|(name, e)| e.readers.iter().map(move |r| (r.clone(), name.clone())))
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unclaimed_tap_writes_nothing_and_a_reader_sees_the_newest_stream() {
        let tap = Arc::new(ReferenceTap::default());
        let mut early = tap.writer(24_000);
        early.push(&[1.0; 100], Instant::now());
        let mut r = tap.reader(24_000);
        let mut got = Vec::new();
        r.read(|s| got.extend_from_slice(s)).unwrap();
        assert!(got.is_empty(), "nothing is written before a reader exists");
        let t0 = Instant::now();
        let mut old = tap.writer(24_000);
        old.push(&[1.0; 100], t0);
        r.read(|s| got.extend_from_slice(s)).unwrap();
        assert_eq!(got.len(), 100);
        assert_eq!(r.clock(), Some((0, t0)));
        // A reopened stream continues the position line where the old one's samples ended.
        let mut new = tap.writer(24_000);
        old.push(&[9.0; 50], t0);
        new.push(&[2.0; 40], t0 + Duration::from_secs(1));
        new.push(&[3.0; 40], t0 + Duration::from_secs(2));
        got.clear();
        r.read(|s| got.extend_from_slice(s)).unwrap();
        assert_eq!(got.len(), 80);
        assert!(got.iter().all(|&v| v == 2.0 || v == 3.0));
        assert_eq!(r.clock(), Some((140, t0 + Duration::from_secs(2))));
        assert_eq!(r.written(), 180);
    }

    #[test]
    fn positions_map_to_instants_both_ways() {
        let t0 = Instant::now() + Duration::from_secs(10);
        let c = (24_000, t0);
        assert_eq!(
            position_at(c, t0 + Duration::from_millis(500), 24_000),
            36_000
        );
        assert_eq!(
            position_at(c, t0 - Duration::from_millis(500), 24_000),
            12_000
        );
        assert_eq!(
            instant_of(c, 36_000, 24_000),
            t0 + Duration::from_millis(500)
        );
        assert_eq!(
            instant_of(c, 12_000, 24_000),
            t0 - Duration::from_millis(500)
        );
    }

    #[test]
    fn a_device_rate_reference_is_resampled_and_its_marks_scaled() {
        let tap = Arc::new(ReferenceTap::default());
        let mut r = tap.reader(24_000);
        let mut w = tap.writer(48_000);
        let t0 = Instant::now();
        let mut n = 0;
        for i in 0..50 {
            w.push(&[0.25; 480], t0 + Duration::from_millis(10 * i));
            r.read(|s| n += s.len()).unwrap();
        }
        assert!((n as i64 - 12_000).abs() < 720, "{n}");
        assert_eq!(r.clock(), Some((240 * 49, t0 + Duration::from_millis(490))));
    }

    #[test]
    fn taps_report_readers_of_a_missing_playback() {
        let taps = Taps::default();
        let a = taps.read("speaker", "aec");
        let b = taps.provide("speaker");
        assert!(Arc::ptr_eq(&a, &b));
        let _ = taps.read("spekaer", "aec2");
        assert_eq!(
            taps.unprovided(),
            vec![("aec2".to_string(), "spekaer".to_string())]
        );
    }
}
