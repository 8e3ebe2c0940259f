//! The per-rank executor (mechanisms.md §3): one iteration as a fixed sequence of phases
//! separated by collectives.
//!
//! Each phase is a method that consumes the token of the previous phase, takes the
//! previous collective's result, and returns this rank's contribution to the next
//! collective together with the next token. A driver therefore cannot skip or reorder a
//! collective: the sequence is fixed by the types, and data-dependent choices live
//! between collectives, never in whether one happens.
//!
//! Call order per iteration (every rank, every iteration):
//! 1. [`RankExecutor::begin_iteration`] → allgather [`RankState`];
//! 2. rank 0: [`RankExecutor::fetch_mode`] (block or poll the ingress queue) → broadcast
//!    [`FetchBatch`] → [`RankExecutor::on_fetch`] → allgather [`PrefixMatches`];
//! 3. [`RankExecutor::on_prefix_matches`] (route, cap check) → allreduce MAX [`PadIntent`];
//! 4. [`RankExecutor::on_pad_intent`] (pad, schedule) → allgather [`BatchVote`];
//! 5. [`RankExecutor::on_vote`] (commit or roll back the dummy) → the driver launches
//!    [`LaunchPlan::launch`] and hands back the output named by `await_output`;
//! 6. [`RankExecutor::on_forward_output`] (update, responses) → gather [`RankResponses`];
//! 7. [`RankExecutor::transfer_status`] → allgather [`TransferStatus`] →
//!    [`RankExecutor::on_transfer_status`] → [`IterationReport`] with the §10 checks.
//!
//! Guardrails: phases never call a collective; counts come from [`RankCounts::of`];
//! seats come from [`DerivedSizes`]; the window comes from the capacity scheduler.

pub mod messages;
mod phases;
pub mod stats;
mod update;

use std::collections::{BTreeSet, VecDeque};

use crate::config::{DerivedSizes, Role, ServerConfig};
use crate::counts::RankCounts;
use crate::ids::{BatchNumber, RankId, ReqId};
use crate::kv::{KvConfig, KvManager};
use crate::padding::{PadPath, TentativeDummy};
use crate::policy::Policy;
use crate::request::{Request, RequestSpec, SchedulableWindow};
use crate::router::{RankLoad, Router};
use crate::scheduler::{
    BatchEntry, CapacityConfig, CapacityOutput, CapacityScheduler, Classes, MicroBatchConfig,
    MicroBatchScheduler, published_window,
};
use crate::seats::SlotPool;

pub use messages::*;
pub use phases::idle_decision;
pub use stats::{IterationReport, IterationStats, RankTotals};

use crate::invariants::Violation;

/// A caller error at a phase boundary (a malformed collective result). The executor is
/// left unchanged; the driver should abort the group with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecutorError {
    /// A collective result has the wrong number of entries.
    #[error(
        "rank {rank}, iteration {iteration}: {phase:?} result has {got} entries, expected {want}"
    )]
    WrongArity {
        /// Rank.
        rank: RankId,
        /// Iteration.
        iteration: u64,
        /// Phase.
        phase: Phase,
        /// Entries received.
        got: usize,
        /// Entries expected (dp, or the popped count).
        want: usize,
    },
    /// The forward output does not belong to the awaited batch.
    #[error("rank {rank}: forward output for batch {got:?}, awaited {want:?}")]
    WrongBatch {
        /// Rank.
        rank: RankId,
        /// Batch received.
        got: Option<BatchNumber>,
        /// Batch awaited.
        want: Option<BatchNumber>,
    },
    /// A transfer event for a request this rank does not hold in a transfer state.
    #[error("rank {rank}: transfer event for {id}, which is not in transfer here")]
    UnknownTransfer {
        /// Rank.
        rank: RankId,
        /// Request.
        id: ReqId,
    },
}

/// The full structural walk of the KV pool is O(blocks): every iteration on pools of up
/// to 4,096 blocks (every test-sized pool), every 16,384 iterations on larger ones.
/// Conservation, seats, leaks, dummies, cap and routing are checked every iteration.
pub fn default_kv_full_check_every(kv_blocks: u32) -> u64 {
    if kv_blocks <= 4096 { 1 } else { 16_384 }
}

