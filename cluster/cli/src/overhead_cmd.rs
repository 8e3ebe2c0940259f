//! `lockstep overhead`: the control plane's cost per iteration with the zero-cost
//! backend, next to a raw loop of the same collectives.

use std::process::ExitCode;

use anyhow::Context;

use crate::args::{MpirunArgs, ProcessDriver};
use crate::mpirun::{args_for_each_process, mpirun_command, require_mpi_build};
use crate::stdout::outln;

/// `lockstep overhead`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct OverheadArgs {
    /// Which driver (`mpi` re-launches this binary under mpirun).
    #[arg(long, value_enum, default_value_t = ProcessDriver::Threads)]
    driver: ProcessDriver,
    /// DP ranks.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    dp: u32,
    /// Active requests per rank.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    active: u32,
    /// Measured iterations.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    iterations: u64,
}

/// Runs `lockstep overhead`.
pub(crate) fn run(
    OverheadArgs {
        driver,
        dp,
        active,
        iterations,
    }: OverheadArgs,
) -> anyhow::Result<ExitCode> {
    let o = match driver {
        ProcessDriver::Threads => lockstep_runtime::overhead::threads(
            dp,
            active,
            iterations,
            lockstep_runtime::overhead::WARMUP,
        )?,
        ProcessDriver::Mpi => {
            require_mpi_build()?;
            let mut cmd = mpirun_command(dp, &MpirunArgs::default())?;
            cmd.arg("overhead")
                .args(args_for_each_process(
                    "overhead",
                    &std::env::args().collect::<Vec<_>>(),
                ))
                .arg("--driver=mpi-rank");
            let status = cmd
                .status()
                .context("starting mpirun (is OpenMPI installed?)")?;
            return Ok(if status.success() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        ProcessDriver::MpiRank => match mpi_overhead(dp, active, iterations)? {
            Some(o) => o,
            None => return Ok(ExitCode::SUCCESS),
        },
    };
    let driver = match driver {
        ProcessDriver::Threads => "threads",
        ProcessDriver::Mpi | ProcessDriver::MpiRank => "mpi",
    };
    outln!(
        "driver={driver} dp={dp} active_per_rank={active} iterations={iterations} collectives_per_iteration={}",
        o.collectives
    );
    outln!(
        "means: overhead_mean_us={:.2} floor_mean_us={:.2} ratio_of_means={:.2}",
        o.overhead_mean_us,
        o.floor_mean_us,
        o.overhead_mean_us / o.floor_mean_us
    );
    outln!(
        "overhead_us={:.2} floor_us={:.2} ratio={:.2}",
        o.overhead_us,
        o.floor_us,
        o.ratio()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "mpi")]
fn mpi_overhead(
    dp: u32,
    active: u32,
    iterations: u64,
) -> anyhow::Result<Option<lockstep_runtime::overhead::Overhead>> {
    Ok(lockstep_runtime::overhead::mpi_rank(
        dp,
        active,
        iterations,
        lockstep_runtime::overhead::WARMUP,
    )?)
}

#[cfg(not(feature = "mpi"))]
fn mpi_overhead(
    _dp: u32,
    _active: u32,
    _iterations: u64,
) -> anyhow::Result<Option<lockstep_runtime::overhead::Overhead>> {
    anyhow::bail!(
        "this lockstep was built without MPI: rebuild with `cargo build --release -p lockstep --features mpi`"
    )
}
