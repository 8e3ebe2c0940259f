//! All ranks of one server stepped through the iteration protocol in one thread, each
//! collective computed directly from the ranks' contributions. This is the host the
//! simulator and the message-level tests run; the threads and MPI drivers run the same
//! protocol with real collectives (one rank per thread or process). Neither spells out
//! the phase order: [`crate::executor::protocol`] does.

use crate::config::{ConfigError, Role, ServerConfig};
use crate::executor::{
    BatchVote, Exchange, ExecutorError, FetchBatch, FetchMode, ForwardOutput, Input, Io,
    IterationReport, PrefixMatches, RankExecutor, RankResponses, RankState, ScheduledBatch,
    StopReason, TransferStatus,
};
use crate::executor::{CollectiveTag, Phase};
use crate::ids::{BatchNumber, RankId};
use crate::policy::Policy;
use crate::token_path::deterministic_token;
use crate::vocab::{PadIntent, Response};

mod coast;

/// A model backend as a host sees it: sampled tokens for a batch.
///
/// The batch is all a source reads: a real model finds each entry's block table,
/// prompt and sampling in it ([`ScheduledBatch::inputs`], which the executor fills at
/// launch when [`TokenSource::reads_forward_inputs`] says so), never the rank.
pub trait TokenSource {
    /// One sampled token per entry of `batch`, into `out` (whose buffer a source may
    /// reuse).
    fn sample_into(
        &mut self,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), ForwardError>;

    /// Whether the source reads the batch's [`crate::executor::ForwardInputs`] (block
    /// tables, prompts): the host then asks its executors to fill them
    /// ([`RankExecutor::set_forward_inputs`]). A source that reads only the entries
    /// says no (the default).
    fn reads_forward_inputs(&self) -> bool {
        false
    }

    /// The token this source samples for a request at an output position along a
    /// path ([`crate::executor::ForwardEntry`]'s `id`, `position`, `path`), where that
    /// is all it reads (a deterministic backend): a host may then compute a stretch of
    /// steps without batches (`executor::stretch`). `None` (the default) for a model.
    fn pure_token(&self) -> Option<fn(u64, u32, u64) -> u32> {
        None
    }

    /// [`TokenSource::sample_into`] into a new output.
    fn sample(&mut self, batch: &ScheduledBatch) -> Result<ForwardOutput, ForwardError> {
        let mut out = ForwardOutput {
            batch: batch.number,
            sampled: Vec::with_capacity(batch.entries.len()),
            logprobs: Vec::new(),
        };
        self.sample_into(batch, &mut out)?;
        Ok(out)
    }
}

/// A forward the model backend could not run (a model error, a token history it lacks).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("forward of batch {batch} on rank {rank} failed: {reason}")]
pub struct ForwardError {
    /// The rank.
    pub rank: RankId,
    /// The batch.
    pub batch: BatchNumber,
    /// Why.
    pub reason: String,
}

/// Deterministic tokens: `mix(id, position, path)`, so token streams can be compared
/// across drivers, and a stream proves where it was computed, not only its length: a
/// request routed to another rank (or, on an aggregated server, run in another
/// iteration) gets other tokens.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeterministicTokens;

impl TokenSource for DeterministicTokens {
    fn sample_into(
        &mut self,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), ForwardError> {
        out.batch = batch.number;
        out.sampled.clear();
        out.sampled.extend(
            batch
                .entries
                .iter()
                .map(|e| deterministic_token(e.id.0, e.position, e.path)),
        );
        Ok(())
    }

