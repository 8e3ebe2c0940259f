//! Router tests (mechanisms.md §5, §10).

use proptest::prelude::*;

use super::*;
use crate::request::PinnedRank;

const KINDS: [RouterKind; 3] = [
    RouterKind::Balanced,
    RouterKind::Conversation,
    RouterKind::KvAware,
];

fn specs(prompts: &[u32]) -> Vec<RequestSpec> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, &p)| RequestSpec::new(i as u64 + 1, p, 8))
        .collect()
}

fn loads(counts: &[u32], tokens: &[u64]) -> Vec<RankLoad> {
    counts
        .iter()
        .zip(tokens)
        .map(|(&requests, &prompt_tokens)| RankLoad {
            requests,
            prompt_tokens,
        })
        .collect()
}

fn idle(dp: usize) -> Vec<RankLoad> {
    vec![RankLoad::default(); dp]
}

fn input<'a>(loads: &'a [RankLoad], new: &'a [RequestSpec], m: u32) -> RouteInput<'a> {
    RouteInput {
        loads,
        new,
        max_per_rank: m,
        prefix_matches: None,
    }
}

fn ranks(a: &Assignment) -> Vec<u32> {
    a.ranks.iter().map(|r| r.0).collect()
}

fn pin(mut spec: RequestSpec, rank: u32, strict: bool) -> RequestSpec {
    spec.pinned = Some(PinnedRank {
        rank: RankId(rank),
        strict,
    });
    spec
}

fn conv(mut spec: RequestSpec, id: u64) -> RequestSpec {
    spec.conversation = Some(ConvId(id));
    spec
}

/// Final per-rank counts after applying `a` on top of `loads`.
fn final_counts(loads: &[RankLoad], a: &Assignment) -> Vec<u32> {
    let mut counts: Vec<u32> = loads.iter().map(|l| l.requests).collect();
    for r in &a.ranks {
        counts[r.index()] += 1;
    }
    counts
}

// ---------------------------------------------------------------- expected, invariant

