//! The phase methods of one iteration (§3), in call order.

use std::collections::BTreeSet;

use crate::config::Role;
use crate::counts::RankCounts;
use crate::ids::{BatchNumber, ReqId};
use crate::invariants::{InvariantKind, Violation};
use crate::kv::KvError;
use crate::padding::{DummyKind, PadPath, TentativeDummy, pad_need};
use crate::request::{Request, RequestSpec, RequestState};
use crate::router::{RankLoad, RouteInput};
use crate::scheduler::EntryKind;

use super::messages::*;
use super::stats::{IterationReport, IterationStats};
use super::{
    AwaitFetch, AwaitForward, AwaitPadIntent, AwaitPrefixMatches, AwaitTransferResult,
    AwaitTransfers, AwaitVote, ExecutorError, RankExecutor,
};

impl RankExecutor {
    /// Phase 1: this rank's contribution to the gather (§3.1).
    pub fn begin_iteration(&mut self) -> (AwaitFetch, RankState) {
        // A fresh scratch, field by field, so its buffers keep their capacity.
        let s = &mut self.scratch;
        s.loads.clear();
        s.popped.clear();
        s.expected = 0;
        s.counts = RankCounts::default();
        s.tentative = None;
        for b in [s.batch.take(), s.launched.take()].into_iter().flatten() {
            self.bufs.recycle(b);
        }
        s.awaited = None;
        s.stats = IterationStats {
            iteration: self.iteration,
            rank: self.rank,
            ..IterationStats::default()
        };
        s.violations.clear();
        s.commands.clear();
        s.responses.clear();
        let responses_due = !self.carried_responses.is_empty();
        s.responses.append(&mut self.carried_responses);
        let counts = self.counts();
        self.scratch.gathered = Some((counts, self.active.len()));
        let state = RankState {
            rank: self.rank,
            counts,
            responses_due,
        };
        (
            AwaitFetch {
                iteration: self.iteration,
            },
            state,
        )
    }

    /// Phase 2, rank 0 only: the idle decision (§3.2). Block only when the global live
    /// count is zero, the waiting queue is empty and no shutdown was read: deciding from
    /// anything narrower (e.g. the routable count) deadlocks a closed-loop client, because
    /// retiring requests finish only when an iteration runs.
    pub fn fetch_mode(&self, gathered: &[RankState]) -> FetchMode {
        if gathered.iter().any(|s| s.responses_due) {
            // A failed request's response waits for this iteration's gather.
            return FetchMode::Poll;
        }
        let live: u64 = gathered.iter().map(|s| u64::from(s.counts.live)).sum();
        idle_decision(live, self.waiting.len(), self.shutdown)
    }

    /// Whether the whole server is done (decided from the gather, so every rank agrees
    /// at the same iteration): a shutdown was read, nothing is live or waiting, and no
    /// rank holds a response still to gather.
    pub fn server_drained(&self, gathered: &[RankState]) -> bool {
        self.shutdown
            && self.waiting.is_empty()
            && gathered
                .iter()
                .all(|s| s.counts.live == 0 && !s.responses_due)
    }

    /// Phase 2 result on every rank: append what rank 0 read to the replicated waiting
    /// queue, apply cancellations, admit FIFO within `capacity - Σ routable` (§3.3), and
    /// return this rank's prefix matches for the popped requests.
    pub fn on_fetch(
        &mut self,
        token: AwaitFetch,
        gathered: &[RankState],
        fetched: &FetchBatch,
    ) -> Result<(AwaitPrefixMatches, PrefixMatches), ExecutorError> {
        let dp = self.sizes.dp as usize;
        if gathered.len() != dp {
            return Err(ExecutorError::WrongArity {
                rank: self.rank,
                iteration: token.iteration,
                phase: Phase::Gather,
                got: gathered.len(),
                want: dp,
            });
        }
        self.shutdown |= fetched.shutdown;
        self.scratch.now_ns = fetched.now_ns;
        for &id in &fetched.cancellations {
            self.cancel(id);
        }
        for spec in &fetched.requests {
            match self.validate_request(spec) {
                Ok(()) => {
                    self.known_ids.insert(spec.id);
                    self.waiting.push_back(spec.clone());
                }
                Err(reason) => {
                    // Every rank drops it the same way; rank 0 alone answers.
                    if self.rank.0 == 0 {
                        self.scratch.responses.push(Response {
                            id: spec.id,
                            new_tokens: 0,
                            last_token: 0,
                            generated: 0,
                            finish: Some(Finish::Failed(reason)),
                        });
                        self.totals.failed += 1;
                    }
                }
            }
        }
        for &id in &fetched.peers_ready {
            self.peer_ready(id);
        }
        self.scratch.loads.clear();
        self.scratch.loads.extend(gathered.iter().map(|s| RankLoad {
            requests: s.counts.routable,
            prompt_tokens: s.counts.routable_prompt_tokens,
        }));
        self.admit();
        let matches = if self.router.needs_prefix_matches() {
            let kv = &self.kv;
            self.scratch
                .popped
                .iter()
                .map(|s| kv.longest_prefix_match(&s.block_hashes))
                .collect()
        } else {
            Vec::new()
        };
        Ok((
            AwaitPrefixMatches {
                iteration: token.iteration,
            },
            PrefixMatches { tokens: matches },
        ))
    }

