//! The bad-input suite: generated inputs to every parser that takes outside input (pipeline and
//! daemon YAML with their `--set` and environment layers, `pack.yaml`, codes JSON, WAV files,
//! control-socket lines, a network client's Ogg/Opus stream cut into messages anywhere, the query
//! parameters of `/api/chat`, the JSON events of `/v1/realtime`), most of them almost valid so that they reach the deep checks, some
//! hostile (alias bombs, deep nesting, lying headers). Every case asserts: no panic, a bounded
//! cost (memory allocated by the parsing thread; a deadline far above any real cost, to catch
//! hangs), and an error that names its source (the file, the variable, the flag).
//!
//! `make test` runs a few thousand cases; `make fuzz` runs many more (`PROPTEST_CASES`, per
//! property). A failing case is printed, shrunk, by proptest.

#[path = "it/support/packs.rs"]
mod packs;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::Config;

use duplex::config::{LoadOptions, Override};
use duplex::stages::Registry;

/// Memory allocated by each thread, live and at its peak, so that a case's cost is measured
/// while other tests run on other threads.
mod meter {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    pub struct Meter;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    fn add(n: isize) {
        let _ = LIVE.try_with(|l| {
            let v = l.get() + n;
            l.set(v);
            let _ = PEAK.try_with(|p| {
                if v > p.get() {
                    p.set(v)
                }
            });
        });
    }

    // SAFETY: every call is forwarded to the system allocator unchanged; the counters are
    // thread-local cells that never allocate.
    unsafe impl GlobalAlloc for Meter {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            add(l.size() as isize);
            // SAFETY: the caller's contract for `alloc` is passed on as is.
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            add(-(l.size() as isize));
            // SAFETY: `p` was allocated by `System` with layout `l` (see `alloc`).
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            add(l.size() as isize);
            // SAFETY: as for `alloc`.
            unsafe { System.alloc_zeroed(l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
            add(new as isize - l.size() as isize);
            // SAFETY: `p` was allocated by `System` with layout `l`.
            unsafe { System.realloc(p, l, new) }
        }
    }

    /// Starts measuring: the peak is reset to what is live now.
    pub fn start() -> isize {
        let live = LIVE.with(|l| l.get());
        PEAK.with(|p| p.set(live));
        live
    }

    /// Bytes above `base` at the peak since `start`.
    pub fn peak_above(base: isize) -> isize {
        PEAK.with(|p| p.get()) - base
    }
}

#[global_allocator]
static METER: meter::Meter = meter::Meter;

/// What one case may allocate: far above a configuration's real cost, far below what a bomb
/// would need.
const MAX_BYTES: isize = 64 << 20;
/// A hang detector, not a measure of speed: every case takes milliseconds.
const DEADLINE: Duration = Duration::from_secs(20);

/// Runs one case: no panic, bounded memory, no hang.
fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> T {
    scratch();
    let base = meter::start();
    let t0 = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(f));
    let peak = meter::peak_above(base);
    let took = t0.elapsed();
    let r = r.unwrap_or_else(|_| panic!("{what}: panicked"));
    assert!(peak < MAX_BYTES, "{what}: allocated {peak} bytes");
    assert!(took < DEADLINE, "{what}: took {took:?}");
    r
}

fn config(cases: u32) -> Config {
    let mut c = Config::with_cases(
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(cases),
    );
    c.failure_persistence = None;
    c
}

/// The scratch directory, which is also the working directory of this test process: a
/// generated relative path (a sink's output) lands there, never in the checkout. Everything
/// else the tests name is absolute.
fn scratch() -> &'static Path {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        std::env::set_current_dir(d.path()).unwrap();
        d
    })
    .path()
}

/// A file of its own for one case (tests run in parallel).
fn case_file(name: &str, bytes: &[u8]) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = scratch().join(format!("case-{}", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

// --- values and YAML text --------------------------------------------------------------------

/// A YAML value as text (flow style), drawn from what users write and what breaks parsers.
fn value() -> BoxedStrategy<String> {
    let leaf = prop_oneof![
        (-5i64..70_000).prop_map(|i| i.to_string()),
        any::<i64>().prop_map(|i| i.to_string()),
        (-1e6f64..1e6).prop_map(|x| format!("{x}")),
        prop::sample::select(vec![
            "true",
            "false",
            "~",
            "null",
            ".inf",
            "-.inf",
            ".nan",
            "0x1f",
            "1e400",
            "''",
            "\"\"",
            "-0",
            "99999999999999999999",
            "0.0",
            "block",
            "drop_oldest",
            "sine",
            "cpu",
            "cuda",
            "virtual",
            "default",
            "reset_and_reprime",
            "i16",
            "f32",
            "!!str 1",
            "!!int x",
            "!custom 1",
            "\"\\u0000\"",
            "'it''s'",
            "/nonexistent/in.wav",
            "models/none",
            "a -> b",
            "24000",
            "1920",
            "8",
        ])
        .prop_map(str::to_string),
        "[a-z_./]{0,12}",
        "\\PC{0,8}".prop_map(|s| format!("{s:?}")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(", "))),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..3).prop_map(|kv| {
                let parts: Vec<String> = kv.into_iter().map(|(k, v)| format!("{k}: {v}")).collect();
                format!("{{{}}}", parts.join(", "))
            }),
        ]
    })
    .boxed()
}