macro_rules! phase_token {
    ($(#[$doc:meta])* $name:ident, $phase:expr) => {
        $(#[$doc])*
        #[must_use = "the next phase of the iteration must run"]
        #[derive(Debug, PartialEq, Eq)]
        pub struct $name {
            iteration: u64,
        }
        impl $name {
            /// The tag of the collective this token waits for.
            pub fn tag(&self) -> CollectiveTag {
                CollectiveTag { iteration: self.iteration, phase: $phase }
            }
        }
    };
}

phase_token!(
    /// Waiting for the gather result and rank 0's fetch broadcast.
    AwaitFetch,
    Phase::Fetch
);
phase_token!(
    /// Waiting for the prefix-match allgather.
    AwaitPrefixMatches,
    Phase::PrefixMatch
);
phase_token!(
    /// Waiting for the pad-intent allreduce.
    AwaitPadIntent,
    Phase::PadIntent
);
phase_token!(
    /// Waiting for the batch-size vote.
    AwaitVote,
    Phase::Vote
);
phase_token!(
    /// Waiting for the forward output the launch plan named.
    AwaitForward,
    Phase::Responses
);
phase_token!(
    /// Ready to contribute this rank's transfer status.
    AwaitTransfers,
    Phase::Transfers
);
phase_token!(
    /// Waiting for the transfer-status allgather.
    AwaitTransferResult,
    Phase::Transfers
);

/// Per-iteration scratch, reset by `begin_iteration`.
#[derive(Debug, Default)]
struct Scratch {
    /// Rank 0's clock for this iteration (from the fetch broadcast).
    now_ns: u64,
    loads: Vec<RankLoad>,
    popped: Vec<RequestSpec>,
    expected: u32,
    counts: RankCounts,
    /// The counts taken at the gather and how many active requests they covered, while
    /// nothing but appends has changed `active` since (a cancellation clears it): the
    /// routed requests are then counted alone and added.
    gathered: Option<(RankCounts, usize)>,
    batch: Option<ScheduledBatch>,
    tentative: Option<TentativeDummy>,
    launched: Option<ScheduledBatch>,
    awaited: Option<BatchNumber>,
    stats: IterationStats,
    violations: Vec<Violation>,
    commands: Vec<crate::executor::messages::TransferCommand>,
    responses: Vec<Response>,
}

/// Working buffers kept across iterations so that a steady-state iteration allocates
/// nothing; each user clears what it takes. Contents never carry meaning from one use to
/// the next.
#[derive(Debug, Default)]
struct Buffers {
    classes: Classes,
    capacity: CapacityOutput,
    planned: Vec<BatchEntry>,
    /// Entry vectors of batches that ended, reused for the next batch.
    spare_entries: Vec<Vec<ForwardEntry>>,
    ids: Vec<ReqId>,
}

impl Buffers {
    /// Keeps a dead batch's entry vector for reuse (a few suffice: at most three batches
    /// are alive at once).
    fn recycle(&mut self, batch: ScheduledBatch) {
        if self.spare_entries.len() < 4 {
            self.spare_entries.push(batch.entries);
        }
    }

    /// An empty entry vector, reused when one is spare.
    fn entries(&mut self) -> Vec<ForwardEntry> {
        let mut v = self.spare_entries.pop().unwrap_or_default();
        v.clear();
        v
    }
}

/// One rank's control plane.
#[derive(Debug)]
pub struct RankExecutor {
    rank: RankId,
    role: Role,
    sizes: DerivedSizes,
    policy: Policy,
    pad_path: PadPath,
    /// ctx server in generation-first mode (§8): arrivals wait for their gen peer.
    generation_first: bool,
    /// Generation-first: waiting requests whose gen peer is already named (replicated:
    /// every rank reads the same fetches); they arrive ready to prefill.
    peer_known: BTreeSet<ReqId>,
    chunked_prefill: bool,
    window: SchedulableWindow,
    iteration: u64,
    /// Resident requests in admission order (the dummy is kept apart).
    active: Vec<Request>,
    /// The dummy, while alive.
    dummy: Option<Request>,
    /// ctx side: requests whose KV send is in flight (out of `active`, KV kept).
    sending: Vec<Request>,
    /// Replicated on every rank (§3.2).
    waiting: VecDeque<RequestSpec>,
    /// Every request id ever accepted (replicated), to refuse duplicates.
    known_ids: BTreeSet<ReqId>,
    kv: KvManager,
    seats: SlotPool,
    router: Router,
    capacity: CapacityScheduler,
    micro: MicroBatchScheduler,
    /// Overlap: the batch launched last iteration whose output is not processed yet.
    in_flight: Option<ScheduledBatch>,
    next_batch: u64,
    next_seq: u64,
    shutdown: bool,
    routed_to_rank: u64,
    routed_total: u64,
    pending_transfer_events: Vec<TransferEvent>,
    /// Responses produced after the response gather (transfer failures), sent next time.
    carried_responses: Vec<Response>,
    totals: RankTotals,
    scratch: Scratch,
    bufs: Buffers,
    kv_full_check_every: u64,
}

impl RankExecutor {
    /// A rank of `server`, with sizes from [`ServerConfig::derive`].
    pub fn new(
        rank: RankId,
        server: &ServerConfig,
        sizes: &DerivedSizes,
        policy: Policy,
    ) -> RankExecutor {
        let window = published_window(server.encoder_decoder);
        let kv = KvManager::new(KvConfig {
            tokens_per_block: sizes.tokens_per_block,
            total_blocks: sizes.kv_blocks_per_rank,
            enable_block_reuse: server.kv_cache_config.enable_block_reuse,
            index_pool_size: sizes.pools.kv_index_pool,
        });
        let capacity = CapacityScheduler::new(CapacityConfig {
            policy: server.scheduler_config.capacity_scheduler_policy,
            max_num_requests: sizes.max_admitted_per_rank,
            window,
            window_ends_at_complete: policy.admission.charge_retiring,
            count_transfers_as_requests: policy.gne.count_transfers_as_requests,
        });
        let micro = MicroBatchScheduler::new(MicroBatchConfig {
            max_batch_size: sizes.max_batch_size,
            max_num_tokens: sizes.max_num_tokens,
            enable_chunked_prefill: server.enable_chunked_prefill,
            chunking_policy: server.scheduler_config.context_chunking_policy,
            tokens_per_block: sizes.tokens_per_block,
        });
        let pad_path = if server.role != Role::Agg && !sizes.overlap {
            PadPath::Intent
        } else {
            PadPath::Expected
        };
        RankExecutor {
            rank,
            role: server.role,
            sizes: sizes.clone(),
            policy,
            pad_path,
            generation_first: server.role == Role::Ctx
                && server.cache_transceiver_config.generation_first,
            peer_known: BTreeSet::new(),
            chunked_prefill: server.enable_chunked_prefill,
            window,
            iteration: 0,
            active: Vec::new(),
            dummy: None,
            sending: Vec::new(),
            waiting: VecDeque::new(),
            known_ids: BTreeSet::new(),
            kv,
            seats: SlotPool::new(sizes.pools.seat_pool),
            router: Router::new(server.attention_dp_config.router, sizes.dp),
            capacity,
            micro,
            in_flight: None,
            next_batch: 0,
            next_seq: 0,
            shutdown: false,
            routed_to_rank: 0,
            routed_total: 0,
            pending_transfer_events: Vec::new(),
            carried_responses: Vec::new(),
            totals: RankTotals::default(),
            scratch: Scratch::default(),
            bufs: Buffers::default(),
            kv_full_check_every: default_kv_full_check_every(sizes.kv_blocks_per_rank),
        }
    }

    /// How often the KV pool's full structural check runs (every `n` iterations; 0:
    /// never). Conservation (used + free = total) is checked every iteration regardless.
    /// Default: [`default_kv_full_check_every`].
    pub fn set_kv_full_check_every(&mut self, n: u64) {
        self.kv_full_check_every = n;
    }

    /// This rank.
    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// The next iteration's number.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// The counts of this rank now (§2).
    pub fn counts(&self) -> RankCounts {
        RankCounts::of_rank(
            self.active.iter().chain(self.dummy.iter()),
            self.sending.len(),
            &self.window,
            &self.policy,
        )
    }

    /// Resident requests (admission order; the dummy excluded).
    pub fn active(&self) -> &[Request] {
        &self.active
    }

    /// The dummy, if one is alive (between padding and the end of the iteration, or
    /// across iterations under legacy `pad.rollback`).
    pub fn dummy(&self) -> Option<&Request> {
        self.dummy.as_ref()
    }

    /// ctx side: requests whose KV send is in flight.
    pub fn sending(&self) -> &[Request] {
        &self.sending
    }

    /// The replicated waiting queue.
    pub fn waiting(&self) -> &VecDeque<RequestSpec> {
        &self.waiting
    }

    /// The KV manager (read-only).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Seats held.
    pub fn seats_used(&self) -> u32 {
        self.seats.used()
    }

    /// The derived sizes this rank runs with.
    pub fn sizes(&self) -> &DerivedSizes {
        &self.sizes
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Cumulative counters.
    pub fn totals(&self) -> &RankTotals {
        &self.totals
    }

    /// Whether a shutdown was received and everything drained on this rank (the driver
    /// checks all ranks and the replicated waiting queue).
    pub fn is_drained(&self) -> bool {
        self.shutdown
            && self.active.is_empty()
            && self.sending.is_empty()
            && self.waiting.is_empty()
            && self.in_flight.is_none()
    }

    /// Whether a shutdown was read (replicated: every rank knows it in the same
    /// iteration). Drivers stop when it is set, the gathered live count is zero and the
    /// waiting queue is empty.
    pub fn shutdown_received(&self) -> bool {
        self.shutdown
    }

    /// Whether the router is KV-aware (its prefix-match allgather carries data).
    pub fn routes_by_prefix(&self) -> bool {
        self.router.needs_prefix_matches()
    }

    /// Delivers a transfer event from the transceiver; applied in the next transfer
    /// phase (a consensus collective, §3.9).
    pub fn handle_transfer_event(&mut self, event: TransferEvent) -> Result<(), ExecutorError> {
        let in_transfer = self.sending.iter().any(|r| r.id() == event.id)
            || self.active.iter().any(|r| {
                r.id() == event.id
                    && r.state == crate::request::RequestState::DisaggGenerationTransInProgress
            });
        if !in_transfer {
            return Err(ExecutorError::UnknownTransfer {
                rank: self.rank,
                id: event.id,
            });
        }
        self.pending_transfer_events.push(event);
        Ok(())
    }

    /// Linear lookup by id, for rare inputs (cancellations, transfer events).
    fn find_active(&self, id: ReqId) -> Option<usize> {
        self.active.iter().position(|r| r.id() == id)
    }

    /// Lookup of a batch entry's request: `active` is sorted by `seq`.
    fn find_seq(&self, seq: u64) -> Option<usize> {
        self.active.binary_search_by_key(&seq, |r| r.seq).ok()
    }

    /// [`RankExecutor::find_seq`] for a batch walked in order: entries come in increasing
    /// `seq` (the schedulers walk `active` in order), so each lookup resumes at `cursor`
    /// with a short forward scan instead of a binary search. Every request before
    /// `cursor` has a smaller `seq` than the last one looked up; a lookup out of order
    /// falls back to the binary search.
    fn find_seq_from(&self, cursor: &mut usize, seq: u64) -> Option<usize> {
        let a = &self.active;
        // The common cases first: the request at the cursor (the one found last was
        // removed) or the one after it.
        for i in [*cursor, *cursor + 1] {
            if a.get(i).is_some_and(|r| r.seq == seq) {
                *cursor = i;
                return Some(i);
            }
        }
        if *cursor > a.len() || (*cursor > 0 && a[*cursor - 1].seq >= seq) {
            return self.find_seq(seq);
        }
        let mut i = *cursor;
        while i < a.len() && a[i].seq < seq {
            i += 1;
        }
        *cursor = i;
        (i < a.len() && a[i].seq == seq).then_some(i)
    }

    /// Appends a newly routed request, keeping `active` sorted by `seq`.
    fn push_active(&mut self, mut r: Request) {
        r.seq = self.next_seq;
        self.next_seq += 1;
        self.active.push(r);
    }

    fn effective_max_new(&self, r: &Request) -> u32 {
        match self.role {
            // A ctx server produces the first token only (§8).
            Role::Ctx => r.spec.max_new_tokens.min(1),
            Role::Agg | Role::Gen => r.spec.max_new_tokens,
        }
    }
}
