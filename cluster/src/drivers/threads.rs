//! The `threads` driver: every rank of one server on its own OS thread with a device
//! thread each, real clock, in-process collectives, and a client that plays the workload
//! in real time (scaled) through the ingress queue.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, unbounded};

use lockstep_actors::config::{DerivedSizes, Role, ServerConfig};
use lockstep_actors::executor::{FetchBatch, FetchMode, RankExecutor, RankResponses};
use lockstep_actors::ids::RankId;
use lockstep_gpu::{AnalyticBackend, Coefficients, ZeroCostBackend};
use lockstep_transport::{InProcessGroup, IngressQueue};

use super::DriverError;
use super::client::{Client, IngressItem};
use super::device::{DeviceHandle, DeviceTiming};
use super::rank_loop::{FrontDoor, LoopOptions, Progress, RankRun, run_rank_until};
use crate::report::{RankSummary, Report, assemble_report, server_report};
use crate::scenario::Scenario;
use crate::workload::Workload;

/// Options of the real drivers.
#[derive(Debug, Clone)]
pub struct ThreadsOptions {
    /// Seed of the workload.
    pub seed: u64,
    /// Wall seconds per modeled second (0: zero-cost backend, no sleeping).
    pub time_scale: f64,
    /// A collective that waits longer fails naming the missing ranks.
    pub collective_timeout: Duration,
    /// Ingress queue capacity.
    pub ingress_capacity: usize,
    /// Deliver every arrival before the ranks start (arrivals at iteration boundaries:
    /// the schedule is then independent of thread timing, for cross-driver equality).
    pub preload: bool,
    /// Fault injection (tests): this rank tags its gather wrongly at this iteration.
    pub mismatch_tag_at: Option<(usize, u64)>,
    /// Fault injection (tests, disaggregated scenarios): the KV blocks of every n-th
    /// transfer are lost on the way, so only the timeout ends that transfer. Overrides
    /// the scenario's `[faults] lost_transfer_every`.
    pub lose_kv_blocks_every: Option<u64>,
}

impl Default for ThreadsOptions {
    fn default() -> Self {
        ThreadsOptions {
            seed: 0,
            time_scale: 0.0,
            collective_timeout: Duration::from_secs(30),
            ingress_capacity: 1 << 16,
            preload: false,
            mismatch_tag_at: None,
            lose_kv_blocks_every: None,
        }
    }
}

/// Rank 0's front door over the ingress queue.
pub struct Rank0Front {
    /// The driver's clock (the fetch broadcasts its reading, §8's stale rule uses it).
    pub clock: Instant,
    /// The queue the client fills.
    pub ingress: IngressQueue<IngressItem>,
    /// Where gathered responses go.
    pub responses: Sender<Vec<RankResponses>>,
}

impl FrontDoor for Rank0Front {
    fn fetch(&mut self, mode: FetchMode) -> FetchBatch {
        fetch_from(&self.ingress, self.clock, mode)
    }

    fn deliver(&mut self, responses: Vec<RankResponses>) {
        if responses.iter().any(|r| !r.responses.is_empty()) {
            let _ = self.responses.send(responses);
        }
    }
}

/// Reads a server's ingress queue for its rank 0: with `Block`, waits for at least one
/// item (the idle decision of §3.2); a closed, empty queue reads as a shutdown.
pub fn fetch_from(
    ingress: &IngressQueue<IngressItem>,
    clock: Instant,
    mode: FetchMode,
) -> FetchBatch {
    let mut items = Vec::new();
    if mode == FetchMode::Block {
        match ingress.pop_blocking() {
            Some(first) => items.push(first),
            // Closed and empty: nothing will ever come; behave as a shutdown.
            None => items.push(IngressItem::Shutdown),
        }
    }
    items.extend(ingress.drain_now());
    let mut batch = FetchBatch {
        now_ns: clock.elapsed().as_nanos() as u64,
        ..FetchBatch::default()
    };
    for item in items {
        match item {
            IngressItem::Request(spec) => batch.requests.push(spec),
            IngressItem::Shutdown => batch.shutdown = true,
            IngressItem::PeerReady(id) => batch.peers_ready.push(id),
        }
    }
    batch
}

/// The one aggregated server the real drivers run, its sizes and its workload.
pub struct Prepared<'a> {
    /// The server.
    pub server: &'a ServerConfig,
    /// Its sizes.
    pub sizes: DerivedSizes,
    /// The workload.
    pub workload: Workload,
    /// Cost coefficients (for a scaled-time device).
    pub coefficients: Coefficients,
}