#[test]
fn expected_follows_the_formula_with_cap_multiplier_and_max_count() {
    // (counts, n_new, mult, cap, expected)
    type Row = (&'static [u32], u32, u32, Option<u32>, u32);
    let table: [Row; 11] = [
        (&[0, 0, 0, 0], 4, 1, None, 1),
        (&[0, 0, 0, 0], 5, 1, None, 2), // ceil(5 / 4)
        (&[1, 2, 3, 0], 2, 1, None, 3), // max(counts) = 3 dominates ceil(8 / 4) = 2
        (&[1, 2, 3, 0], 2, 2, None, 4), // mult 2: 2 * 2 beats max(counts)
        (&[1, 2, 3, 0], 2, 2, Some(3), 3),
        (&[0, 0], 7, 2, None, 8), // 2 * ceil(7 / 2)
        (&[0, 0], 7, 2, Some(4), 4),
        (&[5, 5], 0, 1, None, 5),
        (&[9, 0], 1, 1, Some(4), 4), // the cap wins over max(counts) too
        (&[], 3, 1, None, 0),        // dp = 0
        (&[u32::MAX, u32::MAX], u32::MAX, 2, None, u32::MAX), // saturates, no overflow
    ];
    for (i, &(counts, n_new, mult, cap, want)) in table.iter().enumerate() {
        assert_eq!(
            expected(counts, n_new, mult, cap),
            want,
            "#{i}: counts {counts:?} n_new {n_new} mult {mult} cap {cap:?}"
        );
    }
}

#[test]
fn the_routing_invariant_counts_only_room_below_expected() {
    // (counts, expected, n_new, ok)
    let table: [(&[u32], u32, u32, bool); 6] = [
        (&[0, 0], 2, 4, true),
        (&[0, 0], 2, 5, false),
        (&[3, 0], 2, 2, true), // rank 0 over expected contributes 0, not -1
        (&[3, 0], 2, 3, false),
        (&[], 0, 0, true),
        (&[], 0, 1, false),
    ];
    for (i, &(counts, expected, n_new, ok)) in table.iter().enumerate() {
        let got = check_routing_invariant(counts, expected, n_new);
        assert_eq!(got.is_ok(), ok, "#{i}: {got:?}");
    }
    let err = check_routing_invariant(&[3, 1], 2, 2).unwrap_err();
    assert_eq!(
        err,
        RoutingViolation {
            expected: 2,
            room: 1,
            n_new: 2,
            counts: vec![3, 1],
        }
    );
}

// ---------------------------------------------------------------- balanced

#[test]
fn balanced_sends_the_longest_prompt_to_the_rank_with_fewest_tokens() {
    let loads = loads(&[0, 0, 0], &[50, 10, 30]);
    let new = specs(&[5, 100, 20]);
    let a = Router::new(RouterKind::Balanced).route(input(&loads, &new, 4));
    // expected = 1: 100 → rank 1 (10 tokens), 20 → rank 2 (30), 5 → rank 0 (50).
    assert_eq!(a.expected, 1);
    assert_eq!(ranks(&a), vec![0, 1, 2]);
    assert_eq!(a.violation, None);
}

#[test]
fn balanced_breaks_ties_by_count_then_rank_id() {
    // Equal tokens: the rank with fewer requests first, then the lower id (expected = 2).
    let loads = loads(&[1, 0, 0], &[0, 0, 0]);
    let new = specs(&[9, 9, 9, 9]);
    let a = Router::new(RouterKind::Balanced).route(input(&loads, &new, 4));
    assert_eq!(a.expected, 2);
    assert_eq!(ranks(&a), vec![1, 2, 0, 1]);
    // Equal prompts keep FIFO order in the sort.
    let new = specs(&[3, 7, 7]);
    let a = Router::new(RouterKind::Balanced).route(input(&idle(3), &new, 4));
    assert_eq!(ranks(&a), vec![2, 0, 1]);
}

#[test]
fn balanced_never_fills_a_rank_past_expected() {
    // Rank 0 has no tokens but already holds `expected` requests.
    let loads = loads(&[2, 0, 0], &[0, 900, 800]);
    let new = specs(&[10, 10, 10, 10]);
    let a = Router::new(RouterKind::Balanced).route(input(&loads, &new, 4));
    assert_eq!(a.expected, 2);
    assert_eq!(final_counts(&loads, &a), vec![2, 2, 2]);
    assert_eq!(a.violation, None);
}

#[test]
fn strict_pins_are_placed_before_relaxed_pins() {
    // Rank 1 has room for one: the strict pin (later in FIFO) gets it, the relaxed one is
    // routed normally.
    let loads = loads(&[0, 3], &[0, 0]);
    let new = vec![
        pin(RequestSpec::new(1, 10, 8), 1, false),
        pin(RequestSpec::new(2, 10, 8), 1, true),
    ];
    let a = Router::new(RouterKind::Balanced).route(input(&loads, &new, 4));
    assert_eq!(ranks(&a), vec![0, 1]);
}

#[test]
fn a_pin_to_a_full_or_missing_rank_falls_back_to_routing() {
    let loads = loads(&[4, 0, 0], &[0, 0, 0]);
    let new = vec![
        pin(RequestSpec::new(1, 10, 8), 0, true), // rank 0 is at M
        pin(RequestSpec::new(2, 20, 8), 7, true), // no rank 7
        pin(RequestSpec::new(3, 5, 8), 2, false), // fits
    ];
    for kind in KINDS {
        let a = Router::new(kind).route(input(&loads, &new, 4));
        assert_eq!(a.ranks[2], RankId(2), "{kind:?}");
        assert!(a.ranks.iter().all(|r| r.index() < 3), "{kind:?}: {a:?}");
        if kind != RouterKind::Conversation {
            // Capped `expected` (= M here) keeps the fallback off the full rank.
            assert!(a.ranks[0] != RankId(0), "{kind:?}: {a:?}");
        }
    }
}

#[test]
fn a_pin_may_exceed_expected_but_not_m() {
    let new: Vec<_> = (1..=4)
        .map(|id| pin(RequestSpec::new(id, 10, 8), 0, true))
        .collect();
    let a = Router::new(RouterKind::Balanced).route(input(&idle(2), &new, 3));
    // The balance target is 2; the reported expected covers the pinned placement (3 = M).
    assert_eq!(a.expected, 3);
    assert_eq!(ranks(&a), vec![0, 0, 0, 1]);
}

/// One case of `testdata/balanced.txt`.
struct Case {
    name: String,
    counts: Vec<u32>,
    tokens: Vec<u64>,
    prompts: Vec<u32>,
    m: u32,
    want: Vec<u32>,
}

fn parse_list<T: std::str::FromStr>(field: &str) -> Vec<T>
where
    T::Err: std::fmt::Debug,
{
    field
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("a number"))
        .collect()
}

