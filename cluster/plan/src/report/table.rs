//! The report as text: the summary table of `sim` and `run`, and `ab`'s side-by-side.

use std::fmt::Write;

use super::schema::{Report, ServerReport, TimeBase};

/// `bytes` with a decimal unit: `8.2 GB`, not `8177.4 MB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1000.0 && unit + 1 < UNITS.len() {
        v /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// One latency row: `n/a` where the metric has no samples.
fn latency_row(o: &mut String, name: &str, p: &super::schema::Percentiles) {
    if p.samples == 0 {
        let _ = writeln!(
            o,
            "  {name:<8} {:>9} {:>9} {:>9} {:>9}",
            "n/a", "n/a", "n/a", "n/a"
        );
    } else {
        let _ = writeln!(
            o,
            "  {name:<8} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
            p.mean, p.p50, p.p90, p.p99
        );
    }
}

impl Report {
    /// Human-readable summary. Every term is in the glossary (docs/mechanisms.md).
    pub fn table(&self) -> String {
        let mut o = String::new();
        let policy = if self.legacy_switches.is_empty() {
            "fixed".to_string()
        } else {
            format!("legacy ({})", self.legacy_switches.join(", "))
        };
        let _ = writeln!(
            o,
            "scenario {}  policy {}  seed {}",
            self.scenario, policy, self.seed
        );
        let _ = writeln!(
            o,
            "outcome {}{}",
            self.outcome.name(),
            self.outcome_detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default()
        );
        let r = &self.requests;
        let clock = match self.time_base {
            TimeBase::Virtual => format!(
                "virtual {:.3} s   wall {:.3} s",
                self.virtual_time_s, self.wall_time_s
            ),
            TimeBase::Modeled { time_scale } => format!(
                "modeled {:.3} s (time scale {time_scale})   wall {:.3} s",
                self.virtual_time_s, self.wall_time_s
            ),
            TimeBase::ZeroCost => format!("wall {:.3} s (zero-cost backend)", self.wall_time_s),
            TimeBase::RealModel => format!("wall {:.3} s (real model)", self.wall_time_s),
            TimeBase::Client => format!("wall {:.3} s (measured by the client)", self.wall_time_s),
        };
        let warmup = if r.warmup > 0 {
            format!(" (warm-up {}, not in the figures below)", r.warmup)
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "requests submitted {} completed {} failed {}{warmup}   {clock}",
            r.submitted, r.completed, r.failed
        );
        let t = &self.throughput;
        if self.time_base == TimeBase::ZeroCost {
            let _ = writeln!(
                o,
                "throughput n/a: the zero-cost backend models no forward time (run with --time-scale for modeled figures); latencies below are wall times of the control plane alone"
            );
        } else {
            let _ = writeln!(
                o,
                "throughput {:.1} tok/s total, {:.1} tok/s output, {:.3} req/s",
                t.total_tokens_per_s, t.output_tokens_per_s, t.requests_per_s
            );
        }
        let _ = writeln!(o, "latency ms      mean       p50       p90       p99");
        latency_row(&mut o, "ttft", &self.latency_ms.ttft);
        latency_row(&mut o, "tpot", &self.latency_ms.tpot);
        latency_row(&mut o, "e2e", &self.latency_ms.e2e);
        latency_row(&mut o, "itl", &self.latency_ms.itl);
        if let Some(g) = &self.goodput {
            let _ = writeln!(
                o,
                "goodput {:.3} req/s ({} measured requests completed within {})",
                g.requests_per_s,
                g.good_requests,
                g.slo.describe()
            );
        }
        if let Some(door) = &self.frontend {
            let _ = writeln!(o, "front door: {}", door.describe());
        }
        for s in &self.servers {
            let _ = writeln!(
                o,
                "server {} ({}, dp {}, B {}): iterations {} forward {} vetoed {}  occupancy {:.3} ({:.2} of B per forward; {:.2} scheduled per iteration)  deferrals index {} blocks {}  dummies {}/{}/{} (added/committed/rolled back)  violations {}",
                s.name,
                s.role,
                s.dp,
                s.max_batch_size,
                s.iterations,
                s.forward_iterations,
                s.vetoed_iterations,
                s.occupancy,
                s.mean_scheduled_requests,
                s.scheduled_per_iteration,
                s.deferrals.no_free_index_slot,
                s.deferrals.out_of_blocks,
                s.dummies.added,
                s.dummies.committed,
                s.dummies.rolled_back,
                s.violation_count
            );
            if s.preemptions > 0 {
                let _ = writeln!(o, "  preemptions {}", s.preemptions);
            }
            let b = &s.balance;
            if s.dp > 1
                && let Some(ratio) = b.mean_ratio
            {
                let held = if b.held_iterations > 0 || b.timed_out_iterations > 0 {
                    format!(
                        "  context held {} iterations, timed out {}",
                        b.held_iterations, b.timed_out_iterations
                    )
                } else {
                    String::new()
                };
                // Without modeled forward time, iteration times are the control plane's
                // alone: the ratio stands, a speed of light would not mean anything.
                let sol = if self.time_base == TimeBase::ZeroCost {
                    String::new()
                } else {
                    format!(
                        "  speed of light {:.1} output tok/s vs {:.1} (gap {:.1}%, {:.3} s of {:.3} s lost to imbalance)",
                        b.sol_output_tokens_per_s,
                        b.output_tokens_per_s,
                        b.sol_gap * 100.0,
                        b.imbalance_time_s,
                        b.span_s
                    )
                };
                let _ = writeln!(
                    o,
                    "  balance ratio {:.3} (mean of {} iterations){sol}{held}",
                    ratio, b.measured_iterations,
                );
            }
            let kv = &s.kv;
            if kv.reuse_hits > 0 {
                let looked_up = kv.reuse_hits + kv.allocations;
                let _ = writeln!(
                    o,
                    "  prefix cache: hit rate {:.1}% ({} of {} blocks reused)  evictions {}",
                    kv.reuse_hits as f64 / looked_up as f64 * 100.0,
                    kv.reuse_hits,
                    looked_up,
                    kv.evictions
                );
            }
            let x = &s.transfers;
            match s.role.as_str() {
                // Each transfer once, on the side that receives it (the gen server);
                // the ctx side lists what only it knows.
                "gen" if x.count > 0 || x.timeouts > 0 => {
                    let _ = writeln!(
                        o,
                        "  kv received {} ({}) mean {:.3} ms p99 {:.3} ms  failed {} (lost {}, checksum {})  budget admitted {} deferred {} blocked by active {} max in flight {}",
                        x.count,
                        human_bytes(x.bytes),
                        x.mean_ms,
                        x.p99_ms,
                        x.timeouts,
                        x.lost,
                        x.checksum_failures,
                        x.budget_admitted,
                        x.budget_deferred,
                        x.budget_blocked_by_active,
                        x.max_receives_in_flight
                    );
                }
                "ctx" if x.count > 0 || x.timeouts > 0 => {
                    let _ = writeln!(
                        o,
                        "  kv sent {}  failed {}{}",
                        x.count,
                        x.timeouts,
                        if x.generation_first_promoted > 0 {
                            format!(
                                "  generation-first promoted {}",
                                x.generation_first_promoted
                            )
                        } else {
                            String::new()
                        }
                    );
                }
                _ => {}
            }
            let _ = writeln!(o, "  rank  routed   share  sched/iter  dummy_iters");
            for k in &s.ranks {
                let _ = writeln!(
                    o,
                    "  {:>4} {:>7} {:>7.3} {:>11.3} {:>12}",
                    k.rank,
                    k.routed_requests,
                    k.routing_share,
                    k.mean_scheduled_requests,
                    k.dummy_iterations
                );
            }
        }
        o
    }