/// Checks that the scenario is one aggregated server with a workload.
pub fn prepare<'a>(scenario: &'a Scenario, seed: u64) -> Result<Prepared<'a>, DriverError> {
    let [server] = &scenario.servers[..] else {
        return Err(DriverError::Invalid(format!(
            "the real drivers run one aggregated server; the scenario has {}",
            scenario.servers.len()
        )));
    };
    if server.role != Role::Agg {
        return Err(DriverError::Invalid(format!(
            "server `{}` has role {}: the real drivers run aggregated servers",
            server.name,
            server.role.name()
        )));
    }
    let sizes = server
        .derive(&scenario.policy)
        .map_err(|e| DriverError::Invalid(e.to_string()))?
        .sizes;
    let wl_cfg = scenario
        .workload
        .as_ref()
        .ok_or_else(|| DriverError::Invalid("scenario has no [workload] section".into()))?;
    let workload = Workload::new(
        wl_cfg,
        sizes.tokens_per_block,
        scenario.seed.unwrap_or(seed),
        &scenario.base_dir,
    )
    .map_err(|e| DriverError::Invalid(e.to_string()))?;
    let coefficients = scenario
        .model
        .resolve()
        .map_err(DriverError::Invalid)?
        .coefficients;
    Ok(Prepared {
        server,
        sizes,
        workload,
        coefficients,
    })
}

/// Starts the device of `rank`: the cost model in scaled real time, or zero cost.
pub fn start_device(
    rank: usize,
    coefficients: Coefficients,
    time_scale: f64,
    timeout: Duration,
) -> DeviceHandle {
    if time_scale > 0.0 {
        DeviceHandle::start(
            rank,
            AnalyticBackend { coefficients },
            DeviceTiming { time_scale },
            timeout,
        )
    } else {
        DeviceHandle::start(
            rank,
            ZeroCostBackend,
            DeviceTiming { time_scale: 0.0 },
            timeout,
        )
    }
}

/// Runs the scenario with one thread per rank: its single aggregated server, or — when
/// it has ctx and gen servers — every server, with real KV transfers between them
/// ([`super::disagg_threads`]).
pub fn run(scenario: &Scenario, opts: &ThreadsOptions) -> Result<Report, DriverError> {
    if scenario.servers.iter().any(|s| s.role != Role::Agg) {
        return super::disagg_threads::run(scenario, opts);
    }
    let started = Instant::now();
    let Prepared {
        server,
        sizes,
        workload,
        coefficients,
    } = prepare(scenario, opts.seed)?;
    let dp = sizes.dp as usize;
    let ingress: IngressQueue<IngressItem> = IngressQueue::new(opts.ingress_capacity);
    let (resp_tx, resp_rx) = unbounded::<Vec<RankResponses>>();
    let client = Client::new(
        workload,
        ingress.clone(),
        resp_rx,
        opts.time_scale,
        opts.preload,
    )?;
    let members = InProcessGroup::new(dp, opts.collective_timeout);
    let mut handles = Vec::with_capacity(dp);
    for (r, mut member) in members.into_iter().enumerate() {
        let exec = RankExecutor::new(RankId(r as u32), server, &sizes, scenario.policy);
        let mut front = (r == 0).then(|| Rank0Front {
            clock: Instant::now(),
            ingress: ingress.clone(),
            responses: resp_tx.clone(),
        });
        let time_scale = opts.time_scale;
        let timeout = opts.collective_timeout;
        let loop_opts = LoopOptions {
            max_iterations: None,
            mismatch_tag_at: opts
                .mismatch_tag_at
                .and_then(|(rank, it)| (rank == r).then_some(it)),
            ..LoopOptions::default()
        };
        handles.push(
            std::thread::Builder::new()
                .name(format!("rank-{r}"))
                .spawn(move || -> Result<RankRun, DriverError> {
                    let device = start_device(r, coefficients, time_scale, timeout);
                    run_rank_until(
                        exec,
                        &mut member,
                        front.as_mut().map(|f| f as &mut dyn FrontDoor),
                        &device,
                        &Arc::new(Progress::default()),
                        &loop_opts,
                    )
                })
                .map_err(|e| DriverError::Invalid(format!("spawning rank {r}: {e}")))?,
        );
    }
    drop(resp_tx);
    let result = client.run()?;
    ingress.close();
    let mut summaries = Vec::with_capacity(dp);
    let mut first_error = None;
    for h in handles {
        match h.join() {
            Ok(Ok(run)) => summaries.push(RankSummary::of(
                &run.exec,
                run.iterations,
                run.violations,
                run.violation_count,
            )),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(DriverError::Invalid("a rank thread panicked".into()));
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let end_s = result.end_ns as f64 / 1e9;
    let srv = server_report(
        &server.name,
        server.role,
        sizes.max_batch_size,
        &summaries,
        end_s,
    );
    Ok(assemble_report(
        scenario,
        scenario.seed.unwrap_or(opts.seed),
        result.records,
        result.end_ns,
        started.elapsed().as_secs_f64(),
        vec![srv],
        None,
    ))
}
