//! `lockstep report`: the HTML page of plots of a run's JSON (or of both runs of `ab`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::stdout::outln;
use anyhow::Context;

/// `lockstep report`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct ReportArgs {
    /// The JSON report.
    run: PathBuf,
    /// Where the page goes.
    #[arg(short, long, value_name = "PATH", default_value = "report.html")]
    out: PathBuf,
}

/// Runs `lockstep report`.
pub(crate) fn run(ReportArgs { run, out }: ReportArgs) -> anyhow::Result<ExitCode> {
    let text =
        std::fs::read_to_string(&run).with_context(|| format!("reading {}", run.display()))?;
    let runs = lockstep_plan::report::html::parse_run_file(&text).with_context(|| {
        format!(
            "{} is not a lockstep report (the JSON of `sim`/`run --json` or `ab --json`)",
            run.display()
        )
    })?;
    let page = lockstep_plan::report::html::render(&runs);
    std::fs::write(&out, page).with_context(|| format!("writing {}", out.display()))?;
    outln!(
        "wrote {} ({} run{})",
        out.display(),
        runs.len(),
        if runs.len() == 1 { "" } else { "s" }
    );
    Ok(ExitCode::SUCCESS)
}
