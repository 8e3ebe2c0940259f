//! Swarm testing: many random, valid, small scenarios run under the fixed policy, each
//! classified, every bad one shrunk to a minimal scenario file.
//!
//! - [`generate`]: seed → scenario text (TOML), across every dimension of the format.
//! - [`run_one`]: text → [`Finding`]: parse, run (simulator or threads driver) on a
//!   worker thread with a wall-clock limit and a panic guard, [`classify`].
//! - [`shrink`]: a bad scenario → the smallest variant found with the same finding.
//! - [`run_swarm`]: all of it for `runs` seeds, writing the shrunk files.
//!
//! `lockstep swarm --runs N --seed S` is the command; `cluster/cli/tests/swarm.rs` the CI run.

#![forbid(unsafe_code)]

mod generate;
mod shrink;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once, mpsc};
use std::time::{Duration, Instant};

use lockstep_actors::config::{CacheTransceiverConfig, Role};
use lockstep_actors::vocab::FailureKind;

use lockstep_plan::report::{Outcome, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;
use lockstep_runtime::RuntimeError;
use lockstep_sim::{self as sim, SimError, SimOptions};

pub use generate::generate;
pub use shrink::{Shrunk, shrink, size};

/// How one run ended, from the best (clean) to the worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Every request completed, nothing violated.
    Clean,
    /// Ended (`incomplete`); the only failed requests are KV transfers that timed out,
    /// in a scenario that injects losses (`[faults]`) or sets short transfer timeouts.
    FaultOnly,
    /// Ended, but a §10 invariant was violated (a non-fatal one).
    Violation,
    /// Ended, but some request failed for another reason.
    FailedWithoutFault,
    /// `completed + failed != submitted`, or the per-request list disagrees.
    Accounting,
    /// Ended, but a server still held KV blocks at the end.
    Leak,
    /// A fatal violation (the real executor would crash).
    Crashed,
    /// Work remained and nothing could progress.
    Deadlocked,
    /// The run itself failed (`Outcome::Failed`: a collective error, a lost rank).
    RunFailed,
    /// The driver returned an error that is not a refusal (a protocol bug, a thread
    /// that could not start, a starved front).
    Error,
    /// The run panicked.
    Panic,
    /// The run did not end within the wall-clock limit.
    Timeout,
    /// The product refused the scenario (parse, validation, planning): a generator bug,
    /// or a refusal to narrow the generator around.
    Refused,
}

impl Class {
    /// Every class, in order.
    pub const ALL: [Class; 13] = [
        Class::Clean,
        Class::FaultOnly,
        Class::Violation,
        Class::FailedWithoutFault,
        Class::Accounting,
        Class::Leak,
        Class::Crashed,
        Class::Deadlocked,
        Class::RunFailed,
        Class::Error,
        Class::Panic,
        Class::Timeout,
        Class::Refused,
    ];

    /// The name in summaries and file names.
    pub fn name(self) -> &'static str {
        match self {
            Class::Clean => "clean",
            Class::FaultOnly => "fault-only",
            Class::Violation => "violation",
            Class::FailedWithoutFault => "failed-without-fault",
            Class::Accounting => "accounting",
            Class::Leak => "kv-leak",
            Class::Crashed => "crashed",
            Class::Deadlocked => "deadlocked",
            Class::RunFailed => "run-failed",
            Class::Error => "error",
            Class::Panic => "panic",
            Class::Timeout => "timeout",
            Class::Refused => "refused",
        }
    }

    /// Clean or failed only by injected faults: what the fixed policy must always give.
    pub fn is_ok(self) -> bool {
        matches!(self, Class::Clean | Class::FaultOnly)
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A run's class, with what identifies the defect (`signature`, compared when
/// shrinking) and what happened in words (`detail`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// The class.
    pub class: Class,
    /// What a shrunk variant must keep besides the class: the violation kinds, the
    /// failure reason, the error or the panic message (numbers removed), the role of a
    /// deadlocked server. Empty when the class says all (timeout, accounting, leak).
    pub signature: String,
    /// The outcome detail, the failure, the panic message or the error.
    pub detail: String,
}

