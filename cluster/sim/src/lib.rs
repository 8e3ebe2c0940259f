//! The deterministic simulator: every actor of a scenario — the front, every rank of
//! every server (stepped through the iteration protocol in lockstep, collectives
//! computed in place), every rank's transceiver, the device time model — on one virtual
//! clock, in one thread, over a simulated network ([`net`]: per-link latency and
//! bandwidth, loss by request). Same seed and input → identical report (but for
//! `wall_time_s`).
//!
//! Events are ordered by time and, within an instant, by phase (`lockstep_hosts::order`), then by the
//! participant they belong to, then as they were scheduled: the rule the real drivers'
//! ordered mode follows too, so it can reproduce a run. A server runs its protocol until
//! it needs time to pass (its iteration's process point) or an input (its rank 0 waits:
//! idle, or stalled because its last iteration changed nothing); an input wakes it. A
//! bounded stall that lasts past the stall bound ends the server's work as deadlocked,
//! by the same rule the real drivers apply; if no event at all is left while work
//! remains, every waiting server is stalled out at once. A violation that would crash
//! the real executor ends the run as `crashed`.

#![forbid(unsafe_code)]

mod coast;
mod iterlog;
mod net;
mod server;

use std::collections::{BTreeMap, BinaryHeap};
use std::io::Write;
use std::time::Instant;

use lockstep_actors::executor::RankResponses;
use lockstep_actors::front::Front;
use lockstep_actors::group::{DeterministicTokens, TokenSource};
use lockstep_actors::ids::RankId;
use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::TransceiverIn;
use lockstep_actors::vocab::KvAddress;
use lockstep_gpu::AnalyticBackend;
use lockstep_hosts::client::Client;
use lockstep_hosts::front_host::{FrontHost, FrontInbound};
use lockstep_hosts::net::{Endpoint, Envelope};
use lockstep_hosts::order::{Phase, arrives_after};
use lockstep_hosts::transceiver_host::TransceiverHost;

use lockstep_plan::fleet::{Fleet, PlanError};
use lockstep_plan::report::{ClientLog, Outcome, Report, assemble_report, run_outcome};
use lockstep_plan::scenario::Scenario;

pub use iterlog::IterLogLine;
use lockstep_hosts::net::Outbox;
use net::SimNet;
use server::{ServerState, SimServer, Step};

/// A simulation that could not start or could not go on (bad input, a broken log file,
/// a protocol bug). Results, including crashes and deadlocks, are reports.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The scenario cannot run.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A server's configuration is invalid.
    #[error(transparent)]
    Config(#[from] lockstep_actors::config::ConfigError),
    /// `--preload` with a workload that cannot be delivered up front.
    #[error("--preload delivers every request before the first iteration, but {0}")]
    NotPreloadable(String),
    /// Writing the iteration log failed.
    #[error("iteration log: {0}")]
    IterLog(#[from] std::io::Error),
    /// The ranks of a server disagreed about the protocol (a bug, reported).
    #[error("server `{server}`: {source}")]
    Protocol {
        /// The server.
        server: String,
        /// What went wrong.
        source: lockstep_actors::group::GroupError,
    },
    /// `--model` cannot run this scenario.
    #[error(transparent)]
    Model(#[from] lockstep_plan::model_backend::ModelBackendError),
}

/// Options of one run.
pub struct SimOptions<'a> {
    /// Seed (a seed in the scenario wins).
    pub seed: u64,
    /// Where to write one JSON line per server iteration and rank.
    pub iter_log: Option<&'a mut dyn Write>,
    /// Called with (completed + failed, total if known) as the run goes.
    pub progress: Option<&'a mut dyn FnMut(u64, Option<u64>)>,
    /// Deliver every request, and the client's shutdown, before the first iteration.
    pub preload: bool,
    /// A server whose iterations change nothing while work remains and nothing is in
    /// flight for this long (virtual) is deadlocked.
    pub stall_bound_ns: u64,
    /// A real model samples the tokens (time still comes from the cost model).
    pub model: Option<lockstep_plan::model_backend::ModelBackend>,
    /// Coast through steady decode (`coast.rs`): the same report, sooner. Off: every
    /// iteration runs the whole protocol (`--no-skip`).
    pub skip: bool,
}

impl Default for SimOptions<'_> {
    fn default() -> Self {
        SimOptions {
            seed: 0,
            iter_log: None,
            progress: None,
            preload: false,
            stall_bound_ns: 10_000_000_000,
            model: None,
            skip: true,
        }
    }
}

