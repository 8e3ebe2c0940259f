//! The front driven by scripted inputs.

use super::*;

fn server(role: Role) -> FrontServer {
    FrontServer {
        role,
        generation_first: false,
        name: String::new(),
        limits: ServerLimits::UNBOUNDED,
    }
}

fn front(policy: FrontPolicy, roles: &[Role]) -> Front {
    Front::new(&FrontConfig {
        policy,
        servers: roles.iter().map(|&r| server(r)).collect(),
        prefix_memory: 1024,
    })
}

fn drain(f: &mut Front) -> Vec<FrontOut> {
    std::iter::from_fn(|| f.poll_out()).collect()
}

fn submitted_to(outs: &[FrontOut]) -> Vec<(usize, u64)> {
    outs.iter()
        .filter_map(|o| match o {
            FrontOut::ToServer {
                server,
                item: IngressItem::Request(s),
            } => Some((*server, s.id.0)),
            _ => None,
        })
        .collect()
}

fn response(id: u64, finish: Option<Finish>) -> Response {
    Response {
        id: ReqId(id),
        new_tokens: 1,
        last_token: 7,
        generated: 1,
        finish,
        logprobs: None,
    }
}

fn at(server: u32, rank: u32) -> KvAddress {
    KvAddress {
        server,
        rank: RankId(rank),
    }
}

#[test]
fn round_robin_spreads_requests_over_the_servers_of_the_first_role() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Agg, Role::Agg, Role::Agg]);
    for id in 1..=5 {
        f.handle(0, FrontIn::Request(RequestSpec::new(id, 16, 4)));
    }
    assert_eq!(
        submitted_to(&drain(&mut f)),
        vec![(0, 1), (1, 2), (2, 3), (0, 4), (1, 5)]
    );
    assert_eq!(f.outstanding(), vec![2, 2, 1]);
}

#[test]
fn load_balancing_picks_the_server_with_the_fewest_outstanding_requests() {
    let mut f = front(FrontPolicy::LoadBalancing, &[Role::Agg, Role::Agg]);
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 16, 4)));
    f.handle(0, FrontIn::Request(RequestSpec::new(2, 16, 4)));
    f.handle(0, FrontIn::Request(RequestSpec::new(3, 16, 4)));
    // Request 1 (server 0) completes: server 0 is the least loaded again.
    let mut done = [response(1, Some(Finish::Completed))];
    f.handle_responses(0, 0, RankId(0), &mut done);
    f.handle(0, FrontIn::Request(RequestSpec::new(4, 16, 4)));
    assert_eq!(
        submitted_to(&drain(&mut f)),
        vec![(0, 1), (1, 2), (0, 3), (0, 4)]
    );
}

#[test]
fn kv_aware_follows_the_prefix_it_routed_and_never_reads_server_kv() {
    let mut f = front(FrontPolicy::KvAware, &[Role::Agg, Role::Agg]);
    let with_prefix = |id, hashes: &[u64]| {
        let mut s = RequestSpec::new(id, 64, 4);
        s.block_hashes = hashes.into();
        s
    };
    f.handle(0, FrontIn::Request(with_prefix(1, &[10, 11, 12])));
    f.handle(0, FrontIn::Request(with_prefix(2, &[20, 21])));
    // Shares two blocks with request 1, none with request 2: server 0 despite its load.
    f.handle(0, FrontIn::Request(with_prefix(3, &[10, 11, 99])));
    // Shares nothing: the least loaded (server 1).
    f.handle(0, FrontIn::Request(with_prefix(4, &[30])));
    // The same hashes at another position are another prefix: no match.
    f.handle(0, FrontIn::Request(with_prefix(5, &[11, 10])));
    assert_eq!(
        submitted_to(&drain(&mut f)),
        vec![(0, 1), (1, 2), (0, 3), (1, 4), (0, 5)]
    );
}

