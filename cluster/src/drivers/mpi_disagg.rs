//! The `mpi` driver for a disaggregated scenario: one mpirun world holding a front
//! process (world rank 0: the client and the [`Front`]) and one process per rank of every
//! ctx and gen server, in scenario order. Each server's processes run their collectives
//! over their own communicator, split from the world; everything between servers is a
//! point-to-point message over the world: requests from the front to a server's rank 0,
//! gathered responses back, and transceiver messages carrying real KV bytes between ctx
//! and gen ranks, checked block by block on arrival.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::unbounded;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use lockstep_actors::config::ServerConfig;
use lockstep_actors::executor::{
    CollectiveTag, FetchBatch, FetchMode, Phase, RankExecutor, RankResponses, TransferCommand,
    TransferEvent,
};
use lockstep_actors::ids::RankId;
use lockstep_actors::transceiver::{KvAddress, KvCodec, Outgoing, PeerMessage, Transceiver};
use lockstep_gpu::kv_contents;
use lockstep_transport::{Collective, MpiMember, MpiPeers};

use super::DriverError;
use super::client::{Client, IngressItem};
use super::disagg_threads::{
    Front, FrontInput, FrontLinks, KvLoss, PlannedServer, RankEnd, fleet_report, plan,
};
use super::mpi::{MpiOptions, watchdog};
use super::rank_loop::{FrontDoor, LoopOptions, Progress, TransferPort, run_rank_with_transfers};
use super::threads::start_device;
use crate::report::Report;
use crate::scenario::Scenario;
use crate::workload::Workload;

/// The front process's world rank.
const FRONT: usize = 0;

/// Point-to-point channels (MPI tags).
mod channel {
    /// front → a server's rank 0: [`super::ToServer`].
    pub const INGRESS: i32 = 101;
    /// a server rank → front: [`super::ToFront`].
    pub const FRONT: i32 = 102;
    /// transceiver ↔ transceiver, front → transceiver: `PeerMessage`.
    pub const KV: i32 = 103;
}

/// front → a server's rank 0.
#[derive(Debug, Serialize, Deserialize)]
enum ToServer {
    Item(IngressItem),
}

/// a server rank → front.
#[derive(Debug, Serialize, Deserialize)]
enum ToFront {
    /// Gathered by the server's rank 0.
    Responses(Vec<RankResponses>),
    /// The server's rank 0 left its loop.
    Stopped,
    /// A rank's summary for the report, sent when it leaves.
    End(Box<RankEnd>),
    /// A rank failed; the message says why.
    Failed(String),
}

/// Where every rank lives in the world.
struct Layout {
    /// World rank of each server's rank 0.
    first: Vec<usize>,
    dp: Vec<usize>,
}

