//! Unit and property tests of the KV manager.

use proptest::prelude::*;

use super::*;

const TPB: u32 = 4;

fn kv(total_blocks: u32, index_pool_size: u32) -> KvManager {
    KvManager::new(KvConfig {
        tokens_per_block: TPB,
        total_blocks,
        enable_block_reuse: true,
        index_pool_size,
    })
}

fn ids(kv: &KvManager, id: u64) -> Vec<u32> {
    kv.block_ids_of(ReqId(id)).iter().map(|b| b.0).collect()
}

/// Frees `id`, which must hold a sequence; the block references it dropped.
fn free_held(kv: &mut KvManager, id: ReqId) -> u32 {
    match kv.free_sequence(id) {
        Freed::Sequence { blocks } => blocks,
        Freed::NothingHeld => panic!("request {id} held nothing to free"),
    }
}

/// Used, free and index slots: what a refused call must leave as it was.
fn gauges(kv: &KvManager) -> (u32, u32, u32) {
    (kv.used_blocks(), kv.free_blocks(), kv.index_slots_used())
}

#[test]
fn allocation_takes_the_lowest_free_block_ids_first() {
    let mut kv = kv(8, 4);
    assert_eq!(kv.add_sequence(ReqId(1), &[], 5), Ok(0));
    kv.ensure_tokens(ReqId(1), 9).unwrap();
    assert_eq!(ids(&kv, 1), vec![0, 1, 2]);
    kv.add_sequence(ReqId(2), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(2), 4).unwrap();
    assert_eq!(ids(&kv, 2), vec![3]);
    free_held(&mut kv, ReqId(1));
    kv.add_sequence(ReqId(3), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(3), 8).unwrap();
    assert_eq!(
        ids(&kv, 3),
        vec![0, 1],
        "freed low ids are reused before higher ones"
    );
    assert_eq!(kv.counters().allocations, 6);
    assert_eq!(kv.slot_of(ReqId(3)), Some(Seat(0)));
    kv.check_invariants().unwrap();
}

#[test]
fn ensure_tokens_grows_and_out_of_blocks_changes_nothing() {
    let mut kv = kv(4, 4);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(1), 1).unwrap();
    assert_eq!(kv.blocks_of(ReqId(1)), 1);
    kv.ensure_tokens(ReqId(1), 4).unwrap();
    assert_eq!(kv.blocks_of(ReqId(1)), 1, "a full block holds tpb tokens");
    kv.ensure_tokens(ReqId(1), 10).unwrap();
    assert_eq!(kv.blocks_of(ReqId(1)), 3);
    kv.ensure_tokens(ReqId(1), 2).unwrap();
    assert_eq!(kv.blocks_of(ReqId(1)), 3, "never shrinks");
    assert_eq!(kv.blocks_needed(ReqId(1), 20), 2);
    assert_eq!(
        kv.blocks_needed(ReqId(99), 5),
        2,
        "unknown id needs all of them"
    );

    let before = kv.pool.clone();
    let counters = *kv.counters();
    assert_eq!(
        kv.ensure_tokens(ReqId(1), 20),
        Err(KvError::OutOfBlocks { needed: 2, free: 1 })
    );
    assert_eq!(kv.pool, before);
    assert_eq!(*kv.counters(), counters);
    assert_eq!(
        kv.ensure_tokens(ReqId(7), 1),
        Err(KvError::UnknownSequence(ReqId(7)))
    );
    assert_eq!(kv.pool, before);
    kv.check_invariants().unwrap();
}

#[test]
fn free_sequence_returns_its_blocks_and_slot() {
    let mut kv = kv(6, 2);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(1), 12).unwrap();
    assert_eq!(
        (kv.used_blocks(), kv.free_blocks(), kv.index_slots_used()),
        (3, 3, 1)
    );
    assert_eq!(free_held(&mut kv, ReqId(1)), 3);
    assert_eq!(
        (kv.used_blocks(), kv.free_blocks(), kv.index_slots_used()),
        (0, 6, 0)
    );
    assert!(!kv.has_sequence(ReqId(1)));
    assert_eq!(kv.blocks_of(ReqId(1)), 0);
    assert_eq!(kv.free_sequence(ReqId(1)), Freed::NothingHeld);
    kv.check_invariants().unwrap();
}

