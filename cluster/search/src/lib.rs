//! `lockstep search`: which configuration to run, under latency objectives at
//! percentiles, with every candidate simulated in full — admission, routing, padding,
//! KV transfers, the serving front door — rather than reduced to a throughput formula.
//!
//! The method (ARCHITECTURE.md, "Configuration search"):
//! 1. the space's axes multiplied out, invalid combinations pruned with the reason
//!    counted (`space.rs`);
//! 2. each rank shape's cost model derived once (the roofline of `[model]`), and a bound
//!    from it alone: the most output tokens per second per GPU the candidate could
//!    reach, and the objectives it cannot meet at any load (`bound.rs`);
//! 3. candidates simulated best bound first, in fixed-size rounds on every core; after
//!    each round, those whose bound is below the best result cannot win and are
//!    dropped; each simulated candidate's highest load meeting every objective is found
//!    by bisection (`evaluate.rs`);
//! 4. the finalists re-simulated with further seeds, so each objective comes with a
//!    spread.
//!
//! The answer depends only on the spec and its seed: rounds are fixed in size and
//! results are gathered in candidate order, whatever the number of threads.

#![forbid(unsafe_code)]

pub mod bound;
pub mod evaluate;
pub mod output;
pub mod space;
pub mod spec;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use lockstep_gpu::Coefficients;
use lockstep_plan::model::{CoefficientOverrides, ModelConfig, ServerModel};

use crate::bound::Cheap;
use crate::evaluate::{Evaluation, Measured};
use crate::space::{Candidate, OVER_BUDGET};
use crate::spec::{Bound, LoadKind, Mode, Objective, SearchSpec};

/// A search that cannot run.
#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    /// The spec file cannot be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The spec is not valid TOML or has an unknown or mistyped key.
    #[error("search spec: {0}")]
    Parse(String),
    /// A key with a value it cannot take.
    #[error("search spec: {key} = {value}: must be {want}")]
    Field {
        /// The key.
        key: String,
        /// Its value.
        value: String,
        /// What it must be.
        want: String,
    },
    /// The trace cannot be read.
    #[error("search spec: workload.trace: {0}")]
    Trace(#[source] lockstep_plan::workload::WorkloadError),
    /// An axis of the space with no value.
    #[error("search spec: `{0}` is empty: nothing to search")]
    EmptyAxis(String),
    /// The model cannot be read.
    #[error("search spec: [model]: {0}")]
    Model(String),
    /// Every configuration of the space needs more GPUs than the budget.
    #[error(
        "search spec: gpus.total = {total}: no configuration of the space fits; the smallest needs {smallest} GPUs"
    )]
    NothingFits {
        /// The budget.
        total: u32,
        /// GPUs of the smallest configuration.
        smallest: u32,
    },
    /// Every candidate was pruned.
    #[error("every candidate was pruned: {}", .0.iter().map(|(r, n)| format!("{n} × {r}")).collect::<Vec<_>>().join("; "))]
    AllPruned(BTreeMap<String, u64>),
    /// Processes sharing the search could not exchange results.
    #[error("sharing the search between processes: {0}")]
    Share(String),
    /// An output could not be written.
    #[error("{path}: {message}")]
    Output {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
}

