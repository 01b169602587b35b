//! `token_sink`: writes the agent's tokens as JSON Lines, one line per agent frame:
//! `{"frame": i, "text": t, "audio": [8 ints]}` (plus `"piece"` when the text is known). Each
//! line is flushed as it is written, so a killed run leaves every complete line.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageResult};

use super::{AgentTokens, BuildContext, BuildError, StageKind};

pub(super) const KIND: StageKind = StageKind {
    name: "token_sink",
    doc: "writes the agent's tokens as JSON Lines: {\"frame\", \"text\", \"audio\"}",
    params: &[ParamSpec {
        name: "path",
        ty: T::OutPath,
        default: D::Required,
        doc: "output file (parent directories are created)",
    }],
    inputs: || vec![PortSpec::new::<AgentTokens>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let path = PathBuf::from(p.str("path"));
    let file = super::create_output(&path)?;
    Ok(Body::Stage(Box::new(TokenSink {
        out: BufWriter::new(file),
        path,
        lines: 0,
    })))
}

struct TokenSink {
    out: BufWriter<File>,
    path: PathBuf,
    lines: u64,
}

impl Stage for TokenSink {
    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let t = input.take::<AgentTokens>()?.data;
        let mut line = serde_json::json!({ "frame": t.index, "text": t.text, "audio": t.audio });
        if let Some(piece) = t.piece {
            line["piece"] = serde_json::Value::String(piece);
        }
        let io = |e: std::io::Error| {
            crate::runtime::StageError::msg(format!("{}: {e}", self.path.display()))
        };
        writeln!(self.out, "{line}").map_err(io)?;
        self.out.flush().map_err(io)?;
        self.lines += 1;
        Ok(())
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        tracing::info!(
            "wrote {} ({} agent frames)",
            self.path.display(),
            self.lines
        );
        Ok(())
    }
}
