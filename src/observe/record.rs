//! Recording a run: the runtime's per-frame timings of every stage and link, with wall-clock
//! times, appended as they happen to JSON Lines files in a folder of the run's own, beside a
//! manifest of what ran (the pipeline file, every stage's kind and params, the identity of the
//! model packs they name). A killed process leaves every line written up to the last flush
//! (at most 100 ms old); files rotate by size.
//!
//! The actor threads only hand events to a bounded queue; a thread of the recording's own
//! writes them. When it falls behind, events are dropped and counted (in the file's last line
//! and the log), never waited for. Knows nothing of what the stages compute.
//!
//! A timings line is one of: `{"t": µs since the epoch, "stage": i, "frame": n, "service_us": x}`,
//! `{"t", "edge": i, "wait_us": x}`, `{"t", "stage": i, "interval_us": x}` (a sink's completion),
//! `{"t", "edge": i, "dropped": 1}`; the first line of each file names the stages and edges.
//! Stages may add streams of their own ([`Recording::stream`]): the temporal stage writes
//! `lm.jsonl`, the inputs of every step as its model saw them (and the context length after
//! it); the monitor writes `verdicts.jsonl`, every change of a stage's verdict.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use crate::runtime::Observer;

/// Why a recording could not be made or read back: where (a folder, a file, or a file's line
/// as `FILE:LINE`) and what was wrong there.
pub type RecordError = crate::files::FileError;

/// Events that may wait for the writer.
const QUEUE: usize = 65_536;
/// The writer flushes at least this often.
const FLUSH: Duration = Duration::from_millis(100);

/// The manifest's format name and version.
pub const FORMAT: &str = "duplex-recording";
/// The version of the recording format this build writes.
pub const VERSION: u32 = 2;

enum Event {
    Open(usize, String),
    Line(usize, String),
    Started(Vec<String>, Vec<String>),
    Service(usize, u64, Duration, u64),
    Wait(usize, Duration, u64),
    Completion(usize, Duration, u64),
    Dropped(usize, u64),
    /// Stop writing (the run ended, or the recording was switched off while it goes on).
    Stop,
}

/// Microseconds since the Unix epoch (the recordings' clock).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A recording in progress: a runtime observer.
pub struct Recording {
    dir: PathBuf,
    /// The folder was made for this recording (so [`Recording::discard`] may delete it).
    fresh: bool,
    /// Set by [`Recording::stop`]: nothing more is queued, by the observer or the streams.
    closed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    streams: AtomicU64,
    tx: Mutex<Option<Sender<Event>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    skipped: AtomicU64,
}

impl Recording {
    /// Starts a recording in a new folder under `root` (named by the start time, to the
    /// millisecond, and the process id, plus `.N` when a recording of this process started in
    /// the same millisecond), writing `manifest` (completed with the format, version and start
    /// time) there first.
    ///
    /// # Errors
    ///
    /// A [`RecordError`] naming the folder or file that could not be created.
    pub fn create(
        root: &Path,
        manifest: serde_json::Value,
        max_file_bytes: u64,
    ) -> Result<Recording, RecordError> {
        Self::create_tagged(root, "", manifest, max_file_bytes)
    }

    /// As [`Recording::create`], the folder's name ending in `-TAG` (a session's id).
    ///
    /// # Errors
    ///
    /// As [`Recording::create`].
    pub fn create_tagged(
        root: &Path,
        tag: &str,
        manifest: serde_json::Value,
        max_file_bytes: u64,
    ) -> Result<Recording, RecordError> {
        let now = now_us();
        let stamp = format!(
            "{}.{:03}-{}",
            chrono_like(now / 1_000_000),
            now / 1000 % 1000,
            std::process::id()
        );
        std::fs::create_dir_all(root).map_err(|e| RecordError::new(root.display(), e))?;
        // Made here, one name at a time: two recordings never share a folder.
        for n in 0..1000 {
            let mut name = stamp.clone();
            if n > 0 {
                name = format!("{name}.{n}");
            }
            if !tag.is_empty() {
                name = format!("{name}-{tag}");
            }
            let dir = root.join(name);
            match std::fs::create_dir(&dir) {
                Ok(()) => return Self::start(dir, true, manifest, max_file_bytes),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(RecordError::new(dir.display(), e)),
            }
        }
        Err(RecordError::new(
            root.display(),
            format!("1000 recordings named {stamp} already: no new folder"),
        ))
    }