/// Processes sharing one search (`mpirun -n N lockstep search`): each simulates its
/// share of every round, and every process gathers every result, so all of them take
/// the same decisions and reach the same answer as one process would.
pub trait Share {
    /// This process, `0..size()`.
    fn rank(&self) -> usize;
    /// Processes sharing the search.
    fn size(&self) -> usize;
    /// Every process's `mine` for exchange number `round`, in process order.
    fn allgather(&mut self, round: u64, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String>;
}

/// One process searching alone.
#[derive(Debug, Clone, Copy, Default)]
pub struct Alone;

impl Share for Alone {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn allgather(&mut self, _round: u64, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, String> {
        Ok(vec![mine])
    }
}

/// Runs `work` on this process's share of `items` (item `j` is process `j mod size`'s)
/// on every core, and gathers every process's results: `items.len()` of them, in item
/// order, with the simulations every process ran.
fn shared_map<I: Sync, T: serde::Serialize + serde::de::DeserializeOwned + Send>(
    share: &mut dyn Share,
    round: u64,
    pool: &rayon::ThreadPool,
    items: &[I],
    work: impl Fn(&I, &AtomicU64) -> T + Sync,
) -> Result<(Vec<T>, u64), SearchError> {
    let (rank, size) = (share.rank(), share.size().max(1));
    let simulations = AtomicU64::new(0);
    let mine: Vec<(usize, T)> = pool.install(|| {
        items
            .par_iter()
            .enumerate()
            .filter(|(j, _)| j % size == rank)
            .map(|(j, item)| (j, work(item, &simulations)))
            .collect()
    });
    let payload = (simulations.into_inner(), mine);
    let bytes = bincode::serde::encode_to_vec(&payload, bincode::config::standard())
        .map_err(|e| SearchError::Share(e.to_string()))?;
    let all = share.allgather(round, bytes).map_err(SearchError::Share)?;
    let mut slots: Vec<Option<T>> = items.iter().map(|_| None).collect();
    let mut total = 0;
    for (from, b) in all.iter().enumerate() {
        let ((count, results), _): ((u64, Vec<(usize, T)>), usize) =
            bincode::serde::decode_from_slice(b, bincode::config::standard())
                .map_err(|e| SearchError::Share(format!("process {from}: {e}")))?;
        total += count;
        for (j, t) in results {
            match slots.get_mut(j) {
                Some(slot) if slot.is_none() => *slot = Some(t),
                _ => {
                    return Err(SearchError::Share(format!(
                        "process {from} sent a result for item {j} of {}",
                        items.len()
                    )));
                }
            }
        }
    }
    let out: Option<Vec<T>> = slots.into_iter().collect();
    let out = out.ok_or_else(|| SearchError::Share("a result is missing".into()))?;
    Ok((out, total))
}

/// How far the search is, for a progress bar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Candidates settled (simulated or dropped by the bound).
    pub done: u64,
    /// Candidates to settle.
    pub total: u64,
}

/// A finalist's objectives over further seeds.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SeedSpread {
    /// Seeds run (the search's own included).
    pub runs: u32,
    /// Of those, the runs that met every objective.
    pub met: u32,
    /// Output tokens per second per GPU: least and most.
    pub tokens_per_gpu: (f64, f64),
    /// Per objective (its key): least and most value, ms.
    pub objectives: Vec<(String, f64, f64)>,
}

/// A simulated candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    /// The configuration.
    pub candidate: Candidate,
    /// Its bound.
    pub cheap: Cheap,
    /// Its search over load.
    pub evaluation: Evaluation,
    /// GPUs the objective counts: the candidate's, or with `fewest_gpus` the replicas
    /// the target rate needs.
    pub gpus_needed: Option<u32>,
    /// Further seeds, for finalists.
    pub seeds: Option<SeedSpread>,
    /// KV tokens one rank of each pool holds.
    pub kv_tokens_per_rank: Vec<u64>,
    /// The `[model]` its simulations ran with (derived coefficients; a pool of other
    /// ranks costed apart under `[model.servers]`).
    pub simulated_model: ModelConfig,
}

impl Ranked {
    /// Every load simulated that met every objective in `bounds`, as a front's point.
    pub fn feasible<'a>(&'a self, bounds: &'a [Bound]) -> impl Iterator<Item = ParetoPoint> + 'a {
        let gpus = f64::from(self.candidate.gpus());
        self.evaluation
            .points
            .iter()
            .filter(move |m| m.misses(bounds).is_empty())
            .map(move |m| ParetoPoint {
                label: self.candidate.label(),
                load: m.load,
                tokens_per_gpu: m.output_tokens_per_s / gpus,
                tokens_per_user: m.tokens_per_user(),
            })
    }

