//! The ADP router driven through its message interface, [`Router::route`] with a
//! [`RouteInput`] answered by an [`Assignment`] (mechanisms.md §5, §10). Scripts run
//! several rounds over a small fleet model that applies each assignment (and request
//! completions) to the loads of the next round, so the router's carried state
//! (conversation bindings, the round-robin pointer) and the evolving loads both matter.

use lockstep_actors::config::RouterKind;
use lockstep_actors::ids::{ConvId, RankId, ReqId};
use lockstep_actors::kv::{KvCommand, KvConfig, KvManager, KvReply};
use lockstep_actors::request::{PinnedRank, RequestSpec};
use lockstep_actors::router::{
    Assignment, CONVERSATION_LRU_CAPACITY, RankLoad, RouteInput, Router, RoutingViolation,
    check_routing_invariant, expected,
};

/// A fleet of `dp` ranks as the router sees it: each rank's resident requests.
struct Fleet {
    router: Router,
    m: u32,
    resident: Vec<Vec<RequestSpec>>,
}

impl Fleet {
    fn new(kind: RouterKind, dp: u32, m: u32) -> Fleet {
        Fleet {
            router: Router::new(kind),
            m,
            resident: vec![Vec::new(); dp as usize],
        }
    }

    fn loads(&self) -> Vec<RankLoad> {
        self.resident
            .iter()
            .map(|rs| RankLoad {
                requests: rs.len() as u32,
                prompt_tokens: rs.iter().map(|r| u64::from(r.prompt_len)).sum(),
            })
            .collect()
    }

    fn counts(&self) -> Vec<u32> {
        self.resident.iter().map(|rs| rs.len() as u32).collect()
    }

    /// One routing round; the assignment is applied to the fleet.
    fn round(&mut self, new: &[RequestSpec], prefix_matches: Option<&[Vec<u32>]>) -> Assignment {
        let loads = self.loads();
        let a = self.router.route(RouteInput {
            loads: &loads,
            new,
            max_per_rank: self.m,
            prefix_matches,
        });
        assert_eq!(a.ranks.len(), new.len(), "every request is placed");
        for (spec, rank) in new.iter().zip(&a.ranks) {
            self.resident[rank.index()].push(spec.clone());
        }
        a
    }

    /// Requests that finished leave their rank.
    fn finish(&mut self, ids: &[u64]) {
        for rs in &mut self.resident {
            rs.retain(|r| !ids.contains(&r.id.0));
        }
    }

    fn where_is(&self, id: u64) -> Option<u32> {
        self.resident
            .iter()
            .position(|rs| rs.iter().any(|r| r.id == ReqId(id)))
            .map(|r| r as u32)
    }
}

fn req(id: u64, prompt: u32) -> RequestSpec {
    RequestSpec::new(id, prompt, 8)
}

fn conv(id: u64, conversation: u64) -> RequestSpec {
    RequestSpec {
        conversation: Some(ConvId(conversation)),
        ..req(id, 10)
    }
}

fn pinned(id: u64, rank: u32, strict: bool) -> RequestSpec {
    RequestSpec {
        pinned: Some(PinnedRank {
            rank: RankId(rank),
            strict,
        }),
        ..req(id, 10)
    }
}

fn ranks(a: &Assignment) -> Vec<u32> {
    a.ranks.iter().map(|r| r.0).collect()
}

/// The §10 invariant for a round that was not over-full: the room below `expected` on
/// the counts before the round covers it, and (without pins or stickiness) no rank ends
/// above `expected`.
#[track_caller]
fn assert_within_expected(before: &[u32], a: &Assignment, after: &[u32]) {
    assert_eq!(a.violation, None);
    assert_eq!(
        check_routing_invariant(before, a.expected, a.ranks.len() as u32),
        Ok(())
    );
    assert!(
        after.iter().all(|&c| c <= a.expected),
        "counts {after:?} above expected {}",
        a.expected
    );
}

