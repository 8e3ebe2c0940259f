//! The KV manager driven only through its message interface: scripted sequences of
//! [`KvCommand`]s through [`KvManager::handle`], asserting on the [`KvReply`] / [`KvError`]
//! answers and on the read-only queries (mechanisms.md §4, §6, §7).

use lockstep_actors::ids::{BlockId, ReqId, Seat};
use lockstep_actors::kv::{KvCommand, KvConfig, KvCounters, KvError, KvManager, KvReply};

const TPB: u32 = 4;

fn kv(total_blocks: u32, index_pool_size: u32, reuse: bool) -> KvManager {
    KvManager::new(KvConfig {
        tokens_per_block: TPB,
        total_blocks,
        enable_block_reuse: reuse,
        index_pool_size,
    })
}

fn add(kv: &mut KvManager, id: u64, hashes: &[u64], prompt_len: u32) -> Result<KvReply, KvError> {
    kv.handle(KvCommand::AddSequence {
        id: ReqId(id),
        block_hashes: hashes,
        prompt_len,
    })
}

fn grow(kv: &mut KvManager, id: u64, tokens: u32) -> Result<KvReply, KvError> {
    kv.handle(KvCommand::EnsureTokens {
        id: ReqId(id),
        tokens,
    })
}

fn register(
    kv: &mut KvManager,
    id: u64,
    hashes: &[u64],
    computed_tokens: u32,
) -> Result<KvReply, KvError> {
    kv.handle(KvCommand::RegisterPrefix {
        id: ReqId(id),
        block_hashes: hashes,
        computed_tokens,
    })
}

fn free(kv: &mut KvManager, id: u64) -> Result<KvReply, KvError> {
    kv.handle(KvCommand::FreeSequence { id: ReqId(id) })
}

/// The command was accepted with a plain `Done`.
#[track_caller]
fn done(reply: Result<KvReply, KvError>) {
    assert_eq!(reply, Ok(KvReply::Done));
}

/// The sequence was added; returns the reused prompt tokens.
#[track_caller]
fn added(reply: Result<KvReply, KvError>) -> u32 {
    match reply {
        Ok(KvReply::Added { reused_tokens }) => reused_tokens,
        other => panic!("expected Added, got {other:?}"),
    }
}

fn blocks(kv: &KvManager, id: u64) -> Vec<u32> {
    kv.block_ids_of(ReqId(id)).iter().map(|b| b.0).collect()
}

fn checked(kv: &KvManager) {
    kv.check_conservation().expect("conservation");
    kv.check_invariants().expect("structural invariants");
}

/// Everything a caller can observe of a KV manager, for the sequences and prefixes a
/// test names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Snapshot {
    used: u32,
    free: u32,
    cached: u32,
    slots_used: u32,
    seqs: Vec<(u64, bool, Option<Seat>, Vec<BlockId>)>,
    prefixes: Vec<u32>,
    counters: KvCounters,
}

fn snapshot(kv: &KvManager, ids: &[u64], prefixes: &[&[u64]]) -> Snapshot {
    Snapshot {
        used: kv.used_blocks(),
        free: kv.free_blocks(),
        cached: kv.cached_blocks(),
        slots_used: kv.index_slots_used(),
        seqs: ids
            .iter()
            .map(|&id| {
                (
                    id,
                    kv.has_sequence(ReqId(id)),
                    kv.slot_of(ReqId(id)),
                    kv.block_ids_of(ReqId(id)),
                )
            })
            .collect(),
        prefixes: prefixes
            .iter()
            .map(|h| kv.longest_prefix_match(h))
            .collect(),
        counters: *kv.counters(),
    }
}