    fn pure_token(&self) -> Option<fn(u64, u32, u64) -> u32> {
        Some(deterministic_token)
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
    /// The model backend failed a forward.
    #[error(transparent)]
    Forward(#[from] ForwardError),
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
    /// What each rank asked for at its last poll (its contribution is in `bufs`).
    asks: Vec<Asked>,
    bufs: Collectives,
    /// How many ranks launched a batch at the last forward step.
    n_launched: usize,
    /// Per rank: the output its forward step awaits.
    awaited: Vec<Option<BatchNumber>>,
    /// Responses gathered this iteration, rank order.
    responses: Vec<Response>,
    /// Which rank's responses each range of `responses` holds.
    response_ranks: Vec<(RankId, std::ops::Range<usize>)>,
    /// Per rank: sampled outputs not handed back yet (at most two, under overlap).
    outputs: Vec<Vec<ForwardOutput>>,
    spare_outputs: Vec<ForwardOutput>,
    /// Every rank's batch shape, from the last votes.
    shapes: Vec<crate::executor::BatchShape>,
    /// Per rank while coasting: its counts and `expected` (`coast.rs`).
    coast: Vec<(crate::counts::RankCounts, u32)>,
    /// Per rank while coasting in closed form: its part of the stretch (`coast.rs`).
    stretch: Vec<crate::executor::RankStretch>,
}

/// The ranks' contributions to the collective they ask for, copied out as each rank is
/// polled; kept across iterations so that an iteration allocates nothing.
#[derive(Debug, Default)]
struct Collectives {
    states: Vec<RankState>,
    fetched: Option<FetchBatch>,
    matches: Vec<PrefixMatches>,
    intent: PadIntent,
    votes: Vec<BatchVote>,
    statuses: Vec<TransferStatus>,
}

/// What one rank's poll asked for, copied out of the borrow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// Nothing polled yet, or an `IterationEnded` already consumed.
    Nothing,
    Exchange(CollectiveTag),
    ReadIngress(FetchMode),
    Forward,
    Ended,
    Finished,
    Stopped,
}

impl Asked {
    fn describe(&self) -> String {
        match self {
            Asked::Nothing => "nothing".into(),
            Asked::Exchange(tag) => format!("{} of iteration {}", tag.phase.name(), tag.iteration),
            Asked::ReadIngress(_) => "the ingress read".into(),
            Asked::Forward => "the forward".into(),
            Asked::Ended => "the iteration's end".into(),
            Asked::Finished => "finished".into(),
            Asked::Stopped => "stopped".into(),
        }
    }
}

/// The parts of the group one rank's poll writes into.
struct Sink<'a> {
    bufs: &'a mut Collectives,
    n_launched: &'a mut usize,
    awaited: &'a mut [Option<BatchNumber>],
    responses: &'a mut Vec<Response>,
    response_ranks: &'a mut Vec<(RankId, std::ops::Range<usize>)>,
}

impl Sink<'_> {
    /// Moves rank `i`'s responses into the gathered ones (rank 0 starts them afresh).
    #[inline]
    fn take_responses(&mut self, i: usize, mine: &mut RankResponses) {
        if i == 0 {
            self.responses.clear();
            self.response_ranks.clear();
        }
        let start = self.responses.len();
        if self.responses.is_empty() {
            // Swap rather than copy: the vectors trade buffers.
            std::mem::swap(self.responses, &mut mine.responses);
        } else {
            self.responses.append(&mut mine.responses);
        }
        if self.responses.len() > start {
            self.response_ranks
                .push((RankId(i as u32), start..self.responses.len()));
        }
    }
}

