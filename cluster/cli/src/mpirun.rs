//! The one mpirun launcher: every `--driver mpi` (`run`, `serve`, `overhead`) starts
//! `mpirun -n N THIS_BINARY SUBCOMMAND ...` through [`mpirun_command`], and hands each
//! process its own command line through [`args_for_each_process`].

use std::process::ExitCode;

use anyhow::Context;

use lockstep_plan::scenario::Scenario;

use crate::args::{MpirunArgs, RealArgs, ScenarioArgs, load};

/// `run --driver mpi` and `overhead --driver mpi` need a build with MPI; say so once,
/// before launching anything.
pub(crate) fn require_mpi_build() -> anyhow::Result<()> {
    if cfg!(feature = "mpi") {
        Ok(())
    } else {
        anyhow::bail!(
            "this lockstep was built without MPI: rebuild with `cargo build --release -p lockstep --features mpi` (needs OpenMPI and libclang)"
        )
    }
}

/// What an MPI job can be refused for, checked before any process starts (by the
/// launcher, and by every process of a job started by hand): under mpirun the ranks would
/// otherwise wait for a front process that refused. `--preload` with a workload that
/// cannot be delivered up front; `--model` with a workload whose requests can take more
/// positions than the model has (read from its config.json, without the weights).
pub(crate) fn check_at_startup(scenario: &Scenario, real: &RealArgs) -> anyhow::Result<()> {
    if !real.preload && real.model.model.is_none() {
        return Ok(());
    }
    let fleet = lockstep_plan::fleet::Fleet::plan(scenario, real.seed.unwrap_or(0))?;
    let workload = fleet.workload()?;
    if real.preload
        && let Some(why) = workload.preload_blocker()
    {
        return Err(crate::output::ConfigRefused(format!(
            "--preload delivers every request before the first iteration, but {why}"
        ))
        .into());
    }
    if let Some(dir) = &real.model.model {
        let config = lockstep_gpu::model::ModelConfig::load(dir).map_err(|source| {
            lockstep_plan::model_backend::ModelBackendError::Load {
                dir: dir.clone(),
                source,
            }
        })?;
        lockstep_plan::model_backend::check_positions(
            dir,
            config.max_position_embeddings,
            &workload,
        )?;
    }
    Ok(())
}

/// The processes of an MPI run of `scenario`: the front process and every server's ranks.
pub(crate) fn processes_of(scenario: &Scenario) -> anyhow::Result<u32> {
    let mut processes = 1;
    for server in &scenario.servers {
        processes += server.derive(&scenario.policy)?.sizes.dp;
    }
    Ok(processes)
}

/// `mpirun -n N [--hostfile H] [ARGS...] THIS_BINARY`, the subcommand still to add.
pub(crate) fn mpirun_command(
    processes: u32,
    mpirun: &MpirunArgs,
) -> anyhow::Result<std::process::Command> {
    let exe = std::env::current_exe()?;
    let mut cmd = std::process::Command::new("mpirun");
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "-n", &processes.to_string()]);
    if let Some(h) = &mpirun.hostfile {
        cmd.arg("--hostfile").arg(h);
    }
    cmd.args(&mpirun.mpirun_args).arg(exe);
    Ok(cmd)
}

/// Runs mpirun for `serve --driver mpi`: in its own process group, so that a terminal's
/// Ctrl-C reaches only this launcher, which turns SIGTERM / Ctrl-C into SIGUSR1 for
/// mpirun to forward — the front drains and ends the run — where mpirun, signalled
/// itself, would kill every process at once. A second signal stops the job hard.
pub(crate) fn run_draining_on_signal(
    mut cmd: std::process::Command,
) -> anyhow::Result<std::process::ExitStatus> {
    use std::os::unix::process::CommandExt as _;
    let mut child = cmd
        .process_group(0)
        .spawn()
        .context("starting mpirun (is OpenMPI installed?)")?;
    let pid = child.id().to_string();
    let signals = std::sync::atomic::AtomicU32::new(0);
    ctrlc::set_handler(move || {
        let n = signals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let signal = if n == 0 { "-USR1" } else { "-TERM" };
        let _ = std::process::Command::new("kill")
            .args([signal, pid.as_str()])
            .status();
    })
    .context("setting the signal handler")?;
    Ok(child.wait()?)
}

/// The front process's status is the run's; mpirun passes it on.
pub(crate) fn status_of(status: std::process::ExitStatus) -> ExitCode {
    match status.code() {
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    }
}

/// The options only a launcher reads (which driver, how mpirun starts); every other
/// option goes on to each process it starts.
const LAUNCHER_ONLY: [&str; 3] = ["--driver", "--hostfile", "--mpirun-arg"];

