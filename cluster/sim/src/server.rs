//! One simulated server: its ranks stepped through the iteration protocol in one thread
//! ([`ServerGroup`], the collectives computed in place), rank 0's host policy
//! ([`RankHost`], which every driver runs: ingress into fetches, the stall bound, the
//! forward's launch time), its ranks' transceivers, the device time model, and the
//! accumulators its report needs.
//!
//! Time, as the real drivers spend it ([`RankHost`] says when a batch launches): the
//! device runs forwards one at a time in launch order ([`Device`]); the update happens
//! when the awaited output is ready (this batch's without overlap, the previous one's
//! with it) and the host step is done — that instant is when responses and KV sends
//! leave the ranks, in every driver alike.

use lockstep_actors::config::Role;
use lockstep_actors::executor::{FetchBatch, FetchMode};
use lockstep_actors::group::{GroupError, GroupNeed, ServerGroup, TokenSource};
use lockstep_actors::ids::BatchNumber;
use lockstep_actors::invariants::Violation;
use lockstep_gpu::AnalyticBackend;
use lockstep_hosts::rank_host::{RankHost, Read};
use lockstep_hosts::transceiver_host::TransceiverHost;

use lockstep_plan::fleet::PlannedServer;
use lockstep_plan::report::series::Sampler;
use lockstep_plan::report::{RankEnding, RankSummary, ServerReport, server_report};

use super::iterlog::IterLogLine;

/// What a server is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerState {
    /// Rank 0 waits for an input (idle, or stalled: its last iteration changed nothing).
    Waiting {
        /// The stall bound applies (work remains, nothing in flight).
        bounded: bool,
    },
    /// An iteration runs until its process point.
    Busy,
    /// Drained (or stopped): it will not iterate again.
    Done,
}

/// What an iteration step asks of the event loop.
#[derive(Debug)]
pub enum Step {
    /// Rank 0 waits for an input.
    Waiting {
        /// When the wait ends as deadlocked, if the stall bound applies.
        stall_ends_at: Option<u64>,
    },
    /// The iteration's process point is at this time.
    ProcessAt(u64),
    /// The iteration ended (reports and responses are ready); the next one opens now.
    Ended,
    /// The server drained.
    Finished,
    /// A fatal violation stopped it: a rank's own, or a peer's that this group could not
    /// read (named as such, never dressed up as a violation).
    Crashed(lockstep_actors::executor::StopReason),
}

/// A pending timer: when it fires, and its event's sequence number.
pub type TimerAt = (u64, u64);

/// One simulated server.
pub struct SimServer {
    pub name: String,
    pub role: Role,
    pub max_batch_size: u32,
    pub group: ServerGroup,
    /// Rank 0's host policy: the server's ingress, the stall bound, the launch time.
    pub host: RankHost,
    /// Per rank (ctx and gen servers): the transceiver and its timer.
    pub transceivers: Vec<Option<(TransceiverHost, Option<TimerAt>)>>,
    pub state: ServerState,
    /// The waiting read's stall-bound event.
    pub stall_timer: Option<u64>,
    /// Rank 0's read taken when the server tried to coast and the fetch was not empty:
    /// the next iteration's fetch.
    pending_read: Option<FetchBatch>,
    next_forward: u64,
    /// The running iteration's host and device time.
    current: (u64, u64),
    tokens: Box<dyn TokenSource>,
    iterations: u64,
    busy_ns: u64,
    violations: Vec<Violation>,
    violation_count: u64,
    /// Per rank: samples for the time series.
    samplers: Vec<Sampler>,
    pub log_enabled: bool,
}

