//! The front door (mechanisms.md §8): the actor between the clients and the servers. It
//! picks a server for each request (aggregated, or ctx then gen), hands a request on to
//! a gen server when its ctx server produced the first token, tells the ctx rank to free
//! KV nobody will pull, aborts a send whose gen side failed, cancels a gen-side request
//! whose send failed, and winds the servers down after the client's shutdown (gen
//! servers only once every ctx server has stopped: no handoff can come any more).
//!
//! Pure: no I/O, no clock (inputs carry `now`), no threads. Inputs go through
//! [`Front::handle`]; gathered responses through [`Front::handle_responses`], which
//! rewrites them in place (the hot path: most responses are plain tokens and pass
//! through untouched); outputs are drained with [`Front::poll_out`]. The front has no
//! timers of its own.
//!
//! What it knows is what a real front can know: the requests it routed, the prefix
//! block hashes it sent to each server (`kv_aware`), and each server's load as the
//! requests it has outstanding there. It never reads a server's KV.
//!
//! Guardrails: selection has no side effects besides the round-robin pointer and the
//! prefix memory of the chosen server; a request is in exactly one place (one server, or
//! between a ctx and a gen server) until it ends.

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::config::{RequestShape, Role, ServerLimits, Unservable, roles_needed};
use crate::ids::{RankId, ReqId};
use crate::request::{IngressItem, RequestSpec};
use crate::transceiver::PeerMessage;
use crate::vocab::{AbortCause, Failure, Finish, KvAddress, Response, TransferFailure};

/// How the front picks a server among those of a role (the names production
/// disaggregated routers use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FrontPolicy {
    /// In turn.
    #[default]
    RoundRobin,
    /// The fewest requests outstanding at the front.
    LoadBalancing,
    /// The longest prefix of block hashes already routed to the server, then the fewest
    /// requests outstanding.
    KvAware,
}

/// One turn of the front's outputs ([`Front::take_turn`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FrontTurn {
    /// Per server (in server order), what its ingress gets.
    pub ingress: BTreeMap<usize, ServerIngress>,
    /// Generation-first notices for ctx servers (`IngressItem::PeerReady`), in order.
    pub notices: Vec<(usize, IngressItem)>,
    /// Messages for transceivers, in the order they were made.
    pub to_peers: Vec<(KvAddress, PeerMessage)>,
    /// Responses for the client, in the order they were made.
    pub to_client: Vec<Response>,
}

/// What one server's ingress gets in one turn.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ServerIngress {
    /// New requests (a full queue may refuse them).
    pub requests: Vec<IngressItem>,
    /// Cancellations and shutdowns (taken while the server runs).
    pub control: Vec<IngressItem>,
}

impl ServerIngress {
    /// Requests then control items, as one batch (a host whose queue never refuses).
    pub fn into_items(self) -> Vec<IngressItem> {
        let mut items = self.requests;
        items.extend(self.control);
        items
    }
}

/// One server as the front sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontServer {
    /// Its name (a refusal names each server's limit).
    pub name: String,
    /// Its role.
    pub role: Role,
    /// A ctx server in generation-first mode: its requests wait until the front names
    /// their gen peer.
    pub generation_first: bool,
    /// What it can run: the rule its ranks validate a request by, so the front sends a
    /// request only where it can run.
    pub limits: ServerLimits,
}

/// The front's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontConfig {
    /// Server selection.
    pub policy: FrontPolicy,
    /// The servers, in scenario order.
    pub servers: Vec<FrontServer>,
    /// Block hashes remembered per server for `kv_aware` (least recently routed go
    /// first).
    pub prefix_memory: usize,
}

/// An input of the front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontIn {
    /// A client's new request.
    Request(RequestSpec),
    /// A client cancels a request.
    Cancel(ReqId),
    /// The client will send nothing more.
    Shutdown,
    /// A server could not take an item the front queued (its ingress is full or gone).
    SubmitFailed {
        /// The server.
        server: usize,
        /// The request.
        id: ReqId,
        /// Why.
        reason: String,
    },
    /// A server's ranks left their loop (drained, or failed).
    ServerStopped(usize),
    /// The fleet can no longer be reached (a real driver lost contact with some of its
    /// ranks): every request in flight fails with `reason`, every server counts as
    /// stopped, and nothing more is sent to any of them.
    FleetLost {
        /// Why, naming the ranks lost.
        reason: String,
    },
}

