//! The `threads` backend: the runtime's hosts on OS threads of one process — a rank host
//! per rank of every server (each server its own in-process collective group), a
//! transceiver host per rank of a ctx or gen server, the front host on its own thread,
//! and the client
//! on the caller's. [`Net`] is channels: crossbeam channels to the front and the
//! transceivers, and each server's bounded [`IngressQueue`].

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, select, unbounded};

use lockstep_actors::front::Front;
use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::TransceiverIn;
use lockstep_actors::vocab::{KvAddress, Response, TransferEvent};
use lockstep_transport::{InProcessGroup, IngressError, IngressQueue};

use super::{RealOptions, real_report};
use crate::client::{ClientItem, ClientLoop};
use crate::faults::MisTagged;
use crate::front_host::{FrontEnd, FrontInbound, FrontLoop};
use crate::ordered::{OrderedNet, Sequencer};
use crate::rank_host::{OrderedRank, RankOptions, RankPorts, run_rank};
use crate::rank_setup::{RankParts, build_rank, end_rank, rank_options};
use crate::status::StatusBoard;
use crate::transceiver_host::{
    TransceiverInput, TransceiverLink, run_transceiver, run_transceiver_ordered,
};
use crate::watchdog::Progress;
use crate::{
    Endpoint, Envelope, Inbox, Net, NetError, QueueInbox, Received, RuntimeError, WallClock,
};
use lockstep_hosts::order::Party;
use lockstep_plan::fleet::Fleet;
use lockstep_plan::report::Report;
use lockstep_plan::scenario::Scenario;

/// The channels between the hosts of one process.
struct ThreadNet {
    front: Sender<Envelope>,
    ingress: Vec<IngressQueue<IngressItem>>,
    /// `[server][rank]`.
    transceivers: Vec<Vec<Option<Sender<TransceiverInput>>>>,
}

impl Net for ThreadNet {
    fn send(&self, to: Endpoint, envelope: Envelope) -> Result<(), NetError> {
        let closed = || NetError::Closed { endpoint: to };
        match (to, envelope) {
            (Endpoint::Front, e) => self.front.send(e).map_err(|_| closed()),
            (Endpoint::Ingress(s), Envelope::Ingress(items)) => {
                let queue = self
                    .ingress
                    .get(s)
                    .ok_or(NetError::Unknown { endpoint: to })?;
                // Requests are bounded by the queue (a flood is refused at the door);
                // control items always get through while the server runs.
                let pushed = if items.iter().any(|i| matches!(i, IngressItem::Request(_))) {
                    queue.push_all(items)
                } else {
                    queue.push_all_unbounded(items)
                };
                pushed.map_err(|e| match e {
                    IngressError::Full { capacity } => NetError::Full {
                        endpoint: to,
                        capacity,
                    },
                    IngressError::Closed => closed(),
                })
            }
            (Endpoint::Transceiver(at), Envelope::Peer(message)) => {
                let tx = self
                    .transceivers
                    .get(at.server as usize)
                    .and_then(|s| s.get(at.rank.index()))
                    .and_then(Option::as_ref)
                    .ok_or(NetError::Unknown { endpoint: to })?;
                tx.send(TransceiverInput::In(TransceiverIn::Message(message)))
                    .map_err(|_| closed())
            }
            (Endpoint::Ingress(_) | Endpoint::Transceiver(_), _) => {
                Err(NetError::Unknown { endpoint: to })
            }
        }
    }
}

/// A channel, as a host's inbox.
struct ChannelInbox<T>(Receiver<T>);

