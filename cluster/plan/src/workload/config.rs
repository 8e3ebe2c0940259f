//! The `[workload]` table of a scenario and its validation. Every error names the key as
//! written in the scenario (`workload.<key>`) and the offending value.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::WorkloadError;

/// Which generator produces the arrivals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkloadKind {
    /// A fixed number of clients (`concurrency`), each sending its next request after the
    /// previous one ended plus `think_time_ms`.
    ClosedLoop,
    /// Poisson arrivals at `rate` per second, independent of completions.
    OpenLoop,
    /// Arrivals and lengths replayed from a trace file (`[workload.trace]`).
    Trace,
}

/// A length: a fixed number (`input_len = 1024`) or an inclusive range drawn uniformly
/// (`input_len = [100, 2000]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LenSpec {
    /// Always this many tokens.
    Fixed(u32),
    /// Uniform over `[min, max]`, both inclusive.
    Range([u32; 2]),
}

impl LenSpec {
    /// The smallest value this spec can produce.
    pub fn min(&self) -> u32 {
        match *self {
            LenSpec::Fixed(n) => n,
            LenSpec::Range([lo, _]) => lo,
        }
    }

    /// The largest value this spec can produce.
    pub fn max(&self) -> u32 {
        match *self {
            LenSpec::Fixed(n) => n,
            LenSpec::Range([_, hi]) => hi,
        }
    }

    /// Draws a value. A fixed length draws nothing, so it leaves the stream untouched.
    pub(crate) fn draw(&self, rng: &mut impl Rng) -> u32 {
        match *self {
            LenSpec::Fixed(n) => n,
            LenSpec::Range([lo, hi]) => rng.random_range(lo..=hi),
        }
    }

    /// Lengths are token or round counts: zero is never meaningful, and a range must be
    /// ordered.
    fn check(&self, field: &'static str) -> Result<(), WorkloadError> {
        match *self {
            LenSpec::Fixed(0) => Err(invalid(field, "must be at least 1, got 0".into())),
            LenSpec::Fixed(_) => Ok(()),
            LenSpec::Range([lo, hi]) if lo == 0 => Err(invalid(
                field,
                format!("range [{lo}, {hi}] must start at 1 or more"),
            )),
            LenSpec::Range([lo, hi]) if lo > hi => Err(invalid(
                field,
                format!("range [{lo}, {hi}] has its minimum above its maximum"),
            )),
            LenSpec::Range(_) => Ok(()),
        }
    }
}

impl std::fmt::Display for LenSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LenSpec::Fixed(n) => write!(f, "{n}"),
            LenSpec::Range([lo, hi]) => write!(f, "[{lo}, {hi}]"),
        }
    }
}

/// Multi-round conversations (`[workload.conversation]`): each round's prompt is the
/// previous prompt plus the previous output plus `new_tokens_per_round` new tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConversationConfig {
    /// Rounds (requests) per conversation.
    pub rounds: LenSpec,
    /// New user tokens appended in each round after the first.
    pub new_tokens_per_round: LenSpec,
}

/// The format of a trace file; see `data/traces/README.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// JSON Lines: `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [..]}`.
    Mooncake,
    /// CSV: `TIMESTAMP,ContextTokens,GeneratedTokens` with absolute date-times.
    Azure,
}

fn default_time_scale() -> f64 {
    1.0
}

/// A trace to replay (`[workload.trace]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceConfig {
    /// The file; a relative path is resolved against the scenario file's folder.
    pub path: String,
    /// How the file is laid out.
    pub format: TraceFormat,
    /// Multiplies every arrival time: 0.5 replays the trace twice as fast.
    #[serde(default = "default_time_scale")]
    pub time_scale: f64,
    /// Tokens per `hash_ids` entry of a Mooncake trace (default 512).
    #[serde(default)]
    pub block_tokens: Option<u32>,
    /// Records passed over from the start: the replay begins at the next one, at time 0
    /// (`num_requests` then counts from there).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub skip: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Mooncake's published traces hash 512-token blocks.
pub const DEFAULT_TRACE_BLOCK_TOKENS: u32 = 512;

impl TraceConfig {
    /// The trace block size in tokens.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens.unwrap_or(DEFAULT_TRACE_BLOCK_TOKENS)
    }
}

fn default_input_len() -> LenSpec {
    LenSpec::Fixed(1024)
}