/// An event's place in the queue: time, phase, participant, then insertion order.
type EventKey = (u64, Phase, u32, u64);

/// Something that happens at a virtual time.
#[derive(Debug)]
enum Event {
    /// A server's iteration reaches its process point.
    Process(usize),
    /// A coasting server's last coasted iteration reaches its process point: its
    /// responses leave, and the server goes on.
    Coasted(usize),
    /// A waiting server's stall bound passes.
    StallBound { server: usize },
    /// A waiting server got an input this instant: its read ends after every delivery
    /// of the instant.
    Resume { server: usize },
    /// A transceiver's deadline.
    TransceiverTimer { server: usize, rank: usize },
    /// The front host's deadline: generation-first notices leave the link.
    FrontTimer,
    /// Items reach a server's ingress.
    Ingress {
        server: usize,
        items: Vec<IngressItem>,
    },
    /// A server's message reaches the front (responses with a control latency; without
    /// one they go at once).
    ToFront(Envelope),
}

/// Iterations of the whole fleet with no response at all before the run is declared
/// deadlocked (a livelock guard; real progress emits responses far more often).
const LIVELOCK_ITERATIONS: u64 = 2_000_000;

struct Sim<'s, 'o> {
    fleet: Fleet<'s>,
    /// The front host's timer: when, and its event.
    front_timer: Option<(u64, u64)>,
    now: u64,
    seq: u64,
    queue: BinaryHeap<std::cmp::Reverse<EventKey>>,
    events: BTreeMap<u64, Event>,
    servers: Vec<SimServer>,
    /// Each server's first transceiver's place among all of them.
    first_transceiver: Vec<u32>,
    /// The front's host and the client: the same hosts the real drivers run.
    front: FrontHost,
    client: Client,
    /// What the hosts sent, until it becomes events.
    outbox: Outbox,
    net: SimNet,
    /// Each server's cost model.
    backends: Vec<AnalyticBackend>,
    outcome: Option<(Outcome, String)>,
    iterations_without_response: u64,
    /// Coasting (`coast.rs`): windows, and the iterations coasted in them.
    coasted: (u64, u64),
    /// Coasted iterations applied in closed form.
    closed_form: u64,
    opts: SimOptions<'o>,
}

/// What coasting through steady decode did in a run (`coast.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Coasting {
    /// Stretches coasted.
    pub windows: u64,
    /// Server iterations coasted in them (of every server's).
    pub iterations: u64,
    /// Of those, the ones applied in closed form (`executor::stretch`), not one by one.
    pub closed_form: u64,
}

/// Runs a scenario to the end and reports.
pub fn run(scenario: &Scenario, opts: SimOptions<'_>) -> Result<Report, SimError> {
    run_counting(scenario, opts).map(|(report, _)| report)
}

