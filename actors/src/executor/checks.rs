//! The end of an iteration: the §10 checks and the iteration's report.

use crate::ids::ReqId;
use crate::invariants::{InvariantKind, Violation};
use crate::kv::Freed;

use super::RankExecutor;

impl RankExecutor {
    /// Frees `id`'s KV and checks the pool's answer against `held`: this rank's own record
    /// of whether `id` holds any (`holds_kv`, the dummy).
    pub(super) fn free_kv(&mut self, id: ReqId, held: bool) {
        let freed = self.kv.free_sequence(id);
        self.check_freed(freed, id, held);
    }

    /// The pool must free a sequence exactly when this rank's record says `id` holds one.
    pub(super) fn check_freed(&mut self, freed: Freed, id: ReqId, held: bool) {
        match (freed, held) {
            (Freed::Sequence { .. }, true) | (Freed::NothingHeld, false) => {}
            (Freed::NothingHeld, true) => self.kv_bookkeeping_slip(format!(
                "request {id} is recorded as holding KV, but the pool had no sequence to free"
            )),
            (Freed::Sequence { blocks }, false) => self.kv_bookkeeping_slip(format!(
                "request {id} is recorded as holding no KV, but the pool freed its sequence of {blocks} blocks"
            )),
        }
    }

    /// A KV call that this rank's own bookkeeping says cannot fail did. Nothing a message
    /// carries can cause it (ids are checked at admission; `holds_kv` is set only when the
    /// pool took the sequence), so it is an executor bug: debug builds (every test) stop
    /// on it; release builds keep serving, warn, and report a `Blocks` violation.
    pub(super) fn kv_bookkeeping_slip(&mut self, detail: String) {
        if cfg!(debug_assertions) {
            panic!("rank {}: kv bookkeeping disagrees: {detail}", self.rank);
        }
        tracing::warn!(rank = %self.rank, iteration = self.iteration, detail, "kv bookkeeping disagrees");
        self.violation(InvariantKind::Blocks, detail);
    }

    pub(super) fn violation(&mut self, kind: InvariantKind, detail: String) {
        self.iter.violations.push(Violation {
            iteration: self.iteration,
            rank: self.rank,
            kind,
            detail,
        });
    }

    /// Closes the iteration: the §10 checks, the report (its old vectors become the next
    /// iteration's, so nothing is allocated twice), the progress flag for the next
    /// gather.
    pub(super) fn end_iteration(&mut self) {
        self.check_invariants();
        if !self.iter.commands.is_empty() {
            self.iter.progressed = true;
        }
        let report = &mut self.report;
        report.stats = std::mem::take(&mut self.iter.stats);
        report.stats.kv_blocks_used = self.kv.used_blocks();
        report.stats.kv_blocks_free = self.kv.free_blocks();
        report.stats.seats_used = self.seats.used();
        report.stats.progressed = self.iter.progressed;
        report.violations.clear();
        std::mem::swap(&mut report.violations, &mut self.iter.violations);
        report.transfer_commands.clear();
        std::mem::swap(&mut report.transfer_commands, &mut self.iter.commands);
        self.progressed_last = self.iter.progressed;
        self.totals.iterations += 1;
        self.iteration += 1;
    }

    /// The pool's check (§10): conservation every iteration; the full structural walk
    /// of the pool (O(blocks)) every `kv_full_check_every` iterations (every iteration
    /// in tests).
    pub(super) fn check_kv(&mut self) {
        let every = self.setup.kv_full_check_every;
        let full = every > 0 && self.iteration.is_multiple_of(every);
        let kv_check = if full {
            self.kv.check_invariants()
        } else {
            self.kv.check_conservation()
        };
        if let Err(e) = kv_check {
            self.violation(InvariantKind::Blocks, e.to_string());
        }
    }

    /// The §10 checks at the end of an iteration.
    fn check_invariants(&mut self) {
        let seats = self.setup.sizes.seats;
        let held = self.seats.used();
        if held > seats {
            self.violation(
                InvariantKind::Seats,
                format!("{held} seats held, seats = {seats}"),
            );
        }
        // One walk over the resident requests gathers what the checks below count.
        let mut ids = std::mem::take(&mut self.bufs.ids);
        ids.clear();
        let r = &self.resident;
        let mut holders = u32::from(r.dummy.as_ref().is_some_and(|d| d.seat.is_some()));
        let mut with_kv = r.sending.len() + usize::from(r.dummy.is_some());
        for q in &r.active {
            holders += u32::from(q.seat.is_some());
            with_kv += usize::from(q.holds_kv);
            ids.push(q.id());
        }
        ids.extend(r.sending.iter().map(|q| q.id()));
        if holders != held {
            self.violation(
                InvariantKind::Seats,
                format!("{holders} requests hold a seat but the pool counts {held}"),
            );
        }
        if !self.setup.policy.seats.rederive && self.kv.index_pool_size() != seats {
            let size = self.kv.index_pool_size();
            self.violation(
                InvariantKind::Seats,
                format!("kv index pool {size} != seats {seats}"),
            );
        }
        self.check_kv();
        let sequences = self.kv.index_slots_used() as usize;
        if with_kv != sequences {
            self.violation(
                InvariantKind::BlockLeak,
                format!(
                    "kv holds {sequences} sequences but {with_kv} resident or sending requests own one"
                ),
            );
        }
        if self.resident.dummy.is_some() {
            self.violation(
                InvariantKind::DummySurvived,
                "a dummy is alive at the end of the iteration".into(),
            );
        }
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        let distinct = ids.len();
        self.bufs.ids = ids;
        if distinct != n {
            self.violation(
                InvariantKind::Accounting,
                format!(
                    "{} request ids appear twice among active and sending",
                    n - distinct
                ),
            );
        }
    }
}
