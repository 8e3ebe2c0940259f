//! An ordered threads run (`--ordered`) against the simulator: the real hosts, taking
//! turns in the simulator's order of events in modeled time, do exactly what the
//! simulator does — every request's tokens and failure, and every server's iterations,
//! forwards and routing, gen servers included (which an unordered run leaves to thread
//! timing) — on aggregated and disaggregated fleets, with lost KV, generation-first
//! transfers, the legacy policy and a control link with latency. (The MPI driver's
//! ordered run: `mpi.rs`.)

mod common;

use std::process::Command;

use common::*;
use lockstep_plan::report::Report;
use lockstep_plan::scenario::Scenario;
use lockstep_runtime::RealOptions;

fn ordered() -> RealOptions {
    RealOptions {
        ordered: true,
        ..real_options()
    }
}

fn assert_agree(s: &Scenario, what: &str) -> Report {
    let a = simulate(s);
    let b = threads_run(s, ordered());
    assert_eq!(whole_fingerprint(&a), whole_fingerprint(&b), "{what}");
    b
}

#[test]
fn an_ordered_run_does_what_the_simulator_does_on_every_server_of_a_disaggregated_fleet() {
    // Two ctx and two gen servers; with a slow control link (5 ms) every message's arrival
    // time matters (a read that took one early would change the run).
    for sets in [&[][..], &["model.link.control_latency_us=5000"][..]] {
        let r = assert_agree(&parse(&disagg_text(60), sets), &format!("{sets:?}"));
        assert_eq!(r.requests.completed, 60);
        let transfers = multi_token_requests(&r);
        let receives: u64 = r.servers[2..].iter().map(|s| s.transfers.count).sum();
        assert_eq!(receives, transfers);
        // The gen servers took work: their routing is part of what agrees.
        for s in &r.servers[2..] {
            assert!(s.ranks.iter().map(|k| k.routed_requests).sum::<u64>() > 0);
        }
    }
}

#[test]
fn an_ordered_run_agrees_with_lost_kv_generation_first_and_the_legacy_policy() {
    let sets = ["workload.num_requests=60", "workload.concurrency=60"];
    for extra in [
        "faults.lost_transfer_every=3",
        "server.ctx0.cache_transceiver_config.generation_first=true",
        "server.gen0.cache_transceiver_config.kv_transfer_timeout_ms=1",
    ] {
        let s = example("disagg-small.toml", &[sets[0], sets[1], extra]);
        let r = assert_agree(&s, extra);
        if extra.starts_with("faults") {
            assert!(r.requests.failed > 0, "the wire lost KV");
        }
    }
    let mut legacy = example("disagg-small.toml", &sets);
    legacy.policy = lockstep_actors::policy::Policy::LEGACY;
    assert_agree(&legacy, "legacy");
}

#[test]
fn an_ordered_aggregated_run_agrees_exactly() {
    for (dp, overlap) in [(4, true), (2, false)] {
        let r = assert_agree(&parse(&agg_text(dp, overlap), &[]), &format!("dp {dp}"));
        assert_eq!(r.requests.completed, 80);
    }
}

#[test]
fn ordered_needs_preload_and_refuses_a_time_scale() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(["run", "examples/disagg-small.toml"])
            .args(args)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .output()
            .expect("lockstep runs")
    };
    let without_preload = run(&["--ordered"]);
    assert!(!without_preload.status.success());
    assert!(String::from_utf8_lossy(&without_preload.stderr).contains("--preload"));
    let paced = run(&["--ordered", "--preload", "--time-scale", "0.5"]);
    assert!(!paced.status.success());
    assert!(String::from_utf8_lossy(&paced.stderr).contains("--time-scale 0.5"));
}

#[test]
fn an_mpi_run_that_cannot_be_preloaded_is_refused_before_mpirun_starts() {
    // The README's MPI example once hung here: the front refused after mpirun had
    // started every rank, and the ranks waited for it forever. The refusal comes before
    // any process starts, with the words `sim` and `threads` use, and in a build without
    // MPI too.
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([
            "run",
            "--driver",
            "mpi",
            "examples/disagg-small.toml",
            "--preload",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .output()
        .expect("lockstep runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--preload delivers every request before the first iteration")
            && err.contains("workload.concurrency"),
        "{err}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn servers_costed_apart_agree_and_cost_what_they_say() {
    // ctx0's prefill ten times dearer and gen1's forwards twice as long as the fleet's:
    // each driver times each server with its own cost model.
    let own = [
        "model.servers.ctx0.coefficients.ctx_token_ns=360000.0",
        "model.servers.gen1.coefficients.forward_base_ns=13000000.0",
    ];
    let s = parse(&disagg_text(60), &own);
    assert_agree(&s, "servers costed apart");
    // Modeled time from the simulator (the threads run's busy time is its wall clock's).
    let r = simulate(&s);
    let plain = simulate(&parse(&disagg_text(60), &[]));
    let per_iteration =
        |r: &Report, i: usize| r.servers[i].busy_time_s / r.servers[i].iterations.max(1) as f64;
    // ctx0's iterations (all prefill) are slower than in the fleet costed alike; the
    // plan hands each server its own model, the rest the fleet's.
    assert!(per_iteration(&r, 0) > 2.0 * per_iteration(&plain, 0));
    let fleet = lockstep_plan::fleet::Fleet::plan(&s, 0).expect("a valid scenario");
    let c: Vec<_> = fleet.servers.iter().map(|p| p.coefficients).collect();
    assert_eq!(c[0].ctx_token_ns, 360_000.0);
    assert_eq!(c[3].forward_base_ns, 13_000_000.0);
    assert_eq!(c[1], fleet.profile.coefficients);
    assert_eq!(c[2], fleet.profile.coefficients);
    let e = lockstep_plan::fleet::Fleet::plan(
        &parse(&disagg_text(60), &["model.servers.ctx9.tp=2"]),
        0,
    )
    .map(|_| ())
    .expect_err("a server the scenario does not have");
    assert!(e.to_string().contains("ctx9"), "{e}");
}
