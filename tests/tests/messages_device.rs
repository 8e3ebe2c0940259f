//! The device time model driven through its message interface: [`DeviceIn`] launches
//! through `handle`, the clock through `handle_timeout`, outputs drained with `poll_out`,
//! and `poll_timeout` saying when to come back (mechanisms.md §3, the overlap scheduler:
//! forwards run one at a time in launch order).

use lockstep_actors::device::{Device, DeviceIn, DeviceOut};
use lockstep_actors::ids::BatchNumber;

fn launch(d: &mut Device, now: u64, batch: u64, forward_ns: u64) {
    d.handle(
        now,
        DeviceIn::Launch {
            batch: BatchNumber(batch),
            forward_ns,
        },
    );
}

fn outputs(d: &mut Device) -> Vec<u64> {
    std::iter::from_fn(|| d.poll_out())
        .map(|DeviceOut::Ready(b)| b.0)
        .collect()
}

/// Runs the device as a host would: between launches it sleeps until `poll_timeout`
/// (never past the next launch), fires it, and drains the outputs. Returns
/// `(time, batch)` for every output, and checks that one nanosecond before each
/// announced deadline nothing was ready.
fn run(launches: &[(u64, u64, u64)]) -> Vec<(u64, u64)> {
    let mut d = Device::new();
    let mut seen = Vec::new();
    let mut next = 0;
    loop {
        let next_launch = launches.get(next).map(|&(at, _, _)| at);
        let deadline = d.poll_timeout();
        match (next_launch, deadline) {
            (None, None) => break,
            (Some(at), dl) if dl.is_none_or(|dl| at < dl) => {
                let (at, batch, forward_ns) = launches[next];
                d.handle_timeout(at);
                assert_eq!(
                    outputs(&mut d),
                    Vec::<u64>::new(),
                    "nothing due before {at}"
                );
                launch(&mut d, at, batch, forward_ns);
                next += 1;
            }
            (_, Some(dl)) => {
                if dl > 0 {
                    d.handle_timeout(dl - 1);
                    assert_eq!(outputs(&mut d), Vec::<u64>::new(), "early at {}", dl - 1);
                }
                d.handle_timeout(dl);
                let out = outputs(&mut d);
                assert!(!out.is_empty(), "the deadline {dl} announced an output");
                seen.extend(out.into_iter().map(|b| (dl, b)));
            }
            (Some(_), None) => unreachable!("a launch with no deadline is taken above"),
        }
    }
    seen
}

/// The model in words: a forward starts when it is launched or when the one before it
/// ends, whichever is later, and takes its time.
fn model(launches: &[(u64, u64, u64)]) -> Vec<(u64, u64)> {
    let mut free_at = 0u64;
    launches
        .iter()
        .map(|&(at, batch, forward_ns)| {
            free_at = at.max(free_at) + forward_ns;
            (free_at, batch)
        })
        .collect()
}

#[test]
fn an_idle_device_has_no_deadline_and_no_output() {
    let mut d = Device::new();
    assert_eq!(d.poll_timeout(), None);
    d.handle_timeout(u64::MAX);
    assert_eq!(d.poll_out(), None);
}

#[test]
fn a_launch_is_ready_exactly_at_its_modeled_end_and_not_a_nanosecond_before() {
    let mut d = Device::new();
    launch(&mut d, 100, 7, 250);
    assert_eq!(d.poll_timeout(), Some(350));
    assert_eq!(d.ready_at(BatchNumber(7)), Some(350));
    for t in [100, 200, 349] {
        d.handle_timeout(t);
        assert_eq!(d.poll_out(), None, "at {t}");
    }
    d.handle_timeout(350);
    assert_eq!(d.poll_out(), Some(DeviceOut::Ready(BatchNumber(7))));
    assert_eq!(d.poll_out(), None, "reported once");
    assert_eq!(d.poll_timeout(), None);
    assert_eq!(d.ready_at(BatchNumber(7)), None, "no longer running");
}

