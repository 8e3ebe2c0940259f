//! One rank's host in the real drivers (a thread, or an MPI process's main thread): it
//! runs the executor's iteration protocol over a real [`Collective`], reads the server's
//! ingress on rank 0, drives the device, hands transfer commands to the rank's
//! transceiver and its events back, and delivers rank 0's gathered responses to the
//! front. It never spells out the phase order: it answers whatever the executor asks
//! ([`RankExecutor::poll`]).
//!
//! How rank 0 reads its ingress, when a wait ends and when a forward launches is the
//! rank host's policy that every driver runs ([`RankHost`], written once in
//! `lockstep-hosts`): this loop blocks on the ingress as long as that policy says to
//! wait, and sleeps until the launch time it gives. While rank 0 waits it keeps the
//! group alive ([`Collective::keep_alive`]), so its peers, waiting in the fetch
//! broadcast, measure a stuck rank and not an idle one.

use std::time::{Duration, Instant};

use lockstep_actors::executor::{
    FetchBatch, FetchMode, Input, Io, RankExecutor, RankResponses, StopReason,
};
use lockstep_actors::invariants::Violation;
use lockstep_actors::request::IngressItem;
use lockstep_gpu::AnalyticBackend;
use lockstep_transport::{Collective, Exchanged, exchange};

use super::RuntimeError;
use super::clock::{Clock, WallClock};
use super::device::DeviceHandle;
use super::net::{Endpoint, Envelope, Inbox, Net, Received};
use super::status::StatusPublisher;
use super::transceiver_host::{TransceiverEnd, TransceiverLink};
use super::watchdog::Progress;
use crate::ordered::{Item, Order, Turn};
use lockstep_hosts::order::{Party, Phase, ServerNext};
use lockstep_hosts::rank_host::{RankHost, Read};
use lockstep_plan::report::{RankEnding, RankSummary};

/// Modeled time in the real drivers: the host's step and the device's forward take the
/// cost model's times, scaled, as in the simulator.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    /// The cost model.
    pub backend: AnalyticBackend,
    /// Wall seconds per modeled second.
    pub time_scale: f64,
}

/// How a rank host runs.
#[derive(Debug, Clone)]
pub struct RankOptions {
    /// A bounded stall (work remains, nothing in flight) longer than this is a deadlock.
    pub stall_bound: Duration,
    /// How often a waiting rank 0 tells its peers it is alive.
    pub keep_alive_every: Duration,
    /// Stop after this many iterations (every rank at the same one; the benchmark).
    pub max_iterations: Option<u64>,
    /// Record each iteration's wall time (the benchmark).
    pub time_iterations: bool,
    /// Modeled time (`None`: as fast as the machine goes).
    pub pacing: Option<Pacing>,
    /// Publish the rank's status to the front this often, and on going idle
    /// (`lockstep serve`'s `/metrics`); `None`: never.
    pub status_every: Option<Duration>,
}

impl Default for RankOptions {
    fn default() -> Self {
        RankOptions {
            stall_bound: Duration::from_secs(10),
            keep_alive_every: Duration::from_millis(250),
            max_iterations: None,
            time_iterations: false,
            pacing: None,
            status_every: None,
        }
    }
}

/// What a rank host works with besides its executor and collective.
pub struct RankPorts<'a> {
    /// The server's index in the scenario.
    pub server: usize,
    /// Rank 0: the server's ingress.
    pub ingress: Option<&'a mut dyn Inbox<IngressItem>>,
    /// To the front.
    pub net: &'a dyn Net,
    /// ctx and gen ranks: the transceiver.
    pub transfers: Option<&'a TransceiverLink>,
    /// The device.
    pub device: &'a mut DeviceHandle,
    /// The clock.
    pub clock: &'a WallClock,
    /// Published for the watchdog.
    pub progress: &'a Progress,
    /// An ordered run's turns ([`crate::ordered`]): time is modeled, nothing sleeps,
    /// and rank 0 reads and runs its iterations in its server's turns.
    pub ordered: Option<OrderedRank<'a>>,
}