fn default_output_len() -> LenSpec {
    LenSpec::Fixed(128)
}

/// The `[workload]` table of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadConfig {
    /// `"closed_loop"`, `"open_loop"` or `"trace"`.
    pub kind: WorkloadKind,
    /// Requests in total (closed and open loop: required; trace: an optional cap on the
    /// records used). With conversations this counts rounds, not conversations.
    #[serde(default)]
    pub num_requests: Option<u64>,
    /// Closed loop: requests (or conversations) outstanding at once.
    #[serde(default)]
    pub concurrency: Option<u64>,
    /// Open loop: mean arrivals (or conversation starts) per second.
    #[serde(default)]
    pub rate: Option<f64>,
    /// Prompt tokens of a synthetic request (the first round of a conversation).
    #[serde(default = "default_input_len")]
    pub input_len: LenSpec,
    /// Output tokens of a synthetic request.
    #[serde(default = "default_output_len")]
    pub output_len: LenSpec,
    /// Closed loop and conversations: delay after a response before the next request.
    #[serde(default)]
    pub think_time_ms: f64,
    /// Synthetic: every prompt starts with this many tokens that are the same for all
    /// requests (same block hashes), so they can be served from the prefix cache.
    #[serde(default)]
    pub shared_prefix_tokens: u32,
    /// Turns each closed- or open-loop client into multi-round conversations.
    #[serde(default)]
    pub conversation: Option<ConversationConfig>,
    /// The trace to replay (kind `"trace"` only).
    #[serde(default)]
    pub trace: Option<TraceConfig>,
    /// Seeds the workload stream instead of the run's seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Requests sent one at a time, each after the previous one ended, before the
    /// measured load starts (as benchmark clients warm a server up). They count in the
    /// request totals and are reported apart: latency and throughput cover the measured
    /// load only. Synthetic lengths (`input_len`, `output_len`); a trace's first record.
    #[serde(default)]
    pub warmup_requests: u32,
    /// Seconds over which the measured load ramps up: closed-loop clients start evenly
    /// spread over them; open-loop and trace arrivals are stretched so the arrival rate
    /// rises linearly from 0 to full over them (no request is dropped). 0: all at once.
    #[serde(default)]
    pub ramp_s: f64,
}

/// Requests one run can hold (about 200 bytes of record each).
pub const MAX_REQUESTS: u64 = 100_000_000;

/// Warm-up requests at most.
pub const MAX_WARMUP: u64 = 10_000;

pub(crate) fn invalid(field: &'static str, message: String) -> WorkloadError {
    WorkloadError::Invalid { field, message }
}