/// Byte-level damage to a text: the typos, truncations and pastes of real files.
fn damage(text: String) -> impl Strategy<Value = String> {
    let len = text.len().max(1);
    prop::collection::vec(
        (
            0..len,
            prop_oneof![
                Just(String::new()),
                prop::sample::select(vec![
                    ":", "-", "[", "]", "{", "}", "&a ", "*a", "\n", "  ", "\t", "#", "---\n", "'",
                    "\"", ",", "!!", "?", "|", ">", "%", "@", "`", "\u{0}", "\u{feff}",
                ])
                .prop_map(str::to_string),
            ],
            0..3usize,
        ),
        0..4,
    )
    .prop_map(move |edits| {
        let mut s = text.clone().into_bytes();
        for (at, insert, cut) in edits {
            let at = at.min(s.len());
            let end = (at + cut).min(s.len());
            s.splice(at..end, insert.into_bytes());
        }
        String::from_utf8_lossy(&s).into_owned()
    })
}

/// A text whose anchors and aliases stand for `fanout^depth` values.
fn alias_bomb() -> impl Strategy<Value = String> {
    (2usize..12, 2usize..12, any::<bool>()).prop_map(|(fanout, depth, as_map)| {
        let mut s = format!("l0: &l0 [{}]\n", vec!["x"; fanout].join(", "));
        for i in 1..depth {
            let refs = vec![format!("*l{}", i - 1); fanout].join(", ");
            if as_map {
                let kv: Vec<String> = (0..fanout).map(|k| format!("k{k}: *l{}", i - 1)).collect();
                s.push_str(&format!("l{i}: &l{i} {{{}}}\n", kv.join(", ")));
            } else {
                s.push_str(&format!("l{i}: &l{i} [{refs}]\n"));
            }
        }
        s
    })
}

/// Deep nesting, in flow or block style.
fn deep() -> impl Strategy<Value = String> {
    (1usize..3000, any::<bool>()).prop_map(|(depth, flow)| {
        if flow {
            format!("a: {}{}\n", "[".repeat(depth), "]".repeat(depth))
        } else {
            (0..depth.min(400))
                .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
                .collect()
        }
    })
}

// --- pipeline files ----------------------------------------------------------------------------

/// A value of the right type for `spec` most of the time (so that cases get past the parser
/// to the params, the graph and the stages), anything at all otherwise.
fn param_value(spec: duplex::config::ParamSpec) -> BoxedStrategy<String> {
    use duplex::config::ParamType as T;
    let typed: BoxedStrategy<String> = match spec.ty {
        T::Bool => any::<bool>().prop_map(|b| b.to_string()).boxed(),
        T::Int { min, max } => {
            let hi = max.min(min.saturating_add(100_000));
            prop_oneof![4 => (min..=hi).prop_map(|i| i.to_string()), 1 => any::<i64>().prop_map(|i| i.to_string())].boxed()
        }
        T::Float { min, max } => {
            let hi = max.min(min + 1e5);
            prop_oneof![4 => (min..=hi).prop_map(|x| format!("{x}")), 1 => any::<f64>().prop_map(|x| format!("{x:e}"))].boxed()
        }
        T::Str => "[a-z0-9 ]{0,8}".prop_map(|s| format!("'{s}'")).boxed(),
        T::Choice(c) => prop::sample::select(c.to_vec())
            .prop_map(str::to_string)
            .boxed(),
        // Inputs that exist (a WAV, a codes file) or not; packs that do not (so that no model
        // is ever loaded); outputs in the scratch directory.
        T::Path => prop::sample::select(vec!["in.wav", "codes.json", "missing"])
            .prop_map(|n| inputs().join(n).display().to_string())
            .boxed(),
        T::Dir => "[a-z]{1,6}"
            .prop_map(|n| format!("/nonexistent/{n}"))
            .boxed(),
        T::OutPath => "[a-z]{1,6}"
            .prop_map(|n| format!("{}/{n}.out", scratch().display()))
            .boxed(),
        T::IntList => prop::collection::vec(-10i64..40_000, 0..5)
            .prop_map(|v| {
                format!(
                    "[{}]",
                    v.iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })
            .boxed(),
    };
    prop_oneof![5 => typed, 1 => value()].boxed()
}

/// Input files the generated pipelines name: a short WAV and a short codes file.
fn inputs() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let d = scratch().join("inputs");
        std::fs::create_dir_all(&d).unwrap();
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 48_000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let mut w = hound::WavWriter::create(d.join("in.wav"), spec).unwrap();
        for i in 0..4800 {
            w.write_sample(((i * 31) % 1000) as i16).unwrap();
        }
        w.finalize().unwrap();
        std::fs::write(
            d.join("codes.json"),
            "[[1,2,3,4,5,6,7,8],[8,7,6,5,4,3,2,1]]",
        )
        .unwrap();
        d
    })
}