#[test]
fn expected_and_the_routing_invariant_follow_the_formulas() {
    // expected = min(cap, max(ceil(mult * ceil((Σ + n) / dp)), max(counts)))
    assert_eq!(expected(&[0, 0], 3, 1, Some(4)), 2);
    assert_eq!(expected(&[1, 2], 2, 1, Some(4)), 3);
    assert_eq!(expected(&[4, 0], 1, 1, Some(8)), 4, "max(counts) wins");
    assert_eq!(expected(&[2, 2], 5, 1, Some(4)), 4, "capped at M");
    assert_eq!(
        expected(&[2, 2], 5, 2, None),
        10,
        "conversation: mult 2, no cap"
    );
    assert_eq!(
        expected(&[2, 2], 5, 2, Some(4)),
        4,
        "kv_aware: mult 2, capped"
    );

    assert_eq!(check_routing_invariant(&[1, 3], 3, 2), Ok(()));
    assert_eq!(
        check_routing_invariant(&[1, 3], 3, 3),
        Err(RoutingViolation {
            expected: 3,
            room: 2,
            n_new: 3,
            counts: vec![1, 3],
        })
    );
    assert_eq!(
        check_routing_invariant(&[5, 0], 3, 3),
        Ok(()),
        "a rank above expected adds no negative room"
    );
}

#[test]
fn balanced_rounds_place_longest_first_on_the_lightest_rank_as_loads_evolve() {
    let mut fleet = Fleet::new(RouterKind::Balanced, 2, 4);

    // Round 1, idle: expected 2. 100 -> r0; 50 -> r1; 10 -> r1 (fewer tokens there).
    let before = fleet.counts();
    let a = fleet.round(&[req(1, 100), req(2, 10), req(3, 50)], None);
    assert_eq!(ranks(&a), vec![0, 1, 1]);
    assert_eq!(a.expected, 2);
    assert_within_expected(&before, &a, &fleet.counts());
    assert_eq!(
        fleet.loads(),
        vec![
            RankLoad {
                requests: 1,
                prompt_tokens: 100
            },
            RankLoad {
                requests: 2,
                prompt_tokens: 60
            }
        ]
    );

    // Round 2: expected 3. The first 30 goes to r1 (60 < 100 tokens), which is then at
    // expected, so the second goes to r0 despite its tokens.
    let before = fleet.counts();
    let a = fleet.round(&[req(4, 30), req(5, 30)], None);
    assert_eq!(ranks(&a), vec![1, 0]);
    assert_eq!(a.expected, 3);
    assert_within_expected(&before, &a, &fleet.counts());

    // Requests 2 and 3 finish on r1; round 3 sees the lighter rank.
    fleet.finish(&[2, 3]);
    let before = fleet.counts();
    assert_eq!(before, vec![2, 1]);
    let a = fleet.round(&[req(6, 10)], None);
    assert_eq!(ranks(&a), vec![1]);
    assert_eq!(a.expected, 2);
    assert_within_expected(&before, &a, &fleet.counts());

    // A round with nothing new: only `expected`, and the router does not change.
    let router_before = fleet.router.clone();
    let a = fleet.round(&[], None);
    assert_eq!(
        a,
        Assignment {
            ranks: vec![],
            expected: 2,
            violation: None,
        }
    );
    assert_eq!(fleet.router, router_before);

    // Round 5: five more on [2, 2] with M = 4: room 4 < 5. The violation is reported and
    // the surplus goes to the least-loaded rank; nothing is dropped.
    let new: Vec<RequestSpec> = (7..=11).map(|id| req(id, 10)).collect();
    let a = fleet.round(&new, None);
    assert_eq!(
        a.violation,
        Some(RoutingViolation {
            expected: 4,
            room: 4,
            n_new: 5,
            counts: vec![2, 2],
        })
    );
    assert_eq!(ranks(&a), vec![1, 1, 0, 0, 0]);
    assert_eq!(a.expected, 4, "never reported past M");
    assert_eq!(fleet.counts(), vec![5, 4]);
}

