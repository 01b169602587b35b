//! `duplex doctor`: which ONNX Runtime library a command would load and why (`--ort-lib`, else
//! `DUPLEX__ORT__LIBRARY`, else the search of [`ortlib`](crate::model::ortlib)), what it
//! offers, whether CUDA initialises ([`runtime`]).
//!
//! `duplex doctor --pack DIR`: checks that a model pack loads and runs, as a pipeline would use
//! it: the pack's files and manifest against the graph contract (and each graph's size and
//! weight quantization, step graphs included), then a session for each graph
//! on the chosen provider, one codec frame through the encoder and decoder (and through Mimi's
//! step graphs when the pack has them), and one temporal
//! step whose outputs must be finite; with `--time`, the temporal step's time at a few
//! context lengths with the cache resident, fed from the host, and at fixed shapes (a CUDA
//! graph under CUDA), one conversation's depformer frame (every substep and the user's skipped),
//! the codec's step graphs (fp32 and fp16) batched as a shared codec runs them (one call
//! of B rows against B calls of one row), the shared LM engine's frame time for B
//! conversations stepped together, and the memory a conversation adds to that engine at the
//! pack's whole context (the device's under CUDA; on the CPU what the process allocates, as
//! its allocator counts it).
//! Prints what it found; knows no stages or pipelines.

mod timing;

pub use timing::*;

use std::path::Path;
use std::time::Instant;

use crate::model::depformer::Depformer;
use crate::model::mimi::{MimiDecoder, MimiEncoder};
use crate::model::mimi_step::StepCodec;
use crate::model::pack::{FloatType, Graph, Pack, StepRole};
use crate::model::session::{Provider, SessionOptions};
use crate::model::temporal::TemporalOptions;
use crate::model::tokenizer::Tokenizer;
use crate::model::ModelError;

/// The command, where messages name a file.
const COMMAND: &str = "duplex doctor";

/// Loads ONNX Runtime as every command does (the library of `ort_lib`, the `--ort-lib` flag,
/// else of `DUPLEX__ORT__LIBRARY`, else the search) and reports it: its path and where it came
/// from, its build, the execution providers it offers, and whether CUDA initialises (and what
/// is missing when it does not).
///
/// # Errors
///
/// As [`load_ort_for`](super::load_ort_for): a configuration error (exit 2) for a library a
/// flag, a variable or `ORT_DYLIB_PATH` names that is missing or does not load; another (exit
/// 1) when none is installed.
pub fn runtime(ort_lib: Option<&Path>) -> anyhow::Result<String> {
    let chosen = match ort_lib {
        Some(p) => Some(crate::config::OrtChoice::flag("--ort-lib", p)),
        None => crate::config::ort::from_env(COMMAND, None)?,
    };
    let lib = super::load_ort_for(COMMAND, chosen.as_ref())?;
    let mut text = format!(
        "onnxruntime: {} (found via {})\n",
        lib.path.display(),
        lib.origin
    );
    if let Some(info) = crate::model::ortlib::build_info() {
        text.push_str(&format!("build: {info}\n"));
    }
    match crate::model::session::available_providers() {
        Ok(p) => text.push_str(&format!("providers: {}\n", p.join(", "))),
        Err(e) => text.push_str(&format!("providers: unknown ({e})\n")),
    }
    match crate::model::session::cuda_check(0) {
        Ok(()) => text.push_str("cuda: available (device 0)\n"),
        Err(crate::model::ModelError::Provider { detail, .. }) => {
            text.push_str(&format!("cuda: not available: {detail}\n"))
        }
        Err(e) => text.push_str(&format!("cuda: not available: {e}\n")),
    }
    Ok(text)
}