#[test]
fn prefix_is_reused_after_register_and_free_and_capped_to_compute_one_token() {
    let mut kv = kv(8, 4);
    let hashes = [11, 22, 33];
    kv.add_sequence(ReqId(1), &hashes, 12).unwrap();
    kv.ensure_tokens(ReqId(1), 13).unwrap();
    kv.register_prefix(ReqId(1), &hashes, 12).unwrap();
    kv.register_prefix(ReqId(1), &hashes, 12).unwrap(); // idempotent
    let held = ids(&kv, 1);
    free_held(&mut kv, ReqId(1));
    assert_eq!(kv.cached_blocks(), 3, "keyed blocks stay cached");
    assert_eq!(kv.free_blocks(), 8, "cached blocks still count as free");
    assert_eq!(kv.longest_prefix_match(&hashes), 12);
    assert_eq!(kv.longest_prefix_match(&[11, 22, 99]), 8);
    assert_eq!(
        kv.longest_prefix_match(&[22]),
        0,
        "keys are chained, not per block"
    );

    // A 12-token prompt over 3 cached blocks reuses only 2: the last token is computed.
    assert_eq!(kv.add_sequence(ReqId(2), &hashes, 12), Ok(8));
    assert_eq!(ids(&kv, 2), held[..2].to_vec());
    assert_eq!(kv.counters().reuse_hits, 2);
    assert_eq!(kv.used_blocks(), 2);
    // A longer prompt shares the same blocks (refcount 2) and takes the third too.
    assert_eq!(kv.add_sequence(ReqId(3), &hashes, 13), Ok(12));
    assert_eq!(ids(&kv, 3), held[..3].to_vec());
    assert_eq!(kv.used_blocks(), 3);
    assert_eq!(kv.blocks_needed(ReqId(3), 13), 1);
    assert_eq!(kv.add_sequence(ReqId(4), &hashes, 0), Ok(0));
    kv.check_invariants().unwrap();

    free_held(&mut kv, ReqId(2));
    assert_eq!(kv.used_blocks(), 3, "blocks shared with 3 stay referenced");
    kv.check_invariants().unwrap();
}

#[test]
fn prefix_reuse_is_off_when_disabled() {
    let mut kv = KvManager::new(KvConfig {
        tokens_per_block: TPB,
        total_blocks: 4,
        enable_block_reuse: false,
        index_pool_size: 2,
    });
    kv.add_sequence(ReqId(1), &[1, 2], 9).unwrap();
    kv.ensure_tokens(ReqId(1), 9).unwrap();
    kv.register_prefix(ReqId(1), &[1, 2], 8).unwrap();
    free_held(&mut kv, ReqId(1));
    assert_eq!(kv.cached_blocks(), 0);
    assert_eq!(kv.longest_prefix_match(&[1, 2]), 0);
    assert_eq!(kv.add_sequence(ReqId(2), &[1, 2], 9), Ok(0));
    assert_eq!(kv.counters().reuse_hits, 0);
}

#[test]
fn lru_eviction_takes_the_least_recently_freed_cached_block_first() {
    let mut kv = kv(3, 4);
    // Three one-block prompts, each cached, freed in the order 2, 1, 3.
    for id in 1..=3u64 {
        kv.add_sequence(ReqId(id), &[id], 5).unwrap();
        kv.ensure_tokens(ReqId(id), 4).unwrap();
        kv.register_prefix(ReqId(id), &[id], 4).unwrap();
    }
    let block = |kv: &KvManager, id| ids(kv, id)[0];
    let (b1, b2, b3) = (block(&kv, 1), block(&kv, 2), block(&kv, 3));
    for id in [2, 1, 3] {
        free_held(&mut kv, ReqId(id));
    }
    assert_eq!(kv.cached_blocks(), 3);

    kv.add_sequence(ReqId(10), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(10), 4).unwrap();
    assert_eq!(ids(&kv, 10), vec![b2], "prefix 2 was freed first");
    assert_eq!(kv.counters().evictions, 1);
    assert_eq!(kv.longest_prefix_match(&[2]), 0, "evicted key is forgotten");
    assert_eq!(kv.longest_prefix_match(&[1]), 4);

    // Reusing prefix 1 takes it out of the LRU, so the next eviction takes 3.
    assert_eq!(kv.add_sequence(ReqId(11), &[1], 5), Ok(4));
    assert_eq!(ids(&kv, 11), vec![b1]);
    kv.add_sequence(ReqId(12), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(12), 1).unwrap();
    assert_eq!(ids(&kv, 12), vec![b3]);
    assert_eq!(kv.counters().evictions, 2);
    assert_eq!(kv.free_blocks(), 0);
    kv.check_invariants().unwrap();
}

