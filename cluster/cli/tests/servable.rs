//! Nothing valid is refused and nothing servable fails (issue 29, items 7 and 8): the
//! front door sends a request only to a server that can run it, the MAX_UTILIZATION
//! recompute rule applies only where a pause can happen, and a run that completes
//! fewer requests than it submitted says so in its outcome and exit status.

mod common;

use std::process::Command;

use common::{parse, temp};
use lockstep_plan::report::{Outcome, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, SimOptions};

/// The simulator as `lockstep sim` runs it (seed 0, arrivals as the workload makes them).
fn simulate(s: &Scenario) -> Report {
    sim::run(s, SimOptions::default()).expect("the simulation starts")
}

fn completed_all(r: &Report) {
    assert_eq!(
        r.requests.completed, r.requests.submitted,
        "{:?}: {:?}",
        r.outcome_detail, r.per_request
    );
    assert_eq!(r.outcome, Outcome::Completed, "{:?}", r.outcome_detail);
    for s in &r.servers {
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

fn routed(r: &Report, server: &str) -> u64 {
    r.servers
        .iter()
        .find(|s| s.name == server)
        .expect("the server")
        .ranks
        .iter()
        .map(|k| k.routed_requests)
        .sum()
}

/// One `[[server]]` table: `(name, role, max_num_tokens, chunked prefill, KV tokens a
/// rank)`, 16-token blocks, B 4, one rank.
fn server(name: &str, role: &str, t: u32, chunked: bool, kv: u32) -> String {
    format!(
        r#"
[[server]]
name = "{name}"
role = "{role}"
max_batch_size = 4
max_num_tokens = {t}
enable_chunked_prefill = {chunked}
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = {kv}
"#
    )
}

fn fleet(policy: &str, servers: &[String], workload: &str) -> String {
    format!(
        "name = \"servable\"\n[front]\npolicy = \"{policy}\"\n{}\n[workload]\n{workload}\n",
        servers.concat()
    )
}

const MIXED: &str = r#"kind = "closed_loop"
concurrency = 8
num_requests = 60
input_len = [16, 400]
output_len = [1, 24]"#;

/// Item 7: an aggregated fleet whose servers differ in `max_num_tokens` (one without
/// chunked prefill) and in KV: every request has a server that can run it, and under
/// every front policy it goes there.
#[test]
fn a_heterogeneous_aggregated_fleet_routes_each_request_to_a_server_that_can_run_it() {
    for policy in ["round_robin", "load_balancing", "kv_aware"] {
        let text = fleet(
            policy,
            &[
                // Prompts up to 128 tokens, whatever their output.
                server("short", "agg", 128, false, 65536),
                // Any prompt, but at most 20 blocks (320 tokens) of KV a request.
                server("small_kv", "agg", 4096, true, 320),
                server("long", "agg", 4096, false, 65536),
            ],
            MIXED,
        );
        let r = simulate(&parse(&text, &[]));
        completed_all(&r);
        for name in ["short", "small_kv", "long"] {
            assert!(routed(&r, name) > 0, "{policy}: {name} took nothing");
        }
    }
}

/// Item 7, disaggregated: the ctx servers differ in `max_num_tokens`, the gen servers
/// in KV; the front picks a ctx server that can prefill the request and a gen server
/// that can hold it to completion (also when generation-first names the gen peer up
/// front).
#[test]
fn a_heterogeneous_disaggregated_fleet_routes_each_request_to_servers_that_can_run_it() {
    for generation_first in [false, true] {
        let text = fleet(
            "round_robin",
            &[
                server("ctx_short", "ctx", 128, false, 65536),
                server("ctx_long", "ctx", 4096, false, 65536),
                server("gen_small", "gen", 4096, false, 256),
                server("gen_big", "gen", 4096, false, 65536),
            ],
            MIXED,
        );
        let sets = [format!(
            "server.ctx_short.cache_transceiver_config.generation_first={generation_first}"
        )];
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let r = simulate(&parse(&text, &sets));
        completed_all(&r);
        for name in ["ctx_short", "ctx_long", "gen_small", "gen_big"] {
            assert!(routed(&r, name) > 0, "{name} took nothing");
        }
    }
}

/// Item 7: only a request no server can run is refused, with a reason naming the limit
/// of every server of the role.
#[test]
fn a_request_no_server_can_run_is_refused_naming_every_servers_limit() {
    let text = fleet(
        "round_robin",
        &[
            server("short", "agg", 128, false, 65536),
            server("mid", "agg", 256, false, 65536),
        ],
        MIXED,
    );
    let r = simulate(&parse(&text, &[]));
    assert!(r.requests.failed > 0, "some prompts are longer than 256");
    for d in &r.per_request {
        match d.failure() {
            None => assert!(d.prompt_tokens <= 256, "{d:?}"),
            Some(why) => {
                assert!(d.prompt_tokens > 256, "{d:?}");
                assert!(
                    why.contains("server `short`")
                        && why.contains("max_num_tokens 128")
                        && why.contains("server `mid`")
                        && why.contains("max_num_tokens 256"),
                    "{why}"
                );
            }
        }
    }
}

/// Item 8: a ctx server only prefills, so a paused request there recomputes its prompt
/// alone: the recompute rule does not count `max_new_tokens` on it.
#[test]
fn a_ctx_server_under_max_utilization_is_not_refused_for_the_output_length() {
    let mut ctx = server("ctx0", "ctx", 128, false, 65536);
    ctx.push_str("[server.scheduler_config]\ncapacity_scheduler_policy = \"MAX_UTILIZATION\"\n");
    let text = fleet(
        "round_robin",
        &[ctx, server("gen0", "gen", 4096, true, 65536)],
        "kind = \"closed_loop\"\nconcurrency = 4\nnum_requests = 12\ninput_len = 100\noutput_len = 64",
    );
    completed_all(&simulate(&parse(&text, &[])));
}

/// Item 8: with one request a rank (B 1) a request's step never waits on another's
/// KV, so no pause is needed to make room: a recompute longer than `max_num_tokens`
/// is no reason to refuse it.
#[test]
fn a_batch_size_one_server_under_max_utilization_runs_every_request() {
    let mut agg = server("agg0", "agg", 100, false, 65536);
    agg = agg.replace("max_batch_size = 4", "max_batch_size = 1");
    agg.push_str("[server.scheduler_config]\ncapacity_scheduler_policy = \"MAX_UTILIZATION\"\n");
    let text = fleet(
        "round_robin",
        &[agg],
        "kind = \"closed_loop\"\nconcurrency = 2\nnum_requests = 10\ninput_len = [30, 70]\noutput_len = 40",
    );
    completed_all(&simulate(&parse(&text, &[])));
}

/// Item 8: a request whose recompute could not run is never chosen to pause; its
/// blocks to completion stay reserved instead (as GUARANTEED_NO_EVICT reserves them),
/// so two such requests that together exceed the rank's KV do not deadlock: the second
/// waits for the first. 10 blocks; each request needs 6 to complete (32 + 64 tokens)
/// and could recompute 95 > 64 tokens.
#[test]
fn requests_whose_recompute_cannot_run_are_never_paused_and_never_deadlock() {
    let mut agg = server("agg0", "agg", 64, false, 160);
    agg.push_str("[server.scheduler_config]\ncapacity_scheduler_policy = \"MAX_UTILIZATION\"\n");
    let text = fleet(
        "round_robin",
        &[agg],
        "kind = \"closed_loop\"\nconcurrency = 2\nnum_requests = 6\ninput_len = 32\noutput_len = 64",
    );
    let r = simulate(&parse(&text, &[]));
    completed_all(&r);
    assert_eq!(r.servers[0].preemptions, 0, "nothing could be paused");
}

/// Item 8: a gen server never prefills (a MAX_UTILIZATION pause aside, whose recompute
/// is checked where the pause is decided), so a token budget below one KV block with
/// chunked prefill is no reason to refuse it.
#[test]
fn a_gen_server_with_chunked_prefill_and_a_budget_below_one_block_runs() {
    for policy in ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] {
        let mut gen_server = server("gen0", "gen", 8, true, 640);
        gen_server.push_str(&format!(
            "[server.scheduler_config]\ncapacity_scheduler_policy = \"{policy}\"\n"
        ));
        let text = fleet(
            "round_robin",
            &[server("ctx0", "ctx", 4096, false, 65536), gen_server],
            "kind = \"closed_loop\"\nconcurrency = 4\nnum_requests = 16\ninput_len = [16, 100]\noutput_len = [2, 40]",
        );
        completed_all(&simulate(&parse(&text, &[])));
    }
}

/// Item 8: a run that completes fewer requests than it submitted says so: its outcome
/// is `incomplete` (with the count by kind) and `lockstep sim` exits 3.
#[test]
fn a_run_that_fails_requests_says_so_in_its_outcome_and_exit_status() {
    let text = fleet(
        "round_robin",
        &[server("agg0", "agg", 128, false, 65536)],
        "kind = \"closed_loop\"\nconcurrency = 2\nnum_requests = 2\ninput_len = [100, 300]\noutput_len = 4",
    );
    let path = temp("servable-incomplete.toml");
    std::fs::write(&path, &text).unwrap();
    let json = temp("servable-incomplete.json");
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["sim", path.to_str().unwrap(), "--json"])
        .arg(&json)
        .output()
        .expect("lockstep runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    // Both prompts are longer than the server's 128 tokens: 0 of 2 complete.
    assert_eq!(report.requests.completed, 0, "{:?}", report.requests);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert_eq!(report.outcome, Outcome::Incomplete);
    assert!(
        stdout.contains("outcome incomplete: 2 of 2 requests did not complete (2 refused)"),
        "{stdout}"
    );
}
