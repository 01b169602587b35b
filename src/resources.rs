//! What a process builds once and every pipeline it builds shares: opened packs, tokenizers,
//! the codes of voice prompts, the shared LM engines and the shared codecs.
//!
//! [`Resources`] is owned by the app (`run`, `validate`, `replay`, `daemon`, `serve`) and handed
//! to stage builders through the build context: a second session of `duplex serve` opens no
//! pack, loads no tokenizer and encodes no voice prompt; it takes them from here. Nothing else
//! is process-wide but the ONNX Runtime environment and the metrics recorder.
//!
//! - **Packs** are keyed by their canonical folder and opened (and checked whole) once per change
//!   on disk: a pack whose files changed since is opened again.
//! - **Tokenizers** likewise, by canonical path and the file's size and time.
//! - **Voice codes** are keyed by the voice file's content (its SHA-256), the pack and the codec
//!   path that encodes it: the same WAV under another name costs nothing more.
//! - **Engines** are keyed by pack, execution provider and device, and held weakly: the last
//!   conversation to leave an engine frees it (its weights, its thread), so a daemon reload from
//!   one pack to another keeps no engine of the first. Their slot count, when a stage asks for
//!   none, is the process's ([`Resources::new`]). An engine whose thread failed is replaced by
//!   a fresh one for the next conversation. `DUPLEX_DRILL_ENGINE_PANIC_AT_TICK=N` is a fault
//!   drill: the first engine the process opens fails at its N-th temporal tick.
//! - **Codecs** (a shared Mimi encoder or decoder) likewise, keyed by pack, role, precision,
//!   provider and device. The slots a new conversation can have are the fewest free of any
//!   engine or codec open ([`Resources::free_slots`]).
//!
//! - **The start gate** ([`Resources::start_together`]): conversations built to run as one batch
//!   (`duplex replay` with several `--codes`) each wait, primed, until all have primed, so that
//!   none is fed (and finished) while another still primes.
//!
//! Each load is counted ([`Loads`], and `duplex_resources_loaded_total{what}`), so tests and
//! operators can see what a session cost. The engines report to the observer the process hands
//! in (its metrics and diagnosis, `observe::engine`, recorded off their threads). Knows
//! nothing of stages, pipelines or the network, and reads no environment: the process's settings
//! (a cache's size, a fault drill) are set by the command that makes it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

pub mod primed;

pub use self::primed::{PrimeCache, PrimeFileError, PrimeRecipe};
use crate::model::engine::{CodecOptions, EngineObserver, EngineOptions, SharedCodec, SharedLm};
use crate::model::pack::{FloatType, Pack, StepRole};
use crate::model::tokenizer::Tokenizer;
use crate::model::ModelError;
use crate::observe::names;

/// Handles on the shared engines (LM and codecs) a process holds open: while it holds them,
/// they stay open with no conversation on them.
#[derive(Debug, Clone, Default)]
pub struct Engines {
    /// Shared LM engines.
    pub lm: Vec<Arc<SharedLm>>,
    /// Shared codecs.
    pub codecs: Vec<Arc<SharedCodec>>,
}

impl Engines {
    /// Whether any of them has failed (until a fresh one replaces it).
    pub fn any_failed(&self) -> bool {
        self.lm.iter().any(|e| e.is_failed()) || self.codecs.iter().any(|c| c.is_failed())
    }

    /// The fewest slots of any of them (`None` when none is held): the conversations they
    /// can host at once.
    pub fn min_slots(&self) -> Option<usize> {
        let lm = self.lm.iter().map(|e| e.slots);
        lm.chain(self.codecs.iter().map(|c| c.slots)).min()
    }

    /// Sets their slot gauges (after a metrics recorder is installed).
    pub fn publish(&self) {
        for e in &self.lm {
            e.publish();
        }
        for c in &self.codecs {
            c.publish_slots();
        }
    }
}

/// The codes of a voice prompt: one `[codebooks]` row per 80 ms frame.
pub type VoiceCodes = Arc<Vec<Vec<i64>>>;

