//! The `threads` driver: every rank of one server on its own OS thread with a device
//! thread each, real clock, in-process collectives, and a client thread that plays the
//! workload in real time (scaled) through the ingress queue.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};

use lockstep_actors::config::Role;
use lockstep_actors::executor::{FetchBatch, FetchMode, Finish, RankExecutor, Response};
use lockstep_actors::ids::RankId;
use lockstep_actors::request::RequestSpec;
use lockstep_gpu::{AnalyticBackend, Backend, ZeroCostBackend};
use lockstep_transport::{InProcessGroup, IngressQueue};

use super::DriverError;
use super::device::{DeviceHandle, DeviceTiming};
use super::rank_loop::{FrontDoor, Progress, RankRun, run_rank};
use crate::report::{ClientRecord, Report, assemble_report, server_report};
use crate::scenario::Scenario;
use crate::workload::Workload;

/// What reaches rank 0 through the front door.
#[derive(Debug, Clone)]
pub enum IngressItem {
    /// A new request.
    Request(RequestSpec),
    /// Finish the work in hand, then stop.
    Shutdown,
}

/// Options of the threads driver.
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
}

impl Default for ThreadsOptions {
    fn default() -> Self {
        ThreadsOptions {
            seed: 0,
            time_scale: 0.0,
            collective_timeout: Duration::from_secs(30),
            ingress_capacity: 1 << 16,
            preload: false,
        }
    }
}

struct Rank0Front {
    ingress: IngressQueue<IngressItem>,
    responses: Sender<Vec<Response>>,
}

impl Rank0Front {
    fn convert(items: Vec<IngressItem>) -> FetchBatch {
        let mut batch = FetchBatch::default();
        for item in items {
            match item {
                IngressItem::Request(spec) => batch.requests.push(spec),
                IngressItem::Shutdown => batch.shutdown = true,
            }
        }
        batch
    }
}

impl FrontDoor for Rank0Front {
    fn fetch(&mut self, mode: FetchMode) -> FetchBatch {
        let mut items = Vec::new();
        if mode == FetchMode::Block {
            match self.ingress.pop_blocking() {
                Some(first) => items.push(first),
                // Closed and empty: nothing will ever come; behave as a shutdown.
                None => items.push(IngressItem::Shutdown),
            }
        }
        items.extend(self.ingress.drain_now());
        Rank0Front::convert(items)
    }

    fn deliver(&mut self, responses: Vec<Response>) {
        if !responses.is_empty() {
            let _ = self.responses.send(responses);
        }
    }
}

