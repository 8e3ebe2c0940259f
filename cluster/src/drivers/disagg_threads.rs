//! The `threads` driver for a disaggregated scenario: every rank of every ctx and gen
//! server on its own OS thread (each server its own in-process collective group and its
//! own ingress queue), a per-rank [`Transceiver`] that moves real KV bytes between ctx and
//! gen ranks over channels, and a front thread between the client and the servers.
//!
//! The front (mirroring the simulator's `admit_arrival` / `hand_off` / `fail_other_side`):
//! a request goes to a ctx server; its `ContextDone` response (first token) sends it on
//! to a gen server with `generated_before = 1`, no block hashes, and where its KV lives
//! (`RequestSpec::kv_source`: ctx server and rank), which reaches whichever gen rank the
//! server's router picks and comes back in its `Receive` command. A request whose only output token is out completes there and
//! its ctx rank is told nobody will pull (the KV is freed). A gen-side failure aborts the
//! ctx side's send. ctx servers stop after the client's shutdown once drained (every send
//! acknowledged); gen servers get their shutdown when every ctx server has stopped.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, unbounded};

use lockstep_actors::config::{DerivedSizes, Role, ServerConfig};
use lockstep_actors::executor::{
    FetchBatch, FetchMode, Finish, RankExecutor, RankResponses, Response, TransferCommand,
    TransferEvent,
};
use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::request::RequestSpec;
use lockstep_actors::transceiver::{
    KvAddress, KvCodec, Outgoing, PeerMessage, Transceiver, TransferStats,
};
use lockstep_gpu::{Coefficients, kv_contents};
use lockstep_transport::{InProcessGroup, IngressQueue};

use super::DriverError;
use super::client::{Client, ClientResult, IngressItem};
use super::rank_loop::{
    FrontDoor, LoopOptions, Progress, RankRun, TransferPort, run_rank_with_transfers,
};
use super::threads::{ThreadsOptions, fetch_from, start_device};
use crate::report::{
    Percentiles, RankSummary, Report, ServerReport, assemble_report, server_report,
};
use crate::scenario::{FrontPolicy, Scenario};
use crate::workload::Workload;

/// One server of the scenario, ready to start.
pub(crate) struct PlannedServer<'a> {
    pub(crate) config: &'a ServerConfig,
    pub(crate) sizes: DerivedSizes,
}

/// Every rank's transceiver inbox, indexed `[server][rank]`.
struct Mailboxes {
    inboxes: Vec<Vec<Sender<PeerMessage>>>,
}

impl Mailboxes {
    /// Delivers a message; a rank that has already stopped drops it (its peer times out).
    fn send(&self, to: KvAddress, message: PeerMessage) {
        if let Some(inbox) = self
            .inboxes
            .get(to.server as usize)
            .and_then(|s| s.get(to.rank.index()))
        {
            let _ = inbox.send(message);
        }
    }
}

/// Fault injection: loses the KV blocks of every n-th transfer on the wire.
pub(crate) struct KvLoss {
    pub(crate) every: Option<u64>,
    pub(crate) sent: AtomicU64,
}

impl KvLoss {
    /// Whether the wire loses `message`: every n-th KV-blocks message is lost.
    pub(crate) fn drops(&self, message: &PeerMessage) -> bool {
        if !matches!(message, PeerMessage::KvBlocks { .. }) {
            return false;
        }
        let n = self.sent.fetch_add(1, Ordering::Relaxed) + 1;
        self.every.is_some_and(|e| e > 0 && n.is_multiple_of(e))
    }
}

/// One rank's [`TransferPort`]: its transceiver, its inbox, and the links to its peers.
struct RankTransport {
    transceiver: Transceiver,
    inbox: Receiver<PeerMessage>,
    mailboxes: Arc<Mailboxes>,
    loss: Arc<KvLoss>,
    clock: Instant,
    lost: u64,
}

impl RankTransport {
    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn flush(&mut self) {
        for Outgoing { to, message } in self.transceiver.take_outgoing() {
            if self.loss.drops(&message) {
                self.lost += 1;
                tracing::debug!(id = %message.id(), "fault injection: KV blocks lost");
                continue;
            }
            self.mailboxes.send(to, message);
        }
    }
}

impl TransferPort for RankTransport {
    fn commands(&mut self, commands: &[TransferCommand]) {
        let now = self.now();
        for command in commands {
            self.transceiver.on_command(now, command);
        }
        self.flush();
    }

