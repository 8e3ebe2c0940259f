//! The scenario parser, `--set` and the run's startup checks never panic, hang or
//! allocate without bound on bad input: property tests on stable (CI runs them). The
//! inputs are scenario-shaped — real keys with values drawn from the edges (zero,
//! negative, huge, NaN, wrong types), stray keys and tables, broken TOML — because
//! random bytes rarely get past the TOML grammar. (The trace parsers have their own
//! properties in `cluster/plan/src/workload/tests.rs`.)

use lockstep_plan::fleet::Fleet;
use lockstep_plan::scenario::Scenario;
use proptest::prelude::*;

/// A TOML value from the edges.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1".to_string()),
        Just("2".to_string()),
        Just("1073741824".to_string()),
        Just("9223372036854775807".to_string()),
        Just("-9223372036854775808".to_string()),
        Just("nan".to_string()),
        Just("inf".to_string()),
        Just("-0.5".to_string()),
        Just("1e300".to_string()),
        Just("true".to_string()),
        Just("\"\"".to_string()),
        Just("\"agg\"".to_string()),
        Just("\"gen\"".to_string()),
        Just("\"closed_loop\"".to_string()),
        Just("\"open_loop\"".to_string()),
        Just("\"trace\"".to_string()),
        Just("\"kv_aware\"".to_string()),
        Just("\"MAX_UTILIZATION\"".to_string()),
        Just("[1, 0]".to_string()),
        Just("[5, 10]".to_string()),
        Just("[]".to_string()),
        (1i64..100_000).prop_map(|v| v.to_string()),
        "[a-z_\"]{0,8}".prop_map(|v| format!("\"{v}\"")),
    ]
}

const SERVER_KEYS: &[&str] = &[
    "name",
    "role",
    "ranks",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "enable_attention_dp",
    "max_batch_size",
    "max_num_tokens",
    "disable_overlap_scheduler",
    "enable_chunked_prefill",
    "max_draft_len",
    "kv_cache_config.tokens_per_block",
    "kv_cache_config.max_tokens",
    "kv_cache_config.enable_block_reuse",
    "scheduler_config.capacity_scheduler_policy",
    "attention_dp_config.router",
    "cache_transceiver_config.max_tokens_in_buffer",
    "cache_transceiver_config.kv_transfer_timeout_ms",
    "cache_transceiver_config.generation_first",
    "no_such_key",
];

const WORKLOAD_KEYS: &[&str] = &[
    "kind",
    "num_requests",
    "concurrency",
    "rate",
    "input_len",
    "output_len",
    "think_time_ms",
    "shared_prefix_tokens",
    "warmup_requests",
    "ramp_s",
    "seed",
    "conversation.rounds",
    "conversation.new_tokens_per_round",
    "trace.path",
    "trace.format",
    "trace.time_scale",
    "bogus",
];

const OTHER_KEYS: &[&str] = &[
    "policy.preset",
    "policy.pad.rollback",
    "policy.idle.predicate",
    "model.profile",
    "model.coefficients.forward_base_ns",
    "model.link.bandwidth_gb_per_s",
    "front.policy",
    "faults.lost_transfer_every",
    "faults.timeouts_lost",
    "seed",
];

/// A scenario file: a sound base with some keys overwritten by edge values.
fn scenario_text() -> impl Strategy<Value = String> {
    (
        prop::collection::vec((0..SERVER_KEYS.len(), value()), 0..4),
        prop::collection::vec((0..WORKLOAD_KEYS.len(), value()), 0..4),
        prop::collection::vec((0..OTHER_KEYS.len(), value()), 0..3),
        any::<bool>(),
    )
        .prop_map(|(server, workload, other, garble)| {
            let mut t = String::from("name = \"fuzz\"\n");
            for (k, v) in other {
                // Dotted keys at the top level are valid TOML and reach every table.
                t.push_str(&format!("{} = {v}\n", OTHER_KEYS[k]));
            }
            t.push_str(
                "[[server]]\nname = \"agg0\"\ntensor_parallel_size = 2\nenable_attention_dp = true\nmax_batch_size = 4\nmax_num_tokens = 2048\n",
            );
            for (k, v) in server {
                t.push_str(&format!("{} = {v}\n", SERVER_KEYS[k]));
            }
            t.push_str("[workload]\nkind = \"closed_loop\"\nconcurrency = 4\nnum_requests = 8\n");
            for (k, v) in workload {
                t.push_str(&format!("{} = {v}\n", WORKLOAD_KEYS[k]));
            }
            if garble {
                t.push_str("[[server\n= =\n");
            }
            t
        })
}

/// What `validate` and every driver check before a run, within a time bound.
fn check(text: &str, sets: &[String]) -> Result<(), String> {
    let mut s = Scenario::parse(text, "fuzz").map_err(|e| e.to_string())?;
    for set in sets {
        s.apply_set(set).map_err(|e| e.to_string())?;
    }
    let fleet = Fleet::plan(&s, 0).map_err(|e| e.to_string())?;
    fleet.workload().map_err(|e| e.to_string())?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn scenario_files_and_sets_are_accepted_or_refused_with_a_message_never_a_panic(
        text in scenario_text(),
        sets in prop::collection::vec(
            (0..SERVER_KEYS.len() + WORKLOAD_KEYS.len(), value()).prop_map(|(k, v)| {
                if k < SERVER_KEYS.len() {
                    format!("server.{}={v}", SERVER_KEYS[k])
                } else {
                    format!("workload.{}={v}", WORKLOAD_KEYS[k - SERVER_KEYS.len()])
                }
            }),
            0..3,
        ),
        stray_set in "[a-z.=\"\\[\\]0-9 ]{0,20}",
    ) {
        let mut all = sets.clone();
        all.push(stray_set);
        for sets in [&sets[..], &all[..]] {
            if let Err(message) = check(&text, sets) {
                // A refusal says something.
                prop_assert!(!message.trim().is_empty());
            }
        }
    }
}
