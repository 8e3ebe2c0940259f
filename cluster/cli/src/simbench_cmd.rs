//! `lockstep simbench`: the simulator's own speed and memory on the workloads of issue 25
//! (CPU time, peak RSS, iterations simulated per CPU second, bytes per request), and a
//! previous binary's beside them, runs interleaved.
//!
//! Every measurement is one `BINARY sim SCENARIO --set workload.num_requests=N` child,
//! so a previous binary is measured exactly as this one. Its CPU time (user + sys) and
//! peak RSS come from the OS through a measuring process between this one and the
//! child (this binary again, `simbench --measure-one -- COMMAND...`): a process whose
//! only child is the `sim` reads that child's own figures with
//! `getrusage(RUSAGE_CHILDREN)` once it has waited for it (this process, with many
//! children, would read the largest RSS of them all). The iterations are the `iterations`
//! of each `server` line of `sim`'s table, the report's `servers[].iterations`: asking
//! for `--json` would make the child serialise every request, which at a million
//! requests costs more memory than the run.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::output::write_json;
use crate::stdout::{out, outln};

/// `lockstep simbench`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct SimbenchArgs {
    /// A previous `lockstep` binary to compare with: each workload runs the two in turn
    /// (new, old, then old, new, ...), `--runs` pairs, and the table adds the median of
    /// the pairs' ratios old / new.
    #[arg(long, value_name = "PATH")]
    baseline: Option<PathBuf>,
    /// The binary measured (default: this one).
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// Runs of each binary per workload.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    runs: u32,
    /// A workload to run (repeatable; default: all of them).
    #[arg(long = "workload", value_enum, value_name = "NAME")]
    workloads: Vec<Workload>,
    /// Every workload but `agg-1m` (the long one).
    #[arg(long, conflicts_with = "workloads")]
    quick: bool,
    /// One more argument for the measured binary's `sim`, not the baseline's
    /// (repeatable), e.g. `--extra-arg=--no-skip`.
    #[arg(long = "extra-arg", value_name = "ARG", allow_hyphen_values = true)]
    extra_args: Vec<String>,
    /// Multiply every workload's request count (e.g. 0.01 for a quick look; the
    /// figures then describe smaller runs than the issue's).
    #[arg(long, default_value_t = 1.0, value_parser = positive_scale)]
    scale: f64,
    /// Write the figures, every run's included, as JSON.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Internal: run the command after `--` as the only child of this process and print
    /// its exit status, CPU time, peak RSS and output as one JSON line.
    #[arg(long, hide = true)]
    measure_one: bool,
    /// With --measure-one: the command.
    #[arg(last = true, hide = true)]
    command: Vec<String>,
}

/// A built-in workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Workload {
    /// `examples/disagg-8k1k-con4096.toml`: 20,480 requests, 8k in / 1k out, one ctx and
    /// one gen server.
    Disagg,
    /// `examples/simbench/agg-one-replica-2k256.toml`: one replica, B 128,
    /// MAX_UTILIZATION, 20,480 × 2,048 / 256 tokens.
    OneReplica,
    /// `examples/agg-dp8-chunked.toml` with 256,000 requests.
    #[value(name = "agg-256k")]
    #[serde(rename = "agg-256k")]
    Agg256k,
    /// `examples/agg-dp8-chunked.toml` with 1,000,000 requests.
    #[value(name = "agg-1m")]
    #[serde(rename = "agg-1m")]
    Agg1m,
}

const ALL: [Workload; 4] = [
    Workload::Disagg,
    Workload::OneReplica,
    Workload::Agg256k,
    Workload::Agg1m,
];

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Disagg => "disagg",
            Workload::OneReplica => "one-replica",
            Workload::Agg256k => "agg-256k",
            Workload::Agg1m => "agg-1m",
        }
    }

    /// The scenario (its path under `examples/` and its text, built into the binary so
    /// that the benchmark runs from any folder) and the requests at scale 1.
    fn scenario(self) -> (&'static str, &'static str, u64) {
        const DISAGG: &str = include_str!("../../../examples/disagg-8k1k-con4096.toml");
        const ONE: &str = include_str!("../../../examples/simbench/agg-one-replica-2k256.toml");
        const AGG: &str = include_str!("../../../examples/agg-dp8-chunked.toml");
        match self {
            Workload::Disagg => ("disagg-8k1k-con4096.toml", DISAGG, 20_480),
            Workload::OneReplica => ("simbench/agg-one-replica-2k256.toml", ONE, 20_480),
            Workload::Agg256k => ("agg-dp8-chunked.toml", AGG, 256_000),
            Workload::Agg1m => ("agg-dp8-chunked.toml", AGG, 1_000_000),
        }
    }
}