    /// §3.3: pop FIFO while `Σ routable + popped < dp * M`; a request strictly pinned to
    /// a full rank is set aside with its order kept.
    fn admit(&mut self) {
        let m = self.sizes.max_admitted_per_rank;
        let routable: u64 = self
            .scratch
            .loads
            .iter()
            .map(|l| u64::from(l.requests))
            .sum();
        let max_new = u64::from(self.sizes.capacity).saturating_sub(routable);
        // Per-rank counts only matter for strict pins: built on the first one.
        let mut per_rank: Option<Vec<u32>> = None;
        let mut set_aside = Vec::new();
        let loads = &self.scratch.loads;
        let popped = &mut self.scratch.popped;
        popped.clear();
        while (popped.len() as u64) < max_new {
            let Some(spec) = self.waiting.pop_front() else {
                break;
            };
            match spec.pinned {
                Some(pin) if pin.strict => {
                    let per_rank =
                        per_rank.get_or_insert_with(|| loads.iter().map(|l| l.requests).collect());
                    let r = pin.rank.index();
                    if per_rank[r] >= m {
                        set_aside.push(spec);
                        continue;
                    }
                    per_rank[r] += 1;
                    popped.push(spec);
                }
                _ => popped.push(spec),
            }
        }
        for spec in set_aside.into_iter().rev() {
            self.waiting.push_front(spec);
        }
        self.scratch.stats.admitted_now = self.scratch.popped.len() as u32;
    }

    /// Phase 3: route the popped requests (every rank computes the same assignment and
    /// keeps its share), check the routing invariant and the cap (§10, before padding),
    /// and return this rank's forward intent for the non-overlap disaggregated path.
    pub fn on_prefix_matches(
        &mut self,
        token: AwaitPrefixMatches,
        all: &[PrefixMatches],
    ) -> Result<(AwaitPadIntent, PadIntent), ExecutorError> {
        let dp = self.sizes.dp as usize;
        if all.len() != dp {
            return Err(ExecutorError::WrongArity {
                rank: self.rank,
                iteration: token.iteration,
                phase: Phase::PrefixMatch,
                got: all.len(),
                want: dp,
            });
        }
        let n_new = self.scratch.popped.len();
        if self.router.needs_prefix_matches()
            && let Some(bad) = all.iter().find(|m| m.tokens.len() != n_new)
        {
            return Err(ExecutorError::WrongArity {
                rank: self.rank,
                iteration: token.iteration,
                phase: Phase::PrefixMatch,
                got: bad.tokens.len(),
                want: n_new,
            });
        }
        let by_prefix = self.router.needs_prefix_matches();
        let matches: Vec<Vec<u32>> = if by_prefix {
            all.iter().map(|m| m.tokens.clone()).collect()
        } else {
            Vec::new()
        };
        let assignment = self.router.route(RouteInput {
            loads: &self.scratch.loads,
            new: &self.scratch.popped,
            max_per_rank: self.sizes.max_admitted_per_rank,
            prefix_matches: by_prefix.then_some(&matches[..]),
        });
        // Out of the scratch while requests are pushed (that borrows all of `self`), then
        // back, empty, with its capacity.
        let mut popped = std::mem::take(&mut self.scratch.popped);
        if let Some(v) = &assignment.violation {
            self.violation(InvariantKind::Routing, v.to_string());
        }
        let arrival_state = match self.role {
            Role::Gen => RequestState::DisaggGenerationInit,
            Role::Ctx if self.generation_first => RequestState::DisaggContextWaitScheduler,
            Role::Agg | Role::Ctx => RequestState::ContextInit,
        };
        let mut routed_now = 0;
        for (spec, rank) in popped.drain(..).zip(&assignment.ranks) {
            // Replicated on every rank, whichever rank the request goes to.
            let peer_known = self.peer_known.remove(&spec.id);
            if *rank == self.rank {
                self.totals.routing_digest = crate::kv::mix(self.totals.routing_digest ^ spec.id.0);
                let state = if peer_known {
                    self.totals.generation_first_promoted += 1;
                    self.scratch.stats.generation_first_promoted += 1;
                    RequestState::ContextInit
                } else {
                    arrival_state
                };
                self.push_active(Request::new(spec, state));
                routed_now += 1;
            }
        }
        popped.clear();
        self.scratch.popped = popped;
        self.routed_total += n_new as u64;
        self.routed_to_rank += routed_now as u64;
        self.totals.routed_requests += routed_now as u64;
        self.scratch.expected = assignment.expected;
        let counts = match self.scratch.gathered.take() {
            Some((at_gather, n)) if n <= self.active.len() => at_gather.plus(RankCounts::of(
                &self.active[n..],
                &self.window,
                &self.policy,
            )),
            _ => self.counts(),
        };
        debug_assert_eq!(counts, self.counts(), "counts added up wrong");
        self.scratch.counts = counts;
        // The cap check of §10, before padding (the historical `assert expected >=
        // len(active_requests)`). Fixed: the routable count; legacy charge_retiring:
        // every active request. A dummy alive here survived a rejected iteration (legacy
        // pad.rollback); it is in both counts.
        let admission_count = if self.policy.admission.charge_retiring {
            self.active.len() as u32 + u32::from(self.dummy.is_some())
        } else {
            counts.routable
        };
        if admission_count > assignment.expected {
            self.violation(
                InvariantKind::Cap,
                format!(
                    "admission count {admission_count} exceeds expected {} (active {}, dummy alive: {})",
                    assignment.expected,
                    self.active.len(),
                    self.dummy.is_some()
                ),
            );
        }
        let stats = &mut self.scratch.stats;
        stats.counts = counts;
        stats.expected = assignment.expected;
        stats.routed_now = routed_now;
        stats.routed_to_rank = self.routed_to_rank;
        stats.routed_total = self.routed_total;
        stats.waiting = self.waiting.len() as u32;
        let intent = match self.pad_path {
            PadPath::Expected => PadIntent::None,
            PadPath::Intent => self.local_intent(),
        };
        Ok((
            AwaitPadIntent {
                iteration: token.iteration,
            },
            intent,
        ))
    }

