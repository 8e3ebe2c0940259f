//! `--model`: a real transformer behind the ranks. Every request's tokens equal the
//! same model's dense reference generation (no paging, no batching), so the paged
//! forward read the right blocks through the KV manager's block tables, under chunked
//! prefill, mixed batches, prefix reuse and dp 2; on a disaggregated fleet too, where
//! the gen rank decodes from the K/V its ctx rank computed and the transceiver moved;
//! and the simulator and the threads driver agree token for token, greedy and seeded.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{parse, real_options, threads_run};
use lockstep_gpu::model::{
    InitOptions, Model, SamplingParams, greedy_reference, write_random_model,
};
use lockstep_gpu::model_tokens::prompt_tokens;
use lockstep_plan::fleet::Fleet;
use lockstep_plan::model_backend::ModelBackend;
use lockstep_plan::report::{Outcome, Report};
use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;
use lockstep_sim::{self as sim, SimOptions};

/// dp 2, chunked prefill in chunks smaller than the longest prompt, a shared prefix of
/// 48 tokens (three blocks every request reuses once one computed them).
fn scenario(shared_prefix: u32, requests: u32) -> Scenario {
    fleet_scenario(&server_text("agg0", "agg"), shared_prefix, requests)
}

/// The same requests on a disaggregated fleet: a ctx server and a gen server, dp 2 each.
fn disagg_scenario(shared_prefix: u32, requests: u32) -> Scenario {
    let servers = server_text("ctx0", "ctx") + &server_text("gen0", "gen");
    fleet_scenario(&servers, shared_prefix, requests)
}

fn server_text(name: &str, role: &str) -> String {
    format!(
        r#"
[[server]]
name = "{name}"
role = "{role}"
tensor_parallel_size = 2
enable_attention_dp = true
max_batch_size = 6
max_num_tokens = 96
enable_chunked_prefill = true

[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 4096
enable_block_reuse = true
"#
    )
}

fn fleet_scenario(servers: &str, shared_prefix: u32, requests: u32) -> Scenario {
    parse(
        &format!(
            r#"
name = "model-runs"
{servers}

[workload]
kind = "open_loop"
rate = 1000.0
num_requests = {requests}
input_len = [50, 200]
output_len = [3, 12]
shared_prefix_tokens = {shared_prefix}
"#
        ),
        &[],
    )
}

fn tiny_model(name: &str) -> PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-model-runs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_random_model(
        &dir,
        &InitOptions {
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            vocab: 300,
            intermediate: 128,
            ..InitOptions::default()
        },
    )
    .expect("write the tiny model");
    dir
}

fn backend(dir: &Path, temperature: f32, seed: u64) -> ModelBackend {
    let params = SamplingParams {
        temperature,
        top_p: 0.9,
        top_k: 50,
        seed: 0,
    };
    ModelBackend::load(dir, params, seed).expect("load the tiny model")
}

fn sim_with(s: &Scenario, model: Option<ModelBackend>) -> Report {
    sim::run(
        s,
        SimOptions {
            preload: true,
            model,
            ..SimOptions::default()
        },
    )
    .expect("sim")
}

fn threads_with(s: &Scenario, model: ModelBackend) -> Report {
    threads_run(
        s,
        RealOptions {
            // The simulator's workload seed.
            seed: 0,
            preload: true,
            model: Some(model),
            ..real_options()
        },
    )
}

/// The digest the client folds over a stream of one token per response.
fn digest_of(tokens: &[u32]) -> u64 {
    let mut d = 0u64;
    for &t in tokens {
        d = lockstep_actors::kv::mix(d ^ (u64::from(t) << 32 | 1));
    }
    d
}

/// Per request id: (prompt tokens, output length), as the workload makes them.
fn requests_of(s: &Scenario) -> Vec<(u64, Vec<u32>, u32)> {
    let fleet = Fleet::plan(s, 0).expect("plan");
    let mut w = fleet.workload().expect("workload");
    let mut out = Vec::new();
    while let Some(a) = w.pop_due(u64::MAX) {
        out.push((
            a.spec.id.0,
            prompt_tokens(&a.spec, fleet.tokens_per_block, 300),
            a.spec.max_new_tokens,
        ));
    }
    out
}

