//! Statistics: percentiles, a server's figures from its ranks' summaries, and the whole
//! report from the client's records.

use serde::{Deserialize, Serialize};

use lockstep_actors::invariants::Violation;
use lockstep_actors::transceiver::TransferStats;
use lockstep_actors::vocab::FailureKind;

use super::RequestDetail;
use super::records::ClientLog;
use super::schema::*;
use super::series::{RankSeries, server_series};

impl Percentiles {
    /// Linear interpolation between closest ranks (numpy's default); zeros when empty.
    pub fn of(values: &mut [f64]) -> Percentiles {
        if values.is_empty() {
            return Percentiles::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |q: f64| {
            let pos = q * (values.len() - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = pos.ceil() as usize;
            values[lo] + (values[hi] - values[lo]) * (pos - lo as f64)
        };
        Percentiles {
            samples: values.len() as u64,
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
        }
    }
}

/// How a rank's loop ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankEnding {
    /// A shutdown was read and the server drained.
    Drained,
    /// This rank hit a violation that crashes the real executor.
    Crashed(Violation),
    /// Another rank of the server crashed; this one stopped at the same vote.
    PeerCrashed {
        /// The rank that crashed.
        peer: u32,
    },
    /// The server stalled out (deadlocked): the reason, and this rank's state then.
    StalledOut {
        /// Why.
        reason: String,
        /// The rank's state when it stalled out.
        state: String,
    },
    /// The loop failed (a collective error, a lost device): the error.
    Failed(String),
}

/// What a server report needs from one rank; serializable, so the MPI driver can send
/// it to the front process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    /// Server index (scenario order).
    pub server: u32,
    /// Rank.
    pub rank: u32,
    /// Cumulative counters.
    pub totals: lockstep_actors::executor::RankTotals,
    /// KV counters.
    pub kv: lockstep_actors::kv::KvCounters,
    /// Iterations run.
    pub iterations: u64,
    /// Violations (the first 100).
    pub violations: Vec<Violation>,
    /// Violations in all.
    pub violation_count: u64,
    /// KV blocks held by a sequence when the summary was taken.
    pub kv_used_blocks: u32,
    /// The rank's transceiver counters (ctx and gen servers).
    pub transfers: TransferStats,
    /// KV messages the wire lost (fault injection).
    pub lost: u64,
    /// How the loop ended.
    pub ending: RankEnding,
    /// Each first scheduling here: (request id, ns on the server's rank 0 clock).
    #[serde(default)]
    pub first_scheduled: Vec<(u64, u64)>,
    /// Samples for the server's time series and the balance sums (see
    /// [`super::series::Sampler`]).
    #[serde(default)]
    pub series: RankSeries,
}

impl RankSummary {
    /// The summary of one rank's executor after its loop.
    pub fn of(
        server: usize,
        exec: &lockstep_actors::executor::RankExecutor,
        violations: Vec<Violation>,
        violation_count: u64,
        ending: RankEnding,
    ) -> RankSummary {
        RankSummary {
            server: server as u32,
            rank: exec.rank().0,
            totals: *exec.totals(),
            kv: *exec.kv().counters(),
            iterations: exec.totals().iterations,
            violations,
            violation_count,
            kv_used_blocks: exec.kv().used_blocks(),
            transfers: TransferStats::default(),
            lost: 0,
            ending,
            first_scheduled: exec
                .first_scheduled()
                .iter()
                .map(|&(id, ns)| (id.0, ns))
                .collect(),
            series: RankSeries::default(),
        }
    }
}

