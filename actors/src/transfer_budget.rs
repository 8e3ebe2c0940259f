//! The gen server's transport budget (mechanisms.md §8): how many KV blocks may be in
//! flight to one rank at once.
//!
//! Guardrails: a pure decision over the receives in flight; the executor owns the
//! receives and the counters.

use serde::{Deserialize, Serialize};

/// Receives older than this no longer count against the budget (§8).
pub const STALE_RECEIVE_NS: u64 = 30_000_000_000;

/// What the budget says about the next receive in FCFS order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BudgetDecision {
    /// Start it.
    Admit,
    /// Not now; `blocked_by_active`: receives that were already in flight before this
    /// iteration's walk hold part of the budget (false: only receives this same walk
    /// started fill it).
    Defer {
        /// Whether receives started in an earlier iteration (still in flight, not stale)
        /// hold part of the budget.
        blocked_by_active: bool,
    },
}

/// §8: admit while `used + blocks <= budget`; a head larger than the whole budget is
/// admitted when nothing else is in flight (or it would never start); receives started
/// more than [`STALE_RECEIVE_NS`] ago do not count.
pub fn decide(
    budget_blocks: u32,
    in_flight: impl IntoIterator<Item = InFlight>,
    now_ns: u64,
    blocks: u32,
) -> BudgetDecision {
    let mut used = 0u64;
    let mut active = 0u32;
    let mut earlier = 0u32;
    for r in in_flight {
        // Started more than STALE_RECEIVE_NS ago: no longer counted (§8).
        if now_ns.saturating_sub(r.started_ns) <= STALE_RECEIVE_NS {
            used += u64::from(r.blocks);
            active += 1;
            earlier += u32::from(!r.this_walk);
        }
    }
    if used + u64::from(blocks) <= u64::from(budget_blocks) || active == 0 {
        BudgetDecision::Admit
    } else {
        BudgetDecision::Defer {
            blocked_by_active: earlier > 0,
        }
    }
}

/// A receive in flight on the rank, as the budget sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    /// KV blocks it holds.
    pub blocks: u32,
    /// When it started (the fetch clock of its iteration).
    pub started_ns: u64,
    /// Started by this iteration's walk, not an earlier one.
    pub this_walk: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A receive started in an earlier iteration.
    fn old(blocks: u32, started_ns: u64) -> InFlight {
        InFlight {
            blocks,
            started_ns,
            this_walk: false,
        }
    }

    #[test]
    fn receives_are_admitted_fcfs_within_the_budget() {
        assert_eq!(decide(8, [], 0, 4), BudgetDecision::Admit);
        assert_eq!(decide(8, [old(4, 0)], 0, 4), BudgetDecision::Admit);
        assert_eq!(
            decide(8, [old(4, 0), old(4, 0)], 0, 1),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }

    #[test]
    fn an_oversized_head_is_admitted_only_when_nothing_is_in_flight() {
        assert_eq!(decide(8, [], 0, 20), BudgetDecision::Admit);
        assert_eq!(
            decide(8, [old(1, 0)], 0, 20),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }

    #[test]
    fn stale_receives_do_not_count() {
        // Exactly 30 s old still counts; a nanosecond more does not.
        assert_eq!(
            decide(8, [old(8, 0)], STALE_RECEIVE_NS, 8),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
        assert_eq!(
            decide(8, [old(8, 0)], STALE_RECEIVE_NS + 1, 8),
            BudgetDecision::Admit
        );
        let now = STALE_RECEIVE_NS + 5;
        assert_eq!(decide(8, [old(8, 0)], now, 8), BudgetDecision::Admit);
        assert_eq!(
            decide(8, [old(8, 10)], now, 8),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }

    #[test]
    fn a_budget_filled_by_this_walk_alone_is_not_blocked_by_active_receives() {
        let new = InFlight {
            blocks: 8,
            started_ns: 0,
            this_walk: true,
        };
        assert_eq!(
            decide(8, [new], 0, 1),
            BudgetDecision::Defer {
                blocked_by_active: false
            }
        );
        assert_eq!(
            decide(8, [new, old(0, 0)], 0, 1),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }
}
