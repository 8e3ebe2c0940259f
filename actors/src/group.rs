//! Steps every rank of one server in lockstep in one thread, computing each collective
//! directly from the ranks' contributions. This is the core the simulator drives and the
//! stepper the tests use; the threads and MPI drivers run the same phases with real
//! collectives instead.

use crate::config::{ConfigError, Role, ServerConfig};
use crate::executor::{
    AwaitFetch, AwaitForward, AwaitPadIntent, AwaitPrefixMatches, AwaitTransferResult,
    AwaitTransfers, AwaitVote, BatchVote, ExecutorError, FetchBatch, FetchMode, ForwardOutput,
    IterationReport, PadIntent, PrefixMatches, RankExecutor, RankState, Response, ScheduledBatch,
    TransferStatus,
};
use crate::ids::{BatchNumber, RankId};
use crate::kv::mix;
use crate::policy::Policy;

/// A model backend as the stepper sees it: sampled tokens for a batch.
pub trait TokenSource {
    /// One sampled token per entry of `batch`.
    fn sample(&mut self, batch: &ScheduledBatch) -> ForwardOutput;

    /// [`TokenSource::sample`] into `out`, whose buffer a source may reuse.
    fn sample_into(&mut self, batch: &ScheduledBatch, out: &mut ForwardOutput) {
        *out = self.sample(batch);
    }
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