impl SimServer {
    pub fn new(
        planned: &PlannedServer<'_>,
        policy: lockstep_actors::policy::Policy,
        tokens: Box<dyn TokenSource>,
    ) -> Result<SimServer, lockstep_actors::config::ConfigError> {
        let mut group = ServerGroup::new(planned.config, policy)?;
        // A real model reads each launched batch's block tables and prompts.
        group.set_forward_inputs(tokens.reads_forward_inputs());
        let dp = planned.sizes.dp as usize;
        Ok(SimServer {
            name: planned.config.name.clone(),
            role: planned.config.role,
            max_batch_size: planned.sizes.max_batch_size,
            group,
            host: RankHost::new(u64::MAX, 1.0),
            transceivers: (0..dp).map(|_| None).collect(),
            state: ServerState::Busy,
            stall_timer: None,
            pending_read: None,
            next_forward: 0,
            current: (0, 0),
            tokens,
            iterations: 0,
            busy_ns: 0,
            violations: Vec::new(),
            violation_count: 0,
            samplers: vec![Sampler::default(); dp],
            log_enabled: false,
        })
    }

    /// Runs the protocol until the server needs time to pass or an input: at the
    /// ingress read, a waiting rank 0 with nothing queued stops there.
    pub fn step(&mut self, now: u64, backend: &AnalyticBackend) -> Result<Step, GroupError> {
        // Cheap when debug is off: the level is checked once per call site.
        let _span = tracing::debug_span!("server", name = %self.name).entered();
        loop {
            match self.group.advance()? {
                GroupNeed::ReadIngress(mode) => match self.pending_read.take() {
                    Some(batch) => {
                        // Read in this mode already (a server coasts only when it polls).
                        debug_assert_eq!(mode, FetchMode::Poll);
                        self.begin(now, batch)?
                    }
                    None => match self.host.read(mode, now) {
                        Read::Fetch(batch) => self.begin(now, batch)?,
                        Read::Wait { stall_ends_at } => {
                            self.state = ServerState::Waiting {
                                bounded: stall_ends_at.is_some(),
                            };
                            return Ok(Step::Waiting { stall_ends_at });
                        }
                    },
                },
                GroupNeed::Forward { forward_ran } => {
                    let at = self.time_forward(forward_ran, backend);
                    self.group.sample_launched(self.tokens.as_mut())?;
                    self.state = ServerState::Busy;
                    return Ok(Step::ProcessAt(at));
                }
                GroupNeed::IterationEnded => return Ok(Step::Ended),
                GroupNeed::Finished => {
                    self.state = ServerState::Done;
                    return Ok(Step::Finished);
                }
                GroupNeed::Stopped(why) => {
                    self.state = ServerState::Done;
                    return Ok(Step::Crashed(why));
                }
            }
        }
    }

    /// A waiting rank 0's read ends: with what came, or with a stall-out once the
    /// bound passed (`stalled_out` forces one: no event is left that could end the
    /// wait). Whether it ended.
    pub fn resume(&mut self, now: u64, stalled_out: Option<String>) -> Result<bool, GroupError> {
        let batch = match stalled_out {
            Some(reason) => self.host.stall_out(now, reason),
            None => self.host.poll_wait(now),
        };
        match batch {
            Some(batch) => self.begin(now, batch).map(|()| true),
            None => Ok(false),
        }
    }

    /// The iteration starts with its fetch.
    fn begin(&mut self, now: u64, batch: FetchBatch) -> Result<(), GroupError> {
        self.state = ServerState::Busy;
        self.host.fetched(now);
        self.current = (0, 0);
        self.group.provide_ingress(batch)
    }

    /// The forward step's times: returns the process point.
    fn time_forward(&mut self, forward_ran: bool, backend: &AnalyticBackend) -> u64 {
        let awaited = self.group.awaited()[0];
        self.time_forward_awaiting(forward_ran, awaited, backend)
    }

    /// [`SimServer::time_forward`] for an iteration that awaits `awaited`.
    fn time_forward_awaiting(
        &mut self,
        forward_ran: bool,
        awaited: Option<BatchNumber>,
        backend: &AnalyticBackend,
    ) -> u64 {
        // Every rank's shape came with its vote: the time every driver computes.
        let time = self
            .host
            .forward_times(backend, self.group.shapes(), forward_ran);
        let launched = forward_ran.then(|| {
            self.next_forward += 1;
            BatchNumber(self.next_forward - 1)
        });
        self.current = (time.host_ns, time.forward_ns);
        // Every rank awaits the same batch (they launch in lockstep).
        self.host.process_point(&time, launched, awaited)
    }

