//! The iteration protocol (mechanisms.md §3): the one place where the order of an
//! iteration's steps is written down. Every host — the simulator's server stepper, the
//! threads and MPI rank host, the overhead benchmark, the loom model — runs it through
//! [`RankExecutor::poll`] and [`RankExecutor::handle`]; none spells the order out.
//!
//! One iteration, on every rank (a step in brackets runs only when the server's
//! [`CollectiveSchedule`] has it):
//!
//! 1. `Gather` — allgather [`RankState`]. If the server is drained: [`Io::Finished`].
//! 2. rank 0: [`Io::ReadIngress`] with the idle decision's [`FetchMode`]; then `Fetch` —
//!    broadcast rank 0's [`FetchBatch`]; every rank appends it to its replicated waiting
//!    queue and admits FIFO within `capacity − Σ routable`.
//! 3. [`PrefixMatch` — allgather this rank's cached-prefix matches]; route the admitted
//!    requests (every rank computes the same assignment); the §10 cap check.
//! 4. [`PadIntent` — allreduce MAX of the forward intent]; pad (§6); schedule (§4).
//! 5. `Vote` — allgather [`BatchVote`]: `can_queue` when no rank scheduled zero; commit
//!    or roll back the dummy; a fatal violation on any rank stops every rank here
//!    ([`Io::Stopped`]).
//! 6. [`Io::Forward`]: launch the batch (if `can_queue`) and hand back the awaited
//!    output (this batch's without overlap, the previous one's with it); update states,
//!    finish requests, produce responses.
//! 7. `Responses` — gather [`RankResponses`] to rank 0; or, on a server that transfers
//!    KV, `Transfers` in its place — allgather the responses with [`TransferStatus`]
//!    (both ready here: one round trip), then apply this rank's transfer events.
//! 9. The §10 checks; [`Io::IterationEnded`] with the [`IterationReport`].

use crate::counts::RankCounts;
use crate::invariants::Violation;

use super::messages::*;
use super::{ExecutorError, IterationReport, RankExecutor};
use crate::vocab::*;

/// Why a rank left its loop early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// This rank hit a violation that crashes the real executor.
    Crashed(Violation),
    /// Another rank did; this one stopped at the same point.
    PeerCrashed {
        /// The rank that crashed.
        peer: RankId,
    },
}

use crate::ids::{BatchNumber, RankId};

/// A collective to run: its tag (iteration and phase, from which the kind follows:
/// [`Phase::op`]) and this rank's contribution.
#[derive(Debug)]
pub enum Exchange<'a> {
    /// Allgather of every rank's state.
    States {
        /// Tag.
        tag: CollectiveTag,
        /// This rank's state.
        mine: &'a RankState,
    },
    /// Broadcast of rank 0's ingress read.
    Fetch {
        /// Tag.
        tag: CollectiveTag,
        /// Rank 0's read; `None` on the other ranks.
        mine: Option<&'a FetchBatch>,
    },
    /// Allgather of prefix matches.
    PrefixMatches {
        /// Tag.
        tag: CollectiveTag,
        /// This rank's matches.
        mine: &'a PrefixMatches,
    },
    /// Allreduce MAX of the forward intent.
    PadIntent {
        /// Tag.
        tag: CollectiveTag,
        /// This rank's intent.
        mine: PadIntent,
    },
    /// Allgather of the votes.
    Votes {
        /// Tag.
        tag: CollectiveTag,
        /// This rank's vote.
        mine: &'a BatchVote,
    },
    /// Gather of the responses to rank 0. A host may move the responses out (a host that
    /// computes the collective in place does): the executor clears them afterwards.
    Responses {
        /// Tag.
        tag: CollectiveTag,
        /// This rank's responses.
        mine: &'a mut RankResponses,
    },
    /// Allgather of the transfer status with the responses (which only rank 0 uses). A
    /// host may move the responses out, as for [`Exchange::Responses`].
    TransferStatus {
        /// Tag.
        tag: CollectiveTag,
        /// This rank's status.
        mine: &'a TransferStatus,
        /// This rank's responses.
        responses: &'a mut RankResponses,
    },
}

