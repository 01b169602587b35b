//! `codes_sink`: writes audio codes as JSON Lines, one frame per line (`[c0, c1, …]`), the format
//! `codes_source` and `duplex replay --codes` read back. Each line is flushed as it is written,
//! so a killed run leaves every complete frame.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageError, StageResult};

use super::{BuildContext, BuildError, Codes, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "codes_sink",
    doc: "writes audio codes as JSON Lines, one frame per line: [c0, c1, ...]",
    params: &[ParamSpec {
        name: "path",
        ty: T::OutPath,
        default: D::Required,
        doc: "output file (parent directories are created)",
    }],
    inputs: || vec![PortSpec::new::<Codes>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let path = PathBuf::from(p.str("path"));
    let file = super::create_output(&path)?;
    Ok(Body::Stage(Box::new(CodesSink {
        out: BufWriter::new(file),
        path,
    })))
}

struct CodesSink {
    out: BufWriter<File>,
    path: PathBuf,
}

impl Stage for CodesSink {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let c = input.take::<Codes>()?.data;
        let line = serde_json::to_string(&c.0).map_err(StageError::from)?;
        let io = |e: std::io::Error| StageError::msg(format!("{}: {e}", self.path.display()));
        writeln!(self.out, "{line}").map_err(io)?;
        self.out.flush().map_err(io)
    }
}