    /// Output tokens per second per GPU at the best load (0 when no load meets the
    /// objectives).
    pub fn tokens_per_gpu(&self) -> f64 {
        self.evaluation.best.as_ref().map_or(0.0, |m| {
            m.output_tokens_per_s / f64::from(self.candidate.gpus())
        })
    }
}

/// A point of the Pareto front: a candidate at one load that met every objective.
#[derive(Debug, Clone, PartialEq)]
pub struct ParetoPoint {
    /// The candidate's label.
    pub label: String,
    /// The load: clients, or requests per second.
    pub load: f64,
    /// Output tokens per second per GPU.
    pub tokens_per_gpu: f64,
    /// Output tokens per second per user (1 / mean TPOT).
    pub tokens_per_user: f64,
}

/// What a search found.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchOutcome {
    /// The spec's name.
    pub name: String,
    /// Simulated candidates, best first; those meeting no load at the end.
    pub ranked: Vec<Ranked>,
    /// Candidates of the space, before pruning.
    pub candidates: u64,
    /// Pruned, by reason.
    pub pruned: BTreeMap<String, u64>,
    /// Simulations run.
    pub simulations: u64,
    /// Every simulated point meeting every objective that no other beats on both
    /// tokens per GPU and tokens per user, by tokens per user.
    pub pareto: Vec<ParetoPoint>,
}

/// Candidates simulated per round before the bound prunes again (fixed, so the answer
/// does not depend on the number of threads).
const ROUND: usize = 16;

/// Why the bound drops a candidate.
pub const BELOW_BEST: &str = "bound below the best result";

/// What a candidate's simulations run with.
#[derive(Debug, Clone)]
struct Costed {
    /// Its `[model]`: the decoding pool's ranks as the fleet's, another pool's under
    /// `[model.servers]`.
    model: ModelConfig,
    /// KV tokens one rank of each pool holds.
    kv_tokens: Vec<u64>,
}

/// `c`'s `[model]` and KV, from its pools' rank models (in pool order).
fn costed(c: &Candidate, pools: &[&RankModel]) -> Costed {
    let decoder = pools[pools.len() - 1];
    let mut model = decoder.simulated.clone();
    for (p, m) in c.pools.iter().zip(pools) {
        if m.coefficients != decoder.coefficients {
            for name in p.server_names() {
                model.servers.insert(
                    name,
                    ServerModel {
                        coefficients: m.simulated.coefficients,
                        ..ServerModel::default()
                    },
                );
            }
        }
    }
    Costed {
        model,
        kv_tokens: pools.iter().map(|m| m.kv_tokens).collect(),
    }
}

/// One rank shape's model as simulated (the derived coefficients, so the roofline is
/// fitted once), and what the bound needs.
#[derive(Debug, Clone)]
struct RankModel {
    simulated: ModelConfig,
    coefficients: Coefficients,
    kv_tokens: u64,
}

/// Runs the search in this process.
pub fn search(
    spec: &SearchSpec,
    progress: &(dyn Fn(Progress) + Sync),
) -> Result<SearchOutcome, SearchError> {
    search_shared(spec, progress, &mut Alone)
}

