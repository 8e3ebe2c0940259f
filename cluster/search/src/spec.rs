//! The search spec (`lockstep search SPEC.toml`): the model and its GPUs, the workload,
//! the latency objectives, what to optimise, and the space of configurations.
//!
//! Every check names the key and the value; a spec that passes them is searched.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use lockstep_actors::config::{CapacitySchedulerPolicy, RouterKind};
use lockstep_plan::model::ModelConfig;
use lockstep_plan::workload::{LenSpec, TraceConfig, TraceFormat, TraceSummary, WorkloadError};

use crate::SearchError;

/// A whole spec.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchSpec {
    /// Names the search in its outputs (default: the file's stem).
    #[serde(default)]
    pub name: Option<String>,
    /// A scenario's `[model]`: `hf_config` and `gpu` (and precisions), whose roofline
    /// times each candidate's rank shape, or a `profile` (one rank, whatever its GPUs).
    /// `tp` and `ep` are the search's to choose.
    pub model: ModelConfig,
    /// The GPUs a configuration may use.
    pub gpus: Gpus,
    /// The requests.
    pub workload: SearchWorkload,
    /// Latency objectives at percentiles.
    #[serde(default)]
    pub slo: SloSpec,
    /// What makes one configuration better than another.
    #[serde(default)]
    pub objective: Objective,
    /// The configurations searched.
    #[serde(default)]
    pub space: Space,
    /// How hard to look.
    #[serde(default)]
    pub method: Method,
    /// The serving front door, as a scenario's `[frontend]` (default: the `python`
    /// preset, TensorRT-LLM's own).
    #[serde(default)]
    pub frontend: lockstep_plan::frontend::FrontendConfig,
    /// The control plane's policy, as a scenario's `[policy]` (`preset = "fixed"`, the
    /// default, or `"legacy"`, and any switch).
    #[serde(default, rename = "policy")]
    pub policy_table: Option<toml::Table>,
    /// `policy_table` read.
    #[serde(skip, default = "fixed_policy")]
    pub policy: lockstep_actors::policy::Policy,
    /// Seeds every simulation (finalists also run `method.seeds` further seeds).
    #[serde(default)]
    pub seed: u64,
    /// The folder `model.hf_config` is relative to.
    #[serde(skip)]
    pub base_dir: PathBuf,
}

/// `[gpus]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpus {
    /// The budget: a configuration uses at most this many GPUs.
    pub total: u32,
    /// GPUs per node: a rank's tensor-parallel GPUs stay in one node.
    #[serde(default = "default_per_node")]
    pub per_node: u32,
    /// KV tokens one rank holds; required with a `profile` (the roofline sizes it from
    /// `hf_config` otherwise).
    #[serde(default)]
    pub kv_tokens_per_rank: Option<u64>,
}

fn fixed_policy() -> lockstep_actors::policy::Policy {
    lockstep_actors::policy::Policy::FIXED
}

fn default_per_node() -> u32 {
    8
}

/// What the search varies to load a configuration.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadKind {
    /// Closed-loop clients, each sending its next request when the last one ends.
    #[default]
    Concurrency,
    /// Open-loop arrivals at a mean rate (requests per second, Poisson).
    Rate,
}

/// `[workload]`: the requests; the search finds the highest load (clients, or an
/// arrival rate) each configuration serves within the objectives. The lengths come
/// from `input_len` and `output_len`, or from a recorded trace.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchWorkload {
    /// Prompt tokens (`4096` or `[1024, 8192]`, uniform); absent with a trace.
    #[serde(default)]
    pub input_len: Option<LenSpec>,
    /// Output tokens; absent with a trace.
    #[serde(default)]
    pub output_len: Option<LenSpec>,
    /// `concurrency` (the default) or `rate` (the only one with a trace).
    #[serde(default)]
    pub load: Option<LoadKind>,
    /// The most clients tried (default: twice the configuration's batch slots).
    #[serde(default)]
    pub max_concurrency: Option<u32>,
    /// The highest rate tried, requests per second (default: 1.5 times the most the
    /// configuration's bound allows).
    #[serde(default)]
    pub max_rate: Option<f64>,
    /// Requests per client in one simulation (at least `min_requests` in all; default
    /// 3); absent with a trace.
    #[serde(default)]
    pub requests_per_client: Option<u32>,
    /// Requests in one simulation at least (default 32); absent with a trace.
    #[serde(default)]
    pub min_requests: Option<u32>,
    /// A trace replayed in place of synthetic requests (`[workload.trace]`).
    #[serde(default)]
    pub trace: Option<SearchTrace>,
}

