//! What one rank reports per iteration (mechanisms.md §9) and in total.

use serde::{Deserialize, Serialize};

use crate::counts::RankCounts;
use crate::ids::RankId;

use super::balance::{BalanceDecision, BalanceLoad};
use super::shape::BatchShape;
use crate::invariants::Violation;

use crate::vocab::TransferCommand;

/// One rank's record of one iteration (§9). Host and forward times are the driver's.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IterationStats {
    /// Iteration.
    pub iteration: u64,
    /// Rank.
    pub rank: RankId,
    /// When the iteration started: rank 0's clock at its fetch (the same on every rank).
    #[serde(default)]
    pub started_ns: u64,
    /// Whether the fleet ran the forward (`can_queue`).
    pub forward_ran: bool,
    /// Real requests in the batch this rank scheduled (dummies separate), also in an
    /// iteration whose forward the fleet skipped (see `forward_ran`).
    pub num_scheduled_requests: u32,
    /// Context requests in the batch.
    pub num_ctx_requests: u32,
    /// Context tokens in the batch.
    pub num_ctx_tokens: u32,
    /// Generation requests in the batch.
    pub num_gen_requests: u32,
    /// Dummies in the batch.
    pub num_dummies: u32,
    /// Counts after routing (before padding).
    pub counts: RankCounts,
    /// `expected` of this iteration.
    pub expected: u32,
    /// KV blocks used.
    pub kv_blocks_used: u32,
    /// KV blocks free.
    pub kv_blocks_free: u32,
    /// Seats held at the end of the iteration.
    pub seats_used: u32,
    /// Requests not started this iteration for lack of a KV index slot.
    pub deferrals_no_free_index_slot: u32,
    /// Requests not run this iteration for lack of KV blocks.
    pub deferrals_out_of_blocks: u32,
    /// A dummy was added tentatively.
    pub dummy_added: bool,
    /// The dummy was committed.
    pub dummy_committed: bool,
    /// The dummy was rolled back.
    pub dummy_rolled_back: bool,
    /// Padding was needed but skipped: no KV capacity or seat.
    pub dummy_skipped_no_capacity: bool,
    /// Requests routed to this rank so far.
    pub routed_to_rank: u64,
    /// Requests routed to all ranks so far (`currank_total_requests` =
    /// `routed_to_rank / routed_total`).
    pub routed_total: u64,
    /// Requests routed to this rank this iteration.
    pub routed_now: u32,
    /// Requests popped from the waiting queue this iteration (all ranks).
    pub admitted_now: u32,
    /// Transfer events (done, failed) this rank applied this iteration.
    pub transfer_events_applied: u32,
    /// Generation-first: requests this rank let prefill this iteration because their gen
    /// peer was named.
    pub generation_first_promoted: u32,
    /// Waiting queue length after admission (replicated).
    pub waiting: u32,
    /// Something changed this iteration (a real forward, a response, an admission, a
    /// transfer started or ended, a promotion, a pause).
    pub progressed: bool,
    /// Tokens this rank put into the forward (context chunk and generation tokens of
    /// real entries; dummies are not work); 0 when the fleet skipped the forward.
    #[serde(default)]
    pub num_tokens: u32,
    /// The most tokens any rank of the server put into this forward.
    #[serde(default)]
    pub max_rank_tokens: u32,
    /// The tokens of every rank of the server together.
    #[serde(default)]
    pub total_rank_tokens: u64,
    /// The server's DP ranks (the balance ratio's denominator).
    #[serde(default)]
    pub dp_ranks: u32,
    /// What ADP balance decided this iteration (`off` when it is not enabled).
    #[serde(default)]
    pub balance: BalanceDecision,
    /// This rank's context and generation work as ADP balance saw it (zero when off).
    #[serde(default)]
    pub balance_load: BalanceLoad,
}

/// Tokens one rank's batch puts into the forward: what the balance ratio compares.
pub fn rank_tokens(shape: &BatchShape) -> u32 {
    shape.ctx_tokens.saturating_add(shape.gen_tokens)
}

impl IterationStats {
    /// Records every rank's tokens from the votes' shapes (in rank order); a skipped
    /// forward ran nothing, anywhere.
    pub fn record_rank_tokens(
        &mut self,
        me: RankId,
        shapes: impl ExactSizeIterator<Item = BatchShape>,
        forward_ran: bool,
    ) {
        self.dp_ranks = shapes.len() as u32;
        self.num_tokens = 0;
        self.max_rank_tokens = 0;
        self.total_rank_tokens = 0;
        if !forward_ran {
            return;
        }
        for (i, shape) in shapes.enumerate() {
            let tokens = rank_tokens(&shape);
            if i == me.index() {
                self.num_tokens = tokens;
            }
            self.max_rank_tokens = self.max_rank_tokens.max(tokens);
            self.total_rank_tokens += u64::from(tokens);
        }
    }

