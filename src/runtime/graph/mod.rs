//! Building a pipeline: nodes, links, and every structural check that can be made before a
//! thread starts.
//!
//! [`PipelineBuilder`] takes stages (already constructed, with their declared ports) and links
//! between named ports, and [`PipelineBuilder::build`] refuses anything that cannot run: a link to
//! a stage or port that does not exist, an input linked twice or not at all, an output linked to
//! nothing, frame types that do not match, a cycle other than one closed by a declared feedback
//! link. Errors name the pipeline's origin (usually the YAML file), the stages, ports and types.

mod error;

use error::list_or_none;
pub use error::{GraphError, GraphErrorKind};

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use super::edge::Overflow;
use super::frame::{FrameType, PortSpec};
use super::stage::{Source, Stage};

/// The code a stage runs: either a [`Stage`] (has inputs) or a [`Source`] (has none).
pub enum Body {
    /// A stage with inputs.
    Stage(Box<dyn Stage>),
    /// A stage without inputs.
    Source(Box<dyn Source>),
}

/// One stage of a pipeline, ready to run.
pub struct Node {
    /// Unique name within the pipeline.
    pub name: String,
    /// Its kind, for messages (`resample`, `wav_sink`, …).
    pub kind: String,
    /// Declared inputs (empty for a source).
    pub inputs: Vec<PortSpec>,
    /// Declared outputs (empty for a sink).
    pub outputs: Vec<PortSpec>,
    /// The code.
    pub body: Body,
}

/// A link between an output port and an input port.
#[derive(Debug, Clone)]
pub struct Link {
    /// Producing stage.
    pub from: String,
    /// Output port; `None` when the stage has exactly one output.
    pub from_port: Option<String>,
    /// Consuming stage.
    pub to: String,
    /// Input port; `None` when the stage has exactly one input of the right kind.
    pub to_port: Option<String>,
    /// Queue capacity in frames (at least 1).
    pub capacity: usize,
    /// What to do when the queue is full.
    pub overflow: Overflow,
    /// This link closes the pipeline's cycle (it must end at a feedback input).
    pub feedback: bool,
}

impl Link {
    /// A `block` link of capacity 4 between the single ports of two stages.
    pub fn new(from: impl Into<String>, to: impl Into<String>) -> Self {
        let (from, from_port) = split_port(from.into());
        let (to, to_port) = split_port(to.into());
        Link {
            from,
            from_port,
            to,
            to_port,
            capacity: 4,
            overflow: Overflow::Block,
            feedback: false,
        }
    }

    /// Sets the capacity.
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// Sets the overflow policy.
    pub fn overflow(mut self, overflow: Overflow) -> Self {
        self.overflow = overflow;
        self
    }

    /// Marks the link as the feedback link.
    pub fn feedback(mut self) -> Self {
        self.feedback = true;
        self
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.from)?;
        if let Some(p) = &self.from_port {
            write!(f, ".{p}")?;
        }
        write!(f, " -> {}", self.to)?;
        if let Some(p) = &self.to_port {
            write!(f, ".{p}")?;
        }
        Ok(())
    }
}

/// Splits `stage.port` into its parts.
pub fn split_port(s: String) -> (String, Option<String>) {
    match s.split_once('.') {
        Some((a, b)) => (a.to_string(), Some(b.to_string())),
        None => (s, None),
    }
}

/// Timeouts of the supervisor.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// After a failure or a stop request: how long stages may take to drain and flush before
    /// they are aborted.
    pub drain_timeout: Duration,
    /// After an abort: how long to wait for threads before reporting them as hung.
    pub abort_timeout: Duration,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            drain_timeout: Duration::from_secs(3),
            abort_timeout: Duration::from_secs(2),
        }
    }
}

/// A link with its ports resolved to indices.
#[derive(Debug, Clone)]
pub(crate) struct ResolvedLink {
    pub from: usize,
    pub from_port: usize,
    pub to: usize,
    pub to_port: usize,
    pub capacity: usize,
    pub overflow: Overflow,
    pub feedback: bool,
    pub name: String,
    pub ty: FrameType,
}

/// Collects nodes and links; [`build`](Self::build) validates them into a [`Pipeline`](super::Pipeline).
#[derive(Default)]
pub struct PipelineBuilder {
    origin: Option<String>,
    nodes: Vec<Node>,
    links: Vec<Link>,
    options: RunOptions,
    observers: Vec<std::sync::Arc<dyn super::Observer>>,
    control: super::ControlPlane,
}