    fn local_intent(&self) -> PadIntent {
        let schedulable = |r: &&Request| crate::counts::is_schedulable(r, &self.window);
        if self
            .active
            .iter()
            .filter(schedulable)
            .any(|r| r.is_context())
        {
            PadIntent::Context
        } else if self
            .active
            .iter()
            .filter(schedulable)
            .any(|r| r.is_generation())
        {
            PadIntent::Generation
        } else {
            PadIntent::None
        }
    }

    /// Phase 4 and 5: pad if needed (§6), run the capacity and micro-batch schedulers
    /// (§4), take seats, index slots and blocks for the batch, pad an empty batch that
    /// had work, and return the batch size for the vote.
    pub fn on_pad_intent(
        &mut self,
        token: AwaitPadIntent,
        global: PadIntent,
    ) -> (AwaitVote, BatchVote) {
        let counts = self.scratch.counts;
        if self.dummy.is_none()
            && let Some(kind) = pad_need(
                self.pad_path,
                self.scratch.expected,
                counts.pad_schedulable,
                global,
                self.role == Role::Ctx,
            )
        {
            self.try_pad(kind);
        }
        let mut entries = self.bufs.entries();
        self.schedule_batch(&mut entries);
        let mut batch = ScheduledBatch {
            number: BatchNumber(self.next_batch),
            rank: self.rank,
            entries,
        };
        // A rank whose batch is empty though it has schedulable work (e.g. its one
        // request does not fit in KV) pads so it does not veto the fleet (§6).
        if batch.entries.is_empty() && self.dummy.is_none() && counts.schedulable > 0 {
            self.try_pad(DummyKind::Generation);
        }
        if let Some(d) = &self.dummy {
            batch.entries.push(self.dummy_entry(d));
        }
        let vote = BatchVote {
            batch_size: batch.entries.len() as u32,
        };
        self.scratch.batch = Some(batch);
        (
            AwaitVote {
                iteration: token.iteration,
            },
            vote,
        )
    }

    fn dummy_entry(&self, d: &Request) -> ForwardEntry {
        let kind = if d.is_context() {
            ForwardKind::Context {
                chunk: 1,
                samples: true,
            }
        } else {
            ForwardKind::Generation {
                tokens: d.tokens_per_iteration(),
            }
        };
        ForwardEntry {
            id: ReqId::DUMMY,
            seq: u64::MAX,
            kind,
            kv_tokens: d.kv_tokens,
            position: 0,
            is_dummy: true,
        }
    }

    /// The dummy transaction, step 1 (§6): check capacity first (skip with a warning if
    /// there is none; never crash), then allocate tentatively.
    fn try_pad(&mut self, kind: DummyKind) {
        let draft = self.sizes.draft_len;
        let tokens = match kind {
            DummyKind::Generation => 1 + draft,
            DummyKind::Context => 1,
        };
        if self.seats.free() == 0 {
            self.skip_pad("no free seat");
            return;
        }
        let kv = match self.kv.allocate_dummy(tokens) {
            Ok(kv) => kv,
            Err(e) => {
                self.skip_pad(&e.to_string());
                return;
            }
        };
        let Some(seat) = self.seats.try_take() else {
            // Checked above; keep the KV consistent regardless.
            self.kv.rollback_dummy(kv);
            self.skip_pad("no free seat");
            return;
        };
        let mut spec = RequestSpec::new(0, 1, 1);
        spec.draft_len = draft;
        let state = match kind {
            DummyKind::Generation => RequestState::GenerationInProgress,
            DummyKind::Context => RequestState::ContextInit,
        };
        let mut dummy = Request::new(spec, state);
        dummy.is_dummy = true;
        dummy.seat = Some(seat);
        self.dummy = Some(dummy);
        self.scratch.tentative = Some(TentativeDummy { kv, seat, kind });
        self.scratch.stats.dummy_added = true;
        self.totals.dummies_added += 1;
    }

