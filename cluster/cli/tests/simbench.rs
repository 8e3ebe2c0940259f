//! `lockstep simbench` end to end on small workloads (`--scale`): the table and the JSON
//! of a run against the same binary as its baseline (peak RSS ratios near 1), the
//! iterations against `sim --json`'s, and a missing or failing binary named with the
//! workload.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

use common::{output_within, temp};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

/// Longest a command may take (hang protection, not a speed check).
const DEADLINE: Duration = Duration::from_secs(120);

fn lockstep(args: &[&str]) -> Output {
    let mut c = Command::new(BIN);
    c.args(args);
    output_within(c, DEADLINE)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn f64_at(v: &Value, path: &str) -> f64 {
    v.pointer(path)
        .and_then(Value::as_f64)
        .unwrap_or_else(|| panic!("no number at {path} in {v}"))
}

#[test]
fn against_itself_the_figures_are_there_and_the_memory_ratios_near_one() {
    let json = temp("simbench.json");
    let out = lockstep(&[
        "simbench",
        "--workload",
        "one-replica",
        "--workload",
        "agg-256k",
        "--workload",
        "agg-1m",
        "--scale",
        "0.002",
        "--runs",
        "2",
        "--baseline",
        BIN,
        "--json",
        json.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for needle in [
        "one-replica",
        "agg-256k",
        "agg-1m",
        "baseline",
        "old/new",
        "×",
        "CPU s min / median / max",
        "peak RSS MB",
        "iter / CPU s",
        "B/request",
        "bytes per request, agg-256k → agg-1m: (peak RSS at 2,000 − at 512) / 1,488 requests: new ",
    ] {
        assert!(stdout.contains(needle), "no {needle:?} in\n{stdout}");
    }
    // Four runs per workload, each announced on stderr.
    assert_eq!(stderr.matches("simbench: agg-1m ").count(), 4, "{stderr}");

    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let workloads = v["workloads"].as_array().expect("workloads");
    assert_eq!(workloads.len(), 3, "{v}");
    for w in workloads {
        let name = w["workload"].as_str().unwrap();
        for side in ["new", "baseline"] {
            let runs = w[side]["runs"].as_array().unwrap();
            assert_eq!(runs.len(), 2, "{name} {side}");
            for r in runs {
                let cpu = f64_at(r, "/cpu_s");
                assert!(cpu.is_finite() && cpu > 0.0, "{name} {side}: {r}");
                let rss = f64_at(r, "/peak_rss_bytes");
                assert!(rss > 1e6, "{name} {side}: a process of under 1 MB? {r}");
                assert!(f64_at(r, "/iterations") > 0.0, "{name} {side}: {r}");
            }
            assert!(f64_at(&w[side], "/iterations_per_cpu_s") > 0.0);
            assert!(f64_at(&w[side], "/bytes_per_request") > 0.0);
        }
        // The simulator is deterministic: both binaries (the same) ran the same iterations.
        assert_eq!(
            w["new"]["iterations"], w["baseline"]["iterations"],
            "{name}"
        );
        // CPU time on a busy machine is noise: only a sane ratio is asked of it.
        let cpu = f64_at(w, "/ratios/cpu_old_over_new");
        assert!(cpu.is_finite() && cpu > 0.0, "{name}: {cpu}");
        let rss = f64_at(w, "/ratios/rss_old_over_new");
        assert!((0.8..1.25).contains(&rss), "{name}: RSS ratio {rss}");
    }
    assert_eq!(v["marginal_bytes_per_request"]["to_requests"], 2000);
    assert!(f64_at(&v, "/marginal_bytes_per_request/baseline_bytes_per_request").is_finite());

    // The iterations are the report's: `sim --json` of the same run says as many.
    let one = &workloads[0];
    assert_eq!(one["workload"], "one-replica");
    let report = temp("one-replica.json");
    let scenario = format!(
        "{}/../../examples/simbench/agg-one-replica-2k256.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let requests = one["requests"].as_u64().unwrap();
    let sim = lockstep(&[
        "sim",
        &scenario,
        "--set",
        &format!("workload.num_requests={requests}"),
        "--json",
        report.to_str().unwrap(),
    ]);
    assert!(sim.status.success(), "{}", text(&sim.stderr));
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let iterations: u64 = r["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["iterations"].as_u64().unwrap())
        .sum();
    assert_eq!(one["new"]["iterations"].as_u64(), Some(iterations));
}

#[test]
fn a_missing_or_failing_binary_is_named_with_the_workload() {
    let out = lockstep(&["simbench", "--baseline", "/no/such/lockstep", "--quick"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--baseline /no/such/lockstep: no such file"),
        "{stderr}"
    );

    let out = lockstep(&[
        "simbench",
        "--binary",
        "/bin/false",
        "--workload",
        "disagg",
        "--scale",
        "0.001",
        "--runs",
        "1",
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("workload disagg, new binary /bin/false")
            && stderr.contains("exited with status 1"),
        "{stderr}"
    );
}
