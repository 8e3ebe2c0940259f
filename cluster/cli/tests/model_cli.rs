//! `lockstep model` end to end: init a tiny random model, generate from it greedily and
//! with seeded sampling (each twice: identical text), and a bad directory's error.

use std::path::Path;
use std::process::{Command, Output};

mod scratch;
use scratch::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn lockstep(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run lockstep")
}

fn ok(output: Output) -> String {
    assert!(
        output.status.success(),
        "status {:?}, stderr: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8 output")
}

/// Runs `lockstep ARGS`, which must fail; its stderr.
fn fails(args: &[&str]) -> String {
    let output = lockstep(args);
    assert!(!output.status.success(), "{args:?} succeeded");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn generate_from(dir: &Path) -> String {
    fails(&[
        "model",
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "hello",
    ])
}

fn init(dir: &Path) {
    let path = dir.to_str().unwrap();
    let out = ok(lockstep(&[
        "model",
        "init",
        path,
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "384",
        "--seed",
        "5",
    ]));
    assert!(out.contains("wrote"), "{out}");
}

fn generate(dir: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "model",
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "the cache keeps the keys and the values of every token",
        "--max-tokens",
        "24",
        "--chunk",
        "5",
        "--tokens-per-block",
        "4",
    ];
    args.extend_from_slice(extra);
    ok(lockstep(&args))
}

#[test]
fn greedy_and_seeded_generations_repeat() {
    let dir = TempDir::unmade("generate");
    init(&dir.0);
    let greedy = generate(&dir.0, &[]);
    assert!(!greedy.trim().is_empty(), "greedy produced no text");
    assert_eq!(greedy, generate(&dir.0, &[]), "greedy twice");
    let seeded = [
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--top-k",
        "50",
        "--seed",
        "11",
    ];
    let first = generate(&dir.0, &seeded);
    assert_eq!(first, generate(&dir.0, &seeded), "seeded twice");
    let other = [
        "--temperature",
        "0.9",
        "--top-p",
        "0.95",
        "--top-k",
        "50",
        "--seed",
        "12",
    ];
    assert_ne!(first, generate(&dir.0, &other), "another seed, other text");
    // The chat template wraps the prompt; generation still runs.
    ok(lockstep(&[
        "model",
        "generate",
        "--model",
        dir.0.to_str().unwrap(),
        "--prompt",
        "hi",
        "--chat",
        "--max-tokens",
        "4",
    ]));
}

#[test]
fn bench_reports_both_paths() {
    let dir = TempDir::unmade("bench");
    init(&dir.0);
    let out = ok(lockstep(&[
        "model",
        "bench",
        "--model",
        dir.0.to_str().unwrap(),
        "--prompt-len",
        "16",
        "--decode-tokens",
        "4",
        "--batch",
        "2",
        "--rounds",
        "1",
    ]));
    for needle in ["paged:", "dense:", "paged/dense per-token cost"] {
        assert!(out.contains(needle), "{needle} missing from: {out}");
    }
}

#[test]
fn bad_model_directory_names_the_file() {
    let dir = TempDir::unmade("bad");
    init(&dir.0);
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    let stderr = generate_from(&dir.0);
    assert!(stderr.contains("model.safetensors"), "{stderr}");

    let empty = TempDir::unmade("empty");
    std::fs::create_dir_all(&empty.0).unwrap();
    let stderr = generate_from(&empty.0);
    assert!(stderr.contains("config.json"), "{stderr}");
}

#[test]
fn calibrate_writes_a_profile_the_simulator_runs_with() {
    let tmp = TempDir::unmade("calibrate");
    let dir = tmp.0.join("tiny");
    init(&dir);
    let profile = tmp.0.join("tiny-profile.toml");
    let out = ok(lockstep(&[
        "model",
        "calibrate",
        "--model",
        dir.to_str().unwrap(),
        "--out",
        profile.to_str().unwrap(),
        "--repeats",
        "1",
    ]));
    assert!(out.contains("fitted:"), "{out}");
    let text = std::fs::read_to_string(&profile).expect("the profile file");
    assert!(
        text.contains("[coefficients]") && text.contains("[kv]"),
        "{text}"
    );
    // A context token costs something on any machine.
    let ctx_token_ns: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("ctx_token_ns = "))
        .and_then(|v| v.parse().ok())
        .expect("ctx_token_ns in the file");
    assert!(ctx_token_ns > 0.0, "{text}");
    let scenario = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/agg-balanced.toml"
    );
    let with_file = format!("model.profile=\"{}\"", profile.display());
    let sim = |set: &str| {
        ok(lockstep(&[
            "sim",
            scenario,
            "--set",
            set,
            "--set",
            "workload.num_requests=50",
        ]))
    };
    let calibrated = sim(&with_file);
    assert!(calibrated.contains("completed 50"), "{calibrated}");
    let shipped = sim("model.profile=\"llama3-8b-h100-bf16\"");
    assert_ne!(
        calibrated.lines().find(|l| l.contains("ttft")),
        shipped.lines().find(|l| l.contains("ttft")),
        "the profile file changes the modeled latencies"
    );
    // A profile file that is missing, or has a bad coefficient, is an error naming it.
    let missing = fails(&["sim", scenario, "--set", "model.profile=\"nope.toml\""]);
    assert!(
        missing.contains("model.profile = \"nope.toml\""),
        "{missing}"
    );
    let bad = tmp.0.join("bad.toml");
    std::fs::write(&bad, text.replace("ctx_token_ns = ", "ctx_token_ns = -")).unwrap();
    let err = fails(&[
        "sim",
        scenario,
        "--set",
        &format!("model.profile=\"{}\"", bad.display()),
    ]);
    assert!(err.contains("coefficients.ctx_token_ns"), "{err}");
}