    fn skip_pad(&mut self, why: &str) {
        tracing::debug!(rank = %self.rank, iteration = self.iteration, why, "padding skipped");
        self.scratch.stats.dummy_skipped_no_capacity = true;
        self.totals.dummies_skipped += 1;
    }

    /// Capacity then micro-batch scheduling; then the resources each entry needs: an index
    /// slot (none: deferred, "no free index slot"), a seat (none: the rank cannot seat an
    /// admitted request, a fatal violation), and blocks for the step (none: deferred).
    fn schedule_batch(&mut self, entries: &mut Vec<ForwardEntry>) {
        // The buffers leave `self.bufs` while the phases below borrow all of `self`.
        let mut classes = std::mem::take(&mut self.bufs.classes);
        let mut out = std::mem::take(&mut self.bufs.capacity);
        let mut planned = std::mem::take(&mut self.bufs.planned);
        self.capacity
            .schedule_with(&self.active, &self.kv, &mut classes, &mut out);
        for &i in &out.paused {
            self.pause(i);
        }
        // Pausing and receive starts change requests in place; indices stay valid.
        // Receives start FCFS within the transport budget (§8): the first deferred one
        // stops the walk.
        for &i in &out.disagg_gen_init {
            let blocks = self.kv.blocks_for_tokens(self.active[i].spec.prompt_len);
            let in_flight = self
                .active
                .iter()
                .filter(|r| r.state == RequestState::DisaggGenerationTransInProgress)
                .map(|r| {
                    (
                        self.kv.blocks_of(r.id()),
                        r.transfer_started_ns.unwrap_or(0),
                    )
                });
            match crate::transfer_budget::decide(
                self.sizes.transfer_budget_blocks,
                in_flight,
                self.scratch.now_ns,
                blocks,
            ) {
                crate::transfer_budget::BudgetDecision::Admit => self.start_receive(i),
                crate::transfer_budget::BudgetDecision::Defer { blocked_by_active } => {
                    self.totals.transfer_budget_deferred += 1;
                    if blocked_by_active {
                        self.totals.transfer_budget_blocked_by_active += 1;
                    }
                    break;
                }
            }
        }
        let receiving = self
            .active
            .iter()
            .filter(|r| r.state == RequestState::DisaggGenerationTransInProgress)
            .count() as u32;
        self.totals.max_receives_in_flight = self.totals.max_receives_in_flight.max(receiving);
        let in_flight: BTreeSet<ReqId> = BTreeSet::new();
        self.micro
            .schedule_into(&self.active, &out.fitting, &in_flight, &mut planned);
        entries.reserve(planned.len());
        for e in &planned {
            if let Some(entry) = self.prepare_entry(e.index, e.kind) {
                entries.push(entry);
            }
        }
        self.bufs.classes = classes;
        self.bufs.capacity = out;
        self.bufs.planned = planned;
    }

    fn prepare_entry(&mut self, index: usize, kind: EntryKind) -> Option<ForwardEntry> {
        let id = self.active[index].id();
        if !self.active[index].holds_kv {
            let r = &self.active[index];
            match self
                .kv
                .add_sequence(id, &r.spec.block_hashes, r.spec.prompt_len)
            {
                Ok(reused) => {
                    let r = &mut self.active[index];
                    r.holds_kv = true;
                    // The reused prefix is whole blocks.
                    r.kv_room = reused;
                    if reused > r.context_pos {
                        r.context_pos = reused;
                        r.kv_tokens = reused;
                        r.reused_tokens = reused;
                    }
                }
                Err(KvError::NoFreeIndexSlot { .. }) => {
                    self.scratch.stats.deferrals_no_free_index_slot += 1;
                    self.totals.deferrals_no_free_index_slot += 1;
                    return None;
                }
                Err(_) => {
                    self.scratch.stats.deferrals_out_of_blocks += 1;
                    self.totals.deferrals_out_of_blocks += 1;
                    return None;
                }
            }
        }
        if self.active[index].seat.is_none() {
            match self.seats.try_take() {
                Some(seat) => self.active[index].seat = Some(seat),
                None => {
                    let detail = format!(
                        "request {id} admitted but all {} seats are held (kv index pool {}, seat pool {})",
                        self.seats.size(),
                        self.kv.index_pool_size(),
                        self.seats.size()
                    );
                    self.violation(InvariantKind::SeatUnavailable, detail);
                    return None;
                }
            }
        }
        let r = &self.active[index];
        let (kind, step_tokens, position) = match kind {
            EntryKind::Context { chunk } => {
                // Reuse learnt at start can shorten the planned chunk.
                let chunk = chunk.min(r.context_remaining()).max(1);
                let samples = r.context_pos + chunk >= r.context_len;
                (
                    ForwardKind::Context { chunk, samples },
                    chunk,
                    r.next_position,
                )
            }
            EntryKind::Generation { tokens } => {
                (ForwardKind::Generation { tokens }, tokens, r.next_position)
            }
        };
        let kv_tokens = r.kv_tokens;
        let need = kv_tokens + step_tokens;
        if need > r.kv_room {
            if self.kv.ensure_tokens(id, need).is_err() {
                self.scratch.stats.deferrals_out_of_blocks += 1;
                self.totals.deferrals_out_of_blocks += 1;
                return None;
            }
            let tpb = self.sizes.tokens_per_block;
            self.active[index].kv_room = self.kv.blocks_for_tokens(need) * tpb;
        }
        debug_assert!(
            self.kv.blocks_of(id) * self.sizes.tokens_per_block >= need,
            "request {id}: kv_room {} overstates its blocks",
            self.active[index].kv_room
        );
        Some(ForwardEntry {
            id,
            seq: self.active[index].seq,
            kind,
            kv_tokens,
            position,
            is_dummy: false,
        })
    }