/// How many of each thing the process has loaded (not taken from the cache).
#[derive(Debug, Default)]
pub struct Loads {
    /// Packs opened and checked.
    pub packs: AtomicU64,
    /// Tokenizers loaded.
    pub tokenizers: AtomicU64,
    /// Voice prompts encoded.
    pub voices: AtomicU64,
    /// Session templates read (by the apps that keep one).
    pub templates: AtomicU64,
    /// Shared LM engines opened.
    pub engines: AtomicU64,
    /// Shared codec engines opened (each role its own).
    pub codecs: AtomicU64,
}

impl Loads {
    fn count(c: &AtomicU64, what: &'static str) {
        c.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(names::RESOURCES_LOADED, "what" => what).increment(1);
    }

    /// Counts a session template read from its file.
    pub fn template_read(&self) {
        Self::count(&self.templates, "template");
    }

    /// Every series at zero (after the metrics recorder is installed).
    pub fn register_series() {
        for what in ["pack", "tokenizer", "voice", "template", "engine", "codec"] {
            metrics::counter!(names::RESOURCES_LOADED, "what" => what).absolute(0);
        }
    }
}

/// What changed on disk: the sizes and times of a file, or of a folder's entries.
type Stamp = Vec<(PathBuf, u64, Option<SystemTime>)>;

fn stamp_of(paths: impl IntoIterator<Item = PathBuf>) -> Stamp {
    let mut s: Stamp = paths
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).ok();
            let len = m.as_ref().map_or(0, |m| m.len());
            let t = m.and_then(|m| m.modified().ok());
            (p, len, t)
        })
        .collect();
    s.sort();
    s
}

/// A pack's stamp: its folder, `pack.yaml`, and every graph folder's entries.
fn pack_stamp(dir: &Path) -> Stamp {
    let mut paths = vec![dir.to_path_buf(), dir.join("pack.yaml")];
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                paths.push(p.join("model.onnx"));
                paths.push(p.join("model.onnx.data"));
            }
            paths.push(p);
        }
    }
    stamp_of(paths)
}

/// What names a pack's files as they are now (its canonical folder, and the sizes and times of
/// its files): part of a primed state's key, so that a pack changed on disk (a daemon reloaded
/// onto a new export in the same folder) never restores a state its old graphs computed.
pub fn pack_version(dir: &Path) -> String {
    let dir = canonical(dir);
    let mut h = Sha256::new();
    for (p, len, t) in pack_stamp(&dir) {
        h.update(p.as_os_str().as_encoded_bytes());
        h.update(len.to_le_bytes());
        let ns = t
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        h.update(ns.to_le_bytes());
    }
    format!("{} {:x}", dir.display(), h.finalize())
}

