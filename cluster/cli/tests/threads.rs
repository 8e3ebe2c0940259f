//! The threads driver against the simulator. With every request delivered before the
//! first iteration, both run the same control plane: aggregated runs agree exactly
//! (iterations, forwards, routing, tokens); disaggregated runs agree request by request
//! (tokens, failures under lost KV) and on the ctx servers' routing, and with modeled
//! time on latency and iterations. And the faults: a mismatched collective is a tag
//! error, a stalled server ends `deadlocked`, not a hang.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use lockstep_actors::ids::ReqId;
use lockstep_actors::transceiver::lost_on_the_wire;
use lockstep_plan::report::{Outcome, Report};
use lockstep_runtime::RealOptions;

#[test]
fn aggregated_runs_agree_exactly_on_iterations_forwards_routing_and_tokens() {
    for (dp, overlap) in [(2, true), (4, true), (2, false)] {
        let s = parse(&agg_text(dp, overlap), &[]);
        let a = simulate(&s);
        let b = threads_run(&s, real_options());
        assert_eq!(a.requests.completed, 80);
        assert_eq!(
            agg_fingerprint(&a),
            agg_fingerprint(&b),
            "dp {dp} overlap {overlap}"
        );
        assert!(a.servers[0].ranks.iter().all(|r| r.routed_requests > 0));
    }
}

#[test]
fn adp_balance_holds_the_same_iterations_in_the_simulator_and_the_threads_driver() {
    // Every rank decides from what the gather and routing gave it: the same waits,
    // iterations, routing and tokens under real collectives as in the simulator.
    let s = parse(
        &agg_text(4, true),
        &[
            "server.attention_dp_config.enable_balance=true",
            "server.attention_dp_config.timeout_iters=6",
            "server.attention_dp_config.batching_wait_iters=2",
        ],
    );
    let a = simulate(&s);
    let b = threads_run(&s, real_options());
    assert_eq!(a.requests.completed, 80);
    assert_eq!(agg_fingerprint(&a), agg_fingerprint(&b));
    let (ba, bb) = (&a.servers[0].balance, &b.servers[0].balance);
    assert!(ba.held_iterations > 0, "{ba:?}");
    assert_eq!(
        (
            ba.held_iterations,
            ba.timed_out_iterations,
            ba.measured_iterations
        ),
        (
            bb.held_iterations,
            bb.timed_out_iterations,
            bb.measured_iterations
        )
    );
    assert_eq!(ba.mean_ratio, bb.mean_ratio);
    // Balance changed the run: not the same iterations as with it off.
    let off = simulate(&parse(&agg_text(4, true), &[]));
    assert_ne!(agg_fingerprint(&off).0, agg_fingerprint(&a).0);
}

#[test]
fn a_mismatched_collective_is_a_tag_error_naming_both_ranks_not_a_hang() {
    let s = parse(&agg_text(2, true), &[]);
    let r = threads_run(
        &s,
        RealOptions {
            mismatch_tag_at: Some((1, 5)),
            ..real_options()
        },
    );
    assert_eq!(r.outcome, Outcome::Failed);
    let err = r.outcome_detail.unwrap_or_default();
    assert!(
        err.contains("tag mismatch") && err.contains("Gather") && err.contains("Vote"),
        "{err}"
    );
    // What the failed ranks held failed with them, naming the run's failure.
    assert!(r.requests.failed > 0);
    for d in r.per_request.iter().filter(|d| d.failure().is_some()) {
        let why = d.failure().unwrap();
        assert_eq!(why, "still open when the run ended (failed)", "{d:?}");
    }
}

