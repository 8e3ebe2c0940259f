//! The real drivers against the simulator: with arrivals delivered at iteration
//! boundaries (every request before the first iteration), `sim`, `threads` and `mpi` give
//! identical per-request token streams, routing assignments and iteration counts. And the
//! faults: a mismatched collective is a tag error, not a hang; a lost rank ends the job.

use std::path::PathBuf;
use std::time::Duration;

use lockstep_cluster::drivers::threads::{self, ThreadsOptions};
use lockstep_cluster::report::Report;
use lockstep_cluster::scenario::Scenario;
use lockstep_cluster::sim::{self, SimOptions};

fn scenario_text(dp: u32, overlap: bool) -> String {
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

fn scenario(dp: u32, overlap: bool) -> Scenario {
    Scenario::parse(&scenario_text(dp, overlap), "cross-driver").unwrap()
}

/// What must be identical across drivers.
fn fingerprint(r: &Report) -> (u64, Vec<String>, String) {
    let s = &r.servers[0];
    (
        s.iterations,
        s.ranks.iter().map(|k| k.routing_digest.clone()).collect(),
        serde_json::to_string(&r.per_request).unwrap(),
    )
}

fn simulate(s: &Scenario) -> Report {
    sim::run(
        s,
        SimOptions {
            seed: 3,
            iter_log: None,
            progress: None,
        },
    )
    .unwrap()
}

fn threads_run(s: &Scenario) -> Report {
    threads::run(
        s,
        &ThreadsOptions {
            seed: 3,
            preload: true,
            collective_timeout: Duration::from_secs(20),
            ..ThreadsOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn sim_and_threads_agree_request_by_request_at_2_and_4_ranks() {
    for (dp, overlap) in [(2, true), (4, true), (2, false)] {
        let s = scenario(dp, overlap);
        let a = simulate(&s);
        let b = threads_run(&s);
        assert_eq!(a.requests.completed, 80);
        assert_eq!(
            fingerprint(&a),
            fingerprint(&b),
            "dp {dp} overlap {overlap}"
        );
        assert!(a.servers[0].ranks.iter().all(|r| r.routed_requests > 0));
    }
}

#[test]
fn a_mismatched_collective_is_a_tag_error_naming_both_ranks_not_a_hang() {
    let s = scenario(2, true);
    let started = std::time::Instant::now();
    let err = threads::run(
        &s,
        &ThreadsOptions {
            seed: 3,
            preload: true,
            collective_timeout: Duration::from_secs(20),
            mismatch_tag_at: Some((1, 5)),
            ..ThreadsOptions::default()
        },
    )
    .expect_err("a rank tagging its gather as a vote must fail")
    .to_string();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        err.contains("tag") && err.contains("Gather") && err.contains("Vote"),
        "{err}"
    );
}

/// `examples/disagg-small.toml` (a ctx server of 2 ranks, a gen server of 4) scaled down
/// to a few dozen short requests, all arriving at once.
fn disagg_small(extra: &[&str]) -> Scenario {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/disagg-small.toml");
    let mut s = Scenario::load(&path).expect("example loads");
    for set in [
        "workload.num_requests=40",
        "workload.concurrency=40",
        "workload.input_len=[64, 512]",
        "workload.output_len=[1, 16]",
    ]
    .iter()
    .chain(extra)
    {
        s.apply_set(set).expect("valid --set");
    }
    s
}

fn disagg_threads_run(s: &Scenario, lose_every: Option<u64>) -> Report {
    threads::run(
        s,
        &ThreadsOptions {
            seed: 3,
            preload: true,
            collective_timeout: Duration::from_secs(20),
            lose_kv_blocks_every: lose_every,
            ..ThreadsOptions::default()
        },
    )
    .unwrap()
}

/// Requests that needed a KV transfer (more than the ctx server's single token).
fn multi_token_requests(r: &Report) -> u64 {
    r.per_request.iter().filter(|d| d.output_tokens > 1).count() as u64
}

/// All 40 requests completed; on both sides the transfers are exactly the requests that
/// needed one, moved bytes, and nothing timed out, got lost or failed its checksum; no
/// violation, no KV held at the end.
fn assert_moved_checked_kv_for_every_multi_token_request(r: &Report) {
    assert_eq!(r.requests.completed, 40, "{:?}", r.per_request);
    let transfers = multi_token_requests(r);
    assert!(transfers > 0 && transfers < 40, "{transfers}");
    for s in &r.servers {
        let t = &s.transfers;
        assert_eq!(t.count, transfers, "{}: {t:?}", s.name);
        assert!(t.bytes > 0, "{}", s.name);
        assert_eq!(
            (t.timeouts, t.lost, t.checksum_failures),
            (0, 0, 0),
            "{}",
            s.name
        );
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
fn threads_disaggregated_serving_moves_checked_kv_for_every_multi_token_request() {
    let r = disagg_threads_run(&disagg_small(&[]), None);
    assert_eq!(r.servers.len(), 2);
    assert_moved_checked_kv_for_every_multi_token_request(&r);
    // Both sides saw the same bytes.
    assert_eq!(r.servers[0].transfers.bytes, r.servers[1].transfers.bytes);
}

#[test]
fn threads_disaggregated_serving_streams_exactly_the_simulators_tokens() {
    let s = disagg_small(&[]);
    let a = simulate(&s);
    let b = disagg_threads_run(&s, None);
    assert_eq!(a.requests.completed, 40);
    assert_eq!(b.requests.completed, 40);
    assert_eq!(a.per_request, b.per_request);
}

#[test]
fn threads_disaggregated_lost_kv_fails_exactly_those_requests_by_timeout_without_leaks() {
    let every = 4;
    let s = disagg_small(&["server.cache_transceiver_config.kv_transfer_timeout_ms=300"]);
    let r = disagg_threads_run(&s, Some(every));
    // The ctx side sends the blocks: every n-th send is lost on the wire; the requests
    // that got more than one token are exactly those whose transfer went through.
    let delivered = multi_token_requests(&r);
    let lost = r.servers[0].transfers.lost;
    assert!(lost >= 2, "{lost}");
    assert_eq!(lost, (delivered + lost) / every);
    assert_eq!(
        lost,
        r.servers.iter().map(|s| s.transfers.lost).sum::<u64>()
    );
    let failed: Vec<_> = r
        .per_request
        .iter()
        .filter(|d| d.failure.is_some())
        .collect();
    assert_eq!(r.requests.failed, failed.len() as u64);
    assert_eq!(r.requests.completed + r.requests.failed, 40);
    assert_eq!(failed.len() as u64, lost, "{failed:?}");
    for d in &failed {
        let why = d.failure.as_deref().unwrap_or_default();
        assert!(why.contains("kv transfer timed out after 300 ms"), "{why}");
        // Only the ctx server's first token got out.
        assert_eq!(d.output_tokens, 1, "{d:?}");
    }
    for s in &r.servers {
        assert_eq!(s.transfers.count, delivered, "{}", s.name);
        assert_eq!(s.transfers.timeouts, lost, "{}", s.name);
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
fn threads_disaggregated_failure_responses_reach_a_real_time_client_when_servers_go_idle() {
    // Few requests at a time: a server is often idle (nothing live) right after a
    // transfer fails, and the failure response must still go out, or a closed-loop
    // client waits for it forever.
    let s = disagg_small(&[
        "workload.concurrency=3",
        "workload.num_requests=24",
        "workload.output_len=[2, 8]",
        "server.cache_transceiver_config.kv_transfer_timeout_ms=300",
    ]);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = threads::run(
            &s,
            &ThreadsOptions {
                seed: 3,
                collective_timeout: Duration::from_secs(20),
                lose_kv_blocks_every: Some(3),
                ..ThreadsOptions::default()
            },
        );
        let _ = done_tx.send(r);
    });
    let r = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the run must end, not wait for a response stuck behind an idle rank 0")
        .unwrap();
    assert_eq!(r.requests.completed + r.requests.failed, 24);
    let lost: u64 = r.servers.iter().map(|s| s.transfers.lost).sum();
    assert!(lost >= 4, "every 3rd of 24 transfers is lost: {lost}");
    assert_eq!(r.requests.failed, lost, "{:?}", r.per_request);
    for s in &r.servers {
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
fn threads_disaggregated_serving_spreads_over_two_ctx_and_two_gen_servers() {
    let server = |name: &str, role: &str, dp: u32, b: u32| {
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
            no_overlap = role == "ctx"
        )
    };
    let text = format!(
        r#"
name = "disagg-2x2"
[front]
policy = "load_balancing"
{}{}{}{}
[workload]
kind = "closed_loop"
concurrency = 8
num_requests = 60
input_len = [16, 600]
output_len = [1, 24]
"#,
        server("ctx0", "ctx", 2, 4),
        server("ctx1", "ctx", 1, 4),
        server("gen0", "gen", 2, 16),
        server("gen1", "gen", 1, 16),
    );
    let s = Scenario::parse(&text, "disagg-2x2").unwrap();
    // A real-time client (no preload): arrivals follow completions.
    let r = threads::run(
        &s,
        &ThreadsOptions {
            seed: 3,
            collective_timeout: Duration::from_secs(20),
            ..ThreadsOptions::default()
        },
    )
    .unwrap();
    assert_eq!(r.requests.completed, 60, "{:?}", r.per_request);
    assert_eq!(r.servers.len(), 4);
    let sends: u64 = r.servers[..2].iter().map(|s| s.transfers.count).sum();
    let receives: u64 = r.servers[2..].iter().map(|s| s.transfers.count).sum();
    assert_eq!(sends, multi_token_requests(&r));
    assert_eq!(receives, sends);
    for s in &r.servers {
        assert!(
            s.ranks.iter().map(|k| k.routed_requests).sum::<u64>() > 0,
            "{}",
            s.name
        );
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
    // Same tokens as the simulator, request by request.
    assert_eq!(r.per_request, simulate(&s).per_request);
}

fn mpi_bin() -> Option<PathBuf> {
    // Built by scripts/test.sh with `--features mpi` into its own target dir.
    std::env::var_os("LOCKSTEP_MPI_BIN").map(PathBuf::from)
}

fn mpirun(bin: &PathBuf, n: u32, args: &[&str]) -> std::process::Command {
    let mut c = std::process::Command::new("mpirun");
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "-n", &n.to_string()])
        .arg(bin)
        .arg("rank")
        .args(args);
    c
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lockstep-drivers-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

#[test]
fn mpi_agrees_with_sim_and_threads_at_2_and_4_ranks() {
    let Some(bin) = mpi_bin() else {
        eprintln!("LOCKSTEP_MPI_BIN not set: the MPI cases run from scripts/test.sh");
        return;
    };
    for dp in [2, 4] {
        let path = temp(&format!("eq-{dp}.toml"));
        std::fs::write(&path, scenario_text(dp, true)).unwrap();
        let json = temp(&format!("eq-{dp}.json"));
        let out = mpirun(
            &bin,
            dp,
            &[
                path.to_str().unwrap(),
                "--seed",
                "3",
                "--preload",
                "--json",
                json.to_str().unwrap(),
            ],
        )
        .output()
        .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mpi: Report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        let s = scenario(dp, true);
        assert_eq!(fingerprint(&mpi), fingerprint(&simulate(&s)), "dp {dp}");
        assert_eq!(fingerprint(&mpi), fingerprint(&threads_run(&s)), "dp {dp}");
    }
}

#[test]
fn mpi_world_size_mismatch_is_a_clear_error_on_every_rank() {
    let Some(bin) = mpi_bin() else { return };
    let path = temp("size.toml");
    std::fs::write(&path, scenario_text(4, true)).unwrap();
    // Aggregated dp 4 on 2 processes; disagg-small as shipped (1 front + ctx dp 2 + gen
    // dp 4 = 7 processes) on 5.
    let disagg = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/disagg-small.toml");
    for (scenario, n, says) in [
        (&path, 2, ["world size 2", "dp = 4"]),
        (&disagg, 5, ["world size 5", "7 processes"]),
    ] {
        let out = mpirun(&bin, n, &[scenario.to_str().unwrap(), "--preload"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(says.iter().all(|s| err.contains(s)), "{err}");
    }
}

#[test]
fn mpi_mismatched_collective_is_a_tag_error() {
    let Some(bin) = mpi_bin() else { return };
    let path = temp("tag.toml");
    std::fs::write(&path, scenario_text(2, true)).unwrap();
    let started = std::time::Instant::now();
    let out = mpirun(
        &bin,
        2,
        &[
            path.to_str().unwrap(),
            "--preload",
            "--watchdog-ms",
            "5000",
            "--inject-tag-mismatch",
            "1:5",
        ],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(started.elapsed() < Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tag") && err.contains("Gather") && err.contains("Vote"),
        "{err}"
    );
}

/// A slow MPI job (the cost model in real time) and the pid of one of its rank processes.
fn slow_job(name: &str, watchdog_ms: &str) -> (std::process::Child, String, PathBuf) {
    let bin = mpi_bin().expect("checked by the caller");
    let path = temp(name);
    let text = scenario_text(2, true)
        .replace("num_requests = 80", "num_requests = 4000")
        .replace("concurrency = 80", "concurrency = 64");
    std::fs::write(&path, text).unwrap();
    let child = mpirun(
        &bin,
        2,
        &[
            path.to_str().unwrap(),
            "--time-scale",
            "1.0",
            "--watchdog-ms",
            watchdog_ms,
        ],
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let pids = std::process::Command::new("pgrep")
        .args(["-f", path.to_str().unwrap()])
        .output()
        .unwrap();
    let victim = String::from_utf8_lossy(&pids.stdout)
        .lines()
        .map(str::to_string)
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.contains("rank") && !c.starts_with("mpirun"))
        })
        .expect("a rank process");
    (child, victim, path)
}

#[test]
fn mpi_a_killed_rank_makes_the_others_exit_non_zero_within_the_watchdog_time() {
    if mpi_bin().is_none() {
        return;
    }
    let (mut child, victim, _) = slow_job("kill.toml", "3000");
    let killed = std::time::Instant::now();
    std::process::Command::new("kill")
        .args(["-9", &victim])
        .status()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "the job did not end after a rank was killed"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success(), "the job must fail when a rank is lost");
}

#[test]
fn mpi_watchdog_aborts_the_job_naming_the_stuck_rank_when_a_peer_stops() {
    if mpi_bin().is_none() {
        return;
    }
    let (child, victim, _) = slow_job("stop.toml", "2000");
    // A stopped rank neither progresses nor dies: only the peers' watchdog can end this.
    std::process::Command::new("kill")
        .args(["-STOP", &victim])
        .status()
        .unwrap();
    let stopped = std::time::Instant::now();
    let out = child.wait_with_output().unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-9", &victim])
        .status();
    assert!(
        stopped.elapsed() < Duration::from_secs(20),
        "{:?}",
        stopped.elapsed()
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("made no progress for 2000 ms") && err.contains("live"),
        "{err}"
    );
}

/// The `--set` options that make `examples/disagg-small.toml` the small MPI fleet: ctx
/// dp 2 and gen dp 2, so 1 front + 4 rank processes.
const MPI_DISAGG_SETS: [&str; 5] = [
    "workload.num_requests=40",
    "workload.concurrency=40",
    "workload.input_len=[64, 512]",
    "workload.output_len=[1, 16]",
    "server.gen0.tensor_parallel_size=2",
];

/// Runs the small MPI fleet with `extra` settings; it must succeed.
fn mpi_disagg(bin: &PathBuf, extra: &[&str], name: &str) -> Report {
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/disagg-small.toml");
    let json = temp(name);
    let mut args: Vec<String> = vec![
        example.to_str().unwrap().into(),
        "--seed".into(),
        "3".into(),
        "--preload".into(),
        "--json".into(),
        json.to_str().unwrap().into(),
    ];
    for s in MPI_DISAGG_SETS.iter().chain(extra) {
        args.push("--set".into());
        args.push((*s).into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = mpirun(bin, 5, &args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

#[test]
fn mpi_disaggregated_serving_moves_checked_kv_and_streams_the_simulators_tokens() {
    let Some(bin) = mpi_bin() else { return };
    let r = mpi_disagg(&bin, &[], "disagg-mpi.json");
    assert_moved_checked_kv_for_every_multi_token_request(&r);
    let mut sets = MPI_DISAGG_SETS.to_vec();
    sets.drain(..4);
    let s = disagg_small(&sets);
    assert_eq!(r.per_request, simulate(&s).per_request);
}

#[test]
fn mpi_disaggregated_lost_kv_fails_only_those_requests_by_timeout_without_leaks() {
    let Some(bin) = mpi_bin() else { return };
    let r = mpi_disagg(
        &bin,
        &[
            "faults.lost_transfer_every=3",
            "server.cache_transceiver_config.kv_transfer_timeout_ms=300",
        ],
        "disagg-mpi-lost.json",
    );
    // Each ctx rank process loses every third KV send of its own.
    let lost = r.servers[0].transfers.lost;
    assert!(lost >= 2, "{lost}");
    let failed: Vec<_> = r
        .per_request
        .iter()
        .filter(|d| d.failure.is_some())
        .collect();
    assert_eq!(r.requests.completed + r.requests.failed, 40);
    assert_eq!(failed.len() as u64, lost, "{failed:?}");
    for d in &failed {
        let why = d.failure.as_deref().unwrap_or_default();
        assert!(why.contains("kv transfer timed out after 300 ms"), "{why}");
        assert_eq!(d.output_tokens, 1, "{d:?}");
    }
    for s in &r.servers {
        assert_eq!(s.transfers.timeouts, lost, "{}", s.name);
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
fn disaggregated_serving_completes_every_request_under_the_legacy_policy_too() {
    // threads
    let mut s = disagg_small(&[]);
    s.apply_set("policy.preset=legacy").unwrap();
    let r = disagg_threads_run(&s, None);
    assert!(!r.legacy_switches.is_empty());
    assert_eq!(r.requests.completed, 40, "{:?}", r.per_request);
    // mpi
    let Some(bin) = mpi_bin() else { return };
    let m = mpi_disagg(&bin, &["policy.preset=legacy"], "disagg-mpi-legacy.json");
    assert!(!m.legacy_switches.is_empty());
    assert_eq!(m.requests.completed, 40, "{:?}", m.per_request);
    for s in &m.servers {
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
fn generation_first_serving_promotes_every_request_and_streams_the_simulators_tokens() {
    let first = "server.ctx0.cache_transceiver_config.generation_first=true";
    let s = disagg_small(&[first]);
    let sim = simulate(&s);
    let promoted = |r: &Report| {
        r.servers
            .iter()
            .find(|s| s.name == "ctx0")
            .unwrap()
            .transfers
            .generation_first_promoted
    };
    assert_eq!(sim.requests.completed, 40);
    assert_eq!(promoted(&sim), 40);
    let t = disagg_threads_run(&s, None);
    assert_eq!(t.requests.completed, 40, "{:?}", t.per_request);
    assert_eq!(promoted(&t), 40);
    assert_eq!(t.per_request, sim.per_request);
    let Some(bin) = mpi_bin() else { return };
    let m = mpi_disagg(&bin, &[first], "disagg-mpi-first.json");
    assert_eq!(m.requests.completed, 40, "{:?}", m.per_request);
    assert_eq!(promoted(&m), 40);
    let mut sets = MPI_DISAGG_SETS[4..].to_vec();
    sets.push(first);
    assert_eq!(m.per_request, simulate(&disagg_small(&sets)).per_request);
}
