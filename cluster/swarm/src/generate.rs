//! The scenario generator: one seed, one valid scenario file, drawn across every
//! dimension of the format (README "Scenario files") while keeping each run small.
//!
//! Every draw goes through one `ChaCha8Rng` seeded from the seed, so `generate(seed)` is
//! the same text on every machine (the trace paths aside, which are absolute). Sizes
//! that requests depend on are derived from the workload first, so that no request is
//! refused for a legitimate reason (§3.2: a prompt over `T` without chunked prefill, a
//! request larger than a rank's KV): the first server of each role is sized for every
//! request; a later one may be sized for half the longest prompt and output, so that the
//! front door must route around it.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::OnceLock;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Salt mixed into the seed so the generator's stream differs from the workload's.
const SALT: u64 = 0x5757_4152_4d00_0001;
/// Salts the ADP balance knobs' own stream.
const BALANCE_SALT: u64 = 0x4241_4c41_4e43_4501;
/// Salts the stream that decides which servers are sized for less than every request.
const HETEROGENEOUS_SALT: u64 = 0x4845_5445_524f_0001;

/// The shipped request traces, lengths only: `(prompt, output)` per record in file
/// order. `None` when the file is not there (a binary run away from its repository).
struct Trace {
    path: String,
    format: &'static str,
    lengths: Vec<(u32, u32)>,
}

fn trace_dir() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/traces");
    here.canonicalize().unwrap_or(here)
}

fn load_trace(file: &str, format: &'static str) -> Option<Trace> {
    let path = trace_dir().join(file);
    let text = std::fs::read_to_string(&path).ok()?;
    let mut lengths = Vec::new();
    match format {
        "mooncake" => {
            for line in text.lines().filter(|l| !l.trim().is_empty()).take(1000) {
                let v: serde_json::Value = serde_json::from_str(line).ok()?;
                let get = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
                lengths.push((get("input_length")? as u32, get("output_length")? as u32));
            }
        }
        _ => {
            for line in text.lines().skip(1).take(1000) {
                let mut cols = line.split(',');
                let _time = cols.next()?;
                let prompt = cols.next()?.trim().parse().ok()?;
                let output = cols.next()?.trim().parse().ok()?;
                lengths.push((prompt, output));
            }
        }
    }
    Some(Trace {
        path: path.display().to_string(),
        format,
        lengths,
    })
}

fn traces() -> &'static [Trace] {
    static TRACES: OnceLock<Vec<Trace>> = OnceLock::new();
    TRACES.get_or_init(|| {
        [
            load_trace("mooncake_conversation.jsonl", "mooncake"),
            load_trace("azure_conv_2023.csv", "azure"),
        ]
        .into_iter()
        .flatten()
        .collect()
    })
}

