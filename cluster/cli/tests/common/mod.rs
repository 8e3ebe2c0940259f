//! Scenarios and runners shared by the driver tests: the simulator, the threads driver,
//! and the MPI driver through `mpirun` (every child process with a deadline).

#![allow(dead_code)]

pub mod serve;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use lockstep_plan::report::Report;
use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;
use lockstep_runtime::threads;
use lockstep_sim::{self as sim, SimOptions};

/// One aggregated server of `dp` ranks, 80 requests all arriving at once.
pub fn agg_text(dp: u32, overlap: bool) -> String {
    format!(
        r#"
name = "cross-driver"
[[server]]
name = "agg0"
tensor_parallel_size = {dp}
max_batch_size = 8
max_num_tokens = 2048
enable_chunked_prefill = true
disable_overlap_scheduler = {no_overlap}
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 65536
[workload]
kind = "closed_loop"
concurrency = 80
num_requests = 80
input_len = [16, 900]
output_len = [1, 40]
"#,
        no_overlap = !overlap
    )
}

/// Two ctx servers (dp 2 and 1) and two gen servers (dp 2 and 1), `n` requests all
/// arriving at once. The ctx servers' B of 16 gives them 32 seats and KV index slots a
/// rank, more than a ctx rank ever holds here, so no prefill waits for an index slot
/// that a finished send frees: at zero cost a real driver's sends end in thread time,
/// and such a wait would make the ctx routing (and the tokens, which mix in the ctx
/// rank) timing.
pub fn disagg_text(n: u32) -> String {
    disagg_fleet_text(
        "disagg-2x2",
        &[
            ("ctx0", "ctx", 2, 16),
            ("ctx1", "ctx", 1, 16),
            ("gen0", "gen", 2, 16),
            ("gen1", "gen", 1, 16),
        ],
        n,
    )
}

/// A disaggregated fleet of `(name, role, dp, max_batch_size)` servers (ctx servers
/// without the overlap scheduler, gen servers with it) behind a `load_balancing` front,
/// `n` requests all arriving at once.
pub fn disagg_fleet_text(name: &str, servers: &[(&str, &str, u32, u32)], n: u32) -> String {
    let servers: String = servers
        .iter()
        .map(|(name, role, dp, b)| {
            format!(
                r#"
[[server]]
name = "{name}"
role = "{role}"
tensor_parallel_size = {dp}
max_batch_size = {b}
max_num_tokens = 2048
disable_overlap_scheduler = {no_overlap}
[server.kv_cache_config]
tokens_per_block = 16
max_tokens = 65536
"#,
                no_overlap = *role == "ctx"
            )
        })
        .collect();
    format!(
        r#"
name = "{name}"
[front]
policy = "load_balancing"
{servers}
[workload]
kind = "closed_loop"
concurrency = {n}
num_requests = {n}
input_len = [16, 600]
output_len = [1, 24]
"#
    )
}

/// A scenario from its text, with `--set` overrides.
pub fn parse(text: &str, sets: &[&str]) -> Scenario {
    let mut s = Scenario::parse(text, "test").expect("test scenario parses");
    for set in sets {
        s.apply_set(set).expect("valid --set");
    }
    s
}

/// `examples/NAME`, with `--set` overrides.
pub fn example(name: &str, sets: &[&str]) -> Scenario {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name);
    let mut s = Scenario::load(&path).expect("example loads");
    for set in sets {
        s.apply_set(set).expect("valid --set");
    }
    s
}

/// The simulator, every request (and the client's shutdown) delivered before the first
/// iteration, as the real drivers' `--preload` does.
pub fn simulate(s: &Scenario) -> Report {
    simulate_with(s, |_| {})
}

