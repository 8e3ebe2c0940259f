//! The `lockstep` command line.

#![forbid(unsafe_code)]

use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use lockstep_cluster::report::{Report, ab_table};
use lockstep_cluster::scenario::Scenario;
use lockstep_cluster::sim::{self, SimOptions};
use lockstep_cluster::validate;

#[derive(Debug, Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Attention-data-parallel LLM serving control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct ScenarioArgs {
    /// Scenario file (TOML).
    scenario: PathBuf,
    /// Override a key: `policy.pad.rollback=false`, `server.max_batch_size=4`,
    /// `server.gen0.max_batch_size=128`, `workload.concurrency=64`, `model.profile="..."`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the derived sizes of every server of a scenario, or the validator's error.
    Validate {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Policy preset (applied before --set).
        #[arg(long, value_parser = ["fixed", "legacy"])]
        policy: Option<String>,
    },
    /// Replay the scenario's fleet in virtual time and report.
    Sim {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Policy preset (applied before --set).
        #[arg(long, value_parser = ["fixed", "legacy"])]
        policy: Option<String>,
        /// Seed of the run (a `seed` in the scenario wins).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write the report as JSON.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Write one JSON line per server iteration and rank.
        #[arg(long, value_name = "PATH")]
        iter_log: Option<PathBuf>,
    },
    /// Run the scenario's server for real: one thread per rank (`threads`) or one process
    /// per rank under mpirun (`mpi`, see `lockstep rank`).
    Run {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Which driver.
        #[arg(long, value_parser = ["threads"], default_value = "threads")]
        driver: String,
        /// Policy preset (applied before --set).
        #[arg(long, value_parser = ["fixed", "legacy"])]
        policy: Option<String>,
        /// Seed of the workload.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Wall seconds per modeled second; 0 runs the zero-cost backend.
        #[arg(long, default_value_t = 0.0)]
        time_scale: f64,
        /// Deliver every request before the ranks start (arrivals at iteration
        /// boundaries, for cross-driver comparisons).
        #[arg(long)]
        preload: bool,
        /// A collective waiting longer fails naming the missing ranks.
        #[arg(long, default_value_t = 30_000)]
        timeout_ms: u64,
        /// Write the report as JSON.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
    },
    /// Per-iteration control-plane overhead with the zero-cost backend, next to a raw
    /// loop of the same collectives (the floor).
    Overhead {
        /// Which driver.
        #[arg(long, value_parser = ["threads"], default_value = "threads")]
        driver: String,
        /// DP ranks.
        #[arg(long, default_value_t = 2)]
        dp: u32,
        /// Active requests per rank.
        #[arg(long, default_value_t = 256)]
        active: u32,
        /// Measured iterations.
        #[arg(long, default_value_t = 2000)]
        iterations: u64,
    },
    /// Run the scenario under two policies and print them side by side with deltas.
    Ab {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Baseline preset.
        #[arg(long, default_value = "legacy", value_parser = ["fixed", "legacy"])]
        base: String,
        /// Treatment preset.
        #[arg(long, default_value = "fixed", value_parser = ["fixed", "legacy"])]
        treatment: String,
        /// Seed of both runs.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Write both reports as JSON: {"base": ..., "treatment": ...}.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(args: &ScenarioArgs, preset: Option<&str>) -> anyhow::Result<Scenario> {
    let mut scenario = Scenario::load(&args.scenario)?;
    if let Some(p) = preset {
        scenario.apply_set(&format!("policy.preset=\"{p}\""))?;
    }
    for s in &args.set {
        scenario.apply_set(s)?;
    }
    Ok(scenario)
}

fn simulate(scenario: &Scenario, seed: u64, iter_log: Option<&Path>) -> anyhow::Result<Report> {
    let mut log_file = match iter_log {
        Some(p) => Some(BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {elapsed_precise} [{bar:40}] {pos}/{len} requests",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let mut progress = |done: u64, total: Option<u64>| {
        if let Some(b) = &bar {
            if let Some(t) = total {
                b.set_length(t);
            }
            b.set_position(done);
        }
    };
    let report = sim::run(
        scenario,
        SimOptions {
            seed,
            iter_log: log_file.as_mut().map(|f| f as &mut dyn Write),
            progress: Some(&mut progress),
        },
    )?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(mut f) = log_file {
        f.flush()?;
    }
    Ok(report)
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Validate { args, policy } => {
            let scenario = load(&args, policy.as_deref())?;
            let (table, warnings) = validate::render(&scenario)?;
            print!("{table}");
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Sim {
            args,
            policy,
            seed,
            json,
            iter_log,
        } => {
            let scenario = load(&args, policy.as_deref())?;
            let report = simulate(&scenario, seed, iter_log.as_deref())?;
            print!("{}", report.table());
            if let Some(p) = json {
                write_json(&p, &report)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
            args,
            driver,
            policy,
            seed,
            time_scale,
            preload,
            timeout_ms,
            json,
        } => {
            let scenario = load(&args, policy.as_deref())?;
            anyhow::ensure!(driver == "threads", "unknown driver {driver}");
            let report = lockstep_cluster::drivers::threads::run(
                &scenario,
                &lockstep_cluster::drivers::threads::ThreadsOptions {
                    seed,
                    time_scale,
                    collective_timeout: std::time::Duration::from_millis(timeout_ms),
                    preload,
                    ..Default::default()
                },
            )?;
            print!("{}", report.table());
            if let Some(p) = json {
                write_json(&p, &report)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Overhead {
            driver,
            dp,
            active,
            iterations,
        } => {
            anyhow::ensure!(driver == "threads", "unknown driver {driver}");
            let o = lockstep_cluster::drivers::overhead::threads(dp, active, iterations, 200)?;
            println!("driver={driver} dp={dp} active_per_rank={active} iterations={iterations}");
            println!(
                "overhead_us={:.2} floor_us={:.2} ratio={:.2}",
                o.overhead_us,
                o.floor_us,
                o.ratio()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Ab {
            args,
            base,
            treatment,
            seed,
            json,
        } => {
            let a = simulate(&load(&args, Some(&base))?, seed, None)?;
            let b = simulate(&load(&args, Some(&treatment))?, seed, None)?;
            print!("{}", ab_table(&a, &b, &base, &treatment));
            if let Some(p) = json {
                write_json(&p, &serde_json::json!({ "base": a, "treatment": b }))?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
