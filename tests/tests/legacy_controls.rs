//! Negative controls: each legacy switch, alone, reproduces its historical defect, and the
//! fixed policy does not. If one of these stops failing under legacy, the test that
//! guards the fix no longer binds.

use lockstep_actors::config::{CapacitySchedulerPolicy, Role};
use lockstep_actors::executor::FetchBatch;
use lockstep_actors::ids::ReqId;
use lockstep_actors::invariants::InvariantKind;
use lockstep_actors::kv::{KvCommand, KvConfig, KvManager, KvReply};
use lockstep_actors::policy::{PadPredicate, Policy};
use lockstep_actors::request::{Request, RequestSpec, RequestState, SchedulableWindow};
use lockstep_actors::scheduler::{CapacityConfig, CapacityScheduler, PauseRule};
use lockstep_tests::{ClosedLoop, Harness, SoloRank, adp_server, peer_with};

/// dp=2, B=2, overlap on, output length 1, concurrency far above capacity (§2).
fn binding_case(policy: Policy) -> Harness {
    let mut h =
        Harness::new(&adp_server(2, 2, true), policy).with_client(ClosedLoop::new(64, 400, 64, 1));
    h.run(2000);
    h.assert_all_completed();
    h
}

#[test]
fn fixed_admission_keeps_every_seat_busy_in_the_binding_case() {
    let h = binding_case(Policy::FIXED);
    // After the first iteration every forward carries B = 2 real requests per rank.
    let warm = 1;
    let last_full = h.iterations.len() - 2; // the tail drains
    for it in &h.iterations[warm..last_full] {
        assert!(it.forward_ran, "iteration {}", it.iteration);
        for r in &it.reports {
            assert_eq!(
                r.stats.num_scheduled_requests, 2,
                "iteration {} rank {}",
                it.iteration, r.stats.rank
            );
        }
    }
    let routed = h.routed_per_rank();
    assert_eq!(routed[0], routed[1], "equal routing shares: {routed:?}");
    assert!(h.violations().is_empty(), "{:?}", h.violations());
}

#[test]
fn legacy_charge_retiring_shrinks_the_admission_window() {
    let mut policy = Policy::FIXED;
    policy.admission.charge_retiring = true;
    let legacy = binding_case(policy);
    let fixed = binding_case(Policy::FIXED);
    // The window shrinks: iterations with a non-empty waiting queue admit nothing.
    let starved = legacy
        .iterations
        .iter()
        .filter(|it| it.reports[0].stats.admitted_now == 0 && it.reports[0].stats.waiting > 0)
        .count();
    assert!(starved > 10, "legacy starved iterations: {starved}");
    let (l, f) = (legacy.mean_scheduled(1), fixed.mean_scheduled(1));
    assert!(l < 0.8 * f, "legacy mean scheduled {l} vs fixed {f}");
    assert!(legacy.iterations.len() > fixed.iterations.len());
}

#[test]
fn legacy_seats_rederive_defers_admitted_requests_for_lack_of_an_index_slot() {
    let mut policy = Policy::FIXED;
    policy.seats.rederive = true;
    let derived = adp_server(2, 2, true).derive(&policy).unwrap();
    let warning = derived.warning.expect("the skew is reported as a warning");
    assert!(
        warning.contains(
            "kv_index_pool admits 3 sequences but seats (max_num_sequences) = 4; pool too small"
        ),
        "{warning}"
    );
    let legacy = binding_case(policy);
    let deferred: u64 = legacy
        .group
        .ranks()
        .iter()
        .map(|r| r.totals().deferrals_no_free_index_slot)
        .sum();
    assert!(deferred > 0, "no deferral under seats.rederive");
    // The skew was reported once, at startup; the end-of-iteration seat check leaves
    // the index pool alone under seats.rederive (§10), so no violation piles up.
    assert!(legacy.violations().is_empty(), "{:?}", legacy.violations());
    let fixed = binding_case(Policy::FIXED);
    let deferred: u64 = fixed
        .group
        .ranks()
        .iter()
        .map(|r| r.totals().deferrals_no_free_index_slot)
        .sum();
    assert_eq!(deferred, 0);
    // And the fixed policy refuses to start with the same skew.
    let mut skewed = adp_server(2, 2, true);
    skewed.slot_pools.kv_index_pool = Some(3);
    assert!(skewed.derive(&Policy::FIXED).is_err());
}

/// Rank 0 holds only a retiring request while rank 1 has fresh work (§6).
fn retiring_only_rank(policy: Policy) -> Harness {
    let mut h = Harness::new(&adp_server(2, 2, true), policy);
    h.submit(RequestSpec::new(1, 16, 2)); // → rank 0
    h.step();
    h.submit(RequestSpec::new(2, 16, 10)); // → rank 1 (rank 0 is loaded)
    h.step();
    assert_eq!(
        h.group.ranks()[0].active()[0].state,
        RequestState::GenerationToComplete
    );
    assert_eq!(h.group.ranks()[1].active()[0].id(), ReqId(2));
    h.step();
    h
}