    /// MAX_UTILIZATION pause: reset to context, free KV and seat; the tokens generated so
    /// far are recomputed with the prompt.
    fn pause(&mut self, index: usize) {
        let id = self.active[index].id();
        let _ = self.kv.free_sequence(id);
        let r = &mut self.active[index];
        r.holds_kv = false;
        r.kv_room = 0;
        if let Some(seat) = r.seat.take() {
            self.seats.release(seat);
        }
        if r.generated > 0 {
            r.context_len = r.kv_tokens + 1;
            // What was in flight is recomputed: positions resume after what arrived.
            r.next_position = r.generated;
        }
        r.context_pos = 0;
        r.kv_tokens = 0;
        r.state = RequestState::ContextInit;
    }

    /// gen side (§8): the capacity scheduler admitted a DISAGG_GENERATION_INIT request:
    /// reserve its KV and start the receive.
    fn start_receive(&mut self, i: usize) {
        let id = self.active[i].id();
        let prompt = self.active[i].spec.prompt_len;
        match self.kv.add_sequence(id, &[], prompt) {
            Ok(_) => {}
            Err(KvError::NoFreeIndexSlot { .. }) => {
                self.scratch.stats.deferrals_no_free_index_slot += 1;
                self.totals.deferrals_no_free_index_slot += 1;
                return;
            }
            Err(_) => return,
        }
        if self.kv.ensure_tokens(id, prompt).is_err() {
            let _ = self.kv.free_sequence(id);
            self.scratch.stats.deferrals_out_of_blocks += 1;
            self.totals.deferrals_out_of_blocks += 1;
            return;
        }
        self.active[i].holds_kv = true;
        self.active[i].kv_room = self.kv.blocks_for_tokens(prompt) * self.sizes.tokens_per_block;
        self.active[i].state = RequestState::DisaggGenerationTransInProgress;
        self.active[i].transfer_started_ns = Some(self.scratch.now_ns);
        self.totals.transfer_budget_admitted += 1;
        let blocks = self.kv.blocks_of(id);
        self.scratch.commands.push(TransferCommand::Receive {
            id,
            blocks,
            from: self.active[i].spec.kv_source,
        });
    }

    /// Phase 6: `can_queue = no rank scheduled zero`; commit or roll back the tentative
    /// dummy (§6); say what to launch and which output to hand back.
    pub fn on_vote(
        &mut self,
        token: AwaitVote,
        votes: &[BatchVote],
    ) -> Result<(AwaitForward, LaunchPlan), ExecutorError> {
        let (token, can_queue, await_output) = self.vote(token, votes)?;
        let plan = LaunchPlan {
            can_queue,
            launch: self.scratch.launched.clone(),
            await_output,
        };
        Ok((token, plan))
    }

    /// [`RankExecutor::on_vote`] without handing out a copy of the batch: a driver reads
    /// it in place with [`RankExecutor::launched`]. Returns `can_queue` and the batch
    /// whose output phase 8 needs.
    pub fn vote(
        &mut self,
        token: AwaitVote,
        votes: &[BatchVote],
    ) -> Result<(AwaitForward, bool, Option<BatchNumber>), ExecutorError> {
        let dp = self.sizes.dp as usize;
        if votes.len() != dp {
            return Err(ExecutorError::WrongArity {
                rank: self.rank,
                iteration: token.iteration,
                phase: Phase::Vote,
                got: votes.len(),
                want: dp,
            });
        }
        let can_queue = votes.iter().all(|v| v.batch_size > 0);
        if let Some(tentative) = self.scratch.tentative.take() {
            self.resolve_dummy(tentative, can_queue);
        }
        let batch = self.scratch.batch.take();
        let launch = if can_queue {
            self.next_batch += 1;
            batch
        } else {
            self.totals.vetoed_iterations += 1;
            if let Some(b) = batch {
                self.bufs.recycle(b);
            }
            None
        };
        let await_output = if self.sizes.overlap {
            self.in_flight.as_ref().map(|b| b.number)
        } else {
            launch.as_ref().map(|b| b.number)
        };
        self.scratch.launched = launch;
        self.scratch.awaited = await_output;
        self.scratch.stats.forward_ran = can_queue;
        Ok((
            AwaitForward {
                iteration: token.iteration,
            },
            can_queue,
            await_output,
        ))
    }