/// `[workload.trace]`: the first `requests` records of a trace, their lengths, prefixes
/// and arrival pattern kept; the search varies how fast they are replayed (the load is
/// the replayed arrival rate, requests per second).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchTrace {
    /// The file; a relative path is resolved against the spec file's folder.
    pub path: String,
    /// `mooncake` or `azure`, as a scenario's `[workload.trace]`.
    pub format: TraceFormat,
    /// Tokens per `hash_ids` entry of a Mooncake trace (default 512).
    #[serde(default)]
    pub block_tokens: Option<u32>,
    /// Records replayed by each simulation, from the first (default 1,000, as
    /// `vllm bench serve --num-prompts`).
    #[serde(default = "default_trace_requests")]
    pub requests: u64,
    /// The file, resolved (filled in when the spec is read).
    #[serde(skip)]
    pub resolved_path: PathBuf,
    /// What the replayed records hold, window by window (filled in when the spec is
    /// read): window 0 is the first `requests` records, which the search replays;
    /// window `k` the `k`-th next ones, which a finalist's further seed `k` replays, as
    /// many whole windows as the trace holds, up to `method.seeds`.
    #[serde(skip)]
    pub windows: Vec<TraceSummary>,
}

fn default_trace_requests() -> u64 {
    1000
}

impl SearchTrace {
    /// The scenario's `[workload.trace]` replaying window `window` `time_scale` times as
    /// slowly.
    pub fn config(&self, time_scale: f64, window: usize) -> TraceConfig {
        TraceConfig {
            path: self.resolved_path.display().to_string(),
            format: self.format,
            time_scale,
            block_tokens: self.block_tokens,
            skip: window as u64 * self.requests,
        }
    }
}

impl SearchWorkload {
    /// Requests per client in one simulation.
    pub fn requests_per_client(&self) -> u32 {
        self.requests_per_client
            .unwrap_or(DEFAULT_REQUESTS_PER_CLIENT)
    }

    /// Requests in one simulation at least.
    pub fn min_requests(&self) -> u32 {
        self.min_requests.unwrap_or(DEFAULT_MIN_REQUESTS)
    }

    /// What the search varies: with a trace, always its arrival rate.
    pub fn load_kind(&self) -> LoadKind {
        match (self.load, &self.trace) {
            (Some(kind), _) => kind,
            (None, Some(_)) => LoadKind::Rate,
            (None, None) => LoadKind::Concurrency,
        }
    }

    /// Prompt lengths: as given, or the trace's shortest to longest.
    pub fn input_len(&self) -> LenSpec {
        self.lengths(self.input_len, |t| t.prompt_len)
    }

    /// Output lengths: as given, or the trace's shortest to longest.
    pub fn output_len(&self) -> LenSpec {
        self.lengths(self.output_len, |t| t.output_len)
    }

    fn lengths(&self, given: Option<LenSpec>, of: fn(&TraceSummary) -> (u32, u32)) -> LenSpec {
        if let Some(len) = given {
            return len;
        }
        let summary = self
            .trace
            .as_ref()
            .and_then(|t| t.windows.first())
            .expect("a checked spec has lengths or a read trace");
        match of(summary) {
            (lo, hi) if lo == hi => LenSpec::Fixed(lo),
            (lo, hi) => LenSpec::Range([lo, hi]),
        }
    }

    /// What further seed `k` of a finalist replays: a synthetic workload draws other
    /// requests from window 0; a trace replays its `k`-th next window, while it holds
    /// one (`None` after).
    pub fn window_of_seed(&self, k: usize) -> Option<usize> {
        match &self.trace {
            None => Some(0),
            Some(t) => (k < t.windows.len()).then_some(k),
        }
    }