/// The opened pack and the report of it loading and running one frame on `provider`.
///
/// # Errors
///
/// The first [`ModelError`] met, naming the pack's file, key, graph or input.
pub fn pack(dir: &Path, provider: Provider) -> Result<(Pack, String), ModelError> {
    let t0 = Instant::now();
    let pack = Pack::open(dir)?;
    let mut text = files(&pack, dir);
    let session = SessionOptions {
        provider,
        ..SessionOptions::default()
    };
    text.push_str(&codec(&pack, &session)?);
    text.push_str(&lm(&pack, &session)?);
    text.push_str(&format!(
        "ok: the pack loads and runs ({:.1} s)\n",
        t0.elapsed().as_secs_f64()
    ));
    Ok((pack, text))
}

/// The manifest, then the four graphs and the step graphs the pack has, each with its size
/// and how its weights are quantized.
fn files(pack: &Pack, dir: &Path) -> String {
    let m = &pack.manifest;
    let mut text = format!("pack: {} ({})\n", dir.display(), m.name);
    text.push_str(&format!(
        "manifest: variant {}, dtype {}, mimi {}, context {} frames, max_positions {}\n",
        m.variant.map_or("-", |v| v.name()),
        m.dtype.map_or("-", |d| d.name()),
        m.mimi.as_deref().unwrap_or("-"),
        m.context,
        m.max_positions
    ));
    let steps = [FloatType::F32, FloatType::F16]
        .into_iter()
        .flat_map(|dtype| [StepRole::Encoder, StepRole::Decoder].map(|role| (role, dtype)))
        .filter(|&(role, dtype)| pack.step_graph(role, dtype).is_some())
        .map(|(role, dtype)| role.dir(dtype));
    let folders: Vec<String> = Graph::ALL
        .iter()
        .map(|g| g.dir().to_string())
        .chain(steps)
        .collect();
    for folder in folders {
        let weights = match pack.quantized(&folder) {
            Some(q) => format!(
                "  weights {} (blocks of {}{}{}{})",
                q.name(),
                q.block_size,
                q.matmuls
                    .filter(|&n| n > 0)
                    .map(|n| format!(", {n} MatMuls"))
                    .unwrap_or_default(),
                q.gathers
                    .filter(|&n| n > 0)
                    .map(|n| format!(", {n} tables"))
                    .unwrap_or_default(),
                match q.accuracy_level {
                    Some(4) => ", int8 arithmetic on a CPU",
                    _ => "",
                }
            ),
            None => String::new(),
        };
        text.push_str(&format!(
            "  {:<21} {:>9.1} MiB{weights}\n",
            folder,
            pack.folder_bytes(&folder) as f64 / (1u64 << 20) as f64
        ));
    }
    text
}

/// One frame through Mimi's encoder and decoder, then through each pair of step graphs the
/// pack has.
fn codec(pack: &Pack, session: &SessionOptions) -> Result<String, ModelError> {
    let m = &pack.manifest;
    let mut enc = MimiEncoder::open(pack, session, 1)?;
    let mut dec = MimiDecoder::open(pack, session, 1)?;
    let codes = enc.push(&vec![0.0; m.frame_size])?;
    let pcm = dec.push(&codes, m.audio_vocab)?;
    if pcm.len() != m.frame_size || pcm.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::contract(
            "mimi_decoder",
            format!(
                "decoding one frame gave {} samples (finite: {}), expected {}",
                pcm.len(),
                pcm.iter().all(|v| v.is_finite()),
                m.frame_size
            ),
        ));
    }
    let mut text = format!(
        "mimi: encoder on {}, decoder on {}; a silent frame encodes to {codes:?}\n",
        enc.runs_on(),
        dec.runs_on()
    );
    for dtype in [FloatType::F32, FloatType::F16] {
        if pack.step_graph(StepRole::Encoder, dtype).is_some()
            || pack.step_graph(StepRole::Decoder, dtype).is_some()
        {
            text.push_str(&step_graphs(pack, session, dtype, &codes, &pcm)?);
        }
    }
    Ok(text)
}

