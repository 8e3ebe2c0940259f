//! Between the route and the forward (§4, §6, §8): the dummy transaction, the capacity
//! and micro-batch schedulers, the resources each scheduled entry takes (index slot,
//! seat, blocks), the gen-side transport budget, and the vote's outcome.

use std::collections::BTreeSet;

use crate::config::Role;
use crate::ids::{BatchNumber, ReqId};
use crate::invariants::InvariantKind;
use crate::kv::KvError;
use crate::padding::{DummyKind, PadPath, TentativeDummy, pad_need};
use crate::policy::PadPredicate;
use crate::request::{Request, RequestSpec, RequestState};
use crate::scheduler::EntryKind;

use super::RankExecutor;
use super::messages::*;
use crate::vocab::*;

impl RankExecutor {
    /// Pad if needed (§6), run the capacity and micro-batch schedulers (§4), take seats,
    /// index slots and blocks for the batch, pad an empty batch that had work; returns
    /// the batch size for the vote.
    pub(super) fn pad_and_schedule_batch(&mut self, global: PadIntent) -> u32 {
        let counts = self.iter.counts;
        let need = if self.resident.dummy.is_none() {
            pad_need(
                self.setup.pad_path,
                self.iter.expected,
                counts.pad_schedulable,
                global,
                self.setup.role == Role::Ctx,
            )
        } else {
            None
        };
        // Fixed: the dummy takes its KV and seat after the real requests took theirs, so
        // padding never starves the work it pads around (§6; e.g. a gen request whose
        // blocks to completion would no longer fit). The legacy predicate pads first, as
        // historically.
        let pad_first = self.setup.policy.pad.predicate == PadPredicate::Legacy;
        if pad_first && let Some(kind) = need {
            self.try_pad(kind);
        }
        let mut batch = self.bufs.batch();
        self.schedule_batch(&mut batch.entries);
        if !pad_first && let Some(kind) = need {
            self.try_pad(kind);
        }
        batch.number = BatchNumber(self.resident.next_batch);
        batch.rank = self.rank;
        // A rank whose batch is empty though it has schedulable work (e.g. its one
        // request does not fit in KV) pads so it does not veto the fleet (§6).
        if batch.entries.is_empty()
            && self.resident.dummy.is_none()
            && counts.schedulable > 0
            && self.setup.pad_path != PadPath::Never
        {
            self.try_pad(DummyKind::Generation);
        }
        if let Some(d) = &self.resident.dummy {
            batch.entries.push(dummy_entry(d));
        }
        let size = batch.entries.len() as u32;
        self.iter.batch = Some(batch);
        size
    }

    /// The dummy transaction, step 1 (§6): check capacity first (skip with a warning if
    /// there is none; never crash), then allocate tentatively.
    fn try_pad(&mut self, kind: DummyKind) {
        let draft = self.setup.sizes.draft_len;
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
            let freed = self.kv.rollback_dummy(kv);
            self.check_freed(freed, ReqId::DUMMY, true);
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
        self.resident.dummy = Some(dummy);
        self.iter.tentative = Some(TentativeDummy { kv, seat, kind });
        self.iter.stats.dummy_added = true;
        self.totals.dummies_added += 1;
    }

    fn skip_pad(&mut self, why: &str) {
        tracing::debug!(rank = %self.rank, iteration = self.iteration, why, "padding skipped");
        self.iter.stats.dummy_skipped_no_capacity = true;
        self.totals.dummies_skipped += 1;
    }

