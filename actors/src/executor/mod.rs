//! The per-rank executor (mechanisms.md §3): one rank's control plane, stepped through
//! the iteration protocol by its host.
//!
//! The executor never performs I/O. Its host (the simulator's server stepper, the
//! threads and MPI rank host, the overhead benchmark, the loom model) asks it what it
//! needs next with [`RankExecutor::poll`] and hands the answer back with
//! [`RankExecutor::handle`], in the style of raft-rs's `RawNode`:
//!
//! ```text
//! loop {
//!     match exec.poll() {
//!         Io::Exchange(x)        => run the collective x names (its kind, tag and this
//!                                   rank's contribution), then exec.handle(result);
//!         Io::ReadIngress(mode)  => rank 0: read the ingress queue as `mode` says, then
//!                                   exec.handle(Input::Ingress(batch));
//!         Io::Forward { .. }     => launch the batch on the device, await the named
//!                                   output, then exec.handle(Input::Output(output));
//!         Io::IterationEnded(r)  => hand out r's transfer commands, record its stats;
//!         Io::Finished           => the server is drained: leave;
//!         Io::Stopped(why)       => a fatal violation: every rank stops here.
//!     }
//! }
//! ```
//!
//! The order of the collectives lives in one place, [`protocol`]; which of them a server
//! runs is its [`CollectiveSchedule`], fixed by configuration. Each collective's tag
//! comes from the executor, so a transport can compare tags across ranks and fail
//! loudly, naming both, when they disagree.
//!
//! Guardrails: counts come from [`RankCounts::of`]; seats come from [`DerivedSizes`];
//! the window comes from the capacity scheduler; the phase order comes from
//! [`protocol`] alone.

mod admission;
pub mod balance;
mod checks;
mod coast;
pub mod messages;
pub mod protocol;
mod schedule;
pub mod shape;
pub mod stats;
mod stretch;
mod update;

use std::collections::{BTreeSet, VecDeque};

use crate::config::{DerivedSizes, Role, ServerConfig, ServerLimits};
use crate::counts::RankCounts;
use crate::ids::{BatchNumber, RankId, ReqId};
use crate::kv::{KvConfig, KvManager};
use crate::padding::{PadPath, TentativeDummy};
use crate::policy::Policy;
use crate::request::{Request, RequestSpec, SchedulableWindow};
use crate::router::{RankLoad, Router};
use crate::scheduler::{
    BatchEntry, CapacityConfig, CapacityOutput, CapacityScheduler, Classes, MicroBatchConfig,
    MicroBatchScheduler, PauseRule, published_window,
};
use crate::seats::SlotPool;
use crate::vocab::{Response, TransferCommand, TransferEvent};

pub use admission::idle_decision;
pub use balance::{AdpBalance, BalanceDecision, BalanceLoad};
pub use messages::*;
pub use protocol::{Exchange, Input, Io, StopReason};
pub use shape::BatchShape;
pub use stats::{IterationReport, IterationStats, RankTotals};
pub use stretch::RankStretch;

use crate::invariants::Violation;