/// A fixed follow-up script whose every answer and resulting state depends on the
/// pool's exact contents (free-list order, LRU order, cached keys, slots). Two managers
/// that behave identically on it are, for a caller, the same manager.
fn probe(mut kv: KvManager, ids: &[u64], prefixes: &[&[u64]]) -> Vec<String> {
    let mut log = Vec::new();
    for (i, &p) in prefixes.iter().enumerate() {
        let id = 1000 + i as u64;
        log.push(format!("{:?}", add(&mut kv, id, p, 4 * p.len() as u32 + 1)));
        log.push(format!("{:?}", grow(&mut kv, id, 4 * p.len() as u32 + 1)));
        log.push(format!(
            "{:?} {:?}",
            kv.block_ids_of(ReqId(id)),
            kv.slot_of(ReqId(id))
        ));
    }
    // Drain whatever is left, one block at a time, recording which block comes next
    // (free list lowest-first, then the LRU order of cached blocks).
    let filler = 2000;
    log.push(format!("{:?}", add(&mut kv, filler, &[], 1)));
    let mut tokens = 0;
    while kv.free_blocks() > 0 && kv.has_sequence(ReqId(filler)) {
        tokens += TPB;
        let grown = grow(&mut kv, filler, tokens);
        log.push(format!("{grown:?}"));
        if grown.is_err() {
            break;
        }
    }
    log.push(format!("{:?}", kv.block_ids_of(ReqId(filler))));
    for &id in ids {
        log.push(format!("{id}: {:?}", free(&mut kv, id)));
    }
    log.push(format!("{:?}", snapshot(&kv, ids, prefixes)));
    log
}

#[test]
fn add_grow_and_free_take_and_return_the_lowest_blocks_and_slots() {
    let mut kv = kv(8, 4, false);
    assert_eq!(
        add(&mut kv, 1, &[], 5),
        Ok(KvReply::Added { reused_tokens: 0 })
    );
    assert_eq!(kv.slot_of(ReqId(1)), Some(Seat(0)));
    assert_eq!(kv.blocks_of(ReqId(1)), 0, "adding takes no block by itself");
    assert_eq!(grow(&mut kv, 1, 9), Ok(KvReply::Done));
    assert_eq!(blocks(&kv, 1), vec![0, 1, 2]);
    assert_eq!((kv.used_blocks(), kv.free_blocks()), (3, 5));
    checked(&kv);

    assert_eq!(
        add(&mut kv, 2, &[], 1),
        Ok(KvReply::Added { reused_tokens: 0 })
    );
    assert_eq!(kv.slot_of(ReqId(2)), Some(Seat(1)));
    assert_eq!(grow(&mut kv, 2, 4), Ok(KvReply::Done));
    assert_eq!(blocks(&kv, 2), vec![3]);
    assert_eq!(kv.index_slots_used(), 2);
    checked(&kv);

    assert_eq!(free(&mut kv, 1), Ok(KvReply::Done));
    assert!(!kv.has_sequence(ReqId(1)));
    assert_eq!(blocks(&kv, 1), Vec::<u32>::new());
    assert_eq!((kv.used_blocks(), kv.free_blocks()), (1, 7));
    assert_eq!(kv.index_slots_used(), 1);
    checked(&kv);

    // The freed slot and the freed low block ids are handed out again first.
    assert_eq!(
        add(&mut kv, 3, &[], 1),
        Ok(KvReply::Added { reused_tokens: 0 })
    );
    assert_eq!(kv.slot_of(ReqId(3)), Some(Seat(0)));
    assert_eq!(grow(&mut kv, 3, 8), Ok(KvReply::Done));
    assert_eq!(blocks(&kv, 3), vec![0, 1]);
    assert_eq!(kv.counters().allocations, 6);
    checked(&kv);

    assert_eq!(free(&mut kv, 2), Ok(KvReply::Done));
    assert_eq!(free(&mut kv, 3), Ok(KvReply::Done));
    assert_eq!(
        (kv.used_blocks(), kv.free_blocks(), kv.index_slots_used()),
        (0, 8, 0)
    );
    checked(&kv);
}

