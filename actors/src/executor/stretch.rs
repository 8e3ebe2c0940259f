//! Coasting in closed form: a stretch of coasted iterations ([`super::coast`]) known in
//! advance and applied at once.
//!
//! While a server coasts, what each coasted iteration does to a rank follows from the
//! stretch's start: every request takes one step — one token, one more KV token, a new
//! block where the step crosses a block boundary — so the batch's shape and the pool
//! after each iteration are arithmetic. The host times and records each iteration from
//! the plan ([`RankStretch::shape`], [`RankStretch::stats`]), stops where the
//! protocol would stop coasting ([`RankStretch::fits`]), and applies the iterations to
//! the rank once ([`RankExecutor::stretch_apply`]): the blocks taken in the order the
//! iterations take them, each request's tokens into one [`TokenRun`], the counters.
//! The rank is then as the iterations one by one would leave it, field for field
//! (`--no-skip` runs them so; the coasting tests compare the reports byte for byte).
//!
//! A plan needs every request's KV room to be its whole blocks, so that each crossing
//! takes exactly one block (`stretch_plan` refuses otherwise, and the host coasts
//! iteration by iteration).

use crate::config::Role;
use crate::ids::BatchNumber;
use crate::token_path::token_path;
use crate::vocab::TokenRun;

use super::{BatchShape, IterationStats, RankExecutor};

/// A request's blocks over a stretch: from step `first` on (1-based), every
/// `tokens_per_block`-th step takes one block.
#[derive(Debug, Clone, Copy)]
struct Crossing {
    first: u32,
    /// Its index in the rank's active list.
    index: u32,
    /// Under MAX_UTILIZATION, whether its steps draw on the blocks not kept back for
    /// requests that may not be paused (every request, under the other policies).
    limited: bool,
}

/// One rank's part of a stretch (buffers kept across stretches).
#[derive(Debug, Clone, Default)]
pub struct RankStretch {
    /// Requests, each one step an iteration.
    requests: u32,
    /// Σ KV tokens the first iteration's entries attend.
    kv_tokens: u64,
    tokens_per_block: u32,
    /// Sorted by phase (`(first − 1) mod tokens_per_block`), in active order within one.
    crossings: Vec<Crossing>,
    /// Where each phase starts in `crossings` (`tokens_per_block + 1` bounds).
    phase_start: Vec<u32>,
    /// Blocks free and used at the start.
    free: u32,
    used: u32,
    /// Blocks the limited requests may take: free minus what is kept back.
    limited_room: u64,
    /// Steps counted, blocks taken through them (all, by limited requests), and all
    /// taken through the step before.
    counted: u32,
    taken: u32,
    taken_limited: u32,
    taken_before: u32,
    /// Every coasted iteration's record, as `coast_begin` set it.
    template: IterationStats,
    /// The rank's iteration number at the start.
    iteration: u64,
    /// The first iteration's batch number, and whether a batch stays in flight.
    first_batch: u64,
    overlap: bool,
    /// Scratch: per request, whether it is limited.
    limited: Vec<bool>,
}

impl RankStretch {
    /// The shape of the batch the stretch's `step`-th iteration launches.
    pub fn shape(&self, step: u32) -> BatchShape {
        BatchShape {
            gen_requests: self.requests,
            gen_tokens: self.requests,
            gen_kv_tokens: self.kv_tokens + u64::from(step - 1) * u64::from(self.requests),
            ..BatchShape::default()
        }
    }

    /// Whether the `step`-th iteration's steps fit (the steps before it did): the
    /// blocks it takes are free and, under MAX_UTILIZATION, the scheduler pauses
    /// nothing — what [`RankExecutor::coast_step_fits`] checks before each coasted
    /// iteration. Steps are counted in order: `step` is the next or the last counted.
    pub fn fits(&mut self, step: u32) -> bool {
        if step > self.counted {
            debug_assert_eq!(step, self.counted + 1, "steps are counted in order");
            let (all, limited) = self.takes(step);
            self.taken_before = self.taken;
            self.taken += all;
            self.taken_limited += limited;
            self.counted = step;
        }
        self.taken <= self.free && u64::from(self.taken_limited) <= self.limited_room
    }

    /// The requests whose `step`-th step (1-based) takes a block, in active order:
    /// those whose first crossing is at or before it, in its phase. The one rule both
    /// the count ([`RankStretch::fits`]) and the taking ([`RankExecutor::stretch_apply`])
    /// read.
    fn crossing_at(&self, step: u32) -> impl Iterator<Item = &Crossing> {
        let phase = ((step - 1) % self.tokens_per_block) as usize;
        let range = self.phase_start[phase] as usize..self.phase_start[phase + 1] as usize;
        self.crossings[range]
            .iter()
            .filter(move |c| c.first <= step)
    }

