//! `GET /metrics`: Prometheus text (prometheus-client), named after vLLM's metrics with
//! a `lockstep_` prefix in place of `vllm:` (README "Serving over HTTP" has the table).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use lockstep_runtime::status::{RankStatus, StatusBoard};

/// vLLM's buckets for the time to first token, in seconds.
/// A request's front-door service: from tens of µs (parse, hand-off) to a second (a
/// long prompt through a slow tokenizer).
const FRONT_BUCKETS: [f64; 12] = [
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.1, 1.0,
];

const TTFT_BUCKETS: [f64; 17] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0,
];
/// vLLM's buckets for the end-to-end latency, in seconds.
const E2E_BUCKETS: [f64; 16] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
];

/// The metrics (cheap to clone: every one is shared).
#[derive(Clone)]
pub struct Metrics {
    /// Requests that produced a token and have not finished.
    pub running: Gauge,
    /// Requests accepted that have not produced a token (queued or in prefill).
    pub waiting: Gauge,
    /// Prompt tokens of every request accepted.
    pub prompt_tokens: Counter,
    /// Output tokens delivered.
    pub generation_tokens: Counter,
    /// Requests that reached their length.
    pub request_success: Counter,
    /// Requests that failed.
    pub request_failure: Counter,
    /// Requests cancelled because their client disconnected or stopped reading.
    pub request_cancelled: Counter,
    /// Streams closed because their client read nothing for `--write-timeout-s`.
    pub request_stalled: Counter,
    /// Requests holding a `--max-pending` place.
    pub pending: crate::bridge::Pending,
    /// Requests refused with 429 (too many pending).
    pub request_rejected: Counter,
    /// Seconds from receipt to the first token.
    pub ttft: Histogram,
    /// Seconds from receipt to the last token of a completed request.
    pub e2e: Histogram,
    /// The front door's service of each request accepted: seconds from receipt to the
    /// hand-off to the executor (read, parse, tokenize, check) — what `[frontend]`'s
    /// `request_us` and `prompt_token_ns` model.
    pub front_service: Histogram,
    /// The front door's seconds spent turning output tokens into answer text and
    /// events (detokenize, stop strings, JSON) — what `output_token_ns` models.
    pub front_output: Counter<f64, AtomicU64>,
}

impl Metrics {
    /// The metrics and the registry that encodes them, with the ranks' live status
    /// from `board` (named by `servers`, in scenario order).
    pub fn new(board: StatusBoard, servers: Vec<String>) -> (Metrics, Registry) {
        let m = Metrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Counter::default(),
            request_failure: Counter::default(),
            request_cancelled: Counter::default(),
            request_stalled: Counter::default(),
            pending: crate::bridge::Pending::default(),
            request_rejected: Counter::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            front_service: Histogram::new(FRONT_BUCKETS),
            front_output: Counter::default(),
        };
        let mut r = Registry::with_prefix("lockstep");
        r.register(
            "num_requests_running",
            "Requests that produced a token and have not finished",
            m.running.clone(),
        );
        r.register(
            "num_requests_waiting",
            "Requests accepted that have not produced a token yet",
            m.waiting.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of the requests accepted",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Output tokens delivered",
            m.generation_tokens.clone(),
        );
        r.register(
            "request_success",
            "Requests that reached max_tokens",
            m.request_success.clone(),
        );
        r.register(
            "request_failure",
            "Requests that failed",
            m.request_failure.clone(),
        );
        r.register(
            "num_requests_pending",
            "Requests holding a --max-pending place: accepted, and not both ended and handed to their connection",
            m.pending.gauge(),
        );
        r.register(
            "request_cancelled",
            "Requests cancelled on their ranks because their client disconnected or stopped reading",
            m.request_cancelled.clone(),
        );
        r.register(
            "request_stalled",
            "Streams closed because their client read nothing for --write-timeout-s (their requests cancelled)",
            m.request_stalled.clone(),
        );
        r.register(
            "request_rejected",
            "Requests refused with 429: too many requests pending (--max-pending)",
            m.request_rejected.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Seconds from receipt to the first output token",
            m.ttft.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Seconds from receipt to the end of a completed request",
            m.e2e.clone(),
        );
        r.register(
            "front_service_seconds",
            "Seconds from receipt of a request to its hand-off to the executor (read, parse, tokenize, check)",
            m.front_service.clone(),
        );
        r.register(
            "front_output_seconds",
            "Seconds spent turning output tokens into answer text and events",
            m.front_output.clone(),
        );
        r.register_collector(Box::new(RankCollector { board, servers }));
        (m, r)
    }
}