    /// Starts a recording in `dir` itself (created; refused when it already holds a recording).
    ///
    /// # Errors
    ///
    /// As [`Recording::create`].
    pub fn create_at(
        dir: &Path,
        manifest: serde_json::Value,
        max_file_bytes: u64,
    ) -> Result<Recording, RecordError> {
        if dir.join("manifest.json").exists() {
            return Err(RecordError::new(
                dir.display(),
                "already holds a recording (give a new folder)",
            ));
        }
        let fresh = !dir.exists();
        std::fs::create_dir_all(dir).map_err(|e| RecordError::new(dir.display(), e))?;
        Self::start(dir.to_path_buf(), fresh, manifest, max_file_bytes)
    }

    /// Starts a recording in the existing folder `dir`.
    fn start(
        dir: PathBuf,
        fresh: bool,
        mut manifest: serde_json::Value,
        max_file_bytes: u64,
    ) -> Result<Recording, RecordError> {
        let started = now_us();
        manifest["format"] = FORMAT.into();
        manifest["version"] = VERSION.into();
        manifest["duplex"] = env!("CARGO_PKG_VERSION").into();
        manifest["started_unix_us"] = started.into();
        let m = dir.join("manifest.json");
        let text = serde_json::to_string_pretty(&manifest).unwrap_or_default();
        std::fs::write(&m, text + "\n").map_err(|e| RecordError::new(m.display(), e))?;
        let (tx, rx) = crossbeam_channel::bounded(QUEUE);
        let w = Writer {
            dir: dir.clone(),
            max: max_file_bytes.max(4096),
            index: 0,
            out: None,
            written: 0,
            header: None,
            streams: Vec::new(),
        };
        let writer = std::thread::Builder::new()
            .name("duplex:record".into())
            .spawn(move || w.run(rx))
            .map_err(|e| RecordError::new(dir.display(), format!("its writer thread: {e}")))?;
        Ok(Recording {
            dir,
            fresh,
            closed: Default::default(),
            streams: AtomicU64::new(0),
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            skipped: AtomicU64::new(0),
        })
    }

    /// A stream of the recording's own, for a stage to write what it computed from (the user
    /// codes its model saw, its priming): JSON Lines in `NAME.jsonl`, written and flushed by the
    /// recording's thread like the timings.
    pub fn stream(&self, name: &str) -> RecordStream {
        let id = self.streams.fetch_add(1, Ordering::Relaxed) as usize;
        let tx = self.tx.lock().ok().and_then(|t| t.clone());
        let s = RecordStream {
            tx,
            id,
            closed: self.closed.clone(),
        };
        s.send(Event::Open(id, name.to_string()));
        s
    }

    /// The recording's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Events the writer had no room for.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    /// Stops recording while the run goes on: what is queued is written and the files are
    /// closed; later events, and lines of the stages' streams, are not recorded.
    pub fn stop(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.finish();
    }