/// How a run ended, from its ranks' endings: a crash or a stall-out (deadlock) names
/// the rank and the numbers; a failed loop is a failed run.
pub fn run_outcome<'a>(
    servers: impl IntoIterator<Item = (&'a str, &'a [RankSummary])>,
) -> Option<(Outcome, String)> {
    let mut stalled = Vec::new();
    let mut failed = None;
    for (name, ranks) in servers {
        for r in ranks {
            match &r.ending {
                RankEnding::Crashed(v) => {
                    return Some((Outcome::Crashed, format!("server `{name}`: {v}")));
                }
                RankEnding::StalledOut { reason, state } => {
                    if stalled.is_empty() {
                        stalled.push(format!("server `{name}`: {reason}"));
                    }
                    stalled.push(state.clone());
                }
                RankEnding::Failed(e) => {
                    failed.get_or_insert_with(|| format!("server `{name}` rank {}: {e}", r.rank));
                }
                RankEnding::Drained | RankEnding::PeerCrashed { .. } => {}
            }
        }
    }
    if !stalled.is_empty() {
        return Some((Outcome::Deadlocked, stalled.join("; ")));
    }
    failed.map(|f| (Outcome::Failed, f))
}

/// Builds a server's report from its ranks' summaries (in rank order).
pub fn server_report(
    name: &str,
    role: lockstep_actors::config::Role,
    max_batch_size: u32,
    ranks: &[RankSummary],
    busy_time_s: f64,
) -> ServerReport {
    let dp = ranks.len() as u32;
    let routed_all: u64 = ranks.iter().map(|r| r.totals.routed_requests).sum();
    let forward = ranks.first().map_or(0, |r| r.totals.forward_iterations);
    let scheduled: u64 = ranks.iter().map(|r| r.totals.scheduled_requests).sum();
    let mean = if forward > 0 {
        scheduled as f64 / (forward as f64 * f64::from(dp))
    } else {
        0.0
    };
    let iterations = ranks.first().map_or(0, |r| r.iterations);
    let scheduled_every: u64 = ranks
        .iter()
        .map(|r| r.totals.iteration_scheduled_requests)
        .sum();
    let mean_every = if iterations > 0 {
        scheduled_every as f64 / (iterations as f64 * f64::from(dp))
    } else {
        0.0
    };
    let deferred_batches = ranks.iter().map(|r| r.totals.deferred_batches).sum();
    let mut deferrals = Deferrals::default();
    let mut dummies = Dummies::default();
    let mut kv = KvReport::default();
    let mut violations = Vec::new();
    let mut violation_count = 0;
    let mut transfers = TransferReport::default();
    let mut durations_ms = Vec::new();
    let rank_reports: Vec<RankReport> = ranks
        .iter()
        .map(|r| {
            let t = &r.totals;
            deferrals.no_free_index_slot += t.deferrals_no_free_index_slot;
            deferrals.out_of_blocks += t.deferrals_out_of_blocks;
            dummies.added += t.dummies_added;
            dummies.committed += t.dummies_committed;
            dummies.rolled_back += t.dummies_rolled_back;
            dummies.skipped += t.dummies_skipped;
            kv.allocations += r.kv.allocations;
            kv.reuse_hits += r.kv.reuse_hits;
            kv.evictions += r.kv.evictions;
            kv.used_blocks_at_end += u64::from(r.kv_used_blocks);
            violation_count += r.violation_count;
            let x = &r.transfers;
            transfers.count += x.completed;
            transfers.bytes += x.bytes;
            transfers.timeouts += x.timed_out + x.failed;
            transfers.checksum_failures += x.checksum_failures;
            transfers.lost += r.lost;
            durations_ms.extend(x.durations_ns.iter().map(|&ns| ns as f64 / 1e6));
            transfers.budget_admitted += t.transfer_budget_admitted;
            transfers.budget_deferred += t.transfer_budget_deferred;
            transfers.budget_blocked_by_active += t.transfer_budget_blocked_by_active;
            transfers.generation_first_promoted += t.generation_first_promoted;
            transfers.max_receives_in_flight = transfers
                .max_receives_in_flight
                .max(t.max_receives_in_flight);
            for v in &r.violations {
                if violations.len() < 100 {
                    violations.push(v.clone());
                }
            }
            RankReport {
                rank: r.rank,
                routed_requests: t.routed_requests,
                routing_share: if routed_all > 0 {
                    t.routed_requests as f64 / routed_all as f64
                } else {
                    0.0
                },
                mean_scheduled_requests: if t.forward_iterations > 0 {
                    t.scheduled_requests as f64 / t.forward_iterations as f64
                } else {
                    0.0
                },
                dummy_iterations: t.dummy_iterations,
                completed: t.completed,
                routing_digest: format!("{:016x}", t.routing_digest),
            }
        })
        .collect();
    let timeseries = server_series(ranks.iter().map(|r| &r.series.points[..]));
    let output_tokens = ranks.iter().map(|r| r.totals.output_tokens).sum();
    let balance = ranks
        .first()
        .map(|r| r.series.balance.report(output_tokens))
        .unwrap_or_default();
    let times = Percentiles::of(&mut durations_ms);
    transfers.mean_ms = times.mean;
    transfers.p99_ms = times.p99;
    ServerReport {
        name: name.to_string(),
        role: role.name().to_string(),
        dp,
        max_batch_size,
        iterations,
        forward_iterations: forward,
        vetoed_iterations: ranks.first().map_or(0, |r| r.totals.vetoed_iterations),
        mean_scheduled_requests: mean,
        occupancy: mean / f64::from(max_batch_size.max(1)),
        scheduled_per_iteration: mean_every,
        deferred_batches,
        busy_time_s,
        ranks: rank_reports,
        deferrals,
        dummies,
        kv,
        transfers,
        violations,
        violation_count,
        preemptions: ranks.iter().map(|r| r.totals.preemptions).sum(),
        timeseries,
        balance,
    }
}