/// An output of the front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontOut {
    /// Queue `item` on server `server`'s ingress.
    ToServer {
        /// The server.
        server: usize,
        /// The item.
        item: IngressItem,
    },
    /// Generation-first: the gen server `gen_server` is named for `id`, whose ctx server
    /// is `ctx_server`; the notice travels from the gen peer to the ctx server as an
    /// [`IngressItem::PeerReady`].
    PeerReady {
        /// The ctx server.
        ctx_server: usize,
        /// The gen server named.
        gen_server: usize,
        /// The request.
        id: ReqId,
    },
    /// A message for a rank's transceiver.
    ToPeer {
        /// The rank.
        to: KvAddress,
        /// The message.
        message: PeerMessage,
    },
    /// A response the front itself produced for the client (a request it could not
    /// place).
    ToClient(Response),
}

/// Where a request is.
#[derive(Debug, Clone)]
struct InFlight {
    spec: RequestSpec,
    /// The server holding it now.
    server: usize,
    /// Disaggregated: where its KV lives once the ctx server produced the first token.
    kv: Option<KvAddress>,
    /// Generation-first: the gen server named at arrival.
    gen_peer: Option<usize>,
}

/// Per-server state.
#[derive(Debug)]
struct ServerView {
    server: FrontServer,
    outstanding: u64,
    shutdown_sent: bool,
    stopped: bool,
    prefixes: PrefixMemory,
}

/// The block hashes routed to one server, least recently routed evicted first. Only
/// looked up, never iterated into a decision.
#[derive(Debug, Default)]
struct PrefixMemory {
    capacity: usize,
    tick: u64,
    last_routed: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl PrefixMemory {
    /// How many leading blocks of `keys` (chained) were routed here.
    fn matched(&self, keys: impl Iterator<Item = u64>) -> usize {
        keys.take_while(|k| self.last_routed.contains_key(k))
            .count()
    }

    fn remember(&mut self, keys: impl Iterator<Item = u64>) {
        if self.capacity == 0 {
            return;
        }
        for key in keys {
            self.tick += 1;
            self.last_routed.insert(key, self.tick);
            self.order.push_back((self.tick, key));
        }
        // Entries re-routed since are stale in `order`: skip them.
        while self.last_routed.len() > self.capacity {
            let Some((tick, key)) = self.order.pop_front() else {
                break;
            };
            if self.last_routed.get(&key) == Some(&tick) {
                self.last_routed.remove(&key);
            }
        }
        if self.order.len() > 4 * self.capacity {
            let live = &self.last_routed;
            self.order.retain(|(t, k)| live.get(k) == Some(t));
        }
    }
}

/// The front actor.
#[derive(Debug)]
pub struct Front {
    policy: FrontPolicy,
    servers: Vec<ServerView>,
    requests: BTreeMap<ReqId, InFlight>,
    /// Round-robin pointers per role: agg, ctx, gen.
    round_robin: [usize; 3],
    client_shutdown: bool,
    /// Set by [`FrontIn::FleetLost`]: why every later request fails.
    lost: Option<String>,
    out: VecDeque<FrontOut>,
}

fn role_index(role: Role) -> usize {
    match role {
        Role::Agg => 0,
        Role::Ctx => 1,
        Role::Gen => 2,
    }
}

impl Front {
    /// A front over `config.servers`.
    pub fn new(config: &FrontConfig) -> Front {
        Front {
            policy: config.policy,
            servers: config
                .servers
                .iter()
                .map(|server| ServerView {
                    server: server.clone(),
                    outstanding: 0,
                    shutdown_sent: false,
                    stopped: false,
                    prefixes: PrefixMemory {
                        capacity: config.prefix_memory,
                        ..PrefixMemory::default()
                    },
                })
                .collect(),
            requests: BTreeMap::new(),
            round_robin: [0; 3],
            client_shutdown: false,
            lost: None,
            out: VecDeque::new(),
        }
    }

    /// Whether every server has stopped.
    pub fn all_stopped(&self) -> bool {
        self.servers.iter().all(|s| s.stopped)
    }

    /// Requests in flight (routed and not ended).
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Requests outstanding at each server (the `load_balancing` load).
    pub fn outstanding(&self) -> Vec<u64> {
        self.servers.iter().map(|s| s.outstanding).collect()
    }

    /// The next output, in the order they were made.
    #[must_use]
    pub fn poll_out(&mut self) -> Option<FrontOut> {
        self.out.pop_front()
    }

