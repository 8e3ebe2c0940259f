//! Swarm testing in CI: a few hundred seeded random scenarios under the fixed policy,
//! each of which must end clean or fail only by the faults it injects; the shrinker on
//! a deliberate (legacy-switch) deadlock; the generator's determinism.

use std::path::PathBuf;

use lockstep_plan::scenario::Scenario;
use lockstep_swarm::{self as swarm, Class, Driver, Limits, SwarmConfig};

/// Scenarios of the CI swarm, and the first seed (scenario i uses seed SEED + i).
const RUNS: u64 = 400;
const SEED: u64 = 1;

#[test]
fn every_generated_scenario_runs_clean_or_fails_only_by_its_injected_faults() {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("swarm");
    let cfg = SwarmConfig {
        runs: RUNS,
        seed: SEED,
        out: Some(out.clone()),
        shrink_budget: 150,
        ..SwarmConfig::default()
    };
    let summary = swarm::run_swarm(&cfg, None).expect("the swarm writes its files");
    let total: u64 = summary.counts.values().sum();
    assert_eq!(total, RUNS, "{}", summary.render());
    if !summary.all_ok() {
        let mut message = format!(
            "{} of {RUNS} scenarios (seeds {SEED}..{}) are neither clean nor failed only by injected faults.\n\
             Per class, with the shrunk scenario files (in {}):\n{}\n\
             Replay one with `lockstep sim FILE`; `lockstep swarm --runs 1 --seed N` regenerates the original.\n",
            summary.bad_cases().count(),
            SEED + RUNS,
            out.display(),
            summary.render()
        );
        for case in summary.bad_cases() {
            message.push_str(&format!(
                "\n===== seed {} ({}) =====\n{}",
                case.seed,
                case.finding.class,
                swarm::annotated(case)
            ));
        }
        panic!("{message}");
    }
}

/// A fleet that deadlocks on purpose: the legacy idle predicate (not in the `legacy`
/// preset, mechanisms.md "Legacy switches") makes rank 0 wait for input while its only
/// request is retiring, and the closed-loop client of concurrency 1 waits for that
/// request. Everything else is there for the shrinker to remove.
const DEADLOCKING: &str = r#"
name = "deadlock-on-purpose"
seed = 7

[policy]
idle.predicate = "routable"

[[server]]
name = "agg0"
tensor_parallel_size = 4
max_batch_size = 8
max_num_tokens = 2048
enable_chunked_prefill = true

[server.scheduler_config]
capacity_scheduler_policy = "MAX_UTILIZATION"
context_chunking_policy = "EQUAL_PROGRESS"

[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 65536
enable_block_reuse = true

[server.attention_dp_config]
router = "kv_aware"

[workload]
kind = "closed_loop"
concurrency = 1
num_requests = 40
input_len = [16, 900]
output_len = [1, 40]
think_time_ms = 2.0
shared_prefix_tokens = 16
warmup_requests = 2

[front]
policy = "load_balancing"

[model]
profile = "llama3-70b-h200-fp8-tp8"
"#;

#[test]
fn the_shrinker_keeps_the_class_and_makes_the_scenario_smaller() {
    let limits = Limits::default();
    let found = swarm::run_one(DEADLOCKING, Driver::Sim, &limits);
    assert_eq!(found.class, Class::Deadlocked, "{found:?}");
    let shrunk = swarm::shrink(DEADLOCKING, &found, Driver::Sim, &limits, 300);
    assert_eq!(shrunk.finding.class, Class::Deadlocked, "{shrunk:?}");
    assert!(!shrunk.steps.is_empty(), "{shrunk:?}");
    // Smaller: fewer requests and ranks, fewer keys.
    let before = swarm::size(DEADLOCKING).unwrap();
    let after = swarm::size(&shrunk.text).unwrap();
    assert!(after < before, "size {after} !< {before}:\n{}", shrunk.text);
    assert!(shrunk.requests < 42 && shrunk.ranks < 4, "{}", shrunk.text);
    // The switch that causes it stays; the shrunk file still parses and deadlocks.
    assert!(shrunk.text.contains("routable"), "{}", shrunk.text);
    let again = swarm::run_one(&shrunk.text, Driver::Sim, &limits);
    assert_eq!(again.class, Class::Deadlocked, "{again:?}\n{}", shrunk.text);
}

#[test]
fn generation_is_deterministic_per_seed_and_valid() {
    let mut distinct = std::collections::BTreeSet::new();
    for seed in 0..200 {
        let text = swarm::generate(seed);
        assert_eq!(text, swarm::generate(seed), "seed {seed}");
        let scenario =
            Scenario::parse(&text, "swarm").unwrap_or_else(|e| panic!("seed {seed}: {e}\n{text}"));
        assert_eq!(scenario.seed, Some(seed));
        scenario
            .derive_all()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}\n{text}"));
        distinct.insert(text);
    }
    assert_eq!(distinct.len(), 200);
}

#[test]
fn lost_transfers_with_a_short_timeout_are_fault_only_and_without_faults_clean() {
    let text = |faults: &str| {
        format!(
            r#"
seed = 3
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 2
max_batch_size = 4
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 2
max_batch_size = 16
[server.cache_transceiver_config]
kv_transfer_timeout_ms = 200
[workload]
kind = "closed_loop"
concurrency = 8
num_requests = 40
input_len = [32, 512]
output_len = [2, 32]
{faults}
"#
        )
    };
    let limits = Limits::default();
    let lossy = swarm::run_one(
        &text("[faults]\nlost_transfer_every = 4"),
        Driver::Sim,
        &limits,
    );
    assert_eq!(lossy.class, Class::FaultOnly, "{lossy:?}");
    let clean = swarm::run_one(&text(""), Driver::Sim, &limits);
    assert_eq!(clean.class, Class::Clean, "{clean:?}");
    // A scenario the product refuses is reported as such, with the error.
    let refused = swarm::run_one(
        &text("").replace("max_batch_size = 4", "max_batch_size = 0"),
        Driver::Sim,
        &limits,
    );
    assert_eq!(refused.class, Class::Refused, "{refused:?}");
    assert!(refused.detail.contains("max_batch_size"), "{refused:?}");
}
