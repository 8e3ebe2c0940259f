//! Nothing valid is refused and nothing servable fails (issue 29, item 7): the front
//! door sends a request only to a server that can run it.

mod common;

use common::parse;
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
        match &d.failure {
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
