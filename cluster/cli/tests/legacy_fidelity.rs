//! What the legacy switches cost, as GPU runs of the reference executor measured it
//! (mechanisms.md §3, §6): on the ctx-only binding case (B 2, max_num_tokens 16k, 8k
//! prompts, overlap, output length 1) at 512, 1,024 and 4,096 clients started as
//! benchmark tools start them — one warm-up request, then every client at once — the
//! serving front door (`[frontend]`, its default: the Python front doors) spaces their
//! requests by its service time, and under the legacy preset a rank's routing share sits
//! on a rung `1/(2·dp − k)` with about 2.3–2.7× the iterations and a 10–28 % throughput
//! loss; the fixed preset stays at `1/dp`. The ladder comes from the deferred batch (a
//! skipped forward leaves the previous batch, and its retiring requests, on ranks that
//! had work) meeting legacy `admission.charge_retiring`: without the deferral these
//! controls fail (checked by removing the rule), and without the front door's cost the
//! fleet starts symmetric and stays so (the negative control below). And the legacy pad
//! predicate with the legacy rollback crashes a gen server on the cap check under a
//! burst of KV transfers while requests finish.

mod common;

use common::parse;
use lockstep_plan::report::{Outcome, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, SimOptions};

/// The loads the GPU runs measured.
const CLIENTS: [u32; 3] = [512, 1024, 4096];

/// The binding case at `dp` ranks and `clients` clients: B 2, max_num_tokens 16k,
/// overlap unless `no_overlap`, 8k prompts, output length 1, a warm-up request, then
/// every client at once (four times as many requests as clients), the default front door.
fn binding(dp: u32, clients: u32, no_overlap: bool, preset: &str) -> Scenario {
    parse(
        &format!(
            r#"
name = "binding"
[policy]
preset = "{preset}"
[[server]]
name = "agg0"
tensor_parallel_size = {dp}
enable_attention_dp = true
max_batch_size = 2
max_num_tokens = 16384
disable_overlap_scheduler = {no_overlap}
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[workload]
kind = "closed_loop"
concurrency = {clients}
num_requests = {requests}
input_len = 8192
output_len = 1
warmup_requests = 1
[model]
profile = "deepseek-v3-h200-fp8-adp"
"#,
            requests = 4 * clients
        ),
        &[],
    )
}

fn run(s: &Scenario) -> Report {
    let r = sim::run(s, SimOptions::default()).expect("the simulation starts");
    assert_eq!(r.outcome, Outcome::Completed, "{:?}", r.outcome_detail);
    assert_eq!(r.requests.completed, r.requests.submitted);
    r
}

fn shares(r: &Report) -> Vec<f64> {
    r.servers[0].ranks.iter().map(|k| k.routing_share).collect()
}

/// The rung `1/(2·dp − k)`, k in 1..dp, that `share` sits on (within 0.002), if any.
fn rung(share: f64, dp: u32) -> Option<u32> {
    (1..dp).find(|&k| (share - 1.0 / f64::from(2 * dp - k)).abs() < 0.002)
}

fn total_iterations(r: &Report) -> u64 {
    r.servers[0].iterations
}

#[test]
fn legacy_puts_rank_0_on_a_ladder_rung_with_over_twice_the_iterations_and_a_loss_at_the_measured_loads()
 {
    for dp in [2, 4] {
        for clients in CLIENTS {
            let fixed = run(&binding(dp, clients, false, "fixed"));
            let legacy = run(&binding(dp, clients, false, "legacy"));
            let (f, l) = (shares(&fixed), shares(&legacy));
            for s in &f {
                assert!(
                    (s - 1.0 / f64::from(dp)).abs() < 0.002,
                    "dp {dp}, {clients} clients: fixed {f:?}"
                );
            }
            assert!(
                rung(l[0], dp).is_some(),
                "dp {dp}, {clients} clients: rank 0's legacy share {} is on no rung 1/(2dp-k): {l:?}",
                l[0]
            );
            let ratio = total_iterations(&legacy) as f64 / total_iterations(&fixed) as f64;
            assert!(
                (2.2..3.0).contains(&ratio),
                "dp {dp}, {clients} clients: legacy runs {ratio:.2}x the fixed iterations"
            );
            let loss =
                1.0 - legacy.throughput.total_tokens_per_s / fixed.throughput.total_tokens_per_s;
            assert!(
                loss >= 0.10,
                "dp {dp}, {clients} clients: throughput loss {loss:.3}"
            );
            assert!(legacy.servers[0].deferred_batches > 0);
            // The front door was there, and every client queued at it at once.
            let door = legacy.frontend.expect("the default front door");
            assert_eq!(door.peak_queue, clients, "{door:?}");
        }
    }
}

