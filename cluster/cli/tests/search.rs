//! `lockstep search` end to end through the binary: a small roofline search writes its
//! table, CSV, page and winners, and a winner's scenario, run by `lockstep sim`,
//! reproduces what the search measured; a bad spec is refused naming the key.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod scratch;
use scratch::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn lockstep(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("the binary runs")
}

/// Llama-3-8B on up to 4 H100s, TP 1 or 2, aggregated or disaggregated.
fn spec(dir: &Path) -> PathBuf {
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/models/llama-3-8b/config.json")
        .canonicalize()
        .unwrap();
    let text = format!(
        r#"name = "small"
[model]
hf_config = "{}"
gpu = "H100-SXM"
[gpus]
total = 4
[workload]
input_len = 1024
output_len = 128
max_concurrency = 64
[slo.p90]
ttft_ms = 500
tpot_ms = 30
[space]
modes = ["agg", "disagg"]
tp = [1, 2]
max_batch_size = [32]
ctx_instances = [1]
gen_instances = [1]
[method]
finalists = 1
seeds = 1
"#,
        config.display()
    );
    let path = dir.join("small.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_search_writes_its_answer_and_a_winner_reproduces_it() {
    let dir = TempDir::new("small");
    let spec = spec(&dir.0);
    let out = dir.0.join("out");
    let stdout = search_into(&spec, &out, 2);
    assert!(stdout.contains("tok/s/GPU"), "{stdout}");
    assert!(stdout.contains("Pareto front"), "{stdout}");

    let csv = std::fs::read_to_string(out.join("ranked.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let first: Vec<&str> = lines.next().expect("a ranked row").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    assert_eq!(first[col("rank")], "1");
    let measured: f64 = first[col("output_tokens_per_s")].parse().unwrap();
    assert!(measured > 0.0);
    let ttft: f64 = first[col("slo.p90.ttft_ms")].parse().unwrap();
    assert!(ttft <= 500.0, "the winner meets the objective: {ttft}");

    let page = std::fs::read_to_string(out.join("search.html")).unwrap();
    assert!(page.contains("<svg"), "an inline plot");
    assert!(page.contains(r#"class="dots""#));

    assert_winner_reproduces(&dir.0, &out, measured);
    let yaml = std::fs::read_to_string(out.join("winner-1.yml")).unwrap();
    assert!(yaml.contains("tensor_parallel_size"), "{yaml}");
    assert!(out.join("winner-2.toml").exists());
}

/// Runs `lockstep search SPEC --out OUT --winners N`, which must succeed; its stdout.
fn search_into(spec: &Path, out: &Path, winners: u32) -> String {
    let o = lockstep(&[
        "search",
        spec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--winners",
        &winners.to_string(),
    ]);
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

/// The winner's scenario, run as any scenario is, gives what the search measured.
fn assert_winner_reproduces(dir: &Path, out: &Path, measured: f64) {
    let json = dir.join("winner.json");
    let w = out.join("winner-1.toml");
    let r = lockstep(&["sim", w.to_str().unwrap(), "--json", json.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let again = report["throughput"]["output_tokens_per_s"]
        .as_f64()
        .unwrap();
    assert!(
        (again - measured).abs() < 1e-3,
        "the search measured {measured}, the winner's scenario gives {again}"
    );
}

/// The first ranked row's output tokens per second, from `ranked.csv`.
fn first_ranked_tokens_per_s(out: &Path) -> f64 {
    let csv = std::fs::read_to_string(out.join("ranked.csv")).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let first: Vec<&str> = lines.next().expect("a ranked row").split(',').collect();
    let col = header
        .iter()
        .position(|h| *h == "output_tokens_per_s")
        .unwrap();
    first[col].parse().unwrap()
}

#[test]
fn a_trace_search_finds_a_rate_its_winner_replays() {
    let dir = TempDir::new("trace");
    // An Azure-format trace beside the spec, named relative to it: 120 requests half a
    // second apart, replayed 60 at a time (the finalist's further seed replays the next
    // 60).
    let rows: String = (0..120u32)
        .map(|i| {
            format!(
                "2023-11-16 18:{:02}:{:02}.5000000,{},{}\n",
                i / 120,
                (i / 2) % 60,
                200 + (i * 37) % 800,
                20 + (i * 11) % 80
            )
        })
        .collect();
    std::fs::write(
        dir.0.join("t.csv"),
        format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{rows}"),
    )
    .unwrap();
    let spec = spec(&dir.0);
    let text = std::fs::read_to_string(&spec).unwrap().replace(
        "input_len = 1024\noutput_len = 128\nmax_concurrency = 64",
        "[workload.trace]\npath = \"t.csv\"\nformat = \"azure\"\nrequests = 60",
    );
    std::fs::write(&spec, text).unwrap();
    let out = dir.0.join("out");
    let stdout = search_into(&spec, &out, 1);
    assert!(stdout.contains("req/s"), "the load is a rate: {stdout}");
    assert!(stdout.contains(" of 2 seeds meet them"), "{stdout}");
    let winner = std::fs::read_to_string(out.join("winner-1.toml")).unwrap();
    assert!(winner.contains("kind = \"trace\""), "{winner}");
    assert!(!winner.contains("input_len"), "{winner}");
    assert_winner_reproduces(&dir.0, &out, first_ranked_tokens_per_s(&out));
}

#[test]
fn a_bad_spec_is_refused_naming_the_key() {
    let dir = TempDir::new("bad");
    let spec = spec(&dir.0);
    let text = std::fs::read_to_string(&spec)
        .unwrap()
        .replace("tpot_ms = 30", "tpot_ms = 30\nitl_p99 = 5");
    std::fs::write(&spec, text).unwrap();
    let o = lockstep(&["search", spec.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(78), "a refused configuration");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("itl_p99"), "{stderr}");
}

#[test]
fn the_example_specs_load_and_have_candidates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/search");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let spec = lockstep_search::spec::SearchSpec::load(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let space = lockstep_search::space::enumerate(&spec, true);
        assert!(!space.kept.is_empty(), "{}", path.display());
        n += 1;
    }
    assert!(n >= 2, "the README's two searches");
}