impl Layout {
    fn of(planned: &[PlannedServer<'_>]) -> Layout {
        let mut first = Vec::with_capacity(planned.len());
        let mut next = FRONT + 1;
        for p in planned {
            first.push(next);
            next += p.sizes.dp as usize;
        }
        Layout {
            first,
            dp: planned.iter().map(|p| p.sizes.dp as usize).collect(),
        }
    }

    fn world_size(&self) -> usize {
        1 + self.dp.iter().sum::<usize>()
    }

    fn world_rank(&self, at: KvAddress) -> usize {
        self.first[at.server as usize] + at.rank.index()
    }

    fn locate(&self, world_rank: usize) -> Option<KvAddress> {
        self.first
            .iter()
            .zip(&self.dp)
            .position(|(&f, &n)| (f..f + n).contains(&world_rank))
            .map(|s| KvAddress {
                server: s as u32,
                rank: RankId((world_rank - self.first[s]) as u32),
            })
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Our own message types always encode.
    bincode::serde::encode_to_vec(value, bincode::config::standard()).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(from: usize, bytes: &[u8]) -> Result<T, DriverError> {
    bincode::serde::decode_from_slice(bytes, bincode::config::standard())
        .map(|(v, _)| v)
        .map_err(|e| DriverError::Invalid(format!("malformed message from world rank {from}: {e}")))
}

/// A server rank 0's front door: requests arrive from the front process; gathered
/// responses go back to it.
struct MpiDoor<'p> {
    peers: &'p MpiPeers,
    server: u32,
    clock: Instant,
    /// Longest wait of a blocking fetch before an empty iteration runs: an idle server
    /// keeps iterating slowly, so its ranks' watchdogs see progress.
    heartbeat: Duration,
}

impl FrontDoor for MpiDoor<'_> {
    fn fetch(&mut self, mode: FetchMode) -> FetchBatch {
        let mut batch = FetchBatch::default();
        let waited = Instant::now();
        loop {
            while let Some((from, bytes)) = self.peers.try_receive(channel::INGRESS) {
                match decode::<ToServer>(from, &bytes) {
                    Ok(ToServer::Item(IngressItem::Request(spec))) => batch.requests.push(spec),
                    Ok(ToServer::Item(IngressItem::Shutdown)) => batch.shutdown = true,
                    Ok(ToServer::Item(IngressItem::PeerReady(id))) => batch.peers_ready.push(id),
                    Err(e) => tracing::warn!("{e}"),
                }
            }
            let got = !batch.requests.is_empty() || batch.shutdown || !batch.peers_ready.is_empty();
            if mode == FetchMode::Poll || got || waited.elapsed() >= self.heartbeat {
                break;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        batch.now_ns = self.clock.elapsed().as_nanos() as u64;
        batch
    }

    fn deliver(&mut self, responses: Vec<RankResponses>) {
        if responses.iter().any(|r| !r.responses.is_empty()) {
            self.peers.send_to(
                FRONT,
                channel::FRONT,
                &encode(&(self.server, ToFront::Responses(responses))),
            );
        }
    }
}

/// One rank's transfers over MPI: its transceiver and its links to the other ranks. A
/// receive pulls from the location its request carries (`RequestSpec::kv_source`, set by
/// the front with the first token).
struct MpiPort<'p> {
    peers: &'p MpiPeers,
    layout: &'p Layout,
    transceiver: Transceiver,
    loss: KvLoss,
    lost: u64,
    clock: Instant,
}

impl MpiPort<'_> {
    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn flush(&mut self) {
        for Outgoing { to, message } in self.transceiver.take_outgoing() {
            if self.loss.drops(&message) {
                self.lost += 1;
                continue;
            }
            self.peers
                .send_to(self.layout.world_rank(to), channel::KV, &encode(&message));
        }
    }
}

impl TransferPort for MpiPort<'_> {
    fn commands(&mut self, commands: &[TransferCommand]) {
        let now = self.now();
        for command in commands {
            self.transceiver.on_command(now, command);
        }
        self.flush();
    }

    fn poll(&mut self) -> Vec<TransferEvent> {
        let now = self.now();
        while let Some((from, bytes)) = self.peers.try_receive(channel::KV) {
            match decode::<PeerMessage>(from, &bytes) {
                Ok(message) => self.transceiver.on_message(now, message),
                Err(e) => tracing::warn!("{e}"),
            }
        }
        self.transceiver.on_tick(now);
        self.flush();
        self.transceiver.take_events()
    }
}

/// The front process's links: messages to the servers' processes.
struct MpiLinks<'p> {
    peers: &'p MpiPeers,
    layout: &'p Layout,
}

impl FrontLinks for MpiLinks<'_> {
    fn submit(&mut self, server: usize, item: IngressItem) -> Result<(), String> {
        self.peers.send_to(
            self.layout.first[server],
            channel::INGRESS,
            &encode(&ToServer::Item(item)),
        );
        Ok(())
    }

    fn to_peer(&mut self, to: KvAddress, message: PeerMessage) {
        self.peers
            .send_to(self.layout.world_rank(to), channel::KV, &encode(&message));
    }
}

