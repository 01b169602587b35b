//! Helpers shared by the integration tests: small stages over plain numbers, and paths; the
//! command line, the daemon, the server, the private sound server, network namespaces and the
//! tiny packs (a module each); the length of the soak-length tests (`make soak`), tests rerun
//! in a process of their own, and retries the environment forced, listed for `tools/test.sh`.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duplex::runtime::*;

pub mod cli;
pub mod daemon;
pub mod netns;
pub mod packs;
pub mod pulse;
pub mod serve;
pub mod wait;

/// A number frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Num(pub u64);
impl FrameData for Num {
    const NAME: &'static str = "Num";
}

/// A text frame (a second type, for mismatches).
#[derive(Clone, Debug, PartialEq)]
pub struct Text(pub String);
impl FrameData for Text {
    const NAME: &'static str = "Text";
}

/// Emits 0..n (forever when `n` is None), optionally sleeping between frames.
pub struct Count {
    pub next: u64,
    pub n: Option<u64>,
    pub every: Option<Duration>,
}

impl Count {
    pub fn new(n: u64) -> Self {
        Count {
            next: 0,
            n: Some(n),
            every: None,
        }
    }
    pub fn forever(every: Option<Duration>) -> Self {
        Count {
            next: 0,
            n: None,
            every,
        }
    }
}

impl Source for Count {
    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        if Some(self.next) == self.n {
            return Ok(Flow::Done);
        }
        if let Some(d) = self.every {
            if !cx.sleep_until(Instant::now() + d) {
                return Ok(Flow::Done);
            }
        }
        cx.emit(0, Instant::now(), Num(self.next))?;
        self.next += 1;
        Ok(Flow::Continue)
    }
}

/// What a [`Collect`] sink saw.
#[derive(Default)]
pub struct Seen {
    pub values: Mutex<Vec<u64>>,
    pub finished: AtomicU64,
}

impl Seen {
    pub fn values(&self) -> Vec<u64> {
        self.values.lock().unwrap().clone()
    }
    pub fn finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst) > 0
    }
}

/// Records every number it receives, optionally sleeping per frame (a slow consumer).
pub struct Collect {
    pub seen: Arc<Seen>,
    pub delay: Duration,
}

impl Collect {
    pub fn new() -> (Self, Arc<Seen>) {
        Self::slow(Duration::ZERO)
    }
    pub fn slow(delay: Duration) -> (Self, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        (
            Collect {
                seen: seen.clone(),
                delay,
            },
            seen,
        )
    }
}

impl Stage for Collect {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Num>()?;
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        self.seen.values.lock().unwrap().push(f.data.0);
        Ok(())
    }
    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        self.seen.finished.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// Passes numbers through, adding `add`.
pub struct Add(pub u64);
impl Stage for Add {
    fn process(&mut self, input: Input, cx: &mut Context<'_>) -> StageResult {
        let f = input.take::<Num>()?;
        cx.emit(0, f.meta.origin, Num(f.data.0 + self.0))
    }
}

pub fn num(name: &'static str) -> PortSpec {
    PortSpec::new::<Num>(name)
}

/// A built-in stage built from string params, as a pipeline file would give them.
pub fn build_stage(kind: &str, name: &str, params: &[(&str, &str)]) -> Node {
    let reg = duplex::stages::Registry::builtin();
    let k = reg
        .get(kind)
        .unwrap_or_else(|| panic!("no stage kind {kind}"));
    let raw: Vec<(String, config::Value)> = params
        .iter()
        .map(|(key, v)| {
            (
                key.to_string(),
                config::Value::new(None, config::ValueKind::String(v.to_string())),
            )
        })
        .collect();
    let p = duplex::config::params::check("test", name, kind, k.params, &raw).unwrap();
    let plane = duplex::runtime::ControlPlane::new();
    let resources = duplex::resources::Resources::new(1);
    let body = (k.build)(
        &duplex::stages::BuildContext::new(name, "test", &plane, k, &resources),
        &p,
    )
    .unwrap();
    Node {
        name: name.into(),
        kind: kind.into(),
        inputs: (k.inputs)(),
        outputs: (k.outputs)(),
        body,
    }
}

/// The value of the first line of a Prometheus rendering that starts with `prefix`.
pub fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Whether this is `make soak` (`DUPLEX_SOAK=1`): the soak-length runs at their full length.
/// `make test` runs each at the shortest length that still decides its criterion (each says
/// why that length decides it).
pub fn soak() -> bool {
    std::env::var_os("DUPLEX_SOAK").is_some_and(|v| v == "1")
}

/// Where retries are listed: `target/test-retries.txt`, which `tools/test.sh` empties before the
/// suites and prints after them, so a run says how many it used.
pub fn retries_file() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-retries.txt")
}

/// Records that `test` ran its scenario again because of `why`, a failure proved to be the
/// environment's (the private sound server failing a stream with EIO): printed, and listed in
/// [`retries_file`].
pub fn retried(test: &str, why: &str) {
    use std::io::Write;
    eprintln!("{test}: retried: {why}");
    let line = format!("{test}: {}\n", why.replace('\n', " "));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(retries_file());
    if let Ok(mut f) = file {
        let _ = f.write_all(line.as_bytes());
    }
}

/// The variable that marks a test run again in a process of its own ([`rerun_alone`]).
const OWN_PROCESS: &str = "DUPLEX_TEST_IN_OWN_PROCESS";

/// Whether this is the process [`rerun_alone`] started for one test.
pub fn in_own_process() -> bool {
    std::env::var_os(OWN_PROCESS).is_some()
}

/// Runs the test `name` (its full path in this binary) again in a process of its own with
/// `env` added, for a test that needs the process's environment (in-process sound devices read
/// it) and must not change this process's, shared by the tests running beside it; fails as that
/// run failed. The test calls this unless [`in_own_process`], and returns after it.
pub fn rerun_alone(name: &str, env: Vec<(String, String)>) {
    let exe = std::env::current_exe().unwrap();
    let o = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .envs(env)
        .env(OWN_PROCESS, "1")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        o.status.success(),
        "{name} in its own process:\n{out}\n{err}"
    );
    assert!(
        out.contains("1 passed"),
        "{name} did not run in its own process:\n{out}"
    );
}
