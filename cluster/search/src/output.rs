//! What a search hands back: the ranked table and the Pareto front as text, CSV and an
//! HTML page (inline SVG), and each winner as a scenario and TensorRT-LLM YAML.

use std::fmt::Write as _;
use std::path::Path;

use lockstep_plan::report::plot::{Axes, Series, escape, lines_and_dots};
use lockstep_plan::scenario::Scenario;

use crate::space::space_workload;
use crate::spec::LoadKind;
use crate::{Ranked, SearchError, SearchOutcome, spec::SearchSpec, written_candidate_model};

/// The summary, the ranked table (its first `top` rows) and the Pareto front.
pub fn text(spec: &SearchSpec, o: &SearchOutcome, top: usize) -> String {
    let mut t = String::new();
    let simulated = o.ranked.len();
    let pruned: u64 = o.pruned.values().sum();
    let _ = writeln!(
        t,
        "search {}: {} candidates, {} pruned, {} simulated ({} simulations)",
        o.name, o.candidates, pruned, simulated, o.simulations
    );
    for (reason, n) in &o.pruned {
        let _ = writeln!(t, "  pruned {n:>6}  {reason}");
    }
    let bounds = spec.slo.bounds();
    let objectives: Vec<String> = bounds
        .iter()
        .map(|b| format!("{} ≤ {} ms", b.key(), b.limit_ms))
        .collect();
    let _ = writeln!(
        t,
        "objectives: {}",
        if objectives.is_empty() {
            "none (the highest load)".into()
        } else {
            objectives.join(", ")
        }
    );
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "{:>3}  {:<52} {:>5} {:>7} {:>10} {:>10} {:>7}  objectives at that load; binding",
        "#",
        "configuration",
        "GPUs",
        load_header(spec),
        "tok/s/GPU",
        "tok/s/user",
        "balance",
    );
    for (i, r) in o.ranked.iter().take(top).enumerate() {
        let _ = writeln!(t, "{}", row(spec, i + 1, r));
    }
    if o.ranked.len() > top {
        let _ = writeln!(t, "  … {} more (CSV)", o.ranked.len() - top);
    }
    let _ = writeln!(t);
    let _ = writeln!(
        t,
        "Pareto front (tokens/s/GPU against tokens/s/user, every point meeting the objectives):"
    );
    for p in &o.pareto {
        let _ = writeln!(
            t,
            "  {:>10.1} tok/s/GPU  {:>8.1} tok/s/user  {}  {}",
            p.tokens_per_gpu,
            p.tokens_per_user,
            load_text(spec, p.load),
            p.label
        );
    }
    t.push_str(&ascii_front(o));
    t
}

/// The load column's name.
fn load_header(spec: &SearchSpec) -> &'static str {
    match spec.workload.load_kind() {
        LoadKind::Concurrency => "clients",
        LoadKind::Rate => "req/s",
    }
}

/// A load as the table shows it.
fn load_cell(spec: &SearchSpec, load: f64) -> String {
    match spec.workload.load_kind() {
        LoadKind::Concurrency => format!("{load:.0}"),
        LoadKind::Rate => format!("{load:.2}"),
    }
}

/// A load in words: `41 clients`, `2.50 req/s`.
fn load_text(spec: &SearchSpec, load: f64) -> String {
    format!("{} {}", load_cell(spec, load), load_header(spec))
}

