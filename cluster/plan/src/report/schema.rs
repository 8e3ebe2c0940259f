//! The report's schema: what a run tells its user (admission, occupancy, routing balance,
//! throughput, latency, transfers), serialised as JSON.

use serde::{Deserialize, Serialize};

pub use super::detail::RequestDetail;

use lockstep_actors::invariants::Violation;

/// How the run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every request completed.
    Completed,
    /// The run ended as planned, but not every request completed: some failed or were
    /// cancelled, each with its reason (the detail counts them by kind).
    Incomplete,
    /// A violation that crashes the real executor happened.
    Crashed,
    /// Work remained and nothing could make progress.
    Deadlocked,
    /// A rank's loop failed (a collective error, a lost device or rank).
    Failed,
}

impl Outcome {
    /// Name used in tables.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Incomplete => "incomplete",
            Outcome::Crashed => "crashed",
            Outcome::Deadlocked => "deadlocked",
            Outcome::Failed => "failed",
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
    /// Of the submitted, warm-up requests (`workload.warmup_requests`), left out of
    /// latency and throughput.
    #[serde(default)]
    pub warmup: u64,
}

/// Throughput of the measured load (after any warm-up), from its first arrival to the
/// end of the run.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Throughput {
    /// (prompt + output) tokens of completed requests per second.
    pub total_tokens_per_s: f64,
    /// Output tokens per second.
    pub output_tokens_per_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Seconds the rates above divide by: from the measured load's first arrival to the
    /// end of the run.
    #[serde(default)]
    pub duration_s: f64,
}

/// Which clock a report's times are on.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum TimeBase {
    /// The simulator's virtual time.
    #[default]
    Virtual,
    /// A real driver pacing the cost model: wall time divided by the time scale, so the
    /// figures compare with the simulator's.
    Modeled {
        /// Wall seconds per modeled second.
        time_scale: f64,
    },
    /// A real driver with the zero-cost backend: wall time of the control plane alone;
    /// latencies and throughput describe this machine, not a model.
    ZeroCost,
    /// A real driver running a real model (`--model`): wall time, every forward the
    /// model's own (`--time-scale` paces only the arrivals).
    RealModel,
    /// A client measuring a server over HTTP (`lockstep bench`): wall time at the
    /// client; the report has no server sections (a client cannot see them).
    Client,
}

impl TimeBase {
    /// The clock of a real driver's run (threads, MPI, `serve`): the model's own time
    /// with `--model`, the cost model paced at `time_scale` wall seconds per modeled
    /// second when it is positive, else the zero-cost backend's wall time. The one rule
    /// the report's rescaling, `serve`'s notice and its `/v1/models` all read.
    pub fn of_real_run(model: bool, time_scale: f64) -> TimeBase {
        if model {
            TimeBase::RealModel
        } else if time_scale > 0.0 {
            TimeBase::Modeled { time_scale }
        } else {
            TimeBase::ZeroCost
        }
    }
}

/// Summary statistics of one latency, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Percentiles {
    /// Samples (0: the metric does not apply, e.g. TPOT with one output token).
    #[serde(default)]
    pub samples: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
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
    /// Inter-token latency: every gap between two successive deliveries of output
    /// tokens to the client (HDR histogram, three significant digits).
    #[serde(default)]
    pub itl: Percentiles,
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
    /// Real requests per rank per *forward* iteration (what the forwards carried).
    pub mean_scheduled_requests: f64,
    /// `mean_scheduled_requests / max_batch_size`: the forwarded occupancy.
    pub occupancy: f64,
    /// Real requests per rank per iteration, skipped ones included (what the ranks
    /// scheduled, as the reference executor's log counts it; a request deferred by a
    /// skip counts in the skipped iteration and again in the forward).
    #[serde(default)]
    pub scheduled_per_iteration: f64,
    /// Under overlap: rank-iterations whose previous batch a skipped forward deferred.
    #[serde(default)]
    pub deferred_batches: u64,
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
    /// Preemptions: MAX_UTILIZATION pauses (a started request reset to context, its KV
    /// freed, its tokens recomputed later), all ranks.
    #[serde(default)]
    pub preemptions: u64,
    /// KV usage, waiting queue, running requests and preemptions over time, sampled
    /// at iteration ends (fewer than 2,000 points, evenly spaced in iterations).
    #[serde(default)]
    pub timeseries: Vec<SeriesPoint>,
    /// How evenly the ranks shared the forwards (balance ratio, speed of light).
    #[serde(default)]
    pub balance: BalanceReport,
}

