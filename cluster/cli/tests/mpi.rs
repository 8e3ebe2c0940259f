//! The MPI driver (one front process and one process per rank under mpirun) against the
//! simulator, and its faults: a mismatched collective, a killed or stopped rank, a
//! wrong world size, a stalled server; and the same time model as the simulator. Each
//! test needs mpirun and the MPI build, so each is `#[ignore]`d: a plain `cargo test`
//! reports them as ignored, and `scripts/test.sh` runs them, one at a time, with
//! `LOCKSTEP_MPI_BIN` naming the build (`cargo test -p lockstep --test mpi --
//! --ignored --test-threads=1`). Run that way without `LOCKSTEP_MPI_BIN`, they fail.

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use lockstep_actors::ids::ReqId;
use lockstep_actors::transceiver::lost_on_the_wire;
use lockstep_plan::report::{Outcome, Report};
use lockstep_runtime::device::ForwardRecord;

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_aggregated_runs_agree_exactly_with_the_simulator_at_2_and_4_ranks() {
    let bin = mpi_bin();
    for dp in [2, 4] {
        let text = agg_text(dp, true);
        let mpi = mpi_report(&bin, &text, &[], &format!("agg-{dp}"));
        let sim = simulate(&parse(&text, &[]));
        assert_eq!(agg_fingerprint(&mpi), agg_fingerprint(&sim), "dp {dp}");
    }
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_disaggregated_runs_stream_the_simulators_tokens_over_two_ctx_and_two_gen_servers() {
    let bin = mpi_bin();
    let text = disagg_text(60);
    let mpi = mpi_report(&bin, &text, &[], "disagg");
    let sim = simulate(&parse(&text, &[]));
    assert_eq!(mpi.requests.completed, 60, "{:?}", mpi.per_request);
    assert_eq!(disagg_fingerprint(&mpi), disagg_fingerprint(&sim));
    let transfers = multi_token_requests(&mpi);
    for s in &mpi.servers {
        assert_eq!(
            (s.transfers.timeouts, s.transfers.checksum_failures),
            (0, 0),
            "{}",
            s.name
        );
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
        assert_eq!(s.violation_count, 0, "{}: {:?}", s.name, s.violations);
    }
    let sends: u64 = mpi.servers[..2].iter().map(|s| s.transfers.count).sum();
    let receives: u64 = mpi.servers[2..].iter().map(|s| s.transfers.count).sum();
    assert_eq!((sends, receives), (transfers, transfers));
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_ordered_runs_do_what_the_simulator_does_on_every_server() {
    // The front process holds the order; every rank process's hosts take their turns
    // by calls to it. Two ctx and two gen servers, once with a slow control link and
    // lost KV, so arrival times and failures both matter, and once with two servers
    // costed apart.
    let bin = mpi_bin();
    let text = disagg_text(60);
    for sets in [
        &[][..],
        &[
            "model.link.control_latency_us=5000",
            "faults.lost_transfer_every=5",
        ][..],
        // Servers costed apart: each rank process times its server with its own model.
        &[
            "model.servers.ctx0.coefficients.ctx_token_ns=360000.0",
            "model.servers.gen1.coefficients.forward_base_ns=13000000.0",
        ][..],
    ] {
        let mpi = mpi_report_with(&bin, &text, sets, "disagg-ordered", &["--ordered"]);
        let sim = simulate(&parse(&text, sets));
        assert_eq!(whole_fingerprint(&mpi), whole_fingerprint(&sim), "{sets:?}");
        assert!(mpi.servers[2..].iter().all(|s| s.transfers.count > 0));
    }
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_lost_kv_fails_exactly_the_requests_the_simulator_fails() {
    let bin = mpi_bin();
    let sets = [
        "faults.lost_transfer_every=3",
        "server.cache_transceiver_config.kv_transfer_timeout_ms=300",
    ];
    let text = disagg_text(40);
    let mpi = mpi_report(&bin, &text, &sets, "disagg-lost");
    let sim = simulate(&parse(&text, &sets));
    let outcome = |r: &Report| -> Vec<(u64, u32, u64, bool)> {
        r.per_request
            .iter()
            .map(|d| (d.id, d.output_tokens, d.token_digest, d.failure().is_some()))
            .collect()
    };
    assert_eq!(outcome(&mpi), outcome(&sim));
    let failed = failed_ids(&mpi);
    assert!(failed.len() >= 2, "{failed:?}");
    for d in &mpi.per_request {
        let lost = lost_on_the_wire(ReqId(d.id), Some(3));
        let single_token = d.failure().is_none() && d.output_tokens == 1;
        assert_eq!(d.failure().is_some(), lost && !single_token, "{d:?}");
        if let Some(why) = d.failure() {
            assert!(why.contains("kv transfer timed out after 300 ms"), "{why}");
        }
    }
    for s in &mpi.servers {
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_world_size_mismatch_is_a_clear_error_naming_both_numbers() {
    let bin = mpi_bin();
    let agg = temp("size-agg.toml");
    std::fs::write(&agg, agg_text(4, true)).unwrap();
    let disagg = temp("size-disagg.toml");
    std::fs::write(&disagg, disagg_text(10)).unwrap();
    // Aggregated dp 4 needs 1 front + 4 = 5 processes; the 2x2 fleet 1 + 2 + 1 + 2 + 1.
    for (path, n, says) in [
        (&agg, 2, ["world size 2", "5 processes", "agg0 dp 4"]),
        (&disagg, 5, ["world size 5", "7 processes", "gen1 dp 1"]),
    ] {
        let out = output_within(
            mpirun(&bin, n, &[path.to_str().unwrap(), "--preload"]),
            Duration::from_secs(60),
        );
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(says.iter().all(|s| err.contains(s)), "{err}");
    }
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_a_mismatched_collective_is_a_tag_error_not_a_hang() {
    let bin = mpi_bin();
    let path = temp("tag.toml");
    std::fs::write(&path, agg_text(2, true)).unwrap();
    // A hang (rather than the tag error) runs into the deadline and fails the test.
    let out = output_within(
        mpirun(
            &bin,
            3,
            &[
                path.to_str().unwrap(),
                "--preload",
                "--watchdog-ms",
                "5000",
                "--inject-tag-mismatch",
                "1:5",
            ],
        ),
        Duration::from_secs(60),
    );
    assert!(!out.status.success(), "a failed run exits non-zero");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("tag mismatch") && text.contains("Gather") && text.contains("Vote"),
        "{text}"
    );
}

/// A slow MPI job (the cost model in real time, aggregated dp 2: the front is world rank
/// 0, the server's ranks 1 and 2), and the pid of the process of world rank `victim`.
/// The caller waits on the child; a panic while looking for the pid ends the test process
/// (and with it mpirun, whose stdin and stderr close).
#[allow(clippy::zombie_processes)]
fn slow_job(
    bin: &PathBuf,
    name: &str,
    watchdog_ms: &str,
    victim: u32,
) -> (std::process::Child, u32) {
    let path = temp(name);
    let text = agg_text(2, true)
        .replace("num_requests = 80", "num_requests = 4000")
        .replace("concurrency = 80", "concurrency = 64");
    std::fs::write(&path, text).unwrap();
    let mut child = mpirun(
        bin,
        3,
        &[
            path.to_str().unwrap(),
            "--time-scale",
            "1.0",
            "--watchdog-ms",
            watchdog_ms,
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Find the process of that world rank (OpenMPI tells each its rank) once it is
    // inside its iterations (its watchdog thread runs), polling /proc until a deadline.
    let deadline = Instant::now() + Duration::from_secs(30);
    let wanted = format!("OMPI_COMM_WORLD_RANK={victim}");
    loop {
        if let Some(pid) = rank_process(&path, &wanted) {
            return (child, pid);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the job's processes did not come up");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pid of the process whose command line names `scenario` and whose environment
/// holds `env` (e.g. `OMPI_COMM_WORLD_RANK=2`), once it runs a thread named `watchdog`
/// (spawned when the rank enters its iterations); `None` before that.
fn rank_process(scenario: &std::path::Path, env: &str) -> Option<u32> {
    let scenario = scenario.to_str()?.as_bytes();
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            cmdline.windows(scenario.len()).any(|w| w == scenario)
                && environ.split(|&b| b == 0).any(|kv| kv == env.as_bytes())
                && std::fs::read_dir(format!("/proc/{pid}/task"))
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t.ok())
                    .any(|t| {
                        std::fs::read_to_string(t.path().join("comm"))
                            .is_ok_and(|c| c.trim() == "watchdog")
                    })
        })
}

/// Waits for `child` to end, killing it (and failing) after `limit`.
fn wait_within(mut child: std::process::Child, limit: Duration) -> std::process::Output {
    let started = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("the job did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_a_killed_rank_ends_the_job_non_zero_within_the_watchdog_time() {
    let bin = mpi_bin();
    let (child, victim) = slow_job(&bin, "kill.toml", "3000", 2);
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let out = wait_within(child, Duration::from_secs(20));
    assert!(
        !out.status.success(),
        "the job must fail when a rank is lost"
    );
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_the_watchdog_aborts_the_job_naming_the_stuck_rank_when_a_peer_stops() {
    let bin = mpi_bin();
    let (child, victim) = slow_job(&bin, "stop.toml", "2000", 2);
    // A stopped rank neither progresses nor dies: only its peers' watchdogs end this.
    Command::new("kill")
        .args(["-STOP", &victim.to_string()])
        .status()
        .unwrap();
    // Only the watchdog ends the job: past the deadline the test fails.
    let out = wait_within(child, Duration::from_secs(20));
    let _ = Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lockstep watchdog: server `agg0` rank 0")
            && err.contains("no sign of life for 2000 ms")
            && err.contains("live"),
        "{err}"
    );
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_a_stalled_server_ends_deadlocked_as_in_the_simulator() {
    let bin = mpi_bin();
    // A legacy-only stall (as in threads.rs): judged on the routable count, rank 0 waits
    // for input while its one retiring request needs one more iteration.
    let sets = [
        "policy.idle.predicate=\"routable\"",
        "workload.num_requests=1",
        "workload.concurrency=1",
        "workload.output_len=1",
    ];
    let text = agg_text(2, true);
    let path = temp("stall.toml");
    std::fs::write(&path, &text).unwrap();
    let json = temp("stall.json");
    let mut args = vec![
        path.to_str().unwrap().to_string(),
        "--stall-timeout-ms".into(),
        "300".into(),
        "--json".into(),
        json.to_str().unwrap().into(),
    ];
    for s in sets {
        args.push("--set".into());
        args.push(s.into());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // A hang instead of the stall-out runs into the deadline and fails the test.
    let _ = output_within(mpirun(&bin, 3, &args), Duration::from_secs(60));
    let r: Report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r.outcome, Outcome::Deadlocked, "{:?}", r.outcome_detail);
    let detail = r.outcome_detail.unwrap_or_default();
    assert!(
        detail.contains("rank 0:") && detail.contains("rank 1:"),
        "{detail}"
    );
    assert_eq!(r.requests.failed, 1);
    let sim = simulate_with(&parse(&text, &sets), |o| {
        o.preload = false;
        o.stall_bound_ns = 300_000_000;
    });
    assert_eq!(sim.outcome, Outcome::Deadlocked);
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_generation_first_and_the_legacy_policy_complete_every_request() {
    let bin = mpi_bin();
    let text = disagg_text(40);
    let first = ["server.ctx0.cache_transceiver_config.generation_first=true"];
    let m = mpi_report(&bin, &text, &first, "disagg-first");
    let sim = simulate(&parse(&text, &first));
    let promoted = |r: &Report| {
        r.servers
            .iter()
            .find(|s| s.name == "ctx0")
            .unwrap()
            .transfers
            .generation_first_promoted
    };
    assert_eq!(m.requests.completed, 40, "{:?}", m.per_request);
    assert!(promoted(&m) > 0);
    assert_eq!(promoted(&m), promoted(&sim));
    assert_eq!(disagg_fingerprint(&m), disagg_fingerprint(&sim));
    let legacy = ["policy.preset=\"legacy\""];
    let l = mpi_report(&bin, &text, &legacy, "disagg-legacy");
    assert!(!l.legacy_switches.is_empty());
    assert_eq!(l.requests.completed, 40, "{:?}", l.per_request);
    for s in &l.servers {
        assert_eq!(s.kv.used_blocks_at_end, 0, "{}: leaked KV", s.name);
    }
}

/// The same time model as the simulator (`time_model.rs`) over MPI, 7 processes: with
/// the cost model in real time, latencies and iterations follow the simulator's.
#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_with_modeled_time_latency_and_iterations_follow_the_simulator() {
    let bin = mpi_bin();
    let text = disagg_text(200);
    let a = simulate(&parse(&text, &[]));
    let path = temp("time-model.toml");
    std::fs::write(&path, &text).unwrap();
    let json = temp("time-model.json");
    passes_within_attempts(|| {
        let out = output_within(
            mpirun(
                &bin,
                7,
                &[
                    path.to_str().unwrap(),
                    "--seed",
                    "3",
                    "--preload",
                    "--time-scale",
                    "1",
                    "--json",
                    json.to_str().unwrap(),
                ],
            ),
            std::time::Duration::from_secs(120),
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let b: Report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        same_time_model(&a, &b)?;
        if disagg_fingerprint(&a) != disagg_fingerprint(&b) {
            return Err("ctx routing or token streams differ".into());
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_serve_streams_cancels_and_drains_a_disaggregated_fleet_over_http() {
    use common::serve::*;
    use serde_json::json;
    use std::io::{BufRead, BufReader, Read};
    let bin = mpi_bin();
    let mut s = Server::start_with(
        &bin,
        "disagg-small.toml",
        &["--driver", "mpi", "--time-scale", "1"],
    );
    // A streamed chat completion crosses the ctx → gen handoff between processes.
    let resp = agent()
        .post(&s.url("/v1/chat/completions"))
        .set("Content-Type", "application/json")
        .send_string(
            &json!({"messages": [{"role": "user", "content": "hello over mpi"}], "max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}})
                .to_string(),
        )
        .expect("the stream");
    let body = resp.into_string().expect("the body");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let usage = json_of(&events[events.len() - 2]);
    assert_eq!(usage["usage"]["completion_tokens"], 6, "{body}");
    // Every rank of both servers reports, and the gen server received the KV.
    let m = scrape_until(&s, |m| {
        over_ranks(m, "lockstep_rank_kv_transfers_total") >= 1.0
    });
    assert_eq!(
        m.iter()
            .filter(|(n, _)| n.starts_with("lockstep_kv_cache_usage_perc{"))
            .count(),
        6,
        "ctx dp 2 + gen dp 4: {m:?}"
    );
    assert!(over_ranks(&m, "lockstep_rank_kv_transfers_total") >= 1.0);
    // A client that leaves mid-stream frees its KV on the gen rank.
    let c = start_request(
        &s,
        &json!({"prompt": "a b c d e f g h", "max_tokens": 3000, "stream": true}),
        true,
    );
    let running = scrape_until(&s, |m| over_ranks(m, "lockstep_kv_cache_used_blocks") > 0.0);
    assert!(over_ranks(&running, "lockstep_kv_cache_used_blocks") > 0.0);
    drop(c);
    let after = scrape_until(&s, |m| {
        sample(m, "lockstep_request_cancelled_total") == 1.0
            && over_ranks(m, "lockstep_kv_cache_used_blocks") == 0.0
    });
    assert_eq!(sample(&after, "lockstep_request_cancelled_total"), 1.0);
    assert_eq!(over_ranks(&after, "lockstep_kv_cache_used_blocks"), 0.0);
    // SIGTERM to the launcher drains: the stream in flight ends whole, then every
    // process exits and the launcher with status 0.
    let max = 200;
    let resp = agent()
        .post(&s.url("/v1/completions"))
        .set("Content-Type", "application/json")
        .send_string(&json!({"prompt": "go", "max_tokens": max, "stream": true, "stream_options": {"include_usage": true}}).to_string())
        .expect("the stream starts");
    let mut reader = BufReader::new(resp.into_reader());
    let mut first = String::new();
    reader.read_line(&mut first).expect("a first event");
    s.signal("TERM");
    let mut rest = String::new();
    reader.read_to_string(&mut rest).expect("the rest");
    let events = sse_events(&format!("{first}{rest}"));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        json_of(&events[events.len() - 2])["usage"]["completion_tokens"],
        max
    );
    let (status, out) = s.wait_exit();
    assert!(status.success(), "{status:?}: {out:?}");
    assert!(
        out.iter()
            .any(|l| l.contains("stopped after 3 requests; 6 ranks ended")),
        "{out:?}"
    );
}

/// `--model` under mpirun: every rank process loads the model and runs its forwards on
/// its device thread; every request's greedy and seeded tokens equal the simulator's
/// (which equal the dense reference: `model_runs.rs`), on an aggregated fleet and on a
/// disaggregated one whose gen ranks decode from K/V moved between processes.
#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_with_a_real_model_streams_the_simulators_tokens_greedy_and_seeded() {
    use lockstep_gpu::model::{InitOptions, SamplingParams, write_random_model};
    use lockstep_plan::model_backend::ModelBackend;
    let bin = mpi_bin();
    let dir = temp("mpi-model");
    let _ = std::fs::remove_dir_all(&dir);
    write_random_model(&dir, &InitOptions::default()).expect("init the tiny model");
    let example = |name: &str| {
        std::fs::read_to_string(common::serve::example(name))
            .expect("the example")
            .replace("num_requests = 64", "num_requests = 24")
    };
    let agg = example("model/agg-tiny.toml");
    let disagg = example("model/disagg-tiny.toml");
    for (temperature, text) in [(0.0f32, &agg), (0.8, &agg), (0.0, &disagg), (0.8, &disagg)] {
        let name = format!("mpi-model-{temperature}-{}", text.len());
        let (mut args, json) = rank_args(text, &[], &name);
        let dir_arg = dir.to_string_lossy().into_owned();
        let log = temp(&format!("{name}.forwards.jsonl"));
        let _ = std::fs::remove_file(&log);
        args.extend([
            "--forward-log".into(),
            log.to_string_lossy().into_owned(),
            "--model".into(),
            dir_arg,
            "--temperature".into(),
            temperature.to_string(),
            "--top-k".into(),
            "40".into(),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let s = parse(text, &[]);
        let out = output_within(mpirun(&bin, processes(&s), &args), Duration::from_secs(120));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mpi: Report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        let params = SamplingParams {
            temperature,
            top_k: 40,
            ..SamplingParams::default()
        };
        let model = ModelBackend::load(&dir, params, 3).expect("load");
        // The simulator runs the aggregated fleet: the disaggregated one's tokens equal
        // it too.
        let sim = lockstep_sim::run(
            &parse(&agg, &[]),
            lockstep_sim::SimOptions {
                seed: 3,
                preload: true,
                model: Some(model),
                ..Default::default()
            },
        )
        .expect("sim");
        assert_eq!(mpi.requests.completed, 24, "{:?}", mpi.per_request);
        let streams = |r: &Report| -> Vec<(u64, u32, u64)> {
            r.per_request
                .iter()
                .map(|d| (d.id, d.output_tokens, d.token_digest))
                .collect()
        };
        assert_eq!(
            streams(&mpi),
            streams(&sim),
            "temperature {temperature}, {}",
            s.name
        );
        // Every rank process appended its forwards to the one log, in whole lines.
        let lines = std::fs::read_to_string(&log).expect("the forward log");
        let mut writers = std::collections::BTreeSet::new();
        for (n, line) in lines.lines().enumerate() {
            let r: ForwardRecord = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("line {}: {e}: {line}", n + 1));
            writers.insert((r.server, r.rank));
        }
        let ranks: Vec<(usize, u32)> = s
            .servers
            .iter()
            .enumerate()
            .flat_map(|(i, c)| {
                let dp = c.derive(&s.policy).expect("valid").sizes.dp;
                (0..dp).map(move |r| (i, r))
            })
            .collect();
        assert_eq!(writers.into_iter().collect::<Vec<_>>(), ranks, "{}", s.name);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A search spec with more candidates than one round holds, so the processes exchange
/// results several times and the bound prunes between rounds.
const SEARCH_SPEC: &str = r#"
name = "shared"
[model]
profile = "llama3-8b-h100-bf16"
[gpus]
total = 8
kv_tokens_per_rank = 200000
[frontend]
preset = "none"
[workload]
input_len = [256, 1024]
output_len = [32, 128]
max_concurrency = 96
[slo.p90]
ttft_ms = 400
tpot_ms = 40
[space]
modes = ["agg"]
tp = [1, 2]
max_batch_size = [4, 8, 16, 32]
overlap = [true, false]
agg_instances = [1, 2]
[method]
finalists = 3
seeds = 2
"#;

#[test]
#[ignore = "needs mpirun and the MPI build; scripts/test.sh runs it"]
fn mpi_search_over_three_processes_ranks_as_one_process_does() {
    let bin = mpi_bin();
    let dir = temp("search-shared");
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("shared.toml");
    std::fs::write(&spec, SEARCH_SPEC).unwrap();
    let (one, three) = (dir.join("one"), dir.join("three"));
    let mut alone = Command::new(&bin);
    alone.args([
        "search",
        spec.to_str().unwrap(),
        "--out",
        one.to_str().unwrap(),
    ]);
    let a = output_within(alone, Duration::from_secs(300));
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let mut shared = Command::new("mpirun");
    shared
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .args(["--oversubscribe", "-n", "3"])
        .arg(&bin)
        .args([
            "search",
            spec.to_str().unwrap(),
            "--out",
            three.to_str().unwrap(),
        ]);
    let b = output_within(shared, Duration::from_secs(300));
    assert!(b.status.success(), "{}", String::from_utf8_lossy(&b.stderr));
    let table = |o: &std::process::Output| -> String {
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.starts_with("searched in") && !l.starts_with("wrote "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (ta, tb) = (table(&a), table(&b));
    assert!(ta.contains("pruned"), "{ta}");
    assert!(
        ta.contains("2 of 3 seeds") || ta.contains("3 of 3 seeds"),
        "{ta}"
    );
    // One process printed the answer, and it is the same answer.
    assert_eq!(ta, tb);
    let csv = |d: &PathBuf| std::fs::read_to_string(d.join("ranked.csv")).unwrap();
    assert_eq!(csv(&one), csv(&three));
    let _ = std::fs::remove_dir_all(&dir);
}