impl<T> Inbox<T> for ChannelInbox<T> {
    fn recv_until(&mut self, deadline: Option<Instant>) -> Received<T> {
        let got = match deadline {
            Some(d) => self.0.recv_deadline(d),
            None => self.0.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match got {
            Ok(m) => Received::Message(m),
            Err(RecvTimeoutError::Timeout) => Received::TimedOut,
            Err(RecvTimeoutError::Disconnected) => Received::Closed,
        }
    }
}

/// The front's inbox: the client's items and the servers' messages, whichever comes
/// first.
struct FrontInbox {
    client: Receiver<ClientItem>,
    client_open: bool,
    net: Receiver<Envelope>,
}

impl Inbox<FrontInbound> for FrontInbox {
    fn recv_until(&mut self, deadline: Option<Instant>) -> Received<FrontInbound> {
        let timeout = deadline.map_or(Duration::from_secs(365 * 24 * 3600), |d| {
            d.saturating_duration_since(Instant::now())
        });
        loop {
            if !self.client_open {
                return match self.net.recv_timeout(timeout) {
                    Ok(e) => Received::Message(FrontInbound::Net(e)),
                    Err(RecvTimeoutError::Timeout) => Received::TimedOut,
                    Err(RecvTimeoutError::Disconnected) => Received::Closed,
                };
            }
            select! {
                recv(self.client) -> m => match m {
                    Ok(item) => return Received::Message(FrontInbound::Client(item)),
                    Err(_) => self.client_open = false,
                },
                recv(self.net) -> m => return match m {
                    Ok(e) => Received::Message(FrontInbound::Net(e)),
                    Err(_) => Received::Closed,
                },
                default(timeout) => return Received::TimedOut,
            }
        }
    }
}

/// Runs the scenario with one thread per rank (and per transceiver, and the front).
pub fn run(scenario: &Scenario, opts: &RealOptions) -> Result<Report, RuntimeError> {
    let started = Instant::now();
    let fleet = plan(scenario, opts)?;
    let workload = fleet.workload()?;
    if let Some(m) = &opts.model {
        m.check_workload(&workload)?;
    }
    let clock = WallClock::start();
    let (client_tx, client_rx) = unbounded::<ClientItem>();
    let (to_client, from_front) = unbounded::<Vec<Response>>();
    let client = ClientLoop::new(
        workload,
        scenario.frontend.costs(),
        client_tx,
        from_front,
        clock,
        opts.time_scale,
        opts.preload,
    )?;
    let (end, client_result) = run_hosts(
        opts,
        &fleet,
        clock,
        ClientPorts {
            from_client: client_rx,
            to_client,
            status: None,
        },
        move || client.run(),
    )?;
    Ok(real_report(&fleet, end, client_result?, started, opts))
}

/// The scenario's fleet, checked for the real drivers (its warnings logged).
pub fn plan<'a>(scenario: &'a Scenario, opts: &RealOptions) -> Result<Fleet<'a>, RuntimeError> {
    let fleet = Fleet::plan(scenario, opts.seed)?;
    fleet.check_real()?;
    if let Some(m) = &opts.model {
        m.check(&fleet)?;
    }
    for p in &fleet.servers {
        if let Some(w) = &p.warning {
            // Info, not warn: the command line says it as a note under the report.
            tracing::info!(server = %p.config.name, "{w}");
        }
    }
    Ok(fleet)
}

/// The front host's ends of the channels to whatever plays the client: the workload
/// [`Client`] of `lockstep run`, or `lockstep serve`'s bridge to HTTP handlers.
pub struct ClientPorts {
    /// What the client sends the front (requests, cancels, its shutdown).
    pub from_client: Receiver<ClientItem>,
    /// The responses the front passes on; it closes when every server has stopped.
    pub to_client: Sender<Vec<Response>>,
    /// Where the ranks' live status goes (`lockstep serve`'s `/metrics`); `None`: the
    /// ranks publish none.
    pub status: Option<StatusBoard>,
}

