//! The front driven through its message interface (mechanisms.md §8): [`FrontIn`]s through
//! [`Front::handle`], gathered responses through [`Front::handle_responses`], and
//! [`FrontOut`]s drained with [`Front::poll_out`]. The test plays the servers (an
//! ingress queue each, fed by `ToServer`) and the client (what the rewritten responses
//! and `ToClient` tell it).

use lockstep_actors::config::{Role, ServerLimits};
use lockstep_actors::front::{Front, FrontConfig, FrontIn, FrontOut, FrontPolicy, FrontServer};
use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::request::IngressItem;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::transceiver::PeerMessage;
use lockstep_actors::vocab::{AbortCause, Failure, Finish, KvAddress, Response, TransferFailure};

fn send_timed_out() -> Failure {
    Failure::KvSend(TransferFailure::TimedOut { after_ms: 30_000 })
}

/// The world around a front: each server's ingress queue, the transceiver messages and
/// peer notices it sent, and what the client received.
struct World {
    front: Front,
    ingress: Vec<Vec<IngressItem>>,
    to_peers: Vec<(KvAddress, PeerMessage)>,
    peer_ready: Vec<(usize, usize, ReqId)>,
    client: Vec<Response>,
    now: u64,
}

impl World {
    fn new(policy: FrontPolicy, roles: &[Role]) -> World {
        World::with_servers(
            policy,
            roles
                .iter()
                .map(|&role| FrontServer {
                    role,
                    generation_first: false,
                    name: String::new(),
                    limits: ServerLimits::UNBOUNDED,
                })
                .collect(),
        )
    }

    fn with_servers(policy: FrontPolicy, servers: Vec<FrontServer>) -> World {
        let n = servers.len();
        World {
            front: Front::new(&FrontConfig {
                policy,
                servers,
                prefix_memory: 1024,
            }),
            ingress: vec![Vec::new(); n],
            to_peers: Vec::new(),
            peer_ready: Vec::new(),
            client: Vec::new(),
            now: 0,
        }
    }

    /// Sends one input and moves every output to where it goes.
    fn send(&mut self, input: FrontIn) {
        self.now += 1;
        self.front.handle(self.now, input);
        self.drain();
    }

    fn drain(&mut self) {
        while let Some(out) = self.front.poll_out() {
            match out {
                FrontOut::ToServer { server, item } => self.ingress[server].push(item),
                FrontOut::ToPeer { to, message } => self.to_peers.push((to, message)),
                FrontOut::PeerReady {
                    ctx_server,
                    gen_server,
                    id,
                } => self.peer_ready.push((ctx_server, gen_server, id)),
                FrontOut::ToClient(r) => self.client.push(r),
            }
        }
    }

    /// Server `server`'s rank `rank` gathered `responses`: the front rewrites them and
    /// they go on to the client.
    fn respond(&mut self, server: usize, rank: u32, responses: Vec<Response>) {
        let mut responses = responses;
        self.now += 1;
        self.front
            .handle_responses(self.now, server, RankId(rank), &mut responses);
        self.client.extend(responses);
        self.drain();
    }

    /// The requests queued on `server`, by id.
    fn requests_at(&self, server: usize) -> Vec<u64> {
        self.ingress[server]
            .iter()
            .filter_map(|i| match i {
                IngressItem::Request(s) => Some(s.id.0),
                _ => None,
            })
            .collect()
    }