    /// The own arrival rate (requests per second) of the trace's window `window`, when
    /// there is a trace and it holds that window.
    pub fn trace_rate(&self, window: usize) -> Option<f64> {
        self.trace
            .as_ref()
            .and_then(|t| t.windows.get(window))
            .and_then(TraceSummary::arrival_rate)
    }
}

/// Requests per client in one simulation when the spec does not say.
const DEFAULT_REQUESTS_PER_CLIENT: u32 = 3;

/// Requests in one simulation at least when the spec does not say.
const DEFAULT_MIN_REQUESTS: u32 = 32;

/// One percentile's objectives, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Objectives {
    /// Time to first token.
    pub ttft_ms: Option<f64>,
    /// Time per output token.
    pub tpot_ms: Option<f64>,
    /// Inter-token latency (every gap between deliveries).
    pub itl_ms: Option<f64>,
    /// End to end.
    pub e2e_ms: Option<f64>,
}

/// `[slo.p50]`, `[slo.p90]`, `[slo.p99]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloSpec {
    /// At the median.
    #[serde(default)]
    pub p50: Objectives,
    /// At the 90th percentile.
    #[serde(default)]
    pub p90: Objectives,
    /// At the 99th percentile.
    #[serde(default)]
    pub p99: Objectives,
}

/// A latency metric of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    /// Time to first token.
    Ttft,
    /// Time per output token.
    Tpot,
    /// Inter-token latency.
    Itl,
    /// End to end.
    E2e,
}

/// A percentile the report gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Percentile {
    /// Median.
    P50,
    /// 90th.
    P90,
    /// 99th.
    P99,
}

/// One objective: `metric` at `percentile` at most `limit_ms`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bound {
    /// Which latency.
    pub metric: Metric,
    /// At which percentile.
    pub percentile: Percentile,
    /// The most it may be, ms.
    pub limit_ms: f64,
}

impl Bound {
    /// `ttft_ms.p90`: the spec's key.
    pub fn key(&self) -> String {
        let m = match self.metric {
            Metric::Ttft => "ttft_ms",
            Metric::Tpot => "tpot_ms",
            Metric::Itl => "itl_ms",
            Metric::E2e => "e2e_ms",
        };
        let p = match self.percentile {
            Percentile::P50 => "p50",
            Percentile::P90 => "p90",
            Percentile::P99 => "p99",
        };
        format!("slo.{p}.{m}")
    }
}

impl SloSpec {
    /// Every objective given, in a fixed order.
    pub fn bounds(&self) -> Vec<Bound> {
        let mut out = Vec::new();
        for (percentile, o) in [
            (Percentile::P50, &self.p50),
            (Percentile::P90, &self.p90),
            (Percentile::P99, &self.p99),
        ] {
            for (metric, v) in [
                (Metric::Ttft, o.ttft_ms),
                (Metric::Tpot, o.tpot_ms),
                (Metric::Itl, o.itl_ms),
                (Metric::E2e, o.e2e_ms),
            ] {
                if let Some(limit_ms) = v {
                    out.push(Bound {
                        metric,
                        percentile,
                        limit_ms,
                    });
                }
            }
        }
        out
    }
}

/// `[objective]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, tag = "kind", rename_all = "snake_case")]
pub enum Objective {
    /// The most output tokens per second per GPU within the objectives.
    #[default]
    ThroughputPerGpu,
    /// The fewest GPUs that serve `target_requests_per_s` within the objectives
    /// (configurations replicated behind a round-robin front, each at the load it
    /// serves).
    FewestGpus {
        /// Completed requests per second the deployment must serve.
        target_requests_per_s: f64,
    },
}

/// Aggregated or disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Servers that prefill and decode.
    Agg,
    /// Context servers handing KV to generation servers.
    Disagg,
}