#[test]
fn free_list_is_used_before_any_cached_block_is_evicted() {
    let mut kv = kv(3, 4);
    kv.add_sequence(ReqId(1), &[7], 5).unwrap();
    kv.ensure_tokens(ReqId(1), 4).unwrap();
    kv.register_prefix(ReqId(1), &[7], 4).unwrap();
    free_held(&mut kv, ReqId(1));
    kv.add_sequence(ReqId(2), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(2), 8).unwrap();
    assert_eq!(ids(&kv, 2), vec![1, 2]);
    assert_eq!(kv.counters().evictions, 0);
    assert_eq!(kv.longest_prefix_match(&[7]), 4);
}

#[test]
fn full_index_pool_returns_no_free_index_slot_and_counts_a_deferral() {
    let mut kv = kv(8, 2);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    kv.add_sequence(ReqId(2), &[], 1).unwrap();
    let before = kv.pool.clone();
    assert_eq!(
        kv.add_sequence(ReqId(3), &[], 1),
        Err(KvError::NoFreeIndexSlot { used: 2, size: 2 })
    );
    assert_eq!(kv.counters().deferrals_no_free_index_slot, 1);
    assert_eq!(kv.pool, before, "only the counter changed");
    assert_eq!(
        kv.add_sequence(ReqId(1), &[], 1),
        Err(KvError::DuplicateSequence(ReqId(1)))
    );
    assert_eq!(kv.counters().deferrals_no_free_index_slot, 1);
    free_held(&mut kv, ReqId(1));
    kv.add_sequence(ReqId(3), &[], 1).unwrap();
    assert_eq!(kv.slot_of(ReqId(3)), Some(Seat(0)));
    kv.check_invariants().unwrap();
}

#[test]
fn dummy_allocate_commit_free_restores_the_free_counts() {
    let mut kv = kv(4, 3);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(1), 4).unwrap();
    let before = gauges(&kv);
    let d = kv.allocate_dummy(1).unwrap();
    assert_eq!(gauges(&kv), (before.0 + 1, before.1 - 1, before.2 + 1));
    assert!(kv.has_sequence(ReqId::DUMMY));
    kv.commit_dummy(d);
    assert!(
        kv.has_sequence(ReqId::DUMMY),
        "a committed dummy stays until freed"
    );
    kv.check_invariants().unwrap();
    free_held(&mut kv, ReqId::DUMMY);
    assert_eq!(gauges(&kv), before);
    let c = kv.counters();
    assert_eq!(
        (c.dummy_allocations, c.dummy_commits, c.dummy_rollbacks),
        (1, 1, 0)
    );
    kv.check_invariants().unwrap();
}

#[test]
fn dummy_allocate_rollback_restores_exactly_the_previous_state() {
    let mut kv = kv(4, 3);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(1), 4).unwrap();
    let before = kv.pool.clone();
    let d = kv.allocate_dummy(2).unwrap();
    assert_eq!(kv.blocks_of(ReqId::DUMMY), 1);
    assert_eq!(kv.rollback_dummy(d), Freed::Sequence { blocks: 1 });
    assert!(!kv.has_sequence(ReqId::DUMMY));
    assert_eq!(kv.pool, before);
    let c = kv.counters();
    assert_eq!(
        (c.dummy_allocations, c.dummy_commits, c.dummy_rollbacks),
        (1, 0, 1)
    );
    kv.check_invariants().unwrap();
}

#[test]
fn rolling_back_a_dummy_already_freed_has_nothing_to_undo() {
    let mut kv = kv(4, 3);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    let before = kv.pool.clone();
    let d = kv.allocate_dummy(5).unwrap();
    assert_eq!(free_held(&mut kv, ReqId::DUMMY), 2);
    let freed_once = kv.pool.clone();
    assert_eq!(kv.rollback_dummy(d), Freed::NothingHeld);
    assert_eq!(kv.pool, freed_once, "nothing left to undo, nothing changed");
    assert_eq!(kv.pool, before);
    assert_eq!(kv.counters().dummy_rollbacks, 1, "still a rollback");
    kv.check_invariants().unwrap();
}

