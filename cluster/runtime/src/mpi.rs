//! The `mpi` backend: one mpirun world holding a front process (world rank 0: the client
//! and the front host) and one process per rank of every server, in scenario order —
//! aggregated or disaggregated alike. Each server's collectives run over its own
//! communicator split from the world; everything else is a point-to-point message over
//! the world ([`Net`]): ingress items to a server's rank 0, gathered responses and
//! summaries to the front, transceiver messages (the KV bytes) between ranks.
//!
//! MPI is initialised with full thread support: a rank's main thread runs its host
//! (collectives), its transceiver thread moves KV, its watchdog thread drains
//! keep-alives. Every process sends through one outbox thread, in order, so a blocking
//! send of a large message never stops a host from receiving (no two processes can wait
//! on each other's receives); and no process finalises before the front, having heard
//! from every rank, says so: until then every process keeps draining what reaches it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};
use serde::Serialize;
use serde::de::DeserializeOwned;

use lockstep_actors::executor::{CollectiveTag, Phase};
use lockstep_actors::front::Front;
use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::TransceiverIn;
use lockstep_actors::vocab::{KvAddress, Response, TransferEvent};
use lockstep_transport::{Collective, HEARTBEAT_CHANNEL, MpiMember, MpiPeers};

use super::{RealOptions, real_report};
use crate::client::{ClientItem, ClientLoop};
use crate::faults::MisTagged;
use crate::front_host::{FrontEnd, FrontInbound, FrontLoop};
use crate::ordered::{Item, Order, OrderedNet, Sequencer, Turn, TurnStuck};
use crate::rank_host::{OrderedRank, RankPorts, run_rank};
use crate::rank_setup::{RankParts, build_rank, end_rank, rank_options};
use crate::status::StatusBoard;
use crate::transceiver_host::{
    TransceiverInput, TransceiverLink, run_transceiver, run_transceiver_ordered,
};
use crate::watchdog::{Progress, watch};
use crate::{Clock, Endpoint, Envelope, Inbox, Net, NetError, Received, RuntimeError, WallClock};
use lockstep_hosts::order::{
    OrderError, Party, Phase as OrderPhase, ServerNext, first_transceivers, transceiver_place,
};
use lockstep_plan::fleet::Fleet;
use lockstep_plan::report::Report;
use lockstep_plan::scenario::Scenario;

/// The front process's world rank.
const FRONT: usize = 0;

/// Point-to-point channels (MPI tags).
mod channel {
    /// → a server's rank 0: `Envelope::Ingress`.
    pub const INGRESS: i32 = 101;
    /// → the front: responses, stops, summaries.
    pub const FRONT: i32 = 102;
    /// → a transceiver: `Envelope::Peer`.
    pub const KV: i32 = 103;
    /// front → every process: the run is over, finalise.
    pub const EXIT: i32 = 104;
    /// a rank's watchdog → the front: this process is alive and reachable (empty).
    pub const ALIVE: i32 = 105;
    /// a rank's watchdog → the front: this rank is stuck (its watchdog's description).
    pub const STUCK: i32 = 106;
    /// An ordered run: a rank's main thread → the front's sequencer, a call.
    pub const ORDER_RANK: i32 = 107;
    /// An ordered run: a transceiver thread → the front's sequencer, a call.
    pub const ORDER_TRANSCEIVER: i32 = 108;
    /// The front's sequencer → a rank's main thread: the answer.
    pub const ORDER_RANK_ANSWER: i32 = 109;
    /// The front's sequencer → a transceiver thread: the answer.
    pub const ORDER_TRANSCEIVER_ANSWER: i32 = 110;
}

/// Options of one process.
#[derive(Debug, Clone)]
pub struct MpiOptions {
    /// Shared with the threads driver.
    pub common: RealOptions,
    /// No sign of life for this long aborts the job.
    pub watchdog: Duration,
}

/// Where every rank lives in the world.
#[derive(Debug, Clone)]
struct Layout {
    /// World rank of each server's rank 0.
    first: Vec<usize>,
    dp: Vec<usize>,
}

impl Layout {
    fn of(fleet: &Fleet<'_>) -> Layout {
        let mut first = Vec::with_capacity(fleet.servers.len());
        let mut next = FRONT + 1;
        for p in &fleet.servers {
            first.push(next);
            next += p.sizes.dp as usize;
        }
        Layout {
            first,
            dp: fleet.servers.iter().map(|p| p.sizes.dp as usize).collect(),
        }
    }

    fn world_size(&self) -> usize {
        1 + self.dp.iter().sum::<usize>()
    }

    fn world_rank(&self, at: KvAddress) -> usize {
        self.first[at.server as usize] + at.rank.index()
    }

