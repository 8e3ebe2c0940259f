//! Coasting a whole server (the executor's `coast` module): when every rank is in
//! steady decode, an iteration runs each rank's steps without the collectives, whose
//! results are known. The host (the simulator) checks what only it can see — the
//! fetch reads nothing, no other event comes in the meantime — and times each coasted
//! iteration as any other ([`ServerGroup::shapes`], [`ServerGroup::awaited`]).

use crate::executor::{FetchMode, RankExecutor, RankState};
use crate::ids::RankId;
use crate::vocab::PadIntent;

use super::{Asked, ServerGroup};

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
        let tokens: Vec<u32> = self.ranks.iter().map(|r| r.active().len() as u32).collect();
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