/// A stage of any kind but the microphone (which opens a sound device; the audio tests cover
/// it), with a random subset of its params.
fn stage() -> BoxedStrategy<String> {
    let kinds: Vec<duplex::stages::StageKind> = Registry::builtin()
        .kinds()
        .iter()
        .filter(|k| k.name != "mic")
        .copied()
        .collect();
    (0..kinds.len())
        .prop_flat_map(move |i| {
            let k = kinds[i];
            // Required params always, others at random.
            let (required, optional): (Vec<_>, Vec<_>) = k
                .params
                .iter()
                .copied()
                .partition(|p| matches!(p.default, duplex::config::ParamDefault::Required));
            let n = optional.len();
            prop::sample::subsequence(optional, 0..=n.min(4)).prop_flat_map(move |mut chosen| {
                chosen.extend(required.iter().copied());
                let values: Vec<BoxedStrategy<(String, String)>> = chosen
                    .into_iter()
                    .map(|spec| {
                        param_value(spec)
                            .prop_map(move |v| (spec.name.to_string(), v))
                            .boxed()
                    })
                    .collect();
                let name = k.name;
                values.prop_map(move |kv| {
                    let mut parts = vec![format!("kind: {name}")];
                    if name == "playback" && !kv.iter().any(|(k, _)| k == "device") {
                        parts.push("device: virtual".into());
                    }
                    parts.extend(kv.into_iter().map(|(k, v)| format!("{k}: {v}")));
                    format!("{{{}}}", parts.join(", "))
                })
            })
        })
        .boxed()
}

/// A pipeline document from the registry's own vocabulary: real kinds, real params with values
/// mostly of their type, links that chain the stages (and some that do not).
fn pipeline_doc() -> impl Strategy<Value = String> {
    let port = prop::sample::select(vec![
        "", "", "", ".out", ".in", ".step", ".agent", ".tokens", ".codes",
    ]);
    (
        prop::collection::vec(stage(), 1..6),
        prop::collection::vec((0usize..6, 0usize..6, port.clone(), port, 0u8..4), 0..8),
        prop_oneof![
            4 => Just(Vec::new()),
            1 => prop::collection::vec((prop::sample::select(vec!["description", "defaults", "runtime", "metrics", "ort", "bogus"]), value()), 1..2),
        ],
    )
        .prop_map(|(stages, links, top)| {
            let mut s = String::from("stages:\n");
            for (i, st) in stages.iter().enumerate() {
                s.push_str(&format!("  s{i}: {st}\n"));
            }
            s.push_str("links:\n");
            let n = stages.len();
            // A chain through every stage first, then a few more.
            for i in 1..n {
                s.push_str(&format!("  - s{} -> s{i}\n", i - 1));
            }
            for (a, b, pa, pb, style) in links {
                let (a, b) = (a % n, b % n);
                match style {
                    0 => s.push_str(&format!("  - {{ from: s{a}{pa}, to: s{b}{pb}, feedback: true }}\n")),
                    1 => s.push_str(&format!("  - {{ from: s{a}{pa}, to: s{b}{pb}, capacity: {}, overflow: drop_oldest }}\n", a + b)),
                    _ => s.push_str(&format!("  - s{a}{pa} -> s{b}{pb}\n")),
                }
            }
            for (k, v) in top {
                s.push_str(&format!("{k}: {v}\n"));
            }
            s
        })
}

/// A stage of `kind` with a random subset of its params (`fixed` always set).
fn stage_of(
    kind: &'static str,
    fixed: &'static [(&'static str, &'static str)],
) -> BoxedStrategy<String> {
    let k = *Registry::builtin().get(kind).unwrap();
    let optional: Vec<duplex::config::ParamSpec> = k
        .params
        .iter()
        .copied()
        .filter(|p| !fixed.iter().any(|(n, _)| *n == p.name))
        .collect();
    let n = optional.len();
    prop::sample::subsequence(optional, 0..=n.min(3))
        .prop_flat_map(move |chosen| {
            let values: Vec<BoxedStrategy<String>> = chosen
                .into_iter()
                .map(|spec| {
                    param_value(spec)
                        .prop_map(move |v| format!("{}: {v}", spec.name))
                        .boxed()
                })
                .collect();
            values.prop_map(move |mut kv| {
                kv.insert(0, format!("kind: {kind}"));
                kv.extend(fixed.iter().map(|(n, v)| format!("{n}: {v}")));
                format!("{{{}}}", kv.join(", "))
            })
        })
        .boxed()
}

