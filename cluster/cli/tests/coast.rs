//! Coasting through steady decode (`cluster/sim/src/coast.rs`) changes nothing but the
//! time a simulation takes: every example, under both presets, and a sample of swarm
//! scenarios report the same, byte for byte (but for the wall time), with and without
//! it. The tests also check that coasting happened, so that the comparison is not
//! between two runs of the same path.
//!
//! The large sample: `LOCKSTEP_COAST_SWARM_RUNS=1000 cargo test --release -p lockstep
//! --test coast -- --ignored`.

mod common;

use std::path::{Path, PathBuf};

use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, Coasting, SimOptions};

/// A run's report as JSON without its wall time, or its error, and what coasting did.
fn outcome(s: &Scenario, skip: bool) -> (Result<serde_json::Value, String>, Coasting) {
    let opts = SimOptions {
        skip,
        ..SimOptions::default()
    };
    match sim::run_counting(s, opts) {
        Ok((report, coasting)) => {
            let mut v = serde_json::to_value(&report).expect("a report serializes");
            v.as_object_mut()
                .expect("a report is an object")
                .remove("wall_time_s");
            (Ok(v), coasting)
        }
        Err(e) => (Err(e.to_string()), Coasting::default()),
    }
}

/// Runs `s` both ways, asserts the reports are the same, and says what coasting did.
fn same_both_ways(what: &str, s: &Scenario) -> Coasting {
    let (coasted, coasting) = outcome(s, true);
    let (stepped, none) = outcome(s, false);
    assert_eq!(none, Coasting::default(), "{what}: --no-skip coasted");
    if coasted != stepped {
        let show = |r: &Result<serde_json::Value, String>| match r {
            Ok(v) => serde_json::to_string_pretty(v).unwrap(),
            Err(e) => e.clone(),
        };
        let (a, b) = (show(&coasted), show(&stepped));
        let first = a
            .lines()
            .zip(b.lines())
            .position(|(x, y)| x != y)
            .unwrap_or(0);
        let context = |t: &str| {
            t.lines()
                .skip(first.saturating_sub(8))
                .take(16)
                .collect::<Vec<_>>()
                .join("\n")
        };
        panic!(
            "{what}: the report differs with coasting ({coasting:?}); first difference at line {first}:\n--- coasted\n{}\n--- step by step\n{}",
            context(&a),
            context(&b)
        );
    }
    coasting
}

fn examples() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut found = Vec::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                // `examples/search/` holds `lockstep search` specs, not scenarios.
                if !p.ends_with("search") {
                    dirs.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "toml") {
                found.push(p);
            }
        }
    }
    found.sort();
    found
}

