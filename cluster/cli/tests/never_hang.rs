//! The fixed policy never hangs: the four deadlock causes random scenarios found, one
//! test per rule, each on a scenario of one or two requests (mechanisms.md §4, §6).
//! Each scenario ends `deadlocked` without its rule (checked by removing it; for the
//! dummy the legacy pad predicate keeps the historical order and is the control).

mod common;

use common::parse;
use lockstep_plan::report::{Outcome, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, SimOptions};

fn run(s: &Scenario) -> Report {
    sim::run(
        s,
        SimOptions {
            stall_bound_ns: 1_000_000_000,
            ..SimOptions::default()
        },
    )
    .expect("the simulation starts")
}

fn completed(r: &Report) {
    assert_eq!(r.outcome, Outcome::Completed, "{:?}", r.outcome_detail);
    assert_eq!(r.requests.failed, 0, "{:?}", r.per_request);
}

/// A: with chunked prefill a chunk is a whole number of KV blocks, so a token budget
/// below one block is refused at startup, naming both numbers.
#[test]
fn a_chunk_budget_below_one_kv_block_is_refused_at_startup_naming_both_numbers() {
    let s = parse(
        r#"
name = "a"
[[server]]
name = "agg0"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 2
max_num_tokens = 8
enable_chunked_prefill = true
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 4096
[workload]
kind = "closed_loop"
concurrency = 1
num_requests = 1
input_len = 64
output_len = 4
"#,
        &[],
    );
    let e = sim::run(&s, SimOptions::default())
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("max_num_tokens = 8") && e.contains("tokens_per_block = 16"),
        "{e}"
    );
}

/// B: a gen rank holding only a request that waits for its KV must pad (its peer runs),
/// but the dummy takes its KV after the real requests took theirs, so the request's
/// blocks to completion (exactly the rank's KV here) still fit.
fn dummy_and_gen_init() -> Scenario {
    parse(
        r#"
name = "b"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 1
max_batch_size = 2
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 4096
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 2
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 64
[workload]
kind = "closed_loop"
concurrency = 2
num_requests = 2
input_len = 32
output_len = 32
[model]
profile = "llama3-8b-h100-bf16"
"#,
        &[],
    )
}

#[test]
fn b_a_dummy_never_takes_the_kv_a_request_on_its_rank_needs() {
    let r = run(&dummy_and_gen_init());
    completed(&r);
    // The control: the legacy predicate pads before scheduling, as historically, and
    // the dummy's block keeps both requests from ever being admitted.
    let mut s = dummy_and_gen_init();
    s.apply_set("policy.pad.predicate=\"legacy\"").unwrap();
    let l = run(&s);
    assert_eq!(l.outcome, Outcome::Deadlocked, "{:?}", l.outcome_detail);
    assert!(
        l.outcome_detail
            .unwrap_or_default()
            .contains("states {8: 1}"),
        "both wait in DISAGG_GENERATION_INIT"
    );
}

/// C: on a gen server, GUARANTEED_NO_EVICT keeps the blocks to completion of a request
/// whose KV is still arriving reserved, so a second request is not admitted into blocks
/// the first will need to decode (a slow link keeps the first receiving).
#[test]
fn c_a_request_receiving_its_kv_keeps_its_blocks_to_completion_reserved() {
    let s = parse(
        r#"
name = "c"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 1
max_batch_size = 1
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 4096
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 1
max_batch_size = 2
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 96
[workload]
kind = "closed_loop"
concurrency = 2
num_requests = 2
input_len = 32
output_len = 32
[model]
profile = "llama3-8b-h100-bf16"
[model.link]
bandwidth_gb_per_s = 0.01
"#,
        &[],
    );
    let r = run(&s);
    completed(&r);
    let gen0 = r.servers.iter().find(|s| s.name == "gen0").unwrap();
    assert_eq!(gen0.deferrals.out_of_blocks, 0, "nothing over-committed");
}

/// D: MAX_UTILIZATION pauses a request by resetting it to a context of its prompt and
/// what it generated; without chunked prefill a request whose recompute could exceed
/// `max_num_tokens` would block the head of the queue forever after a pause. Such a
/// request is never chosen to pause: its blocks to completion stay reserved, as
/// GUARANTEED_NO_EVICT reserves them, and it runs (it used to be refused, and a workload
/// of only such requests refused at startup).
#[test]
fn d_a_request_whose_recompute_could_not_fit_one_forward_is_never_paused() {
    let text = r#"
name = "d"
[[server]]
name = "agg0"
tensor_parallel_size = 1
max_batch_size = 2
max_num_tokens = 100
[server.scheduler_config]
capacity_scheduler_policy = "MAX_UTILIZATION"
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 160
[workload]
kind = "closed_loop"
concurrency = 2
num_requests = 40
input_len = [30, 70]
output_len = 40
[model]
profile = "llama3-8b-h100-bf16"
"#;
    completed(&run(&parse(text, &[])));
    // With chunked prefill every recompute can run: requests are paused as before.
    completed(&run(&parse(text, &["server.enable_chunked_prefill=true"])));
    // Only requests that cannot be paused: none is, and none deadlocks.
    let r = run(&parse(text, &["workload.input_len=70"]));
    completed(&r);
    assert_eq!(r.servers[0].preemptions, 0);
}