/// [`run`], with what coasting did.
pub fn run_counting(
    scenario: &Scenario,
    opts: SimOptions<'_>,
) -> Result<(Report, Coasting), SimError> {
    let started = Instant::now();
    let fleet = Fleet::plan(scenario, opts.seed)?;
    if let Some(m) = &opts.model {
        m.check(&fleet)?;
    }
    let workload = fleet.workload()?;
    if let Some(m) = &opts.model {
        m.check_workload(&workload)?;
    }
    let mut servers = Vec::with_capacity(fleet.servers.len());
    for (s, p) in fleet.servers.iter().enumerate() {
        if let Some(w) = &p.warning {
            // Info, not warn: the command line says it as a note under the report.
            tracing::info!(server = %p.config.name, "{w}");
        }
        let (tokens, mut model_codecs): (Box<dyn TokenSource>, _) = match &opts.model {
            Some(m) => m.sim_server(p),
            None => (Box::new(DeterministicTokens), Vec::new()),
        };
        let mut server = SimServer::new(p, scenario.policy, tokens)?;
        server.log_enabled = opts.iter_log.is_some();
        server.host = lockstep_hosts::rank_host::RankHost::new(opts.stall_bound_ns, 1.0);
        if p.config.role != lockstep_actors::config::Role::Agg {
            // With a model the ranks move its K/V; otherwise only sizes.
            let mut model_codecs = model_codecs.drain(..);
            for r in 0..p.sizes.dp {
                let me = KvAddress {
                    server: s as u32,
                    rank: RankId(r),
                };
                let codec = model_codecs.next().unwrap_or_else(|| fleet.modeled_codec());
                // The wire's time, as the real drivers model it (at scale 1).
                let mut host = TransceiverHost::new(
                    p.transceiver(me, codec),
                    scenario.faults.lost_transfer_every,
                    fleet.wire_model(1.0),
                );
                if scenario.faults.timeouts_lost {
                    host = host.without_timeouts();
                }
                server.transceivers[r as usize] = Some((host, None));
            }
        }
        servers.push(server);
    }
    let mut sim = Sim {
        // Generation-first notices on the link as the real drivers time them (at scale 1).
        front: FrontHost::new(
            Front::new(&fleet.front_config()),
            fleet.servers.len(),
            fleet.ranks(),
        )
        .with_notice_link(fleet.wire_model(1.0)),
        front_timer: None,
        // The serving front door in virtual time (scale 1).
        client: Client::new(
            workload,
            lockstep_hosts::frontend::Frontend::new(scenario.frontend.costs(), 1.0),
        ),
        outbox: Outbox::default(),
        net: SimNet::new(&scenario.model),
        backends: (0..fleet.servers.len()).map(|s| fleet.backend(s)).collect(),
        fleet,
        now: 0,
        seq: 0,
        queue: BinaryHeap::new(),
        events: BTreeMap::new(),
        first_transceiver: lockstep_hosts::order::first_transceivers(
            &servers
                .iter()
                .map(|s| s.transceivers.len() as u32)
                .collect::<Vec<_>>(),
        ),
        servers,
        outcome: None,
        iterations_without_response: 0,
        coasted: (0, 0),
        closed_form: 0,
        opts,
    };
    if sim.opts.preload {
        let items = sim
            .client
            .preload()
            .map_err(|e| SimError::NotPreloadable(e.0))?;
        sim.front_handles(items.into_iter().map(FrontInbound::Client));
    }
    sim.run_loop()?;
    let coasting = Coasting {
        windows: sim.coasted.0,
        iterations: sim.coasted.1,
        closed_form: sim.closed_form,
    };
    tracing::debug!(?coasting, "coasted through steady decode");
    Ok((sim.report(started.elapsed().as_secs_f64()), coasting))
}

impl Sim<'_, '_> {
    fn push(&mut self, at: u64, e: Event) -> u64 {
        self.seq += 1;
        let (phase, who) = self.place(&e);
        self.queue
            .push(std::cmp::Reverse((at, phase, who, self.seq)));
        self.events.insert(self.seq, e);
        self.seq
    }

    /// An event's phase and participant within its instant ([`Phase`]).
    fn place(&self, e: &Event) -> (Phase, u32) {
        match e {
            Event::Process(s) | Event::Coasted(s) => (Phase::Process, *s as u32),
            Event::ToFront(
                Envelope::Responses { server, .. } | Envelope::ServerStopped { server },
            ) => (Phase::Front, *server),
            Event::ToFront(_) | Event::FrontTimer => (Phase::Front, u32::MAX),
            Event::TransceiverTimer { server, rank } => {
                (Phase::Transceiver, self.transceiver_index(*server, *rank))
            }
            Event::Ingress { server, .. } => (Phase::Delivery, *server as u32),
            Event::StallBound { server } | Event::Resume { server } => {
                (Phase::Resume, *server as u32)
            }
        }
    }

    /// A transceiver's place among all of them: by server, then by rank.
    fn transceiver_index(&self, server: usize, rank: usize) -> u32 {
        let at = KvAddress {
            server: server as u32,
            rank: RankId(rank as u32),
        };
        lockstep_hosts::order::transceiver_place(&self.first_transceiver, at)
    }

    /// Cancels a scheduled event (its queue entry is skipped, and moves no clock).
    fn cancel(&mut self, seq: u64) {
        self.events.remove(&seq);
    }

    /// The time of the next live event, dropping cancelled entries on the way.
    fn next_event_time(&mut self) -> Option<u64> {
        while let Some(&std::cmp::Reverse((at, _, _, seq))) = self.queue.peek() {
            if self.events.contains_key(&seq) {
                return Some(at);
            }
            self.queue.pop();
        }
        None
    }

    fn protocol(&self, s: usize, source: lockstep_actors::group::GroupError) -> SimError {
        SimError::Protocol {
            server: self.servers[s].name.clone(),
            source,
        }
    }

