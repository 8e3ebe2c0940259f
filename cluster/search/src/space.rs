//! The candidates: the product of the space's axes, each either kept or pruned with a
//! reason, and the scenario a kept one runs as.

use std::collections::BTreeMap;

use lockstep_actors::config::{
    CapacitySchedulerPolicy, KvCacheConfig, Role, RouterKind, SchedulerConfig, ServerConfig,
};
use lockstep_plan::model::ModelConfig;
use lockstep_plan::scenario::Scenario;
use lockstep_plan::workload::{WorkloadConfig, WorkloadKind};

use crate::spec::{LoadKind, Mode, SearchSpec};

/// An instance's parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Shape {
    /// One rank of this many tensor-parallel GPUs.
    Tp(u32),
    /// This many attention-DP ranks of one GPU each.
    Adp(u32),
}

impl Shape {
    /// GPUs of one instance.
    pub fn gpus(self) -> u32 {
        match self {
            Shape::Tp(n) | Shape::Adp(n) => n,
        }
    }

    /// GPUs of one rank.
    pub fn rank_gpus(self) -> u32 {
        match self {
            Shape::Tp(n) => n,
            Shape::Adp(_) => 1,
        }
    }

    /// Ranks of one instance.
    pub fn ranks(self) -> u32 {
        match self {
            Shape::Tp(_) => 1,
            Shape::Adp(n) => n,
        }
    }

    /// `TP4`, `ADP8`.
    pub fn label(self) -> String {
        match self {
            Shape::Tp(n) => format!("TP{n}"),
            Shape::Adp(n) => format!("ADP{n}"),
        }
    }
}

/// Instances of one role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pool {
    /// Agg, ctx or gen.
    pub role: Role,
    /// How many.
    pub instances: u32,
    /// Each one's parallelism.
    pub shape: Shape,
    /// `max_batch_size`.
    pub max_batch_size: u32,
    /// The overlap scheduler.
    pub overlap: bool,
    /// GPUs its routed experts spread over (1 for a dense model).
    pub ep: u32,
}

impl Pool {
    /// Its servers' names: `ctx0`, `ctx1`, ...
    pub fn server_names(&self) -> Vec<String> {
        (0..self.instances)
            .map(|i| format!("{}{i}", self.role.name()))
            .collect()
    }

    /// Its ranks' shape as the roofline sees it: (GPUs of one rank, EP).
    pub fn rank_shape(&self) -> (u32, u32) {
        (self.shape.rank_gpus(), self.ep)
    }
}

/// One configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Aggregated or disaggregated.
    pub mode: Mode,
    /// `[agg]` or `[ctx, gen]`.
    pub pools: Vec<Pool>,
    /// `max_num_tokens` of every server.
    pub max_num_tokens: u32,
    /// `enable_chunked_prefill` of every server.
    pub chunked_prefill: bool,
    /// The capacity scheduler of every server.
    pub policy: CapacitySchedulerPolicy,
    /// The ADP router (attention-DP instances).
    pub router: RouterKind,
    /// TensorRT-LLM's ADP balance (attention-DP instances).
    pub adp_balance: bool,
}

impl Candidate {
    /// GPUs in use.
    pub fn gpus(&self) -> u32 {
        self.pools
            .iter()
            .map(|p| p.instances * p.shape.gpus())
            .sum()
    }

    /// The pool that decodes (agg or gen).
    pub fn decoder(&self) -> &Pool {
        self.pools.last().expect("a candidate has a pool")
    }

    /// Whether any instance has several ranks (so the router matters).
    fn has_adp(&self) -> bool {
        self.pools.iter().any(|p| p.shape.ranks() > 1)
    }

    /// Batch slots of the whole deployment's decoders.
    pub fn slots(&self) -> u32 {
        let d = self.decoder();
        d.instances * d.shape.ranks() * d.max_batch_size
    }

    /// One line: `disagg 2×ADP4 B4 : 1×ADP8 B256 · T8192 · GNE · overlap · ep8`.
    pub fn label(&self) -> String {
        let pools: Vec<String> = self
            .pools
            .iter()
            .map(|p| {
                format!(
                    "{}×{}{} B{}{}",
                    p.instances,
                    p.shape.label(),
                    if p.ep > 1 {
                        format!(" ep{}", p.ep)
                    } else {
                        String::new()
                    },
                    p.max_batch_size,
                    if p.overlap { " ovl" } else { "" }
                )
            })
            .collect();
        let policy = match self.policy {
            CapacitySchedulerPolicy::GuaranteedNoEvict => "GNE",
            CapacitySchedulerPolicy::MaxUtilization => "MAXU",
            CapacitySchedulerPolicy::StaticBatch => "STATIC",
        };
        let mut s = format!(
            "{} {} T{} {}{}",
            match self.mode {
                Mode::Agg => "agg",
                Mode::Disagg => "disagg",
            },
            pools.join(" : "),
            self.max_num_tokens,
            policy,
            if self.chunked_prefill { " chunked" } else { "" },
        );
        if self.has_adp() && self.router != RouterKind::Balanced {
            s.push_str(&format!(" router={:?}", self.router).to_lowercase());
        }
        if self.adp_balance {
            s.push_str(" balance");
        }
        s
    }