#[test]
fn disaggregated_runs_agree_on_tokens_over_two_ctx_and_two_gen_servers() {
    // At zero cost the gen servers' routing is timing (which requests reach a gen
    // ingress together depends on when their prefills ended); the ctx routing and the
    // tokens, which carry the ctx rank of each prompt, are not (`disagg_fingerprint`).
    let s = parse(&disagg_text(60), &[]);
    let a = simulate(&s);
    let b = threads_run(&s, real_options());
    assert_eq!(a.requests.completed, 60);
    assert_eq!(b.requests.completed, 60, "{:?}", b.per_request);
    // Tokens mix in the ctx rank that computed each prompt: equal streams prove equal
    // ctx routing request by request, and the ctx servers' routing digests agree too.
    assert_eq!(disagg_fingerprint(&a), disagg_fingerprint(&b));
    // Every server took work, moved checked KV for every multi-token request, and
    // holds nothing at the end.
    let transfers = multi_token_requests(&b);
    let sends: u64 = b.servers[..2].iter().map(|s| s.transfers.count).sum();
    let receives: u64 = b.servers[2..].iter().map(|s| s.transfers.count).sum();
    assert_eq!((sends, receives), (transfers, transfers));
    for s in &b.servers {
        assert!(
            s.ranks.iter().map(|k| k.routed_requests).sum::<u64>() > 0,
            "{}",
            s.name
        );
        let t = &s.transfers;
        assert!(t.bytes > 0, "{}", s.name);
        assert_eq!(
            (t.timeouts, t.lost, t.checksum_failures),
            (0, 0, 0),
            "{}",
            s.name
        );
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

/// Every request whose KV the wire loses fails, unless its only token came from the ctx
/// server (nothing was sent); every other request completes.
fn assert_failed_exactly_the_lost(r: &Report, every: u64) {
    for d in &r.per_request {
        let lost = lost_on_the_wire(ReqId(d.id), Some(every));
        let single_token = d.failure().is_none() && d.output_tokens == 1;
        assert_eq!(d.failure().is_some(), lost && !single_token, "{d:?}");
    }
}

/// Per request: tokens, their digest, and whether it failed.
fn outcomes(r: &Report) -> Vec<(u64, u32, u64, bool)> {
    r.per_request
        .iter()
        .map(|d| (d.id, d.output_tokens, d.token_digest, d.failure().is_some()))
        .collect()
}

#[test]
fn lost_kv_fails_exactly_the_requests_whose_kv_the_wire_lost_in_both_drivers() {
    let every = 4;
    let s = parse(
        &disagg_text(60),
        &[
            "faults.lost_transfer_every=4",
            "server.cache_transceiver_config.kv_transfer_timeout_ms=300",
        ],
    );
    let a = simulate(&s);
    let b = threads_run(&s, real_options());
    // The same requests fail, with the same tokens; all others complete (which side of
    // a lost transfer times out first is thread timing).
    assert_eq!(outcomes(&a), outcomes(&b));
    let failed = failed_ids(&b);
    assert!(failed.len() >= 2, "{failed:?}");
    assert_failed_exactly_the_lost(&b, every);
    for d in b.per_request.iter().filter(|d| d.failure().is_some()) {
        let why = d.failure().unwrap_or_default();
        assert!(why.contains("kv transfer timed out after 300 ms"), "{why}");
        assert_eq!(
            d.output_tokens, 1,
            "only the ctx server's token got out: {d:?}"
        );
    }
    for s in &b.servers {
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
    // The report counts the losses it saw; which side's timeout fires first is thread
    // timing, so the count is bounded by the failures rather than pinned to them.
    let lost: u64 = b.servers.iter().map(|s| s.transfers.lost).sum();
    assert!(
        lost > 0 && lost <= failed.len() as u64,
        "{lost} of {failed:?}"
    );
}

#[test]
fn failure_responses_reach_a_real_time_client_when_servers_go_idle() {
    // Few requests at a time: a server is often idle right after a transfer fails, and
    // the failure must still reach the client, or a closed loop waits for it forever.
    let s = parse(
        &disagg_text(24),
        &[
            "workload.concurrency=3",
            "workload.output_len=[2, 8]",
            "faults.lost_transfer_every=3",
            "server.cache_transceiver_config.kv_transfer_timeout_ms=300",
        ],
    );
    let r = threads_run(
        &s,
        RealOptions {
            preload: false,
            ..real_options()
        },
    );
    let failed: BTreeSet<u64> = failed_ids(&r).into_iter().collect();
    let lost: BTreeSet<u64> = (1..=24)
        .filter(|&id| lost_on_the_wire(ReqId(id), Some(3)))
        .collect();
    assert_eq!(failed, lost, "{:?}", r.per_request);
    assert_eq!(r.requests.completed, 24 - lost.len() as u64);
    for s in &r.servers {
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

/// A server that stalls (the fixed policy has no stall left to show, so a legacy-only
/// one, §3.2): judged on the routable count, rank 0 waits for input while its one
/// request, retiring, needs one more iteration, and the closed-loop client waits for
/// that request's answer. Nothing changes until the stall bound.
fn stalling() -> lockstep_plan::scenario::Scenario {
    parse(
        &agg_text(2, true),
        &[
            "policy.idle.predicate=\"routable\"",
            "workload.num_requests=1",
            "workload.concurrency=1",
            "workload.output_len=1",
        ],
    )
}

#[test]
fn a_stalled_server_ends_deadlocked_in_the_simulator_and_the_threads_driver_alike() {
    let s = stalling();
    let a = simulate_with(&s, |o| {
        o.preload = false;
        o.stall_bound_ns = 300_000_000;
    });
    assert_eq!(a.outcome, Outcome::Deadlocked, "{:?}", a.outcome_detail);
    let b = threads_run(
        &s,
        RealOptions {
            preload: false,
            stall_bound: Duration::from_millis(300),
            ..real_options()
        },
    );
    assert_eq!(b.outcome, Outcome::Deadlocked, "{:?}", b.outcome_detail);
    for r in [&a, &b] {
        let detail = r.outcome_detail.as_deref().unwrap_or_default();
        // Every rank's state is named.
        assert!(
            detail.contains("rank 0:") && detail.contains("rank 1:"),
            "{detail}"
        );
        assert!(
            detail.contains("no iteration changed anything for 300 ms"),
            "{detail}"
        );
        // The request is accounted for: failed with the deadlock as the reason.
        assert_eq!(r.requests.failed, 1);
        assert!(
            r.per_request
                .iter()
                .all(|d| { d.failure().is_some_and(|f| f.contains("deadlocked")) })
        );
    }
}

/// §3.2's negative control in the real driver: judged on the routable count, rank 0
/// waits for input while a retiring request needs one more iteration, and a closed-loop
/// client sends nothing until it is answered. The wait is bounded like any stall, so the
/// run ends deadlocked, as in the simulator, instead of hanging; under the live count
/// (the fixed rule) the same scenario completes.
#[test]
fn judging_idleness_on_the_routable_count_deadlocks_a_closed_loop_client_in_every_driver() {
    let sets = [
        "workload.concurrency=1",
        "workload.num_requests=3",
        "workload.output_len=1",
    ];
    let fixed = parse(&agg_text(2, true), &sets);
    let text = agg_text(2, true);
    let mut with_switch: Vec<&str> = sets.to_vec();
    with_switch.push("policy.idle.predicate=\"routable\"");
    let defective = parse(&text, &with_switch);
    let options = RealOptions {
        preload: false,
        stall_bound: Duration::from_millis(300),
        ..real_options()
    };
    let ok = threads_run(&fixed, options.clone());
    assert_eq!(ok.outcome, Outcome::Completed, "{:?}", ok.outcome_detail);
    assert_eq!(ok.requests.completed, 3);

    let a = simulate_with(&defective, |o| {
        o.preload = false;
        o.stall_bound_ns = 300_000_000;
    });
    let b = threads_run(&defective, options);
    for r in [&a, &b] {
        assert_eq!(r.outcome, Outcome::Deadlocked, "{:?}", r.outcome_detail);
        let detail = r.outcome_detail.as_deref().unwrap_or_default();
        assert!(detail.contains("retiring 1"), "{detail}");
        assert_eq!(r.requests.completed, 0, "{:?}", r.per_request);
        // The request the server held fails naming the deadlock; the client's later
        // ones (it sends one at a time) are refused by the stopped server: at its door,
        // or before they are sent (which of them is thread timing; the simulator and
        // the threads driver word the door differently).
        for d in &r.per_request {
            let why = d.failure().unwrap_or("completed");
            assert!(
                why.contains("deadlocked")
                    || why == "server `agg0` stopped"
                    || why == "server 0: Ingress(0) is closed"
                    || why == "not served: every server had stopped before the request was sent",
                "{d:?}"
            );
        }
        assert!(
            r.per_request
                .iter()
                .any(|d| { d.failure().is_some_and(|w| w.contains("deadlocked")) })
        );
    }
}

#[test]
fn generation_first_promotes_every_request_and_streams_the_simulators_tokens() {
    let s = parse(
        &disagg_text(40),
        &["server.ctx0.cache_transceiver_config.generation_first=true"],
    );
    let promoted = |r: &Report| {
        r.servers
            .iter()
            .find(|s| s.name == "ctx0")
            .unwrap()
            .transfers
            .generation_first_promoted
    };
    let a = simulate(&s);
    let b = threads_run(&s, real_options());
    assert_eq!(b.requests.completed, 40, "{:?}", b.per_request);
    // ctx0 takes every other request (load balancing over two ctx servers).
    assert!(promoted(&a) > 0);
    assert_eq!(promoted(&a), promoted(&b));
    assert_eq!(disagg_fingerprint(&a), disagg_fingerprint(&b));
}

#[test]
fn disaggregated_serving_completes_every_request_under_the_legacy_policy_too() {
    let s = parse(&disagg_text(40), &["policy.preset=\"legacy\""]);
    let r = threads_run(&s, real_options());
    assert!(!r.legacy_switches.is_empty());
    assert_eq!(r.requests.completed, 40, "{:?}", r.per_request);
    for s in &r.servers {
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
fn preload_refuses_a_closed_loop_whose_later_requests_wait_on_earlier_ones() {
    let s = parse(&agg_text(2, true), &["workload.concurrency=8"]);
    let err = threads_try(&s, real_options()).expect_err("refused");
    assert!(
        err.contains("concurrency 8 < workload.num_requests 80"),
        "{err}"
    );
    let e = lockstep_sim::run(
        &s,
        lockstep_sim::SimOptions {
            preload: true,
            ..Default::default()
        },
    )
    .expect_err("refused")
    .to_string();
    assert!(
        e.contains("concurrency 8 < workload.num_requests 80"),
        "{e}"
    );
}