impl PipelineBuilder {
    /// An empty pipeline.
    pub fn new() -> Self {
        Self::default()
    }

    /// Names where the pipeline came from (a file path), for error messages.
    pub fn origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = Some(origin.into());
        self
    }

    /// Sets the supervisor's timeouts.
    pub fn options(mut self, options: RunOptions) -> Self {
        self.options = options;
        self
    }

    /// Sets the control plane whose endpoints the stages were given (see
    /// [`ControlPlane`](super::ControlPlane)); the running pipeline's [`Handle`](super::Handle)
    /// hands it out. Without one, the pipeline has an empty plane.
    pub fn control(mut self, plane: super::ControlPlane) -> Self {
        self.control = plane;
        self
    }

    /// Adds an observer: it receives everything the runtime measures (several may be added;
    /// each receives everything).
    pub fn observer(mut self, observer: std::sync::Arc<dyn super::Observer>) -> Self {
        self.observers.push(observer);
        self
    }

    /// Names of the stages added so far, in order.
    pub fn stage_names(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// Adds a stage.
    pub fn node(mut self, node: Node) -> Self {
        self.nodes.push(node);
        self
    }

    /// Adds a source stage with the given outputs.
    pub fn source(
        self,
        name: &str,
        kind: &str,
        outputs: Vec<PortSpec>,
        body: impl Source + 'static,
    ) -> Self {
        self.node(Node {
            name: name.into(),
            kind: kind.into(),
            inputs: vec![],
            outputs,
            body: Body::Source(Box::new(body)),
        })
    }

    /// Adds a stage with inputs.
    pub fn stage(
        self,
        name: &str,
        kind: &str,
        inputs: Vec<PortSpec>,
        outputs: Vec<PortSpec>,
        body: impl Stage + 'static,
    ) -> Self {
        self.node(Node {
            name: name.into(),
            kind: kind.into(),
            inputs,
            outputs,
            body: Body::Stage(Box::new(body)),
        })
    }

    /// Adds a link.
    pub fn link(mut self, link: Link) -> Self {
        self.links.push(link);
        self
    }

    fn err(&self, kind: GraphErrorKind) -> GraphError {
        GraphError {
            origin: self.origin.clone(),
            kind: Box::new(kind),
        }
    }

    /// Checks the graph without consuming the nodes; returns the resolved links.
    pub(crate) fn check(&self) -> Result<Vec<ResolvedLink>, GraphError> {
        use GraphErrorKind::*;
        if self.nodes.is_empty() {
            return Err(self.err(Empty));
        }
        let mut index = HashMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            if index.insert(n.name.as_str(), i).is_some() {
                return Err(self.err(DuplicateStage(n.name.clone())));
            }
        }
        let mut resolved = Vec::with_capacity(self.links.len());
        for l in &self.links {
            let text = l.to_string();
            let find = |s: &str| {
                index.get(s).copied().ok_or_else(|| {
                    self.err(UnknownStage {
                        link: text.clone(),
                        stage: s.to_string(),
                    })
                })
            };
            let from = find(&l.from)?;
            let to = find(&l.to)?;
            let fp =
                self.resolve_port(&text, from, l.from_port.as_deref(), "output", l.feedback)?;
            let tp = self.resolve_port(&text, to, l.to_port.as_deref(), "input", l.feedback)?;
            let out = &self.nodes[from].outputs[fp];
            let inp = &self.nodes[to].inputs[tp];
            let from_name = format!("{}.{}", l.from, out.name);
            let to_name = format!("{}.{}", l.to, inp.name);
            if l.capacity == 0 {
                return Err(self.err(ZeroCapacity { link: text }));
            }
            if l.feedback && !inp.feedback {
                return Err(self.err(Feedback {
                    link: text,
                    reason: format!(
                        "marked `feedback: true` but `{to_name}` is not a feedback input"
                    ),
                }));
            }
            if !l.feedback && inp.feedback {
                return Err(self.err(Feedback {
                    link: text,
                    reason: format!(
                        "`{to_name}` is a feedback input: mark the link `feedback: true`"
                    ),
                }));
            }
            if !inp.ty.accepts(&out.ty) {
                return Err(self.err(TypeMismatch {
                    link: text,
                    from: from_name,
                    from_type: out.ty.name().into(),
                    to: to_name,
                    to_type: inp.ty.name().into(),
                }));
            }
            resolved.push(ResolvedLink {
                from,
                from_port: fp,
                to,
                to_port: tp,
                capacity: l.capacity,
                overflow: l.overflow,
                feedback: l.feedback,
                name: format!("{from_name} -> {to_name}"),
                ty: out.ty,
            });
        }
        self.check_every_port_linked(&resolved)?;
        if let Some(path) = find_cycle(self.nodes.len(), &resolved) {
            return Err(self.err(Cycle {
                path: path.iter().map(|&i| self.nodes[i].name.clone()).collect(),
            }));
        }
        self.negotiate(&resolved)?;
        Ok(resolved)
    }

    /// Every port linked, inputs exactly once (inputs first: a consumer without a producer is
    /// the likelier mistake).
    fn check_every_port_linked(&self, resolved: &[ResolvedLink]) -> Result<(), GraphError> {
        use GraphErrorKind::*;
        for (i, n) in self.nodes.iter().enumerate() {
            for (p, spec) in n.inputs.iter().enumerate() {
                let count = resolved
                    .iter()
                    .filter(|r| r.to == i && r.to_port == p)
                    .count();
                let port = format!("{}.{}", n.name, spec.name);
                if count == 0 {
                    return Err(self.err(UnlinkedInput { port }));
                }
                if count > 1 {
                    return Err(self.err(InputLinkedTwice { port }));
                }
            }
        }
        for (i, n) in self.nodes.iter().enumerate() {
            for (p, spec) in n.outputs.iter().enumerate() {
                if !resolved.iter().any(|r| r.from == i && r.from_port == p) {
                    return Err(self.err(UnlinkedOutput {
                        port: format!("{}.{}", n.name, spec.name),
                    }));
                }
            }
        }
        Ok(())
    }

    /// Propagates [`Caps`](super::Caps) from the sources along the (acyclic once feedback links
    /// are set aside) graph, letting each stage refuse what it cannot take.
    fn negotiate(&self, links: &[ResolvedLink]) -> Result<(), GraphError> {
        use super::Caps;
        let n = self.nodes.len();
        let mut out_caps: Vec<Option<Vec<Caps>>> = vec![None; n];
        let forward: Vec<&ResolvedLink> = links.iter().filter(|l| !l.feedback).collect();
        // Kahn's order: a stage once all its forward producers are known.
        let mut pending: Vec<usize> = (0..n)
            .map(|i| forward.iter().filter(|l| l.to == i).count())
            .collect();
        let mut ready: Vec<usize> = (0..n).filter(|&i| pending[i] == 0).collect();
        while let Some(i) = ready.pop() {
            let node = &self.nodes[i];
            let inputs: Vec<Caps> = (0..node.inputs.len())
                .map(|p| {
                    forward
                        .iter()
                        .find(|l| l.to == i && l.to_port == p)
                        .and_then(|l| out_caps[l.from].as_ref()?.get(l.from_port).cloned())
                        .unwrap_or_default()
                })
                .collect();
            let caps = match &node.body {
                Body::Source(s) => s.caps(),
                Body::Stage(s) => s.caps(&inputs).map_err(|reason| {
                    let link = forward
                        .iter()
                        .find(|l| l.to == i)
                        .map(|l| l.name.clone())
                        .unwrap_or_else(|| node.name.clone());
                    self.err(GraphErrorKind::Caps {
                        link,
                        stage: node.name.clone(),
                        reason,
                    })
                })?,
            };
            out_caps[i] = Some(caps);
            for l in forward.iter().filter(|l| l.from == i) {
                pending[l.to] -= 1;
                if pending[l.to] == 0 {
                    ready.push(l.to);
                }
            }
        }
        Ok(())
    }

    fn resolve_port(
        &self,
        link: &str,
        node: usize,
        port: Option<&str>,
        dir: &'static str,
        feedback: bool,
    ) -> Result<usize, GraphError> {
        let n = &self.nodes[node];
        let ports = if dir == "input" {
            &n.inputs
        } else {
            &n.outputs
        };
        let names = || ports.iter().map(|p| p.name.to_string()).collect::<Vec<_>>();
        match port {
            Some(name) => ports.iter().position(|p| p.name == name).ok_or_else(|| {
                self.err(GraphErrorKind::UnknownPort {
                    link: link.into(),
                    stage: n.name.clone(),
                    dir,
                    port: name.into(),
                    available: names(),
                })
            }),
            None => {
                // An implicit input port is the only one of the link's kind (feedback or not).
                let candidates: Vec<usize> = (0..ports.len())
                    .filter(|&i| dir == "output" || ports[i].feedback == feedback)
                    .collect();
                match candidates.as_slice() {
                    [one] => Ok(*one),
                    [] if feedback && dir == "input" => Err(self.err(GraphErrorKind::Feedback {
                        link: link.into(),
                        reason: format!(
                            "marked `feedback: true` but stage `{}` has no feedback input (its inputs: {})",
                            n.name,
                            list_or_none(&names())
                        ),
                    })),
                    [] => Err(self.err(GraphErrorKind::UnknownPort {
                        link: link.into(),
                        stage: n.name.clone(),
                        dir,
                        port: if feedback && dir == "input" {
                            "(feedback)".into()
                        } else {
                            "(any)".into()
                        },
                        available: names(),
                    })),
                    _ => Err(self.err(GraphErrorKind::AmbiguousPort {
                        link: link.into(),
                        stage: n.name.clone(),
                        dir,
                        ports: candidates.iter().map(|&i| ports[i].name.to_string()).collect(),
                    })),
                }
            }
        }
    }

    /// Validates the graph and returns a pipeline ready to start.
    ///
    /// # Errors
    ///
    /// A [`GraphError`] naming the origin, stages, ports and types involved.
    pub fn build(self) -> Result<super::Pipeline, GraphError> {
        let links = self.check()?;
        Ok(super::Pipeline {
            nodes: self.nodes,
            links,
            options: self.options,
            observers: super::Observers::new(self.observers),
            control: self.control,
        })
    }

    /// The resolved graph as text (stages with their ports, then edges with type, capacity and
    /// policy), or the first error.
    ///
    /// # Errors
    ///
    /// As [`build`](Self::build).
    pub fn describe(&self) -> Result<String, GraphError> {
        let links = self.check()?;
        let mut s = String::new();
        use std::fmt::Write;
        let _ = writeln!(s, "stages:");
        for n in &self.nodes {
            let _ = writeln!(
                s,
                "  {:<14} {:<14} in [{}]  out [{}]",
                n.name,
                n.kind,
                PortSpec::list(&n.inputs),
                PortSpec::list(&n.outputs)
            );
        }
        let _ = writeln!(s, "edges:");
        for l in &links {
            let _ = writeln!(
                s,
                "  {:<40} {:<8} capacity {:<3} {}{}",
                l.name,
                l.ty.name(),
                l.capacity,
                l.overflow,
                if l.feedback { "  feedback" } else { "" }
            );
        }
        Ok(s)
    }
}