    /// The scenario this candidate runs as: `model` is its `[model]` (a pool costed
    /// apart under `[model.servers]`), `kv_tokens` what one rank of each pool holds,
    /// `workload` the load.
    pub fn scenario(
        &self,
        name: &str,
        model: ModelConfig,
        kv_tokens: &[u64],
        workload: WorkloadConfig,
        spec: &SearchSpec,
    ) -> Scenario {
        let mut servers = Vec::new();
        for (p, &kv) in self.pools.iter().zip(kv_tokens) {
            for name in p.server_names() {
                servers.push(self.server(p, name, kv));
            }
        }
        Scenario {
            name: name.to_string(),
            description: Some(self.label()),
            policy: spec.policy,
            servers,
            workload: Some(workload),
            model,
            faults: Default::default(),
            front: Default::default(),
            frontend: spec.frontend,
            seed: None,
            base_dir: spec.base_dir.clone(),
        }
    }

    fn server(&self, p: &Pool, name: String, kv_tokens: u64) -> ServerConfig {
        let d = ServerConfig::default();
        ServerConfig {
            name,
            role: p.role,
            tensor_parallel_size: i64::from(p.shape.gpus()),
            enable_attention_dp: p.shape.ranks() > 1,
            max_batch_size: i64::from(p.max_batch_size),
            max_num_tokens: i64::from(self.max_num_tokens),
            disable_overlap_scheduler: !p.overlap,
            enable_chunked_prefill: self.chunked_prefill,
            scheduler_config: SchedulerConfig {
                capacity_scheduler_policy: self.policy,
                ..d.scheduler_config
            },
            kv_cache_config: KvCacheConfig {
                max_tokens: i64::try_from(kv_tokens).unwrap_or(i64::MAX),
                // Random prompts share nothing, as production perf suites run them.
                enable_block_reuse: false,
                ..d.kv_cache_config
            },
            attention_dp_config: lockstep_actors::config::AttentionDpConfig {
                router: self.router,
                enable_balance: self.adp_balance,
                ..d.attention_dp_config
            },
            ..d
        }
    }
}

/// Candidates kept, and how many were pruned for each reason.
#[derive(Debug, Default)]
pub struct Enumerated {
    /// In enumeration order.
    pub kept: Vec<Candidate>,
    /// Reason → count.
    pub pruned: BTreeMap<String, u64>,
}

impl Enumerated {
    fn prune(&mut self, reason: &str) {
        *self.pruned.entry(reason.to_string()).or_default() += 1;
    }
}

/// A pool before the shared knobs: role, instances, shape, `max_batch_size`.
type PoolAxes = (Role, u32, Shape, u32);

/// Why a candidate over the budget is pruned (also the error when all are).
pub const OVER_BUDGET: &str = "more GPUs than gpus.total";