/// Runs the search shared between the processes of `share`; every process returns the
/// same outcome.
pub fn search_shared(
    spec: &SearchSpec,
    progress: &(dyn Fn(Progress) + Sync),
    share: &mut dyn Share,
) -> Result<SearchOutcome, SearchError> {
    let moe = model_has_experts(spec)?;
    let enumerated = space::enumerate(spec, moe);
    let candidates = enumerated.kept.len() as u64 + enumerated.pruned.values().sum::<u64>();
    let mut pruned = enumerated.pruned;
    if enumerated.kept.is_empty() {
        if pruned.keys().all(|r| r == OVER_BUDGET) {
            return Err(SearchError::NothingFits {
                total: spec.gpus.total,
                smallest: smallest_gpus(spec),
            });
        }
        return Err(SearchError::AllPruned(pruned));
    }

    // Each rank shape's model, once.
    let mut models: BTreeMap<(u32, u32), Result<RankModel, String>> = BTreeMap::new();
    for c in &enumerated.kept {
        for p in &c.pools {
            let (gpus, ep) = p.rank_shape();
            models
                .entry((gpus, ep))
                .or_insert_with(|| rank_model(spec, gpus, ep));
        }
    }
    let mut open: Vec<(Candidate, Cheap, Costed)> = Vec::new();
    for c in enumerated.kept {
        let pools: Result<Vec<&RankModel>, &String> = c
            .pools
            .iter()
            .map(|p| models[&p.rank_shape()].as_ref())
            .collect();
        match pools {
            Err(why) => *pruned.entry(why.clone()).or_default() += 1,
            Ok(pools) => {
                let (decoder, prefill) = (pools[pools.len() - 1], pools[0]);
                let cheap = bound::cheap(
                    spec,
                    &c,
                    (decoder.coefficients, decoder.kv_tokens),
                    prefill.coefficients,
                );
                match &cheap.infeasible {
                    Some(why) => *pruned.entry(reason_kind(why)).or_default() += 1,
                    None => {
                        let costed = costed(&c, &pools);
                        open.push((c, cheap, costed));
                    }
                }
            }
        }
    }
    if open.is_empty() {
        return Err(SearchError::AllPruned(pruned));
    }
    // Best bound first; ties in enumeration order (the sort is stable).
    open.sort_by(|a, b| b.1.tokens_per_gpu.total_cmp(&a.1.tokens_per_gpu));

    let pool = thread_pool(spec.method.jobs);
    let mut simulations = 0;
    let mut exchange = 0;
    let mut total = open.len() as u64;
    let mut done = 0;
    progress(Progress { done, total });
    let mut ranked: Vec<Ranked> = Vec::new();
    let mut rest = open.into_iter().peekable();
    while rest.peek().is_some() {
        let round: Vec<(Candidate, Cheap, Costed)> = rest.by_ref().take(ROUND).collect();
        let (evaluations, ran) = shared_map(
            share,
            exchange,
            &pool,
            &round,
            |(c, cheap, costed), sims| evaluate_candidate(spec, c, cheap, costed, sims),
        )?;
        exchange += 1;
        simulations += ran;
        done += round.len() as u64;
        for ((candidate, cheap, costed), evaluation) in round.into_iter().zip(evaluations) {
            ranked.push(Ranked {
                gpus_needed: gpus_needed(spec, &candidate, &evaluation),
                candidate,
                cheap,
                evaluation,
                seeds: None,
                kv_tokens_per_rank: costed.kv_tokens,
                simulated_model: costed.model,
            });
        }
        if spec.objective == Objective::ThroughputPerGpu {
            let best = ranked
                .iter()
                .map(Ranked::tokens_per_gpu)
                .fold(0.0, f64::max);
            let mut kept = Vec::new();
            for (c, cheap, costed) in rest.by_ref() {
                if cheap.tokens_per_gpu < best {
                    *pruned.entry(BELOW_BEST.into()).or_default() += 1;
                    total -= 1;
                } else {
                    kept.push((c, cheap, costed));
                }
            }
            rest = kept.into_iter().peekable();
        }
        progress(Progress { done, total });
    }
    rank(spec, &mut ranked);

    // Finalists: further seeds at their best load.
    let finalists = ranked
        .iter()
        .take_while(|r| r.evaluation.best.is_some())
        .take(spec.method.finalists as usize)
        .count();
    let (spreads, ran) = shared_map(share, exchange, &pool, &ranked[..finalists], |r, sims| {
        seed_spread(spec, r, sims)
    })?;
    simulations += ran;
    for (r, s) in ranked.iter_mut().zip(spreads) {
        r.seeds = Some(s);
    }
    let pareto = pareto(spec, &ranked);
    Ok(SearchOutcome {
        name: spec.name().to_string(),
        ranked,
        candidates,
        pruned,
        simulations,
        pareto,
    })
}