    /// Everything the front produced since the last turn, grouped as every host
    /// delivers it: per server its requests, then its control items (a full queue
    /// refuses only requests); the generation-first notices, which stand for the gen
    /// peer's answer and so cross the link between the servers (the front host holds
    /// each for that link's time, and sends it after its server's requests, so it never
    /// overtakes the request it concerns); the messages for transceivers; the responses
    /// for the client. One rule for the simulator and the real front host.
    pub fn take_turn(&mut self) -> FrontTurn {
        let mut turn = FrontTurn::default();
        while let Some(out) = self.out.pop_front() {
            match out {
                FrontOut::ToServer { server, item } => {
                    let items = turn.ingress.entry(server).or_default();
                    match item {
                        IngressItem::Request(_) => items.requests.push(item),
                        _ => items.control.push(item),
                    }
                }
                FrontOut::PeerReady { ctx_server, id, .. } => {
                    turn.notices.push((ctx_server, IngressItem::PeerReady(id)))
                }
                FrontOut::ToPeer { to, message } => turn.to_peers.push((to, message)),
                FrontOut::ToClient(r) => turn.to_client.push(r),
            }
        }
        turn
    }

    /// The one funnel for inputs other than gathered responses.
    pub fn handle(&mut self, _now_ns: u64, input: FrontIn) {
        match input {
            FrontIn::Request(spec) => self.on_request(spec),
            FrontIn::Cancel(id) => {
                if let Some(r) = self.requests.get(&id) {
                    let server = r.server;
                    self.out.push_back(FrontOut::ToServer {
                        server,
                        item: IngressItem::Cancel(id),
                    });
                }
            }
            FrontIn::Shutdown => {
                self.client_shutdown = true;
                self.shutdown(Role::Agg);
                self.shutdown(Role::Ctx);
                self.shutdown_gen_when_ctx_stopped();
            }
            FrontIn::SubmitFailed { server, id, reason } => {
                self.on_submit_failed(server, id, reason)
            }
            FrontIn::ServerStopped(server) => self.on_server_stopped(server),
            FrontIn::FleetLost { reason } => self.on_fleet_lost(&reason),
        }
    }

    fn on_fleet_lost(&mut self, reason: &str) {
        self.client_shutdown = true;
        self.lost = Some(reason.to_string());
        for s in &mut self.servers {
            s.stopped = true;
            s.shutdown_sent = true;
            s.outstanding = 0;
        }
        // Everything queued for the servers is moot now; the client hears of every
        // request in flight, in id order.
        self.out.retain(|o| matches!(o, FrontOut::ToClient(_)));
        for r in std::mem::take(&mut self.requests).into_values() {
            self.out.push_back(FrontOut::ToClient(failed(
                &r.spec,
                Failure::FleetLost(reason.to_string()),
            )));
        }
    }

    fn on_request(&mut self, spec: RequestSpec) {
        if let Some(reason) = &self.lost {
            self.out.push_back(FrontOut::ToClient(failed(
                &spec,
                Failure::FleetLost(reason.clone()),
            )));
            return;
        }
        let disaggregated = !self.has(Role::Agg);
        let entry = if disaggregated { Role::Ctx } else { Role::Agg };
        // Every role the request needs must have a server that can run it: only then
        // is it routed, and only to such servers (a missing gen server is found at the
        // handoff, as before).
        let shape = RequestShape::of(&spec);
        for &role in roles_needed(disaggregated, spec.max_new_tokens) {
            if let Some(why) = self.unservable(role, &shape) {
                self.out
                    .push_back(FrontOut::ToClient(failed(&spec, Failure::Unservable(why))));
                return;
            }
        }
        let Some(server) = self.pick(entry, &spec) else {
            self.out.push_back(FrontOut::ToClient(failed(
                &spec,
                Failure::NoServer {
                    role: entry.name().to_string(),
                },
            )));
            return;
        };
        let id = spec.id;
        let mut gen_peer = None;
        if self.servers[server].server.generation_first {
            // Generation-first (§8): name the gen peer now; its notice reaches the ctx
            // server, whose ranks then let the request prefill. A request whose one
            // output token comes from the ctx server needs no gen server that could run
            // it; the first gen server stands in to release its prefill.
            gen_peer = self.pick(Role::Gen, &spec).or_else(|| {
                (spec.max_new_tokens <= 1)
                    .then(|| self.servers.iter().position(|s| s.server.role == Role::Gen))
                    .flatten()
            });
            if let Some(gen_server) = gen_peer {
                self.out.push_back(FrontOut::PeerReady {
                    ctx_server: server,
                    gen_server,
                    id,
                });
            }
        }
        self.servers[server].outstanding += 1;
        self.out.push_back(FrontOut::ToServer {
            server,
            item: IngressItem::Request(spec.clone()),
        });
        self.requests.insert(
            id,
            InFlight {
                spec,
                server,
                kv: None,
                gen_peer,
            },
        );
    }

