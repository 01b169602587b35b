//! The process's cache of primed conversation states (`priming: cached`), and its file.
//!
//! - **The cache.** [`PrimeCache`] keeps the state a priming left
//!   ([`TemporalState`]) under the digest of what computed it ([`PrimeRecipe::key`]: the pack's
//!   files as they are now, the graph, the chunk, every frame fed), shared by every
//!   conversation of the process, least recently used first out, bounded in bytes; counted in
//!   `duplex_prime_cache_total{result}`, `_bytes`, `_evictions_total`.
//! - **The file.** [`PrimeCache::save`] writes the states whose recipe it knows, with what
//!   computed them in terms that hold on any machine (the temporal graph's identity, not its
//!   path); [`PrimeCache::load`] puts them back under the keys they have here, on the pack of
//!   those given whose temporal graph is the same, and refuses a state of another graph naming
//!   both. Format: a first line `duplex-primed-states 1`, a JSON line describing every state
//!   (its recipe, its shape, the length of each of its buffers), then those buffers' bytes in
//!   order.
//!
//! Knows nothing of stages, pipelines or the network.

use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::pack_version;
use crate::model::pack::{FloatType, Variant};
use crate::model::temporal::TemporalState;
use crate::observe::names;

/// The first line of a state file.
const MAGIC: &str = "duplex-primed-states 1";
/// The longest description line read (the frames of every state are in it).
const MAX_HEADER: u64 = 64 << 20;

/// Why a file of primed states could not be written or read: where (the file, or a pack whose
/// temporal graph could not be identified) and what was wrong there.
pub type PrimeFileError = crate::files::FileError;

/// What a primed state was computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimeRecipe {
    /// The pack's folder.
    pub pack: PathBuf,
    /// What ran the temporal graph: its provider and cache dtype, and the cache mode
    /// (`cpu f32 kv=Resident`).
    pub graph: String,
    /// Frames per prefill call.
    pub chunk: usize,
    /// Every frame fed, in order.
    pub frames: Vec<Vec<i64>>,
}

impl PrimeRecipe {
    /// The cache's key: a SHA-256 of the pack as it is now on this machine
    /// ([`pack_version`]), the graph, the chunk and the frames.
    pub fn key(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(pack_version(&self.pack).as_bytes());
        h.update(b"\n");
        h.update(self.graph.as_bytes());
        h.update(self.chunk.to_le_bytes());
        for f in &self.frames {
            for t in f {
                h.update(t.to_le_bytes());
            }
        }
        h.finalize().into()
    }
}