/// `--scale`: a finite number above 0.
fn positive_scale(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("must be a finite number > 0, got `{text}`")),
    }
}

/// What the measuring process reports of its one child.
#[derive(Debug, Serialize, Deserialize)]
struct ChildRun {
    /// Exit status; `None`: killed by `signal`.
    status: Option<i32>,
    signal: Option<i32>,
    user_s: f64,
    sys_s: f64,
    wall_s: f64,
    peak_rss_bytes: u64,
    stdout: String,
    stderr: String,
}

/// One measured run of `sim`.
#[derive(Debug, Clone, Serialize)]
struct Run {
    /// user + sys.
    cpu_s: f64,
    user_s: f64,
    sys_s: f64,
    wall_s: f64,
    peak_rss_bytes: u64,
    /// Σ over servers of the report's `iterations`; `None` if the table showed none.
    iterations: Option<u64>,
}

/// Smallest, median, largest.
#[derive(Debug, Clone, Copy, Serialize)]
struct Spread {
    min: f64,
    median: f64,
    max: f64,
}

impl Spread {
    fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut v: Vec<f64> = values.into_iter().collect();
        v.sort_by(f64::total_cmp);
        Spread {
            min: v.first().copied().unwrap_or(f64::NAN),
            median: median_sorted(&v),
            max: v.last().copied().unwrap_or(f64::NAN),
        }
    }
}

fn median_sorted(v: &[f64]) -> f64 {
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    Spread::of(values).median
}

/// One binary's runs of one workload and their figures.
#[derive(Debug, Serialize)]
struct Figures {
    binary: PathBuf,
    cpu_s: Spread,
    peak_rss_bytes: Spread,
    iterations: Option<u64>,
    /// Median over the runs of iterations / CPU second.
    iterations_per_cpu_s: Option<f64>,
    /// Median peak RSS / requests.
    bytes_per_request: f64,
    runs: Vec<Run>,
}

impl Figures {
    fn of(binary: &Path, runs: Vec<Run>, requests: u64) -> Figures {
        let iterations = runs.iter().find_map(|r| r.iterations);
        let peak_rss_bytes = Spread::of(runs.iter().map(|r| r.peak_rss_bytes as f64));
        Figures {
            binary: binary.to_path_buf(),
            cpu_s: Spread::of(runs.iter().map(|r| r.cpu_s)),
            peak_rss_bytes,
            iterations,
            iterations_per_cpu_s: iterations.map(|_| {
                median(
                    runs.iter()
                        .filter_map(|r| Some(r.iterations? as f64 / r.cpu_s)),
                )
            }),
            bytes_per_request: peak_rss_bytes.median / requests.max(1) as f64,
            runs,
        }
    }
}