/// Found by the swarm (seed 293): in generation-first mode the front's notice naming the
/// gen peer crosses the link between servers while the request crosses the front's
/// link; when the control link is slower the notice arrives first. A notice for a
/// request not accepted yet is remembered (replicated), so the request arrives ready
/// instead of waiting in DISAGG_CONTEXT_WAIT_SCHEDULER forever.
#[test]
fn e_a_generation_first_notice_that_overtakes_its_request_is_remembered() {
    let s = parse(
        r#"
name = "e"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 1
max_batch_size = 1
max_num_tokens = 64
disable_overlap_scheduler = true
[server.cache_transceiver_config]
generation_first = true
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 640
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 1
max_batch_size = 1
max_num_tokens = 64
disable_overlap_scheduler = true
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 608
[workload]
kind = "closed_loop"
concurrency = 1
num_requests = 3
input_len = 1
output_len = 2
[model.link]
latency_us = 22.0
control_latency_us = 89.0
"#,
        &[],
    );
    let r = run(&s);
    completed(&r);
    let ctx0 = &r.servers[0];
    assert_eq!(ctx0.transfers.generation_first_promoted, 3);
}

/// Found by the swarm (seed 333): STATIC_BATCH on a gen server formed a new batch while
/// the previous one was still receiving its KV, admitting more than the KV could finish.
/// Requests receiving their KV belong to the batch in progress and keep their blocks to
/// completion reserved.
#[test]
fn f_static_batch_waits_for_the_batch_still_receiving_its_kv() {
    let s = parse(
        r#"
name = "f"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 1
max_num_tokens = 64
disable_overlap_scheduler = true
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 1152
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 1
max_batch_size = 3
max_num_tokens = 3
disable_overlap_scheduler = true
[server.scheduler_config]
capacity_scheduler_policy = "STATIC_BATCH"
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 576
[workload]
kind = "closed_loop"
concurrency = 5
num_requests = 5
input_len = 1
output_len = 281
"#,
        &[],
    );
    completed(&run(&s));
}

/// A gen server whose queue is longer than the transfer timeout (one seat, 400-token
/// decodes, seven requests): a ctx rank's KV waits for its pull as long as the request
/// queues, and the transfer timeout counts only from the pull. The control: with the pull
/// bound at the transfer timeout (as when both counted from the send), the last request
/// fails although nothing was lost.
#[test]
fn g_a_request_queued_at_the_gen_server_longer_than_the_transfer_timeout_completes() {
    let scenario = |pull_timeout_ms: u64| {
        parse(
            &format!(
                r#"
name = "g"
[model]
profile = "deepseek-v3-h200-fp8-adp"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 1
max_batch_size = 3
max_num_tokens = 1
disable_overlap_scheduler = true
[server.kv_cache_config]
tokens_per_block = 64
max_tokens = 8192
[server.cache_transceiver_config]
kv_pull_timeout_ms = {pull_timeout_ms}
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 1
max_batch_size = 1
max_num_tokens = 1
disable_overlap_scheduler = true
[server.kv_cache_config]
tokens_per_block = 64
max_tokens = 704
[server.cache_transceiver_config]
kv_transfer_timeout_ms = 30000
[workload]
kind = "closed_loop"
concurrency = 7
num_requests = 7
input_len = 1
output_len = 400
"#
            ),
            &[],
        )
    };
    let r = run(&scenario(480_000));
    completed(&r);
    assert!(
        r.virtual_time_s > 35.0,
        "the last request queued longer than the 30 s transfer timeout: {} s",
        r.virtual_time_s
    );

    let control = run(&scenario(30_000));
    let failures: Vec<_> = control
        .per_request
        .iter()
        .filter_map(|d| d.failure().map(String::from))
        .collect();
    assert!(!failures.is_empty(), "the control fails a request");
    assert!(
        failures
            .iter()
            .all(|f| f.contains("kv not pulled within 30000 ms")),
        "{failures:?}"
    );
}
