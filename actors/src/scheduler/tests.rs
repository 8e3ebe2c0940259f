//! Scheduler tests: the rules of mechanisms.md §4 and the two legacy switches of §2/§4,
//! against a small fake [`KvView`] (the real KV manager is tested on its own).

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::config::{CapacitySchedulerPolicy, ContextChunkingPolicy};
use crate::ids::ReqId;
use crate::kv::KvView;
use crate::request::{Request, RequestSpec, RequestState};

const TPB: u32 = 4;

/// A KV pool reduced to what the schedulers read: free blocks and blocks held per id.
#[derive(Debug, Clone, Default)]
struct FakeKv {
    free: u32,
    held: BTreeMap<ReqId, u32>,
}

impl FakeKv {
    fn new(free: u32) -> FakeKv {
        FakeKv {
            free,
            held: BTreeMap::new(),
        }
    }

    fn hold(mut self, id: u64, blocks: u32) -> FakeKv {
        self.held.insert(ReqId(id), blocks);
        self
    }
}

impl KvView for FakeKv {
    fn tokens_per_block(&self) -> u32 {
        TPB
    }
    fn free_blocks(&self) -> u32 {
        self.free
    }
    fn has_sequence(&self, id: ReqId) -> bool {
        self.held.contains_key(&id)
    }
    fn blocks_needed(&self, id: ReqId, tokens: u32) -> u32 {
        tokens.div_ceil(TPB).saturating_sub(self.blocks_of(id))
    }
    fn blocks_of(&self, id: ReqId) -> u32 {
        self.held.get(&id).copied().unwrap_or(0)
    }
}

/// A new context: nothing prefilled.
fn ctx(id: u64, prompt: u32, max_new: u32) -> Request {
    Request::new(
        RequestSpec::new(id, prompt, max_new),
        RequestState::ContextInit,
    )
}

/// A request past its prefill in `state`, one token generated.
fn decoding(id: u64, prompt: u32, max_new: u32, state: RequestState) -> Request {
    let mut r = Request::new(RequestSpec::new(id, prompt, max_new), state);
    r.context_pos = prompt;
    r.kv_tokens = prompt;
    r.generated = 1;
    r
}

fn gen_req(id: u64, prompt: u32, max_new: u32) -> Request {
    decoding(id, prompt, max_new, RequestState::GenerationInProgress)
}

fn capacity(policy: CapacitySchedulerPolicy, max_num_requests: u32) -> CapacityConfig {
    CapacityConfig {
        policy,
        max_num_requests,
        window: published_window(false),
        window_ends_at_complete: false,
        count_transfers_as_requests: false,
        pause: PauseRule::ANY,
    }
}

fn gne(max_num_requests: u32) -> CapacityScheduler {
    CapacityScheduler::new(capacity(
        CapacitySchedulerPolicy::GuaranteedNoEvict,
        max_num_requests,
    ))
}

fn micro(b: u32, t: u32, chunked: bool, policy: ContextChunkingPolicy) -> MicroBatchScheduler {
    MicroBatchScheduler::new(MicroBatchConfig {
        max_batch_size: b,
        max_num_tokens: t,
        enable_chunked_prefill: chunked,
        chunking_policy: policy,
        tokens_per_block: TPB,
    })
}

fn kinds(entries: &[BatchEntry]) -> Vec<(usize, EntryKind)> {
    entries.iter().map(|e| (e.index, e.kind)).collect()
}

fn ctx_entry(index: usize, chunk: u32) -> (usize, EntryKind) {
    (index, EntryKind::Context { chunk })
}

fn gen_entry(index: usize, tokens: u32) -> (usize, EntryKind) {
    (index, EntryKind::Generation { tokens })
}

// ---- capacity: GUARANTEED_NO_EVICT ----

