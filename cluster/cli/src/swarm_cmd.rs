//! `lockstep swarm`: random valid scenarios run, classified, and the bad ones shrunk.

use crate::stdout::{out, outln};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// `lockstep swarm`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct SwarmArgs {
    /// Scenarios to generate and run.
    #[arg(long, default_value_t = 100)]
    runs: u64,
    /// Scenario i (from 0) uses seed S+i.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where the shrunk scenarios go.
    #[arg(long, default_value = "target/swarm")]
    out: PathBuf,
    /// Also run every K-th scenario under the threads driver (0: never).
    #[arg(long, default_value_t = 0)]
    threads_every: u64,
    /// Scenarios run at once (default: the machine's cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Wall-clock limit of one simulator run, in seconds.
    #[arg(long, default_value_t = 10)]
    time_limit_s: u64,
    /// Runs one shrink may spend (0: no shrinking).
    #[arg(long, default_value_t = 400)]
    shrink_budget: usize,
    /// Also shrink and write the runs that failed only by injected faults.
    #[arg(long)]
    shrink_fault_only: bool,
}

/// Runs `lockstep swarm`.
pub(crate) fn run(
    SwarmArgs {
        runs,
        seed,
        out,
        threads_every,
        jobs,
        time_limit_s,
        shrink_budget,
        shrink_fault_only,
    }: SwarmArgs,
) -> anyhow::Result<ExitCode> {
    use lockstep_swarm as swarm;
    let defaults = swarm::SwarmConfig::default();
    let cfg = swarm::SwarmConfig {
        runs,
        seed,
        out: Some(out),
        threads_every,
        jobs: jobs.unwrap_or(defaults.jobs),
        limits: swarm::Limits {
            sim_wall: std::time::Duration::from_secs(time_limit_s),
            ..swarm::Limits::default()
        },
        shrink_budget,
        shrink_fault_only,
    };
    let tty = std::io::stderr().is_terminal();
    let progress = |done: u64, total: u64| {
        if tty && (done.is_multiple_of(100) || done == total) {
            eprint!("\r{done}/{total} scenarios");
        }
    };
    let summary = swarm::run_swarm(&cfg, Some(&progress))?;
    if tty {
        eprintln!();
    }
    out!("{}", summary.render());
    if summary.timeouts_rerun > 0 {
        outln!(
            "{} run(s) timed out among the others and were run again alone",
            summary.timeouts_rerun
        );
    }
    outln!(
        "swarm: {runs} scenarios from seed {seed} in {:.1} s: {}",
        summary.elapsed.as_secs_f64(),
        if summary.all_ok() {
            "every run clean or failed only by injected faults"
        } else {
            "some runs are neither clean nor fault-only (shrunk files above)"
        }
    );
    Ok(if summary.all_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
