//! One simulated server: its ranks (a `ServerGroup`), its ingress queue, and the
//! accumulators its report needs.

use std::collections::VecDeque;

use lockstep_actors::config::{Role, ServerConfig};
use lockstep_actors::executor::{
    FetchBatch, FetchMode, IterationReport, Response, TransferCommand,
};
use lockstep_actors::group::{BegunIteration, DeterministicTokens, ServerGroup};
use lockstep_actors::ids::RankId;
use lockstep_actors::invariants::Violation;
use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;
use lockstep_gpu::{Backend, BatchShape};

use crate::report::{Percentiles, RankSummary, ServerReport, TransferReport, server_report};

use super::SimError;
use super::iterlog::IterLogLine;

/// What a server is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerState {
    /// Rank 0 blocks on the ingress queue (nothing live, nothing waiting).
    Idle,
    /// An iteration is running until its end event.
    Busy,
    /// The last iteration changed nothing; the server sleeps until an input concerns it
    /// (its next iteration would be identical).
    Stalled,
}

/// The results of an iteration, delivered at its end.
pub struct FinishedIteration {
    pub responses: Vec<Response>,
    pub commands: Vec<(RankId, TransferCommand)>,
    pub fatal: Option<Violation>,
    pub progress: bool,
    pub log_lines: Vec<IterLogLine>,
}

/// Transfer accumulators.
#[derive(Debug, Default)]
pub struct TransferAcc {
    pub count: u64,
    pub bytes: u64,
    pub times_ms: Vec<f64>,
    pub timeouts: u64,
    pub lost: u64,
}

pub struct SimServer {
    pub name: String,
    pub role: Role,
    pub tokens_per_block: u32,
    pub overlap: bool,
    pub max_batch_size: u32,
    pub group: ServerGroup,
    pub ingress: VecDeque<RequestSpec>,
    /// Generation-first notices waiting for the next fetch.
    pub peers_ready: Vec<lockstep_actors::ids::ReqId>,
    pub state: ServerState,
    pub transfers: TransferAcc,
    /// The running iteration's start, host and device time; its results are in `begun`.
    pending: Option<(u64, u64, u64)>,
    /// Buffers reused by every iteration: phases 1-8, the cost model's shapes, phase 9.
    begun: BegunIteration,
    shapes: Vec<BatchShape>,
    reports: Vec<IterationReport>,
    iterations: u64,
    busy_ns: u64,
    violations: Vec<Violation>,
    violation_count: u64,
    tokens: DeterministicTokens,
    pub log_enabled: bool,
}

impl SimServer {
    pub fn new(index: usize, cfg: &ServerConfig, policy: Policy) -> Result<SimServer, SimError> {
        let group = ServerGroup::new(cfg, policy)
            .map_err(|e| SimError::Scenario(crate::scenario::ScenarioError::Config(e)))?;
        if let Some(w) = group.warning() {
            tracing::warn!(server = index, "{w}");
        }
        let sizes = group.ranks()[0].sizes().clone();
        Ok(SimServer {
            name: cfg.name.clone(),
            role: cfg.role,
            tokens_per_block: sizes.tokens_per_block,
            overlap: sizes.overlap,
            max_batch_size: sizes.max_batch_size,
            group,
            ingress: VecDeque::new(),
            peers_ready: Vec::new(),
            state: ServerState::Idle,
            transfers: TransferAcc::default(),
            pending: None,
            begun: BegunIteration {
                forward_ran: false,
                launched: Vec::new(),
                responses: Vec::new(),
            },
            shapes: Vec::new(),
            reports: Vec::new(),
            iterations: 0,
            busy_ns: 0,
            violations: Vec::new(),
            violation_count: 0,
            tokens: DeterministicTokens,
            log_enabled: true,
        })
    }

    /// Starts an iteration at `now`. `Ok(Some(d))`: it lasts `d` ns; `Ok(None)`: idle.
    pub fn step(
        &mut self,
        now: u64,
        backend: &impl Backend,
    ) -> Result<Option<u64>, lockstep_actors::executor::ExecutorError> {
        let ingress = &mut self.ingress;
        let peers_ready = &mut self.peers_ready;
        let mut fetch = |mode: FetchMode| {
            if mode == FetchMode::Block && ingress.is_empty() && peers_ready.is_empty() {
                return None;
            }
            Some(FetchBatch {
                requests: ingress.drain(..).collect(),
                cancellations: Vec::new(),
                shutdown: false,
                peers_ready: std::mem::take(peers_ready),
                now_ns: now,
            })
        };
        let ran = self
            .group
            .begin_into(&mut fetch, &mut self.tokens, &mut self.begun)?;
        match ran {
            false => {
                self.state = ServerState::Idle;
                Ok(None)
            }
            true => {
                let it = &self.begun;
                let dp = self.group.ranks().len();
                self.shapes.clear();
                self.shapes.resize(dp, BatchShape::default());
                for b in &it.launched {
                    self.shapes[b.rank.index()] = BatchShape::of(b);
                }
                let time = backend.iteration_ns(&self.shapes, it.forward_ran, self.overlap);
                // Every iteration takes some time, so virtual time always advances.
                let total = time.total_ns.max(1_000);
                self.state = ServerState::Busy;
                self.iterations += 1;
                self.busy_ns += total;
                self.pending = Some((now, time.host_ns, time.device_ns));
                Ok(Some(total))
            }
        }
    }

