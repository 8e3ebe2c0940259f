//! Greedy shrinking of a scenario file: try simpler variants one at a time (fewer
//! requests, fewer and smaller servers, fixed lengths at the ends of their ranges, faults
//! off, one feature off at a time), keep each that still shows the same finding, and
//! repeat until no variant does or the run budget is spent.
//!
//! It works on the TOML table, so it shrinks any scenario file, generated or not.

use toml::{Table, Value};

use super::{Driver, Finding, Limits, run_one};

/// The result of a shrink.
#[derive(Debug, Clone, PartialEq)]
pub struct Shrunk {
    /// The smallest scenario found (TOML).
    pub text: String,
    /// Its finding (the same defect as the original's).
    pub finding: Finding,
    /// What each kept step did, in order.
    pub steps: Vec<String>,
    /// Runs spent.
    pub attempts: usize,
    /// Requests of the shrunk workload (`num_requests`, or the trace's cap), warm-up
    /// included.
    pub requests: u64,
    /// Ranks of the shrunk fleet (tp × pp summed over servers).
    pub ranks: u64,
}

fn int(v: Option<&Value>) -> Option<i64> {
    v.and_then(Value::as_integer)
}

fn table<'a>(t: &'a Table, key: &str) -> Option<&'a Table> {
    t.get(key).and_then(Value::as_table)
}

fn servers(t: &Table) -> Vec<&Table> {
    t.get("server")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_table).collect())
        .unwrap_or_default()
}

fn requests(t: &Table) -> u64 {
    let w = table(t, "workload");
    let n = w.and_then(|w| int(w.get("num_requests"))).unwrap_or(0);
    let warm = w.and_then(|w| int(w.get("warmup_requests"))).unwrap_or(0);
    (n + warm).max(0) as u64
}

fn ranks(t: &Table) -> u64 {
    servers(t)
        .iter()
        .map(|s| {
            let tp = int(s.get("tensor_parallel_size")).unwrap_or(1);
            let pp = int(s.get("pipeline_parallel_size")).unwrap_or(1);
            (tp * pp).max(0) as u64
        })
        .sum()
}

fn leaves(v: &Value) -> u64 {
    match v {
        Value::Table(t) => t.values().map(leaves).sum(),
        Value::Array(a) if a.iter().all(Value::is_table) => a.iter().map(leaves).sum(),
        _ => 1,
    }
}

/// A scenario's size, for "smaller": requests + ranks + keys set. `None` if the text
/// is not TOML.
pub fn size(text: &str) -> Option<u64> {
    let t: Table = text.parse().ok()?;
    Some(requests(&t) + ranks(&t) + leaves(&Value::Table(t.clone())))
}

/// A named variant of a table.
type Candidate = (String, Table);

/// The table at a dotted path inside `t`, created if missing; `server` paths start
/// with the server's index.
fn section<'a>(t: &'a mut Table, path: &[&str]) -> Option<&'a mut Table> {
    let mut cur = t;
    let mut i = 0;
    while i < path.len() {
        let key = path[i];
        if key == "server" {
            let idx: usize = path.get(i + 1)?.parse().ok()?;
            cur = cur
                .get_mut("server")?
                .as_array_mut()?
                .get_mut(idx)?
                .as_table_mut()?;
            i += 2;
        } else {
            cur = cur.get_mut(key)?.as_table_mut()?;
            i += 1;
        }
    }
    Some(cur)
}

/// Collects variants of one scenario table.
struct Variants<'a> {
    base: &'a Table,
    out: Vec<Candidate>,
}