fn balanced_cases() -> Vec<Case> {
    include_str!("testdata/balanced.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|line| {
            let f: Vec<&str> = line.split('|').map(str::trim).collect();
            assert_eq!(f.len(), 6, "malformed case: {line}");
            Case {
                name: f[0].to_string(),
                counts: parse_list(f[1]),
                tokens: parse_list(f[2]),
                prompts: parse_list(f[3]),
                m: f[4].parse().expect("M"),
                want: parse_list(f[5]),
            }
        })
        .collect()
}

#[test]
fn balanced_matches_the_cases_in_testdata() {
    let cases = balanced_cases();
    assert!(cases.len() >= 5);
    for (i, c) in cases.iter().enumerate() {
        let loads = loads(&c.counts, &c.tokens);
        let new = specs(&c.prompts);
        let a = Router::new(RouterKind::Balanced).route(input(&loads, &new, c.m));
        assert_eq!(ranks(&a), c.want, "#{i} {}: {a:?}", c.name);
        assert_eq!(a.violation, None, "#{i} {}", c.name);
    }
}

// ---------------------------------------------------------------- conversation

#[test]
fn a_conversation_sticks_to_its_rank_while_under_m() {
    let mut router = Router::new(RouterKind::Conversation);
    let a = router.route(input(&idle(4), &[conv(RequestSpec::new(1, 10, 8), 7)], 4));
    assert_eq!(ranks(&a), vec![0]);
    assert_eq!(router.bound_rank(ConvId(7)), Some(RankId(0)));
    // Rank 0 is at `expected` (3) but under M (4): the conversation still sticks.
    let loads = loads(&[3, 0, 0, 0], &[0; 4]);
    let a = router.route(input(&loads, &[conv(RequestSpec::new(2, 10, 8), 7)], 4));
    // The balance target is 3; the reported expected covers the sticky placement (4 = M).
    assert_eq!(a.expected, 4);
    assert_eq!(ranks(&a), vec![0]);
}

#[test]
fn a_conversation_moves_when_its_rank_is_full() {
    let mut router = Router::new(RouterKind::Conversation);
    let a = router.route(input(&idle(2), &[conv(RequestSpec::new(1, 10, 8), 7)], 4));
    assert_eq!(ranks(&a), vec![0]);
    let loads = loads(&[4, 0], &[0, 0]);
    let a = router.route(input(&loads, &[conv(RequestSpec::new(2, 10, 8), 7)], 4));
    assert_eq!(ranks(&a), vec![1]);
    assert_eq!(router.bound_rank(ConvId(7)), Some(RankId(1)));
}

#[test]
fn round_robin_spreads_unbound_conversations() {
    let mut router = Router::new(RouterKind::Conversation);
    let new: Vec<_> = (1..=4)
        .map(|id| conv(RequestSpec::new(id, 10, 8), 100 + id))
        .collect();
    let a = router.route(input(&idle(3), &new, 4));
    assert_eq!(ranks(&a), vec![0, 1, 2, 0]);
    // The pointer carries over to the next round; requests without a conversation take
    // the round-robin path too and bind nothing.
    let loads = loads(&[2, 1, 1], &[0; 3]);
    let a = router.route(input(&loads, &specs(&[10, 10]), 4));
    assert_eq!(ranks(&a), vec![1, 2]);
    for id in 101..=104 {
        assert!(router.bound_rank(ConvId(id)).is_some(), "conversation {id}");
    }
}

#[test]
fn round_robin_skips_a_rank_at_expected() {
    // expected = max(2 * ceil(7 / 4), 6) = 6: rank 0, where the pointer starts, is at it.
    let mut router = Router::new(RouterKind::Conversation);
    let loads = loads(&[6, 0, 0, 0], &[0; 4]);
    let new = vec![conv(RequestSpec::new(1, 10, 8), 1)];
    let a = router.route(input(&loads, &new, 8));
    assert_eq!(a.expected, 6);
    assert_eq!(ranks(&a), vec![1]);
}

