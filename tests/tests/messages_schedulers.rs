//! The capacity scheduler and the micro-batch scheduler as request/response actors
//! (mechanisms.md §4): scripted `active` lists over a real [`KvManager`] in, decisions
//! out. Single calls check one decision; a small scripted driver feeds every decision
//! back (KV through `KvCommand`s, request progress) to check sequences of iterations.

use std::collections::BTreeSet;

use lockstep_actors::config::{CapacitySchedulerPolicy, ContextChunkingPolicy};
use lockstep_actors::ids::ReqId;
use lockstep_actors::kv::{KvCommand, KvConfig, KvManager, KvReply};
use lockstep_actors::request::{Request, RequestSpec, RequestState};
use lockstep_actors::scheduler::{
    BatchEntry, CapacityConfig, CapacityOutput, CapacityScheduler, EntryKind, MicroBatchConfig,
    MicroBatchScheduler, PauseRule, published_window,
};

const TPB: u32 = 4;

fn kv(total_blocks: u32) -> KvManager {
    KvManager::new(KvConfig {
        tokens_per_block: TPB,
        total_blocks,
        enable_block_reuse: false,
        index_pool_size: 64,
    })
}

/// Gives `id` a sequence holding `tokens` tokens' worth of blocks.
fn hold(kv: &mut KvManager, id: u64, tokens: u32) {
    let added = kv.handle(KvCommand::AddSequence {
        id: ReqId(id),
        block_hashes: &[],
        prompt_len: tokens,
    });
    assert_eq!(added, Ok(KvReply::Added { reused_tokens: 0 }));
    let grown = kv.handle(KvCommand::EnsureTokens {
        id: ReqId(id),
        tokens,
    });
    assert_eq!(grown, Ok(KvReply::Done));
}

fn capacity_config(policy: CapacitySchedulerPolicy, max_num_requests: u32) -> CapacityConfig {
    CapacityConfig {
        policy,
        max_num_requests,
        window: published_window(false),
        window_ends_at_complete: false,
        count_transfers_as_requests: false,
        pause: PauseRule::ANY,
    }
}

fn capacity(policy: CapacitySchedulerPolicy, max_num_requests: u32) -> CapacityScheduler {
    CapacityScheduler::new(capacity_config(policy, max_num_requests))
}

const GNE: CapacitySchedulerPolicy = CapacitySchedulerPolicy::GuaranteedNoEvict;
const MAX_UTIL: CapacitySchedulerPolicy = CapacitySchedulerPolicy::MaxUtilization;
const STATIC: CapacitySchedulerPolicy = CapacitySchedulerPolicy::StaticBatch;
const FCFS: ContextChunkingPolicy = ContextChunkingPolicy::FirstComeFirstServed;
const EQUAL: ContextChunkingPolicy = ContextChunkingPolicy::EqualProgress;

fn micro(b: u32, t: u32, chunked: bool, policy: ContextChunkingPolicy) -> MicroBatchScheduler {
    MicroBatchScheduler::new(MicroBatchConfig {
        max_batch_size: b,
        max_num_tokens: t,
        enable_chunked_prefill: chunked,
        chunking_policy: policy,
        tokens_per_block: TPB,
    })
}

/// A new context.
fn ctx(id: u64, prompt: u32, max_new: u32) -> Request {
    Request::new(
        RequestSpec::new(id, prompt, max_new),
        RequestState::ContextInit,
    )
}

/// A request in `state` whose prompt is in the cache and one token was generated.
fn past_prefill(id: u64, prompt: u32, max_new: u32, state: RequestState) -> Request {
    let mut r = Request::new(RequestSpec::new(id, prompt, max_new), state);
    r.context_pos = prompt;
    r.kv_tokens = prompt;
    r.generated = 1;
    r.holds_kv = true;
    r
}

fn decoding(id: u64, prompt: u32, max_new: u32) -> Request {
    past_prefill(id, prompt, max_new, RequestState::GenerationInProgress)
}

fn ids(active: &[Request], indices: &[usize]) -> Vec<u64> {
    indices.iter().map(|&i| active[i].id().0).collect()
}

