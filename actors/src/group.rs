//! All ranks of one server stepped through the iteration protocol in one thread, each
//! collective computed directly from the ranks' contributions. This is the host the
//! simulator and the message-level tests run; the threads and MPI drivers run the same
//! protocol with real collectives (one rank per thread or process). Neither spells out
//! the phase order: [`crate::executor::protocol`] does.

use crate::config::{ConfigError, Role, ServerConfig};
use crate::executor::{
    BatchVote, Exchange, ExecutorError, FetchBatch, FetchMode, ForwardOutput, Input, Io,
    IterationReport, PadIntent, PrefixMatches, RankExecutor, RankState, Response,
    ScheduledBatch, StopReason, TransferStatus,
};
use crate::executor::{CollectiveTag, Phase};
use crate::ids::{BatchNumber, RankId};
use crate::kv::mix;
use crate::policy::Policy;

/// A model backend as a host sees it: sampled tokens for a batch.
pub trait TokenSource {
    /// One sampled token per entry of `batch`, into `out` (whose buffer a source may
    /// reuse).
    fn sample_into(&mut self, batch: &ScheduledBatch, out: &mut ForwardOutput);

    /// [`TokenSource::sample_into`] into a new output.
    fn sample(&mut self, batch: &ScheduledBatch) -> ForwardOutput {
        let mut out = ForwardOutput {
            batch: batch.number,
            sampled: Vec::with_capacity(batch.entries.len()),
        };
        self.sample_into(batch, &mut out);
        out
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

/// A failure of the in-thread host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// A rank refused its input.
    #[error(transparent)]
    Executor(#[from] ExecutorError),
    /// Two ranks asked for different steps: the protocol diverged (a bug, reported
    /// rather than papered over).
    #[error("rank {rank} is at {got} while rank 0 is at {want}")]
    Diverged {
        /// The rank that differs.
        rank: RankId,
        /// What rank 0 needs.
        want: String,
        /// What this rank needs.
        got: String,
    },
}

/// What the whole server needs from its host next (the steps that are not collectives,
/// which the group computes itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupNeed {
    /// Rank 0 reads the ingress queue: answer with [`ServerGroup::provide_ingress`].
    ReadIngress(FetchMode),
    /// The forward step: [`ServerGroup::launched`] holds the batches launched (one per
    /// rank when the forward ran), [`ServerGroup::awaited`] the outputs each rank needs;
    /// answer with [`ServerGroup::provide_outputs`].
    Forward {
        /// Whether the forward ran (`can_queue`).
        forward_ran: bool,
    },
    /// The iteration ended: [`ServerGroup::reports`] and [`ServerGroup::responses`]
    /// hold it.
    IterationEnded,
    /// The server is drained.
    Finished,
    /// A fatal violation stopped every rank at the vote.
    Stopped(StopReason),
}

/// One iteration of a whole server (what [`ServerGroup::step`] returns).
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

/// The result of one [`ServerGroup::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupStep {
    /// Rank 0 would wait on the ingress queue and nothing was there: no iteration ran
    /// (the group stays at its ingress read).
    Idle,
    /// An iteration ran.
    Ran(GroupIteration),
    /// The server is drained.
    Finished,
    /// A fatal violation stopped the server.
    Stopped(StopReason),
}

/// All ranks of one server.
#[derive(Debug)]
pub struct ServerGroup {
    name: String,
    role: Role,
    ranks: Vec<RankExecutor>,
    warning: Option<String>,
    /// The batches launched at the last forward step (copies, in reused vectors).
    launched: Vec<ScheduledBatch>,
    /// Per rank: the output its forward step awaits.
    awaited: Vec<Option<BatchNumber>>,
    /// Responses gathered this iteration, rank order.
    responses: Vec<Response>,
    /// Per-rank reports of the iteration that ended last.
    reports: Vec<IterationReport>,
    /// Per rank: sampled outputs not handed back yet (at most two, under overlap).
    outputs: Vec<Vec<ForwardOutput>>,
    spare_outputs: Vec<ForwardOutput>,
    bufs: Collectives,
}

/// Collective results kept across iterations so that an iteration allocates nothing.
#[derive(Debug, Default)]
struct Collectives {
    states: Vec<RankState>,
    matches: Vec<PrefixMatches>,
    votes: Vec<BatchVote>,
    statuses: Vec<TransferStatus>,
}