#[test]
fn the_lru_evicts_the_least_recently_used_conversation() {
    let mut router = Router::with_lru_capacity(2);
    let round = |router: &mut Router, id: u64, c: u64| {
        router.route(input(&idle(2), &[conv(RequestSpec::new(id, 10, 8), c)], 4));
    };
    round(&mut router, 1, 1);
    round(&mut router, 2, 2);
    round(&mut router, 3, 1); // refreshes 1: 2 is now the least recently used
    round(&mut router, 4, 3);
    assert!(router.bound_rank(ConvId(1)).is_some());
    assert_eq!(router.bound_rank(ConvId(2)), None);
    assert!(router.bound_rank(ConvId(3)).is_some());
}

#[test]
fn bound_rank_does_not_refresh_the_lru() {
    let mut router = Router::with_lru_capacity(2);
    let round = |router: &mut Router, id: u64, c: u64| {
        router.route(input(&idle(2), &[conv(RequestSpec::new(id, 10, 8), c)], 4));
    };
    round(&mut router, 1, 1);
    round(&mut router, 2, 2);
    assert!(router.bound_rank(ConvId(1)).is_some());
    round(&mut router, 3, 3);
    assert_eq!(router.bound_rank(ConvId(1)), None);
    assert!(router.bound_rank(ConvId(2)).is_some());
}

#[test]
fn a_pinned_request_binds_its_conversation_to_the_pinned_rank() {
    let mut router = Router::new(RouterKind::Conversation);
    let new = vec![pin(conv(RequestSpec::new(1, 10, 8), 9), 2, false)];
    let a = router.route(input(&idle(3), &new, 4));
    assert_eq!(ranks(&a), vec![2]);
    assert_eq!(router.bound_rank(ConvId(9)), Some(RankId(2)));
    let a = router.route(input(&idle(3), &[conv(RequestSpec::new(2, 10, 8), 9)], 4));
    assert_eq!(ranks(&a), vec![2]);
}

#[test]
fn other_routers_bind_no_conversation() {
    for kind in [RouterKind::Balanced, RouterKind::KvAware] {
        let mut router = Router::new(kind);
        router.route(input(&idle(2), &[conv(RequestSpec::new(1, 10, 8), 5)], 4));
        assert_eq!(router.bound_rank(ConvId(5)), None, "{kind:?}");
    }
}

// ---------------------------------------------------------------- kv_aware

fn kv_route(loads: &[RankLoad], new: &[RequestSpec], m: u32, pm: &[Vec<u32>]) -> Assignment {
    let mut router = Router::new(RouterKind::KvAware);
    assert!(router.needs_prefix_matches());
    router.route(RouteInput {
        loads,
        new,
        max_per_rank: m,
        prefix_matches: Some(pm),
    })
}

#[test]
fn kv_aware_prefers_the_rank_with_the_long_cached_prefix() {
    // Rank 1 carries more load but caches 800 of 1000 tokens:
    // rank 0: 1000 + 0; rank 1: 200 + 500/1000 * 1000 = 700.
    let loads = loads(&[0, 0], &[0, 500]);
    let a = kv_route(&loads, &specs(&[1000]), 4, &[vec![0], vec![800]]);
    assert_eq!(ranks(&a), vec![1]);
}

#[test]
fn kv_aware_ignores_a_match_under_ten_percent() {
    let loads = loads(&[0, 0], &[0, 10]);
    // 99 < 10% of 1000: counts as 0, so rank 1 only has more load.
    let a = kv_route(&loads, &specs(&[1000]), 4, &[vec![0], vec![99]]);
    assert_eq!(ranks(&a), vec![0]);
    // Exactly 10% counts.
    let a = kv_route(&loads, &specs(&[1000]), 4, &[vec![0], vec![100]]);
    assert_eq!(ranks(&a), vec![1]);
}