fn row(spec: &SearchSpec, n: usize, r: &Ranked) -> String {
    let bounds = spec.slo.bounds();
    let Some(best) = &r.evaluation.best else {
        return format!(
            "{n:>3}  {:<52} {:>5} {:>7} {:>10} {:>10} {:>7}  no load meets them: {}",
            r.candidate.label(),
            r.candidate.gpus(),
            "-",
            "-",
            "-",
            "-",
            r.evaluation.binding
        );
    };
    let values: Vec<String> = bounds
        .iter()
        .map(|b| {
            format!(
                "{} {:.1}",
                b.key().trim_start_matches("slo."),
                best.value(b)
            )
        })
        .collect();
    let mut s = format!(
        "{n:>3}  {:<52} {:>5} {:>7} {:>10.1} {:>10.1} {:>7}  {}; binding: {}",
        r.candidate.label(),
        r.gpus_needed.unwrap_or(r.candidate.gpus()),
        load_cell(spec, best.load),
        r.tokens_per_gpu(),
        best.tokens_per_user(),
        best.balance.map_or("-".into(), |b| format!("{b:.3}")),
        values.join(", "),
        r.evaluation.binding
    );
    if let Some(sd) = &r.seeds {
        let _ = write!(
            s,
            "; {} of {} seeds meet them, tok/s/GPU {:.1}–{:.1}",
            sd.met, sd.runs, sd.tokens_per_gpu.0, sd.tokens_per_gpu.1
        );
    }
    s
}

/// The front and every feasible point, 64 × 16 characters.
fn ascii_front(o: &SearchOutcome) -> String {
    const W: usize = 64;
    const H: usize = 16;
    let mut t = String::new();
    if o.pareto.is_empty() {
        return t;
    }
    let xmax = o
        .pareto
        .iter()
        .map(|p| p.tokens_per_user)
        .fold(0.0, f64::max)
        .max(1e-9);
    let ymax = o
        .pareto
        .iter()
        .map(|p| p.tokens_per_gpu)
        .fold(0.0, f64::max)
        .max(1e-9);
    let mut grid = vec![vec![' '; W]; H];
    for p in &o.pareto {
        let x = ((p.tokens_per_user / xmax) * (W - 1) as f64).round() as usize;
        let y = ((p.tokens_per_gpu / ymax) * (H - 1) as f64).round() as usize;
        grid[H - 1 - y.min(H - 1)][x.min(W - 1)] = '*';
    }
    let _ = writeln!(t, "  tok/s/GPU (max {ymax:.0})");
    for line in grid {
        let _ = writeln!(t, "  |{}", line.into_iter().collect::<String>());
    }
    let _ = writeln!(t, "  +{}", "-".repeat(W));
    let _ = writeln!(t, "   tok/s/user → (max {xmax:.0})");
    t
}