impl Variants<'_> {
    fn push(&mut self, what: String, edit: impl FnOnce(&mut Table) -> Option<()>) {
        let mut t = self.base.clone();
        if edit(&mut t).is_some() && t != *self.base {
            self.out.push((what, t));
        }
    }

    /// `path.key = value`.
    fn set(&mut self, path: &[&str], key: &str, value: Value) {
        let what = format!("{} = {value}", dotted(path, key));
        self.push(what, |t| {
            section(t, path)?.insert(key.into(), value);
            Some(())
        });
    }

    /// `path.key` removed (back to its default).
    fn remove(&mut self, path: &[&str], key: &str) {
        let what = format!("{} removed", dotted(path, key));
        self.push(what, |t| section(t, path)?.remove(key).map(|_| ()));
    }

    /// An integer key made smaller: the floor, a quarter, a half, three quarters (one
    /// less below 16).
    fn smaller(&mut self, path: &[&str], key: &str, floor: i64) {
        let Some(n) = section(&mut self.base.clone(), path).and_then(|s| int(s.get(key))) else {
            return;
        };
        let mut tried = Vec::new();
        let last = if n <= 16 { n - 1 } else { n - n / 4 };
        for v in [floor, n / 4, n / 2, last] {
            if v >= floor && v < n && !tried.contains(&v) {
                tried.push(v);
                self.set(path, key, Value::Integer(v));
            }
        }
    }

    /// A length (`n` or `[lo, hi]`) made fixed at either end, or smaller.
    fn length(&mut self, path: &[&str], key: &str) {
        let Some(v) = section(&mut self.base.clone(), path).and_then(|s| s.get(key).cloned())
        else {
            return;
        };
        match v {
            Value::Array(a) => {
                for end in a.iter().filter(|x| x.is_integer()) {
                    self.set(path, key, end.clone());
                }
            }
            Value::Integer(n) if n > 1 => {
                self.set(path, key, Value::Integer(1));
                self.set(path, key, Value::Integer(n / 2));
            }
            _ => {}
        }
    }
}

fn dotted(path: &[&str], key: &str) -> String {
    let mut parts: Vec<&str> = path.to_vec();
    parts.push(key);
    parts.join(".")
}

/// Every simpler variant of `base`, the biggest reductions first.
fn candidates(base: &Table) -> Vec<Candidate> {
    let mut v = Variants {
        base,
        out: Vec::new(),
    };
    let w = ["workload"];
    v.smaller(&w, "num_requests", 1);
    // Servers: drop one when its role keeps another.
    let roles: Vec<String> = servers(base)
        .iter()
        .map(|s| {
            s.get("role")
                .and_then(Value::as_str)
                .unwrap_or("agg")
                .to_string()
        })
        .collect();
    for (i, role) in roles.iter().enumerate() {
        if roles.iter().filter(|r| *r == role).count() > 1 {
            v.push(format!("server {i} ({role}) removed"), |t| {
                let list = t.get_mut("server")?.as_array_mut()?;
                list.remove(i);
                Some(())
            });
        }
    }
    v.push("[faults] removed".into(), |t| {
        t.remove("faults").map(|_| ())
    });
    v.smaller(&w, "concurrency", 1);
    v.remove(&w, "warmup_requests");
    v.remove(&w, "conversation");
    for i in 0..roles.len() {
        let idx = i.to_string();
        let s = ["server", idx.as_str()];
        // A rank count change invalidates an explicit `ranks`.
        v.remove(&s, "ranks");
        v.smaller(&s, "tensor_parallel_size", 1);
        v.remove(&s, "pipeline_parallel_size");
    }
    v.remove(&w, "ramp_s");
    v.remove(&w, "think_time_ms");
    v.remove(&w, "shared_prefix_tokens");
    v.length(&w, "input_len");
    v.length(&w, "output_len");
    v.length(&["workload", "conversation"], "rounds");
    v.length(&["workload", "conversation"], "new_tokens_per_round");
    if table(base, "workload")
        .and_then(|w| w.get("kind"))
        .and_then(Value::as_str)
        == Some("open_loop")
    {
        let n = requests(base).max(1) as i64;
        v.push(
            format!("open loop -> closed loop of concurrency {n}"),
            |t| {
                let w = section(t, &["workload"])?;
                w.remove("rate");
                w.remove("think_time_ms");
                w.insert("kind".into(), Value::String("closed_loop".into()));
                w.insert("concurrency".into(), Value::Integer(n));
                Some(())
            },
        );
    }
    for i in 0..roles.len() {
        let idx = i.to_string();
        let s = ["server", idx.as_str()];
        v.smaller(&s, "max_batch_size", 1);
        v.remove(&s, "max_draft_len");
        v.set(&s, "disable_overlap_scheduler", Value::Boolean(true));
        v.set(&s, "enable_chunked_prefill", Value::Boolean(false));
        v.remove(&s, "hybrid_model");
        v.remove(&s, "encoder_decoder");
        v.remove(&s, "enable_attention_dp");
        let sched = ["server", idx.as_str(), "scheduler_config"];
        v.remove(&sched, "capacity_scheduler_policy");
        v.remove(&sched, "context_chunking_policy");
        let kv = ["server", idx.as_str(), "kv_cache_config"];
        v.set(&kv, "enable_block_reuse", Value::Boolean(false));
        v.remove(&s, "attention_dp_config");
        let ct = ["server", idx.as_str(), "cache_transceiver_config"];
        v.remove(&ct, "generation_first");
        v.remove(&ct, "kv_transfer_timeout_ms");
        v.remove(&ct, "kv_pull_timeout_ms");
        v.remove(&ct, "max_tokens_in_buffer");
        v.smaller(&s, "max_num_tokens", 1);
    }
    v.remove(&[], "front");
    v.remove(&["model"], "coefficients");
    v.remove(&["model"], "link");
    v.remove(&["model"], "profile");
    if let Some(p) = table(base, "policy") {
        for key in p.keys() {
            if key != "preset" || p.len() == 1 {
                v.remove(&["policy"], key);
            }
        }
    }
    v.out
}