    fn poll(&mut self) -> Vec<TransferEvent> {
        let now = self.now();
        while let Ok(message) = self.inbox.try_recv() {
            self.transceiver.on_message(now, message);
        }
        self.transceiver.on_tick(now);
        self.flush();
        self.transceiver.take_events()
    }
}

/// What reaches the front.
pub(crate) enum FrontInput {
    /// From the client.
    Client(IngressItem),
    /// Gathered by a server's rank 0.
    Responses {
        server: usize,
        responses: Vec<RankResponses>,
    },
    /// A server's rank 0 left its loop (drained, or failed).
    ServerStopped(usize),
}

/// A server's rank 0 side of the front door.
struct ServerDoor {
    server: usize,
    clock: Instant,
    ingress: IngressQueue<IngressItem>,
    to_front: Sender<FrontInput>,
}

impl FrontDoor for ServerDoor {
    fn fetch(&mut self, mode: FetchMode) -> FetchBatch {
        fetch_from(&self.ingress, self.clock, mode)
    }

    fn deliver(&mut self, responses: Vec<RankResponses>) {
        if responses.iter().any(|r| !r.responses.is_empty()) {
            let _ = self.to_front.send(FrontInput::Responses {
                server: self.server,
                responses,
            });
        }
    }
}

impl Drop for ServerDoor {
    fn drop(&mut self) {
        // Sent after every response this rank delivered (one sender: in order).
        let _ = self.to_front.send(FrontInput::ServerStopped(self.server));
    }
}

/// How the front reaches the servers and their transceivers: queues and channels in one
/// process (`threads`), messages between processes (`mpi`).
pub trait FrontLinks {
    /// Queues `item` on server `server`'s ingress (its rank 0 reads it); `Err` says why
    /// the server cannot take it.
    fn submit(&mut self, server: usize, item: IngressItem) -> Result<(), String>;
    /// A message for a rank's transceiver.
    fn to_peer(&mut self, to: KvAddress, message: PeerMessage);
}

/// The links of the threads driver.
struct ThreadLinks {
    ingresses: Vec<IngressQueue<IngressItem>>,
    mailboxes: Arc<Mailboxes>,
}

impl FrontLinks for ThreadLinks {
    fn submit(&mut self, server: usize, item: IngressItem) -> Result<(), String> {
        self.ingresses[server]
            .push(item)
            .map_err(|e| format!("ingress: {e}"))
    }

    fn to_peer(&mut self, to: KvAddress, message: PeerMessage) {
        self.mailboxes.send(to, message);
    }
}

/// The front's view of one server.
pub(crate) struct FrontServer {
    role: Role,
    /// A ctx server in generation-first mode: its requests wait for the front to name
    /// their gen peer.
    generation_first: bool,
    /// Requests sent there and not yet ended there (the `load_balancing` policy).
    outstanding: u64,
    shutdown_sent: bool,
    stopped: bool,
}

/// The front's state (the threads driver runs it on its own thread, the MPI driver in
/// its front process).
pub(crate) struct Front<L: FrontLinks> {
    policy: FrontPolicy,
    servers: Vec<FrontServer>,
    specs: HashMap<ReqId, RequestSpec>,
    /// Handed-off requests: where their KV lives, to abort the send if the gen side fails.
    kv_of: HashMap<ReqId, KvAddress>,
    links: L,
    to_client: Sender<Vec<RankResponses>>,
    /// Round-robin pointers: ctx, gen.
    round_robin: [usize; 2],
    /// Generation-first: the gen server named for a request at arrival.
    gen_peers: HashMap<ReqId, usize>,
}

impl<L: FrontLinks> Front<L> {
    /// A front over `servers` (scenario order).
    pub(crate) fn new(
        policy: FrontPolicy,
        servers: &[&ServerConfig],
        links: L,
        to_client: Sender<Vec<RankResponses>>,
    ) -> Front<L> {
        Front {
            policy,
            servers: servers
                .iter()
                .map(|s| FrontServer {
                    role: s.role,
                    generation_first: s.role == Role::Ctx
                        && s.cache_transceiver_config.generation_first,
                    outstanding: 0,
                    shutdown_sent: false,
                    stopped: false,
                })
                .collect(),
            specs: HashMap::new(),
            kv_of: HashMap::new(),
            links,
            to_client,
            round_robin: [0, 0],
            gen_peers: HashMap::new(),
        }
    }