    /// Capacity then micro-batch scheduling; then the resources each entry needs: an index
    /// slot (none: deferred, "no free index slot"), a seat (none: the rank cannot seat an
    /// admitted request, a fatal violation), and blocks for the step (none: deferred).
    fn schedule_batch(&mut self, entries: &mut Vec<ForwardEntry>) {
        // The buffers leave `self.bufs` while the steps below borrow all of `self`.
        let mut classes = std::mem::take(&mut self.bufs.classes);
        let mut out = std::mem::take(&mut self.bufs.capacity);
        let mut planned = std::mem::take(&mut self.bufs.planned);
        self.capacity
            .schedule_with(&self.resident.active, &self.kv, &mut classes, &mut out);
        for &i in &out.paused {
            self.pause(i);
        }
        // Pausing and receive starts change requests in place; indices stay valid.
        // Receives start FCFS within the transport budget (§8): the first deferred one
        // stops the walk.
        let mut started_this_walk = 0usize;
        for &i in &out.disagg_gen_init {
            let blocks = self
                .kv
                .blocks_for_tokens(self.resident.active[i].spec.prompt_len);
            let walk = &out.disagg_gen_init[..started_this_walk];
            let in_flight = self
                .resident
                .active
                .iter()
                .enumerate()
                .filter(|(_, r)| r.state == RequestState::DisaggGenerationTransInProgress)
                .map(|(j, r)| crate::transfer_budget::InFlight {
                    blocks: self.kv.blocks_of(r.id()),
                    started_ns: r.transfer_started_ns.unwrap_or(0),
                    this_walk: walk.contains(&j),
                });
            match crate::transfer_budget::decide(
                self.setup.sizes.transfer_budget_blocks,
                in_flight,
                self.iter.now_ns,
                blocks,
            ) {
                crate::transfer_budget::BudgetDecision::Admit => {
                    self.start_receive(i);
                    started_this_walk += 1;
                }
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
            .resident
            .active
            .iter()
            .filter(|r| r.state == RequestState::DisaggGenerationTransInProgress)
            .count() as u32;
        self.totals.max_receives_in_flight = self.totals.max_receives_in_flight.max(receiving);
        let in_flight: BTreeSet<ReqId> = BTreeSet::new();
        self.micro.schedule_into(
            &self.resident.active,
            &out.fitting,
            &in_flight,
            &mut planned,
        );
        // ADP balance holds this iteration's context work on every rank alike.
        if self.iter.balance.holds_context() {
            planned.retain(|e| !matches!(e.kind, EntryKind::Context { .. }));
        }
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

    pub(super) fn prepare_entry(&mut self, index: usize, kind: EntryKind) -> Option<ForwardEntry> {
        let id = self.resident.active[index].id();
        if !self.resident.active[index].holds_kv {
            let r = &self.resident.active[index];
            match self
                .kv
                .add_sequence(id, &r.spec.block_hashes, r.spec.prompt_len)
            {
                Ok(reused) => {
                    let r = &mut self.resident.active[index];
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
                    self.iter.stats.deferrals_no_free_index_slot += 1;
                    self.totals.deferrals_no_free_index_slot += 1;
                    return None;
                }
                Err(KvError::OutOfBlocks { .. }) => {
                    self.iter.stats.deferrals_out_of_blocks += 1;
                    self.totals.deferrals_out_of_blocks += 1;
                    return None;
                }
                Err(e @ (KvError::DuplicateSequence(_) | KvError::UnknownSequence(_))) => {
                    // `holds_kv` said the pool has no sequence for it: the rank's own
                    // bookkeeping slipped; not a lack of blocks, so not counted as one.
                    self.kv_bookkeeping_slip(format!("request {id}: adding its sequence: {e}"));
                    return None;
                }
            }
        }
        if self.resident.active[index].seat.is_none() {
            match self.seats.try_take() {
                Some(seat) => {
                    self.resident.active[index].seat = Some(seat);
                    self.first_scheduled.push((id, self.iter.now_ns));
                }
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
        let r = &self.resident.active[index];
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
                self.iter.stats.deferrals_out_of_blocks += 1;
                self.totals.deferrals_out_of_blocks += 1;
                return None;
            }
            let tpb = self.setup.sizes.tokens_per_block;
            self.resident.active[index].kv_room = self.kv.blocks_for_tokens(need) * tpb;
        }
        debug_assert!(
            self.kv.blocks_of(id) * self.setup.sizes.tokens_per_block >= need,
            "request {id}: kv_room {} overstates its blocks",
            self.resident.active[index].kv_room
        );
        let path = crate::token_path::token_path(
            self.setup.role,
            self.rank,
            self.resident.next_batch,
            self.resident.active[index].spec.kv_source,
        );
        Some(ForwardEntry {
            id,
            seq: self.resident.active[index].seq,
            kind,
            kv_tokens,
            position,
            path,
            is_dummy: false,
        })
    }

    /// MAX_UTILIZATION pause: reset to context, free KV and seat; the tokens generated so
    /// far are recomputed with the prompt.
    fn pause(&mut self, index: usize) {
        self.totals.preemptions += 1;
        let id = self.resident.active[index].id();
        self.free_kv(id, self.resident.active[index].holds_kv);
        let r = &mut self.resident.active[index];
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
        self.iter.progressed = true;
    }

    /// gen side (§8): the capacity scheduler admitted a DISAGG_GENERATION_INIT request:
    /// reserve its KV and start the receive.
    fn start_receive(&mut self, i: usize) {
        let id = self.resident.active[i].id();
        let prompt = self.resident.active[i].spec.prompt_len;
        match self.kv.add_sequence(id, &[], prompt) {
            Ok(_) => {}
            Err(KvError::NoFreeIndexSlot { .. }) => {
                self.iter.stats.deferrals_no_free_index_slot += 1;
                self.totals.deferrals_no_free_index_slot += 1;
                return;
            }
            Err(_) => return,
        }
        if self.kv.ensure_tokens(id, prompt).is_err() {
            // Added just above: the sequence is there to free.
            self.free_kv(id, true);
            self.iter.stats.deferrals_out_of_blocks += 1;
            self.totals.deferrals_out_of_blocks += 1;
            return;
        }
        let tpb = self.setup.sizes.tokens_per_block;
        let kv_room = self.kv.blocks_for_tokens(prompt) * tpb;
        let now = self.iter.now_ns;
        let r = &mut self.resident.active[i];
        r.holds_kv = true;
        r.kv_room = kv_room;
        r.state = RequestState::DisaggGenerationTransInProgress;
        r.transfer_started_ns = Some(now);
        let from = r.spec.kv_source;
        self.totals.transfer_budget_admitted += 1;
        let blocks = self.kv.blocks_of(id);
        let block_ids = self.kv.block_ids_of(id).iter().map(|b| b.0).collect();
        self.iter.commands.push(TransferCommand::Receive {
            id,
            blocks,
            from,
            block_ids,
        });
    }

    /// The vote's outcome (§3.6, §6): commit or roll back the tentative dummy, and set
    /// up the forward step — the batch to launch (when `can_queue`) and the output to
    /// await (this batch's without overlap, the previous one's with it).
    pub(super) fn resolve_vote(&mut self, can_queue: bool) {
        if let Some(tentative) = self.iter.tentative.take() {
            self.resolve_dummy(tentative, can_queue);
        }
        let batch = self.iter.batch.take();
        // The §9 record counts what this rank scheduled, also when the fleet skips it.
        if let Some(b) = &batch {
            self.record_scheduled(b);
        }
        let own_work = self.iter.vote.batch_size > 0;
        let launch = if can_queue {
            self.resident.next_batch += 1;
            batch.map(|mut b| {
                self.fill_forward_inputs(&mut b);
                b
            })
        } else {
            self.totals.vetoed_iterations += 1;
            if let Some(b) = batch {
                self.bufs.recycle(b);
            }
            None
        };
        // Under overlap a skipped forward defers the previous batch on a rank that had
        // work of its own: its tokens wait, its retiring requests stay resident into the
        // next gather (§3; as production's `can_queue || !can_queue_this_rank`).
        self.iter.deferred = self.setup.sizes.overlap && !can_queue && own_work;
        if self.iter.deferred && self.resident.in_flight.is_some() {
            self.totals.deferred_batches += 1;
        }
        let awaited = if self.iter.deferred {
            None
        } else if self.setup.sizes.overlap {
            self.resident.in_flight.as_ref().map(|b| b.number)
        } else {
            launch.as_ref().map(|b| b.number)
        };
        self.iter.launched = launch;
        self.iter.awaited = awaited;
        self.iter.stats.forward_ran = can_queue;
    }

    /// At launch: what a model needs beyond the entries (when the host's device reads
    /// it), read here, where the state lives: each entry's block table as the KV
    /// manager holds it now, a context entry's prompt ids and block hashes, the rank's
    /// pool, and every [`LIVE_EVERY`]-th batch the requests the rank still holds. The
    /// buffers are the recycled batch's: refilled, not reallocated.
    fn fill_forward_inputs(&self, batch: &mut ScheduledBatch) {
        let inputs = &mut batch.inputs;
        inputs.clear();
        if !self.setup.forward_inputs {
            return;
        }
        inputs.filled = true;
        inputs.pool = KvPool {
            blocks: self.kv.total_blocks(),
            tokens_per_block: self.kv.tokens_per_block(),
        };
        let mut cursor = 0;
        for e in &batch.entries {
            if e.is_dummy {
                inputs.entries.push(EntryInputs::default());
                continue;
            }
            // Nothing leaves `active` between the schedule and the launch.
            let found = self.find_seq_from(&mut cursor, e.seq);
            debug_assert!(found.is_some(), "request {} launched, not resident", e.id);
            let Some(i) = found else {
                inputs.entries.push(EntryInputs::default());
                continue;
            };
            let spec = &self.resident.active[i].spec;
            let mut entry = EntryInputs {
                prompt_len: spec.prompt_len,
                sampling: spec.sampling,
                blocks: inputs.push_blocks(self.kv.block_table(e.id).iter().copied()),
                ..EntryInputs::default()
            };
            if let ForwardKind::Context { .. } = e.kind {
                (entry.prompt, entry.hashes) =
                    inputs.push_prompt(&spec.prompt_tokens, &spec.block_hashes);
            }
            // Most requests have neither: nothing is copied for them.
            if !spec.logit_bias.is_empty() || !spec.end_ids.is_empty() {
                (entry.logit_bias, entry.end_ids) =
                    inputs.push_logit_rules(&spec.logit_bias, &spec.end_ids);
            }
            inputs.entries.push(entry);
        }
        let n = batch.number.0;
        if n > 0 && n.is_multiple_of(LIVE_EVERY) {
            let r = &self.resident;
            let live = r
                .active
                .iter()
                .chain(&r.sending)
                .map(|q| q.spec.id)
                .chain(self.replicated.waiting.iter().map(|s| s.id))
                .collect();
            inputs.live = Some(live);
        }
    }

    fn resolve_dummy(&mut self, tentative: TentativeDummy, can_queue: bool) {
        if can_queue {
            self.kv.commit_dummy(tentative.kv);
            self.iter.stats.dummy_committed = true;
            self.totals.dummies_committed += 1;
        } else if self.setup.policy.pad.rollback {
            // Roll back exactly this dummy: its KV, its seat, itself. Nothing frees the
            // dummy between its allocation in this iteration and the vote.
            let freed = self.kv.rollback_dummy(tentative.kv);
            self.check_freed(freed, ReqId::DUMMY, true);
            self.seats.release(tentative.seat);
            self.resident.dummy = None;
            self.iter.stats.dummy_rolled_back = true;
            self.totals.dummies_rolled_back += 1;
        } else {
            // Legacy: nothing undoes the dummy; it survives into the next iteration.
            self.kv.commit_dummy(tentative.kv);
        }
    }

    /// The run stops at this vote (a fatal violation): the tentative dummy is rolled
    /// back with the rest of the iteration's work.
    pub(super) fn abandon_tentative(&mut self) {
        if let Some(tentative) = self.iter.tentative.take() {
            let freed = self.kv.rollback_dummy(tentative.kv);
            self.check_freed(freed, ReqId::DUMMY, true);
            self.seats.release(tentative.seat);
            self.resident.dummy = None;
        }
    }

    pub(super) fn free_dummy(&mut self) {
        if let Some(d) = self.resident.dummy.take() {
            // A resident dummy holds the KV its allocation took (a rollback clears both).
            self.free_kv(ReqId::DUMMY, true);
            if let Some(seat) = d.seat {
                self.seats.release(seat);
            }
        }
    }
}

fn dummy_entry(d: &Request) -> ForwardEntry {
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
        path: 0,
        is_dummy: true,
    }
}