    fn spec_at(&self, server: usize, id: u64) -> RequestSpec {
        self.ingress[server]
            .iter()
            .find_map(|i| match i {
                IngressItem::Request(s) if s.id == ReqId(id) => Some(s.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("request {id} not queued on server {server}"))
    }

    fn shutdown_sent(&self, server: usize) -> bool {
        self.ingress[server].contains(&IngressItem::Shutdown)
    }

    /// What the client saw of request `id`: (tokens streamed, how it ended).
    fn seen(&self, id: u64) -> (Vec<u32>, Option<Finish>) {
        let mine = self.client.iter().filter(|r| r.id == ReqId(id));
        let tokens = mine
            .clone()
            .filter(|r| r.new_tokens > 0)
            .map(|r| r.last_token)
            .collect();
        let ends: Vec<&Finish> = mine.filter_map(|r| r.finish.as_ref()).collect();
        assert!(ends.len() <= 1, "request {id} ended twice: {ends:?}");
        (tokens, ends.first().map(|f| (*f).clone()))
    }
}

fn token(id: u64, token: u32, generated: u32) -> Response {
    Response {
        id: ReqId(id),
        new_tokens: 1,
        last_token: token,
        generated,
        finish: None,
        logprobs: None,
    }
}

fn last(id: u64, token: u32, generated: u32, finish: Finish) -> Response {
    Response {
        finish: Some(finish),
        ..self::token(id, token, generated)
    }
}

fn ended(id: u64, finish: Finish) -> Response {
    Response {
        id: ReqId(id),
        new_tokens: 0,
        last_token: 0,
        generated: 0,
        finish: Some(finish),
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
fn aggregated_requests_alternate_over_two_servers_and_their_responses_reach_the_client() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Agg, Role::Agg]);
    for id in 1..=4 {
        w.send(FrontIn::Request(RequestSpec::new(id, 32, 3)));
    }
    assert_eq!(w.requests_at(0), vec![1, 3]);
    assert_eq!(w.requests_at(1), vec![2, 4]);
    assert_eq!(
        w.spec_at(0, 3),
        RequestSpec::new(3, 32, 3),
        "passed on unchanged"
    );
    assert_eq!(w.front.outstanding(), vec![2, 2]);
    assert_eq!(w.front.in_flight(), 4);

    // Tokens stream through untouched; completions end the requests at the front.
    w.respond(0, 0, vec![token(1, 11, 1), token(3, 31, 1)]);
    w.respond(1, 1, vec![token(2, 21, 1)]);
    w.respond(
        0,
        0,
        vec![token(1, 12, 2), last(3, 32, 2, Finish::Completed)],
    );
    assert_eq!(w.front.outstanding(), vec![1, 2]);
    w.respond(0, 0, vec![last(1, 13, 3, Finish::Completed)]);
    w.respond(
        1,
        1,
        vec![
            token(2, 22, 2),
            ended(4, Finish::Failed(Failure::Deadlocked("boom".into()))),
        ],
    );
    assert_eq!(w.seen(1), (vec![11, 12, 13], Some(Finish::Completed)));
    assert_eq!(w.seen(3), (vec![31, 32], Some(Finish::Completed)));
    assert_eq!(w.seen(2), (vec![21, 22], None));
    assert_eq!(
        w.seen(4),
        (
            vec![],
            Some(Finish::Failed(Failure::Deadlocked("boom".into())))
        )
    );
    assert_eq!(w.front.outstanding(), vec![0, 1]);
    assert_eq!(w.front.in_flight(), 1);
    assert!(w.to_peers.is_empty(), "aggregated servers move no KV");
}

#[test]
fn load_balancing_selection_follows_the_outstanding_requests_as_they_complete() {
    let mut w = World::new(FrontPolicy::LoadBalancing, &[Role::Agg, Role::Agg]);
    w.send(FrontIn::Request(RequestSpec::new(1, 32, 2)));
    w.send(FrontIn::Request(RequestSpec::new(2, 32, 2)));
    w.send(FrontIn::Request(RequestSpec::new(3, 32, 2)));
    assert_eq!(w.front.outstanding(), vec![2, 1]);
    // Both of server 0's requests finish: it becomes the less loaded.
    w.respond(
        0,
        0,
        vec![
            last(1, 5, 2, Finish::Completed),
            last(3, 5, 2, Finish::Completed),
        ],
    );
    w.send(FrontIn::Request(RequestSpec::new(4, 32, 2)));
    w.send(FrontIn::Request(RequestSpec::new(5, 32, 2)));
    w.send(FrontIn::Request(RequestSpec::new(6, 32, 2)));
    // 4 to server 0 (0 against 1), 5 to server 0 (a tie goes to the first), 6 to 1.
    assert_eq!(w.requests_at(0), vec![1, 3, 4, 5]);
    assert_eq!(w.requests_at(1), vec![2, 6]);
    assert_eq!(w.front.outstanding(), vec![2, 2]);
}

#[test]
fn a_ctx_first_token_is_handed_to_a_gen_server_carrying_its_kv_source() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen, Role::Gen]);
    let spec = RequestSpec {
        block_hashes: vec![7, 8, 9].into(),
        draft_len: 1,
        ..RequestSpec::new(1, 48, 4)
    };
    w.send(FrontIn::Request(spec.clone()));
    w.send(FrontIn::Request(RequestSpec::new(2, 16, 4)));
    assert_eq!(
        w.requests_at(0),
        vec![1, 2],
        "new requests go to the ctx server"
    );
    assert!(w.requests_at(1).is_empty() && w.requests_at(2).is_empty());

    // Request 1's first token comes from ctx rank 1.
    w.respond(0, 1, vec![last(1, 100, 1, Finish::ContextDone)]);
    assert_eq!(
        w.client.last(),
        Some(&token(1, 100, 1)),
        "the client sees the first token, not an end"
    );
    let handed = w.spec_at(1, 1);
    assert_eq!(
        handed,
        RequestSpec {
            generated_before: 1,
            block_hashes: Default::default(),
            kv_source: Some(at(0, 1)),
            ..spec
        }
    );
    assert_eq!(w.front.outstanding(), vec![1, 1, 0]);

    // Request 2's first token, from ctx rank 0, goes to the other gen server.
    w.respond(0, 0, vec![last(2, 200, 1, Finish::ContextDone)]);
    assert_eq!(w.spec_at(2, 2).kv_source, Some(at(0, 0)));
    assert_eq!(w.front.outstanding(), vec![0, 1, 1]);

    // The gen servers finish them; the client sees one stream per request.
    w.respond(1, 0, vec![token(1, 101, 2), token(1, 102, 3)]);
    w.respond(1, 0, vec![last(1, 103, 4, Finish::Completed)]);
    w.respond(2, 3, vec![token(2, 201, 2), token(2, 202, 3)]);
    w.respond(2, 3, vec![last(2, 203, 4, Finish::Completed)]);
    assert_eq!(
        w.seen(1),
        (vec![100, 101, 102, 103], Some(Finish::Completed))
    );
    assert_eq!(
        w.seen(2),
        (vec![200, 201, 202, 203], Some(Finish::Completed))
    );
    assert_eq!(w.front.in_flight(), 0);
    assert_eq!(w.front.outstanding(), vec![0, 0, 0]);
    assert!(
        w.to_peers.is_empty(),
        "the gen side pulled; the front sent nothing"
    );
}