/// The calibration of a real run: `run --model --forward-log` writes one line per
/// forward, `model calibrate --from-log` fits them into a profile the simulator runs
/// with; a log line that is not a record is an error naming the line; a log without
/// --model is refused.
#[test]
fn a_real_runs_forward_log_calibrates_a_profile() {
    let tmp = TempDir::unmade("from-log");
    let dir = tmp.0.join("tiny");
    init(&dir);
    let scenario = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/model/agg-tiny.toml"
    );
    let log = tmp.0.join("forwards.jsonl");
    let report = ok(lockstep(&[
        "run",
        scenario,
        "--driver",
        "threads",
        "--model",
        dir.to_str().unwrap(),
        "--forward-log",
        log.to_str().unwrap(),
    ]));
    assert!(
        report.contains("completed 64") && report.contains("(real model)"),
        "{report}"
    );
    let lines = std::fs::read_to_string(&log).expect("the log");
    assert!(lines.lines().count() >= 20, "{lines}");
    let profile = tmp.0.join("fitted.toml");
    let calibrate = [
        "model",
        "calibrate",
        "--model",
        dir.to_str().unwrap(),
        "--from-log",
        log.to_str().unwrap(),
        "--out",
        profile.to_str().unwrap(),
    ];
    let out = ok(lockstep(&calibrate));
    assert!(
        out.contains("decode only") && out.contains("fitted:"),
        "{out}"
    );
    let with_file = format!("model.profile=\"{}\"", profile.display());
    let sim = ok(lockstep(&["sim", scenario, "--set", &with_file]));
    assert!(sim.contains("completed 64"), "{sim}");
    std::fs::write(&log, format!("{lines}not json\n")).unwrap();
    let err = fails(&calibrate);
    let bad_line = lines.lines().count() + 1;
    assert!(err.contains(&format!("line {bad_line}")), "{err}");
    let err = fails(&[
        "run",
        scenario,
        "--driver",
        "threads",
        "--forward-log",
        log.to_str().unwrap(),
    ]);
    assert!(err.contains("--model"), "{err}");
}

#[test]
fn init_refuses_a_directory_that_holds_a_model_unless_forced() {
    let dir = TempDir::unmade("init-twice");
    init(&dir.0);
    let config = std::fs::read(dir.0.join("config.json")).unwrap();
    let err = fails(&["model", "init", dir.0.to_str().unwrap(), "--seed", "9"]);
    assert!(
        err.contains("already holds config.json, model.safetensors") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(dir.0.join("config.json")).unwrap(),
        config,
        "a refused init changed the model"
    );
    let out = ok(lockstep(&[
        "model",
        "init",
        dir.0.to_str().unwrap(),
        "--seed",
        "9",
        "--force",
    ]));
    assert!(out.contains("wrote"), "{out}");
}

#[test]
fn generate_says_how_many_tokens_how_fast_and_why_it_stopped() {
    let dir = TempDir::unmade("generate-summary");
    init(&dir.0);
    let out = lockstep(&[
        "model",
        "generate",
        "--model",
        dir.0.to_str().unwrap(),
        "--prompt",
        "hello",
        "--max-tokens",
        "5",
    ]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let summary = err.lines().last().unwrap_or_default();
    assert!(
        summary.contains("prompt tokens")
            && summary.contains("tokens/s")
            && summary.contains("finish reason: "),
        "{err}"
    );
    let generated: usize = summary
        .split(", ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no generated count in {summary:?}"));
    match generated {
        5 => assert!(summary.ends_with("finish reason: length"), "{summary}"),
        0..5 => assert!(summary.ends_with("finish reason: stop"), "{summary}"),
        n => panic!("{n} tokens for --max-tokens 5: {summary}"),
    }
}
