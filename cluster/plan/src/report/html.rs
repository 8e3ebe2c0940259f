//! `lockstep report RUN.json -o report.html`: one self-contained HTML page (inline SVG
//! made here, no script, nothing fetched) with the latency CDFs, per-rank routing share
//! and occupancy, and KV usage and waiting queue over time; an `ab` file's two runs are
//! overlaid in every plot.

use std::fmt::Write;

use serde::Deserialize;

use super::plot::{Axes, Series, bar_plot, escape, line_plot};
use super::schema::{Percentiles, Report};

/// Series colours: the first run (or `ab`'s base) and the second (the treatment).
const COLORS: [&str; 2] = ["#d62728", "#1f77b4"];
/// A CDF keeps at most this many points.
const CDF_POINTS: usize = 400;

/// A run file: one report (`sim`/`run --json`) or `ab --json`'s pair.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RunFile {
    Ab {
        base: Box<Report>,
        treatment: Box<Report>,
        #[serde(default)]
        base_name: Option<String>,
        #[serde(default)]
        treatment_name: Option<String>,
    },
    One(Box<Report>),
}

/// A run's name: its policy, or "external server" for `lockstep bench`'s report (a
/// client's view of a server whose policy it cannot know).
fn policy_name(r: &Report) -> String {
    if is_external(r) {
        "external server".into()
    } else if r.legacy_switches.is_empty() {
        "fixed".into()
    } else {
        "legacy".into()
    }
}

/// Whether the report is a client's (`lockstep bench`) of an external server.
fn is_external(r: &Report) -> bool {
    matches!(r.time_base, super::schema::TimeBase::Client)
}

/// The named reports of a run file's text: one, or `ab`'s base and treatment (named by
/// their policies).
pub fn parse_run_file(text: &str) -> Result<Vec<(String, Report)>, serde_json::Error> {
    Ok(match serde_json::from_str::<RunFile>(text) {
        Ok(RunFile::One(r)) => vec![(policy_name(&r), *r)],
        Ok(RunFile::Ab {
            base,
            treatment,
            base_name,
            treatment_name,
        }) => {
            let a = base_name.unwrap_or_else(|| format!("base ({})", policy_name(&base)));
            let mut b = treatment_name
                .unwrap_or_else(|| format!("treatment ({})", policy_name(&treatment)));
            if a == b {
                b.push_str(" (treatment)");
            }
            vec![(a, *base), (b, *treatment)]
        }
        // An untagged enum's error says nothing useful: parse as one report for the
        // message (which field, which line).
        Err(_) => {
            let r: Report = serde_json::from_str(text)?;
            vec![(policy_name(&r), r)]
        }
    })
}

/// `(value, fraction of requests ≤ value)`, at most [`CDF_POINTS`] points.
fn cdf(mut values: Vec<f64>) -> Vec<(f64, f64)> {
    values.retain(|v| v.is_finite());
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(CDF_POINTS).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (values[i], (i + 1) as f64 / n as f64))
        .collect();
    if pts.last().map(|p| p.1) != Some(1.0) {
        pts.push((values[n - 1], 1.0));
    }
    pts
}

/// The measured, completed requests' latencies.
fn latencies(r: &Report, f: impl Fn(&super::RequestDetail) -> Option<f64>) -> Vec<f64> {
    r.per_request
        .iter()
        .filter(|d| d.id > r.requests.warmup && d.failure().is_none())
        .filter_map(f)
        .collect()
}

fn fmt_p(p: &Percentiles) -> String {
    if p.samples == 0 {
        "n/a".into()
    } else {
        format!("{:.2} / {:.2} / {:.2}", p.mean, p.p50, p.p99)
    }
}

