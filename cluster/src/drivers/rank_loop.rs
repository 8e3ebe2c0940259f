//! One rank's loop over real collectives: the executor phases of `lockstep-actors`, each
//! followed by the collective its type names, every iteration, in the same order on every
//! rank (mechanisms.md §3). Used by the threads and MPI drivers alike.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use lockstep_actors::executor::CollectiveTag;
use lockstep_actors::executor::{
    BatchVote, FetchBatch, FetchMode, IterationReport, PadIntent, Phase, PrefixMatches,
    RankExecutor, RankResponses, RankState, TransferCommand, TransferEvent, TransferStatus,
};
use lockstep_actors::invariants::Violation;
use lockstep_transport::Collective;

use super::DriverError;
use super::device::DeviceHandle;

/// Rank 0's side of the front door.
pub trait FrontDoor {
    /// Reads the ingress queue: with `Block`, waits for at least one item (the idle
    /// decision of §3.2); with `Poll`, drains what is there.
    fn fetch(&mut self, mode: FetchMode) -> FetchBatch;
    /// Hands the responses gathered this iteration (one vector per rank, as gathered:
    /// nothing is copied on rank 0's critical path) to the clients.
    fn deliver(&mut self, responses: Vec<RankResponses>);
}

/// A rank's side of the KV transport (disaggregated servers): the driver's glue between
/// the executor and its transceiver. It owns the clock the transceiver reads (the rank
/// loop keeps none).
pub trait TransferPort {
    /// The transfers the executor asked for this iteration (`IterationReport::
    /// transfer_commands`), handed over right after the transfer phase.
    fn commands(&mut self, commands: &[TransferCommand]);
    /// Transfers that ended since the last poll, for the executor; called just before
    /// the transfer-status phase, so they apply in this iteration's consensus.
    fn poll(&mut self) -> Vec<TransferEvent>;
}

/// What a rank hands back when its loop ends.
pub struct RankRun {
    /// The executor, for the report.
    pub exec: RankExecutor,
    /// Iterations run.
    pub iterations: u64,
    /// Violations seen (the first 100).
    pub violations: Vec<Violation>,
    /// Violations in all.
    pub violation_count: u64,
    /// Wall time of each iteration, when [`LoopOptions::time_iterations`] asked for it.
    pub iteration_times: Vec<std::time::Duration>,
}

/// Progress published for the watchdog: the iteration, the phase the rank is in, and
/// its counts at the last gather (so a stuck rank can be described without touching its
/// actors from another thread).
#[derive(Debug, Default)]
pub struct Progress {
    /// Iterations completed.
    pub iteration: AtomicU64,
    /// Last phase entered (as `Phase as u64`).
    pub phase: AtomicU64,
    /// Live requests at the last gather.
    pub live: AtomicU64,
    /// Routable requests at the last gather.
    pub routable: AtomicU64,
    /// Retiring requests at the last gather.
    pub retiring: AtomicU64,
    /// Schedulable requests at the last gather.
    pub schedulable: AtomicU64,
    /// Waiting queue length at the last gather.
    pub waiting: AtomicU64,
}

impl Progress {
    /// One line for a watchdog message.
    pub fn describe(&self) -> String {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "iteration {}, last collective tag phase #{}, live {}, routable {}, retiring {}, schedulable {}, waiting {}",
            l(&self.iteration),
            l(&self.phase),
            l(&self.live),
            l(&self.routable),
            l(&self.retiring),
            l(&self.schedulable),
            l(&self.waiting)
        )
    }
}

impl Progress {
    fn enter(&self, phase: Phase) {
        self.phase.store(phase as u64, Ordering::Relaxed);
    }
}

fn coll<T>(
    rank: usize,
    r: Result<T, lockstep_transport::CollectiveError>,
) -> Result<T, DriverError> {
    r.map_err(|source| DriverError::Collective { rank, source })
}

fn exe<T>(
    rank: usize,
    r: Result<T, lockstep_actors::executor::ExecutorError>,
) -> Result<T, DriverError> {
    r.map_err(|source| DriverError::Executor { rank, source })
}

/// Runs one rank until a shutdown has been read and the whole server is drained (decided
/// from replicated data only — the shutdown flag, the gathered live counts, the waiting
/// queue — so every rank leaves at the same iteration).
pub fn run_rank<C: Collective>(
    exec: RankExecutor,
    coll_group: &mut C,
    front: Option<&mut dyn FrontDoor>,
    device: &DeviceHandle,
    progress: &Arc<Progress>,
) -> Result<RankRun, DriverError> {
    run_rank_until(
        exec,
        coll_group,
        front,
        device,
        progress,
        &LoopOptions::default(),
    )
}

/// Options of a rank loop.
#[derive(Debug, Clone, Copy, Default)]
pub struct LoopOptions {
    /// Stop after this many iterations (every rank at the same one).
    pub max_iterations: Option<u64>,
    /// Fault injection: at this iteration this rank tags its gather with the wrong
    /// phase, as a rank that reordered a collective would.
    pub mismatch_tag_at: Option<u64>,
    /// Record each iteration's wall time (the overhead benchmark).
    pub time_iterations: bool,
}

/// [`run_rank`], stopping after `max_iterations` iterations if given (every rank stops
/// at the same one: used by the overhead benchmark).
pub fn run_rank_until<C: Collective>(
    exec: RankExecutor,
    coll_group: &mut C,
    front: Option<&mut dyn FrontDoor>,
    device: &DeviceHandle,
    progress: &Arc<Progress>,
    options: &LoopOptions,
) -> Result<RankRun, DriverError> {
    run_rank_with_transfers(exec, coll_group, front, None, device, progress, options)
}