#[test]
fn a_first_token_hands_the_request_to_a_gen_server_with_its_kv_location() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen, Role::Gen]);
    let mut spec = RequestSpec::new(1, 100, 8);
    spec.block_hashes = vec![1, 2, 3].into();
    f.handle(0, FrontIn::Request(spec));
    assert_eq!(submitted_to(&drain(&mut f)), vec![(0, 1)]);
    let mut first = [response(1, Some(Finish::ContextDone))];
    f.handle_responses(0, 0, RankId(1), &mut first);
    assert_eq!(first[0].finish, None, "the client sees a token, not an end");
    let outs = drain(&mut f);
    let [
        FrontOut::ToServer {
            server: 1,
            item: IngressItem::Request(handed),
        },
    ] = &outs[..]
    else {
        panic!("one handoff to the first gen server, got {outs:?}");
    };
    assert_eq!(handed.generated_before, 1);
    assert!(
        handed.block_hashes.is_empty(),
        "a gen server never prefills"
    );
    assert_eq!(handed.kv_source, Some(at(0, 1)));
    assert_eq!(f.outstanding(), vec![0, 1, 0]);
    // It completes on the gen server: nothing left in flight.
    let mut done = [response(1, Some(Finish::Completed))];
    f.handle_responses(0, 1, RankId(0), &mut done);
    assert_eq!(f.in_flight(), 0);
    assert!(drain(&mut f).is_empty());
}

#[test]
fn a_single_token_request_completes_at_the_ctx_server_and_its_kv_is_released() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 100, 1)));
    drain(&mut f);
    let mut first = [response(1, Some(Finish::ContextDone))];
    f.handle_responses(0, 0, RankId(0), &mut first);
    assert_eq!(first[0].finish, Some(Finish::Completed));
    assert_eq!(
        drain(&mut f),
        vec![FrontOut::ToPeer {
            to: at(0, 0),
            message: PeerMessage::Release { id: ReqId(1) }
        }]
    );
}

#[test]
fn a_gen_side_failure_aborts_the_ctx_send_and_a_ctx_side_failure_cancels_the_gen_request() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    for id in [1, 2] {
        f.handle(0, FrontIn::Request(RequestSpec::new(id, 100, 8)));
        let mut first = [response(id, Some(Finish::ContextDone))];
        f.handle_responses(0, 0, RankId(0), &mut first);
    }
    drain(&mut f);
    let mut gen_failed = [response(
        1,
        Some(Finish::Failed(Failure::KvReceive(
            TransferFailure::TimedOut { after_ms: 5 },
        ))),
    )];
    f.handle_responses(0, 1, RankId(0), &mut gen_failed);
    assert!(matches!(
        &drain(&mut f)[..],
        [FrontOut::ToPeer { to, message: PeerMessage::Abort { id: ReqId(1), .. } }] if *to == at(0, 0)
    ));
    let mut send_failed = [response(
        2,
        Some(Finish::Failed(Failure::KvSend(TransferFailure::TimedOut {
            after_ms: 5,
        }))),
    )];
    f.handle_responses(0, 0, RankId(0), &mut send_failed);
    assert_eq!(
        drain(&mut f),
        vec![FrontOut::ToServer {
            server: 1,
            item: IngressItem::Cancel(ReqId(2))
        }]
    );
    assert_eq!(f.in_flight(), 0);
}

#[test]
fn gen_servers_shut_down_only_after_every_ctx_server_stopped() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Ctx, Role::Gen]);
    f.handle(0, FrontIn::Shutdown);
    let shut = |outs: &[FrontOut]| -> Vec<usize> {
        outs.iter()
            .filter_map(|o| match o {
                FrontOut::ToServer {
                    server,
                    item: IngressItem::Shutdown,
                } => Some(*server),
                _ => None,
            })
            .collect()
    };
    assert_eq!(shut(&drain(&mut f)), vec![0, 1]);
    f.handle(0, FrontIn::ServerStopped(0));
    assert!(shut(&drain(&mut f)).is_empty());
    f.handle(0, FrontIn::ServerStopped(1));
    assert_eq!(shut(&drain(&mut f)), vec![2]);
    assert!(!f.all_stopped());
    f.handle(0, FrontIn::ServerStopped(2));
    assert!(f.all_stopped());
}

#[test]
fn a_server_that_stops_unasked_winds_every_server_down() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    f.handle(0, FrontIn::ServerStopped(1));
    let outs = drain(&mut f);
    assert!(outs.contains(&FrontOut::ToServer {
        server: 0,
        item: IngressItem::Shutdown
    }));
}

