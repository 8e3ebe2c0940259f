//! ADP balance (mechanisms.md §4.1, §9.1) end to end in the simulator, asserted on the
//! per-iteration record (`--iter-log`'s lines): with balance on no forward starts context
//! work on some ranks while another rank has none, unless the context wait timed out (or
//! a rank had no generation work to keep it busy); with both waits at 0 a run equals
//! balance off exactly; the record's balance ratio is the ranks' mean over max tokens.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lockstep_plan::report::Report;
use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, SimOptions};
use serde_json::Value;

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/balance/short-prompts-long-outputs.toml")
}

fn scenario(sets: &[&str]) -> Scenario {
    let mut s = Scenario::load(&example()).expect("example loads");
    // Small enough for a debug test, long enough to hold and time out often.
    for set in ["workload.num_requests=300", "workload.concurrency=192"]
        .iter()
        .chain(sets)
    {
        s.apply_set(set).expect("valid --set");
    }
    s
}

/// The report and the iteration log's lines, by iteration then rank.
fn simulate(s: &Scenario) -> (Report, BTreeMap<u64, Vec<Value>>) {
    let mut log = Vec::new();
    let report = sim::run(
        s,
        SimOptions {
            iter_log: Some(&mut log),
            ..SimOptions::default()
        },
    )
    .expect("simulation starts");
    let mut by_iteration: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    for line in String::from_utf8(log).unwrap().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        by_iteration
            .entry(v["iteration"].as_u64().unwrap())
            .or_default()
            .push(v);
    }
    for ranks in by_iteration.values_mut() {
        ranks.sort_by_key(|r| r["rank"].as_u64().unwrap());
    }
    (report, by_iteration)
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// Forwards that started context work on some rank while another rank had none, and
/// every rank had generation work — what the context wait exists to prevent — with the
/// iteration's decision.
fn lopsided_context_starts(log: &BTreeMap<u64, Vec<Value>>) -> Vec<(u64, String)> {
    log.iter()
        .filter(|(_, ranks)| {
            let started = ranks
                .iter()
                .any(|r| r["forward_ran"] == true && u(r, "num_ctx_requests") > 0);
            let one_had_none = ranks.iter().any(|r| u(r, "context_work") == 0);
            let all_generating = ranks.iter().all(|r| u(r, "generation_work") > 0);
            started && one_had_none && all_generating
        })
        .map(|(i, ranks)| (*i, ranks[0]["balance"].as_str().unwrap().to_string()))
        .collect()
}

#[test]
fn with_balance_on_context_starts_on_every_rank_together_unless_the_wait_timed_out() {
    const TIMEOUT: u64 = 8;
    let (report, log) = simulate(&scenario(&[
        "server.attention_dp_config.enable_balance=true",
        &format!("server.attention_dp_config.timeout_iters={TIMEOUT}"),
    ]));
    assert_eq!(report.requests.completed, 300);
    let b = &report.servers[0].balance;
    assert!(b.held_iterations > 100, "{b:?}");
    assert!(b.timed_out_iterations > 0, "{b:?}");
    // Every rank records the same decision.
    for (i, ranks) in &log {
        assert!(
            ranks.iter().all(|r| r["balance"] == ranks[0]["balance"]),
            "iteration {i}: {ranks:?}"
        );
    }
    // The rule: a lopsided start only when the wait timed out.
    let lopsided = lopsided_context_starts(&log);
    assert!(!lopsided.is_empty(), "the workload must time out sometimes");
    for (i, decision) in &lopsided {
        assert_eq!(decision, "timed_out", "iteration {i}");
    }
    // And a timeout comes after exactly TIMEOUT − 1 held iterations of context wait.
    let decisions: Vec<&str> = log
        .values()
        .map(|r| r[0]["balance"].as_str().unwrap())
        .collect();
    for (at, _) in decisions
        .iter()
        .enumerate()
        .filter(|(_, d)| **d == "timed_out")
    {
        let waited = decisions[..at]
            .iter()
            .rev()
            .take_while(|d| **d == "wait_for_context")
            .count() as u64;
        assert_eq!(waited, TIMEOUT - 1, "timeout at record {at}");
    }
    // A held iteration runs no context anywhere.
    for (i, ranks) in &log {
        if ranks[0]["balance"] == "wait_for_context" || ranks[0]["balance"] == "wait_for_batching" {
            assert!(
                ranks.iter().all(|r| u(r, "num_ctx_requests") == 0),
                "iteration {i}: {ranks:?}"
            );
        }
    }
}