#[test]
fn dummy_allocation_is_refused_without_a_slot_or_blocks_and_changes_nothing() {
    // No slot.
    let mut kv1 = kv(4, 1);
    kv1.add_sequence(ReqId(1), &[], 1).unwrap();
    let before = kv1.pool.clone();
    let counters = *kv1.counters();
    assert_eq!(
        kv1.allocate_dummy(1).map(expect_refused),
        Err(KvError::NoFreeIndexSlot { used: 1, size: 1 })
    );
    assert_eq!(kv1.pool, before);
    assert_eq!(*kv1.counters(), counters);

    // No blocks.
    let mut kv2 = kv(2, 4);
    kv2.add_sequence(ReqId(1), &[], 1).unwrap();
    kv2.ensure_tokens(ReqId(1), 8).unwrap();
    let before = kv2.pool.clone();
    let counters = *kv2.counters();
    assert_eq!(
        kv2.allocate_dummy(1).map(expect_refused),
        Err(KvError::OutOfBlocks { needed: 1, free: 0 })
    );
    assert_eq!(kv2.pool, before);
    assert_eq!(*kv2.counters(), counters);
}

/// Consumes a token that a test expected never to get.
fn expect_refused(d: TentativeDummyKv) {
    d.consume();
    panic!("expected the dummy allocation to be refused");
}

#[test]
fn a_second_dummy_is_refused_while_one_is_alive() {
    let mut kv = kv(4, 4);
    let d = kv.allocate_dummy(1).unwrap();
    let before = kv.pool.clone();
    let second = kv.allocate_dummy(1);
    assert_eq!(second, Err(KvError::DuplicateSequence(ReqId::DUMMY)));
    assert_eq!(kv.pool, before);
    assert_eq!(kv.rollback_dummy(d), Freed::Sequence { blocks: 1 });
    assert_eq!(kv.free_blocks(), 4);
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "TentativeDummyKv dropped")]
fn dropping_an_unconsumed_dummy_panics_in_debug_builds() {
    let mut kv = kv(4, 4);
    let d = kv.allocate_dummy(1).unwrap();
    drop(d);
}

#[test]
fn zero_tokens_per_block_is_treated_as_one() {
    let kv = KvManager::new(KvConfig {
        tokens_per_block: 0,
        total_blocks: 2,
        enable_block_reuse: true,
        index_pool_size: 1,
    });
    assert_eq!(kv.tokens_per_block(), 1);
    assert_eq!(kv.blocks_for_tokens(3), 3);
}

#[test]
fn kv_view_delegates_to_the_manager() {
    let mut kv = kv(4, 2);
    kv.add_sequence(ReqId(5), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(5), 5).unwrap();
    let v: &dyn KvView = &kv;
    assert_eq!(v.tokens_per_block(), TPB);
    assert_eq!(v.free_blocks(), 2);
    assert!(v.has_sequence(ReqId(5)));
    assert_eq!(v.blocks_of(ReqId(5)), 2);
    assert_eq!(v.blocks_needed(ReqId(5), 12), 1);
    assert_eq!(v.blocks_needed(ReqId(6), 12), 3);
}

#[test]
fn check_invariants_reports_a_corrupted_pool() {
    let mut kv = kv(4, 2);
    kv.add_sequence(ReqId(1), &[], 1).unwrap();
    kv.ensure_tokens(ReqId(1), 4).unwrap();
    kv.pool.refcount[0] = 2;
    let e = kv.check_invariants().unwrap_err();
    assert_eq!(e.name, "refcount_matches_holders");
    assert!(e.detail.contains("refcount 2"), "{}", e.detail);
}

#[test]
fn free_list_pops_lowest_first_across_words() {
    let mut f = FreeList::full(130);
    assert_eq!(f.len(), 130);
    assert!(!f.contains(130));
    let first: Vec<u32> = (0..70).map(|_| f.pop_first().unwrap()).collect();
    assert_eq!(first, (0..70).collect::<Vec<u32>>());
    f.insert(65);
    f.insert(3);
    f.remove(71);
    assert_eq!(f.pop_first(), Some(3));
    assert_eq!(f.pop_first(), Some(65));
    assert_eq!(f.pop_first(), Some(70));
    assert_eq!(f.pop_first(), Some(72));
    assert_eq!(f.len(), 130 - 70 - 3);
    while f.pop_first().is_some() {}
    assert_eq!((f.len(), f.pop_first()), (0, None));
    assert_eq!(
        f,
        FreeList {
            words: vec![0; 3],
            len: 0,
            first: 0
        },
        "the cursor is a hint"
    );
}

