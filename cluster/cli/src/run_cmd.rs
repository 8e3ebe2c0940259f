//! `lockstep run`: the scenario's servers for real, one thread per rank (`--driver
//! mpi` re-launches this binary under mpirun, see `mpirun.rs` and `rank_cmd.rs`).

use std::process::ExitCode;

use crate::args::{Driver, MpirunArgs, RealArgs, ScenarioArgs, load};
use crate::mpirun::relaunch_under_mpirun;
use crate::output::{exit_code, print_report, write_json};

/// `lockstep run`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub(crate) args: ScenarioArgs,
    /// Which driver (`mpi` re-launches this binary under `mpirun`, one process per
    /// rank; it needs a build with `--features mpi`).
    #[arg(long, value_enum, default_value_t = Driver::Threads)]
    driver: Driver,
    #[command(flatten)]
    pub(crate) real: RealArgs,
    #[command(flatten)]
    mpirun: MpirunArgs,
}

/// Runs `lockstep run`.
pub(crate) fn run(
    RunArgs {
        args,
        driver,
        real,
        mpirun,
    }: RunArgs,
) -> anyhow::Result<ExitCode> {
    if real.ordered && real.time_scale > 0.0 {
        return Err(crate::output::UsageError(format!(
            "--ordered runs in modeled time without sleeping: --time-scale {} has nothing to pace",
            real.time_scale
        ))
        .into());
    }
    if driver == Driver::Mpi {
        return relaunch_under_mpirun(&args, &real, &mpirun);
    }
    let scenario = load(&args, real.policy.as_deref(), real.seed)?;
    let mut report = lockstep_runtime::threads::run(&scenario, &real.options()?)?;
    if let Some(slo) = &real.slo {
        report.apply_slo(slo);
    }
    print_report(&report, &scenario);
    if let Some(p) = &real.json {
        write_json(p, &report)?;
    }
    Ok(exit_code(&report))
}
