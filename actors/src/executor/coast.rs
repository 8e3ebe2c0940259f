//! Coasting: an iteration of steady decode taken without the protocol's collectives,
//! for a host that holds every rank of a server in one thread (the simulator).
//!
//! In steady decode every rank holds only requests generating one token each, nothing
//! arrives, transfers or pads, the fetch reads nothing, and admission pops nothing (the
//! queue is empty or the fleet is full). Every replicated decision of the iteration's
//! first half is then known without running it: rank 0 polls, nothing is admitted or
//! routed, `expected` is the router's answer for no new
//! request, no rank pads, the capacity and micro-batch schedulers take every request as
//! one generation step. What is left is each request's step: its entry
//! ([`RankExecutor::prepare_entry`], which takes a new KV block where the step needs
//! one), the forward's effects ([`RankExecutor::process_output`]) and the pool's check.
//! Both are the protocol's own code, so a coasted iteration changes the rank exactly as
//! the protocol would.
//!
//! The conditions are checked before a server coasts ([`RankExecutor::coast_ready`],
//! [`RankExecutor::coast_expected`], [`RankExecutor::coast_limit`], and the group's
//! checks across ranks); each coasted iteration then checks that its new blocks are
//! free and that the capacity scheduler takes every request
//! ([`RankExecutor::coast_step_fits`]). Whatever breaks them — a request's last token,
//! an arrival, a transfer — is an iteration the protocol runs in full.

use crate::config::{CapacitySchedulerPolicy, Role};
use crate::counts::RankCounts;
use crate::ids::BatchNumber;
use crate::invariants::Violation;
use crate::padding::pad_need;
use crate::request::RequestState;
use crate::router::{RankLoad, RouteInput};
use crate::scheduler::EntryKind;

use super::messages::*;
use super::protocol::Stage;
use super::{BatchShape, IterationStats, RankExecutor};
use crate::vocab::*;

/// One generation step: the only entry a coasted iteration schedules.
const STEP: EntryKind = EntryKind::Generation { tokens: 1 };

/// Whether a coasted iteration steps `q`: a request in progress. The other request a
/// coasting rank may hold, a retiring one (its last token in flight), is not scheduled.
pub(super) fn coast_steps(q: &crate::request::Request) -> bool {
    q.state == RequestState::GenerationInProgress
}

impl RankExecutor {
    /// Whether this rank, between iterations, is in steady decode as far as its own
    /// state goes: every request it holds generates one token per iteration with its
    /// seat and KV, nothing else is resident, pending or carried, and the last
    /// iteration left no violation or transfer behind (what waits in the queue is the
    /// group's to judge: [`RankExecutor::coast_expected`]). Under overlap the batch in
    /// flight is one step of every request, in order, and a request may be retiring:
    /// its last token is in that batch, so this iteration schedules the others and ends
    /// it ([`RankExecutor::coast_limit`] makes that iteration the stretch's last).
    pub fn coast_ready(&self) -> bool {
        let r = &self.resident;
        let s = &self.setup.sizes;
        let n = r.active.len();
        let scheduled = self.coast_scheduled();
        let fits = scheduled > 0
            && scheduled <= s.max_batch_size as usize
            && scheduled <= s.max_num_tokens as usize
            && n <= s.max_admitted_per_rank as usize;
        let quiet = matches!(self.stage, Stage::Open)
            && self.setup.role != Role::Ctx
            && self.stop.is_none()
            && self.replicated.stalled_out.is_none()
            && self.carried_responses.is_empty()
            && self.pending_transfer_events.is_empty()
            && r.dummy.is_none()
            && r.sending.is_empty()
            && self.balance.is_none()
            && !self.setup.forward_inputs
            && self.report.violations.is_empty()
            && self.report.transfer_commands.is_empty();
        if !(fits && quiet) {
            return false;
        }
        let steady = r.active.iter().all(|q| {
            (coast_steps(q) || (s.overlap && q.state == RequestState::GenerationToComplete))
                && q.seat.is_some()
                && q.holds_kv
                && !q.awaiting_encoder_output
                && !q.is_dummy
                && q.spec.draft_len == 0
        });
        let in_flight = match &r.in_flight {
            None => !s.overlap,
            Some(b) => {
                s.overlap
                    && b.entries.len() == n
                    && b.entries.iter().zip(&r.active).all(|(e, q)| {
                        e.seq == q.seq
                            && !e.is_dummy
                            && e.kind == ForwardKind::Generation { tokens: 1 }
                    })
            }
        };
        steady && in_flight
    }

    /// The requests a coasted iteration schedules: those in progress (not a retiring
    /// one, whose last token is in flight).
    pub fn coast_scheduled(&self) -> usize {
        self.resident
            .active
            .iter()
            .filter(|q| coast_steps(q))
            .count()
    }