#[test]
fn gne_reserves_in_progress_requests_before_considering_new_contexts() {
    // The new context comes first in `active` and would fit alone (4 blocks), but the
    // decoding request's reservation to completion (4 blocks, 3 held) is taken first.
    let active = [ctx(1, 8, 8), gen_req(2, 8, 8)];
    let kv = FakeKv::new(4).hold(2, 3);
    let out = gne(8).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![1]);
    assert!(out.paused.is_empty());
    // With one more block the context fits too, and `fitting` is in `active` order.
    let kv = FakeKv::new(5).hold(2, 3);
    assert_eq!(gne(8).schedule(&active, &kv).fitting, vec![0, 1]);
}

#[test]
fn gne_schedules_in_progress_requests_even_when_their_reservation_exceeds_free_blocks() {
    let active = [gen_req(1, 8, 64), gen_req(2, 8, 64)];
    let kv = FakeKv::new(0).hold(1, 3).hold(2, 3);
    let out = gne(8).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![0, 1]);
}

#[test]
fn gne_treats_a_started_chunked_prefill_as_in_progress() {
    // Request 1 holds a sequence (a chunk was prefilled), so it is scheduled even though
    // its remaining blocks exceed what is free; request 2 is new and must fit.
    let mut started = ctx(1, 32, 8);
    started.context_pos = 16;
    let active = [started, ctx(2, 4, 4)];
    let kv = FakeKv::new(3).hold(1, 4);
    let out = gne(8).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![0]);
}

#[test]
fn gne_stops_at_the_first_new_context_that_does_not_fit_head_of_line() {
    // Request 1 needs 8 blocks to completion, 5 are free; request 2 needs 2 and would fit
    // but FCFS does not let it overtake.
    let active = [ctx(1, 16, 16), ctx(2, 4, 4)];
    let out = gne(8).schedule(&active, &FakeKv::new(5));
    assert!(out.fitting.is_empty());
    // Once the head fits, both go.
    let out = gne(8).schedule(&active, &FakeKv::new(10));
    assert_eq!(out.fitting, vec![0, 1]);
}

#[test]
fn gne_stops_new_contexts_at_the_request_cap() {
    let active = [ctx(1, 4, 4), ctx(2, 4, 4), ctx(3, 4, 4)];
    let out = gne(2).schedule(&active, &FakeKv::new(100));
    assert_eq!(out.fitting, vec![0, 1]);
}

#[test]
fn gne_fits_disagg_generation_init_separately_without_taking_a_request_slot() {
    let init = |id, prompt, max_new| {
        let mut r = Request::new(
            RequestSpec::new(id, prompt, max_new),
            RequestState::DisaggGenerationInit,
        );
        r.generated = 1;
        r
    };
    // Cap 1 is taken by the decoding request; the arrivals need 2, 20 and 2 blocks.
    let active = [
        gen_req(1, 4, 4),
        init(2, 4, 4),
        init(3, 40, 40),
        init(4, 4, 4),
    ];
    let kv = FakeKv::new(10).hold(1, 2);
    let out = gne(1).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![0]);
    // Index 2 does not fit in the 10 blocks left, which stops the walk before index 3.
    assert_eq!(out.disagg_gen_init, vec![1]);
}

#[test]
fn gne_charges_disagg_generation_init_after_new_contexts() {
    let mut init = Request::new(
        RequestSpec::new(2, 8, 8),
        RequestState::DisaggGenerationInit,
    );
    init.generated = 1;
    // The context takes 4 of 6 blocks; the arrival needs 4.
    let active = [ctx(1, 8, 8), init];
    let out = gne(4).schedule(&active, &FakeKv::new(6));
    assert_eq!(out.fitting, vec![0]);
    assert!(out.disagg_gen_init.is_empty());
}

#[test]
fn a_decoder_awaiting_its_encoder_output_is_not_scheduled() {
    let mut waiting = ctx(1, 4, 4);
    waiting.awaiting_encoder_output = true;
    let active = [waiting, ctx(2, 4, 4)];
    let out = gne(8).schedule(&active, &FakeKv::new(100));
    assert_eq!(out.fitting, vec![1]);
}

