//! `lockstep validate`, `lockstep profiles` and `lockstep explain`: print what a scenario,
//! the model profiles or a Hugging Face config.json come to; nothing runs.

use std::process::ExitCode;

use lockstep_plan::validate;

use crate::args::{ScenarioArgs, load};
use crate::stdout::{out, outln};

/// `lockstep validate`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct ValidateArgs {
    #[command(flatten)]
    args: ScenarioArgs,
    /// Policy preset (applied before --set).
    #[arg(long, value_parser = ["fixed", "legacy"])]
    policy: Option<String>,
}

/// Runs `lockstep validate`.
pub(crate) fn validate(ValidateArgs { args, policy }: ValidateArgs) -> anyhow::Result<ExitCode> {
    let scenario = load(&args, policy.as_deref(), None)?;
    let (table, warnings) = validate::render(&scenario)?;
    out!("{table}");
    for w in warnings {
        eprintln!("warning: {w}");
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `lockstep profiles`.
pub(crate) fn profiles() -> anyhow::Result<ExitCode> {
    for p in lockstep_gpu::profiles() {
        outln!("{}", p.name);
        outln!(
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
            let fields: Vec<String> = map.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            outln!("  coefficients (ns): {}", fields.join(", "));
        }
        for line in p.assumptions.lines().filter(|l| !l.trim().is_empty()) {
            outln!("  {}", line.trim());
        }
        outln!();
    }
    Ok(ExitCode::SUCCESS)
}

/// Runs `lockstep explain`.
pub(crate) fn explain(args: lockstep_plan::explain::ExplainArgs) -> anyhow::Result<ExitCode> {
    out!("{}", lockstep_plan::explain::explain(&args)?);
    Ok(ExitCode::SUCCESS)
}
