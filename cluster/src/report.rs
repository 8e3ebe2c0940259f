//! The report of a run: what a user of an ADP fleet needs to know (admission, occupancy,
//! routing balance, throughput, latency), as JSON and as a table.

use std::fmt::Write;

use serde::{Deserialize, Serialize};

use lockstep_actors::invariants::Violation;

/// How the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every request was accounted for.
    Completed,
    /// A violation that crashes the real executor happened.
    Crashed,
    /// Work remained and nothing could make progress.
    Deadlocked,
}

impl Outcome {
    /// Name used in tables.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Crashed => "crashed",
            Outcome::Deadlocked => "deadlocked",
        }
    }
}

/// Request accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RequestCounts {
    /// Entered the system.
    pub submitted: u64,
    /// Completed.
    pub completed: u64,
    /// Failed (with a reason) or cancelled.
    pub failed: u64,
}

/// Throughput over the virtual time.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Throughput {
    /// (prompt + output) tokens of completed requests per second.
    pub total_tokens_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
}

/// Summary statistics of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Percentiles {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

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
            mean: values.iter().sum::<f64>() / values.len() as f64,
            p50: at(0.5),
            p90: at(0.9),
            p99: at(0.99),
        }
    }
}

/// Time to first token, time per output token, end to end.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Latency {
    /// TTFT.
    pub ttft: Percentiles,
    /// TPOT (requests with more than one output token).
    pub tpot: Percentiles,
    /// End to end.
    pub e2e: Percentiles,
}

/// One rank of a server.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RankReport {
    /// Rank.
    pub rank: u32,
    /// Requests routed to it.
    pub routed_requests: u64,
    /// Routed to it / routed to all ranks of the server.
    pub routing_share: f64,
    /// Real requests per forward iteration.
    pub mean_scheduled_requests: f64,
    /// Forward iterations in which it ran a dummy.
    pub dummy_iterations: u64,
    /// Requests completed here.
    pub completed: u64,
    /// Digest of the ids routed here, in routing order (hex): equal digests mean the
    /// same routing assignments.
    pub routing_digest: String,
}

/// Deferral counters of a server (all ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Deferrals {
    /// Admitted requests not started for lack of a KV index slot (§7).
    pub no_free_index_slot: u64,
    /// Requests not run for lack of KV blocks.
    pub out_of_blocks: u64,
}

/// Dummy counters of a server (all ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Dummies {
    /// Added tentatively.
    pub added: u64,
    /// Committed.
    pub committed: u64,
    /// Rolled back.
    pub rolled_back: u64,
    /// Needed but skipped for lack of capacity.
    pub skipped: u64,
}

/// KV counters of a server (all ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvReport {
    /// Blocks allocated.
    pub allocations: u64,
    /// Blocks served from the prefix cache.
    pub reuse_hits: u64,
    /// Cached blocks evicted.
    pub evictions: u64,
    /// Blocks still held by a sequence when the run ended (a drained server holds none:
    /// anything else is leaked KV).
    #[serde(default)]
    pub used_blocks_at_end: u64,
}

/// Transfers seen by a server (disaggregated roles).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TransferReport {
    /// Transfers completed.
    pub count: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Mean transfer time.
    pub mean_ms: f64,
    /// 99th percentile transfer time.
    pub p99_ms: f64,
    /// Transfers that timed out or failed.
    pub timeouts: u64,
    /// gen side, §8: receives the transport budget admitted.
    pub budget_admitted: u64,
    /// gen side, §8: times the budget deferred the head receive.
    pub budget_deferred: u64,
    /// gen side, §8: deferrals because receives in flight held the budget.
    pub budget_blocked_by_active: u64,
    /// gen side: the most receives in flight on one rank at once.
    pub max_receives_in_flight: u32,
    /// ctx side, generation-first mode: requests promoted once their gen peer was known.
    pub generation_first_promoted: u64,
    /// Fault injection (`[faults] lost_transfer_every`): transfers whose KV was lost.
    #[serde(default)]
    pub lost: u64,
    /// Transfers failed because a received block's checksum did not match (real KV
    /// transport only).
    #[serde(default)]
    pub checksum_failures: u64,
}

