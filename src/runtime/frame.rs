//! What travels along an edge: a payload plus the metadata the runtime needs to time it.
//!
//! The runtime never looks inside a payload. A stage declares the *type* of the frames on each of
//! its ports ([`FrameType`]) so that a pipeline whose links join mismatched types is refused before
//! any thread starts; payloads themselves move type-erased and are checked again (cheaply, by
//! `TypeId`) where a stage takes them out.

use std::any::{Any, TypeId};
use std::fmt;
use std::time::Instant;

/// Metadata carried by every frame.
///
/// `origin` is the monotonic instant at which the newest sample (or token) that this frame
/// depends on was captured or created. Stages that transform a frame pass its origin on, so the
/// age of a frame at any later point (for instance mouth-to-ear latency at a playback stage) is
/// `Instant::now() - origin`, on one clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameMeta {
    /// Index of this frame on the output port that emitted it: 0, 1, 2, … with no gaps.
    pub seq: u64,
    /// Capture instant of the newest sample this frame depends on.
    pub origin: Instant,
}

/// A typed frame: metadata and payload.
#[derive(Debug, Clone)]
pub struct Frame<T> {
    /// Sequence number and capture instant.
    pub meta: FrameMeta,
    /// The payload.
    pub data: T,
}

/// A type-erased payload as it sits in an edge.
pub type Payload = Box<dyn Any + Send>;

/// Data that may travel along an edge.
///
/// `NAME` is what users see in `duplex stages`, in `duplex validate` and in type-mismatch errors,
/// so keep it short and stable (`Pcm`, `Codes`, …). `Clone` is needed because one output may be
/// linked to several consumers (fan-out); a single consumer receives the original without a copy.
pub trait FrameData: Clone + Send + 'static {
    /// Name of the type in messages and listings.
    const NAME: &'static str;
}

/// The declared type of a port: a concrete [`FrameData`] type, or "anything" (for sinks that
/// discard or count frames of any type).
#[derive(Clone, Copy)]
pub struct FrameType {
    id: Option<TypeId>,
    name: &'static str,
    clone_fn: Option<fn(&(dyn Any + Send)) -> Payload>,
}

fn clone_payload<T: FrameData>(p: &(dyn Any + Send)) -> Payload {
    match p.downcast_ref::<T>() {
        Some(v) => Box::new(v.clone()),
        // Unreachable through the runtime: a payload is cloned only by the output port that
        // declared its type, after checking that type on emit.
        None => Box::new(()),
    }
}

impl FrameType {
    /// The type of frames carrying `T`.
    pub fn of<T: FrameData>() -> Self {
        FrameType {
            id: Some(TypeId::of::<T>()),
            name: T::NAME,
            clone_fn: Some(clone_payload::<T>),
        }
    }

    /// A wildcard input type that accepts frames of any type.
    pub fn any() -> Self {
        FrameType {
            id: None,
            name: "Any",
            clone_fn: None,
        }
    }

    /// Name shown to users.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether an input port of this type accepts frames from an output port of type `out`.
    pub fn accepts(&self, out: &FrameType) -> bool {
        match (self.id, out.id) {
            (None, _) => true,
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        }
    }

    pub(crate) fn is<T: 'static>(&self) -> bool {
        self.id == Some(TypeId::of::<T>())
    }

    pub(crate) fn clone_payload(&self, p: &Payload) -> Option<Payload> {
        self.clone_fn.map(|f| f(p.as_ref()))
    }
}

impl fmt::Debug for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl fmt::Display for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A port declared by a stage: its name, the type of its frames and whether it is a feedback
/// input (pulled by the stage itself with [`Context::recv_feedback`](super::Context::recv_feedback)
/// instead of being delivered to `process`).
#[derive(Debug, Clone, Copy)]
pub struct PortSpec {
    /// Port name, unique among the stage's inputs (or outputs).
    pub name: &'static str,
    /// Frame type.
    pub ty: FrameType,
    /// Feedback input: closes the one allowed cycle of a pipeline.
    pub feedback: bool,
}

impl PortSpec {
    /// A port carrying frames of type `T`.
    pub fn new<T: FrameData>(name: &'static str) -> Self {
        PortSpec {
            name,
            ty: FrameType::of::<T>(),
            feedback: false,
        }
    }

    /// An input port that accepts frames of any type.
    pub fn any(name: &'static str) -> Self {
        PortSpec {
            name,
            ty: FrameType::any(),
            feedback: false,
        }
    }

    /// Lists ports as `name: Type, name: Type (feedback)`, or `-` when there are none.
    pub fn list(ports: &[PortSpec]) -> String {
        if ports.is_empty() {
            return "-".into();
        }
        ports
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// A feedback input carrying `T`.
    pub fn feedback<T: FrameData>(name: &'static str) -> Self {
        PortSpec {
            feedback: true,
            ..Self::new::<T>(name)
        }
    }
}

impl fmt::Display for PortSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name, self.ty)?;
        if self.feedback {
            f.write_str(" (feedback)")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct A;
    impl FrameData for A {
        const NAME: &'static str = "A";
    }
    #[derive(Clone)]
    struct B;
    impl FrameData for B {
        const NAME: &'static str = "B";
    }

    #[test]
    fn types_match_by_identity_and_any_accepts_all() {
        let a = FrameType::of::<A>();
        let b = FrameType::of::<B>();
        assert!(a.accepts(&FrameType::of::<A>()));
        assert!(!a.accepts(&b));
        assert!(FrameType::any().accepts(&a));
        assert!(!a.accepts(&FrameType::any()));
        assert_eq!(b.to_string(), "B");
    }

    #[test]
    fn clone_payload_clones_the_value() {
        #[derive(Clone, PartialEq, Debug)]
        struct V(u32);
        impl FrameData for V {
            const NAME: &'static str = "V";
        }
        let p: Payload = Box::new(V(7));
        let c = FrameType::of::<V>().clone_payload(&p).unwrap();
        assert_eq!(c.downcast_ref::<V>(), Some(&V(7)));
    }
}