fn entries(active: &[Request], batch: &[BatchEntry]) -> Vec<(u64, EntryKind)> {
    batch
        .iter()
        .map(|e| (active[e.index].id().0, e.kind))
        .collect()
}

fn c(chunk: u32) -> EntryKind {
    EntryKind::Context { chunk }
}

fn g(tokens: u32) -> EntryKind {
    EntryKind::Generation { tokens }
}

// ---- one message, one decision: the capacity scheduler ----

#[test]
fn gne_reserves_in_progress_blocks_to_completion_before_admitting_new_contexts() {
    let mut kv = kv(8);
    // Request 2 decodes and holds 3 of the 4 blocks it needs to complete (8 + 8 tokens).
    hold(&mut kv, 2, 9);
    let mut active = vec![ctx(1, 8, 8), decoding(2, 8, 8)];
    active[1].kv_tokens = 9;
    // Free: 5. Request 2 reserves 1, so the new context (4 blocks to completion) fits.
    let out = capacity(GNE, 8).schedule(&active, &kv);
    assert_eq!(
        ids(&active, &out.fitting),
        vec![1, 2],
        "fitting is in active order"
    );
    assert!(out.paused.is_empty() && out.disagg_gen_init.is_empty());

    // One block fewer (another sequence takes it): the reservation wins, the new context
    // waits, although its prompt alone (2 blocks) would fit.
    hold(&mut kv, 99, 4);
    let out = capacity(GNE, 8).schedule(&active, &kv);
    assert_eq!(ids(&active, &out.fitting), vec![2]);
}

#[test]
fn gne_blocks_at_the_head_of_the_line_and_never_skips_ahead() {
    let kv = kv(6);
    // 24 + 8 tokens = 8 blocks: never fits in 6. The small one behind it would.
    let active = vec![ctx(1, 24, 8), ctx(2, 4, 4)];
    let out = capacity(GNE, 8).schedule(&active, &kv);
    assert_eq!(out, CapacityOutput::default());
    // Swapped, the small one fits and the big one still waits.
    let active = vec![ctx(2, 4, 4), ctx(1, 24, 8)];
    let out = capacity(GNE, 8).schedule(&active, &kv);
    assert_eq!(ids(&active, &out.fitting), vec![2]);
}

#[test]
fn gne_schedules_in_progress_requests_even_past_the_free_blocks_they_were_promised() {
    let mut kv = kv(4);
    hold(&mut kv, 1, 8);
    hold(&mut kv, 2, 8);
    let active = vec![decoding(1, 8, 64), decoding(2, 8, 64)];
    assert_eq!(kv.free_blocks(), 0);
    let out = capacity(GNE, 8).schedule(&active, &kv);
    assert_eq!(ids(&active, &out.fitting), vec![1, 2]);
    assert!(out.paused.is_empty(), "GUARANTEED_NO_EVICT never pauses");
}

#[test]
fn the_request_cap_bounds_in_progress_and_new_work_together() {
    let mut kv = kv(64);
    hold(&mut kv, 1, 8);
    let active = vec![decoding(1, 8, 4), ctx(2, 8, 4), ctx(3, 8, 4), ctx(4, 8, 4)];
    for (policy, cap, want) in [
        (GNE, 1, vec![1]),
        (GNE, 3, vec![1, 2, 3]),
        (MAX_UTIL, 2, vec![1, 2]),
        (MAX_UTIL, 8, vec![1, 2, 3, 4]),
        (STATIC, 3, vec![1]),
    ] {
        let out = capacity(policy, cap).schedule(&active, &kv);
        assert_eq!(ids(&active, &out.fitting), want, "{policy:?} cap {cap}");
    }
    let fresh = vec![ctx(2, 8, 4), ctx(3, 8, 4), ctx(4, 8, 4)];
    let out = capacity(STATIC, 2).schedule(&fresh, &kv);
    assert_eq!(ids(&fresh, &out.fitting), vec![2, 3]);
}