    fn run_loop(&mut self) -> Result<(), SimError> {
        for s in 0..self.servers.len() {
            let step = self.servers[s].step(0, &self.backends[s]);
            self.after_step(s, step)?;
        }
        let mut backstop_at = None;
        loop {
            if self
                .outcome
                .as_ref()
                .is_some_and(|o| o.0 == Outcome::Crashed)
            {
                return Ok(());
            }
            let next_event = self.next_event_time();
            let next_arrival = if self.opts.preload {
                None
            } else {
                self.client.next_arrival_ns()
            };
            // Plain tokens wait for anything else the client does (they only reach
            // open requests' records, at the times the front door was done with them),
            // or for nothing else being left.
            let next_release = self.client.poll_timeout().or_else(|| {
                (next_event.is_none() && next_arrival.is_none())
                    .then(|| self.client.next_due())
                    .flatten()
            });
            let next_client = match (next_arrival, next_release) {
                (Some(a), Some(r)) => Some(a.min(r)),
                (a, r) => a.or(r),
            };
            let now = match (next_event, next_client) {
                (None, None) => {
                    if self.servers.iter().all(|s| s.state == ServerState::Done)
                        || backstop_at == Some(self.now)
                    {
                        return Ok(());
                    }
                    // Nothing can make progress any more: every waiting server's wait
                    // would never end.
                    backstop_at = Some(self.now);
                    self.stall_out_everything()?;
                    continue;
                }
                (Some(e), None) => e,
                (None, Some(a)) => a,
                (Some(e), Some(a)) => e.min(a),
            };
            debug_assert!(now >= self.now, "time went back: {now} < {}", self.now);
            self.now = now;
            if next_client == Some(now) {
                // What the front door finished by now, then the arrivals of this
                // instant, reach the front together, and its outputs go out as one
                // batch per server.
                let mut items = Vec::new();
                if next_release == Some(now) {
                    self.client.handle_timeout(now, &mut items);
                }
                if next_arrival == Some(now) {
                    self.client.send_due(now, now, &mut items);
                }
                if items.is_empty() {
                    // Only tokens reached the client (the front door streams one a few
                    // µs apart): the front has nothing to do unless the client is done.
                    if let Some(shutdown) = self.client.shutdown_due() {
                        self.front_handles([FrontInbound::Client(shutdown)]);
                    }
                } else {
                    self.front_handles(items.into_iter().map(FrontInbound::Client));
                }
                continue;
            }
            let Some(std::cmp::Reverse((_, _, _, seq))) = self.queue.pop() else {
                continue;
            };
            let Some(event) = self.events.remove(&seq) else {
                continue;
            };
            self.on_event(event)?;
            if self.iterations_without_response > LIVELOCK_ITERATIONS {
                self.outcome = Some((
                    Outcome::Deadlocked,
                    format!(
                        "{LIVELOCK_ITERATIONS} iterations without a response; {}",
                        self.describe_all()
                    ),
                ));
                return Ok(());
            }
        }
    }

    fn on_event(&mut self, event: Event) -> Result<(), SimError> {
        let now = self.now;
        match event {
            Event::Process(s) => {
                let step = self.servers[s].process(now);
                self.after_step(s, step)?;
            }
            Event::Coasted(s) => {
                self.emit_responses(s);
                self.step_on(s)?;
            }
            Event::StallBound { server } => {
                // Only the waiting read's timer is live (ending a wait cancels it): the
                // host ends the read with the stall-out.
                self.servers[server].stall_timer = None;
                self.resume(server, None)?;
            }
            Event::Resume { server } => {
                if matches!(self.servers[server].state, ServerState::Waiting { .. }) {
                    self.resume(server, None)?;
                }
            }
            Event::TransceiverTimer { server, rank } => {
                if let Some((_, timer)) = &mut self.servers[server].transceivers[rank] {
                    *timer = None;
                }
                self.pump(server, rank)?;
            }
            Event::Ingress { server, items } => {
                if self.servers[server].state == ServerState::Done {
                    // The server stopped while they were on their way.
                    self.front.bounced(now, server, items, &self.outbox);
                    self.after_front();
                } else {
                    self.servers[server].host.deliver(items);
                    self.wake(server);
                }
            }
            Event::ToFront(envelope) => self.front_handles([FrontInbound::Net(envelope)]),
            Event::FrontTimer => {
                self.front_timer = None;
                self.front.handle_timeout(now, &self.outbox);
                self.deliver_sent();
            }
        }
        Ok(())
    }