#[test]
fn a_single_token_request_ends_at_the_ctx_server_and_its_kv_is_released() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    w.send(FrontIn::Request(RequestSpec::new(1, 48, 1)));
    w.respond(0, 2, vec![last(1, 9, 1, Finish::ContextDone)]);
    assert_eq!(w.seen(1), (vec![9], Some(Finish::Completed)));
    assert_eq!(
        w.to_peers,
        vec![(at(0, 2), PeerMessage::Release { id: ReqId(1) })]
    );
    assert!(w.requests_at(1).is_empty(), "nothing for the gen server");
    assert_eq!(w.front.in_flight(), 0);
}

#[test]
fn generation_first_names_the_gen_peer_at_arrival_and_hands_off_to_it() {
    let mut w = World::with_servers(
        FrontPolicy::RoundRobin,
        vec![
            FrontServer {
                role: Role::Ctx,
                generation_first: true,
                name: String::new(),
                limits: ServerLimits::UNBOUNDED,
            },
            FrontServer {
                role: Role::Gen,
                generation_first: false,
                name: String::new(),
                limits: ServerLimits::UNBOUNDED,
            },
            FrontServer {
                role: Role::Gen,
                generation_first: false,
                name: String::new(),
                limits: ServerLimits::UNBOUNDED,
            },
        ],
    );
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 4)));
    w.send(FrontIn::Request(RequestSpec::new(2, 16, 4)));
    assert_eq!(w.peer_ready, vec![(0, 1, ReqId(1)), (0, 2, ReqId(2))]);
    // Request 2 finishes its prefill first: it still goes to the peer named for it.
    w.respond(0, 0, vec![last(2, 5, 1, Finish::ContextDone)]);
    w.respond(0, 0, vec![last(1, 5, 1, Finish::ContextDone)]);
    assert_eq!(w.requests_at(1), vec![1]);
    assert_eq!(w.requests_at(2), vec![2]);
}