#[test]
fn retiring_requests_take_no_slot_unless_the_legacy_window_says_so() {
    let mut kv = kv(64);
    hold(&mut kv, 1, 9);
    hold(&mut kv, 2, 9);
    let active = vec![
        past_prefill(1, 8, 2, RequestState::GenerationToComplete),
        past_prefill(2, 8, 2, RequestState::GenerationToComplete),
        ctx(3, 8, 4),
        ctx(4, 8, 4),
    ];
    let fixed = capacity(GNE, 2).schedule(&active, &kv);
    assert_eq!(ids(&active, &fixed.fitting), vec![3, 4]);
    let legacy = CapacityScheduler::new(CapacityConfig {
        window_ends_at_complete: true,
        ..capacity_config(GNE, 2)
    })
    .schedule(&active, &kv);
    assert_eq!(legacy, CapacityOutput::default(), "the two retiring fill M");
    let legacy3 = CapacityScheduler::new(CapacityConfig {
        window_ends_at_complete: true,
        ..capacity_config(GNE, 3)
    })
    .schedule(&active, &kv);
    assert_eq!(
        ids(&active, &legacy3.fitting),
        vec![3],
        "never the retiring ones"
    );
}

#[test]
fn gen_arrivals_are_admitted_apart_by_blocks_to_completion_and_receives_take_no_slot() {
    let mut kv = kv(10);
    hold(&mut kv, 1, 8); // a receive in flight holds its prompt
    let active = vec![
        Request::new(
            RequestSpec::new(1, 8, 8),
            RequestState::DisaggGenerationTransInProgress,
        ),
        ctx(2, 8, 8),
        Request::new(
            RequestSpec::new(3, 8, 4),
            RequestState::DisaggGenerationInit,
        ),
        Request::new(
            RequestSpec::new(4, 8, 4),
            RequestState::DisaggGenerationInit,
        ),
    ];
    // Free 8, of which the receive in flight keeps 2 more for its completion (§4): the
    // context takes 4 to completion, and request 3 (3) no longer fits.
    let out = capacity(GNE, 1).schedule(&active, &kv);
    assert_eq!(ids(&active, &out.fitting), vec![2]);
    assert_eq!(ids(&active, &out.disagg_gen_init), Vec::<u64>::new());

    // Legacy: the receive in flight also takes the only slot, so no context is admitted
    // and both gen arrivals fit in the 6 blocks left.
    let legacy = CapacityScheduler::new(CapacityConfig {
        count_transfers_as_requests: true,
        ..capacity_config(GNE, 1)
    })
    .schedule(&active, &kv);
    assert!(legacy.fitting.is_empty(), "{legacy:?}");
    assert_eq!(ids(&active, &legacy.disagg_gen_init), vec![3, 4]);
}

#[test]
fn max_utilization_pauses_the_latest_started_request_when_a_step_does_not_fit() {
    let mut kv = kv(6);
    // Request 1: 6 tokens in 2 blocks, its next token fits. Requests 2 and 3: 8 tokens in
    // 2 full blocks, each next token needs a third. Nothing is free.
    hold(&mut kv, 1, 6);
    hold(&mut kv, 2, 8);
    hold(&mut kv, 3, 8);
    let mut active = vec![decoding(1, 6, 8), decoding(2, 8, 8), decoding(3, 8, 8)];
    active[0].kv_tokens = 6;
    let out = capacity(MAX_UTIL, 8).schedule(&active, &kv);
    // 1 starts (needs 0); 2 does not fit, so 1 (the latest started) is paused and its 2
    // blocks let 2 start; 3 then takes the last of them.
    assert_eq!(ids(&active, &out.fitting), vec![2, 3]);
    assert_eq!(ids(&active, &out.paused), vec![1]);

    // The scheduler is pure: asking again gives the same answer, KV untouched.
    assert_eq!(capacity(MAX_UTIL, 8).schedule(&active, &kv), out);
    assert_eq!(kv.free_blocks(), 0);
}