/// Starts the front host and every server's rank (and transceiver) threads, runs
/// `client` on the caller's thread, and returns how the front ended (every rank's summary,
/// or the loss of the fleet) with what `client` returned once every server has stopped. Items already in `ports.from_client` reach
/// the servers before any rank runs when `opts.preload` is set.
pub fn run_hosts<R>(
    opts: &RealOptions,
    fleet: &Fleet,
    clock: WallClock,
    ports: ClientPorts,
    client: impl FnOnce() -> R,
) -> Result<(FrontEnd, R), RuntimeError> {
    let ClientPorts {
        from_client: client_rx,
        to_client,
        status,
    } = ports;
    let (front_tx, front_rx) = unbounded::<Envelope>();
    let ingress: Vec<IngressQueue<IngressItem>> = fleet
        .servers
        .iter()
        .map(|_| IngressQueue::new(opts.ingress_capacity))
        .collect();
    let mut inboxes: Vec<Vec<Option<Receiver<TransceiverInput>>>> = Vec::new();
    let mut transceivers = Vec::new();
    for p in &fleet.servers {
        let moves_kv = p.config.role != lockstep_actors::config::Role::Agg;
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..p.sizes.dp)
            .map(|_| {
                if moves_kv {
                    let (tx, rx) = unbounded();
                    (Some(tx), Some(rx))
                } else {
                    (None, None)
                }
            })
            .unzip();
        transceivers.push(senders);
        inboxes.push(receivers);
    }
    let net = ThreadNet {
        front: front_tx,
        ingress: ingress.clone(),
        transceivers,
    };
    let rank_options: Vec<_> = (0..fleet.servers.len())
        .map(|s| {
            rank_options(
                fleet,
                s,
                opts,
                opts.collective_timeout / 4,
                status.is_some(),
            )
        })
        .collect();
    let quiet_limit = opts.collective_timeout.max(opts.stall_bound) * 2;
    // An ordered run: the hosts take turns in the simulator's order, in modeled time.
    let sequencer = opts.ordered.then(|| {
        let dp: Vec<u32> = fleet.servers.iter().map(|p| p.sizes.dp).collect();
        Sequencer::new(&dp, fleet.scenario.model.control_ns(), quiet_limit)
    });
    let sequencer = sequencer.as_ref();
    let front_net = sequencer.map(|s| OrderedNet::front(s, &net));
    let front_net: &dyn Net = match &front_net {
        Some(n) => n,
        None => &net,
    };
    let wire_scale = if opts.ordered { 1.0 } else { opts.time_scale };

    let (end, client_result) = std::thread::scope(|scope| {
        let mut front = FrontLoop::new(
            Front::new(&fleet.front_config()),
            fleet.servers.len(),
            fleet.ranks(),
            front_net,
            to_client,
            clock,
        )
        .with_notice_link(fleet.wire_model(wire_scale))
        .with_status(status);
        if opts.preload {
            // Every request reaches the servers' ingress before any rank runs: the first
            // fetch sees them all, as in the other drivers (an ordered run's at time 0).
            let items = client_rx.try_iter().map(FrontInbound::Client);
            match sequencer {
                Some(_) => front.handle_all_at(0, items),
                None => front.handle_all(items),
            }
        }
        let mut front_inbox = FrontInbox {
            client: client_rx,
            client_open: true,
            net: front_rx,
        };
        let front_thread = std::thread::Builder::new()
            .name("front".into())
            .spawn_scoped(scope, move || match sequencer {
                Some(s) => front.run_ordered(s, &mut front_inbox, quiet_limit),
                None => front.run(&mut front_inbox, quiet_limit),
            })
            .map_err(|source| RuntimeError::Spawn {
                what: "the front".into(),
                source,
            })?;
        for (s, p) in fleet.servers.iter().enumerate() {
            let members = InProcessGroup::new(p.sizes.dp as usize, opts.collective_timeout);
            for (r, member) in members.into_iter().enumerate() {
                let me = KvAddress {
                    server: s as u32,
                    rank: lockstep_actors::ids::RankId(r as u32),
                };
                let parts = build_rank(fleet, me, opts, format!("{}-device-{r}", p.config.name));
                let transceiver = inboxes[s][r].take().map(|inbox| {
                    (
                        inbox,
                        net.transceivers[s][r].clone().expect("a sender per inbox"),
                    )
                });
                let ingress = (r == 0).then(|| QueueInbox(ingress[s].clone()));
                let net = &net;
                let rank_options = &rank_options[s];
                let backend = fleet.backend(s);
                std::thread::Builder::new()
                    .name(format!("{}-rank-{r}", p.config.name))
                    .spawn_scoped(scope, move || {
                        rank_thread(RankThread {
                            server: s,
                            parts,
                            member,
                            ingress,
                            transceiver,
                            net,
                            clock,
                            options: rank_options,
                            scope,
                            ordered: sequencer.map(|sequencer| OrderedRank { sequencer, backend }),
                        })
                    })
                    .map_err(|source| RuntimeError::Spawn {
                        what: format!("{} rank {r}", p.config.name),
                        source,
                    })?;
            }
        }
        let client_result = client();
        // Normally every server has stopped already; after a client error this lets
        // the servers drain and stop instead of waiting forever.
        for q in &ingress {
            q.close();
        }
        let end = front_thread.join().map_err(|_| RuntimeError::Panicked {
            what: "the front".into(),
        })??;
        Ok::<_, RuntimeError>((end, client_result))
    })?;
    Ok((end, client_result))
}