/// Polls rank `i` and copies what it contributes into the sink (one pass per phase:
/// each rank is polled right after it handled the previous result, while its state is
/// in cache).
#[inline]
fn collect(rank: &mut RankExecutor, i: usize, sink: &mut Sink<'_>) -> Asked {
    match rank.poll() {
        Io::Exchange(x) => {
            let tag = x.tag();
            let b = &mut *sink.bufs;
            match x {
                Exchange::States { mine, .. } => b.states[i] = *mine,
                Exchange::Fetch { mine, .. } => {
                    if let Some(f) = mine {
                        b.fetched = Some(f.clone());
                    }
                }
                Exchange::PrefixMatches { mine, .. } => {
                    b.matches[i].tokens.clone_from(&mine.tokens)
                }
                Exchange::PadIntent { mine, .. } => {
                    if i == 0 {
                        b.intent = PadIntent::None;
                    }
                    b.intent = b.intent.max(mine);
                }
                Exchange::Votes { mine, .. } => b.votes[i] = *mine,
                Exchange::Responses { mine, .. } => sink.take_responses(i, mine),
                Exchange::TransferStatus {
                    mine, responses, ..
                } => {
                    b.statuses[i].events.clone_from(&mine.events);
                    sink.take_responses(i, responses);
                }
            }
            Asked::Exchange(tag)
        }
        Io::ReadIngress(mode) => Asked::ReadIngress(mode),
        Io::Forward {
            launch,
            await_output,
            ..
        } => {
            if i == 0 {
                *sink.n_launched = 0;
            }
            sink.awaited[i] = await_output;
            if launch.is_some() {
                *sink.n_launched += 1;
            }
            Asked::Forward
        }
        // Read in place afterwards (`RankExecutor::last_report`).
        Io::IterationEnded(_) => Asked::Ended,
        Io::Finished => Asked::Finished,
        Io::Stopped(_) => Asked::Stopped,
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
            asks: vec![Asked::Nothing; dp],
            bufs: Collectives {
                states: vec![RankState::default(); dp],
                fetched: None,
                matches: vec![PrefixMatches::default(); dp],
                intent: PadIntent::None,
                votes: vec![BatchVote::default(); dp],
                statuses: vec![TransferStatus::default(); dp],
            },
            n_launched: 0,
            awaited: vec![None; dp],
            responses: Vec::new(),
            response_ranks: Vec::new(),
            outputs: (0..dp).map(|_| Vec::new()).collect(),
            spare_outputs: Vec::new(),
            shapes: Vec::new(),
            coast: Vec::new(),
            stretch: Vec::new(),
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

    /// Whether every rank's launched batches carry their forward inputs
    /// ([`RankExecutor::set_forward_inputs`]): on for a token source that reads them
    /// ([`TokenSource::reads_forward_inputs`]).
    pub fn set_forward_inputs(&mut self, on: bool) {
        for r in &mut self.ranks {
            r.set_forward_inputs(on);
        }
    }

    /// The batches launched at the forward step the group is at.
    pub fn launched(&self) -> impl Iterator<Item = &ScheduledBatch> {
        self.ranks.iter().filter_map(RankExecutor::launched)
    }

    /// Every rank's batch shape at the forward step the group is at (from the votes).
    pub fn shapes(&self) -> &[crate::executor::BatchShape] {
        &self.shapes
    }

    /// Per rank, the output the last forward step awaits.
    pub fn awaited(&self) -> &[Option<BatchNumber>] {
        &self.awaited
    }

    /// Responses gathered to rank 0 in the iteration that ended last, rank order.
    pub fn responses(&self) -> &[Response] {
        &self.responses
    }

    /// The gathered responses with the rank each range came from, mutably (a front
    /// rewrites them in place).
    pub fn responses_by_rank(&mut self) -> (&mut [Response], &[(RankId, std::ops::Range<usize>)]) {
        (&mut self.responses, &self.response_ranks)
    }

    /// Takes the gathered responses (the group keeps an empty vector).
    pub fn take_responses(&mut self) -> Vec<Response> {
        std::mem::take(&mut self.responses)
    }

    /// Per-rank reports of the iteration that ended last, rank order.
    pub fn reports(&self) -> impl Iterator<Item = &IterationReport> {
        self.ranks.iter().map(RankExecutor::last_report)
    }

    /// Whether every rank holds nothing and the replicated waiting queue is empty.
    pub fn is_empty(&self) -> bool {
        self.ranks
            .iter()
            .all(|r| r.active().is_empty() && r.sending().is_empty() && r.dummy().is_none())
            && self.ranks[0].waiting().is_empty()
    }

    /// Polls rank `i` into the buffers.
    #[inline]
    fn collect(&mut self, i: usize) {
        let mut sink = Sink {
            bufs: &mut self.bufs,
            n_launched: &mut self.n_launched,
            awaited: &mut self.awaited,
            responses: &mut self.responses,
            response_ranks: &mut self.response_ranks,
        };
        self.asks[i] = collect(&mut self.ranks[i], i, &mut sink);
    }

    /// Hands every rank the input `make` builds from the collected contributions, and
    /// collects what each asks next.
    fn handle_all(&mut self, make: impl Fn(&Collectives) -> InputKind) -> Result<(), GroupError> {
        let kind = make(&self.bufs);
        let fetched = self.bufs.fetched.take();
        for i in 0..self.ranks.len() {
            let b = &self.bufs;
            let input = match &kind {
                InputKind::States => Input::States(&b.states),
                InputKind::Fetch => Input::Fetch(fetched.as_ref().expect("rank 0 broadcast")),
                InputKind::PrefixMatches => Input::PrefixMatches(&b.matches),
                InputKind::PadIntent(g) => Input::PadIntent(*g),
                InputKind::Votes => Input::Votes(&b.votes),
                InputKind::Responses => Input::ResponsesGathered,
                InputKind::TransferStatus => Input::TransferStatus(&b.statuses),
            };
            self.ranks[i].handle(input)?;
            // No step is followed by itself, so this rank's next contribution goes to
            // other buffers than the ones this input reads: collect it now, while the
            // rank is in cache.
            self.collect(i);
        }
        Ok(())
    }

    /// Steps every rank until the server needs something other than a collective.
    pub fn advance(&mut self) -> Result<GroupNeed, GroupError> {
        loop {
            if self.asks[0] == Asked::Nothing {
                for i in 0..self.ranks.len() {
                    self.collect(i);
                }
            }
            let first = self.asks[0];
            match &first {
                Asked::Exchange(tag) => {
                    self.expect_all(&first)?;
                    let kind = match tag.phase {
                        Phase::Gather => InputKind::States,
                        Phase::Fetch => InputKind::Fetch,
                        Phase::PrefixMatch => InputKind::PrefixMatches,
                        Phase::PadIntent => InputKind::PadIntent(self.bufs.intent),
                        Phase::Vote => {
                            self.shapes.clear();
                            self.shapes.extend(self.bufs.votes.iter().map(|v| v.shape));
                            InputKind::Votes
                        }
                        Phase::Responses => InputKind::Responses,
                        Phase::Transfers => InputKind::TransferStatus,
                    };
                    self.handle_all(|_| kind)?;
                }
                // The other ranks already wait in the fetch broadcast.
                Asked::ReadIngress(mode) => return Ok(GroupNeed::ReadIngress(*mode)),
                Asked::Forward => {
                    self.expect_all(&first)?;
                    let n = self.n_launched;
                    return Ok(GroupNeed::Forward {
                        forward_ran: n == self.ranks.len() && n > 0,
                    });
                }
                Asked::Ended => {
                    self.expect_all(&first)?;
                    // Consumed: the next advance opens the next iteration.
                    self.asks.iter_mut().for_each(|a| *a = Asked::Nothing);
                    return Ok(GroupNeed::IterationEnded);
                }
                Asked::Finished => {
                    self.expect_all(&first)?;
                    return Ok(GroupNeed::Finished);
                }
                Asked::Stopped => {
                    // Report the crashed rank's violation, whichever rank it was.
                    let mut reason = None;
                    for r in &mut self.ranks {
                        if let Io::Stopped(why) = r.poll() {
                            let crashed = matches!(why, StopReason::Crashed(_));
                            if crashed || reason.is_none() {
                                reason = Some(why.clone());
                            }
                            if crashed {
                                break;
                            }
                        }
                    }
                    return Ok(GroupNeed::Stopped(reason.expect("rank 0 stopped")));
                }
                Asked::Nothing => unreachable!("collected above"),
            }
        }
    }

    /// Every rank must ask what rank 0 asks.
    fn expect_all(&self, want: &Asked) -> Result<(), GroupError> {
        for (i, got) in self.asks.iter().enumerate().skip(1) {
            let same = match (want, got) {
                (Asked::Exchange(a), Asked::Exchange(b)) => a == b,
                (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
            };
            if !same {
                return Err(GroupError::Diverged {
                    rank: RankId(i as u32),
                    want: want.describe(),
                    got: got.describe(),
                });
            }
        }
        Ok(())
    }

    /// Rank 0's ingress read.
    pub fn provide_ingress(&mut self, read: FetchBatch) -> Result<(), GroupError> {
        self.ranks[0].handle(Input::Ingress(read))?;
        self.collect(0);
        Ok(())
    }

    /// Samples every launched batch with `tokens` and keeps the outputs until a rank
    /// awaits them (the stand-in device of an in-thread host).
    pub fn sample_launched(&mut self, tokens: &mut dyn TokenSource) -> Result<(), GroupError> {
        for exec in &self.ranks {
            let Some(batch) = exec.launched() else {
                continue;
            };
            let mut out = self.spare_outputs.pop().unwrap_or(ForwardOutput {
                batch: batch.number,
                sampled: Vec::new(),
                logprobs: Vec::new(),
            });
            tokens.sample_into(batch, &mut out)?;
            self.outputs[batch.rank.index()].push(out);
        }
        Ok(())
    }

    /// Hands every rank the output it awaits (sampled earlier by
    /// [`ServerGroup::sample_launched`]).
    pub fn provide_outputs(&mut self) -> Result<(), GroupError> {
        for i in 0..self.ranks.len() {
            let pending = &mut self.outputs[i];
            let output = self.awaited[i].and_then(|n| {
                let at = pending.iter().position(|o| o.batch == n)?;
                Some(pending.remove(at))
            });
            self.ranks[i].handle(Input::Output(output.as_ref()))?;
            self.spare_outputs.extend(output);
            self.collect(i);
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
        let mut forward_ran = false;
        let mut launched = Vec::new();
        loop {
            match self.advance()? {
                GroupNeed::ReadIngress(mode) => {
                    let Some(read) = fetch(mode) else {
                        return Ok(GroupStep::Idle);
                    };
                    self.provide_ingress(read)?;
                }
                GroupNeed::Forward { forward_ran: ran } => {
                    forward_ran = ran;
                    launched = self.launched().cloned().collect();
                    self.sample_launched(tokens)?;
                    self.provide_outputs()?;
                }
                GroupNeed::IterationEnded => {
                    let reports: Vec<IterationReport> = self.reports().cloned().collect();
                    return Ok(GroupStep::Ran(GroupIteration {
                        iteration: reports[0].stats.iteration,
                        forward_ran,
                        launched: std::mem::take(&mut launched),
                        responses: self.take_responses(),
                        reports,
                    }));
                }
                GroupNeed::Finished => return Ok(GroupStep::Finished),
                GroupNeed::Stopped(why) => return Ok(GroupStep::Stopped(why)),
            }
        }
    }
}

/// Which input the collected contributions make.
#[derive(Debug, Clone, Copy)]
enum InputKind {
    States,
    Fetch,
    PrefixMatches,
    PadIntent(PadIntent),
    Votes,
    Responses,
    TransferStatus,
}