/// The ranks' counters, from the latest status each rank published (labels `server`,
/// `rank`), encoded at each scrape.
#[derive(Debug)]
struct RankCollector {
    board: StatusBoard,
    servers: Vec<String>,
}

/// One per-rank series: its name, help, whether it is a counter, and its value.
type Series = (&'static str, &'static str, bool, fn(&RankStatus) -> f64);

const RANK_SERIES: [Series; 12] = [
    (
        "kv_cache_usage_perc",
        "KV cache usage of the rank, from 0 to 1 (blocks held by a sequence / blocks)",
        false,
        |s| {
            if s.kv_blocks_total == 0 {
                0.0
            } else {
                f64::from(s.kv_blocks_used) / f64::from(s.kv_blocks_total)
            }
        },
    ),
    (
        "kv_cache_used_blocks",
        "KV blocks held by a sequence on the rank",
        false,
        |s| f64::from(s.kv_blocks_used),
    ),
    (
        "rank_requests_resident",
        "Requests started on the rank and not ended",
        false,
        |s| f64::from(s.resident),
    ),
    (
        "prefix_cache_hit_blocks",
        "KV blocks served from the rank's prefix cache",
        true,
        |s| s.kv.reuse_hits as f64,
    ),
    (
        "rank_routed_requests",
        "Requests routed to the rank (its routing share: this over the server's sum)",
        true,
        |s| s.totals.routed_requests as f64,
    ),
    ("rank_iterations", "Iterations the rank ran", true, |s| {
        s.totals.iterations as f64
    }),
    (
        "rank_vetoed_iterations",
        "Iterations whose forward some rank vetoed",
        true,
        |s| s.totals.vetoed_iterations as f64,
    ),
    (
        "rank_scheduled_requests",
        "Real requests in the batches the rank scheduled, summed over iterations (per iteration: over rank_iterations)",
        true,
        |s| s.totals.iteration_scheduled_requests as f64,
    ),
    (
        "rank_dummy_iterations",
        "Forward iterations in which the rank ran a pad dummy",
        true,
        |s| s.totals.dummy_iterations as f64,
    ),
    (
        "rank_deferrals",
        "Requests not run in an iteration for lack of a KV index slot or of KV blocks",
        true,
        |s| (s.totals.deferrals_no_free_index_slot + s.totals.deferrals_out_of_blocks) as f64,
    ),
    (
        "rank_kv_transfers",
        "KV receives the rank's transfer budget admitted (gen servers)",
        true,
        |s| s.totals.transfer_budget_admitted as f64,
    ),
    (
        "rank_preemptions",
        "MAX_UTILIZATION pauses (a started request reset to be recomputed)",
        true,
        |s| s.totals.preemptions as f64,
    ),
];

impl Collector for RankCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ranks = self.board.snapshot();
        if ranks.is_empty() {
            return Ok(());
        }
        for (name, help, counter, value) in RANK_SERIES {
            let kind = if counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for s in &ranks {
                let server = self
                    .servers
                    .get(s.server as usize)
                    .cloned()
                    .unwrap_or_else(|| s.server.to_string());
                let labels = [("server", server), ("rank", s.rank.to_string())];
                let one = family.encode_family(&labels)?;
                if counter {
                    ConstCounter::new(value(s)).encode(one)?;
                } else {
                    ConstGauge::new(value(s)).encode(one)?;
                }
            }
        }
        Ok(())
    }
}

/// The registry in Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}