    /// Blocks the `step`-th iteration takes: all, and by limited requests.
    fn takes(&self, step: u32) -> (u32, u32) {
        self.crossing_at(step).fold((0, 0), |(all, limited), c| {
            (all + 1, limited + u32::from(c.limited))
        })
    }

    /// The record of the `step`-th iteration (counted by [`RankStretch::fits`], the
    /// last or the one before), started at `started_ns`: what the rank would report
    /// (one record, rewritten for each iteration).
    pub fn stats(&mut self, step: u32, started_ns: u64) -> &IterationStats {
        let taken = if step == self.counted {
            self.taken
        } else {
            debug_assert_eq!(step + 1, self.counted, "a step counted last or before");
            self.taken_before
        };
        let s = &mut self.template;
        s.iteration = self.iteration + u64::from(step - 1);
        s.started_ns = started_ns;
        s.kv_blocks_used = self.used + taken;
        s.kv_blocks_free = self.free - taken;
        s.progressed = true;
        s
    }

    /// The batch whose output the `step`-th iteration awaits: under overlap the one
    /// launched the iteration before, else its own.
    pub fn awaited(&self, step: u32) -> BatchNumber {
        BatchNumber(self.first_batch + u64::from(step - 1) - u64::from(self.overlap))
    }
}

impl RankExecutor {
    /// Plans a stretch from here, after [`RankExecutor::coast_begin`], into `plan`:
    /// whether this rank's steps can be known in advance (every request's KV room is
    /// its whole blocks, and what MAX_UTILIZATION keeps back is free).
    pub fn stretch_plan(&self, plan: &mut RankStretch) -> bool {
        let active = &self.resident.active;
        let tpb = self.kv.tokens_per_block();
        let reserved = self
            .capacity
            .steady_reserve(active, &self.kv, &mut plan.limited);
        let free = self.kv.free_blocks();
        if reserved > u64::from(free) || tpb == 0 {
            return false;
        }
        plan.requests = active.len() as u32;
        plan.kv_tokens = 0;
        plan.tokens_per_block = tpb;
        plan.free = free;
        plan.used = self.kv.used_blocks();
        plan.limited_room = u64::from(free) - reserved;
        plan.counted = 0;
        plan.taken = 0;
        plan.taken_limited = 0;
        plan.taken_before = 0;
        plan.template = self.report.stats.clone();
        plan.iteration = self.iteration;
        plan.first_batch = self.resident.next_batch;
        plan.overlap = self.setup.sizes.overlap;
        plan.phase_start.clear();
        plan.phase_start.resize(tpb as usize + 1, 0);
        for r in active {
            let whole_blocks = self.kv.blocks_of(r.id()) * tpb;
            // A retiring request ends in the first iteration: that one runs as a
            // coasted one (`coast_limit` makes it the stretch's only one).
            if !super::coast::coast_steps(r)
                || !r.holds_kv
                || r.kv_room != whole_blocks
                || r.kv_room < r.kv_tokens
            {
                return false;
            }
            let first = r.kv_room - r.kv_tokens + 1;
            plan.phase_start[((first - 1) % tpb) as usize + 1] += 1;
            plan.kv_tokens += u64::from(r.kv_tokens);
        }
        for p in 1..plan.phase_start.len() {
            plan.phase_start[p] += plan.phase_start[p - 1];
        }
        // A counting sort, stable: active order within each phase.
        plan.crossings.clear();
        plan.crossings.resize(
            active.len(),
            Crossing {
                first: 0,
                index: 0,
                limited: false,
            },
        );
        let mut next: Vec<u32> = plan.phase_start[..tpb as usize].to_vec();
        for (i, r) in active.iter().enumerate() {
            let first = r.kv_room - r.kv_tokens + 1;
            let slot = &mut next[((first - 1) % tpb) as usize];
            plan.crossings[*slot as usize] = Crossing {
                first,
                index: i as u32,
                limited: plan.limited[i],
            };
            *slot += 1;
        }
        true
    }

