//! `codes_source`: user codes from a JSON file (an array of frames, each an array of
//! `codebooks` ints, or one such array per line), so the LM can be run and checked without audio.

use crate::files::FileError;
use std::path::Path;

use crate::config::{ParamDefault as D, ParamSpec, ParamType as T, Params};
use crate::runtime::{Body, Caps, Context, Flow, PortSpec, Source, StageResult};

use super::pacing::Pacer;
use super::params::stage_params;
use super::{caps, BuildContext, BuildError, Codes, StageKind};

stage_params! {
    /// `codes_source`'s params.
    struct CodesSourceParams {
        path: String = ParamSpec {
            name: "path",
            ty: T::Path,
            default: D::Required,
            doc: "JSON file",
        },
        codebooks: usize = ParamSpec {
            name: "codebooks",
            ty: T::Int { min: 1, max: 64 },
            default: D::Int(8),
            doc: "codes per frame",
        },
        vocab: i64 = ParamSpec {
            name: "vocab",
            ty: T::Int {
                min: 1,
                max: 1 << 20,
            },
            default: D::Int(2048),
            doc: "codes must be below this",
        },
        realtime: bool = ParamSpec {
            name: "realtime",
            ty: T::Bool,
            default: D::Bool(false),
            doc: "pace frames at 12.5 Hz (else as fast as possible)",
        },
    }
}

pub(super) const KIND: StageKind = StageKind {
    name: "codes_source",
    doc: "user codes from a JSON file: [[8 ints], ...], one frame per 80 ms step",
    params: CodesSourceParams::SPECS,
    inputs: Vec::new,
    outputs: || vec![PortSpec::new::<Codes>("out")],
    commands: &[],
    status: &[],
    build,
};

/// Reads and checks a codes file.
///
/// # Errors
///
/// A [`FileError`] naming the file (its line, for JSON Lines) and, for a bad frame, its index.
pub fn read_codes(path: &Path, codebooks: usize, vocab: i64) -> Result<Vec<Vec<i64>>, FileError> {
    // Bounded (two hours of frames take about 5 MB), and a FIFO refused rather than waited on.
    let bytes = crate::files::read_limited(path, 256 << 20)
        .map_err(|e| FileError::new(path.display(), e))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| FileError::new(path.display(), "not UTF-8 text (expected JSON)"))?;
    // A JSON array of frames, or JSON Lines of frames (what `codes_sink` writes).
    let frames: Vec<Vec<i64>> = match serde_json::from_str(&text) {
        Ok(f) => f,
        Err(_)
            if text.trim_start().starts_with("[")
                && !text.trim_start().starts_with("[[")
                && text.trim().lines().count() > 1 =>
        {
            text.lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, l)| {
                    serde_json::from_str(l).map_err(|e| {
                        FileError::new(
                            format!("{}:{}", path.display(), i + 1),
                            format!("not a frame of {codebooks} integer codes: {e}"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Err(e) => {
            return Err(FileError::new(
                path.display(),
                format!("not a JSON array of frames of {codebooks} integer codes: {e}"),
            ))
        }
    };
    if frames.is_empty() {
        return Err(FileError::new(path.display(), "no frames"));
    }
    for (i, f) in frames.iter().enumerate() {
        if f.len() != codebooks {
            return Err(FileError::new(
                path.display(),
                format!("frame {i} has {} codes, expected {codebooks}", f.len()),
            ));
        }
        if let Some((q, c)) = f.iter().enumerate().find(|(_, c)| !(0..vocab).contains(*c)) {
            return Err(FileError::new(
                path.display(),
                format!("frame {i}: code {c} of codebook {q} is out of range 0..{vocab}"),
            ));
        }
    }
    Ok(frames)
}

fn build(_: &BuildContext<'_>, p: &Params) -> Result<Body, BuildError> {
    let p = CodesSourceParams::from_params(p)?;
    let frames = read_codes(Path::new(p.path.as_str()), p.codebooks, p.vocab)
        .map_err(|e| BuildError::from(e).key("path"))?;
    Ok(Body::Source(Box::new(CodesSource {
        codebooks: p.codebooks,
        vocab: p.vocab,
        frames: frames.into_iter(),
        // One code frame stands for 1920 samples at 24 kHz.
        pacer: Pacer::new(p.realtime, 24_000),
    })))
}

struct CodesSource {
    codebooks: usize,
    vocab: i64,
    frames: std::vec::IntoIter<Vec<i64>>,
    pacer: Pacer,
}

impl Source for CodesSource {
    fn caps(&self) -> Vec<Caps> {
        vec![Caps::new()
            .with(caps::CODEBOOKS, self.codebooks as i64)
            .with(caps::VOCAB, self.vocab)]
    }

    fn produce(&mut self, cx: &mut Context<'_>) -> StageResult<Flow> {
        let Some(f) = self.frames.next() else {
            return Ok(Flow::Done);
        };
        let Some(origin) = self.pacer.next(1920, cx) else {
            return Ok(Flow::Done);
        };
        cx.emit(0, origin, Codes(f))?;
        Ok(Flow::Continue)
    }
}