#[test]
fn ensure_tokens_grows_block_by_block_and_never_shrinks() {
    let mut kv = kv(4, 2, false);
    added(add(&mut kv, 1, &[], 1));
    let script = [(1, 1), (4, 1), (5, 2), (10, 3), (2, 3), (12, 3), (0, 3)];
    for (tokens, want) in script {
        assert_eq!(
            grow(&mut kv, 1, tokens),
            Ok(KvReply::Done),
            "grow to {tokens}"
        );
        assert_eq!(kv.blocks_of(ReqId(1)), want, "after growing to {tokens}");
        checked(&kv);
    }
    assert_eq!(kv.blocks_needed(ReqId(1), 16), 1);
    assert_eq!(
        kv.blocks_needed(ReqId(9), 5),
        2,
        "an unknown id needs them all"
    );
    assert_eq!(kv.counters().allocations, 3);
}

#[test]
fn a_registered_prefix_is_reused_as_whole_blocks_capped_to_compute_one_token() {
    let mut kv = kv(8, 4, true);
    let hashes = [11, 22, 33];
    assert_eq!(add(&mut kv, 1, &hashes, 12).unwrap().reused_tokens(), 0);
    done(grow(&mut kv, 1, 13));
    assert_eq!(register(&mut kv, 1, &hashes, 12), Ok(KvReply::Done));
    assert_eq!(
        register(&mut kv, 1, &hashes, 12),
        Ok(KvReply::Done),
        "idempotent"
    );
    let held = blocks(&kv, 1);
    assert_eq!(held, vec![0, 1, 2, 3]);
    assert_eq!(kv.longest_prefix_match(&hashes), 12);
    assert_eq!(kv.longest_prefix_match(&[11, 22, 99]), 8);
    assert_eq!(
        kv.longest_prefix_match(&[22, 33]),
        0,
        "keys chain from the start"
    );

    assert_eq!(free(&mut kv, 1), Ok(KvReply::Done));
    assert_eq!(kv.cached_blocks(), 3, "the three keyed blocks stay cached");
    assert_eq!(kv.free_blocks(), 8, "cached blocks still count as free");
    assert_eq!(kv.used_blocks(), 0);
    assert_eq!(kv.longest_prefix_match(&hashes), 12);
    checked(&kv);

    // A 12-token prompt over 3 cached blocks reuses 2: its last token must be computed.
    assert_eq!(
        add(&mut kv, 2, &hashes, 12),
        Ok(KvReply::Added { reused_tokens: 8 })
    );
    assert_eq!(blocks(&kv, 2), held[..2].to_vec());
    assert_eq!(kv.used_blocks(), 2);
    assert_eq!(kv.cached_blocks(), 1);
    assert_eq!(kv.blocks_needed(ReqId(2), 12), 1);
    // A 13-token prompt can reuse all three, sharing two with sequence 2.
    assert_eq!(
        add(&mut kv, 3, &hashes, 13),
        Ok(KvReply::Added { reused_tokens: 12 })
    );
    assert_eq!(blocks(&kv, 3), held[..3].to_vec());
    assert_eq!(kv.used_blocks(), 3, "shared blocks are counted once");
    assert_eq!(kv.counters().reuse_hits, 5);
    // A one-token prompt reuses nothing.
    assert_eq!(
        add(&mut kv, 4, &hashes, 1),
        Ok(KvReply::Added { reused_tokens: 0 })
    );
    assert_eq!(kv.blocks_of(ReqId(4)), 0);
    checked(&kv);

    // Sequence 2's missing block comes from the free list, not from the cache.
    done(grow(&mut kv, 2, 12));
    assert_eq!(
        blocks(&kv, 2),
        vec![0, 1, 3],
        "block 3 was unkeyed, so free"
    );
    done(free(&mut kv, 2));
    assert_eq!(
        kv.used_blocks(),
        3,
        "blocks shared with sequence 3 stay referenced"
    );
    done(free(&mut kv, 3));
    done(free(&mut kv, 4));
    assert_eq!((kv.used_blocks(), kv.cached_blocks()), (0, 3));
    assert_eq!(kv.longest_prefix_match(&hashes), 12);
    checked(&kv);
}