impl Exchange<'_> {
    /// The collective's tag.
    pub fn tag(&self) -> CollectiveTag {
        match self {
            Exchange::States { tag, .. }
            | Exchange::Fetch { tag, .. }
            | Exchange::PrefixMatches { tag, .. }
            | Exchange::PadIntent { tag, .. }
            | Exchange::Votes { tag, .. }
            | Exchange::Responses { tag, .. }
            | Exchange::TransferStatus { tag, .. } => *tag,
        }
    }
}

/// What the executor needs from its host next.
#[derive(Debug)]
pub enum Io<'a> {
    /// Run this collective and hand its result back.
    Exchange(Exchange<'a>),
    /// Rank 0: read the ingress queue as the mode says and hand back what was read as
    /// [`Input::Ingress`].
    ReadIngress(FetchMode),
    /// Launch `launch` (if any) on the device, then hand back the output of
    /// `await_output` (if any) as [`Input::Output`]. What the iteration costs follows
    /// from every rank's [`BatchVote::shape`], which the host has from the vote's result
    /// (the same on every rank).
    Forward {
        /// The batch to launch now: everything its forward needs (with its
        /// [`ForwardInputs`] when the host asked for them,
        /// [`RankExecutor::set_forward_inputs`]); a device reads nothing else of the
        /// rank.
        launch: Option<&'a ScheduledBatch>,
        /// The batch whose output the update needs: this one without overlap, the
        /// previous one with it.
        await_output: Option<BatchNumber>,
    },
    /// The iteration ended (returned once; the next poll opens the next iteration).
    IterationEnded(&'a IterationReport),
    /// The server is drained (a shutdown was read and nothing is left): leave the loop.
    Finished,
    /// A fatal violation stopped every rank of the server at this iteration's vote.
    Stopped(&'a StopReason),
}

/// An answer to the last [`Io`].
#[derive(Debug)]
pub enum Input<'a> {
    /// The states allgather.
    States(&'a [RankState]),
    /// Rank 0's ingress read.
    Ingress(FetchBatch),
    /// The fetch broadcast.
    Fetch(&'a FetchBatch),
    /// The prefix-match allgather.
    PrefixMatches(&'a [PrefixMatches]),
    /// The pad-intent allreduce.
    PadIntent(PadIntent),
    /// The vote allgather.
    Votes(&'a [BatchVote]),
    /// The awaited forward output (`None` when nothing was awaited).
    Output(Option<&'a ForwardOutput>),
    /// The responses gather completed (rank 0's host has them).
    ResponsesGathered,
    /// The transfer-status allgather.
    TransferStatus(&'a [TransferStatus]),
}

impl Input<'_> {
    fn name(&self) -> &'static str {
        match self {
            Input::States(_) => "the states",
            Input::Ingress(_) => "an ingress read",
            Input::Fetch(_) => "the fetch broadcast",
            Input::PrefixMatches(_) => "the prefix matches",
            Input::PadIntent(_) => "the pad intent",
            Input::Votes(_) => "the votes",
            Input::Output(_) => "a forward output",
            Input::ResponsesGathered => "the responses gather",
            Input::TransferStatus(_) => "the transfer status",
        }
    }
}

/// Where a rank is in its iteration, with the small data that moves from one step to
/// the next (vectors travel in the iteration's data, so a step changes no heap state
/// here).
#[derive(Debug, Clone, Copy)]
pub(super) enum Stage {
    /// Between iterations: the next poll opens one.
    Open,
    /// Awaiting the states allgather (this rank's in the iteration's data).
    Gather,
    /// Rank 0: awaiting the ingress read.
    ReadIngress(FetchMode),
    /// Awaiting the fetch broadcast (rank 0 holds its read in the iteration's data).
    Fetch,
    /// Awaiting the prefix matches (this rank's in the iteration's data).
    PrefixMatch,
    /// Awaiting the pad intent.
    PadIntent(PadIntent),
    /// Awaiting the votes (this rank's in the iteration's data).
    Vote,
    /// Awaiting the forward output.
    Forward,
    /// Awaiting the responses gather.
    Responses,
    /// Awaiting the transfer status (this rank's in the iteration's data).
    Transfers,
    /// The iteration ended; the report is ready.
    Ended,
    /// The server is drained.
    Finished,
    /// Stopped by a fatal violation (why: `RankExecutor::stop`).
    Stopped,
}

impl Stage {
    fn name(&self) -> &'static str {
        match self {
            Stage::Open => "the iteration to open",
            Stage::Gather => "the states",
            Stage::ReadIngress(_) => "an ingress read",
            Stage::Fetch => "the fetch broadcast",
            Stage::PrefixMatch => "the prefix matches",
            Stage::PadIntent(_) => "the pad intent",
            Stage::Vote => "the votes",
            Stage::Forward => "a forward output",
            Stage::Responses => "the responses gather",
            Stage::Transfers => "the transfer status",
            Stage::Ended => "the next poll",
            Stage::Finished => "nothing (finished)",
            Stage::Stopped => "nothing (stopped)",
        }
    }
}

impl RankExecutor {
    /// What this rank needs next. Between iterations it opens the next one (its gather).
    #[inline]
    pub fn poll(&mut self) -> Io<'_> {
        match self.stage {
            Stage::Open => {
                self.iter.state = self.open_iteration();
                self.stage = Stage::Gather;
            }
            Stage::Ended => {
                self.stage = Stage::Open;
                return Io::IterationEnded(&self.report);
            }
            _ => {}
        }
        let iteration = self.iteration;
        let tag = |phase| CollectiveTag { iteration, phase };
        match &mut self.stage {
            Stage::Gather => Io::Exchange(Exchange::States {
                tag: tag(Phase::Gather),
                mine: &self.iter.state,
            }),
            Stage::ReadIngress(mode) => Io::ReadIngress(*mode),
            Stage::Fetch => Io::Exchange(Exchange::Fetch {
                tag: tag(Phase::Fetch),
                mine: self.iter.read.as_ref(),
            }),
            Stage::PrefixMatch => Io::Exchange(Exchange::PrefixMatches {
                tag: tag(Phase::PrefixMatch),
                mine: &self.iter.matches,
            }),
            Stage::PadIntent(i) => Io::Exchange(Exchange::PadIntent {
                tag: tag(Phase::PadIntent),
                mine: *i,
            }),
            Stage::Vote => Io::Exchange(Exchange::Votes {
                tag: tag(Phase::Vote),
                mine: &self.iter.vote,
            }),
            Stage::Forward => Io::Forward {
                launch: self.iter.launched.as_ref(),
                await_output: self.iter.awaited,
            },
            Stage::Responses => Io::Exchange(Exchange::Responses {
                tag: tag(Phase::Responses),
                mine: &mut self.iter.responses,
            }),
            Stage::Transfers => Io::Exchange(Exchange::TransferStatus {
                tag: tag(Phase::Transfers),
                mine: &self.iter.status,
                responses: &mut self.iter.responses,
            }),
            Stage::Finished => Io::Finished,
            Stage::Stopped => Io::Stopped(self.stop.as_ref().expect("a stopped rank says why")),
            Stage::Open | Stage::Ended => unreachable!("handled above"),
        }
    }

    /// Hands back the answer to the last [`RankExecutor::poll`]. An input the executor
    /// did not ask for, or a malformed one, is refused and changes nothing.
    pub fn handle(&mut self, input: Input<'_>) -> Result<(), ExecutorError> {
        let dp = self.setup.sizes.dp as usize;
        self.stage = match (self.stage, input) {
            (Stage::Gather, Input::States(all)) => {
                self.arity(Phase::Gather, all.len(), dp)?;
                self.on_states(all)
            }
            (Stage::ReadIngress(_), Input::Ingress(read)) => {
                self.iter.read = Some(read);
                Stage::Fetch
            }
            (Stage::Fetch, Input::Fetch(fetched)) => {
                self.iter.read = None;
                self.on_fetch(fetched);
                self.after_fetch()
            }
            (Stage::PrefixMatch, Input::PrefixMatches(all)) => {
                self.arity(Phase::PrefixMatch, all.len(), dp)?;
                let n = self.iter.popped.len();
                if let Some(bad) = all.iter().find(|m| m.tokens.len() != n) {
                    self.arity(Phase::PrefixMatch, bad.tokens.len(), n)?;
                }
                self.route(Some(all));
                self.after_route()
            }
            (Stage::PadIntent(_), Input::PadIntent(global)) => self.pad_and_schedule(global),
            (Stage::Vote, Input::Votes(votes)) => {
                self.arity(Phase::Vote, votes.len(), dp)?;
                self.on_votes(votes)
            }
            (Stage::Forward, Input::Output(output)) => {
                let got = output.map(|o| o.batch);
                if got != self.iter.awaited {
                    return Err(ExecutorError::WrongBatch {
                        rank: self.rank,
                        got,
                        want: self.iter.awaited,
                    });
                }
                self.process_output(output);
                if self.setup.schedule.transfers {
                    let status = &mut self.iter.status.events;
                    status.clear();
                    status.append(&mut self.pending_transfer_events);
                    Stage::Transfers
                } else {
                    Stage::Responses
                }
            }
            (Stage::Responses, Input::ResponsesGathered) => {
                self.iter.responses.responses.clear();
                self.end_iteration();
                Stage::Ended
            }
            (Stage::Transfers, Input::TransferStatus(all)) => {
                self.arity(Phase::Transfers, all.len(), dp)?;
                self.iter.responses.responses.clear();
                self.apply_transfers();
                self.end_iteration();
                Stage::Ended
            }
            (stage, input) => {
                return Err(ExecutorError::UnexpectedInput {
                    rank: self.rank,
                    iteration: self.iteration,
                    awaiting: stage.name(),
                    got: input.name(),
                });
            }
        };
        Ok(())
    }

    /// A collective result of the wrong size is refused before anything changes.
    fn arity(&self, phase: Phase, got: usize, want: usize) -> Result<(), ExecutorError> {
        if got == want {
            Ok(())
        } else {
            Err(ExecutorError::WrongArity {
                rank: self.rank,
                iteration: self.iteration,
                phase,
                got,
                want,
            })
        }
    }

    /// Opens an iteration: fresh working data, this rank's contribution to the gather.
    fn open_iteration(&mut self) -> RankState {
        let it = &mut self.iter;
        it.loads.clear();
        it.popped.clear();
        it.expected = 0;
        it.counts = RankCounts::default();
        it.tentative = None;
        for b in [it.batch.take(), it.launched.take()].into_iter().flatten() {
            self.bufs.recycle(b);
        }
        it.awaited = None;
        it.deferred = false;
        it.progressed = false;
        it.stats = super::IterationStats {
            iteration: self.iteration,
            rank: self.rank,
            ..super::IterationStats::default()
        };
        it.violations.clear();
        it.commands.clear();
        it.responses.rank = self.rank;
        it.responses.responses.clear();
        let state = self.gather_state();
        self.iter
            .responses
            .responses
            .append(&mut self.carried_responses);
        self.iter.gathered = Some((state.counts, self.resident.active.len()));
        self.iter.balance = super::BalanceDecision::Off;
        state
    }

    /// This rank's contribution to the gather, as it stands between iterations: its
    /// counts, whether it holds responses due, whether its last iteration changed
    /// anything, whether a transfer of its is in flight (and its ADP balance load).
    pub fn gather_state(&self) -> RankState {
        let counts = self.counts();
        let balance = if self.balance.is_some() {
            super::BalanceLoad::of(&self.resident.active)
        } else {
            super::BalanceLoad::default()
        };
        RankState {
            rank: self.rank,
            balance,
            counts,
            responses_due: !self.carried_responses.is_empty(),
            progressed: self.progressed_last,
            awaiting_transfer: counts.receiving > 0 || !self.resident.sending.is_empty(),
        }
    }

    /// The gather's result: leave if the server is drained; otherwise rank 0 reads the
    /// ingress and everyone awaits its broadcast.
    fn on_states(&mut self, all: &[RankState]) -> Stage {
        if self.server_drained(all) {
            return Stage::Finished;
        }
        self.iter.loads.clear();
        self.iter
            .loads
            .extend(all.iter().map(|s| crate::router::RankLoad {
                requests: s.counts.routable,
                prompt_tokens: s.counts.routable_prompt_tokens,
            }));
        self.iter.balance_loads.clear();
        if self.balance.is_some() {
            self.iter
                .balance_loads
                .extend(all.iter().map(|s| s.balance));
        }
        if self.rank.0 == 0 {
            Stage::ReadIngress(self.fetch_mode(all))
        } else {
            Stage::Fetch
        }
    }

    /// ADP balance (`balance.rs`): whether this iteration's context work runs, from
    /// every rank's load, the same decision on every rank. A held iteration counts as
    /// progress: the next one is not the same (the wait's count moved on), and the wait
    /// is bounded by its iteration counts.
    fn decide_balance(&mut self) {
        let Some(policy) = &mut self.balance else {
            return;
        };
        let decision = policy.decide(&self.iter.balance_loads);
        self.iter.balance = decision;
        self.iter.stats.balance = decision;
        self.iter.stats.balance_load = self
            .iter
            .balance_loads
            .get(self.rank.index())
            .copied()
            .unwrap_or_default();
        if decision.holds_context() {
            self.iter.progressed = true;
        }
    }

    /// After the fetch: the prefix matches (KV-aware routing), or route now.
    fn after_fetch(&mut self) -> Stage {
        if self.setup.schedule.prefix_matches {
            let kv = &self.kv;
            let tokens = &mut self.iter.matches.tokens;
            tokens.clear();
            tokens.extend(
                self.iter
                    .popped
                    .iter()
                    .map(|s| kv.longest_prefix_match(&s.block_hashes)),
            );
            Stage::PrefixMatch
        } else {
            self.route(None);
            self.after_route()
        }
    }

    /// After routing: the pad intent (non-overlap disaggregated path), or pad and
    /// schedule now.
    fn after_route(&mut self) -> Stage {
        if self.setup.schedule.pad_intent {
            Stage::PadIntent(self.local_intent())
        } else {
            self.pad_and_schedule(PadIntent::None)
        }
    }

    /// Pad (§6) and schedule (§4); this rank's vote.
    fn pad_and_schedule(&mut self, global: PadIntent) -> Stage {
        self.decide_balance();
        let batch_size = self.pad_and_schedule_batch(global);
        let fatal = self.iter.violations.iter().any(|v| v.kind.is_fatal());
        let shape = self
            .iter
            .batch
            .as_ref()
            .map(super::BatchShape::of)
            .unwrap_or_default();
        self.iter.vote = BatchVote {
            batch_size,
            fatal,
            shape,
        };
        Stage::Vote
    }

    /// The votes: stop every rank on a fatal violation anywhere; otherwise commit or roll
    /// back the dummy and set up the forward.
    fn on_votes(&mut self, votes: &[BatchVote]) -> Stage {
        if let Some(peer) = votes.iter().position(|v| v.fatal) {
            // The run ends here; the tentative dummy goes with this iteration's work.
            self.abandon_tentative();
            let mine = self.iter.violations.iter().find(|v| v.kind.is_fatal());
            self.stop = Some(match mine {
                Some(v) => StopReason::Crashed(v.clone()),
                None => StopReason::PeerCrashed {
                    peer: RankId(peer as u32),
                },
            });
            return Stage::Stopped;
        }
        let can_queue = votes.iter().all(|v| v.batch_size > 0);
        self.resolve_vote(can_queue);
        self.iter
            .stats
            .record_rank_tokens(self.rank, votes.iter().map(|v| v.shape), can_queue);
        Stage::Forward
    }
}