/// A rank's part in an ordered run.
#[derive(Clone, Copy)]
pub struct OrderedRank<'a> {
    /// The run's turns.
    pub sequencer: &'a dyn Order,
    /// The cost model: every iteration's modeled time.
    pub backend: AnalyticBackend,
}

/// What a rank host reports when its loop ends.
#[derive(Debug)]
pub struct RankRun {
    /// How it ended.
    pub ending: RankEnding,
    /// Violations seen (the first 100).
    pub violations: Vec<Violation>,
    /// Violations in all.
    pub violation_count: u64,
    /// Wall time of each iteration, when [`RankOptions::time_iterations`] asked.
    pub iteration_times: Vec<Duration>,
    /// Samples for the server's time series.
    pub series: lockstep_plan::report::series::Sampler,
}

/// Runs `exec` until the server drains (or stops, or `max_iterations`).
/// A rank's summary after its loop (every real driver's): the executor's counts, how
/// the loop ended (a host error ends it `Failed`), its time series, and what its
/// transceiver moved.
pub fn rank_summary(
    server: usize,
    exec: &RankExecutor,
    outcome: Result<RankRun, RuntimeError>,
    transfers: TransceiverEnd,
) -> RankSummary {
    let (ending, violations, count, series) = match outcome {
        Ok(run) => (
            run.ending,
            run.violations,
            run.violation_count,
            run.series.into_points(),
        ),
        Err(e) => (
            RankEnding::Failed(e.to_string()),
            Vec::new(),
            0,
            Default::default(),
        ),
    };
    let mut summary = RankSummary::of(server, exec, violations, count, ending);
    summary.transfers = transfers.stats;
    summary.lost = transfers.lost;
    summary.series = series;
    summary
}

/// Hands the executor the transfer events its transceiver reported since the last call.
fn apply_arrived_transfer_events(exec: &mut RankExecutor, ports: &RankPorts<'_>) {
    if let Some(link) = ports.transfers {
        while let Ok(event) = link.events.try_recv() {
            // A request this rank no longer holds in transfer (it failed meanwhile) has
            // nothing left to apply.
            let _ = exec.handle_transfer_event(event);
        }
    }
}

