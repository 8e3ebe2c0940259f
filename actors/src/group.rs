//! Steps every rank of one server in lockstep in one thread, computing each collective
//! directly from the ranks' contributions. This is the core the simulator drives and the
//! stepper the tests use; the threads and MPI drivers run the same phases with real
//! collectives instead.

use std::collections::BTreeMap;

use crate::config::{ConfigError, Role, ServerConfig};
use crate::executor::{
    AwaitTransfers, ExecutorError, FetchBatch, FetchMode, ForwardOutput, IterationReport,
    PadIntent, RankExecutor, Response, ScheduledBatch,
};
use crate::ids::{BatchNumber, RankId};
use crate::kv::mix;
use crate::policy::Policy;

/// A model backend as the stepper sees it: sampled tokens for a batch.
pub trait TokenSource {
    /// One sampled token per entry of `batch`.
    fn sample(&mut self, batch: &ScheduledBatch) -> ForwardOutput;
}

/// Deterministic tokens: `mix(id, position)`, so token streams can be compared across
/// drivers and across aggregated and disaggregated runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeterministicTokens;

/// The token a deterministic backend samples for request `id` at output `position`.
pub fn deterministic_token(id: u64, position: u32) -> u32 {
    (mix(id.wrapping_mul(0x100_0000_01B3) ^ u64::from(position)) % 32_000) as u32
}

impl TokenSource for DeterministicTokens {
    fn sample(&mut self, batch: &ScheduledBatch) -> ForwardOutput {
        ForwardOutput {
            batch: batch.number,
            sampled: batch
                .entries
                .iter()
                .map(|e| deterministic_token(e.id.0, e.position))
                .collect(),
        }
    }
}

/// One iteration of a whole server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupIteration {
    /// Iteration number.
    pub iteration: u64,
    /// Whether the forward ran.
    pub forward_ran: bool,
    /// Batches launched this iteration (one per rank when the forward ran).
    pub launched: Vec<ScheduledBatch>,
    /// Responses gathered to rank 0, in rank order.
    pub responses: Vec<Response>,
    /// Per-rank reports, in rank order.
    pub reports: Vec<IterationReport>,
}

/// The result of one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupStep {
    /// Rank 0 would block on the ingress queue and nothing was there: no iteration ran.
    Idle,
    /// An iteration ran.
    Ran(GroupIteration),
}

/// All ranks of one server.
#[derive(Debug)]
pub struct ServerGroup {
    name: String,
    role: Role,
    ranks: Vec<RankExecutor>,
    outputs: BTreeMap<(RankId, BatchNumber), ForwardOutput>,
    awaiting_end: Vec<AwaitTransfers>,
    warning: Option<String>,
}