/// A TOML string literal.
fn quoted(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

struct Gen {
    rng: ChaCha8Rng,
}

impl Gen {
    fn chance(&mut self, p: f64) -> bool {
        self.rng.random_bool(p)
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Log-uniform over `[lo, hi]`: small values as often as large ones.
    fn log_range(&mut self, lo: u64, hi: u64) -> u64 {
        let (l, h) = ((lo.max(1) as f64).ln(), ((hi.max(lo) + 1) as f64).ln());
        let x = self.rng.random_range(l..h).exp().floor() as u64;
        x.clamp(lo, hi)
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.rng.random_range(0..items.len())]
    }

    fn float(&mut self, lo: f64, hi: f64) -> f64 {
        // Three decimals: the file reads back to the same number.
        (self.rng.random_range(lo..hi) * 1000.0).round() / 1000.0
    }
}

/// A drawn length: fixed or a range, and its bounds.
#[derive(Clone, Copy)]
struct Len {
    lo: u32,
    hi: u32,
    fixed: bool,
}

impl Len {
    fn toml(self) -> String {
        if self.fixed {
            self.hi.to_string()
        } else {
            format!("[{}, {}]", self.lo, self.hi)
        }
    }
}

fn draw_len(g: &mut Gen, max: u32, one: f64) -> Len {
    if g.chance(one) {
        return Len {
            lo: 1,
            hi: 1,
            fixed: true,
        };
    }
    let hi = g.log_range(1, u64::from(max)) as u32;
    if g.chance(0.4) {
        Len {
            lo: hi,
            hi,
            fixed: true,
        }
    } else {
        let lo = if g.chance(0.3) {
            1
        } else {
            g.log_range(1, u64::from(hi)) as u32
        };
        Len {
            lo,
            hi,
            fixed: false,
        }
    }
}

/// What the servers must accommodate, from the workload.
struct Needs {
    /// Longest prompt any request can have (conversation rounds grown).
    prompt: u32,
    /// Longest output.
    output: u32,
}

/// The `[workload]` table, and what it needs from the servers.
fn workload(g: &mut Gen, out: &mut String) -> Needs {
    let traces = traces();
    let roll = g.range(0, 99);
    let kind = if roll < 45 {
        "closed_loop"
    } else if roll < 80 || traces.is_empty() {
        "open_loop"
    } else {
        "trace"
    };
    out.push_str("[workload]\n");
    let _ = writeln!(out, "kind = \"{kind}\"");
    let warmup = if g.chance(0.2) { g.range(1, 3) } else { 0 };
    let ramp = g.chance(0.2).then(|| g.float(0.0, 0.5));
    let needs;
    if kind == "trace" {
        let trace = &traces[g.range(0, traces.len() as u64 - 1) as usize];
        let cap = if trace.format == "mooncake" { 30 } else { 150 };
        let n = g.log_range(3, cap).min(trace.lengths.len() as u64);
        let _ = writeln!(out, "num_requests = {n}");
        let used = &trace.lengths[..n as usize];
        needs = Needs {
            prompt: used.iter().map(|l| l.0).max().unwrap_or(1),
            output: used.iter().map(|l| l.1).max().unwrap_or(1),
        };
        write_warmup_ramp(out, warmup, ramp);
        out.push_str("\n[workload.trace]\n");
        let _ = writeln!(out, "path = {}", quoted(&trace.path));
        let _ = writeln!(out, "format = \"{}\"", trace.format);
        let _ = writeln!(
            out,
            "time_scale = {}",
            g.pick(&[0.001, 0.01, 0.05, 0.2, 1.0])
        );
        // `block_tokens` stays the trace's own 512: the file's `hash_ids` are per 512
        // tokens, and another value is refused (rightly) at load.
        return needs;
    }
    let conversation = g.chance(0.2);
    let n = g.log_range(5, 300);
    let _ = writeln!(out, "num_requests = {n}");
    if kind == "closed_loop" {
        let _ = writeln!(out, "concurrency = {}", g.log_range(1, 64));
    } else {
        let _ = writeln!(out, "rate = {}", g.log_range(1, 5000));
    }
    let input = draw_len(g, 4096, 0.05);
    let output = draw_len(g, 384, 0.2);
    let _ = writeln!(out, "input_len = {}", input.toml());
    let _ = writeln!(out, "output_len = {}", output.toml());
    if (kind == "closed_loop" || conversation) && g.chance(0.3) {
        let _ = writeln!(out, "think_time_ms = {}", g.float(0.0, 50.0));
    }
    if g.chance(0.25) {
        let _ = writeln!(
            out,
            "shared_prefix_tokens = {}",
            g.range(0, u64::from(input.lo))
        );
    }
    write_warmup_ramp(out, warmup, ramp);
    let mut prompt = input.hi;
    if conversation {
        let rounds = Len {
            lo: g.range(1, 2) as u32,
            hi: g.range(2, 4) as u32,
            fixed: g.chance(0.3),
        };
        let rounds = if rounds.fixed {
            Len {
                lo: rounds.hi,
                ..rounds
            }
        } else {
            rounds
        };
        let new_tokens = draw_len(g, 256, 0.05);
        out.push_str("\n[workload.conversation]\n");
        let _ = writeln!(out, "rounds = {}", rounds.toml());
        let _ = writeln!(out, "new_tokens_per_round = {}", new_tokens.toml());
        prompt += (rounds.hi - 1) * (output.hi + new_tokens.hi);
    }
    Needs {
        prompt,
        output: output.hi,
    }
}

fn write_warmup_ramp(out: &mut String, warmup: u64, ramp: Option<f64>) {
    if warmup > 0 {
        let _ = writeln!(out, "warmup_requests = {warmup}");
    }
    if let Some(r) = ramp {
        let _ = writeln!(out, "ramp_s = {r}");
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Role {
    Agg,
    Ctx,
    Gen,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Agg => "agg",
            Role::Ctx => "ctx",
            Role::Gen => "gen",
        }
    }
}

/// One `[[server]]` table sized for `needs`.
/// `lossy`: the scenario loses KV on the wire, so short transfer timeouts are likelier
/// (a lost transfer only ends at its timeout).
fn server(
    g: &mut Gen,
    out: &mut String,
    name: &str,
    role: Role,
    tpb: u32,
    needs: &Needs,
    lossy: bool,
) {
    let _ = write!(
        out,
        "\n[[server]]\nname = \"{name}\"\nrole = \"{}\"\n",
        role.name()
    );
    let dp = g.pick(&[1u32, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 7, 8, 8]);
    let pp = if g.chance(0.1) { 2 } else { 1 };
    let _ = writeln!(out, "tensor_parallel_size = {dp}");
    if pp > 1 || g.chance(0.1) {
        let _ = writeln!(out, "pipeline_parallel_size = {pp}");
    }
    if g.chance(0.1) {
        let _ = writeln!(out, "ranks = {}", dp * pp);
    }
    // Mostly attention DP; sometimes plain TP (one attention batch).
    let _ = writeln!(out, "enable_attention_dp = {}", !g.chance(0.1));
    let _ = writeln!(out, "max_batch_size = {}", g.log_range(1, 64));
    let draft = if g.chance(0.1) {
        g.range(1, 3) as u32
    } else {
        0
    };
    if draft > 0 {
        let _ = writeln!(out, "max_draft_len = {draft}");
    }
    let chunked = g.chance(if role == Role::Gen { 0.3 } else { 0.5 });
    let policy = g.pick(&[
        "GUARANTEED_NO_EVICT",
        "GUARANTEED_NO_EVICT",
        "MAX_UTILIZATION",
        "STATIC_BATCH",
    ]);
    // T: at least a generation step; a prefilling server's T holds a block with chunked
    // prefill, and the longest prompt without it. A gen server never prefills, and a
    // MAX_UTILIZATION recompute over T is no limit (such a request is never paused).
    let mut floor = 1 + draft;
    if role != Role::Gen {
        floor = floor.max(if chunked { tpb } else { needs.prompt + draft });
    }
    let t = if g.chance(0.3) {
        floor
    } else if chunked || role == Role::Gen {
        floor.max(g.pick(&[
            tpb,
            tpb + 1,
            2 * tpb,
            3 * tpb - 1,
            256,
            512,
            1024,
            2048,
            4096,
            8192,
        ]))
    } else {
        floor + g.log_range(1, u64::from(floor)) as u32
    };
    let _ = writeln!(out, "max_num_tokens = {t}");
    let _ = writeln!(out, "disable_overlap_scheduler = {}", g.chance(0.3));
    let _ = writeln!(out, "enable_chunked_prefill = {chunked}");
    if g.chance(0.03) {
        out.push_str("hybrid_model = true\n");
    }
    if g.chance(0.03) {
        out.push_str("encoder_decoder = true\n");
    }
    out.push_str("\n[server.scheduler_config]\n");
    let _ = writeln!(out, "capacity_scheduler_policy = \"{policy}\"");
    let _ = writeln!(
        out,
        "context_chunking_policy = \"{}\"",
        g.pick(&["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"])
    );
    // KV: from exactly one request's blocks (a tight pool) to plenty.
    let need_blocks = (needs.prompt + needs.output).div_ceil(tpb);
    let blocks = match g.range(0, 9) {
        0 | 1 => need_blocks,
        2 | 3 => need_blocks + g.range(1, 3) as u32,
        4 | 5 => need_blocks * 2,
        6 | 7 => need_blocks * 4,
        _ => need_blocks.saturating_mul(16).max(need_blocks),
    };
    let cap = (1u32 << 19) / tpb;
    let blocks = blocks.min(cap.max(need_blocks));
    let extra = if g.chance(0.2) {
        g.range(0, u64::from(tpb) - 1) as u32
    } else {
        0
    };
    out.push_str("\n[server.kv_cache_config]\n");
    let _ = writeln!(out, "tokens_per_block = {tpb}");
    let _ = writeln!(out, "max_tokens = {}", blocks * tpb + extra);
    let _ = writeln!(out, "enable_block_reuse = {}", g.chance(0.5));
    out.push_str("\n[server.attention_dp_config]\n");
    let _ = writeln!(
        out,
        "router = \"{}\"",
        g.pick(&["balanced", "conversation", "kv_aware"])
    );
    // ADP balance is drawn from a stream of its own, so every other draw — and so every
    // scenario of a seed from before this knob, but for these lines — stays the same.
    let mut balance = Gen {
        rng: ChaCha8Rng::seed_from_u64(g.rng.clone().random::<u64>() ^ BALANCE_SALT),
    };
    if balance.chance(0.3) {
        let _ = writeln!(out, "enable_balance = true");
        let _ = writeln!(out, "timeout_iters = {}", balance.pick(&[0, 1, 2, 5, 50]));
        let _ = writeln!(
            out,
            "batching_wait_iters = {}",
            balance.pick(&[0, 1, 3, 10])
        );
    }
    if role != Role::Agg && (lossy || g.chance(0.8)) {
        out.push_str("\n[server.cache_transceiver_config]\n");
        if g.chance(0.6) {
            let budget = g.pick(&[1, 17, 100, 1024, 4096, 16384, 65536]);
            let budget = if g.chance(0.2) { tpb } else { budget };
            let _ = writeln!(out, "max_tokens_in_buffer = {budget}");
        }
        if g.chance(if lossy { 0.7 } else { 0.25 }) {
            let _ = writeln!(
                out,
                "kv_transfer_timeout_ms = {}",
                g.pick(&[1, 5, 20, 100, 500, 2000])
            );
        }
        if role == Role::Ctx && g.chance(if lossy { 0.3 } else { 0.1 }) {
            let _ = writeln!(out, "kv_pull_timeout_ms = {}", g.pick(&[10, 200, 5000]));
        }
        if role == Role::Ctx && g.chance(0.3) {
            out.push_str("generation_first = true\n");
        }
    }
}

/// A valid scenario for `seed`, as TOML text; its `seed` key is `seed`, so the file
/// replays the same run under `lockstep sim`.
pub fn generate(seed: u64) -> String {
    let mut g = Gen {
        rng: ChaCha8Rng::seed_from_u64(seed ^ SALT),
    };
    let mut out = String::new();
    let _ = writeln!(out, "name = \"swarm-{seed}\"");
    let _ = writeln!(out, "seed = {seed}");
    if g.chance(0.2) {
        out.push_str("\n[policy]\npreset = \"fixed\"\n");
    }
    out.push('\n');
    let needs = workload(&mut g, &mut out);
    let tpb = g.pick(&[16u32, 32, 64]);
    let disaggregated = g.chance(0.4);
    let mut roles = Vec::new();
    if disaggregated {
        for _ in 0..g.range(1, 2) {
            roles.push(Role::Ctx);
        }
        for _ in 0..g.range(1, 2) {
            roles.push(Role::Gen);
        }
    } else {
        for _ in 0..if g.chance(0.15) { 2 } else { 1 } {
            roles.push(Role::Agg);
        }
    }
    let lost_every = ((disaggregated && g.chance(0.25)) || (!disaggregated && g.chance(0.03)))
        .then(|| g.pick(&[1u64, 2, 3, 5, 7, 10]));
    let mut counts = [0usize; 3];
    let mut heterogeneous = Gen {
        rng: ChaCha8Rng::seed_from_u64(seed ^ HETEROGENEOUS_SALT),
    };
    let half = Needs {
        prompt: (needs.prompt / 2).max(1),
        output: (needs.output / 2).max(1),
    };
    for role in &roles {
        let n = &mut counts[*role as usize];
        let name = format!("{}{n}", role.name());
        // The first server of a role can run every request; a later one maybe not.
        let sized_for = if *n > 0 && heterogeneous.chance(0.5) {
            &half
        } else {
            &needs
        };
        *n += 1;
        server(
            &mut g,
            &mut out,
            &name,
            *role,
            tpb,
            sized_for,
            lost_every.is_some(),
        );
    }
    if roles.len() > 2 || (roles.len() == 2 && !disaggregated) || g.chance(0.2) {
        let _ = write!(
            out,
            "\n[front]\npolicy = \"{}\"\n",
            g.pick(&["round_robin", "load_balancing", "kv_aware"])
        );
    }
    if g.chance(0.8) {
        let profiles = lockstep_gpu::profiles();
        let profile = &profiles[g.range(0, profiles.len() as u64 - 1) as usize];
        let _ = write!(out, "\n[model]\nprofile = {}\n", quoted(&profile.name));
        if g.chance(0.1) {
            out.push_str("\n[model.coefficients]\n");
            let _ = writeln!(out, "forward_base_ns = {}", g.float(0.0, 5e6));
            let _ = writeln!(out, "host_per_request_ns = {}", g.float(0.0, 1e5));
        }
        if disaggregated && g.chance(0.2) {
            out.push_str("\n[model.link]\n");
            let _ = writeln!(out, "bandwidth_gb_per_s = {}", g.float(0.5, 400.0));
            let _ = writeln!(out, "latency_us = {}", g.float(0.0, 200.0));
            let _ = writeln!(out, "control_latency_us = {}", g.float(0.0, 100.0));
        }
    }
    if let Some(every) = lost_every {
        let _ = write!(out, "\n[faults]\nlost_transfer_every = {every}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_range_stays_in_bounds() {
        let mut g = Gen {
            rng: ChaCha8Rng::seed_from_u64(1),
        };
        for _ in 0..10_000 {
            let x = g.log_range(3, 17);
            assert!((3..=17).contains(&x), "{x}");
        }
        assert_eq!(g.log_range(5, 5), 5);
    }
}