#[test]
fn a_prefix_registered_by_a_live_sequence_is_shared_while_it_runs() {
    let mut kv = kv(8, 4, true);
    let hashes = [5, 6];
    added(add(&mut kv, 1, &hashes, 9));
    done(grow(&mut kv, 1, 9));
    // Only the blocks covered by computed tokens are published: 6 tokens = 1 block.
    done(register(&mut kv, 1, &hashes, 6));
    assert_eq!(kv.longest_prefix_match(&hashes), 4);
    assert_eq!(
        add(&mut kv, 2, &hashes, 9),
        Ok(KvReply::Added { reused_tokens: 4 })
    );
    done(register(&mut kv, 1, &hashes, 8));
    assert_eq!(kv.longest_prefix_match(&hashes), 8);
    assert_eq!(
        add(&mut kv, 3, &hashes, 9),
        Ok(KvReply::Added { reused_tokens: 8 })
    );
    assert_eq!(blocks(&kv, 2), vec![0]);
    assert_eq!(blocks(&kv, 3), vec![0, 1]);
    assert_eq!(kv.used_blocks(), 3, "three blocks of sequence 1, shared");
    checked(&kv);
}

#[test]
fn with_reuse_disabled_nothing_is_cached_or_reused() {
    let mut kv = kv(4, 2, false);
    added(add(&mut kv, 1, &[1, 2], 9));
    done(grow(&mut kv, 1, 9));
    assert_eq!(register(&mut kv, 1, &[1, 2], 8), Ok(KvReply::Done));
    done(free(&mut kv, 1));
    assert_eq!(kv.cached_blocks(), 0);
    assert_eq!(kv.longest_prefix_match(&[1, 2]), 0);
    assert_eq!(
        add(&mut kv, 2, &[1, 2], 9),
        Ok(KvReply::Added { reused_tokens: 0 })
    );
    assert_eq!(kv.counters().reuse_hits, 0);
    checked(&kv);
}

#[test]
fn out_of_free_blocks_the_least_recently_freed_cached_block_is_evicted() {
    let mut kv = kv(3, 4, true);
    for id in 1..=3u64 {
        added(add(&mut kv, id, &[id], 5));
        done(grow(&mut kv, id, 4));
        done(register(&mut kv, id, &[id], 4));
    }
    let first = |kv: &KvManager, id| blocks(kv, id)[0];
    let (b1, b2, b3) = (first(&kv, 1), first(&kv, 2), first(&kv, 3));
    for id in [2, 1, 3] {
        done(free(&mut kv, id));
    }
    assert_eq!((kv.cached_blocks(), kv.free_blocks()), (3, 3));

    // No block on the free list: the first block needed evicts prefix 2 (freed first).
    added(add(&mut kv, 10, &[], 1));
    done(grow(&mut kv, 10, 4));
    assert_eq!(blocks(&kv, 10), vec![b2]);
    assert_eq!(kv.counters().evictions, 1);
    assert_eq!(
        kv.longest_prefix_match(&[2]),
        0,
        "the evicted prefix is forgotten"
    );
    assert_eq!(kv.longest_prefix_match(&[1]), 4);
    assert_eq!(kv.longest_prefix_match(&[3]), 4);

    // Reusing prefix 1 takes it out of the LRU: the next eviction takes prefix 3.
    assert_eq!(
        add(&mut kv, 11, &[1], 5),
        Ok(KvReply::Added { reused_tokens: 4 })
    );
    assert_eq!(blocks(&kv, 11), vec![b1]);
    added(add(&mut kv, 12, &[], 1));
    done(grow(&mut kv, 12, 1));
    assert_eq!(blocks(&kv, 12), vec![b3]);
    assert_eq!(kv.counters().evictions, 2);
    assert_eq!(kv.free_blocks(), 0);
    checked(&kv);

    // And now there is truly nothing left.
    assert_eq!(
        grow(&mut kv, 12, 5),
        Err(KvError::OutOfBlocks { needed: 1, free: 0 })
    );
}

