//! The dummy transaction across a vote (mechanisms.md §6, §10: no dummy survives an
//! iteration).
//!
//! Two ranks, each with a real `KvManager`. Rank 1 has nothing schedulable while rank 0
//! is expected to run, so it pads tentatively every iteration. Rank 0 schedules nothing
//! in iteration 0 (the vote rejects: `can_queue` needs every batch non-empty) and one
//! request in iteration 1 (the vote accepts). Batch sizes go through the real allgather.
//! On acceptance the dummy is committed and freed after the forward; on rejection it is
//! rolled back. Every rank checks at the end of every iteration that no dummy is alive
//! and the block pool is conserved.

#![cfg(lockstep_loom)]

use lockstep_actors::executor::{CollectiveTag, PadIntent, Phase};
use lockstep_actors::ids::ReqId;
use lockstep_actors::kv::{KvConfig, KvManager};
use lockstep_actors::padding::{PadPath, pad_need};
use lockstep_transport::{Collective, InProcessGroup, InProcessMember};
use loom::thread;
use std::time::Duration;

const ITERATIONS: u64 = 2;

fn run_rank(mut group: InProcessMember) {
    let rank = group.rank();
    let mut kv = KvManager::new(KvConfig {
        tokens_per_block: 4,
        total_blocks: 4,
        enable_block_reuse: false,
        index_pool_size: 2,
    });
    let real = ReqId(1);
    for iteration in 0..ITERATIONS {
        // Schedule: rank 0 runs its one request only in iteration 1; rank 1 never has work.
        let schedulable = u32::from(rank == 0 && iteration == 1);
        if schedulable > 0 {
            kv.add_sequence(real, &[], 3).expect("index slot");
            kv.ensure_tokens(real, 3).expect("blocks");
        }
        // Rank 1 is expected to run (its peer may) but has nothing: it pads.
        let expected = u32::from(rank == 1);
        let dummy = pad_need(
            PadPath::Expected,
            expected,
            schedulable,
            PadIntent::None,
            false,
        )
        .map(|_| {
            kv.allocate_dummy(1)
                .expect("the tiny pool has room for a dummy")
        });
        let batch = schedulable + u32::from(dummy.is_some());

        // Vote.
        let tag = CollectiveTag {
            iteration,
            phase: Phase::Vote,
        };
        let batches: Vec<u32> = group.allgather(tag, &batch).expect("vote");
        let can_queue = batches.iter().all(|&b| b > 0);
        assert_eq!(
            can_queue,
            iteration == 1,
            "rank {rank} iteration {iteration}"
        );

        match dummy {
            Some(d) if can_queue => {
                kv.commit_dummy(d);
                // Forward ran; the dummy's work is done.
                kv.free_sequence(ReqId::DUMMY).expect("committed dummy");
            }
            Some(d) => kv.rollback_dummy(d),
            None => {}
        }
        if schedulable > 0 && can_queue {
            // Its one token was the last: it completes and frees its blocks.
            kv.free_sequence(real).expect("real request");
        }

        assert!(
            !kv.has_sequence(ReqId::DUMMY),
            "rank {rank}: a dummy outlived iteration {iteration}"
        );
        assert_eq!(
            kv.used_blocks() + kv.free_blocks(),
            kv.total_blocks(),
            "rank {rank} iteration {iteration}"
        );
        kv.check_invariants().expect("kv invariants");
    }
}

#[test]
fn no_dummy_outlives_its_iteration() {
    let mut builder = loom::model::Builder::new();
    // LOOM_MAX_PREEMPTIONS overrides; 2 is what CI runs (style.md §3).
    builder.preemption_bound = builder.preemption_bound.or(Some(2));
    builder.check(|| {
        let mut members = InProcessGroup::new(2, Duration::from_secs(60)).into_iter();
        let (m0, m1) = (members.next().unwrap(), members.next().unwrap());
        let rank1 = thread::spawn(move || run_rank(m1));
        run_rank(m0);
        rank1.join().expect("rank 1");
    });
}
