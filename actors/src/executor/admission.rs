//! What happens between the gather and the pad decision (§3.2, §3.3, §5): the idle
//! decision, the replicated fetch (requests, cancellations, generation-first notices, a
//! stall-out), admission within `capacity − Σ routable`, and routing with the §10 cap
//! check.

use crate::config::{RequestShape, Role};
use crate::counts::RankCounts;
use crate::invariants::InvariantKind;
use crate::padding::PadPath;
use crate::policy::IdlePredicate;
use crate::request::{Request, RequestSpec, RequestState};
use crate::router::RouteInput;

use super::RankExecutor;
use super::messages::*;
use crate::vocab::*;

impl RankExecutor {
    /// Rank 0's read mode (§3.2). Block only when the global live count is zero, the
    /// waiting queue is empty and no shutdown was read: deciding from anything narrower
    /// (e.g. the routable count) deadlocks a closed-loop client, because retiring
    /// requests finish only when an iteration runs. When work remains but no rank's last
    /// iteration changed anything, the next would be identical: wait for an input.
    pub(super) fn fetch_mode(&self, gathered: &[RankState]) -> FetchMode {
        if gathered.iter().any(|s| s.responses_due) {
            // A failed request's response waits for this iteration's gather.
            return FetchMode::Poll;
        }
        let live: u64 = gathered.iter().map(|s| u64::from(s.counts.live)).sum();
        let judged = match self.setup.policy.idle.predicate {
            IdlePredicate::Live => live,
            IdlePredicate::Routable => gathered.iter().map(|s| u64::from(s.counts.routable)).sum(),
        };
        let stalled = FetchMode::Stalled {
            bounded: !gathered.iter().any(|s| s.awaiting_transfer),
        };
        match idle_decision(
            judged,
            self.replicated.waiting.len(),
            self.replicated.shutdown,
        ) {
            FetchMode::Block if live == 0 => FetchMode::Block,
            // `idle.predicate = "routable"`: rank 0 waits for input although work
            // remains. The wait is bounded like any stall, so a closed-loop client's
            // deadlock ends in failed requests instead of a hang.
            FetchMode::Block => stalled,
            _ if gathered.iter().all(|s| !s.progressed) => stalled,
            _ => FetchMode::Poll,
        }
    }

    /// Whether the whole server is done (decided from the gather, so every rank agrees
    /// at the same iteration): a shutdown was read, nothing is live or waiting, and no
    /// rank holds a response still to gather.
    pub(super) fn server_drained(&self, gathered: &[RankState]) -> bool {
        self.replicated.shutdown
            && self.replicated.waiting.is_empty()
            && gathered
                .iter()
                .all(|s| s.counts.live == 0 && !s.responses_due)
    }

    /// The fetch broadcast on every rank: a stall-out fails everything; new requests
    /// are validated and queued (rank 0 answers a refused one); cancellations apply
    /// (after the requests: a client that left at once has its cancel in the same fetch
    /// as its request); generation-first notices promote; then admission.
    pub(super) fn on_fetch(&mut self, fetched: &FetchBatch) {
        self.replicated.shutdown |= fetched.shutdown;
        self.iter.now_ns = fetched.now_ns;
        self.iter.stats.started_ns = fetched.now_ns;
        if let Some(why) = &fetched.stalled_out {
            self.stall_out(why);
        }
        for spec in &fetched.requests {
            match self.validate_request(spec) {
                Ok(()) => {
                    self.replicated.known_ids.insert(spec.id);
                    self.replicated.waiting.push_back(spec.clone());
                }
                Err(reason) => {
                    // Every rank drops it the same way; rank 0 alone answers.
                    self.replicated.peer_known.remove(&spec.id);
                    if self.rank.0 == 0 {
                        self.push_finish(spec.id, 0, Finish::Failed(Failure::Refused(reason)));
                    }
                }
            }
        }
        for &id in &fetched.cancellations {
            self.cancel(id);
        }
        for &id in &fetched.peers_ready {
            self.peer_ready(id);
        }
        self.admit();
    }