    /// Server selection among those of `role` (`[front] policy`): round robin, or the
    /// fewest requests outstanding at the front (`load_balancing`; `kv_aware` too: the
    /// front of this driver cannot see the servers' KV caches).
    fn pick(&mut self, role: Role) -> usize {
        let candidates: Vec<usize> = (0..self.servers.len())
            .filter(|&i| self.servers[i].role == role)
            .collect();
        match self.policy {
            FrontPolicy::RoundRobin => {
                let counter = &mut self.round_robin[usize::from(role == Role::Gen)];
                let chosen = candidates[*counter % candidates.len()];
                *counter += 1;
                chosen
            }
            FrontPolicy::LoadBalancing | FrontPolicy::KvAware => *candidates
                .iter()
                .min_by_key(|&&i| (self.servers[i].outstanding, i))
                .unwrap_or(&candidates[0]),
        }
    }

    /// Queues `spec` on `server`; a server that cannot take it fails the request (it is
    /// never lost) and this returns false.
    fn submit(&mut self, server: usize, spec: RequestSpec) -> bool {
        self.servers[server].outstanding += 1;
        let Err(e) = self
            .links
            .submit(server, IngressItem::Request(spec.clone()))
        else {
            return true;
        };
        self.servers[server].outstanding -= 1;
        let _ = self.to_client.send(vec![RankResponses {
            rank: RankId(0),
            responses: vec![Response {
                id: spec.id,
                new_tokens: 0,
                last_token: 0,
                generated: spec.generated_before,
                finish: Some(Finish::Failed(e)),
            }],
        }]);
        false
    }

    fn shutdown(&mut self, role: Role) {
        for i in 0..self.servers.len() {
            let s = &mut self.servers[i];
            if s.role == role && !s.shutdown_sent {
                s.shutdown_sent = true;
                let _ = self.links.submit(i, IngressItem::Shutdown);
            }
        }
    }

    /// Returns false once every server has stopped.
    pub(crate) fn handle(&mut self, input: FrontInput) -> bool {
        match input {
            FrontInput::Client(IngressItem::Request(spec)) => {
                let target = self.pick(Role::Ctx);
                let id = spec.id;
                self.specs.insert(id, spec.clone());
                if !self.submit(target, spec) {
                    self.specs.remove(&id);
                    self.gen_peers.remove(&id);
                } else if self.servers[target].generation_first {
                    // Generation-first (§8): name the gen peer now and tell the ctx
                    // server, whose ranks promote the request at the same fetch.
                    let peer = self.pick(Role::Gen);
                    self.gen_peers.insert(id, peer);
                    let _ = self.links.submit(target, IngressItem::PeerReady(id));
                }
            }
            FrontInput::Client(IngressItem::PeerReady(_)) => {}
            FrontInput::Client(IngressItem::Shutdown) => self.shutdown(Role::Ctx),
            FrontInput::Responses { server, responses } => self.on_responses(server, responses),
            FrontInput::ServerStopped(server) => {
                let s = &mut self.servers[server];
                s.stopped = true;
                if !s.shutdown_sent {
                    // It failed: wind every server down (each drains what it holds; a
                    // transfer with the failed server times out).
                    tracing::warn!(server, "a server stopped before its shutdown");
                    self.shutdown(Role::Ctx);
                    self.shutdown(Role::Gen);
                }
                let ctx_all_stopped = self
                    .servers
                    .iter()
                    .filter(|s| s.role == Role::Ctx)
                    .all(|s| s.stopped);
                if ctx_all_stopped {
                    // No handoff can come any more.
                    self.shutdown(Role::Gen);
                }
            }
        }
        !self.servers.iter().all(|s| s.stopped)
    }