fn thread_pool(jobs: u32) -> rayon::ThreadPool {
    let mut b = rayon::ThreadPoolBuilder::new();
    if jobs > 0 {
        b = b.num_threads(jobs as usize);
    }
    b.build().expect("a thread pool")
}

/// Whether `[model]` has routed experts (a profile: none).
fn model_has_experts(spec: &SearchSpec) -> Result<bool, SearchError> {
    let Some(path) = &spec.model.hf_config else {
        return Ok(false);
    };
    let arch = lockstep_gpu::roofline::Architecture::from_file(&spec.base_dir.join(path))
        .map_err(|e| SearchError::Model(format!("hf_config = {path}: {e}")))?;
    Ok(arch.experts.is_some())
}

/// GPUs of the smallest configuration the space holds.
fn smallest_gpus(spec: &SearchSpec) -> u32 {
    let s = &spec.space;
    let shape =
        s.tp.iter()
            .chain(&s.attention_dp)
            .copied()
            .min()
            .unwrap_or(1);
    let min = |v: &[u32]| v.iter().copied().min().unwrap_or(1);
    s.modes
        .iter()
        .map(|m| match m {
            Mode::Agg => min(&s.agg_instances) * shape,
            Mode::Disagg => (min(&s.ctx_instances) + min(&s.gen_instances)) * shape,
        })
        .min()
        .unwrap_or(shape)
}