    /// Stops the recording and deletes its folder, when it was made for it: for a recording
    /// whose run never started (cancelled, refused, only checked), of which nothing is kept.
    pub fn discard(&self) {
        self.stop();
        self.finish();
        if self.fresh {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), "recording not deleted: {e}");
            }
        }
    }

    /// Whether [`Recording::stop`] was called.
    pub fn stopped(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Writes what is queued and closes the files (also done when dropped).
    pub fn finish(&self) {
        if let Some(tx) = self.tx.lock().ok().and_then(|mut t| t.take()) {
            // Blocking, once: the writer writes everything queued before it, then ends (the
            // stages' streams and the monitor may still hold senders).
            let _ = tx.send(Event::Stop);
        }
        if let Some(w) = self.writer.lock().ok().and_then(|mut w| w.take()) {
            let _ = w.join();
        }
        let n = self.skipped();
        if n > 0 {
            tracing::warn!(
                dir = %self.dir.display(),
                "the recording dropped {n} timing events (its writer fell behind)"
            );
        }
    }

    fn send(&self, e: Event) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        let Ok(tx) = self.tx.lock() else { return };
        if let Some(tx) = tx.as_ref() {
            if let Err(TrySendError::Full(_)) = tx.try_send(e) {
                self.skipped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A stage's own stream in a recording (see [`Recording::stream`]). Never blocks: a line the
/// writer has no room for is lost (the writer's queue is large).
pub struct RecordStream {
    tx: Option<Sender<Event>>,
    id: usize,
    closed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl RecordStream {
    fn send(&self, e: Event) {
        if self.closed.load(Ordering::Relaxed) {
            return;
        }
        if let Some(tx) = &self.tx {
            let _ = tx.try_send(e);
        }
    }

    /// Appends one JSON value as a line.
    pub fn write(&self, v: &serde_json::Value) {
        self.send(Event::Line(self.id, v.to_string()));
    }
}

/// `YYYYMMDD-HHMMSS` (UTC) of a Unix time, without a date library.
fn chrono_like(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil from days (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

impl Observer for Recording {
    fn started(&self, stages: &[String], edges: &[String]) {
        self.send(Event::Started(stages.to_vec(), edges.to_vec()));
    }
    fn service(&self, stage: usize, frame: u64, took: Duration) {
        self.send(Event::Service(stage, frame, took, now_us()));
    }
    fn completion(&self, stage: usize, interval: Duration) {
        self.send(Event::Completion(stage, interval, now_us()));
    }
    fn edge_wait(&self, edge: usize, wait: Duration) {
        self.send(Event::Wait(edge, wait, now_us()));
    }
    fn edge_dropped(&self, edge: usize) {
        self.send(Event::Dropped(edge, now_us()));
    }
}

struct Writer {
    dir: PathBuf,
    max: u64,
    index: u32,
    out: Option<BufWriter<File>>,
    written: u64,
    header: Option<String>,
    streams: Vec<Option<BufWriter<File>>>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Event>) {
        let mut last_flush = Instant::now();
        loop {
            match rx.recv_timeout(FLUSH) {
                Ok(Event::Stop) => break,
                Ok(e) => self.write(e),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
            }
            if last_flush.elapsed() >= FLUSH {
                self.flush();
                last_flush = Instant::now();
            }
        }
        self.flush();
    }

    fn flush(&mut self) {
        for s in self.streams.iter_mut().flatten() {
            let _ = s.flush();
        }
        if let Some(o) = self.out.as_mut() {
            if let Err(e) = o.flush() {
                tracing::error!(dir = %self.dir.display(), "recording: {e}");
                self.out = None;
            }
        }
    }

    fn line(&mut self, text: &str) {
        self.ensure_open();
        self.raw(text);
    }

    /// Opens the next timings file when there is none or the current one is full; a new file
    /// starts with the header.
    fn ensure_open(&mut self) {
        if self.out.is_none() || self.written >= self.max {
            self.flush();
            let p = self.dir.join(format!("timings.{:04}.jsonl", self.index));
            self.index += 1;
            match File::create(&p) {
                Ok(f) => {
                    self.out = Some(BufWriter::new(f));
                    self.written = 0;
                    // Every file says what its indices mean.
                    if let Some(h) = self.header.clone() {
                        self.raw(&h);
                    }
                }
                Err(e) => tracing::error!("recording: {}: {e}", p.display()),
            }
        }
    }

    fn raw(&mut self, text: &str) {
        if let Some(o) = self.out.as_mut() {
            if writeln!(o, "{text}").is_ok() {
                self.written += text.len() as u64 + 1;
            }
        }
    }

    fn write(&mut self, e: Event) {
        let text = match e {
            Event::Open(id, name) => {
                let p = self.dir.join(format!("{name}.jsonl"));
                let f = File::create(&p)
                    .map_err(|e| tracing::error!("recording: {}: {e}", p.display()))
                    .ok();
                if self.streams.len() <= id {
                    self.streams.resize_with(id + 1, || None);
                }
                self.streams[id] = f.map(BufWriter::new);
                return;
            }
            Event::Line(id, line) => {
                if let Some(Some(s)) = self.streams.get_mut(id) {
                    let _ = writeln!(s, "{line}");
                }
                return;
            }
            Event::Started(stages, edges) => {
                let h = serde_json::json!({ "stages": stages, "edges": edges }).to_string();
                self.header = Some(h.clone());
                if self.out.is_none() {
                    // Opening the first file writes the header.
                    self.ensure_open();
                    return;
                }
                h
            }
            Event::Service(s, f, d, t) => format!(
                "{{\"t\":{t},\"stage\":{s},\"frame\":{f},\"service_us\":{}}}",
                d.as_micros()
            ),
            Event::Wait(edge, d, t) => {
                format!(
                    "{{\"t\":{t},\"edge\":{edge},\"wait_us\":{}}}",
                    d.as_micros()
                )
            }
            Event::Completion(s, d, t) => format!(
                "{{\"t\":{t},\"stage\":{s},\"interval_us\":{}}}",
                d.as_micros()
            ),
            Event::Dropped(edge, t) => format!("{{\"t\":{t},\"edge\":{edge},\"dropped\":1}}"),
            Event::Stop => return,
        };
        self.line(&text);
    }
}

/// Deletes the oldest recordings under `root` (folders holding a `manifest.json`, oldest by
/// name, which starts with the UTC start time) until what is left takes at most `budget` bytes,
/// never touching the newest `keep` (those being written). Returns how many were deleted.
pub fn prune(root: &Path, budget: u64, keep: usize) -> usize {
    fn size(p: &Path) -> u64 {
        std::fs::read_dir(p)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| m.len())
            .sum()
    }
    let mut recs: Vec<(PathBuf, u64)> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("manifest.json").is_file())
        .map(|p| {
            let n = size(&p);
            (p, n)
        })
        .collect();
    recs.sort();
    let mut total: u64 = recs.iter().map(|(_, n)| n).sum();
    let mut deleted = 0;
    let deletable = recs.len().saturating_sub(keep);
    for (p, n) in recs.into_iter().take(deletable) {
        if total <= budget {
            break;
        }
        match std::fs::remove_dir_all(&p) {
            Ok(()) => {
                total -= n;
                deleted += 1;
                tracing::info!(dir = %p.display(), bytes = n, "recording deleted: over the recordings' size budget");
            }
            Err(e) => tracing::warn!(dir = %p.display(), "recording not deleted: {e}"),
        }
    }
    deleted
}

/// A recording read back: its manifest, every stage's per-frame service times, and the LM's
/// stream. A last line cut short (a killed process) is ignored; any other line that does not
/// parse is an error naming the file and line.
#[derive(Debug, Clone, Default)]
pub struct Recorded {
    /// The folder.
    pub dir: PathBuf,
    /// `manifest.json`.
    pub manifest: serde_json::Value,
    /// Stage names, in the runtime's order.
    pub stages: Vec<String>,
    /// Per stage (by name): (frame, seconds inside the stage), in order.
    pub service: std::collections::BTreeMap<String, Vec<(u64, f64)>>,
    /// The LM's steps in order: the user codes it saw, the agent frame it produced (`null`
    /// while it had none), the context length after it.
    pub steps: Vec<RecordedStep>,
    /// Priming scripts, with the number of steps before each.
    pub primes: Vec<(usize, serde_json::Value)>,
    /// The live verdict changes (`verdicts.jsonl`), in order.
    pub verdicts: Vec<serde_json::Value>,
}

/// One LM step of a recording.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedStep {
    /// The user codes as the model saw them.
    pub user: serde_json::Value,
    /// The agent frame (`{text, audio}`) or `null`.
    pub agent: serde_json::Value,
    /// KV length after the step, when recorded.
    pub kv: Option<u64>,
}

/// Lines of a JSON Lines file; a bad last line is dropped (cut short by a kill), any other is an
/// error.
fn json_lines(path: &Path) -> Result<Vec<serde_json::Value>, RecordError> {
    let text = std::fs::read_to_string(path).map_err(|e| RecordError::new(path.display(), e))?;
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, l) in lines.iter().enumerate() {
        match serde_json::from_str::<serde_json::Value>(l) {
            Ok(v) => out.push(v),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => {
                return Err(RecordError::new(
                    format!("{}:{}", path.display(), i + 1),
                    format!("not a recording line ({e}); was the file edited?"),
                ))
            }
        }
    }
    Ok(out)
}

impl Recorded {
    /// Reads the recording in `dir`.
    ///
    /// # Errors
    ///
    /// A [`RecordError`] naming the folder or file: not a recording, written by another format version,
    /// a line that does not parse, an index that names no stage.
    pub fn open(dir: &Path) -> Result<Recorded, RecordError> {
        let mpath = dir.join("manifest.json");
        if !dir.is_dir() {
            return Err(RecordError::new(dir.display(), "no such recording folder"));
        }
        let text = std::fs::read_to_string(&mpath).map_err(|e| {
            RecordError::new(
                dir.display(),
                format!("not a recording ({}: {e})", mpath.display()),
            )
        })?;
        let manifest: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| RecordError::new(mpath.display(), format!("not valid JSON ({e})")))?;
        if manifest["format"] != FORMAT {
            return Err(RecordError::new(
                mpath.display(),
                format!("not a duplex recording (format {})", manifest["format"]),
            ));
        }
        let version = manifest["version"].as_u64().unwrap_or(0);
        if version != u64::from(VERSION) {
            return Err(RecordError::new(
                mpath.display(),
                format!(
                    "recording format version {version} (duplex {}); this build reads version \
                     {VERSION}",
                    manifest["duplex"].as_str().unwrap_or("?")
                ),
            ));
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| RecordError::new(dir.display(), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("timings.") && n.ends_with(".jsonl"))
            })
            .collect();
        files.sort();
        let mut r = Recorded {
            dir: dir.to_path_buf(),
            manifest,
            ..Default::default()
        };
        for f in &files {
            let lines = json_lines(f)?;
            let Some(header) = lines.first() else {
                continue;
            };
            let stages: Vec<String> = header["stages"]
                .as_array()
                .ok_or_else(|| {
                    RecordError::new(format!("{}:1", f.display()), "no header naming the stages")
                })?
                .iter()
                .map(|s| s.as_str().unwrap_or("").to_string())
                .collect();
            r.stages = stages.clone();
            for (i, l) in lines.iter().enumerate().skip(1) {
                let (Some(st), Some(us)) = (l["stage"].as_u64(), l["service_us"].as_u64()) else {
                    continue;
                };
                let name = stages.get(st as usize).ok_or_else(|| {
                    RecordError::new(
                        format!("{}:{}", f.display(), i + 1),
                        format!("stage {st} is not in the header"),
                    )
                })?;
                r.service
                    .entry(name.clone())
                    .or_default()
                    .push((l["frame"].as_u64().unwrap_or(0), us as f64 / 1e6));
            }
        }
        let lm = dir.join("lm.jsonl");
        if lm.exists() {
            for l in json_lines(&lm)? {
                if l.get("step").is_some() {
                    r.steps.push(RecordedStep {
                        user: l["user"].clone(),
                        agent: l["agent"].clone(),
                        kv: l["kv"].as_u64(),
                    });
                } else if let Some(p) = l.get("prime") {
                    r.primes.push((r.steps.len(), p.clone()));
                }
            }
        }
        let v = dir.join("verdicts.jsonl");
        if v.exists() {
            r.verdicts = json_lines(&v)?;
        }
        Ok(r)
    }

    /// The manifest's stage named `name`: (kind, params, the rest).
    pub fn stage(&self, name: &str) -> Option<&serde_json::Value> {
        self.manifest["stages"]
            .as_array()?
            .iter()
            .find(|s| s["name"] == name)
    }

    /// The first stage of `kind` in the manifest.
    pub fn stage_of_kind(&self, kind: &str) -> Option<&serde_json::Value> {
        self.manifest["stages"]
            .as_array()?
            .iter()
            .find(|s| s["kind"] == kind)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// Regression: two recordings started in the same second (`ctl record on` twice) shared a
    /// folder name, and the second failed with "already holds a recording".
    #[test]
    fn recordings_started_at_once_get_folders_of_their_own_and_a_discarded_one_is_gone() {
        let root = tempfile::tempdir().unwrap();
        let recs: Vec<super::Recording> = (0..5)
            .map(|_| super::Recording::create(root.path(), serde_json::json!({}), 1 << 20).unwrap())
            .collect();
        let mut dirs: Vec<&Path> = recs.iter().map(|r| r.dir()).collect();
        dirs.sort();
        dirs.dedup();
        assert_eq!(dirs.len(), 5);
        for d in &dirs {
            assert!(d.join("manifest.json").is_file(), "{}", d.display());
        }
        recs[0].discard();
        assert!(!recs[0].dir().exists());
        assert!(recs[1].dir().exists());
    }

    #[test]
    fn pruning_deletes_the_oldest_recordings_down_to_the_budget_and_keeps_the_newest() {
        let root = tempfile::tempdir().unwrap();
        for (name, bytes) in [
            ("20260101-000000-1", 3000),
            ("20260102-000000-1", 3000),
            ("20260103-000000-1", 3000),
            ("20260104-000000-1", 3000),
        ] {
            let d = root.path().join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("manifest.json"), "{}").unwrap();
            std::fs::write(d.join("timings.0000.jsonl"), vec![b'x'; bytes]).unwrap();
        }
        // Not a recording: never touched.
        std::fs::create_dir_all(root.path().join("notes")).unwrap();
        let left = |r: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(r)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(super::prune(root.path(), 7000, 1), 2);
        assert_eq!(
            left(root.path()),
            ["20260103-000000-1", "20260104-000000-1", "notes"]
        );
        // The newest `keep` stay even over budget.
        assert_eq!(super::prune(root.path(), 0, 1), 1);
        assert_eq!(left(root.path()), ["20260104-000000-1", "notes"]);
    }

    #[test]
    fn folder_names_are_utc_dates() {
        assert_eq!(super::chrono_like(0), "19700101-000000");
        assert_eq!(super::chrono_like(1_796_137_385), "20261201-150305");
    }
}