    /// Applies the first `steps` iterations of the stretch `plan` describes, as the
    /// coasted iterations would (the last fetched at `last_fetch_ns`, a read among them
    /// bringing `shutdown`): each step's blocks in order, every request's `steps`
    /// tokens appended to `run` (`token`: the backend's token for a request, output
    /// position and path; under overlap the first step's tokens are the in-flight
    /// batch's, `in_flight_tokens`), the counters, the last iteration's record. Under
    /// overlap the batch in flight is then the last step's, still to be sampled.
    #[allow(clippy::too_many_arguments)]
    pub fn stretch_apply(
        &mut self,
        plan: &RankStretch,
        steps: u32,
        last_fetch_ns: u64,
        shutdown: bool,
        in_flight_tokens: Option<&[u32]>,
        token: fn(u64, u32, u64) -> u32,
        run: &mut TokenRun,
    ) {
        debug_assert!(steps >= 1 && steps <= plan.counted);
        self.replicated.shutdown |= shutdown;
        self.iter.violations.clear();
        let tpb = plan.tokens_per_block;
        // The blocks, iteration by iteration, in active order within one (as
        // `prepare_entry` takes them); the KV tokens before a step are those at the
        // start plus the steps before it.
        for step in 1..=steps {
            for c in plan.crossing_at(step) {
                let i = c.index as usize;
                let id = self.resident.active[i].id();
                let need = self.resident.active[i].kv_tokens + step;
                if let Err(e) = self.kv.ensure_tokens(id, need) {
                    // The plan counted this block as free: the rank's bookkeeping slipped.
                    self.kv_bookkeeping_slip(format!("request {id}: a coasted step's block: {e}"));
                    continue;
                }
                self.resident.active[i].kv_room = self.kv.blocks_for_tokens(need) * tpb;
            }
        }
        let overlap = self.setup.sizes.overlap;
        let (role, rank) = (self.setup.role, self.rank);
        let first_batch = self.resident.next_batch;
        // The first token received: under overlap, the in-flight entry's (launched one
        // batch and one position earlier).
        let back = u32::from(overlap);
        run.ids.reserve(self.resident.active.len());
        run.tokens
            .reserve(self.resident.active.len() * steps as usize);
        // No step applied here ends a request or makes it retiring (`coast_limit`): the
        // stretch's last iteration, which may, runs as a coasted one.
        debug_assert!(
            self.resident
                .active
                .iter()
                .all(|r| r.generated + steps + back < self.effective_max_new(r)),
            "a stretch of {steps} steps ends a request or makes it retiring"
        );
        for (i, r) in self.resident.active.iter_mut().enumerate() {
            let id = r.id();
            run.ids.push(id);
            let fixed_path =
                (role != Role::Agg).then(|| token_path(role, rank, 0, r.spec.kv_source));
            let position = r.next_position - back;
            let batch = first_batch - u64::from(back);
            for j in 0..steps {
                let t = match in_flight_tokens {
                    Some(sampled) if j == 0 => sampled[i],
                    _ => {
                        let path = fixed_path.unwrap_or_else(|| {
                            token_path(role, rank, batch + u64::from(j), r.spec.kv_source)
                        });
                        token(id.0, position + j, path)
                    }
                };
                run.tokens.push(t);
            }
            r.kv_tokens += steps;
            r.next_position += steps;
            r.generated += steps;
        }
        let (k, n) = (u64::from(steps), self.resident.active.len() as u64);
        if overlap && let Some(b) = &mut self.resident.in_flight {
            let last = first_batch + k - 1;
            b.number = BatchNumber(last);
            for (e, r) in b.entries.iter_mut().zip(&self.resident.active) {
                e.kv_tokens = r.kv_tokens - 1;
                e.position = r.next_position - 1;
                e.path = token_path(role, rank, last, r.spec.kv_source);
            }
        }
        let t = &mut self.totals;
        t.output_tokens += k * n;
        t.iteration_scheduled_requests += k * n;
        t.forward_iterations += k;
        t.scheduled_requests += k * n;
        t.iterations += k;
        self.iteration += k;
        self.resident.next_batch += k;
        self.progressed_last = true;
        // The last iteration's record, as `coast_land` leaves it.
        let it = &mut self.iter;
        it.now_ns = last_fetch_ns;
        it.progressed = true;
        it.deferred = false;
        it.launched = None;
        it.responses.responses.clear();
        it.stats.num_scheduled_requests = n as u32;
        it.stats.num_ctx_tokens = 0;
        it.stats.num_dummies = 0;
        self.check_kv();
        let report = &mut self.report;
        report.stats.iteration = self.iteration - 1;
        report.stats.started_ns = last_fetch_ns;
        report.stats.kv_blocks_used = self.kv.used_blocks();
        report.stats.kv_blocks_free = self.kv.free_blocks();
        report.stats.progressed = true;
        report.violations.clear();
        std::mem::swap(&mut report.violations, &mut self.iter.violations);
    }

    /// The batch in flight (under overlap), to sample after a stretch.
    pub fn in_flight(&self) -> Option<&super::ScheduledBatch> {
        self.resident.in_flight.as_ref()
    }
}
