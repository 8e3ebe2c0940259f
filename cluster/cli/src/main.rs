//! The `lockstep` command line.

#![forbid(unsafe_code)]

use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use lockstep_bench::{BenchOptions, Endpoint};
use lockstep_plan::model_backend::ModelBackend;
use lockstep_plan::report::{Report, Slo, ab_table};
use lockstep_plan::scenario::Scenario;
use lockstep_plan::validate;
use lockstep_runtime::RealOptions;
use lockstep_sim::{self as sim, SimOptions};

mod args;
mod calibrate;
mod model_cmd;
mod mpirun;
mod output;
mod trtllm_cmd;

#[cfg(feature = "mpi")]
use args::scenario_digest;
use args::{
    Driver, ModelArgs, MpirunArgs, ProcessDriver, RealArgs, ScenarioArgs, finite_non_negative, load,
};
use mpirun::{
    args_for_each_process, mpirun_command, processes_of, relaunch_under_mpirun, require_mpi_build,
    run_draining_on_signal, status_of,
};
use output::{exit_code, requests_bar, write_json};

#[derive(Debug, Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Attention-data-parallel LLM serving control plane",
    after_help = "Exit status of a run: 0 completed, 1 the run failed (a collective error, a lost rank), 2 the fleet crashed or deadlocked (the report says how)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
        /// Seed of the run (wins over a `seed` in the scenario; default 0).
        #[arg(long)]
        seed: Option<u64>,
        /// Write the report as JSON.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Write one JSON line per server iteration and rank.
        #[arg(long, value_name = "PATH")]
        iter_log: Option<PathBuf>,
        /// Goodput: requests per second completed within every objective given
        /// (`ttft_ms=200,tpot_ms=20,e2e_ms=5000`, any of them).
        #[arg(long, value_name = "KEY=MS,...")]
        slo: Option<Slo>,
        /// Deliver every request, and the client's shutdown, before the first iteration
        /// (as `run --preload` does, for comparing drivers).
        #[arg(long)]
        preload: bool,
        /// A server whose iterations change nothing for this long (virtual), while
        /// requests remain and no KV transfer is in flight, is deadlocked.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        stall_timeout_ms: u64,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Run the scenario's servers for real: one thread per rank (`threads`) or one
    /// process per rank plus a front process under mpirun (`mpi`, see `lockstep rank`);
    /// aggregated or disaggregated alike, with real KV transfers between ctx and gen
    /// servers.
    Run {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Which driver (`mpi` re-launches this binary under `mpirun`, one process per
        /// rank; it needs a build with `--features mpi`).
        #[arg(long, value_enum, default_value_t = Driver::Threads)]
        driver: Driver,
        #[command(flatten)]
        real: RealArgs,
        #[command(flatten)]
        mpirun: MpirunArgs,
    },
    /// One process of an MPI run: `mpirun -n N lockstep rank SCENARIO.toml ...` with N =
    /// 1 + the ranks of every server (built with `--features mpi`). World rank 0 is the
    /// front process: it plays the workload and writes the report.
    Rank {
        #[command(flatten)]
        args: ScenarioArgs,
        #[command(flatten)]
        real: RealArgs,
        /// No iteration progress for this long aborts the whole job.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
        watchdog_ms: u64,
        /// Fault injection (tests): RANK:ITERATION tags that rank's gather wrongly.
        #[arg(long, value_name = "RANK:ITERATION")]
        inject_tag_mismatch: Option<String>,
    },
    /// Per-iteration control-plane overhead with the zero-cost backend, next to a raw
    /// loop of the same collectives (the floor).
    Overhead {
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
    },
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
    Ab {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Baseline preset.
        #[arg(long, default_value = "legacy", value_parser = ["fixed", "legacy"])]
        base: String,
        /// Treatment preset.
        #[arg(long, default_value = "fixed", value_parser = ["fixed", "legacy"])]
        treatment: String,
        /// Seed of both runs (wins over a `seed` in the scenario; default 0).
        #[arg(long)]
        seed: Option<u64>,
        /// Write both reports as JSON: {"base_name", "treatment_name", "base": ...,
        /// "treatment": ...} (`lockstep report` plots it).
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Goodput of both runs: requests per second completed within every objective
        /// given (`ttft_ms=200,tpot_ms=20,e2e_ms=5000`, any of them).
        #[arg(long, value_name = "KEY=MS,...")]
        slo: Option<Slo>,
    },
    /// Write one self-contained HTML page of plots (latency CDFs, routing share and
    /// occupancy per rank, KV usage and waiting queue over time) from a run's JSON
    /// (`sim`/`run --json`), or of both runs of `ab --json`, overlaid.
    Report {
        /// The JSON report.
        run: PathBuf,
        /// Where the page goes.
        #[arg(short, long, value_name = "PATH", default_value = "report.html")]
        out: PathBuf,
    },
    /// Serve the scenario's fleet over HTTP with an OpenAI-compatible API
    /// (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`)
    /// until SIGTERM or Ctrl-C, which stop accepting and answer the requests in flight.
    /// The scenario's workload is not played: the requests are the HTTP clients'.
    Serve {
        #[command(flatten)]
        args: ScenarioArgs,
        /// Which driver: `threads`, or `mpi` (re-launches this binary under mpirun: the
        /// HTTP server in the front process, world rank 0, one process per rank).
        #[arg(long, value_enum, default_value_t = ProcessDriver::Threads)]
        driver: ProcessDriver,
        #[command(flatten)]
        mpirun: MpirunArgs,
        /// Address to bind; one that is not loopback needs --api-key.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port (0: any free port; the address is printed on stdout).
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Require `Authorization: Bearer KEY` on /v1/*.
        #[arg(long, value_name = "KEY")]
        api_key: Option<String>,
        /// Wall seconds per modeled second; 0 runs the zero-cost backend.
        #[arg(long, default_value_t = 0.0, value_parser = finite_non_negative)]
        time_scale: f64,
        /// Policy preset (applied before --set).
        #[arg(long, value_parser = ["fixed", "legacy"])]
        policy: Option<String>,
        /// The served model's name (default: the --model directory's name, or else the
        /// scenario file's stem).
        #[arg(long)]
        model_name: Option<String>,
        /// Largest request body in bytes (413 past it).
        #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(1..))]
        max_body_bytes: u64,
        /// Longest prompt in tokens (400 past it).
        #[arg(long, default_value_t = 32_768, value_parser = clap::value_parser!(u32).range(1..))]
        max_prompt_tokens: u32,
        /// Seconds a shutdown waits for the requests in flight.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
        drain_timeout_s: u64,
        /// Requests accepted and not ended past which a new one is answered 429 with
        /// `Retry-After` (the queue bound; TGI's --max-concurrent-requests).
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
        max_pending: u64,
        /// A collective waiting longer fails naming the missing ranks.
        #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_ms: u64,
        /// Seed of every request's sampling stream (with --model and --temperature).
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Play the scenario's workload against any OpenAI-compatible server over plain
    /// HTTP (`lockstep serve`, vLLM, SGLang, TensorRT-LLM) and report what vLLM's
    /// benchmark_serving reports, in the report of `sim`/`run` (`--json` for `lockstep
    /// report`). Exit status: 0 every request completed, 1 some failed (the reasons are
    /// printed) or the server could not be reached.
    Bench {
        #[command(flatten)]
        args: ScenarioArgs,
        /// The server's base URL: `http://HOST:PORT` (plain HTTP; a trailing /v1 is
        /// taken off).
        #[arg(long)]
        url: String,
        /// Seed of the workload (wins over a `seed` in the scenario; default 0).
        #[arg(long)]
        seed: Option<u64>,
        /// The model named in requests (default: the first of GET /v1/models).
        #[arg(long)]
        model: Option<String>,
        /// Which API: /v1/completions (prompts as token ids) or /v1/chat/completions
        /// (prompts as words).
        #[arg(long, value_parser = ["completions", "chat"], default_value = "completions")]
        endpoint: String,
        /// Send `Authorization: Bearer KEY`.
        #[arg(long, value_name = "KEY")]
        api_key: Option<String>,
        /// Wall seconds per workload second (0: every arrival as soon as it is released).
        #[arg(long, default_value_t = 1.0, value_parser = finite_non_negative)]
        time_scale: f64,
        /// Write the report as JSON.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Goodput: requests per second completed within every objective given
        /// (`ttft_ms=200,tpot_ms=20,e2e_ms=5000`, any of them).
        #[arg(long, value_name = "KEY=MS,...")]
        slo: Option<Slo>,
        /// Longest one request may take, from sending to the end of its stream; it fails
        /// past it.
        #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
        request_timeout_s: u64,
        /// No progress bar (there is none either when stderr is not a terminal).
        #[arg(long)]
        no_progress: bool,
    },
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
    Swarm {
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
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal who did not ask for none.
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .init();
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

fn simulate(
    scenario: &Scenario,
    seed: u64,
    iter_log: Option<&Path>,
    preload: bool,
    stall_timeout_ms: u64,
    model: Option<ModelBackend>,
) -> anyhow::Result<Report> {
    let mut log_file = match iter_log {
        Some(p) => Some(BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let bar = std::io::stderr().is_terminal().then(requests_bar);
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
            preload,
            stall_bound_ns: stall_timeout_ms.saturating_mul(1_000_000),
            model,
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
        Command::Validate { args, policy } => {
            let scenario = load(&args, policy.as_deref(), None)?;
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
            slo,
            preload,
            stall_timeout_ms,
            model,
        } => {
            let scenario = load(&args, policy.as_deref(), seed)?;
            let model = model.load(seed.unwrap_or(0))?;
            let mut report = simulate(
                &scenario,
                seed.unwrap_or(0),
                iter_log.as_deref(),
                preload,
                stall_timeout_ms,
                model,
            )?;
            if let Some(slo) = &slo {
                report.apply_slo(slo);
            }
            print!("{}", report.table());
            if let Some(p) = json {
                write_json(&p, &report)?;
            }
            Ok(exit_code(&report))
        }
        Command::Run {
            args,
            driver,
            real,
            mpirun,
        } => {
            if driver == Driver::Mpi {
                return relaunch_under_mpirun(&args, &real, &mpirun);
            }
            let scenario = load(&args, real.policy.as_deref(), real.seed)?;
            let mut report = lockstep_runtime::threads::run(&scenario, &real.options()?)?;
            if let Some(slo) = &real.slo {
                report.apply_slo(slo);
            }
            print!("{}", report.table());
            if let Some(p) = &real.json {
                write_json(p, &report)?;
            }
            Ok(exit_code(&report))
        }
        Command::Rank {
            args,
            real,
            watchdog_ms,
            inject_tag_mismatch,
        } => rank_command(&args, &real, watchdog_ms, inject_tag_mismatch.as_deref()),
        Command::Model { command } => model_cmd::run(command),
        Command::Explain(args) => {
            print!("{}", lockstep_plan::explain::explain(&args)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Import { command } => {
            trtllm_cmd::run_import(command)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Export { command } => {
            trtllm_cmd::run_export(command)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Profiles => {
            for p in lockstep_gpu::profiles() {
                println!("{}", p.name);
                println!(
                    "  kv: {} per token ({} layers, {} kv heads, head dim {}, {} bytes per element{})",
                    lockstep_plan::report::table::human_bytes(p.kv.bytes_per_token()),
                    p.kv.layers,
                    p.kv.kv_heads,
                    p.kv.head_dim,
                    p.kv.dtype_bytes,
                    if p.kv.mla { ", MLA" } else { "" }
                );
                let c = serde_json::to_value(p.coefficients)?;
                if let Some(map) = c.as_object() {
                    let fields: Vec<String> =
                        map.iter().map(|(k, v)| format!("{k} = {v}")).collect();
                    println!("  coefficients (ns): {}", fields.join(", "));
                }
                for line in p.assumptions.lines().filter(|l| !l.trim().is_empty()) {
                    println!("  {}", line.trim());
                }
                println!();
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Overhead {
            driver,
            dp,
            active,
            iterations,
        } => {
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
            println!(
                "driver={driver} dp={dp} active_per_rank={active} iterations={iterations} collectives_per_iteration={}",
                o.collectives
            );
            println!(
                "means: overhead_mean_us={:.2} floor_mean_us={:.2} ratio_of_means={:.2}",
                o.overhead_mean_us,
                o.floor_mean_us,
                o.overhead_mean_us / o.floor_mean_us
            );
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
            slo,
        } => {
            let seed_or_0 = seed.unwrap_or(0);
            let mut a = simulate(
                &load(&args, Some(&base), seed)?,
                seed_or_0,
                None,
                false,
                10_000,
                None,
            )?;
            let mut b = simulate(
                &load(&args, Some(&treatment), seed)?,
                seed_or_0,
                None,
                false,
                10_000,
                None,
            )?;
            if let Some(slo) = &slo {
                a.apply_slo(slo);
                b.apply_slo(slo);
            }
            print!("{}", ab_table(&a, &b, &base, &treatment));
            if let Some(p) = json {
                let (base_name, treatment_name) = if base == treatment {
                    (format!("{base} (base)"), format!("{treatment} (treatment)"))
                } else {
                    (base.clone(), treatment.clone())
                };
                write_json(
                    &p,
                    &serde_json::json!({
                        "base_name": base_name,
                        "treatment_name": treatment_name,
                        "base": a,
                        "treatment": b,
                    }),
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Report { run, out } => {
            let text = std::fs::read_to_string(&run)
                .with_context(|| format!("reading {}", run.display()))?;
            let runs = lockstep_plan::report::html::parse_run_file(&text).with_context(|| {
                format!(
                    "{} is not a lockstep report (the JSON of `sim`/`run --json` or `ab --json`)",
                    run.display()
                )
            })?;
            let page = lockstep_plan::report::html::render(&runs);
            std::fs::write(&out, page).with_context(|| format!("writing {}", out.display()))?;
            println!(
                "wrote {} ({} run{})",
                out.display(),
                runs.len(),
                if runs.len() == 1 { "" } else { "s" }
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve {
            args,
            driver,
            mpirun,
            host,
            port,
            api_key,
            time_scale,
            policy,
            model_name,
            max_body_bytes,
            max_prompt_tokens,
            drain_timeout_s,
            max_pending,
            timeout_ms,
            seed,
            model: model_args,
        } => {
            use lockstep_serve::ServeOptions;
            let scenario = load(&args, policy.as_deref(), None)?;
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
                api_key,
                model,
                max_body_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
                max_prompt_tokens,
                drain_timeout: std::time::Duration::from_secs(drain_timeout_s),
                workers: 2,
                max_pending: usize::try_from(max_pending).unwrap_or(usize::MAX),
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
                    let summary =
                        lockstep_serve::serve(&scenario, &real, &opts, listener, |addr| {
                            announce(&opts.model, addr)
                        })?;
                    Ok(serve_ended(&summary))
                }
            }
        }
        Command::Bench {
            args,
            url,
            seed,
            model,
            endpoint,
            api_key,
            time_scale,
            json,
            slo,
            request_timeout_s,
            no_progress,
        } => bench_command(
            &args,
            BenchOptions {
                url,
                model,
                endpoint: if endpoint == "chat" {
                    Endpoint::Chat
                } else {
                    Endpoint::Completions
                },
                api_key,
                time_scale,
                request_timeout: std::time::Duration::from_secs(request_timeout_s),
                seed: seed.unwrap_or(0),
            },
            seed,
            json.as_deref(),
            slo.as_ref(),
            !no_progress,
        ),
        Command::Swarm {
            runs,
            seed,
            out,
            threads_every,
            jobs,
            time_limit_s,
            shrink_budget,
            shrink_fault_only,
        } => {
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
            print!("{}", summary.render());
            if summary.timeouts_rerun > 0 {
                println!(
                    "{} run(s) timed out among the others and were run again alone",
                    summary.timeouts_rerun
                );
            }
            println!(
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
    }
}

/// `lockstep bench`: plays the workload against the server, prints the table and vLLM's
/// result block, writes the JSON; 1 if any request failed.
fn bench_command(
    args: &ScenarioArgs,
    opts: BenchOptions,
    seed: Option<u64>,
    json: Option<&Path>,
    slo: Option<&Slo>,
    progress: bool,
) -> anyhow::Result<ExitCode> {
    let scenario = load(args, None, seed)?;
    let bar = (progress && std::io::stderr().is_terminal()).then(requests_bar);
    let mut tick = |done: u64, total: u64| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    };
    let mut report = lockstep_bench::run(&scenario, &opts, Some(&mut tick))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(slo) = slo {
        report.apply_slo(slo);
    }
    print!("{}", report.table());
    print!("{}", lockstep_bench::summary::vllm_summary(&report));
    if let Some(p) = json {
        write_json(p, &report)?;
    }
    if report.requests.failed > 0 {
        eprintln!(
            "error: {} of {} requests failed (reasons above)",
            report.requests.failed, report.requests.submitted
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(exit_code(&report))
}

fn announce(model: &str, addr: std::net::SocketAddr) {
    println!("lockstep serve: model {model} on http://{addr}");
    let _ = std::io::stdout().flush();
}

/// The closing lines of a serve run, and its exit status: non-zero if a rank did not
/// drain.
fn serve_ended(summary: &lockstep_serve::ServeSummary) -> ExitCode {
    let failed: Vec<String> = summary
        .ranks
        .iter()
        .filter(|r| !matches!(r.ending, lockstep_plan::report::RankEnding::Drained))
        .map(|r| format!("server {} rank {}: {:?}", r.server, r.rank, r.ending))
        .collect();
    println!(
        "lockstep serve: stopped after {} requests; {} ranks ended",
        summary.requests,
        summary.ranks.len()
    );
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
            Ok(serve_ended(&front.summary))
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

#[cfg(feature = "mpi")]
fn rank_command(
    args: &ScenarioArgs,
    real: &RealArgs,
    watchdog_ms: u64,
    inject: Option<&str>,
) -> anyhow::Result<ExitCode> {
    use lockstep_runtime::mpi::{MpiOptions, run_process};
    let scenario = load(args, real.policy.as_deref(), real.seed)?;
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
            print!("{}", report.table());
            if let Some(p) = &real.json {
                write_json(p, &report)?;
            }
            if front.abandoned {
                // Lost ranks: finalising would wait for them. Exit now, non-zero;
                // mpirun ends the rest of the job.
                eprintln!(
                    "error: {}",
                    report
                        .outcome_detail
                        .as_deref()
                        .unwrap_or("lost part of the fleet")
                );
                use std::io::Write as _;
                let _ = std::io::stdout().flush();
                std::process::exit(1);
            }
            Ok(exit_code(&report))
        }
        Ok(None) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("error: {e}");
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