/// What identifies a pack's temporal graph wherever the pack lies: a SHA-256 of its graph file
/// and, of each file beside it (the external weights), its name, size and first and last MiB.
///
/// # Errors
///
/// The graph's folder cannot be read.
pub fn temporal_identity(pack: &Path) -> std::io::Result<String> {
    let dir = pack.join("temporal");
    let mut h = Sha256::new();
    h.update(std::fs::read(dir.join("model.onnx"))?);
    let mut others: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n != "model.onnx") && p.is_file())
        .collect();
    others.sort();
    for p in others {
        let mut f = std::fs::File::open(&p)?;
        let len = f.metadata()?.len();
        h.update(p.file_name().unwrap_or_default().as_encoded_bytes());
        h.update(len.to_le_bytes());
        let mut buf = vec![0u8; (1 << 20).min(len as usize)];
        f.read_exact(&mut buf)?;
        h.update(&buf);
        if len > 1 << 20 {
            use std::io::Seek;
            f.seek(std::io::SeekFrom::End(-(buf.len() as i64)))?;
            f.read_exact(&mut buf)?;
            h.update(&buf);
        }
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Primed conversation states, by what primed them: a cache shared by every conversation of
/// the process, least recently used first out, bounded in bytes.
#[derive(Debug)]
pub struct PrimeCache {
    max_bytes: usize,
    inner: Mutex<PrimeEntries>,
}

#[derive(Debug)]
struct Entry {
    state: Arc<TemporalState>,
    used: u64,
    recipe: Option<Arc<PrimeRecipe>>,
}

#[derive(Debug, Default)]
struct PrimeEntries {
    bytes: usize,
    clock: u64,
    map: HashMap<[u8; 32], Entry>,
}

impl PrimeCache {
    /// A cache of at most `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        PrimeCache {
            max_bytes,
            inner: Mutex::default(),
        }
    }

    /// The state primed by `key`, when kept (counted as a hit or a miss).
    pub fn get(&self, key: &[u8; 32]) -> Option<Arc<TemporalState>> {
        let found = self.inner.lock().ok().and_then(|mut e| {
            e.clock += 1;
            let now = e.clock;
            e.map.get_mut(key).map(|entry| {
                entry.used = now;
                entry.state.clone()
            })
        });
        let result = if found.is_some() { "hit" } else { "miss" };
        metrics::counter!(names::PRIME_CACHE, "result" => result).increment(1);
        found
    }

    /// Keeps `state` under `key` (with what computed it, when known: a state without a recipe
    /// is not saved to a file), dropping the least recently used states until the cache is
    /// within its bytes (a state larger than the whole cache is not kept).
    pub fn put(&self, key: [u8; 32], state: TemporalState, recipe: Option<PrimeRecipe>) {
        let size = state.bytes();
        if size > self.max_bytes {
            return;
        }
        let Ok(mut e) = self.inner.lock() else {
            return;
        };
        e.clock += 1;
        let entry = Entry {
            state: Arc::new(state),
            used: e.clock,
            recipe: recipe.map(Arc::new),
        };
        if let Some(old) = e.map.insert(key, entry) {
            e.bytes -= old.state.bytes();
        }
        e.bytes += size;
        while e.bytes > self.max_bytes {
            let Some(oldest) = e.map.iter().min_by_key(|(_, x)| x.used).map(|(k, _)| *k) else {
                break;
            };
            if let Some(x) = e.map.remove(&oldest) {
                e.bytes -= x.state.bytes();
                metrics::counter!(names::PRIME_CACHE_EVICTIONS).increment(1);
            }
        }
        metrics::gauge!(names::PRIME_CACHE_BYTES).set(e.bytes as f64);
    }

    /// States kept, and their bytes.
    pub fn usage(&self) -> (usize, usize) {
        self.inner
            .lock()
            .map(|e| (e.map.len(), e.bytes))
            .unwrap_or((0, 0))
    }

    /// Writes every state whose recipe is known to `path` (through a file beside it, renamed
    /// over it when complete). Returns how many.
    ///
    /// # Errors
    ///
    /// The file cannot be written, or a state's pack cannot be read (naming it).
    pub fn save(&self, path: &Path) -> Result<usize, PrimeFileError> {
        let entries: Vec<(Arc<TemporalState>, Arc<PrimeRecipe>)> = self
            .inner
            .lock()
            .map(|e| {
                let mut v: Vec<_> = e
                    .map
                    .values()
                    .filter_map(|x| Some((x.used, x.state.clone(), x.recipe.clone()?)))
                    .collect();
                // The most recently used last: loading them in order keeps that order.
                v.sort_by_key(|(used, _, _)| *used);
                v.into_iter().map(|(_, s, r)| (s, r)).collect()
            })
            .unwrap_or_default();
        let mut identities = HashMap::new();
        let mut states = Vec::new();
        for (s, r) in &entries {
            let id = match identities.get(&r.pack) {
                Some(id) => id,
                None => {
                    let id = temporal_identity(&r.pack)
                        .map_err(|e| PrimeFileError::new(r.pack.display(), e))?;
                    identities.entry(r.pack.clone()).or_insert(id)
                }
            };
            let (layers, heads, head_dim, dtype, variant) = s.shape;
            states.push(serde_json::json!({
                "pack": r.pack.file_name().map(|n| n.to_string_lossy().to_string()),
                "temporal": id,
                "graph": r.graph,
                "chunk": r.chunk,
                "frames": r.frames,
                "len": s.len,
                "pos": s.pos,
                "layers": layers,
                "heads": heads,
                "head_dim": head_dim,
                "dtype": dtype.name(),
                "variant": match variant { Variant::Gqa => "gqa", Variant::Standard => "standard" },
                "buffers": s.rows.iter().map(Vec::len).collect::<Vec<_>>(),
            }));
        }
        let tmp = path.with_extension("partial");
        let write = || -> std::io::Result<()> {
            let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            writeln!(f, "{MAGIC}")?;
            serde_json::to_writer(&mut f, &serde_json::json!({ "states": states }))?;
            writeln!(f)?;
            for (s, _) in &entries {
                for b in &s.rows {
                    f.write_all(b)?;
                }
            }
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            PrimeFileError::new(path.display(), e)
        })?;
        Ok(entries.len())
    }

    /// Reads the states of a file [`save`](Self::save) wrote and keeps each under the key it
    /// has here: on the pack among `packs` whose temporal graph is the one that computed it.
    /// Returns how many.
    ///
    /// # Errors
    ///
    /// A file that is not a state file or is cut short, and a state of a temporal graph none of
    /// `packs` has (naming the pack it was primed on and those it was offered), each naming the
    /// file.
    pub fn load(&self, path: &Path, packs: &[PathBuf]) -> Result<usize, PrimeFileError> {
        let at = |e: String| PrimeFileError::new(path.display(), e);
        let f = std::fs::File::open(path).map_err(|e| at(e.to_string()))?;
        let file_len = f.metadata().map_err(|e| at(e.to_string()))?.len();
        let mut r = std::io::BufReader::new(f);
        let mut line = String::new();
        let mut consumed = (&mut r)
            .take(64)
            .read_line(&mut line)
            .map_err(|e| at(e.to_string()))? as u64;
        if line.trim_end() != MAGIC {
            return Err(at(format!(
                "not a file of primed states (it starts {:?}; `duplex prime` writes them)",
                line.trim_end()
            )));
        }
        line.clear();
        consumed += (&mut r)
            .take(MAX_HEADER)
            .read_line(&mut line)
            .map_err(|e| at(e.to_string()))? as u64;
        let header: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| at(format!("its description: {e}")))?;
        let described = header["states"]
            .as_array()
            .ok_or_else(|| at("its description lists no states".into()))?;
        // The buffers it declares are the bytes that follow, exactly: nothing is allocated for
        // more than the file holds.
        let declared = described.iter().try_fold(0u64, |sum, d| {
            d["buffers"]
                .as_array()?
                .iter()
                .try_fold(sum, |s, b| s.checked_add(b.as_u64()?))
        });
        if declared != Some(file_len.saturating_sub(consumed)) {
            return Err(at(format!(
                "its states declare {} bytes, and {} follow their description",
                declared.map_or("an impossible number of".to_string(), |n| n.to_string()),
                file_len.saturating_sub(consumed)
            )));
        }
        let mut ids: Vec<(PathBuf, String)> = Vec::new();
        for p in packs {
            if !ids.iter().any(|(q, _)| q == p) {
                let id = temporal_identity(p).map_err(|e| PrimeFileError::new(p.display(), e))?;
                ids.push((p.clone(), id));
            }
        }
        let mut loaded = Vec::new();
        for (i, d) in described.iter().enumerate() {
            let bad = |why: &str| at(format!("state {}: {why}", i + 1));
            let temporal = d["temporal"].as_str().ok_or_else(|| bad("no `temporal`"))?;
            let Some((pack, _)) = ids.iter().find(|(_, id)| id == temporal) else {
                let offered: Vec<String> = ids
                    .iter()
                    .map(|(p, id)| format!("{} ({})", p.display(), &id[..12]))
                    .collect();
                return Err(bad(&format!(
                    "primed on pack {} (temporal graph {}), not on {}",
                    d["pack"].as_str().unwrap_or("?"),
                    // The file's text: cut by characters, never inside one.
                    temporal.chars().take(12).collect::<String>(),
                    if offered.is_empty() {
                        "any pack of this configuration".to_string()
                    } else {
                        offered.join(" or ")
                    }
                )));
            };
            let (state, recipe) = read_state(d, pack, &mut r).map_err(|e| bad(&e))?;
            loaded.push((state, recipe));
        }
        let mut rest = [0u8; 1];
        if r.read(&mut rest).map_err(|e| at(e.to_string()))? != 0 {
            return Err(at("more bytes than its states hold".into()));
        }
        let n = loaded.len();
        for (state, recipe) in loaded {
            self.put(recipe.key(), state, Some(recipe));
        }
        Ok(n)
    }
}