type EngineKey = (PathBuf, &'static str, i32);
/// A shared codec is known by its pack, role, precision, provider and device.
type CodecKey = (PathBuf, &'static str, &'static str, &'static str, i32);

/// An execution provider as part of an engine's key: its name and device.
fn device_of(p: crate::model::session::Provider) -> (&'static str, i32) {
    match p {
        crate::model::session::Provider::Cpu => ("cpu", 0),
        crate::model::session::Provider::Cuda { device_id } => ("cuda", device_id),
    }
}

/// A shared engine or codec as [`Resources`] keeps it.
trait Shared {
    fn is_failed(&self) -> bool;
    fn slots(&self) -> usize;
    /// `shared engine`, `shared codec`.
    const WHAT: &'static str;
}

impl Shared for SharedLm {
    fn is_failed(&self) -> bool {
        SharedLm::is_failed(self)
    }
    fn slots(&self) -> usize {
        self.slots
    }
    const WHAT: &'static str = "shared engine";
}

impl Shared for SharedCodec {
    fn is_failed(&self) -> bool {
        SharedCodec::is_failed(self)
    }
    fn slots(&self) -> usize {
        self.slots
    }
    const WHAT: &'static str = "shared codec";
}

/// The entry of `map` for `key` while it is open and has not failed (gone and failed entries are
/// dropped: a fresh one is opened). The first stage to open it decided its size: a stage that
/// asks for other `slots` is warned that they are not applied.
fn still_open<K: Eq + std::hash::Hash, E: Shared>(
    map: &mut HashMap<K, Weak<E>>,
    key: &K,
    pack: &Pack,
    asked: usize,
    graph: &str,
) -> Option<Arc<E>> {
    map.retain(|_, w| w.upgrade().is_some_and(|e| !e.is_failed()));
    let e = map.get(key).and_then(Weak::upgrade)?;
    if asked != 0 && asked != e.slots() {
        tracing::warn!(
            pack = %pack.dir.display(),
            graph,
            slots = e.slots(),
            asked,
            "the {} is already open: `slots` of this stage is not applied",
            E::WHAT
        );
    }
    Some(e)
}

/// A cache of things loaded from files, each with the stamp of the files it was loaded from.
type Cache<T> = Mutex<HashMap<PathBuf, (Stamp, Arc<T>)>>;

/// The entry of `cache` for `key` when its files still have `stamp`, else what `open` loads
/// (outside the lock: other entries may be loaded meanwhile), kept for next time.
fn cached<T>(
    cache: &Cache<T>,
    key: PathBuf,
    stamp: Stamp,
    open: impl FnOnce() -> Result<T, ModelError>,
) -> Result<Arc<T>, ModelError> {
    if let Some((s, v)) = cache.lock().ok().and_then(|m| m.get(&key).cloned()) {
        if s == stamp {
            return Ok(v);
        }
    }
    let v = Arc::new(open()?);
    if let Ok(mut m) = cache.lock() {
        m.insert(key, (stamp, v.clone()));
    }
    Ok(v)
}
/// A voice prompt's codes are known by the file's SHA-256, the pack and the codec path.
type VoiceKey = ([u8; 32], PathBuf, String);

/// The resources of one process. See the module doc.
pub struct Resources {
    slots: usize,
    packs: Cache<Pack>,
    tokenizers: Cache<Tokenizer>,
    voices: Mutex<HashMap<VoiceKey, VoiceCodes>>,
    engines: Mutex<HashMap<EngineKey, Weak<SharedLm>>>,
    codecs: Mutex<HashMap<CodecKey, Weak<SharedCodec>>>,
    /// The fault drill ([`Resources::set_engine_drill`]), for the first engine opened.
    drill: Mutex<Option<u64>>,
    /// Who hears the engines (their metrics and diagnosis, off their threads): made with the
    /// first engine, by what the process handed in ([`Resources::set_observer`]; none: nobody).
    observer: std::sync::OnceLock<Arc<dyn EngineObserver>>,
    make_observer: fn() -> Arc<dyn EngineObserver>,
    /// Primed conversation states, shared by every pipeline of the process.
    primed: Arc<PrimeCache>,
    /// Conversations that start feeding together, once all have primed.
    start_gate: Option<Arc<StartGate>>,
    /// What has been loaded so far.
    pub loads: Loads,
}

/// Conversations that wait for each other at the end of their priming (see the module doc).
#[derive(Debug)]
pub struct StartGate {
    expected: usize,
    arrived: Mutex<usize>,
    all_in: std::sync::Condvar,
}

impl StartGate {
    fn new(expected: usize) -> Self {
        StartGate {
            expected,
            arrived: Mutex::new(0),
            all_in: std::sync::Condvar::new(),
        }
    }

    /// Counts one conversation in: primed, or failed (so that no other waits for it).
    pub fn arrive(&self) {
        if let Ok(mut n) = self.arrived.lock() {
            *n += 1;
            self.all_in.notify_all();
        }
    }

    /// Waits until every conversation has arrived; returns early (false) when `stop` says so,
    /// checked every 50 ms. True when all are in.
    pub fn wait(&self, stop: impl Fn() -> bool) -> bool {
        let Ok(mut n) = self.arrived.lock() else {
            return false;
        };
        while *n < self.expected {
            if stop() {
                return false;
            }
            n = match self
                .all_in
                .wait_timeout(n, std::time::Duration::from_millis(50))
            {
                Ok((n, _)) => n,
                Err(_) => return false,
            };
        }
        true
    }
}

impl std::fmt::Debug for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resources")
            .field("slots", &self.slots)
            .field("loads", &self.loads)
            .finish_non_exhaustive()
    }
}

impl Default for Resources {
    fn default() -> Self {
        Resources::new(1)
    }
}

/// The primed states a process keeps unless told otherwise (`duplex serve`'s `prime_cache_mb`).
const DEFAULT_PRIME_CACHE_BYTES: usize = 256 << 20;

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

