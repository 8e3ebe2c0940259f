//! The report's user metrics (per-request times and queue time, ITL, goodput, the
//! per-server time series, preemptions) and the HTML page `lockstep report` writes
//! (checked as text here; `report_browser.rs` renders it in a real browser).

mod common;

use std::process::Command;

use common::{agg_text, parse, simulate, temp};
use lockstep_plan::report::html::{parse_run_file, render};
use lockstep_plan::report::series::MAX_POINTS;
use lockstep_plan::report::{Report, Slo, TimeBase};

fn ab_reports() -> Vec<(String, Report)> {
    let text = agg_text(4, true);
    vec![
        (
            "legacy".into(),
            simulate(&parse(&text, &["policy.preset=\"legacy\""])),
        ),
        ("fixed".into(), simulate(&parse(&text, &[]))),
    ]
}

#[test]
fn every_request_carries_its_times_and_queue_time_in_order() {
    let r = simulate(&parse(&agg_text(2, true), &[]));
    assert_eq!(r.requests.completed, 80);
    for d in &r.per_request {
        let sched = d.first_scheduled_ms().expect("every request was scheduled");
        let first = d.first_token_ms().expect("every request got a token");
        let end = d.end_ms().expect("every request ended");
        assert!(
            d.arrival_ms() <= sched && sched <= first && first <= end,
            "{d:?}"
        );
        assert_eq!(d.queue_ms(), Some(sched - d.arrival_ms()), "{d:?}");
        assert!(d.prompt_tokens >= 16, "{d:?}");
    }
    // 80 requests at once on 2 ranks of B 8: most of them queue.
    assert!(r.per_request.iter().any(|d| d.queue_ms().unwrap() > 0.0));
}

#[test]
fn itl_covers_every_gap_between_token_deliveries() {
    let r = simulate(&parse(&agg_text(2, true), &[]));
    // One token per delivery here, so the gaps of a request add up to its time from
    // first token to end, and there are (tokens - 1) of them.
    let (mut gaps, mut span_ms) = (0u64, 0.0);
    for d in &r.per_request {
        gaps += u64::from(d.output_tokens.saturating_sub(1));
        span_ms += d.end_ms().unwrap() - d.first_token_ms().unwrap();
    }
    let itl = r.latency_ms.itl;
    assert_eq!(itl.samples, gaps);
    assert!(
        (itl.mean - span_ms / gaps as f64).abs() < 1e-6 * itl.mean,
        "{itl:?}"
    );
    assert!(itl.p50 <= itl.p90 && itl.p90 <= itl.p99, "{itl:?}");
    // Output length 1 everywhere: no gap, reported as n/a.
    let one = simulate(&parse(&agg_text(2, true), &["workload.output_len=[1,1]"]));
    assert_eq!(one.latency_ms.itl.samples, 0);
    assert!(
        one.table().contains("  itl            n/a"),
        "{}",
        one.table()
    );
}

#[test]
fn goodput_counts_the_completed_requests_within_every_objective() {
    let mut r = simulate(&parse(&agg_text(2, true), &[]));
    let all = Slo {
        ttft_ms: Some(1e12),
        tpot_ms: Some(1e12),
        e2e_ms: None,
    };
    r.apply_slo(&all);
    let g = r.goodput.unwrap();
    assert_eq!(g.good_requests, 80);
    assert!((g.requests_per_s - r.throughput.requests_per_s).abs() < 1e-9);
    // The median TTFT as the objective: about half the requests meet it.
    let ttft = r.latency_ms.ttft.p50;
    r.apply_slo(&Slo {
        ttft_ms: Some(ttft),
        ..Slo::default()
    });
    let half = r.goodput.unwrap().good_requests;
    let expected = r
        .per_request
        .iter()
        .filter(|d| d.ttft_ms().unwrap() <= ttft)
        .count() as u64;
    assert_eq!(half, expected);
    assert!((30..=60).contains(&half), "{half}");
    assert!(r.table().contains("goodput"), "{}", r.table());
}

#[test]
fn a_bad_slo_on_the_command_line_names_the_key_and_the_value() {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["sim", "examples/ctx-only.toml", "--slo", "ttft_ms=soon"])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ttft_ms") && err.contains("`soon`"), "{err}");
}

#[test]
fn the_time_series_is_bounded_and_follows_kv_usage_and_the_queue() {
    let r = simulate(&parse(&agg_text(2, true), &[]));
    let s = &r.servers[0];
    let ts = &s.timeseries;
    assert!(!ts.is_empty() && ts.len() < MAX_POINTS);
    assert!(ts.windows(2).all(|w| w[0].t_s < w[1].t_s));
    assert!(ts.iter().all(|p| (0.0..=1.0).contains(&p.kv_usage)));
    assert!(ts.iter().any(|p| p.kv_usage > 0.0));
    // 80 requests at once: the queue starts long and drains.
    assert!(ts.iter().any(|p| p.waiting > 0));
    assert_eq!(ts.last().unwrap().waiting, 0);
    assert!(ts.iter().any(|p| p.running > 0));
}