/// The shape of the pipelines users run (a source, a resampler, a framer, a sink) with
/// params drawn at random: many are valid, many fail where stages meet (rates, frame sizes).
fn template_doc() -> impl Strategy<Value = String> {
    let wav_in: &'static str = Box::leak(
        inputs()
            .join("in.wav")
            .display()
            .to_string()
            .into_boxed_str(),
    );
    let out: &'static str = Box::leak(
        scratch()
            .join("t.wav")
            .display()
            .to_string()
            .into_boxed_str(),
    );
    let src: &'static [(&str, &str)] = Box::leak(vec![("path", wav_in)].into_boxed_slice());
    let sink: &'static [(&str, &str)] = Box::leak(vec![("path", out)].into_boxed_slice());
    (
        prop_oneof![
            stage_of("wav_source", src),
            stage_of("synth_source", &[("duration", "0.05")])
        ],
        stage_of("resample", &[]),
        prop::option::of(stage_of("framer", &[])),
        prop_oneof![
            stage_of("wav_sink", sink),
            stage_of("null_sink", &[]),
            stage_of("playback", &[("device", "virtual")]),
            stage_of("inject_delay", &[("base_ms", "0")]),
        ],
    )
        .prop_map(|(a, b, c, d)| {
            let mut stages = vec![a, b];
            stages.extend(c);
            stages.push(d);
            let mut s = String::from("stages:\n");
            for (i, st) in stages.iter().enumerate() {
                s.push_str(&format!("  s{i}: {st}\n"));
            }
            s.push_str("links:\n");
            for i in 1..stages.len() {
                s.push_str(&format!("  - s{} -> s{i}\n", i - 1));
            }
            s
        })
}

fn pipeline_text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => pipeline_doc(),
        4 => template_doc(),
        3 => prop_oneof![pipeline_doc().boxed(), template_doc().boxed()].prop_flat_map(damage),
        1 => alias_bomb(),
        1 => deep(),
        1 => "\\PC{0,200}",
    ]
}

/// Environment variables and `--set` flags over a pipeline.
/// `KEY=value` pairs.
type Pairs = Vec<(String, String)>;

fn layers() -> impl Strategy<Value = (Pairs, Pairs)> {
    let key = prop::sample::select(vec![
        "defaults.capacity",
        "defaults.overflow",
        "runtime.drain_timeout_ms",
        "metrics.window",
        "metrics.address",
        "ort.library",
        "stages.s0.kind",
        "stages.s0.path",
        "stages.s1.to",
        "stages..x",
        "bogus",
        "stages.s0",
        "links",
        "stages.s9.kind",
        "a.b.c.d",
    ]);
    let few = |key: prop::sample::Select<&'static str>| prop_oneof![3 => Just(Vec::new()), 1 => prop::collection::vec((key, value()), 1..3)];
    (few(key.clone()), few(key)).prop_map(|(env, sets)| {
        let env = env
            .into_iter()
            .map(|(k, v)| {
                (
                    format!("DUPLEX__{}", k.replace('.', "__").to_uppercase()),
                    v,
                )
            })
            .collect();
        (
            env,
            sets.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        )
    })
}

/// An error must lead with where it came from: the file, a variable, a flag.
fn names_its_source(e: &str, file: &Path) -> bool {
    e.starts_with(&file.display().to_string())
        || e.starts_with("environment variable DUPLEX__")
        || e.starts_with("--set ")
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn pipeline_files_with_their_layers(text in pipeline_text(), (env, sets) in layers()) {
        let p = case_file("p.yaml", text.as_bytes());
        let opts = LoadOptions {
            sets: sets.iter().map(|(k, v)| Override::set(k.clone(), v.clone())).collect(),
            env: Some(env.iter().cloned().collect::<HashMap<_, _>>()),
        };
        let r = bounded(&text, || duplex::app::validate(&p, &opts, &Registry::builtin()));
        if let Err(e) = r {
            let e = e.to_string();
            prop_assert!(names_its_source(&e, &p), "{e}\n--- from ---\n{text}\n{env:?} {sets:?}");
        }
    }
}

// --- the daemon's configuration ----------------------------------------------------------------

fn daemon_text() -> impl Strategy<Value = String> {
    let pipeline = Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/daemon.yaml");
    let key = prop::sample::select(vec![
        "pack",
        "input_device",
        "output_device",
        "persona",
        "persona_tokens",
        "tokenizer",
        "voice",
        "long_session",
        "metrics_address",
        "control_socket",
        "sampling",
        "samplng",
        "sampling.seed",
        "pipeline",
    ]);
    let doc = prop::collection::vec((key, value()), 0..6)
        .prop_map(move |kv| {
            let mut s = format!("pipeline: {}\n", pipeline.display());
            for (k, v) in kv {
                match k.split_once('.') {
                    Some((a, b)) => s.push_str(&format!("{a}:\n  {b}: {v}\n")),
                    None => s.push_str(&format!("{k}: {v}\n")),
                }
            }
            s
        })
        .boxed();
    prop_oneof![
        4 => doc.clone(),
        4 => doc.prop_flat_map(damage),
        1 => alias_bomb(),
        1 => deep(),
    ]
}

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn daemon_configurations(text in daemon_text(), env in prop::collection::vec((prop::sample::select(vec!["DUPLEX__PACK", "DUPLEX__PERSONA_TOKENS", "DUPLEX__SAMPLING__SEED", "DUPLEX__BOGUS", "DUPLEX__SAMPLING"]), value()), 0..2)) {
        let p = case_file("daemon.yaml", text.as_bytes());
        let env: HashMap<String, String> = env.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let r = bounded(&text, || {
            duplex::app::daemon::load_config(Some(&p), Some(env.clone())).and_then(|c| c.pipeline_spec().map(|_| ()))
        });
        if let Err(e) = r {
            let e = e.to_string();
            prop_assert!(
                names_its_source(&e, &p) || e.starts_with("configs/daemon.yaml (built in)"),
                "{e}\n--- from ---\n{text}\n{env:?}"
            );
        }
    }
}