impl Finding {
    fn new(class: Class, signature: impl Into<String>, detail: impl Into<String>) -> Finding {
        Finding {
            class,
            signature: signature.into(),
            detail: detail.into(),
        }
    }

    /// Whether `other` shows the same defect: same class and signature.
    pub fn same_bug(&self, other: &Finding) -> bool {
        self.class == other.class && self.signature == other.signature
    }
}

/// Words without their numbers (`N` for every run of digits), at most 160 characters:
/// what stays the same when a scenario shrinks.
fn normalized(text: &str) -> String {
    let mut out = String::new();
    let mut in_number = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
        if out.len() >= 160 {
            break;
        }
    }
    out
}

/// Whether the scenario injects faults a request may legitimately fail of: lost KV
/// (`[faults]`), or a transfer or pull timeout below the default on a ctx or gen server.
pub fn injects_faults(scenario: &Scenario) -> bool {
    let defaults = CacheTransceiverConfig::default();
    scenario.faults.lost_transfer_every.is_some()
        || scenario.faults.timeouts_lost
        || scenario.servers.iter().any(|s| {
            let ct = &s.cache_transceiver_config;
            s.role != Role::Agg
                && (ct.kv_transfer_timeout_ms < defaults.kv_transfer_timeout_ms
                    || ct.kv_pull_timeout_ms < defaults.kv_pull_timeout_ms)
        })
}

/// The role of the first server a deadlock's detail names (`server `gen0`: ...`), so
/// that shrinking keeps a deadlock on the same side of a disaggregated fleet.
fn stuck_role(detail: &str, scenario: &Scenario) -> String {
    detail
        .split("server `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .and_then(|name| scenario.servers.iter().find(|s| s.name == name))
        .map(|s| format!("on a {} server", s.role.name()))
        .unwrap_or_default()
}

/// Classifies a report of `scenario`.
pub fn classify(report: &Report, scenario: &Scenario) -> Finding {
    let detail = report.outcome_detail.clone().unwrap_or_default();
    let kinds = |fatal_only: bool| {
        let mut kinds: Vec<&str> = report
            .servers
            .iter()
            .flat_map(|s| &s.violations)
            .filter(|v| !fatal_only || v.kind.is_fatal())
            .map(|v| v.kind.name())
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        kinds.join(",")
    };
    match report.outcome {
        Outcome::Crashed => return Finding::new(Class::Crashed, kinds(true), detail),
        Outcome::Deadlocked => {
            return Finding::new(Class::Deadlocked, stuck_role(&detail, scenario), detail);
        }
        Outcome::Failed => return Finding::new(Class::RunFailed, normalized(&detail), detail),
        Outcome::Completed | Outcome::Incomplete => {}
    }
    let r = &report.requests;
    let failures: Vec<(Option<FailureKind>, &str)> = report
        .per_request
        .iter()
        .filter_map(|d| Some((d.failure_kind(), d.failure()?)))
        .collect();
    if r.completed + r.failed != r.submitted
        || report.per_request.len() as u64 != r.submitted
        || failures.len() as u64 != r.failed
    {
        return Finding::new(
            Class::Accounting,
            "",
            format!(
                "submitted {} completed {} failed {}; {} per-request entries, {} with a failure",
                r.submitted,
                r.completed,
                r.failed,
                report.per_request.len(),
                failures.len()
            ),
        );
    }
    let violations: u64 = report.servers.iter().map(|s| s.violation_count).sum();
    if violations > 0 {
        let first = report
            .servers
            .iter()
            .flat_map(|s| s.violations.iter().map(move |v| format!("{}: {v}", s.name)))
            .next()
            .unwrap_or_default();
        return Finding::new(
            Class::Violation,
            kinds(false),
            format!("{violations} violations; first: {first}"),
        );
    }
    if let Some(s) = report.servers.iter().find(|s| s.kv.used_blocks_at_end > 0) {
        return Finding::new(
            Class::Leak,
            "",
            format!(
                "server `{}` holds {} KV blocks at the end",
                s.name, s.kv.used_blocks_at_end
            ),
        );
    }
    if failures.is_empty() {
        return Finding::new(Class::Clean, "", "");
    }
    let faults = injects_faults(scenario);
    match failures
        .iter()
        // A KV transfer that timed out (lost or slow), or KV its gen server did not pull
        // in time, is what injected faults cause.
        .find(|(kind, _)| !(faults && *kind == Some(FailureKind::TransferTimeout)))
    {
        None => Finding::new(
            Class::FaultOnly,
            "",
            format!(
                "{} of {} requests failed by injected faults",
                failures.len(),
                r.submitted
            ),
        ),
        Some((_, reason)) => Finding::new(
            Class::FailedWithoutFault,
            normalized(reason),
            format!(
                "{} of {} requests failed; e.g. {reason}",
                failures.len(),
                r.submitted
            ),
        ),
    }
}

/// Which driver runs a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Driver {
    /// The simulator (`stall_bound_ns` default, no preload).
    Sim,
    /// The threads driver, zero-cost backend (`time_scale` 0), no preload.
    Threads,
}