#[test]
fn legacy_pad_predicate_lets_a_rank_holding_only_retiring_requests_veto_the_forward() {
    let mut policy = Policy::FIXED;
    policy.pad.predicate = PadPredicate::Legacy;
    let legacy = retiring_only_rank(policy);
    assert!(
        !legacy.iterations[2].forward_ran,
        "legacy: the forward is vetoed"
    );
    assert_eq!(legacy.iterations[2].reports[0].stats.num_dummies, 0);
    let fixed = retiring_only_rank(Policy::FIXED);
    assert!(fixed.iterations[2].forward_ran, "fixed: rank 0 pads");
    assert!(fixed.iterations[2].reports[0].stats.dummy_committed);
}

/// A gen rank full of requests waiting for their KV (routable, not schedulable) pads;
/// the peer vetoes the iteration.
fn rollback_case(policy: Policy) -> Vec<Vec<InvariantKind>> {
    let mut server = adp_server(2, 2, true);
    server.role = Role::Gen;
    let mut solo = SoloRank::new(&server, policy);
    let gen_spec = |id| {
        let mut s = RequestSpec::new(id, 16, 4);
        s.generated_before = 1;
        s
    };
    let fetched = FetchBatch {
        requests: vec![gen_spec(1), gen_spec(2)],
        ..FetchBatch::default()
    };
    // Both requests come here (the peer already holds 2), start their receive, and this
    // rank, holding M = 2 requests of which none is schedulable, pads; the peer votes 0.
    let (_, first) = solo.iterate(peer_with(2), fetched, 0);
    assert!(first.stats.dummy_added);
    assert_eq!(
        solo.exec.counts().routable,
        if policy.pad.rollback { 2 } else { 3 }
    );
    let (_, second) = solo.iterate(peer_with(2), FetchBatch::default(), 1);
    // The crash is announced in the vote, so every rank stops at the same point.
    let crashed = second.violations.iter().any(|v| v.kind.is_fatal());
    assert_eq!(solo.last_vote.fatal, crashed);
    assert_eq!(solo.stopped.is_some(), crashed);
    [first, second]
        .iter()
        .map(|r| r.violations.iter().map(|v| v.kind).collect())
        .collect()
}

#[test]
fn legacy_pad_rollback_off_lets_a_dummy_survive_and_trips_the_cap_check() {
    let mut policy = Policy::FIXED;
    policy.pad.rollback = false;
    let legacy = rollback_case(policy);
    assert!(
        legacy[0].contains(&InvariantKind::DummySurvived),
        "{legacy:?}"
    );
    assert!(legacy[1].contains(&InvariantKind::Cap), "{legacy:?}");
    assert!(InvariantKind::Cap.is_fatal());
    let fixed = rollback_case(Policy::FIXED);
    assert!(fixed.iter().all(|v| v.is_empty()), "{fixed:?}");
}

fn transfer_mix() -> (Vec<Request>, KvManager) {
    let mk = |id, state| {
        let mut spec = RequestSpec::new(id, 16, 4);
        spec.generated_before = 1;
        Request::new(spec, state)
    };
    let active = vec![
        mk(1, RequestState::DisaggGenerationTransInProgress),
        mk(2, RequestState::DisaggGenerationTransInProgress),
        mk(3, RequestState::DisaggGenerationTransComplete),
    ];
    let mut kv = KvManager::new(KvConfig {
        tokens_per_block: 16,
        total_blocks: 64,
        enable_block_reuse: false,
        index_pool_size: 8,
    });
    for r in &active {
        let added = kv.handle(KvCommand::AddSequence {
            id: r.id(),
            block_hashes: &[],
            prompt_len: 16,
        });
        assert_eq!(added, Ok(KvReply::Added { reused_tokens: 0 }));
        let grown = kv.handle(KvCommand::EnsureTokens {
            id: r.id(),
            tokens: 16,
        });
        assert_eq!(grown, Ok(KvReply::Done));
    }
    (active, kv)
}

fn gne_with(count_transfers: bool) -> Vec<usize> {
    let (active, kv) = transfer_mix();
    let s = CapacityScheduler::new(CapacityConfig {
        policy: CapacitySchedulerPolicy::GuaranteedNoEvict,
        max_num_requests: 2,
        window: SchedulableWindow::published(false),
        window_ends_at_complete: false,
        count_transfers_as_requests: count_transfers,
        pause: PauseRule::ANY,
    });
    s.schedule(&active, &kv).fitting
}

#[test]
fn legacy_gne_count_transfers_lets_in_transfer_requests_consume_request_slots() {
    assert_eq!(gne_with(false), vec![2], "fixed: the received request runs");
    assert!(
        gne_with(true).is_empty(),
        "legacy: two transfers fill the cap of 2"
    );
    // On a gen server the legacy preset keeps the same behaviour end to end.
    let mut server = adp_server(1, 2, false);
    server.role = Role::Gen;
    assert!(server.derive(&Policy::LEGACY).is_ok());
}