    /// The batch this iteration launches, between the vote and the forward output.
    pub fn launched(&self) -> Option<&ScheduledBatch> {
        self.scratch.launched.as_ref()
    }

    fn resolve_dummy(&mut self, tentative: TentativeDummy, can_queue: bool) {
        if can_queue {
            self.kv.commit_dummy(tentative.kv);
            self.scratch.stats.dummy_committed = true;
            self.totals.dummies_committed += 1;
        } else if self.policy.pad.rollback {
            // Roll back exactly this dummy: its KV, its seat, itself.
            self.kv.rollback_dummy(tentative.kv);
            self.seats.release(tentative.seat);
            self.dummy = None;
            self.scratch.stats.dummy_rolled_back = true;
            self.totals.dummies_rolled_back += 1;
        } else {
            // Legacy: nothing undoes the dummy; it survives into the next iteration.
            self.kv.commit_dummy(tentative.kv);
        }
    }

    /// Phase 8: process the awaited output and update states (§3 non-overlap and overlap
    /// orders), tear down finished requests and the dummy, and return this rank's
    /// responses for the gather to rank 0.
    pub fn on_forward_output(
        &mut self,
        token: AwaitForward,
        output: Option<ForwardOutput>,
    ) -> Result<(AwaitTransfers, RankResponses), ExecutorError> {
        self.process_output(output.as_ref())?;
        let responses = RankResponses {
            rank: self.rank,
            responses: std::mem::take(&mut self.scratch.responses),
        };
        Ok((
            AwaitTransfers {
                iteration: token.iteration,
            },
            responses,
        ))
    }

    /// [`RankExecutor::on_forward_output`] with the output borrowed and the responses
    /// appended to `out`, a vector the driver reuses (the in-crate stepper gathers every
    /// rank into one).
    pub fn forward_output_into(
        &mut self,
        token: AwaitForward,
        output: Option<&ForwardOutput>,
        out: &mut Vec<Response>,
    ) -> Result<AwaitTransfers, ExecutorError> {
        self.process_output(output)?;
        if out.is_empty() {
            // Swap rather than copy: the two vectors trade buffers and keep capacity.
            std::mem::swap(out, &mut self.scratch.responses);
        } else {
            out.append(&mut self.scratch.responses);
        }
        Ok(AwaitTransfers {
            iteration: token.iteration,
        })
    }

    fn process_output(&mut self, output: Option<&ForwardOutput>) -> Result<(), ExecutorError> {
        let got = output.map(|o| o.batch);
        if got != self.scratch.awaited {
            return Err(ExecutorError::WrongBatch {
                rank: self.rank,
                got,
                want: self.scratch.awaited,
            });
        }
        let launched = self.scratch.launched.take();
        if self.sizes.overlap {
            // Launch N+1 happened; now process batch N's tokens, then update N+1's states.
            let prev = self.in_flight.take();
            if let (Some(prev), Some(out)) = (&prev, output) {
                self.apply_tokens(prev, out);
            }
            if let Some(prev) = prev {
                self.bufs.recycle(prev);
            }
            if let Some(batch) = &launched {
                self.apply_launch(batch);
            }
        } else if let Some(batch) = &launched {
            self.apply_launch(batch);
            if let Some(out) = output {
                self.apply_tokens(batch, out);
            }
        }
        if let Some(batch) = &launched {
            self.record_batch(batch);
            // The dummy ran; it never outlives the iteration of its forward (§6).
            if self.dummy.is_some() {
                self.free_dummy();
            }
        }
        // Under overlap the batch stays in flight until next iteration's output (moved,
        // not copied: nothing above reads `in_flight`).
        if self.sizes.overlap {
            self.in_flight = launched;
        } else if let Some(batch) = launched {
            self.bufs.recycle(batch);
        }
        Ok(())
    }

    fn record_batch(&mut self, batch: &ScheduledBatch) {
        let s = &mut self.scratch.stats;
        for e in &batch.entries {
            if e.is_dummy {
                s.num_dummies += 1;
                continue;
            }
            s.num_scheduled_requests += 1;
            match e.kind {
                ForwardKind::Context { chunk, .. } => {
                    s.num_ctx_requests += 1;
                    s.num_ctx_tokens += chunk;
                }
                ForwardKind::Generation { .. } => s.num_gen_requests += 1,
            }
        }
        self.totals.forward_iterations += 1;
        self.totals.scheduled_requests += u64::from(s.num_scheduled_requests);
        self.totals.context_tokens += u64::from(s.num_ctx_tokens);
        if s.num_dummies > 0 {
            self.totals.dummy_iterations += 1;
        }
    }