#[test]
fn pins_go_first_strict_before_relaxed_and_a_pin_to_a_full_rank_falls_back() {
    let mut fleet = Fleet::new(RouterKind::Balanced, 2, 2);
    let a = fleet.round(
        &[pinned(1, 1, false), pinned(2, 1, true), pinned(3, 1, true)],
        None,
    );
    // Both strict pins fill rank 1 to M; the relaxed one falls back to routing.
    assert_eq!(ranks(&a), vec![0, 1, 1]);
    assert_eq!(a.violation, None);
    let a = fleet.round(&[pinned(4, 1, true)], None);
    assert_eq!(ranks(&a), vec![0], "rank 1 is at M");
    assert_eq!(fleet.counts(), vec![2, 2]);
    // Rank 1 drains: the pin is honoured again, above the balance target.
    fleet.finish(&[2, 3]);
    let a = fleet.round(&[pinned(5, 1, true), pinned(6, 1, true)], None);
    assert_eq!(ranks(&a), vec![1, 1]);
    assert_eq!(a.expected, 2);
}

#[test]
fn conversation_bindings_carry_over_rounds_stick_under_m_and_move_when_full() {
    let mut fleet = Fleet::new(RouterKind::Conversation, 2, 2);

    // Round 1: unbound, round robin from rank 0; the conversation is bound there.
    let a = fleet.round(&[conv(1, 7)], None);
    assert_eq!(ranks(&a), vec![0]);
    assert_eq!(fleet.router.bound_rank(ConvId(7)), Some(RankId(0)));

    // Round 2: rank 0 holds 1 < M: the conversation sticks.
    let a = fleet.round(&[conv(2, 7)], None);
    assert_eq!(ranks(&a), vec![0]);
    assert_eq!(fleet.counts(), vec![2, 0]);

    // Round 3: rank 0 is at M: the next rank in round robin (the pointer moved past 0
    // in round 1) takes it, and the binding follows.
    let snapshot = fleet.router.clone();
    let loads = fleet.loads();
    let a = fleet.round(&[conv(3, 7)], None);
    assert_eq!(ranks(&a), vec![1]);
    assert_eq!(fleet.router.bound_rank(ConvId(7)), Some(RankId(1)));
    // The same message to a router without that history lands elsewhere: the pointer
    // is state carried between messages.
    let fresh = Router::new(RouterKind::Conversation).route(RouteInput {
        loads: &loads,
        new: &[conv(3, 7)],
        max_per_rank: 2,
        prefix_matches: None,
    });
    assert_eq!(ranks(&fresh), vec![0]);
    assert_ne!(fleet.router, snapshot);

    // Round 4: rank 0 drains; the conversation stays on rank 1 (under M) regardless.
    fleet.finish(&[1, 2]);
    assert_eq!(fleet.counts(), vec![0, 1]);
    let a = fleet.round(&[conv(4, 7)], None);
    assert_eq!(ranks(&a), vec![1]);

    // Round 5: a new conversation and an unbound request share the round robin.
    let a = fleet.round(&[conv(5, 8), req(6, 10)], None);
    assert_eq!(ranks(&a), vec![0, 1]);
    assert_eq!(fleet.router.bound_rank(ConvId(8)), Some(RankId(0)));
    assert_eq!(a.violation, None);
    assert_eq!(fleet.where_is(4), Some(1));
}

#[test]
fn conversation_state_evolves_identically_on_every_rank() {
    let rounds: Vec<Vec<RequestSpec>> = vec![
        vec![conv(1, 1), conv(2, 2), conv(3, 3)],
        vec![conv(4, 1), req(5, 30), conv(6, 4)],
        vec![conv(7, 2), conv(8, 2), conv(9, 2)],
        vec![],
        vec![conv(10, 3), conv(11, 5)],
    ];
    let mut replicas: Vec<Fleet> = (0..3)
        .map(|_| Fleet::new(RouterKind::Conversation, 3, 2))
        .collect();
    for (i, new) in rounds.iter().enumerate() {
        let answers: Vec<Assignment> = replicas.iter_mut().map(|f| f.round(new, None)).collect();
        assert!(
            answers.windows(2).all(|w| w[0] == w[1]),
            "round {i}: {answers:?}"
        );
        if i == 1 {
            fleet_finish_all(&mut replicas, &[1, 2]);
        }
    }
    assert!(replicas.windows(2).all(|w| w[0].router == w[1].router));
    for c in 1..=5 {
        assert!(replicas[0].router.bound_rank(ConvId(c)).is_some(), "{c}");
    }
    assert_ne!(replicas[0].router, Router::new(RouterKind::Conversation));
}