/// [`run_rank_until`] with a KV transport: the executor's transfer commands go to
/// `transfers` after each iteration, and the transfer events it reports are handed to
/// the executor before each transfer phase.
pub fn run_rank_with_transfers<C: Collective>(
    mut exec: RankExecutor,
    coll_group: &mut C,
    mut front: Option<&mut dyn FrontDoor>,
    mut transfers: Option<&mut dyn TransferPort>,
    device: &DeviceHandle,
    progress: &Arc<Progress>,
    options: &LoopOptions,
) -> Result<RankRun, DriverError> {
    let rank = coll_group.rank();
    let mut violations = Vec::new();
    let mut violation_count = 0u64;
    let mut iterations = 0u64;
    // Reused every iteration: a steady-state iteration allocates no response vector.
    let mut responses = RankResponses {
        rank: exec.rank(),
        responses: Vec::new(),
    };
    let mut iteration_times = Vec::new();
    let mut report = IterationReport::default();
    loop {
        if options.max_iterations.is_some_and(|m| iterations >= m) {
            break;
        }
        let started = options.time_iterations.then(std::time::Instant::now);
        let iteration = exec.iteration();
        let tag = |phase| CollectiveTag { iteration, phase };
        progress.enter(Phase::Gather);
        let (t, state) = exec.begin_iteration();
        let c = state.counts;
        progress.live.store(u64::from(c.live), Ordering::Relaxed);
        progress
            .routable
            .store(u64::from(c.routable), Ordering::Relaxed);
        progress
            .retiring
            .store(u64::from(c.retiring), Ordering::Relaxed);
        progress
            .schedulable
            .store(u64::from(c.schedulable), Ordering::Relaxed);
        progress
            .waiting
            .store(exec.waiting().len() as u64, Ordering::Relaxed);
        let gather_tag = if options.mismatch_tag_at == Some(iteration) {
            tag(Phase::Vote)
        } else {
            tag(Phase::Gather)
        };
        let states: Vec<RankState> = coll(rank, coll_group.allgather(gather_tag, &state))?;
        if exec.server_drained(&states) {
            break;
        }
        progress.enter(Phase::Fetch);
        let fetched = if rank == 0 {
            let mode = exec.fetch_mode(&states);
            let batch = match front.as_mut() {
                Some(f) => f.fetch(mode),
                None => FetchBatch::default(),
            };
            coll(rank, coll_group.broadcast(t.tag(), 0, Some(&batch)))?
        } else {
            coll(rank, coll_group.broadcast::<FetchBatch>(t.tag(), 0, None))?
        };
        let (t, matches) = exe(rank, exec.on_fetch(t, &states, &fetched))?;
        progress.enter(Phase::PrefixMatch);
        let all: Vec<PrefixMatches> = coll(rank, coll_group.allgather(t.tag(), &matches))?;
        let (t, intent) = exe(rank, exec.on_prefix_matches(t, &all))?;
        progress.enter(Phase::PadIntent);
        let global = coll(rank, coll_group.allreduce_max(t.tag(), intent as u64))?;
        let global = match global {
            0 => PadIntent::None,
            1 => PadIntent::Generation,
            _ => PadIntent::Context,
        };
        let (t, vote) = exec.on_pad_intent(t, global);
        progress.enter(Phase::Vote);
        let votes: Vec<BatchVote> = coll(rank, coll_group.allgather(t.tag(), &vote))?;
        let (t, _can_queue, awaited) = exe(rank, exec.vote(t, &votes))?;
        if let Some(batch) = exec.launched() {
            device.launch(batch)?;
        }
        let output = match awaited {
            Some(n) => Some(device.await_output(n)?),
            None => None,
        };
        responses.responses.clear();
        let t = exe(
            rank,
            exec.forward_output_into(t, output.as_ref(), &mut responses.responses),
        )?;
        if let Some(output) = output {
            device.recycle(output);
        }
        progress.enter(Phase::Responses);
        let gathered: Option<Vec<RankResponses>> =
            coll(rank, coll_group.gather(t.tag(), 0, &responses))?;
        if let (Some(all), Some(f)) = (gathered, front.as_mut()) {
            f.deliver(all);
        }
        if let Some(port) = transfers.as_mut() {
            for event in port.poll() {
                // A request this rank no longer holds in transfer (it failed meanwhile)
                // has nothing left to apply.
                let _ = exec.handle_transfer_event(event);
            }
        }
        let (t, status) = exec.transfer_status(t);
        progress.enter(Phase::Transfers);
        let statuses: Vec<TransferStatus> = coll(rank, coll_group.allgather(t.tag(), &status))?;
        exe(rank, exec.transfer_result_into(t, &statuses, &mut report))?;
        if let Some(port) = transfers.as_mut()
            && !report.transfer_commands.is_empty()
        {
            port.commands(&report.transfer_commands);
        }
        let mut fatal = None;
        for v in report.violations.drain(..) {
            violation_count += 1;
            if v.kind.is_fatal() {
                fatal.get_or_insert_with(|| v.clone());
            }
            if violations.len() < 100 {
                violations.push(v);
            }
        }
        // Every rank read the same flags: all stop here together.
        if let Some(v) = fatal {
            return Err(DriverError::Crashed(v));
        }
        if let Some(peer) = statuses.iter().position(|s| s.fatal) {
            return Err(DriverError::PeerCrashed { rank, peer });
        }
        iterations += 1;
        progress.iteration.store(iterations, Ordering::Relaxed);
        if let Some(started) = started {
            iteration_times.push(started.elapsed());
        }
    }
    Ok(RankRun {
        exec,
        iterations,
        violations,
        violation_count,
        iteration_times,
    })
}
