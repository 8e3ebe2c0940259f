//! The forward's effects and the transfer phase (§3, §8): launch effects (prefill
//! progress, state transitions), token effects (append, respond, finish), and transfer
//! completions.

use crate::config::Role;
use crate::request::RequestState;

use super::RankExecutor;
use super::messages::*;
use crate::vocab::*;

impl RankExecutor {
    /// The awaited output arrived: process it and update states in the order of §3 —
    /// without overlap, this batch's launch effects then its tokens; with overlap, the
    /// previous batch's tokens (batch N) then this batch's launch effects (N+1). Then
    /// tear down the dummy, which never outlives the iteration of its forward (§6).
    pub(super) fn process_output(&mut self, output: Option<&ForwardOutput>) {
        let launched = self.iter.launched.take();
        if self.iter.deferred {
            // Nothing launched, and the previous batch stays pending (§3).
            debug_assert!(launched.is_none());
            return;
        }
        if self.setup.sizes.overlap {
            let prev = self.resident.in_flight.take();
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
            if self.resident.dummy.is_some() {
                self.free_dummy();
            }
        }
        // Under overlap the batch stays in flight until next iteration's output (moved,
        // not copied).
        if self.setup.sizes.overlap {
            self.resident.in_flight = launched;
        } else if let Some(batch) = launched {
            self.bufs.recycle(batch);
        }
    }

    /// The §9 record of the batch this rank scheduled (at the vote, whether or not the
    /// fleet runs the forward).
    pub(super) fn record_scheduled(&mut self, batch: &ScheduledBatch) {
        let s = &mut self.iter.stats;
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
        self.totals.iteration_scheduled_requests += u64::from(s.num_scheduled_requests);
    }

    /// Totals of a batch the fleet forwarded.
    fn record_batch(&mut self, batch: &ScheduledBatch) {
        let s = &self.iter.stats;
        // A forward of dummies only changes nothing but counters.
        if s.num_scheduled_requests > 0 {
            self.iter.progressed = true;
        }
        self.totals.forward_iterations += 1;
        self.totals.scheduled_requests += u64::from(s.num_scheduled_requests);
        self.totals.context_tokens += u64::from(s.num_ctx_tokens);
        if s.num_dummies > 0 {
            self.totals.dummy_iterations += 1;
        }
        debug_assert_eq!(
            batch.real_entries().count() as u32,
            s.num_scheduled_requests
        );
    }

    /// The transfer phase (§3.9): apply this rank's events, agreed in the allgather.
    pub(super) fn apply_transfers(&mut self) {
        let mut events = std::mem::take(&mut self.iter.status.events);
        self.iter.stats.transfer_events_applied = events.len() as u32;
        if !events.is_empty() {
            self.iter.progressed = true;
        }
        for event in events.drain(..) {
            self.apply_transfer(event);
        }
        // Back, empty, with its capacity.
        self.iter.status.events = events;
    }

    /// Effects of launching `batch`: prefill progress, KV growth, and the state updates
    /// of §3 (context finished → GENERATION_IN_PROGRESS; under overlap, a request whose
    /// next token is its last → GENERATION_TO_COMPLETE, i.e. retiring).
    pub(super) fn apply_launch(&mut self, batch: &ScheduledBatch) {
        let overlap = self.setup.sizes.overlap;
        let mut cursor = 0;
        for e in batch.real_entries() {
            let Some(i) = self.find_seq_from(&mut cursor, e.seq) else {
                continue;
            };
            let max_new = self.effective_max_new(&self.resident.active[i]);
            let r = &mut self.resident.active[i];
            match e.kind {
                ForwardKind::Context { chunk, samples } => {
                    r.context_pos += chunk;
                    r.kv_tokens += chunk;
                    let computed = r.context_pos.min(r.spec.prompt_len);
                    let registered = if r.spec.block_hashes.is_empty() {
                        Ok(())
                    } else {
                        self.kv
                            .register_prefix(e.id, &r.spec.block_hashes, computed)
                    };
                    if samples {
                        r.next_position += 1;
                        r.state = if overlap && r.generated + 1 >= max_new {
                            RequestState::GenerationToComplete
                        } else {
                            RequestState::GenerationInProgress
                        };
                    }
                    // Scheduled this iteration, so `prepare_entry` gave it a sequence; the
                    // only refusal (an unknown sequence) is an executor bug.
                    if let Err(err) = registered {
                        self.kv_bookkeeping_slip(format!("request {}: {err}", e.id));
                    }
                }
                ForwardKind::Generation { tokens } => {
                    r.kv_tokens += tokens;
                    r.next_position += tokens;
                    r.state = if overlap && r.generated + tokens >= max_new {
                        RequestState::GenerationToComplete
                    } else {
                        RequestState::GenerationInProgress
                    };
                }
            }
        }
    }