    /// The balance ratio of this iteration: the ranks' mean tokens over their maximum
    /// (1 when every rank carried the same, 1/dp when one rank carried everything).
    /// `None` when no rank carried any token (an idle or skipped iteration): there is no
    /// imbalance to measure, so such iterations are left out of the mean and cost nothing
    /// in the speed-of-light time.
    pub fn balance_ratio(&self) -> Option<f64> {
        if self.max_rank_tokens == 0 || self.dp_ranks == 0 {
            return None;
        }
        Some(
            self.total_rank_tokens as f64
                / (f64::from(self.dp_ranks) * f64::from(self.max_rank_tokens)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(ctx_tokens: u32, gen_tokens: u32, dummies: u32) -> BatchShape {
        BatchShape {
            ctx_tokens,
            gen_tokens,
            dummies,
            ..BatchShape::default()
        }
    }

    #[test]
    fn the_balance_ratio_of_a_hand_built_iteration_is_mean_over_max() {
        // Four ranks: one prefills 1,000 tokens beside 3 decodes, two decode 4 and 2, one
        // runs only a dummy (no real token).
        let shapes = [
            shape(1000, 3, 0),
            shape(0, 4, 0),
            shape(0, 2, 0),
            shape(0, 0, 1),
        ];
        let mut s = IterationStats::default();
        s.record_rank_tokens(RankId(1), shapes.into_iter(), true);
        assert_eq!((s.num_tokens, s.max_rank_tokens), (4, 1003));
        assert_eq!((s.total_rank_tokens, s.dp_ranks), (1009, 4));
        // mean 1009 / 4 = 252.25, max 1003.
        let want = 252.25 / 1003.0;
        assert!((s.balance_ratio().unwrap() - want).abs() < 1e-12);
        // Perfectly even: 1.
        s.record_rank_tokens(
            RankId(0),
            [shape(5, 1, 0), shape(0, 6, 0)].into_iter(),
            true,
        );
        assert_eq!(s.balance_ratio(), Some(1.0));
    }

    #[test]
    fn an_iteration_without_tokens_or_forward_has_no_ratio() {
        let mut s = IterationStats::default();
        s.record_rank_tokens(
            RankId(0),
            [shape(0, 0, 1), shape(0, 0, 0)].into_iter(),
            true,
        );
        assert_eq!(s.balance_ratio(), None);
        // A skipped forward ran nothing, whatever the ranks scheduled.
        s.record_rank_tokens(
            RankId(0),
            [shape(7, 0, 0), shape(0, 1, 0)].into_iter(),
            false,
        );
        assert_eq!((s.num_tokens, s.max_rank_tokens, s.dp_ranks), (0, 0, 2));
        assert_eq!(s.balance_ratio(), None);
    }
}

/// One rank's output at the end of an iteration.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct IterationReport {
    /// §9 record.
    pub stats: IterationStats,
    /// §10 violations found this iteration.
    pub violations: Vec<Violation>,
    /// Transfers the driver must start.
    pub transfer_commands: Vec<TransferCommand>,
}

/// Cumulative counters of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankTotals {
    /// Iterations.
    pub iterations: u64,
    /// Iterations whose forward ran.
    pub forward_iterations: u64,
    /// Σ real requests in the batches the fleet forwarded.
    pub scheduled_requests: u64,
    /// Σ real requests this rank scheduled, over every iteration (a vetoed iteration's
    /// batch included, as the reference executor's log counts it).
    #[serde(default)]
    pub iteration_scheduled_requests: u64,
    /// Under overlap: iterations in which this rank's previous batch was deferred by a
    /// skipped forward (§3).
    #[serde(default)]
    pub deferred_batches: u64,
    /// Forward iterations in which this rank ran a dummy.
    pub dummy_iterations: u64,
    /// Iterations whose forward was vetoed by some rank.
    pub vetoed_iterations: u64,
    /// Requests routed to this rank.
    pub routed_requests: u64,
    /// A running digest of the ids routed here, in order (equal digests: the same
    /// routing assignments, whichever driver ran them).
    pub routing_digest: u64,
    /// Dummies added / committed / rolled back / skipped.
    pub dummies_added: u64,
    /// Committed.
    pub dummies_committed: u64,
    /// Rolled back.
    pub dummies_rolled_back: u64,
    /// Skipped for lack of capacity.
    pub dummies_skipped: u64,
    /// No free index slot deferrals.
    pub deferrals_no_free_index_slot: u64,
    /// Out of blocks deferrals.
    pub deferrals_out_of_blocks: u64,
    /// gen side, §8: receives the transport budget admitted.
    pub transfer_budget_admitted: u64,
    /// gen side, §8: times the budget deferred the head receive.
    pub transfer_budget_deferred: u64,
    /// gen side, §8: deferrals because receives in flight held the budget.
    pub transfer_budget_blocked_by_active: u64,
    /// gen side: the most receives in flight at once.
    pub max_receives_in_flight: u32,
    /// ctx side, generation-first mode: requests promoted from
    /// DISAGG_CONTEXT_WAIT_SCHEDULER once their gen peer was known.
    pub generation_first_promoted: u64,
    /// Requests completed on this rank.
    pub completed: u64,
    /// Requests failed on this rank.
    pub failed: u64,
    /// Output tokens produced on this rank.
    pub output_tokens: u64,
    /// Context tokens computed on this rank.
    pub context_tokens: u64,
    /// MAX_UTILIZATION pauses (preemptions: a started request reset to context, its KV
    /// freed, to be recomputed).
    #[serde(default)]
    pub preemptions: u64,
}