    fn free_dummy(&mut self) {
        if let Some(d) = self.dummy.take() {
            let _ = self.kv.free_sequence(ReqId::DUMMY);
            if let Some(seat) = d.seat {
                self.seats.release(seat);
            }
        }
    }

    /// Phase 9: the transfer events this rank applies this iteration (a consensus
    /// collective, §3.9).
    pub fn transfer_status(
        &mut self,
        token: AwaitTransfers,
    ) -> (AwaitTransferResult, TransferStatus) {
        let events = std::mem::take(&mut self.pending_transfer_events);
        // Fatal violations (cap, unseatable request) are all found before this phase.
        let fatal = self.scratch.violations.iter().any(|v| v.kind.is_fatal());
        (
            AwaitTransferResult {
                iteration: token.iteration,
            },
            TransferStatus { events, fatal },
        )
    }

    /// Phase 9 result: apply this rank's transfer events, run the §10 checks, close the
    /// iteration.
    pub fn on_transfer_status(
        &mut self,
        token: AwaitTransferResult,
        all: &[TransferStatus],
    ) -> Result<IterationReport, ExecutorError> {
        let mut report = IterationReport::default();
        self.transfer_result_into(token, all, &mut report)?;
        Ok(report)
    }

    /// [`RankExecutor::on_transfer_status`] into a report the driver reuses: every
    /// field is overwritten, and the report's old vectors become the next iteration's
    /// (cleared) scratch, so nothing is allocated or copied twice.
    pub fn transfer_result_into(
        &mut self,
        token: AwaitTransferResult,
        all: &[TransferStatus],
        report: &mut IterationReport,
    ) -> Result<(), ExecutorError> {
        let dp = self.sizes.dp as usize;
        if all.len() != dp {
            return Err(ExecutorError::WrongArity {
                rank: self.rank,
                iteration: token.iteration,
                phase: Phase::Transfers,
                got: all.len(),
                want: dp,
            });
        }
        let mine = all[self.rank.index()].events.clone();
        self.scratch.stats.transfer_events_applied = mine.len() as u32;
        for event in mine {
            self.apply_transfer(event);
        }
        self.check_invariants();
        report.stats = std::mem::take(&mut self.scratch.stats);
        report.stats.kv_blocks_used = self.kv.used_blocks();
        report.stats.kv_blocks_free = self.kv.free_blocks();
        report.stats.seats_used = self.seats.used();
        self.totals.iterations += 1;
        self.iteration += 1;
        report.violations.clear();
        std::mem::swap(&mut report.violations, &mut self.scratch.violations);
        report.transfer_commands.clear();
        std::mem::swap(&mut report.transfer_commands, &mut self.scratch.commands);
        Ok(())
    }

    pub(super) fn violation(&mut self, kind: InvariantKind, detail: String) {
        self.scratch.violations.push(Violation {
            iteration: self.iteration,
            rank: self.rank,
            kind,
            detail,
        });
    }

    /// Bad input gets a reason and changes nothing (the request is never queued).
    fn validate_request(&self, spec: &RequestSpec) -> Result<(), String> {
        let s = &self.sizes;
        if spec.id == ReqId::DUMMY {
            return Err("request id 0 is reserved for pad dummies".into());
        }
        if self.known_ids.contains(&spec.id) {
            return Err(format!("request id {} was already submitted", spec.id));
        }
        if spec.prompt_len == 0 {
            return Err("prompt_len must be positive, got 0".into());
        }
        if spec.max_new_tokens == 0 {
            return Err("max_new_tokens must be positive, got 0".into());
        }
        if spec.draft_len > s.draft_len {
            return Err(format!(
                "draft_len {} exceeds the server's max_draft_len {}",
                spec.draft_len, s.draft_len
            ));
        }
        // A gen server receives the prompt's KV; only prefilling servers compute it.
        if self.role != Role::Gen
            && !self.chunked_prefill
            && spec.prompt_len + spec.draft_len > s.max_num_tokens
        {
            return Err(format!(
                "prompt_len {} exceeds max_num_tokens {} with chunked prefill off",
                spec.prompt_len, s.max_num_tokens
            ));
        }
        let total = u64::from(spec.prompt_len) + u64::from(spec.max_new_tokens);
        let blocks = total.div_ceil(u64::from(s.tokens_per_block));
        if blocks > u64::from(s.kv_blocks_per_rank) {
            return Err(format!(
                "prompt_len {} + max_new_tokens {} needs {blocks} KV blocks, a rank has {}",
                spec.prompt_len, spec.max_new_tokens, s.kv_blocks_per_rank
            ));
        }
        if let Some(pin) = spec.pinned
            && pin.rank.0 >= s.dp
        {
            return Err(format!(
                "attention_dp_rank {} is out of range for dp = {}",
                pin.rank, s.dp
            ));
        }
        if self.role == Role::Gen
            && (spec.generated_before == 0 || spec.generated_before >= spec.max_new_tokens)
        {
            return Err(format!(
                "a gen server needs 1 <= generated_before < max_new_tokens, got {} and {}",
                spec.generated_before, spec.max_new_tokens
            ));
        }
        Ok(())
    }