fn summary_table(runs: &[(String, Report)]) -> String {
    let mut o = String::from("<table><tr><th>metric</th>");
    for (name, _) in runs {
        let _ = write!(o, "<th>{}</th>", escape(name));
    }
    o.push_str("</tr>");
    let mut row = |name: &str, f: &dyn Fn(&Report) -> String| {
        let _ = write!(o, "<tr><td>{}</td>", escape(name));
        for (_, r) in runs {
            let _ = write!(o, "<td>{}</td>", escape(&f(r)));
        }
        o.push_str("</tr>");
    };
    row("outcome", &|r| r.outcome.name().to_string());
    row("requests completed / failed (warm-up)", &|r| {
        format!(
            "{} / {} ({})",
            r.requests.completed, r.requests.failed, r.requests.warmup
        )
    });
    let clocks: Vec<&str> = runs.iter().map(|(_, r)| time_unit(r)).collect();
    let clock = match clocks.first() {
        Some(c) if clocks.iter().all(|d| d == c) => *c,
        _ => "run",
    };
    row(&format!("{clock} time (s)"), &|r| {
        format!("{:.3}", r.virtual_time_s)
    });
    row("throughput (tok/s total, output; req/s)", &|r| {
        format!(
            "{:.1}, {:.1}; {:.3}",
            r.throughput.total_tokens_per_s,
            r.throughput.output_tokens_per_s,
            r.throughput.requests_per_s
        )
    });
    row("goodput (req/s)", &|r| match &r.goodput {
        Some(g) => format!(
            "{:.3} ({} requests within {})",
            g.requests_per_s,
            g.good_requests,
            g.slo.describe()
        ),
        None => "n/a (no --slo)".into(),
    });
    row("front door", &|r| match &r.frontend {
        Some(door) => door.describe(),
        None => "none".into(),
    });
    row("TTFT ms mean / p50 / p99", &|r| fmt_p(&r.latency_ms.ttft));
    row("TPOT ms mean / p50 / p99", &|r| fmt_p(&r.latency_ms.tpot));
    row("ITL ms mean / p50 / p99", &|r| fmt_p(&r.latency_ms.itl));
    row("E2E ms mean / p50 / p99", &|r| fmt_p(&r.latency_ms.e2e));
    row("violations (§10)", &|r| {
        if is_external(r) {
            return "n/a (external server)".into();
        }
        let total: u64 = r.servers.iter().map(|s| s.violation_count).sum();
        let mut t = total.to_string();
        let on: Vec<String> = r
            .servers
            .iter()
            .filter(|s| s.violation_count > 0)
            .map(|s| format!("{}: {}", s.name, s.violation_count))
            .collect();
        if !on.is_empty() {
            let _ = write!(t, " ({})", on.join(", "));
        }
        if let Some(v) = r.servers.iter().find_map(|s| s.violations.first()) {
            let _ = write!(
                t,
                "; first: {} on rank {} at iteration {}: {}",
                v.kind.name(),
                v.rank.0,
                v.iteration,
                v.detail
            );
        }
        t
    });
    if let Some((_, first)) = runs.first() {
        for (i, s) in first.servers.iter().enumerate() {
            row(&format!("{}: occupancy", s.name), &|r| {
                r.servers
                    .get(i)
                    .map_or("n/a".into(), |s| format!("{:.3}", s.occupancy))
            });
            row(&format!("{}: prefix cache hit rate", s.name), &|r| {
                r.servers.get(i).map_or("n/a".into(), |s| {
                    let looked_up = s.kv.reuse_hits + s.kv.allocations;
                    if looked_up == 0 {
                        "n/a".into()
                    } else {
                        format!("{:.1}%", s.kv.reuse_hits as f64 / looked_up as f64 * 100.0)
                    }
                })
            });
            row(
                &format!(
                    "{}: balance ratio; speed-of-light output tok/s (gap)",
                    s.name
                ),
                &|r| {
                    r.servers.get(i).map_or("n/a".into(), |s| {
                        let b = &s.balance;
                        match b.mean_ratio {
                            Some(ratio) => format!(
                                "{ratio:.3}; {:.1} ({:.1}%)",
                                b.sol_output_tokens_per_s,
                                b.sol_gap * 100.0
                            ),
                            None => "n/a".into(),
                        }
                    })
                },
            );
            row(&format!("{}: preemptions", s.name), &|r| {
                r.servers
                    .get(i)
                    .map_or("n/a".into(), |s| s.preemptions.to_string())
            });
        }
    }
    o.push_str("</table>");
    o
}