#[test]
fn without_the_overlap_scheduler_both_presets_agree_to_the_request() {
    for dp in [2, 4] {
        for clients in CLIENTS {
            let fixed = run(&binding(dp, clients, true, "fixed"));
            let legacy = run(&binding(dp, clients, true, "legacy"));
            assert_eq!(
                shares(&fixed),
                shares(&legacy),
                "dp {dp}, {clients} clients"
            );
            assert_eq!(total_iterations(&fixed), total_iterations(&legacy));
            assert_eq!(legacy.servers[0].deferred_batches, 0);
            let placed = |r: &Report| -> Vec<(u64, Option<f64>)> {
                r.per_request
                    .iter()
                    .map(|d| (d.id, d.first_scheduled_ms()))
                    .collect()
            };
            assert_eq!(
                placed(&fixed),
                placed(&legacy),
                "dp {dp}, {clients} clients"
            );
        }
    }
}

#[test]
fn a_free_front_door_starts_the_fleet_symmetric_and_it_never_leaves_symmetry() {
    // The negative control: with every client's request reaching the executor at once
    // the fleet fills in step and stays so; legacy costs vetoed iterations but the
    // shares stay equal (what the old `ab` saw, and what tools without a front door
    // model predict).
    for dp in [2, 4] {
        let mut s = binding(dp, 512, false, "legacy");
        s.apply_set("frontend.preset=\"none\"").unwrap();
        let l = run(&s);
        let sh = shares(&l);
        for k in &sh {
            assert!((k - 1.0 / f64::from(dp)).abs() < 0.002, "dp {dp}: {sh:?}");
        }
        assert!(l.frontend.is_some_and(|d| d.peak_queue == 0));
    }
}

#[test]
fn the_generation_role_shows_no_ladder() {
    let s = parse(
        r#"
name = "gen-role"
[policy]
preset = "legacy"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 2
max_num_tokens = 16384
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 2
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[workload]
kind = "closed_loop"
concurrency = 64
num_requests = 400
input_len = 1024
output_len = 64
warmup_requests = 1
[model]
profile = "llama3-8b-h100-bf16"
"#,
        &[],
    );
    let r = run(&s);
    let gen0 = r.servers.iter().find(|s| s.name == "gen0").unwrap();
    for k in &gen0.ranks {
        assert!((k.routing_share - 0.5).abs() < 0.02, "{:?}", gen0.ranks);
    }
}

/// A gen server at its cap of requests awaiting KV while others finish (§6): under the
/// legacy pad predicate a gen rank whose requests all await KV pads, a rank holding only
/// retiring requests does not and vetoes the forward, the dummy survives (legacy
/// rollback), and the next gather trips the cap check.
fn burst() -> Scenario {
    parse(
        r#"
name = "gen-burst"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 4
enable_attention_dp = true
max_batch_size = 4
max_num_tokens = 16384
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 2
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[workload]
kind = "closed_loop"
concurrency = 32
num_requests = 200
input_len = [512, 4096]
output_len = [2, 4]
[model]
profile = "llama3-8b-h100-bf16"
"#,
        &[],
    )
}

#[test]
fn the_legacy_pad_predicate_and_rollback_crash_a_gen_server_on_the_cap_check_and_fixed_completes() {
    let fixed = run(&burst());
    assert_eq!(fixed.requests.completed, 200);
    for preset in [
        &["policy.preset=\"legacy\""][..],
        &[
            "policy.pad.predicate=\"legacy\"",
            "policy.pad.rollback=false",
        ][..],
    ] {
        let mut s = burst();
        for set in preset {
            s.apply_set(set).unwrap();
        }
        let r = sim::run(&s, SimOptions::default()).unwrap();
        assert_eq!(
            r.outcome,
            Outcome::Crashed,
            "{preset:?}: {:?}",
            r.outcome_detail
        );
        let detail = r.outcome_detail.unwrap_or_default();
        // The numbers of the historical assert: M = 2 requests awaiting KV plus the
        // dummy that survived the vetoed iteration, over expected = M.
        assert!(
            detail.starts_with("server `gen0`: iteration ")
                && detail.contains(
                    "cap violated: admission count 3 exceeds expected 2 (active 2, dummy alive: true)"
                ),
            "{detail}"
        );
        // The requests the crashed server held fail with the crash; the others had
        // completed before it.
        assert!(
            r.requests.failed > 0 && r.requests.completed > 0,
            "{:?}",
            r.requests
        );
        for d in r.per_request.iter().filter(|d| d.failure().is_some()) {
            assert_eq!(
                d.failure(),
                Some("still open when the run ended (crashed)"),
                "{d:?}"
            );
        }
    }
    // The rollback alone prevents it.
    let mut s = burst();
    s.apply_set("policy.pad.predicate=\"legacy\"").unwrap();
    assert_eq!(run(&s).outcome, Outcome::Completed);
}
