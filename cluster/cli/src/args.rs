//! The options several subcommands share (the scenario and its `--set` overrides, the
//! drivers, how mpirun starts, `--model`, the real drivers' options) and what they turn
//! into: the loaded scenario, the [`RealOptions`] of a run.

use std::path::PathBuf;

use anyhow::Context;

use lockstep_plan::model_backend::ModelBackend;
use lockstep_plan::report::Slo;
use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;

use crate::model_cmd;

#[derive(Debug, clap::Args)]
pub(crate) struct ScenarioArgs {
    /// Scenario file (TOML).
    pub(crate) scenario: PathBuf,
    /// Override a key: `policy.pad.rollback=false`, `server.max_batch_size=4`,
    /// `server.gen0.max_batch_size=128`, `workload.concurrency=64`, `model.profile="..."`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub(crate) set: Vec<String>,
}

/// Where `run` runs the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Driver {
    /// One thread per rank, in this process.
    Threads,
    /// One process per rank under mpirun (this binary, re-launched).
    Mpi,
}

/// Where `serve` and `overhead` run the ranks: as [`Driver`], or one process of an MPI
/// run (what the `mpi` launcher starts each process with).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ProcessDriver {
    /// One thread per rank, in this process.
    Threads,
    /// One process per rank under mpirun (this binary, re-launched).
    Mpi,
    /// One process of an MPI run.
    #[value(hide = true)]
    MpiRank,
}

/// How `--driver mpi` starts mpirun.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct MpirunArgs {
    /// `--driver mpi`: mpirun's hostfile (which hosts the processes go to; README
    /// "Running on several machines").
    #[arg(long, value_name = "PATH")]
    pub(crate) hostfile: Option<PathBuf>,
    /// `--driver mpi`: one more argument for mpirun, repeatable, e.g.
    /// `--mpirun-arg=--map-by --mpirun-arg=ppr:3:node` or
    /// `--mpirun-arg=--mca --mpirun-arg=btl_tcp_if_include --mpirun-arg=eth1`.
    #[arg(long = "mpirun-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) mpirun_args: Vec<String>,
}

/// `--model DIR` and how its tokens are sampled (`sim`, `run`, `serve`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ModelArgs {
    /// A model directory (`lockstep model init DIR`, or a Hugging Face Llama / Qwen2 /
    /// Mistral checkpoint): every forward runs it on the CPU and its tokens are the
    /// model's. `sim` still times forwards with the cost model; `run` and `serve` take
    /// the model's own time. Aggregated and disaggregated fleets alike (a ctx server's
    /// ranks hand the model's K/V to the gen server's).
    #[arg(long, value_name = "DIR")]
    pub(crate) model: Option<PathBuf>,
    /// With --model.
    #[command(flatten)]
    pub(crate) sampling: model_cmd::SamplingArgs,
}

impl ModelArgs {
    /// The loaded model, if --model was given; each request's random stream is seeded
    /// from `seed` and its id.
    pub(crate) fn load(&self, seed: u64) -> anyhow::Result<Option<ModelBackend>> {
        let Some(dir) = &self.model else {
            return Ok(None);
        };
        // Each request's stream is seeded from the run's seed and its id (ModelSampling).
        let params = self.sampling.params(0);
        Ok(Some(ModelBackend::load(dir, params, seed)?))
    }
}

/// The options both real drivers take (`run --driver mpi` passes them on to `rank`).
#[derive(Debug, clap::Args)]
pub(crate) struct RealArgs {
    /// Policy preset (applied before --set).
    #[arg(long, value_parser = ["fixed", "legacy"])]
    pub(crate) policy: Option<String>,
    /// Seed of the workload (wins over a `seed` in the scenario; default 0).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Wall seconds per modeled second; 0 runs the zero-cost backend.
    #[arg(long, default_value_t = 0.0, value_parser = finite_non_negative)]
    pub(crate) time_scale: f64,
    /// Deliver every request before the ranks start (arrivals at iteration boundaries,
    /// for cross-driver comparisons).
    #[arg(long)]
    pub(crate) preload: bool,
    /// Run the hosts in the simulator's order of events, in modeled time, without
    /// sleeping (needs --preload): which fetch reads a handoff and which
    /// iteration sees a KV transfer's completion follow the time model, so the run does
    /// what `sim --preload` does, request by request, however busy the machine.
    #[arg(long, requires = "preload")]
    pub(crate) ordered: bool,
    /// Write the report as JSON (the front process under mpirun).
    #[arg(long, value_name = "PATH")]
    pub(crate) json: Option<PathBuf>,
    /// Goodput: requests per second completed within every objective given
    /// (`ttft_ms=200,tpot_ms=20,e2e_ms=5000`, any of them).
    #[arg(long, value_name = "KEY=MS,...")]
    pub(crate) slo: Option<Slo>,
    /// A server whose iterations change nothing for this long, while requests remain
    /// and no KV transfer is in flight, is deadlocked: its requests fail and the run
    /// reports `deadlocked`.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) stall_timeout_ms: u64,
    /// A collective waiting longer fails naming the missing ranks.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) timeout_ms: u64,
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// With --model: write each forward's batch shape and measured time, one JSON line
    /// each, for `lockstep model calibrate --from-log`. Under mpirun every rank process
    /// appends whole lines to PATH (on its own host); `run --driver mpi` empties it first.
    #[arg(long, value_name = "PATH")]
    pub(crate) forward_log: Option<PathBuf>,
}