impl WorkloadConfig {
    /// Checks every value without reading a trace. `tokens_per_block` is the servers' KV
    /// block size; a Mooncake trace block must be a whole number of KV blocks.
    pub fn validate(&self, tokens_per_block: u32) -> Result<(), WorkloadError> {
        if tokens_per_block == 0 {
            return Err(invalid(
                "tokens_per_block",
                "the KV block size must be at least 1, got 0".into(),
            ));
        }
        if let Some(0) = self.num_requests {
            return Err(invalid(
                "workload.num_requests",
                "must be at least 1, got 0".into(),
            ));
        }
        // The workload plans its requests up front (conversations, the report's records):
        // a count no run could finish is refused instead of allocated.
        if let Some(n) = self.num_requests
            && n > MAX_REQUESTS
        {
            return Err(invalid(
                "workload.num_requests",
                format!("{n} is more than the {MAX_REQUESTS} one run can hold"),
            ));
        }
        if u64::from(self.warmup_requests) > MAX_WARMUP {
            return Err(invalid(
                "workload.warmup_requests",
                format!(
                    "{} is more than {MAX_WARMUP} (they are sent one at a time)",
                    self.warmup_requests
                ),
            ));
        }
        if !(self.ramp_s.is_finite() && self.ramp_s >= 0.0) {
            return Err(invalid(
                "workload.ramp_s",
                format!("must be a finite number >= 0, got {}", self.ramp_s),
            ));
        }
        if !(self.think_time_ms.is_finite() && self.think_time_ms >= 0.0) {
            return Err(invalid(
                "workload.think_time_ms",
                format!("must be a finite number >= 0, got {}", self.think_time_ms),
            ));
        }
        let kind = match self.kind {
            WorkloadKind::ClosedLoop => "closed_loop",
            WorkloadKind::OpenLoop => "open_loop",
            WorkloadKind::Trace => "trace",
        };
        // A key the chosen kind ignores is almost always a mistake in the scenario.
        let unused = |field: &'static str, value: String| {
            invalid(
                field,
                format!("= {value} has no effect with kind = \"{kind}\""),
            )
        };
        match self.kind {
            WorkloadKind::ClosedLoop | WorkloadKind::OpenLoop => {
                if self.num_requests.is_none() {
                    return Err(invalid(
                        "workload.num_requests",
                        format!("is required with kind = \"{kind}\""),
                    ));
                }
                if let Some(t) = &self.trace {
                    return Err(unused(
                        "workload.trace",
                        format!("{{ path = {:?} }}", t.path),
                    ));
                }
                self.input_len.check("workload.input_len")?;
                self.output_len.check("workload.output_len")?;
                if self.shared_prefix_tokens > self.input_len.min() {
                    return Err(invalid(
                        "workload.shared_prefix_tokens",
                        format!(
                            "{} is longer than the shortest prompt (input_len = {})",
                            self.shared_prefix_tokens, self.input_len
                        ),
                    ));
                }
                if let Some(c) = &self.conversation {
                    c.rounds.check("workload.conversation.rounds")?;
                    c.new_tokens_per_round
                        .check("workload.conversation.new_tokens_per_round")?;
                }
            }
            WorkloadKind::Trace => {
                let Some(t) = &self.trace else {
                    return Err(invalid(
                        "workload.trace",
                        "is required with kind = \"trace\" (a [workload.trace] table with path and format)"
                            .into(),
                    ));
                };
                if !(t.time_scale.is_finite() && t.time_scale > 0.0) {
                    return Err(invalid(
                        "workload.trace.time_scale",
                        format!("must be a finite number > 0, got {}", t.time_scale),
                    ));
                }
                let bt = t.block_tokens();
                if bt == 0 || bt % tokens_per_block != 0 {
                    return Err(invalid(
                        "workload.trace.block_tokens",
                        format!(
                            "{bt} is not a multiple of the servers' tokens_per_block = {tokens_per_block}"
                        ),
                    ));
                }
                if self.conversation.is_some() {
                    return Err(unused("workload.conversation", "{ .. }".into()));
                }
                if self.think_time_ms != 0.0 {
                    return Err(unused(
                        "workload.think_time_ms",
                        self.think_time_ms.to_string(),
                    ));
                }
                if self.shared_prefix_tokens != 0 {
                    return Err(unused(
                        "workload.shared_prefix_tokens",
                        self.shared_prefix_tokens.to_string(),
                    ));
                }
            }
        }
        match (self.kind, self.concurrency) {
            (WorkloadKind::ClosedLoop, None) => {
                return Err(invalid(
                    "workload.concurrency",
                    "is required with kind = \"closed_loop\"".into(),
                ));
            }
            (WorkloadKind::ClosedLoop, Some(0)) => {
                return Err(invalid(
                    "workload.concurrency",
                    "must be at least 1, got 0".into(),
                ));
            }
            (WorkloadKind::ClosedLoop, Some(_)) | (_, None) => {}
            (_, Some(c)) => return Err(unused("workload.concurrency", c.to_string())),
        }
        match (self.kind, self.rate) {
            (WorkloadKind::OpenLoop, None) => {
                return Err(invalid(
                    "workload.rate",
                    "is required with kind = \"open_loop\"".into(),
                ));
            }
            (WorkloadKind::OpenLoop, Some(r)) if !(r.is_finite() && r > 0.0) => {
                return Err(invalid(
                    "workload.rate",
                    format!("must be a finite number > 0 (arrivals per second), got {r}"),
                ));
            }
            (WorkloadKind::OpenLoop, Some(_)) | (_, None) => {}
            (_, Some(r)) => return Err(unused("workload.rate", r.to_string())),
        }
        // Open loop without conversations never waits on a response.
        if self.kind == WorkloadKind::OpenLoop
            && self.conversation.is_none()
            && self.think_time_ms != 0.0
        {
            return Err(invalid(
                "workload.think_time_ms",
                format!(
                    "= {} has no effect with kind = \"open_loop\" without [workload.conversation]",
                    self.think_time_ms
                ),
            ));
        }
        Ok(())
    }
}