/// One state of a file: its description `d` and its buffers' bytes, read from `r`.
fn read_state(
    d: &serde_json::Value,
    pack: &Path,
    r: &mut impl Read,
) -> Result<(TemporalState, PrimeRecipe), String> {
    let int = |k: &str| {
        d[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| format!("no `{k}`"))
    };
    let (len, pos) = (int("len")?, int("pos")?);
    let (layers, heads, head_dim) = (int("layers")?, int("heads")?, int("head_dim")?);
    let (dtype, es) = match d["dtype"].as_str() {
        Some("f32") => (FloatType::F32, 4),
        Some("f16") => (FloatType::F16, 2),
        other => return Err(format!("dtype {other:?}")),
    };
    let variant = match d["variant"].as_str() {
        Some("gqa") => Variant::Gqa,
        Some("standard") => Variant::Standard,
        other => return Err(format!("variant {other:?}")),
    };
    let frames: Vec<Vec<i64>> =
        serde_json::from_value(d["frames"].clone()).map_err(|e| format!("`frames`: {e}"))?;
    let sizes: Vec<usize> =
        serde_json::from_value(d["buffers"].clone()).map_err(|e| format!("`buffers`: {e}"))?;
    // Every buffer is one layer's K or V: heads × len × head_dim values.
    let each = heads
        .checked_mul(len)
        .and_then(|x| x.checked_mul(head_dim))
        .and_then(|x| x.checked_mul(es));
    if sizes.len() != 2 * layers || each.is_none_or(|n| sizes.iter().any(|s| *s != n)) {
        return Err(format!(
            "{} buffers for {layers} layers of {heads} heads × {len} rows × {head_dim}",
            sizes.len()
        ));
    }
    let mut rows = Vec::with_capacity(sizes.len());
    for n in sizes {
        let mut b = vec![0u8; n];
        r.read_exact(&mut b)
            .map_err(|e| format!("its bytes are cut short ({e})"))?;
        rows.push(b);
    }
    let recipe = PrimeRecipe {
        pack: pack.to_path_buf(),
        graph: d["graph"].as_str().ok_or("no `graph`")?.to_string(),
        chunk: int("chunk")?,
        frames,
    };
    let state = TemporalState {
        len,
        pos,
        rows,
        shape: (layers, heads, head_dim, dtype, variant),
    };
    Ok((state, recipe))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state file survives its round trip; every truncation and every flipped byte of it is
    /// refused or read, never a panic; a state of another temporal graph is refused, naming
    /// the pack it was primed on.
    #[test]
    fn a_state_file_round_trips_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let pack = dir.path().join("pack");
        std::fs::create_dir_all(pack.join("temporal")).unwrap();
        std::fs::write(pack.join("temporal/model.onnx"), b"graph").unwrap();
        std::fs::write(pack.join("temporal/model.onnx.data"), vec![7u8; 3000]).unwrap();
        let state = TemporalState {
            len: 2,
            pos: 2,
            rows: vec![(0..16).collect(), (16..32).collect()],
            shape: (1, 1, 2, FloatType::F32, Variant::Gqa),
        };
        let recipe = PrimeRecipe {
            pack: pack.clone(),
            graph: "cpu f32 kv=Resident".into(),
            chunk: 32,
            frames: vec![vec![1, 2, 3], vec![4, 5, 6]],
        };
        let key = recipe.key();
        let c = PrimeCache::new(1 << 20);
        c.put(key, state, Some(recipe));
        let file = dir.path().join("states");
        assert_eq!(c.save(&file).unwrap(), 1);
        let d = PrimeCache::new(1 << 20);
        assert_eq!(d.load(&file, std::slice::from_ref(&pack)).unwrap(), 1);
        let back = d.get(&key).expect("the same key here");
        assert_eq!(
            back.rows,
            vec![(0..16).collect::<Vec<u8>>(), (16..32).collect()]
        );
        assert_eq!((back.len, back.pos), (2, 2));

        let bytes = std::fs::read(&file).unwrap();
        let damaged = dir.path().join("damaged");
        for cut in 0..bytes.len() {
            std::fs::write(&damaged, &bytes[..cut]).unwrap();
            let e = PrimeCache::new(1 << 20).load(&damaged, std::slice::from_ref(&pack));
            assert!(e.is_err(), "cut at {cut}");
            // The file at fault, named.
            assert!(e.unwrap_err().at.contains("damaged"));
        }
        for at in 0..bytes.len() {
            let mut b = bytes.clone();
            b[at] ^= 0x5a;
            std::fs::write(&damaged, &b).unwrap();
            let _ = PrimeCache::new(1 << 20).load(&damaged, std::slice::from_ref(&pack));
        }
        // A graph identity that is not hex (a character of several bytes at the cut) is named,
        // not a panic.
        let text = String::from_utf8_lossy(&bytes).replace(
            &format!(
                "\"temporal\":\"{}",
                &temporal_identity(&pack).unwrap()[..11]
            ),
            "\"temporal\":\"abcdefghijké",
        );
        std::fs::write(&damaged, text.as_bytes()).unwrap();
        let e = PrimeCache::new(1 << 20)
            .load(&damaged, std::slice::from_ref(&pack))
            .unwrap_err();
        assert!(e.what.contains("graph abcdefghijké"), "{e}");
        // Another pack's graph.
        let other = dir.path().join("other");
        std::fs::create_dir_all(other.join("temporal")).unwrap();
        std::fs::write(other.join("temporal/model.onnx"), b"another graph").unwrap();
        let e = PrimeCache::new(1 << 20).load(&file, &[other]).unwrap_err();
        assert!(
            e.what.contains("primed on pack pack") && e.what.contains("other"),
            "{e}"
        );
    }

    #[test]
    fn the_prime_cache_keeps_states_within_its_bytes_least_recently_used_out() {
        let c = PrimeCache::new(1000);
        let k = |i: u8| [i; 32];
        c.put(k(1), TemporalState::filler(400), None);
        c.put(k(2), TemporalState::filler(400), None);
        assert_eq!(c.usage(), (2, 800));
        // 1 is used again, so 2 is the least recently used when 3 needs room.
        assert!(c.get(&k(1)).is_some());
        c.put(k(3), TemporalState::filler(400), None);
        assert_eq!(c.usage(), (2, 800));
        assert!(c.get(&k(2)).is_none(), "evicted");
        assert!(c.get(&k(1)).is_some() && c.get(&k(3)).is_some());
        // Another key is a miss; a state larger than the whole cache is not kept.
        assert!(c.get(&k(9)).is_none());
        c.put(k(4), TemporalState::filler(2000), None);
        assert!(c.get(&k(4)).is_none());
        assert_eq!(c.usage(), (2, 800));
        // The same key again replaces its state.
        c.put(k(3), TemporalState::filler(100), None);
        assert_eq!(c.usage(), (2, 500));
    }
}