    /// An input reached server `s`: a waiting rank 0 reads at the end of this instant,
    /// with whatever else reaches it in the instant.
    fn wake(&mut self, s: usize) {
        if matches!(self.servers[s].state, ServerState::Waiting { .. }) {
            self.push(self.now, Event::Resume { server: s });
        }
    }

    /// A waiting server's read ends, if its host says so (with a stall-out, if given),
    /// and it runs on.
    fn resume(&mut self, s: usize, stalled_out: Option<String>) -> Result<(), SimError> {
        let now = self.now;
        let resumed = self.servers[s]
            .resume(now, stalled_out)
            .map_err(|e| self.protocol(s, e))?;
        if !resumed {
            return Ok(());
        }
        if let Some(seq) = self.servers[s].stall_timer.take() {
            self.cancel(seq);
        }
        let step = self.servers[s].step(now, &self.backends[s]);
        self.after_step(s, step)
    }

    /// What a server's step asks for: time to pass, an input, or the iteration's end.
    fn after_step(
        &mut self,
        s: usize,
        mut step: Result<Step, lockstep_actors::group::GroupError>,
    ) -> Result<(), SimError> {
        loop {
            match step.map_err(|e| self.protocol(s, e))? {
                Step::Waiting { stall_ends_at } => {
                    if let Some(at) = stall_ends_at {
                        if let Some(old) = self.servers[s].stall_timer.take() {
                            self.cancel(old);
                        }
                        let seq = self.push(at.max(self.now), Event::StallBound { server: s });
                        self.servers[s].stall_timer = Some(seq);
                    }
                    return Ok(());
                }
                Step::ProcessAt(at) => {
                    self.push(at, Event::Process(s));
                    return Ok(());
                }
                Step::Ended => {
                    self.iteration_ended(s)?;
                    if self.try_coast(s)? {
                        return Ok(());
                    }
                    step = self.servers[s].step(self.now, &self.backends[s]);
                }
                Step::Finished => {
                    let stopped = Envelope::ServerStopped { server: s as u32 };
                    let after =
                        arrives_after(Endpoint::Front, Phase::Process, self.net.control_ns());
                    self.push(self.now + after, Event::ToFront(stopped));
                    return Ok(());
                }
                Step::Crashed(why) => {
                    use lockstep_actors::executor::StopReason;
                    let name = &self.servers[s].name;
                    let detail = match why {
                        StopReason::Crashed(v) => format!("server `{name}`: {v}"),
                        StopReason::PeerCrashed { peer } => {
                            format!("server `{name}`: rank {peer} crashed")
                        }
                    };
                    self.outcome = Some((Outcome::Crashed, detail));
                    return Ok(());
                }
            }
        }
    }

    /// The iteration's outputs: the log, the responses (to the front), the transfer
    /// commands (to the transceivers).
    fn iteration_ended(&mut self, s: usize) -> Result<(), SimError> {
        let now = self.now;
        if self.servers[s].log_enabled
            && let Some(log) = self.opts.iter_log.as_mut()
        {
            for line in self.servers[s].log_lines() {
                serde_json::to_writer(&mut **log, &line).map_err(std::io::Error::other)?;
                log.write_all(b"\n")?;
            }
        }
        self.emit_responses(s);
        let commands: Vec<(usize, Vec<_>)> = self.servers[s]
            .group
            .reports()
            .enumerate()
            .filter(|(_, r)| !r.transfer_commands.is_empty())
            .map(|(i, r)| (i, r.transfer_commands.clone()))
            .collect();
        for (rank, cmds) in commands {
            if let Some((t, _)) = &mut self.servers[s].transceivers[rank] {
                for c in cmds {
                    t.handle(now, TransceiverIn::Command(c));
                }
            }
            // The host runs in this instant's transceiver phase, after every server's
            // process point.
            self.run_transceiver_now(s, rank);
        }
        Ok(())
    }

