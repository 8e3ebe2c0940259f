//! `lockstep search` on spaces whose answer is known by construction, and on specs it
//! must refuse.

use lockstep_search::spec::SearchSpec;
use lockstep_search::{Progress, SearchError, SearchOutcome, search};

/// A cost model in which one configuration dominates: every forward costs a fixed
/// 20 ms whatever it holds (so a bigger batch is more tokens for the same time) and
/// the host 20 ms per iteration (so overlapping host and device halves an iteration).
/// Of `max_batch_size` 8 or 32 with the overlap scheduler on or off, B32 with overlap
/// serves the most tokens per GPU; B8 without overlap the fewest.
const DOMINATED: &str = r#"
name = "dominated"
[model]
profile = "llama3-8b-h100-bf16"
[model.coefficients]
forward_base_ns = 20000000.0
ctx_token_ns = 0.0
ctx_attention_ns = 0.0
gen_request_ns = 0.0
gen_token_ns = 0.0
kv_read_ns = 0.0
collective_ns = 0.0
host_base_ns = 20000000.0
host_per_request_ns = 0.0
[gpus]
total = 8
kv_tokens_per_rank = 1000000
[frontend]
preset = "none"
[workload]
input_len = 64
output_len = 32
max_concurrency = 64
[slo.p90]
tpot_ms = 1000
[space]
modes = ["agg"]
tp = [1]
max_batch_size = [8, 32]
overlap = [true, false]
[method]
finalists = 2
seeds = 1
"#;

fn run(text: &str, jobs: u32) -> Result<SearchOutcome, SearchError> {
    let mut spec = SearchSpec::parse(text)?;
    spec.method.jobs = jobs;
    search(&spec, &|_: Progress| {})
}

#[test]
fn the_dominating_configuration_wins_and_the_bound_holds() {
    // Without a trace, every further seed draws from the one workload.
    let spec = SearchSpec::parse(DOMINATED).expect("a valid spec");
    assert_eq!(spec.workload.window_of_seed(3), Some(0));
    let o = run(DOMINATED, 2).expect("a valid spec");
    let labels: Vec<String> = o.ranked.iter().map(|r| r.candidate.label()).collect();
    assert_eq!(o.ranked.len(), 4, "{labels:?}");
    assert_eq!(labels[0], "agg 1×TP1 B32 ovl T8192 GNE", "{labels:?}");
    assert_eq!(labels[3], "agg 1×TP1 B8 T8192 GNE", "{labels:?}");
    let best = &o.ranked[0];
    let m = best
        .evaluation
        .best
        .as_ref()
        .expect("the winner meets a load");
    // A closed loop at B32 with a 20 ms iteration (host and device overlapped): close to
    // 32 tokens per 20 ms.
    assert!(
        best.tokens_per_gpu() > 1200.0 && best.tokens_per_gpu() <= 1600.0,
        "{} tok/s/GPU at {} clients",
        best.tokens_per_gpu(),
        m.load
    );
    for r in &o.ranked {
        assert!(
            r.tokens_per_gpu() <= r.cheap.tokens_per_gpu * 1.000_001,
            "{}: measured {} above its bound {}",
            r.candidate.label(),
            r.tokens_per_gpu(),
            r.cheap.tokens_per_gpu
        );
    }
    // Each objective's value is checked: the winner's TPOT is within its bound.
    assert!(m.tpot.p90 <= 1000.0);
    let spread = best.seeds.as_ref().expect("a finalist runs further seeds");
    assert_eq!(spread.runs, 2);
    assert!(!o.pareto.is_empty());
}

