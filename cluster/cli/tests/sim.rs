//! The simulator end to end: determinism, accounting in every example under both
//! policies, the binding case of §2 decided by the mechanism, and bad input.

use std::path::{Path, PathBuf};

use lockstep_plan::report::{Outcome, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_sim::{self as sim, SimOptions};

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
}

fn load(name: &str, sets: &[&str]) -> Scenario {
    let mut s = Scenario::load(&examples_dir().join(name)).expect("example loads");
    for set in sets {
        s.apply_set(set).expect("valid --set");
    }
    s
}

fn try_run(s: &Scenario, seed: u64) -> Result<Report, sim::SimError> {
    sim::run(
        s,
        SimOptions {
            seed,
            ..SimOptions::default()
        },
    )
}

fn run(s: &Scenario, seed: u64) -> Report {
    try_run(s, seed).expect("simulation starts")
}

#[test]
fn same_seed_and_input_give_an_identical_report() {
    for name in [
        "agg-balanced.toml",
        "agg-conversation.toml",
        "disagg-small.toml",
    ] {
        let s = load(name, &["workload.num_requests=150"]);
        let a = serde_json::to_string(&run(&s, 7).without_wall_time()).unwrap();
        let b = serde_json::to_string(&run(&s, 7).without_wall_time()).unwrap();
        assert_eq!(a, b, "{name}: two runs differ");
        let c = serde_json::to_string(&run(&s, 8).without_wall_time()).unwrap();
        if name == "agg-balanced.toml" {
            assert_ne!(a, c, "{name}: the seed must matter for a random workload");
        }
    }
}

/// What each example shows under the `legacy` preset, next to the same run under
/// `fixed` (README's examples table; mechanisms.md, legacy switches).
fn legacy_symptom(name: &str, legacy: &Report, fixed: &Report) {
    let (l, f) = (&legacy.servers, &fixed.servers);
    let survived = |s: &lockstep_plan::report::ServerReport| {
        s.violations
            .iter()
            .all(|v| v.kind.name() == "dummy_survived")
            && s.violation_count > 0
    };
    match name {
        // The binding case: ranks holding only retiring requests veto every other
        // forward, and the ranks schedule half as much per iteration.
        "agg-dp2-binding.toml" => {
            assert!(
                l[0].vetoed_iterations * 2 + 2 >= l[0].iterations,
                "{:?}",
                l[0]
            );
            assert!(f[0].vetoed_iterations <= 2, "{:?}", f[0]);
            assert!(
                l[0].scheduled_per_iteration < 0.6 * f[0].scheduled_per_iteration,
                "{} vs {}",
                l[0].scheduled_per_iteration,
                f[0].scheduled_per_iteration
            );
        }
        // The ctx-only benchmark (a warm-up, then every client at once through the
        // front door): vetoes, rank 0 starved towards the rung 1/7 of the routing
        // share, lower occupancy and a longer run.
        "ctx-only.toml" => {
            assert!(
                l[0].vetoed_iterations > 3 * f[0].vetoed_iterations,
                "{:?}",
                l[0]
            );
            let min_share = |s: &lockstep_plan::report::ServerReport| {
                s.ranks.iter().map(|k| k.routing_share).fold(1.0, f64::min)
            };
            assert!(
                min_share(&l[0]) < 0.2 && min_share(&f[0]) > 0.23,
                "{:?} vs {:?}",
                l[0].ranks,
                f[0].ranks
            );
            assert!(l[0].occupancy < 0.9 * f[0].occupancy);
            assert!(legacy.virtual_time_s > 1.05 * fixed.virtual_time_s);
            assert!(l[0].deferred_batches > 0 && f[0].deferred_batches == 0);
        }
        // Disaggregated: the ctx server's rederived index pool (pp·B + 1 < 2B) defers
        // admitted prefills; the gen server's vetoed dummies survive.
        "disagg-small.toml" | "disagg-8k1k-con4096.toml" => {
            assert!(
                l[0].deferrals.no_free_index_slot > 0,
                "{:?}",
                l[0].deferrals
            );
            assert_eq!(f[0].deferrals.no_free_index_slot, 0);
            assert!(survived(&l[1]), "{:?}", l[1].violations);
        }
        // The skewed deployment runs under legacy (refused under fixed, checked by the
        // caller) and vetoes a third of its iterations.
        "legacy-skew.toml" => {
            assert!(l[0].vetoed_iterations * 3 > l[0].iterations, "{:?}", l[0]);
        }
        // Everywhere else: a vetoed iteration's dummy survives (no rollback) and the
        // skipped forwards leave deferred batches.
        _ => {
            assert!(survived(&l[0]), "{name}: {:?}", l[0].violations);
            assert!(l[0].deferred_batches > 0, "{name}");
            assert_eq!(f[0].deferred_batches, 0, "{name}");
        }
    }
}