// ---- capacity: legacy switches ----

#[test]
fn legacy_window_ending_at_complete_lets_retiring_requests_crowd_out_a_new_context() {
    let active = [
        decoding(1, 8, 2, RequestState::GenerationToComplete),
        decoding(2, 8, 2, RequestState::GenerationToComplete),
        ctx(3, 8, 8),
    ];
    let kv = FakeKv::new(100).hold(1, 3).hold(2, 3);
    let fixed = gne(2).schedule(&active, &kv);
    assert_eq!(fixed.fitting, vec![2]);

    let mut config = capacity(CapacitySchedulerPolicy::GuaranteedNoEvict, 2);
    config.window_ends_at_complete = true;
    let legacy = CapacityScheduler::new(config).schedule(&active, &kv);
    assert!(legacy.fitting.is_empty(), "{legacy:?}");
}

#[test]
fn legacy_transfer_counting_lets_receives_in_flight_take_the_request_slots() {
    let active = [
        decoding(1, 8, 8, RequestState::DisaggGenerationTransInProgress),
        decoding(2, 8, 8, RequestState::DisaggGenerationTransInProgress),
        decoding(3, 8, 8, RequestState::DisaggGenerationTransComplete),
    ];
    let kv = FakeKv::new(100).hold(1, 4).hold(2, 4).hold(3, 4);
    let fixed = gne(2).schedule(&active, &kv);
    assert_eq!(fixed.fitting, vec![2]);

    let mut config = capacity(CapacitySchedulerPolicy::GuaranteedNoEvict, 2);
    config.count_transfers_as_requests = true;
    let legacy = CapacityScheduler::new(config).schedule(&active, &kv);
    assert!(legacy.fitting.is_empty(), "{legacy:?}");
}

// ---- capacity: MAX_UTILIZATION and STATIC_BATCH ----

fn max_util(max_num_requests: u32) -> CapacityScheduler {
    CapacityScheduler::new(capacity(
        CapacitySchedulerPolicy::MaxUtilization,
        max_num_requests,
    ))
}

#[test]
fn max_utilization_pauses_the_most_recently_started_request_when_a_step_does_not_fit() {
    // Each request holds 1 block with 4 tokens cached; its next step needs a 2nd block.
    let active = [gen_req(1, 4, 8), gen_req(2, 4, 8), gen_req(3, 4, 8)];
    let kv = FakeKv::new(2).hold(1, 1).hold(2, 1).hold(3, 1);
    let out = max_util(8).schedule(&active, &kv);
    // 1 and 2 take the 2 free blocks; 3 does not fit, so 2 (started last) is paused,
    // giving back its held block and its step.
    assert_eq!(out.fitting, vec![0, 2]);
    assert_eq!(out.paused, vec![1]);
}

#[test]
fn max_utilization_pauses_the_request_itself_when_nothing_else_can_be_paused() {
    let active = [gen_req(1, 4, 8), ctx(2, 8, 4)];
    let kv = FakeKv::new(0).hold(1, 1);
    let out = max_util(8).schedule(&active, &kv);
    assert!(out.fitting.is_empty());
    assert_eq!(out.paused, vec![0]);
    // Its freed block is then available: a 1-block prompt fits into it.
    let active = [gen_req(1, 4, 8), ctx(2, 4, 100)];
    let out = max_util(8).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![1]);
    assert_eq!(out.paused, vec![0]);
}

/// MAX_UTILIZATION where a recompute of more than `t` tokens cannot run (chunked
/// prefill off); `prefill_only` for a ctx server.
fn max_util_t(max_num_requests: u32, t: u32, prefill_only: bool) -> CapacityScheduler {
    let mut config = capacity(CapacitySchedulerPolicy::MaxUtilization, max_num_requests);
    config.pause = PauseRule {
        max_num_tokens: t,
        chunked_prefill: false,
        prefill_only,
    };
    CapacityScheduler::new(config)
}