    /// Generation-first (§8): the front named `id`'s gen peer. Every rank reads the same
    /// notice at the same iteration: a request still waiting is remembered (it will
    /// arrive ready); a resident one in DISAGG_CONTEXT_WAIT_SCHEDULER is promoted by the
    /// rank holding it; anything else (already promoted, gone) is ignored alike.
    fn peer_ready(&mut self, id: ReqId) {
        if !self.generation_first {
            return;
        }
        if self.waiting.iter().any(|s| s.id == id) {
            self.peer_known.insert(id);
        } else if let Some(i) = self.find_active(id)
            && self.active[i].state == RequestState::DisaggContextWaitScheduler
        {
            // A state changed since the gather: the routing-time counts start afresh.
            self.scratch.gathered = None;
            self.active[i].state = RequestState::ContextInit;
            self.totals.generation_first_promoted += 1;
            self.scratch.stats.generation_first_promoted += 1;
        }
    }

    fn cancel(&mut self, id: ReqId) {
        self.peer_known.remove(&id);
        if let Some(pos) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(pos);
            if self.rank.0 == 0 {
                self.push_finish(id, 0, Finish::Cancelled);
            }
            return;
        }
        if let Some(i) = self.find_active(id) {
            self.scratch.gathered = None;
            let r = self.active.remove(i);
            self.release(&r);
            self.push_finish(id, r.generated, Finish::Cancelled);
        }
    }

    pub(super) fn push_finish(&mut self, id: ReqId, generated: u32, finish: Finish) {
        if matches!(finish, Finish::Failed(_) | Finish::Cancelled) {
            self.totals.failed += 1;
        }
        self.scratch.responses.push(Response {
            id,
            new_tokens: 0,
            last_token: 0,
            generated,
            finish: Some(finish),
        });
    }

    /// Frees everything a request holds on this rank.
    pub(super) fn release(&mut self, r: &Request) {
        if r.holds_kv {
            let _ = self.kv.free_sequence(r.id());
        }
        if let Some(seat) = r.seat {
            self.seats.release(seat);
        }
    }

    /// The §10 checks at the end of an iteration.
    fn check_invariants(&mut self) {
        let seats = self.sizes.seats;
        let held = self.seats.used();
        if held > seats {
            self.violation(
                InvariantKind::Seats,
                format!("{held} seats held, seats = {seats}"),
            );
        }
        // One walk over the resident requests gathers what the checks below count.
        let mut ids = std::mem::take(&mut self.bufs.ids);
        ids.clear();
        let mut holders = u32::from(self.dummy.as_ref().is_some_and(|d| d.seat.is_some()));
        let mut with_kv = self.sending.len() + usize::from(self.dummy.is_some());
        for r in &self.active {
            holders += u32::from(r.seat.is_some());
            with_kv += usize::from(r.holds_kv);
            ids.push(r.id());
        }
        ids.extend(self.sending.iter().map(|r| r.id()));
        if holders != held {
            self.violation(
                InvariantKind::Seats,
                format!("{holders} requests hold a seat but the pool counts {held}"),
            );
        }
        if !self.policy.seats.rederive && self.kv.index_pool_size() != seats {
            let size = self.kv.index_pool_size();
            self.violation(
                InvariantKind::Seats,
                format!("kv index pool {size} != seats {seats}"),
            );
        }
        // Conservation every iteration; the full structural walk of the pool (O(blocks))
        // every `kv_full_check_every` iterations (every iteration in tests).
        let full =
            self.kv_full_check_every > 0 && self.iteration.is_multiple_of(self.kv_full_check_every);
        let kv_check = if full {
            self.kv.check_invariants()
        } else {
            self.kv.check_conservation()
        };
        if let Err(e) = kv_check {
            self.violation(InvariantKind::Blocks, e.to_string());
        }
        let sequences = self.kv.index_slots_used() as usize;
        if with_kv != sequences {
            self.violation(
                InvariantKind::BlockLeak,
                format!(
                    "kv holds {sequences} sequences but {with_kv} resident or sending requests own one"
                ),
            );
        }
        if self.dummy.is_some() {
            self.violation(
                InvariantKind::DummySurvived,
                "a dummy is alive at the end of the iteration".into(),
            );
        }
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        let distinct = ids.len();
        self.bufs.ids = ids;
        if distinct != n {
            self.violation(
                InvariantKind::Accounting,
                format!(
                    "{} request ids appear twice among active and sending",
                    n - distinct
                ),
            );
        }
    }
}

/// The idle decision of §3.2, one definition for every driver and the loom model.
pub fn idle_decision(global_live: u64, waiting: usize, shutdown: bool) -> FetchMode {
    if global_live == 0 && waiting == 0 && !shutdown {
        FetchMode::Block
    } else {
        FetchMode::Poll
    }
}
