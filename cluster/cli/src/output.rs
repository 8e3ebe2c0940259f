//! What the runs share in their output: the exit status of a report, the JSON file, the
//! progress bar of the requests.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

use crate::stdout::{out, outln};
use lockstep_plan::report::Report;

/// Prints `error: TEXT` on stderr in one write: `eprintln!` writes its pieces apart, and
/// under mpirun, whose processes share one forwarded stderr, another process's line can
/// land between `error: ` and the text.
pub(crate) fn print_error(text: &str) {
    use std::io::Write as _;
    let line = format!("error: {text}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// A command line the parser could not refuse itself (two options that do not go
/// together): exit 64, as clap's own usage errors.
#[derive(Debug)]
pub(crate) struct UsageError(pub(crate) String);

/// A configuration refused before anything started: exit 78. The library's own
/// configuration errors (a bad scenario, a refused fleet) are told apart by type.
#[derive(Debug)]
pub(crate) struct ConfigRefused(pub(crate) String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

impl std::fmt::Display for ConfigRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for ConfigRefused {}

/// What `serve` says once at startup, on stderr: a seat skew a legacy policy lets
/// through, and, without `--time-scale` or `--model`, that it answers at the zero-cost
/// backend's speed, since a benchmark against it then measures the control plane alone.
pub(crate) fn serve_notes(
    scenario: &lockstep_plan::scenario::Scenario,
    time_base: lockstep_plan::report::TimeBase,
) {
    for note in server_notes(scenario) {
        eprintln!("note: {note}");
    }
    if time_base == lockstep_plan::report::TimeBase::ZeroCost {
        eprintln!(
            "note: serving at zero modeled cost (--time-scale 0, no --model): forwards take no time, so a client's throughput and latencies measure the control plane and HTTP only; give --time-scale 1 to pace the cost model in wall time"
        );
    }
}

/// The exit status says how the run ended, so scripts need not parse the report:
/// 0 every request completed, 1 the run itself failed (a collective error, a lost device
/// or rank), 2 the fleet crashed (a fatal violation) or deadlocked, 3 the run ended but
/// some requests did not complete (each with its reason in the report).
pub(crate) fn exit_code(report: &Report) -> ExitCode {
    use lockstep_plan::report::Outcome;
    match report.outcome {
        Outcome::Completed => ExitCode::SUCCESS,
        Outcome::Failed => ExitCode::FAILURE,
        Outcome::Crashed | Outcome::Deadlocked => ExitCode::from(2),
        Outcome::Incomplete => ExitCode::from(3),
    }
}

/// The text report of a run on stdout, and under it a line when an open-loop fleet did
/// not keep up with its offered rate (the latencies then depend on the run's length).
pub(crate) fn print_report(report: &Report, scenario: &lockstep_plan::scenario::Scenario) {
    out!("{}", report.table());
    for note in server_notes(scenario) {
        outln!("note: {note}");
    }
    if let Some(note) = lockstep_plan::report::saturation_note(report, scenario.workload.as_ref()) {
        outln!("{note}");
    }
}

/// What the scenario's servers were derived with that the user should know (the seat
/// skew a legacy `seats.rederive` lets through), in the report's words: the libraries
/// log it at info level only, for RUST_LOG.
pub(crate) fn server_notes(scenario: &lockstep_plan::scenario::Scenario) -> Vec<String> {
    scenario
        .servers
        .iter()
        .filter_map(|s| s.derive(&scenario.policy).ok()?.warning)
        .collect()
}

/// Writes `value` as pretty JSON, streamed: a report's `per_request` is never held as
/// text (a million requests would take about 300 MB of it).
pub(crate) fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    use std::io::Write as _;
    let context = || format!("writing {}", path.display());
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).with_context(context)?);
    serde_json::to_writer_pretty(&mut out, value).with_context(context)?;
    out.write_all(b"\n").with_context(context)?;
    out.flush().with_context(context)
}

/// The progress bar of a run's requests (on stderr).
pub(crate) fn requests_bar() -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} {elapsed_precise} [{bar:40}] {pos}/{len} requests",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}