/// One server.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ServerReport {
    /// Name.
    pub name: String,
    /// agg, ctx or gen.
    pub role: String,
    /// DP ranks.
    pub dp: u32,
    /// `max_batch_size`.
    pub max_batch_size: u32,
    /// Iterations run.
    pub iterations: u64,
    /// Iterations whose forward ran.
    pub forward_iterations: u64,
    /// Iterations whose forward some rank vetoed.
    pub vetoed_iterations: u64,
    /// Real requests per rank per forward iteration.
    pub mean_scheduled_requests: f64,
    /// `mean_scheduled_requests / max_batch_size`.
    pub occupancy: f64,
    /// Virtual time the server spent iterating.
    pub busy_time_s: f64,
    /// Per rank.
    pub ranks: Vec<RankReport>,
    /// Deferrals.
    pub deferrals: Deferrals,
    /// Dummies.
    pub dummies: Dummies,
    /// KV.
    pub kv: KvReport,
    /// Transfers (ctx: sends; gen: receives).
    pub transfers: TransferReport,
    /// §10 violations (the first 100).
    pub violations: Vec<Violation>,
    /// Violations in all.
    pub violation_count: u64,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Legacy switches on (empty: the fixed policy).
    pub legacy_switches: Vec<String>,
    /// Seed.
    pub seed: u64,
    /// How it ended.
    pub outcome: Outcome,
    /// The fatal violation or the deadlock's rank states.
    pub outcome_detail: Option<String>,
    /// Accounting.
    pub requests: RequestCounts,
    /// Virtual time at the end.
    pub virtual_time_s: f64,
    /// Wall-clock time of the run (the only field that varies between identical runs).
    pub wall_time_s: f64,
    /// Throughput.
    pub throughput: Throughput,
    /// Latency.
    pub latency_ms: Latency,
    /// Servers in scenario order.
    pub servers: Vec<ServerReport>,
    /// Per request, in id order: output tokens, the token stream's digest, and the
    /// failure reason if any (for comparing drivers and runs request by request).
    pub per_request: Vec<RequestDetail>,
}

/// One request's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestDetail {
    /// Request id.
    pub id: u64,
    /// Output tokens received.
    pub output_tokens: u32,
    /// Digest of the token stream (hex).
    pub token_digest: String,
    /// Completed, or the failure reason.
    pub failure: Option<String>,
}

