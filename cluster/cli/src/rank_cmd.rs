//! `lockstep rank`: one process of an MPI run (what `run --driver mpi` starts under
//! mpirun, or a person by hand); world rank 0 is the front process.

use std::process::ExitCode;

#[cfg(feature = "mpi")]
use anyhow::Context;

#[cfg(feature = "mpi")]
use lockstep_runtime::RealOptions;

use crate::args::{RealArgs, ScenarioArgs};
#[cfg(feature = "mpi")]
use crate::args::{load, scenario_digest};
#[cfg(feature = "mpi")]
use crate::output::{exit_code, write_json};

/// `lockstep rank`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct RankArgs {
    #[command(flatten)]
    pub(crate) args: ScenarioArgs,
    #[command(flatten)]
    pub(crate) real: RealArgs,
    /// No iteration progress for this long aborts the whole job.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    watchdog_ms: u64,
    /// Fault injection (tests): RANK:ITERATION tags that rank's gather wrongly.
    #[arg(long, value_name = "RANK:ITERATION")]
    inject_tag_mismatch: Option<String>,
}

/// Runs `lockstep rank`.
pub(crate) fn run(
    RankArgs {
        args,
        real,
        watchdog_ms,
        inject_tag_mismatch,
    }: RankArgs,
) -> anyhow::Result<ExitCode> {
    rank_command(&args, &real, watchdog_ms, inject_tag_mismatch.as_deref())
}

#[cfg(feature = "mpi")]
fn rank_command(
    args: &ScenarioArgs,
    real: &RealArgs,
    watchdog_ms: u64,
    inject: Option<&str>,
) -> anyhow::Result<ExitCode> {
    use lockstep_runtime::mpi::{MpiOptions, run_process};
    let scenario = load(args, real.policy.as_deref(), real.seed)?;
    crate::mpirun::check_at_startup(&scenario, real)?;
    let digest = scenario_digest(args)?;
    let mismatch = match inject {
        None => None,
        Some(s) => {
            let (r, it) = s
                .split_once(':')
                .context("--inject-tag-mismatch takes RANK:ITERATION")?;
            Some((r.parse()?, it.parse()?))
        }
    };
    let opts = MpiOptions {
        common: RealOptions {
            mismatch_tag_at: mismatch,
            ..real.options_logging(true)?
        },
        watchdog: std::time::Duration::from_millis(watchdog_ms),
    };
    let outcome = run_process(&scenario, digest, &opts);
    match outcome {
        Ok(Some(front)) => {
            let mut report = front.report;
            if let Some(slo) = &real.slo {
                report.apply_slo(slo);
            }
            crate::output::print_report(&report, &scenario);
            if let Some(p) = &real.json {
                write_json(p, &report)?;
            }
            if front.abandoned {
                // Lost ranks: finalising would wait for them. Exit now, non-zero;
                // mpirun ends the rest of the job.
                crate::output::print_error(
                    report
                        .outcome_detail
                        .as_deref()
                        .unwrap_or("lost part of the fleet"),
                );
                use std::io::Write as _;
                let _ = std::io::stdout().flush();
                std::process::exit(1);
            }
            Ok(exit_code(&report))
        }
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            crate::output::print_error(&e.to_string());
            // A failing rank must not leave its peers waiting in a collective.
            std::process::exit(2);
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn rank_command(
    _args: &ScenarioArgs,
    _real: &RealArgs,
    _watchdog_ms: u64,
    _inject: Option<&str>,
) -> anyhow::Result<ExitCode> {
    anyhow::bail!(
        "this lockstep was built without MPI: rebuild with `cargo build --release -p lockstep --features mpi`"
    )
}
