//! The same time model in the simulator and the threads driver: with the cost model in
//! real time (`--time-scale 1`), the threads driver's latencies and iterations follow the
//! simulator's, the serving front door's service included. One test in its own binary, run alone: modeled time on a small machine
//! must not share it with other tests. (The same check over MPI is in `mpi.rs`.)

mod common;

use common::*;
use lockstep_runtime::RealOptions;

/// The same time model: with the cost model in real time (`--time-scale 1`), the threads
/// driver's latencies and iterations follow the simulator's (in one of
/// [`PACED_ATTEMPTS`] runs: wall-time pacing on a shared machine).
fn disaggregated() {
    let s = parse(&disagg_text(200), &[]);
    let a = simulate(&s);
    passes_within_attempts(|| {
        let b = threads_run(
            &s,
            RealOptions {
                time_scale: 1.0,
                ..real_options()
            },
        );
        same_time_model(&a, &b)?;
        // The ctx routing and the token streams (which carry each prompt's ctx rank).
        if disagg_fingerprint(&a) != disagg_fingerprint(&b) {
            return Err("ctx routing or token streams differ".into());
        }
        Ok(())
    });
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
    passes_within_attempts(|| {
        let b = threads_run(
            &s,
            RealOptions {
                time_scale: 1.0,
                preload: false,
                ..real_options()
            },
        );
        // The front door ran in both, and served every request for the same time.
        let service = |r: &lockstep_plan::report::Report| -> Vec<f64> {
            r.per_request.iter().map(|d| d.front_service_ms()).collect()
        };
        if b.frontend.is_none() || service(&a) != service(&b) || service(&a)[0] <= 0.0 {
            return Err(format!("front door: {:?} vs {:?}", a.frontend, b.frontend));
        }
        same_time_model(&a, &b)
    });
}

#[test]
fn with_modeled_time_latency_and_iterations_follow_the_simulator() {
    disaggregated();
    aggregated();
}
