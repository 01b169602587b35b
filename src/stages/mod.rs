//! Stage kinds: one file per kind, each adapting a building block to the runtime's
//! [`Stage`](crate::runtime::Stage) or [`Source`](crate::runtime::Source) trait and declaring its
//! ports and params.
//!
//! Stages never see a thread or a channel: they get frames in `process` and emit through the
//! [`Context`](crate::runtime::Context). The [`Registry`] maps kind names (as written in pipeline
//! files) to builders; applications can register kinds of their own next to the built-in ones.
//! A builder's error is a [`BuildError`] that says whether the configuration is wrong or
//! something is not available now, and which param is at fault.

mod aec;
mod codec;
mod codes_sink;
mod codes_source;
mod depformer;
mod error;
mod framer;
pub mod inject_delay;
mod mic;
mod mimi_decode;
mod mimi_encode;
mod model_params;
mod null_sink;
mod opus;
pub(crate) mod params;
mod playback;
mod resample;
mod session;
mod synth_source;
mod temporal;
mod token_sink;
mod types;
mod wav_sink;
mod wav_source;

pub use codes_source::read_codes;
pub use error::{BuildError, BuildErrorKind};

pub mod read;

/// The names of the kinds the apps look for in a template (each is that kind's `KIND.name`):
/// an app finds a stage by one of these, never by a string of its own.
pub mod kind {
    /// The LM's temporal transformer.
    pub const TEMPORAL: &str = "temporal";
    /// The LM's depformer (the sampler).
    pub const DEPFORMER: &str = "depformer";
    /// A sound device's output.
    pub const PLAYBACK: &str = "playback";
    /// Ogg/Opus in.
    pub const OPUS_DECODE: &str = "opus_decode";
    /// Ogg/Opus out.
    pub const OPUS_ENCODE: &str = "opus_encode";
    /// A served session's network input.
    pub const SESSION_IN: &str = "session_in";
    /// A served session's network audio output.
    pub const SESSION_AUDIO_OUT: &str = "session_audio_out";
    /// A served session's network input of PCM (the realtime API, phones, WebRTC).
    pub const SESSION_PCM_IN: &str = "session_pcm_in";
    /// A served session's network output of PCM.
    pub const SESSION_PCM_OUT: &str = "session_pcm_out";
}
pub(crate) use temporal::check_voice;

use std::fmt::Write;

use crate::model::pack::Pack;

use crate::config::{KindCatalog, ParamSpec, Params};
use crate::runtime::{Body, CommandSpec, ControlPlane, Endpoint, PortSpec, StatusSpec};

pub use types::*;

/// Everything a builder gets besides its params.
pub struct BuildContext<'a> {
    /// The stage's name in the pipeline.
    pub stage: &'a str,
    /// The pipeline file, for messages.
    pub file: &'a str,
    /// The pipeline's control plane.
    pub control: &'a ControlPlane,
    /// The commands the stage's kind declares.
    pub commands: &'static [CommandSpec],
    /// The network session the pipeline serves, when it serves one (`duplex serve`).
    pub session: Option<&'a crate::session::PipelineEnd>,
    /// The recording of the run, when it is recorded (`record.dir`).
    pub recording: Option<&'a crate::observe::record::Recording>,
    /// The pipeline's reference taps (a `playback` stage provides one under its name, an
    /// `aec` stage reads it); None where the caller builds stages alone.
    pub taps: Option<&'a crate::audio::reference::Taps>,
    /// The pipeline's conversation count (the LM stage starts a new conversation, the codec
    /// stages start new streams); None where the caller builds stages alone.
    pub conversation: Option<&'a Conversation>,
    /// What the process builds once (packs, tokenizers, voice codes, engines, primed states):
    /// every stage takes them from here (a caller building stages alone makes one).
    pub resources: &'a crate::resources::Resources,
}