impl Resources {
    /// Resources for a process that hosts `conversations` at once: the slot count of a shared
    /// engine a stage opens without one (`duplex serve`'s `max_sessions`, the number of
    /// `duplex replay --codes` files; 1 for a single pipeline). Nothing is read from the
    /// environment: what the process's settings say is set by its caller.
    pub fn new(conversations: usize) -> Self {
        Resources {
            slots: conversations.max(1),
            packs: Mutex::default(),
            tokenizers: Mutex::default(),
            voices: Mutex::default(),
            engines: Mutex::default(),
            codecs: Mutex::default(),
            drill: Mutex::new(None),
            observer: std::sync::OnceLock::new(),
            make_observer: || Arc::new(crate::model::engine::Unobserved),
            primed: Arc::new(PrimeCache::new(DEFAULT_PRIME_CACHE_BYTES)),
            start_gate: None,
            loads: Loads::default(),
        }
    }

    /// Who hears the engines and codecs: `make` is called once, with the first one opened (the
    /// commands hand in the metrics' observer, `observe::engine`; without one nobody hears
    /// them).
    pub fn set_observer(&mut self, make: fn() -> Arc<dyn EngineObserver>) {
        self.make_observer = make;
    }

    /// The fault drill: the first engine opened from now on fails at its `tick`-th temporal
    /// tick (`None`: no drill).
    pub fn set_engine_drill(&mut self, tick: Option<u64>) {
        self.drill = Mutex::new(tick);
    }

    /// The pipelines built from now on wait for each other, primed, before their first frame
    /// (`conversations` of them; see the module doc).
    pub fn start_together(&mut self, conversations: usize) {
        self.start_gate = (conversations > 1).then(|| Arc::new(StartGate::new(conversations)));
    }

    /// The gate conversations meet at after priming, when they start together.
    pub fn start_gate(&self) -> Option<Arc<StartGate>> {
        self.start_gate.clone()
    }

    /// Bounds the process's cache of primed states to `bytes` (an empty cache of that size:
    /// set before the first conversation).
    pub fn set_prime_cache_bytes(&mut self, bytes: usize) {
        self.primed = Arc::new(PrimeCache::new(bytes));
    }

    /// The process's cache of primed conversation states (`priming: cached`).
    pub fn primed(&self) -> Arc<PrimeCache> {
        self.primed.clone()
    }

    /// Sets the number of conversations the process hosts (the slot count of engines opened
    /// from now on without one).
    pub fn set_conversations(&mut self, conversations: usize) {
        self.slots = conversations.max(1);
    }

    /// The pack in `dir`, opened and checked once per change on disk.
    ///
    /// # Errors
    ///
    /// As [`Pack::open`].
    pub fn pack(&self, dir: &Path) -> Result<Arc<Pack>, ModelError> {
        let key = canonical(dir);
        let stamp = pack_stamp(&key);
        cached(&self.packs, key, stamp, || {
            let p = Pack::open(dir)?;
            Loads::count(&self.loads.packs, "pack");
            Ok(p)
        })
    }

    /// The tokenizer at `path`, loaded once per change on disk.
    ///
    /// # Errors
    ///
    /// As [`Tokenizer::open`].
    pub fn tokenizer(&self, path: &Path) -> Result<Arc<Tokenizer>, ModelError> {
        let key = canonical(path);
        let stamp = stamp_of([key.clone()]);
        cached(&self.tokenizers, key, stamp, || {
            let t = Tokenizer::open(path)?;
            Loads::count(&self.loads.tokenizers, "tokenizer");
            Ok(t)
        })
    }

