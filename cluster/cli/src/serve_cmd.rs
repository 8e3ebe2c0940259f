//! `lockstep serve`: the scenario's fleet behind an OpenAI-compatible HTTP API, on
//! threads or under mpirun (the launcher, and [`serve_rank`], one of its processes).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[cfg(feature = "mpi")]
use anyhow::Context;

use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;

#[cfg(feature = "mpi")]
use crate::args::scenario_digest;
use crate::args::{ModelArgs, MpirunArgs, ProcessDriver, ScenarioArgs, finite_non_negative, load};
use crate::mpirun::{
    args_for_each_process, mpirun_command, processes_of, require_mpi_build, run_draining_on_signal,
    status_of,
};
use crate::stdout::outln;
use crate::vllm_flags::ServeShorthands;

/// `lockstep serve`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    args: ScenarioArgs,
    /// Which driver: `threads`, or `mpi` (re-launches this binary under mpirun: the
    /// HTTP server in the front process, world rank 0, one process per rank).
    #[arg(long, value_enum, default_value_t = ProcessDriver::Threads)]
    driver: ProcessDriver,
    #[command(flatten)]
    mpirun: MpirunArgs,
    /// Address to bind; one that is not loopback needs an API key (--api-key-file,
    /// LOCKSTEP_API_KEY or --api-key).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the address is printed on stdout).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/*. Other users of the machine see a
    /// command line: prefer --api-key-file or the environment variable LOCKSTEP_API_KEY
    /// (at most one of the three gives the key).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Like --api-key, the key read from PATH (trailing newlines dropped).
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// Wall seconds per modeled second; 0 runs the zero-cost backend.
    #[arg(long, default_value_t = 0.0, value_parser = finite_non_negative)]
    time_scale: f64,
    /// Policy preset (applied before --set).
    #[arg(long, value_parser = ["fixed", "legacy"])]
    policy: Option<String>,
    /// The served model's name, as vLLM's --served-model-name (default: the --model
    /// directory's name, or else the scenario file's stem). `--model-name` still works.
    #[arg(long = "served-model-name", alias = "model-name", value_name = "NAME")]
    model_name: Option<String>,
    /// Largest request body in bytes (413 past it).
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..))]
    max_body_bytes: u64,
    /// Longest prompt in tokens (400 past it).
    #[arg(long, default_value_t = 32_768, value_parser = clap::value_parser!(u32).range(1..))]
    max_prompt_tokens: u32,
    /// Seconds a shutdown waits for the requests in flight; those still running then
    /// are cut (each answered 503 or an error event) and the exit status is non-zero.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    drain_timeout_s: u64,
    /// Requests accepted and not both ended and delivered past which a new one is
    /// answered 429 with `Retry-After` (the queue bound; TGI's
    /// --max-concurrent-requests).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    max_pending: u64,
    /// Seconds an answer may wait on a client that reads none of it (nginx's
    /// send_timeout); then its connection is closed and its request cancelled.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    write_timeout_s: u64,
    /// Output events (one per step) a stream may have waiting for a client that reads
    /// nothing (its connection's buffers full for a second): one more cancels the
    /// request, and the stream ends with an error event saying why. An HTTP worker
    /// merely behind the fleet is never cut off.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    stream_buffer: u64,
    /// A collective waiting longer fails naming the missing ranks.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: u64,
    /// Seed of every request's sampling stream (with --model and --temperature).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    vllm: ServeShorthands,
}

