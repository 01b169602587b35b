//! `null_sink`: accepts frames of any type and discards them (counted in the stage's stats).

use crate::config::Params;
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageResult};

use super::{BuildContext, BuildError, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "null_sink",
    doc: "discards frames of any type (they are still counted and timed)",
    params: &[],
    inputs: || vec![PortSpec::any("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, _: &Params) -> Result<Body, BuildError> {
    Ok(Body::Stage(Box::new(NullSink)))
}

struct NullSink;

impl Stage for NullSink {
    fn process(&mut self, _input: Input, _cx: &mut Context<'_>) -> StageResult {
        Ok(())
    }
}