fn name(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn every_example_reports_the_same_with_and_without_coasting_under_both_presets() {
    let found = examples();
    assert!(found.len() >= 20, "{found:?}");
    let (mut coasted, mut closed_form) = (0, 0);
    for path in &found {
        // The production-shaped benchmark runs whole in the benchmark; its first
        // requests show every mechanism here.
        let big = path.ends_with("disagg-8k1k-con4096.toml");
        let n = if big { 60 } else { 150 };
        for preset in ["fixed", "legacy"] {
            let mut s = Scenario::load(path).expect("example loads");
            // A workload without a request count to set runs whole.
            let _ = s.apply_set(&format!("workload.num_requests={n}"));
            s.apply_set(&format!("policy.preset=\"{preset}\""))
                .expect("a preset");
            let what = format!("{} ({preset})", name(path));
            let c = same_both_ways(&what, &s);
            coasted += c.iterations;
            closed_form += c.closed_form;
        }
    }
    assert!(
        coasted > 10_000,
        "the examples coasted only {coasted} iterations: the comparison would not test coasting"
    );
    println!("examples: {coasted} iterations coasted, {closed_form} in closed form");
    assert!(
        closed_form > coasted / 2,
        "only {closed_form} of {coasted} coasted iterations in closed form: the comparison would not test it"
    );
}

/// MAX_UTILIZATION on a tight pool: requests pause and are recomputed, and the long
/// ones, whose recompute could not run in one forward, may never be paused (they keep
/// their blocks to completion): the capacity scheduler's decision depends on the pool
/// from one iteration to the next, and a coasted iteration must take it as the
/// scheduler does.
#[test]
fn max_utilization_on_a_tight_pool_reports_the_same_with_and_without_coasting() {
    let (mut coasted, mut closed_form) = (0, 0);
    for (dp, overlap, tokens) in [(1, true, 96), (2, false, 96), (2, true, 160)] {
        let text = format!(
            r#"
name = "coast-max-utilization"
[[server]]
name = "agg0"
tensor_parallel_size = {dp}
enable_attention_dp = {adp}
max_batch_size = 8
max_num_tokens = {tokens}
disable_overlap_scheduler = {no_overlap}
[server.scheduler_config]
capacity_scheduler_policy = "MAX_UTILIZATION"
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 1024
enable_block_reuse = false
[workload]
kind = "closed_loop"
concurrency = 12
num_requests = 60
input_len = [16, 80]
output_len = [8, 120]
"#,
            adp = dp > 1,
            no_overlap = !overlap
        );
        let s = Scenario::parse(&text, "coast").expect("the scenario parses");
        let c = same_both_ways(&format!("dp {dp}, overlap {overlap}, T {tokens}"), &s);
        coasted += c.iterations;
        closed_form += c.closed_form;
    }
    // One rank, a pool of 10 blocks, requests of 16 prompt tokens and 30 to 110 output
    // tokens: the long ones may not be paused (their recompute exceeds T = 64), so the
    // blocks to their completion stay reserved, and a short one at a block boundary is
    // paused when the pool's free blocks are all reserved, although some are free.
    let tight = r#"
name = "coast-max-utilization-reserved"
seed = SEED
[[server]]
name = "agg0"
tensor_parallel_size = 1
max_batch_size = 8
max_num_tokens = 64
[server.scheduler_config]
capacity_scheduler_policy = "MAX_UTILIZATION"
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 160
enable_block_reuse = false
[frontend]
preset = "none"
[workload]
kind = "closed_loop"
concurrency = 3
num_requests = 12
input_len = 16
output_len = [30, 110]
"#;
    for seed in 0..12 {
        let text = tight.replace("SEED", &seed.to_string());
        let s = Scenario::parse(&text, "coast").expect("the scenario parses");
        let c = same_both_ways(&format!("reserved blocks, seed {seed}"), &s);
        coasted += c.iterations;
        closed_form += c.closed_form;
    }
    println!("MAX_UTILIZATION: {coasted} iterations coasted, {closed_form} in closed form");
    assert!(coasted > 100, "only {coasted} iterations coasted");
    assert!(
        closed_form > 50,
        "only {closed_form} of {coasted} coasted iterations in closed form"
    );
}

/// Swarm scenarios `first..first + runs`, each compared both ways; the iterations
/// coasted in all, and of them in closed form.
fn swarm_sample(first: u64, runs: u64) -> (u64, u64) {
    let (mut coasted, mut closed_form) = (0, 0);
    for seed in first..first + runs {
        let text = lockstep_swarm::generate(seed);
        let s = Scenario::parse(&text, "swarm")
            .unwrap_or_else(|e| panic!("swarm seed {seed}: {e}\n{text}"));
        let c = same_both_ways(&format!("swarm seed {seed}:\n{text}\n"), &s);
        coasted += c.iterations;
        closed_form += c.closed_form;
    }
    (coasted, closed_form)
}

#[test]
fn swarm_scenarios_report_the_same_with_and_without_coasting() {
    let (coasted, closed_form) = swarm_sample(7_000, 40);
    println!("swarm: {coasted} iterations coasted, {closed_form} in closed form");
    assert!(
        coasted > 1_000,
        "the sample coasted only {coasted} iterations"
    );
    assert!(
        closed_form > coasted / 4,
        "only {closed_form} of {coasted} coasted iterations in closed form"
    );
}

#[test]
#[ignore = "the large sample: run in release, see the file's comment"]
fn many_swarm_scenarios_report_the_same_with_and_without_coasting() {
    let runs = std::env::var("LOCKSTEP_COAST_SWARM_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let (coasted, closed_form) = swarm_sample(100_000, runs);
    println!(
        "{runs} swarm scenarios the same both ways; {coasted} iterations coasted, {closed_form} in closed form"
    );
}
