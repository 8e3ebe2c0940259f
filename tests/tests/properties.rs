//! proptest properties over whole servers (the module-level properties live next to the
//! KV manager, schedulers, routers and seats).

use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::seats::{SkewDirection, SlotPools, validate_pools};
use lockstep_tests::{Harness, adp_server};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    dp: i64,
    b: i64,
    t: i64,
    overlap: bool,
    chunked: bool,
    requests: Vec<(u32, u32)>,
    per_step: usize,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1i64..=4,
        1i64..=4,
        prop_oneof![Just(64i64), Just(256), Just(4096)],
        any::<bool>(),
        any::<bool>(),
        prop::collection::vec((1u32..=300, 1u32..=12), 1..40),
        1usize..=8,
    )
        .prop_map(|(dp, b, t, overlap, chunked, requests, per_step)| Case {
            dp,
            b,
            t,
            overlap,
            chunked,
            requests,
            per_step,
        })
}

fn run(c: &Case, policy: Policy) -> Harness {
    let mut server = adp_server(c.dp, c.b, c.overlap);
    server.max_num_tokens = c.t;
    server.enable_chunked_prefill = c.chunked;
    let mut h = Harness::new(&server, policy);
    let mut pending = c.requests.iter().enumerate().peekable();
    for _ in 0..20_000 {
        for _ in 0..c.per_step {
            if let Some((i, &(p, o))) = pending.next() {
                h.submit(RequestSpec::new(i as u64 + 1, p, o));
            }
        }
        if h.step().is_none() && pending.peek().is_none() {
            break;
        }
    }
    h
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// With the fixed policy no dummy survives any iteration, the cap check and every
    /// other §10 invariant hold, B and T are never exceeded, and every request ends.
    #[test]
    fn fixed_policy_keeps_every_invariant(c in case()) {
        let h = run(&c, Policy::FIXED);
        prop_assert!(h.violations().is_empty(), "{:?}", h.violations());
        for it in &h.iterations {
            for b in &it.launched {
                let real = b.real_entries().count() as i64;
                let tokens: u32 = b.entries.iter().map(|e| e.tokens()).sum();
                prop_assert!(real <= c.b);
                prop_assert!(i64::from(tokens) <= c.t);
            }
        }
        for r in h.group.ranks() {
            prop_assert!(r.dummy().is_none());
        }
        // Prompts longer than T without chunking are refused with a reason; all others
        // complete.
        prop_assert_eq!(h.finished.len() as u64, h.submitted);
    }

    /// The seats validator is two-sided: it accepts exactly the pools equal to the seats
    /// and reports the direction of any skew.
    #[test]
    fn seats_validator_is_two_sided(seats in 1u32..512, sizes in prop::array::uniform4(1u32..512)) {
        let pools = SlotPools { seat_pool: sizes[0], kv_index_pool: sizes[1], sampler_pool: sizes[2], draft_pool: sizes[3] };
        match validate_pools(seats, &pools) {
            Ok(()) => prop_assert!(sizes.iter().all(|&s| s == seats)),
            Err(skew) => {
                prop_assert!(skew.pool_size != seats);
                let want = if skew.pool_size < seats { SkewDirection::TooSmall } else { SkewDirection::TooLarge };
                prop_assert_eq!(skew.direction, want);
                let msg = skew.to_string();
                prop_assert!(msg.contains(&skew.pool_size.to_string()) && msg.contains(&seats.to_string()));
            }
        }
    }
}