    fn on_responses(&mut self, server: usize, gathered: Vec<RankResponses>) {
        let role = self.servers[server].role;
        let mut to_client = Vec::with_capacity(gathered.len());
        for RankResponses { rank, responses } in gathered {
            let mut forwarded = Vec::with_capacity(responses.len());
            for mut r in responses {
                let id = r.id;
                if r.finish.is_some() {
                    let s = &mut self.servers[server];
                    s.outstanding = s.outstanding.saturating_sub(1);
                }
                let here = KvAddress {
                    server: server as u32,
                    rank,
                };
                match (role, &r.finish) {
                    (Role::Ctx, Some(Finish::ContextDone)) => {
                        let single_token = self
                            .specs
                            .get(&id)
                            .is_none_or(|spec| spec.max_new_tokens <= 1);
                        if single_token {
                            // Its only output token is out: done, and nobody will pull.
                            self.links.to_peer(here, PeerMessage::Release { id });
                            r.finish = Some(Finish::Completed);
                            self.specs.remove(&id);
                            self.gen_peers.remove(&id);
                        } else if let Some(spec) = self.specs.get(&id) {
                            let mut spec = spec.clone();
                            spec.generated_before = 1;
                            // The gen server receives the KV; it never prefills, so the
                            // prompt's block hashes (prefix reuse) mean nothing there.
                            spec.block_hashes = Vec::new();
                            // Whichever gen rank the server's router picks pulls from here.
                            spec.kv_source = Some(here);
                            self.kv_of.insert(id, here);
                            let target = match self.gen_peers.remove(&id) {
                                Some(peer) => peer,
                                None => self.pick(Role::Gen),
                            };
                            if !self.submit(target, spec) {
                                // Nobody will pull: the ctx side frees its KV now.
                                self.kv_of.remove(&id);
                                self.links.to_peer(
                                    here,
                                    PeerMessage::Abort {
                                        id,
                                        reason: "no gen server could take the request".into(),
                                    },
                                );
                            }
                        }
                    }
                    (Role::Gen, Some(Finish::Failed(_) | Finish::Cancelled)) => {
                        let why = match &r.finish {
                            Some(Finish::Failed(why)) => why.clone(),
                            _ => "cancelled".to_string(),
                        };
                        if let Some(ctx) = self.kv_of.remove(&id) {
                            // The ctx side must free its KV too (ignored if it already did).
                            self.links.to_peer(
                                ctx,
                                PeerMessage::Abort {
                                    id,
                                    reason: format!("gen side failed: {why}"),
                                },
                            );
                        }
                        self.specs.remove(&id);
                        self.gen_peers.remove(&id);
                    }
                    (_, Some(_)) => {
                        // Completed on the gen side, or failed on the ctx side (a failed
                        // send aborts the gen side through the transceivers).
                        self.kv_of.remove(&id);
                        self.specs.remove(&id);
                        self.gen_peers.remove(&id);
                    }
                    (_, None) => {}
                }
                forwarded.push(r);
            }
            to_client.push(RankResponses {
                rank,
                responses: forwarded,
            });
        }
        let _ = self.to_client.send(to_client);
    }
}

/// Checks the scenario (ctx and gen servers, one block size, no simulator-only fault)
/// and derives every server's sizes.
pub(crate) fn plan(scenario: &Scenario) -> Result<Vec<PlannedServer<'_>>, DriverError> {
    let roles: Vec<Role> = scenario.servers.iter().map(|s| s.role).collect();
    if roles.contains(&Role::Agg) {
        return Err(DriverError::Invalid(
            "a scenario has either agg servers or ctx and gen servers, not both".into(),
        ));
    }
    if !roles.contains(&Role::Ctx) || !roles.contains(&Role::Gen) {
        return Err(DriverError::Invalid(
            "a disaggregated scenario needs at least one ctx and one gen server".into(),
        ));
    }
    if scenario.faults.timeouts_lost {
        return Err(DriverError::Invalid(
            "faults.timeouts_lost is a simulator-only fault: a real transceiver always times out"
                .into(),
        ));
    }
    let mut planned = Vec::with_capacity(scenario.servers.len());
    for config in &scenario.servers {
        let sizes = config
            .derive(&scenario.policy)
            .map_err(|e| DriverError::Invalid(e.to_string()))?
            .sizes;
        planned.push(PlannedServer { config, sizes });
    }
    let first = &planned[0];
    if let Some(other) = planned
        .iter()
        .find(|p| p.sizes.tokens_per_block != first.sizes.tokens_per_block)
    {
        return Err(DriverError::Invalid(format!(
            "server `{}`: kv_cache_config.tokens_per_block = {} differs from server `{}`'s {}; \
             KV handed between servers needs one block size",
            other.config.name,
            other.sizes.tokens_per_block,
            first.config.name,
            first.sizes.tokens_per_block
        )));
    }
    Ok(planned)
}

/// What one rank hands back for the report: its executor's summary and its
/// transceiver's counters (sent to the front process under MPI).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct RankEnd {
    pub(crate) summary: RankSummary,
    pub(crate) transfers: TransferStats,
    pub(crate) lost: u64,
}

