//! Coasting a whole server (the executor's `coast` module): when every rank is in
//! steady decode, an iteration runs each rank's steps without the collectives, whose
//! results are known. The host (the simulator) checks what only it can see — the
//! fetch reads nothing, no other event comes in the meantime — and times each coasted
//! iteration as any other ([`ServerGroup::shapes`], [`ServerGroup::awaited`]).

use crate::executor::{FetchMode, ForwardOutput, IterationStats, RankExecutor, RankState};
use crate::ids::RankId;
use crate::vocab::{PadIntent, TokenRun};

use super::{Asked, GroupError, ServerGroup, TokenSource};

impl ServerGroup {
    /// How many iterations the server can coast from here (0: none): every rank is
    /// ready ([`RankExecutor::coast_ready`]), rank 0 would poll, and no rank would pad
    /// or fail the cap check. The decisions are kept for [`ServerGroup::coast_begin`].
    pub fn coast_limit(&mut self) -> u64 {
        if self.asks.iter().any(|a| *a != Asked::Nothing)
            || !self.ranks.iter().all(RankExecutor::coast_ready)
        {
            return 0;
        }
        let states: Vec<RankState> = self.ranks.iter().map(RankExecutor::gather_state).collect();
        if self.ranks[0].coast_fetch_mode(&states) != FetchMode::Poll {
            return 0;
        }
        let global = self
            .ranks
            .iter()
            .map(RankExecutor::coast_intent)
            .max()
            .unwrap_or(PadIntent::None);
        self.coast.clear();
        let mut limit = u64::MAX;
        for (r, state) in self.ranks.iter_mut().zip(&states) {
            let Some(expected) = r.coast_expected(&states, global) else {
                return 0;
            };
            self.coast.push((state.counts, expected));
            limit = limit.min(r.coast_limit());
        }
        limit
    }

    /// Starts coasting with the decisions [`ServerGroup::coast_limit`] took.
    pub fn coast_begin(&mut self) {
        let tokens: Vec<u32> = self
            .ranks
            .iter()
            .map(|r| r.coast_scheduled() as u32)
            .collect();
        for (r, &(counts, expected)) in self.ranks.iter_mut().zip(&self.coast) {
            r.coast_begin(counts, expected, &tokens);
        }
    }

    /// Whether every rank's next coasted steps fit ([`RankExecutor::coast_step_fits`]).
    pub fn coast_step_fits(&mut self) -> bool {
        self.ranks.iter_mut().all(RankExecutor::coast_step_fits)
    }

    /// A coasted iteration's first half on every rank, fetched at `now_ns` (the fetch
    /// read nothing but maybe the `shutdown`): the batches launched, their shapes
    /// ([`ServerGroup::shapes`]) and the outputs awaited ([`ServerGroup::awaited`]).
    pub fn coast_launch(&mut self, now_ns: u64, shutdown: bool) {
        self.shapes.clear();
        for (i, r) in self.ranks.iter_mut().enumerate() {
            self.shapes.push(r.coast_launch(now_ns, shutdown));
            self.awaited[i] = r.coast_awaited();
        }
    }

    /// A coasted iteration's second half: every rank gets the output it awaits
    /// (sampled by [`ServerGroup::sample_launched`]) and ends the iteration that
    /// started at `started_ns`; the responses are gathered in rank order
    /// ([`ServerGroup::responses_by_rank`]).
    pub fn coast_land(&mut self, started_ns: u64) {
        self.responses.clear();
        self.response_ranks.clear();
        for i in 0..self.ranks.len() {
            let pending = &mut self.outputs[i];
            let output = self.awaited[i].and_then(|n| {
                let at = pending.iter().position(|o| o.batch == n)?;
                Some(pending.remove(at))
            });
            self.ranks[i].coast_land(output.as_ref(), started_ns);
            self.spare_outputs.extend(output);
            let start = self.responses.len();
            self.responses.append(self.ranks[i].coast_responses());
            if self.responses.len() > start {
                self.response_ranks
                    .push((RankId(i as u32), start..self.responses.len()));
            }
        }
    }
}