pub fn run_rank<C: Collective + ?Sized>(
    exec: &mut RankExecutor,
    coll: &mut C,
    mut ports: RankPorts<'_>,
    opts: &RankOptions,
) -> Result<RankRun, RuntimeError> {
    let rank = exec.rank().index();
    let server = ports.server;
    let _rank_span = tracing::info_span!("rank", server, rank).entered();
    let mut run = RankRun {
        ending: RankEnding::Drained,
        violations: Vec::new(),
        violation_count: 0,
        iteration_times: Vec::new(),
        series: Default::default(),
    };
    let mut iterations = 0u64;
    let mut iteration_started = Instant::now();
    let mut publisher = opts.status_every.map(StatusPublisher::new);
    // The rank host's policy: rank 0's ingress reading and stall bound, the launch time.
    let mut host = RankHost::new(
        u64::try_from(opts.stall_bound.as_nanos()).unwrap_or(u64::MAX),
        opts.pacing.map_or(1.0, |p| p.time_scale),
    );
    let ordered = ports.ordered;
    // In an ordered run: the modeled time of this rank's iteration's process point.
    let mut modeled_now = 0u64;
    // Every rank's batch shape, from the last vote: what the forward costs.
    let mut shapes = Vec::new();
    let coll_err = |source| RuntimeError::Collective {
        server,
        rank,
        source,
    };
    let mut iteration_span = tracing::debug_span!("iteration", n = 0u64).entered();
    loop {
        apply_arrived_transfer_events(exec, &ports);
        let exe_err = |source| RuntimeError::Executor {
            server,
            rank,
            source,
        };
        // Read before `poll` borrows the executor (an iteration's pauses happen while it
        // schedules, before it ends).
        let preemptions = exec.totals().preemptions;
        match exec.poll() {
            Io::Exchange(x) => {
                let phase = x.tag().phase;
                ports.progress.enter(phase, ports.clock.now_ns());
                let result = exchange(coll, x).map_err(coll_err)?;
                ports.progress.alive(ports.clock.now_ns());
                // Rank 0's gathered responses move to the front as they are (the
                // executor only needs to know the gather happened).
                let to_front = |all: Vec<RankResponses>| {
                    if all.iter().any(|r| !r.responses.is_empty()) {
                        ports
                            .net
                            .send(
                                Endpoint::Front,
                                Envelope::Responses {
                                    server: server as u32,
                                    responses: all,
                                },
                            )
                            .map_err(|source| RuntimeError::Net {
                                server,
                                rank,
                                source,
                            })?;
                    }
                    Ok::<(), RuntimeError>(())
                };
                let result = match result {
                    Exchanged::Responses(Some(all)) => {
                        to_front(all)?;
                        Exchanged::Responses(None)
                    }
                    Exchanged::TransferStatus {
                        status,
                        responses: Some(all),
                    } => {
                        to_front(all)?;
                        Exchanged::TransferStatus {
                            status,
                            responses: None,
                        }
                    }
                    other => other,
                };
                if let Exchanged::States(all) = &result {
                    ports.progress.gathered(&all[rank], exec.waiting().len());
                }
                let fetched_at = match &result {
                    // Ordered: the modeled time rank 0 fetched at, broadcast with it.
                    Exchanged::Fetch(batch) if ordered.is_some() => Some(batch.now_ns),
                    Exchanged::Fetch(_) => Some(ports.clock.now_ns()),
                    _ => None,
                };
                exec.handle(result.input()).map_err(exe_err)?;
                if let Some(at) = fetched_at {
                    host.fetched(at);
                    modeled_now = at;
                }
                if let Exchanged::Votes(votes) = &result {
                    shapes.clear();
                    shapes.extend(votes.iter().map(|v| v.shape));
                }
            }
            Io::ReadIngress(mode) => {
                let read = match ordered {
                    Some(o) => {
                        read_ingress_ordered(&mut ports, o.sequencer, &mut host, coll, mode, opts)?
                    }
                    None => read_ingress(&mut ports, &mut host, coll, mode, opts),
                };
                exec.handle(Input::Ingress(read)).map_err(exe_err)?;
            }
            Io::Forward {
                launch,
                await_output,
            } => {
                // The server's iteration time, from every rank's shape: the same on
                // every rank and in the simulator.
                let time = match ordered {
                    Some(o) => {
                        // The iteration's process point, in modeled time: rank 0 takes
                        // its server's turn there; the other ranks wait for it, so the
                        // transfer events applied below are those the order gave by
                        // then.
                        let t = host.forward_times(&o.backend, &shapes, launch.is_some());
                        let at = host.process_point(&t, launch.map(|b| b.number), await_output);
                        modeled_now = if rank == 0 {
                            wait_for_process_point(o.sequencer, server, at)?;
                            at
                        } else {
                            // Rank 0's process point (its awaited output may differ).
                            o.sequencer
                                .wait_server_turn_after(server, host.fetched_at())?
                        };
                        // Nothing sleeps: a forward costs no wall time.
                        None
                    }
                    None => opts
                        .pacing
                        .map(|p| host.forward_times(&p.backend, &shapes, launch.is_some())),
                };
                if let Some(t) = time {
                    ports.clock.sleep_until(t.launch_at);
                }
                let device_err = |source| RuntimeError::Device {
                    server,
                    rank,
                    source,
                };
                // The batch carries all its forward needs (block tables, prompts): the
                // device reads nothing of the executor.
                if let Some(batch) = launch {
                    let forward_ns = time.map_or(0, |t| t.forward_ns);
                    ports.device.launch(batch, forward_ns).map_err(device_err)?;
                }
                let output = match await_output {
                    Some(n) => Some(ports.device.await_output(n).map_err(device_err)?),
                    None => None,
                };
                // The transfer status goes out right after the output: what arrived
                // during the forward belongs to this iteration, as in the simulator.
                apply_arrived_transfer_events(exec, &ports);
                exec.handle(Input::Output(output.as_ref()))
                    .map_err(exe_err)?;
                if let Some(o) = output {
                    ports.device.recycle(o);
                }
            }
            Io::IterationEnded(report) => {
                if let Some(link) = ports.transfers
                    && !report.transfer_commands.is_empty()
                {
                    match ordered {
                        // In this turn, for the transceiver's turn of this instant.
                        Some(o) => {
                            post_commands(o.sequencer, server, rank, &report.transfer_commands)
                        }
                        None => link.send_commands(&report.transfer_commands),
                    }
                }
                for v in &report.violations {
                    run.violation_count += 1;
                    if run.violations.len() < 100 {
                        run.violations.push(v.clone());
                    }
                }
                iterations += 1;
                drop(iteration_span);
                iteration_span = tracing::debug_span!("iteration", n = iterations).entered();
                let now = match ordered {
                    Some(_) => modeled_now,
                    None => ports.clock.now_ns(),
                };
                run.series.record(&report.stats, now, preemptions);
                // Signs of life are wall time, also in an ordered run.
                ports
                    .progress
                    .iteration_done(iterations, ports.clock.now_ns());
                if let Some(status) = publisher
                    .as_mut()
                    .and_then(|p| p.after_iteration(server, exec))
                {
                    // Only metrics depend on it: a front that cannot take it loses
                    // nothing that matters.
                    let _ = ports
                        .net
                        .send(Endpoint::Front, Envelope::Status(Box::new(status)));
                }
                if opts.time_iterations {
                    run.iteration_times.push(iteration_started.elapsed());
                }
                iteration_started = Instant::now();
                if opts.max_iterations.is_some_and(|m| iterations >= m) {
                    break;
                }
            }
            Io::Finished => {
                if let Some((reason, state)) = exec.stalled_out() {
                    run.ending = RankEnding::StalledOut {
                        reason: reason.to_string(),
                        state: state.to_string(),
                    };
                }
                break;
            }
            Io::Stopped(why) => {
                run.ending = match why {
                    StopReason::Crashed(v) => {
                        run.violation_count += 1;
                        if run.violations.len() < 100 {
                            run.violations.push(v.clone());
                        }
                        RankEnding::Crashed(v.clone())
                    }
                    StopReason::PeerCrashed { peer } => RankEnding::PeerCrashed { peer: peer.0 },
                };
                break;
            }
        }
    }
    Ok(run)
}

