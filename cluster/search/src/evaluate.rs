//! One candidate in full: the simulator at a load, and the most clients it serves within
//! every objective, found by bisection.

use serde::{Deserialize, Serialize};

use lockstep_plan::report::{Outcome, Percentiles, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_sim::SimOptions;

use crate::spec::{Bound, Metric, Percentile, SearchSpec};

/// What one simulation measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// The load: closed-loop clients, or open-loop requests per second.
    pub load: f64,
    /// Output tokens per second of the whole deployment.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Seconds from the first request's arrival to the last one's.
    pub arrival_span_s: f64,
    /// Seconds the rates divide by: from the first arrival to the end of the run.
    pub duration_s: f64,
    /// Time to first token, ms.
    pub ttft: Percentiles,
    /// Time per output token, ms.
    pub tpot: Percentiles,
    /// Inter-token latency, ms.
    pub itl: Percentiles,
    /// End to end, ms.
    pub e2e: Percentiles,
    /// The decoding servers' mean ADP balance ratio (1: perfectly balanced).
    pub balance: Option<f64>,
    /// Why the run does not count, if it does not (a failed request, an error).
    pub broken: Option<String>,
}

impl Measured {
    fn of(load: f64, r: &Report) -> Measured {
        let broken = if r.outcome != Outcome::Completed {
            Some(format!(
                "the run ended {:?}: {}",
                r.outcome,
                r.outcome_detail.as_deref().unwrap_or("no detail")
            ))
        } else if r.requests.failed > 0 {
            Some(format!("{} requests failed", r.requests.failed))
        } else {
            None
        };
        let decoders: Vec<f64> = r
            .servers
            .iter()
            .filter(|s| s.role != "ctx")
            .filter_map(|s| s.balance.mean_ratio)
            .collect();
        let balance =
            (!decoders.is_empty()).then(|| decoders.iter().sum::<f64>() / decoders.len() as f64);
        let arrivals = r.per_request.iter().map(|d| d.arrival_ns);
        let span_ns = match (arrivals.clone().min(), arrivals.max()) {
            (Some(a), Some(b)) => b - a,
            _ => 0,
        };
        Measured {
            load,
            output_tokens_per_s: r.throughput.output_tokens_per_s,
            requests_per_s: r.throughput.requests_per_s,
            arrival_span_s: span_ns as f64 / 1e9,
            duration_s: r.throughput.duration_s,
            ttft: r.latency_ms.ttft,
            tpot: r.latency_ms.tpot,
            itl: r.latency_ms.itl,
            e2e: r.latency_ms.e2e,
            balance,
            broken,
        }
    }

    /// The value an objective reads.
    pub fn value(&self, b: &Bound) -> f64 {
        let p = match b.metric {
            Metric::Ttft => &self.ttft,
            Metric::Tpot => &self.tpot,
            Metric::Itl => &self.itl,
            Metric::E2e => &self.e2e,
        };
        match b.percentile {
            Percentile::P50 => p.p50,
            Percentile::P90 => p.p90,
            Percentile::P99 => p.p99,
        }
    }

    /// The objectives it misses (their keys), or why the run does not count.
    pub fn misses(&self, bounds: &[Bound]) -> Vec<String> {
        if let Some(why) = &self.broken {
            return vec![why.clone()];
        }
        bounds
            .iter()
            .filter(|b| self.value(b) > b.limit_ms)
            .map(Bound::key)
            .collect()
    }

    /// Output tokens per second one client sees while decoding: 1 / mean TPOT.
    pub fn tokens_per_user(&self) -> f64 {
        if self.tpot.mean > 0.0 {
            1000.0 / self.tpot.mean
        } else {
            0.0
        }
    }
}

/// A candidate's search over load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    /// The highest load meeting every objective (`None`: not even one client does).
    pub best: Option<Measured>,
    /// Every load simulated, in the order tried.
    pub points: Vec<Measured>,
    /// What stops more load: the objectives missed at the lowest load that misses, or
    /// the load cap.
    pub binding: String,
}

/// Where the load search may stop without missing an objective.
pub const LOAD_CAP: &str = "load cap (workload.max_concurrency or max_rate)";

/// The loads a search may try: from `first` up to `max`, whole numbers when `integer`
/// (clients).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadRange {
    /// The lowest load tried; missing an objective there makes the candidate infeasible.
    pub first: f64,
    /// The highest.
    pub max: f64,
    /// Clients are whole.
    pub integer: bool,
}

/// Simulates from `range.first` up, doubling until a load misses an objective (or the
/// range's top is reached), then bisects (geometrically) between the last load that met
/// them all and the first that did not. Doubling first keeps the simulations small: the
/// largest is at most twice the answer.
pub fn search_load(
    spec: &SearchSpec,
    range: LoadRange,
    mut simulate: impl FnMut(f64) -> Measured,
) -> Evaluation {
    let bounds = spec.slo.bounds();
    let mut points = Vec::new();
    let mut run = |n: f64, points: &mut Vec<Measured>| -> Vec<String> {
        let m = simulate(n);
        let misses = m.misses(&bounds);
        points.push(m);
        misses
    };
    let snap = |x: f64| if range.integer { x.round().max(1.0) } else { x };
    let max = snap(range.max.max(range.first));
    let mut lo = snap(range.first);
    let misses = run(lo, &mut points);
    if !misses.is_empty() {
        return Evaluation {
            best: None,
            points,
            binding: misses.join(", "),
        };
    }
    let mut failed: Option<(f64, Vec<String>)> = None;
    while lo < max {
        let next = snap(lo * 2.0).min(max);
        let misses = run(next, &mut points);
        if misses.is_empty() {
            lo = next;
        } else {
            failed = Some((next, misses));
            break;
        }
    }
    let Some((mut hi, mut hi_misses)) = failed else {
        return Evaluation {
            best: points.last().cloned(),
            points,
            binding: LOAD_CAP.into(),
        };
    };
    let tolerance = 1.0 + spec.method.load_tolerance;
    loop {
        let close = hi <= lo * tolerance || (range.integer && hi <= lo + 1.0);
        if close {
            break;
        }
        let mut mid = snap((lo * hi).sqrt());
        if range.integer {
            mid = mid.clamp(lo + 1.0, hi - 1.0);
        }
        let misses = run(mid, &mut points);
        if misses.is_empty() {
            lo = mid;
        } else {
            hi = mid;
            hi_misses = misses;
        }
    }
    let best = points
        .iter()
        .find(|m| m.load == lo && m.misses(&bounds).is_empty())
        .cloned();
    Evaluation {
        best,
        points,
        binding: hi_misses.join(", "),
    }
}

/// Runs `scenario` in the simulator; an error is a broken measurement.
pub fn simulate(scenario: &Scenario, load: f64, seed: u64) -> Measured {
    match lockstep_sim::run(
        scenario,
        SimOptions {
            seed,
            ..SimOptions::default()
        },
    ) {
        Ok(report) => Measured::of(load, &report),
        Err(e) => Measured {
            load,
            output_tokens_per_s: 0.0,
            requests_per_s: 0.0,
            arrival_span_s: 0.0,
            duration_s: 0.0,
            ttft: Percentiles::default(),
            tpot: Percentiles::default(),
            itl: Percentiles::default(),
            e2e: Percentiles::default(),
            balance: None,
            broken: Some(e.to_string()),
        },
    }
}