#[test]
fn kv_aware_balances_load_when_matches_are_equal() {
    let loads1 = loads(&[0, 0], &[300, 100]);
    let a = kv_route(&loads1, &specs(&[100]), 4, &[vec![50], vec![50]]);
    assert_eq!(ranks(&a), vec![1]);
    // No matches at all (or none reported): equal first, then the load placed this round
    // pushes the second request away.
    let a = kv_route(&idle(2), &specs(&[100, 100]), 4, &[vec![], vec![]]);
    assert_eq!(ranks(&a), vec![0, 1]);
    let a = Router::new(RouterKind::KvAware).route(input(&idle(2), &specs(&[100, 100]), 4));
    assert_eq!(ranks(&a), vec![0, 1]);
}

#[test]
fn kv_aware_skips_a_cached_rank_at_expected() {
    // expected = min(M = 2, max(2 * ceil(3 / 2), 2)) = 2: rank 0 is full despite the match.
    let loads = loads(&[2, 0], &[0, 0]);
    let a = kv_route(&loads, &specs(&[1000]), 2, &[vec![1000], vec![0]]);
    assert_eq!(a.expected, 2);
    assert_eq!(ranks(&a), vec![1]);
}

#[test]
fn kv_aware_scores_empty_prompts_on_an_idle_fleet_without_nan() {
    let a = kv_route(
        &idle(3),
        &specs(&[0, 0, 0]),
        4,
        &[vec![0; 3], vec![0; 3], vec![0; 3]],
    );
    // expected = 2; every score is 0, so (load, rank id) decides.
    assert_eq!(ranks(&a), vec![0, 0, 1]);
    assert_eq!(a.violation, None);
}

// ---------------------------------------------------------------- violations

#[test]
fn a_routing_violation_is_reported_and_no_request_is_dropped() {
    // Every rank is at M: balanced and kv_aware cap `expected` at M, so there is no room.
    let loads = loads(&[4, 4], &[0, 0]);
    let new = specs(&[10, 20, 30]);
    for kind in [RouterKind::Balanced, RouterKind::KvAware] {
        let a = Router::new(kind).route(input(&loads, &new, 4));
        let v = a.violation.clone().expect("a violation");
        assert_eq!(v.expected, 4, "{kind:?}");
        assert_eq!(v.room, 0, "{kind:?}");
        assert_eq!(v.n_new, 3, "{kind:?}");
        assert_eq!(v.counts, vec![4, 4], "{kind:?}");
        assert_eq!(a.ranks.len(), 3, "{kind:?}");
        // Least loaded (count, rank id) each time: the two ranks alternate.
        assert_eq!(final_counts(&loads, &a), vec![6, 5], "{kind:?}: {a:?}");
    }
    // The conversation router's uncapped `expected` leaves room; nothing is dropped either.
    let a = Router::new(RouterKind::Conversation).route(input(&loads, &new, 4));
    assert_eq!(a.violation, None);
    assert_eq!(a.ranks.len(), 3);
}

#[test]
fn routing_with_no_ranks_reports_a_violation_instead_of_panicking() {
    let new = specs(&[10, 20]);
    for kind in KINDS {
        let a = Router::new(kind).route(input(&[], &new, 4));
        assert_eq!(a.ranks.len(), 2, "{kind:?}");
        assert_eq!(a.expected, 0, "{kind:?}");
        assert!(a.violation.is_some(), "{kind:?}");
        let a = Router::new(kind).route(input(&[], &[], 4));
        assert_eq!(a.violation, None, "{kind:?}");
    }
}

#[test]
fn short_prefix_match_tables_count_as_no_match() {
    let a = kv_route(&idle(3), &specs(&[100, 100]), 4, &[vec![100]]);
    assert_eq!(ranks(&a), vec![0, 1]);
}

// ---------------------------------------------------------------- properties

#[derive(Debug, Clone)]
struct RoundCase {
    loads: Vec<RankLoad>,
    new: Vec<RequestSpec>,
    m: u32,
    matches: Vec<Vec<u32>>,
}