#[test]
fn every_example_completes_under_fixed_and_shows_its_defect_under_legacy() {
    let mut names: Vec<String> = std::fs::read_dir(examples_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    names.sort();
    assert_eq!(
        names.len(),
        11,
        "a new example needs its legacy symptom: {names:?}"
    );
    for name in &names {
        // The production-shaped benchmark is run in release by the benchmark, not here.
        let n = if name.starts_with("disagg-8k1k") {
            "40"
        } else {
            "120"
        };
        let with = |preset: &str| {
            let mut s = load(name, &[&format!("workload.num_requests={n}")]);
            s.apply_set(&format!("policy.preset=\"{preset}\"")).unwrap();
            s
        };
        let legacy = run(&with("legacy"), 0);
        // Every legacy defect the examples show is a cost, not a failure.
        assert_eq!(
            legacy.outcome,
            Outcome::Completed,
            "{name}: {:?}",
            legacy.outcome_detail
        );
        assert_eq!(
            legacy.requests.failed, 0,
            "{name}: {:?}",
            legacy.per_request
        );
        assert_eq!(
            legacy.requests.completed, legacy.requests.submitted,
            "{name}"
        );
        if name == "legacy-skew.toml" {
            let e = try_run(&with("fixed"), 0)
                .expect_err("the fixed policy refuses a seat skew at startup")
                .to_string();
            assert!(
                e.contains("kv_index_pool admits 5 sequences but seats (max_num_sequences) = 8"),
                "{e}"
            );
            legacy_symptom(name, &legacy, &legacy);
            continue;
        }
        let fixed = run(&with("fixed"), 0);
        assert_eq!(
            fixed.outcome,
            Outcome::Completed,
            "{name}: {:?}",
            fixed.outcome_detail
        );
        assert_eq!(
            fixed.requests.failed, 0,
            "{name}: nothing fails under the fixed policy"
        );
        assert_eq!(fixed.requests.completed, fixed.requests.submitted, "{name}");
        for srv in &fixed.servers {
            assert_eq!(
                srv.violation_count, 0,
                "{name}/{}: {:?}",
                srv.name, srv.violations
            );
        }
        // Same requests, same lengths under both presets.
        let lengths = |r: &Report| -> Vec<(u64, u32)> {
            r.per_request
                .iter()
                .map(|d| (d.id, d.output_tokens))
                .collect()
        };
        assert_eq!(lengths(&legacy), lengths(&fixed), "{name}");
        legacy_symptom(name, &legacy, &fixed);
    }
}

/// Real requests per rank per iteration over all iterations (not only forward ones).
fn per_iteration(r: &Report) -> f64 {
    let s = &r.servers[0];
    s.mean_scheduled_requests * s.forward_iterations as f64 / s.iterations as f64
}

#[test]
fn fixed_policy_keeps_every_seat_busy_in_the_binding_case_and_legacy_does_not() {
    // dp=2, B=2, overlap, output length 1, concurrency far above capacity.
    let base = ["workload.num_requests=400", "workload.concurrency=64"];
    let fixed = run(&load("agg-dp2-binding.toml", &base), 0);
    let s = &fixed.servers[0];
    assert_eq!(s.dp, 2);
    assert_eq!(s.max_batch_size, 2);
    // Every iteration but the first (nothing launched yet) and the one that reads the
    // client's shutdown runs B.
    assert!(s.iterations - s.forward_iterations <= 2, "{s:?}");
    assert!(
        (s.mean_scheduled_requests - 2.0).abs() < 0.02,
        "{}",
        s.mean_scheduled_requests
    );
    assert!((s.ranks[0].routing_share - s.ranks[1].routing_share).abs() < 0.01);
    assert!(per_iteration(&fixed) > 1.95);

    let legacy = run(
        &load(
            "agg-dp2-binding.toml",
            &[base[0], base[1], "policy.preset=\"legacy\""],
        ),
        0,
    );
    // Retiring requests are charged: every other iteration admits nothing and, with the
    // legacy pad predicate, the ranks holding only retiring requests veto the forward.
    let l = &legacy.servers[0];
    assert!(l.vetoed_iterations * 3 > l.iterations, "{l:?}");
    assert!(per_iteration(&legacy) < 1.2, "{}", per_iteration(&legacy));

    let mut charge_only = load("agg-dp2-binding.toml", &base);
    charge_only
        .apply_set("policy.admission.charge_retiring=true")
        .unwrap();
    let c = run(&charge_only, 0);
    // Alone, the admission defect pads the starved iterations with dummies instead: about
    // every other forward runs dummies only.
    let cs = &c.servers[0];
    assert!(cs.mean_scheduled_requests < 1.2, "{cs:?}");
    assert!(
        cs.ranks[0].dummy_iterations * 2 + 4 >= cs.forward_iterations,
        "{cs:?}"
    );
    assert!(c.virtual_time_s > fixed.virtual_time_s);
}

#[test]
fn a_trace_error_names_the_line() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("bad.jsonl"),
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [1]}\n\
         {\"timestamp\": 5, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [2]}\n",
    )
    .unwrap();
    let text = r#"