/// One frame each way through the step graphs of `dtype`, against the whole-utterance graphs'
/// `codes` and `pcm`; and whether a shared codec can run them.
fn step_graphs(
    pack: &Pack,
    session: &SessionOptions,
    dtype: FloatType,
    codes: &[i64],
    pcm: &[f32],
) -> Result<String, ModelError> {
    let m = &pack.manifest;
    let mut senc = StepCodec::open(pack, StepRole::Encoder, dtype, session)?;
    let mut sdec = StepCodec::open(pack, StepRole::Decoder, dtype, session)?;
    let scodes = senc.encode(&vec![0.0; m.frame_size])?;
    let spcm = sdec.decode(codes, m.audio_vocab)?;
    if spcm.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::contract(
            "mimi_decoder_step",
            "decoding one frame gave samples that are not finite",
        ));
    }
    let worst = spcm
        .iter()
        .zip(pcm)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    // Whether a shared codec can run them: a row left out of a call must keep its state.
    let rows = if senc.steps_some_rows() && sdec.steps_some_rows() {
        let mut two = StepCodec::open_rows(pack, StepRole::Encoder, dtype, session, 2)?;
        two.encode_some(&vec![0.25; 2 * m.frame_size], Some(&[true, false]))?;
        if two.row_state(1).iter().any(|b| *b != 0) {
            return Err(ModelError::contract(
                "mimi_encoder_step",
                "a batch row left out of a call (`active` false) changed its state",
            ));
        }
        "batch rows stepped apart (a shared codec can run them)".to_string()
    } else {
        format!(
            "no `active` input: every batch row steps on every call, so a shared codec \
             cannot run them (rebuild with python tools/make_mimi_step.py {})",
            pack.dir.display()
        )
    };
    Ok(format!(
        "mimi step graphs ({}): encoder on {}, {} states; decoder on {}, {} states; a silent \
         frame encodes to {scodes:?} ({}), decodes within {worst:.1e} of the decoder's; \
         {rows}\n",
        dtype.name(),
        senc.runs_on(),
        senc.manifest.states.len(),
        sdec.runs_on(),
        sdec.manifest.states.len(),
        if scodes == codes {
            "the same"
        } else {
            "not the same"
        },
    ))
}

/// One temporal step (its outputs finite), the depformer opened, the tokenizer read.
fn lm(pack: &Pack, session: &SessionOptions) -> Result<String, ModelError> {
    let m = &pack.manifest;
    let mut temporal = crate::model::temporal::open(
        pack,
        &TemporalOptions {
            session: *session,
            ..TemporalOptions::default()
        },
    )?;
    temporal.step(&m.layout().initial)?;
    let (mut hidden, mut logits) = (Vec::new(), Vec::new());
    temporal.read_hidden(&mut hidden);
    temporal.read_logits(&mut logits);
    if hidden.iter().chain(&logits).any(|v| !v.is_finite()) {
        return Err(ModelError::contract(
            "temporal",
            "the first step's hidden state or text logits are not finite",
        ));
    }
    let i = temporal.info();
    let mut text = format!(
        "temporal: on {}, {} layers, {} heads x {}, hidden {}, text vocab {}; one step finite\n",
        temporal.runs_on(),
        i.layers,
        i.heads,
        i.head_dim,
        i.hidden_dim,
        i.vocab
    );
    let dep = Depformer::open(pack, session)?;
    text.push_str(&format!(
        "depformer: on {}, {} layers, {} substeps\n",
        dep.runs_on(),
        dep.info.layers,
        dep.steps()
    ));
    match pack.tokenizer() {
        Some(p) => {
            let tok = Tokenizer::open(&p)?;
            text.push_str(&format!(
                "tokenizer: {} ({} pieces)\n",
                p.display(),
                tok.len()
            ));
        }
        None => text.push_str("tokenizer: none (persona text and transcripts need one)\n"),
    }
    Ok(text)
}