/// Every candidate of the space; `moe` says whether the model has routed experts.
pub fn enumerate(spec: &SearchSpec, moe: bool) -> Enumerated {
    let s = &spec.space;
    let mut out = Enumerated::default();
    let shapes: Vec<Shape> =
        s.tp.iter()
            .map(|&n| Shape::Tp(n))
            .chain(s.attention_dp.iter().map(|&n| Shape::Adp(n)))
            .collect();
    let mut layouts: Vec<(Mode, Vec<PoolAxes>)> = Vec::new();
    for &mode in &s.modes {
        match mode {
            Mode::Agg => {
                for &n in &s.agg_instances {
                    for &shape in &shapes {
                        for &b in &s.max_batch_size {
                            layouts.push((mode, vec![(Role::Agg, n, shape, b)]));
                        }
                    }
                }
            }
            Mode::Disagg => {
                for &cn in &s.ctx_instances {
                    for &cs in &shapes {
                        for &cb in &s.ctx_max_batch_size {
                            for &gn in &s.gen_instances {
                                for &gs in &shapes {
                                    for &gb in &s.max_batch_size {
                                        layouts.push((
                                            mode,
                                            vec![(Role::Ctx, cn, cs, cb), (Role::Gen, gn, gs, gb)],
                                        ));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    for (mode, pools) in layouts {
        let gpus: u32 = pools.iter().map(|&(_, n, sh, _)| n * sh.gpus()).sum();
        if gpus > spec.gpus.total {
            out.prune(OVER_BUDGET);
            continue;
        }
        if pools.iter().any(|p| p.2.rank_gpus() > spec.gpus.per_node) {
            out.prune("a rank's TP spans nodes (more than gpus.per_node)");
            continue;
        }
        // The experts' spread: listed (one value for every pool), or TensorRT-LLM's
        // default per server (its GPUs with attention DP, else 1); a dense model has
        // none to spread.
        let eps: Vec<Option<u32>> = if !moe || s.ep.is_empty() {
            vec![None]
        } else {
            s.ep.iter().copied().map(Some).collect()
        };
        let ep_of = |shape: Shape, listed: Option<u32>| match (moe, listed) {
            (false, _) => 1,
            (true, Some(ep)) => ep,
            (true, None) if shape.ranks() > 1 => shape.gpus(),
            (true, None) => 1,
        };
        for &listed in &eps {
            if moe && pools.iter().any(|p| ep_of(p.2, listed) > p.2.gpus().max(1)) {
                out.prune("ep larger than an instance's GPUs");
                continue;
            }
            for &t in &s.max_num_tokens {
                for &chunked in &s.chunked_prefill {
                    for &policy in &s.capacity_scheduler_policy {
                        for &overlap in &s.overlap {
                            let has_adp = pools.iter().any(|p| p.2.ranks() > 1);
                            // Without attention DP there is one rank: no router and no
                            // balance to choose.
                            let routers = if has_adp {
                                &s.router[..]
                            } else {
                                &s.router[..1]
                            };
                            let balances: &[bool] = if has_adp { &s.adp_balance } else { &[false] };
                            for (&router, &adp_balance) in routers
                                .iter()
                                .flat_map(|r| balances.iter().map(move |b| (r, b)))
                            {
                                let pools = pools
                                    .iter()
                                    .map(|&(role, instances, shape, b)| Pool {
                                        role,
                                        instances,
                                        shape,
                                        max_batch_size: b,
                                        // Context servers run without the overlap scheduler, as
                                        // TensorRT-LLM's disaggregated recipes set them.
                                        overlap: overlap && role != Role::Ctx,
                                        ep: ep_of(shape, listed),
                                    })
                                    .collect();
                                out.kept.push(Candidate {
                                    mode,
                                    pools,
                                    max_num_tokens: t,
                                    chunked_prefill: chunked,
                                    policy,
                                    router,
                                    adp_balance,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Open loop: arrivals span at least this many unloaded requests' times, so that a
/// fleet that cannot keep up builds a queue that shows.
pub const RATE_SPAN_REQUESTS: f64 = 10.0;

/// The workload of one simulation at `load`: closed-loop clients whose starts spread
/// over `unloaded_request_s` (as in a steady state), `requests_per_client` each; or
/// open-loop arrivals at `load` requests per second over [`RATE_SPAN_REQUESTS`]
/// unloaded requests' times, at least `min_requests` either way; or a trace's window
/// `window` of records, replayed so they arrive at `load` requests per second on
/// average.
pub fn space_workload(
    spec: &SearchSpec,
    load: f64,
    seed: u64,
    window: usize,
    unloaded_request_s: f64,
) -> WorkloadConfig {
    let w = &spec.workload;
    if let Some(t) = &w.trace {
        let natural = w
            .trace_rate(window)
            .expect("only windows the spec read are replayed");
        return WorkloadConfig {
            kind: WorkloadKind::Trace,
            num_requests: Some(t.requests),
            concurrency: None,
            rate: None,
            input_len: w.input_len(),
            output_len: w.output_len(),
            think_time_ms: 0.0,
            shared_prefix_tokens: 0,
            conversation: None,
            trace: Some(t.config(natural / load, window)),
            seed: Some(seed),
            warmup_requests: 0,
            ramp_s: 0.0,
        };
    }
    let (kind, concurrency, rate, wanted, ramp_s) = match w.load_kind() {
        LoadKind::Concurrency => (
            WorkloadKind::ClosedLoop,
            Some(load.round().max(1.0) as u64),
            None,
            load.round().max(1.0) * f64::from(w.requests_per_client()),
            unloaded_request_s,
        ),
        LoadKind::Rate => (
            WorkloadKind::OpenLoop,
            None,
            Some(load),
            load * unloaded_request_s * RATE_SPAN_REQUESTS,
            0.0,
        ),
    };
    let requests = (wanted.ceil() as u64).max(u64::from(w.min_requests()));
    WorkloadConfig {
        kind,
        num_requests: Some(requests),
        concurrency,
        rate,
        input_len: w.input_len(),
        output_len: w.output_len(),
        think_time_ms: 0.0,
        shared_prefix_tokens: 0,
        conversation: None,
        trace: None,
        seed: Some(seed),
        warmup_requests: 0,
        ramp_s,
    }
}

/// Open loop: whether the fleet kept up with its arrivals. Requests arriving over
/// `arrival_span_s` are served by `duration_s` (first arrival to the run's end); a
/// fleet that keeps up drains in about `drain_s` after the last arrival (the longest
/// request's time alone), so a run lasting clearly longer than `span + drain` (its rate below
/// [`KEPT_UP`] of that) left a queue behind.
pub fn saturation(
    arrival_span_s: f64,
    duration_s: f64,
    drain_s: f64,
    offered: f64,
) -> Option<String> {
    let expected = arrival_span_s + drain_s;
    (duration_s * KEPT_UP > expected).then(|| {
        format!(
            "saturated at {offered:.2} req/s: the run lasted {duration_s:.1} s for arrivals over {arrival_span_s:.1} s"
        )
    })
}

/// The share of the expected duration over the run's below which it kept up.
pub const KEPT_UP: f64 = 0.9;