#[test]
fn max_utilization_never_pauses_a_request_whose_recompute_could_not_run() {
    // As in the test above, but request 2's recompute (4 + 40 - 1 tokens) could not run
    // in a forward of 16. Its blocks to completion (11, 1 held) are reserved first: with
    // 11 free, 1 is left. 1 takes it; 3 does not fit, and 2, started after 1, is passed
    // over: 1 is paused instead, and 3 steps in what 1 gave back.
    let active = [gen_req(1, 4, 8), gen_req(2, 4, 40), gen_req(3, 4, 8)];
    let kv = FakeKv::new(11).hold(1, 1).hold(2, 1).hold(3, 1);
    let out = max_util_t(8, 16, false).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![1, 2]);
    assert_eq!(out.paused, vec![0]);
    // With only its reservation free, 1 finds nothing before it to pause and pauses
    // itself; 2 still runs within its reservation.
    let kv = FakeKv::new(10).hold(1, 1).hold(2, 1).hold(3, 1);
    let out = max_util_t(8, 16, false).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![1, 2]);
    assert_eq!(out.paused, vec![0]);
    // Where every recompute can run, 2 (started last before 3) is the victim.
    let kv = FakeKv::new(2).hold(1, 1).hold(2, 1).hold(3, 1);
    assert_eq!(max_util(8).schedule(&active, &kv).paused, vec![1]);
}

#[test]
fn max_utilization_admits_a_request_that_may_not_be_paused_only_for_its_blocks_to_completion() {
    // 8 prompt + 100 output tokens: 27 blocks to completion; its recompute could not run
    // in 64 tokens. 3 free blocks hold its prompt, not its completion: it waits (and the
    // walk stops there, FCFS), where a request that may be paused would start.
    let active = [ctx(1, 8, 100), ctx(2, 4, 4)];
    let out = max_util_t(8, 64, false).schedule(&active, &FakeKv::new(3));
    assert!(out.fitting.is_empty(), "{out:?}");
    assert_eq!(
        max_util(8).schedule(&active, &FakeKv::new(3)).fitting,
        vec![0, 1]
    );
    assert_eq!(
        max_util_t(8, 64, false)
            .schedule(&active, &FakeKv::new(29))
            .fitting,
        vec![0, 1]
    );
    // On a ctx server the request produces one token: its recompute is its prompt, it
    // may be paused, and it is admitted by its prompt.
    assert_eq!(
        max_util_t(8, 64, true)
            .schedule(&active, &FakeKv::new(3))
            .fitting,
        vec![0, 1]
    );
}

#[test]
fn max_utilization_keeps_the_reservation_of_a_request_that_may_not_be_paused() {
    // Request 1 (may not be paused) holds 2 of its 27 blocks to completion; 25 more stay
    // reserved. A new context's 1-block prompt does not fit in what is left.
    let active = [gen_req(1, 8, 100), ctx(2, 4, 4)];
    let kv = FakeKv::new(25).hold(1, 2);
    let out = max_util_t(8, 64, false).schedule(&active, &kv);
    assert_eq!(out.fitting, vec![0]);
    let kv = FakeKv::new(26).hold(1, 2);
    assert_eq!(
        max_util_t(8, 64, false).schedule(&active, &kv).fitting,
        vec![0, 1]
    );
}

#[test]
fn max_utilization_admits_new_contexts_by_prompt_not_by_completion() {
    // 2 blocks of prompt fit in 3 free ones though the completion would need 27.
    let active = [ctx(1, 8, 100)];
    assert_eq!(
        max_util(8).schedule(&active, &FakeKv::new(3)).fitting,
        vec![0]
    );
    assert!(gne(8).schedule(&active, &FakeKv::new(3)).fitting.is_empty());
}