#[test]
fn the_answer_does_not_depend_on_the_threads() {
    // More candidates than one round holds, so the bound prunes between rounds: what it
    // prunes must not depend on how many simulations run at once.
    let text = DOMINATED
        .replace(
            "max_batch_size = [8, 32]",
            "max_batch_size = [4, 8, 16, 32]",
        )
        .replace("tp = [1]", "tp = [1, 2]\nagg_instances = [1, 2]");
    let one = run(&text, 1).expect("a valid spec");
    let two = run(&text, 2).expect("a valid spec");
    assert_eq!(one.candidates, 32);
    assert!(
        one.pruned
            .get(lockstep_search::BELOW_BEST)
            .is_some_and(|&n| n > 0),
        "{:?}",
        one.pruned
    );
    assert_eq!(one, two);
}

#[test]
fn a_tight_objective_binds_the_load() {
    // TPOT p90 at most 45 ms: an iteration is 20 ms with overlap, 40 ms without; a
    // request decodes once per iteration, so every candidate meets it at low load, and
    // the binding constraint is named.
    let text = DOMINATED.replace("tpot_ms = 1000", "tpot_ms = 1000\nttft_ms = 150");
    let o = run(&text, 2).expect("a valid spec");
    assert!(o.ranked.iter().all(|r| r.evaluation.best.is_some()));
    let winner = &o.ranked[0];
    assert_eq!(winner.candidate.label(), "agg 1×TP1 B32 ovl T8192 GNE");
    let m = winner.evaluation.best.as_ref().expect("a load meets it");
    assert!(m.ttft.p90 <= 150.0, "{:?}", m.ttft);
    assert!(
        winner.evaluation.binding.contains("slo.p90.ttft_ms"),
        "{}",
        winner.evaluation.binding
    );
    assert!(m.load < 64.0, "the load cap was not reached: {}", m.load);
    // The load found is the bisection's: the least load above it that was simulated
    // misses the TTFT objective, and is within the tolerance (5 %) or one client.
    let above = winner
        .evaluation
        .points
        .iter()
        .filter(|p| p.load > m.load)
        .min_by(|a, b| a.load.total_cmp(&b.load))
        .expect("a higher load was simulated");
    assert!(above.ttft.p90 > 150.0, "{:?}", above.ttft);
    assert!(
        above.load == m.load + 1.0 || above.load <= m.load * 1.05,
        "found {} below a miss at {}",
        m.load,
        above.load
    );
}