fn fleet_finish_all(fleets: &mut [Fleet], ids: &[u64]) {
    for f in fleets {
        f.finish(ids);
    }
}

#[test]
fn the_conversation_lru_forgets_the_least_recently_used_binding_past_its_capacity() {
    let mut router = Router::new(RouterKind::Conversation);
    let loads = [RankLoad::default(); 2];
    let route = |router: &mut Router, new: &[RequestSpec]| {
        router.route(RouteInput {
            loads: &loads,
            new,
            max_per_rank: u32::MAX,
            prefix_matches: None,
        })
    };
    route(&mut router, &[conv(1, 0)]);
    route(&mut router, &[conv(2, 1)]);
    route(&mut router, &[conv(3, 0)]); // refreshes conversation 0
    let many: Vec<RequestSpec> = (0..CONVERSATION_LRU_CAPACITY as u64 - 1)
        .map(|i| conv(10 + i, 1_000 + i))
        .collect();
    let a = route(&mut router, &many);
    assert_eq!(a.ranks.len(), many.len());
    assert_eq!(router.bound_rank(ConvId(1)), None, "least recently used");
    assert!(router.bound_rank(ConvId(0)).is_some());
    assert!(
        router
            .bound_rank(ConvId(1_000 + CONVERSATION_LRU_CAPACITY as u64 - 2))
            .is_some()
    );
}

#[test]
fn other_kinds_bind_no_conversation_and_need_no_prefix_matches_except_kv_aware() {
    for kind in [RouterKind::Balanced, RouterKind::KvAware] {
        let mut fleet = Fleet::new(kind, 2, 4);
        fleet.round(&[conv(1, 5)], None);
        assert_eq!(fleet.router.bound_rank(ConvId(5)), None, "{kind:?}");
        assert_eq!(fleet.router.kind(), kind);
    }
    assert!(Router::new(RouterKind::KvAware).needs_prefix_matches());
    assert!(!Router::new(RouterKind::Balanced).needs_prefix_matches());
    assert!(!Router::new(RouterKind::Conversation).needs_prefix_matches());
}

// ---- kv_aware over real KV managers ----

const TPB: u32 = 4;

/// A request whose prompt is whole blocks with the given content hashes.
fn hashed(id: u64, hashes: &[u64]) -> RequestSpec {
    RequestSpec {
        block_hashes: hashes.into(),
        ..RequestSpec::new(id, TPB * hashes.len() as u32, 4)
    }
}

/// A fleet whose ranks keep real KV caches: routed requests are prefilled there (their
/// prefix registered), and each round's prefix matches are read from the caches.
struct KvFleet {
    fleet: Fleet,
    caches: Vec<KvManager>,
}

impl KvFleet {
    fn new(dp: u32, m: u32) -> KvFleet {
        KvFleet {
            fleet: Fleet::new(RouterKind::KvAware, dp, m),
            caches: (0..dp)
                .map(|_| {
                    KvManager::new(KvConfig {
                        tokens_per_block: TPB,
                        total_blocks: 256,
                        enable_block_reuse: true,
                        index_pool_size: 16,
                    })
                })
                .collect(),
        }
    }

    /// The prefix-match allgather: per rank, per new request, cached tokens.
    fn matches(&self, new: &[RequestSpec]) -> Vec<Vec<u32>> {
        self.caches
            .iter()
            .map(|kv| {
                new.iter()
                    .map(|s| kv.longest_prefix_match(&s.block_hashes))
                    .collect()
            })
            .collect()
    }