#[test]
fn a_lost_fleet_fails_every_request_in_flight_and_every_later_one_with_the_reason() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    for id in 1..=3 {
        f.handle(0, FrontIn::Request(RequestSpec::new(id, 100, 8)));
    }
    // Request 2 is at the gen server already.
    let mut first = [response(2, Some(Finish::ContextDone))];
    f.handle_responses(0, 0, RankId(0), &mut first);
    f.handle(
        0,
        FrontIn::FleetLost {
            reason: "lost world rank 3".into(),
        },
    );
    f.handle(0, FrontIn::Request(RequestSpec::new(4, 100, 8)));
    let outs = drain(&mut f);
    assert!(f.all_stopped());
    assert_eq!(f.in_flight(), 0);
    let failed: Vec<(u64, Failure)> = outs
        .iter()
        .filter_map(|o| match o {
            FrontOut::ToClient(r) => match &r.finish {
                Some(Finish::Failed(why)) => Some((r.id.0, why.clone())),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let why = Failure::FleetLost("lost world rank 3".to_string());
    assert_eq!(
        failed,
        vec![
            (1, why.clone()),
            (2, why.clone()),
            (3, why.clone()),
            (4, why)
        ]
    );
    // Nothing queued for a server survives the loss.
    assert!(
        outs.iter().all(|o| matches!(o, FrontOut::ToClient(_))),
        "{outs:?}"
    );
}

#[test]
fn a_handoff_no_gen_server_takes_fails_the_request_and_frees_the_ctx_kv() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 100, 8)));
    let mut first = [response(1, Some(Finish::ContextDone))];
    f.handle_responses(0, 0, RankId(0), &mut first);
    drain(&mut f);
    f.handle(
        0,
        FrontIn::SubmitFailed {
            server: 1,
            id: ReqId(1),
            reason: "ingress queue full".into(),
        },
    );
    let outs = drain(&mut f);
    assert!(
        matches!(
            &outs[..],
            [
                FrontOut::ToPeer {
                    message: PeerMessage::Abort { .. },
                    ..
                },
                FrontOut::ToClient(Response {
                    finish: Some(Finish::Failed(_)),
                    generated: 1,
                    ..
                })
            ]
        ),
        "{outs:?}"
    );
    assert_eq!(f.outstanding(), vec![0, 0]);
}

#[test]
fn generation_first_names_the_gen_peer_at_arrival_and_hands_off_there() {
    let mut f = Front::new(&FrontConfig {
        policy: FrontPolicy::RoundRobin,
        servers: vec![
            FrontServer {
                role: Role::Ctx,
                generation_first: true,
                name: String::new(),
                limits: ServerLimits::UNBOUNDED,
            },
            server(Role::Gen),
            server(Role::Gen),
        ],
        prefix_memory: 0,
    });
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 100, 8)));
    f.handle(0, FrontIn::Request(RequestSpec::new(2, 100, 8)));
    let outs = drain(&mut f);
    let named: Vec<(u64, usize)> = outs
        .iter()
        .filter_map(|o| match o {
            FrontOut::PeerReady { id, gen_server, .. } => Some((id.0, *gen_server)),
            _ => None,
        })
        .collect();
    assert_eq!(named, vec![(1, 1), (2, 2)]);
    // Request 2's first token: it goes to the peer named at arrival.
    let mut first = [response(2, Some(Finish::ContextDone))];
    f.handle_responses(0, 0, RankId(0), &mut first);
    assert_eq!(submitted_to(&drain(&mut f)), vec![(2, 2)]);
}