    fn locate(&self, world_rank: usize) -> Option<KvAddress> {
        let s = self
            .first
            .iter()
            .zip(&self.dp)
            .position(|(&f, &n)| (f..f + n).contains(&world_rank))?;
        Some(KvAddress {
            server: s as u32,
            rank: lockstep_actors::ids::RankId((world_rank - self.first[s]) as u32),
        })
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Our own message types always encode.
    bincode::serde::encode_to_vec(value, bincode::config::standard()).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(from: usize, bytes: &[u8]) -> Result<T, RuntimeError> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(v, _)| v)
        .map_err(|e| RuntimeError::Malformed {
            from,
            message: e.to_string(),
        })
}

/// A process's outbox: one thread sends everything, in order.
struct Outbox {
    tx: Option<Sender<(usize, i32, Vec<u8>)>>,
    thread: Option<JoinHandle<()>>,
}

impl Outbox {
    fn start() -> Result<Outbox, RuntimeError> {
        let (tx, rx) = unbounded::<(usize, i32, Vec<u8>)>();
        let thread = std::thread::Builder::new()
            .name("outbox".into())
            .spawn(move || {
                let peers = MpiPeers::for_this_thread();
                while let Ok((to, tag, bytes)) = rx.recv() {
                    peers.send_to(to, tag, &bytes);
                }
            })
            .map_err(|source| RuntimeError::Spawn {
                what: "the outbox".into(),
                source,
            })?;
        Ok(Outbox {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Sends everything queued, then stops.
    fn flush(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// [`Net`] over MPI: messages to world ranks, through the outbox.
struct MpiNet {
    layout: Layout,
    outbox: Sender<(usize, i32, Vec<u8>)>,
}

impl Net for MpiNet {
    fn send(&self, to: Endpoint, envelope: Envelope) -> Result<(), NetError> {
        let (rank, tag) = match to {
            Endpoint::Front => (FRONT, channel::FRONT),
            Endpoint::Ingress(s) => (
                *self
                    .layout
                    .first
                    .get(s)
                    .ok_or(NetError::Unknown { endpoint: to })?,
                channel::INGRESS,
            ),
            Endpoint::Transceiver(at) => {
                if at.server as usize >= self.layout.first.len() {
                    return Err(NetError::Unknown { endpoint: to });
                }
                (self.layout.world_rank(at), channel::KV)
            }
        };
        self.outbox
            .send((rank, tag, encode(&envelope)))
            .map_err(|_| NetError::Closed { endpoint: to })
    }
}

/// How long an idle MPI inbox sleeps between probes.
const PROBE_EVERY: Duration = Duration::from_micros(50);

/// Waits for the next envelope on `tag` (probing), until `deadline`.
fn probe_until(
    peers: &MpiPeers,
    tag: i32,
    deadline: Option<Instant>,
    mut other: impl FnMut() -> bool,
) -> Option<(usize, Vec<u8>)> {
    loop {
        if let Some(got) = peers.try_receive(tag) {
            return Some(got);
        }
        if other() || deadline.is_some_and(|d| Instant::now() >= d) {
            return None;
        }
        std::thread::sleep(PROBE_EVERY);
    }
}

/// A server's ingress, as its rank 0 reads it over MPI.
struct IngressInbox {
    peers: MpiPeers,
    queued: VecDeque<IngressItem>,
}

impl Inbox<IngressItem> for IngressInbox {
    fn recv_until(&mut self, deadline: Option<Instant>) -> Received<IngressItem> {
        loop {
            if let Some(item) = self.queued.pop_front() {
                return Received::Message(item);
            }
            match probe_until(&self.peers, channel::INGRESS, deadline, || false) {
                Some((from, bytes)) => match decode::<Envelope>(from, &bytes) {
                    Ok(Envelope::Ingress(items)) => self.queued.extend(items),
                    Ok(other) => tracing::warn!(?other, "not an ingress message"),
                    Err(e) => tracing::warn!("{e}"),
                },
                None => return Received::TimedOut,
            }
        }
    }
}

/// A transceiver's inbox over MPI: its rank's commands, and its peers' messages.
struct TransceiverInbox {
    peers: MpiPeers,
    commands: Receiver<TransceiverInput>,
}

impl Inbox<TransceiverInput> for TransceiverInbox {
    fn recv_until(&mut self, deadline: Option<Instant>) -> Received<TransceiverInput> {
        let mut command = None;
        let got = probe_until(&self.peers, channel::KV, deadline, || {
            command = self.commands.try_recv().ok();
            command.is_some()
        });
        if let Some(c) = command {
            return Received::Message(c);
        }
        match got {
            Some((from, bytes)) => match decode::<Envelope>(from, &bytes) {
                Ok(Envelope::Peer(m)) => {
                    Received::Message(TransceiverInput::In(TransceiverIn::Message(m)))
                }
                Ok(_) | Err(_) => Received::TimedOut,
            },
            None => Received::TimedOut,
        }
    }
}

/// An ordered run's call to the front process's sequencer ([`Order`]'s methods).
#[derive(Debug, Serialize, serde::Deserialize)]
enum OrderCall {
    Now,
    Holds(Party),
    WaitTurn(Party, Option<u64>),
    WaitServerTurnAfter(usize, u64),
    Take(Party, u64, bool),
    EndServer(usize, ServerNext),
    End(Party, Option<u64>),
    Leave(Party),
    Post(Party, u64, (OrderPhase, u32), Item),
}

/// The sequencer's answer to an [`OrderCall`].
#[derive(Debug, Serialize, serde::Deserialize)]
enum OrderAnswer {
    Now(u64),
    Holds(bool),
    Turn(Result<Turn, TurnStuck>),
    At(Result<u64, TurnStuck>),
    Items(Vec<Item>),
    Done,
    Posted(Result<(), OrderError>),
}

fn answer(order: &Sequencer, call: OrderCall) -> OrderAnswer {
    match call {
        OrderCall::Now => OrderAnswer::Now(order.now()),
        OrderCall::Holds(p) => OrderAnswer::Holds(order.holds(p)),
        OrderCall::WaitTurn(p, slice_ms) => {
            OrderAnswer::Turn(order.wait_turn(p, slice_ms.map(Duration::from_millis)))
        }
        OrderCall::WaitServerTurnAfter(s, at) => {
            OrderAnswer::At(order.wait_server_turn_after(s, at))
        }
        OrderCall::Take(p, upto, inclusive) => OrderAnswer::Items(order.take(p, upto, inclusive)),
        OrderCall::EndServer(s, next) => {
            order.end_server(s, next);
            OrderAnswer::Done
        }
        OrderCall::End(p, deadline) => {
            order.end(p, deadline);
            OrderAnswer::Done
        }
        OrderCall::Leave(p) => {
            order.leave(p);
            OrderAnswer::Done
        }
        OrderCall::Post(to, delay, from, item) => {
            OrderAnswer::Posted(order.post(to, delay, from, item))
        }
    }
}

/// The front process's side of an ordered run's calls: one thread takes them off the
/// world, and each calling thread of a rank process gets a thread of its own here that
/// answers its calls in order (a wait for a turn blocks only that one), until `done`.
fn serve_order_calls(order: &Sequencer, outbox: &Sender<(usize, i32, Vec<u8>)>, done: &AtomicBool) {
    std::thread::scope(|scope| {
        let peers = MpiPeers::for_this_thread();
        let mut callers: Vec<((usize, i32), Sender<OrderCall>)> = Vec::new();
        while !done.load(Ordering::Relaxed) {
            let mut any = false;
            for (tag, answer_tag) in [
                (channel::ORDER_RANK, channel::ORDER_RANK_ANSWER),
                (
                    channel::ORDER_TRANSCEIVER,
                    channel::ORDER_TRANSCEIVER_ANSWER,
                ),
            ] {
                while let Some((from, bytes)) = peers.try_receive(tag) {
                    any = true;
                    let call = match decode::<OrderCall>(from, &bytes) {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!("{e}");
                            continue;
                        }
                    };
                    let caller = match callers.iter().find(|(k, _)| *k == (from, tag)) {
                        Some((_, tx)) => tx.clone(),
                        None => {
                            let (tx, rx) = unbounded::<OrderCall>();
                            let outbox = outbox.clone();
                            scope.spawn(move || {
                                while let Ok(call) = rx.recv() {
                                    let a = answer(order, call);
                                    if outbox.send((from, answer_tag, encode(&a))).is_err() {
                                        return;
                                    }
                                }
                            });
                            callers.push(((from, tag), tx.clone()));
                            tx
                        }
                    };
                    let _ = caller.send(call);
                }
            }
            if !any {
                std::thread::sleep(PROBE_EVERY);
            }
        }
        // Closing the callers' channels ends their threads.
        callers.clear();
    });
}

/// A rank process's thread's way to the front process's sequencer: each call goes
/// out and waits for its answer, so what it sent is there before the thread goes on.
/// While it waits the rank shows signs of life (a turn can be a long way off).
struct RemoteOrder {
    outbox: Sender<(usize, i32, Vec<u8>)>,
    call_tag: i32,
    answer_tag: i32,
    first_transceiver: Vec<u32>,
    control_ns: u64,
    alive: Option<(Arc<Progress>, WallClock)>,
}

impl RemoteOrder {
    fn call(&self, call: OrderCall) -> OrderAnswer {
        tracing::debug!(tag = self.call_tag, ?call, "order call");
        let peers = MpiPeers::for_this_thread();
        if self
            .outbox
            .send((FRONT, self.call_tag, encode(&call)))
            .is_err()
        {
            return OrderAnswer::Done;
        }
        loop {
            if let Some((from, bytes)) = peers.try_receive(self.answer_tag) {
                match decode::<OrderAnswer>(from, &bytes) {
                    Ok(a) => return a,
                    Err(e) => tracing::warn!("{e}"),
                }
            }
            if let Some((progress, clock)) = &self.alive {
                progress.alive(clock.now_ns());
            }
            std::thread::sleep(PROBE_EVERY);
        }
    }
}

impl Order for RemoteOrder {
    fn transceiver(&self, at: KvAddress) -> Party {
        Party::Transceiver(transceiver_place(&self.first_transceiver, at))
    }

    fn control_ns(&self) -> u64 {
        self.control_ns
    }

    fn now(&self) -> u64 {
        match self.call(OrderCall::Now) {
            OrderAnswer::Now(t) => t,
            _ => 0,
        }
    }

    fn holds(&self, p: Party) -> bool {
        matches!(self.call(OrderCall::Holds(p)), OrderAnswer::Holds(true))
    }

    fn wait_turn(&self, me: Party, slice: Option<Duration>) -> Result<Turn, TurnStuck> {
        let slice_ms = slice.map(|s| s.as_millis().max(1) as u64);
        match self.call(OrderCall::WaitTurn(me, slice_ms)) {
            OrderAnswer::Turn(t) => t,
            _ => Ok(Turn::Gone),
        }
    }

    fn wait_server_turn_after(&self, server: usize, fetched_at: u64) -> Result<u64, TurnStuck> {
        match self.call(OrderCall::WaitServerTurnAfter(server, fetched_at)) {
            OrderAnswer::At(t) => t,
            _ => Ok(fetched_at),
        }
    }

    fn take(&self, p: Party, upto: u64, inclusive: bool) -> Vec<Item> {
        match self.call(OrderCall::Take(p, upto, inclusive)) {
            OrderAnswer::Items(items) => items,
            _ => Vec::new(),
        }
    }

    fn end_server(&self, s: usize, next: ServerNext) {
        self.call(OrderCall::EndServer(s, next));
    }

    fn end(&self, p: Party, deadline: Option<u64>) {
        self.call(OrderCall::End(p, deadline));
    }

    fn leave(&self, p: Party) {
        self.call(OrderCall::Leave(p));
    }

    fn post(
        &self,
        to: Party,
        delay_ns: u64,
        from: (OrderPhase, u32),
        item: Item,
    ) -> Result<(), OrderError> {
        match self.call(OrderCall::Post(to, delay_ns, from, item)) {
            OrderAnswer::Posted(r) => r,
            _ => Err(OrderError::Gone(to)),
        }
    }
}

/// What the front knows of every rank's liveness: each rank's watchdog thread sends it
/// a sign of life every tenth of the watchdog bound, and says so when its rank is stuck.
/// A rank that has not ended and is silent for 1.5 bounds, or a stuck rank's notice,
/// ends the run: the ranks silent for half a bound or more are the ones lost.
struct Liveness {
    peers: MpiPeers,
    /// When each world rank was last heard from (index 0, the front, unused).
    heard: Vec<Instant>,
    /// Ranks whose summary arrived: they owe nothing more.
    ended: Vec<bool>,
    limit: Duration,
    /// Names the ranks.
    layout: Layout,
    names: Vec<String>,
}

impl Liveness {
    fn new(layout: &Layout, names: Vec<String>, limit: Duration) -> Liveness {
        let n = layout.world_size();
        Liveness {
            peers: MpiPeers::for_this_thread(),
            heard: vec![Instant::now(); n],
            ended: vec![false; n],
            limit,
            layout: layout.clone(),
            names,
        }
    }

    fn heard_from(&mut self, world_rank: usize) {
        if let Some(t) = self.heard.get_mut(world_rank) {
            *t = Instant::now();
        }
    }

    /// Takes the signs of life and notices that arrived; the reason the run must end
    /// now, if it must.
    fn check(&mut self) -> Option<String> {
        while let Some((from, _)) = self.peers.try_receive(channel::ALIVE) {
            self.heard_from(from);
        }
        let now = Instant::now();
        let silent = |this: &Liveness, bound: Duration| -> Vec<usize> {
            (1..this.heard.len())
                .filter(|&w| !this.ended[w] && now.duration_since(this.heard[w]) >= bound)
                .collect()
        };
        if let Some((from, bytes)) = self.peers.try_receive(channel::STUCK) {
            let lost = silent(self, self.limit / 2);
            return Some(self.describe(
                &lost,
                &format!(
                    "world rank {from} ({}) is stuck: {}",
                    self.name(from),
                    String::from_utf8_lossy(&bytes)
                ),
            ));
        }
        let overdue = silent(self, self.limit * 3 / 2);
        if overdue.is_empty() {
            return None;
        }
        let lost = silent(self, self.limit / 2);
        Some(self.describe(
            &lost,
            &format!(
                "the front heard nothing from them for {} ms",
                (self.limit * 3 / 2).as_millis()
            ),
        ))
    }

    fn name(&self, world_rank: usize) -> String {
        match self.layout.locate(world_rank) {
            Some(at) => format!(
                "server `{}` rank {}",
                self.names[at.server as usize],
                at.rank.index()
            ),
            None => "the front".into(),
        }
    }

    fn describe(&self, lost: &[usize], why: &str) -> String {
        if lost.is_empty() {
            return format!("the run was abandoned: {why}");
        }
        let mut by_server: Vec<(String, Vec<String>)> = Vec::new();
        for &w in lost {
            if let Some(at) = self.layout.locate(w) {
                let name = &self.names[at.server as usize];
                match by_server.iter_mut().find(|(n, _)| n == name) {
                    Some((_, ranks)) => ranks.push(at.rank.index().to_string()),
                    None => by_server.push((name.clone(), vec![at.rank.index().to_string()])),
                }
            }
        }
        let servers: Vec<String> = by_server
            .iter()
            .map(|(n, r)| format!("server `{n}` rank{} {}", plural(r.len()), r.join(", ")))
            .collect();
        let worlds: Vec<String> = lost.iter().map(usize::to_string).collect();
        format!(
            "lost contact with world rank{} {} ({}): unreachable, no sign of life for {} ms or more; {why}",
            plural(lost.len()),
            worlds.join(", "),
            servers.join("; "),
            (self.limit / 2).as_millis()
        )
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// The front's inbox over MPI: the client's items and the servers' messages, and the
/// ranks' liveness.
struct FrontInbox {
    peers: MpiPeers,
    client: Receiver<ClientItem>,
    liveness: Liveness,
}

impl Inbox<FrontInbound> for FrontInbox {
    fn recv_until(&mut self, deadline: Option<Instant>) -> Received<FrontInbound> {
        if let Some(why) = self.liveness.check() {
            return Received::Message(FrontInbound::Lost(why));
        }
        let mut item = None;
        let mut lost = None;
        let liveness = &mut self.liveness;
        let got = probe_until(&self.peers, channel::FRONT, deadline, || {
            lost = liveness.check();
            item = self.client.try_recv().ok();
            lost.is_some() || item.is_some()
        });
        if let Some(why) = lost {
            return Received::Message(FrontInbound::Lost(why));
        }
        if let Some(i) = item {
            return Received::Message(FrontInbound::Client(i));
        }
        match got {
            Some((from, bytes)) => match decode::<Envelope>(from, &bytes) {
                Ok(e) => {
                    self.liveness.heard_from(from);
                    if matches!(e, Envelope::RankEnded(_))
                        && let Some(ended) = self.liveness.ended.get_mut(from)
                    {
                        *ended = true;
                    }
                    Received::Message(FrontInbound::Net(e))
                }
                Err(e) => {
                    tracing::warn!("{e}");
                    Received::TimedOut
                }
            },
            None => Received::TimedOut,
        }
    }
}

/// The front process's result.
#[derive(Debug)]
pub struct FrontReport {
    /// The run's report.
    pub report: Report,
    /// The front lost contact with part of the fleet: the report is out, but this
    /// process must not finalise MPI (that would wait for the lost ranks): print the
    /// report and exit at once, non-zero, so that mpirun ends the job.
    pub abandoned: bool,
}

/// What the front process's client is given: the ends of its channels to the front
/// host, and the run's clock.
pub struct ClientEnds {
    /// To the front host.
    pub to_front: Sender<ClientItem>,
    /// The responses the front passes on; it closes when every server has stopped.
    pub from_front: Receiver<Vec<Response>>,
    /// The run's clock.
    pub clock: WallClock,
}

/// How the front process's side of a run ended.
#[derive(Debug)]
pub struct FrontSide<R> {
    /// How the front host ended.
    pub end: FrontEnd,
    /// What the client returned.
    pub client: R,
    /// The front lost contact with part of the fleet: this process must not finalise
    /// MPI (that would wait for the lost ranks); it must exit at once, non-zero, so
    /// that mpirun ends the job.
    pub abandoned: bool,
}

/// Runs this process's part of the scenario, the workload client playing in the front
/// process. The front process returns the report; the others `None`.
pub fn run_process(
    scenario: &Scenario,
    scenario_text_digest: u64,
    opts: &MpiOptions,
) -> Result<Option<FrontReport>, RuntimeError> {
    let started = Instant::now();
    let fleet = Fleet::plan(scenario, opts.common.seed)?;
    fleet.check_real()?;
    let time_scale = opts.common.time_scale;
    let preload = opts.common.preload;
    let side = run_process_with(&fleet, scenario_text_digest, opts, None, |ends| {
        let client = ClientLoop::new(
            fleet.workload()?,
            fleet.scenario.frontend.costs(),
            ends.to_front,
            ends.from_front,
            ends.clock,
            time_scale,
            preload,
        )?;
        Ok(move || client.run())
    })?;
    let Some(side) = side else {
        return Ok(None);
    };
    Ok(Some(FrontReport {
        report: real_report(&fleet, side.end, side.client?, started, &opts.common),
        abandoned: side.abandoned,
    }))
}

/// Runs this process's part of `fleet`: a server rank, or the front process, where
/// `client` makes what runs in the client's place (on its own thread) — the workload
/// client, or `lockstep serve`'s bridge to HTTP. `status`: where the front keeps the
/// ranks' live status (the ranks then publish it). The front process returns its side;
/// the others `None`.
pub fn run_process_with<R, C, F>(
    fleet: &Fleet<'_>,
    scenario_text_digest: u64,
    opts: &MpiOptions,
    status: Option<StatusBoard>,
    client: F,
) -> Result<Option<FrontSide<R>>, RuntimeError>
where
    R: Send + 'static,
    C: FnOnce() -> R + Send + 'static,
    F: FnOnce(ClientEnds) -> Result<C, RuntimeError>,
{
    if let Some(m) = &opts.common.model {
        m.check(fleet)?;
    }
    let layout = Layout::of(fleet);
    let mut member = MpiMember::init().map_err(RuntimeError::Mpi)?;
    let world_rank = member.world_rank();
    if member.world_size() != layout.world_size() {
        let servers: Vec<String> = fleet
            .servers
            .iter()
            .map(|p| format!("{} dp {}", p.config.name, p.sizes.dp))
            .collect();
        return Err(RuntimeError::WorldSize {
            world_rank,
            world: member.world_size(),
            needed: layout.world_size(),
            layout: servers.join(", "),
        });
    }
    let setup = CollectiveTag {
        iteration: u64::MAX,
        phase: Phase::Gather,
    };
    let digests: Vec<u64> = member
        .allgather(setup, &scenario_text_digest)
        .map_err(RuntimeError::Mpi)?;
    if let Some((other, d)) = digests.iter().enumerate().find(|(_, d)| **d != digests[0]) {
        return Err(RuntimeError::ScenarioMismatch {
            world_rank,
            first: digests[0],
            other,
            digest: *d,
        });
    }
    let at = layout.locate(world_rank);
    let mut member = member
        .split(at.map_or(0, |a| a.server as usize + 1))
        .map_err(RuntimeError::Mpi)?;
    let mut outbox = Outbox::start()?;
    let net = MpiNet {
        layout: layout.clone(),
        outbox: outbox.tx.clone().expect("a started outbox"),
    };
    let publish = status.is_some();
    let result = match at {
        None => run_front(fleet, &net, &layout, opts, status, client).map(Some),
        Some(at) => run_server_rank(fleet, &net, &mut member, at, opts, publish).map(|()| None),
    };
    if let Ok(Some(FrontSide {
        abandoned: true, ..
    })) = &result
    {
        // Neither wait for the outbox (a send to a lost rank may never complete) nor
        // finalise (MPI_Finalize waits for every process).
        std::mem::forget(member);
        return result;
    }
    drop(net);
    outbox.flush();
    // The member goes last: dropping it finalises MPI.
    drop(member);
    result
}

fn run_front<R, C, F>(
    fleet: &Fleet<'_>,
    net: &MpiNet,
    layout: &Layout,
    opts: &MpiOptions,
    status: Option<StatusBoard>,
    client: F,
) -> Result<FrontSide<R>, RuntimeError>
where
    R: Send + 'static,
    C: FnOnce() -> R + Send + 'static,
    F: FnOnce(ClientEnds) -> Result<C, RuntimeError>,
{
    let clock = WallClock::start();
    let (client_tx, client_rx) = unbounded::<ClientItem>();
    let (to_client, from_front) = unbounded::<Vec<Response>>();
    let client = client(ClientEnds {
        to_front: client_tx,
        from_front,
        clock,
    })?;
    // An ordered run: this process holds the sequencer the ranks call.
    let ordered = opts.common.ordered;
    let sequencer = ordered.then(|| {
        let dp: Vec<u32> = fleet.servers.iter().map(|p| p.sizes.dp).collect();
        Sequencer::new(&dp, fleet.scenario.model.control_ns(), opts.watchdog * 2)
    });
    let front_net = sequencer.as_ref().map(|s| OrderedNet::front(s, net));
    let front_net: &dyn Net = match &front_net {
        Some(n) => n,
        None => net,
    };
    let mut host = FrontLoop::new(
        Front::new(&fleet.front_config()),
        fleet.servers.len(),
        fleet.ranks(),
        front_net,
        to_client,
        clock,
    )
    .with_notice_link(fleet.wire_model(if ordered { 1.0 } else { opts.common.time_scale }))
    .with_status(status);
    if opts.common.preload {
        // Every request goes out in the front's first turn: one ingress message per
        // server, which its rank 0's first read takes whole (an ordered run's at 0).
        let items = client_rx.try_iter().map(FrontInbound::Client);
        if ordered {
            host.handle_all_at(0, items);
        } else {
            host.handle_all(items);
        }
    }
    let client_thread = std::thread::Builder::new()
        .name("client".into())
        .spawn(client)
        .map_err(|source| RuntimeError::Spawn {
            what: "the client".into(),
            source,
        })?;
    let names = fleet
        .servers
        .iter()
        .map(|p| p.config.name.clone())
        .collect();
    let mut inbox = FrontInbox {
        peers: MpiPeers::for_this_thread(),
        client: client_rx,
        liveness: Liveness::new(layout, names, opts.watchdog),
    };
    let end = match &sequencer {
        Some(sequencer) => {
            let done = AtomicBool::new(false);
            std::thread::scope(|scope| {
                let (outbox, done) = (net.outbox.clone(), &done);
                scope.spawn(move || serve_order_calls(sequencer, &outbox, done));
                let end = host.run_ordered(sequencer, &mut inbox, opts.watchdog * 2);
                done.store(true, Ordering::Relaxed);
                end
            })
        }
        None => host.run(&mut inbox, opts.watchdog * 2),
    };
    let abandoned = matches!(&end, Ok(e) if e.lost.is_some());
    if !abandoned {
        // Every process may finalise now (or, after a failure, stop waiting). After a
        // loss mpirun ends them: the front exits non-zero.
        for world_rank in FRONT + 1..layout.world_size() {
            let _ = net.outbox.send((world_rank, channel::EXIT, Vec::new()));
        }
    }
    let end = end?;
    let client = client_thread.join().map_err(|_| RuntimeError::Panicked {
        what: "the client".into(),
    })?;
    Ok(FrontSide {
        end,
        client,
        abandoned,
    })
}

fn run_server_rank(
    fleet: &Fleet<'_>,
    net: &MpiNet,
    member: &mut MpiMember,
    at: KvAddress,
    opts: &MpiOptions,
    publish_status: bool,
) -> Result<(), RuntimeError> {
    let s = at.server as usize;
    let p = &fleet.servers[s];
    let rank = at.rank.index();
    let clock = WallClock::start();
    let progress = Arc::new(Progress::default());
    progress.alive(clock.now_ns());
    let finished = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (progress, finished) = (progress.clone(), finished.clone());
        let limit = opts.watchdog;
        let who = format!("server `{}` rank {rank}", p.config.name);
        std::thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || {
                let peers = MpiPeers::for_this_thread();
                watch(
                    &progress,
                    &clock,
                    limit,
                    || {
                        // This process is alive and reachable: the front's liveness
                        // check hears it.
                        peers.send_to(FRONT, channel::ALIVE, &[0u8]);
                        let mut any = false;
                        while peers.try_receive(HEARTBEAT_CHANNEL).is_some() {
                            any = true;
                        }
                        any
                    },
                    || finished.load(Ordering::Relaxed),
                    |why| {
                        eprintln!("lockstep watchdog: {who}: {why} — aborting the job");
                        // The front, if it can hear this, writes the report naming the
                        // ranks lost and ends the job; if it cannot, this process does.
                        peers.send_to(FRONT, channel::STUCK, why.as_bytes());
                        std::thread::sleep(limit / 2);
                        eprintln!(
                            "lockstep watchdog: {who}: the front did not end the job; exiting"
                        );
                        std::process::exit(3);
                    },
                )
            })
            .map_err(|source| RuntimeError::Spawn {
                what: "the watchdog".into(),
                source,
            })?
    };
    let RankParts {
        mut exec,
        transceiver,
        mut device,
        mistag,
        lose,
        wire,
    } = build_rank(fleet, at, &opts.common, "device".into());
    // An ordered run: this process's threads call the front process's sequencer.
    let dp: Vec<u32> = fleet.servers.iter().map(|p| p.sizes.dp).collect();
    let remote_order = |call_tag, answer_tag, alive| RemoteOrder {
        outbox: net.outbox.clone(),
        call_tag,
        answer_tag,
        first_transceiver: first_transceivers(&dp),
        control_ns: fleet.scenario.model.control_ns(),
        alive,
    };
    let ordered = opts.common.ordered;
    let order = ordered.then(|| {
        remote_order(
            channel::ORDER_RANK,
            channel::ORDER_RANK_ANSWER,
            Some((progress.clone(), clock)),
        )
    });
    let transceiver_order = ordered.then(|| {
        remote_order(
            channel::ORDER_TRANSCEIVER,
            channel::ORDER_TRANSCEIVER_ANSWER,
            None,
        )
    });
    let (events_tx, events_rx) = unbounded::<TransferEvent>();
    let (commands_tx, commands_rx) = unbounded::<TransceiverInput>();
    let link = transceiver.is_some().then(|| TransceiverLink {
        commands: commands_tx.clone(),
        events: events_rx,
    });
    let transceiver_thread = match transceiver {
        Some(transceiver) => {
            let layout = net.layout.clone();
            let outbox = net.outbox.clone();
            Some(
                std::thread::Builder::new()
                    .name("transceiver".into())
                    .spawn(move || {
                        let net = MpiNet { layout, outbox };
                        if let Some(order) = transceiver_order {
                            return run_transceiver_ordered(
                                transceiver,
                                &order,
                                &events_tx,
                                &net,
                                lose,
                                wire,
                            )
                            .unwrap_or_else(|e| {
                                tracing::error!("transceiver: {e}");
                                Default::default()
                            });
                        }
                        let mut inbox = TransceiverInbox {
                            peers: MpiPeers::for_this_thread(),
                            commands: commands_rx,
                        };
                        run_transceiver(
                            transceiver,
                            &mut inbox,
                            &net,
                            &events_tx,
                            &clock,
                            lose,
                            wire,
                        )
                    })
                    .map_err(|source| RuntimeError::Spawn {
                        what: "the transceiver".into(),
                        source,
                    })?,
            )
        }
        None => None,
    };
    let mut ingress = (rank == 0).then(|| IngressInbox {
        peers: MpiPeers::for_this_thread(),
        queued: VecDeque::new(),
    });
    let options = rank_options(fleet, s, &opts.common, opts.watchdog / 4, publish_status);
    // An ordered run's responses and end wait in the sequencer for the front's turn.
    let ordered_net = order.as_ref().map(|o| OrderedNet::server(o, s, net));
    let rank_net: &dyn Net = match &ordered_net {
        Some(n) => n,
        None => net,
    };
    let outcome = run_rank(
        &mut exec,
        &mut MisTagged {
            inner: member,
            at: mistag,
        },
        RankPorts {
            server: s,
            ingress: ingress.as_mut().map(|i| i as &mut dyn Inbox<IngressItem>),
            net: rank_net,
            transfers: link.as_ref(),
            device: &mut device,
            clock: &clock,
            progress: &progress,
            ordered: order.as_ref().map(|o| OrderedRank {
                sequencer: o,
                backend: fleet.backend(s),
            }),
        },
        &options,
    );
    drop(device);
    if let Some(l) = &link {
        match &order {
            Some(o) => o.leave(o.transceiver(at)),
            None => l.stop(),
        }
    }
    let end = transceiver_thread
        .and_then(|h| h.join().ok())
        .unwrap_or_default();
    end_rank(rank_net, s, &exec, outcome, end);
    if let Some(o) = &order
        && rank == 0
    {
        // After its server's stop is on its way to the front.
        o.leave(Party::Server(s as u32));
    }
    // Until the front says the run is over, drain what still reaches this process (a
    // late message must not block its sender).
    let peers = MpiPeers::for_this_thread();
    let give_up = Instant::now() + opts.watchdog * 4;
    loop {
        progress.alive(clock.now_ns());
        if peers.try_receive(channel::EXIT).is_some() {
            break;
        }
        if Instant::now() >= give_up {
            tracing::warn!("the front never said the run is over; finalising anyway");
            break;
        }
        let mut drained = false;
        for tag in [channel::KV, channel::INGRESS] {
            while peers.try_receive(tag).is_some() {
                drained = true;
            }
        }
        if !drained {
            std::thread::sleep(PROBE_EVERY * 20);
        }
    }
    finished.store(true, Ordering::Relaxed);
    let _ = watchdog.join();
    Ok(())
}