    fn has(&self, role: Role) -> bool {
        self.servers.iter().any(|s| s.server.role == role)
    }

    /// Why no server of `role` can run a request of `shape`, if there are servers of
    /// the role and none can.
    fn unservable(&self, role: Role, shape: &RequestShape) -> Option<Unservable> {
        if !self.has(role) {
            return None;
        }
        crate::config::unservable(
            role,
            self.servers
                .iter()
                .map(|s| (s.server.name.as_str(), s.server.role, &s.server.limits)),
            shape,
        )
    }

    /// Server selection among those of `role` that can run the request (`[front]
    /// policy`); ties break by server order. Remembers the request's prefix at the
    /// chosen server.
    fn pick(&mut self, role: Role, spec: &RequestSpec) -> Option<usize> {
        let shape = RequestShape::of(spec);
        let of_role: Vec<usize> = (0..self.servers.len())
            .filter(|&i| self.servers[i].server.role == role)
            .collect();
        let can_run = |i: usize| {
            self.servers[i]
                .server
                .limits
                .refusal(role, &shape)
                .is_none()
        };
        let candidates: Vec<usize> = of_role.iter().copied().filter(|&i| can_run(i)).collect();
        let chosen = match self.policy {
            FrontPolicy::RoundRobin => {
                // In turn: the next server of the role, from the one after the last
                // chosen, that can run the request.
                let counter = &mut self.round_robin[role_index(role)];
                let start = *counter % of_role.len().max(1);
                let k = (0..of_role.len())
                    .find(|j| candidates.contains(&of_role[(start + j) % of_role.len()]))?;
                *counter = start + k + 1;
                of_role[(start + k) % of_role.len()]
            }
            FrontPolicy::LoadBalancing => *candidates
                .iter()
                .min_by_key(|&&i| (self.servers[i].outstanding, i))?,
            FrontPolicy::KvAware => *candidates.iter().min_by_key(|&&i| {
                let s = &self.servers[i];
                let matched = s
                    .prefixes
                    .matched(crate::kv::chain_keys(&spec.block_hashes));
                (std::cmp::Reverse(matched), s.outstanding, i)
            })?,
        };
        if self.policy == FrontPolicy::KvAware {
            self.servers[chosen]
                .prefixes
                .remember(crate::kv::chain_keys(&spec.block_hashes));
        }
        Some(chosen)
    }

    fn shutdown(&mut self, role: Role) {
        for (server, s) in self.servers.iter_mut().enumerate() {
            if s.server.role == role && !s.shutdown_sent {
                s.shutdown_sent = true;
                self.out.push_back(FrontOut::ToServer {
                    server,
                    item: IngressItem::Shutdown,
                });
            }
        }
    }

    fn shutdown_gen_when_ctx_stopped(&mut self) {
        let ctx_stopped = self
            .servers
            .iter()
            .filter(|s| s.server.role == Role::Ctx)
            .all(|s| s.stopped);
        if self.client_shutdown && ctx_stopped {
            // No handoff can come any more.
            self.shutdown(Role::Gen);
        }
    }

    fn on_server_stopped(&mut self, server: usize) {
        let s = &mut self.servers[server];
        s.stopped = true;
        if !s.shutdown_sent {
            // It failed: wind every server down (each drains what it holds; a transfer
            // with the failed server times out).
            s.shutdown_sent = true;
            self.client_shutdown = true;
            self.shutdown(Role::Agg);
            self.shutdown(Role::Ctx);
            self.shutdown(Role::Gen);
        }
        self.shutdown_gen_when_ctx_stopped();
    }

    fn on_submit_failed(&mut self, server: usize, id: ReqId, reason: String) {
        let s = &mut self.servers[server];
        s.outstanding = s.outstanding.saturating_sub(1);
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        if let Some(kv) = r.kv {
            // Nobody will pull: the ctx side frees its KV now.
            self.out.push_back(FrontOut::ToPeer {
                to: kv,
                message: PeerMessage::Abort {
                    id,
                    cause: TransferFailure::Aborted(AbortCause::Failed(Box::new(
                        Failure::Undeliverable(format!(
                            "no gen server could take the request: {reason}"
                        )),
                    ))),
                },
            });
        }
        let mut response = failed(&r.spec, Failure::Undeliverable(reason));
        response.generated = r.spec.generated_before.max(u32::from(r.kv.is_some()));
        self.out.push_back(FrontOut::ToClient(response));
    }