#[test]
fn overlapped_launches_queue_behind_the_running_forward_in_launch_order() {
    let mut d = Device::new();
    launch(&mut d, 0, 0, 10);
    // Launched while batch 0 runs (the overlap scheduler): each waits for the one before.
    launch(&mut d, 4, 1, 10);
    launch(&mut d, 5, 2, 3);
    assert_eq!(d.ready_at(BatchNumber(0)), Some(10));
    assert_eq!(d.ready_at(BatchNumber(1)), Some(20));
    assert_eq!(d.ready_at(BatchNumber(2)), Some(23));
    assert_eq!(d.poll_timeout(), Some(10), "the earliest");

    d.handle_timeout(10);
    assert_eq!(outputs(&mut d), vec![0]);
    assert_eq!(d.poll_timeout(), Some(20));
    d.handle_timeout(19);
    assert_eq!(outputs(&mut d), Vec::<u64>::new());
    d.handle_timeout(22);
    assert_eq!(outputs(&mut d), vec![1]);
    assert_eq!(d.poll_timeout(), Some(23));
    d.handle_timeout(23);
    assert_eq!(outputs(&mut d), vec![2]);
    assert_eq!(d.poll_timeout(), None);
}

#[test]
fn a_late_clock_delivers_everything_due_in_launch_order() {
    let mut d = Device::new();
    launch(&mut d, 0, 3, 5);
    launch(&mut d, 1, 1, 1);
    launch(&mut d, 2, 2, 1);
    d.handle_timeout(1_000);
    assert_eq!(outputs(&mut d), vec![3, 1, 2]);
    // Spurious and repeated calls are harmless.
    d.handle_timeout(1_000);
    d.handle_timeout(0);
    assert_eq!(outputs(&mut d), Vec::<u64>::new());
}

#[test]
fn after_an_idle_gap_a_launch_starts_when_it_is_launched() {
    let mut d = Device::new();
    launch(&mut d, 0, 0, 10);
    d.handle_timeout(10);
    assert_eq!(outputs(&mut d), vec![0]);
    launch(&mut d, 50, 1, 5);
    assert_eq!(d.poll_timeout(), Some(55), "not 15: the device was idle");
    // A zero-time forward is ready at once, behind what runs.
    launch(&mut d, 51, 2, 0);
    assert_eq!(d.ready_at(BatchNumber(2)), Some(55));
    d.handle_timeout(55);
    assert_eq!(outputs(&mut d), vec![1, 2]);
}

#[test]
fn reset_forgets_every_forward() {
    let mut d = Device::new();
    launch(&mut d, 0, 0, 10);
    launch(&mut d, 0, 1, 10);
    d.handle_timeout(10);
    d.reset();
    assert_eq!(d.poll_out(), None, "the ready output is forgotten too");
    assert_eq!(d.poll_timeout(), None);
    d.handle_timeout(100);
    assert_eq!(d.poll_out(), None);
}

#[test]
fn a_host_sleeping_until_poll_timeout_sees_each_output_at_its_modeled_time() {
    let launches = [
        (0, 0, 10),
        (4, 1, 10),
        (5, 2, 3),
        (40, 3, 2),
        (41, 4, 0),
        (60, 5, 7),
    ];
    let seen = run(&launches);
    assert_eq!(
        seen,
        vec![(10, 0), (20, 1), (23, 2), (42, 3), (42, 4), (67, 5)]
    );
    assert_eq!(seen, model(&launches));
}

#[test]
fn scripted_launch_sequences_match_the_serial_model() {
    // A few hundred launches from a fixed linear congruential sequence per seed.
    for seed in 1..=20u64 {
        let mut x = seed;
        let mut step = || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            x >> 33
        };
        let mut at = 0;
        let launches: Vec<(u64, u64, u64)> = (0..300)
            .map(|batch| {
                at += step() % 20;
                (at, batch, step() % 30)
            })
            .collect();
        let seen = run(&launches);
        assert_eq!(seen, model(&launches), "seed {seed}");
        let batches: Vec<u64> = seen.iter().map(|&(_, b)| b).collect();
        assert_eq!(
            batches,
            (0..300).collect::<Vec<_>>(),
            "launch order, seed {seed}"
        );
    }
}
