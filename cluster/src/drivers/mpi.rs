//! The `mpi` driver: `mpirun -n N lockstep rank SCENARIO.toml` runs one rank per
//! process. Rank 0 plays the workload (a client thread) and writes the report; every rank
//! checks at startup that the world size matches the scenario's ranks and that all ranks
//! loaded the same scenario. A watchdog thread per process aborts the job when its rank
//! makes no progress.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;

use lockstep_actors::executor::{CollectiveTag, Phase, RankExecutor, RankResponses};
use lockstep_actors::ids::RankId;
use lockstep_transport::{Collective, IngressQueue, MpiMember};

use super::DriverError;
use super::client::{Client, IngressItem};
use super::rank_loop::{FrontDoor, LoopOptions, Progress, run_rank_until};
use super::threads::{Prepared, Rank0Front, ThreadsOptions, prepare, start_device};
use crate::report::{RankSummary, Report, assemble_report, server_report};
use crate::scenario::Scenario;

/// Options of one rank process.
#[derive(Debug, Clone)]
pub struct MpiOptions {
    /// Shared with the threads driver (seed, time scale, preload, ingress capacity).
    pub common: ThreadsOptions,
    /// No iteration progress for this long aborts the job.
    pub watchdog: Duration,
    /// Fault injection (tests): this rank tags a collective wrongly at this iteration.
    pub mismatch_tag_at: Option<(usize, u64)>,
}

pub(crate) fn watchdog(rank: usize, progress: Arc<Progress>, limit: Duration) {
    std::thread::spawn(move || {
        let mut last = progress.iteration.load(Ordering::Relaxed);
        let mut since = Instant::now();
        loop {
            std::thread::sleep(limit / 10);
            let now = progress.iteration.load(Ordering::Relaxed);
            if now != last {
                last = now;
                since = Instant::now();
                continue;
            }
            if since.elapsed() >= limit {
                eprintln!(
                    "lockstep watchdog: rank {rank} made no progress for {} ms; a peer is lost or stuck — aborting the job; rank {rank}: {}",
                    limit.as_millis(),
                    progress.describe()
                );
                std::process::exit(3);
            }
        }
    });
}

/// Runs this process's rank. Rank 0 returns the report; the others `None`.
pub fn run_rank_process(
    scenario: &Scenario,
    scenario_text_digest: u64,
    opts: &MpiOptions,
) -> Result<Option<Report>, DriverError> {
    let started = Instant::now();
    let mut member =
        MpiMember::init().map_err(|source| DriverError::Collective { rank: 0, source })?;
    let rank = member.rank();
    let Prepared {
        server,
        sizes,
        workload,
        coefficients,
    } = prepare(scenario, opts.common.seed)?;
    let world = member.size();
    if world != sizes.dp as usize {
        return Err(DriverError::Invalid(format!(
            "rank {rank}: MPI world size {world} does not match the scenario's ranks: server `{}` has dp = {}",
            server.name, sizes.dp
        )));
    }
    let setup = CollectiveTag {
        iteration: u64::MAX,
        phase: Phase::Gather,
    };
    let digests: Vec<u64> = member
        .allgather(setup, &scenario_text_digest)
        .map_err(|source| DriverError::Collective { rank, source })?;
    if let Some((other, d)) = digests.iter().enumerate().find(|(_, d)| **d != digests[0]) {
        return Err(DriverError::Invalid(format!(
            "rank {rank}: ranks disagree on the scenario: rank 0 has digest {:016x}, rank {other} has {d:016x}",
            digests[0]
        )));
    }
    let progress = Arc::new(Progress::default());
    watchdog(rank, progress.clone(), opts.watchdog);
    let ingress: IngressQueue<IngressItem> = IngressQueue::new(opts.common.ingress_capacity);
    let (resp_tx, resp_rx) = unbounded::<Vec<RankResponses>>();
    let client_thread = if rank == 0 {
        let client = Client::new(
            workload,
            ingress.clone(),
            resp_rx,
            opts.common.time_scale,
            opts.common.preload,
        )?;
        Some(std::thread::spawn(move || client.run()))
    } else {
        drop(resp_rx);
        None
    };
    let mut front = (rank == 0).then(|| Rank0Front {
        clock: Instant::now(),
        ingress: ingress.clone(),
        responses: resp_tx,
    });
    let exec = RankExecutor::new(RankId(rank as u32), server, &sizes, scenario.policy);
    let device = start_device(rank, coefficients, opts.common.time_scale, opts.watchdog);
    let loop_opts = LoopOptions {
        max_iterations: None,
        mismatch_tag_at: opts
            .mismatch_tag_at
            .and_then(|(r, it)| (r == rank).then_some(it)),
        ..LoopOptions::default()
    };
    let run = run_rank_until(
        exec,
        &mut member,
        front.as_mut().map(|f| f as &mut dyn FrontDoor),
        &device,
        &progress,
        &loop_opts,
    )?;
    drop(front);
    let summary = RankSummary::of(
        &run.exec,
        run.iterations,
        run.violations,
        run.violation_count,
    );
    let done = CollectiveTag {
        iteration: u64::MAX,
        phase: Phase::Responses,
    };
    let all = member
        .gather(done, 0, &summary)
        .map_err(|source| DriverError::Collective { rank, source })?;
    progress.iteration.store(u64::MAX, Ordering::Relaxed);
    let Some(all) = all else {
        return Ok(None);
    };
    let result = client_thread
        .expect("rank 0 runs the client")
        .join()
        .map_err(|_| DriverError::Invalid("client thread panicked".into()))??;
    let srv = server_report(
        &server.name,
        server.role,
        sizes.max_batch_size,
        &all,
        result.end_ns as f64 / 1e9,
    );
    Ok(Some(assemble_report(
        scenario,
        scenario.seed.unwrap_or(opts.common.seed),
        result.records,
        result.end_ns,
        started.elapsed().as_secs_f64(),
        vec![srv],
        None,
    )))
}
