//! ONNX Runtime sessions: per-stage options, execution providers that refuse to pretend, and a
//! report of the provider really used.
//!
//! Asking for CUDA when it cannot take effect (a binary built without the `cuda` feature, a
//! CPU-only ONNX Runtime, missing CUDA libraries, no GPU) is an error unless the caller allows
//! falling back to the CPU, in which case a warning says so. Registration goes through
//! `error_on_failure`, because ONNX Runtime would otherwise fall back silently.

use std::path::Path;

use ort::session::Session;

use super::error::ModelError;
use super::ortlib;

/// Where a session computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Provider {
    /// The CPU execution provider.
    #[default]
    Cpu,
    /// The CUDA execution provider on a device.
    Cuda {
        /// GPU index.
        device_id: i32,
    },
}

impl Provider {
    /// `cpu` or `cuda`.
    pub fn name(&self) -> &'static str {
        match self {
            Provider::Cpu => "cpu",
            Provider::Cuda { .. } => "cuda",
        }
    }
}

/// Options of one session (from a stage's YAML params).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionOptions {
    /// Provider asked for.
    pub provider: Provider,
    /// When the provider cannot take effect: fall back to the CPU with a warning instead of
    /// failing.
    pub allow_fallback: bool,
    /// Intra-op threads (0 = ONNX Runtime's default).
    pub intra_threads: usize,
    /// Let idle intra-op threads spin. Off by default: several sessions share few cores.
    pub spinning: bool,
    /// Ask the CUDA provider to capture the first run as a CUDA graph and replay it (the
    /// caller binds every input and output at fixed addresses and shapes).
    pub cuda_graph: bool,
    /// Who hears which provider and dtype each graph really runs on (the process's metrics,
    /// which the stages that open graphs hand in); none: only the log says it.
    pub on_ready: Option<ReadyHook>,
}

/// A function told, once per graph opened, the graph's name, the provider it really runs on
/// and its dtype. A plain function, so that options stay `Copy` and this layer knows nothing
/// of who listens.
#[derive(Clone, Copy)]
pub struct ReadyHook(pub fn(graph: &str, provider: Provider, dtype: &str));

impl PartialEq for ReadyHook {
    /// Options are equal whoever hears them.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for ReadyHook {}

impl std::fmt::Debug for ReadyHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReadyHook")
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            provider: Provider::Cpu,
            allow_fallback: false,
            intra_threads: 1,
            spinning: false,
            cuda_graph: false,
            on_ready: None,
        }
    }
}

impl SessionOptions {
    /// Why `cuda_graph` cannot apply to these options (the option in the way and what a CUDA
    /// graph needs): off the CUDA provider; `None` when it can, or is not asked for.
    pub fn cuda_graph_conflict(&self) -> Option<(&'static str, &'static str)> {
        (self.cuda_graph && !matches!(self.provider, Provider::Cuda { .. })).then_some((
            "execution_provider",
            "`cuda_graph: true` needs `execution_provider: cuda` (a CUDA graph is the CUDA provider's)",
        ))
    }
}

/// A session with the provider it really runs on.
pub struct OpenSession {
    /// The session.
    pub session: Session,
    /// The provider in use.
    pub provider: Provider,
}

fn builder(
    graph: &str,
    opts: &SessionOptions,
) -> Result<ort::session::builder::SessionBuilder, ModelError> {
    ortlib::environment(None)?;
    let env = ortlib::env().ok_or_else(|| ModelError::ort(graph, "ONNX Runtime is not loaded"))?;
    let mut b = Session::builder(env).map_err(|e| ModelError::ort(graph, e))?;
    if opts.intra_threads > 0 {
        b = b
            .with_intra_threads(opts.intra_threads)
            .map_err(|e| ModelError::ort(graph, e))?;
    }
    // Input shapes change every step (the cache and the mask grow by one row): ONNX Runtime's
    // memory-pattern cache would keep one plan per shape seen, growing with the conversation.
    b = b
        .with_intra_op_spinning(opts.spinning)
        .map_err(|e| ModelError::ort(graph, e))?
        .with_memory_pattern(false)
        .map_err(|e| ModelError::ort(graph, e))?;
    Ok(b)
}

#[cfg(feature = "cuda")]
fn with_cuda(
    graph: &str,
    b: ort::session::builder::SessionBuilder,
    device_id: i32,
    cuda_graph: bool,
) -> Result<ort::session::builder::SessionBuilder, ModelError> {
    let ep = ort::ep::CUDA::default()
        .with_device_id(device_id)
        .with_cuda_graph(cuda_graph)
        .build()
        .error_on_failure();
    b.with_execution_providers([ep]).map_err(|e| {
        no_cuda(
            graph,
            device_id,
            format!(
                "{e} (is this the GPU build of ONNX Runtime, `onnxruntime-gpu`, with the CUDA libraries and a GPU present?)"
            ),
        )
    })
}

#[cfg(not(feature = "cuda"))]
fn with_cuda(
    graph: &str,
    _b: ort::session::builder::SessionBuilder,
    device_id: i32,
    _cuda_graph: bool,
) -> Result<ort::session::builder::SessionBuilder, ModelError> {
    Err(no_cuda(
        graph,
        device_id,
        "this duplex binary was built without CUDA support (rebuild with `--features cuda`)".into(),
    ))
}

/// The CUDA provider could not be registered for `graph`, and why.
fn no_cuda(graph: &str, device_id: i32, detail: String) -> ModelError {
    ModelError::Provider {
        graph: graph.into(),
        provider: Provider::Cuda { device_id }.name().to_string(),
        detail,
    }
}

