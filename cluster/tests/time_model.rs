//! The same time model in the simulator and the threads driver: with the cost model in
//! real time (`--time-scale 1`), the threads driver's latencies and iterations follow the
//! simulator's. One test in its own binary, run alone: modeled time on a small machine
//! must not share it with other tests.

mod common;

use common::*;
use lockstep_cluster::backends::RealOptions;
use lockstep_cluster::report::Report;

/// The same time model: with the cost model in real time (`--time-scale 1`), the threads
/// driver's latencies and iterations follow the simulator's.
fn assert_same_time_model(a: &Report, b: &Report) {
    assert_eq!(a.per_request, b.per_request);
    let (la, lb) = (&a.latency_ms, &b.latency_ms);
    assert!(
        within(la.ttft.mean, lb.ttft.mean, 10.0),
        "ttft {:?} vs {:?}",
        la.ttft,
        lb.ttft
    );
    assert!(
        within(la.tpot.mean, lb.tpot.mean, 10.0),
        "tpot {:?} vs {:?}",
        la.tpot,
        lb.tpot
    );
    for (sa, sb) in a.servers.iter().zip(&b.servers) {
        assert!(
            close_counts(sa.iterations, sb.iterations, 3),
            "{}: {} iterations simulated, {} run",
            sa.name,
            sa.iterations,
            sb.iterations
        );
    }
}

fn disaggregated() {
    let s = parse(&disagg_text(200), &[]);
    let a = simulate(&s);
    let b = threads_run(
        &s,
        RealOptions {
            time_scale: 1.0,
            ..real_options()
        },
    );
    assert_same_time_model(&a, &b);
    for ctx in ["ctx0", "ctx1"] {
        assert_eq!(routing(&a, ctx), routing(&b, ctx), "{ctx}");
    }
}

fn aggregated() {
    // Open loop: arrivals at random instants, as clients send them, at a load the
    // server keeps up with (near saturation queueing amplifies any timing noise of a
    // small shared machine).
    let s = example(
        "agg-balanced.toml",
        &["workload.num_requests=40", "workload.rate=8.0"],
    );
    let a = simulate_with(&s, |o| o.preload = false);
    let b = threads_run(
        &s,
        RealOptions {
            time_scale: 1.0,
            preload: false,
            ..real_options()
        },
    );
    assert_same_time_model(&a, &b);
}

/// The same check over MPI (7 processes): the disaggregated fleet.
fn disaggregated_over_mpi() {
    let Some(bin) = mpi_bin("with_modeled_time_latency_and_iterations_follow_the_simulator (mpi)")
    else {
        return;
    };
    let text = disagg_text(200);
    let a = simulate(&parse(&text, &[]));
    let path = temp("time-model.toml");
    std::fs::write(&path, &text).unwrap();
    let json = temp("time-model.json");
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
    assert_same_time_model(&a, &b);
    for ctx in ["ctx0", "ctx1"] {
        assert_eq!(routing(&a, ctx), routing(&b, ctx), "{ctx}");
    }
}

#[test]
fn with_modeled_time_latency_and_iterations_follow_the_simulator() {
    disaggregated();
    aggregated();
    disaggregated_over_mpi();
}
