//! One end-to-end test per mechanism, in the simulator (debug builds of small scenarios
//! run in milliseconds): what each rule does to a whole run, asserted on the report.

mod common;

use common::*;
use lockstep_cluster::report::{Outcome, Report};

/// Per request: completion and length, without the token digest.
fn lengths(r: &Report) -> Vec<(u64, u32, bool)> {
    r.per_request
        .iter()
        .map(|d| (d.id, d.output_tokens, d.failure.is_none()))
        .collect()
}

/// The ids whose token digests differ between two runs of the same workload.
fn differing_digests(a: &Report, b: &Report) -> Vec<u64> {
    a.per_request
        .iter()
        .zip(&b.per_request)
        .filter(|(x, y)| x.token_digest != y.token_digest)
        .map(|(x, _)| x.id)
        .collect()
}

#[test]
fn token_streams_prove_the_routing_not_only_the_lengths() {
    // The same aggregated workload under two routers: every request completes with the
    // same length either way, but it runs on another rank (or in another iteration), so
    // its tokens differ; a run that routed differently cannot pass for the same run.
    let balanced = parse(&agg_text(4, true), &[]);
    let kv_aware = parse(
        &agg_text(4, true),
        &["server.attention_dp_config.router=\"kv_aware\""],
    );
    let a = simulate(&balanced);
    let b = simulate(&kv_aware);
    assert_eq!(a.requests.completed, 80);
    assert_eq!(lengths(&a), lengths(&b));
    assert_ne!(routing(&a, "agg0"), routing(&b, "agg0"));
    assert_ne!(agg_fingerprint(&a), agg_fingerprint(&b));
    let moved = differing_digests(&a, &b);
    assert!(
        moved.len() >= 40,
        "only {} of 80 streams differ",
        moved.len()
    );
    // And the same run twice is the same stream.
    assert_eq!(agg_fingerprint(&a), agg_fingerprint(&simulate(&balanced)));

    // Disaggregated: another router on ctx0 puts prompts on other ctx ranks; the gen
    // tokens carry the ctx rank they were computed on, so whole streams differ.
    let lb = parse(&disagg_text(40), &[]);
    let kv = parse(
        &disagg_text(40),
        &["server.ctx0.attention_dp_config.router=\"kv_aware\""],
    );
    let (c, d) = (simulate(&lb), simulate(&kv));
    assert_eq!(c.requests.completed, 40);
    assert_eq!(lengths(&c), lengths(&d));
    assert!(
        routing(&c, "ctx0") != routing(&d, "ctx0"),
        "ctx0 routed alike"
    );
    assert!(all_routing(&c) != all_routing(&d));
    assert!(
        disagg_fingerprint(&c) != disagg_fingerprint(&d),
        "fingerprints agree"
    );
    let moved = differing_digests(&c, &d);
    assert!(moved.len() >= 4, "{moved:?}");
    assert!(disagg_fingerprint(&c) == disagg_fingerprint(&simulate(&lb)));
    assert_eq!(c.outcome, Outcome::Completed);
}