    /// Ends the running iteration (its transfer phase and checks run now, so transfer
    /// events that arrived during it apply) and hands back its results.
    pub fn finish_iteration(
        &mut self,
    ) -> Result<Option<FinishedIteration>, lockstep_actors::executor::ExecutorError> {
        let Some((started, host_ns, device_ns)) = self.pending.take() else {
            return Ok(None);
        };
        self.group.end_into(&mut self.reports)?;
        let it = &mut self.begun;
        let mut commands = Vec::new();
        let mut fatal = None;
        // A forward of dummies only changes nothing but counters: the next iteration would
        // be the same, so it is no progress (a gen server waiting for KV sleeps instead of
        // padding forever).
        let real_forward = it
            .launched
            .iter()
            .any(|b| b.real_entries().next().is_some());
        let mut progress = real_forward || !it.responses.is_empty();
        let mut log_lines = Vec::new();
        for report in &self.reports {
            let st = &report.stats;
            progress |= st.admitted_now > 0
                || st.transfer_events_applied > 0
                || st.generation_first_promoted > 0
                || !report.transfer_commands.is_empty();
            for c in &report.transfer_commands {
                commands.push((st.rank, c.clone()));
            }
            for v in &report.violations {
                self.violation_count += 1;
                if self.violations.len() < 100 {
                    self.violations.push(v.clone());
                }
                if fatal.is_none() && v.kind.is_fatal() {
                    fatal = Some(v.clone());
                }
            }
            if self.log_enabled {
                log_lines.push(IterLogLine::new(
                    &self.name, started, host_ns, device_ns, st,
                ));
            }
        }
        Ok(Some(FinishedIteration {
            responses: std::mem::take(&mut it.responses),
            commands,
            fatal,
            progress,
            log_lines,
        }))
    }

    /// Hands back a finished iteration's response vector for reuse.
    pub fn recycle(&mut self, done: FinishedIteration) {
        let mut responses = done.responses;
        responses.clear();
        if responses.capacity() > self.begun.responses.capacity() {
            self.begun.responses = responses;
        }
    }

    /// One line per rank for a deadlock report.
    pub fn describe(&self) -> String {
        let ranks: Vec<String> = self
            .group
            .ranks()
            .iter()
            .map(|r| {
                let c = r.counts();
                let mut by_state: std::collections::BTreeMap<i32, u32> = Default::default();
                for q in r.active() {
                    *by_state.entry(q.state.as_int()).or_default() += 1;
                }
                format!(
                    "rank {}: live {} routable {} retiring {} schedulable {} sending {} waiting {} states {:?}",
                    r.rank(),
                    c.live,
                    c.routable,
                    c.retiring,
                    c.schedulable,
                    r.sending().len(),
                    r.waiting().len(),
                    by_state
                )
            })
            .collect();
        format!(
            "server `{}` ({:?}): {}",
            self.name,
            self.state,
            ranks.join(", ")
        )
    }

    pub fn report(&self) -> ServerReport {
        // One summary per rank; server-wide violations are already collected here.
        let summaries: Vec<RankSummary> = self
            .group
            .ranks()
            .iter()
            .map(|r| RankSummary::of(r, self.iterations, Vec::new(), 0))
            .collect();
        let mut report = server_report(
            &self.name,
            self.role,
            self.max_batch_size,
            &summaries,
            self.busy_ns as f64 / 1e9,
        );
        let mut times = self.transfers.times_ms.clone();
        let p = Percentiles::of(&mut times);
        report.transfers = TransferReport {
            count: self.transfers.count,
            bytes: self.transfers.bytes,
            mean_ms: p.mean,
            p99_ms: p.p99,
            timeouts: self.transfers.timeouts,
            lost: self.transfers.lost,
            ..report.transfers
        };
        report.violations = self.violations.clone();
        report.violation_count = self.violation_count;
        report
    }
}