impl RealArgs {
    /// The options of a run in this process (`threads`): a `--forward-log` is emptied.
    pub(crate) fn options(&self) -> anyhow::Result<RealOptions> {
        self.options_logging(false)
    }

    /// `append`: a rank process under mpirun, one of several writing the same
    /// `--forward-log`; each line goes out in one write to a file opened for appending,
    /// so the processes' lines interleave whole.
    pub(crate) fn options_logging(&self, append: bool) -> anyhow::Result<RealOptions> {
        let seed = self.seed.unwrap_or(0);
        Ok(RealOptions {
            seed,
            time_scale: self.time_scale,
            preload: self.preload,
            ordered: self.ordered,
            stall_bound: std::time::Duration::from_millis(self.stall_timeout_ms),
            collective_timeout: std::time::Duration::from_millis(self.timeout_ms),
            model: self.model.load(seed)?,
            forward_log: match &self.forward_log {
                None => None,
                Some(_) if self.model.model.is_none() => {
                    return Err(crate::output::UsageError(
                        "--forward-log records the forwards of --model: give --model DIR".into(),
                    )
                    .into());
                }
                Some(p) => {
                    let file = std::fs::OpenOptions::new()
                        .create(true)
                        .write(true)
                        .append(append)
                        .truncate(!append)
                        .open(p)
                        .with_context(|| format!("--forward-log: opening {}", p.display()))?;
                    let log: lockstep_runtime::device::ForwardLog =
                        std::sync::Arc::new(std::sync::Mutex::new(std::io::LineWriter::new(file)));
                    Some(log)
                }
            },
            ..RealOptions::default()
        })
    }
}

/// The scenario with the preset, the `--set` overrides and the command line's seed (which
/// wins over the file's) applied.
pub(crate) fn load(
    args: &ScenarioArgs,
    preset: Option<&str>,
    seed: Option<u64>,
) -> anyhow::Result<Scenario> {
    let mut scenario = Scenario::load(&args.scenario)?;
    if seed.is_some() {
        scenario.seed = seed;
    }
    if let Some(p) = preset {
        scenario.apply_set(&format!("policy.preset=\"{p}\""))?;
    }
    for s in &args.set {
        scenario.apply_set(s)?;
    }
    Ok(scenario)
}

/// `--time-scale`: a finite number of wall seconds per modeled second, 0 or more.
pub(crate) fn finite_non_negative(text: &str) -> Result<f64, String> {
    let v: f64 = text
        .parse()
        .map_err(|_| format!("expected a number, got `{text}`"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number >= 0, got {text}"))
    }
}

/// A digest of the scenario file and the `--set` overrides: every MPI process checks it
/// runs the same scenario.
#[cfg(feature = "mpi")]
pub(crate) fn scenario_digest(args: &ScenarioArgs) -> anyhow::Result<u64> {
    let text = std::fs::read(&args.scenario)?;
    let mut digest = lockstep_actors::kv::mix(text.len() as u64);
    for chunk in text.chunks(8).chain(args.set.iter().map(|s| s.as_bytes())) {
        let mut word = [0u8; 8];
        word[..chunk.len().min(8)].copy_from_slice(&chunk[..chunk.len().min(8)]);
        digest = lockstep_actors::kv::mix(digest ^ u64::from_le_bytes(word));
    }
    Ok(digest)
}