fn round_case() -> impl Strategy<Value = RoundCase> {
    (1usize..=5, 1u32..=5)
        .prop_flat_map(|(dp, m)| {
            (
                prop::collection::vec((0..=m, 0u64..20_000), dp),
                Just(m),
                prop::collection::vec(
                    (
                        0u32..3000,
                        prop::option::of((0u32..=dp as u32, any::<bool>())),
                        prop::option::of(0u64..6),
                    ),
                    dp * m as usize,
                ),
                prop::collection::vec(prop::collection::vec(0u32..3000, dp * m as usize), dp),
                any::<u32>(),
            )
        })
        .prop_map(|(ranks, m, reqs, matches, pick)| {
            let loads: Vec<RankLoad> = ranks
                .iter()
                .map(|&(requests, prompt_tokens)| RankLoad {
                    requests,
                    prompt_tokens,
                })
                .collect();
            let used: u32 = ranks.iter().map(|r| r.0).sum();
            // Admission's bound: Σcounts + n_new <= dp * M.
            let room = loads.len() as u32 * m - used;
            let n = (pick % (room + 1)) as usize;
            let new = reqs
                .iter()
                .take(n)
                .enumerate()
                .map(|(i, &(prompt, pin, c))| {
                    let mut s = RequestSpec::new(i as u64 + 1, prompt, 8);
                    s.pinned = pin.map(|(rank, strict)| PinnedRank {
                        rank: RankId(rank),
                        strict,
                    });
                    s.conversation = c.map(ConvId);
                    s
                })
                .collect();
            RoundCase {
                loads,
                new,
                m,
                matches,
            }
        })
}

fn route_case(kind: RouterKind, c: &RoundCase, new: &[RequestSpec]) -> (Router, Assignment) {
    let mut router = Router::new(kind);
    let a = router.route(RouteInput {
        loads: &c.loads,
        new,
        max_per_rank: c.m,
        prefix_matches: Some(&c.matches),
    });
    (router, a)
}

proptest! {
    #[test]
    fn routing_is_deterministic_complete_and_within_bounds(c in round_case()) {
        let dp = c.loads.len();
        for kind in KINDS {
            let (r1, a1) = route_case(kind, &c, &c.new);
            let (r2, a2) = route_case(kind, &c, &c.new);
            prop_assert_eq!(&a1, &a2, "{:?}", kind);
            prop_assert_eq!(&r1, &r2, "{:?}", kind);
            prop_assert_eq!(a1.ranks.len(), c.new.len());
            prop_assert!(a1.ranks.iter().all(|r| r.index() < dp), "{:?}: {:?}", kind, a1);
            // Counts <= M and Σcounts + n_new <= dp * M: the invariant always holds.
            prop_assert_eq!(&a1.violation, &None, "{:?}", kind);
            if kind != RouterKind::Conversation {
                // Pins stop at M and the rest stop at expected <= M.
                let counts = final_counts(&c.loads, &a1);
                prop_assert!(counts.iter().all(|&n| n <= c.m), "{:?}: {:?}", kind, counts);
            }
        }
    }

    #[test]
    fn without_pins_no_rank_ends_past_expected(c in round_case()) {
        let new: Vec<RequestSpec> = c
            .new
            .iter()
            .cloned()
            .map(|mut s| {
                s.pinned = None;
                s
            })
            .collect();
        for kind in [RouterKind::Balanced, RouterKind::KvAware] {
            let (_, a) = route_case(kind, &c, &new);
            prop_assert_eq!(&a.violation, &None);
            let counts = final_counts(&c.loads, &a);
            for (r, &n) in counts.iter().enumerate() {
                prop_assert!(n <= a.expected, "{:?}: rank {} has {} > {}", kind, r, n, a.expected);
            }
        }
    }

    #[test]
    fn pinned_requests_land_on_their_rank_whenever_it_has_room(c in round_case()) {
        let dp = c.loads.len();
        for kind in KINDS {
            let (_, a) = route_case(kind, &c, &c.new);
            for r in 0..dp {
                let to_r = |strict_only: bool| {
                    c.new
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| {
                            s.pinned
                                .is_some_and(|p| p.rank.index() == r && (p.strict || !strict_only))
                        })
                        .map(|(i, _)| i)
                        .collect::<Vec<_>>()
                };
                let base = c.loads[r].requests as usize;
                for strict_only in [true, false] {
                    let pins = to_r(strict_only);
                    if base + pins.len() <= c.m as usize {
                        for i in pins {
                            prop_assert_eq!(a.ranks[i].index(), r, "{:?}: request {}", kind, i);
                        }
                    }
                }
            }
        }
    }
}