/// Removes tables left empty (`[server.scheduler_config]` once its keys went).
fn prune(t: &mut Table) {
    for (_, v) in t.iter_mut() {
        match v {
            Value::Table(inner) => prune(inner),
            Value::Array(a) => a.iter_mut().filter_map(Value::as_table_mut).for_each(prune),
            _ => {}
        }
    }
    t.retain(|_, v| !matches!(v, Value::Table(inner) if inner.is_empty()));
}

/// The table as scenario text, its sections in the README's order (top-level keys,
/// `[policy]`, `[[server]]`, `[workload]`, `[front]`, `[model]`, `[faults]`, then any
/// other), empty tables left out.
pub fn render(table: &Table) -> Option<String> {
    let mut t = table.clone();
    prune(&mut t);
    let order = ["policy", "server", "workload", "front", "model", "faults"];
    let (plain, sections): (Table, Table) = t.into_iter().partition(|(k, v)| {
        !order.contains(&k.as_str())
            && !v.is_table()
            && !matches!(v, Value::Array(a) if a.iter().any(Value::is_table))
    });
    let mut out = toml::to_string(&plain).ok()?;
    let mut rest: Vec<(&String, &Value)> = sections.iter().collect();
    rest.sort_by_key(|(k, _)| order.iter().position(|o| o == k).unwrap_or(order.len()));
    for (k, v) in rest {
        let mut one = Table::new();
        one.insert(k.clone(), v.clone());
        out.push('\n');
        out.push_str(&toml::to_string(&one).ok()?);
    }
    Some(out)
}

/// Shrinks `text`, whose run gave `target`, keeping every variant that gives the same
/// defect ([`Finding::same_bug`]), within `budget` runs.
pub fn shrink(
    text: &str,
    target: &Finding,
    driver: Driver,
    limits: &Limits,
    budget: usize,
) -> Shrunk {
    let mut attempts = 0;
    let mut steps = Vec::new();
    let mut finding = target.clone();
    let Ok(mut current) = text.parse::<Table>() else {
        return Shrunk {
            text: text.to_string(),
            finding,
            steps,
            attempts,
            requests: 0,
            ranks: 0,
        };
    };
    let mut current_text = text.to_string();
    'passes: loop {
        let mut kept_any = false;
        let mut k = 0;
        loop {
            let list = candidates(&current);
            let Some((what, candidate)) = list.into_iter().nth(k) else {
                break;
            };
            k += 1;
            if attempts >= budget {
                break 'passes;
            }
            let Some(candidate_text) = render(&candidate) else {
                continue;
            };
            attempts += 1;
            let got = run_one(&candidate_text, driver, limits);
            if got.same_bug(target) {
                tracing::debug!(step = %what, "shrink: kept");
                // One entry per key: its last value.
                let key = what.split(" = ").next().unwrap_or_default();
                if steps
                    .last()
                    .is_some_and(|l: &String| l.split(" = ").next() == Some(key))
                {
                    steps.pop();
                }
                steps.push(what);
                current = candidate;
                current_text = candidate_text;
                finding = got;
                kept_any = true;
                // The list changed (one option fewer, a smaller number): the same
                // position now holds the next variant.
                k -= 1;
            }
        }
        if !kept_any {
            break;
        }
    }
    Shrunk {
        requests: requests(&current),
        ranks: ranks(&current),
        text: current_text,
        finding,
        steps,
        attempts,
    }
}
