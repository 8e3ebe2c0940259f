//! One test (or a few) per numbered rule of mechanisms.md, driven through the actors'
//! phases by the harness. Names cite the section.

use lockstep_actors::config::{KvCacheConfig, Role};
use lockstep_actors::executor::{
    CollectiveTag, FetchBatch, FetchMode, Phase, RankExecutor, idle_decision,
};
use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::policy::Policy;
use lockstep_actors::request::{PinnedRank, RequestSpec, RequestState};
use lockstep_actors::vocab::{
    Failure, Finish, TransferCommand, TransferEvent, TransferFailure, TransferOutcome,
};
use lockstep_tests::{ClosedLoop, Harness, SoloRank, adp_server, peer_with};

const TIMED_OUT: TransferFailure = TransferFailure::TimedOut { after_ms: 30_000 };

#[test]
fn s1_overlap_marks_a_request_whose_next_token_is_its_last_as_retiring() {
    let mut h = Harness::new(&adp_server(1, 4, true), Policy::FIXED);
    h.submit(RequestSpec::new(1, 32, 2));
    h.step(); // context launched; first token not yet processed; will not complete next
    let r = &h.group.ranks()[0].active()[0];
    assert_eq!(r.state, RequestState::GenerationInProgress);
    h.step(); // first token processed; generation step for token 2 launched → retiring
    let r = &h.group.ranks()[0].active()[0];
    assert_eq!(r.state, RequestState::GenerationToComplete);
    assert_eq!(r.generated, 1);
    h.step(); // last token processed → complete
    assert!(h.group.ranks()[0].active().is_empty());
    assert_eq!(h.finished[&ReqId(1)], Finish::Completed);
    assert_eq!(h.streamed[&ReqId(1)].len(), 2);
}

#[test]
fn s1_without_overlap_requests_complete_in_the_iteration_of_their_last_token() {
    let mut h = Harness::new(&adp_server(1, 4, false), Policy::FIXED);
    h.submit(RequestSpec::new(1, 32, 2));
    h.step();
    h.step();
    assert_eq!(h.finished[&ReqId(1)], Finish::Completed);
    assert!(
        h.iterations
            .iter()
            .all(|it| it.reports[0].stats.counts.retiring == 0)
    );
}

#[test]
fn s2_retiring_request_is_live_but_not_routable() {
    let mut h = Harness::new(&adp_server(1, 4, true), Policy::FIXED);
    h.submit(RequestSpec::new(1, 32, 1));
    h.step();
    let c = h.group.ranks()[0].counts();
    assert_eq!((c.live, c.routable, c.retiring), (1, 0, 1));
}

#[test]
fn s3_2_rank0_blocks_only_when_global_live_is_zero_and_the_queue_is_empty() {
    let table = [
        (0, 0, false, FetchMode::Block),
        (1, 0, false, FetchMode::Poll),
        (0, 1, false, FetchMode::Poll),
        (0, 0, true, FetchMode::Poll),
    ];
    for (i, (live, waiting, shutdown, want)) in table.into_iter().enumerate() {
        assert_eq!(idle_decision(live, waiting, shutdown), want, "#{i}");
    }
    // A server holding only retiring requests keeps iterating and finishes them.
    let mut h = Harness::new(&adp_server(2, 2, true), Policy::FIXED);
    h.submit_many(1, 2, 16, 1);
    h.step();
    assert_eq!(
        h.group
            .ranks()
            .iter()
            .map(|r| r.counts().retiring)
            .sum::<u32>(),
        2
    );
    assert!(
        h.step().is_some(),
        "retiring requests must not let rank 0 block"
    );
    h.assert_all_completed();
    assert!(h.step().is_none(), "then the server is idle");
}