/// `[space]`: every list is one axis; candidates are their product, pruned.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Space {
    /// Aggregated, disaggregated or both.
    pub modes: Vec<Mode>,
    /// Tensor-parallel instances: one rank of this many GPUs.
    pub tp: Vec<u32>,
    /// Attention-DP instances: this many ranks of one GPU each (TensorRT-LLM's
    /// `tensor_parallel_size` with `enable_attention_dp`).
    pub attention_dp: Vec<u32>,
    /// GPUs the routed experts spread over (MoE models; empty: as TensorRT-LLM
    /// defaults, the instance's GPUs with attention DP, else 1).
    pub ep: Vec<u32>,
    /// `max_batch_size` of an aggregated or generation server.
    pub max_batch_size: Vec<u32>,
    /// `max_num_tokens`.
    pub max_num_tokens: Vec<u32>,
    /// `enable_chunked_prefill`.
    pub chunked_prefill: Vec<bool>,
    /// `scheduler_config.capacity_scheduler_policy`.
    pub capacity_scheduler_policy: Vec<CapacitySchedulerPolicy>,
    /// The overlap scheduler (TensorRT-LLM's `disable_overlap_scheduler = false`) on an
    /// aggregated or generation server.
    pub overlap: Vec<bool>,
    /// `attention_dp_config.router` (attention-DP instances only).
    pub router: Vec<RouterKind>,
    /// `attention_dp_config.enable_balance`, TensorRT-LLM's ADP balance (attention-DP
    /// instances only).
    pub adp_balance: Vec<bool>,
    /// Aggregated instances behind the front.
    pub agg_instances: Vec<u32>,
    /// Context instances.
    pub ctx_instances: Vec<u32>,
    /// Generation instances.
    pub gen_instances: Vec<u32>,
    /// `max_batch_size` of a context server.
    pub ctx_max_batch_size: Vec<u32>,
}

impl Default for Space {
    fn default() -> Self {
        Space {
            modes: vec![Mode::Agg, Mode::Disagg],
            tp: vec![1, 2, 4, 8],
            attention_dp: vec![],
            ep: vec![],
            max_batch_size: vec![64, 128, 256],
            max_num_tokens: vec![8192],
            chunked_prefill: vec![false],
            capacity_scheduler_policy: vec![CapacitySchedulerPolicy::GuaranteedNoEvict],
            overlap: vec![true],
            router: vec![RouterKind::Balanced],
            adp_balance: vec![false],
            agg_instances: vec![1],
            ctx_instances: vec![1, 2],
            gen_instances: vec![1],
            ctx_max_batch_size: vec![4],
        }
    }
}

/// `[method]`.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Method {
    /// Stop bisecting a candidate's load when the next step would be within this share.
    pub load_tolerance: f64,
    /// Finalists re-simulated with further seeds.
    pub finalists: u32,
    /// Further seeds per finalist.
    pub seeds: u32,
    /// Simulations in flight at once (0: every core).
    pub jobs: u32,
}

impl Default for Method {
    fn default() -> Self {
        Method {
            load_tolerance: 0.05,
            finalists: 5,
            seeds: 3,
            jobs: 0,
        }
    }
}

impl SearchSpec {
    /// Reads and checks a spec file.
    pub fn load(path: &Path) -> Result<SearchSpec, SearchError> {
        let text = std::fs::read_to_string(path).map_err(|source| SearchError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let base_dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let mut spec = SearchSpec::parse_in(&text, base_dir)?;
        if spec.name.is_none() {
            spec.name = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        }
        Ok(spec)
    }

    /// Parses and checks spec text (paths relative to the current folder).
    pub fn parse(text: &str) -> Result<SearchSpec, SearchError> {
        SearchSpec::parse_in(text, PathBuf::from("."))
    }

    /// Parses and checks spec text whose paths are relative to `base_dir`; reads the
    /// trace, if any.
    fn parse_in(text: &str, base_dir: PathBuf) -> Result<SearchSpec, SearchError> {
        let mut spec: SearchSpec =
            toml::from_str(text).map_err(|e| SearchError::Parse(e.to_string()))?;
        spec.base_dir = base_dir;
        if let Some(t) = &spec.policy_table {
            spec.policy = lockstep_plan::policy_keys::policy_from_table(t)
                .map_err(|e| SearchError::Parse(format!("[policy] {e}")))?;
        }
        spec.check_workload()?;
        spec.read_trace()?;
        spec.check()?;
        Ok(spec)
    }

    /// Reads the trace's records once, for the lengths and the rate its loads start from.
    fn read_trace(&mut self) -> Result<(), SearchError> {
        let Some(t) = self.workload.trace.as_mut() else {
            return Ok(());
        };
        let joined = self.base_dir.join(&t.path);
        // Absolute, so the winners' scenarios find it wherever they are written.
        t.resolved_path = std::fs::canonicalize(&joined).unwrap_or(joined);
        let read = |t: &SearchTrace, window: usize| {
            lockstep_plan::workload::summarize_trace(
                &t.config(1.0, window),
                Path::new("."),
                Some(t.requests),
            )
        };
        let summary = read(t, 0).map_err(SearchError::Trace)?;
        if summary.arrival_rate().is_none() {
            return Err(SearchError::Field {
                key: "workload.trace".into(),
                value: t.path.clone(),
                want: format!(
                    "a trace whose first {} records arrive over some time (these {} arrive at once)",
                    t.requests, summary.records
                ),
            });
        }
        t.windows = vec![summary];
        for window in 1..=self.method.seeds as usize {
            match read(t, window) {
                Ok(w) if w.records == t.requests && w.arrival_rate().is_some() => {
                    t.windows.push(w);
                }
                // The trace ends before another whole window.
                Ok(_) | Err(WorkloadError::Invalid { .. }) => break,
                Err(e) => return Err(SearchError::Trace(e)),
            }
        }
        Ok(())
    }

    /// The name outputs carry.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("search")
    }