/// A run that ended as planned but did not complete every request: how many, by
/// failure kind (in the kinds' order).
fn not_completed(records: &[RequestDetail]) -> Option<String> {
    let mut kinds: std::collections::BTreeMap<FailureKind, u64> = Default::default();
    for r in records.iter().filter(|r| !r.completed()) {
        let kind = match (r.failure_kind(), r.end_ns()) {
            (Some(kind), Some(_)) => kind,
            _ => FailureKind::Unfinished,
        };
        *kinds.entry(kind).or_default() += 1;
    }
    if kinds.is_empty() {
        return None;
    }
    let failed: u64 = kinds.values().sum();
    let by_kind: Vec<String> = kinds
        .iter()
        .map(|(kind, n)| format!("{n} {}", kind.name()))
        .collect();
    Some(format!(
        "{failed} of {} requests did not complete ({})",
        records.len(),
        by_kind.join(", ")
    ))
}

/// Builds the whole report from the client's log, the first scheduling of each request
/// (request id, ns; from every rank, on the report's clock: the earliest counts) and the
/// servers' reports. Requests still open when the run ended count as failed (a crashed
/// or deadlocked run fails what it held).
pub fn assemble_report(
    scenario: &crate::scenario::Scenario,
    seed: u64,
    client: ClientLog,
    first_scheduled: impl IntoIterator<Item = (u64, u64)>,
    wall_time_s: f64,
    servers: Vec<ServerReport>,
    outcome: Option<(Outcome, String)>,
) -> Report {
    let ClientLog {
        records,
        itl,
        end_ns,
        frontend,
    } = client;
    let (outcome, outcome_detail) = match outcome {
        Some((o, d)) => (o, Some(d)),
        None => match not_completed(&records) {
            Some(d) => (Outcome::Incomplete, Some(d)),
            None => (Outcome::Completed, None),
        },
    };
    // The records become the report's `per_request` in place: nothing per request is
    // copied (a run of a million requests holds one 88-byte record each).
    let mut records = records;
    records.sort_unstable_by_key(|r| r.id);
    for (id, ns) in first_scheduled {
        if let Ok(i) = records.binary_search_by_key(&id, |r| r.id) {
            records[i].scheduled_at(ns);
        }
    }
    let open = format!("still open when the run ended ({})", outcome.name());
    for r in records.iter_mut().filter(|r| r.end_ns().is_none()) {
        r.mark_unfinished(&open);
    }
    let mut counts = RequestCounts {
        submitted: records.len() as u64,
        ..RequestCounts::default()
    };
    let (mut total_tokens, mut output_tokens) = (0u64, 0u64);
    // Warm-up requests (ids 1..=W, sent first) count in the totals; latency and
    // throughput cover the measured load, from its first arrival.
    let warmup = scenario
        .workload
        .as_ref()
        .map_or(0, |w| u64::from(w.warmup_requests));
    counts.warmup = records.iter().filter(|r| r.id <= warmup).count() as u64;
    let load_start_ns = records
        .iter()
        .filter(|r| r.id > warmup)
        .map(|r| r.arrival_ns)
        .min()
        .unwrap_or(0);
    let measured_completed = || {
        records
            .iter()
            .filter(move |r| r.id > warmup && r.completed())
    };
    for r in &records {
        if r.completed() {
            counts.completed += 1;
        } else {
            counts.failed += 1;
        }
    }
    for r in measured_completed() {
        output_tokens += u64::from(r.output_tokens);
        total_tokens += u64::from(r.output_tokens) + u64::from(r.prompt_tokens);
    }
    // One latency at a time: each vector is as long as the run.
    let ms = |ns: u64| ns as f64 / 1e6;
    let latency = |f: &dyn Fn(&RequestDetail) -> Option<f64>| {
        let mut v: Vec<f64> = measured_completed().filter_map(f).collect();
        Percentiles::of(&mut v)
    };
    let ttft = latency(&|r| Some(ms(r.first_token_ns()?.saturating_sub(r.arrival_ns))));
    let tpot = latency(&|r| {
        let first = r.first_token_ns()?;
        let end = r.end_ns()?;
        (r.output_tokens > 1)
            .then(|| ms(end.saturating_sub(first)) / f64::from(r.output_tokens - 1))
    });
    let e2e = latency(&|r| Some(ms(r.end_ns()?.saturating_sub(r.arrival_ns))));
    let frontend = frontend.map(|mut door| {
        let measured = || records.iter().filter(|r| r.id > warmup);
        let n = measured().count().max(1) as f64;
        door.mean_queue_ms = measured().map(|r| r.front_queue_ns as f64).sum::<f64>() / n / 1e6;
        door.mean_service_ms = measured().map(|r| r.front_service_ns as f64).sum::<f64>() / n / 1e6;
        door
    });
    let secs = end_ns as f64 / 1e9;
    let load_secs = end_ns.saturating_sub(load_start_ns) as f64 / 1e9;
    let per_s = |x: f64| if load_secs > 0.0 { x / load_secs } else { 0.0 };
    Report {
        scenario: scenario.name.clone(),
        legacy_switches: scenario
            .policy
            .legacy_switches()
            .into_iter()
            .map(String::from)
            .collect(),
        seed,
        outcome,
        outcome_detail,
        requests: counts,
        time_base: TimeBase::Virtual,
        virtual_time_s: secs,
        wall_time_s,
        throughput: Throughput {
            total_tokens_per_s: per_s(total_tokens as f64),
            output_tokens_per_s: per_s(output_tokens as f64),
            requests_per_s: per_s(counts.completed as f64),
            duration_s: load_secs,
        },
        latency_ms: Latency {
            ttft,
            tpot,
            e2e,
            itl: itl.percentiles(),
        },
        goodput: None,
        servers,
        frontend,
        per_request: records,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!(p.mean, 5.5);
        assert_eq!(p.p50, 5.5);
        assert!((p.p90 - 9.1).abs() < 1e-9);
        assert!((p.p99 - 9.91).abs() < 1e-9);
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
    }
}