/// A reason with its numbers taken out, so that reasons of one kind count together.
fn reason_kind(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut in_number = false;
    for ch in message.chars() {
        if ch.is_ascii_digit() || (in_number && ch == '.') {
            if !in_number {
                out.push('N');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(ch);
        }
    }
    out
}

/// The `[model]` a rank of `rank_gpus` GPUs with experts over `ep` is written out
/// with: the spec's, with `hf_config` by its full path (the scenario lands elsewhere)
/// and the rank shape.
pub fn written_model(spec: &SearchSpec, rank_gpus: u32, ep: u32) -> ModelConfig {
    let mut written = spec.model.clone();
    if let Some(path) = &written.hf_config {
        let full = spec.base_dir.join(path);
        written.hf_config = Some(
            std::fs::canonicalize(&full)
                .unwrap_or(full)
                .display()
                .to_string(),
        );
        written.tp = Some(rank_gpus);
        written.ep = Some(ep);
    }
    written
}

/// `c`'s `[model]` as written out: the decoding pool's rank shape as the fleet's, any
/// other pool's under `[model.servers]`.
pub fn written_candidate_model(spec: &SearchSpec, c: &Candidate) -> ModelConfig {
    let decoder = c.decoder().rank_shape();
    let mut model = written_model(spec, decoder.0, decoder.1);
    if model.hf_config.is_some() {
        for p in &c.pools {
            let (tp, ep) = p.rank_shape();
            if (tp, ep) != decoder {
                for name in p.server_names() {
                    model.servers.insert(
                        name,
                        ServerModel {
                            tp: Some(tp),
                            ep: Some(ep),
                            ..ServerModel::default()
                        },
                    );
                }
            }
        }
    }
    model
}

fn rank_model(spec: &SearchSpec, rank_gpus: u32, ep: u32) -> Result<RankModel, String> {
    let written = written_model(spec, rank_gpus, ep);
    let kv_tokens = if written.hf_config.is_some() {
        written
            .kv_capacity_tokens(&spec.base_dir)
            .map_err(|e| reason_kind(&e.to_string()))?
            .expect("hf_config given")
    } else {
        spec.gpus
            .kv_tokens_per_rank
            .expect("checked: a profile comes with gpus.kv_tokens_per_rank")
    };
    let profile = written
        .resolve(&spec.base_dir)
        .map_err(|e| reason_kind(&e.to_string()))?;
    let c = profile.coefficients;
    // The fitted coefficients as overrides: the same profile, without fitting again.
    let simulated = ModelConfig {
        coefficients: CoefficientOverrides::every(&c),
        kv: Some(profile.kv),
        link: written.link,
        ..ModelConfig::default()
    };
    Ok(RankModel {
        simulated,
        coefficients: c,
        kv_tokens,
    })
}

/// The loads tried on `c`: from one client (or one request in flight on average) up to
/// the spec's cap, else twice the batch slots (or 1.5 times the rate the bound allows).
fn load_range(spec: &SearchSpec, c: &Candidate, cheap: &Cheap) -> evaluate::LoadRange {
    let w = &spec.workload;
    match w.load_kind() {
        LoadKind::Concurrency => evaluate::LoadRange {
            first: 1.0,
            max: f64::from(
                w.max_concurrency
                    .unwrap_or_else(|| c.slots().saturating_mul(2))
                    .max(1),
            ),
            integer: true,
        },
        LoadKind::Rate => {
            let first = 1.0 / cheap.unloaded_request_s.max(1e-9);
            let bound_rate =
                cheap.tokens_per_gpu * f64::from(c.gpus()) / f64::from(w.output_len().min());
            evaluate::LoadRange {
                first,
                max: w.max_rate.unwrap_or(1.5 * bound_rate).max(first),
                integer: false,
            }
        }
    }
}

fn evaluate_candidate(
    spec: &SearchSpec,
    c: &Candidate,
    cheap: &Cheap,
    costed: &Costed,
    simulations: &AtomicU64,
) -> Evaluation {
    evaluate::search_load(spec, load_range(spec, c, cheap), |n| {
        simulations.fetch_add(1, Ordering::Relaxed);
        simulate_at(
            spec,
            c,
            cheap,
            &costed.model,
            &costed.kv_tokens,
            n,
            Draw {
                seed: spec.seed,
                window: 0,
            },
        )
    })
}

/// Which requests one simulation replays.
#[derive(Debug, Clone, Copy)]
struct Draw {
    /// Seeds the simulation.
    seed: u64,
    /// With a trace, which window of its records (see `SearchTrace::windows`).
    window: usize,
}

/// One simulation of `c` at `load`; an open-loop run the fleet did not keep up with
/// counts as missing (its queue would grow with a longer run).
fn simulate_at(
    spec: &SearchSpec,
    c: &Candidate,
    cheap: &Cheap,
    model: &ModelConfig,
    kv_tokens: &[u64],
    load: f64,
    draw: Draw,
) -> Measured {
    let Draw { seed, window } = draw;
    let workload = space::space_workload(spec, load, seed, window, cheap.unloaded_request_s);
    let scenario = c.scenario(spec.name(), model.clone(), kv_tokens, workload, spec);
    let mut measured = evaluate::simulate(&scenario, load, seed);
    if spec.workload.load_kind() == LoadKind::Rate && measured.broken.is_none() {
        // The last arrival may be the longest request.
        measured.broken = space::saturation(
            measured.arrival_span_s,
            measured.duration_s,
            cheap.longest_request_s,
            load,
        );
    }
    measured
}

fn gpus_needed(spec: &SearchSpec, c: &Candidate, e: &Evaluation) -> Option<u32> {
    let best = e.best.as_ref()?;
    match spec.objective {
        Objective::ThroughputPerGpu => Some(c.gpus()),
        Objective::FewestGpus {
            target_requests_per_s,
        } => {
            if best.requests_per_s <= 0.0 {
                return None;
            }
            let replicas = (target_requests_per_s / best.requests_per_s).ceil();
            Some((replicas as u32).max(1).saturating_mul(c.gpus()))
        }
    }
}

/// Best first: meeting some load before none; then by the objective; then by tokens
/// per GPU; then by label, so equal results keep one order.
fn rank(spec: &SearchSpec, ranked: &mut [Ranked]) {
    ranked.sort_by(|a, b| {
        let feasible = b
            .evaluation
            .best
            .is_some()
            .cmp(&a.evaluation.best.is_some());
        let objective = match spec.objective {
            Objective::ThroughputPerGpu => std::cmp::Ordering::Equal,
            Objective::FewestGpus { .. } => a
                .gpus_needed
                .unwrap_or(u32::MAX)
                .cmp(&b.gpus_needed.unwrap_or(u32::MAX)),
        };
        feasible
            .then(objective)
            .then(b.tokens_per_gpu().total_cmp(&a.tokens_per_gpu()))
            .then_with(|| a.candidate.label().cmp(&b.candidate.label()))
    });
}

fn seed_spread(spec: &SearchSpec, r: &Ranked, simulations: &AtomicU64) -> SeedSpread {
    let best = r.evaluation.best.as_ref().expect("a finalist met a load");
    let n = best.load;
    let bounds = spec.slo.bounds();
    let mut runs = vec![best.clone()];
    for k in 1..=spec.method.seeds as usize {
        let Some(window) = spec.workload.window_of_seed(k) else {
            break;
        };
        simulations.fetch_add(1, Ordering::Relaxed);
        let seed = spec.seed.wrapping_add(k as u64);
        runs.push(simulate_at(
            spec,
            &r.candidate,
            &r.cheap,
            &r.simulated_model,
            &r.kv_tokens_per_rank,
            n,
            Draw { seed, window },
        ));
    }
    let gpus = f64::from(r.candidate.gpus());
    let tps: Vec<f64> = runs.iter().map(|m| m.output_tokens_per_s / gpus).collect();
    let spread = |v: &[f64]| {
        (
            v.iter().copied().fold(f64::INFINITY, f64::min),
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        )
    };
    SeedSpread {
        runs: runs.len() as u32,
        met: runs.iter().filter(|m| m.misses(&bounds).is_empty()).count() as u32,
        tokens_per_gpu: spread(&tps),
        objectives: bounds
            .iter()
            .map(|b| {
                let v: Vec<f64> = runs.iter().map(|m| m.value(b)).collect();
                let (lo, hi) = spread(&v);
                (b.key(), lo, hi)
            })
            .collect(),
    }
}

/// Every point that met every objective and that no other point beats on both axes.
fn pareto(spec: &SearchSpec, ranked: &[Ranked]) -> Vec<ParetoPoint> {
    let bounds = spec.slo.bounds();
    let mut points: Vec<ParetoPoint> = ranked.iter().flat_map(|r| r.feasible(&bounds)).collect();
    // By tokens per user, best first; keep a point only if it beats every point before
    // it on tokens per GPU.
    points.sort_by(|a, b| {
        b.tokens_per_user
            .total_cmp(&a.tokens_per_user)
            .then(b.tokens_per_gpu.total_cmp(&a.tokens_per_gpu))
            .then_with(|| a.label.cmp(&b.label))
    });
    let mut front: Vec<ParetoPoint> = Vec::new();
    for p in points {
        if front
            .last()
            .is_none_or(|last| p.tokens_per_gpu > last.tokens_per_gpu)
        {
            front.push(p);
        }
    }
    front.reverse();
    front
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_of_one_kind_count_together() {
        assert_eq!(
            reason_kind("[model] tp = 8: must divide the 28 attention heads"),
            "[model] tp = N: must divide the N attention heads"
        );
        assert_eq!(reason_kind("needs 170.5 GiB"), "needs N GiB");
    }
}