    fn round(&mut self, new: &[RequestSpec]) -> (Vec<Vec<u32>>, Assignment) {
        let matches = self.matches(new);
        let a = self.fleet.round(new, Some(&matches));
        for (spec, rank) in new.iter().zip(&a.ranks) {
            let kv = &mut self.caches[rank.index()];
            let added = kv.handle(KvCommand::AddSequence {
                id: spec.id,
                block_hashes: &spec.block_hashes,
                prompt_len: spec.prompt_len,
            });
            assert!(matches!(added, Ok(KvReply::Added { .. })), "{added:?}");
            let grown = kv.handle(KvCommand::EnsureTokens {
                id: spec.id,
                tokens: spec.prompt_len,
            });
            assert_eq!(grown, Ok(KvReply::Done));
            let registered = kv.handle(KvCommand::RegisterPrefix {
                id: spec.id,
                block_hashes: &spec.block_hashes,
                computed_tokens: spec.prompt_len,
            });
            assert_eq!(registered, Ok(KvReply::Done));
        }
        (matches, a)
    }

    fn finish(&mut self, ids: &[u64]) {
        for &id in ids {
            if let Some(r) = self.fleet.where_is(id) {
                let freed =
                    self.caches[r as usize].handle(KvCommand::FreeSequence { id: ReqId(id) });
                assert_eq!(freed, Ok(KvReply::Done));
            }
        }
        self.fleet.finish(ids);
    }
}

#[test]
fn kv_aware_follows_the_prefix_cached_by_an_earlier_round() {
    let mut fleet = KvFleet::new(2, 4);
    let first: Vec<u64> = (1..=10).collect();
    // Round 1, idle fleet, nothing cached: ties go to rank 0.
    let (m, a) = fleet.round(&[hashed(1, &first)]);
    assert_eq!(m, vec![vec![0], vec![0]]);
    assert_eq!(ranks(&a), vec![0]);
    fleet.finish(&[1]);
    assert_eq!(fleet.fleet.counts(), vec![0, 0]);

    // Round 2: a follow-up extending request 1's prompt finds 40 tokens cached on rank
    // 0 (score 8 against 48 elsewhere); an unrelated prompt then avoids the load just
    // placed there.
    let follow_up: Vec<u64> = (1..=12).collect();
    let other: Vec<u64> = (100..112).collect();
    let (m, a) = fleet.round(&[hashed(2, &follow_up), hashed(3, &other)]);
    assert_eq!(m, vec![vec![40, 0], vec![0, 0]]);
    assert_eq!(ranks(&a), vec![0, 1]);
    assert_eq!(a.violation, None);

    // Round 3: a 400-token prompt sharing 8 tokens with request 3 (on rank 1): under 10 %
    // of the prompt, so it counts as no match and the tie on load goes to rank 0.
    let mut long: Vec<u64> = vec![100, 101];
    long.extend(500..598);
    let (m, a) = fleet.round(&[hashed(4, &long)]);
    assert_eq!(m, vec![vec![0], vec![8]]);
    assert_eq!(ranks(&a), vec![0]);

    // Round 4: a prompt sharing 48 of its 64 tokens with request 3 goes to rank 1, where
    // that prefix is cached, although rank 0 matches 8 tokens of it too (request 4).
    let mut near: Vec<u64> = (100..112).collect();
    near.extend(700..704);
    let (m, a) = fleet.round(&[hashed(5, &near)]);
    assert_eq!(m, vec![vec![8], vec![48]]);
    assert_eq!(ranks(&a), vec![1]);
    assert_eq!(fleet.fleet.counts(), vec![2, 2]);
}

#[test]
fn kv_aware_skips_the_cached_rank_once_it_is_at_expected() {
    let mut fleet = KvFleet::new(2, 2);
    let prefix: Vec<u64> = (1..=10).collect();
    fleet.round(&[hashed(1, &prefix)]);
    fleet.round(&[hashed(2, &[50])]);
    assert_eq!(fleet.fleet.counts(), vec![1, 1]);
    // Rank 0 caches all of request 3's prompt but two requests arrive: expected =
    // min(M = 2, 2 * ceil(4 / 2)) = 2. Request 3 takes rank 0 to 2; request 4, also
    // cached only on rank 0, must go to rank 1.
    let (m, a) = fleet.round(&[hashed(3, &prefix), hashed(4, &prefix)]);
    assert_eq!(m[0], vec![40, 40]);
    assert_eq!(a.expected, 2);
    assert_eq!(ranks(&a), vec![0, 1]);
    assert_eq!(a.violation, None);
}
