//! The idle decision under a closed-loop client (mechanisms.md §3.2).
//!
//! Two ranks run the iteration's first two collectives on the real in-process group:
//! gather (allgather of live and routable counts), then fetch (rank 0 reads the real
//! ingress queue, blocking or draining as `idle_decision` says, and broadcasts what it
//! read). A request fetched in iteration k is admitted to rank 0 and scheduled; at the
//! end of k it will complete next iteration, so it becomes *retiring* (live, not
//! routable), as under the overlap scheduler; in k+1 it completes and rank 0 answers the
//! client. The client sends one request, waits for its answer, sends a second, waits,
//! then shuts down (closes the queue).
//!
//! Deciding idleness from the routable count blocks rank 0 in iteration k+1 while the
//! retiring request waits for that very iteration to finish, and the client sends
//! nothing until it does: a deadlock loom finds.

#![cfg(lockstep_loom)]

use lockstep_actors::executor::{CollectiveTag, FetchMode, Phase, idle_decision};
use lockstep_transport::{Collective, InProcessGroup, InProcessMember, IngressQueue};
use loom::thread;
use std::time::Duration;

/// The count the idle decision reads.
#[derive(Debug, Clone, Copy)]
enum Predicate {
    /// Σ live: active and retiring requests (the fixed rule).
    Live,
    /// Σ routable: retiring requests ignored (the defect).
    Routable,
}

/// A request resident on a rank.
#[derive(Debug)]
struct Resident {
    id: u32,
    retiring: bool,
}

/// What rank 0 read and broadcast: new request ids, and whether the queue was closed.
type Fetched = (Vec<u32>, bool);

fn tag(iteration: u64, phase: Phase) -> CollectiveTag {
    CollectiveTag { iteration, phase }
}

/// Runs one rank until the fleet agrees to stop. Only rank 0 has the queues.
fn run_rank(
    mut group: InProcessMember,
    queues: Option<(IngressQueue<u32>, IngressQueue<u32>)>,
    predicate: Predicate,
) {
    let rank = group.rank();
    let mut resident: Vec<Resident> = Vec::new();
    let mut shutdown = false;
    // Requests are admitted as soon as they are fetched (capacity is never short here),
    // so the replicated waiting queue is always empty.
    let waiting = 0;
    for iteration in 0.. {
        // 1. Gather.
        let live = resident.len() as u64;
        let routable = resident.iter().filter(|r| !r.retiring).count() as u64;
        let states: Vec<(u64, u64)> = group
            .allgather(tag(iteration, Phase::Gather), &(live, routable))
            .expect("gather");
        let global_live: u64 = states.iter().map(|s| s.0).sum();
        let global_routable: u64 = states.iter().map(|s| s.1).sum();

        // 2. Fetch: rank 0 alone reads the queue; everyone gets what it read.
        let fetched: Fetched = match &queues {
            Some((ingress, _)) => {
                let count = match predicate {
                    Predicate::Live => global_live,
                    Predicate::Routable => global_routable,
                };
                let read = match idle_decision(count, waiting, shutdown) {
                    FetchMode::Block => match ingress.pop_blocking() {
                        Some(id) => (vec![id], false),
                        None => (Vec::new(), true),
                    },
                    FetchMode::Poll => {
                        // Closed before draining means nothing can arrive after the drain.
                        let closed = ingress.is_closed();
                        (ingress.drain_now(), closed)
                    }
                };
                group.broadcast(tag(iteration, Phase::Fetch), 0, Some(&read))
            }
            None => group.broadcast(tag(iteration, Phase::Fetch), 0, None),
        }
        .expect("fetch");
        shutdown |= fetched.1;
        // Every rank sees the same gather and broadcast, so all stop in the same iteration.
        if shutdown && global_live == 0 && fetched.0.is_empty() {
            break;
        }

        // Update: last iteration's retiring requests complete and are answered.
        if let Some((_, responses)) = &queues {
            for r in resident.iter().filter(|r| r.retiring) {
                responses.push(r.id).expect("response queue has room");
            }
        }
        resident.retain(|r| !r.retiring);
        // Admit to rank 0 and schedule; each will complete next iteration, so it ends
        // this one retiring (GENERATION_TO_COMPLETE).
        if rank == 0 {
            resident.extend(fetched.0.iter().map(|&id| Resident {
                id,
                retiring: false,
            }));
        }
        for r in &mut resident {
            r.retiring = true;
        }
    }
}

/// Two ranks and the closed-loop client (on the model's main thread): three threads.
fn closed_loop(predicate: Predicate) {
    let mut builder = loom::model::Builder::new();
    // LOOM_MAX_PREEMPTIONS overrides; 2 is what CI runs (style.md §3).
    builder.preemption_bound = builder.preemption_bound.or(Some(2));
    builder.check(move || {
        let ingress = IngressQueue::new(2);
        let responses = IngressQueue::new(2);
        let mut members = InProcessGroup::new(2, Duration::from_secs(60)).into_iter();
        let (m0, m1) = (members.next().unwrap(), members.next().unwrap());
        let queues = (ingress.clone(), responses.clone());
        let rank0 = thread::spawn(move || run_rank(m0, Some(queues), predicate));
        let rank1 = thread::spawn(move || run_rank(m1, None, predicate));

        for id in [1, 2] {
            ingress.push(id).expect("ingress has room");
            assert_eq!(responses.pop_blocking(), Some(id), "answer to request {id}");
        }
        ingress.close();
        rank0.join().expect("rank 0");
        rank1.join().expect("rank 1");
    });
}

#[test]
fn live_predicate_never_deadlocks_a_closed_loop_client() {
    closed_loop(Predicate::Live);
}

/// The negative control: run by `legacy_predicate_deadlock_is_found_by_loom` in a child
/// process, because loom's deadlock report aborts the process.
#[test]
#[ignore = "deadlocks by design; run through legacy_predicate_deadlock_is_found_by_loom"]
fn routable_predicate_deadlocks_a_closed_loop_client() {
    closed_loop(Predicate::Routable);
}

#[test]
fn legacy_predicate_deadlock_is_found_by_loom() {
    let exe = std::env::current_exe().expect("test binary path");
    let out = std::process::Command::new(exe)
        .args([
            "routable_predicate_deadlocks_a_closed_loop_client",
            "--ignored",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .expect("run the negative control");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("running 1 test"),
        "the control did not run:\n{text}"
    );
    assert!(!out.status.success(), "the control passed:\n{text}");
    assert!(
        text.contains("deadlock"),
        "no loom deadlock report:\n{text}"
    );
}