impl Report {
    /// Human-readable summary.
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
        let _ = writeln!(
            o,
            "requests submitted {} completed {} failed {}   virtual {:.3} s   wall {:.3} s",
            r.submitted, r.completed, r.failed, self.virtual_time_s, self.wall_time_s
        );
        let t = &self.throughput;
        let _ = writeln!(
            o,
            "throughput {:.1} tok/s total, {:.1} tok/s output, {:.3} req/s",
            t.total_tokens_per_s, t.output_tokens_per_s, t.requests_per_s
        );
        let _ = writeln!(o, "latency ms      mean       p50       p90       p99");
        for (name, p) in [
            ("ttft", &self.latency_ms.ttft),
            ("tpot", &self.latency_ms.tpot),
            ("e2e", &self.latency_ms.e2e),
        ] {
            let _ = writeln!(
                o,
                "  {name:<8} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                p.mean, p.p50, p.p90, p.p99
            );
        }
        for s in &self.servers {
            let _ = writeln!(
                o,
                "server {} ({}, dp {}, B {}): iterations {} forward {} vetoed {}  occupancy {:.3} ({:.2} of B)  deferrals index {} blocks {}  dummies {}/{}/{} (added/committed/rolled back)  violations {}",
                s.name,
                s.role,
                s.dp,
                s.max_batch_size,
                s.iterations,
                s.forward_iterations,
                s.vetoed_iterations,
                s.occupancy,
                s.mean_scheduled_requests,
                s.deferrals.no_free_index_slot,
                s.deferrals.out_of_blocks,
                s.dummies.added,
                s.dummies.committed,
                s.dummies.rolled_back,
                s.violation_count
            );
            if s.transfers.count > 0 || s.transfers.timeouts > 0 {
                let x = &s.transfers;
                let _ = writeln!(
                    o,
                    "  transfers {} ({:.1} MB) mean {:.3} ms p99 {:.3} ms timeouts {} lost {} checksum failures {}  budget admitted {} deferred {} blocked by active {} max in flight {}",
                    x.count,
                    x.bytes as f64 / 1e6,
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
        let delta = if a != 0.0 {
            format!("{:+.1}%", (b - a) / a.abs() * 100.0)
        } else if b == 0.0 {
            "=".to_string()
        } else {
            "new".to_string()
        };
        let _ = writeln!(o, "{name:<36} {a:>14.3} {b:>14.3} {delta:>10}");
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
    row(
        "tpot mean (ms)",
        base.latency_ms.tpot.mean,
        treatment.latency_ms.tpot.mean,
    );
    row(
        "e2e p99 (ms)",
        base.latency_ms.e2e.p99,
        treatment.latency_ms.e2e.p99,
    );
    for (a, b) in base.servers.iter().zip(&treatment.servers) {
        let n = &a.name;
        row(&format!("{n}: occupancy"), a.occupancy, b.occupancy);
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

/// The client side's record of one request, from which latencies are computed.
#[derive(Debug, Clone)]
pub struct ClientRecord {
    /// What was submitted.
    pub spec: lockstep_actors::request::RequestSpec,
    /// When it arrived.
    pub arrival_ns: u64,
    /// When the first output token reached the client.
    pub first_token_ns: Option<u64>,
    /// When it ended.
    pub end_ns: Option<u64>,
    /// Output tokens received.
    pub output_tokens: u32,
    /// Completed (rather than failed).
    pub completed: bool,
    /// Why it failed, if it did.
    pub failure: Option<String>,
    /// A digest of the token stream received.
    pub token_digest: u64,
}

impl ClientRecord {
    /// A request that arrived at `arrival_ns`.
    pub fn new(spec: lockstep_actors::request::RequestSpec, arrival_ns: u64) -> ClientRecord {
        ClientRecord {
            spec,
            arrival_ns,
            first_token_ns: None,
            end_ns: None,
            output_tokens: 0,
            completed: false,
            failure: None,
            token_digest: 0,
        }
    }

    /// Records the tokens of one response received at `now_ns`.
    pub fn on_tokens(&mut self, r: &lockstep_actors::executor::Response, now_ns: u64) {
        if r.new_tokens > 0 {
            self.first_token_ns.get_or_insert(now_ns);
            self.output_tokens += r.new_tokens;
            // The stream's identity, so drivers can be compared token for token.
            self.token_digest = lockstep_actors::kv::mix(
                self.token_digest ^ (u64::from(r.last_token) << 32 | u64::from(r.new_tokens)),
            );
        }
    }

    /// Applies one response received at `now_ns` (aggregated servers: a completion ends
    /// the request; disaggregated drivers handle `ContextDone` themselves).
    pub fn on_response(&mut self, r: &lockstep_actors::executor::Response, now_ns: u64) {
        use lockstep_actors::executor::Finish;
        self.on_tokens(r, now_ns);
        match &r.finish {
            None | Some(Finish::ContextDone) => {}
            Some(Finish::Completed) => self.end(now_ns, true, None),
            Some(Finish::Failed(why)) => self.end(now_ns, false, Some(why.clone())),
            Some(Finish::Cancelled) => self.end(now_ns, false, Some("cancelled".into())),
        }
    }

    /// Ends the request once.
    pub fn end(&mut self, now_ns: u64, completed: bool, failure: Option<String>) {
        if self.end_ns.is_none() {
            self.end_ns = Some(now_ns);
            self.completed = completed;
            self.failure = failure;
        }
    }
}

/// What a server report needs from one rank; serializable, so the MPI driver can gather
/// it to rank 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
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
    #[serde(default)]
    pub kv_used_blocks: u32,
}

impl RankSummary {
    /// The summary of one rank's executor.
    pub fn of(
        exec: &lockstep_actors::executor::RankExecutor,
        iterations: u64,
        violations: Vec<Violation>,
        violation_count: u64,
    ) -> RankSummary {
        RankSummary {
            rank: exec.rank().0,
            totals: *exec.totals(),
            kv: *exec.kv().counters(),
            iterations,
            violations,
            violation_count,
            kv_used_blocks: exec.kv().used_blocks(),
        }
    }
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
    let mut deferrals = Deferrals::default();
    let mut dummies = Dummies::default();
    let mut kv = KvReport::default();
    let mut violations = Vec::new();
    let mut violation_count = 0;
    let mut transfers = TransferReport::default();
    let rank_reports = ranks
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
    ServerReport {
        name: name.to_string(),
        role: role.name().to_string(),
        dp,
        max_batch_size,
        iterations: ranks.first().map_or(0, |r| r.iterations),
        forward_iterations: forward,
        vetoed_iterations: ranks.first().map_or(0, |r| r.totals.vetoed_iterations),
        mean_scheduled_requests: mean,
        occupancy: mean / f64::from(max_batch_size.max(1)),
        busy_time_s,
        ranks: rank_reports,
        deferrals,
        dummies,
        kv,
        transfers,
        violations,
        violation_count,
    }
}

/// Builds the whole report from the client records and the servers' reports.
/// Requests still open when the run ended count as failed (a crashed or deadlocked run
/// fails what it held).
pub fn assemble_report(
    scenario: &crate::scenario::Scenario,
    seed: u64,
    records: Vec<ClientRecord>,
    end_ns: u64,
    wall_time_s: f64,
    servers: Vec<ServerReport>,
    outcome: Option<(Outcome, String)>,
) -> Report {
    let (outcome, outcome_detail) = match outcome {
        Some((o, d)) => (o, Some(d)),
        None => (Outcome::Completed, None),
    };
    let per_request = records
        .iter()
        .map(|r| RequestDetail {
            id: r.spec.id.0,
            output_tokens: r.output_tokens,
            token_digest: format!("{:016x}", r.token_digest),
            failure: match (r.end_ns, r.completed) {
                (Some(_), true) => None,
                (Some(_), false) => Some(r.failure.clone().unwrap_or_else(|| "failed".into())),
                (None, _) => Some(format!(
                    "still open when the run ended ({})",
                    outcome.name()
                )),
            },
        })
        .collect();
    let mut counts = RequestCounts {
        submitted: records.len() as u64,
        ..RequestCounts::default()
    };
    let (mut ttft, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new());
    let (mut total_tokens, mut output_tokens) = (0u64, 0u64);
    for r in &records {
        match (r.end_ns, r.completed) {
            (Some(end), true) => {
                counts.completed += 1;
                output_tokens += u64::from(r.output_tokens);
                total_tokens += u64::from(r.output_tokens) + u64::from(r.spec.prompt_len);
                e2e.push(end.saturating_sub(r.arrival_ns) as f64 / 1e6);
                if let Some(first) = r.first_token_ns {
                    ttft.push(first.saturating_sub(r.arrival_ns) as f64 / 1e6);
                    if r.output_tokens > 1 {
                        tpot.push(
                            end.saturating_sub(first) as f64 / 1e6 / f64::from(r.output_tokens - 1),
                        );
                    }
                }
            }
            _ => counts.failed += 1,
        }
    }
    let secs = end_ns as f64 / 1e9;
    let per_s = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
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
        virtual_time_s: secs,
        wall_time_s,
        throughput: Throughput {
            total_tokens_per_s: per_s(total_tokens as f64),
            output_tokens_per_s: per_s(output_tokens as f64),
            requests_per_s: per_s(counts.completed as f64),
        },
        latency_ms: Latency {
            ttft: Percentiles::of(&mut ttft),
            tpot: Percentiles::of(&mut tpot),
            e2e: Percentiles::of(&mut e2e),
        },
        servers,
        per_request,
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
