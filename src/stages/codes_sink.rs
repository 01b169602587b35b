//! `codes_sink`: writes audio codes as JSON Lines, one frame per line (`[c0, c1, …]`), the format
//! `codes_source` and `duplex replay --codes` read back. Each line is flushed as it is written,
//! so a killed run leaves every complete frame. The file is checked at build and created when
//! the pipeline starts ([`OutputFile`]).

use std::fs::File;
use std::io::{BufWriter, Write};

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageError, StageResult};

use super::params::stage_params;
use super::{BuildContext, BuildError, Codes, OutputFile, StageKind};

stage_params! {
    /// `codes_sink`'s params.
    struct CodesSinkParams {
        path: String = ParamSpec {
        name: "path",
        ty: T::OutPath,
        default: D::Required,
        doc: "output file (parent directories are created)",
    },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "codes_sink",
    doc: "writes audio codes as JSON Lines, one frame per line: [c0, c1, ...]",
    params: CodesSinkParams::SPECS,
    inputs: || vec![PortSpec::new::<Codes>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = CodesSinkParams::from_params(p)?;
    Ok(Body::Stage(Box::new(CodesSink {
        file: OutputFile::check(p.path.as_str(), "path")?,
        out: None,
    })))
}

struct CodesSink {
    file: OutputFile,
    /// Created at start.
    out: Option<BufWriter<File>>,
}

impl CodesSink {
    fn out(&mut self) -> Result<&mut BufWriter<File>, StageError> {
        let out = match self.out.take() {
            Some(out) => out,
            None => BufWriter::new(self.file.create()?),
        };
        Ok(self.out.insert(out))
    }
}

impl Stage for CodesSink {
    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        self.out().map(drop)
    }

    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let c = input.take::<Codes>()?.data;
        let line = serde_json::to_string(&c.0).map_err(StageError::from)?;
        let out = self.out()?;
        let written = writeln!(out, "{line}").and_then(|()| out.flush());
        written.map_err(|e| StageError::msg(format!("{}: {e}", self.file.path().display())))
    }
}
