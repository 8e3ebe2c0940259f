//! `lockstep search SPEC.toml`: the best configuration under latency objectives
//! (`cluster/search`), with a progress bar, the ranked table and Pareto front on
//! stdout, and files for the winners.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use crate::stdout::{out, outln};
use lockstep_search::{Alone, Progress, Share, output, spec::SearchSpec};

/// `lockstep search`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct SearchArgs {
    /// The search spec (TOML): `[model]`, `[gpus]`, `[workload]`, `[slo.p50|p90|p99]`,
    /// `[objective]`, `[space]`, `[method]` (README, "Which configuration: `lockstep
    /// search`").
    spec: PathBuf,
    /// Seeds every simulation (overrides the spec's `seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Simulations in flight at once (default: the spec's `method.jobs`, else every core).
    #[arg(long)]
    jobs: Option<u32>,
    /// Rows of the ranked table printed.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// A folder for `ranked.csv`, `search.html` and the winners as `winner-K.toml`
    /// (scenarios at the load found) and `winner-K.yml` (TensorRT-LLM's YAML).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Winners written to `--out`.
    #[arg(long, default_value_t = 3)]
    winners: usize,
}

pub(crate) fn run(args: SearchArgs) -> anyhow::Result<ExitCode> {
    let mut spec = SearchSpec::load(&args.spec)?;
    if let Some(seed) = args.seed {
        spec.seed = seed;
    }
    if let Some(jobs) = args.jobs {
        spec.method.jobs = jobs;
    }
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} {pos}/{len} candidates [{elapsed_precise}, ETA {eta}] {wide_bar}",
            )
            .expect("a valid template"),
        );
        b
    });
    let started = std::time::Instant::now();
    let mut share = world()?;
    let first = share.rank() == 0;
    let bar = bar.filter(|_| first);
    let outcome = lockstep_search::search_shared(
        &spec,
        &|p: Progress| {
            if let Some(b) = &bar {
                b.set_length(p.total);
                b.set_position(p.done);
            }
        },
        share.as_mut(),
    )?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    // Every process has the answer; one says it.
    if !first {
        return Ok(ExitCode::SUCCESS);
    }
    out!("{}", output::text(&spec, &outcome, args.top));
    outln!("searched in {:.1} s wall", started.elapsed().as_secs_f64());
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let csv = dir.join("ranked.csv");
        output::write_csv(&spec, &outcome, &csv)?;
        let html = dir.join("search.html");
        std::fs::write(&html, output::html(&spec, &outcome))
            .with_context(|| format!("writing {}", html.display()))?;
        outln!("wrote {}", csv.display());
        outln!("wrote {}", html.display());
        for note in output::write_winners(&spec, &outcome, dir, args.winners)? {
            outln!("wrote {note}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The processes sharing this search: the MPI world under `mpirun` (the MPI build),
/// else this process alone.
#[cfg(not(feature = "mpi"))]
fn world() -> anyhow::Result<Box<dyn Share>> {
    Ok(Box::new(Alone))
}

#[cfg(feature = "mpi")]
fn world() -> anyhow::Result<Box<dyn Share>> {
    let member = lockstep_transport::MpiMember::init()?;
    if member.world_size() <= 1 {
        return Ok(Box::new(Alone));
    }
    Ok(Box::new(MpiShare(member)))
}

/// The MPI world sharing a search: results are exchanged with one allgather per round.
#[cfg(feature = "mpi")]
struct MpiShare(lockstep_transport::MpiMember);

#[cfg(feature = "mpi")]
impl Share for MpiShare {
    fn rank(&self) -> usize {
        self.0.world_rank()
    }

    fn size(&self) -> usize {
        self.0.world_size()
    }

    fn allgather(&mut self, round: u64, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        use lockstep_actors::executor::{CollectiveTag, Phase};
        use lockstep_transport::Collective;
        let tag = CollectiveTag {
            iteration: round,
            phase: Phase::Gather,
        };
        Collective::allgather(&mut self.0, tag, &mine).map_err(|e| e.to_string())
    }
}