fn time_unit(r: &Report) -> &'static str {
    match r.time_base {
        super::schema::TimeBase::Virtual => "virtual",
        super::schema::TimeBase::Modeled { .. } => "modeled",
        super::schema::TimeBase::ZeroCost | super::schema::TimeBase::RealModel => "wall",
        super::schema::TimeBase::Client => "client wall",
    }
}

/// The page for one report, or for `ab`'s two (overlaid).
pub fn render(runs: &[(String, Report)]) -> String {
    let series = |f: &dyn Fn(&Report) -> Vec<(f64, f64)>| -> Vec<Series> {
        runs.iter()
            .enumerate()
            .map(|(i, (name, r))| Series {
                name: name.clone(),
                color: COLORS[(i + usize::from(runs.len() == 1)) % 2].to_string(),
                points: f(r),
            })
            .collect()
    };
    let clock = runs.first().map_or("virtual", |(_, r)| time_unit(r));
    let mut plots: Vec<(String, String)> = Vec::new();
    for (metric, f) in [
        (
            "TTFT",
            &(|d: &super::RequestDetail| d.ttft_ms())
                as &dyn Fn(&super::RequestDetail) -> Option<f64>,
        ),
        ("TPOT", &|d| d.tpot_ms().filter(|_| d.output_tokens > 1)),
        ("E2E", &|d| d.e2e_ms()),
    ] {
        let axes = Axes {
            title: format!("{metric} CDF"),
            x_label: format!("{metric} (ms)"),
            y_label: "fraction of requests".into(),
        };
        let s = series(&|r| cdf(latencies(r, f)));
        plots.push((
            format!("{} CDF", metric.to_lowercase()),
            line_plot(&axes, &s, Some((0.0, 1.0))),
        ));
    }
    // ITL is a gap between two token deliveries, not a request's: the report keeps its
    // percentiles over every gap (no per-request values), drawn as bars.
    let itl_stats = ["mean", "p50", "p90", "p99"];
    plots.push((
        "itl percentiles".into(),
        bar_plot(
            &Axes {
                title: "ITL percentiles (every token gap)".into(),
                x_label: "statistic".into(),
                y_label: "ITL (ms)".into(),
            },
            &itl_stats.map(String::from),
            &series(&|r| {
                let p = &r.latency_ms.itl;
                if p.samples == 0 {
                    Vec::new()
                } else {
                    [p.mean, p.p50, p.p90, p.p99]
                        .into_iter()
                        .enumerate()
                        .map(|(i, v)| (i as f64, v))
                        .collect()
                }
            }),
            None,
        ),
    ));
    let servers: Vec<String> = runs
        .first()
        .map(|(_, r)| r.servers.iter().map(|s| s.name.clone()).collect())
        .unwrap_or_default();
    for (si, server) in servers.iter().enumerate() {
        let ranks = runs
            .iter()
            .filter_map(|(_, r)| r.servers.get(si))
            .map(|s| s.ranks.len())
            .max()
            .unwrap_or(0);
        let categories: Vec<String> = (0..ranks).map(|k| format!("rank {k}")).collect();
        let per_rank = |f: &dyn Fn(&super::schema::ServerReport, usize) -> f64| {
            series(&|r| {
                r.servers.get(si).map_or(Vec::new(), |s| {
                    (0..s.ranks.len()).map(|k| (k as f64, f(s, k))).collect()
                })
            })
        };
        plots.push((
            format!("{server} routing share"),
            bar_plot(
                &Axes {
                    title: format!("{server}: routing share per rank"),
                    x_label: "rank".into(),
                    y_label: "share of routed requests".into(),
                },
                &categories,
                &per_rank(&|s, k| s.ranks[k].routing_share),
                Some((0.0, 1.0)),
            ),
        ));
        plots.push((
            format!("{server} occupancy"),
            bar_plot(
                &Axes {
                    title: format!("{server}: occupancy per rank"),
                    x_label: "rank".into(),
                    y_label: "requests per forward / max batch".into(),
                },
                &categories,
                &per_rank(&|s, k| {
                    s.ranks[k].mean_scheduled_requests / f64::from(s.max_batch_size.max(1))
                }),
                Some((0.0, 1.0)),
            ),
        ));
        let over_time = |f: &dyn Fn(&super::schema::SeriesPoint) -> f64| {
            series(&|r| {
                r.servers.get(si).map_or(Vec::new(), |s| {
                    s.timeseries.iter().map(|p| (p.t_s, f(p))).collect()
                })
            })
        };
        plots.push((
            format!("{server} kv usage"),
            line_plot(
                &Axes {
                    title: format!("{server}: KV cache usage"),
                    x_label: format!("{clock} time (s)"),
                    y_label: "KV blocks used (fraction)".into(),
                },
                &over_time(&|p| p.kv_usage),
                Some((0.0, 1.0)),
            ),
        ));
        plots.push((
            format!("{server} waiting"),
            line_plot(
                &Axes {
                    title: format!("{server}: waiting queue"),
                    x_label: format!("{clock} time (s)"),
                    y_label: "requests waiting".into(),
                },
                &over_time(&|p| p.waiting as f64),
                None,
            ),
        ));
        // Over iterations, as TensorRT-LLM's ADP balance blog plots it; idle iterations
        // (no token anywhere) have no ratio.
        let by_iteration = series(&|r| {
            r.servers.get(si).map_or(Vec::new(), |s| {
                s.timeseries
                    .iter()
                    .filter_map(|p| p.balance_ratio.map(|b| (p.iteration as f64, b)))
                    .collect()
            })
        });
        if ranks > 1 {
            plots.push((
                format!("{server} balance ratio"),
                line_plot(
                    &Axes {
                        title: format!("{server}: balance ratio"),
                        x_label: "iteration".into(),
                        y_label: "mean / max tokens across ranks".into(),
                    },
                    &by_iteration,
                    Some((0.0, 1.0)),
                ),
            ));
        }
    }
    let title = match runs {
        [(_, r)] if is_external(r) => {
            format!("lockstep bench: {} (external server)", r.scenario)
        }
        [(_, r)] => format!("lockstep report: {}", r.scenario),
        [(a, r), (b, _), ..] => format!("lockstep ab: {} ({a} vs {b})", r.scenario),
        [] => "lockstep report".into(),
    };
    let mut o = String::new();
    let _ = write!(
        o,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title><style>\
body{{font-family:sans-serif;margin:16px;color:#222;background:#fafafa}}\
table{{border-collapse:collapse;margin:8px 0 16px}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}}\
.plots{{display:flex;flex-wrap:wrap;gap:12px}}.plots figure{{margin:0;border:1px solid #ddd;background:#fff}}\
</style></head><body><h1>{t}</h1>",
        t = escape(&title)
    );
    o.push_str(&summary_table(runs));
    o.push_str("<div class=\"plots\">");
    for (name, svg) in &plots {
        let _ = write!(o, "<figure data-plot=\"{}\">{svg}</figure>", escape(name));
    }
    o.push_str("</div><p>Times are on the report's clock (");
    o.push_str(clock);
    o.push_str(" time");
    if runs.iter().any(|(_, r)| is_external(r)) {
        o.push_str("; a client cannot see an external server's ranks: no server plots");
    }
    o.push_str(
        "). The TTFT, TPOT and E2E CDFs are over requests; ITL is over every gap between \
two token deliveries, kept as percentiles only, hence bars. Every term is explained in \
the glossary of docs/mechanisms.md.</p></body></html>\n",
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cdf_is_bounded_increasing_and_ends_at_one() {
        let c = cdf((0..10_000).map(f64::from).rev().collect());
        assert!(c.len() <= CDF_POINTS + 1);
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1));
        assert_eq!(c.last().unwrap(), &(9999.0, 1.0));
        assert!(cdf(Vec::new()).is_empty());
    }
}
