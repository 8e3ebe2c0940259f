//! `lockstep ab`: the scenario simulated twice — under two policies, or two sets of
//! `--base-set` / `--treatment-set` overrides (e.g. ADP balance off and on) — side by
//! side with deltas.

use std::path::PathBuf;
use std::process::ExitCode;

use lockstep_plan::report::{Report, Slo, ab_table};

use crate::args::{ScenarioArgs, load};
use crate::output::write_json;
use crate::sim_cmd::simulate;
use crate::stdout::{out, outln};

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
    /// `KEY=VALUE` applied to the baseline only, after `--set` (repeatable), e.g.
    /// `server.attention_dp_config.enable_balance=false`.
    #[arg(long, value_name = "KEY=VALUE")]
    base_set: Vec<String>,
    /// `KEY=VALUE` applied to the treatment only, after `--set` (repeatable), e.g.
    /// `server.attention_dp_config.enable_balance=true`.
    #[arg(long, value_name = "KEY=VALUE")]
    treatment_set: Vec<String>,
    /// The baseline's name in the table and the JSON (default: its preset and its own
    /// overrides).
    #[arg(long, value_name = "NAME")]
    base_name: Option<String>,
    /// The treatment's name (default: its preset and its own overrides).
    #[arg(long, value_name = "NAME")]
    treatment_name: Option<String>,
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
        base_set,
        treatment_set,
        base_name,
        treatment_name,
        seed,
        json,
        slo,
    }: AbArgs,
) -> anyhow::Result<ExitCode> {
    let seed_or_0 = seed.unwrap_or(0);
    let side = |preset: &str, sets: &[String]| -> anyhow::Result<(Report, Vec<String>)> {
        let mut scenario = load(&args, Some(preset), seed)?;
        for s in sets {
            scenario.apply_set(s)?;
        }
        let report = simulate(&scenario, seed_or_0, None, false, 10_000, None, true)?;
        Ok((report, crate::output::server_notes(&scenario)))
    };
    let (mut a, a_notes) = side(&base, &base_set)?;
    let (mut b, b_notes) = side(&treatment, &treatment_set)?;
    // A side is named by its preset and its own overrides.
    let name = |preset: &str, sets: &[String]| {
        std::iter::once(preset)
            .chain(sets.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let base = base_name.unwrap_or_else(|| name(&base, &base_set));
    let treatment = treatment_name.unwrap_or_else(|| name(&treatment, &treatment_set));
    if let Some(slo) = &slo {
        a.apply_slo(slo);
        b.apply_slo(slo);
    }
    out!("{}", ab_table(&a, &b, &base, &treatment));
    for (side, notes) in [(&base, &a_notes), (&treatment, &b_notes)] {
        for note in notes {
            outln!("note ({side}): {note}");
        }
    }
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