impl Driver {
    /// The name in summaries and file names.
    pub fn name(self) -> &'static str {
        match self {
            Driver::Sim => "sim",
            Driver::Threads => "threads",
        }
    }
}

/// Wall-clock limits of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A simulator run taking longer is a [`Class::Timeout`].
    pub sim_wall: Duration,
    /// A threads-driver run taking longer is a [`Class::Timeout`].
    pub threads_wall: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            sim_wall: Duration::from_secs(10),
            threads_wall: Duration::from_secs(60),
        }
    }
}

/// The threads driver's options in a swarm: the real time of a stall and of a
/// collective wait bounded well inside the wall-clock limit.
pub fn threads_options() -> RealOptions {
    RealOptions {
        preload: false,
        stall_bound: Duration::from_secs(2),
        collective_timeout: Duration::from_secs(10),
        ..RealOptions::default()
    }
}

/// Prefix of the worker threads' names; the panic hook keeps their panics quiet.
const WORKER: &str = "swarm-run";

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn payload_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// Installs (once) a panic hook that records a swarm worker's panic, with its
/// location, instead of printing it; every other thread's panic goes to the hook that
/// was there before.
fn capture_worker_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let worker = std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with(WORKER));
            if worker {
                let at = info
                    .location()
                    .map(|l| format!(" (at {}:{})", l.file(), l.line()))
                    .unwrap_or_default();
                let text = format!("{}{at}", payload_text(info.payload()));
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(text));
            } else {
                previous(info);
            }
        }));
    });
}

/// How a guarded call ended.
enum Guarded<T> {
    Done(T),
    Panicked(String),
    TimedOut,
    NotStarted(String),
}

/// Runs `f` on a worker thread, catching a panic, waiting at most `limit`. A worker
/// past its limit is left running (a thread cannot be stopped from outside); it ends
/// with the process.
fn guarded<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Guarded<T> {
    capture_worker_panics();
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name(WORKER.into())
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
                LAST_PANIC
                    .with(|l| l.borrow_mut().take())
                    .unwrap_or_else(|| payload_text(&*p))
            });
            let _ = tx.send(result);
        });
    let handle = match spawned {
        Ok(h) => h,
        Err(e) => return Guarded::NotStarted(e.to_string()),
    };
    match rx.recv_timeout(limit) {
        Ok(result) => {
            let _ = handle.join();
            match result {
                Ok(v) => Guarded::Done(v),
                Err(message) => Guarded::Panicked(message),
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => Guarded::TimedOut,
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Guarded::Panicked("the worker ended without a result".into())
        }
    }
}

/// What one guarded run produced.
type RunResult = Result<Report, (Class, String)>;

fn run_sim(scenario: Scenario) -> RunResult {
    sim::run(&scenario, SimOptions::default()).map_err(|e| match e {
        SimError::Plan(_) | SimError::Config(_) => (Class::Refused, e.to_string()),
        _ => (Class::Error, e.to_string()),
    })
}

fn run_threads(scenario: Scenario) -> RunResult {
    lockstep_runtime::threads::run(&scenario, &threads_options()).map_err(|e| match e {
        RuntimeError::Plan(_) => (Class::Refused, e.to_string()),
        _ => (Class::Error, e.to_string()),
    })
}

