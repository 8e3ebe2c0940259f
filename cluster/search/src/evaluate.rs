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
    /// Closed-loop clients.
    pub concurrency: u32,
    /// Output tokens per second of the whole deployment.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
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
    fn of(concurrency: u32, r: &Report) -> Measured {
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
        Measured {
            concurrency,
            output_tokens_per_s: r.throughput.output_tokens_per_s,
            requests_per_s: r.throughput.requests_per_s,
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
pub const LOAD_CAP: &str = "load cap (workload.max_concurrency)";

/// Simulates from one client up, doubling until a load misses an objective (or `max`
/// is reached), then bisects (geometrically) between the last load that met them all and
/// the first that did not. Doubling first keeps the simulations small: the largest is
/// at most twice the answer.
pub fn search_load(
    spec: &SearchSpec,
    max: u32,
    mut simulate: impl FnMut(u32) -> Measured,
) -> Evaluation {
    let bounds = spec.slo.bounds();
    let mut points = Vec::new();
    let mut run = |n: u32, points: &mut Vec<Measured>| -> Vec<String> {
        let m = simulate(n);
        let misses = m.misses(&bounds);
        points.push(m);
        misses
    };
    let misses = run(1, &mut points);
    if !misses.is_empty() {
        return Evaluation {
            best: None,
            points,
            binding: misses.join(", "),
        };
    }
    let mut lo = 1;
    let mut failed: Option<(u32, Vec<String>)> = None;
    while lo < max {
        let next = lo.saturating_mul(2).min(max);
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
    while hi > lo + 1 && f64::from(hi) > f64::from(lo) * tolerance {
        let mid = ((f64::from(lo) * f64::from(hi)).sqrt().round() as u32).clamp(lo + 1, hi - 1);
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
        .find(|m| m.concurrency == lo && m.misses(&bounds).is_empty())
        .cloned();
    Evaluation {
        best,
        points,
        binding: hi_misses.join(", "),
    }
}

/// Runs `scenario` in the simulator; an error is a broken measurement.
pub fn simulate(scenario: &Scenario, concurrency: u32, seed: u64) -> Measured {
    match lockstep_sim::run(
        scenario,
        SimOptions {
            seed,
            ..SimOptions::default()
        },
    ) {
        Ok(report) => Measured::of(concurrency, &report),
        Err(e) => Measured {
            concurrency,
            output_tokens_per_s: 0.0,
            requests_per_s: 0.0,
            ttft: Percentiles::default(),
            tpot: Percentiles::default(),
            itl: Percentiles::default(),
            e2e: Percentiles::default(),
            balance: None,
            broken: Some(e.to_string()),
        },
    }
}