#[test]
fn max_utilization_admits_new_contexts_by_prompt_where_gne_needs_completion() {
    let kv = kv(3);
    let active = vec![ctx(1, 8, 64)];
    assert_eq!(
        ids(
            &active,
            &capacity(MAX_UTIL, 8).schedule(&active, &kv).fitting
        ),
        vec![1]
    );
    assert!(capacity(GNE, 8).schedule(&active, &kv).fitting.is_empty());
    assert!(
        capacity(STATIC, 8)
            .schedule(&active, &kv)
            .fitting
            .is_empty()
    );
}

// ---- one message, one decision: the micro-batch scheduler ----

#[test]
fn micro_batch_stops_at_b_entries_and_at_t_tokens_counting_draft_tokens() {
    let mut active: Vec<Request> = (1..=5).map(|id| decoding(id, 8, 8)).collect();
    let all: Vec<usize> = (0..5).collect();
    let none = BTreeSet::new();
    let out = micro(3, 100, false, FCFS).schedule(&active, &all, &none);
    assert_eq!(
        entries(&active, &out),
        vec![(1, g(1)), (2, g(1)), (3, g(1))]
    );

    for r in &mut active {
        r.spec.draft_len = 2;
    }
    let out = micro(8, 10, false, FCFS).schedule(&active, &all, &none);
    assert_eq!(
        entries(&active, &out),
        vec![(1, g(3)), (2, g(3)), (3, g(3))],
        "three 3-token steps fit in 10, a fourth does not"
    );
    assert_eq!(out.iter().map(BatchEntry::tokens).sum::<u32>(), 9);
}

#[test]
fn micro_batch_walks_only_fitting_in_order_and_skips_requests_in_flight() {
    let active = vec![
        decoding(1, 8, 8),
        ctx(2, 6, 4),
        decoding(3, 8, 8),
        ctx(4, 5, 4),
    ];
    let in_flight: BTreeSet<ReqId> = [ReqId(3)].into();
    let out = micro(8, 100, false, FCFS).schedule(&active, &[1, 2, 3], &in_flight);
    assert_eq!(entries(&active, &out), vec![(2, c(6)), (4, c(5))]);
}

#[test]
fn without_chunking_the_first_context_that_does_not_fit_ends_the_batch() {
    let active = vec![
        decoding(1, 8, 8),
        ctx(2, 20, 4),
        decoding(3, 8, 8),
        ctx(4, 2, 4),
    ];
    let out = micro(8, 16, false, FCFS).schedule(&active, &[0, 1, 2, 3], &BTreeSet::new());
    assert_eq!(entries(&active, &out), vec![(1, g(1))]);
}

#[test]
fn fcfs_chunking_gives_the_budget_in_order_in_whole_blocks_unless_a_chunk_finishes() {
    let active = vec![
        ctx(1, 10, 4),
        decoding(2, 8, 8),
        ctx(3, 10, 4),
        ctx(4, 3, 4),
    ];
    let fitting = [0, 1, 2, 3];
    let none = BTreeSet::new();
    // T = 16: the generation step takes 1; request 1 takes all 10; request 3 gets 5 cut
    // to 4 (one block); nothing is left for request 4.
    let out = micro(8, 16, true, FCFS).schedule(&active, &fitting, &none);
    assert_eq!(
        entries(&active, &out),
        vec![(1, c(10)), (2, g(1)), (3, c(4))]
    );
    // T = 14: request 3 gets 3, cut to 0 and left out; request 4 finishes in 3 tokens.
    let out = micro(8, 14, true, FCFS).schedule(&active, &fitting, &none);
    assert_eq!(
        entries(&active, &out),
        vec![(1, c(10)), (2, g(1)), (4, c(3))]
    );
}

#[test]
fn equal_progress_chunking_advances_every_context_a_block_per_round() {
    let active = vec![ctx(1, 10, 4), ctx(2, 10, 4), ctx(3, 6, 4)];
    let out = micro(8, 16, true, EQUAL).schedule(&active, &[0, 1, 2], &BTreeSet::new());
    // Round 1: 4 + 4 + 4; round 2: request 1 takes the last 4.
    assert_eq!(
        entries(&active, &out),
        vec![(1, c(8)), (2, c(4)), (3, c(4))]
    );
}