#[test]
fn max_utilization_preemptions_are_counted_over_time() {
    let text = r#"
name = "preempt"
[[server]]
name = "agg0"
tensor_parallel_size = 1
max_batch_size = 16
max_num_tokens = 4096
[server.scheduler_config]
capacity_scheduler_policy = "MAX_UTILIZATION"
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 2048
[workload]
kind = "closed_loop"
concurrency = 48
num_requests = 48
input_len = [64, 256]
output_len = [100, 200]
"#;
    let r = simulate(&parse(text, &[]));
    assert_eq!(r.requests.completed, 48, "{:?}", r.outcome_detail);
    let s = &r.servers[0];
    assert!(s.preemptions > 0, "no preemption: {s:?}");
    let ts = &s.timeseries;
    assert!(ts.windows(2).all(|w| w[0].preemptions <= w[1].preemptions));
    assert!(ts.last().unwrap().preemptions > 0);
    assert!(r.table().contains("preemptions"), "{}", r.table());
}

/// The `data-points` of every series of one plot.
fn series_points(html: &str, plot: &str) -> Vec<usize> {
    let start = html
        .find(&format!("data-plot=\"{plot}\""))
        .unwrap_or_else(|| panic!("no plot {plot}"));
    let svg = &html[start..start + html[start..].find("</svg>").unwrap()];
    svg.match_indices("class=\"series\"")
        .map(|(i, _)| {
            let rest = &svg[i..];
            let at = rest.find("data-points=\"").unwrap() + 13;
            rest[at..at + rest[at..].find('"').unwrap()]
                .parse()
                .unwrap()
        })
        .collect()
}

#[test]
fn the_page_has_an_svg_per_plot_with_both_runs_and_no_external_url() {
    let runs = ab_reports();
    let html = render(&runs);
    // Three CDFs, the ITL percentiles, and per server: routing share, occupancy, KV
    // usage, waiting queue, balance ratio over iterations.
    assert_eq!(html.matches("<svg class=\"plot\"").count(), 4 + 5);
    let completed = runs[1].1.requests.completed as usize;
    assert_eq!(series_points(&html, "ttft CDF"), vec![completed, completed]);
    assert_eq!(series_points(&html, "e2e CDF").len(), 2);
    let multi = runs[1]
        .1
        .per_request
        .iter()
        .filter(|d| d.output_tokens > 1)
        .count();
    assert_eq!(series_points(&html, "tpot CDF")[1], multi);
    assert_eq!(series_points(&html, "agg0 routing share"), vec![4, 4]);
    assert_eq!(series_points(&html, "agg0 occupancy"), vec![4, 4]);
    let samples = runs[1].1.servers[0].timeseries.len();
    assert_eq!(series_points(&html, "agg0 kv usage")[1], samples);
    assert_eq!(series_points(&html, "agg0 waiting")[1], samples);
    // The balance ratio where some rank carried tokens.
    let ratios = runs[1].1.servers[0]
        .timeseries
        .iter()
        .filter(|p| p.balance_ratio.is_some())
        .count();
    assert!(ratios > 0 && ratios <= samples);
    assert_eq!(series_points(&html, "agg0 balance ratio")[1], ratios);
    assert!(html.matches("class=\"legend\"").count() >= 16);
    for axis in [
        "TTFT (ms)",
        "fraction of requests",
        "virtual time (s)",
        "rank",
        "mean / max tokens across ranks",
    ] {
        assert!(html.contains(axis), "no axis label {axis}");
    }
    assert!(!html.contains("http://") && !html.contains("https://"));
    assert!(!html.contains("src=") && !html.contains("href="));
    // A single run: one series per plot.
    let one = render(&runs[1..]);
    assert_eq!(series_points(&one, "ttft CDF"), vec![completed]);
}

#[test]
fn the_report_command_reads_sim_and_ab_json_and_names_a_bad_file() {
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let (json, html) = (temp("ab.json"), temp("ab.html"));
    let out = Command::new(bin)
        .args([
            "ab",
            "examples/ctx-only.toml",
            "--set",
            "workload.num_requests=200",
        ])
        .arg("--json")
        .arg(&json)
        .current_dir(root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs = parse_run_file(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(
        runs.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(),
        ["legacy", "fixed"]
    );
    let out = Command::new(bin)
        .arg("report")
        .arg(&json)
        .arg("-o")
        .arg(&html)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>") && page.contains("legacy vs fixed"));
    let garbage = temp("garbage.json");
    std::fs::write(&garbage, "{\"scenario\": 3}").unwrap();
    for (file, words) in [
        (garbage.clone(), "is not a lockstep report"),
        (temp("missing.json"), "reading"),
    ] {
        let out = Command::new(bin)
            .arg("report")
            .arg(&file)
            .arg("-o")
            .arg(temp("x.html"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&file.display().to_string()) && err.contains(words),
            "{err}"
        );
    }
}

/// One plot's SVG.
fn plot_svg<'a>(html: &'a str, plot: &str) -> &'a str {
    let start = html
        .find(&format!("data-plot=\"{plot}\""))
        .unwrap_or_else(|| panic!("no plot {plot}"));
    &html[start..start + html[start..].find("</svg>").unwrap()]
}