impl ServerGroup {
    /// Builds every rank. Fails on invalid values or a seat skew (unless the legacy
    /// switch turns it into [`ServerGroup::warning`]).
    pub fn new(server: &ServerConfig, policy: Policy) -> Result<ServerGroup, ConfigError> {
        let derived = server.derive(&policy)?;
        let ranks = (0..derived.sizes.dp)
            .map(|r| RankExecutor::new(RankId(r), server, &derived.sizes, policy))
            .collect();
        Ok(ServerGroup {
            name: server.name.clone(),
            role: server.role,
            ranks,
            outputs: BTreeMap::new(),
            awaiting_end: Vec::new(),
            warning: derived.warning,
        })
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The startup warning, if the legacy switch let a seat skew through.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    /// The ranks.
    pub fn ranks(&self) -> &[RankExecutor] {
        &self.ranks
    }

    /// The ranks, mutably (to deliver transfer events).
    pub fn ranks_mut(&mut self) -> &mut [RankExecutor] {
        &mut self.ranks
    }

    /// Whether every rank holds nothing and the replicated waiting queue is empty.
    pub fn is_empty(&self) -> bool {
        self.ranks
            .iter()
            .all(|r| r.active().is_empty() && r.sending().is_empty() && r.dummy().is_none())
            && self.ranks[0].waiting().is_empty()
            && self.outputs.is_empty()
    }

    /// Whether an iteration was begun and not ended.
    pub fn in_iteration(&self) -> bool {
        !self.awaiting_end.is_empty()
    }

    /// Runs one iteration on every rank: [`ServerGroup::begin`] then
    /// [`ServerGroup::end`]. `fetch` is rank 0's ingress read: given the mode it returns
    /// what it read, or `None` when blocking found nothing (then no iteration runs: the
    /// server is idle).
    pub fn step(
        &mut self,
        fetch: &mut dyn FnMut(FetchMode) -> Option<FetchBatch>,
        tokens: &mut dyn TokenSource,
    ) -> Result<GroupStep, ExecutorError> {
        let Some(begun) = self.begin(fetch, tokens)? else {
            return Ok(GroupStep::Idle);
        };
        let reports = self.end()?;
        Ok(GroupStep::Ran(GroupIteration {
            iteration: reports[0].stats.iteration,
            forward_ran: begun.forward_ran,
            launched: begun.launched,
            responses: begun.responses,
            reports,
        }))
    }

    /// Phases 1 to 8 of an iteration on every rank (up to the responses). The transfer
    /// phase runs in [`ServerGroup::end`], so a driver that models the iteration's
    /// duration applies the transfer events that arrived meanwhile at its end.
    pub fn begin(
        &mut self,
        fetch: &mut dyn FnMut(FetchMode) -> Option<FetchBatch>,
        tokens: &mut dyn TokenSource,
    ) -> Result<Option<BegunIteration>, ExecutorError> {
        assert!(
            self.awaiting_end.is_empty(),
            "ServerGroup::begin called twice without end"
        );
        // 1. Gather.
        let (tokens_fetch, states): (Vec<_>, Vec<_>) =
            self.ranks.iter_mut().map(|r| r.begin_iteration()).unzip();
        // 2. Fetch (rank 0 decides, broadcast).
        let mode = self.ranks[0].fetch_mode(&states);
        let Some(fetched) = fetch(mode) else {
            return Ok(None);
        };
        let mut next = Vec::with_capacity(self.ranks.len());
        let mut matches = Vec::with_capacity(self.ranks.len());
        for (r, t) in self.ranks.iter_mut().zip(tokens_fetch) {
            let (t, m) = r.on_fetch(t, &states, &fetched)?;
            next.push(t);
            matches.push(m);
        }
        // 3. Prefix matches (allgather) → route → pad intent (allreduce MAX).
        let mut next2 = Vec::with_capacity(self.ranks.len());
        let mut intent = PadIntent::None;
        for (r, t) in self.ranks.iter_mut().zip(next) {
            let (t, i) = r.on_prefix_matches(t, &matches)?;
            intent = intent.max(i);
            next2.push(t);
        }
        // 4-5. Pad and schedule → vote (allgather).
        let (next3, votes): (Vec<_>, Vec<_>) = self
            .ranks
            .iter_mut()
            .zip(next2)
            .map(|(r, t)| r.on_pad_intent(t, intent))
            .unzip();
        // 6-7. Commit or roll back; launch; hand back the awaited output.
        let mut launched = Vec::new();
        let mut forward_ran = false;
        let mut plans = Vec::with_capacity(self.ranks.len());
        for (r, t) in self.ranks.iter_mut().zip(next3) {
            let (t, plan) = r.on_vote(t, &votes)?;
            forward_ran = plan.can_queue;
            if let Some(batch) = plan.launch {
                let out = tokens.sample(&batch);
                self.outputs.insert((r.rank(), batch.number), out);
                launched.push(batch);
            }
            plans.push((t, plan.await_output));
        }
        // 8. Update → responses (gather to rank 0).
        let mut responses = Vec::new();
        for (r, (t, awaited)) in self.ranks.iter_mut().zip(plans) {
            let output = awaited.and_then(|b| self.outputs.remove(&(r.rank(), b)));
            let (t, rr) = r.on_forward_output(t, output)?;
            responses.extend(rr.responses);
            self.awaiting_end.push(t);
        }
        Ok(Some(BegunIteration {
            forward_ran,
            launched,
            responses,
        }))
    }

    /// Phase 9 (the transfer consensus) and the §10 checks on every rank; closes the
    /// iteration [`ServerGroup::begin`] opened.
    pub fn end(&mut self) -> Result<Vec<IterationReport>, ExecutorError> {
        let awaiting = std::mem::take(&mut self.awaiting_end);
        assert_eq!(
            awaiting.len(),
            self.ranks.len(),
            "ServerGroup::end without begin"
        );
        let (next, statuses): (Vec<_>, Vec<_>) = self
            .ranks
            .iter_mut()
            .zip(awaiting)
            .map(|(r, t)| r.transfer_status(t))
            .unzip();
        let mut reports = Vec::with_capacity(self.ranks.len());
        for (r, t) in self.ranks.iter_mut().zip(next) {
            reports.push(r.on_transfer_status(t, &statuses)?);
        }
        Ok(reports)
    }
}

/// Phases 1 to 8 of an iteration, done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BegunIteration {
    /// Whether the forward ran.
    pub forward_ran: bool,
    /// Batches launched (one per rank when the forward ran).
    pub launched: Vec<ScheduledBatch>,
    /// Responses gathered to rank 0, in rank order.
    pub responses: Vec<Response>,
}
