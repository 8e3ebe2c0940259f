//! `lockstep sim`: the scenario's fleet replayed in virtual time; [`simulate`] is also
//! `ab`'s.

use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use lockstep_plan::model_backend::ModelBackend;
use lockstep_plan::report::{Report, Slo};
use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, SimOptions};

use crate::args::{ModelArgs, ScenarioArgs, load};
use crate::output::{exit_code, print_report, requests_bar, write_json};

/// `lockstep sim`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct SimArgs {
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
    /// Write one JSON line per server iteration and rank (every iteration then runs
    /// the whole protocol: as with --no-skip).
    #[arg(long, value_name = "PATH")]
    iter_log: Option<PathBuf>,
    /// Run every iteration through the whole protocol. By default the simulator coasts
    /// through steady decode (iterations where every request only decodes and nothing
    /// arrives, ends or transfers) without the collectives; the report is the same
    /// either way, byte for byte.
    #[arg(long)]
    no_skip: bool,
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
}

/// Runs `lockstep sim`.
pub(crate) fn run(
    SimArgs {
        args,
        policy,
        seed,
        json,
        iter_log,
        slo,
        preload,
        stall_timeout_ms,
        no_skip,
        model,
    }: SimArgs,
) -> anyhow::Result<ExitCode> {
    let scenario = load(&args, policy.as_deref(), seed)?;
    let model = model.load(seed.unwrap_or(0))?;
    let mut report = simulate(
        &scenario,
        seed.unwrap_or(0),
        iter_log.as_deref(),
        preload,
        stall_timeout_ms,
        model,
        !no_skip,
    )?;
    if let Some(slo) = &slo {
        report.apply_slo(slo);
    }
    print_report(&report, &scenario);
    if let Some(p) = json {
        write_json(&p, &report)?;
    }
    Ok(exit_code(&report))
}

pub(crate) fn simulate(
    scenario: &Scenario,
    seed: u64,
    iter_log: Option<&Path>,
    preload: bool,
    stall_timeout_ms: u64,
    model: Option<ModelBackend>,
    skip: bool,
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
            skip,
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