    /// Effects of `batch`'s sampled tokens: append, emit a response, finish requests that
    /// reached their length (freeing seat and KV; on a ctx server, start the KV send).
    pub(super) fn apply_tokens(&mut self, batch: &ScheduledBatch, output: &ForwardOutput) {
        let finished = match self.setup.role {
            Role::Ctx => Finish::ContextDone,
            Role::Agg | Role::Gen => Finish::Completed,
        };
        self.iter.responses.responses.reserve(batch.entries.len());
        // A finished request leaves `active` at the cursor: what precedes it is unchanged.
        let mut cursor = 0;
        // The entries that carry log-probabilities, in entry order.
        let mut logprobs = output.logprobs.iter().peekable();
        for (index, (e, &token)) in batch.entries.iter().zip(&output.sampled).enumerate() {
            let logprobs = logprobs
                .next_if(|(at, _)| *at as usize == index)
                .map(|(_, l)| l.clone());
            if e.is_dummy {
                continue;
            }
            let sampled = match e.kind {
                ForwardKind::Context { samples, .. } => u32::from(samples),
                ForwardKind::Generation { tokens } => tokens,
            };
            if sampled == 0 {
                continue;
            }
            let Some(i) = self.find_seq_from(&mut cursor, e.seq) else {
                continue;
            };
            let max_new = self.effective_max_new(&self.resident.active[i]);
            let r = &mut self.resident.active[i];
            let added = sampled.min(max_new.saturating_sub(r.generated));
            r.generated += added;
            let generated = r.generated;
            self.totals.output_tokens += u64::from(added);
            let done = generated >= max_new;
            self.iter.progressed = true;
            self.iter.responses.responses.push(Response {
                id: e.id,
                new_tokens: added,
                last_token: token,
                generated,
                finish: done.then(|| finished.clone()),
                logprobs,
            });
            if done {
                self.finish(i);
            }
        }
    }

    /// Tears down a finished request. ctx server: the request leaves the active list but
    /// keeps its KV until the send completes (§8).
    fn finish(&mut self, index: usize) {
        let mut r = self.resident.active.remove(index);
        if let Some(seat) = r.seat.take() {
            self.seats.release(seat);
        }
        match self.setup.role {
            Role::Ctx => {
                r.state = RequestState::DisaggContextTransInProgress;
                let blocks = self.kv.blocks_of(r.id());
                self.iter
                    .commands
                    .push(TransferCommand::Send { id: r.id(), blocks });
                self.resident.sending.push(r);
            }
            Role::Agg | Role::Gen => {
                r.state = RequestState::GenerationComplete;
                // Whatever the request's record says it holds is freed (`check_freed`).
                let held = std::mem::replace(&mut r.holds_kv, false);
                r.kv_room = 0;
                self.free_kv(r.id(), held);
                self.totals.completed += 1;
            }
        }
    }

    /// Applies one transfer event: a received KV makes the request schedulable as
    /// generation; a finished send frees the ctx-side KV; a failure fails that request
    /// only (error response, resources freed), never the server (§8).
    pub(super) fn apply_transfer(&mut self, event: TransferEvent) {
        let failure = match event.outcome {
            TransferOutcome::Done => None,
            TransferOutcome::Failed(reason) => Some(reason),
        };
        if let Some(pos) = self
            .resident
            .sending
            .iter()
            .position(|r| r.id() == event.id)
        {
            let r = self.resident.sending.remove(pos);
            self.free_kv(r.id(), r.holds_kv);
            match failure {
                None => self.totals.completed += 1,
                Some(reason) => self.fail_after_transfer(&r, Failure::KvSend(reason)),
            }
            return;
        }
        let Some(i) = self.find_active(event.id) else {
            return;
        };
        match failure {
            None => {
                let r = &mut self.resident.active[i];
                r.state = RequestState::DisaggGenerationTransComplete;
                r.context_pos = r.context_len;
                r.kv_tokens = r.spec.prompt_len;
            }
            Some(reason) => {
                let r = self.resident.active.remove(i);
                self.release(&r);
                self.fail_after_transfer(&r, Failure::KvReceive(reason));
            }
        }
    }

    /// A failed transfer fails its request; the response goes out with the next
    /// iteration's gather (this one's has already happened).
    fn fail_after_transfer(&mut self, r: &crate::request::Request, reason: Failure) {
        self.totals.failed += 1;
        self.carried_responses.push(Response {
            id: r.id(),
            new_tokens: 0,
            last_token: 0,
            generated: r.generated,
            finish: Some(Finish::Failed(reason)),
            logprobs: None,
        });
    }
}