    /// Whether a request here is retiring (its last token in flight, under overlap).
    fn coast_retiring(&self) -> bool {
        self.resident
            .active
            .iter()
            .any(|q| q.state == RequestState::GenerationToComplete)
    }

    /// Iterations this rank can coast, the last one the first in which one of its
    /// requests ends or turns retiring: without overlap a request's last token ends it;
    /// with overlap the in-flight token comes first and the launch of the last token
    /// makes it retiring. That iteration is still steady when it starts (its first
    /// half is every coasted iteration's), and its second half is the protocol's own
    /// `process_output`, which ends the request or makes it retiring; after it the
    /// server is no longer steady.
    ///
    /// A retiring request ends in the first coasted iteration, which changes what the
    /// next one would gather: that iteration is the stretch's only one.
    pub fn coast_limit(&self) -> u64 {
        let ahead = if self.setup.sizes.overlap { 2 } else { 1 };
        let limit = self
            .resident
            .active
            .iter()
            .filter(|q| coast_steps(q))
            .map(|q| {
                let left = self.effective_max_new(q).saturating_sub(q.generated);
                u64::from((left + 1).saturating_sub(ahead))
            })
            .min()
            .unwrap_or(0);
        if self.coast_retiring() {
            limit.min(1)
        } else {
            limit
        }
    }

    /// The iteration's replicated decisions as the first half would take them from the
    /// gathered `states` (every rank's, in rank order) and the global pad intent: the
    /// `expected` of routing no request, if admission pops nothing, the cap check
    /// passes and this rank needs no dummy; `None` otherwise.
    pub fn coast_expected(&mut self, states: &[RankState], global: PadIntent) -> Option<u32> {
        let loads: Vec<RankLoad> = states
            .iter()
            .map(|s| RankLoad {
                requests: s.counts.routable,
                prompt_tokens: s.counts.routable_prompt_tokens,
            })
            .collect();
        let assignment = self.router.route(RouteInput {
            loads: &loads,
            new: &[],
            max_per_rank: self.setup.sizes.max_admitted_per_rank,
            prefix_matches: None,
        });
        // Admission pops nothing: the queue is empty, or the fleet's routable requests
        // fill its capacity (§3.3).
        let routable: u64 = states.iter().map(|s| u64::from(s.counts.routable)).sum();
        if !self.replicated.waiting.is_empty() && routable < u64::from(self.setup.sizes.capacity) {
            return None;
        }
        let counts = states.get(self.rank.index())?.counts;
        let admission_count = if self.setup.policy.admission.charge_retiring {
            self.resident.active.len() as u32
        } else {
            counts.routable
        };
        let pad = pad_need(
            self.setup.pad_path,
            assignment.expected,
            counts.pad_schedulable,
            global,
            self.setup.role == Role::Ctx,
        );
        (assignment.violation.is_none() && admission_count <= assignment.expected && pad.is_none())
            .then_some(assignment.expected)
    }

    /// Rank 0's read mode, as the gather of `states` (every rank's
    /// [`RankExecutor::gather_state`]) decides it: a server coasts only when it polls.
    pub fn coast_fetch_mode(&self, states: &[RankState]) -> FetchMode {
        self.fetch_mode(states)
    }

    /// This rank's forward intent, as the pad-intent allreduce takes it (`None` where
    /// the server's path has no such allreduce).
    pub fn coast_intent(&self) -> PadIntent {
        if self.setup.schedule.pad_intent {
            self.local_intent()
        } else {
            PadIntent::None
        }
    }

    /// Starts coasting: the record every coasted iteration reports (its iteration and
    /// start set per iteration), from this rank's `counts`, the `expected` of
    /// [`RankExecutor::coast_expected`], and every rank's tokens per forward.
    pub fn coast_begin(&mut self, counts: RankCounts, expected: u32, rank_tokens: &[u32]) {
        let n = self.coast_scheduled() as u32;
        self.report.stats = IterationStats {
            iteration: self.iteration,
            rank: self.rank,
            started_ns: 0,
            forward_ran: true,
            num_scheduled_requests: n,
            num_ctx_requests: 0,
            num_ctx_tokens: 0,
            num_gen_requests: n,
            num_dummies: 0,
            counts,
            expected,
            kv_blocks_used: self.kv.used_blocks(),
            kv_blocks_free: self.kv.free_blocks(),
            seats_used: self.seats.used(),
            routed_to_rank: self.resident.routed_here,
            routed_total: self.replicated.routed_total,
            waiting: self.replicated.waiting.len() as u32,
            progressed: true,
            num_tokens: n,
            max_rank_tokens: rank_tokens.iter().copied().max().unwrap_or(0),
            total_rank_tokens: rank_tokens.iter().map(|&t| u64::from(t)).sum(),
            dp_ranks: rank_tokens.len() as u32,
            ..IterationStats::default()
        };
    }