fn digests(r: &Report) -> Vec<(u64, u64)> {
    let mut d: Vec<_> = r
        .per_request
        .iter()
        .map(|d| (d.id, d.token_digest))
        .collect();
    d.sort();
    d
}

#[test]
fn every_request_generates_the_dense_reference_tokens_in_the_simulator_and_on_threads() {
    let dir = tiny_model("greedy");
    let s = scenario(48, 16);
    let model = backend(&dir, 0.0, 0);
    let sim = sim_with(&s, Some(model.clone()));
    let threads = threads_with(&s, model.clone());
    assert_eq!(sim.requests.completed, 16, "{:?}", sim.per_request);
    assert_eq!(threads.requests.completed, 16, "{:?}", threads.per_request);
    // Blocks were shared: the later requests reused the prefix the first computed.
    for r in [&sim, &threads] {
        assert!(
            r.servers[0].kv.reuse_hits >= 3,
            "no prefix reuse: {:?}",
            r.servers[0].kv
        );
        assert_eq!(r.servers[0].kv.used_blocks_at_end, 0, "leaked KV");
    }
    let expected: Vec<(u64, u64)> = {
        let loaded: Arc<Model> = model.model.clone();
        let mut e: Vec<_> = requests_of(&s)
            .into_iter()
            .map(|(id, prompt, n)| {
                (
                    id,
                    digest_of(
                        &greedy_reference(&loaded, &prompt, n as usize).expect("dense reference"),
                    ),
                )
            })
            .collect();
        e.sort();
        e
    };
    assert_eq!(digests(&sim), expected, "simulator vs dense reference");
    assert_eq!(digests(&threads), expected, "threads vs dense reference");
    // Disaggregated: the ctx ranks prefill (reusing the shared prefix) and sample the
    // first token; the gen ranks decode from the K/V that arrived.
    let disagg = disagg_scenario(48, 16);
    let sim_disagg = sim_with(&disagg, Some(model.clone()));
    let threads_disagg = threads_with(&disagg, model.clone());
    for r in [&sim_disagg, &threads_disagg] {
        assert_eq!(r.requests.completed, 16, "{:?}", r.per_request);
        let moved: u64 = r.servers[1].transfers.count;
        assert_eq!(moved, 16, "every request's K/V reached a gen rank");
        assert!(r.servers[0].kv.reuse_hits >= 3, "{:?}", r.servers[0].kv);
        for s in &r.servers {
            assert_eq!(s.kv.used_blocks_at_end, 0, "leaked KV on {}", s.name);
        }
    }
    assert_eq!(digests(&sim_disagg), expected, "disaggregated simulator");
    assert_eq!(digests(&threads_disagg), expected, "disaggregated threads");
    // Negative control: the stand-in backend's tokens are not the model's.
    let stand_in = sim_with(&s, None);
    assert_ne!(digests(&stand_in), expected);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn seeded_sampling_gives_the_same_tokens_on_every_driver_and_other_tokens_for_another_seed() {
    let dir = tiny_model("seeded");
    let s = scenario(0, 12);
    let a = sim_with(&s, Some(backend(&dir, 0.8, 7)));
    let b = threads_with(&s, backend(&dir, 0.8, 7));
    let other = sim_with(&s, Some(backend(&dir, 0.8, 8)));
    let greedy = sim_with(&s, Some(backend(&dir, 0.0, 7)));
    assert_eq!(a.requests.completed, 12);
    assert_eq!(digests(&a), digests(&b));
    let differ = |x: &Report, y: &Report| {
        digests(x)
            .iter()
            .zip(digests(y))
            .filter(|(p, q)| p.1 != q.1)
            .count()
    };
    assert!(differ(&a, &other) > 6, "another seed, other tokens");
    assert!(differ(&a, &greedy) > 6, "sampling is not greedy");
    // Disaggregated serving samples the same tokens: the first on a ctx rank, the rest
    // on a gen rank, each a function of the request's seed, position and logits.
    let disagg = disagg_scenario(0, 12);
    let c = sim_with(&disagg, Some(backend(&dir, 0.8, 7)));
    let d = threads_with(&disagg, backend(&dir, 0.8, 7));
    assert_eq!(c.requests.completed, 12);
    assert_eq!(d.requests.completed, 12);
    assert_eq!(digests(&c), digests(&a), "disaggregated vs aggregated");
    assert_eq!(
        digests(&d),
        digests(&a),
        "disaggregated threads vs aggregated"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_model_the_scenario_cannot_use_is_refused_at_startup_naming_the_setting() {
    let dir = tiny_model("refused");
    let model = backend(&dir, 0.0, 0);
    let speculative = parse(
        &(server_text("agg0", "agg").replace(
            "enable_chunked_prefill = true",
            "enable_chunked_prefill = true\nmax_draft_len = 2",
        ) + "[workload]\nkind = \"closed_loop\"\nconcurrency = 2\nnum_requests = 2\n"),
        &[],
    );
    let err = sim::run(
        &speculative,
        SimOptions {
            model: Some(model.clone()),
            ..SimOptions::default()
        },
    )
    .expect_err("speculative decoding is refused");
    assert!(err.to_string().contains("draft_len 2"), "{err}");
    let err = lockstep_runtime::threads::run(
        &speculative,
        &RealOptions {
            model: Some(model),
            ..real_options()
        },
    )
    .expect_err("on threads too");
    assert!(err.to_string().contains("draft_len 2"), "{err}");
    let bad = ModelBackend::load(
        &dir,
        SamplingParams {
            top_p: 1.5,
            ..SamplingParams::default()
        },
        0,
    )
    .expect_err("top_p out of range");
    assert!(bad.to_string().contains("top_p 1.5"), "{bad}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A forward slower than the collective timeout fails its rank with an error naming the
/// bound, within about that bound, instead of hanging it; a bound the forward meets runs
/// the same scenario to the end (the control).
#[test]
fn a_forward_past_the_timeout_fails_the_rank_naming_the_bound() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-model-slow-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Wide enough that one 1,000-token prefill takes far longer than 1 ms.
    write_random_model(
        &dir,
        &InitOptions {
            layers: 4,
            hidden: 256,
            heads: 8,
            kv_heads: 4,
            vocab: 512,
            intermediate: 512,
            ..InitOptions::default()
        },
    )
    .expect("write the model");
    let s = parse(
        r#"
name = "slow-forward"

[[server]]
name = "agg0"
role = "agg"
max_batch_size = 1
max_num_tokens = 1024

[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 4096

[workload]
kind = "closed_loop"
concurrency = 1
num_requests = 1
input_len = [1000, 1000]
output_len = [2, 2]
"#,
        &[],
    );
    let model = backend(&dir, 0.0, 0);
    let run = |timeout: Duration| {
        common::threads_try(
            &s,
            RealOptions {
                model: Some(model.clone()),
                collective_timeout: timeout,
                ..real_options()
            },
        )
    };
    let started = std::time::Instant::now();
    let failed = run(Duration::from_millis(1)).expect("a report");
    assert_eq!(failed.outcome, Outcome::Failed);
    let why = failed.outcome_detail.clone().unwrap_or_default();
    assert!(
        why.contains("rank 0: device: batch 0: the model's forward took longer than 1ms (--timeout-ms raises the bound)"),
        "{why}"
    );
    // Accounted for: the request failed, with a reason.
    assert_eq!(failed.requests.failed, 1);
    assert!(failed.per_request[0].failure().is_some());
    // The device thread finishes its forward before the run returns: bounded by it.
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "ended in {:?}",
        started.elapsed()
    );
    let report = run(Duration::from_secs(20)).expect("a bound the forward meets");
    assert_eq!(report.outcome, Outcome::Completed);
    assert_eq!(report.requests.completed, 1);
    let _ = std::fs::remove_dir_all(&dir);
}