/// The wall-clock limit of a threads-driver run: its limit, or more when the scenario
/// itself lasts longer in real time. The threads driver keeps arrivals (a trace's
/// timestamps) and transfer timeouts in real time, so a scenario whose simulation lasts
/// 120 virtual seconds takes about as long there; the limit is then 1.5 times that plus
/// 10 s.
fn threads_limit(scenario: &Scenario, limits: &Limits) -> Duration {
    let modeled = guarded(limits.sim_wall, {
        let owned = scenario.clone();
        move || run_sim(owned)
    });
    match modeled {
        Guarded::Done(Ok(report)) => limits
            .threads_wall
            .max(Duration::from_secs_f64(report.virtual_time_s * 1.5 + 10.0)),
        _ => limits.threads_wall,
    }
}

/// Parses `text`, runs it under `driver` with the limits and a panic guard, and
/// classifies the result. Never panics, never hangs longer than the limit.
pub fn run_one(text: &str, driver: Driver, limits: &Limits) -> Finding {
    run_one_with_report(text, driver, limits).0
}

/// [`run_one`], with the report when the run produced one.
pub fn run_one_with_report(
    text: &str,
    driver: Driver,
    limits: &Limits,
) -> (Finding, Option<Box<Report>>) {
    let scenario = match Scenario::parse(text, "swarm") {
        Ok(s) => s,
        Err(e) => {
            let message = e.to_string();
            return (
                Finding::new(Class::Refused, normalized(&message), message),
                None,
            );
        }
    };
    let limit = match driver {
        Driver::Sim => limits.sim_wall,
        Driver::Threads => threads_limit(&scenario, limits),
    };
    let owned = scenario.clone();
    let result = guarded(limit, move || match driver {
        Driver::Sim => run_sim(owned),
        Driver::Threads => run_threads(owned),
    });
    match result {
        Guarded::Done(Ok(report)) => (classify(&report, &scenario), Some(Box::new(report))),
        Guarded::Done(Err((class, message))) => {
            (Finding::new(class, normalized(&message), message), None)
        }
        Guarded::Panicked(message) => (
            Finding::new(Class::Panic, normalized(&message), message),
            None,
        ),
        Guarded::TimedOut => (
            Finding::new(
                Class::Timeout,
                "",
                format!("no result within {:.1} s of wall time", limit.as_secs_f64()),
            ),
            None,
        ),
        Guarded::NotStarted(message) => {
            (Finding::new(Class::Error, "worker thread", message), None)
        }
    }
}

/// A swarm's settings.
#[derive(Debug, Clone)]
pub struct SwarmConfig {
    /// Scenarios to generate and run.
    pub runs: u64,
    /// Scenario `i` (from 0) uses seed `seed + i`.
    pub seed: u64,
    /// Where the shrunk scenarios go (`None`: not written).
    pub out: Option<PathBuf>,
    /// Also run every K-th scenario under the threads driver (0: never).
    pub threads_every: u64,
    /// Worker threads running scenarios at once (at least 1).
    pub jobs: usize,
    /// Wall-clock limits of one run.
    pub limits: Limits,
    /// Runs one shrink may spend (0: no shrinking).
    pub shrink_budget: usize,
    /// Also shrink the runs that failed only by injected faults.
    pub shrink_fault_only: bool,
}

impl Default for SwarmConfig {
    fn default() -> Self {
        SwarmConfig {
            runs: 100,
            seed: 0,
            out: None,
            threads_every: 0,
            jobs: std::thread::available_parallelism().map_or(1, usize::from),
            limits: Limits::default(),
            shrink_budget: 400,
            shrink_fault_only: false,
        }
    }
}

/// One run of a swarm that was not clean (or, with `shrink_fault_only`, fault-only).
#[derive(Debug, Clone)]
pub struct Case {
    /// The scenario's seed.
    pub seed: u64,
    /// The driver that ran it.
    pub driver: Driver,
    /// What the generated scenario gave.
    pub finding: Finding,
    /// The generated scenario.
    pub text: String,
    /// The minimal variant found, when shrinking ran.
    pub shrunk: Option<Shrunk>,
    /// Where the shrunk scenario was written.
    pub path: Option<PathBuf>,
}