/// Everything one rank's thread owns.
struct RankThread<'scope, 'env> {
    server: usize,
    parts: RankParts,
    member: lockstep_transport::InProcessMember,
    ingress: Option<QueueInbox<IngressItem>>,
    /// A ctx or gen rank's transceiver inbox, and the sender into it.
    transceiver: Option<(Receiver<TransceiverInput>, Sender<TransceiverInput>)>,
    net: &'scope ThreadNet,
    clock: WallClock,
    options: &'scope RankOptions,
    scope: &'scope std::thread::Scope<'scope, 'env>,
    /// An ordered run's turns.
    ordered: Option<OrderedRank<'scope>>,
}

/// One rank: its transceiver thread, its device, its loop; at the end its summary to
/// the front (rank 0 first says the server stopped), whatever happened.
fn rank_thread(t: RankThread<'_, '_>) {
    let RankThread {
        server,
        parts,
        mut member,
        mut ingress,
        transceiver,
        net,
        clock,
        options,
        scope,
        ordered,
    } = t;
    let RankParts {
        mut exec,
        transceiver: actor,
        mut device,
        mistag,
        lose,
        wire,
    } = parts;
    let rank = exec.rank();
    let (events_tx, events_rx) = unbounded::<TransferEvent>();
    let mut link = None;
    let mut transceiver_thread = None;
    if let (Some(transceiver), Some((inbox, commands))) = (actor, transceiver) {
        link = Some(TransceiverLink {
            commands,
            events: events_rx,
        });
        let spawned = std::thread::Builder::new()
            .name(format!("transceiver-{server}-{rank}"))
            .spawn_scoped(scope, move || match ordered {
                Some(o) => {
                    run_transceiver_ordered(transceiver, o.sequencer, &events_tx, net, lose, wire)
                        .unwrap_or_else(|e| {
                            tracing::error!(server, %rank, "transceiver: {e}");
                            Default::default()
                        })
                }
                None => run_transceiver(
                    transceiver,
                    &mut ChannelInbox(inbox),
                    net,
                    &events_tx,
                    &clock,
                    lose,
                    wire,
                ),
            });
        match spawned {
            Ok(h) => transceiver_thread = Some(h),
            Err(e) => tracing::error!(server, %rank, "starting the transceiver: {e}"),
        }
    }
    let progress = Progress::default();
    // An ordered run's responses and end wait in the sequencer for the front's turn.
    let ordered_net = ordered.map(|o| OrderedNet::server(o.sequencer, server, net));
    let rank_net: &dyn Net = match &ordered_net {
        Some(n) => n,
        None => net,
    };
    let ports = RankPorts {
        server,
        ingress: ingress.as_mut().map(|i| i as &mut dyn Inbox<IngressItem>),
        net: rank_net,
        transfers: link.as_ref(),
        device: &mut device,
        clock: &clock,
        progress: &progress,
        ordered,
    };
    let mut coll = MisTagged {
        inner: &mut member,
        at: mistag,
    };
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_rank(&mut exec, &mut coll, ports, options)
    }))
    .unwrap_or_else(|_| {
        Err(RuntimeError::Panicked {
            what: format!("server {server} rank {rank}"),
        })
    });
    // Leaving the group wakes any peer still waiting in a collective.
    drop(member);
    if let Some(i) = &ingress {
        // Later submissions fail at once instead of waiting in a queue nobody reads.
        i.0.close();
    }
    if let Some(l) = &link {
        match ordered {
            Some(o) => o.sequencer.leave(o.sequencer.transceiver(KvAddress {
                server: server as u32,
                rank,
            })),
            None => l.stop(),
        }
    }
    let end = transceiver_thread
        .and_then(|h| h.join().ok())
        .unwrap_or_default();
    end_rank(rank_net, server, &exec, outcome, end);
    if let Some(o) = ordered
        && rank.0 == 0
    {
        // After its server's stop is on its way to the front.
        o.sequencer.leave(Party::Server(server as u32));
    }
}
