//! The `lockstep` command line: the subcommands (each in its own `*_cmd.rs`, its
//! options with it) and the dispatch to them.

#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod ab_cmd;
mod args;
mod bench_cmd;
mod calibrate;
mod inspect_cmd;
mod model_cmd;
mod mpirun;
mod output;
mod overhead_cmd;
mod rank_cmd;
mod report_cmd;
mod run_cmd;
mod search_cmd;
mod serve_cmd;
mod sim_cmd;
mod simbench_cmd;
mod stdout;
mod swarm_cmd;
mod trtllm_cmd;
mod vllm_flags;

#[derive(Debug, Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Attention-data-parallel LLM serving control plane",
    after_help = "Exit status: 0 success (every request completed); 1 the run failed (a collective error, a lost rank, a server that could not be reached); 2 the fleet crashed or deadlocked (the report says how); 3 the run ended but some requests did not complete; 64 a usage error (an unknown option, a bad or missing argument); 78 a configuration refused before anything started (a bad scenario or TOML, a --set that does not apply, a workload the fleet or --model cannot serve). Errors are one line on stderr starting `error: `; log lines go to stderr, warnings of the unexpected only unless RUST_LOG asks for more (e.g. RUST_LOG=info). A reader of stdout that goes away (`| head`) drops the rest of the output, not the command: the status is still the command's own."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the derived sizes of every server of a scenario, or the validator's error.
    Validate(inspect_cmd::ValidateArgs),
    /// Replay the scenario's fleet in virtual time and report.
    Sim(sim_cmd::SimArgs),
    /// Run the scenario's servers for real: one thread per rank (`threads`) or one
    /// process per rank plus a front process under mpirun (`mpi`, see `lockstep rank`);
    /// aggregated or disaggregated alike, with real KV transfers between ctx and gen
    /// servers.
    Run(run_cmd::RunArgs),
    /// One process of an MPI run: `mpirun -n N lockstep rank SCENARIO.toml ...` with N =
    /// 1 + the ranks of every server (built with `--features mpi`). World rank 0 is the
    /// front process: it plays the workload and writes the report.
    Rank(rank_cmd::RankArgs),
    /// Per-iteration control-plane overhead with the zero-cost backend, next to a raw
    /// loop of the same collectives (the floor).
    Overhead(overhead_cmd::OverheadArgs),
    /// List the model profiles `[model] profile` can name: their KV geometry, their
    /// coefficients and the assumptions behind them.
    Profiles,
    /// A real model on the CPU: write a random one, generate text through the paged KV
    /// cache, benchmark the paged forward against the dense reference.
    Model {
        #[command(subcommand)]
        command: model_cmd::ModelCommand,
    },
    /// Run the scenario under two policies and print them side by side with deltas.
    Ab(ab_cmd::AbArgs),
    /// Write one self-contained HTML page of plots (latency CDFs, routing share and
    /// occupancy per rank, KV usage and waiting queue over time) from a run's JSON
    /// (`sim`/`run --json`), or of both runs of `ab --json`, overlaid.
    Report(report_cmd::ReportArgs),
    /// Serve the scenario's fleet over HTTP with an OpenAI-compatible API
    /// (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`;
    /// `/tokenize` and `/detokenize` with `--model`) until SIGTERM or Ctrl-C, which stop accepting and answer the requests in flight.
    /// The scenario's workload is not played: the requests are the HTTP clients'.
    Serve(serve_cmd::ServeArgs),
    /// Play the scenario's workload against any OpenAI-compatible server over plain
    /// HTTP (`lockstep serve`, vLLM, SGLang, TensorRT-LLM) and report what vLLM's
    /// benchmark_serving reports, in the report of `sim`/`run` (`--json` for `lockstep
    /// report`). Exit status: 0 every request completed, 1 some failed (the reasons are
    /// printed) or the server could not be reached.
    Bench(bench_cmd::BenchArgs),
    /// The roofline of a Hugging Face config.json on a GPU: parameters, KV per token and
    /// capacity, a typical prefill and decode step op by op, the fitted coefficients.
    Explain(lockstep_plan::explain::ExplainArgs),
    /// Write a scenario from another system's configuration.
    Import {
        #[command(subcommand)]
        command: trtllm_cmd::ImportCommand,
    },
    /// Write a scenario as another system's configuration.
    Export {
        #[command(subcommand)]
        command: trtllm_cmd::ExportCommand,
    },
    /// Swarm testing: run N random valid scenarios under the fixed policy, classify each
    /// (clean, fault-only, violation, failed-without-fault, crashed, deadlocked, panic,
    /// timeout, refused, ...), shrink every bad one and write it to --out. Exits 1 if any
    /// run is neither clean nor failed only by injected faults.
    Swarm(swarm_cmd::SwarmArgs),
    /// The simulator's own speed and memory: CPU time, peak RSS, iterations per CPU
    /// second and bytes per request of `sim` on built-in workloads (issue 25), each run a
    /// child process; `--baseline PATH` runs a previous binary in turn with this one and
    /// prints the ratios.
    Simbench(simbench_cmd::SimbenchArgs),
    /// Which configuration to run: searches a space of parallelism, instance counts,
    /// batch sizes and scheduler settings for the most output tokens per second per GPU
    /// (or the fewest GPUs) under latency objectives at percentiles, simulating each
    /// candidate in full and bisecting for the highest load it serves.
    Search(search_cmd::SearchArgs),
}