    fn sample_into(&mut self, batch: &ScheduledBatch, out: &mut ForwardOutput) {
        out.batch = batch.number;
        out.sampled.clear();
        out.sampled.extend(
            batch
                .entries
                .iter()
                .map(|e| deterministic_token(e.id.0, e.position)),
        );
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
    /// Per rank: forward outputs not handed back yet (at most two, under overlap).
    outputs: Vec<Vec<ForwardOutput>>,
    /// Outputs handed back, reused for the next samples.
    spare_outputs: Vec<ForwardOutput>,
    awaiting_end: Vec<AwaitTransfers>,
    warning: Option<String>,
    bufs: Collectives,
}

/// The per-iteration collective results and phase tokens, kept across iterations so that
/// an iteration allocates nothing. Every phase clears what it fills.
#[derive(Debug, Default)]
struct Collectives {
    states: Vec<RankState>,
    fetch: Vec<AwaitFetch>,
    matches: Vec<PrefixMatches>,
    prefix: Vec<AwaitPrefixMatches>,
    pad: Vec<AwaitPadIntent>,
    vote: Vec<AwaitVote>,
    votes: Vec<BatchVote>,
    forward: Vec<(AwaitForward, Option<BatchNumber>)>,
    transfers: Vec<AwaitTransferResult>,
    statuses: Vec<TransferStatus>,
}

impl ServerGroup {
    /// Builds every rank. Fails on invalid values or a seat skew (unless the legacy
    /// switch turns it into [`ServerGroup::warning`]).
    pub fn new(server: &ServerConfig, policy: Policy) -> Result<ServerGroup, ConfigError> {
        let derived = server.derive(&policy)?;
        let ranks: Vec<RankExecutor> = (0..derived.sizes.dp)
            .map(|r| RankExecutor::new(RankId(r), server, &derived.sizes, policy))
            .collect();
        Ok(ServerGroup {
            name: server.name.clone(),
            role: server.role,
            outputs: (0..ranks.len()).map(|_| Vec::new()).collect(),
            spare_outputs: Vec::new(),
            ranks,
            awaiting_end: Vec::new(),
            warning: derived.warning,
            bufs: Collectives::default(),
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
            && self.outputs.iter().all(Vec::is_empty)
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
        let mut out = BegunIteration {
            forward_ran: false,
            launched: Vec::new(),
            responses: Vec::new(),
        };
        Ok(self.begin_into(fetch, tokens, &mut out)?.then_some(out))
    }

    /// [`ServerGroup::begin`] into `out`, whose vectors (and launched batches) are reused:
    /// `Ok(true)` when an iteration ran and `out` holds it, `Ok(false)` when idle.
    pub fn begin_into(
        &mut self,
        fetch: &mut dyn FnMut(FetchMode) -> Option<FetchBatch>,
        tokens: &mut dyn TokenSource,
        out: &mut BegunIteration,
    ) -> Result<bool, ExecutorError> {
        assert!(
            self.awaiting_end.is_empty(),
            "ServerGroup::begin called twice without end"
        );
        let b = &mut self.bufs;
        // 1. Gather.
        b.fetch.clear();
        b.states.clear();
        for r in &mut self.ranks {
            let (t, state) = r.begin_iteration();
            b.fetch.push(t);
            b.states.push(state);
        }
        // 2. Fetch (rank 0 decides, broadcast).
        let mode = self.ranks[0].fetch_mode(&b.states);
        let Some(fetched) = fetch(mode) else {
            return Ok(false);
        };
        b.prefix.clear();
        b.matches.clear();
        for (r, t) in self.ranks.iter_mut().zip(b.fetch.drain(..)) {
            let (t, m) = r.on_fetch(t, &b.states, &fetched)?;
            b.prefix.push(t);
            b.matches.push(m);
        }
        // 3. Prefix matches (allgather) → route → pad intent (allreduce MAX).
        b.pad.clear();
        let mut intent = PadIntent::None;
        for (r, t) in self.ranks.iter_mut().zip(b.prefix.drain(..)) {
            let (t, i) = r.on_prefix_matches(t, &b.matches)?;
            intent = intent.max(i);
            b.pad.push(t);
        }
        // 4-5. Pad and schedule → vote (allgather).
        b.vote.clear();
        b.votes.clear();
        for (r, t) in self.ranks.iter_mut().zip(b.pad.drain(..)) {
            let (t, v) = r.on_pad_intent(t, intent);
            b.vote.push(t);
            b.votes.push(v);
        }
        // 6-7. Commit or roll back; launch; hand back the awaited output. The batch is
        // read in place on its rank; `out.launched` gets a copy into reused vectors.
        let mut launched = 0;
        out.forward_ran = false;
        b.forward.clear();
        for (r, t) in self.ranks.iter_mut().zip(b.vote.drain(..)) {
            let (t, can_queue, awaited) = r.vote(t, &b.votes)?;
            out.forward_ran = can_queue;
            if let Some(batch) = r.launched() {
                let mut sampled = self.spare_outputs.pop().unwrap_or(ForwardOutput {
                    batch: batch.number,
                    sampled: Vec::new(),
                });
                tokens.sample_into(batch, &mut sampled);
                self.outputs[r.rank().index()].push(sampled);
                match out.launched.get_mut(launched) {
                    Some(copy) => {
                        copy.number = batch.number;
                        copy.rank = batch.rank;
                        copy.entries.clear();
                        copy.entries.extend_from_slice(&batch.entries);
                    }
                    None => out.launched.push(batch.clone()),
                }
                launched += 1;
            }
            b.forward.push((t, awaited));
        }
        out.launched.truncate(launched);
        // 8. Update → responses (gather to rank 0).
        out.responses.clear();
        for (r, (t, awaited)) in self.ranks.iter_mut().zip(b.forward.drain(..)) {
            let pending = &mut self.outputs[r.rank().index()];
            let output = awaited.and_then(|n| {
                let at = pending.iter().position(|o| o.batch == n)?;
                Some(pending.remove(at))
            });
            let t = r.forward_output_into(t, output.as_ref(), &mut out.responses)?;
            self.spare_outputs.extend(output);
            self.awaiting_end.push(t);
        }
        Ok(true)
    }

    /// Phase 9 (the transfer consensus) and the §10 checks on every rank; closes the
    /// iteration [`ServerGroup::begin`] opened.
    pub fn end(&mut self) -> Result<Vec<IterationReport>, ExecutorError> {
        let mut reports = Vec::with_capacity(self.ranks.len());
        self.end_into(&mut reports)?;
        Ok(reports)
    }

    /// [`ServerGroup::end`] into `reports` (one per rank, overwritten), a vector the
    /// caller reuses.
    pub fn end_into(&mut self, reports: &mut Vec<IterationReport>) -> Result<(), ExecutorError> {
        assert_eq!(
            self.awaiting_end.len(),
            self.ranks.len(),
            "ServerGroup::end without begin"
        );
        let b = &mut self.bufs;
        b.transfers.clear();
        b.statuses.clear();
        for (r, t) in self.ranks.iter_mut().zip(self.awaiting_end.drain(..)) {
            let (t, status) = r.transfer_status(t);
            b.transfers.push(t);
            b.statuses.push(status);
        }
        // Reports are overwritten in place (their vectors reused), one per rank.
        reports.resize_with(self.ranks.len(), IterationReport::default);
        for ((r, t), report) in self
            .ranks
            .iter_mut()
            .zip(b.transfers.drain(..))
            .zip(reports.iter_mut())
        {
            r.transfer_result_into(t, &b.statuses, report)?;
        }
        Ok(())
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