/// Runs the scenario's single aggregated server with one thread per rank.
pub fn run(scenario: &Scenario, opts: &ThreadsOptions) -> Result<Report, DriverError> {
    let started = Instant::now();
    let [server] = &scenario.servers[..] else {
        return Err(DriverError::Invalid(format!(
            "the threads driver runs one aggregated server; the scenario has {}",
            scenario.servers.len()
        )));
    };
    if server.role != Role::Agg {
        return Err(DriverError::Invalid(format!(
            "server `{}` has role {}: the threads driver runs aggregated servers",
            server.name,
            server.role.name()
        )));
    }
    let derived = server
        .derive(&scenario.policy)
        .map_err(|e| DriverError::Invalid(e.to_string()))?;
    let sizes = derived.sizes;
    let wl_cfg = scenario
        .workload
        .as_ref()
        .ok_or_else(|| DriverError::Invalid("scenario has no [workload] section".into()))?;
    let mut workload = Workload::new(
        wl_cfg,
        sizes.tokens_per_block,
        scenario.seed.unwrap_or(opts.seed),
        &scenario.base_dir,
    )
    .map_err(|e| DriverError::Invalid(e.to_string()))?;
    let profile = scenario.model.resolve().map_err(DriverError::Invalid)?;
    let dp = sizes.dp as usize;
    let ingress: IngressQueue<IngressItem> = IngressQueue::new(opts.ingress_capacity);
    let (resp_tx, resp_rx) = unbounded::<Vec<Response>>();
    let mut members = InProcessGroup::new(dp, opts.collective_timeout);
    let progresses: Vec<Arc<Progress>> = (0..dp).map(|_| Arc::new(Progress::default())).collect();

    let mut records = std::collections::BTreeMap::new();
    let clock = Instant::now();
    let now_ns = |c: &Instant| c.elapsed().as_nanos() as u64;
    // Preload: every arrival now, then the shutdown, before any rank runs.
    if opts.preload {
        while let Some(t) = workload.next_arrival_ns() {
            let a = workload.pop_due(t).expect("due arrival");
            records.insert(a.spec.id, ClientRecord::new(a.spec.clone(), 0));
            push(&ingress, IngressItem::Request(a.spec))?;
        }
        push(&ingress, IngressItem::Shutdown)?;
    }

    let mut handles = Vec::with_capacity(dp);
    for (r, member) in members.drain(..).enumerate() {
        let exec = RankExecutor::new(RankId(r as u32), server, &sizes, scenario.policy);
        let progress = progresses[r].clone();
        let front = (r == 0).then(|| Rank0Front {
            ingress: ingress.clone(),
            responses: resp_tx.clone(),
        });
        let coefficients = profile.coefficients;
        let time_scale = opts.time_scale;
        let timeout = opts.collective_timeout;
        handles.push(
            std::thread::Builder::new()
                .name(format!("rank-{r}"))
                .spawn(move || -> Result<RankRun, DriverError> {
                    let mut member = member;
                    let device = if time_scale > 0.0 {
                        start_device(r, AnalyticBackend { coefficients }, time_scale, timeout)
                    } else {
                        start_device(r, ZeroCostBackend, 0.0, timeout)
                    };
                    let mut front = front;
                    run_rank(
                        exec,
                        &mut member,
                        front.as_mut().map(|f| f as &mut dyn FrontDoor),
                        &device,
                        &progress,
                    )
                })
                .expect("spawn rank thread"),
        );
    }
    drop(resp_tx);

    // The client: real-time arrivals (scaled), closed-loop follow-ups on responses.
    let scale = if opts.time_scale > 0.0 { opts.time_scale } else { 0.0 };
    let mut shutdown_sent = opts.preload;
    loop {
        if !opts.preload {
            while let Some(t) = workload.next_arrival_ns() {
                let due = (t as f64 * scale) as u64;
                if due > now_ns(&clock) {
                    break;
                }
                let a = workload.pop_due(t).expect("due arrival");
                records.insert(a.spec.id, ClientRecord::new(a.spec.clone(), now_ns(&clock)));
                push(&ingress, IngressItem::Request(a.spec))?;
            }
            if !shutdown_sent
                && workload.exhausted()
                && records.values().all(|r: &ClientRecord| r.end_ns.is_some())
            {
                push(&ingress, IngressItem::Shutdown)?;
                shutdown_sent = true;
            }
        }
        let wait = match workload.next_arrival_ns() {
            Some(t) if !opts.preload => {
                let due = (t as f64 * scale) as u64;
                Duration::from_nanos(due.saturating_sub(now_ns(&clock)).min(50_000_000))
            }
            _ => Duration::from_millis(50),
        };
        match resp_rx.recv_timeout(wait) {
            Ok(batch) => {
                let now = now_ns(&clock);
                for resp in batch {
                    if let Some(rec) = records.get_mut(&resp.id) {
                        rec.on_response(&resp, now);
                        if matches!(resp.finish, Some(Finish::Completed | Finish::Failed(_) | Finish::Cancelled | Finish::ContextDone)) {
                            workload.on_finished(resp.id, now, rec.completed);
                        }
                    }
                }
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        }
    }
    ingress.close();
    let mut runs = Vec::with_capacity(dp);
    let mut first_error = None;
    for h in handles {
        match h.join() {
            Ok(Ok(run)) => runs.push(run),
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
    let execs: Vec<&RankExecutor> = runs.iter().map(|r| &r.exec).collect();
    let violations = runs.iter().flat_map(|r| r.violations.iter().cloned()).collect();
    let count = runs.iter().map(|r| r.violation_count).sum();
    let srv = server_report(
        &server.name,
        server.role,
        sizes.max_batch_size,
        &execs,
        runs[0].iterations,
        clock.elapsed().as_secs_f64(),
        violations,
        count,
    );
    Ok(assemble_report(
        scenario,
        scenario.seed.unwrap_or(opts.seed),
        records.into_values().collect(),
        clock.elapsed().as_nanos() as u64,
        started.elapsed().as_secs_f64(),
        vec![srv],
        None,
    ))
}

fn start_device<B: Backend + Send + 'static>(
    rank: usize,
    backend: B,
    time_scale: f64,
    timeout: Duration,
) -> DeviceHandle {
    DeviceHandle::start(rank, backend, DeviceTiming { time_scale }, timeout)
}

fn push(q: &IngressQueue<IngressItem>, item: IngressItem) -> Result<(), DriverError> {
    q.push(item)
        .map_err(|e| DriverError::Invalid(format!("ingress: {e}")))
}