/// A stretch of coasted iterations in closed form (`executor::stretch`): every rank's
/// part planned at once, each iteration timed and recorded from the plans, the
/// iterations applied to the ranks at the end.
impl ServerGroup {
    /// Plans a stretch after [`ServerGroup::coast_begin`]: whether every rank's steps
    /// are known in advance and the first iteration's fit.
    pub fn stretch_begin(&mut self) -> bool {
        self.stretch
            .resize_with(self.ranks.len(), crate::executor::RankStretch::default);
        let planned = self
            .ranks
            .iter()
            .zip(&mut self.stretch)
            .all(|(r, plan)| r.stretch_plan(plan));
        planned && self.stretch_fits(1)
    }

    /// Every rank's batch shape in the stretch's `step`-th iteration, into
    /// [`ServerGroup::shapes`].
    pub fn stretch_shapes(&mut self, step: u32) {
        self.shapes.clear();
        self.shapes
            .extend(self.stretch.iter().map(|p| p.shape(step)));
    }

    /// Whether the batches just launched ([`ServerGroup::shapes`]) have the shapes the
    /// plan gave the stretch's `step`-th iteration (a check of the plan).
    pub fn stretch_planned_shapes(&self, step: u32) -> bool {
        self.shapes.len() == self.stretch.len()
            && self
                .shapes
                .iter()
                .zip(&self.stretch)
                .all(|(s, p)| *s == p.shape(step))
    }

    /// Whether every rank's steps of the stretch's `step`-th iteration fit (counted on
    /// every rank, in order: [`crate::executor::RankStretch::fits`]).
    pub fn stretch_fits(&mut self, step: u32) -> bool {
        let mut fits = true;
        for plan in &mut self.stretch {
            fits &= plan.fits(step);
        }
        fits
    }

    /// The record rank `rank` reports for the stretch's `step`-th iteration, started
    /// at `started_ns`, and the rank.
    pub fn stretch_stats(
        &mut self,
        rank: usize,
        step: u32,
        started_ns: u64,
    ) -> (&IterationStats, &RankExecutor) {
        (
            self.stretch[rank].stats(step, started_ns),
            &self.ranks[rank],
        )
    }

    /// The batch the stretch's `step`-th iteration awaits (every rank the same).
    pub fn stretch_awaited(&self, step: u32) -> Option<crate::ids::BatchNumber> {
        self.stretch.first().map(|p| p.awaited(step))
    }

    /// Applies the stretch's first `steps` iterations to every rank
    /// ([`RankExecutor::stretch_apply`]), their tokens into `run` in rank order, the
    /// last fetched at `last_fetch_ns`. Under overlap each rank's batch now in flight
    /// is sampled by `tokens`, as a launch is.
    pub fn stretch_apply(
        &mut self,
        steps: u32,
        last_fetch_ns: u64,
        shutdown: bool,
        tokens: &mut dyn TokenSource,
        run: &mut TokenRun,
    ) -> Result<(), GroupError> {
        let Some(token) = tokens.pure_token() else {
            unreachable!("a stretch is planned only with a pure token source")
        };
        run.clear();
        run.steps = steps;
        self.responses.clear();
        self.response_ranks.clear();
        for i in 0..self.ranks.len() {
            // Under overlap, the in-flight batch's output, sampled at its launch.
            let pending = self.ranks[i].in_flight().map(|b| b.number).and_then(|n| {
                let at = self.outputs[i].iter().position(|o| o.batch == n)?;
                Some(self.outputs[i].remove(at))
            });
            self.ranks[i].stretch_apply(
                &self.stretch[i],
                steps,
                last_fetch_ns,
                shutdown,
                pending.as_ref().map(|o| o.sampled.as_slice()),
                token,
                run,
            );
            self.spare_outputs.extend(pending);
            if let Some(batch) = self.ranks[i].in_flight() {
                let mut out = self.spare_outputs.pop().unwrap_or(ForwardOutput {
                    batch: batch.number,
                    sampled: Vec::new(),
                    logprobs: Vec::new(),
                });
                tokens.sample_into(batch, &mut out)?;
                self.outputs[i].push(out);
            }
        }
        Ok(())
    }
}