/// What a swarm found.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Runs per driver and class.
    pub counts: BTreeMap<(Driver, Class), u64>,
    /// Every run that was not clean (fault-only ones only when shrunk), by seed.
    pub cases: Vec<Case>,
    /// Wall time of the whole swarm.
    pub elapsed: Duration,
    /// Runs that timed out among the others and were run again alone (the second
    /// result is the one counted).
    pub timeouts_rerun: u64,
}

impl Summary {
    /// Whether every run was clean or fault-only.
    pub fn all_ok(&self) -> bool {
        self.counts.iter().all(|((_, c), n)| c.is_ok() || *n == 0)
    }

    /// The cases that are not clean or fault-only.
    pub fn bad_cases(&self) -> impl Iterator<Item = &Case> {
        self.cases.iter().filter(|c| !c.finding.class.is_ok())
    }

    /// One line per driver and class: the count, then each case's seed, shrunk file
    /// and a short detail.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for ((driver, class), n) in &self.counts {
            out.push_str(&format!("{} {class}: {n}\n", driver.name()));
            for c in self
                .cases
                .iter()
                .filter(|c| c.driver == *driver && c.finding.class == *class)
            {
                let shrunk = c.shrunk.as_ref().map_or(String::new(), |s| {
                    format!(" -> {} requests, {} ranks", s.requests, s.ranks)
                });
                let path = c
                    .path
                    .as_ref()
                    .map_or(String::new(), |p| format!(" {}", p.display()));
                let detail: String = c.finding.detail.chars().take(200).collect();
                out.push_str(&format!(
                    "  seed {}{path}{shrunk}: {}\n",
                    c.seed,
                    detail.replace('\n', " ")
                ));
            }
        }
        out
    }
}

