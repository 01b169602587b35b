//! The `duplex` command line. Thin: parsing, logging set-up, exit codes; the work is in
//! [`duplex::app`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use duplex::app;
use duplex::config::{LoadOptions, Override};
use duplex::stages::Registry;

#[derive(Parser)]
#[command(
    name = "duplex",
    version,
    about = "Real-time full-duplex speech-to-speech pipelines"
)]
struct Cli {
    /// Log filter (tracing-subscriber syntax), e.g. `debug` or `duplex=trace`; also RUST_LOG.
    #[arg(long, global = true)]
    log: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a pipeline file and print per-stage timing.
    Run {
        /// The pipeline file (YAML).
        file: PathBuf,
        /// Override a setting, e.g. `--set stages.src.path=in.wav` (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// Check a pipeline file and print the resolved graph.
    Validate {
        /// The pipeline file (YAML).
        file: PathBuf,
        /// Override a setting (repeatable).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// List the stage kinds with their ports and params.
    Stages {
        /// As Markdown (the reference in docs/stages.md).
        #[arg(long)]
        markdown: bool,
    },
    /// Run the LM on a pack: user codes (JSON) in, agent tokens (JSON Lines) out; or re-run a
    /// recording's LM headless (`--recording DIR --out NEW_DIR`) and compare it with the live run.
    Replay(Box<app::ReplayArgs>),
    /// Measure a pack's full-duplex behaviour on a benchmark's inputs (Full-Duplex-Bench's
    /// layout): `run` them through packs offline, `score` the outputs, `stereo` the user and
    /// the agent together.
    #[command(subcommand)]
    Eval(app::eval::EvalCmd),
    /// Compare a recording with its replay: per-stage quantiles by context, trend, bimodality,
    /// a verdict (environment or code), and whether the token streams are the same.
    Compare {
        /// The live recording.
        recording: PathBuf,
        /// The headless replay's recording (`duplex replay --recording … --out …`).
        replay: PathBuf,
    },
    /// List sound devices (inputs and outputs) with their default configuration.
    Devices {
        /// Also list every configuration each device supports.
        #[arg(long, short)]
        verbose: bool,
    },
    /// Run the live assistant (mic -> model -> speaker) until stopped.
    Daemon {
        /// Configuration file (default: $XDG_CONFIG_HOME/duplex/daemon.yaml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Check the configuration, its pipeline, the pack and the devices, then exit.
        #[arg(long)]
        check: bool,
    },
    /// Serve conversations over the network (WebSocket: the Moshi protocol, the OpenAI realtime
    /// API, Twilio's media streams): one session pipeline per client, built from a session
    /// template.
    Serve(app::serve::ServeArgs),
    /// Measure how many real-time conversations a running server keeps up with: N clients
    /// streaming audio at once, levels raised until one falls behind.
    Loadtest(app::loadtest::LoadtestArgs),
    /// Prime a session of the server's template with its default voice and persona and write
    /// the primed state to a file, for `duplex serve`'s `prime_cache_file` (a server that
    /// loads it starts warm).
    Prime(app::serve::PrimeArgs),
    /// Send a command to the running daemon: status, reset, persona TEXT, mute, unmute, pause,
    /// resume, record on|off.
    Ctl {
        /// Control socket (default: $XDG_RUNTIME_DIR/duplex/control.sock, or the config's).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The command and its argument.
        #[arg(required = true, num_args = 1..)]
        command: Vec<String>,
    },
    /// Check the environment: ONNX Runtime library and version, the execution providers it
    /// offers, and whether CUDA initialises (and what is missing when it does not).
    Doctor {
        /// Path of libonnxruntime to use (over DUPLEX__ORT__LIBRARY, ORT_DYLIB_PATH and the
        /// search).
        #[arg(long)]
        ort_lib: Option<PathBuf>,
        /// Also check a model pack: its files against the graph contract, a session per graph,
        /// one codec frame and one temporal step (exit 2 when it does not load).
        #[arg(long, value_name = "DIR")]
        pack: Option<PathBuf>,
        /// The provider the pack check runs on: `cpu` or `cuda`.
        #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
        provider: String,
        /// With `--pack`: also time the temporal step at contexts 50, 1000, 2500 and 3000, with
        /// the cache resident, fed from the host, and at fixed shapes (a CUDA graph under CUDA);
        /// the depformer's frame; the codec's step graphs batched; the shared LM engine's frame
        /// for B conversations; and the memory a conversation adds to that engine.
        #[arg(long, requires = "pack")]
        time: bool,
        /// (Used by `--time`: opens the shared LM engine with this many slots and prints what
        /// that added to the memory in use.)
        #[arg(long, requires = "pack", hide = true, value_name = "SLOTS")]
        memory_probe: Option<usize>,
    },
}

fn parse_sets(sets: &[String]) -> anyhow::Result<Vec<Override>> {
    sets.iter()
        .map(|s| match s.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok(Override::set(k.trim(), v)),
            _ => Err(anyhow::Error::new(duplex::config::ConfigError::new(
                "--set",
                duplex::config::ConfigErrorKind::Syntax,
                format!("{s:?} is not KEY=VALUE (e.g. --set stages.source.path=in.wav)"),
            ))),
        })
        .collect()
}

/// Writes to stdout. A closed or full stdout is an error of the command (exit 1, said on
/// stderr), never a panic.
fn out(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    o.write_all(text.as_bytes())
        .and_then(|()| o.flush())
        .map_err(|e| anyhow::anyhow!("writing to standard output: {e}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = cli
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        // `duplex eval` runs hundreds of short pipelines: their start and end lines would
        // bury its own progress.
        .unwrap_or_else(|| {
            if matches!(cli.cmd, Cmd::Eval(_)) {
                "warn"
            } else {
                "info"
            }
            .into()
        });
    app::logging::init(&filter);
    match dispatch(cli.cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            app::logging::final_error(&format!("{e:#}"));
            ExitCode::from(app::exit_code(&e) as u8)
        }
    }
}

fn dispatch(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Run { file, sets } => {
            let sets = parse_sets(&sets)?;
            let report = app::run_file(&file, &sets)?;
            out(&format!("{}\n", app::timing_table(&report)))
        }
        Cmd::Validate { file, sets } => {
            let opts = LoadOptions {
                sets: parse_sets(&sets)?,
                env: None,
            };
            out(&app::validate(&file, &opts, &Registry::builtin())?)
        }
        Cmd::Replay(args) => replay(&args),
        Cmd::Eval(app::eval::EvalCmd::Run(args)) => out(&app::eval::run(&args)?),
        Cmd::Eval(app::eval::EvalCmd::Stereo(args)) => out(&app::eval::stereo(&args)?),
        Cmd::Eval(app::eval::EvalCmd::Score(args)) => out(&app::eval::score(&args)?),
        Cmd::Eval(app::eval::EvalCmd::Compare(args)) => out(&app::eval::compare(&args)?),
        Cmd::Compare { recording, replay } => out(&app::compare(&recording, &replay)?.to_string()),
        Cmd::Daemon { config, check } => daemon(config.as_deref(), check),
        Cmd::Serve(args) => app::serve::run(&args),
        Cmd::Loadtest(args) => loadtest(&args),
        Cmd::Prime(args) => out(&app::serve::prime(&args)?),
        Cmd::Ctl { socket, command } => ctl(socket, &command),
        Cmd::Devices { verbose } => devices(verbose),
        Cmd::Stages { markdown } => out(&if markdown {
            Registry::builtin().describe_markdown()
        } else {
            Registry::builtin().describe()
        }),
        Cmd::Doctor {
            ort_lib,
            pack,
            provider,
            time,
            memory_probe,
        } => {
            let provider = match provider.as_str() {
                "cuda" => duplex::model::session::Provider::Cuda { device_id: 0 },
                _ => duplex::model::session::Provider::Cpu,
            };
            doctor(ort_lib.as_deref(), pack, provider, time, memory_probe)
        }
    }
}

fn replay(args: &app::ReplayArgs) -> anyhow::Result<()> {
    if args.recording.is_some() {
        let (report, comparison) = app::replay_recording(args)?;
        app::logging::report(&app::timing_table(&report));
        return out(&comparison.to_string());
    }
    let reports = app::replay(args)?;
    for (i, report) in reports.iter().enumerate() {
        if reports.len() > 1 {
            app::logging::report(&format!(
                "conversation {} ({})",
                i + 1,
                args.codes
                    .get(i)
                    .map(|c| c.display().to_string())
                    .unwrap_or_default()
            ));
        }
        app::logging::report(&app::timing_table(report));
    }
    Ok(())
}

fn daemon(config: Option<&std::path::Path>, check: bool) -> anyhow::Result<()> {
    if !check {
        return app::daemon::run(config);
    }
    let c = app::daemon::check(config)?;
    out(&format!(
        "{}: ok (pipeline {}, pack {}, input {}, output {}, control socket {})\n",
        c.file,
        c.pipeline.display(),
        c.pack,
        c.input_device,
        c.output_device,
        c.control_socket.display()
    ))
}

fn loadtest(args: &app::loadtest::LoadtestArgs) -> anyhow::Result<()> {
    let report = app::loadtest::run(args)?;
    if args.json {
        out(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        out(&report.to_string())?;
    }
    // For scripts: a server that kept up with no level tried fails the command, and one that
    // admitted no session at all says why.
    if let Some(why) = report.none_admitted() {
        anyhow::bail!("no session was admitted: {why}");
    }
    if report.keeps_up_with == 0 {
        anyhow::bail!("the server kept up with none of the levels tried");
    }
    Ok(())
}

fn ctl(socket: Option<PathBuf>, command: &[String]) -> anyhow::Result<()> {
    // Only the socket is looked up: `ctl` works from any directory.
    let socket = match socket {
        Some(s) => s,
        None => app::daemon::control_socket(None, None)?,
    };
    let reply = app::control::send(&socket, &command.join(" "))?;
    let parsed = serde_json::from_str::<serde_json::Value>(&reply).ok();
    match &parsed {
        // Indented for a person at a terminal; one line for scripts.
        Some(v) if std::io::IsTerminal::is_terminal(&std::io::stdout()) => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(v).unwrap_or(reply.clone())
        ))?,
        _ => out(&format!("{reply}\n"))?,
    }
    if !parsed.is_some_and(|v| v["ok"] == true) {
        anyhow::bail!("the daemon refused the command");
    }
    Ok(())
}