#[test]
fn s3_3_admission_pops_fifo_within_capacity_minus_routable() {
    let mut h = Harness::new(&adp_server(2, 2, false), Policy::FIXED);
    h.submit_many(1, 10, 16, 8);
    h.step();
    let admitted: Vec<u64> = h
        .group
        .ranks()
        .iter()
        .flat_map(|r| r.active().iter().map(|q| q.id().0))
        .collect();
    let mut sorted = admitted.clone();
    sorted.sort();
    assert_eq!(sorted, vec![1, 2, 3, 4], "capacity dp*B = 4, FIFO");
    for r in h.group.ranks() {
        let w: Vec<u64> = r.waiting().iter().map(|s| s.id.0).collect();
        assert_eq!(
            w,
            (5..=10).collect::<Vec<_>>(),
            "waiting queue is replicated"
        );
    }
    h.step();
    assert_eq!(
        h.iterations[1].reports[0].stats.admitted_now, 0,
        "window full"
    );
}

#[test]
fn s3_3_request_pinned_to_a_full_rank_is_set_aside_in_order() {
    let mut h = Harness::new(&adp_server(2, 1, false), Policy::FIXED);
    let pinned = |id| {
        let mut s = RequestSpec::new(id, 16, 4);
        s.pinned = Some(PinnedRank {
            rank: RankId(0),
            strict: true,
        });
        s
    };
    let (a, b) = (pinned(1), pinned(2));
    h.submit(a);
    h.submit(b);
    h.submit(RequestSpec::new(3, 16, 4));
    h.step();
    let r0: Vec<u64> = h.group.ranks()[0]
        .active()
        .iter()
        .map(|r| r.id().0)
        .collect();
    let r1: Vec<u64> = h.group.ranks()[1]
        .active()
        .iter()
        .map(|r| r.id().0)
        .collect();
    assert_eq!(r0, vec![1]);
    assert_eq!(r1, vec![3]);
    let w: Vec<u64> = h.group.ranks()[0]
        .waiting()
        .iter()
        .map(|s| s.id.0)
        .collect();
    assert_eq!(w, vec![2], "the pinned request waits for its rank");
    h.run(100);
    h.assert_all_completed();
}

/// Drives rank 0 through one iteration of the real protocol with nothing to do (every
/// other rank contributing what it contributes: the same, as all are empty), and returns
/// the tags of the collectives it asked for, in order.
fn one_empty_iteration(server: &lockstep_actors::config::ServerConfig) -> Vec<CollectiveTag> {
    use lockstep_actors::executor::{Exchange, Input, Io};
    let sizes = server.derive(&Policy::FIXED).unwrap().sizes;
    let dp = sizes.dp as usize;
    let mut e = RankExecutor::new(RankId(0), server, &sizes, Policy::FIXED);
    let mut tags = Vec::new();
    loop {
        let result = match e.poll() {
            Io::Exchange(x) => {
                tags.push(x.tag());
                match x {
                    Exchange::States { mine, .. } => {
                        let all = vec![*mine; dp];
                        e.handle(Input::States(&all))
                    }
                    Exchange::Fetch { mine, .. } => {
                        let f = mine.cloned().unwrap();
                        e.handle(Input::Fetch(&f))
                    }
                    Exchange::PrefixMatches { mine, .. } => {
                        let all = vec![mine.clone(); dp];
                        e.handle(Input::PrefixMatches(&all))
                    }
                    Exchange::PadIntent { mine, .. } => e.handle(Input::PadIntent(mine)),
                    Exchange::Votes { mine, .. } => {
                        assert_eq!(mine.batch_size, 0, "nothing to run");
                        let all = vec![*mine; dp];
                        e.handle(Input::Votes(&all))
                    }
                    Exchange::Responses { .. } => e.handle(Input::ResponsesGathered),
                    Exchange::TransferStatus { mine, .. } => {
                        let all = vec![mine.clone(); dp];
                        e.handle(Input::TransferStatus(&all))
                    }
                }
            }
            Io::ReadIngress(mode) => {
                assert_eq!(mode, FetchMode::Block, "an empty server blocks (§3.2)");
                e.handle(Input::Ingress(FetchBatch::default()))
            }
            Io::Forward {
                launch,
                await_output,
                ..
            } => {
                assert!(launch.is_none() && await_output.is_none());
                e.handle(Input::Output(None))
            }
            Io::IterationEnded(report) => {
                assert!(report.violations.is_empty());
                break;
            }
            Io::Finished | Io::Stopped(_) => panic!("an empty server runs on"),
        };
        result.unwrap();
    }
    assert!(tags.iter().all(|t| t.iteration == 0));
    assert_eq!(e.iteration(), 1);
    tags
}

