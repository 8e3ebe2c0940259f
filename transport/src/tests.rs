//! Unit tests on real threads (the loom models live in `loom-tests`).

use std::thread;
use std::time::{Duration, Instant};

use lockstep_actors::executor::{CollectiveTag, Phase};

use crate::{Collective, CollectiveError, InProcessGroup, IngressError, IngressQueue};

fn tag(iteration: u64, phase: Phase) -> CollectiveTag {
    CollectiveTag { iteration, phase }
}

/// Runs `body(member)` on one thread per member and returns the results in rank order.
fn on_every_rank<R: Send + 'static>(
    size: usize,
    timeout: Duration,
    body: impl Fn(crate::InProcessMember) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let handles: Vec<_> = InProcessGroup::new(size, timeout)
        .into_iter()
        .map(|m| {
            let body = body.clone();
            thread::spawn(move || body(m))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

#[test]
fn members_are_send() {
    fn assert_send<T: Send>() {}
    assert_send::<crate::InProcessMember>();
    assert_send::<IngressQueue<u64>>();
}

#[test]
fn four_ranks_agree_on_every_collective_for_a_thousand_rounds() {
    const SIZE: usize = 4;
    const ROUNDS: u64 = 1_000;
    let results = on_every_rank(SIZE, Duration::from_secs(30), |mut m| {
        let rank = m.rank();
        assert_eq!(m.size(), SIZE);
        for i in 0..ROUNDS {
            let all = m.allgather(tag(i, Phase::Gather), &(i, rank)).unwrap();
            let want: Vec<(u64, usize)> = (0..SIZE).map(|r| (i, r)).collect();
            assert_eq!(all, want, "allgather round {i} at rank {rank}");

            let root = (i as usize) % SIZE;
            let value = format!("round {i} from {root}");
            let mine = (rank == root).then_some(&value);
            let got: String = m.broadcast(tag(i, Phase::Fetch), root, mine).unwrap();
            assert_eq!(got, value, "broadcast round {i} at rank {rank}");

            let max = m
                .allreduce_max(tag(i, Phase::PadIntent), (rank as u64 + i) % 5)
                .unwrap();
            let want_max = (0..SIZE as u64).map(|r| (r + i) % 5).max().unwrap();
            assert_eq!(max, want_max, "allreduce round {i} at rank {rank}");

            let gathered = m
                .gather(tag(i, Phase::Responses), root, &vec![rank as u32; rank])
                .unwrap();
            if rank == root {
                let want: Vec<Vec<u32>> = (0..SIZE).map(|r| vec![r as u32; r]).collect();
                assert_eq!(gathered, Some(want), "gather round {i} at root {rank}");
            } else {
                assert_eq!(gathered, None, "gather round {i} at non-root {rank}");
            }
        }
        rank
    });
    assert_eq!(results, vec![0, 1, 2, 3]);
}

#[test]
fn mismatched_tag_is_reported_on_every_rank_naming_both_ranks_and_tags() {
    let good = tag(7, Phase::Gather);
    let bad = tag(7, Phase::Vote);
    let results = on_every_rank(3, Duration::from_secs(30), move |mut m| {
        let t = if m.rank() == 2 { bad } else { good };
        let first = m.allgather(t, &m.rank());
        // Later calls fail fast instead of waiting for a peer that gave up.
        let later = m.allgather(tag(8, Phase::Gather), &m.rank());
        (first, later)
    });
    let want = CollectiveError::TagMismatch {
        rank_a: 0,
        tag_a: good,
        rank_b: 2,
        tag_b: bad,
    };
    for (rank, (first, later)) in results.into_iter().enumerate() {
        assert_eq!(first, Err(want.clone()), "rank {rank}");
        assert!(
            matches!(later, Err(CollectiveError::GroupBroken(_))),
            "rank {rank}: {later:?}"
        );
    }
    let text = want.to_string();
    for needle in [
        "rank 0",
        "rank 2",
        &format!("{good:?}"),
        &format!("{bad:?}"),
    ] {
        assert!(text.contains(needle), "{text:?} lacks {needle:?}");
    }
}

#[test]
fn a_rank_that_never_arrives_times_the_others_out_naming_it() {
    let timeout = Duration::from_millis(200);
    let mut members = InProcessGroup::new(3, timeout);
    // Rank 2 stays alive but never calls: dropping it would break the group at once.
    let absent = members.pop().unwrap();
    let started = Instant::now();
    let handles: Vec<_> = members
        .into_iter()
        .map(|mut m| {
            thread::spawn(move || {
                let first = m.allgather(tag(0, Phase::Gather), &1u8);
                let later = m.allgather(tag(1, Phase::Gather), &1u8);
                (first, later)
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let (first, later) = h.join().unwrap();
        match first {
            Err(CollectiveError::Timeout {
                tag: t, missing, ..
            }) => {
                assert_eq!(t, tag(0, Phase::Gather), "rank {rank}");
                assert_eq!(missing, vec![2], "rank {rank}");
            }
            other => panic!("rank {rank}: expected a timeout naming rank 2, got {other:?}"),
        }
        assert!(
            matches!(later, Err(CollectiveError::GroupBroken(_))),
            "rank {rank}: {later:?}"
        );
    }
    let waited = started.elapsed();
    assert!(waited >= timeout, "gave up early: {waited:?}");
    assert!(
        waited < timeout * 10,
        "took {waited:?} for a {timeout:?} timeout"
    );
    drop(absent);
}

#[test]
fn a_timeout_error_names_the_missing_ranks() {
    let e = CollectiveError::Timeout {
        tag: tag(3, Phase::Vote),
        waited_ms: 200,
        missing: vec![2, 3],
    };
    assert!(e.to_string().contains("[2, 3]"), "{e}");
}

#[test]
fn a_dropped_member_breaks_the_group_instead_of_hanging() {
    let mut members = InProcessGroup::new(3, Duration::from_secs(60));
    let gone = members.pop().unwrap();
    let started = Instant::now();
    let handles: Vec<_> = members
        .into_iter()
        .map(|mut m| thread::spawn(move || m.allgather(tag(0, Phase::Gather), &0u8)))
        .collect();
    thread::sleep(Duration::from_millis(20));
    drop(gone);
    for h in handles {
        match h.join().unwrap() {
            Err(CollectiveError::GroupBroken(why)) => assert!(why.contains("rank 2"), "{why}"),
            other => panic!("expected GroupBroken, got {other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_panicking_rank_breaks_the_group_and_says_so() {
    let results = on_every_rank(2, Duration::from_secs(60), |mut m| {
        if m.rank() == 1 {
            // The panic drops the member while unwinding.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _held = &mut m;
                panic!("rank 1 fails before its first collective");
            }));
            assert!(r.is_err());
            return Ok(vec![]);
        }
        m.allgather(tag(0, Phase::Gather), &0u8)
    });
    match &results[0] {
        Err(CollectiveError::GroupBroken(why)) => assert!(why.contains("panicked"), "{why}"),
        other => panic!("expected GroupBroken, got {other:?}"),
    }
}

#[test]
fn a_broadcast_root_without_a_value_fails_on_every_rank() {
    let results = on_every_rank(2, Duration::from_secs(30), |mut m| {
        let r: Result<u32, _> = m.broadcast(tag(0, Phase::Fetch), 0, None);
        // The round still completed, so the group goes on.
        let next = m.allreduce_max(tag(1, Phase::PadIntent), m.rank() as u64);
        (r, next)
    });
    assert!(
        matches!(results[0].0, Err(CollectiveError::Encode(_))),
        "{:?}",
        results[0]
    );
    assert!(
        matches!(results[1].0, Err(CollectiveError::Decode { rank: 0, .. })),
        "{:?}",
        results[1]
    );
    assert!(results.iter().all(|(_, next)| *next == Ok(1)));
}

#[test]
fn ranks_calling_different_collectives_under_one_tag_break_the_group() {
    let results = on_every_rank(2, Duration::from_secs(30), |mut m| {
        let t = tag(0, Phase::Gather);
        if m.rank() == 0 {
            m.allreduce_max(t, 1).map(|_| ())
        } else {
            m.allgather(t, &1u64).map(|_| ())
        }
    });
    for r in results {
        assert!(matches!(r, Err(CollectiveError::GroupBroken(_))), "{r:?}");
    }
}

#[test]
fn a_contribution_of_another_type_is_a_decode_error_naming_its_rank() {
    let results = on_every_rank(2, Duration::from_secs(30), |mut m| {
        let t = tag(0, Phase::Gather);
        if m.rank() == 0 {
            m.allgather(t, &String::from("a string")).map(|_| ())
        } else {
            m.allgather(t, &7u8).map(|_| ())
        }
    });
    assert!(
        matches!(results[0], Err(CollectiveError::Decode { rank: 1, .. })),
        "{results:?}"
    );
}

#[test]
fn a_full_queue_refuses_a_push_and_changes_nothing() {
    let q = IngressQueue::new(2);
    q.push(1).unwrap();
    q.push(2).unwrap();
    assert_eq!(q.push(3), Err(IngressError::Full { capacity: 2 }));
    assert_eq!(q.len(), 2);
    assert_eq!(q.drain_now(), vec![1, 2]);
    assert!(q.is_empty());
    q.push(4).unwrap();
    assert_eq!(q.drain_now(), vec![4]);
}

#[test]
fn pop_blocking_wakes_on_push_and_returns_none_after_close() {
    let q = IngressQueue::new(4);
    let reader = {
        let q = q.clone();
        thread::spawn(move || {
            let first = q.pop_blocking();
            let second = q.pop_blocking();
            (first, second)
        })
    };
    thread::sleep(Duration::from_millis(20));
    q.push(42u32).unwrap();
    thread::sleep(Duration::from_millis(20));
    q.close();
    assert_eq!(reader.join().unwrap(), (Some(42), None));
    assert_eq!(q.push(1), Err(IngressError::Closed));
    assert_eq!(q.len(), 0);
}

#[test]
fn items_queued_before_close_are_still_delivered() {
    let q = IngressQueue::new(4);
    q.push("a").unwrap();
    q.close();
    assert!(q.is_closed());
    assert_eq!(q.pop_blocking(), Some("a"));
    assert_eq!(q.pop_blocking(), None);
    assert_eq!(q.drain_now(), Vec::<&str>::new());
}