// --- pack.yaml --------------------------------------------------------------------------------

fn manifest_text() -> impl Strategy<Value = String> {
    let base = std::fs::read_to_string(packs::pack("tiny").join("pack.yaml")).unwrap();
    let key = prop::sample::select(vec![
        "name",
        "variant",
        "dtype",
        "sample_rate",
        "frame_size",
        "codebooks",
        "text_vocab",
        "audio_vocab",
        "delays",
        "initial_tokens",
        "text_padding",
        "silence_codes",
        "sine_codes",
        "context",
        "max_positions",
        "temporal",
        "depformer",
        "tokenizer",
        "text_vocb",
    ]);
    let edited = (
        prop::collection::vec((key, value()), 0..3),
        Just(base.clone()),
    )
        .prop_map(|(kv, base)| {
            let mut s: String = base
                .lines()
                .filter(|l| !kv.iter().any(|(k, _)| l.starts_with(&format!("{k}:"))))
                .filter(|l| !l.starts_with(' '))
                .map(|l| format!("{l}\n"))
                .collect();
            for (k, v) in kv {
                s.push_str(&format!("{k}: {v}\n"));
            }
            s
        })
        .boxed();
    prop_oneof![
        4 => edited.clone(),
        3 => edited.prop_flat_map(damage),
        1 => alias_bomb(),
    ]
}

fn pack_dir(manifest: &str) -> PathBuf {
    let p = case_file("pack.yaml", manifest.as_bytes());
    let dir = p.parent().unwrap().to_path_buf();
    for g in packs::ALL_GRAPHS {
        std::os::unix::fs::symlink(packs::pack("tiny").join(g), dir.join(g)).unwrap();
    }
    dir
}

proptest! {
    #![proptest_config(config(300))]

    #[test]
    fn pack_manifests(text in manifest_text()) {
        let dir = pack_dir(&text);
        let r = bounded(&text, || duplex::model::pack::Pack::open(&dir));
        if let Err(e) = r {
            let e = e.to_string();
            prop_assert!(e.contains("pack.yaml"), "{e}\n--- from ---\n{text}");
        }
    }
}

// --- codes JSON -------------------------------------------------------------------------------