#[test]
fn s3_every_rank_runs_the_collectives_of_its_schedule_in_the_fixed_order() {
    let phases = |server| -> Vec<Phase> {
        one_empty_iteration(&server)
            .iter()
            .map(|t| t.phase)
            .collect()
    };
    // Aggregated, balanced router: no prefix matches, no pad intent, no transfers.
    let agg = adp_server(2, 2, false);
    assert_eq!(
        phases(agg.clone()),
        vec![Phase::Gather, Phase::Fetch, Phase::Vote, Phase::Responses]
    );
    // The KV-aware router reads every rank's prefix matches.
    let mut kv_aware = agg.clone();
    kv_aware.attention_dp_config.router = lockstep_actors::config::RouterKind::KvAware;
    assert_eq!(
        phases(kv_aware),
        vec![
            Phase::Gather,
            Phase::Fetch,
            Phase::PrefixMatch,
            Phase::Vote,
            Phase::Responses
        ]
    );
    // A gen server without overlap pads by intent and polls its transfers, whose
    // allgather carries the responses in place of the response gather.
    let mut gen_server = agg.clone();
    gen_server.role = Role::Gen;
    assert_eq!(
        phases(gen_server.clone()),
        vec![
            Phase::Gather,
            Phase::Fetch,
            Phase::PadIntent,
            Phase::Vote,
            Phase::Transfers
        ]
    );
    // With overlap it pads on the `expected` path: no intent allreduce, so a ctx or gen
    // server with overlap runs four collectives, as an aggregated one does.
    let mut overlapped = gen_server.clone();
    overlapped.disable_overlap_scheduler = false;
    assert_eq!(
        phases(overlapped),
        vec![Phase::Gather, Phase::Fetch, Phase::Vote, Phase::Transfers]
    );
    // A single rank never pads (nobody waits for it): no intent allreduce either.
    let mut single = gen_server;
    single.tensor_parallel_size = 1;
    assert!(!phases(single).contains(&Phase::PadIntent));
}

#[test]
fn s3_a_malformed_collective_result_is_an_error_that_changes_nothing() {
    use lockstep_actors::executor::{Input, Io};
    let server = adp_server(2, 2, false);
    let sizes = server.derive(&Policy::FIXED).unwrap().sizes;
    let mut e = RankExecutor::new(RankId(0), &server, &sizes, Policy::FIXED);
    let Io::Exchange(lockstep_actors::executor::Exchange::States { mine, .. }) = e.poll() else {
        panic!("an iteration opens with the gather");
    };
    let one = [*mine];
    let err = e.handle(Input::States(&one)).unwrap_err();
    assert!(err.to_string().contains("1 entries, expected 2"), "{err}");
    // Still awaiting the gather: a second, well-formed answer is taken.
    let Io::Exchange(lockstep_actors::executor::Exchange::States { mine, .. }) = e.poll() else {
        panic!("still at the gather");
    };
    let two = [*mine, *mine];
    e.handle(Input::States(&two)).unwrap();
    // An answer to a question not asked is refused too.
    let err = e.handle(Input::ResponsesGathered).unwrap_err();
    assert!(err.to_string().contains("while awaiting"), "{err}");
}