impl RankEnd {
    pub(crate) fn of(run: RankRun, transfers: TransferStats, lost: u64) -> RankEnd {
        RankEnd {
            summary: RankSummary::of(
                &run.exec,
                run.iterations,
                run.violations,
                run.violation_count,
            ),
            transfers,
            lost,
        }
    }
}

/// Runs a disaggregated scenario: every rank of every server on its own thread, KV moved
/// between ranks by their transceivers.
pub fn run(scenario: &Scenario, opts: &ThreadsOptions) -> Result<Report, DriverError> {
    let started = Instant::now();
    let planned = plan(scenario)?;
    let seed = scenario.seed.unwrap_or(opts.seed);
    let tokens_per_block = planned[0].sizes.tokens_per_block;
    let wl_cfg = scenario
        .workload
        .as_ref()
        .ok_or_else(|| DriverError::Invalid("scenario has no [workload] section".into()))?;
    let workload = Workload::new(wl_cfg, tokens_per_block, seed, &scenario.base_dir)
        .map_err(|e| DriverError::Invalid(e.to_string()))?;
    let profile = scenario.model.resolve().map_err(DriverError::Invalid)?;
    let coefficients: Coefficients = profile.coefficients;
    let codec = KvCodec {
        block_bytes: kv_contents::block_bytes(profile.kv.bytes_per_token(), tokens_per_block),
        fill: kv_contents::fill_block,
        checksum: kv_contents::checksum,
    };

    let clock = Instant::now();
    let loss = Arc::new(KvLoss {
        every: opts
            .lose_kv_blocks_every
            .or(scenario.faults.lost_transfer_every),
        sent: AtomicU64::new(0),
    });
    let mut inboxes = Vec::with_capacity(planned.len());
    let mut inbox_senders = Vec::with_capacity(planned.len());
    for p in &planned {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..p.sizes.dp).map(|_| unbounded::<PeerMessage>()).unzip();
        inbox_senders.push(senders);
        inboxes.push(receivers);
    }
    let mailboxes = Arc::new(Mailboxes {
        inboxes: inbox_senders,
    });

    let (front_tx, front_rx) = unbounded::<FrontInput>();
    let ingresses: Vec<IngressQueue<IngressItem>> = planned
        .iter()
        .map(|_| IngressQueue::new(opts.ingress_capacity))
        .collect();

    // The client and the front between it and the servers.
    let client_ingress: IngressQueue<IngressItem> = IngressQueue::new(opts.ingress_capacity);
    let (client_tx, client_rx) = unbounded::<Vec<RankResponses>>();
    let client = Client::new(
        workload,
        client_ingress.clone(),
        client_rx,
        opts.time_scale,
        opts.preload,
    )?;
    let configs: Vec<&ServerConfig> = planned.iter().map(|p| p.config).collect();
    let mut front = Front::new(
        scenario.front.policy,
        &configs,
        ThreadLinks {
            ingresses: ingresses.clone(),
            mailboxes: mailboxes.clone(),
        },
        client_tx,
    );

    // With `preload`, every arrival reaches the ctx servers' ingress queues before any
    // rank runs: the first fetch sees them all, as in the other drivers.
    if opts.preload {
        for item in client_ingress.drain_now() {
            front.handle(FrontInput::Client(item));
        }
    }

    // Every rank of every server.
    let mut handles = Vec::new();
    for (s, (p, server_inboxes)) in planned.iter().zip(inboxes).enumerate() {
        let members = InProcessGroup::new(p.sizes.dp as usize, opts.collective_timeout);
        let timeout_ms = p
            .config
            .cache_transceiver_config
            .kv_transfer_timeout_ms
            .max(1) as u64;
        for (r, (mut member, inbox)) in members.into_iter().zip(server_inboxes).enumerate() {
            let me = KvAddress {
                server: s as u32,
                rank: RankId(r as u32),
            };
            let exec = RankExecutor::new(me.rank, p.config, &p.sizes, scenario.policy);
            let mut transport = RankTransport {
                transceiver: Transceiver::new(me, timeout_ms, codec),
                inbox,
                mailboxes: mailboxes.clone(),
                loss: loss.clone(),
                clock,
                lost: 0,
            };
            let mut door = (r == 0).then(|| ServerDoor {
                server: s,
                clock,
                ingress: ingresses[s].clone(),
                to_front: front_tx.clone(),
            });
            let time_scale = opts.time_scale;
            let collective_timeout = opts.collective_timeout;
            let loop_opts = LoopOptions::default();
            let name = format!("{}-rank-{r}", p.config.name);
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || -> Result<RankEnd, DriverError> {
                    let device = start_device(r, coefficients, time_scale, collective_timeout);
                    let run = run_rank_with_transfers(
                        exec,
                        &mut member,
                        door.as_mut().map(|d| d as &mut dyn FrontDoor),
                        Some(&mut transport),
                        &device,
                        &Arc::new(Progress::default()),
                        &loop_opts,
                    )?;
                    Ok(RankEnd::of(
                        run,
                        transport.transceiver.stats().clone(),
                        transport.lost,
                    ))
                })
                .map_err(|e| DriverError::Invalid(format!("spawning {name}: {e}")))?;
            handles.push((s, handle));
        }
    }

    let forwarder = {
        let ingress = client_ingress.clone();
        let to_front = front_tx.clone();
        std::thread::Builder::new()
            .name("front-ingress".into())
            .spawn(move || {
                while let Some(item) = ingress.pop_blocking() {
                    if to_front.send(FrontInput::Client(item)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| DriverError::Invalid(format!("spawning the front: {e}")))?
    };
    // Kept to wind the servers down should the client stop early.
    let shutdown_tx = front_tx;
    let front_thread = std::thread::Builder::new()
        .name("front".into())
        .spawn(move || {
            while let Ok(input) = front_rx.recv() {
                if !front.handle(input) {
                    break;
                }
            }
            // Dropping the front closes the client's response channel: the client ends.
        })
        .map_err(|e| DriverError::Invalid(format!("spawning the front: {e}")))?;

    let result = client.run();
    // Normally every server has stopped already and this goes nowhere; after a client
    // error it lets the servers drain and stop instead of waiting forever.
    let _ = shutdown_tx.send(FrontInput::Client(IngressItem::Shutdown));
    drop(shutdown_tx);
    client_ingress.close();
    for ingress in &ingresses {
        ingress.close();
    }
    let _ = forwarder.join();
    let _ = front_thread.join();

    let mut ends: Vec<Vec<RankEnd>> = planned.iter().map(|_| Vec::new()).collect();
    let mut first_error = None;
    for (s, h) in handles {
        match h.join() {
            Ok(Ok(end)) => ends[s].push(end),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(DriverError::Invalid("a rank thread panicked".into()));
            }
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(fleet_report(
        scenario, seed, &planned, ends, result?, started,
    ))
}

/// The report of a disaggregated run: the client's records and one section per server
/// (`ends[s]`: server `s`'s ranks in rank order). Shared by the threads and MPI drivers.
pub(crate) fn fleet_report(
    scenario: &Scenario,
    seed: u64,
    planned: &[PlannedServer<'_>],
    ends: Vec<Vec<RankEnd>>,
    result: ClientResult,
    started: Instant,
) -> Report {
    let end_s = result.end_ns as f64 / 1e9;
    let servers = planned
        .iter()
        .zip(ends)
        .map(|(p, ends)| server_section(p.config, &p.sizes, ends, end_s))
        .collect();
    assemble_report(
        scenario,
        seed,
        result.records,
        result.end_ns,
        started.elapsed().as_secs_f64(),
        servers,
        None,
    )
}

/// One server's report: the ranks' summaries plus their transceivers' counters.
pub(crate) fn server_section(
    config: &ServerConfig,
    sizes: &DerivedSizes,
    ends: Vec<RankEnd>,
    end_s: f64,
) -> ServerReport {
    let mut durations_ms = Vec::new();
    let (mut count, mut bytes, mut failures, mut checksum_failures, mut lost) = (0, 0, 0, 0, 0);
    let mut summaries = Vec::with_capacity(ends.len());
    for end in ends {
        let t = &end.transfers;
        count += t.completed;
        bytes += t.bytes;
        failures += t.timed_out + t.failed;
        checksum_failures += t.checksum_failures;
        lost += end.lost;
        durations_ms.extend(t.durations_ns.iter().map(|&ns| ns as f64 / 1e6));
        summaries.push(end.summary);
    }
    let mut report = server_report(
        &config.name,
        config.role,
        sizes.max_batch_size,
        &summaries,
        end_s,
    );
    let times = Percentiles::of(&mut durations_ms);
    report.transfers.count = count;
    report.transfers.bytes = bytes;
    report.transfers.mean_ms = times.mean;
    report.transfers.p99_ms = times.p99;
    report.transfers.timeouts = failures;
    report.transfers.lost = lost;
    report.transfers.checksum_failures = checksum_failures;
    report
}