    /// The responses of server `s`'s iteration that ended now, to the front (and the
    /// client), as every driver sends them.
    fn emit_responses(&mut self, s: usize) {
        let now = self.now;
        let control_ns = self.net.control_ns();
        let (responses, ranges) = self.servers[s].group.responses_by_rank();
        if responses.is_empty() {
            self.iterations_without_response += 1;
        } else if control_ns == 0 {
            self.iterations_without_response = 0;
            // Rank 0's gathered responses reach the front at once: handled in place,
            // and the same slice passed on to the client as one message (no copy per
            // iteration), which the front door serves as one job per process, as in
            // the real drivers.
            for (rank, range) in ranges {
                self.front
                    .gathered(now, s, *rank, &mut responses[range.clone()]);
            }
            self.client.on_responses(now, responses);
            self.front.send_turn(now, &self.outbox);
            self.after_front();
        } else {
            self.iterations_without_response = 0;
            // Rank 0's gathered responses, as every driver sends them to the front.
            let gathered = Envelope::Responses {
                server: s as u32,
                responses: ranges
                    .iter()
                    .map(|(rank, range)| RankResponses {
                        rank: *rank,
                        responses: responses[range.clone()].to_vec(),
                    })
                    .collect(),
            };
            let after = arrives_after(Endpoint::Front, Phase::Process, control_ns);
            self.push(now + after, Event::ToFront(gathered));
        }
        if let Some(p) = self.opts.progress.as_mut() {
            let (finished, total) = self.client.progress();
            p(finished, total);
        }
    }

    /// The front's host handles `inputs` at once; then what it sent becomes events,
    /// and the client gets its responses (and may say it is done, which the front
    /// handles in turn).
    fn front_handles(&mut self, inputs: impl IntoIterator<Item = FrontInbound>) {
        self.front.handle_all(self.now, inputs, &self.outbox);
        self.after_front();
    }

    /// The front's outputs: responses to the client (whose shutdown may follow), and
    /// what it sent onto the simulated network.
    fn after_front(&mut self) {
        while self.front.has_for_client() {
            let responses = self.front.take_for_client();
            self.client.on_responses(self.now, &responses);
            if let Some(shutdown) = self.client.shutdown_due() {
                self.front
                    .handle(self.now, FrontInbound::Client(shutdown), &self.outbox);
            }
        }
        if let Some(shutdown) = self.client.shutdown_due() {
            self.front
                .handle(self.now, FrontInbound::Client(shutdown), &self.outbox);
        }
        self.deliver_sent();
    }

    /// What the hosts sent, as events: a server's ingress after the control latency —
    /// everything one reaction sent it as one delivery, as its rank 0 reads back to
    /// back sends in one fetch (even without a latency it is an event: a request the
    /// client sends the instant a server's iteration ends reaches that server after its
    /// next iteration began, as it almost always does in the real drivers, where the
    /// client, the front and rank 0 race and rank 0's next fetch is a collective away)
    /// — and transceivers' messages after the link's time for their size. The front
    /// host's timer follows its next deadline.
    fn deliver_sent(&mut self) {
        let now = self.now;
        let mut ingress: Vec<(usize, Vec<IngressItem>)> = Vec::new();
        let mut peers = Vec::new();
        for (to, envelope) in self.outbox.take() {
            match (to, envelope) {
                (Endpoint::Ingress(server), Envelope::Ingress(items)) => {
                    match ingress.iter_mut().find(|(s, _)| *s == server) {
                        Some((_, queued)) => queued.extend(items),
                        None => ingress.push((server, items)),
                    }
                }
                (Endpoint::Transceiver(to), Envelope::Peer(message)) => peers.push((to, message)),
                (to, envelope) => {
                    tracing::warn!(?to, ?envelope, "the simulator has no such route");
                }
            }
        }
        for (to, message) in peers {
            // Onto the receiving host's modeled wire: it runs when the message is due.
            let (s, r) = (to.server as usize, to.rank.index());
            if let Some(Some((host, _))) = self
                .servers
                .get_mut(s)
                .and_then(|x| x.transceivers.get_mut(r))
            {
                host.handle(now, TransceiverIn::Message(message));
                self.arm_transceiver_timer(s, r);
            }
        }
        ingress.sort_by_key(|(s, _)| *s);
        let control_ns = self.net.control_ns();
        for (server, items) in ingress {
            let after = arrives_after(Endpoint::Ingress(server), Phase::Delivery, control_ns);
            self.push(now + after, Event::Ingress { server, items });
        }
        self.arm_front_timer();
    }

