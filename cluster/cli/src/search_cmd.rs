//! `lockstep search SPEC.toml`: the best configuration under latency objectives
//! (`cluster/search`), with a progress bar, the ranked table and Pareto front on
//! stdout, and files for the winners.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};

use lockstep_search::{Progress, output, spec::SearchSpec};

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
    let outcome = lockstep_search::search(&spec, &|p: Progress| {
        if let Some(b) = &bar {
            b.set_length(p.total);
            b.set_position(p.done);
        }
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    print!("{}", output::text(&spec, &outcome, args.top));
    println!("searched in {:.1} s wall", started.elapsed().as_secs_f64());
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let csv = dir.join("ranked.csv");
        output::write_csv(&spec, &outcome, &csv)?;
        let html = dir.join("search.html");
        std::fs::write(&html, output::html(&spec, &outcome))
            .with_context(|| format!("writing {}", html.display()))?;
        println!("wrote {}", csv.display());
        println!("wrote {}", html.display());
        for note in output::write_winners(&spec, &outcome, dir, args.winners)? {
            println!("wrote {note}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