/// `sysexits.h`'s EX_USAGE: the command line was wrong.
const EX_USAGE: u8 = 64;
/// `sysexits.h`'s EX_CONFIG: the scenario or a configuration was refused.
const EX_CONFIG: u8 = 78;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG)),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal who did not ask for none.
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            // Help and version go to stdout and succeed; anything else is a usage error.
            let code = match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => ExitCode::SUCCESS,
                _ => ExitCode::from(EX_USAGE),
            };
            let _ = e.print();
            return code;
        }
    };
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            output::print_error(&error_text(&e));
            error_exit_code(&e)
        }
    }
}

/// What the tracing subscriber prints without RUST_LOG: warnings, which are of the
/// unexpected (a message where none belongs, bookkeeping that disagrees); what a user
/// is expected to meet (a seat skew let through) is a `note: ` line instead.
const DEFAULT_LOG: &str = "warn";

/// The exit status of an error: [`EX_CONFIG`] for a configuration refused before
/// anything ran, [`EX_USAGE`] for a command line the parser could not catch, 1 for a run
/// that failed.
fn error_exit_code(e: &anyhow::Error) -> ExitCode {
    use lockstep_plan::fleet::PlanError;
    use lockstep_plan::model_backend::ModelBackendError;
    use lockstep_plan::scenario::ScenarioError;
    use lockstep_plan::workload::WorkloadError;
    use lockstep_runtime::RuntimeError;
    use lockstep_sim::SimError;
    for cause in e.chain() {
        if cause.is::<output::UsageError>() {
            return ExitCode::from(EX_USAGE);
        }
        let config = cause.is::<output::ConfigRefused>()
            || cause.is::<ScenarioError>()
            || cause.is::<PlanError>()
            || cause.is::<WorkloadError>()
            || cause.is::<ModelBackendError>()
            || cause.is::<lockstep_actors::config::ConfigError>()
            || cause.is::<lockstep_plan::report::SloError>()
            || matches!(
                cause.downcast_ref::<lockstep_search::SearchError>(),
                Some(e) if !matches!(e, lockstep_search::SearchError::Output { .. })
            )
            || matches!(
                cause.downcast_ref::<SimError>(),
                Some(
                    SimError::Plan(_)
                        | SimError::Config(_)
                        | SimError::NotPreloadable(_)
                        | SimError::Model(_)
                )
            )
            || matches!(
                cause.downcast_ref::<RuntimeError>(),
                Some(RuntimeError::Plan(_) | RuntimeError::Model(_))
            )
            || matches!(
                cause.downcast_ref::<lockstep_serve::ServeError>(),
                Some(
                    lockstep_serve::ServeError::Model(_)
                        | lockstep_serve::ServeError::Runtime(
                            RuntimeError::Plan(_) | RuntimeError::Model(_)
                        )
                        | lockstep_serve::ServeError::OpenWithoutKey { .. }
                        | lockstep_serve::ServeError::BadHost { .. }
                )
            );
        if config {
            return ExitCode::from(EX_CONFIG);
        }
    }
    ExitCode::FAILURE
}

/// An error and its causes, each said once: a cause whose text the message already
/// contains (many library errors quote their source) is not repeated.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string().trim_end().to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        let c = c.trim_end();
        if !text.contains(c) {
            text.push_str(": ");
            text.push_str(c);
        }
    }
    text
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Validate(args) => inspect_cmd::validate(args),
        Command::Sim(args) => sim_cmd::run(args),
        Command::Run(args) => run_cmd::run(args),
        Command::Rank(args) => rank_cmd::run(args),
        Command::Overhead(args) => overhead_cmd::run(args),
        Command::Profiles => inspect_cmd::profiles(),
        Command::Model { command } => model_cmd::run(command),
        Command::Ab(args) => ab_cmd::run(args),
        Command::Report(args) => report_cmd::run(args),
        Command::Serve(args) => serve_cmd::run(args),
        Command::Bench(args) => bench_cmd::run(args),
        Command::Explain(args) => inspect_cmd::explain(args),
        Command::Import { command } => trtllm_cmd::run_import(command)
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
        Command::Export { command } => trtllm_cmd::run_export(command)
            .map(|()| ExitCode::SUCCESS)
            .map_err(Into::into),
        Command::Swarm(args) => swarm_cmd::run(args),
        Command::Simbench(args) => simbench_cmd::run(args),
        Command::Search(args) => search_cmd::run(args),
    }
}