/// [`simulate`] with options adjusted.
pub fn simulate_with(s: &Scenario, adjust: impl FnOnce(&mut SimOptions<'_>)) -> Report {
    let mut opts = SimOptions {
        seed: 3,
        preload: true,
        ..SimOptions::default()
    };
    adjust(&mut opts);
    sim::run(s, opts).expect("the simulation starts")
}

/// The threads driver's options of these tests: preloaded, seed 3.
pub fn real_options() -> RealOptions {
    RealOptions {
        seed: 3,
        preload: true,
        collective_timeout: Duration::from_secs(20),
        ..RealOptions::default()
    }
}

/// The threads driver, run in a thread with a deadline: a hang fails the test.
pub fn threads_run(s: &Scenario, opts: RealOptions) -> Report {
    threads_try(s, opts).expect("the threads run succeeds")
}

/// [`threads_run`], the error as text.
pub fn threads_try(s: &Scenario, opts: RealOptions) -> Result<Report, String> {
    let s = s.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(threads::run(&s, &opts).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the threads run ended within 120 s")
}

/// What must be identical across drivers for an aggregated run.
pub fn agg_fingerprint(r: &Report) -> (u64, u64, Vec<String>, String) {
    let s = &r.servers[0];
    (
        s.iterations,
        s.forward_iterations,
        s.ranks.iter().map(|k| k.routing_digest.clone()).collect(),
        // The outcome of each request (its times are on each driver's clock).
        request_outcomes(r),
    )
}

/// Every server's per-rank routing digests.
pub fn routing(r: &Report, server: &str) -> Vec<String> {
    r.servers
        .iter()
        .find(|s| s.name == server)
        .expect("the server is in the report")
        .ranks
        .iter()
        .map(|k| k.routing_digest.clone())
        .collect()
}

/// Requests that needed a KV transfer (more than the ctx server's single token).
pub fn multi_token_requests(r: &Report) -> u64 {
    r.per_request.iter().filter(|d| d.output_tokens > 1).count() as u64
}

/// The ids of the requests that failed, in order.
pub fn failed_ids(r: &Report) -> Vec<u64> {
    r.per_request
        .iter()
        .filter(|d| d.failure().is_some())
        .map(|d| d.id)
        .collect()
}

/// `a` and `b` within 5% (or `slack` iterations, for small counts) of each other.
pub fn close_counts(a: u64, b: u64, slack: u64) -> bool {
    let diff = a.abs_diff(b);
    diff <= slack || diff * 20 <= a.max(b)
}

/// `b` within `percent` of `a`.
pub fn within(a: f64, b: f64, percent: f64) -> bool {
    (b - a).abs() <= a.abs() * percent / 100.0
}

// ---- MPI ----

/// The MPI binary (`LOCKSTEP_MPI_BIN`, built by `scripts/test.sh` with `--features
/// mpi`). The MPI tests are `#[ignore]`d, so they run only when asked; asked without
/// the binary, they fail.
pub fn mpi_bin() -> PathBuf {
    match std::env::var_os("LOCKSTEP_MPI_BIN") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "this test needs the MPI build: run scripts/test.sh, or build with `cargo build --release -p lockstep --features mpi` and set LOCKSTEP_MPI_BIN to the binary"
        ),
    }
}

/// `mpirun -n N BIN rank ARGS...`.
pub fn mpirun(bin: &PathBuf, n: u32, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .args(["--oversubscribe", "-n", &n.to_string()])
        .arg(bin)
        .arg("rank")
        .args(args);
    c
}

/// Runs a command to its end, killing it after `limit` (a hang fails the test).
pub fn output_within(mut c: Command, limit: Duration) -> Output {
    let child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the child process starts (for mpirun: OpenMPI installed?)");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("the child's output"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("the command ran past {limit:?} and was killed");
        }
    }
}