#[test]
fn the_free_list_is_used_before_any_cached_block_is_evicted() {
    let mut kv = kv(3, 4, true);
    added(add(&mut kv, 1, &[7], 5));
    done(grow(&mut kv, 1, 4));
    done(register(&mut kv, 1, &[7], 4));
    done(free(&mut kv, 1));
    added(add(&mut kv, 2, &[], 1));
    done(grow(&mut kv, 2, 8));
    assert_eq!(blocks(&kv, 2), vec![1, 2]);
    assert_eq!(kv.counters().evictions, 0);
    assert_eq!(kv.longest_prefix_match(&[7]), 4);
    checked(&kv);
}

/// A scripted pool with live sequences, a cached prefix and a partly used free list.
fn busy_pool() -> (KvManager, Vec<u64>, Vec<&'static [u64]>) {
    let mut kv = kv(6, 3, true);
    added(add(&mut kv, 1, &[41, 42], 9));
    done(grow(&mut kv, 1, 9));
    done(register(&mut kv, 1, &[41, 42], 8));
    added(add(&mut kv, 2, &[], 3));
    done(grow(&mut kv, 2, 3));
    added(add(&mut kv, 3, &[51], 5));
    done(grow(&mut kv, 3, 4));
    done(register(&mut kv, 3, &[51], 4));
    done(free(&mut kv, 3));
    // Sequences 1 and 2 live (4 blocks), prefix [51] cached (1 block), 1 block free.
    assert_eq!(
        (kv.used_blocks(), kv.cached_blocks(), kv.free_blocks()),
        (4, 1, 2)
    );
    checked(&kv);
    let ids = vec![1, 2, 3];
    let prefixes: Vec<&'static [u64]> = vec![&[41, 42], &[51]];
    (kv, ids, prefixes)
}

/// Applies `refuse` to a copy of `kv`, expects `want`, and checks that nothing a caller
/// can observe changed (except, where `deferral` says so, the deferral counter), now and
/// in how the manager behaves afterwards.
fn assert_refused_unchanged(
    kv: &KvManager,
    ids: &[u64],
    prefixes: &[&[u64]],
    refuse: impl FnOnce(&mut KvManager) -> Result<KvReply, KvError>,
    want: KvError,
    deferral: bool,
) {
    let mut refused = kv.clone();
    let before = snapshot(kv, ids, prefixes);
    let got = refuse(&mut refused);
    match got {
        Err(e) => assert_eq!(e, want),
        Ok(reply) => {
            if let Some(d) = reply.into_dummy() {
                done(refused.handle(KvCommand::RollbackDummy(d)));
            }
            panic!("expected {want:?}, the command succeeded");
        }
    }
    let mut after = snapshot(&refused, ids, prefixes);
    if deferral {
        assert_eq!(
            after.counters.deferrals_no_free_index_slot,
            before.counters.deferrals_no_free_index_slot + 1,
            "a refused add counts one deferral"
        );
        after.counters.deferrals_no_free_index_slot -= 1;
    }
    assert_eq!(after, before, "a refusal ({want:?}) changed the manager");
    checked(&refused);
    let mut untouched = probe(kv.clone(), ids, prefixes);
    let mut touched = probe(refused, ids, prefixes);
    if deferral {
        // The final snapshots differ only in that counter; compare the rest.
        untouched.pop();
        touched.pop();
    }
    assert_eq!(
        touched, untouched,
        "a refusal ({want:?}) changed later behaviour"
    );
}