    /// Whether the next coasted iteration's steps fit: the KV blocks it takes (one for
    /// each request whose step crosses a block boundary) are free, and under
    /// MAX_UTILIZATION, whose decision depends on the pool, the capacity scheduler itself
    /// takes every request and pauses none.
    pub fn coast_step_fits(&mut self) -> bool {
        let crossing = self
            .resident
            .active
            .iter()
            .filter(|q| coast_steps(q) && q.kv_tokens + 1 > q.kv_room)
            .count();
        if crossing as u64 > u64::from(self.kv.free_blocks()) {
            return false;
        }
        let retiring = self.coast_retiring();
        if self.capacity.policy() != CapacitySchedulerPolicy::MaxUtilization && !retiring {
            // GUARANTEED_NO_EVICT and STATIC_BATCH take every request in progress up to
            // the cap (`coast_ready`), whatever the pool holds; a retiring request may
            // take a slot off the cap (legacy `admission.charge_retiring`), so then the
            // scheduler itself is asked.
            return true;
        }
        let scheduled = self.coast_scheduled();
        let (classes, out) = (&mut self.bufs.classes, &mut self.bufs.capacity);
        self.capacity
            .schedule_with(&self.resident.active, &self.kv, classes, out);
        out.paused.is_empty() && out.disagg_gen_init.is_empty() && out.fitting.len() == scheduled
    }

    /// A coasted iteration's first half at `now_ns`, whose fetch read nothing but maybe
    /// the `shutdown`: every request's step scheduled and launched; the batch's shape
    /// for the cost model.
    pub fn coast_launch(&mut self, now_ns: u64, shutdown: bool) -> BatchShape {
        self.replicated.shutdown |= shutdown;
        let it = &mut self.iter;
        it.now_ns = now_ns;
        it.progressed = false;
        it.deferred = false;
        it.violations.clear();
        it.responses.rank = self.rank;
        it.responses.responses.clear();
        let mut batch = self.bufs.batch();
        batch.entries.reserve(self.resident.active.len());
        for i in 0..self.resident.active.len() {
            if !coast_steps(&self.resident.active[i]) {
                // Retiring: its last token is in flight.
                continue;
            }
            let entry = self.prepare_entry(i, STEP);
            debug_assert!(entry.is_some(), "a coasted step was deferred");
            if let Some(e) = entry {
                batch.entries.push(e);
            }
        }
        batch.number = BatchNumber(self.resident.next_batch);
        batch.rank = self.rank;
        let n = batch.entries.len() as u32;
        // What the vote records (`record_scheduled`) and the forward's accounting reads.
        let s = &mut self.iter.stats;
        s.num_scheduled_requests = n;
        s.num_ctx_tokens = 0;
        s.num_dummies = 0;
        self.totals.iteration_scheduled_requests += u64::from(n);
        self.resident.next_batch += 1;
        let shape = BatchShape::of(&batch);
        self.iter.awaited = if self.setup.sizes.overlap {
            self.resident.in_flight.as_ref().map(|b| b.number)
        } else {
            Some(batch.number)
        };
        self.iter.launched = Some(batch);
        shape
    }

    /// The output a coasted iteration awaits.
    pub fn coast_awaited(&self) -> Option<BatchNumber> {
        self.iter.awaited
    }

    /// A coasted iteration's second half: the awaited `output` applied as the forward
    /// step applies it, the pool checked, the iteration's record (started at
    /// `started_ns`) and responses out.
    pub fn coast_land(&mut self, output: Option<&ForwardOutput>, started_ns: u64) {
        self.process_output(output);
        self.check_kv();
        let report = &mut self.report;
        report.stats.iteration = self.iteration;
        report.stats.started_ns = started_ns;
        report.stats.kv_blocks_used = self.kv.used_blocks();
        report.stats.kv_blocks_free = self.kv.free_blocks();
        report.stats.progressed = self.iter.progressed;
        report.violations.clear();
        std::mem::swap(&mut report.violations, &mut self.iter.violations);
        self.progressed_last = self.iter.progressed;
        self.totals.iterations += 1;
        self.iteration += 1;
    }

    /// The responses of the coasted iteration that ended, moved out.
    pub fn coast_responses(&mut self) -> &mut Vec<Response> {
        &mut self.iter.responses.responses
    }

    /// The violations of the last iteration (a coasted one's pool check).
    pub fn last_violations(&self) -> &[Violation] {
        &self.report.violations
    }
}