/// Every simulated candidate, one CSV row each.
pub fn write_csv(spec: &SearchSpec, o: &SearchOutcome, path: &Path) -> Result<(), SearchError> {
    let err = |e: csv::Error| SearchError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    let mut w = csv::Writer::from_path(path).map_err(err)?;
    let bounds = spec.slo.bounds();
    let mut header: Vec<String> = [
        "rank",
        "configuration",
        "mode",
        "gpus",
        "gpus_needed",
        load_header(spec),
        "output_tokens_per_s",
        "tokens_per_s_per_gpu",
        "tokens_per_s_per_user",
        "requests_per_s",
        "balance",
        "bound_tokens_per_s_per_gpu",
        "binding",
        "seeds_met",
        "seeds_run",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    header.extend(bounds.iter().map(|b| b.key()));
    w.write_record(&header).map_err(err)?;
    for (i, r) in o.ranked.iter().enumerate() {
        let best = r.evaluation.best.as_ref();
        let f = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
        let mut rec = vec![
            (i + 1).to_string(),
            r.candidate.label(),
            format!("{:?}", r.candidate.mode).to_lowercase(),
            r.candidate.gpus().to_string(),
            r.gpus_needed.map_or(String::new(), |g| g.to_string()),
            best.map_or(String::new(), |m| load_cell(spec, m.load)),
            f(best.map(|m| m.output_tokens_per_s)),
            f(best.map(|_| r.tokens_per_gpu())),
            f(best.map(|m| m.tokens_per_user())),
            f(best.map(|m| m.requests_per_s)),
            f(best.and_then(|m| m.balance)),
            format!("{:.3}", r.cheap.tokens_per_gpu),
            r.evaluation.binding.clone(),
            r.seeds
                .as_ref()
                .map_or(String::new(), |s| s.met.to_string()),
            r.seeds
                .as_ref()
                .map_or(String::new(), |s| s.runs.to_string()),
        ];
        rec.extend(bounds.iter().map(|b| f(best.map(|m| m.value(b)))));
        w.write_record(&rec).map_err(err)?;
    }
    w.flush().map_err(|e| SearchError::Output {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// The scenario of the `n`-th ranked candidate at its best load (`None`: no load).
pub fn winner_scenario(spec: &SearchSpec, r: &Ranked) -> Option<Scenario> {
    let best = r.evaluation.best.as_ref()?;
    let c = &r.candidate;
    let mut s = c.scenario(
        spec.name(),
        written_candidate_model(spec, c),
        &r.kv_tokens_per_rank,
        space_workload(spec, best.load, spec.seed, 0, r.cheap.unloaded_request_s),
        spec,
    );
    s.seed = Some(spec.seed);
    Some(s)
}

/// A scenario as a file `lockstep sim` reads; `policy` is its `[policy]` as written
/// (none: the fixed policy).
pub fn scenario_toml(s: &Scenario, policy: Option<&toml::Table>) -> Result<String, String> {
    let mut t = toml::Table::new();
    t.insert("name".into(), s.name.clone().into());
    if let Some(d) = &s.description {
        t.insert("description".into(), d.clone().into());
    }
    if let Some(seed) = s.seed {
        t.insert("seed".into(), toml::Value::Integer(seed as i64));
    }
    if let Some(policy) = policy {
        t.insert("policy".into(), toml::Value::Table(policy.clone()));
    }
    let enc = |e: toml::ser::Error| e.to_string();
    t.insert(
        "model".into(),
        toml::Value::try_from(&s.model).map_err(enc)?,
    );
    t.insert(
        "frontend".into(),
        toml::Value::try_from(s.frontend).map_err(enc)?,
    );
    if let Some(w) = &s.workload {
        let mut table = toml::Value::try_from(w).map_err(enc)?;
        // A trace's records give the lengths: the synthetic ones would only mislead.
        if w.kind == lockstep_plan::workload::WorkloadKind::Trace
            && let Some(keys) = table.as_table_mut()
        {
            keys.remove("input_len");
            keys.remove("output_len");
        }
        t.insert("workload".into(), table);
    }
    let servers: Result<Vec<toml::Value>, String> = s
        .servers
        .iter()
        .map(|sv| toml::Value::try_from(sv).map_err(enc))
        .collect();
    t.insert("server".into(), toml::Value::Array(servers?));
    toml::to_string(&t).map_err(enc)
}

/// Writes the first `n` winners into `dir` as `winner-K.toml` (a scenario at the load
/// found) and `winner-K.yml` (TensorRT-LLM's YAML); returns the files written and what
/// the YAML could not say.
pub fn write_winners(
    spec: &SearchSpec,
    o: &SearchOutcome,
    dir: &Path,
    n: usize,
) -> Result<Vec<String>, SearchError> {
    let mut notes = Vec::new();
    for (k, r) in o.ranked.iter().take(n).enumerate() {
        let Some(mut s) = winner_scenario(spec, r) else {
            break;
        };
        let toml_path = dir.join(format!("winner-{}.toml", k + 1));
        let out = |path: &Path, message: String| SearchError::Output {
            path: path.display().to_string(),
            message,
        };
        let text = scenario_toml(&s, spec.policy_table.as_ref()).map_err(|m| out(&toml_path, m))?;
        let header = format!(
            "# `lockstep search` winner {} of {}: {}\n# {:.1} output tokens/s per GPU at {}\n",
            k + 1,
            o.name,
            r.candidate.label(),
            r.tokens_per_gpu(),
            r.evaluation
                .best
                .as_ref()
                .map_or(String::new(), |m| load_text(spec, m.load)),
        );
        std::fs::write(&toml_path, header + &text).map_err(|e| out(&toml_path, e.to_string()))?;
        notes.push(toml_path.display().to_string());
        let yml_path = dir.join(format!("winner-{}.yml", k + 1));
        // TensorRT-LLM's YAML describes one aggregated server: replicas are said apart.
        let replicas = if r.candidate.mode == crate::spec::Mode::Agg {
            let n = s.servers.len();
            s.servers.truncate(1);
            n
        } else {
            1
        };
        s.base_dir = dir.to_path_buf();
        match lockstep_plan::trtllm::export(&s, &yml_path) {
            Ok(e) => {
                let mut yaml = String::new();
                if replicas > 1 {
                    let _ = writeln!(yaml, "# {replicas} replicas of this server");
                }
                for ne in &e.not_expressible {
                    let _ = writeln!(yaml, "# not expressible: {ne}");
                }
                yaml.push_str(&e.yaml);
                std::fs::write(&yml_path, yaml).map_err(|e| out(&yml_path, e.to_string()))?;
                notes.push(yml_path.display().to_string());
            }
            Err(e) => notes.push(format!("{}: not written: {e}", yml_path.display())),
        }
    }
    Ok(notes)
}

/// One HTML page: the Pareto front over every feasible point (inline SVG) and the
/// ranked table.
pub fn html(spec: &SearchSpec, o: &SearchOutcome) -> String {
    let bounds = spec.slo.bounds();
    let dots: Vec<(f64, f64)> = o
        .ranked
        .iter()
        .flat_map(|r| r.feasible(&bounds))
        .map(|p| (p.tokens_per_user, p.tokens_per_gpu))
        .collect();
    let front: Vec<(f64, f64)> = o
        .pareto
        .iter()
        .map(|p| (p.tokens_per_user, p.tokens_per_gpu))
        .collect();
    let svg = lines_and_dots(
        &Axes {
            title: format!("{}: output tokens/s per GPU against per user", o.name),
            x_label: "output tokens/s per user (1 / mean TPOT)".into(),
            y_label: "output tokens/s per GPU".into(),
        },
        &[Series {
            name: "Pareto front".into(),
            color: "#d62728".into(),
            points: front,
        }],
        &[Series {
            name: "every load meeting the objectives".into(),
            color: "#1f77b4".into(),
            points: dots,
        }],
        None,
    );
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>lockstep search: {n}</title><style>body{{font-family:sans-serif;margin:24px}}table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td:nth-child(2){{text-align:left}}</style></head><body><h1>lockstep search: {n}</h1><pre>",
        n = escape(&o.name)
    );
    let pruned: u64 = o.pruned.values().sum();
    let _ = writeln!(
        h,
        "{} candidates, {} pruned, {} simulated ({} simulations)",
        o.candidates,
        pruned,
        o.ranked.len(),
        o.simulations
    );
    for (reason, n) in &o.pruned {
        let _ = writeln!(h, "  pruned {n:>6}  {}", escape(reason));
    }
    h.push_str("</pre>");
    h.push_str(&svg);
    let _ = write!(
        h,
        "<h2>Ranked</h2><table><tr><th>#</th><th>configuration</th><th>GPUs</th><th>{}</th><th>tok/s/GPU</th><th>tok/s/user</th>",
        load_header(spec)
    );
    for b in &bounds {
        let _ = write!(h, "<th>{}</th>", escape(&b.key()));
    }
    h.push_str("<th>balance</th><th>binding</th></tr>");
    for (i, r) in o.ranked.iter().enumerate() {
        let best = r.evaluation.best.as_ref();
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td>",
            i + 1,
            escape(&r.candidate.label()),
            r.gpus_needed.unwrap_or(r.candidate.gpus()),
            best.map_or("-".into(), |m| load_cell(spec, m.load)),
            r.tokens_per_gpu(),
            best.map_or("-".into(), |m| format!("{:.1}", m.tokens_per_user())),
        );
        for b in &bounds {
            let _ = write!(
                h,
                "<td>{}</td>",
                best.map_or("-".into(), |m| format!("{:.1}", m.value(b)))
            );
        }
        let _ = write!(
            h,
            "<td>{}</td><td>{}</td></tr>",
            best.and_then(|m| m.balance)
                .map_or("-".into(), |b| format!("{b:.3}")),
            escape(&r.evaluation.binding)
        );
    }
    h.push_str("</table></body></html>\n");
    h
}
