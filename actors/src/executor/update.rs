//! Phase 8 and 9 effects: launch effects (prefill progress, state transitions), token
//! effects (append, finish), and transfer completions (§3, §8).

use crate::config::Role;
use crate::request::RequestState;

use super::RankExecutor;
use super::messages::*;

impl RankExecutor {
    /// Effects of launching `batch`: prefill progress, KV growth, and the state updates
    /// of §3 (context finished → GENERATION_IN_PROGRESS; under overlap, a request whose
    /// next token is its last → GENERATION_TO_COMPLETE, i.e. retiring).
    pub(super) fn apply_launch(&mut self, batch: &ScheduledBatch) {
        let overlap = self.sizes.overlap;
        let mut cursor = 0;
        for e in batch.real_entries() {
            let Some(i) = self.find_seq_from(&mut cursor, e.seq) else {
                continue;
            };
            let max_new = self.effective_max_new(&self.active[i]);
            let r = &mut self.active[i];
            match e.kind {
                ForwardKind::Context { chunk, samples } => {
                    r.context_pos += chunk;
                    r.kv_tokens += chunk;
                    let computed = r.context_pos.min(r.spec.prompt_len);
                    if !r.spec.block_hashes.is_empty() {
                        let _ = self
                            .kv
                            .register_prefix(e.id, &r.spec.block_hashes, computed);
                    }
                    if samples {
                        r.next_position += 1;
                        r.state = if overlap && r.generated + 1 >= max_new {
                            RequestState::GenerationToComplete
                        } else {
                            RequestState::GenerationInProgress
                        };
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
        let finished = match self.role {
            Role::Ctx => Finish::ContextDone,
            Role::Agg | Role::Gen => Finish::Completed,
        };
        self.scratch.responses.reserve(batch.entries.len());
        // A finished request leaves `active` at the cursor: what precedes it is unchanged.
        let mut cursor = 0;
        for (e, &token) in batch.entries.iter().zip(&output.sampled) {
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
            let max_new = self.effective_max_new(&self.active[i]);
            let r = &mut self.active[i];
            let added = sampled.min(max_new.saturating_sub(r.generated));
            r.generated += added;
            let generated = r.generated;
            self.totals.output_tokens += u64::from(added);
            let done = generated >= max_new;
            self.scratch.responses.push(Response {
                id: e.id,
                new_tokens: added,
                last_token: token,
                generated,
                finish: done.then(|| finished.clone()),
            });
            if done {
                self.finish(i);
            }
        }
    }

    /// Tears down a finished request. ctx server: the request leaves the active list but
    /// keeps its KV until the send completes (§8).
    fn finish(&mut self, index: usize) {
        let mut r = self.active.remove(index);
        if let Some(seat) = r.seat.take() {
            self.seats.release(seat);
        }
        match self.role {
            Role::Ctx => {
                r.state = RequestState::DisaggContextTransInProgress;
                let blocks = self.kv.blocks_of(r.id());
                self.scratch
                    .commands
                    .push(TransferCommand::Send { id: r.id(), blocks });
                self.sending.push(r);
            }
            Role::Agg | Role::Gen => {
                r.state = RequestState::GenerationComplete;
                r.holds_kv = false;
                r.kv_room = 0;
                let _ = self.kv.free_sequence(r.id());
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
        if let Some(pos) = self.sending.iter().position(|r| r.id() == event.id) {
            let r = self.sending.remove(pos);
            let _ = self.kv.free_sequence(r.id());
            match failure {
                None => self.totals.completed += 1,
                Some(reason) => {
                    self.fail_after_transfer(&r, format!("kv send failed: {reason}"));
                }
            }
            return;
        }
        let Some(i) = self.find_active(event.id) else {
            return;
        };
        match failure {
            None => {
                let r = &mut self.active[i];
                r.state = RequestState::DisaggGenerationTransComplete;
                r.context_pos = r.context_len;
                r.kv_tokens = r.spec.prompt_len;
            }
            Some(reason) => {
                let r = self.active.remove(i);
                self.release(&r);
                self.fail_after_transfer(&r, format!("kv receive failed: {reason}"));
            }
        }
    }

    /// A failed transfer fails its request; the response goes out with the next
    /// iteration's gather (this one's has already happened).
    fn fail_after_transfer(&mut self, r: &crate::request::Request, reason: String) {
        self.totals.failed += 1;
        self.carried_responses.push(Response {
            id: r.id(),
            new_tokens: 0,
            last_token: 0,
            generated: r.generated,
            finish: Some(Finish::Failed(reason)),
        });
    }
}
