//! `GET /metrics`: Prometheus text (prometheus-client), named after vLLM's metrics with
//! a `lockstep_` prefix in place of `vllm:` (README "Serving over HTTP" has the table).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// vLLM's buckets for the time to first token, in seconds.
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
    /// Seconds from receipt to the first token.
    pub ttft: Histogram,
    /// Seconds from receipt to the last token of a completed request.
    pub e2e: Histogram,
}

impl Metrics {
    /// The metrics and the registry that encodes them.
    pub fn new() -> (Metrics, Registry) {
        let m = Metrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Counter::default(),
            request_failure: Counter::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
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
            "time_to_first_token_seconds",
            "Seconds from receipt to the first output token",
            m.ttft.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Seconds from receipt to the end of a completed request",
            m.e2e.clone(),
        );
        (m, r)
    }
}

/// The registry in Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}