/// A pipeline's conversation count. The LM stage bumps it when it starts a new conversation
/// (a reset, a new persona, the long-session policy's re-prime); the codec stages start a new
/// stream when they see it change, at their next frame. Cheap to clone; every clone is the
/// same count.
#[derive(Clone, Default, Debug)]
pub struct Conversation(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl Conversation {
    /// The current conversation's number (0 for the first).
    pub fn current(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Starts the next conversation.
    pub fn begin(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl<'a> BuildContext<'a> {
    /// The context for building stage `stage` of kind `kind` into the pipeline whose plane is
    /// `control`, in the process whose resources are `resources`.
    pub fn new(
        stage: &'a str,
        file: &'a str,
        control: &'a ControlPlane,
        kind: &StageKind,
        resources: &'a crate::resources::Resources,
    ) -> Self {
        BuildContext {
            stage,
            file,
            control,
            commands: kind.commands,
            session: None,
            recording: None,
            taps: None,
            conversation: None,
            resources,
        }
    }

    /// The pack in `dir`: the process's, opened once per change on disk.
    ///
    /// # Errors
    ///
    /// The pack's error, on the `pack` param.
    pub fn pack(&self, dir: &std::path::Path) -> Result<std::sync::Arc<Pack>, BuildError> {
        Ok(self.resources.pack(dir)?)
    }

    /// The tokenizer at `path`, loaded once per process.
    ///
    /// # Errors
    ///
    /// The tokenizer's error, on the `tokenizer` param.
    pub fn tokenizer(
        &self,
        path: &std::path::Path,
    ) -> Result<std::sync::Arc<crate::model::tokenizer::Tokenizer>, BuildError> {
        self.resources
            .tokenizer(path)
            .map_err(|e| BuildError::invalid(e.to_string()).key("tokenizer"))
    }

    /// The same context for a pipeline whose conversation count is `conversation`.
    pub fn with_conversation(mut self, conversation: &'a Conversation) -> Self {
        self.conversation = Some(conversation);
        self
    }

    /// The pipeline's conversation count (a count of its own for a stage built alone).
    pub fn conversation(&self) -> Conversation {
        self.conversation.cloned().unwrap_or_default()
    }

    /// The same context for a pipeline whose reference taps are `taps`.
    pub fn with_taps(mut self, taps: &'a crate::audio::reference::Taps) -> Self {
        self.taps = Some(taps);
        self
    }

    /// The same context for a pipeline whose run is recorded into `recording`.
    pub fn with_recording(
        mut self,
        recording: Option<&'a crate::observe::record::Recording>,
    ) -> Self {
        self.recording = recording;
        self
    }

    /// The same context for a pipeline that serves the network session `session`.
    pub fn with_session(mut self, session: Option<&'a crate::session::PipelineEnd>) -> Self {
        self.session = session;
        self
    }

    /// The session the pipeline serves; an error naming the stage kind when there is none (the
    /// session stages run only inside `duplex serve`).
    pub fn session(&self, kind: &str) -> Result<&'a crate::session::PipelineEnd, BuildError> {
        self.session.ok_or_else(|| {
            BuildError::invalid(format!(
                "`{kind}` is a network session's end: it runs only in a session template of \
                 `duplex serve`"
            ))
        })
    }

    /// The stage's own endpoint on the pipeline's control plane: the commands sent to it, and
    /// the status block it reports in. Call it once, from the builder.
    pub fn endpoint(&self) -> Endpoint {
        self.control.endpoint(self.stage, self.commands)
    }
}

/// A file a stage writes (a sink's `path`, the virtual player's `capture`): checked when the
/// stage is built, created when the pipeline starts.
///
/// Building a pipeline must leave what it would write as it is: `duplex validate`, a pipeline
/// refused after this stage was built (a bad link, another stage's param) and a daemon reload
/// that is rejected all build stages without running them, and a file created at build would
/// be truncated for nothing. [`OutputFile::check`] looks without creating or truncating
/// anything; [`OutputFile::create`] (from the stage's `start`, or its first write) creates the
/// missing folders and the file.
#[derive(Debug, Clone)]
pub(crate) struct OutputFile {
    path: std::path::PathBuf,
}

impl OutputFile {
    /// Checks that `path` (the value of param `key`) can be written: not a directory, and
    /// either a file this process may write or a name in a folder (existing, or to be created
    /// under the nearest existing one) where it may create files. Creates nothing.
    ///
    /// # Errors
    ///
    /// A [`BuildError`] naming `key` and the path, saying what is in the way.
    pub(crate) fn check(path: &str, key: &'static str) -> Result<Self, BuildError> {
        use std::os::unix::fs::FileTypeExt;
        let p = std::path::Path::new(path);
        let bad = |m: String| BuildError::invalid(format!("{path}: {m}")).key(key);
        if path.ends_with('/') {
            return Err(bad("names a folder: end it with a file name".into()));
        }
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => return Err(bad("is a directory, not a file".into())),
            Ok(m) if m.file_type().is_socket() => {
                return Err(bad("is a socket, not a file".into()))
            }
            Ok(_) => writable(p, libc::W_OK).map_err(|e| bad(format!("cannot be written: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Missing folders are created under the nearest existing one, then the file.
                let dir = p
                    .ancestors()
                    .skip(1)
                    .map(|a| {
                        if a.as_os_str().is_empty() {
                            std::path::Path::new(".")
                        } else {
                            a
                        }
                    })
                    .find(|a| a.exists())
                    .unwrap_or(std::path::Path::new("."));
                if !dir.is_dir() {
                    return Err(bad(format!("{} is not a directory", dir.display())));
                }
                writable(dir, libc::W_OK | libc::X_OK)
                    .map_err(|e| bad(format!("cannot create files in {}: {e}", dir.display())))?;
            }
            Err(e) => return Err(bad(e.to_string())),
        }
        Ok(OutputFile { path: p.into() })
    }

    /// The path.
    pub(crate) fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Creates the missing folders above the file (for writers that create the file
    /// themselves).
    ///
    /// # Errors
    ///
    /// A [`StageError`](crate::runtime::StageError) naming the folder.
    pub(crate) fn create_folders(&self) -> Result<(), crate::runtime::StageError> {
        match self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            Some(dir) => std::fs::create_dir_all(dir)
                .map_err(|e| crate::runtime::StageError::msg(format!("{}: {e}", dir.display()))),
            None => Ok(()),
        }
    }

    /// Creates (or truncates) the file, and the missing folders above it.
    ///
    /// # Errors
    ///
    /// A [`StageError`](crate::runtime::StageError) naming the path.
    pub(crate) fn create(&self) -> Result<std::fs::File, crate::runtime::StageError> {
        self.create_folders()?;
        std::fs::File::create(&self.path)
            .map_err(|e| crate::runtime::StageError::msg(format!("{}: {e}", self.path.display())))
    }
}

/// `access(2)`: whether this process may use `path` as `mode` says (it follows the path's
/// links and knows read-only file systems), without opening it.
fn writable(path: &std::path::Path, mode: libc::c_int) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL in the path"))?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call; access reads nothing else.
    if unsafe { libc::access(c.as_ptr(), mode) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A stage kind: its name, docs, params, ports and builder.
#[derive(Clone, Copy)]
pub struct StageKind {
    /// Name used as `kind:` in pipeline files.
    pub name: &'static str,
    /// One line for `duplex stages`.
    pub doc: &'static str,
    /// Declared params.
    pub params: &'static [ParamSpec],
    /// Input ports.
    pub inputs: fn() -> Vec<PortSpec>,
    /// Output ports.
    pub outputs: fn() -> Vec<PortSpec>,
    /// Commands it takes at frame boundaries (through its [`Endpoint`]).
    pub commands: &'static [CommandSpec],
    /// Status it reports.
    pub status: &'static [StatusSpec],
    /// Builds the stage from checked params. The error should say what to fix, and which
    /// param is at fault.
    pub build: fn(&BuildContext<'_>, &Params) -> Result<Body, BuildError>,
}

/// The status keys of the stages that own a sound device (`mic`, `playback`).
pub(crate) mod device_status {
    use crate::runtime::StatusSpec;

    /// The device open now.
    pub const NAME: StatusSpec = StatusSpec {
        name: "name",
        doc: "the device open now",
    };
    /// Its state.
    pub const STATE: StatusSpec = StatusSpec {
        name: "device",
        doc: "its state: opening, running, reconnecting, failed, closed",
    };
    /// Times the device was reopened after a loss.
    pub const RECONNECTS: StatusSpec = StatusSpec {
        name: "reconnects",
        doc: "times the device was reopened after it was lost",
    };
    /// Why the last switch failed.
    pub const SWITCH_ERROR: StatusSpec = StatusSpec {
        name: "switch_error",
        doc: "why the last switch failed (null once one succeeds)",
    };
}

/// The set of known stage kinds.
#[derive(Clone)]
pub struct Registry {
    kinds: Vec<StageKind>,
}

impl Default for Registry {
    fn default() -> Self {
        Self::builtin()
    }
}

impl Registry {
    /// The built-in kinds.
    pub fn builtin() -> Self {
        Registry {
            kinds: vec![
                synth_source::KIND,
                wav_source::KIND,
                resample::KIND,
                framer::KIND,
                wav_sink::KIND,
                null_sink::KIND,
                codes_source::KIND,
                mimi_encode::KIND,
                temporal::KIND,
                depformer::KIND,
                mimi_decode::KIND,
                token_sink::KIND,
                mic::KIND,
                playback::KIND,
                aec::KIND,
                inject_delay::KIND,
                codes_sink::KIND,
                opus::DECODE,
                opus::ENCODE,
                session::INPUT,
                session::AUDIO_OUT,
                session::TEXT_OUT,
                session::PCM_INPUT,
                session::PCM_OUT,
            ],
        }
    }

    /// Adds (or replaces) a kind.
    pub fn register(&mut self, kind: StageKind) {
        self.kinds.retain(|k| k.name != kind.name);
        self.kinds.push(kind);
    }

    /// The kind called `name`.
    pub fn get(&self, name: &str) -> Option<&StageKind> {
        self.kinds.iter().find(|k| k.name == name)
    }

    /// All kinds, in registration order.
    pub fn kinds(&self) -> &[StageKind] {
        &self.kinds
    }

    /// Text for `duplex stages`: every kind with its ports and params.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for k in &self.kinds {
            let _ = writeln!(s, "{}\n    {}", k.name, k.doc);
            let _ = writeln!(s, "    in:  {}", PortSpec::list(&(k.inputs)()));
            let _ = writeln!(s, "    out: {}", PortSpec::list(&(k.outputs)()));
            if !k.commands.is_empty() {
                let _ = writeln!(s, "    commands:");
                for c in k.commands {
                    let _ = writeln!(s, "      {:<28} {}", c.usage(), c.doc);
                }
            }
            if !k.status.is_empty() {
                let _ = writeln!(s, "    status:");
                for st in k.status {
                    let _ = writeln!(s, "      {:<28} {}", st.name, st.doc);
                }
            }
            if !k.params.is_empty() {
                let _ = writeln!(s, "    params:");
                for p in k.params {
                    let _ = writeln!(
                        s,
                        "      {:<12} {:<28} default {:<10} {}",
                        p.name,
                        p.ty.to_string(),
                        p.default.to_string(),
                        p.doc
                    );
                }
            }
            s.push('\n');
        }
        s
    }
}

impl Registry {
    /// Markdown for `duplex stages --markdown` (docs/stages.md): the same reference as
    /// [`describe`](Self::describe), a section per kind with a table of its params.
    pub fn describe_markdown(&self) -> String {
        let cell = |t: &str| t.replace('|', "\\|").replace('\n', " ");
        let mut s = String::from(
            "<!-- Generated by `duplex stages --markdown > docs/stages.md`: edit the stages' \
             descriptions in src/stages/, not this file (tests/it/compute/docs.rs fails when it is stale). \
             -->\n\n# Stage kinds\n\nEvery kind a pipeline file's `stages:` may name, with its \
             ports, the commands and status it answers on the control socket, and its params \
             (`duplex stages` prints the same as text). How stages are joined: \
             [the guide](guide.md).\n\n",
        );
        for k in &self.kinds {
            let _ = writeln!(s, "- [`{0}`](#{0}): {1}", k.name, cell(k.doc));
        }
        for k in &self.kinds {
            let _ = writeln!(s, "\n## {}\n\n{}\n", k.name, k.doc);
            let ports = |p: &[PortSpec]| match PortSpec::list(p).as_str() {
                "-" | "" => "none".to_string(),
                l => format!("`{l}`"),
            };
            let _ = writeln!(s, "- in: {}", ports(&(k.inputs)()));
            let _ = writeln!(s, "- out: {}", ports(&(k.outputs)()));
            if !k.commands.is_empty() {
                let _ = writeln!(s, "\n| command | what it does |\n|---|---|");
                for c in k.commands {
                    let _ = writeln!(s, "| `{}` | {} |", cell(&c.usage()), cell(c.doc));
                }
            }
            if !k.status.is_empty() {
                let _ = writeln!(s, "\n| status | what it says |\n|---|---|");
                for st in k.status {
                    let _ = writeln!(s, "| `{}` | {} |", st.name, cell(st.doc));
                }
            }
            if !k.params.is_empty() {
                let _ = writeln!(
                    s,
                    "\n| param | type | default | what it is |\n|---|---|---|---|"
                );
                for p in k.params {
                    let _ = writeln!(
                        s,
                        "| `{}` | {} | `{}` | {} |",
                        p.name,
                        cell(&p.ty.to_string()),
                        cell(&p.default.to_string()),
                        cell(p.doc)
                    );
                }
            }
        }
        s
    }
}

impl KindCatalog for Registry {
    fn params(&self, kind: &str) -> Option<&[ParamSpec]> {
        self.get(kind).map(|k| k.params)
    }

    fn kind_names(&self) -> Vec<&str> {
        self.kinds.iter().map(|k| k.name).collect()
    }
}

/// The `realtime` and `chunk_ms` params shared by sources.
pub(crate) mod pacing {
    use std::time::{Duration, Instant};

    use crate::runtime::Context;

    /// Paces a source at real time: chunk `k` is due when its newest sample would have been
    /// captured, `start + (k + 1) · chunk duration`.
    pub struct Pacer {
        realtime: bool,
        start: Option<Instant>,
        samples: u64,
        rate: u32,
    }

    impl Pacer {
        pub fn new(realtime: bool, rate: u32) -> Self {
            Pacer {
                realtime,
                start: None,
                samples: 0,
                rate,
            }
        }

        /// Waits (if real-time) until `n` more samples are due and returns their capture instant,
        /// or `None` when the pipeline is stopping.
        pub fn next(&mut self, n: usize, cx: &mut Context<'_>) -> Option<Instant> {
            let start = *self.start.get_or_insert_with(Instant::now);
            self.samples += n as u64;
            if !self.realtime {
                return Some(Instant::now());
            }
            let due = start + Duration::from_secs_f64(self.samples as f64 / self.rate as f64);
            cx.sleep_until(due).then_some(due)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_model_kind_declares_exactly_what_its_typed_params_read() {
        use crate::config::ParamSpec;
        use model_params::{CodecParams, EngineParams, ModelParams};
        let read = |structs: &[&[ParamSpec]]| {
            let mut v: Vec<&str> = structs
                .iter()
                .flat_map(|s| s.iter().map(|p| p.name))
                .collect();
            v.sort_unstable();
            v
        };
        let declared = |k: &StageKind| {
            let mut v: Vec<&str> = k.params.iter().map(|p| p.name).collect();
            v.sort_unstable();
            v
        };
        let lm = [EngineParams::SPECS, ModelParams::SPECS];
        assert_eq!(
            declared(&temporal::KIND),
            read(&[&[temporal::TemporalParams::SPECS], &lm[..]].concat())
        );
        assert_eq!(
            declared(&depformer::KIND),
            read(&[&[depformer::DepformerParams::SPECS], &lm[..]].concat())
        );
        for k in [&mimi_encode::KIND, &mimi_decode::KIND] {
            assert_eq!(declared(k), read(&[CodecParams::SPECS, ModelParams::SPECS]));
        }
    }

    #[test]
    fn a_build_error_keeps_the_error_it_came_from() {
        let e = BuildError::from(crate::model::ModelError::contract(
            "temporal",
            "no `hidden`",
        ));
        assert_eq!(e.kind, BuildErrorKind::Invalid);
        assert_eq!(e.key, Some("pack"));
        let cause = e.cause().expect("a cause");
        assert!(cause.downcast_ref::<crate::model::ModelError>().is_some());
        assert_eq!(cause.to_string(), e.message);
        // Said once: the cause is not also the source of a chain.
        assert!(std::error::Error::source(&e).is_none());
        assert!(BuildError::invalid("x").cause().is_none());
        assert_eq!(e.clone(), e);
    }
}