/// The execution providers the loaded ONNX Runtime library was built with
/// (`CPUExecutionProvider`, `CUDAExecutionProvider`, …), as it lists them.
///
/// # Errors
///
/// [`ModelError::Ort`] with ONNX Runtime's message.
pub fn available_providers() -> Result<Vec<String>, ModelError> {
    let mut list: *mut *mut std::ffi::c_char = std::ptr::null_mut();
    let mut n: std::ffi::c_int = 0;
    // SAFETY: ONNX Runtime fills `list` with `n` C strings it owns, released once below.
    let status = unsafe { (ort::api().GetAvailableProviders)(&mut list, &mut n) };
    if !status.0.is_null() {
        // SAFETY: a non-null status is a valid OrtStatus, released once here.
        let msg = unsafe {
            let m = std::ffi::CStr::from_ptr((ort::api().GetErrorMessage)(status.0))
                .to_string_lossy()
                .into_owned();
            (ort::api().ReleaseStatus)(status.0);
            m
        };
        return Err(ModelError::ort("providers", msg));
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `list` holds `n` valid C strings.
        out.push(unsafe {
            std::ffi::CStr::from_ptr(*list.add(i))
                .to_string_lossy()
                .into_owned()
        });
    }
    // SAFETY: `list` and `n` are what GetAvailableProviders returned.
    let status = unsafe { (ort::api().ReleaseAvailableProviders)(list, n) };
    if !status.0.is_null() {
        // SAFETY: as above.
        unsafe { (ort::api().ReleaseStatus)(status.0) };
    }
    Ok(out)
}

/// Whether the CUDA execution provider can be registered for device `device_id` here: `Ok`, or
/// what is missing (a build without CUDA support, a CPU-only ONNX Runtime, CUDA libraries, a GPU).
///
/// # Errors
///
/// [`ModelError::Provider`] saying why CUDA cannot take effect; ONNX Runtime's errors.
pub fn cuda_check(device_id: i32) -> Result<(), ModelError> {
    let b = builder("doctor", &SessionOptions::default())?;
    with_cuda("doctor", b, device_id, false).map(|_| ())
}

/// Logs the provider and dtype a graph really runs with, and tells `opts.on_ready` (which
/// exports them as `duplex_model_info{graph, execution_provider, dtype} = 1` where a stage
/// opened the graph). The model's owner learns it from the model itself: `runs_on`.
pub fn report(opts: &SessionOptions, graph: &str, provider: Provider, dtype: &str) {
    tracing::info!(
        graph,
        execution_provider = provider.name(),
        dtype,
        "session ready"
    );
    if let Some(ReadyHook(hook)) = opts.on_ready {
        hook(graph, provider, dtype);
    }
}

/// A session builder with `opts` applied, and the provider it will run on.
fn configured(
    graph: &str,
    opts: &SessionOptions,
) -> Result<(ort::session::builder::SessionBuilder, Provider), ModelError> {
    let mut provider = Provider::Cpu;
    let b = match opts.provider {
        Provider::Cpu => builder(graph, opts)?,
        Provider::Cuda { device_id } => {
            match with_cuda(graph, builder(graph, opts)?, device_id, opts.cuda_graph) {
                Ok(b) => {
                    provider = opts.provider;
                    b
                }
                Err(ModelError::Provider { detail, .. }) if opts.allow_fallback => {
                    tracing::warn!(
                    graph,
                    "execution provider `cuda` is not available ({detail}); running on the CPU because `allow_fallback` is set"
                );
                    builder(graph, opts)?
                }
                Err(ModelError::Provider { detail, .. }) => {
                    return Err(ModelError::Provider {
                        graph: graph.into(),
                        provider: "cuda".into(),
                        detail: format!(
                            "{detail}; set `allow_fallback: true` to run on the CPU instead"
                        ),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    };
    Ok((b, provider))
}

/// The names of a session's inputs and of its outputs, in the graph's order.
pub(crate) fn io_names(session: &Session) -> (Vec<String>, Vec<String>) {
    let names = |v: &[ort::value::Outlet]| v.iter().map(|o| o.name().to_string()).collect();
    (names(session.inputs()), names(session.outputs()))
}

/// Opens a graph built in memory (`bytes`; `graph` names it in messages) with `opts`.
///
/// # Errors
///
/// As [`open`].
pub(crate) fn open_bytes(
    bytes: &[u8],
    graph: &str,
    opts: &SessionOptions,
) -> Result<OpenSession, ModelError> {
    let (mut b, provider) = configured(graph, opts)?;
    let session = b
        .commit_from_memory(bytes)
        .map_err(|e| ModelError::ort(graph, e))?;
    Ok(OpenSession { session, provider })
}

/// Opens `path` (graph `graph`, for messages) with `opts`. Call [`report`] once the graph's
/// dtype is known.
///
/// # Errors
///
/// [`ModelError::Provider`] when CUDA is asked for and cannot take effect (and falling back is
/// not allowed); [`ModelError::Ort`] when ONNX Runtime cannot load the graph.
pub fn open(path: &Path, graph: &str, opts: &SessionOptions) -> Result<OpenSession, ModelError> {
    let (mut b, provider) = configured(graph, opts)?;
    let session = b.commit_from_file(path).map_err(|e| {
        use ort::error::ErrorCode as C;
        let graph = format!("{graph} ({})", path.display());
        match e.code() {
            // The file itself is wrong: nothing to retry.
            C::InvalidArgument
            | C::NoSuchFile
            | C::NoModel
            | C::InvalidProtobuf
            | C::NotImplemented
            | C::InvalidGraph => ModelError::Invalid {
                graph,
                detail: e.to_string(),
            },
            _ => ModelError::ort(&graph, e),
        }
    })?;
    Ok(OpenSession { session, provider })
}