/// A server's balance figures (TensorRT-LLM's ADP balance metrics; `report/balance.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct BalanceReport {
    /// Iterations in which some rank carried tokens (the ratio's samples).
    pub measured_iterations: u64,
    /// Mean over those of the balance ratio (mean tokens over max tokens across ranks);
    /// `null` when no iteration carried tokens.
    pub mean_ratio: Option<f64>,
    /// Σ iteration time, s (rank 0's clock, fetch to end).
    pub busy_time_s: f64,
    /// From the first iteration's start to the last one's end, s.
    pub span_s: f64,
    /// Σ iteration time × (1 − balance ratio), s: what perfect balance would save.
    pub imbalance_time_s: f64,
    /// Output tokens the server's ranks produced, per second of its span.
    pub output_tokens_per_s: f64,
    /// The same at the speed of light: every iteration perfectly balanced.
    pub sol_output_tokens_per_s: f64,
    /// `span / (span − imbalance)`.
    pub sol_speedup: f64,
    /// `1 − actual / speed of light`: the share of the speed-of-light throughput lost to
    /// imbalance.
    pub sol_gap: f64,
    /// Iterations the balance policy held context work.
    pub held_iterations: u64,
    /// Iterations whose held context work ran because `timeout_iters` passed.
    pub timed_out_iterations: u64,
}

/// One point of a server's time series.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct SeriesPoint {
    /// The iteration.
    pub iteration: u64,
    /// When it ended, on the report's clock (`time_base`), in seconds.
    pub t_s: f64,
    /// KV blocks held by sequences, all ranks.
    pub kv_blocks_used: u64,
    /// `kv_blocks_used` / every rank's KV blocks.
    pub kv_usage: f64,
    /// The server's waiting queue: admitted by the front, not yet routed to a rank.
    pub waiting: u64,
    /// Real requests scheduled this iteration, all ranks.
    pub running: u64,
    /// Preemptions so far, all ranks.
    pub preemptions: u64,
    /// The iteration's balance ratio (mean over max tokens across ranks); `null` when no
    /// rank carried a token.
    #[serde(default)]
    pub balance_ratio: Option<f64>,
}

/// Service-level objectives for goodput (`--slo ttft_ms=…,tpot_ms=…,e2e_ms=…`): a
/// request is good when it completed and meets every objective given.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token at most this (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Time per output token at most this (ms); a request with one output token has
    /// TPOT 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// End-to-end latency at most this (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_ms: Option<f64>,
}

/// Goodput under an [`Slo`], as vLLM's benchmark defines it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Goodput {
    /// The objectives.
    pub slo: Slo,
    /// Measured requests that completed and met every objective.
    pub good_requests: u64,
    /// `good_requests` per second of the measured load (`throughput.duration_s`).
    pub requests_per_s: f64,
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
    /// The clock of every time in the report.
    #[serde(default)]
    pub time_base: TimeBase,
    /// Time at the end, on the report's clock (`time_base`).
    pub virtual_time_s: f64,
    /// Wall-clock time of the run (the only field that varies between identical runs).
    pub wall_time_s: f64,
    /// Throughput.
    pub throughput: Throughput,
    /// Latency.
    pub latency_ms: Latency,
    /// Goodput, when the run was given `--slo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub goodput: Option<Goodput>,
    /// Servers in scenario order.
    pub servers: Vec<ServerReport>,
    /// The serving front door (`[frontend]`), when the run had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<FrontendSummary>,
    /// Per request, in id order: output tokens, the token stream's digest, the failure
    /// reason if any (for comparing drivers and runs request by request), and its times.
    pub per_request: Vec<RequestDetail>,
}

/// What the serving front door did over the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FrontendSummary {
    /// Its processes.
    pub processes: u32,
    /// The share of its processes' time spent serving jobs over the run.
    pub utilization: f64,
    /// The most requests inside it at once (waiting or in service).
    pub peak_queue: u32,
    /// The measured requests' mean wait for a process (ms).
    #[serde(default)]
    pub mean_queue_ms: f64,
    /// The measured requests' mean service (ms).
    #[serde(default)]
    pub mean_service_ms: f64,
}

impl FrontendSummary {
    /// One line for the tables.
    pub fn describe(&self) -> String {
        format!(
            "{} process{}, utilization {:.3}, peak queue {}; per request {:.3} ms waiting, {:.3} ms in service",
            self.processes,
            if self.processes == 1 { "" } else { "es" },
            self.utilization,
            self.peak_queue,
            self.mean_queue_ms,
            self.mean_service_ms
        )
    }
}