fn codes_text() -> impl Strategy<Value = String> {
    let frame = prop::collection::vec(prop_oneof![0i64..2048, any::<i64>()], 0..10).prop_map(|v| {
        format!(
            "[{}]",
            v.iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    });
    let frames = prop::collection::vec(frame, 0..20).prop_map(|f| format!("[{}]", f.join(",")));
    prop_oneof![
        4 => frames.clone(),
        3 => frames.prop_flat_map(damage),
        1 => (1usize..100_000).prop_map(|d| format!("{}{}", "[".repeat(d), "]".repeat(d))),
        1 => "\\PC{0,100}",
    ]
}

proptest! {
    #![proptest_config(config(1000))]

    #[test]
    fn codes_files(text in codes_text()) {
        let p = case_file("codes.json", text.as_bytes());
        let r = bounded(&text, || duplex::stages::read_codes(&p, 8, 2048).map_err(|e| e.to_string()));
        match r {
            Ok(frames) => prop_assert!(frames.iter().all(|f| f.len() == 8 && f.iter().all(|c| (0..2048).contains(c)))),
            Err(e) => prop_assert!(e.contains(&p.display().to_string()), "{e}"),
        }
    }
}

// --- WAV files --------------------------------------------------------------------------------

fn wav_bytes() -> impl Strategy<Value = Vec<u8>> {
    let spec = (
        prop::sample::select(vec![
            (8u16, false),
            (16, false),
            (24, false),
            (32, false),
            (32, true),
        ]),
        1u16..4,
        prop::sample::select(vec![8000u32, 16_000, 24_000, 44_100, 48_000]),
        0usize..2000,
    );
    let valid = spec.prop_map(|((bits, float), channels, rate, frames)| {
        let mut cur = std::io::Cursor::new(Vec::new());
        let spec = hound::WavSpec {
            channels,
            sample_rate: rate,
            bits_per_sample: bits,
            sample_format: if float {
                hound::SampleFormat::Float
            } else {
                hound::SampleFormat::Int
            },
        };
        let mut w = hound::WavWriter::new(&mut cur, spec).unwrap();
        for i in 0..frames * channels as usize {
            if float {
                w.write_sample((i as f32 * 0.01).sin()).unwrap();
            } else {
                let max = (1i64 << (bits - 1)) - 1;
                w.write_sample(((i as i64 * 7919) % max) as i32).unwrap();
            }
        }
        w.finalize().unwrap();
        cur.into_inner()
    });
    (
        valid,
        prop::collection::vec((0usize..80, any::<u8>()), 0..6),
        prop::option::of(0usize..4000),
        prop::option::of((0usize..80, any::<u32>())),
    )
        .prop_map(|(mut b, flips, cut, field)| {
            for (at, v) in flips {
                if at < b.len() {
                    b[at] = v;
                }
            }
            // A size field set to anything (the RIFF and data chunk sizes live here).
            if let Some((at, v)) = field {
                let at = at & !3;
                if at + 4 <= b.len() {
                    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
                }
            }
            if let Some(c) = cut {
                b.truncate(c);
            }
            b
        })
}

proptest! {
    #![proptest_config(config(1500))]

    #[test]
    fn wav_files(bytes in wav_bytes()) {
        let p = case_file("in.wav", &bytes);
        let name = p.display().to_string();
        let r = bounded(&name, || {
            let mut r = duplex::audio::WavReader::open(&p)?;
            let mut out = Vec::new();
            while r.read(4096, &mut out)? > 0 {}
            Ok::<usize, duplex::audio::AudioError>(out.len())
        });
        if let Err(e) = r {
            let e = e.to_string();
            prop_assert!(e.starts_with(&name), "{e}");
        }
    }
}

// --- control-socket lines ---------------------------------------------------------------------

fn control_line() -> impl Strategy<Value = String> {
    let word = prop::sample::select(vec![
        "status",
        "reset",
        "persona",
        "mute",
        "unmute",
        "pause",
        "resume",
        "STATUS",
        "persona\"",
        "",
    ]);
    prop_oneof![
        (word, "[ \\t]{0,2}", "\\PC{0,30}").prop_map(|(w, sp, arg)| format!("{w}{sp}{arg}")),
        "\\PC{0,200}",
        prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn control_lines(line in control_line()) {
        use duplex::app::control::{parse, Command};
        let r = bounded(&line, || parse(&line));
        match r {
            Ok(Command::Persona(p)) => prop_assert!(!p.is_empty()),
            Ok(_) => prop_assert!(line.split_whitespace().count() == 1, "{line:?}"),
            Err(e) => {
                prop_assert!(e.starts_with("unknown or malformed command"), "{e}");
                prop_assert!(e.len() < 600, "the reply quotes at most 80 characters: {e}");
            }
        }
    }
}

/// The socket itself, with raw bytes: every client gets one JSON line, the server goes on.
#[test]
fn control_socket_takes_any_bytes() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("c.sock");
    use duplex::app::control::Command;
    let handler: duplex::app::control::Handler = std::sync::Arc::new(|c| match c {
        Command::Status => serde_json::json!({ "ok": true, "ready": true }),
        other => serde_json::json!({ "ok": true, "done": format!("{other:?}") }),
    });
    let _server = duplex::app::control::ControlServer::start(&sock, handler).unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(config(200));
    let bytes = prop::collection::vec(any::<u8>(), 0..6000);
    runner
        .run(&bytes, |b| {
            let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
            let _ = s.write_all(&b);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut reply = String::new();
            s.read_to_string(&mut reply).unwrap();
            let v: serde_json::Value = serde_json::from_str(reply.trim())
                .map_err(|e| TestCaseError::fail(format!("{reply:?}: {e}")))?;
            prop_assert!(v["ok"].is_boolean(), "{reply}");
            Ok(())
        })
        .unwrap();
    // Still serving.
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    s.write_all(b"status\n").unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.contains("\"ready\":true"), "{reply}");
}

/// A client's Ogg/Opus stream: a valid one of a few packets, then damaged (bytes flipped, cut,
/// garbage spliced in), and the cut points of the messages it arrives in.
fn client_stream() -> impl Strategy<Value = (Vec<u8>, Vec<usize>)> {
    let valid = (1usize..8, 0u32..3).prop_map(|(packets, serial)| {
        let mut w = duplex::audio::opus::OggOpusWriter::new(serial, None).unwrap();
        let pcm: Vec<f32> = (0..packets * 960)
            .map(|i| (i as f32 * 0.05).sin() * 0.4)
            .collect();
        let mut pages = w.push(&pcm).unwrap();
        pages.extend(w.flush().unwrap());
        pages.concat()
    });
    (
        valid,
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 0..6),
        prop::collection::vec(1usize..300, 0..40),
    )
        .prop_map(|(mut bytes, edits, cuts)| {
            for (at, b, how) in edits {
                if bytes.is_empty() {
                    break;
                }
                let i = at.index(bytes.len());
                match how {
                    0 => bytes[i] ^= b | 1,
                    1 => bytes.truncate(i),
                    2 => {
                        let junk: Vec<u8> =
                            (0..b as usize).map(|k| (k as u8).wrapping_mul(b)).collect();
                        bytes.splice(i..i, junk);
                    }
                    _ => bytes[i] = b,
                }
            }
            (bytes, cuts)
        })
}