/// An error of the swarm itself (its results are a [`Summary`]).
#[derive(Debug, thiserror::Error)]
pub enum SwarmError {
    /// The output folder or a shrunk file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// Runs `f(i)` for every `i` in `0..n` on `jobs` threads; results in index order.
fn parallel<T: Send>(n: usize, jobs: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let next = AtomicU64::new(0);
    let results: Mutex<Vec<Option<T>>> = Mutex::new((0..n).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..jobs.clamp(1, n.max(1)) {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    if i >= n {
                        break;
                    }
                    let r = f(i);
                    if let Ok(mut v) = results.lock() {
                        v[i] = Some(r);
                    }
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .flatten()
        .collect()
}

/// The file name of a case: `CLASS-seedN.toml` (`-threads` before the extension for
/// the threads driver). The shrunk scenario goes to `--out`, the original to
/// `--out/original/`.
fn case_name(case: &Case) -> String {
    let driver = match case.driver {
        Driver::Sim => "",
        Driver::Threads => "-threads",
    };
    format!(
        "{}-seed{}{driver}.toml",
        case.finding.class.name(),
        case.seed
    )
}

/// The shrunk scenario with a comment header: class, seed, outcome.
pub fn annotated(case: &Case) -> String {
    let (text, finding, how) = match &case.shrunk {
        Some(s) => (
            s.text.as_str(),
            &s.finding,
            format!(
                "# shrunk in {} steps ({} runs): {}\n",
                s.steps.len(),
                s.attempts,
                if s.steps.is_empty() {
                    "nothing simpler kept the class".into()
                } else {
                    s.steps.join("; ")
                }
            ),
        ),
        None => (case.text.as_str(), &case.finding, String::new()),
    };
    let mut out = format!(
        "# lockstep swarm: class {} under the {} driver, fixed policy\n\
         # seed {}: the original (unshrunk) scenario is original/{}; \
         `lockstep swarm --runs 1 --seed {}` runs it again\n",
        finding.class,
        case.driver.name(),
        case.seed,
        case_name(case),
        case.seed,
    );
    out.push_str(&how);
    let replay = match case.driver {
        Driver::Sim => "lockstep sim THIS_FILE",
        Driver::Threads => "lockstep run --driver threads --stall-timeout-ms 2000 THIS_FILE",
    };
    out.push_str(&format!("# replay: {replay}\n# outcome:\n"));
    let detail: String = finding.detail.chars().take(2000).collect();
    for line in detail.lines() {
        out.push_str(&format!("#   {line}\n"));
    }
    out.push('\n');
    out.push_str(text);
    out
}

/// Generates, runs and classifies `cfg.runs` scenarios, shrinks every bad one and
/// writes it to `cfg.out`. `progress` is told each finished run (done, total).
pub fn run_swarm(
    cfg: &SwarmConfig,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> Result<Summary, SwarmError> {
    let started = Instant::now();
    let n = usize::try_from(cfg.runs).unwrap_or(usize::MAX);
    let done = AtomicU64::new(0);
    let results = parallel(n, cfg.jobs, |i| {
        let seed = cfg.seed.wrapping_add(i as u64);
        let text = generate(seed);
        let mut out = vec![(Driver::Sim, run_one(&text, Driver::Sim, &cfg.limits))];
        if cfg.threads_every > 0 && (i as u64 + 1).is_multiple_of(cfg.threads_every) {
            out.push((
                Driver::Threads,
                run_one(&text, Driver::Threads, &cfg.limits),
            ));
        }
        let d = done.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(p) = progress {
            p(d, cfg.runs);
        }
        (seed, text, out)
    });
    let mut summary = Summary::default();
    for (seed, text, runs) in results {
        for (driver, mut finding) in runs {
            if finding.class == Class::Timeout {
                // A wall-clock limit on a shared machine can be a noisy neighbour: a
                // timeout counts only if the run times out again alone.
                summary.timeouts_rerun += 1;
                finding = run_one(&text, driver, &cfg.limits);
            }
            *summary.counts.entry((driver, finding.class)).or_default() += 1;
            if finding.class != Class::Clean {
                summary.cases.push(Case {
                    seed,
                    driver,
                    finding,
                    text: text.clone(),
                    shrunk: None,
                    path: None,
                });
            }
        }
    }
    for ((driver, class), n) in &summary.counts {
        tracing::info!(
            driver = driver.name(),
            class = class.name(),
            n,
            "swarm runs"
        );
    }
    if !cfg.shrink_fault_only {
        summary
            .cases
            .retain(|c| c.finding.class != Class::FaultOnly);
    }
    if cfg.shrink_budget > 0 {
        let shrunk = parallel(summary.cases.len(), cfg.jobs, |i| {
            let c = &summary.cases[i];
            let budget = match (c.driver, c.finding.class) {
                // Every try of these costs up to the wall-clock limit.
                (_, Class::Timeout) => cfg.shrink_budget.min(8),
                (Driver::Threads, _) => cfg.shrink_budget.min(40),
                (Driver::Sim, _) => cfg.shrink_budget,
            };
            shrink(&c.text, &c.finding, c.driver, &cfg.limits, budget)
        });
        for (c, s) in summary.cases.iter_mut().zip(shrunk) {
            c.shrunk = Some(s);
        }
    }
    if let Some(dir) = &cfg.out
        && !summary.cases.is_empty()
    {
        let err = |path: &Path, source| SwarmError::Write {
            path: path.display().to_string(),
            source,
        };
        let originals = dir.join("original");
        std::fs::create_dir_all(&originals).map_err(|e| err(&originals, e))?;
        for c in &mut summary.cases {
            let name = case_name(c);
            let original = originals.join(&name);
            std::fs::write(&original, &c.text).map_err(|e| err(&original, e))?;
            let path = dir.join(name);
            std::fs::write(&path, annotated(c)).map_err(|e| err(&path, e))?;
            c.path = Some(path);
        }
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_leave_the_signature() {
        assert_eq!(
            normalized("kv transfer timed out after 500 ms on rank 12"),
            "kv transfer timed out after N ms on rank N"
        );
    }

    #[test]
    fn a_panic_is_caught_with_its_location_and_a_hang_is_cut_off() {
        match guarded(Duration::from_secs(5), || -> u32 { panic!("boom") }) {
            Guarded::Panicked(m) => assert!(m.contains("boom") && m.contains("swarm"), "{m}"),
            _ => panic!("expected a panic"),
        }
        let slow = guarded(Duration::from_millis(50), || {
            std::thread::sleep(Duration::from_millis(500));
        });
        assert!(matches!(slow, Guarded::TimedOut));
    }
}