[[server]]
name = "agg0"
tensor_parallel_size = 2
max_batch_size = 4
[workload]
kind = "trace"
[workload.trace]
path = "bad.jsonl"
format = "mooncake"
"#;
    std::fs::write(dir.join("s.toml"), text).unwrap();
    let s = Scenario::load(&dir.join("s.toml")).unwrap();
    let e = try_run(&s, 0).expect_err("bad trace refused").to_string();
    assert!(
        e.contains("bad.jsonl:2") && e.contains("output_length"),
        "{e}"
    );
}

#[test]
fn bad_workload_values_name_the_key() {
    let mut s = load("agg-balanced.toml", &[]);
    s.apply_set("workload.rate=-1.0").unwrap();
    let e = try_run(&s, 0).expect_err("refused").to_string();
    assert!(e.contains("rate") && e.contains("-1"), "{e}");
    let mut s = load("agg-balanced.toml", &[]);
    let e = s.apply_set("workload.rat=3").unwrap_err().to_string();
    assert!(e.contains("rat"), "{e}");
}

#[test]
fn the_iteration_log_has_one_line_per_server_iteration_and_rank() {
    let s = load("agg-dp2-binding.toml", &["workload.num_requests=20"]);
    let mut log = Vec::new();
    let r = sim::run(
        &s,
        SimOptions {
            iter_log: Some(&mut log),
            ..SimOptions::default()
        },
    )
    .unwrap();
    let text = String::from_utf8(log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as u64, r.servers[0].iterations * 2);
    for key in [
        "iteration",
        "rank",
        "num_scheduled_requests",
        "num_ctx_requests",
        "num_ctx_tokens",
        "num_gen_requests",
        "live",
        "routable",
        "retiring",
        "kv_blocks_used",
        "kv_blocks_free",
        "seats_used",
        "deferrals_no_free_index_slot",
        "dummy_added",
        "dummy_committed",
        "dummy_rolled_back",
        "currank_total_requests",
        "host_ns",
        "forward_ns",
    ] {
        assert!(lines[0].get(key).is_some(), "missing {key}");
    }
    // And the values: dp 2, B 2, 20 requests of 1,024 prompt tokens and one output
    // token each, 32-token blocks, 65,536 KV tokens a rank.
    let u = |l: &serde_json::Value, k: &str| l[k].as_u64().unwrap_or_else(|| panic!("{k}: {l}"));
    for (i, pair) in lines.chunks(2).enumerate() {
        assert_eq!(
            (u(&pair[0], "iteration"), u(&pair[0], "rank")),
            (i as u64, 0)
        );
        assert_eq!(
            (u(&pair[1], "iteration"), u(&pair[1], "rank")),
            (i as u64, 1)
        );
        assert_eq!(pair[0]["forward_ran"], pair[1]["forward_ran"]);
        assert_eq!(pair[0]["time_ns"], pair[1]["time_ns"]);
    }
    let forward: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l["forward_ran"] == true).collect();
    let total = |k: &str| forward.iter().map(|l| u(l, k)).sum::<u64>();
    // Each request ran exactly one step, its whole prompt, and sampled its one token.
    assert_eq!(total("num_scheduled_requests"), 20);
    assert_eq!(total("num_ctx_requests"), 20);
    assert_eq!(total("num_gen_requests"), 0);
    assert_eq!(total("num_ctx_tokens"), 20 * 1024);
    for l in &lines {
        assert_eq!(u(l, "kv_blocks_used") + u(l, "kv_blocks_free"), 2048, "{l}");
        assert!(u(l, "num_scheduled_requests") <= 2, "B exceeded: {l}");
        assert!(u(l, "seats_used") <= 4, "{l}");
        assert!(u(l, "routable") + u(l, "retiring") <= u(l, "live"), "{l}");
        assert_eq!(u(l, "forward_ns") > 0, l["forward_ran"] == true, "{l}");
        // A forward of two 1,024-token prompts holds 2 * 32 blocks until they retire.
        if u(l, "num_ctx_requests") == 2 && l["forward_ran"] == true {
            assert!(u(l, "kv_blocks_used") >= 64, "{l}");
        }
    }
    // The routed counts end at each rank's share of the 20.
    let routed: Vec<&str> = lines[lines.len() - 2..]
        .iter()
        .map(|l| l["currank_total_requests"].as_str().unwrap())
        .collect();
    assert_eq!(
        routed,
        [
            format!("{}/20", r.servers[0].ranks[0].routed_requests),
            format!("{}/20", r.servers[0].ranks[1].routed_requests)
        ]
    );
    // The server drains: the last iteration holds nothing.
    for l in &lines[lines.len() - 2..] {
        assert_eq!(
            (u(l, "live"), u(l, "kv_blocks_used"), u(l, "seats_used")),
            (0, 0, 0)
        );
    }
}