proptest! {
    #![proptest_config(config(1500))]

    #[test]
    fn client_audio_streams((bytes, cuts) in client_stream()) {
        use duplex::audio::opus::{OggOpusReader, StreamError};
        let r = bounded("an Ogg/Opus stream", || {
            let mut reader = OggOpusReader::new();
            let mut out = Vec::new();
            let mut rest: &[u8] = &bytes;
            let mut cuts = cuts.iter().cycle();
            while !rest.is_empty() {
                let n = (*cuts.next().unwrap_or(&rest.len())).min(rest.len());
                reader.push(&rest[..n], &mut out, &mut duplex::audio::pace::Unlimited)?;
                rest = &rest[n..];
            }
            Ok::<usize, StreamError>(out.len())
        });
        match r {
            // At most what the packets hold: 8 packets of 40 ms, and a pre-skip dropped.
            Ok(n) => prop_assert!(n <= 8 * 960 + 2880, "{n} samples"),
            Err(e) => {
                let m = e.to_string();
                prop_assert!(
                    m.starts_with("not an Ogg stream")
                        || m.starts_with("damaged Ogg page")
                        || m.starts_with("not an Opus stream")
                        || m.starts_with("Opus packet"),
                    "{m}"
                );
                prop_assert!(m.len() < 300, "{m}");
            }
        }
    }
}

/// Ogg pages of arbitrary Opus packets (any table of contents, any length up to 3 bytes, none
/// at all), 255 to a page, as a hostile client would send to make the server decode hours of
/// audio from a few bytes.
fn packet_bombs() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..4), 1..6),
        1usize..40,
    )
        .prop_map(|(packets, pages)| {
            use ogg::writing::{PacketWriteEndInfo, PacketWriter};
            let mut w = PacketWriter::new(Vec::new());
            let mut head = b"OpusHead".to_vec();
            head.extend_from_slice(&[1, 1, 0, 0, 0xc0, 0x5d, 0, 0, 0, 0, 0]);
            w.write_packet(head, 5, PacketWriteEndInfo::EndPage, 0)
                .unwrap();
            w.write_packet(
                b"OpusTags\0\0\0\0\0\0\0\0".to_vec(),
                5,
                PacketWriteEndInfo::EndPage,
                0,
            )
            .unwrap();
            for page in 0..pages {
                for i in 0..255 {
                    let end = if i == 254 {
                        PacketWriteEndInfo::EndPage
                    } else {
                        PacketWriteEndInfo::NormalPacket
                    };
                    let p = packets[i % packets.len()].clone();
                    w.write_packet(p, 5, end, (page * 255 + i) as u64).unwrap();
                }
            }
            w.into_inner()
        })
}

proptest! {
    #![proptest_config(config(60))]

    /// The memory property of a session's input: whatever its packets claim, one message
    /// decodes at most the real-time budget's catch-up (1 s) and one packet more; the rest is
    /// refused undecoded, or the stream is refused as damaged.
    #[test]
    fn no_client_stream_decodes_past_its_real_time_budget(bytes in packet_bombs()) {
        use duplex::audio::opus::OggOpusReader;
        use duplex::audio::pace::RealTime;
        let mut reader = OggOpusReader::new();
        let mut out = Vec::new();
        let mut budget = RealTime::new(24_000, 1.0, std::time::Duration::from_secs(1));
        let decoded = match reader.push(&bytes, &mut out, &mut budget) {
            Ok(()) => out.len(),
            Err(e) => {
                prop_assert!(e.to_string().starts_with("Opus packet"), "{e}");
                out.len()
            }
        };
        prop_assert!(decoded <= 24_000 + 2 * 2880, "{decoded} samples from {} bytes", bytes.len());
    }
}

/// Query strings of `/api/chat` as clients send them, and worse.
fn query_pairs() -> impl Strategy<Value = Vec<(String, String)>> {
    let key = prop::sample::select(vec![
        "text_temperature",
        "text_topk",
        "audio_temperature",
        "audio_topk",
        "text_seed",
        "audio_seed",
        "text_prompt",
        "voice_prompt",
        "worker_auth_id",
        "email",
        "",
    ]);
    let v = prop_oneof![
        value(),
        "[0-9]{0,3}(\\.[0-9]{0,3})?",
        "-?[0-9]{1,25}",
        prop::sample::select(vec![
            "NaN",
            "inf",
            "-0",
            "1e400",
            "../x.wav",
            "a/b.wav",
            "<system> hi <system>"
        ])
        .prop_map(String::from),
        prop::collection::vec(any::<char>(), 0..50).prop_map(|c| c.into_iter().collect()),
    ];
    prop::collection::vec((key.prop_map(String::from), v), 0..8)
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn chat_query_parameters(pairs in query_pairs()) {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let env: HashMap<String, String> = [(
            "DUPLEX__PIPELINE".to_string(),
            root.join("pipelines/serve.yaml").display().to_string(),
        )]
        .into();
        let cfg = duplex::app::serve::load_config(None, Some(env)).unwrap();
        let r = bounded("query parameters", || cfg.session_params(&pairs));
        match r {
            Ok(p) => {
                prop_assert!(p.sampling.text_temperature.is_finite() && p.sampling.audio_temperature.is_finite());
                prop_assert!(p.voice.is_none(), "no voices folder, yet a voice: {p:?}");
            }
            Err(m) => {
                prop_assert!(m.contains("query parameter") || m.contains("voice prompt"), "{m}");
                prop_assert!(m.len() < 400, "{m}");
            }
        }
    }
}

