//! A stretch of coasted iterations applied in closed form (`executor::stretch`) leaves
//! every rank as the coasted iterations one by one leave it (`group::coast`) and hands on
//! the same tokens: the actors' half of the simulator's byte-identity with `--no-skip`
//! (`cluster/cli/tests/coast.rs` checks the whole report).

use std::collections::BTreeMap;

use lockstep_actors::group::{DeterministicTokens, ServerGroup};
use lockstep_actors::ids::ReqId;
use lockstep_actors::policy::Policy;
use lockstep_actors::vocab::TokenRun;
use lockstep_tests::{Harness, adp_server};

/// A server of `dp` ranks decoding `2 * dp` requests of 40 prompt and 300 output tokens
/// (blocks of 16 tokens, so a stretch crosses block boundaries), stepped through the
/// protocol until it can coast at least `steps` iterations.
fn steady(dp: i64, overlap: bool, steps: u64) -> Harness {
    let mut h = Harness::new(&adp_server(dp, 8, overlap), Policy::FIXED);
    h.submit_many(1, 2 * dp as u64, 40, 300);
    for _ in 0..40 {
        h.step();
        if h.group.coast_limit() >= steps {
            return h;
        }
    }
    panic!("dp {dp}, overlap {overlap}: the server never came to steady decode");
}

/// Each rank's state as far as anything after a stretch can see it.
fn ranks(group: &ServerGroup) -> Vec<String> {
    group
        .ranks()
        .iter()
        .map(|r| {
            format!(
                "iteration {} active {:?} kv {:?} seats {} totals {:?} in flight {:?} stats {:?}",
                r.iteration(),
                r.active(),
                r.kv(),
                r.seats_used(),
                r.totals(),
                r.in_flight(),
                r.last_report().stats,
            )
        })
        .collect()
}

/// One coasted iteration fetched at `now`; each request's token, appended to `streams`.
fn coast_one(group: &mut ServerGroup, now: u64, streams: &mut BTreeMap<ReqId, Vec<u32>>) {
    assert!(group.coast_step_fits());
    group.coast_launch(now, false);
    group
        .sample_launched(&mut DeterministicTokens)
        .expect("deterministic tokens");
    group.coast_land(now);
    for r in group.responses() {
        assert!(r.finish.is_none(), "request {} ended in a stretch", r.id);
        streams.entry(r.id).or_default().push(r.last_token);
    }
}

#[test]
fn a_stretch_in_closed_form_leaves_the_ranks_as_its_iterations_one_by_one() {
    const STEPS: u32 = 40;
    for (dp, overlap) in [(1, true), (2, true), (2, false), (3, true)] {
        let what = format!("dp {dp}, overlap {overlap}");
        let (mut one_by_one, mut closed) = (
            steady(dp, overlap, u64::from(STEPS) + 1),
            steady(dp, overlap, u64::from(STEPS) + 1),
        );
        assert_eq!(ranks(&one_by_one.group), ranks(&closed.group), "{what}");
        let fetch = |j: u32| 1_000_000_000 + u64::from(j) * 1_000_000;

        let mut streams = BTreeMap::new();
        one_by_one.group.coast_limit();
        one_by_one.group.coast_begin();
        for j in 0..STEPS {
            coast_one(&mut one_by_one.group, fetch(j), &mut streams);
        }

        closed.group.coast_limit();
        closed.group.coast_begin();
        assert!(closed.group.stretch_begin(), "{what}: no plan");
        for step in 1..=STEPS {
            assert!(closed.group.stretch_fits(step), "{what}: step {step}");
        }
        let mut run = TokenRun::default();
        closed
            .group
            .stretch_apply(
                STEPS,
                fetch(STEPS - 1),
                false,
                &mut DeterministicTokens,
                &mut run,
            )
            .expect("deterministic tokens");

        assert_eq!(ranks(&one_by_one.group), ranks(&closed.group), "{what}");
        let run_streams: BTreeMap<ReqId, Vec<u32>> = run
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| (*id, run.tokens_of(i).to_vec()))
            .collect();
        assert_eq!(streams, run_streams, "{what}: the tokens");
        assert!(
            streams.values().all(|t| t.len() == STEPS as usize),
            "{what}"
        );

        // What was left in flight (and its sampled output, under overlap) carries on:
        // the next iteration is the same both ways.
        let (mut next_a, mut next_b) = (BTreeMap::new(), BTreeMap::new());
        coast_one(&mut one_by_one.group, fetch(STEPS), &mut next_a);
        coast_one(&mut closed.group, fetch(STEPS), &mut next_b);
        assert_eq!(next_a, next_b, "{what}: the iteration after");
        assert_eq!(ranks(&one_by_one.group), ranks(&closed.group), "{what}");
    }
}