    /// The report with `wall_time_s` zeroed: identical across runs of the same input.
    pub fn without_wall_time(&self) -> Report {
        Report {
            wall_time_s: 0.0,
            ..self.clone()
        }
    }
}

/// Two reports side by side with deltas (`lockstep ab`).
pub fn ab_table(base: &Report, treatment: &Report, base_name: &str, treat_name: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<36} {:>14} {:>14} {:>10}",
        "metric", base_name, treat_name, "delta"
    );
    let mut row = |name: &str, a: f64, b: f64| {
        if a.is_nan() || b.is_nan() {
            let _ = writeln!(o, "{name:<36} {:>14} {:>14} {:>10}", "n/a", "n/a", "");
            return;
        }
        let delta = if a != 0.0 {
            format!("{:+.1}%", (b - a) / a.abs() * 100.0)
        } else if b == 0.0 {
            "=".to_string()
        } else {
            "new".to_string()
        };
        // Counts print as integers, measures with three decimals.
        let counted = name.contains("requests ")
            || name.ends_with("iterations")
            || name.ends_with("deferrals")
            || name.ends_with("violations")
            || name.ends_with("batches");
        if counted {
            let _ = writeln!(o, "{name:<36} {a:>14.0} {b:>14.0} {delta:>10}");
        } else {
            let _ = writeln!(o, "{name:<36} {a:>14.3} {b:>14.3} {delta:>10}");
        }
    };
    row(
        "requests completed",
        base.requests.completed as f64,
        treatment.requests.completed as f64,
    );
    row(
        "requests failed",
        base.requests.failed as f64,
        treatment.requests.failed as f64,
    );
    row(
        "virtual time (s)",
        base.virtual_time_s,
        treatment.virtual_time_s,
    );
    row(
        "total tokens/s",
        base.throughput.total_tokens_per_s,
        treatment.throughput.total_tokens_per_s,
    );
    row(
        "output tokens/s",
        base.throughput.output_tokens_per_s,
        treatment.throughput.output_tokens_per_s,
    );
    row(
        "requests/s",
        base.throughput.requests_per_s,
        treatment.throughput.requests_per_s,
    );
    row(
        "ttft mean (ms)",
        base.latency_ms.ttft.mean,
        treatment.latency_ms.ttft.mean,
    );
    row(
        "ttft p99 (ms)",
        base.latency_ms.ttft.p99,
        treatment.latency_ms.ttft.p99,
    );
    // A metric without samples (TPOT with one output token) is not applicable.
    let mean = |p: &super::schema::Percentiles| if p.samples == 0 { f64::NAN } else { p.mean };
    row(
        "tpot mean (ms)",
        mean(&base.latency_ms.tpot),
        mean(&treatment.latency_ms.tpot),
    );
    row(
        "itl mean (ms)",
        mean(&base.latency_ms.itl),
        mean(&treatment.latency_ms.itl),
    );
    if let (Some(a), Some(b)) = (&base.goodput, &treatment.goodput) {
        row("goodput (req/s)", a.requests_per_s, b.requests_per_s);
    }
    row(
        "e2e p99 (ms)",
        base.latency_ms.e2e.p99,
        treatment.latency_ms.e2e.p99,
    );
    if let (Some(a), Some(b)) = (&base.frontend, &treatment.frontend) {
        row(
            "front door wait mean (ms)",
            a.mean_queue_ms,
            b.mean_queue_ms,
        );
        row("front door utilization", a.utilization, b.utilization);
    }
    for (a, b) in base.servers.iter().zip(&treatment.servers) {
        let n = &a.name;
        row(&format!("{n}: occupancy"), a.occupancy, b.occupancy);
        row(
            &format!("{n}: scheduled per iteration"),
            a.scheduled_per_iteration,
            b.scheduled_per_iteration,
        );
        row(
            &format!("{n}: rank 0 routing share"),
            a.ranks.first().map_or(0.0, |r| r.routing_share),
            b.ranks.first().map_or(0.0, |r| r.routing_share),
        );
        row(
            &format!("{n}: forward iterations"),
            a.forward_iterations as f64,
            b.forward_iterations as f64,
        );
        row(
            &format!("{n}: vetoed iterations"),
            a.vetoed_iterations as f64,
            b.vetoed_iterations as f64,
        );
        row(
            &format!("{n}: deferred batches"),
            a.deferred_batches as f64,
            b.deferred_batches as f64,
        );
        row(
            &format!("{n}: no-free-index-slot deferrals"),
            a.deferrals.no_free_index_slot as f64,
            b.deferrals.no_free_index_slot as f64,
        );
        let spread = |s: &ServerReport| {
            let shares: Vec<f64> = s.ranks.iter().map(|r| r.routing_share).collect();
            let max = shares.iter().cloned().fold(f64::MIN, f64::max);
            let min = shares.iter().cloned().fold(f64::MAX, f64::min);
            if shares.is_empty() { 0.0 } else { max - min }
        };
        row(&format!("{n}: routing share spread"), spread(a), spread(b));
        let ratio = |s: &ServerReport| s.balance.mean_ratio.unwrap_or(f64::NAN);
        row(&format!("{n}: balance ratio"), ratio(a), ratio(b));
        row(
            &format!("{n}: speed-of-light output tok/s"),
            a.balance.sol_output_tokens_per_s,
            b.balance.sol_output_tokens_per_s,
        );
        row(
            &format!("{n}: speed-of-light gap"),
            a.balance.sol_gap,
            b.balance.sol_gap,
        );
        row(
            &format!("{n}: violations"),
            a.violation_count as f64,
            b.violation_count as f64,
        );
    }
    let _ = writeln!(
        o,
        "outcome: {} → {}",
        base.outcome.name(),
        treatment.outcome.name()
    );
    o
}