#[test]
fn without_balance_context_starts_lopsided_and_the_record_says_off() {
    // The same check finds the defect balance exists for when balance is off: the test
    // above can fail.
    let (_, log) = simulate(&scenario(&[]));
    let lopsided = lopsided_context_starts_by_gather(&log);
    assert!(lopsided > 100, "{lopsided}");
    assert!(log.values().flatten().all(|r| r["balance"] == "off"));
}

/// With balance off the record has no loads (nothing measured them): judge by what the
/// ranks scheduled — some rank prefilled while another decoded only.
fn lopsided_context_starts_by_gather(log: &BTreeMap<u64, Vec<Value>>) -> usize {
    log.values()
        .filter(|ranks| {
            ranks.iter().all(|r| r["forward_ran"] == true)
                && ranks.iter().any(|r| u(r, "num_ctx_requests") > 0)
                && ranks.iter().any(|r| u(r, "num_ctx_requests") == 0)
        })
        .count()
}

#[test]
fn both_waits_at_zero_equal_balance_off_exactly() {
    let off = scenario(&[]);
    let zero = scenario(&[
        "server.attention_dp_config.enable_balance=true",
        "server.attention_dp_config.timeout_iters=0",
        "server.attention_dp_config.batching_wait_iters=0",
    ]);
    let (a, log_a) = simulate(&off);
    let (b, log_b) = simulate(&zero);
    let json = |r: &Report| serde_json::to_string(&r.without_wall_time()).unwrap();
    assert_eq!(json(&a), json(&b));
    // Record by record, but for the decision and the loads only balance measures.
    let strip = |log: &BTreeMap<u64, Vec<Value>>| -> Vec<Value> {
        log.values()
            .flatten()
            .map(|r| {
                let mut r = r.clone();
                let o = r.as_object_mut().unwrap();
                for k in ["balance", "context_work", "generation_work"] {
                    o.remove(k);
                }
                r
            })
            .collect()
    };
    assert_eq!(strip(&log_a), strip(&log_b));
    assert!(log_b.values().flatten().all(|r| r["balance"] == "run"));
    // timeout 0 alone still has the batching wait: not the same run.
    let (c, _) = simulate(&scenario(&[
        "server.attention_dp_config.enable_balance=true",
        "server.attention_dp_config.timeout_iters=0",
    ]));
    assert!(c.servers[0].balance.held_iterations > 0);
    assert_ne!(json(&a), json(&c));
}

#[test]
fn the_records_balance_ratio_is_the_ranks_mean_over_max_tokens() {
    let (report, log) = simulate(&scenario(&[]));
    let mut measured = 0;
    let mut sum = 0.0;
    for (i, ranks) in &log {
        let tokens: Vec<f64> = ranks.iter().map(|r| u(r, "num_tokens") as f64).collect();
        let max = tokens.iter().cloned().fold(0.0, f64::max);
        for r in ranks {
            assert_eq!(u(r, "max_rank_tokens") as f64, max, "iteration {i}");
        }
        match ranks[0]["balance_ratio"].as_f64() {
            None => assert_eq!(max, 0.0, "iteration {i}"),
            Some(ratio) => {
                let want = tokens.iter().sum::<f64>() / tokens.len() as f64 / max;
                assert!(
                    (ratio - want).abs() < 1e-12,
                    "iteration {i}: {ratio} {want}"
                );
                measured += 1;
                sum += ratio;
            }
        }
    }
    let b = &report.servers[0].balance;
    assert_eq!(b.measured_iterations, measured);
    assert!((b.mean_ratio.unwrap() - sum / measured as f64).abs() < 1e-9);
    // Imbalance costs this workload something, and the speed of light is above.
    assert!(b.mean_ratio.unwrap() < 0.95, "{b:?}");
    assert!(b.sol_output_tokens_per_s > b.output_tokens_per_s, "{b:?}");
}

#[test]
fn a_negative_wait_is_refused_naming_the_field_and_value() {
    let s = scenario(&["server.attention_dp_config.timeout_iters=-1"]);
    let e = sim::run(&s, SimOptions::default())
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("`attention_dp_config.timeout_iters` must be an integer >= 0, got -1"),
        "{e}"
    );
}