#[test]
fn refusals_change_nothing() {
    let (kv, ids, prefixes) = busy_pool();

    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| grow(kv, 2, 4 * 6),
        KvError::OutOfBlocks { needed: 5, free: 2 },
        false,
    );
    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| grow(kv, 7, 1),
        KvError::UnknownSequence(ReqId(7)),
        false,
    );
    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| register(kv, 3, &[51], 4),
        KvError::UnknownSequence(ReqId(3)),
        false,
    );
    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| free(kv, 3),
        KvError::UnknownSequence(ReqId(3)),
        false,
    );
    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| add(kv, 1, &[51], 5),
        KvError::DuplicateSequence(ReqId(1)),
        false,
    );
    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| kv.handle(KvCommand::AllocateDummy { tokens: 9 }),
        KvError::OutOfBlocks { needed: 3, free: 2 },
        false,
    );

    // Fill the index pool: a third sequence that would reuse the cached prefix.
    let mut full = kv.clone();
    assert_eq!(
        add(&mut full, 4, &[51], 5),
        Ok(KvReply::Added { reused_tokens: 4 })
    );
    let ids4 = [1, 2, 3, 4];
    assert_refused_unchanged(
        &full,
        &ids4,
        &prefixes,
        |kv| add(kv, 5, &[41, 42], 9),
        KvError::NoFreeIndexSlot { used: 3, size: 3 },
        true,
    );
    assert_refused_unchanged(
        &full,
        &ids4,
        &prefixes,
        |kv| kv.handle(KvCommand::AllocateDummy { tokens: 1 }),
        KvError::NoFreeIndexSlot { used: 3, size: 3 },
        false,
    );
}

#[test]
fn a_second_dummy_is_refused_while_one_is_alive() {
    let (mut kv, mut ids, prefixes) = busy_pool();
    let d = kv
        .handle(KvCommand::AllocateDummy { tokens: 1 })
        .unwrap()
        .into_dummy()
        .expect("a dummy");
    ids.push(ReqId::DUMMY.0);
    assert_refused_unchanged(
        &kv,
        &ids,
        &prefixes,
        |kv| kv.handle(KvCommand::AllocateDummy { tokens: 1 }),
        KvError::DuplicateSequence(ReqId::DUMMY),
        false,
    );
    assert_eq!(kv.handle(KvCommand::RollbackDummy(d)), Ok(KvReply::Done));
    assert!(!kv.has_sequence(ReqId::DUMMY));
}

#[test]
fn a_rolled_back_dummy_leaves_the_manager_exactly_as_before() {
    let (mut kv, ids, prefixes) = busy_pool();
    let mut with_dummy = ids.clone();
    with_dummy.push(ReqId::DUMMY.0);
    let before = snapshot(&kv, &with_dummy, &prefixes);
    let pristine = kv.clone();

    // One block: the last one on the free list (the cached prefix is not touched).
    let reply = kv.handle(KvCommand::AllocateDummy { tokens: 4 }).unwrap();
    let d = reply
        .into_dummy()
        .expect("AllocateDummy answers with a dummy");
    assert!(kv.has_sequence(ReqId::DUMMY));
    assert_eq!(blocks(&kv, ReqId::DUMMY.0), vec![5]);
    assert_eq!(kv.counters().evictions, 0);
    assert_eq!(kv.slot_of(ReqId::DUMMY), Some(Seat(2)));
    assert_eq!(kv.index_slots_used(), before.slots_used + 1);
    assert_eq!(kv.counters().dummy_allocations, 1);
    checked(&kv);

    assert_eq!(kv.handle(KvCommand::RollbackDummy(d)), Ok(KvReply::Done));
    let mut after = snapshot(&kv, &with_dummy, &prefixes);
    assert_eq!(after.counters.dummy_allocations, 1);
    assert_eq!(after.counters.dummy_rollbacks, 1);
    assert_eq!(after.counters.dummy_commits, 0);
    assert_eq!(after.counters.allocations, before.counters.allocations + 1);
    // Apart from the transaction's own counters, nothing moved.
    after.counters.dummy_allocations = 0;
    after.counters.dummy_rollbacks = 0;
    after.counters.allocations = before.counters.allocations;
    assert_eq!(after, before);
    checked(&kv);
    let mut a = probe(kv, &ids, &prefixes);
    let mut b = probe(pristine, &ids, &prefixes);
    a.pop();
    b.pop();
    assert_eq!(a, b, "a rolled-back dummy changed later behaviour");
}