    /// The process point: hand the outputs back and finish the iteration.
    pub fn process(&mut self, now: u64) -> Result<Step, GroupError> {
        self.group.provide_outputs()?;
        match self.group.advance()? {
            GroupNeed::IterationEnded => {}
            other => unreachable!("an iteration ends after its outputs, got {other:?}"),
        }
        self.record_iteration(now);
        Ok(Step::Ended)
    }

    /// The accounting of an iteration that ended at `now`: its time, every rank's
    /// samples and violations.
    fn record_iteration(&mut self, now: u64) {
        self.count_iteration(self.host.fetched_at(), now);
        for ((report, rank), sampler) in self
            .group
            .reports()
            .zip(self.group.ranks())
            .zip(&mut self.samplers)
        {
            sampler.record(&report.stats, now, rank.totals().preemptions);
        }
        self.note_violations();
    }

    /// Every rank's violations of the iteration (or stretch) that ended, kept for the
    /// report (the first 100, and how many).
    fn note_violations(&mut self) {
        for report in self.group.reports() {
            for v in &report.violations {
                self.violation_count += 1;
                if self.violations.len() < 100 {
                    self.violations.push(v.clone());
                }
            }
        }
    }

    /// An iteration fetched at `fetch_at` ended at `at`: counted, and its time busy (the
    /// server's busy time is every iteration's, fetch to end).
    fn count_iteration(&mut self, fetch_at: u64, at: u64) {
        self.iterations += 1;
        self.busy_ns += at.saturating_sub(fetch_at);
    }

    /// Reads rank 0's ingress as a coasting server's fetch at `now` (it polls): whether
    /// the read is empty, and a shutdown it brings. A read with anything in it is kept
    /// for the next iteration's fetch, which then runs in full.
    pub fn coast_read(&mut self, now: u64) -> Option<bool> {
        if self.pending_read.is_some() {
            return None;
        }
        let Read::Fetch(batch) = self.host.read(FetchMode::Poll, now) else {
            unreachable!("a poll never waits")
        };
        let empty = batch.requests.is_empty()
            && batch.cancellations.is_empty()
            && batch.peers_ready.is_empty()
            && batch.stalled_out.is_none();
        if empty {
            Some(batch.shutdown)
        } else {
            self.pending_read = Some(batch);
            None
        }
    }

    /// One coasted iteration (the group's `coast`), fetched at `fetch_at` with the
    /// read's `shutdown`, timed as every iteration is: when it ends.
    pub fn coast_iteration(
        &mut self,
        fetch_at: u64,
        shutdown: bool,
        backend: &AnalyticBackend,
    ) -> Result<u64, GroupError> {
        self.state = ServerState::Busy;
        self.host.fetched(fetch_at);
        self.group.coast_launch(fetch_at, shutdown);
        let at = self.time_forward(true, backend);
        self.group.sample_launched(self.tokens.as_mut())?;
        self.group.coast_land(fetch_at);
        self.record_iteration(at);
        Ok(at)
    }

    /// Plans a stretch of coasted iterations in closed form, after the group's
    /// `coast_begin` (the sim's `coast.rs`): whether the token source and every rank
    /// allow it.
    pub fn stretch_begin(&mut self) -> bool {
        self.tokens.pure_token().is_some() && self.group.stretch_begin()
    }

    /// The stretch's `step`-th iteration, fetched at `fetch_at`, timed as every
    /// iteration is (from the plan's shapes): when it ends.
    pub fn stretch_time(&mut self, fetch_at: u64, step: u32, backend: &AnalyticBackend) -> u64 {
        self.state = ServerState::Busy;
        self.host.fetched(fetch_at);
        self.group.stretch_shapes(step);
        let awaited = self.group.stretch_awaited(step);
        self.time_forward_awaiting(true, awaited, backend)
    }

