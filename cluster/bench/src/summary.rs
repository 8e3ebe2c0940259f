//! vLLM `benchmark_serving`'s result block, from a report: the lines a user of that
//! script compares (throughputs; TTFT, TPOT, ITL and E2EL mean, median, p99; goodput),
//! then why requests failed, most common reason first.

use std::collections::BTreeMap;
use std::fmt::Write;

use lockstep_plan::report::{Percentiles, Report};

/// Failure reasons listed at most.
const REASONS_SHOWN: usize = 5;

fn line(o: &mut String, name: &str, value: impl std::fmt::Display) {
    let _ = writeln!(o, "{name:<40} {value:<10}");
}

/// A latency's lines; `n/a` where nothing was measured (no request completed, or the
/// metric does not apply), not a 0.00 that reads as a measurement.
fn latency(o: &mut String, title: &str, short: &str, p: &Percentiles) {
    let _ = writeln!(o, "{title:-^50}");
    let value = |v: f64| {
        if p.samples == 0 {
            "n/a".to_string()
        } else {
            format!("{v:.2}")
        }
    };
    line(o, &format!("Mean {short} (ms):"), value(p.mean));
    line(o, &format!("Median {short} (ms):"), value(p.p50));
    line(o, &format!("P99 {short} (ms):"), value(p.p99));
}

/// The result block of `report`.
pub fn vllm_summary(report: &Report) -> String {
    let mut o = String::new();
    let warmup = report.requests.warmup;
    let measured = report.per_request.iter().filter(|d| d.id > warmup);
    let (mut ok, mut input, mut output, mut failed) = (0u64, 0u64, 0u64, 0u64);
    let mut reasons: BTreeMap<&str, u64> = BTreeMap::new();
    for d in measured {
        match d.failure() {
            None => {
                ok += 1;
                input += u64::from(d.prompt_tokens);
                output += u64::from(d.output_tokens);
            }
            Some(why) => {
                failed += 1;
                *reasons.entry(why).or_default() += 1;
            }
        }
    }
    let t = &report.throughput;
    let l = &report.latency_ms;
    let _ = writeln!(o, "{:=^50}", " Serving Benchmark Result ");
    line(&mut o, "Successful requests:", ok);
    line(&mut o, "Failed requests:", failed);
    line(
        &mut o,
        "Benchmark duration (s):",
        format!("{:.2}", t.duration_s),
    );
    line(&mut o, "Total input tokens:", input);
    line(&mut o, "Total generated tokens:", output);
    line(
        &mut o,
        "Request throughput (req/s):",
        format!("{:.2}", t.requests_per_s),
    );
    line(
        &mut o,
        "Output token throughput (tok/s):",
        format!("{:.2}", t.output_tokens_per_s),
    );
    line(
        &mut o,
        "Total Token throughput (tok/s):",
        format!("{:.2}", t.total_tokens_per_s),
    );
    if let Some(g) = &report.goodput {
        line(
            &mut o,
            "Request goodput (req/s):",
            format!("{:.2}", g.requests_per_s),
        );
    }
    latency(&mut o, "Time to First Token", "TTFT", &l.ttft);
    latency(
        &mut o,
        "Time per Output Token (excl. 1st token)",
        "TPOT",
        &l.tpot,
    );
    latency(&mut o, "Inter-token Latency", "ITL", &l.itl);
    latency(&mut o, "End-to-end Latency", "E2EL", &l.e2e);
    let _ = writeln!(o, "{:=^50}", "");
    if !reasons.is_empty() {
        let mut by_count: Vec<(&str, u64)> = reasons.into_iter().collect();
        by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let _ = writeln!(o, "failed requests by reason:");
        for (why, n) in by_count.iter().take(REASONS_SHOWN) {
            let _ = writeln!(o, "  {n} × {why}");
        }
        if by_count.len() > REASONS_SHOWN {
            let _ = writeln!(
                o,
                "  ... and {} other reasons (see per_request in --json)",
                by_count.len() - REASONS_SHOWN
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_plan::report::{RequestDetail, Throughput};

    fn detail(id: u64, failure: Option<&str>) -> RequestDetail {
        let mut d = RequestDetail::new(id, 10, 0);
        d.output_tokens = 4;
        d.set_first_token_ns(Some(1_000_000));
        d.end(
            2_000_000,
            failure.map(|why| (lockstep_actors::vocab::FailureKind::Client, why.to_string())),
        );
        d
    }

    #[test]
    fn the_block_counts_measured_requests_and_lists_reasons() {
        let report: Report = serde_json::from_value(serde_json::json!({
            "scenario": "s", "legacy_switches": [], "seed": 0, "outcome": "completed",
            "outcome_detail": null,
            "requests": {"submitted": 4, "completed": 2, "failed": 2, "warmup": 1},
            "virtual_time_s": 1.0, "wall_time_s": 1.0,
            "throughput": {"total_tokens_per_s": 28.0, "output_tokens_per_s": 8.0,
                           "requests_per_s": 2.0, "duration_s": 1.0},
            "latency_ms": {"ttft": {"samples": 1, "mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0},
                           "tpot": {"samples": 1, "mean": 0.5, "p50": 0.5, "p90": 0.5, "p99": 0.5},
                           "e2e": {"samples": 1, "mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}},
            "servers": [], "per_request": []
        }))
        .unwrap();
        let report = Report {
            per_request: vec![
                detail(1, None),
                detail(2, None),
                detail(3, Some("HTTP 401: key")),
                detail(4, Some("HTTP 401: key")),
            ],
            throughput: Throughput {
                duration_s: 1.0,
                ..report.throughput
            },
            ..report
        };
        let s = vllm_summary(&report);
        assert!(
            s.contains("Successful requests:                     1 "),
            "{s}"
        );
        assert!(
            s.contains("Failed requests:                         2 "),
            "{s}"
        );
        assert!(
            s.contains("Total input tokens:                      10 "),
            "{s}"
        );
        assert!(
            s.contains("Mean TTFT (ms):                          1.00"),
            "{s}"
        );
        assert!(
            s.contains("P99 E2EL (ms):                           2.00"),
            "{s}"
        );
        assert!(s.contains("2 × HTTP 401: key"), "{s}");
    }

    #[test]
    fn a_bench_where_every_request_failed_shows_no_latency() {
        let report: Report = serde_json::from_value(serde_json::json!({
            "scenario": "s", "legacy_switches": [], "seed": 0, "outcome": "incomplete",
            "outcome_detail": "2 of 2 requests did not complete",
            "requests": {"submitted": 2, "completed": 0, "failed": 2, "warmup": 0},
            "virtual_time_s": 1.0, "wall_time_s": 1.0,
            "throughput": {"total_tokens_per_s": 0.0, "output_tokens_per_s": 0.0,
                           "requests_per_s": 0.0, "duration_s": 1.0},
            "latency_ms": {"ttft": {"samples": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0},
                           "tpot": {"samples": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0},
                           "e2e": {"samples": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}},
            "servers": [], "per_request": []
        }))
        .unwrap();
        let report = Report {
            per_request: vec![
                detail(1, Some("connection refused")),
                detail(2, Some("connection refused")),
            ],
            ..report
        };
        let s = vllm_summary(&report);
        assert!(
            s.contains("Mean TTFT (ms):                          n/a"),
            "{s}"
        );
        assert!(
            s.contains("P99 E2EL (ms):                           n/a"),
            "{s}"
        );
        assert!(!s.contains("(ms):                           0.00"), "{s}");
    }
}