#[test]
fn cancellations_reach_the_server_holding_the_request_and_free_the_other_side() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 8)));
    w.send(FrontIn::Request(RequestSpec::new(2, 16, 8)));

    // Request 1 is cancelled while still at the ctx server.
    w.send(FrontIn::Cancel(ReqId(1)));
    assert_eq!(w.ingress[0].last(), Some(&IngressItem::Cancel(ReqId(1))));
    w.respond(0, 0, vec![ended(1, Finish::Cancelled)]);
    assert_eq!(w.seen(1), (vec![], Some(Finish::Cancelled)));
    assert!(w.to_peers.is_empty(), "no KV was handed anywhere");

    // Request 2 is cancelled after its handoff: the gen server holds it now.
    w.respond(0, 1, vec![last(2, 50, 1, Finish::ContextDone)]);
    w.send(FrontIn::Cancel(ReqId(2)));
    assert_eq!(w.ingress[1].last(), Some(&IngressItem::Cancel(ReqId(2))));
    assert_eq!(
        w.ingress[0]
            .iter()
            .filter(|i| **i == IngressItem::Cancel(ReqId(2)))
            .count(),
        0,
        "not the ctx server"
    );
    w.respond(1, 0, vec![ended(2, Finish::Cancelled)]);
    assert_eq!(w.seen(2), (vec![50], Some(Finish::Cancelled)));
    // The ctx rank that holds its KV is told to free it.
    assert_eq!(
        w.to_peers,
        vec![(
            at(0, 1),
            PeerMessage::Abort {
                id: ReqId(2),
                cause: TransferFailure::Aborted(AbortCause::GenSide(Box::new(
                    AbortCause::Cancelled
                ))),
            }
        )]
    );
    assert_eq!(w.front.in_flight(), 0);

    // A cancel for a request the front no longer knows goes nowhere.
    let before: Vec<usize> = w.ingress.iter().map(Vec::len).collect();
    w.send(FrontIn::Cancel(ReqId(2)));
    w.send(FrontIn::Cancel(ReqId(77)));
    assert_eq!(w.ingress.iter().map(Vec::len).collect::<Vec<_>>(), before);
}

#[test]
fn a_failed_send_after_the_handoff_cancels_the_request_on_the_gen_server() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 8)));
    w.respond(0, 0, vec![last(1, 50, 1, Finish::ContextDone)]);
    w.respond(0, 0, vec![ended(1, Finish::Failed(send_timed_out()))]);
    assert_eq!(w.ingress[1].last(), Some(&IngressItem::Cancel(ReqId(1))));
    assert_eq!(
        w.seen(1),
        (vec![50], Some(Finish::Failed(send_timed_out())))
    );
    assert_eq!(w.front.in_flight(), 0);
}

#[test]
fn aggregated_shutdown_follows_the_queued_work_on_every_server() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Agg, Role::Agg]);
    for id in 1..=3 {
        w.send(FrontIn::Request(RequestSpec::new(id, 16, 2)));
    }
    w.send(FrontIn::Shutdown);
    for s in 0..2 {
        assert_eq!(
            w.ingress[s].last(),
            Some(&IngressItem::Shutdown),
            "server {s}"
        );
        assert_eq!(
            w.ingress[s]
                .iter()
                .filter(|i| **i == IngressItem::Shutdown)
                .count(),
            1
        );
    }
    // A second shutdown sends nothing new.
    w.send(FrontIn::Shutdown);
    assert_eq!(w.ingress[0].len(), 3);
    assert!(!w.front.all_stopped());
    w.send(FrontIn::ServerStopped(0));
    w.send(FrontIn::ServerStopped(1));
    assert!(w.front.all_stopped());
}

#[test]
fn gen_servers_shut_down_after_every_ctx_server_stopped_and_after_the_last_handoff() {
    let mut w = World::new(
        FrontPolicy::RoundRobin,
        &[Role::Ctx, Role::Ctx, Role::Gen, Role::Gen],
    );
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 4)));
    w.send(FrontIn::Request(RequestSpec::new(2, 16, 4)));
    w.send(FrontIn::Shutdown);
    // The ctx servers are told now, behind their work; the gen servers not yet.
    assert_eq!(
        w.ingress[0],
        vec![
            IngressItem::Request(RequestSpec::new(1, 16, 4)),
            IngressItem::Shutdown
        ]
    );
    assert_eq!(w.ingress[1].last(), Some(&IngressItem::Shutdown));
    assert!(!w.shutdown_sent(2) && !w.shutdown_sent(3));

    // Server 0 drains: its request's first token is handed off, then it stops.
    w.respond(0, 0, vec![last(1, 10, 1, Finish::ContextDone)]);
    w.send(FrontIn::ServerStopped(0));
    assert!(
        !w.shutdown_sent(2) && !w.shutdown_sent(3),
        "server 1 may still hand off"
    );
    // Server 1 drains the same way; only its stop releases the gen shutdown.
    w.respond(1, 0, vec![last(2, 20, 1, Finish::ContextDone)]);
    assert!(!w.shutdown_sent(2) && !w.shutdown_sent(3));
    w.send(FrontIn::ServerStopped(1));
    for s in [2, 3] {
        let items = &w.ingress[s];
        assert_eq!(items.last(), Some(&IngressItem::Shutdown), "server {s}");
        assert!(
            matches!(items[0], IngressItem::Request(_)),
            "the handoff to server {s} is queued before its shutdown: {items:?}"
        );
    }
    assert!(!w.front.all_stopped());
    w.respond(2, 0, vec![last(1, 11, 4, Finish::Completed)]);
    w.respond(3, 0, vec![last(2, 21, 4, Finish::Completed)]);
    w.send(FrontIn::ServerStopped(2));
    w.send(FrontIn::ServerStopped(3));
    assert!(w.front.all_stopped());
    assert_eq!(w.front.in_flight(), 0);
    assert_eq!(w.seen(1), (vec![10, 11], Some(Finish::Completed)));
}