    /// Runs a transceiver host: its messages go onto the simulated network, its
    /// events to its rank (which wakes its server), and its next deadline onto the
    /// clock.
    fn pump(&mut self, s: usize, r: usize) -> Result<(), SimError> {
        let now = self.now;
        let mut events = Vec::new();
        let Some((host, _)) = &mut self.servers[s].transceivers[r] else {
            return Ok(());
        };
        let woke = host.run(now, &self.outbox, &mut events);
        self.deliver_sent();
        self.arm_transceiver_timer(s, r);
        if woke {
            for e in events {
                // A request the rank no longer holds in transfer has nothing to apply.
                let _ = self.servers[s].group.ranks_mut()[r].handle_transfer_event(e);
            }
            self.servers[s].host.deliver([IngressItem::Wake]);
            self.wake(s);
        }
        Ok(())
    }

    /// A transceiver host runs in this instant's transceiver phase (its timer moves
    /// to now).
    fn run_transceiver_now(&mut self, s: usize, r: usize) {
        let now = self.now;
        let Some((_, timer)) = &mut self.servers[s].transceivers[r] else {
            return;
        };
        if timer.is_some_and(|(at, _)| at == now) {
            return;
        }
        if let Some((_, seq)) = timer.take() {
            self.cancel(seq);
        }
        let seq = self.push(now, Event::TransceiverTimer { server: s, rank: r });
        if let Some((_, timer)) = &mut self.servers[s].transceivers[r] {
            *timer = Some((now, seq));
        }
    }

    /// The front host's timer at its next deadline (moved when the deadline moved).
    fn arm_front_timer(&mut self) {
        let due = self.front.poll_timeout();
        if self.front_timer.map(|(at, _)| at) == due {
            return;
        }
        if let Some((_, seq)) = self.front_timer.take() {
            self.cancel(seq);
        }
        if let Some(at) = due {
            let seq = self.push(at.max(self.now), Event::FrontTimer);
            self.front_timer = Some((at, seq));
        }
    }

    /// One timer per transceiver host, at its next deadline: a timer set for a
    /// deadline that moved (its transfer ended, an earlier message arrived) is
    /// cancelled, so it moves no clock.
    fn arm_transceiver_timer(&mut self, s: usize, r: usize) {
        let now = self.now;
        let Some((host, timer)) = &mut self.servers[s].transceivers[r] else {
            return;
        };
        let due = host.poll_timeout();
        if timer.map(|(at, _)| at) == due {
            return;
        }
        let cancelled = timer.take().map(|(_, seq)| seq);
        if let Some(seq) = cancelled {
            self.cancel(seq);
        }
        if let Some(at) = due.map(|at| at.max(now)) {
            let seq = self.push(at, Event::TransceiverTimer { server: s, rank: r });
            if let Some((_, timer)) = &mut self.servers[s].transceivers[r] {
                *timer = Some((at, seq));
            }
        }
    }

    /// No event is left while work remains: every waiting server's wait would never
    /// end, so each is stalled out (its requests fail as deadlocked).
    fn stall_out_everything(&mut self) -> Result<(), SimError> {
        let detail = format!(
            "no event can make progress at t = {:.6} s while requests remain; {}",
            self.now as f64 / 1e9,
            self.describe_all()
        );
        if self.outcome.is_none() {
            self.outcome = Some((Outcome::Deadlocked, detail.clone()));
        }
        for s in 0..self.servers.len() {
            if matches!(self.servers[s].state, ServerState::Waiting { .. }) {
                self.resume(s, Some("no event can make progress".into()))?;
            }
        }
        Ok(())
    }

    fn describe_all(&self) -> String {
        let states: Vec<String> = self.servers.iter().map(|s| s.describe()).collect();
        states.join("; ")
    }

    fn report(self, wall_time_s: f64) -> Report {
        let outcome = self.outcome.clone().or_else(|| {
            let endings: Vec<Vec<lockstep_plan::report::RankSummary>> = self
                .servers
                .iter()
                .enumerate()
                .map(|(i, s)| s.endings(i))
                .collect();
            run_outcome(
                self.servers
                    .iter()
                    .zip(&endings)
                    .map(|(s, e)| (s.name.as_str(), &e[..])),
            )
        });
        assemble_report(
            self.fleet.scenario,
            self.fleet.seed,
            {
                let seen = self.client.into_result(self.now);
                ClientLog {
                    records: seen.records,
                    itl: seen.itl,
                    end_ns: seen.end_ns,
                    frontend: seen.frontend,
                }
            },
            self.servers.iter().flat_map(|s| s.first_scheduled()),
            wall_time_s,
            self.servers.iter().map(|s| s.report()).collect(),
            outcome,
        )
    }
}