/// Runs `lockstep serve`.
pub(crate) fn run(
    ServeArgs {
        args,
        driver,
        mpirun,
        host,
        port,
        api_key,
        api_key_file,
        time_scale,
        policy,
        model_name,
        max_body_bytes,
        max_prompt_tokens,
        drain_timeout_s,
        max_pending,
        write_timeout_s,
        stream_buffer,
        timeout_ms,
        seed,
        model: model_args,
        vllm,
    }: ServeArgs,
) -> anyhow::Result<ExitCode> {
    use lockstep_serve::ServeOptions;
    use lockstep_serve::api_key::{API_KEY_ENV, KeySource, resolve_api_key};
    // Checked first: a bad key fails at once, before the scenario or a model loads.
    let api_key = resolve_api_key(
        api_key,
        api_key_file.as_deref(),
        std::env::var_os(API_KEY_ENV),
    )?;
    let time_base =
        lockstep_plan::report::TimeBase::of_real_run(model_args.model.is_some(), time_scale);
    let mut scenario = load(&args, policy.as_deref(), None)?;
    vllm.apply(&mut scenario)?;
    if driver != ProcessDriver::MpiRank {
        crate::output::serve_notes(&scenario, time_base);
    }
    // As vLLM names a model by its path: the model directory's name, or else the
    // scenario's.
    let model = model_name.unwrap_or_else(|| {
        model_args
            .model
            .as_deref()
            .and_then(Path::file_name)
            .or_else(|| args.scenario.file_stem())
            .map_or("lockstep".into(), |s| s.to_string_lossy().into_owned())
    });
    let opts = ServeOptions {
        host,
        port,
        api_key: api_key.as_ref().map(|k| k.key.clone()),
        model,
        max_body_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
        max_prompt_tokens: vllm
            .max_model_len
            .map_or(max_prompt_tokens, |l| l.min(max_prompt_tokens)),
        max_model_len: vllm.max_model_len,
        time_base,
        drain_timeout: std::time::Duration::from_secs(drain_timeout_s),
        workers: 2,
        max_pending: usize::try_from(max_pending).unwrap_or(usize::MAX),
        write_timeout: std::time::Duration::from_secs(write_timeout_s),
        stream_buffer: usize::try_from(stream_buffer).unwrap_or(usize::MAX),
    };
    let real = RealOptions {
        time_scale,
        collective_timeout: std::time::Duration::from_millis(timeout_ms),
        model: if driver == ProcessDriver::Mpi {
            // The rank processes load it.
            None
        } else {
            model_args.load(seed)?
        },
        ..RealOptions::default()
    };
    match driver {
        ProcessDriver::Mpi => {
            require_mpi_build()?;
            // Refused here, before any process starts.
            lockstep_serve::check_address(&opts)?;
            let mut mpirun = mpirun;
            if api_key.is_some_and(|k| k.source == KeySource::Env) {
                // OpenMPI hands remote processes only the variables it is told to: the
                // front (world rank 0) may be on another host.
                mpirun.mpirun_args.extend(["-x".into(), API_KEY_ENV.into()]);
            }
            let mut cmd = mpirun_command(processes_of(&scenario)?, &mpirun)?;
            cmd.arg("serve")
                .args(args_for_each_process(
                    "serve",
                    &std::env::args().collect::<Vec<_>>(),
                ))
                .arg("--driver=mpi-rank");
            Ok(status_of(run_draining_on_signal(cmd)?))
        }
        ProcessDriver::MpiRank => serve_rank(&scenario, &args, &opts, real),
        ProcessDriver::Threads => {
            let listener = lockstep_serve::bind(&opts)?;
            let summary = lockstep_serve::serve(&scenario, &real, &opts, listener, |addr| {
                announce(&opts.model, addr)
            })?;
            Ok(serve_ended(&summary, drain_timeout_s))
        }
    }
}

fn announce(model: &str, addr: std::net::SocketAddr) {
    outln!("lockstep serve: model {model} on http://{addr}");
    let _ = std::io::stdout().flush();
}

/// The closing lines of a serve run, and its exit status: non-zero if a rank did not
/// drain, or if the drain timeout cut answers.
fn serve_ended(summary: &lockstep_serve::ServeSummary, drain_timeout_s: u64) -> ExitCode {
    let mut failed: Vec<String> = summary
        .ranks
        .iter()
        .filter(|r| !matches!(r.ending, lockstep_plan::report::RankEnding::Drained))
        .map(|r| format!("server {} rank {}: {:?}", r.server, r.rank, r.ending))
        .collect();
    outln!(
        "lockstep serve: stopped after {} requests; {} ranks ended; {} cut at the drain timeout",
        summary.requests,
        summary.ranks.len(),
        summary.cut,
    );
    if summary.cut > 0 {
        failed.push(format!(
            "the drain was incomplete: {} answers were not finished within --drain-timeout-s {drain_timeout_s} and were cut (each told so, if its client was reading)",
            summary.cut
        ));
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        for f in &failed {
            eprintln!("error: {f}");
        }
        ExitCode::FAILURE
    }
}

/// One process of `serve --driver mpi`.
#[cfg(feature = "mpi")]
fn serve_rank(
    scenario: &Scenario,
    args: &ScenarioArgs,
    opts: &lockstep_serve::ServeOptions,
    real: RealOptions,
) -> anyhow::Result<ExitCode> {
    use lockstep_runtime::mpi::MpiOptions;
    let watchdog = real.collective_timeout;
    let mpi = MpiOptions {
        common: real,
        watchdog,
    };
    let digest = scenario_digest(args)?;
    // The launcher asks for a drain with SIGUSR1, which mpirun forwards to every
    // process: only the front (world rank 0) acts on it, and then ends the run, which
    // stops the ranks; a rank must not die of it first.
    if std::env::var("OMPI_COMM_WORLD_RANK").is_ok_and(|r| r != "0") {
        let ignored = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGUSR1, ignored)
            .context("setting the SIGUSR1 handler")?;
    }
    match lockstep_serve::serve_process(scenario, digest, &mpi, opts, |addr| {
        announce(&opts.model, addr)
    }) {
        Ok(Some(front)) => {
            if let Some(lost) = &front.lost {
                // Lost ranks: finalising would wait for them. Exit now, non-zero;
                // mpirun ends the rest of the job.
                eprintln!("error: {lost}");
                let _ = std::io::stdout().flush();
                std::process::exit(1);
            }
            Ok(serve_ended(&front.summary, opts.drain_timeout.as_secs()))
        }
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
            // A failing process must not leave its peers waiting in a collective.
            std::process::exit(2);
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn serve_rank(
    _scenario: &Scenario,
    _args: &ScenarioArgs,
    _opts: &lockstep_serve::ServeOptions,
    _real: RealOptions,
) -> anyhow::Result<ExitCode> {
    require_mpi_build()?;
    Ok(ExitCode::FAILURE)
}