/// A fresh path in this test process's scratch folder.
pub fn temp(name: &str) -> PathBuf {
    let d = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lockstep-drivers-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// Processes an MPI run of `s` needs: the front plus every server's ranks.
pub fn processes(s: &Scenario) -> u32 {
    1 + s
        .servers
        .iter()
        .map(|c| c.derive(&s.policy).expect("valid").sizes.dp)
        .sum::<u32>()
}

/// `lockstep rank`'s arguments for scenario `text` (written to a scratch file named after
/// `name`), preloaded with seed 3, with `--set` overrides, and the path its JSON report
/// goes to.
pub fn rank_args(text: &str, sets: &[&str], name: &str) -> (Vec<String>, PathBuf) {
    let path = temp(&format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    let json = temp(&format!("{name}.json"));
    let mut args: Vec<String> = vec![
        path.to_str().unwrap().into(),
        "--seed".into(),
        "3".into(),
        "--preload".into(),
        "--json".into(),
        json.to_str().unwrap().into(),
    ];
    for s in sets {
        args.push("--set".into());
        args.push((*s).into());
    }
    (args, json)
}

/// Runs scenario `text` (with `--set` overrides) under mpirun, preloaded with seed 3,
/// and returns its report; the run must end as planned (every request completed, or
/// exit status 3: some failed, each with its reason, e.g. lost KV).
pub fn mpi_report(bin: &PathBuf, text: &str, sets: &[&str], name: &str) -> Report {
    mpi_report_with(bin, text, sets, name, &[])
}

/// [`mpi_report`] with more options for the rank processes.
pub fn mpi_report_with(
    bin: &PathBuf,
    text: &str,
    sets: &[&str],
    name: &str,
    extra: &[&str],
) -> Report {
    let (args, json) = rank_args(text, sets, name);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend_from_slice(extra);
    let n = processes(&parse(text, sets));
    let started = Instant::now();
    let out = output_within(mpirun(bin, n, &args), Duration::from_secs(120));
    assert!(
        out.status.success() || out.status.code() == Some(3),
        "mpirun failed after {:?}: {}",
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

/// The same time model: every request completed alike with as many tokens, mean TTFT
/// and TPOT within 10 %, every server's iterations within 5 % (or 3). (Not the token
/// streams: paced in wall time, an aggregated server's iterations only come that close,
/// and its tokens mix in the iteration; callers compare streams where the path agrees.)
pub fn same_time_model(a: &Report, b: &Report) -> Result<(), String> {
    let lengths = |r: &Report| -> Vec<(u64, u32, bool)> {
        r.per_request
            .iter()
            .map(|d| (d.id, d.output_tokens, d.failure().is_none()))
            .collect()
    };
    if lengths(a) != lengths(b) {
        return Err(format!(
            "requests differ: {:?} vs {:?}",
            lengths(a),
            lengths(b)
        ));
    }
    let (la, lb) = (&a.latency_ms, &b.latency_ms);
    if !within(la.ttft.mean, lb.ttft.mean, 10.0) {
        return Err(format!("ttft {:?} vs {:?}", la.ttft, lb.ttft));
    }
    if !within(la.tpot.mean, lb.tpot.mean, 10.0) {
        return Err(format!("tpot {:?} vs {:?}", la.tpot, lb.tpot));
    }
    for (sa, sb) in a.servers.iter().zip(&b.servers) {
        if !close_counts(sa.iterations, sb.iterations, 3) {
            return Err(format!(
                "{}: {} iterations simulated, {} run",
                sa.name, sa.iterations, sb.iterations
            ));
        }
    }
    Ok(())
}

/// How many times a comparison paced in wall time runs before it counts as failed.
/// A small shared machine sometimes deschedules a rank for tens of milliseconds, which
/// moves a whole batch to the next iteration; a model that is wrong fails every time.
pub const PACED_ATTEMPTS: usize = 3;

/// Runs `attempt` (one paced run compared with the simulator) until it passes, at most
/// [`PACED_ATTEMPTS`] times; prints every miss and panics with all of them.
pub fn passes_within_attempts(mut attempt: impl FnMut() -> Result<(), String>) {
    let mut misses = Vec::new();
    for n in 1..=PACED_ATTEMPTS {
        match attempt() {
            Ok(()) => {
                if !misses.is_empty() {
                    eprintln!("passed at attempt {n}; earlier misses: {misses:#?}");
                }
                return;
            }
            Err(miss) => {
                eprintln!("attempt {n} missed: {miss}");
                misses.push(miss);
            }
        }
    }
    panic!("missed in all {PACED_ATTEMPTS} attempts: {misses:#?}");
}

/// What must be identical across drivers for a disaggregated run with preloaded
/// requests: every request's outcome and token stream (whose tokens mix in the ctx
/// server and rank that computed each prompt, `token_path`), and every ctx server's
/// per-rank routing digests (the ids routed to each rank, in order). A gen server's
/// routing is left out: which requests reach its ingress together depends on when their
/// prefills ended, which at zero cost is thread timing (its tokens still carry the ctx
/// rank they came from).
pub fn disagg_fingerprint(r: &Report) -> (String, Vec<(String, Vec<String>)>) {
    (
        // The outcome of each request, not its times (each driver has its own clock).
        r.per_request
            .iter()
            .map(|d| {
                format!(
                    "{} {} {} {:?}",
                    d.id,
                    d.output_tokens,
                    d.token_digest,
                    d.failure()
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
        r.servers
            .iter()
            .filter(|s| s.role == "ctx")
            .map(|s| (s.name.clone(), routing(r, &s.name)))
            .collect(),
    )
}

/// Each request's outcome — id, output tokens, token digest, failure — but not its
/// times (each driver has its own clock).
pub fn request_outcomes(r: &Report) -> String {
    format!(
        "{:?}",
        r.per_request
            .iter()
            .map(|d| (d.id, d.output_tokens, &d.token_digest, d.failure()))
            .collect::<Vec<_>>()
    )
}

/// Everything a run does, but its times: each request's outcome, each server's
/// iterations, forwards, vetoed iterations, routing and transfers (what an ordered run
/// reproduces of the simulator's).
pub fn whole_fingerprint(r: &Report) -> (String, Vec<String>) {
    (
        request_outcomes(r),
        r.servers
            .iter()
            .map(|s| {
                format!(
                    "{}: iterations {} forwards {} vetoed {} routing {:?} transfers {} lost {}",
                    s.name,
                    s.iterations,
                    s.forward_iterations,
                    s.vetoed_iterations,
                    s.ranks
                        .iter()
                        .map(|k| k.routing_digest.as_str())
                        .collect::<Vec<_>>(),
                    s.transfers.count,
                    s.transfers.lost,
                )
            })
            .collect(),
    )
}

/// Every server's per-rank routing digests, gen servers included: what must differ when
/// a run routes differently (compared within one driver).
pub fn all_routing(r: &Report) -> Vec<(String, Vec<String>)> {
    r.servers
        .iter()
        .map(|s| (s.name.clone(), routing(r, &s.name)))
        .collect()
}

/// The simulator (seed 3; `preload` as given) with its `--iter-log`: the report and one
/// JSON object per server iteration and rank (§9).
pub fn simulate_logged(s: &Scenario, preload: bool) -> (Report, Vec<serde_json::Value>) {
    let mut log: Vec<u8> = Vec::new();
    let r = sim::run(
        s,
        SimOptions {
            seed: 3,
            preload,
            iter_log: Some(&mut log),
            ..SimOptions::default()
        },
    )
    .expect("the simulation starts");
    let lines = String::from_utf8(log)
        .expect("the iteration log is UTF-8")
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    (r, lines)
}