/// A cycle among non-feedback links, as node indices with the first repeated at the end.
fn find_cycle(n: usize, links: &[ResolvedLink]) -> Option<Vec<usize>> {
    let mut adj = vec![Vec::new(); n];
    for l in links.iter().filter(|l| !l.feedback) {
        adj[l.from].push(l.to);
    }
    // 0 = unvisited, 1 = on stack, 2 = done
    let mut state = vec![0u8; n];
    let mut stack: Vec<usize> = Vec::new();
    fn dfs(
        v: usize,
        adj: &[Vec<usize>],
        state: &mut [u8],
        stack: &mut Vec<usize>,
    ) -> Option<Vec<usize>> {
        state[v] = 1;
        stack.push(v);
        for &w in &adj[v] {
            if state[w] == 1 {
                let start = stack.iter().position(|&x| x == w).unwrap_or(0);
                let mut path = stack[start..].to_vec();
                path.push(w);
                return Some(path);
            }
            if state[w] == 0 {
                if let Some(p) = dfs(w, adj, state, stack) {
                    return Some(p);
                }
            }
        }
        stack.pop();
        state[v] = 2;
        None
    }
    for v in 0..n {
        if state[v] == 0 {
            if let Some(p) = dfs(v, &adj, &mut state, &mut stack) {
                return Some(p);
            }
        }
    }
    None
}