/// Runs this process's part of a disaggregated scenario. The front process returns the
/// report; the server ranks `None`.
pub fn run_process(
    scenario: &Scenario,
    scenario_text_digest: u64,
    opts: &MpiOptions,
) -> Result<Option<Report>, DriverError> {
    let started = Instant::now();
    let planned = plan(scenario)?;
    let layout = Layout::of(&planned);
    let mut member =
        MpiMember::init().map_err(|source| DriverError::Collective { rank: 0, source })?;
    let world_rank = member.world_rank();
    if member.world_size() != layout.world_size() {
        let servers: Vec<String> = planned
            .iter()
            .map(|p| format!("{} dp {}", p.config.name, p.sizes.dp))
            .collect();
        return Err(DriverError::Invalid(format!(
            "world rank {world_rank}: MPI world size {} does not match the scenario's {} processes (1 front + {})",
            member.world_size(),
            layout.world_size(),
            servers.join(", ")
        )));
    }
    let setup = CollectiveTag {
        iteration: u64::MAX,
        phase: Phase::Gather,
    };
    let digests: Vec<u64> = member
        .allgather(setup, &scenario_text_digest)
        .map_err(|source| DriverError::Collective {
            rank: world_rank,
            source,
        })?;
    if let Some((other, d)) = digests.iter().enumerate().find(|(_, d)| **d != digests[0]) {
        return Err(DriverError::Invalid(format!(
            "world rank {world_rank}: processes disagree on the scenario: world rank 0 has digest {:016x}, world rank {other} has {d:016x}",
            digests[0]
        )));
    }
    let peers = member.peers();
    let at = layout.locate(world_rank);
    let mut member = member
        .split(at.map_or(0, |a| a.server as usize + 1))
        .map_err(|source| DriverError::Collective {
            rank: world_rank,
            source,
        })?;
    let result = match at {
        None => run_front(scenario, &planned, &layout, &peers, opts, started).map(Some),
        Some(at) => {
            let outcome =
                run_server_rank(scenario, &planned, &layout, &peers, &mut member, at, opts);
            if let Err(e) = &outcome {
                peers.send_to(
                    FRONT,
                    channel::FRONT,
                    &encode(&(at.server, ToFront::Failed(e.to_string()))),
                );
            }
            outcome.map(|()| None)
        }
    };
    // The handle goes before the member: dropping the member finalises MPI.
    drop(peers);
    drop(member);
    result
}