/// What one rank's poll asked for, copied out of the borrow.
enum Asked {
    Exchange(CollectiveTag),
    ReadIngress(FetchMode),
    Forward,
    Ended,
    Finished,
    Stopped(StopReason),
}

impl Asked {
    fn describe(&self) -> String {
        match self {
            Asked::Exchange(tag) => format!("{} of iteration {}", tag.phase.name(), tag.iteration),
            Asked::ReadIngress(_) => "the ingress read".into(),
            Asked::Forward => "the forward".into(),
            Asked::Ended => "the iteration's end".into(),
            Asked::Finished => "finished".into(),
            Asked::Stopped(_) => "stopped".into(),
        }
    }
}

impl ServerGroup {
    /// Builds every rank. Fails on invalid values or a seat skew (unless the legacy
    /// switch turns it into [`ServerGroup::warning`]).
    pub fn new(server: &ServerConfig, policy: Policy) -> Result<ServerGroup, ConfigError> {
        let derived = server.derive(&policy)?;
        let ranks: Vec<RankExecutor> = (0..derived.sizes.dp)
            .map(|r| RankExecutor::new(RankId(r), server, &derived.sizes, policy))
            .collect();
        let dp = ranks.len();
        Ok(ServerGroup {
            name: server.name.clone(),
            role: server.role,
            ranks,
            warning: derived.warning,
            launched: Vec::new(),
            awaited: vec![None; dp],
            responses: Vec::new(),
            reports: (0..dp).map(|_| IterationReport::default()).collect(),
            outputs: (0..dp).map(|_| Vec::new()).collect(),
            spare_outputs: Vec::new(),
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

    /// The batches launched at the last forward step.
    pub fn launched(&self) -> &[ScheduledBatch] {
        &self.launched
    }

    /// Per rank, the output the last forward step awaits.
    pub fn awaited(&self) -> &[Option<BatchNumber>] {
        &self.awaited
    }

    /// Responses gathered to rank 0 in the iteration that ended last, rank order.
    pub fn responses(&self) -> &[Response] {
        &self.responses
    }

    /// Takes the gathered responses (the group keeps an empty vector).
    pub fn take_responses(&mut self) -> Vec<Response> {
        std::mem::take(&mut self.responses)
    }

    /// Hands back a response vector for reuse.
    pub fn recycle_responses(&mut self, mut v: Vec<Response>) {
        v.clear();
        if v.capacity() > self.responses.capacity() {
            self.responses = v;
        }
    }

    /// Per-rank reports of the iteration that ended last.
    pub fn reports(&self) -> &[IterationReport] {
        &self.reports
    }

    /// Whether every rank holds nothing and the replicated waiting queue is empty.
    pub fn is_empty(&self) -> bool {
        self.ranks
            .iter()
            .all(|r| r.active().is_empty() && r.sending().is_empty() && r.dummy().is_none())
            && self.ranks[0].waiting().is_empty()
    }

    /// Steps every rank until the server needs something other than a collective.
    pub fn advance(&mut self) -> Result<GroupNeed, GroupError> {
        loop {
            // Rank 0 decides what comes next; the other ranks must agree.
            let first = asked_of(self.ranks[0].poll());
            match first {
                Asked::Exchange(tag) => self.exchange(tag)?,
                Asked::ReadIngress(mode) => return Ok(GroupNeed::ReadIngress(mode)),
                Asked::Forward => return self.collect_forward(),
                Asked::Ended => return self.collect_reports(),
                Asked::Finished => {
                    self.expect_all(|a| matches!(a, Asked::Finished), &first)?;
                    return Ok(GroupNeed::Finished);
                }
                Asked::Stopped(why) => {
                    self.expect_all(|a| matches!(a, Asked::Stopped(_)), &Asked::Stopped(why.clone()))?;
                    // Report the crashed rank's violation, whichever rank it was.
                    let crashed = self.ranks.iter_mut().find_map(|r| match r.poll() {
                        Io::Stopped(StopReason::Crashed(v)) => Some(StopReason::Crashed(v.clone())),
                        _ => None,
                    });
                    return Ok(GroupNeed::Stopped(crashed.unwrap_or(why)));
                }
            }
        }
    }

    fn expect_all(&mut self, ok: impl Fn(&Asked) -> bool, want: &Asked) -> Result<(), GroupError> {
        for r in self.ranks.iter_mut().skip(1) {
            let got = asked_of(r.poll());
            if !ok(&got) {
                return Err(GroupError::Diverged {
                    rank: r.rank(),
                    want: want.describe(),
                    got: got.describe(),
                });
            }
        }
        Ok(())
    }

    fn diverged(rank: RankId, want: CollectiveTag, got: &Asked) -> GroupError {
        GroupError::Diverged {
            rank,
            want: Asked::Exchange(want).describe(),
            got: got.describe(),
        }
    }

    /// Runs one collective over every rank, computed in place. Rank 0 was polled
    /// already (a poll is repeatable until the input arrives).
    fn exchange(&mut self, tag: CollectiveTag) -> Result<(), GroupError> {
        let b = &mut self.bufs;
        match tag.phase {
            Phase::Gather => {
                b.states.clear();
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::States { tag: t, mine }) if t == tag => {
                            b.states.push(*mine)
                        }
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                }
                for r in &mut self.ranks {
                    r.handle(Input::States(&b.states))?;
                }
            }
            Phase::Fetch => {
                let fetched = match self.ranks[0].poll() {
                    Io::Exchange(Exchange::Fetch { mine: Some(f), .. }) => f.clone(),
                    other => {
                        let got = asked_of(other);
                        return Err(Self::diverged(RankId(0), tag, &got));
                    }
                };
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::Fetch { tag: t, .. }) if t == tag => {}
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                    r.handle(Input::Fetch(&fetched))?;
                }
            }
            Phase::PrefixMatch => {
                b.matches.clear();
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::PrefixMatches { tag: t, mine }) if t == tag => {
                            b.matches.push(mine.clone())
                        }
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                }
                for r in &mut self.ranks {
                    r.handle(Input::PrefixMatches(&b.matches))?;
                }
            }
            Phase::PadIntent => {
                let mut global = PadIntent::None;
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::PadIntent { tag: t, mine }) if t == tag => {
                            global = global.max(mine)
                        }
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                }
                for r in &mut self.ranks {
                    r.handle(Input::PadIntent(global))?;
                }
            }
            Phase::Vote => {
                b.votes.clear();
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::Votes { tag: t, mine }) if t == tag => {
                            b.votes.push(*mine)
                        }
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                }
                for r in &mut self.ranks {
                    r.handle(Input::Votes(&b.votes))?;
                }
            }
            Phase::Responses => {
                self.responses.clear();
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::Responses { tag: t, mine }) if t == tag => {
                            if self.responses.is_empty() {
                                // Swap rather than copy: the vectors trade buffers.
                                std::mem::swap(&mut self.responses, &mut mine.responses);
                            } else {
                                self.responses.append(&mut mine.responses);
                            }
                        }
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                }
                for r in &mut self.ranks {
                    r.handle(Input::ResponsesGathered)?;
                }
            }
            Phase::Transfers => {
                b.statuses.clear();
                for r in &mut self.ranks {
                    match r.poll() {
                        Io::Exchange(Exchange::TransferStatus { tag: t, mine }) if t == tag => {
                            b.statuses.push(mine.clone())
                        }
                        other => {
                            let got = asked_of(other);
                            return Err(Self::diverged(r.rank(), tag, &got));
                        }
                    }
                }
                for r in &mut self.ranks {
                    r.handle(Input::TransferStatus(&b.statuses))?;
                }
            }
        }
        Ok(())
    }

    fn collect_forward(&mut self) -> Result<GroupNeed, GroupError> {
        let mut n = 0;
        for (i, r) in self.ranks.iter_mut().enumerate() {
            match r.poll() {
                Io::Forward {
                    launch,
                    await_output,
                } => {
                    self.awaited[i] = await_output;
                    if let Some(batch) = launch {
                        match self.launched.get_mut(n) {
                            Some(copy) => {
                                copy.number = batch.number;
                                copy.rank = batch.rank;
                                copy.entries.clear();
                                copy.entries.extend_from_slice(&batch.entries);
                            }
                            None => self.launched.push(batch.clone()),
                        }
                        n += 1;
                    }
                }
                other => {
                    let got = asked_of(other);
                    return Err(GroupError::Diverged {
                        rank: r.rank(),
                        want: "the forward".into(),
                        got: got.describe(),
                    });
                }
            }
        }
        self.launched.truncate(n);
        Ok(GroupNeed::Forward {
            forward_ran: n == self.ranks.len() && n > 0,
        })
    }

    /// Every rank's report of the iteration that just ended (rank 0's was announced by
    /// the poll that found it; `IterationEnded` is returned once).
    fn collect_reports(&mut self) -> Result<GroupNeed, GroupError> {
        for (i, (r, report)) in self.ranks.iter_mut().zip(self.reports.iter_mut()).enumerate() {
            let ended = i == 0 || matches!(r.poll(), Io::IterationEnded(_));
            match ended {
                true => {
                    let rep = r.last_report();
                    // Overwritten in place: the report's vectors are reused.
                    report.stats = rep.stats.clone();
                    report.violations.clear();
                    report.violations.extend_from_slice(&rep.violations);
                    report.transfer_commands.clear();
                    report
                        .transfer_commands
                        .extend_from_slice(&rep.transfer_commands);
                }
                false => {
                    return Err(GroupError::Diverged {
                        rank: r.rank(),
                        want: "the iteration's end".into(),
                        got: "another step".into(),
                    });
                }
            }
        }
        Ok(GroupNeed::IterationEnded)
    }

    /// Rank 0's ingress read.
    pub fn provide_ingress(&mut self, read: FetchBatch) -> Result<(), GroupError> {
        Ok(self.ranks[0].handle(Input::Ingress(read))?)
    }

    /// Samples every launched batch with `tokens` and keeps the outputs until a rank
    /// awaits them (the stand-in device of an in-thread host).
    pub fn sample_launched(&mut self, tokens: &mut dyn TokenSource) {
        for batch in &self.launched {
            let mut out = self.spare_outputs.pop().unwrap_or(ForwardOutput {
                batch: batch.number,
                sampled: Vec::new(),
            });
            tokens.sample_into(batch, &mut out);
            self.outputs[batch.rank.index()].push(out);
        }
    }

    /// Hands every rank the output it awaits (sampled earlier by
    /// [`ServerGroup::sample_launched`]).
    pub fn provide_outputs(&mut self) -> Result<(), GroupError> {
        for (i, r) in self.ranks.iter_mut().enumerate() {
            let pending = &mut self.outputs[i];
            let output = self.awaited[i].and_then(|n| {
                let at = pending.iter().position(|o| o.batch == n)?;
                Some(pending.remove(at))
            });
            r.handle(Input::Output(output.as_ref()))?;
            self.spare_outputs.extend(output);
        }
        Ok(())
    }

    /// Runs one whole iteration: `fetch` is rank 0's ingress read (given the mode, what
    /// it read, or `None` when a wait found nothing: then no iteration runs and the
    /// group stays at its read), `tokens` samples every launched batch.
    pub fn step(
        &mut self,
        fetch: &mut dyn FnMut(FetchMode) -> Option<FetchBatch>,
        tokens: &mut dyn TokenSource,
    ) -> Result<GroupStep, GroupError> {
        let mut iteration = None;
        let mut forward_ran = false;
        loop {
            match self.advance()? {
                GroupNeed::ReadIngress(mode) => {
                    iteration.get_or_insert(self.ranks[0].iteration());
                    let Some(read) = fetch(mode) else {
                        return Ok(GroupStep::Idle);
                    };
                    self.provide_ingress(read)?;
                }
                GroupNeed::Forward { forward_ran: ran } => {
                    forward_ran = ran;
                    self.sample_launched(tokens);
                    self.provide_outputs()?;
                }
                GroupNeed::IterationEnded => {
                    return Ok(GroupStep::Ran(GroupIteration {
                        iteration: iteration.unwrap_or(self.reports[0].stats.iteration),
                        forward_ran,
                        launched: self.launched.clone(),
                        responses: self.take_responses(),
                        reports: self.reports.clone(),
                    }));
                }
                GroupNeed::Finished => return Ok(GroupStep::Finished),
                GroupNeed::Stopped(why) => return Ok(GroupStep::Stopped(why)),
            }
        }
    }
}

fn asked_of(io: Io<'_>) -> Asked {
    match io {
        Io::Exchange(x) => Asked::Exchange(x.tag()),
        Io::ReadIngress(mode) => Asked::ReadIngress(mode),
        Io::Forward { .. } => Asked::Forward,
        Io::IterationEnded(_) => Asked::Ended,
        Io::Finished => Asked::Finished,
        Io::Stopped(why) => Asked::Stopped(why.clone()),
    }
}
