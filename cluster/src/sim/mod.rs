//! The deterministic simulator: every server of a scenario on one virtual clock, in one
//! thread. A server iteration is one event lasting the backend's modeled time (max over
//! its ranks; under overlap max of host and device time); arrivals, KV transfers and
//! client think time are events too. Same seed and input → identical report (but for
//! `wall_time_s`).
//!
//! Progress never stalls silently: a server whose iteration changed nothing sleeps until
//! an input concerns it; if work remains and no event can make progress, the run ends as
//! `deadlocked` with every rank's state; a violation that would crash the real executor
//! ends it as `crashed`.

mod iterlog;
mod records;
mod server;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::io::Write;
use std::time::Instant;

use lockstep_actors::config::Role;
use lockstep_actors::executor::{Finish, TransferCommand, TransferEvent, TransferOutcome};
use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::request::RequestSpec;
use lockstep_gpu::{AnalyticBackend, ModelProfile};

use crate::report::{Outcome, Report};
use crate::scenario::{FrontPolicy, Scenario};
use crate::workload::Workload;

pub use iterlog::IterLogLine;
use records::ById;
use server::{ServerState, SimServer};

/// A simulation that could not start (bad input). Results, including crashes and
/// deadlocks, are reports, not errors.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// Scenario problem.
    #[error("{0}")]
    Scenario(#[from] crate::scenario::ScenarioError),
    /// Workload problem.
    #[error("{0}")]
    Workload(#[from] crate::workload::WorkloadError),
    /// Anything else about the input, named.
    #[error("{0}")]
    Invalid(String),
    /// Writing the iteration log failed.
    #[error("iteration log: {0}")]
    IterLog(#[from] std::io::Error),
}

/// Options of one run.
pub struct SimOptions<'a> {
    /// Seed (sub-seeds are derived from it).
    pub seed: u64,
    /// Where to write one JSON line per server iteration and rank.
    pub iter_log: Option<&'a mut dyn Write>,
    /// Called with (completed + failed, total if known) as the run goes.
    pub progress: Option<&'a mut dyn FnMut(u64, Option<u64>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A server's iteration ends.
    IterationEnd(usize),
    /// A KV transfer finishes.
    TransferDone(ReqId),
    /// A KV transfer hit its timeout (it was lost, or slower than the timeout).
    TransferTimeout(ReqId),
    /// Generation-first: the front's notice that a request's gen peer is named reaches
    /// its ctx server's ingress.
    PeerReady(usize, ReqId),
}

/// Per-request bookkeeping of the client side (shared with the real drivers).
type Record = crate::report::ClientRecord;

/// A ctx → gen handoff in progress.
#[derive(Debug, Clone, Copy, Default)]
struct Handoff {
    ctx: Option<(usize, RankId)>,
    decode: Option<(usize, RankId)>,
    started_ns: u64,
    bytes: u64,
    timeout_ms: u64,
}

struct Sim<'s, 'o> {
    scenario: &'s Scenario,
    now: u64,
    seq: u64,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    servers: Vec<SimServer>,
    workload: Workload,
    records: ById<Record>,
    profile: ModelProfile,
    backend: AnalyticBackend,
    handoffs: BTreeMap<ReqId, Handoff>,
    /// Generation-first: the gen server picked for a request while it waits on its ctx
    /// server (the peer it is handed to later).
    gen_peers: BTreeMap<ReqId, usize>,
    rr_agg: usize,
    rr_ctx: usize,
    rr_gen: usize,
    receives: u64,
    finished: u64,
    outcome: Option<(Outcome, String)>,
    iterations_without_response: u64,
    opts: SimOptions<'o>,
}

/// Iterations of the whole fleet with no response at all before the run is declared
/// deadlocked (a livelock guard; real progress emits responses far more often).
const LIVELOCK_ITERATIONS: u64 = 2_000_000;

/// Runs a scenario to the end and reports.
pub fn run(scenario: &Scenario, opts: SimOptions<'_>) -> Result<Report, SimError> {
    let started = Instant::now();
    let wl_cfg = scenario
        .workload
        .as_ref()
        .ok_or_else(|| SimError::Invalid("scenario has no [workload] section".into()))?;
    let profile = scenario.model.resolve().map_err(SimError::Invalid)?;
    let mut servers = Vec::new();
    for (i, cfg) in scenario.servers.iter().enumerate() {
        servers.push(SimServer::new(i, cfg, scenario.policy)?);
    }
    for s in &mut servers {
        s.log_enabled = opts.iter_log.is_some();
    }
    let roles: Vec<Role> = servers.iter().map(|s| s.role).collect();
    let has_agg = roles.contains(&Role::Agg);
    let has_ctx = roles.contains(&Role::Ctx);
    let has_gen = roles.contains(&Role::Gen);
    if has_agg && (has_ctx || has_gen) {
        return Err(SimError::Invalid(
            "a scenario has either agg servers or ctx and gen servers, not both".into(),
        ));
    }
    if has_ctx != has_gen {
        return Err(SimError::Invalid(
            "a disaggregated scenario needs at least one ctx and one gen server".into(),
        ));
    }
    let tpb = servers[0].tokens_per_block;
    if let Some(s) = servers.iter().find(|s| s.tokens_per_block != tpb) {
        return Err(SimError::Invalid(format!(
            "server `{}`: kv_cache_config.tokens_per_block = {} differs from server `{}`'s {}; \
             KV handed between servers needs one block size",
            s.name, s.tokens_per_block, servers[0].name, tpb
        )));
    }
    let workload = Workload::new(
        wl_cfg,
        tpb,
        scenario.seed.unwrap_or(opts.seed),
        &scenario.base_dir,
    )?;
    let backend = AnalyticBackend {
        coefficients: profile.coefficients,
    };
    let mut sim = Sim {
        scenario,
        now: 0,
        seq: 0,
        events: BinaryHeap::new(),
        servers,
        workload,
        records: ById::new(),
        profile,
        backend,
        handoffs: BTreeMap::new(),
        gen_peers: BTreeMap::new(),
        rr_agg: 0,
        rr_ctx: 0,
        rr_gen: 0,
        receives: 0,
        finished: 0,
        outcome: None,
        iterations_without_response: 0,
        opts,
    };
    sim.run_loop()?;
    Ok(sim.report(started.elapsed().as_secs_f64()))
}

impl Sim<'_, '_> {
    fn push(&mut self, at: u64, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, e)));
    }

    fn run_loop(&mut self) -> Result<(), SimError> {
        loop {
            if self.outcome.is_some() {
                return Ok(());
            }
            let next_event = self.events.peek().map(|Reverse((t, _, _))| *t);
            let next_arrival = self.workload.next_arrival_ns();
            let now = match (next_event, next_arrival) {
                (None, None) => break,
                (Some(e), None) => e,
                (None, Some(a)) => a,
                (Some(e), Some(a)) => e.min(a),
            };
            debug_assert!(now >= self.now, "time went back: {now} < {}", self.now);
            self.now = now;
            if next_arrival == Some(now) {
                // Arrivals of one instant reach the ingress together, then servers wake:
                // a fetch sees every request that arrived at that instant.
                let mut woken = Vec::new();
                while let Some(arrival) = self.workload.pop_due(now) {
                    let target = self.admit_arrival(arrival.spec, arrival.at_ns);
                    if !woken.contains(&target) {
                        woken.push(target);
                    }
                }
                for target in woken {
                    self.wake(target);
                }
                continue;
            }
            let Some(Reverse((_, _, event))) = self.events.pop() else {
                break;
            };
            match event {
                Event::IterationEnd(s) => self.end_iteration(s)?,
                Event::TransferDone(id) => self.finish_transfer(id, None),
                Event::PeerReady(s, id) => {
                    self.servers[s].peers_ready.push(id);
                    self.wake(s);
                }
                Event::TransferTimeout(id) => {
                    let ms = self.handoffs.get(&id).map_or(0, |h| h.timeout_ms);
                    self.finish_transfer(id, Some(format!("kv transfer timed out after {ms} ms")))
                }
            }
        }
        // Nothing can make progress any more.
        let outstanding = self.records.values().filter(|r| r.end_ns.is_none()).count();
        if outstanding > 0 || !self.workload.exhausted() {
            let states: Vec<String> = self.servers.iter().map(|s| s.describe()).collect();
            self.outcome = Some((
                Outcome::Deadlocked,
                format!(
                    "{outstanding} requests outstanding and no event can make progress at t = {:.6} s; {}",
                    self.now as f64 / 1e9,
                    states.join("; ")
                ),
            ));
        }
        Ok(())
    }

    /// The front door: an arrival goes to an agg server, or to a ctx server first.
    /// Returns the server to wake.
    fn admit_arrival(&mut self, spec: RequestSpec, at_ns: u64) -> usize {
        let id = spec.id;
        self.records.insert(id, Record::new(spec.clone(), at_ns));
        let target = self.pick(&[Role::Agg, Role::Ctx], &spec);
        if self.scenario.servers[target]
            .cache_transceiver_config
            .generation_first
        {
            // Generation-first (§8): the gen peer is named now; the notice reaches the ctx
            // server one control-link latency later, and its ranks promote the request
            // (or let it arrive ready) all at the same fetch.
            let peer = self.pick(&[Role::Gen], &spec);
            self.gen_peers.insert(id, peer);
            let latency = self.scenario.model.transfer_ns(&self.profile, 0);
            self.push(at_ns + latency, Event::PeerReady(target, id));
        }
        self.servers[target].ingress.push_back(spec);
        target
    }

    /// The front door's server selection (`[front] policy`): round robin, the fewest
    /// live requests (`load_balancing`), or the longest cached prefix (`kv_aware`, ties
    /// to the least loaded); ties break by server order.
    fn pick(&mut self, roles: &[Role], spec: &RequestSpec) -> usize {
        let candidates: Vec<usize> = self
            .servers
            .iter()
            .enumerate()
            .filter(|(_, s)| roles.contains(&s.role))
            .map(|(i, _)| i)
            .collect();
        let load = |s: &server::SimServer| -> u64 {
            s.ingress.len() as u64
                + s.group
                    .ranks()
                    .iter()
                    .map(|r| u64::from(r.counts().live) + r.waiting().len() as u64)
                    .sum::<u64>()
        };
        match self.scenario.front.policy {
            FrontPolicy::RoundRobin => {
                let counter = match self.servers[candidates[0]].role {
                    Role::Agg => &mut self.rr_agg,
                    Role::Ctx => &mut self.rr_ctx,
                    Role::Gen => &mut self.rr_gen,
                };
                let chosen = candidates[*counter % candidates.len()];
                *counter += 1;
                chosen
            }
            FrontPolicy::LoadBalancing => *candidates
                .iter()
                .min_by_key(|&&i| (load(&self.servers[i]), i))
                .expect("a server of the role exists"),
            FrontPolicy::KvAware => *candidates
                .iter()
                .min_by_key(|&&i| {
                    let s = &self.servers[i];
                    let matched = s
                        .group
                        .ranks()
                        .iter()
                        .map(|r| r.kv().longest_prefix_match(&spec.block_hashes))
                        .max()
                        .unwrap_or(0);
                    (std::cmp::Reverse(matched), load(s), i)
                })
                .expect("a server of the role exists"),
        }
    }

    fn wake(&mut self, s: usize) {
        if matches!(
            self.servers[s].state,
            ServerState::Idle | ServerState::Stalled
        ) {
            self.start_iteration(s);
        }
    }

    fn start_iteration(&mut self, s: usize) {
        let now = self.now;
        let backend = self.backend;
        match self.servers[s].step(now, &backend) {
            Ok(Some(duration)) => {
                self.push(now + duration, Event::IterationEnd(s));
            }
            Ok(None) => {}
            Err(e) => {
                self.outcome = Some((
                    Outcome::Crashed,
                    format!("server `{}`: {e}", self.servers[s].name),
                ));
            }
        }
    }

    fn end_iteration(&mut self, s: usize) -> Result<(), SimError> {
        let now = self.now;
        let mut done = match self.servers[s].finish_iteration() {
            Ok(Some(done)) => done,
            Ok(None) => return Ok(()),
            Err(e) => {
                self.outcome = Some((
                    Outcome::Crashed,
                    format!("server `{}`: {e}", self.servers[s].name),
                ));
                return Ok(());
            }
        };
        if let Some(log) = self.opts.iter_log.as_mut() {
            for line in &done.log_lines {
                serde_json::to_writer(&mut **log, line).map_err(std::io::Error::other)?;
                log.write_all(b"\n")?;
            }
        }
        if let Some(v) = done.fatal.take() {
            self.outcome = Some((
                Outcome::Crashed,
                format!("server `{}`: {v}", self.servers[s].name),
            ));
            return Ok(());
        }
        let role = self.servers[s].role;
        if done.responses.is_empty() {
            self.iterations_without_response += 1;
        } else {
            self.iterations_without_response = 0;
        }
        for r in &done.responses {
            let Some(rec) = self.records.get_mut(&r.id) else {
                continue;
            };
            rec.on_tokens(r, now);
            match &r.finish {
                None => {}
                Some(Finish::Completed) => self.end_request(r.id, true, None),
                Some(Finish::ContextDone) => self.hand_off(s, r.id),
                Some(Finish::Failed(why)) => {
                    let why = why.clone();
                    self.end_request(r.id, false, Some(why));
                    if let Some(h) = self.handoffs.remove(&r.id) {
                        // The other side must free its KV too.
                        self.fail_other_side(h, r.id, role);
                    }
                }
                Some(Finish::Cancelled) => {
                    self.end_request(r.id, false, Some("cancelled".into()));
                    if let Some(h) = self.handoffs.remove(&r.id) {
                        // The other side must free its KV too.
                        self.fail_other_side(h, r.id, role);
                    }
                }
            }
        }
        for (rank, cmd) in &done.commands {
            match *cmd {
                TransferCommand::Send { id, .. } => {
                    let h = self.handoffs.entry(id).or_default();
                    h.ctx = Some((s, *rank));
                    if self.records.get(&id).is_some_and(|r| r.end_ns.is_some()) {
                        // Nothing to hand over (output length 1): release the KV now.
                        self.deliver(s, *rank, id, TransferOutcome::Done);
                        self.handoffs.remove(&id);
                    }
                }
                TransferCommand::Receive { id, .. } => {
                    let prompt = self.records.get(&id).map_or(0, |r| r.spec.prompt_len);
                    let duration = self.scenario.model.transfer_ns(&self.profile, prompt);
                    let bytes = self.profile.kv.bytes_per_token() * u64::from(prompt);
                    let timeout_ms = self.scenario.servers[s]
                        .cache_transceiver_config
                        .kv_transfer_timeout_ms
                        .max(1) as u64;
                    let h = self.handoffs.entry(id).or_default();
                    h.decode = Some((s, *rank));
                    h.started_ns = now;
                    h.bytes = bytes;
                    h.timeout_ms = timeout_ms;
                    self.receives += 1;
                    // Fault injection: every n-th transfer is lost and only its timeout
                    // ends it; a transfer slower than the timeout times out too.
                    let lost = self
                        .scenario
                        .faults
                        .lost_transfer_every
                        .is_some_and(|n| n > 0 && self.receives.is_multiple_of(n));
                    let timeout_ns = timeout_ms * 1_000_000;
                    if lost {
                        self.servers[s].transfers.lost += 1;
                    }
                    if lost && self.scenario.faults.timeouts_lost {
                        // Nothing will ever end this transfer.
                    } else if lost || duration > timeout_ns {
                        self.push(now + timeout_ns, Event::TransferTimeout(id));
                    } else {
                        self.push(now + duration, Event::TransferDone(id));
                    }
                }
            }
        }
        let progress = done.progress;
        self.servers[s].recycle(done);
        if let Some(p) = self.opts.progress.as_mut() {
            p(self.finished, self.workload.total());
        }
        if self.iterations_without_response > LIVELOCK_ITERATIONS {
            let states: Vec<String> = self.servers.iter().map(|s| s.describe()).collect();
            self.outcome = Some((
                Outcome::Deadlocked,
                format!(
                    "{LIVELOCK_ITERATIONS} iterations without a response; {}",
                    states.join("; ")
                ),
            ));
            return Ok(());
        }
        // Go on unless the server is idle or stalled; an input wakes it.
        if progress || !self.servers[s].ingress.is_empty() {
            self.start_iteration(s);
        } else {
            self.servers[s].state = ServerState::Stalled;
        }
        Ok(())
    }

    fn end_request(&mut self, id: ReqId, completed: bool, failure: Option<String>) {
        self.gen_peers.remove(&id);
        let now = self.now;
        if let Some(rec) = self.records.get_mut(&id)
            && rec.end_ns.is_none()
        {
            rec.end(now, completed, failure);
            self.finished += 1;
            self.workload.on_finished(id, now, completed);
        }
    }

    /// ctx finished the prefill: the front forwards the request to a gen server, unless
    /// its single output token is already out.
    fn hand_off(&mut self, _ctx: usize, id: ReqId) {
        let Some(rec) = self.records.get(&id) else {
            return;
        };
        if rec.spec.max_new_tokens <= 1 {
            self.end_request(id, true, None);
            return;
        }
        let mut spec = rec.spec.clone();
        spec.generated_before = 1;
        // The gen server receives the KV; it never prefills, so the prompt's block
        // hashes (prefix reuse) mean nothing there.
        spec.block_hashes = Vec::new();
        let target = match self.gen_peers.remove(&id) {
            Some(peer) => peer,
            None => self.pick(&[Role::Gen], &spec),
        };
        self.servers[target].ingress.push_back(spec);
        self.wake(target);
    }

    fn deliver(&mut self, s: usize, rank: RankId, id: ReqId, outcome: TransferOutcome) {
        let server = &mut self.servers[s];
        if let Some(r) = server.group.ranks_mut().get_mut(rank.index()) {
            // A request the rank no longer holds in transfer (failed meanwhile) is skipped.
            let _ = r.handle_transfer_event(TransferEvent { id, outcome });
        }
        self.wake(s);
    }

    /// Ends a transfer on both sides: done, or failed (`Some(reason)`), which fails that
    /// request only and frees its KV on both sides (§8).
    fn finish_transfer(&mut self, id: ReqId, failure: Option<String>) {
        let Some(h) = self.handoffs.remove(&id) else {
            return;
        };
        let now = self.now;
        for side in [h.decode, h.ctx].into_iter().flatten() {
            let (server, rank) = side;
            let t = &mut self.servers[server].transfers;
            let outcome = match &failure {
                None => {
                    t.count += 1;
                    t.bytes += h.bytes;
                    t.times_ms.push((now - h.started_ns) as f64 / 1e6);
                    TransferOutcome::Done
                }
                Some(why) => {
                    t.timeouts += 1;
                    TransferOutcome::Failed(why.clone())
                }
            };
            self.deliver(server, rank, id, outcome);
        }
    }

    fn fail_other_side(&mut self, h: Handoff, id: ReqId, failed_on: Role) {
        let other = match failed_on {
            Role::Ctx => h.decode,
            Role::Gen | Role::Agg => h.ctx,
        };
        if let Some((s, rank)) = other {
            self.deliver(s, rank, id, TransferOutcome::Failed("peer failed".into()));
        }
    }

    fn report(&self, wall_time_s: f64) -> Report {
        crate::report::assemble_report(
            self.scenario,
            self.scenario.seed.unwrap_or(self.opts.seed),
            self.records.values().cloned().collect(),
            self.now,
            wall_time_s,
            self.servers.iter().map(|s| s.report()).collect(),
            self.outcome.clone(),
        )
    }
}