/// Rank 0 reads its ingress as the executor's mode says: what has arrived goes to the
/// rank host, and while it says to wait, the loop blocks on the ingress in slices,
/// keeping the group alive between them.
fn read_ingress<C: Collective + ?Sized>(
    ports: &mut RankPorts<'_>,
    host: &mut RankHost,
    coll: &mut C,
    mode: FetchMode,
    opts: &RankOptions,
) -> FetchBatch {
    let clock = ports.clock;
    let Some(ingress) = ports.ingress.as_deref_mut() else {
        // Only rank 0 reads the ingress; the others' reads are empty.
        return FetchBatch {
            now_ns: clock.now_ns(),
            ..FetchBatch::default()
        };
    };
    let drain = |ingress: &mut dyn Inbox<IngressItem>, host: &mut RankHost| {
        while let Some(item) = ingress.try_recv() {
            host.deliver([item]);
        }
    };
    drain(ingress, host);
    let stall_ends_at = match host.read(mode, clock.now_ns()) {
        Read::Fetch(batch) => return batch,
        Read::Wait { stall_ends_at } => stall_ends_at,
    };
    loop {
        let slice = clock
            .now_ns()
            .saturating_add(opts.keep_alive_every.as_nanos() as u64);
        let until = stall_ends_at.map_or(slice, |b| b.min(slice));
        match ingress.recv_until(Some(clock.instant(until))) {
            Received::Message(item) => {
                host.deliver([item]);
                drain(ingress, host);
            }
            // Nothing will ever come: behave as a shutdown.
            Received::Closed => host.close(),
            Received::TimedOut => {}
        }
        if let Some(batch) = host.poll_wait(clock.now_ns()) {
            return batch;
        }
        coll.keep_alive();
        ports.progress.alive(clock.now_ns());
    }
}