/// The baseline against the measured binary, pair by pair.
#[derive(Debug, Serialize)]
struct Ratios {
    /// Median over the pairs of baseline CPU / new CPU (above 1: the new one is faster).
    cpu_old_over_new: f64,
    /// Median over the pairs of baseline peak RSS / new peak RSS.
    rss_old_over_new: f64,
    cpu_per_pair: Vec<f64>,
    rss_per_pair: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct WorkloadResult {
    workload: Workload,
    scenario: String,
    requests: u64,
    new: Figures,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline: Option<Figures>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ratios: Option<Ratios>,
}

/// (peak RSS at 1 M − at 256 k) / the requests between them, per binary.
#[derive(Debug, Serialize)]
struct Marginal {
    from_requests: u64,
    to_requests: u64,
    new_bytes_per_request: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline_bytes_per_request: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Summary {
    binary: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline: Option<PathBuf>,
    runs: u32,
    scale: f64,
    extra_args: Vec<String>,
    workloads: Vec<WorkloadResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    marginal_bytes_per_request: Option<Marginal>,
}

/// The scenarios, written out for the children; removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> anyhow::Result<ScratchDir> {
        let dir = std::env::temp_dir().join(format!("lockstep-simbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `lockstep simbench`.
pub(crate) fn run(args: SimbenchArgs) -> anyhow::Result<ExitCode> {
    if args.measure_one {
        return measure_one(&args.command);
    }
    if !args.command.is_empty() {
        bail!("unexpected arguments after `--`: {:?}", args.command);
    }
    let me = std::env::current_exe().context("finding this binary")?;
    let binary = match &args.binary {
        Some(b) => checked_binary("--binary", b)?,
        None => me.clone(),
    };
    let baseline = match &args.baseline {
        Some(b) => Some(checked_binary("--baseline", b)?),
        None => None,
    };
    let workloads: Vec<Workload> = if !args.workloads.is_empty() {
        ALL.into_iter()
            .filter(|w| args.workloads.contains(w))
            .collect()
    } else if args.quick {
        ALL.into_iter().filter(|w| *w != Workload::Agg1m).collect()
    } else {
        ALL.to_vec()
    };
    let scratch = ScratchDir::new()?;
    let mut results = Vec::new();
    for w in workloads {
        let (file, text, base) = w.scenario();
        let requests = ((base as f64 * args.scale).round() as u64).max(1);
        let path = scratch.0.join(file.replace('/', "-"));
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        let sim_args = |extra: &[String]| -> Vec<String> {
            let mut a = vec![
                "sim".to_string(),
                path.display().to_string(),
                "--set".into(),
                format!("workload.num_requests={requests}"),
            ];
            a.extend(extra.iter().cloned());
            a
        };
        let new_args = sim_args(&args.extra_args);
        let old_args = sim_args(&[]);
        let mut new_runs = Vec::new();
        let mut old_runs = Vec::new();
        for i in 0..args.runs {
            let progress = format!("{}/{}", i + 1, args.runs);
            let new_first = i % 2 == 0;
            if new_first || baseline.is_none() {
                new_runs.push(measure(&me, w, "new", &progress, &binary, &new_args)?);
            }
            if let Some(old) = &baseline {
                old_runs.push(measure(&me, w, "baseline", &progress, old, &old_args)?);
                if !new_first {
                    new_runs.push(measure(&me, w, "new", &progress, &binary, &new_args)?);
                }
            }
        }
        let ratios = baseline.as_ref().map(|_| {
            let cpu: Vec<f64> = old_runs
                .iter()
                .zip(&new_runs)
                .map(|(o, n)| o.cpu_s / n.cpu_s)
                .collect();
            let rss: Vec<f64> = old_runs
                .iter()
                .zip(&new_runs)
                .map(|(o, n)| o.peak_rss_bytes as f64 / n.peak_rss_bytes as f64)
                .collect();
            Ratios {
                cpu_old_over_new: median(cpu.iter().copied()),
                rss_old_over_new: median(rss.iter().copied()),
                cpu_per_pair: cpu,
                rss_per_pair: rss,
            }
        });
        results.push(WorkloadResult {
            workload: w,
            scenario: format!("examples/{file}"),
            requests,
            new: Figures::of(&binary, new_runs, requests),
            baseline: baseline
                .as_ref()
                .map(|b| Figures::of(b, old_runs, requests)),
            ratios,
        });
    }
    drop(scratch);
    let marginal = marginal(&results);
    let summary = Summary {
        binary,
        baseline,
        runs: args.runs,
        scale: args.scale,
        extra_args: args.extra_args,
        workloads: results,
        marginal_bytes_per_request: marginal,
    };
    out!("{}", table(&summary));
    if let Some(p) = &args.json {
        write_json(p, &summary)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The path of a binary given on the command line, if it is a file.
fn checked_binary(flag: &str, path: &Path) -> anyhow::Result<PathBuf> {
    if !path.is_file() {
        bail!(
            "{flag} {}: no such file (a lockstep binary to run `sim` with)",
            path.display()
        );
    }
    Ok(path.to_path_buf())
}

/// One run of `binary` with `args`, measured by a child `me simbench --measure-one`.
fn measure(
    me: &Path,
    w: Workload,
    which: &str,
    progress: &str,
    binary: &Path,
    args: &[String],
) -> anyhow::Result<Run> {
    let what = || {
        format!(
            "workload {}, {which} binary {}: `{} {}`",
            w.name(),
            binary.display(),
            binary.display(),
            args.join(" ")
        )
    };
    let out = Command::new(me)
        .args(["simbench", "--measure-one", "--"])
        .arg(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| {
            format!(
                "{}: starting the measuring process {}",
                what(),
                me.display()
            )
        })?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            what(),
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .trim_start_matches("error: ")
        );
    }
    let child: ChildRun = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("{}: reading the measuring process's figures", what()))?;
    match (child.status, child.signal) {
        (Some(0), _) => {}
        (status, signal) => {
            let how = match (status, signal) {
                (Some(c), _) => format!("exited with status {c}"),
                (None, Some(s)) => format!("was killed by signal {s}"),
                (None, None) => "ended abnormally".to_string(),
            };
            let mut said = tail(&child.stderr, 2000);
            if said.is_empty() {
                said = tail(&child.stdout, 2000);
            }
            if said.is_empty() {
                bail!("{} {how} (and printed nothing)", what());
            }
            bail!("{} {how}: {said}", what());
        }
    }
    let run = Run {
        cpu_s: child.user_s + child.sys_s,
        user_s: child.user_s,
        sys_s: child.sys_s,
        wall_s: child.wall_s,
        peak_rss_bytes: child.peak_rss_bytes,
        iterations: table_iterations(&child.stdout),
    };
    eprintln!(
        "simbench: {} {which} {progress}: CPU {:.3} s, peak RSS {:.1} MB",
        w.name(),
        run.cpu_s,
        run.peak_rss_bytes as f64 / 1e6
    );
    Ok(run)
}

/// The last `max` bytes of `text` (at a character boundary), trimmed.
fn tail(text: &str, max: usize) -> String {
    let text = text.trim();
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}

/// Σ of `iterations N` over the `server ...: iterations N ...` lines of `sim`'s table.
fn table_iterations(stdout: &str) -> Option<u64> {
    let mut found = false;
    let mut total = 0u64;
    for line in stdout.lines() {
        if !line.starts_with("server ") {
            continue;
        }
        let Some((_, rest)) = line.split_once("): iterations ") else {
            continue;
        };
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(n) = digits.parse::<u64>() {
            total += n;
            found = true;
        }
    }
    found.then_some(total)
}

/// `--measure-one -- COMMAND...`: runs the command as this process's only child, output
/// captured, and prints one JSON line of its [`ChildRun`].
fn measure_one(command: &[String]) -> anyhow::Result<ExitCode> {
    use std::os::unix::process::ExitStatusExt;

    use nix::sys::resource::{UsageWho, getrusage};
    use nix::sys::time::TimeValLike;

    let Some((program, args)) = command.split_first() else {
        bail!("--measure-one needs a command after `--`");
    };
    let start = Instant::now();
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("starting {program}"))?;
    let wall_s = start.elapsed().as_secs_f64();
    // This process has had one child, waited for: its figures are that child's.
    let usage = getrusage(UsageWho::RUSAGE_CHILDREN).context("getrusage(RUSAGE_CHILDREN)")?;
    let seconds = |t: nix::sys::time::TimeVal| t.num_microseconds() as f64 / 1e6;
    // Linux and the BSDs count ru_maxrss in KiB, macOS in bytes.
    let rss_unit: u64 = if cfg!(target_os = "macos") { 1 } else { 1024 };
    let child = ChildRun {
        status: out.status.code(),
        signal: out.status.signal(),
        user_s: seconds(usage.user_time()),
        sys_s: seconds(usage.system_time()),
        wall_s,
        peak_rss_bytes: u64::try_from(usage.max_rss()).unwrap_or(0) * rss_unit,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    outln!("{}", serde_json::to_string(&child)?);
    Ok(ExitCode::SUCCESS)
}

/// (peak RSS at `agg-1m` − at `agg-256k`) / the requests between them, when both ran.
fn marginal(results: &[WorkloadResult]) -> Option<Marginal> {
    let find = |w| results.iter().find(|r| r.workload == w);
    let (small, large) = (find(Workload::Agg256k)?, find(Workload::Agg1m)?);
    if large.requests <= small.requests {
        return None;
    }
    let extra = (large.requests - small.requests) as f64;
    let per =
        |l: &Figures, s: &Figures| (l.peak_rss_bytes.median - s.peak_rss_bytes.median) / extra;
    Some(Marginal {
        from_requests: small.requests,
        to_requests: large.requests,
        new_bytes_per_request: per(&large.new, &small.new),
        baseline_bytes_per_request: match (&large.baseline, &small.baseline) {
            (Some(l), Some(s)) => Some(per(l, s)),
            _ => None,
        },
    })
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A finite number rounded to a whole, with thousands separators and its sign.
fn whole(x: f64) -> String {
    if !x.is_finite() {
        return "—".into();
    }
    let sign = if x < -0.5 { "-" } else { "" };
    format!("{sign}{}", thousands(x.abs().round() as u64))
}

fn plural(n: u32) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The printed table.
fn table(s: &Summary) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let _ = writeln!(o, "simbench: {} (new)", s.binary.display());
    if let Some(b) = &s.baseline {
        let _ = writeln!(
            o,
            "  against {} (baseline), {} run{} of each per workload, interleaved",
            b.display(),
            s.runs,
            plural(s.runs)
        );
    } else {
        let _ = writeln!(o, "  {} run{} per workload", s.runs, plural(s.runs));
    }
    if !s.extra_args.is_empty() {
        let _ = writeln!(
            o,
            "  new binary's sim also given: {}",
            s.extra_args.join(" ")
        );
    }
    if s.scale != 1.0 {
        let _ = writeln!(o, "  request counts scaled by {}", s.scale);
    }
    let _ = writeln!(
        o,
        "  CPU = user + sys of the sim process; RSS = its peak resident set (MB = 10^6 bytes)\n"
    );
    let _ = writeln!(
        o,
        "{:<12} {:>10}  {:<9} {:>27}  {:>26}  {:>12}  {:>12}  {:>9}",
        "workload",
        "requests",
        "binary",
        "CPU s min / median / max",
        "peak RSS MB min/med/max",
        "iterations",
        "iter / CPU s",
        "B/request"
    );
    let row = |o: &mut String, name: &str, requests: &str, label: &str, f: &Figures| {
        let mb = |x: f64| x / 1e6;
        let _ = writeln!(
            o,
            "{:<12} {:>10}  {:<9} {:>27}  {:>26}  {:>12}  {:>12}  {:>9}",
            name,
            requests,
            label,
            format!(
                "{:.3} / {:.3} / {:.3}",
                f.cpu_s.min, f.cpu_s.median, f.cpu_s.max
            ),
            format!(
                "{:.1} / {:.1} / {:.1}",
                mb(f.peak_rss_bytes.min),
                mb(f.peak_rss_bytes.median),
                mb(f.peak_rss_bytes.max)
            ),
            f.iterations.map_or("—".into(), thousands),
            f.iterations_per_cpu_s.map_or("—".into(), whole),
            whole(f.bytes_per_request),
        );
    };
    for r in &s.workloads {
        row(
            &mut o,
            r.workload.name(),
            &thousands(r.requests),
            "new",
            &r.new,
        );
        if let Some(b) = &r.baseline {
            row(&mut o, "", "", "baseline", b);
        }
        if let Some(q) = &r.ratios {
            let _ = writeln!(
                o,
                "{:<12} {:>10}  {:<9} {:>27}  {:>26}",
                "",
                "",
                "old/new",
                format!("×{:.2}", q.cpu_old_over_new),
                format!("×{:.2}", q.rss_old_over_new),
            );
        }
    }
    if let Some(m) = &s.marginal_bytes_per_request {
        let _ = write!(
            o,
            "\nbytes per request, agg-256k → agg-1m: (peak RSS at {} − at {}) / {} requests: new {} B",
            thousands(m.to_requests),
            thousands(m.from_requests),
            thousands(m.to_requests - m.from_requests),
            whole(m.new_bytes_per_request),
        );
        if let Some(b) = m.baseline_bytes_per_request {
            let _ = write!(o, ", baseline {} B", whole(b));
        }
        let _ = writeln!(o);
    }
    if s.baseline.is_some() {
        let _ = writeln!(
            o,
            "\nold/new: the median over the run pairs of the baseline's figure over the new binary's (above 1: the new one is faster or smaller)"
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tables_iterations_are_summed_over_servers() {
        let out = "requests 10\nserver ctx0 (ctx, dp 4, B 2): iterations 120 forward 100 vetoed 0\n  rank 0 ...\nserver gen1 (gen, dp 1, B 8): iterations 30 forward 30\n";
        assert_eq!(table_iterations(out), Some(150));
        assert_eq!(table_iterations("no servers here\n"), None);
    }

    #[test]
    fn spreads_and_separators() {
        let s = Spread::of([3.0, 1.0, 2.0, 10.0]);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.5, 10.0));
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(999), "999");
        assert_eq!(whole(-1234.4), "-1,234");
        assert_eq!(tail("aé", 1), "");
    }
}