fn devices(verbose: bool) -> anyhow::Result<()> {
    let (list, noise) = duplex::audio::device::capture_stderr(duplex::audio::device::list);
    for line in noise.iter().filter(|l| !l.trim().is_empty()) {
        tracing::debug!(target: "duplex::sound_libraries", "{line}");
    }
    let mut text = String::new();
    for d in &list {
        text.push_str(&format!(
            "{:<6} {}{}{}\n",
            d.direction.name(),
            d.id,
            if d.description.is_empty() || d.description == d.id {
                String::new()
            } else {
                format!("  ({})", d.description)
            },
            if d.is_default { "  [default]" } else { "" }
        ));
        if let Some(c) = &d.default_config {
            text.push_str(&format!("         default: {c}\n"));
        }
        if verbose {
            for c in &d.configs {
                text.push_str(&format!("         supports: {c}\n"));
            }
        }
    }
    out(&text)?;
    // `alsa:null` always opens, and discards or invents everything: not a device.
    if !list
        .iter()
        .any(|d| d.default_config.is_some() && d.id != "alsa:null")
    {
        anyhow::bail!(
            "no usable sound device (none opens, but alsa:null, which plays nothing and records silence){}",
            duplex::audio::device::server_hint()
        );
    }
    Ok(())
}

fn doctor(
    ort_lib: Option<&std::path::Path>,
    pack: Option<PathBuf>,
    provider: duplex::model::session::Provider,
    time: bool,
    memory_probe: Option<usize>,
) -> anyhow::Result<()> {
    use app::doctor as d;
    if let (Some(slots), Some(dir)) = (memory_probe, &pack) {
        let (added, kv) = d::memory_probe(dir, provider, slots)
            .map_err(|e| anyhow::anyhow!("the memory probe: {e}"))?;
        return out(&format!("memory-probe: {added} {kv}\n"));
    }
    let text = d::runtime(ort_lib)?;
    out(&text)?;
    let Some(dir) = pack else {
        return Ok(());
    };
    let (pack, report) = d::pack(&dir, provider).map_err(|e| {
        duplex::config::ConfigError::new(
            &dir.display().to_string(),
            duplex::config::ConfigErrorKind::Build,
            format!("the pack does not load: {e}"),
        )
    })?;
    out(&report)?;
    if !time {
        return Ok(());
    }
    out(&d::step_times(&pack, provider, &d::TIMED_CONTEXTS)?)?;
    out(&d::depformer_frame_times(&pack, provider)?)?;
    out(&d::codec_batch_times(&pack, provider, &d::CODEC_BATCHES)?)?;
    let all = &d::ENGINE_BATCHES;
    out(&d::engine_ticks(&pack, provider, all, false)?)?;
    let drawn = match provider {
        duplex::model::session::Provider::Cpu => &d::ENGINE_BATCHES_CPU_DRAWN[..],
        _ => all,
    };
    out(&d::engine_ticks(&pack, provider, drawn, true)?)?;
    out(&d::engine_memory(&dir, provider, d::MEMORY_SLOTS))
}