#[test]
fn static_batch_admits_no_new_work_while_something_is_in_progress() {
    let sb = CapacityScheduler::new(capacity(CapacitySchedulerPolicy::StaticBatch, 8));
    let active = [ctx(1, 4, 4), gen_req(2, 4, 4)];
    let kv = FakeKv::new(100).hold(2, 1);
    assert_eq!(sb.schedule(&active, &kv).fitting, vec![1]);
    // Nothing in progress: the contexts form the next batch.
    let active = [ctx(1, 4, 4), ctx(3, 4, 4)];
    assert_eq!(sb.schedule(&active, &kv).fitting, vec![0, 1]);
}

// ---- micro-batch ----

#[test]
fn micro_batch_stops_at_max_batch_size_entries() {
    let active = [gen_req(1, 4, 8), gen_req(2, 4, 8), gen_req(3, 4, 8)];
    let mb = micro(2, 100, false, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1, 2], &BTreeSet::new());
    assert_eq!(kinds(&out), vec![gen_entry(0, 1), gen_entry(1, 1)]);
}

#[test]
fn micro_batch_stops_at_max_num_tokens_counting_draft_tokens() {
    let mut active = [gen_req(1, 4, 8), gen_req(2, 4, 8), gen_req(3, 4, 8)];
    for r in &mut active {
        r.spec.draft_len = 1;
    }
    let mb = micro(8, 5, false, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1, 2], &BTreeSet::new());
    assert_eq!(kinds(&out), vec![gen_entry(0, 2), gen_entry(1, 2)]);
}

#[test]
fn micro_batch_skips_requests_in_flight() {
    let active = [gen_req(1, 4, 8), gen_req(2, 4, 8), ctx(3, 4, 4)];
    let in_flight = BTreeSet::from([ReqId(1)]);
    let mb = micro(8, 100, false, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1, 2], &in_flight);
    assert_eq!(kinds(&out), vec![gen_entry(1, 1), ctx_entry(2, 4)]);
}

#[test]
fn micro_batch_only_walks_fitting() {
    let active = [gen_req(1, 4, 8), gen_req(2, 4, 8), ctx(3, 4, 4)];
    let mb = micro(8, 100, false, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[2, 9], &BTreeSet::new());
    assert_eq!(kinds(&out), vec![ctx_entry(2, 4)]);
}

#[test]
fn without_chunking_a_context_that_does_not_fit_stops_the_walk() {
    // 1 token for the generation step leaves 7; the 10-token prompt does not fit, and the
    // 2-token prompt behind it may not overtake it.
    let active = [gen_req(1, 4, 8), ctx(2, 10, 4), ctx(3, 2, 4)];
    let mb = micro(8, 8, false, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1, 2], &BTreeSet::new());
    assert_eq!(kinds(&out), vec![gen_entry(0, 1)]);
}

#[test]
fn a_fully_reused_context_costs_and_computes_one_token() {
    let mut reused = ctx(1, 8, 4);
    reused.context_pos = 8;
    reused.reused_tokens = 8;
    let active = [reused];
    for chunked in [false, true] {
        let mb = micro(8, 1, chunked, ContextChunkingPolicy::FirstComeFirstServed);
        let out = mb.schedule(&active, &[0], &BTreeSet::new());
        assert_eq!(kinds(&out), vec![ctx_entry(0, 1)], "chunked={chunked}");
    }
}

#[test]
fn first_come_first_served_chunking_gives_the_budget_in_order_in_whole_blocks() {
    // Budget after the generation step: 15. Context 1 finishes (10); context 2 gets 5,
    // cut to 4 (one block) because it does not finish its prompt.
    let active = [gen_req(1, 4, 8), ctx(2, 10, 4), ctx(3, 10, 4)];
    let mb = micro(8, 16, true, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1, 2], &BTreeSet::new());
    assert_eq!(
        kinds(&out),
        vec![gen_entry(0, 1), ctx_entry(1, 10), ctx_entry(2, 4)]
    );
}