fn refused(text: &str) -> String {
    match run(text, 1) {
        Ok(o) => panic!("searched a bad spec: {} ranked", o.ranked.len()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_objective_that_does_not_exist_is_named() {
    let e = refused(&DOMINATED.replace("tpot_ms = 1000", "tpot = 1000"));
    assert!(e.contains("unknown field `tpot`"), "{e}");
    let e = refused(&DOMINATED.replace("[slo.p90]", "[slo.p95]"));
    assert!(e.contains("p95"), "{e}");
    let e = refused(&DOMINATED.replace("tpot_ms = 1000", "tpot_ms = -3"));
    assert!(e.contains("slo.p90.tpot_ms = -3"), "{e}");
}

#[test]
fn an_empty_space_is_named() {
    let e = refused(&DOMINATED.replace("max_batch_size = [8, 32]", "max_batch_size = []"));
    assert!(e.contains("space.max_batch_size"), "{e}");
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn a_budget_no_configuration_fits_names_both_numbers() {
    let text = DOMINATED
        .replace("total = 8", "total = 3")
        .replace("tp = [1]", "tp = [4, 8]");
    let e = refused(&text);
    assert!(e.contains("gpus.total = 3"), "{e}");
    assert!(e.contains("needs 4 GPUs"), "{e}");
}

#[test]
fn the_search_chooses_the_rank_shape() {
    let e = refused(&DOMINATED.replace("[model]\n", "[model]\ntp = 2\n"));
    assert!(e.contains("model.tp"), "{e}");
}

#[test]
fn a_policy_is_read_and_a_bad_switch_is_named() {
    let legacy = DOMINATED.replace("[gpus]", "[policy]\npreset = \"legacy\"\n[gpus]");
    let spec = SearchSpec::parse(&legacy).expect("a valid spec");
    assert_eq!(spec.policy, lockstep_actors::policy::Policy::LEGACY);
    let e = refused(&DOMINATED.replace("[gpus]", "[policy]\nno_such_switch = true\n[gpus]"));
    assert!(e.contains("no_such_switch"), "{e}");
}

#[test]
fn attention_dp_axes_multiply_only_attention_dp_instances() {
    let text = DOMINATED
        .replace(
            "tp = [1]",
            "tp = [1]\nattention_dp = [2]\nadp_balance = [false, true]",
        )
        .replace("overlap = [true, false]", "overlap = [true]");
    let o = run(&text, 2).expect("a valid spec");
    let labels: Vec<String> = o.ranked.iter().map(|r| r.candidate.label()).collect();
    // TP1 × {B8, B32} once each; ADP2 × {B8, B32} × balance off and on.
    assert_eq!(o.candidates, 6, "{labels:?}");
    assert_eq!(
        labels.iter().filter(|l| l.ends_with(" balance")).count(),
        2,
        "{labels:?}"
    );
    assert!(
        labels
            .iter()
            .all(|l| !l.contains("TP1") || !l.ends_with(" balance"))
    );
}

#[test]
fn an_arrival_rate_is_searched_like_clients() {
    let text = DOMINATED
        .replace("max_concurrency = 64", "load = \"rate\"")
        .replace("tpot_ms = 1000", "tpot_ms = 1000\nttft_ms = 150");
    let o = run(&text, 2).expect("a valid spec");
    let winner = &o.ranked[0];
    assert_eq!(winner.candidate.label(), "agg 1×TP1 B32 ovl T8192 GNE");
    let m = winner.evaluation.best.as_ref().expect("a rate meets them");
    assert!(m.ttft.p90 <= 150.0, "{:?}", m.ttft);
    // Open loop: the run ended about one request after the last arrival.
    assert!(
        m.duration_s <= m.arrival_span_s + 2.0,
        "arrivals over {} s, the run lasted {} s",
        m.arrival_span_s,
        m.duration_s
    );
    // Without a latency objective, saturation alone stops the load: the fleet cannot
    // serve more than its bound.
    let text = DOMINATED.replace("max_concurrency = 64", "load = \"rate\"");
    let o = run(&text, 2).expect("a valid spec");
    let winner = &o.ranked[0];
    let m = winner.evaluation.best.as_ref().expect("a rate meets them");
    assert!(
        winner.evaluation.binding.starts_with("saturated"),
        "{}",
        winner.evaluation.binding
    );
    // B32 with overlap finishes at most one request per 20 ms iteration (each holds a
    // slot for its prefill and 31 decode steps): 50 req/s. Saturation shows once the
    // run outlasts its arrivals by a tenth, so a rate a little above can pass; far
    // above cannot, and well below would mean the search stopped early.
    assert!(
        m.load > 40.0 && m.load <= 55.0,
        "B32 serves 50 req/s at most; found {}",
        m.load
    );
    let refused =
        SearchSpec::parse(&text.replace("load = \"rate\"", "load = \"rate\"\nmax_concurrency = 8"));
    assert!(
        refused.is_err_and(|e| e.to_string().contains("workload.max_concurrency")),
        "clients and a rate together"
    );
}

/// Llama-3-8B by roofline on H100s: context and generation servers of different
/// tensor parallelism.
fn mixed_spec() -> String {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/models/llama-3-8b/config.json")
        .canonicalize()
        .unwrap();
    format!(
        r#"name = "mixed"
[model]
hf_config = "{}"
gpu = "H100-SXM"
[gpus]
total = 4
[frontend]
preset = "none"
[workload]
input_len = 1024
output_len = 64
max_concurrency = 32
[slo.p90]
tpot_ms = 50
[space]
modes = ["disagg"]
tp = [1, 2]
max_batch_size = [16]
ctx_instances = [1]
gen_instances = [1]
[method]
finalists = 0
"#,
        config.display()
    )
}

#[test]
fn context_and_generation_servers_of_different_shapes_are_costed_apart() {
    let o = run(&mixed_spec(), 2).expect("a valid spec");
    let labels: Vec<String> = o.ranked.iter().map(|r| r.candidate.label()).collect();
    // TP1 and TP2, for ctx and gen: four pairs, none pruned for their shapes.
    assert_eq!(o.ranked.len(), 4, "{:?}", o.pruned);
    let spec = SearchSpec::parse(&mixed_spec()).unwrap();
    let mixed = o
        .ranked
        .iter()
        .find(|r| r.candidate.label().starts_with("disagg 1×TP2 B4 : 1×TP1"))
        .unwrap_or_else(|| panic!("ctx TP2 with gen TP1 in {labels:?}"));
    // The simulated [model] is the gen ranks'; the ctx server is costed apart, with the
    // TP2 model's own (cheaper per token) prefill.
    let ctx = &mixed.simulated_model.servers["ctx0"].coefficients;
    let gen_ctx_token = mixed.simulated_model.coefficients.ctx_token_ns.unwrap();
    assert!(ctx.ctx_token_ns.unwrap() < gen_ctx_token, "{ctx:?}");
    // Written out with the roofline's keys, it runs as it was measured.
    let s = lockstep_search::output::winner_scenario(&spec, mixed).expect("it met a load");
    assert_eq!(s.model.servers["ctx0"].tp, Some(2));
    assert_eq!(s.model.tp, Some(1));
    let report = lockstep_sim::run(&s, lockstep_sim::SimOptions::default()).unwrap();
    let measured = mixed.evaluation.best.as_ref().unwrap().output_tokens_per_s;
    assert_eq!(report.throughput.output_tokens_per_s, measured);
}

#[test]
fn the_fewest_gpus_for_a_target_rate_counts_replicas() {
    // B32 with overlap completes about 40 requests per second at its best load (one GPU);
    // 100 req/s need three such GPUs, B8 without overlap many more.
    let text = DOMINATED.replace(
        "[space]",
        "[objective]\nkind = \"fewest_gpus\"\ntarget_requests_per_s = 100.0\n[space]",
    );
    let o = run(&text, 2).expect("a valid spec");
    let winner = &o.ranked[0];
    assert_eq!(winner.candidate.label(), "agg 1×TP1 B32 ovl T8192 GNE");
    let rate = winner.evaluation.best.as_ref().unwrap().requests_per_s;
    let needed = winner.gpus_needed.expect("a load meets the objectives");
    assert_eq!(
        needed,
        (100.0 / rate).ceil() as u32,
        "at {rate} req/s per replica"
    );
    let gpus: Vec<u32> = o.ranked.iter().filter_map(|r| r.gpus_needed).collect();
    assert!(
        gpus.windows(2).all(|w| w[0] <= w[1]),
        "ranked by GPUs: {gpus:?}"
    );
    assert!(gpus[3] > gpus[0], "{gpus:?}");
}

/// A Mooncake-format trace of `records` requests, one every 100 ms (10 req/s), prompts
/// of 48 to 80 tokens and outputs of 16 to 48 (32 on average), every fourth sharing its
/// (512-token) block id with the others.
fn write_trace(name: &str, records: u32) -> std::path::PathBuf {
    write_trace_ending(name, records, None)
}

/// [`write_trace`], its last record's output `last_output` tokens long when given.
fn write_trace_ending(name: &str, records: u32, last_output: Option<u32>) -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("search-trace-{name}-{}.jsonl", std::process::id()));
    let lines: String = (0..records)
        .map(|i| {
            format!(
                "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": {}, \"hash_ids\": [{}]}}\n",
                i * 100,
                48 + (i * 7) % 33,
                match last_output {
                    Some(n) if i + 1 == records => n,
                    _ => 16 + (i * 13) % 33,
                },
                if i % 4 == 0 { 0 } else { i + 1 }
            )
        })
        .collect();
    std::fs::write(&path, lines).unwrap();
    path
}

fn trace_spec(path: &std::path::Path) -> String {
    DOMINATED.replace(
        "input_len = 64\noutput_len = 32\nmax_concurrency = 64",
        &format!(
            "[workload.trace]\npath = {:?}\nformat = \"mooncake\"\nrequests = 200",
            path.display().to_string()
        ),
    )
}

#[test]
fn a_trace_is_replayed_faster_until_the_fleet_cannot_keep_up() {
    let path = write_trace("replay", 500);
    let text = trace_spec(&path);
    let spec = SearchSpec::parse(&text).expect("a valid spec");
    // The lengths and the rate are the first 200 records'.
    assert_eq!(
        spec.workload.load_kind(),
        lockstep_search::spec::LoadKind::Rate
    );
    assert_eq!(
        spec.workload.input_len(),
        lockstep_plan::workload::LenSpec::Range([48, 80])
    );
    assert_eq!(
        spec.workload.output_len(),
        lockstep_plan::workload::LenSpec::Range([16, 48])
    );
    let natural = spec.workload.trace_rate(0).expect("a rate");
    assert!((natural - 10.0).abs() < 1e-9, "{natural}");
    // One further seed (`method.seeds`): the next 200 records; the last 100 are not a
    // whole window.
    let windows = &spec.workload.trace.as_ref().unwrap().windows;
    assert_eq!(windows.len(), 2);
    assert_eq!(windows[1].records, 200);
    assert_eq!(spec.workload.window_of_seed(1), Some(1));
    assert_eq!(
        spec.workload.window_of_seed(2),
        None,
        "no third whole window"
    );
    let next = lockstep_search::space::space_workload(&spec, 20.0, 0, 1, 1.0);
    assert_eq!(next.trace.as_ref().map(|t| t.skip), Some(200));

    let o = run(&text, 2).expect("a valid spec");
    let winner = &o.ranked[0];
    assert_eq!(winner.candidate.label(), "agg 1×TP1 B32 ovl T8192 GNE");
    let m = winner
        .evaluation
        .best
        .as_ref()
        .expect("some rate is served");
    // Replayed at `load` req/s on average: 200 records arrive over 199 / load seconds.
    assert!(
        (m.arrival_span_s - 199.0 / m.load).abs() < 0.01 * m.arrival_span_s,
        "arrivals over {} s at {} req/s",
        m.arrival_span_s,
        m.load
    );
    // As with a synthetic rate: B32 with overlap ends at most one 32-token request per
    // 20 ms iteration (50 req/s); only saturation binds.
    assert!(
        winner.evaluation.binding.starts_with("saturated"),
        "{}",
        winner.evaluation.binding
    );
    assert!(m.load > 35.0 && m.load <= 60.0, "found {} req/s", m.load);
    let spread = winner.seeds.as_ref().expect("a finalist");
    assert_eq!(spread.runs, 2, "the first window and the next");
    // The winner replays the same trace at that rate.
    let s = lockstep_search::output::winner_scenario(&spec, winner).expect("a winner");
    let w = s.workload.as_ref().expect("a workload");
    assert_eq!(w.kind, lockstep_plan::workload::WorkloadKind::Trace);
    assert_eq!(w.num_requests, Some(200));
    let t = w.trace.as_ref().expect("a trace");
    assert!(std::path::Path::new(&t.path).is_absolute(), "{}", t.path);
    assert!((t.time_scale - natural / m.load).abs() < 1e-9);
    std::fs::remove_file(&path).ok();
}

#[test]
fn a_trace_spec_is_refused_naming_the_key() {
    let path = write_trace("refused", 10);
    let text = trace_spec(&path);
    let e = refused(&text.replace("[workload.trace]", "input_len = 64\n[workload.trace]"));
    assert!(
        e.contains("workload.input_len") && e.contains("absent with a [workload.trace]"),
        "{e}"
    );
    let e = refused(&text.replace(
        "[workload.trace]",
        "load = \"concurrency\"\n[workload.trace]",
    ));
    assert!(e.contains("workload.load"), "{e}");
    let e = refused(&text.replace("requests = 200", "requests = 0"));
    assert!(e.contains("workload.trace.requests = 0"), "{e}");
    let e = refused(&text.replace("[workload.trace]", "min_requests = 64\n[workload.trace]"));
    assert!(e.contains("workload.min_requests = 64"), "{e}");
    let e = refused(&text.replace("requests = 200", "requests = 200\nblock_tokens = 0"));
    assert!(e.contains("workload.trace.block_tokens = 0"), "{e}");
    let e = refused(&text.replace("[workload.trace]", "max_concurrency = 4\n[workload.trace]"));
    assert!(e.contains("workload.max_concurrency"), "{e}");
    let e = refused(&text.replace("requests = 200", "requests = 0"));
    assert!(e.contains("workload.trace.requests = 0"), "{e}");
    let e = refused(&text.replace(".jsonl", ".missing"));
    assert!(
        e.contains("workload.trace") && e.contains(".missing"),
        "{e}"
    );
    let e = refused(&text.replace("[workload.trace]", "output_len = 0\n[workload.trace]"));
    assert!(e.contains("workload.output_len"), "{e}");
    // One record has no rate to scale.
    let e = refused(&text.replace("requests = 200", "requests = 1"));
    assert!(e.contains("arrive at once"), "{e}");
    let e = refused(&DOMINATED.replace("input_len = 64\n", ""));
    assert!(e.contains("workload.input_len = absent"), "{e}");
    std::fs::remove_file(&path).ok();
}

#[test]
fn the_shipped_trace_spec_reads_its_windows_from_a_relative_path() {
    // Tests run in the crate's folder: the spec and its trace are named relative to it,
    // and the trace relative to the spec.
    let spec = SearchSpec::load(std::path::Path::new(
        "../../examples/search/llama3-70b-azure-trace.toml",
    ))
    .expect("the shipped spec");
    let t = spec.workload.trace.as_ref().expect("a trace");
    assert!(
        t.resolved_path.is_absolute(),
        "{}",
        t.resolved_path.display()
    );
    // The search's window and one per further seed (3), 1,000 records each.
    assert_eq!(t.windows.len(), 4);
    assert!(t.windows.iter().all(|w| w.records == 1000));
    // The first 1,000 requests of the Azure 2023 conversation trace: 18:15:46.68 to
    // 18:19:22.71 (data/traces/README.md), about 4.6 req/s.
    let rate = spec.workload.trace_rate(0).expect("a rate");
    assert!((rate - 999.0 / 216.03).abs() < 0.01, "{rate}");
    assert_eq!(
        spec.workload.input_len(),
        lockstep_plan::workload::LenSpec::Range([2, 4145])
    );
}

#[test]
fn a_trace_ending_in_a_long_request_is_not_taken_for_a_queue() {
    // The last request decodes 1,000 tokens, 20 ms each: the run ends 20 s after the
    // last arrival however fast the fleet is. Judged by the shortest request's time
    // alone, every replay would look saturated.
    let path = write_trace_ending("long-last", 200, Some(1000));
    let o = run(&trace_spec(&path), 2).expect("a valid spec");
    let winner = &o.ranked[0];
    let m = winner
        .evaluation
        .best
        .as_ref()
        .unwrap_or_else(|| panic!("no rate served: {}", winner.evaluation.binding));
    assert!(m.duration_s > m.arrival_span_s + 19.0, "{m:?}");
    assert!(m.load > 35.0, "found {} req/s", m.load);
    std::fs::remove_file(&path).ok();
}
