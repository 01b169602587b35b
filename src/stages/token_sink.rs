//! `token_sink`: writes the agent's tokens as JSON Lines, one line per agent frame:
//! `{"frame": i, "text": t, "audio": [8 ints]}` (plus `"piece"` when the text is known). Each
//! line is flushed as it is written, so a killed run leaves every complete line. The file is
//! checked at build and created when the pipeline starts ([`OutputFile`]).

use std::fs::File;
use std::io::{BufWriter, Write};

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Context, Input, PortSpec, Stage, StageResult};

use super::params::stage_params;
use super::{AgentTokens, BuildContext, BuildError, OutputFile, StageKind};

stage_params! {
    /// `token_sink`'s params.
    struct TokenSinkParams {
        path: String = ParamSpec {
        name: "path",
        ty: T::OutPath,
        default: D::Required,
        doc: "output file (parent directories are created)",
    },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "token_sink",
    doc: "writes the agent's tokens as JSON Lines: {\"frame\", \"text\", \"audio\"}",
    params: TokenSinkParams::SPECS,
    inputs: || vec![PortSpec::new::<AgentTokens>("in")],
    outputs: Vec::new,
    commands: &[],
    status: &[],
    build,
};

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = TokenSinkParams::from_params(p)?;
    Ok(Body::Stage(Box::new(TokenSink {
        file: OutputFile::check(p.path.as_str(), "path")?,
        out: None,
        lines: 0,
    })))
}

struct TokenSink {
    file: OutputFile,
    /// Created at start.
    out: Option<BufWriter<File>>,
    lines: u64,
}

impl TokenSink {
    fn out(&mut self) -> Result<&mut BufWriter<File>, crate::runtime::StageError> {
        let out = match self.out.take() {
            Some(out) => out,
            None => BufWriter::new(self.file.create()?),
        };
        Ok(self.out.insert(out))
    }
}

impl Stage for TokenSink {
    fn start(&mut self, _cx: &mut Context<'_>) -> StageResult {
        self.out().map(drop)
    }

    fn process(&mut self, input: Input, _cx: &mut Context<'_>) -> StageResult {
        let t = input.take::<AgentTokens>()?.data;
        let mut line = serde_json::json!({ "frame": t.index, "text": t.text, "audio": t.audio });
        if let Some(piece) = t.piece {
            line["piece"] = serde_json::Value::String(piece);
        }
        let out = self.out()?;
        let written = writeln!(out, "{line}").and_then(|()| out.flush());
        written.map_err(|e| {
            crate::runtime::StageError::msg(format!("{}: {e}", self.file.path().display()))
        })?;
        self.lines += 1;
        Ok(())
    }

    fn finish(&mut self, _cx: &mut Context<'_>) -> StageResult {
        tracing::info!(
            "wrote {} ({} agent frames)",
            self.file.path().display(),
            self.lines
        );
        Ok(())
    }
}