    /// §3.3: pop FIFO while `Σ routable + popped < dp * M`; a request strictly pinned to
    /// a full rank is set aside with its order kept.
    fn admit(&mut self) {
        let m = self.setup.sizes.max_admitted_per_rank;
        let routable: u64 = self.iter.loads.iter().map(|l| u64::from(l.requests)).sum();
        let max_new = u64::from(self.setup.sizes.capacity).saturating_sub(routable);
        // Per-rank counts only matter for strict pins: built on the first one.
        let mut per_rank: Option<Vec<u32>> = None;
        let mut set_aside = Vec::new();
        let loads = &self.iter.loads;
        let popped = &mut self.iter.popped;
        let waiting = &mut self.replicated.waiting;
        popped.clear();
        while (popped.len() as u64) < max_new {
            let Some(spec) = waiting.pop_front() else {
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
            waiting.push_front(spec);
        }
        self.iter.stats.admitted_now = self.iter.popped.len() as u32;
        if !self.iter.popped.is_empty() {
            self.iter.progressed = true;
        }
    }

    /// Route the popped requests (every rank computes the same assignment and keeps its
    /// share), check the routing invariant and the cap (§10, before padding).
    pub(super) fn route(&mut self, all_matches: Option<&[PrefixMatches]>) {
        let n_new = self.iter.popped.len();
        let matches: Option<Vec<Vec<u32>>> =
            all_matches.map(|all| all.iter().map(|m| m.tokens.clone()).collect());
        let assignment = self.router.route(RouteInput {
            loads: &self.iter.loads,
            new: &self.iter.popped,
            max_per_rank: self.setup.sizes.max_admitted_per_rank,
            prefix_matches: matches.as_deref(),
        });
        // Out of the iteration while requests are pushed (that borrows all of `self`),
        // then back, empty, with its capacity.
        let mut popped = std::mem::take(&mut self.iter.popped);
        if let Some(v) = &assignment.violation {
            self.violation(InvariantKind::Routing, v.to_string());
        }
        let arrival_state = match self.setup.role {
            Role::Gen => RequestState::DisaggGenerationInit,
            Role::Ctx if self.setup.generation_first => RequestState::DisaggContextWaitScheduler,
            Role::Agg | Role::Ctx => RequestState::ContextInit,
        };
        let mut routed_now = 0;
        for (spec, rank) in popped.drain(..).zip(&assignment.ranks) {
            // Replicated on every rank, whichever rank the request goes to.
            let peer_known = self.replicated.peer_known.remove(&spec.id);
            // Every rank counts every rank's new context work alike (ADP balance).
            if let Some(load) = self.iter.balance_loads.get_mut(rank.index())
                && (peer_known || arrival_state == RequestState::ContextInit)
            {
                load.context += 1;
            }
            if *rank == self.rank {
                self.totals.routing_digest = crate::kv::mix(self.totals.routing_digest ^ spec.id.0);
                let state = if peer_known {
                    self.totals.generation_first_promoted += 1;
                    self.iter.stats.generation_first_promoted += 1;
                    RequestState::ContextInit
                } else {
                    arrival_state
                };
                self.push_active(Request::new(spec, state));
                routed_now += 1;
            }
        }
        self.iter.popped = popped;
        self.replicated.routed_total += n_new as u64;
        self.resident.routed_here += routed_now as u64;
        self.totals.routed_requests += routed_now as u64;
        self.iter.expected = assignment.expected;
        let counts = match self.iter.gathered.take() {
            Some((at_gather, n)) if n <= self.resident.active.len() => {
                at_gather.plus(RankCounts::of(
                    &self.resident.active[n..],
                    &self.setup.window,
                    &self.setup.policy,
                ))
            }
            _ => self.counts(),
        };
        debug_assert_eq!(counts, self.counts(), "counts added up wrong");
        self.iter.counts = counts;
        // The cap check of §10, before padding (the historical `assert expected >=
        // len(active_requests)`). Fixed: the routable count; legacy charge_retiring:
        // every active request. A dummy alive here survived a rejected iteration (legacy
        // pad.rollback); it is in both counts.
        let admission_count = if self.setup.policy.admission.charge_retiring {
            self.resident.active.len() as u32 + u32::from(self.resident.dummy.is_some())
        } else {
            counts.routable
        };
        if admission_count > assignment.expected {
            self.violation(
                InvariantKind::Cap,
                format!(
                    "admission count {admission_count} exceeds expected {} (active {}, dummy alive: {})",
                    assignment.expected,
                    self.resident.active.len(),
                    self.resident.dummy.is_some()
                ),
            );
        }
        let stats = &mut self.iter.stats;
        stats.counts = counts;
        stats.expected = assignment.expected;
        stats.routed_now = routed_now;
        stats.routed_to_rank = self.resident.routed_here;
        stats.routed_total = self.replicated.routed_total;
        stats.waiting = self.replicated.waiting.len() as u32;
    }

    /// This rank's forward intent on the non-overlap disaggregated path (§6).
    pub(super) fn local_intent(&self) -> PadIntent {
        debug_assert_eq!(self.setup.pad_path, PadPath::Intent);
        let schedulable = |r: &&Request| crate::counts::is_schedulable(r, &self.setup.window);
        let active = &self.resident.active;
        if active.iter().filter(schedulable).any(|r| r.is_context()) {
            PadIntent::Context
        } else if active.iter().filter(schedulable).any(|r| r.is_generation()) {
            PadIntent::Generation
        } else {
            PadIntent::None
        }
    }

    /// Bad input gets a reason and changes nothing (the request is never queued).
    fn validate_request(&self, spec: &RequestSpec) -> Result<(), String> {
        if spec.id == crate::ids::ReqId::DUMMY {
            return Err("request id 0 is reserved for pad dummies".into());
        }
        if self.replicated.known_ids.contains(&spec.id) {
            return Err(format!("request id {} was already submitted", spec.id));
        }
        if spec.prompt_len == 0 {
            return Err("prompt_len must be positive, got 0".into());
        }
        if spec.max_new_tokens == 0 {
            return Err("max_new_tokens must be positive, got 0".into());
        }
        // The sizes rule the front also applies when it picks a server (§8), so a
        // request reaches a server only when it can run there.
        if let Some(why) = self
            .setup
            .limits
            .refusal(self.setup.role, &RequestShape::of(spec))
        {
            return Err(why.to_string());
        }
        if self.setup.role == Role::Gen
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
    fn peer_ready(&mut self, id: crate::ids::ReqId) {
        if !self.setup.generation_first {
            return;
        }
        // A notice for a request not accepted yet (the notice can overtake the request:
        // it crosses the link between servers, the request the front's) or still
        // waiting is remembered, replicated: the request arrives ready (§8). Every rank
        // decides this from replicated state only.
        if !self.replicated.known_ids.contains(&id)
            || self.replicated.waiting.iter().any(|s| s.id == id)
        {
            self.replicated.peer_known.insert(id);
        } else if let Some(i) = self.find_active(id)
            && self.resident.active[i].state == RequestState::DisaggContextWaitScheduler
        {
            // A state changed since the gather: the routing-time counts start afresh.
            self.iter.gathered = None;
            self.resident.active[i].state = RequestState::ContextInit;
            self.totals.generation_first_promoted += 1;
            self.iter.stats.generation_first_promoted += 1;
            self.iter.progressed = true;
        }
    }

    fn cancel(&mut self, id: crate::ids::ReqId) {
        self.replicated.peer_known.remove(&id);
        if let Some(pos) = self.replicated.waiting.iter().position(|s| s.id == id) {
            self.replicated.waiting.remove(pos);
            if self.rank.0 == 0 {
                self.push_finish(id, 0, Finish::Cancelled);
            }
            return;
        }
        if let Some(i) = self.find_active(id) {
            self.iter.gathered = None;
            let r = self.resident.active.remove(i);
            self.release(&r);
            if r.state == RequestState::DisaggGenerationTransInProgress {
                self.iter.commands.push(TransferCommand::Abort {
                    id,
                    cause: AbortCause::Cancelled,
                });
            }
            self.push_finish(id, r.generated, Finish::Cancelled);
        }
    }

    /// The server stalled out (§3.2's wait found no input within the bound while work
    /// remained): the deadlock's evidence is kept, and every request this rank holds
    /// fails with the reason (rank 0 answers for the waiting queue); a shutdown follows,
    /// so the server winds down instead of hanging.
    fn stall_out(&mut self, why: &str) {
        if self.replicated.stalled_out.is_none() {
            self.stalled_state = Some(self.describe());
            self.replicated.stalled_out = Some(why.to_string());
        }
        self.replicated.shutdown = true;
        self.iter.gathered = None;
        let reason = Failure::Deadlocked(why.to_string());
        for spec in std::mem::take(&mut self.replicated.waiting) {
            if self.rank.0 == 0 {
                self.push_finish(spec.id, 0, Finish::Failed(reason.clone()));
            }
        }
        self.replicated.peer_known.clear();
        for r in std::mem::take(&mut self.resident.active) {
            self.release(&r);
            if r.state == RequestState::DisaggGenerationTransInProgress {
                self.iter.commands.push(TransferCommand::Abort {
                    id: r.id(),
                    cause: AbortCause::Failed(Box::new(reason.clone())),
                });
            }
            self.push_finish(r.id(), r.generated, Finish::Failed(reason.clone()));
        }
        for r in std::mem::take(&mut self.resident.sending) {
            // Its first token went out already (ContextDone); the front fails the
            // request when the ctx side reports the send failed.
            self.free_kv(r.id(), r.holds_kv);
            let cause = AbortCause::Failed(Box::new(reason.clone()));
            self.iter.commands.push(TransferCommand::Abort {
                id: r.id(),
                cause: cause.clone(),
            });
            self.push_finish(
                r.id(),
                r.generated,
                Finish::Failed(Failure::KvSend(TransferFailure::Aborted(cause))),
            );
        }
        if let Some(batch) = self.resident.in_flight.take() {
            self.bufs.recycle(batch);
        }
    }

    pub(super) fn push_finish(&mut self, id: crate::ids::ReqId, generated: u32, finish: Finish) {
        if matches!(finish, Finish::Failed(_) | Finish::Cancelled) {
            self.totals.failed += 1;
        }
        self.iter.progressed = true;
        self.iter.responses.responses.push(Response {
            id,
            new_tokens: 0,
            last_token: 0,
            generated,
            finish: Some(finish),
            logprobs: None,
        });
    }

    /// Frees everything a request holds on this rank.
    pub(super) fn release(&mut self, r: &Request) {
        if r.holds_kv {
            self.free_kv(r.id(), true);
        }
        if let Some(seat) = r.seat {
            self.seats.release(seat);
        }
    }
}

/// The idle decision of §3.2, one definition for every host and the loom model.
pub fn idle_decision(global_live: u64, waiting: usize, shutdown: bool) -> FetchMode {
    if global_live == 0 && waiting == 0 && !shutdown {
        FetchMode::Block
    } else {
        FetchMode::Poll
    }
}