#[test]
fn evicted_prefixes_stop_matching_and_stale_keys_are_purged() {
    // 64 blocks, 8 per sequence: every sequence evicts the cached blocks of one freed
    // 8 sequences earlier, so thousands of evictions pass the purge threshold.
    let mut kv = kv(64, 2);
    let hashes = |i: u64| (0..8).map(|j| i * 1_000 + j).collect::<Vec<u64>>();
    for i in 1..=600u64 {
        let h = hashes(i);
        assert_eq!(kv.add_sequence(ReqId(i), &h, 8 * TPB), Ok(0));
        kv.ensure_tokens(ReqId(i), 8 * TPB).unwrap();
        kv.register_prefix(ReqId(i), &h, 8 * TPB).unwrap();
        free_held(&mut kv, ReqId(i));
        if i % 50 == 0 {
            assert_eq!(kv.check_invariants(), Ok(()), "after sequence {i}");
        }
    }
    assert!(kv.counters().evictions > 4_000);
    assert!(
        kv.pool.key_to_block.len() <= 2 * 64 + 1_024,
        "stale entries are purged: {} entries",
        kv.pool.key_to_block.len()
    );
    // The last 8 sequences are cached (a reuse never covers the last prompt token);
    // older ones were evicted and must not match through a stale entry.
    assert_eq!(kv.longest_prefix_match(&hashes(600)), 8 * TPB);
    assert_eq!(kv.longest_prefix_match(&hashes(593)), 8 * TPB);
    assert_eq!(kv.longest_prefix_match(&hashes(592)), 0);
    assert_eq!(kv.longest_prefix_match(&hashes(1)), 0);
    // Re-publishing an evicted prefix takes its stale entry over.
    let h = hashes(1);
    kv.add_sequence(ReqId(10_000), &h, 8 * TPB).unwrap();
    kv.ensure_tokens(ReqId(10_000), 8 * TPB).unwrap();
    kv.register_prefix(ReqId(10_000), &h, 8 * TPB).unwrap();
    free_held(&mut kv, ReqId(10_000));
    assert_eq!(kv.longest_prefix_match(&h), 8 * TPB);
    assert_eq!(kv.check_invariants(), Ok(()));
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        id: u64,
        hashes: Vec<u64>,
        prompt_len: u32,
    },
    Ensure {
        id: u64,
        tokens: u32,
    },
    Register {
        id: u64,
        hashes: Vec<u64>,
        computed: u32,
    },
    Free {
        id: u64,
    },
    Dummy {
        tokens: u32,
        commit: bool,
    },
    FreeDummy,
}

fn hashes() -> impl Strategy<Value = Vec<u64>> {
    // A three-letter alphabet so chained prefixes collide often.
    prop::collection::vec(0u64..3, 0..5)
}

fn op() -> impl Strategy<Value = Op> {
    let id = 1u64..6;
    prop_oneof![
        (id.clone(), hashes(), 0u32..24).prop_map(|(id, hashes, prompt_len)| Op::Add {
            id,
            hashes,
            prompt_len
        }),
        (id.clone(), 0u32..40).prop_map(|(id, tokens)| Op::Ensure { id, tokens }),
        (id.clone(), hashes(), 0u32..24).prop_map(|(id, hashes, computed)| Op::Register {
            id,
            hashes,
            computed
        }),
        id.prop_map(|id| Op::Free { id }),
        (0u32..12, any::<bool>()).prop_map(|(tokens, commit)| Op::Dummy { tokens, commit }),
        Just(Op::FreeDummy),
    ]
}