#[test]
fn disaggregated_runs_move_kv_and_report_transfers() {
    let s = load("disagg-small.toml", &["workload.num_requests=100"]);
    let r = run(&s, 0);
    assert_eq!(r.requests.completed, 100);
    let ctx = r.servers.iter().find(|s| s.role == "ctx").unwrap();
    let generation = r.servers.iter().find(|s| s.role == "gen").unwrap();
    assert_eq!(generation.transfers.count, 100);
    assert!(generation.transfers.bytes > 0 && generation.transfers.mean_ms > 0.0);
    assert_eq!(ctx.transfers.count, 100);
    assert!(r.latency_ms.tpot.mean > 0.0);
}

#[test]
fn a_lost_transfer_times_out_and_fails_only_that_request() {
    let mut s = load(
        "disagg-small.toml",
        &[
            "workload.num_requests=100",
            "server.gen0.cache_transceiver_config.kv_transfer_timeout_ms=500",
        ],
    );
    s.faults.lost_transfer_every = Some(10);
    let r = run(&s, 0);
    assert_eq!(r.outcome, Outcome::Incomplete, "{:?}", r.outcome_detail);
    assert_eq!(
        r.outcome_detail.as_deref(),
        Some("10 of 100 requests did not complete (10 transfer_timeout)")
    );
    assert_eq!(r.requests.submitted, 100);
    assert_eq!(r.requests.failed, 10, "every 10th of 100 transfers is lost");
    assert_eq!(r.requests.completed, 90);
    let failed: Vec<_> = r
        .per_request
        .iter()
        .filter(|d| d.failure().is_some())
        .collect();
    assert!(
        failed
            .iter()
            .all(|d| d.failure().unwrap().contains("timed out after 500 ms")),
        "{failed:?}"
    );
    for srv in &r.servers {
        assert_eq!(srv.transfers.timeouts, 10, "{}", srv.name);
        // KV freed on both sides: the end-of-iteration leak and conservation checks hold.
        assert_eq!(srv.violation_count, 0, "{}: {:?}", srv.name, srv.violations);
        assert_eq!(srv.kv.used_blocks_at_end, 0, "{}", srv.name);
    }
    let lost: u64 = r.servers.iter().map(|s| s.transfers.lost).sum();
    assert_eq!(lost, 10);
}