#[test]
fn a_server_that_stops_unasked_winds_every_server_down() {
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Agg, Role::Ctx, Role::Gen]);
    w.send(FrontIn::ServerStopped(1));
    assert!(w.shutdown_sent(0));
    assert!(!w.shutdown_sent(1), "the stopped server itself is not told");
    assert!(w.shutdown_sent(2), "no ctx server is left to hand off");
}

#[test]
fn requests_the_front_cannot_place_fail_back_to_the_client() {
    // No server at all (without an agg server, new requests are for ctx servers).
    let mut w = World::new(FrontPolicy::RoundRobin, &[]);
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 4)));
    assert_eq!(
        w.seen(1),
        (
            vec![],
            Some(Finish::Failed(Failure::NoServer { role: "ctx".into() }))
        )
    );
    assert_eq!(w.front.in_flight(), 0);

    // A ctx server but no gen server: the first token arrives, then the request fails
    // and the ctx rank frees its KV.
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Ctx]);
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 4)));
    w.respond(0, 0, vec![last(1, 3, 1, Finish::ContextDone)]);
    assert_eq!(
        w.seen(1),
        (
            vec![3],
            Some(Finish::Failed(Failure::NoServer { role: "gen".into() }))
        )
    );
    assert!(matches!(
        &w.to_peers[..],
        [(to, PeerMessage::Abort { id: ReqId(1), .. })] if *to == at(0, 0)
    ));

    // A gen server that cannot take the handoff.
    let mut w = World::new(FrontPolicy::RoundRobin, &[Role::Ctx, Role::Gen]);
    w.send(FrontIn::Request(RequestSpec::new(1, 16, 4)));
    w.respond(0, 1, vec![last(1, 3, 1, Finish::ContextDone)]);
    w.send(FrontIn::SubmitFailed {
        server: 1,
        id: ReqId(1),
        reason: "ingress closed".into(),
    });
    let (tokens, end) = w.seen(1);
    assert_eq!(tokens, vec![3]);
    assert_eq!(
        end,
        Some(Finish::Failed(Failure::Undeliverable(
            "ingress closed".into()
        )))
    );
    let failure = w.client.last().expect("a response");
    assert_eq!(failure.generated, 1, "the first token was delivered");
    assert!(matches!(
        &w.to_peers[..],
        [(to, PeerMessage::Abort { id: ReqId(1), .. })] if *to == at(0, 1)
    ));
    assert_eq!(w.front.outstanding(), vec![0, 0]);
    assert_eq!(w.front.in_flight(), 0);
}

#[test]
fn kv_aware_selection_follows_the_prefixes_it_routed() {
    let mut w = World::new(FrontPolicy::KvAware, &[Role::Agg, Role::Agg]);
    let hashed = |id, hashes: &[u64]| RequestSpec {
        block_hashes: hashes.into(),
        ..RequestSpec::new(id, 16 * hashes.len() as u32, 4)
    };
    w.send(FrontIn::Request(hashed(1, &[1, 2, 3])));
    w.send(FrontIn::Request(hashed(2, &[9])));
    w.send(FrontIn::Request(hashed(3, &[1, 2, 4])));
    w.send(FrontIn::Request(hashed(4, &[9, 9])));
    // Nothing shared: the fewest outstanding (server 1, once 2 and 4 completed there).
    w.respond(
        1,
        0,
        vec![
            last(2, 1, 4, Finish::Completed),
            last(4, 1, 4, Finish::Completed),
        ],
    );
    assert_eq!(w.front.outstanding(), vec![2, 0]);
    w.send(FrontIn::Request(hashed(5, &[5])));
    // Request 1's prefix again: server 0, although it is now the busier one.
    w.send(FrontIn::Request(hashed(6, &[1, 2, 3, 4])));
    assert_eq!(w.requests_at(0), vec![1, 3, 6]);
    assert_eq!(w.requests_at(1), vec![2, 4, 5]);
}