    /// The workload's own keys, before a trace is read.
    fn check_workload(&self) -> Result<(), SearchError> {
        let bad = |key: &str, value: String, want: &str| SearchError::Field {
            key: key.to_string(),
            value,
            want: want.to_string(),
        };
        let w = &self.workload;
        for (key, len) in [
            ("workload.input_len", w.input_len),
            ("workload.output_len", w.output_len),
        ] {
            match (len, &w.trace) {
                (None, None) => {
                    return Err(bad(key, "absent".into(), "given (or a [workload.trace])"));
                }
                (Some(len), Some(_)) => {
                    return Err(bad(
                        key,
                        format!("{len:?}"),
                        "absent with a [workload.trace]: the trace's records give the lengths",
                    ));
                }
                (Some(len), None) if len.min() == 0 || len.min() > len.max() => {
                    return Err(bad(
                        key,
                        format!("{len:?}"),
                        "at least 1 (a range low to high)",
                    ));
                }
                _ => {}
            }
        }
        if let Some(t) = &w.trace {
            if w.load == Some(LoadKind::Concurrency) {
                return Err(bad(
                    "workload.load",
                    "\"concurrency\"".into(),
                    "\"rate\" (or absent) with a [workload.trace]: a trace's arrivals are replayed faster or slower",
                ));
            }
            if t.requests == 0 {
                return Err(bad("workload.trace.requests", "0".into(), "at least 1"));
            }
            for (key, value) in [
                ("workload.requests_per_client", w.requests_per_client),
                ("workload.min_requests", w.min_requests),
            ] {
                if let Some(n) = value {
                    return Err(bad(
                        key,
                        n.to_string(),
                        "absent with a [workload.trace]: workload.trace.requests says how many",
                    ));
                }
            }
            if t.block_tokens == Some(0) {
                return Err(bad("workload.trace.block_tokens", "0".into(), "at least 1"));
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), SearchError> {
        let bad = |key: &str, value: String, want: &str| SearchError::Field {
            key: key.to_string(),
            value,
            want: want.to_string(),
        };
        if self.model.tp.is_some() || self.model.ep.is_some() {
            let key = if self.model.tp.is_some() {
                "model.tp"
            } else {
                "model.ep"
            };
            return Err(bad(
                key,
                "given".into(),
                "absent: the search chooses it (space.tp, space.attention_dp, space.ep)",
            ));
        }
        if self.gpus.total == 0 {
            return Err(bad("gpus.total", "0".into(), "at least 1"));
        }
        if self.gpus.per_node == 0 {
            return Err(bad("gpus.per_node", "0".into(), "at least 1"));
        }
        if self.model.hf_config.is_none() && self.gpus.kv_tokens_per_rank.is_none() {
            return Err(bad(
                "gpus.kv_tokens_per_rank",
                "absent".into(),
                "given when [model] names a profile rather than an hf_config",
            ));
        }
        let w = &self.workload;
        if w.max_concurrency == Some(0) {
            return Err(bad("workload.max_concurrency", "0".into(), "at least 1"));
        }
        if let Some(r) = w.max_rate
            && !(r.is_finite() && r > 0.0)
        {
            return Err(bad("workload.max_rate", r.to_string(), "a positive rate"));
        }
        if w.load_kind() == LoadKind::Rate && w.max_concurrency.is_some() {
            return Err(bad(
                "workload.max_concurrency",
                "given".into(),
                "absent with load = \"rate\" (give workload.max_rate)",
            ));
        }
        if w.requests_per_client == Some(0) {
            return Err(bad(
                "workload.requests_per_client",
                "0".into(),
                "at least 1",
            ));
        }
        for b in self.slo.bounds() {
            if !(b.limit_ms.is_finite() && b.limit_ms > 0.0) {
                return Err(bad(
                    &b.key(),
                    b.limit_ms.to_string(),
                    "a positive number of ms",
                ));
            }
        }
        if let Objective::FewestGpus {
            target_requests_per_s: t,
        } = self.objective
            && !(t.is_finite() && t > 0.0)
        {
            return Err(bad(
                "objective.target_requests_per_s",
                t.to_string(),
                "a positive rate",
            ));
        }
        let m = &self.method;
        if !(m.load_tolerance.is_finite() && m.load_tolerance > 0.0 && m.load_tolerance < 1.0) {
            return Err(bad(
                "method.load_tolerance",
                m.load_tolerance.to_string(),
                "between 0 and 1",
            ));
        }
        self.check_space()
    }

    fn check_space(&self) -> Result<(), SearchError> {
        let s = &self.space;
        let empty = |key: &str| SearchError::EmptyAxis(format!("space.{key}"));
        let positive = |key: &str, v: &[u32]| -> Result<(), SearchError> {
            if let Some(&z) = v.iter().find(|&&x| x == 0) {
                return Err(SearchError::Field {
                    key: format!("space.{key}"),
                    value: z.to_string(),
                    want: "every value at least 1".into(),
                });
            }
            Ok(())
        };
        if s.modes.is_empty() {
            return Err(empty("modes"));
        }
        if s.tp.is_empty() && s.attention_dp.is_empty() {
            return Err(empty("tp` and `space.attention_dp"));
        }
        for (key, v) in [
            ("tp", &s.tp),
            ("attention_dp", &s.attention_dp),
            ("ep", &s.ep),
        ] {
            positive(key, v)?;
        }
        if let Some(&d) = s.attention_dp.iter().find(|&&d| d < 2) {
            return Err(SearchError::Field {
                key: "space.attention_dp".into(),
                value: d.to_string(),
                want: "at least 2 ranks (one rank is space.tp = [1])".into(),
            });
        }
        for (key, v) in [
            ("max_batch_size", &s.max_batch_size),
            ("max_num_tokens", &s.max_num_tokens),
        ] {
            if v.is_empty() {
                return Err(empty(key));
            }
            positive(key, v)?;
        }
        if s.chunked_prefill.is_empty() {
            return Err(empty("chunked_prefill"));
        }
        if s.capacity_scheduler_policy.is_empty() {
            return Err(empty("capacity_scheduler_policy"));
        }
        if s.overlap.is_empty() {
            return Err(empty("overlap"));
        }
        if s.router.is_empty() {
            return Err(empty("router"));
        }
        if s.adp_balance.is_empty() {
            return Err(empty("adp_balance"));
        }
        if s.modes.contains(&Mode::Agg) {
            if s.agg_instances.is_empty() {
                return Err(empty("agg_instances"));
            }
            positive("agg_instances", &s.agg_instances)?;
        }
        if s.modes.contains(&Mode::Disagg) {
            for (key, v) in [
                ("ctx_instances", &s.ctx_instances),
                ("gen_instances", &s.gen_instances),
                ("ctx_max_batch_size", &s.ctx_max_batch_size),
            ] {
                if v.is_empty() {
                    return Err(empty(key));
                }
                positive(key, v)?;
            }
        }
        Ok(())
    }
}