#[test]
fn a_fully_reused_prompt_still_computes_one_token() {
    let mut r = ctx(1, 8, 4);
    r.context_pos = 8;
    let active = vec![r];
    for chunked in [false, true] {
        let out = micro(8, 16, chunked, FCFS).schedule(&active, &[0], &BTreeSet::new());
        assert_eq!(entries(&active, &out), vec![(1, c(1))], "chunked={chunked}");
    }
}

// ---- scripted sequences: every decision fed back ----

/// A rank reduced to the two schedulers, a real KV manager and request progress,
/// applying each decision the way the executor does (§3.5, §3.8).
struct Rank {
    kv: KvManager,
    active: Vec<Request>,
    capacity: CapacityScheduler,
    micro: MicroBatchScheduler,
    iteration: usize,
    /// (request, iteration it completed in, tokens generated).
    done: Vec<(u64, usize, u32)>,
}

/// What one iteration decided, by request id.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Decided {
    fitting: Vec<u64>,
    paused: Vec<u64>,
    batch: Vec<(u64, EntryKind)>,
}

impl Rank {
    fn new(kv: KvManager, capacity: CapacityScheduler, micro: MicroBatchScheduler) -> Rank {
        Rank {
            kv,
            active: Vec::new(),
            capacity,
            micro,
            iteration: 0,
            done: Vec::new(),
        }
    }

    fn submit(&mut self, id: u64, prompt: u32, max_new: u32) {
        self.active.push(ctx(id, prompt, max_new));
    }

    fn iterate(&mut self) -> Decided {
        self.iteration += 1;
        let out = self.capacity.schedule(&self.active, &self.kv);
        let batch = self
            .micro
            .schedule(&self.active, &out.fitting, &BTreeSet::new());
        let decided = Decided {
            fitting: ids(&self.active, &out.fitting),
            paused: ids(&self.active, &out.paused),
            batch: entries(&self.active, &batch),
        };
        for &i in &out.paused {
            let r = &mut self.active[i];
            let freed = self.kv.handle(KvCommand::FreeSequence { id: r.id() });
            assert_eq!(freed, Ok(KvReply::Done), "a paused request held KV");
            r.context_len = r.kv_tokens + 1;
            r.context_pos = 0;
            r.kv_tokens = 0;
            r.holds_kv = false;
            r.state = RequestState::ContextInit;
        }
        for e in &batch {
            let r = &mut self.active[e.index];
            if !r.holds_kv {
                let added = self.kv.handle(KvCommand::AddSequence {
                    id: r.id(),
                    block_hashes: &[],
                    prompt_len: r.spec.prompt_len,
                });
                assert_eq!(added, Ok(KvReply::Added { reused_tokens: 0 }));
                r.holds_kv = true;
            }
            let need = r.kv_tokens + e.tokens();
            let grown = self.kv.handle(KvCommand::EnsureTokens {
                id: r.id(),
                tokens: need,
            });
            assert_eq!(
                grown,
                Ok(KvReply::Done),
                "iteration {}: the capacity scheduler admitted request {} but its step of {} \
                 tokens does not fit",
                self.iteration,
                r.id(),
                e.tokens()
            );
            match e.kind {
                EntryKind::Context { chunk } => {
                    r.context_pos += chunk;
                    r.kv_tokens += chunk;
                    if r.context_pos >= r.context_len {
                        r.state = RequestState::GenerationInProgress;
                        r.generated += 1;
                    }
                }
                EntryKind::Generation { tokens } => {
                    r.kv_tokens += tokens;
                    r.generated += tokens;
                }
            }
        }
        let kv = &mut self.kv;
        let iteration = self.iteration;
        let done = &mut self.done;
        self.active.retain(|r| {
            if r.generated < r.spec.max_new_tokens {
                return true;
            }
            let freed = kv.handle(KvCommand::FreeSequence { id: r.id() });
            assert_eq!(freed, Ok(KvReply::Done));
            done.push((r.id().0, iteration, r.generated));
            false
        });
        self.kv.check_invariants().expect("KV invariants");
        decided
    }
}