    /// The accounting of the stretch's `step`-th iteration, fetched at `fetch_at` and
    /// ended at `at`, as [`SimServer::record_iteration`] does it for the others.
    pub fn stretch_record(&mut self, step: u32, fetch_at: u64, at: u64) {
        self.count_iteration(fetch_at, at);
        for (i, sampler) in self.samplers.iter_mut().enumerate() {
            let (stats, rank) = self.group.stretch_stats(i, step, fetch_at);
            sampler.record(stats, at, rank.totals().preemptions);
        }
    }

    /// Applies the stretch's first `steps` iterations (the last fetched at
    /// `last_fetch`), their tokens into `run`.
    pub fn stretch_apply(
        &mut self,
        steps: u32,
        last_fetch: u64,
        shutdown: bool,
        run: &mut lockstep_actors::vocab::TokenRun,
    ) -> Result<(), GroupError> {
        self.group
            .stretch_apply(steps, last_fetch, shutdown, self.tokens.as_mut(), run)?;
        // The pool's check ran once, at the end: what it found is reported as any
        // iteration's (the next iteration's record replaces it).
        self.note_violations();
        Ok(())
    }

    /// The stretch's last iteration, timed already ([`SimServer::stretch_time`]:
    /// fetched at `fetch_at`, ended at `at`), run as a coasted iteration is.
    pub fn stretch_last(
        &mut self,
        step: u32,
        fetch_at: u64,
        at: u64,
        shutdown: bool,
    ) -> Result<(), GroupError> {
        self.group.coast_launch(fetch_at, shutdown);
        debug_assert!(
            self.group.stretch_planned_shapes(step),
            "server `{}`: the plan's shapes differ from the launched batches'",
            self.name
        );
        self.group.sample_launched(self.tokens.as_mut())?;
        self.group.coast_land(fetch_at);
        self.record_iteration(at);
        Ok(())
    }

    /// The iteration log's lines for the iteration that ended.
    pub fn log_lines(&self) -> Vec<IterLogLine> {
        let (host_ns, device_ns) = self.current;
        let t0 = self.host.fetched_at();
        self.group
            .reports()
            .map(|r| IterLogLine::new(&self.name, t0, host_ns, device_ns, &r.stats))
            .collect()
    }

    /// One line per rank for a deadlock report.
    pub fn describe(&self) -> String {
        let ranks: Vec<String> = self.group.ranks().iter().map(|r| r.describe()).collect();
        format!(
            "server `{}` ({:?}): {}",
            self.name,
            self.state,
            ranks.join(", ")
        )
    }

    /// The server's section of the report.
    pub fn report(&self) -> ServerReport {
        let summaries: Vec<RankSummary> = self
            .group
            .ranks()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let ending = match r.stalled_out() {
                    Some((reason, state)) => RankEnding::StalledOut {
                        reason: reason.to_string(),
                        state: state.to_string(),
                    },
                    None => RankEnding::Drained,
                };
                // Server-wide violations are collected once, below.
                let mut s = RankSummary::of(0, r, Vec::new(), 0, ending);
                if let Some((t, _)) = &self.transceivers[i] {
                    let end = t.end();
                    s.transfers = end.stats;
                    s.lost = end.lost;
                }
                s.series = self.samplers[i].clone().into_points();
                s
            })
            .collect();
        let mut report = server_report(
            &self.name,
            self.role,
            self.max_batch_size,
            &summaries,
            self.busy_ns as f64 / 1e9,
        );
        report.violations = self.violations.clone();
        report.violation_count = self.violation_count;
        report
    }

    /// Each first scheduling on any rank: (request id, virtual ns).
    pub fn first_scheduled(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.group
            .ranks()
            .iter()
            .flat_map(|r| r.first_scheduled().iter().map(|&(id, ns)| (id.0, ns)))
    }

    /// Every rank's ending (for the run's outcome).
    pub fn endings(&self, server: usize) -> Vec<RankSummary> {
        self.group
            .ranks()
            .iter()
            .filter_map(|r| {
                let (reason, state) = r.stalled_out()?;
                Some(RankSummary::of(
                    server,
                    r,
                    Vec::new(),
                    0,
                    RankEnding::StalledOut {
                        reason: reason.to_string(),
                        state: state.to_string(),
                    },
                ))
            })
            .collect()
    }
}
