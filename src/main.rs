//! The `duplex` command line. Thin: parsing, logging set-up, exit codes; the work is in
//! [`duplex::app`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use duplex::app;
use duplex::config::LoadOptions;
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
    Stages,
    /// Run the LM on a pack: user codes (JSON) in, agent tokens (JSON Lines) out.
    Replay(app::ReplayArgs),
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
    /// Send a command to the running daemon: status, reset, persona TEXT, mute, unmute, pause,
    /// resume.
    Ctl {
        /// Control socket (default: $XDG_RUNTIME_DIR/duplex/control.sock, or the config's).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// The command and its argument.
        #[arg(required = true, num_args = 1..)]
        command: Vec<String>,
    },
    /// Check the environment: ONNX Runtime library and version.
    Doctor {
        /// Path of libonnxruntime to use instead of discovering it.
        #[arg(long)]
        ort_lib: Option<PathBuf>,
    },
}

fn parse_sets(sets: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    sets.iter()
        .map(|s| match s.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
            _ => Err(anyhow::Error::new(duplex::config::ConfigError {
                file: "--set".into(),
                stage: None,
                key: None,
                kind: duplex::config::ConfigErrorKind::Syntax,
                message: format!("{s:?} is not KEY=VALUE"),
            })),
        })
        .collect()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = cli
        .log
        .clone()
        .or_else(|| std::env::var("RUST_LOG").ok())
        .unwrap_or_else(|| "info".into());
    app::logging::init(&filter);

    let result: anyhow::Result<()> = (|| match cli.cmd {
        Cmd::Run { file, sets } => {
            let sets = parse_sets(&sets)?;
            let report = app::run_file(&file, &sets)?;
            println!("{}", app::timing_table(&report));
            Ok(())
        }
        Cmd::Validate { file, sets } => {
            let opts = LoadOptions {
                sets: parse_sets(&sets)?,
                env: None,
            };
            print!("{}", app::validate(&file, &opts, &Registry::builtin())?);
            Ok(())
        }
        Cmd::Replay(args) => {
            let report = app::replay(&args)?;
            eprintln!("{}", app::timing_table(&report));
            Ok(())
        }
        Cmd::Daemon { config, check } => {
            if check {
                let c = app::daemon::check_all(config.as_deref())?;
                println!(
                    "{}: ok (pipeline {}, pack {}, input {}, output {}, control socket {})",
                    c.file,
                    c.pipeline.display(),
                    c.pack,
                    c.input_device,
                    c.output_device,
                    c.control_socket.display()
                );
                return Ok(());
            }
            app::daemon::run(config.as_deref())
        }
        Cmd::Ctl { socket, command } => {
            let socket = match socket {
                Some(s) => s,
                None => app::daemon::load_config(None, None)?.control_socket,
            };
            let reply = app::control::send(&socket, &command.join(" "))?;
            let parsed = serde_json::from_str::<serde_json::Value>(&reply).ok();
            match &parsed {
                // Indented for a person at a terminal; one line for scripts.
                Some(v) if std::io::IsTerminal::is_terminal(&std::io::stdout()) => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(v).unwrap_or(reply.clone())
                    )
                }
                _ => println!("{reply}"),
            }
            let ok = parsed.is_some_and(|v| v["ok"] == true);
            if !ok {
                anyhow::bail!("the daemon refused the command");
            }
            Ok(())
        }
        Cmd::Devices { verbose } => {
            let list = duplex::audio::device::list();
            if list.is_empty() {
                println!("no sound devices (is a sound server running?)");
            }
            for d in list {
                println!(
                    "{:<6} {}{}{}",
                    d.direction.name(),
                    d.id,
                    if d.description.is_empty() || d.description == d.id {
                        String::new()
                    } else {
                        format!("  ({})", d.description)
                    },
                    if d.is_default { "  [default]" } else { "" }
                );
                if let Some(c) = &d.default_config {
                    println!("         default: {c}");
                }
                if verbose {
                    for c in &d.configs {
                        println!("         supports: {c}");
                    }
                }
            }
            Ok(())
        }
        Cmd::Stages => {
            print!("{}", Registry::builtin().describe());
            Ok(())
        }
        Cmd::Doctor { ort_lib } => {
            let lib = duplex::model::ortlib::environment(ort_lib.as_deref())?;
            println!(
                "onnxruntime: {} (found via {})",
                lib.path.display(),
                lib.origin
            );
            if let Some(info) = duplex::model::ortlib::build_info() {
                println!("build: {info}");
            }
            Ok(())
        }
    })();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            app::logging::final_error(&format!("{e:#}"));
            ExitCode::from(app::exit_code(&e) as u8)
        }
    }
}