#[test]
fn disaggregated_serving_streams_as_many_tokens_as_aggregated_serving_along_its_own_path() {
    let workload = r#"
[workload]
kind = "closed_loop"
concurrency = 32
num_requests = 120
input_len = [64, 1500]
output_len = [1, 60]
"#;
    let agg = format!(
        r#"
[[server]]
name = "agg0"
tensor_parallel_size = 2
max_batch_size = 16
max_num_tokens = 4096
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
{workload}"#
    );
    let disagg = format!(
        r#"
[[server]]
name = "ctx0"
role = "ctx"
tensor_parallel_size = 2
max_batch_size = 4
max_num_tokens = 4096
disable_overlap_scheduler = true
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[[server]]
name = "gen0"
role = "gen"
tensor_parallel_size = 2
max_batch_size = 16
max_num_tokens = 1024
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
{workload}"#
    );
    let a = run(&Scenario::parse(&agg, "agg").unwrap(), 5);
    let d = run(&Scenario::parse(&disagg, "disagg").unwrap(), 5);
    assert_eq!(a.requests.completed, 120);
    assert_eq!(d.requests.completed, 120);
    // Same ids, same token counts, completed alike: nothing lost or duplicated.
    let lengths = |r: &Report| -> Vec<(u64, u32, bool)> {
        r.per_request
            .iter()
            .map(|x| (x.id, x.output_tokens, x.failure().is_none()))
            .collect()
    };
    assert_eq!(lengths(&a), lengths(&d));
    // The streams themselves prove where they were computed (an aggregated rank and
    // iteration, or a ctx rank): they differ request by request.
    let same = a
        .per_request
        .iter()
        .zip(&d.per_request)
        .filter(|(x, y)| x.token_digest == y.token_digest)
        .count();
    assert_eq!(same, 0, "{same} streams did not depend on their path");
}

#[test]
fn generation_first_holds_each_prefill_until_its_gen_peer_is_named() {
    // One request at a time and a slow control link (50 ms): TTFT is the prefill plus,
    // in generation-first mode, the notice naming the gen peer.
    let base = load(
        "disagg-small.toml",
        &[
            "workload.num_requests=40",
            "workload.concurrency=1",
            "model.link.latency_us=50000",
        ],
    );
    let mut first = base.clone();
    first
        .apply_set("server.ctx0.cache_transceiver_config.generation_first=true")
        .unwrap();
    let b = run(&base, 3);
    let f = run(&first, 3);
    assert_eq!(b.requests.completed, 40);
    assert_eq!(f.requests.completed, 40, "{:?}", f.outcome_detail);
    let ctx = |r: &Report| r.servers.iter().find(|s| s.name == "ctx0").unwrap().clone();
    // Every request waited in DISAGG_CONTEXT_WAIT_SCHEDULER and was promoted once.
    assert_eq!(ctx(&f).transfers.generation_first_promoted, 40);
    assert_eq!(ctx(&b).transfers.generation_first_promoted, 0);
    // The wait is real: each first token comes at least one link latency later.
    let (tb, tf) = (b.latency_ms.ttft.mean, f.latency_ms.ttft.mean);
    assert!(tf >= tb + 50.0, "mean ttft {tf} ms vs {tb} ms");
    // Nothing lost or duplicated: the same tokens for every request.
    assert_eq!(b.per_request, f.per_request);
}