#[test]
fn gne_script_admits_a_third_request_only_when_blocks_to_completion_are_back() {
    // 8 blocks; each request needs 4 to completion (8 + 8 tokens): two at a time.
    let mut rank = Rank::new(kv(8), capacity(GNE, 8), micro(8, 64, false, FCFS));
    for id in 1..=3 {
        rank.submit(id, 8, 8);
    }
    let first = rank.iterate();
    assert_eq!(
        first,
        Decided {
            fitting: vec![1, 2],
            paused: vec![],
            batch: vec![(1, c(8)), (2, c(8))],
        }
    );
    for it in 2..=8 {
        let d = rank.iterate();
        assert_eq!(d.fitting, vec![1, 2], "iteration {it}");
        assert_eq!(d.batch, vec![(1, g(1)), (2, g(1))], "iteration {it}");
    }
    assert_eq!(rank.done, vec![(1, 8, 8), (2, 8, 8)]);
    assert_eq!(rank.kv.used_blocks(), 0);
    let ninth = rank.iterate();
    assert_eq!(ninth.batch, vec![(3, c(8))]);
    while !rank.active.is_empty() && rank.iteration < 50 {
        rank.iterate();
    }
    assert_eq!(rank.done.last(), Some(&(3, 16, 8)));
    assert_eq!((rank.kv.used_blocks(), rank.kv.free_blocks()), (0, 8));
}

#[test]
fn max_utilization_script_pauses_resets_and_recomputes_a_request() {
    // 6 blocks; three 8-token prompts fill them (2 blocks each) in the first iteration.
    let mut rank = Rank::new(kv(6), capacity(MAX_UTIL, 8), micro(8, 64, false, FCFS));
    for id in 1..=3 {
        rank.submit(id, 8, 4);
    }
    let first = rank.iterate();
    assert_eq!(first.batch, vec![(1, c(8)), (2, c(8)), (3, c(8))]);
    assert_eq!(rank.kv.free_blocks(), 0);

    // Every next token needs a third block: request 1 (first in line, nothing started
    // before it) is paused and gives its two blocks to 2 and 3.
    let second = rank.iterate();
    assert_eq!(
        second,
        Decided {
            fitting: vec![2, 3],
            paused: vec![1],
            batch: vec![(2, g(1)), (3, g(1))],
        }
    );
    let r1 = &rank.active[0];
    assert_eq!(r1.state, RequestState::ContextInit);
    assert!(!rank.kv.has_sequence(ReqId(1)));
    assert_eq!(
        r1.context_len, 9,
        "prompt plus the generated token is recomputed"
    );
    assert_eq!(r1.generated, 1, "what was generated is kept");

    // 2 and 3 finish (4 tokens: the prefill's and three steps) while 1 waits for room.
    let third = rank.iterate();
    assert_eq!(third.batch, vec![(2, g(1)), (3, g(1))]);
    let fourth = rank.iterate();
    assert_eq!(fourth.batch, vec![(2, g(1)), (3, g(1))]);
    assert_eq!(rank.done, vec![(2, 4, 4), (3, 4, 4)]);
    let fifth = rank.iterate();
    assert_eq!(
        fifth.batch,
        vec![(1, c(9))],
        "the recompute covers prompt + generated"
    );
    while !rank.active.is_empty() && rank.iteration < 50 {
        rank.iterate();
    }
    assert_eq!(rank.done.last(), Some(&(1, 7, 4)));
    assert_eq!(rank.kv.used_blocks(), 0);
}

#[test]
fn static_batch_script_holds_a_late_arrival_until_the_batch_has_drained() {
    let mut rank = Rank::new(kv(64), capacity(STATIC, 8), micro(8, 64, false, FCFS));
    rank.submit(1, 8, 3);
    rank.submit(2, 8, 2);
    assert_eq!(rank.iterate().batch, vec![(1, c(8)), (2, c(8))]);
    rank.submit(3, 8, 2);
    let second = rank.iterate();
    assert_eq!(second.fitting, vec![1, 2], "no new work while a batch runs");
    assert_eq!(rank.done, vec![(2, 2, 2)]);
    let third = rank.iterate();
    assert_eq!(third.batch, vec![(1, g(1))]);
    assert_eq!(rank.done.last(), Some(&(1, 3, 3)));
    assert_eq!(rank.iterate().batch, vec![(3, c(8))]);
}