/// The one way a launcher hands its options to the processes it starts under mpirun:
/// its own command line `argv` after `subcommand`, as given, less [`LAUNCHER_ONLY`]
/// (with their values, in either `--key value` or `--key=value` form). Nothing is
/// rebuilt by hand, so an option added to a subcommand is never dropped on the way: the
/// process either takes it or refuses it by name.
pub(crate) fn args_for_each_process(subcommand: &str, argv: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = argv.iter().skip(1).skip_while(|a| *a != subcommand).skip(1);
    while let Some(a) = args.next() {
        if LAUNCHER_ONLY.contains(&a.as_str()) {
            args.next();
        } else if !LAUNCHER_ONLY
            .iter()
            .any(|flag| a.strip_prefix(flag).is_some_and(|v| v.starts_with('=')))
        {
            out.push(a.clone());
        }
    }
    out
}

/// `run --driver mpi`: re-launch this binary as `mpirun -n N lockstep rank ...`, N = 1
/// (the front process) + every server's ranks.
pub(crate) fn relaunch_under_mpirun(
    args: &ScenarioArgs,
    real: &RealArgs,
    mpirun: &MpirunArgs,
) -> anyhow::Result<ExitCode> {
    let scenario = load(args, real.policy.as_deref(), real.seed)?;
    check_at_startup(&scenario, real)?;
    require_mpi_build()?;
    let mut cmd = mpirun_command(processes_of(&scenario)?, mpirun)?;
    cmd.arg("rank").args(args_for_each_process(
        "run",
        &std::env::args().collect::<Vec<_>>(),
    ));
    if let Some(log) = &real.forward_log {
        if real.model.model.is_none() {
            anyhow::bail!("--forward-log records the forwards of --model: give --model DIR");
        }
        // Empty it here: the ranks append.
        std::fs::File::create(log)
            .with_context(|| format!("--forward-log: creating {}", log.display()))?;
    }
    let status = cmd
        .status()
        .context("starting mpirun (is OpenMPI installed?)")?;
    Ok(status_of(status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rank_cmd::RankArgs;
    use crate::run_cmd::RunArgs;
    use crate::{Cli, Command};
    use clap::Parser;

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    /// `run --driver mpi` hands every option `rank` shares with it on, whatever it is:
    /// the rank process parses the same scenario and real-driver options the launcher
    /// did, and none of the launcher's own.
    #[test]
    fn a_rank_process_gets_every_option_of_the_run_it_was_launched_for() {
        let run = argv(&[
            "lockstep",
            "run",
            "examples/disagg-small.toml",
            "--driver",
            "mpi",
            "--hostfile",
            "hosts.txt",
            "--mpirun-arg=--map-by",
            "--mpirun-arg",
            "ppr:3:node",
            "--set",
            "workload.num_requests=60",
            "--policy",
            "legacy",
            "--seed",
            "7",
            "--time-scale",
            "0.5",
            "--preload",
            "--json",
            "out.json",
            "--slo",
            "ttft_ms=200",
            "--stall-timeout-ms",
            "1234",
            "--timeout-ms",
            "4321",
            "--model",
            "/tmp/tiny",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--forward-log",
            "fl.jsonl",
        ]);
        let Command::Run(RunArgs {
            args: run_args,
            real: run_real,
            ..
        }) = Cli::try_parse_from(&run).expect("run parses").command
        else {
            panic!("not run");
        };
        let mut rank = argv(&["lockstep", "rank"]);
        rank.extend(args_for_each_process("run", &run));
        let parsed = Cli::try_parse_from(&rank);
        let Ok(Cli {
            command:
                Command::Rank(RankArgs {
                    args: rank_args,
                    real: rank_real,
                    ..
                }),
            ..
        }) = parsed
        else {
            panic!("rank refused {rank:?}: {parsed:?}");
        };
        assert_eq!(format!("{rank_args:?}"), format!("{run_args:?}"));
        assert_eq!(format!("{rank_real:?}"), format!("{run_real:?}"));
        for gone in [
            "--driver",
            "--hostfile",
            "--mpirun-arg",
            "hosts.txt",
            "ppr:3:node",
        ] {
            assert!(
                !rank.iter().any(|a| a.starts_with(gone)),
                "{gone} in {rank:?}"
            );
        }
    }

    #[test]
    fn a_serve_process_gets_the_launchers_options_in_either_form() {
        let serve = argv(&[
            "lockstep",
            "serve",
            "s.toml",
            "--driver=mpi",
            "--port",
            "0",
            "--hostfile=h",
            "--api-key",
            "k",
        ]);
        assert_eq!(
            args_for_each_process("serve", &serve),
            argv(&["s.toml", "--port", "0", "--api-key", "k"])
        );
    }
}