    /// The codes of the voice prompt `file` for `pack` by the codec path `codec` (a string that
    /// names everything that changes the codes: strategy, precision), computed by `encode` the
    /// first time this content is asked for.
    ///
    /// # Errors
    ///
    /// `unreadable`'s error (given what is wrong, naming the file) when the file cannot be
    /// read, or `encode`'s error.
    pub fn voice_codes<E>(
        &self,
        file: &Path,
        pack: &Pack,
        codec: &str,
        unreadable: impl FnOnce(String) -> E,
        encode: impl FnOnce() -> Result<Vec<Vec<i64>>, E>,
    ) -> Result<VoiceCodes, E> {
        let bytes = crate::files::read_limited(file, 1 << 30)
            .map_err(|e| unreadable(format!("{}: {e}", file.display())))?;
        let key = (
            Sha256::digest(&bytes).into(),
            canonical(&pack.dir),
            codec.to_string(),
        );
        if let Some(c) = self.voices.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(c);
        }
        let codes = Arc::new(encode()?);
        Loads::count(&self.loads.voices, "voice");
        if let Ok(mut m) = self.voices.lock() {
            m.insert(key, codes.clone());
        }
        Ok(codes)
    }

    /// Who hears the engines and codecs (made with the first one).
    fn observer(&self) -> Arc<dyn EngineObserver> {
        self.observer.get_or_init(self.make_observer).clone()
    }

    /// A stage's slot count, or the process's when it asks for none (0).
    fn slots_or_default(&self, asked: usize) -> usize {
        if asked == 0 {
            self.slots
        } else {
            asked
        }
    }

    /// The shared engine of `pack` on `opts`' execution provider and device, opened on first
    /// use and kept while anything holds it. A stage that asks for no slot count gets the
    /// process's.
    ///
    /// # Errors
    ///
    /// As [`SharedLm::open`].
    pub fn engine(&self, pack: &Pack, opts: &EngineOptions) -> Result<Arc<SharedLm>, ModelError> {
        let (provider, device) = device_of(opts.session.provider);
        let key = (canonical(&pack.dir), provider, device);
        let mut map = self
            .engines
            .lock()
            .map_err(|_| ModelError::contract("engine", "the engine table is poisoned"))?;
        if let Some(e) = still_open(&mut map, &key, pack, opts.slots, "engine") {
            return Ok(e);
        }
        let mut opts = opts.clone();
        opts.observer = self.observer();
        opts.slots = self.slots_or_default(opts.slots);
        if let Some(n) = self.drill.lock().ok().and_then(|mut d| d.take()) {
            tracing::warn!("fault drill: this engine fails at temporal tick {n}");
            opts.panic_at_tick = Some(n);
        }
        let e = Arc::new(SharedLm::open(pack, &opts)?);
        Loads::count(&self.loads.engines, "engine");
        map.insert(key, Arc::downgrade(&e));
        Ok(e)
    }

    /// The shared codec of `pack`'s `role` step graph of precision `dtype` on `opts`' execution
    /// provider and device, opened (and warmed) on first use and kept while anything holds it.
    /// A stage that asks for no slot count (0) gets the process's.
    ///
    /// # Errors
    ///
    /// As [`SharedCodec::open`].
    pub fn codec(
        &self,
        pack: &Pack,
        role: StepRole,
        dtype: FloatType,
        opts: &CodecOptions,
    ) -> Result<Arc<SharedCodec>, ModelError> {
        let (provider, device) = device_of(opts.session.provider);
        let key = (
            canonical(&pack.dir),
            role.graph(),
            dtype.name(),
            provider,
            device,
        );
        let mut map = self
            .codecs
            .lock()
            .map_err(|_| ModelError::contract(role.graph(), "the codec table is poisoned"))?;
        if let Some(e) = still_open(&mut map, &key, pack, opts.slots, role.graph()) {
            return Ok(e);
        }
        let mut opts = opts.clone();
        opts.observer = self.observer();
        opts.slots = self.slots_or_default(opts.slots);
        let e = Arc::new(SharedCodec::open(pack, role, dtype, &opts)?);
        Loads::count(&self.loads.codecs, "codec");
        map.insert(key, Arc::downgrade(&e));
        Ok(e)
    }

    /// The shared codecs open now.
    pub fn codecs(&self) -> Vec<Arc<SharedCodec>> {
        self.codecs
            .lock()
            .map(|m| m.values().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }

    /// Every shared engine and codec open now, held.
    pub fn open_engines(&self) -> Engines {
        Engines {
            lm: self.engines(),
            codecs: self.codecs(),
        }
    }

    /// The engines open now (failed ones included: [`SharedLm::is_failed`]).
    pub fn engines(&self) -> Vec<Arc<SharedLm>> {
        self.engines
            .lock()
            .map(|m| m.values().filter_map(Weak::upgrade).collect())
            .unwrap_or_default()
    }

    /// Slots of the open engines, the LM's and the codecs' (the fewest of any), `None` when
    /// none is open.
    pub fn total_slots(&self) -> Option<usize> {
        let lm = self.engines().into_iter().map(|e| e.slots);
        lm.chain(self.codecs().into_iter().map(|c| c.slots)).min()
    }

    /// Free slots of the open engines, the LM's and the codecs' (the fewest of any), `None`
    /// when none is open.
    pub fn free_slots(&self) -> Option<usize> {
        let lm = self.engines().into_iter().map(|e| e.free_slots());
        lm.chain(self.codecs().into_iter().map(|c| c.free_slots()))
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_gate_opens_when_every_conversation_has_arrived_or_on_stop() {
        let mut r = Resources::new(3);
        assert!(r.start_gate().is_none(), "no gate unless asked");
        r.start_together(3);
        let gate = r.start_gate().unwrap();
        let opened = std::sync::Arc::new(AtomicU64::new(0));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let (g, o) = (gate.clone(), opened.clone());
                std::thread::spawn(move || {
                    g.arrive();
                    let all = g.wait(|| false);
                    o.fetch_add(1, Ordering::SeqCst);
                    all
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(opened.load(Ordering::SeqCst), 0, "two of three arrived");
        // The third (primed or failed) arrives: both go on, all in.
        gate.arrive();
        for w in waiters {
            assert!(w.join().unwrap());
        }
        // A conversation asked to stop leaves the wait, not all in.
        r.start_together(2);
        let g = r.start_gate().unwrap();
        g.arrive();
        assert!(!g.wait(|| true));
        r.start_together(1);
        assert!(r.start_gate().is_none(), "one conversation waits for none");
    }

    #[test]
    fn voice_codes_are_computed_once_per_content_pack_and_codec() {
        let r = Resources::new(1);
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.wav");
        let b = dir.path().join("b.wav");
        std::fs::write(&a, b"same bytes").unwrap();
        std::fs::write(&b, b"same bytes").unwrap();
        let pack = Pack {
            dir: dir.path().into(),
            manifest: Default::default(),
        };
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let enc = || -> Result<Vec<Vec<i64>>, String> {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(vec![vec![1, 2]])
        };
        let x = r
            .voice_codes(&a, &pack, "stateful f32", |e| e, enc)
            .unwrap();
        let y = r
            .voice_codes(&b, &pack, "stateful f32", |e| e, enc)
            .unwrap();
        assert!(Arc::ptr_eq(&x, &y), "the same content under another name");
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        r.voice_codes(&a, &pack, "window", |e| e, enc).unwrap();
        std::fs::write(&a, b"other bytes").unwrap();
        r.voice_codes(&a, &pack, "stateful f32", |e| e, enc)
            .unwrap();
        assert_eq!(
            calls.load(Ordering::Relaxed),
            3,
            "another codec, other content"
        );
        assert_eq!(r.loads.voices.load(Ordering::Relaxed), 3);
        let e = r
            .voice_codes(&dir.path().join("none.wav"), &pack, "x", |e| e, enc)
            .unwrap_err();
        assert!(e.contains("none.wav"), "{e}");
    }

    /// A primed state's key names the pack's files as they are: the same folder after an export
    /// in place (a graph's weights rewritten) is another pack; the same files under another
    /// path name are the same folder.
    #[test]
    fn a_pack_changed_on_disk_is_another_version() {
        let dir = tempfile::tempdir().unwrap();
        let pack = dir.path().join("pack");
        std::fs::create_dir_all(pack.join("temporal")).unwrap();
        std::fs::write(pack.join("pack.yaml"), "name: x\n").unwrap();
        let data = pack.join("temporal/model.onnx.data");
        std::fs::write(pack.join("temporal/model.onnx"), b"graph").unwrap();
        std::fs::write(&data, vec![1u8; 64]).unwrap();
        let v0 = pack_version(&pack);
        assert_eq!(v0, pack_version(&dir.path().join("pack/../pack")));
        assert_eq!(v0, pack_version(&pack), "nothing changed");
        // New weights of another size.
        std::fs::write(&data, vec![2u8; 65]).unwrap();
        let v1 = pack_version(&pack);
        assert_ne!(v0, v1);
        // Of the same size, written later.
        let f = std::fs::File::options().write(true).open(&data).unwrap();
        f.set_modified(SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        assert_ne!(v1, pack_version(&pack));
    }
}