#[test]
fn a_turn_gives_each_server_its_requests_then_its_control_items_notices_included() {
    let mut f = Front::new(&FrontConfig {
        policy: FrontPolicy::RoundRobin,
        servers: vec![
            FrontServer {
                role: Role::Ctx,
                generation_first: true,
                name: String::new(),
                limits: ServerLimits::UNBOUNDED,
            },
            server(Role::Gen),
        ],
        prefix_memory: 0,
    });
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 100, 8)));
    f.handle(0, FrontIn::Cancel(ReqId(1)));
    f.handle(0, FrontIn::Request(RequestSpec::new(2, 100, 8)));
    let turn = f.take_turn();
    assert_eq!(turn.ingress.keys().copied().collect::<Vec<_>>(), vec![0]);
    let ctx = &turn.ingress[&0];
    let ids = |items: &[IngressItem]| -> Vec<String> {
        items
            .iter()
            .map(|i| match i {
                IngressItem::Request(s) => format!("request {}", s.id),
                IngressItem::Cancel(id) => format!("cancel {id}"),
                IngressItem::PeerReady(id) => format!("peer ready {id}"),
                other => format!("{other:?}"),
            })
            .collect()
    };
    assert_eq!(ids(&ctx.requests), vec!["request 1", "request 2"]);
    assert_eq!(ids(&ctx.control), vec!["cancel 1"]);
    // The generation-first notices, for the ctx server, in order.
    let notices: Vec<IngressItem> = turn
        .notices
        .iter()
        .map(|(s, n)| {
            assert_eq!(*s, 0);
            n.clone()
        })
        .collect();
    assert_eq!(ids(&notices), vec!["peer ready 1", "peer ready 2"]);
    assert!(turn.to_client.is_empty() && turn.to_peers.is_empty());
    assert_eq!(
        f.take_turn(),
        FrontTurn::default(),
        "a turn takes everything"
    );
}

#[test]
fn a_cancel_goes_to_the_server_holding_the_request() {
    let mut f = front(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 100, 8)));
    f.handle(0, FrontIn::Cancel(ReqId(1)));
    let mut first = [response(1, Some(Finish::ContextDone))];
    drain(&mut f);
    f.handle_responses(0, 0, RankId(0), &mut first);
    f.handle(0, FrontIn::Cancel(ReqId(1)));
    let outs = drain(&mut f);
    assert_eq!(
        outs.last(),
        Some(&FrontOut::ToServer {
            server: 1,
            item: IngressItem::Cancel(ReqId(1))
        })
    );
    // An unknown request's cancel goes nowhere.
    f.handle(0, FrontIn::Cancel(ReqId(99)));
    assert!(drain(&mut f).is_empty());
}

/// A server named `name` of `role` with `max_num_tokens` `t` (chunked prefill off), 16
/// blocks of 16 tokens a rank, dp 2.
fn limited(name: &str, role: Role, t: u32) -> FrontServer {
    FrontServer {
        name: name.into(),
        role,
        generation_first: false,
        limits: ServerLimits {
            chunked_prefill: false,
            max_num_tokens: t,
            tokens_per_block: 16,
            kv_blocks_per_rank: 16,
            max_draft_len: 0,
            dp: 2,
        },
    }
}

fn refusals(outs: &[FrontOut]) -> Vec<(u64, String)> {
    outs.iter()
        .filter_map(|o| match o {
            FrontOut::ToClient(Response {
                id,
                finish: Some(Finish::Failed(why)),
                ..
            }) => Some((id.0, why.to_string())),
            _ => None,
        })
        .collect()
}

#[test]
fn every_policy_routes_only_to_servers_that_can_run_the_request() {
    for policy in [
        FrontPolicy::RoundRobin,
        FrontPolicy::LoadBalancing,
        FrontPolicy::KvAware,
    ] {
        let mut f = Front::new(&FrontConfig {
            policy,
            servers: vec![
                limited("short", Role::Agg, 64),
                limited("long", Role::Agg, 256),
            ],
            prefix_memory: 16,
        });
        // Prompts of 200 tokens only fit `long`; of 32, both.
        for id in 1..=6 {
            let prompt = if id % 2 == 1 { 200 } else { 32 };
            f.handle(0, FrontIn::Request(RequestSpec::new(id, prompt, 4)));
        }
        let outs = drain(&mut f);
        assert!(refusals(&outs).is_empty(), "{policy:?}: {outs:?}");
        let routed = submitted_to(&outs);
        assert_eq!(routed.len(), 6, "{policy:?}");
        for (server, id) in routed {
            assert!(
                id % 2 == 0 || server == 1,
                "{policy:?}: {id} went to {server}"
            );
        }
    }
    // Round robin still takes turns among the servers that can run each request.
    let mut f = Front::new(&FrontConfig {
        policy: FrontPolicy::RoundRobin,
        servers: vec![
            limited("short", Role::Agg, 64),
            limited("long", Role::Agg, 256),
            limited("short2", Role::Agg, 64),
        ],
        prefix_memory: 0,
    });
    for (id, prompt) in [(1, 32), (2, 200), (3, 32), (4, 32), (5, 200)] {
        f.handle(0, FrontIn::Request(RequestSpec::new(id, prompt, 4)));
    }
    assert_eq!(
        submitted_to(&drain(&mut f)),
        vec![(0, 1), (1, 2), (2, 3), (0, 4), (1, 5)]
    );
}