/// A caller error at the protocol boundary (an input the executor did not ask for, or a
/// malformed collective result). The executor is left unchanged; the host should abort
/// the group with this message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecutorError {
    /// A collective result has the wrong number of entries.
    #[error(
        "rank {rank}, iteration {iteration}: {} result has {got} entries, expected {want}", phase.name()
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
    /// The host handed an input the executor did not ask for.
    #[error("rank {rank}, iteration {iteration}: got {got} while awaiting {awaiting}")]
    UnexpectedInput {
        /// Rank.
        rank: RankId,
        /// Iteration.
        iteration: u64,
        /// What the executor awaited.
        awaiting: &'static str,
        /// What it got.
        got: &'static str,
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

/// What a rank is configured with; set once at construction.
#[derive(Debug)]
struct Setup {
    role: Role,
    sizes: DerivedSizes,
    policy: Policy,
    pad_path: PadPath,
    schedule: CollectiveSchedule,
    /// ctx server in generation-first mode (§8): arrivals wait for their gen peer.
    generation_first: bool,
    /// What the server can run (request validation reads it).
    limits: ServerLimits,
    window: SchedulableWindow,
    kv_full_check_every: u64,
    /// The host's device reads each launched batch's [`ForwardInputs`] (a real model):
    /// fill them at launch.
    forward_inputs: bool,
}

/// What every rank holds identically (§3.2: every rank applies the same broadcast).
#[derive(Debug, Default)]
struct Replicated {
    /// The waiting queue.
    waiting: VecDeque<RequestSpec>,
    /// Every request id ever accepted, to refuse duplicates.
    known_ids: crate::ids::ReqIdSet,
    /// Generation-first: waiting requests whose gen peer is already named; they arrive
    /// ready to prefill.
    peer_known: BTreeSet<ReqId>,
    /// A shutdown was read.
    shutdown: bool,
    /// The server stalled out (deadlocked): why, and every rank's requests were failed.
    stalled_out: Option<String>,
    /// Requests routed to all ranks so far.
    routed_total: u64,
}

/// This rank's requests.
#[derive(Debug, Default)]
struct Resident {
    /// Resident requests in admission order (`seq` increasing; the dummy is apart).
    active: Vec<Request>,
    /// The dummy, while alive.
    dummy: Option<Request>,
    /// ctx side: requests whose KV send is in flight (out of `active`, KV kept).
    sending: Vec<Request>,
    /// Overlap: the batch launched last iteration whose output is not processed yet.
    in_flight: Option<ScheduledBatch>,
    /// The next batch number.
    next_batch: u64,
    /// The next admission number.
    next_seq: u64,
    /// Requests routed here so far.
    routed_here: u64,
}

/// The working data of the iteration in progress, reset when one opens. What moves
/// between two collectives travels in the protocol's stage ([`protocol`]); this holds
/// what the iteration accumulates across all of them.
#[derive(Debug, Default)]
struct Iteration {
    /// Rank 0's clock for this iteration (from the fetch broadcast).
    now_ns: u64,
    /// This rank's contribution to the gather.
    state: RankState,
    /// This rank's vote.
    vote: BatchVote,
    /// Rank 0: what it read from the ingress, until the broadcast.
    read: Option<FetchBatch>,
    /// This rank's prefix matches for the popped requests (KV-aware routing).
    matches: PrefixMatches,
    /// This rank's transfer events for the transfer phase.
    status: TransferStatus,
    /// Every rank's load at the gather.
    loads: Vec<RankLoad>,
    /// ADP balance on: every rank's context and generation work (the gather's, plus
    /// what routing placed).
    balance_loads: Vec<balance::BalanceLoad>,
    /// This iteration's balance decision (replicated).
    balance: balance::BalanceDecision,
    /// Requests popped from the waiting queue, to route.
    popped: Vec<RequestSpec>,
    /// `expected` of this iteration's routing.
    expected: u32,
    /// This rank's counts after routing.
    counts: RankCounts,
    /// The counts taken at the gather and how many active requests they covered, while
    /// nothing but appends has changed `active` since (a cancellation clears it): the
    /// routed requests are then counted alone and added.
    gathered: Option<(RankCounts, usize)>,
    /// The tentative dummy, between padding and the vote.
    tentative: Option<TentativeDummy>,
    /// The batch scheduled, until the vote.
    batch: Option<ScheduledBatch>,
    /// The batch launched (after a positive vote), until its effects are applied.
    launched: Option<ScheduledBatch>,
    /// The output the forward step awaits.
    awaited: Option<BatchNumber>,
    /// Under overlap, the fleet skipped the forward while this rank had scheduled work:
    /// the previous batch stays pending, unprocessed, until a forward runs (§3).
    deferred: bool,
    /// Something changed this iteration (see [`RankState::progressed`]).
    progressed: bool,
    /// The §9 record.
    stats: IterationStats,
    /// §10 violations found so far.
    violations: Vec<Violation>,
    /// Transfers for the host to start.
    commands: Vec<TransferCommand>,
    /// This rank's responses, gathered to rank 0.
    responses: RankResponses,
}

/// Working buffers kept across iterations so that a steady-state iteration allocates
/// nothing; each user clears what it takes. Contents never carry meaning from one use to
/// the next.
#[derive(Debug, Default)]
struct Buffers {
    classes: Classes,
    capacity: CapacityOutput,
    planned: Vec<BatchEntry>,
    /// Batches that ended, their entry vectors and forward inputs reused for the next.
    spare_batches: Vec<ScheduledBatch>,
    ids: Vec<ReqId>,
}

impl Buffers {
    /// Keeps a dead batch for reuse (a few suffice: at most three batches are alive at
    /// once).
    fn recycle(&mut self, batch: ScheduledBatch) {
        if self.spare_batches.len() < 4 {
            self.spare_batches.push(batch);
        }
    }

    /// An empty batch, reused when one is spare.
    fn batch(&mut self) -> ScheduledBatch {
        let mut b = self.spare_batches.pop().unwrap_or_default();
        b.entries.clear();
        b.inputs.clear();
        b
    }
}

/// One rank's control plane.
#[derive(Debug)]
pub struct RankExecutor {
    rank: RankId,
    setup: Setup,
    replicated: Replicated,
    resident: Resident,
    kv: KvManager,
    seats: SlotPool,
    router: Router,
    capacity: CapacityScheduler,
    micro: MicroBatchScheduler,
    /// ADP balance (`attention_dp_config.enable_balance`), replicated on every rank.
    balance: Option<balance::AdpBalance>,
    /// Transfer events from the transceiver, applied at the next transfer phase.
    pending_transfer_events: Vec<TransferEvent>,
    /// Responses produced after the response gather (transfer failures), sent next time.
    carried_responses: Vec<Response>,
    /// Whether the last iteration changed anything (reported at the next gather).
    progressed_last: bool,
    /// The iteration this rank is in, by protocol step.
    stage: protocol::Stage,
    iter: Iteration,
    /// The report of the last iteration that ended.
    report: IterationReport,
    totals: RankTotals,
    iteration: u64,
    bufs: Buffers,
    /// The rank's state when the server stalled out (the deadlock's evidence).
    stalled_state: Option<String>,
    /// Why the rank stopped (a fatal violation here or on a peer).
    stop: Option<StopReason>,
    /// `(request, rank 0's clock at the iteration's fetch)` each time a request took a
    /// seat here, i.e. was scheduled for the first time (again after a pause): the
    /// report's queue time. 16 bytes per start; drivers read it at the end.
    first_scheduled: Vec<(ReqId, u64)>,
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
            pause: PauseRule {
                max_num_tokens: sizes.max_num_tokens,
                chunked_prefill: server.enable_chunked_prefill,
                prefill_only: server.role == Role::Ctx,
            },
        });
        let micro = MicroBatchScheduler::new(MicroBatchConfig {
            max_batch_size: sizes.max_batch_size,
            max_num_tokens: sizes.max_num_tokens,
            enable_chunked_prefill: server.enable_chunked_prefill,
            chunking_policy: server.scheduler_config.context_chunking_policy,
            tokens_per_block: sizes.tokens_per_block,
        });
        let pad_path = if sizes.dp <= 1 {
            PadPath::Never
        } else if server.role != Role::Agg && !sizes.overlap {
            PadPath::Intent
        } else {
            PadPath::Expected
        };
        let router = Router::new(server.attention_dp_config.router);
        let schedule = CollectiveSchedule {
            prefix_matches: router.needs_prefix_matches(),
            pad_intent: pad_path == PadPath::Intent,
            transfers: server.role != Role::Agg,
        };
        RankExecutor {
            rank,
            setup: Setup {
                role: server.role,
                sizes: sizes.clone(),
                policy,
                pad_path,
                schedule,
                generation_first: server.role == Role::Ctx
                    && server.cache_transceiver_config.generation_first,
                limits: ServerLimits::of(server, sizes),
                window,
                kv_full_check_every: default_kv_full_check_every(sizes.kv_blocks_per_rank),
                forward_inputs: false,
            },
            replicated: Replicated::default(),
            resident: Resident::default(),
            kv,
            seats: SlotPool::new(sizes.pools.seat_pool),
            router,
            capacity,
            micro,
            balance: balance::AdpBalance::new(&server.attention_dp_config, sizes.max_batch_size),
            pending_transfer_events: Vec::new(),
            carried_responses: Vec::new(),
            progressed_last: true,
            stage: protocol::Stage::Open,
            iter: Iteration::default(),
            report: IterationReport::default(),
            totals: RankTotals::default(),
            iteration: 0,
            bufs: Buffers::default(),
            stalled_state: None,
            stop: None,
            first_scheduled: Vec::new(),
        }
    }

    /// How often the KV pool's full structural check runs (every `n` iterations; 0:
    /// never). Conservation (used + free = total) is checked every iteration regardless.
    /// Default: [`default_kv_full_check_every`].
    pub fn set_kv_full_check_every(&mut self, n: u64) {
        self.setup.kv_full_check_every = n;
    }

    /// Whether each launched batch carries its [`ForwardInputs`] (block tables,
    /// prompts, the live list): a host whose device runs a real model says so; a
    /// token source that reads only the entries (the deterministic one, the modeled
    /// time) spares the rank the copies. Off by default.
    pub fn set_forward_inputs(&mut self, on: bool) {
        self.setup.forward_inputs = on;
    }

    /// This rank.
    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// The server's role.
    pub fn role(&self) -> Role {
        self.setup.role
    }

    /// The iteration in progress, or the next one between iterations.
    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    /// Which collectives this server's iteration runs.
    pub fn schedule(&self) -> CollectiveSchedule {
        self.setup.schedule
    }

    /// The counts of this rank now (§2).
    pub fn counts(&self) -> RankCounts {
        let r = &self.resident;
        RankCounts::of_rank(
            r.active.iter().chain(r.dummy.iter()),
            r.sending.len(),
            &self.setup.window,
            &self.setup.policy,
        )
    }

    /// Resident requests (admission order; the dummy excluded).
    pub fn active(&self) -> &[Request] {
        &self.resident.active
    }

    /// The dummy, if one is alive (between padding and the end of the iteration, or
    /// across iterations under legacy `pad.rollback`).
    pub fn dummy(&self) -> Option<&Request> {
        self.resident.dummy.as_ref()
    }

    /// ctx side: requests whose KV send is in flight.
    pub fn sending(&self) -> &[Request] {
        &self.resident.sending
    }

    /// The replicated waiting queue.
    pub fn waiting(&self) -> &VecDeque<RequestSpec> {
        &self.replicated.waiting
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
        &self.setup.sizes
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.setup.policy
    }

    /// Each time a request was first scheduled here (took a seat): the request and rank
    /// 0's clock at that iteration's fetch, in order.
    pub fn first_scheduled(&self) -> &[(ReqId, u64)] {
        &self.first_scheduled
    }

    /// Cumulative counters.
    pub fn totals(&self) -> &RankTotals {
        &self.totals
    }

    /// Whether a shutdown was read (replicated: every rank knows it in the same
    /// iteration).
    pub fn shutdown_received(&self) -> bool {
        self.replicated.shutdown
    }

    /// Whether the router is KV-aware.
    pub fn routes_by_prefix(&self) -> bool {
        self.router.needs_prefix_matches()
    }

    /// The batch this iteration launches (between the vote and the forward's output).
    pub fn launched(&self) -> Option<&ScheduledBatch> {
        self.iter.launched.as_ref()
    }

    /// The report of the last iteration that ended.
    pub fn last_report(&self) -> &IterationReport {
        &self.report
    }

    /// Why the server stalled out, and this rank's state at that moment (the evidence
    /// of a deadlock), if it did.
    pub fn stalled_out(&self) -> Option<(&str, &str)> {
        Some((
            self.replicated.stalled_out.as_deref()?,
            self.stalled_state.as_deref()?,
        ))
    }

    /// Whether a KV transfer of this rank is in flight (a send, or a receive).
    pub fn awaiting_transfer(&self) -> bool {
        !self.resident.sending.is_empty()
            || self
                .resident
                .active
                .iter()
                .any(|r| r.state == crate::request::RequestState::DisaggGenerationTransInProgress)
    }

    /// One line describing this rank's requests (for deadlock and watchdog reports).
    pub fn describe(&self) -> String {
        let c = self.counts();
        let mut by_state: std::collections::BTreeMap<i32, u32> = Default::default();
        for q in &self.resident.active {
            *by_state.entry(q.state.as_int()).or_default() += 1;
        }
        format!(
            "rank {}: live {} routable {} retiring {} schedulable {} sending {} waiting {} kv used {}/{} states {:?}",
            self.rank,
            c.live,
            c.routable,
            c.retiring,
            c.schedulable,
            self.resident.sending.len(),
            self.replicated.waiting.len(),
            self.kv.used_blocks(),
            self.kv.total_blocks(),
            by_state
        )
    }

    /// Delivers a transfer event from the transceiver; applied in the next transfer
    /// phase (a consensus collective, §3.9).
    pub fn handle_transfer_event(&mut self, event: TransferEvent) -> Result<(), ExecutorError> {
        let in_transfer = self.resident.sending.iter().any(|r| r.id() == event.id)
            || self.resident.active.iter().any(|r| {
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
        self.resident.active.iter().position(|r| r.id() == id)
    }

    /// Lookup of a batch entry's request: `active` is sorted by `seq`.
    fn find_seq(&self, seq: u64) -> Option<usize> {
        self.resident
            .active
            .binary_search_by_key(&seq, |r| r.seq)
            .ok()
    }

    /// [`RankExecutor::find_seq`] for a batch walked in order: entries come in increasing
    /// `seq` (the schedulers walk `active` in order), so each lookup resumes at `cursor`
    /// with a short forward scan instead of a binary search. Every request before
    /// `cursor` has a smaller `seq` than the last one looked up; a lookup out of order
    /// falls back to the binary search.
    fn find_seq_from(&self, cursor: &mut usize, seq: u64) -> Option<usize> {
        let a = &self.resident.active;
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
        r.seq = self.resident.next_seq;
        self.resident.next_seq += 1;
        self.resident.active.push(r);
    }

    fn effective_max_new(&self, r: &Request) -> u32 {
        match self.setup.role {
            // A ctx server produces the first token only (§8).
            Role::Ctx => r.spec.max_new_tokens.min(1),
            Role::Agg | Role::Gen => r.spec.max_new_tokens,
        }
    }
}