/// Events of `/v1/realtime` as clients send them, and worse: every event type with fields of
/// every JSON kind, the formats in both spellings, sampling options, base64 that is and is not,
/// deep nesting, and raw text.
fn realtime_events() -> impl Strategy<Value = String> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        prop::sample::select(vec![
            "pcm16",
            "g711_ulaw",
            "g711_alaw",
            "audio/pcm",
            "audio/pcmu",
            "mp3",
            "calm.wav",
            "../etc/passwd",
            "AAAA",
            "AAA",
            "////",
            "",
        ])
        .prop_map(Value::from),
        "[A-Za-z0-9+/=]{0,64}".prop_map(Value::from),
        prop::collection::vec(any::<char>(), 0..20)
            .prop_map(|c| Value::from(c.into_iter().collect::<String>())),
    ];
    let value = leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map(
                prop::sample::select(vec![
                    "type",
                    "rate",
                    "format",
                    "voice",
                    "input",
                    "output",
                    "text_temperature",
                    "audio_topk",
                    "max_steps",
                    "x",
                ])
                .prop_map(String::from),
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    let kind = prop::sample::select(vec![
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
        "input_audio_buffer.clear",
        "response.create",
        "response.cancel",
        "conversation.item.create",
        "no.such.event",
        "",
    ]);
    let session = (
        value.clone(),
        value.clone(),
        value.clone(),
        value.clone(),
        value.clone(),
    )
        .prop_map(|(i, f, v, o, d)| {
            json!({
                "instructions": i,
                "input_audio_format": f,
                "audio": {"output": {"voice": v, "format": o}},
                "duplex": d,
            })
        });
    let event = (kind, session, value.clone(), value, any::<bool>()).prop_map(
        |(kind, session, audio, id, typed)| {
            let mut e = json!({"session": session, "audio": audio, "event_id": id});
            if typed {
                e["type"] = Value::from(kind);
            }
            e.to_string()
        },
    );
    prop_oneof![
        8 => event,
        1 => prop::collection::vec(any::<char>(), 0..200).prop_map(|c| c.into_iter().collect()),
        1 => (1usize..5000).prop_map(|n| "[".repeat(n)),
    ]
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn realtime_events_parse_or_name_their_fault(text in realtime_events()) {
        use duplex::app::serve::realtime::{parse_event, ClientEvent};
        let r = bounded("realtime event", || parse_event(&text));
        match r {
            Ok((_, ClientEvent::Append(b64))) => prop_assert!(b64.len() <= text.len()),
            Ok(_) => {}
            Err(e) => {
                prop_assert!(!e.message.is_empty() && e.message.len() < 400, "{e:?}");
                let known = [
                    "invalid_json", "missing_type", "unknown_event", "unsupported_event",
                    "invalid_value", "invalid_base64",
                ];
                prop_assert!(known.contains(&e.code), "{e:?}");
                // Only a message that is not JSON has no field to name.
                prop_assert_eq!(e.param.is_none(), e.code == "invalid_json", "{:?}", e);
            }
        }
    }
}

/// The error event repeats a client's value short, however long the value: a format object,
/// a rate, an event type, a sampling option's name (the proptest above found the format).
#[test]
fn realtime_errors_show_a_clients_long_values_short() {
    use duplex::app::serve::realtime::parse_event;
    use serde_json::json;
    let long = "x".repeat(5000);
    let deep = json!({"type": long, "nested": {"a": [long.clone(), long.clone()]}});
    let events = [
        json!({"type": "session.update", "session": {"input_audio_format": deep}}),
        json!({"type": "session.update", "session": {"audio": {"output": {"format": {"type": "audio/pcm", "rate": deep}}}}}),
        json!({"type": format!("conversation.item.create{long}")}),
        json!({"type": long}),
        json!({"type": "session.update", "session": {"duplex": {long.clone(): 1}}}),
    ];
    for e in events {
        let err = parse_event(&e.to_string()).expect_err("refused");
        assert!(
            err.message.len() < 400 && err.param.as_deref().is_some_and(|p| p.len() < 100),
            "{} bytes of message, param {:?}",
            err.message.len(),
            err.param.as_deref().map(str::len)
        );
        assert!(err.message.contains('…') || err.param.is_some_and(|p| p.contains('…')));
    }
}