fn run_server_rank(
    scenario: &Scenario,
    planned: &[PlannedServer<'_>],
    layout: &Layout,
    peers: &MpiPeers,
    member: &mut MpiMember,
    at: KvAddress,
    opts: &MpiOptions,
) -> Result<(), DriverError> {
    let p = &planned[at.server as usize];
    let rank = at.rank.index();
    let profile = scenario.model.resolve().map_err(DriverError::Invalid)?;
    let codec = KvCodec {
        block_bytes: kv_contents::block_bytes(
            profile.kv.bytes_per_token(),
            p.sizes.tokens_per_block,
        ),
        fill: kv_contents::fill_block,
        checksum: kv_contents::checksum,
    };
    let timeout_ms = p
        .config
        .cache_transceiver_config
        .kv_transfer_timeout_ms
        .max(1) as u64;
    let progress = Arc::new(Progress::default());
    watchdog(layout.world_rank(at), progress.clone(), opts.watchdog);
    let clock = Instant::now();
    let exec = RankExecutor::new(at.rank, p.config, &p.sizes, scenario.policy);
    let device = start_device(
        rank,
        profile.coefficients,
        opts.common.time_scale,
        opts.watchdog,
    );
    let mut door = (rank == 0).then(|| MpiDoor {
        peers,
        server: at.server,
        clock,
        heartbeat: opts.watchdog / 4,
    });
    let mut port = MpiPort {
        peers,
        layout,
        transceiver: Transceiver::new(at, timeout_ms, codec),
        loss: KvLoss {
            every: opts
                .common
                .lose_kv_blocks_every
                .or(scenario.faults.lost_transfer_every),
            sent: AtomicU64::new(0),
        },
        lost: 0,
        clock,
    };
    let run = run_rank_with_transfers(
        exec,
        member,
        door.as_mut().map(|d| d as &mut dyn FrontDoor),
        Some(&mut port),
        &device,
        &progress,
        &LoopOptions::default(),
    )?;
    let end = RankEnd::of(run, port.transceiver.stats().clone(), port.lost);
    // In order on one channel: the last responses, then `Stopped`, then the summary.
    if door.is_some() {
        peers.send_to(
            FRONT,
            channel::FRONT,
            &encode(&(at.server, ToFront::Stopped)),
        );
    }
    peers.send_to(
        FRONT,
        channel::FRONT,
        &encode(&(at.server, ToFront::End(Box::new(end)))),
    );
    progress.iteration.store(u64::MAX, Ordering::Relaxed);
    Ok(())
}

fn run_front(
    scenario: &Scenario,
    planned: &[PlannedServer<'_>],
    layout: &Layout,
    peers: &MpiPeers,
    opts: &MpiOptions,
    started: Instant,
) -> Result<Report, DriverError> {
    let seed = scenario.seed.unwrap_or(opts.common.seed);
    let wl_cfg = scenario
        .workload
        .as_ref()
        .ok_or_else(|| DriverError::Invalid("scenario has no [workload] section".into()))?;
    let workload = Workload::new(
        wl_cfg,
        planned[0].sizes.tokens_per_block,
        seed,
        &scenario.base_dir,
    )
    .map_err(|e| DriverError::Invalid(e.to_string()))?;
    let client_ingress = lockstep_transport::IngressQueue::new(opts.common.ingress_capacity);
    let (client_tx, client_rx) = unbounded::<Vec<RankResponses>>();
    let client = Client::new(
        workload,
        client_ingress.clone(),
        client_rx,
        opts.common.time_scale,
        opts.common.preload,
    )?;
    let configs: Vec<&ServerConfig> = planned.iter().map(|p| p.config).collect();
    let mut front = Front::new(
        scenario.front.policy,
        &configs,
        MpiLinks { peers, layout },
        client_tx,
    );
    let client_thread = std::thread::Builder::new()
        .name("client".into())
        .spawn(move || client.run())
        .map_err(|e| DriverError::Invalid(format!("spawning the client: {e}")))?;

    // Until every server has stopped: client items in, responses out, handoffs between.
    let ranks = layout.dp.iter().sum::<usize>();
    let mut ends: Vec<Vec<RankEnd>> = planned.iter().map(|_| Vec::new()).collect();
    let mut received_ends = 0;
    let mut failure = None;
    let mut running = true;
    let mut last_message = Instant::now();
    while running || received_ends < ranks {
        let mut busy = false;
        if running {
            for item in client_ingress.drain_now() {
                busy = true;
                running = front.handle(FrontInput::Client(item));
            }
        }
        while let Some((from, bytes)) = peers.try_receive(channel::FRONT) {
            busy = true;
            let (server, message) = decode::<(u32, ToFront)>(from, &bytes)?;
            let server = server as usize;
            match message {
                ToFront::Responses(responses) => {
                    running = front.handle(FrontInput::Responses { server, responses });
                }
                ToFront::Stopped => running = front.handle(FrontInput::ServerStopped(server)),
                ToFront::End(end) => {
                    ends[server].push(*end);
                    received_ends += 1;
                }
                ToFront::Failed(why) => {
                    failure.get_or_insert(DriverError::Invalid(format!(
                        "server `{}`: {why}",
                        planned[server].config.name
                    )));
                    received_ends += 1;
                }
            }
        }
        if busy {
            last_message = Instant::now();
        } else if last_message.elapsed() > opts.watchdog * 2 {
            return Err(DriverError::Invalid(format!(
                "front: no message from any server for {} ms ({received_ends} of {ranks} ranks reported their end)",
                (opts.watchdog * 2).as_millis()
            )));
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    // Dropping the front closes the client's response channel: the client ends.
    drop(front);
    client_ingress.close();
    let result = client_thread
        .join()
        .map_err(|_| DriverError::Invalid("client thread panicked".into()))??;
    if let Some(e) = failure {
        return Err(e);
    }
    for end in &mut ends {
        end.sort_by_key(|e| e.summary.rank);
    }
    Ok(fleet_report(scenario, seed, planned, ends, result, started))
}