/// Applies `op`; `Ok(())` if it succeeded.
fn apply(kv: &mut KvManager, op: &Op) -> Result<(), KvError> {
    match op {
        Op::Add {
            id,
            hashes,
            prompt_len,
        } => {
            let matched = kv.longest_prefix_match(hashes);
            let reused = kv.add_sequence(ReqId(*id), hashes, *prompt_len)?;
            assert!(reused <= matched, "reused {reused} > match {matched}");
            assert!(
                reused < (*prompt_len).max(1),
                "reused {reused} of prompt {prompt_len}"
            );
            assert_eq!(kv.blocks_of(ReqId(*id)) * TPB, reused);
            Ok(())
        }
        Op::Ensure { id, tokens } => {
            kv.ensure_tokens(ReqId(*id), *tokens)?;
            assert!(kv.blocks_of(ReqId(*id)) >= kv.blocks_for_tokens(*tokens));
            Ok(())
        }
        Op::Register {
            id,
            hashes,
            computed,
        } => kv.register_prefix(ReqId(*id), hashes, *computed),
        Op::Free { id } => freed_or_refused(kv, ReqId(*id)),
        Op::Dummy { tokens, commit } => {
            let d = kv.allocate_dummy(*tokens)?;
            if *commit {
                kv.commit_dummy(d);
            } else {
                let blocks = kv.blocks_of(ReqId::DUMMY);
                assert_eq!(kv.rollback_dummy(d), Freed::Sequence { blocks });
            }
            Ok(())
        }
        Op::FreeDummy => freed_or_refused(kv, ReqId::DUMMY),
    }
}

/// Frees `id`; nothing held counts as a refusal, so the caller checks it changed nothing.
fn freed_or_refused(kv: &mut KvManager, id: ReqId) -> Result<(), KvError> {
    let blocks = kv.blocks_of(id);
    match kv.free_sequence(id) {
        Freed::Sequence { blocks: freed } => {
            assert_eq!(freed, blocks, "request {id} freed a different block count");
            Ok(())
        }
        Freed::NothingHeld => Err(KvError::UnknownSequence(id)),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn invariants_hold_after_every_step_and_failures_change_nothing(
        reuse in any::<bool>(),
        total in 1u32..14,
        slots in 1u32..5,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut kv = KvManager::new(KvConfig {
            tokens_per_block: TPB,
            total_blocks: total,
            enable_block_reuse: reuse,
            index_pool_size: slots,
        });
        for op in &ops {
            let before = kv.pool.clone();
            let gauges_before = gauges(&kv);
            let counters_before = *kv.counters();
            let result = apply(&mut kv, op);
            if let Err(e) = &result {
                prop_assert_eq!(gauges(&kv), gauges_before, "{:?} failed with {:?}", op, e);
                prop_assert!(kv.pool == before, "{:?} failed with {:?} but changed the pool", op, e);
                let mut expect = counters_before;
                if matches!((op, e), (Op::Add { .. }, KvError::NoFreeIndexSlot { .. })) {
                    expect.deferrals_no_free_index_slot += 1;
                }
                prop_assert_eq!(*kv.counters(), expect);
            }
            if let Err(v) = kv.check_invariants() {
                return Err(TestCaseError::fail(format!("after {op:?} ({result:?}): {v}")));
            }
            prop_assert_eq!(kv.used_blocks() + kv.free_blocks(), kv.total_blocks());
            prop_assert!(kv.index_slots_used() <= kv.index_pool_size());
        }
    }

    #[test]
    fn a_rolled_back_dummy_leaves_the_pool_as_it_was(
        total in 1u32..10,
        ops in prop::collection::vec(op(), 0..30),
        tokens in 0u32..16,
    ) {
        let mut kv = kv(total, 4);
        for op in &ops {
            let _ = apply(&mut kv, op);
        }
        let before = kv.pool.clone();
        if let Ok(d) = kv.allocate_dummy(tokens) {
            let blocks = kv.blocks_for_tokens(tokens);
            prop_assert_eq!(kv.rollback_dummy(d), Freed::Sequence { blocks });
            // Evicted cached blocks come back as plain free blocks: counts match exactly.
            prop_assert_eq!(kv.free_blocks(), before.free.len() as u32 + before.lru.len() as u32);
            prop_assert_eq!(kv.pool.used, before.used);
            prop_assert_eq!(kv.pool.seqs.clone(), before.seqs.clone());
            prop_assert_eq!(kv.index_slots_used(), before.slots.used());
        } else {
            prop_assert!(kv.pool == before);
        }
        prop_assert!(kv.check_invariants().is_ok());
    }
}