/// Ordered: rank 0's iteration reaches its process point at `at`: it ends its
/// server's turn and waits for the next, which comes there.
fn wait_for_process_point(
    sequencer: &dyn Order,
    server: usize,
    at: u64,
) -> Result<(), RuntimeError> {
    sequencer.end_server(server, ServerNext::Busy(at));
    loop {
        match sequencer.wait_turn(Party::Server(server as u32), None)? {
            Turn::Granted(_) => return Ok(()),
            other => tracing::warn!(server, ?other, "a busy server's turn, unexpectedly"),
        }
    }
}

/// Ordered: a rank's transfer commands go to its transceiver, which runs them in this
/// instant's transceiver phase.
fn post_commands(
    sequencer: &dyn Order,
    server: usize,
    rank: usize,
    commands: &[lockstep_actors::vocab::TransferCommand],
) {
    let me = sequencer.transceiver(lockstep_actors::vocab::KvAddress {
        server: server as u32,
        rank: lockstep_actors::ids::RankId(rank as u32),
    });
    for c in commands {
        // A transceiver that left has nothing to do with it.
        let _ = sequencer.post(
            me,
            0,
            (Phase::Process, server as u32),
            Item::Command(c.clone()),
        );
    }
}

/// Ordered: rank 0 reads its ingress in its server's turn. A read at a process point
/// sees what arrived before that instant; if it must wait, the turn ends, and the next
/// comes with an input (which sees everything that arrived in its instant), with the
/// stall bound, or when nothing in the run could end the wait (a stall-out).
fn read_ingress_ordered<C: Collective + ?Sized>(
    ports: &mut RankPorts<'_>,
    sequencer: &dyn Order,
    host: &mut RankHost,
    coll: &mut C,
    mode: FetchMode,
    opts: &RankOptions,
) -> Result<FetchBatch, RuntimeError> {
    let server = ports.server;
    let me = Party::Server(server as u32);
    let deliver = |host: &mut RankHost, items: Vec<Item>| {
        for item in items {
            if let Item::Ingress(items) = item {
                host.deliver(items);
            }
        }
    };
    if ports.ingress.is_none() {
        // Only rank 0 reads the ingress.
        return Ok(FetchBatch {
            now_ns: host.fetched_at(),
            ..FetchBatch::default()
        });
    }
    if !sequencer.holds(me) {
        // The first read, at the run's start: in the server's first turn.
        wait_for_process_point(sequencer, server, 0)?;
    }
    let now = sequencer.now();
    deliver(host, sequencer.take(me, now, false));
    let stall_ends_at = match host.read(mode, now) {
        Read::Fetch(batch) => return Ok(batch),
        Read::Wait { stall_ends_at } => stall_ends_at,
    };
    sequencer.end_server(server, ServerNext::Waiting { stall_ends_at });
    loop {
        match sequencer.wait_turn(me, Some(opts.keep_alive_every))? {
            Turn::Slice => {
                coll.keep_alive();
                ports.progress.alive(ports.clock.now_ns());
            }
            Turn::Granted(at) => {
                deliver(host, sequencer.take(me, at, true));
                if let Some(batch) = host.poll_wait(at) {
                    return Ok(batch);
                }
                sequencer.end_server(server, ServerNext::Waiting { stall_ends_at });
            }
            Turn::StallOut(at) => {
                if let Some(batch) = host.stall_out(at, "no event can make progress".into()) {
                    return Ok(batch);
                }
            }
            Turn::Quiet | Turn::Gone => {
                // Nothing will ever come: behave as a shutdown.
                host.close();
                if let Some(batch) = host.poll_wait(sequencer.now()) {
                    return Ok(batch);
                }
            }
        }
    }
}
