//! proptest properties over whole servers (the module-level properties live next to the
//! KV manager, schedulers, routers and seats).

use lockstep_actors::config::{CapacitySchedulerPolicy, Role, RouterKind};
use lockstep_actors::ids::{ConvId, ReqId};
use lockstep_actors::policy::Policy;
use lockstep_actors::request::{RequestSpec, RequestState};
use lockstep_actors::seats::{SkewDirection, SlotPools, validate_pools};
use lockstep_actors::vocab::{Failure, Finish, TransferEvent, TransferOutcome};
use lockstep_tests::{Harness, adp_server};
use proptest::prelude::*;

/// One request of a case: prompt and output length, which shared prefix it starts with
/// (0: none), its conversation (0: none), and whether the client cancels it.
#[derive(Debug, Clone)]
struct Req {
    prompt: u32,
    output: u32,
    prefix: u8,
    conversation: u8,
    cancel: bool,
}

#[derive(Debug, Clone)]
struct Case {
    dp: i64,
    b: i64,
    t: i64,
    overlap: bool,
    chunked: bool,
    role: Role,
    capacity: CapacitySchedulerPolicy,
    router: RouterKind,
    /// KV tokens a rank: tight pools (a few requests' worth) as often as ample ones.
    kv_tokens: i64,
    requests: Vec<Req>,
    per_step: usize,
}

fn req() -> impl Strategy<Value = Req> {
    (
        1u32..=300,
        1u32..=12,
        0u8..=3,
        0u8..=4,
        prop::bool::weighted(0.1),
    )
        .prop_map(|(prompt, output, prefix, conversation, cancel)| Req {
            prompt,
            output,
            prefix,
            conversation,
            cancel,
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        (
            1i64..=4,
            1i64..=4,
            prop_oneof![Just(64i64), Just(256), Just(4096)],
            any::<bool>(),
            any::<bool>(),
        ),
        (
            prop_oneof![2 => Just(Role::Agg), 1 => Just(Role::Ctx), 1 => Just(Role::Gen)],
            prop_oneof![
                Just(CapacitySchedulerPolicy::GuaranteedNoEvict),
                Just(CapacitySchedulerPolicy::MaxUtilization),
                Just(CapacitySchedulerPolicy::StaticBatch),
            ],
            prop_oneof![
                Just(RouterKind::Balanced),
                Just(RouterKind::Conversation),
                Just(RouterKind::KvAware),
            ],
            prop_oneof![Just(1i64 << 16), (2i64..=40).prop_map(|blocks| blocks * 16)],
        ),
        prop::collection::vec(req(), 1..40),
        1usize..=8,
    )
        .prop_map(
            |(
                (dp, b, t, overlap, chunked),
                (role, capacity, router, kv_tokens),
                requests,
                per_step,
            )| {
                Case {
                    dp,
                    b,
                    t,
                    overlap,
                    chunked,
                    role,
                    capacity,
                    router,
                    kv_tokens,
                    requests,
                    per_step,
                }
            },
        )
}

/// The spec of request `i` of a case: prefix `k` is the same block hashes for every
/// request that has it, so the KV manager reuses them (and kv_aware routes by them).
fn spec(i: usize, r: &Req, role: Role) -> RequestSpec {
    let output = if role == Role::Gen {
        r.output.max(2)
    } else {
        r.output
    };
    let mut s = RequestSpec::new(i as u64 + 1, r.prompt, output);
    let full_blocks = r.prompt / 16;
    s.block_hashes = (0..full_blocks)
        .map(|b| {
            if r.prefix > 0 && b < 4 {
                1000 * u64::from(r.prefix) + u64::from(b)
            } else {
                (i as u64 + 1) << 20 | u64::from(b)
            }
        })
        .collect();
    if r.conversation > 0 {
        s.conversation = Some(ConvId(u64::from(r.conversation)));
    }
    if role == Role::Gen {
        s.generated_before = 1;
    }
    s
}

fn run(c: &Case, policy: Policy) -> Harness {
    let mut server = adp_server(c.dp, c.b, c.overlap);
    server.role = c.role;
    server.max_num_tokens = c.t;
    server.enable_chunked_prefill = c.chunked;
    server.scheduler_config.capacity_scheduler_policy = c.capacity;
    server.attention_dp_config.router = c.router;
    server.kv_cache_config.max_tokens = c.kv_tokens;
    let mut h = Harness::new(&server, policy);
    let mut pending = c.requests.iter().enumerate().peekable();
    let mut to_cancel: Vec<ReqId> = Vec::new();
    for _ in 0..20_000 {
        // The client cancels what it meant to one step after sending it.
        h.cancellations.append(&mut to_cancel);
        for _ in 0..c.per_step {
            if let Some((i, r)) = pending.next() {
                h.submit(spec(i, r, c.role));
                if r.cancel {
                    to_cancel.push(ReqId(i as u64 + 1));
                }
            }
        }
        // The transceivers: every send and receive in flight ends at once.
        for rank in 0..h.group.ranks().len() {
            let e = &h.group.ranks()[rank];
            let ids: Vec<ReqId> = e
                .sending()
                .iter()
                .map(|r| r.id())
                .chain(
                    e.active()
                        .iter()
                        .filter(|r| r.state == RequestState::DisaggGenerationTransInProgress)
                        .map(|r| r.id()),
                )
                .collect();
            for id in ids {
                h.group.ranks_mut()[rank]
                    .handle_transfer_event(TransferEvent {
                        id,
                        outcome: TransferOutcome::Done,
                    })
                    .expect("a transfer event for a request in transfer");
            }
        }
        let idle = h.step().is_none();
        if idle && pending.peek().is_none() && to_cancel.is_empty() {
            break;
        }
    }
    h
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

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
        // Every request ended: completed (a ctx server's "context done"), cancelled
        // only if the client cancelled it, or refused at arrival with its reason (a
        // prompt over T without chunking, more KV than a rank has) — never failed any
        // other way (a recompute that could exceed T is no reason: such a request is
        // never paused).
        prop_assert_eq!(h.finished.len() as u64, h.submitted, "{} of {} ended", h.finished.len(), h.submitted);
        for (id, f) in &h.finished {
            let r = &c.requests[id.0 as usize - 1];
            match f {
                Finish::Completed => prop_assert!(c.role != Role::Ctx),
                Finish::ContextDone => prop_assert_eq!(c.role, Role::Ctx),
                Finish::Cancelled => prop_assert!(r.cancel, "{id} cancelled unasked"),
                Finish::Failed(Failure::Refused(why)) => prop_assert!(
                    why.contains("exceeds max_num_tokens") || why.contains("KV blocks"),
                    "{id} refused: {why}"
                ),
                Finish::Failed(why) => prop_assert!(false, "{id} failed: {why}"),
            }
        }
        for r in h.group.ranks() {
            prop_assert_eq!(r.kv().used_blocks(), 0, "leaked KV");
            prop_assert_eq!(r.seats_used(), 0);
        }
    }

    /// The seats validator is two-sided: it accepts exactly the pools equal to the seats
    /// and reports the direction of any skew.
    #[test]
    fn seats_validator_is_two_sided(
        seats in 2u32..512,
        deltas in prop::array::uniform4(prop_oneof![Just(-1i64), Just(0), Just(0), Just(1), -600i64..600]),
    ) {
        // Each pool around the seats (one short, equal, one over) or anywhere, so the
        // Ok branch (every pool equal) comes up often.
        let sizes = deltas.map(|d| (i64::from(seats) + d).clamp(1, 1024) as u32);
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