#[test]
fn first_come_first_served_chunking_drops_a_zero_chunk_and_lets_a_finishing_one_through() {
    // Budget 3: context 1's chunk rounds down to 0 and is not scheduled; context 2's
    // whole 2-token prompt fits.
    let active = [gen_req(1, 4, 8), ctx(2, 10, 4), ctx(3, 2, 4)];
    let mb = micro(8, 4, true, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1, 2], &BTreeSet::new());
    assert_eq!(kinds(&out), vec![gen_entry(0, 1), ctx_entry(2, 2)]);
}

#[test]
fn equal_progress_chunking_advances_every_context_one_block_per_round() {
    // Budget 15. Round 1: 4 + 3 (finishes) + 4 = 11. Round 2: context 1 takes the last
    // 4; context 3 gets nothing more.
    let active = [gen_req(1, 4, 8), ctx(2, 10, 4), ctx(3, 3, 4), ctx(4, 10, 4)];
    let mb = micro(8, 16, true, ContextChunkingPolicy::EqualProgress);
    let out = mb.schedule(&active, &[0, 1, 2, 3], &BTreeSet::new());
    assert_eq!(
        kinds(&out),
        vec![
            gen_entry(0, 1),
            ctx_entry(1, 8),
            ctx_entry(2, 3),
            ctx_entry(3, 4)
        ]
    );
}

#[test]
fn chunked_batches_keep_fitting_order_with_generation_steps_charged_first() {
    // The context comes first but the generation step is charged before the budget is
    // shared: 6 - 1 = 5 tokens, cut to one block.
    let active = [ctx(1, 10, 4), gen_req(2, 4, 8)];
    let mb = micro(8, 6, true, ContextChunkingPolicy::FirstComeFirstServed);
    let out = mb.schedule(&active, &[0, 1], &BTreeSet::new());
    assert_eq!(kinds(&out), vec![ctx_entry(0, 4), gen_entry(1, 1)]);
}

// ---- properties ----

const STATES: [RequestState; 13] = [
    RequestState::DisaggTransError,
    RequestState::EncoderInit,
    RequestState::DisaggContextWaitScheduler,
    RequestState::DisaggGenerationInit,
    RequestState::DisaggGenerationTransInProgress,
    RequestState::ContextInit,
    RequestState::DisaggContextInitAndTrans,
    RequestState::DisaggGenerationTransComplete,
    RequestState::GenerationInProgress,
    RequestState::GenerationToComplete,
    RequestState::GenerationComplete,
    RequestState::DisaggContextTransInProgress,
    RequestState::DisaggContextComplete,
];

/// (state index, prompt, max_new, context_pos fraction, generated, draft, holds a sequence)
type RawReq = (usize, u32, u32, u32, u32, u32, bool);

fn build(raw: &[RawReq], free: u32) -> (Vec<Request>, FakeKv) {
    let mut kv = FakeKv::new(free);
    let mut active = Vec::new();
    for (i, &(s, prompt, max_new, pos, generated, draft, seq)) in raw.iter().enumerate() {
        let id = i as u64 + 1;
        let mut spec = RequestSpec::new(id, prompt, max_new);
        spec.draft_len = draft;
        let mut r = Request::new(spec, STATES[s]);
        r.context_pos = (prompt * pos / 4).min(prompt);
        r.generated = generated.min(max_new);
        if seq {
            kv.held.insert(ReqId(id), r.tokens_in_cache().div_ceil(TPB));
        }
        active.push(r);
    }
    (active, kv)
}

fn raw_req() -> impl Strategy<Value = RawReq> {
    (
        0..STATES.len(),
        1u32..64,
        1u32..32,
        0u32..=4,
        0u32..32,
        0u32..3,
        any::<bool>(),
    )
}

fn policy() -> impl Strategy<Value = CapacitySchedulerPolicy> {
    prop_oneof![
        Just(CapacitySchedulerPolicy::GuaranteedNoEvict),
        Just(CapacitySchedulerPolicy::MaxUtilization),
        Just(CapacitySchedulerPolicy::StaticBatch),
    ]
}

