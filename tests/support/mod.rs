//! Helpers shared by the integration tests: small stages over plain numbers, and paths.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use duplex::runtime::*;

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
    let body = (k.build)(
        &duplex::stages::BuildContext::new(name, "test", &plane, k),
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
