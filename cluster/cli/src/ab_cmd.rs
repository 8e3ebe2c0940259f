//! `lockstep ab`: the scenario simulated under two policies, side by side with deltas.

use std::path::PathBuf;
use std::process::ExitCode;

use lockstep_plan::report::{Slo, ab_table};

use crate::args::{ScenarioArgs, load};
use crate::output::write_json;
use crate::sim_cmd::simulate;

/// `lockstep ab`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct AbArgs {
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
}

/// Runs `lockstep ab`.
pub(crate) fn run(
    AbArgs {
        args,
        base,
        treatment,
        seed,
        json,
        slo,
    }: AbArgs,
) -> anyhow::Result<ExitCode> {
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