proptest! {
    #[test]
    fn capacity_never_fits_retiring_or_transfer_requests_and_never_exceeds_the_cap(
        raw in prop::collection::vec(raw_req(), 0..16),
        free in 0u32..64,
        policy in policy(),
        cap in 0u32..8,
        legacy_window in any::<bool>(),
        legacy_transfers in any::<bool>(),
        pause in (1u32..128, any::<bool>(), any::<bool>()),
    ) {
        let (active, kv) = build(&raw, free);
        let pause = PauseRule {
            max_num_tokens: pause.0,
            chunked_prefill: pause.1,
            prefill_only: pause.2,
        };
        let config = CapacityConfig {
            policy,
            max_num_requests: cap,
            window: published_window(false),
            window_ends_at_complete: legacy_window,
            count_transfers_as_requests: legacy_transfers,
            pause,
        };
        let out = CapacityScheduler::new(config).schedule(&active, &kv);
        let charged = active
            .iter()
            .filter(|r| {
                (legacy_window && r.state == RequestState::GenerationToComplete)
                    || (legacy_transfers
                        && r.state == RequestState::DisaggGenerationTransInProgress)
            })
            .count();
        prop_assert!(out.fitting.len() <= (cap as usize).saturating_sub(charged));
        prop_assert!(out.fitting.windows(2).all(|w| w[0] < w[1]), "{:?}", out.fitting);
        for &i in &out.fitting {
            let r = &active[i];
            prop_assert!(!r.state.is_retiring() && !r.state.is_transfer_state(), "{:?}", r.state);
            prop_assert!(r.is_context() || r.is_generation());
            prop_assert!(!out.paused.contains(&i));
        }
        for &i in &out.disagg_gen_init {
            prop_assert_eq!(active[i].state, RequestState::DisaggGenerationInit);
        }
        if policy != CapacitySchedulerPolicy::MaxUtilization {
            prop_assert!(out.paused.is_empty());
        }
        // A request whose recompute could not run is never paused.
        for &i in &out.paused {
            prop_assert!(pause.may_pause(&active[i], TPB), "{:?} paused", active[i]);
        }
    }

    #[test]
    fn micro_batch_respects_b_and_t_and_schedules_each_fitting_request_at_most_once(
        raw in prop::collection::vec(raw_req(), 0..16),
        fitting in prop::collection::vec(0usize..18, 0..20),
        in_flight in prop::collection::btree_set(1u64..17, 0..4),
        b in 0u32..8,
        t in 0u32..80,
        chunked in any::<bool>(),
        equal_progress in any::<bool>(),
    ) {
        let (active, _) = build(&raw, 0);
        let policy = if equal_progress {
            ContextChunkingPolicy::EqualProgress
        } else {
            ContextChunkingPolicy::FirstComeFirstServed
        };
        let in_flight: BTreeSet<ReqId> = in_flight.into_iter().map(ReqId).collect();
        let out = micro(b, t, chunked, policy).schedule(&active, &fitting, &in_flight);
        prop_assert!(out.len() <= b as usize);
        let tokens: u32 = out.iter().map(BatchEntry::tokens).sum();
        prop_assert!(tokens <= t, "{tokens} > {t}");
        let cost: u32 = out
            .iter()
            .map(|e| match e.kind {
                EntryKind::Generation { tokens } => tokens,
                EntryKind::Context { chunk } => chunk + active[e.index].spec.draft_len,
            })
            .sum();
        prop_assert!(cost <= t, "cost {cost} > {t}");
        let mut seen = BTreeSet::new();
        for e in &out {
            prop_assert!(seen.insert(e.index), "twice: {}", e.index);
            prop_assert!(fitting.contains(&e.index));
            prop_assert!(!in_flight.contains(&active[e.index].id()));
            prop_assert!(e.tokens() > 0);
            if let EntryKind::Context { chunk } = e.kind {
                prop_assert!(chunk <= active[e.index].context_remaining().max(1));
            }
        }
    }
}