#[test]
fn s3_bad_requests_fail_with_a_reason_and_change_nothing() {
    let mut h = Harness::new(&adp_server(2, 2, false), Policy::FIXED);
    h.submit(RequestSpec::new(0, 16, 4)); // reserved id
    h.submit(RequestSpec::new(1, 0, 4)); // empty prompt
    h.submit(RequestSpec::new(2, 16, 0)); // no output
    h.submit(RequestSpec::new(3, 100_000, 4)); // > T without chunking
    h.submit(RequestSpec::new(4, 16, 4)); // fine
    h.submit(RequestSpec::new(4, 16, 4)); // duplicate id
    h.step();
    let failed: Vec<(u64, String)> = h.iterations[0]
        .responses
        .iter()
        .filter_map(|r| match &r.finish {
            Some(Finish::Failed(Failure::Refused(why))) => Some((r.id.0, why.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 5, "{failed:?}");
    assert!(failed[0].1.contains("reserved"));
    assert!(failed[1].1.contains("prompt_len"));
    assert!(failed[2].1.contains("max_new_tokens"));
    assert!(failed[3].1.contains("max_num_tokens 4096"));
    assert!(failed[4].1.contains("already submitted"));
    let resident: usize = h.group.ranks().iter().map(|r| r.active().len()).sum();
    assert_eq!(resident, 1);
}

#[test]
fn s3_cancelled_requests_are_answered_and_free_their_resources() {
    let mut h = Harness::new(&adp_server(1, 1, false), Policy::FIXED);
    h.submit_many(1, 2, 16, 50);
    h.step();
    h.cancellations = vec![ReqId(1), ReqId(2)];
    h.step();
    assert_eq!(h.finished[&ReqId(1)], Finish::Cancelled);
    assert_eq!(h.finished[&ReqId(2)], Finish::Cancelled);
    let r = &h.group.ranks()[0];
    assert!(r.active().is_empty() && r.waiting().is_empty());
    assert_eq!((r.kv().used_blocks(), r.seats_used()), (0, 0));
}

#[test]
fn s4_generation_and_context_respect_b_and_t_every_iteration() {
    let mut server = adp_server(2, 3, true);
    server.max_num_tokens = 64;
    server.enable_chunked_prefill = true;
    let mut h = Harness::new(&server, Policy::FIXED);
    h.submit_many(1, 12, 100, 5);
    h.run(500);
    h.assert_all_completed();
    for it in &h.iterations {
        for b in &it.launched {
            let real = b.real_entries().count();
            let tokens: u32 = b.entries.iter().map(|e| e.tokens()).sum();
            assert!(real <= 3, "iteration {}: {real} > B", it.iteration);
            assert!(tokens <= 64, "iteration {}: {tokens} > T", it.iteration);
        }
    }
}

#[test]
fn s5_every_rank_computes_the_same_assignment_and_a_request_lives_on_one_rank() {
    let mut h = Harness::new(&adp_server(4, 4, true), Policy::FIXED)
        .with_client(ClosedLoop::new(24, 80, 40, 6));
    for _ in 0..200 {
        if h.step().is_none() {
            break;
        }
        let ranks = h.group.ranks();
        let w0: Vec<ReqId> = ranks[0].waiting().iter().map(|s| s.id).collect();
        for r in ranks {
            let w: Vec<ReqId> = r.waiting().iter().map(|s| s.id).collect();
            assert_eq!(w, w0, "waiting queue replicated");
        }
        let mut ids: Vec<ReqId> = ranks
            .iter()
            .flat_map(|r| r.active().iter().map(|q| q.id()))
            .collect();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "a request is resident on exactly one rank");
    }
    h.assert_all_completed();
    let routed = h.routed_per_rank();
    assert_eq!(routed.iter().sum::<u64>(), 80);
}

#[test]
fn s6_rank_with_nothing_schedulable_pads_when_a_peer_runs_and_the_dummy_dies_with_the_iteration() {
    let mut h = Harness::new(&adp_server(2, 2, true), Policy::FIXED);
    h.submit(RequestSpec::new(1, 16, 3));
    h.step();
    let it = &h.iterations[0];
    assert!(it.forward_ran, "rank 1 padded, so it did not veto");
    let dummies: Vec<u32> = it.reports.iter().map(|r| r.stats.num_dummies).collect();
    assert_eq!(dummies.iter().sum::<u32>(), 1);
    assert!(it.reports.iter().any(|r| r.stats.dummy_committed));
    for r in h.group.ranks() {
        assert!(r.dummy().is_none(), "no dummy survives an iteration");
    }
    h.run(20);
    h.assert_all_completed();
    assert!(h.violations().is_empty(), "{:?}", h.violations());
}

#[test]
fn s6_a_rejected_iteration_rolls_back_exactly_its_dummy() {
    let mut solo = SoloRank::new(&adp_server(2, 2, false), Policy::FIXED);
    let (ran, report) = solo.iterate(peer_with(1), FetchBatch::default(), 0);
    let e = &solo.exec;
    assert!(!ran);
    assert!(report.stats.dummy_added && report.stats.dummy_rolled_back);
    assert!(e.dummy().is_none());
    assert_eq!((e.kv().used_blocks(), e.seats_used()), (0, 0));
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

#[test]
fn s6_padding_is_skipped_with_a_warning_when_the_rank_has_no_kv_capacity() {
    // A ctx rank whose whole KV pool is held by an in-flight send has nothing schedulable
    // while its peer has work: it needs a dummy but has no block for one.
    let mut server = adp_server(2, 2, true);
    server.role = Role::Ctx;
    server.kv_cache_config = KvCacheConfig {
        tokens_per_block: 16,
        max_tokens: 48,
        enable_block_reuse: false,
    };
    let mut solo = SoloRank::new(&server, Policy::FIXED);
    let fetched = FetchBatch {
        requests: vec![RequestSpec::new(1, 40, 8)],
        ..FetchBatch::default()
    };
    let (ran, _) = solo.iterate(peer_with(0), fetched, 1);
    assert!(ran);
    // Nothing to run anywhere: the retiring request's token is processed all the same.
    let (ran, _) = solo.iterate(peer_with(0), FetchBatch::default(), 0);
    assert!(!ran);
    assert_eq!(
        solo.exec.sending().len(),
        1,
        "the first token is out, the KV send in flight"
    );
    assert_eq!(solo.exec.kv().free_blocks(), 0);
    let (ran, report) = solo.iterate(peer_with(1), FetchBatch::default(), 1);
    assert!(!ran, "no dummy, so this rank vetoes");
    assert!(report.stats.dummy_skipped_no_capacity);
    assert!(!report.stats.dummy_added);
    assert!(solo.exec.dummy().is_none());
    assert!(report.violations.is_empty(), "{:?}", report.violations);
}

#[test]
fn s6_non_overlap_disaggregated_pads_with_the_peers_role() {
    let mut server = adp_server(2, 2, false);
    server.role = Role::Ctx;
    let mut h = Harness::new(&server, Policy::FIXED);
    h.submit(RequestSpec::new(1, 16, 4));
    h.step();
    let it = &h.iterations[0];
    assert!(it.forward_ran);
    let dummy_rank = it
        .reports
        .iter()
        .position(|r| r.stats.num_dummies == 1)
        .expect("one rank padded");
    let batch = it
        .launched
        .iter()
        .find(|b| b.rank.index() == dummy_rank)
        .unwrap();
    assert!(matches!(
        batch.entries[0].kind,
        lockstep_actors::executor::ForwardKind::Context { chunk: 1, .. }
    ));
}

#[test]
fn s7_a_seat_skew_fails_at_startup_naming_both_numbers() {
    let mut server = adp_server(2, 4, true);
    server.slot_pools.kv_index_pool = Some(5);
    let err = server.derive(&Policy::FIXED).unwrap_err().to_string();
    assert!(
        err.contains(
            "kv_index_pool admits 5 sequences but seats (max_num_sequences) = 8; pool too small"
        ),
        "{err}"
    );
    server.slot_pools.kv_index_pool = Some(9);
    let err = server.derive(&Policy::FIXED).unwrap_err().to_string();
    assert!(
        err.contains(
            "kv_index_pool admits 9 sequences but seats (max_num_sequences) = 8; pool too large"
        ),
        "{err}"
    );
}

#[test]
fn s7_adp_overlap_seats_have_headroom_for_retiring_plus_replacements() {
    let mut h = Harness::new(&adp_server(2, 2, true), Policy::FIXED)
        .with_client(ClosedLoop::new(64, 200, 16, 1));
    h.run(1000);
    h.assert_all_completed();
    let max_seats = h
        .iterations
        .iter()
        .flat_map(|it| it.reports.iter().map(|r| r.stats.seats_used))
        .max()
        .unwrap();
    assert!(max_seats <= 4, "seats = 2B = 4, saw {max_seats}");
    assert!(h.violations().is_empty(), "{:?}", h.violations());
}

fn gen_server() -> lockstep_actors::config::ServerConfig {
    let mut server = adp_server(1, 2, false);
    server.role = Role::Gen;
    server
}

fn gen_spec(id: u64) -> RequestSpec {
    let mut s = RequestSpec::new(id, 32, 4);
    s.generated_before = 1;
    s
}

#[test]
fn s8_gen_request_waits_for_its_kv_then_decodes() {
    let mut h = Harness::new(&gen_server(), Policy::FIXED);
    h.submit(gen_spec(1));
    h.step();
    let rank = &h.group.ranks()[0];
    assert_eq!(
        rank.active()[0].state,
        RequestState::DisaggGenerationTransInProgress
    );
    assert_eq!(rank.active()[0].seat, None, "no seat before the KV arrives");
    assert!(matches!(
        h.iterations[0].reports[0].transfer_commands[..],
        [TransferCommand::Receive {
            id: ReqId(1),
            blocks: 2,
            from: None,
            ..
        }]
    ));
    h.group.ranks_mut()[0]
        .handle_transfer_event(TransferEvent {
            id: ReqId(1),
            outcome: TransferOutcome::Done,
        })
        .unwrap();
    h.step();
    assert_eq!(
        h.group.ranks()[0].active()[0].state,
        RequestState::DisaggGenerationTransComplete
    );
    h.run(10);
    assert_eq!(h.finished[&ReqId(1)], Finish::Completed);
    assert_eq!(
        h.streamed[&ReqId(1)].len(),
        3,
        "tokens 2..=4 on the gen server"
    );
}

#[test]
fn s8_a_failed_transfer_fails_only_that_request_and_frees_its_kv() {
    let mut h = Harness::new(&gen_server(), Policy::FIXED);
    h.submit(gen_spec(1));
    h.submit(gen_spec(2));
    h.step();
    for (id, outcome) in [
        (1, TransferOutcome::Failed(TIMED_OUT)),
        (2, TransferOutcome::Done),
    ] {
        h.group.ranks_mut()[0]
            .handle_transfer_event(TransferEvent {
                id: ReqId(id),
                outcome,
            })
            .unwrap();
    }
    h.run(10);
    assert_eq!(
        h.finished[&ReqId(1)],
        Finish::Failed(Failure::KvReceive(TIMED_OUT))
    );
    assert_eq!(h.finished[&ReqId(2)], Finish::Completed);
    let r = &h.group.ranks()[0];
    assert_eq!((r.kv().used_blocks(), r.seats_used()), (0, 0));
    assert!(h.violations().is_empty(), "{:?}", h.violations());
}

#[test]
fn s3_2_a_failed_transfers_response_keeps_an_idle_server_iterating_until_it_is_gathered() {
    // The only request fails its receive: after the transfer phase nothing is live, but
    // its error response waits for the next response gather. The gather says so
    // (`responses_due`), rank 0 polls instead of blocking, and the response goes out.
    let mut h = Harness::new(&gen_server(), Policy::FIXED);
    h.submit(gen_spec(1));
    h.step();
    h.group.ranks_mut()[0]
        .handle_transfer_event(TransferEvent {
            id: ReqId(1),
            outcome: TransferOutcome::Failed(TIMED_OUT),
        })
        .unwrap();
    assert!(h.step().is_some(), "the iteration that applies the failure");
    assert!(!h.finished.contains_key(&ReqId(1)));
    assert_eq!(h.group.ranks()[0].counts().live, 0);
    assert!(
        h.step().is_some(),
        "nothing is live, yet the iteration must run for the response"
    );
    assert_eq!(
        h.finished[&ReqId(1)],
        Finish::Failed(Failure::KvReceive(TIMED_OUT))
    );
    assert!(h.step().is_none(), "then the server idles");
}

#[test]
fn s8_ctx_request_keeps_its_kv_until_the_send_completes() {
    let mut server = adp_server(1, 2, false);
    server.role = Role::Ctx;
    let mut h = Harness::new(&server, Policy::FIXED);
    h.submit(RequestSpec::new(1, 40, 10));
    h.step();
    assert_eq!(h.finished[&ReqId(1)], Finish::ContextDone);
    let r = &h.group.ranks()[0];
    assert!(r.active().is_empty());
    assert_eq!(r.sending().len(), 1);
    assert_eq!(
        r.sending()[0].state,
        RequestState::DisaggContextTransInProgress
    );
    assert_eq!(
        r.kv().used_blocks(),
        3,
        "40 prompt tokens kept for the send"
    );
    assert_eq!(r.seats_used(), 0);
    h.group.ranks_mut()[0]
        .handle_transfer_event(TransferEvent {
            id: ReqId(1),
            outcome: TransferOutcome::Done,
        })
        .unwrap();
    h.step();
    let r = &h.group.ranks()[0];
    assert!(r.sending().is_empty());
    assert_eq!(r.kv().used_blocks(), 0);
}

#[test]
fn s9_iteration_stats_report_routing_share_and_occupancy() {
    let mut h = Harness::new(&adp_server(2, 2, true), Policy::FIXED);
    h.submit_many(1, 4, 16, 3);
    h.step();
    let it = &h.iterations[0];
    for r in &it.reports {
        assert_eq!(r.stats.routed_to_rank, 2);
        assert_eq!(r.stats.routed_total, 4);
        assert_eq!(r.stats.num_scheduled_requests, 2);
        assert_eq!(r.stats.num_ctx_requests, 2);
        assert_eq!(r.stats.num_ctx_tokens, 32);
        assert!(r.stats.kv_blocks_used > 0);
        assert_eq!(r.stats.seats_used, 2);
    }
}

#[test]
fn s10_fixed_policy_runs_report_no_violation_and_account_for_every_request() {
    let mut server = adp_server(3, 4, true);
    server.enable_chunked_prefill = true;
    server.max_num_tokens = 128;
    let mut h = Harness::new(&server, Policy::FIXED).with_client(ClosedLoop::new(40, 150, 200, 5));
    h.run(5000);
    h.assert_all_completed();
    assert!(h.violations().is_empty(), "{:?}", h.violations());
    for r in h.group.ranks() {
        assert_eq!((r.kv().used_blocks(), r.seats_used()), (0, 0));
    }
}

#[test]
fn s8_with_a_budget_of_one_prompt_at_most_one_receive_is_in_flight_per_gen_rank() {
    let mut server = gen_server();
    // Prompts of 32 tokens = 2 blocks of 16; the budget holds exactly one.
    server.cache_transceiver_config.max_tokens_in_buffer = 32;
    let mut h = Harness::new(&server, Policy::FIXED);
    for id in 1..=3 {
        h.submit(gen_spec(id));
    }
    h.step();
    let receiving = |h: &Harness| {
        h.group.ranks()[0]
            .active()
            .iter()
            .filter(|r| r.state == RequestState::DisaggGenerationTransInProgress)
            .count()
    };
    assert_eq!(receiving(&h), 1);
    for _ in 0..20 {
        let rank = &h.group.ranks()[0];
        let pending: Vec<ReqId> = rank
            .active()
            .iter()
            .filter(|r| r.state == RequestState::DisaggGenerationTransInProgress)
            .map(|r| r.id())
            .collect();
        for id in pending {
            h.group.ranks_mut()[0]
                .handle_transfer_event(TransferEvent {
                    id,
                    outcome: TransferOutcome::Done,
                })
                .unwrap();
        }
        if h.step().is_none() {
            break;
        }
        assert!(receiving(&h) <= 1);
    }
    h.assert_all_completed();
    let t = h.group.ranks()[0].totals();
    assert_eq!(t.max_receives_in_flight, 1);
    assert_eq!(t.transfer_budget_admitted, 3);
    // Two deferrals of both kinds: in the first iteration request 2 waits behind the
    // receive its own walk just started (not blocked by an active receive); later one
    // waits behind a receive an earlier iteration started, whose end is applied only at
    // that iteration's transfer step (blocked by an active receive).
    assert_eq!(
        (
            t.transfer_budget_deferred,
            t.transfer_budget_blocked_by_active
        ),
        (2, 1),
        "{t:?}"
    );
}

#[test]
fn s8_the_transport_budget_is_first_come_first_served_a_smaller_receive_never_overtakes() {
    let mut server = gen_server();
    server.max_batch_size = 8;
    // A budget of 4 blocks of 16 tokens.
    server.cache_transceiver_config.max_tokens_in_buffer = 64;
    let mut h = Harness::new(&server, Policy::FIXED);
    let spec = |id: u64, prompt: u32| {
        let mut s = RequestSpec::new(id, prompt, 4);
        s.generated_before = 1;
        s
    };
    // 3 blocks: starts alone.
    h.submit(spec(1, 48));
    h.step();
    // 2 blocks: 3 + 2 > 4, deferred; then 1 block, which would fit (3 + 1 <= 4) but
    // must not start ahead of the request before it.
    h.submit(spec(2, 32));
    h.submit(spec(3, 16));
    h.step();
    h.step();
    let state = |h: &Harness, id: u64| {
        h.group.ranks()[0]
            .active()
            .iter()
            .find(|r| r.id() == ReqId(id))
            .map(|r| r.state)
    };
    assert_eq!(
        state(&h, 1),
        Some(RequestState::DisaggGenerationTransInProgress)
    );
    assert_eq!(state(&h, 2), Some(RequestState::DisaggGenerationInit));
    assert_eq!(
        state(&h, 3),
        Some(RequestState::DisaggGenerationInit),
        "a later, smaller receive overtook the head of the queue"
    );
    let t = h.group.ranks()[0].totals();
    assert_eq!(t.transfer_budget_admitted, 1, "{t:?}");
    assert!(t.transfer_budget_deferred >= 2, "{t:?}");
}

#[test]
fn s3_2_a_server_whose_iterations_change_nothing_waits_instead_of_spinning() {
    // A gen request whose KV receive started and never ends: after the iteration that
    // started it (which emitted a transfer command: progress), nothing changes, so rank
    // 0 waits for input (the harness sees the server go quiet) instead of iterating.
    let mut h = Harness::new(&gen_server(), Policy::FIXED);
    h.submit(gen_spec(1));
    let ran = h.run(50);
    assert!(ran < 10, "the server spun for {ran} iterations");
    assert_eq!(
        h.group.ranks()[0].active()[0].state,
        RequestState::DisaggGenerationTransInProgress
    );
    // The iteration that started the receive reported progress; the last one did not.
    let progressed: Vec<bool> = h
        .iterations
        .iter()
        .map(|it| it.reports[0].stats.progressed)
        .collect();
    assert_eq!(progressed.first(), Some(&true), "{progressed:?}");
    assert_eq!(progressed.last(), Some(&false), "{progressed:?}");
    // Every iteration the harness saw is counted by the rank.
    assert_eq!(
        h.group.ranks()[0].totals().iterations,
        h.iterations.len() as u64
    );
}