/// The y axis's tick labels of one plot (right-aligned texts), bottom to top.
fn y_tick_labels(html: &str, plot: &str) -> Vec<String> {
    let mark = "text-anchor=\"end\" font-size=\"11\">";
    plot_svg(html, plot)
        .match_indices(mark)
        .map(|(i, _)| {
            let rest = &plot_svg(html, plot)[i + mark.len()..];
            rest[..rest.find('<').unwrap()].to_string()
        })
        .collect()
}

#[test]
fn an_all_zero_series_gets_an_axis_whose_tick_labels_differ() {
    let mut r = simulate(&parse(&agg_text(2, true), &[]));
    for p in &mut r.servers[0].timeseries {
        p.waiting = 0;
    }
    let html = render(&[("fixed".into(), r)]);
    let labels = y_tick_labels(&html, "agg0 waiting");
    assert!(labels.len() >= 3, "{labels:?}");
    let mut distinct = labels.clone();
    distinct.dedup();
    assert_eq!(distinct, labels, "repeated tick labels");
    assert_eq!(labels.first().map(String::as_str), Some("0"));
    assert_eq!(labels.last().map(String::as_str), Some("1"));
}

#[test]
fn occupancy_and_routing_share_are_drawn_on_a_fixed_zero_to_one_axis() {
    let mut r = simulate(&parse(&agg_text(4, true), &[]));
    let s = &mut r.servers[0];
    let b = f64::from(s.max_batch_size);
    for k in &mut s.ranks {
        k.mean_scheduled_requests = 0.077 * b;
    }
    let html = render(&[("fixed".into(), r)]);
    // The plot area is 236 px high (340 less 52 above and 52 below).
    let svg = plot_svg(&html, "agg0 occupancy");
    let heights: Vec<f64> = svg
        .match_indices("class=\"bar\"")
        .map(|(i, _)| {
            let rest = &svg[i..];
            let at = rest.find("height=\"").unwrap() + 8;
            rest[at..at + rest[at..].find('"').unwrap()]
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(heights.len(), 4);
    for h in heights {
        assert!(h < 0.1 * 236.0, "an occupancy of 0.077 drawn {h} px high");
    }
    for plot in ["agg0 occupancy", "agg0 routing share"] {
        assert_eq!(y_tick_labels(&html, plot).last().unwrap(), "1", "{plot}");
    }
}

#[test]
fn the_page_has_an_itl_percentile_plot_and_says_why_bars() {
    let runs = ab_reports();
    let html = render(&runs);
    assert_eq!(series_points(&html, "itl percentiles"), vec![4, 4]);
    assert!(html.contains("ITL (ms)") && html.contains("every gap between"));
    // No gap at all (one output token each): the plot says so.
    let one = simulate(&parse(&agg_text(2, true), &["workload.output_len=[1,1]"]));
    let html = render(&[("fixed".into(), one)]);
    assert!(plot_svg(&html, "itl percentiles").contains("no samples"));
}

#[test]
fn the_summary_table_has_a_violations_row() {
    let mut runs = ab_reports();
    let s = &mut runs[0].1.servers[0];
    s.violation_count = 3;
    s.violations = serde_json::from_str(
        r#"[{"iteration": 7, "rank": 1, "kind": "Seats", "detail": "3 holders, 2 seats"}]"#,
    )
    .unwrap();
    let html = render(&runs);
    let row = &html[html.find("<tr><td>violations").expect("a violations row")..];
    let row = &row[..row.find("</tr>").unwrap()];
    assert!(
        row.contains(
            "<td>3 (agg0: 3); first: seats on rank 1 at iteration 7: 3 holders, 2 seats</td>"
        ),
        "{row}"
    );
    assert!(row.contains("<td>0</td>"), "{row}");
}

#[test]
fn a_bench_report_says_client_wall_time_and_names_no_policy() {
    let mut r = simulate(&parse(&agg_text(2, true), &[]));
    // What `lockstep bench` writes: the client's clock, no server sections.
    r.time_base = TimeBase::Client;
    r.servers.clear();
    let runs = parse_run_file(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(runs[0].0, "external server");
    let html = render(&runs);
    assert!(html.contains("client wall time (s)"), "no client clock");
    assert!(!html.contains("virtual"), "a client's clock called virtual");
    for policy in ["<th>fixed</th>", "<th>legacy</th>", ">fixed<", ">legacy<"] {
        assert!(!html.contains(policy), "a policy column: {policy}");
    }
    assert!(html.contains("<th>external server</th>"));
    assert!(html.contains("(external server)"));
    // A simulated run keeps its virtual clock and its policy.
    let sim = render(&ab_reports()[1..]);
    assert!(sim.contains("<td>virtual time (s)</td>") && sim.contains("<th>fixed</th>"));
}