#[test]
fn request_cap_script_keeps_at_most_m_requests_running() {
    let mut rank = Rank::new(kv(64), capacity(GNE, 2), micro(8, 64, false, FCFS));
    for id in 1..=4 {
        rank.submit(id, 4, 2);
    }
    assert_eq!(rank.iterate().batch, vec![(1, c(4)), (2, c(4))]);
    assert_eq!(rank.iterate().batch, vec![(1, g(1)), (2, g(1))]);
    assert_eq!(rank.done, vec![(1, 2, 2), (2, 2, 2)]);
    assert_eq!(rank.iterate().batch, vec![(3, c(4)), (4, c(4))]);
}

#[test]
fn chunked_prefill_script_fcfs_spreads_long_prompts_over_iterations() {
    let mut rank = Rank::new(kv(64), capacity(GNE, 8), micro(8, 16, true, FCFS));
    rank.submit(1, 20, 2);
    rank.submit(2, 20, 2);
    // 16 tokens a forward: request 1 first, in whole blocks.
    assert_eq!(rank.iterate().batch, vec![(1, c(16))]);
    assert_eq!(rank.active[0].context_pos, 16);
    // Request 1 finishes its prompt (4); request 2 gets the remaining 12.
    assert_eq!(rank.iterate().batch, vec![(1, c(4)), (2, c(12))]);
    // A generation step first charged, then the last 8 of request 2.
    assert_eq!(rank.iterate().batch, vec![(1, g(1)), (2, c(8))]);
    assert_eq!(rank.done, vec![(1, 3, 2)]);
    assert_eq!(rank.iterate().batch, vec![(2, g(1))]);
    assert_eq!(rank.done, vec![(1, 3, 2), (2, 4, 2)]);
}

#[test]
fn chunked_prefill_script_equal_progress_moves_contexts_in_step() {
    let mut rank = Rank::new(kv(64), capacity(GNE, 8), micro(8, 16, true, EQUAL));
    for id in 1..=3 {
        rank.submit(id, 10, 1);
    }
    assert_eq!(rank.iterate().batch, vec![(1, c(8)), (2, c(4)), (3, c(4))]);
    assert_eq!(rank.iterate().batch, vec![(1, c(2)), (2, c(6)), (3, c(6))]);
    // One output token each: the prefill's sample completes them.
    assert_eq!(rank.done, vec![(1, 2, 1), (2, 2, 1), (3, 2, 1)]);
    assert_eq!(rank.kv.used_blocks(), 0);
}

#[test]
fn max_utilization_admits_a_paused_request_only_when_its_recompute_fits() {
    let mut kv = kv(6);
    // Request 2 decodes in 4 blocks with room for its next token; 2 blocks are free.
    hold(&mut kv, 2, 16);
    let mut r2 = decoding(2, 8, 16);
    r2.kv_tokens = 15;
    // Request 1 was paused after 1 token: 9 tokens (3 blocks) to recompute.
    let mut r1 = ctx(1, 8, 4);
    r1.generated = 1;
    r1.context_len = 9;
    let active = vec![r1, r2];
    let out = capacity(MAX_UTIL, 8).schedule(&active, &kv);
    let batch = micro(8, 64, false, FCFS).schedule(&active, &out.fitting, &BTreeSet::new());
    for e in &batch {
        let r = &active[e.index];
        let need = kv.blocks_needed(r.id(), r.kv_tokens + e.tokens());
        assert!(
            need <= kv.free_blocks(),
            "request {} admitted with a step of {} tokens needing {need} blocks, {} free",
            r.id(),
            e.tokens(),
            kv.free_blocks()
        );
    }
}