#[test]
fn gne_count_transfers_on_a_gen_server_is_dormant_because_routing_already_counts_transfers() {
    // A gen server whose ranks hold receives in flight next to decoding requests. The
    // legacy switch charges in-transfer requests to GUARANTEED_NO_EVICT's request cap;
    // the scheduler-level control (tests/legacy_controls.rs) shows that it takes slots.
    // End to end it cannot: §2's routable count includes in-transfer requests, so the
    // router never places more than M on a rank and decoders + transfers <= M already.
    let base = load(
        "disagg-small.toml",
        &[
            "workload.num_requests=300",
            "server.gen0.max_batch_size=8",
            "server.gen0.cache_transceiver_config.max_tokens_in_buffer=65536",
        ],
    );
    let mut legacy = base.clone();
    legacy
        .apply_set("policy.gne.count_transfers_as_requests=true")
        .unwrap();
    let f = run(&base, 11);
    let l = run(&legacy, 11);
    assert_eq!(f.requests.completed, 300);
    assert_eq!(l.requests.completed, 300);
    assert_eq!(
        l.legacy_switches,
        vec!["gne.count_transfers_as_requests".to_string()]
    );
    let gen_server = |r: &Report| r.servers.iter().find(|s| s.name == "gen0").unwrap().clone();
    // Not vacuous: receives overlapped on a rank while others decoded.
    assert!(gen_server(&f).transfers.max_receives_in_flight >= 2);
    assert_eq!(gen_server(&f).iterations, gen_server(&l).iterations);
    assert_eq!(f.per_request, l.per_request);
    assert_eq!(f.virtual_time_s, l.virtual_time_s);
}

fn two_servers(policy: &str) -> Scenario {
    let text = format!(
        r#"
[front]
policy = "{policy}"
[[server]]
name = "big"
tensor_parallel_size = 2
max_batch_size = 16
max_num_tokens = 8192
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[[server]]
name = "small"
tensor_parallel_size = 2
max_batch_size = 2
max_num_tokens = 8192
[server.kv_cache_config]
tokens_per_block = 32
max_tokens = 262144
[workload]
kind = "closed_loop"
concurrency = 24
num_requests = 240
input_len = [256, 1024]
output_len = [16, 64]
think_time_ms = 50.0
[workload.conversation]
rounds = [3, 5]
new_tokens_per_round = [32, 128]
"#
    );
    Scenario::parse(&text, policy).unwrap()
}

fn routed(r: &Report, server: &str) -> u64 {
    r.servers
        .iter()
        .find(|s| s.name == server)
        .unwrap()
        .ranks
        .iter()
        .map(|k| k.routed_requests)
        .sum()
}

#[test]
fn the_front_door_policies_pick_servers_as_named() {
    let rr = run(&two_servers("round_robin"), 0);
    let lb = run(&two_servers("load_balancing"), 0);
    let kv = run(&two_servers("kv_aware"), 0);
    for r in [&rr, &lb, &kv] {
        assert_eq!(r.requests.completed, 240);
    }
    assert_eq!(
        routed(&rr, "big"),
        routed(&rr, "small"),
        "round robin alternates"
    );
    // The small server drains slower, so the fewest-live policy sends it less.
    assert!(
        routed(&lb, "big") > routed(&lb, "small") + 20,
        "{} / {}",
        routed(&lb, "big"),
        routed(&lb, "small")
    );
    // Conversation rounds go where their prefix is cached: more reuse than round robin.
    let hits = |r: &Report| r.servers.iter().map(|s| s.kv.reuse_hits).sum::<u64>();
    assert!(
        hits(&kv) > hits(&rr),
        "kv_aware {} vs round robin {}",
        hits(&kv),
        hits(&rr)
    );
}

#[test]
fn a_transfer_that_never_ends_makes_the_run_deadlocked_with_every_rank_state() {
    let mut s = load("disagg-small.toml", &["workload.num_requests=30"]);
    s.faults.lost_transfer_every = Some(7);
    s.faults.timeouts_lost = true;
    let r = run(&s, 0);
    assert_eq!(r.outcome, Outcome::Deadlocked);
    let detail = r.outcome_detail.unwrap();
    assert!(detail.contains("no event can make progress"), "{detail}");
    assert!(
        detail.contains("server `gen0`") && detail.contains("rank 0"),
        "{detail}"
    );
    // What was held fails with the outcome, and only that: every failure names the
    // deadlock or the lost transfer (whose timeout never fires here).
    assert!(r.requests.failed >= 1);
    for d in r.per_request.iter().filter(|d| d.failure().is_some()) {
        let why = d.failure().unwrap();
        assert!(why.contains("deadlocked"), "{d:?}");
    }
    assert!(
        r.per_request
            .iter()
            .filter_map(|d| d.failure())
            .any(|f| f.contains("deadlocked"))
    );
}