    /// Responses gathered by server `server`'s rank 0 from rank `rank`, rewritten in
    /// place for the client: a ctx server's first token continues the request (it is
    /// handed to a gen server) or completes it (a single output token); everything
    /// else passes through.
    pub fn handle_responses(
        &mut self,
        _now_ns: u64,
        server: usize,
        rank: RankId,
        responses: &mut [Response],
    ) {
        let role = self.servers[server].server.role;
        for r in responses.iter_mut() {
            if r.finish.is_none() {
                continue;
            }
            let s = &mut self.servers[server];
            s.outstanding = s.outstanding.saturating_sub(1);
            let here = KvAddress {
                server: server as u32,
                rank,
            };
            match (role, &r.finish) {
                (Role::Ctx, Some(Finish::ContextDone)) => r.finish = self.hand_off(r.id, here),
                (_, Some(Finish::Failed(why))) => {
                    let why = AbortCause::Failed(Box::new(why.clone()));
                    self.on_failed(role, r.id, why);
                }
                (_, Some(Finish::Cancelled)) => self.on_failed(role, r.id, AbortCause::Cancelled),
                (_, Some(Finish::Completed)) | (_, _) => {
                    self.requests.remove(&r.id);
                }
            }
        }
    }

    /// The ctx rank `here` produced `id`'s first token and holds its KV. Returns what
    /// the client sees of it: a completion (nothing more to generate) or a token.
    fn hand_off(&mut self, id: ReqId, here: KvAddress) -> Option<Finish> {
        let Some(r) = self.requests.get(&id) else {
            // Unknown here (cancelled meanwhile): nobody will pull.
            self.out.push_back(FrontOut::ToPeer {
                to: here,
                message: PeerMessage::Release { id },
            });
            return Some(Finish::Completed);
        };
        if r.spec.max_new_tokens <= 1 {
            // Its only output token is out: done, and nobody will pull.
            self.out.push_back(FrontOut::ToPeer {
                to: here,
                message: PeerMessage::Release { id },
            });
            self.requests.remove(&id);
            return Some(Finish::Completed);
        }
        let gen_peer = r.gen_peer;
        // The gen server receives the KV; it never prefills, so the prompt's block
        // hashes (prefix reuse) mean nothing there: they are not sent (a long prompt
        // has thousands).
        let mut spec = self.requests[&id].spec.clone();
        spec.block_hashes = Default::default();
        spec.generated_before = 1;
        // Whichever gen rank the server's router picks pulls from here.
        spec.kv_source = Some(here);
        let target = match gen_peer {
            Some(peer) => Some(peer),
            None => self.pick(Role::Gen, &spec),
        };
        let Some(target) = target else {
            self.requests.remove(&id);
            self.out.push_back(FrontOut::ToPeer {
                to: here,
                message: PeerMessage::Abort {
                    id,
                    cause: TransferFailure::Aborted(AbortCause::Failed(Box::new(no_gen_server()))),
                },
            });
            return Some(Finish::Failed(no_gen_server()));
        };
        let r = self.requests.get_mut(&id).expect("looked up above");
        r.server = target;
        r.kv = Some(here);
        self.servers[target].outstanding += 1;
        self.out.push_back(FrontOut::ToServer {
            server: target,
            item: IngressItem::Request(spec),
        });
        None
    }

    /// `id` failed (or was cancelled) on a server of `role`: free what the other side
    /// of a handoff still holds.
    fn on_failed(&mut self, role: Role, id: ReqId, why: AbortCause) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        match (role, r.kv) {
            (Role::Gen, Some(ctx)) => {
                // The ctx side must free its KV too (ignored if it already did).
                self.out.push_back(FrontOut::ToPeer {
                    to: ctx,
                    message: PeerMessage::Abort {
                        id,
                        cause: TransferFailure::Aborted(AbortCause::GenSide(Box::new(why))),
                    },
                });
            }
            (Role::Ctx, Some(kv)) if r.server != kv.server as usize => {
                // The send failed after the handoff: the gen server still holds the
                // request (waiting for its KV); cancel it there.
                self.out.push_back(FrontOut::ToServer {
                    server: r.server,
                    item: IngressItem::Cancel(id),
                });
            }
            _ => {}
        }
    }
}

fn no_gen_server() -> Failure {
    Failure::NoServer {
        role: Role::Gen.name().to_string(),
    }
}

fn failed(spec: &RequestSpec, reason: Failure) -> Response {
    Response {
        id: spec.id,
        new_tokens: 0,
        last_token: 0,
        generated: spec.generated_before,
        finish: Some(Finish::Failed(reason)),
        logprobs: None,
    }
}