#[test]
fn a_request_no_server_can_run_is_refused_at_the_front_naming_every_limit() {
    let mut f = Front::new(&FrontConfig {
        policy: FrontPolicy::RoundRobin,
        servers: vec![
            limited("short", Role::Agg, 64),
            limited("long", Role::Agg, 256),
        ],
        prefix_memory: 0,
    });
    f.handle(0, FrontIn::Request(RequestSpec::new(1, 300, 4)));
    // Pinned to a rank neither server has (dp 2).
    let mut pinned = RequestSpec::new(2, 32, 4);
    pinned.pinned = Some(crate::request::PinnedRank {
        rank: RankId(5),
        strict: true,
    });
    f.handle(0, FrontIn::Request(pinned));
    let outs = drain(&mut f);
    assert!(submitted_to(&outs).is_empty(), "{outs:?}");
    let refused = refusals(&outs);
    assert_eq!(refused.len(), 2, "{outs:?}");
    assert_eq!(
        refused[0].1,
        "no agg server can run the request: server `short`: prompt_len 300 exceeds \
         max_num_tokens 64 with chunked prefill off; server `long`: prompt_len 300 exceeds \
         max_num_tokens 256 with chunked prefill off"
    );
    assert!(
        refused[1]
            .1
            .contains("attention_dp_rank 5 is out of range for dp = 2"),
        "{}",
        refused[1].1
    );
    assert_eq!(f.in_flight(), 0);
    assert_eq!(f.outstanding(), vec![0, 0]);
}

#[test]
fn a_disaggregated_request_no_gen_server_can_hold_is_refused_before_its_prefill() {
    let mut small_gen = limited("gen_small", Role::Gen, 4096);
    small_gen.limits.kv_blocks_per_rank = 4;
    let mut ctx = limited("ctx0", Role::Ctx, 4096);
    ctx.limits.kv_blocks_per_rank = 64;
    let mut f = Front::new(&FrontConfig {
        policy: FrontPolicy::RoundRobin,
        servers: vec![ctx, small_gen, limited("gen_big", Role::Gen, 4096)],
        prefix_memory: 0,
    });
    // 100 + 8 tokens: 7 blocks, more than gen_small's 4; both go to gen_big.
    for id in 1..=2 {
        f.handle(0, FrontIn::Request(RequestSpec::new(id, 100, 8)));
        let mut first = [response(id, Some(Finish::ContextDone))];
        assert_eq!(submitted_to(&drain(&mut f)), vec![(0, id)]);
        f.handle_responses(0, 0, RankId(0), &mut first);
        assert_eq!(submitted_to(&drain(&mut f)), vec![(2, id)]);
    }
    // 300 tokens fit no gen server's 16 blocks: refused at arrival, never prefilled.
    f.handle(0, FrontIn::Request(RequestSpec::new(3, 300, 8)));
    let outs = drain(&mut f);
    assert!(submitted_to(&outs).is_empty(), "{outs:?}");
    let refused = refusals(&outs);
    assert!(
        refused[0]
            .1
            .starts_with("no gen server can run the request: server `gen_small`"),
        "{refused:?}"
    );
    // A single output token comes from the ctx server: no gen server needed.
    f.handle(0, FrontIn::Request(RequestSpec::new(4, 300, 1)));
    assert_eq!(submitted_to(&drain(&mut f)), vec![(0, 4)]);
}