/// A rollback frees exactly the dummy's slot and blocks; an eviction its allocation made
/// is not undone (no eviction is): the block comes back free, without its prefix key.
#[test]
fn a_rolled_back_dummy_gives_back_its_blocks_but_not_an_evicted_prefix() {
    let (mut kv, ids, prefixes) = busy_pool();
    // Two blocks: the last one on the free list, then the cached prefix [51] is evicted.
    let before = snapshot(&kv, &ids, &prefixes);
    assert_eq!(before.prefixes[1], 4);
    let d = kv
        .handle(KvCommand::AllocateDummy { tokens: 8 })
        .unwrap()
        .into_dummy()
        .expect("a dummy");
    assert_eq!(kv.counters().evictions, 1);
    assert_eq!(kv.handle(KvCommand::RollbackDummy(d)), Ok(KvReply::Done));
    assert!(!kv.has_sequence(ReqId::DUMMY));
    assert_eq!(kv.index_slots_used(), before.slots_used);
    assert_eq!(kv.used_blocks(), before.used);
    assert_eq!(
        kv.free_blocks(),
        before.free,
        "free or evictable, as before"
    );
    assert_eq!(
        kv.cached_blocks(),
        before.cached - 1,
        "the evicted block is no longer cached"
    );
    assert_eq!(
        kv.longest_prefix_match(&[51]),
        0,
        "the evicted prefix stays evicted"
    );
    checked(&kv);
}

#[test]
fn a_committed_dummy_stays_until_freed_under_the_dummy_id() {
    let (mut kv, ids, prefixes) = busy_pool();
    let before = snapshot(&kv, &ids, &prefixes);
    let d = kv
        .handle(KvCommand::AllocateDummy { tokens: 1 })
        .unwrap()
        .into_dummy()
        .expect("a dummy");
    assert_eq!(kv.handle(KvCommand::CommitDummy(d)), Ok(KvReply::Done));
    assert!(kv.has_sequence(ReqId::DUMMY), "a committed dummy stays");
    assert_eq!(kv.blocks_of(ReqId::DUMMY), 1);
    assert_eq!(kv.used_blocks(), before.used + 1);
    assert_eq!(kv.free_blocks(), before.free - 1);
    assert_eq!(kv.index_slots_used(), before.slots_used + 1);
    checked(&kv);

    assert_eq!(
        kv.handle(KvCommand::FreeSequence { id: ReqId::DUMMY }),
        Ok(KvReply::Done)
    );
    assert!(!kv.has_sequence(ReqId::DUMMY));
    let after = snapshot(&kv, &ids, &prefixes);
    assert_eq!(
        (after.used, after.free, after.cached, after.slots_used),
        (before.used, before.free, before.cached, before.slots_used)
    );
    assert_eq!(after.seqs, before.seqs);
    assert_eq!(after.prefixes, before.prefixes);
    let c = kv.counters();
    assert_eq!(
        (c.dummy_allocations, c.dummy_commits, c.dummy_rollbacks),
        (1, 1, 0)
    );
    assert_eq!(
        kv.handle(KvCommand::FreeSequence { id: ReqId::DUMMY }),
        Err(KvError::UnknownSequence(ReqId::DUMMY)),
        "the dummy is freed once"
    );
    checked(&kv);
}

#[test]
fn replies_carry_the_reused_tokens_and_the_dummy_only_where_they_belong() {
    let mut kv = kv(4, 4, true);
    let first = add(&mut kv, 1, &[9], 5).unwrap();
    assert_eq!(first.reused_tokens(), 0);
    assert_eq!(first.into_dummy(), None);
    let grown = grow(&mut kv, 1, 5).unwrap();
    assert_eq!(grown, KvReply::Done);
    assert_eq!(grown.reused_tokens(), 0);
    done(register(&mut kv, 1, &[9], 4));
    let second = add(&mut kv, 2, &[9], 5).unwrap();
    assert_eq!(second.reused_tokens(), 4);
    assert_eq!(second.into_dummy(), None);
    let dummy = kv.handle(KvCommand::AllocateDummy { tokens: 1 }).unwrap();
    assert_eq!(dummy.reused_tokens(), 0);
    let d = dummy.into_dummy().expect("a dummy");
    done(kv.handle(KvCommand::RollbackDummy(d)));
    assert_eq!(kv.free_blocks(), 2);
}
