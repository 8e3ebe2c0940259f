//! The `lockstep` command line.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use lockstep_cluster::scenario::Scenario;
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the derived sizes of every server of a scenario, or the validator's error.
    Validate {
        /// Scenario file (TOML).
        scenario: PathBuf,
        /// Override a key: `policy.pad.rollback=false`, `server.max_batch_size=4`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// Policy preset (applied before --set).
        #[arg(long, value_parser = ["fixed", "legacy"])]
        policy: Option<String>,
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
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn load(path: &std::path::Path, policy: Option<&str>, set: &[String]) -> anyhow::Result<Scenario> {
    let mut scenario = Scenario::load(path)?;
    if let Some(p) = policy {
        scenario.apply_set(&format!("policy.preset=\"{p}\""))?;
    }
    for s in set {
        scenario.apply_set(s)?;
    }
    Ok(scenario)
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Validate {
            scenario,
            set,
            policy,
        } => {
            let scenario = load(&scenario, policy.as_deref(), &set)?;
            let (table, warnings) = validate::render(&scenario)?;
            print!("{table}");
            for w in warnings {
                eprintln!("warning: {w}");
            }
            Ok(())
        }
    }
}
