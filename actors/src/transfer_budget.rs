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
    /// Not now; `blocked_by_active`: receives in flight hold the budget.
    Defer {
        /// Whether receives in flight hold the budget.
        blocked_by_active: bool,
    },
}

/// §8: admit while `used + blocks <= budget`; a head larger than the whole budget is
/// admitted when nothing else is in flight (or it would never start); receives started
/// more than [`STALE_RECEIVE_NS`] ago do not count.
pub fn decide(
    budget_blocks: u32,
    in_flight: impl IntoIterator<Item = (u32, u64)>,
    now_ns: u64,
    blocks: u32,
) -> BudgetDecision {
    let mut used = 0u64;
    let mut active = 0u32;
    for (b, started_ns) in in_flight {
        if now_ns.saturating_sub(started_ns) < STALE_RECEIVE_NS {
            used += u64::from(b);
            active += 1;
        }
    }
    if used + u64::from(blocks) <= u64::from(budget_blocks) || active == 0 {
        BudgetDecision::Admit
    } else {
        BudgetDecision::Defer {
            blocked_by_active: active > 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receives_are_admitted_fcfs_within_the_budget() {
        assert_eq!(decide(8, [], 0, 4), BudgetDecision::Admit);
        assert_eq!(decide(8, [(4, 0)], 0, 4), BudgetDecision::Admit);
        assert_eq!(
            decide(8, [(4, 0), (4, 0)], 0, 1),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }

    #[test]
    fn an_oversized_head_is_admitted_only_when_nothing_is_in_flight() {
        assert_eq!(decide(8, [], 0, 20), BudgetDecision::Admit);
        assert_eq!(
            decide(8, [(1, 0)], 0, 20),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }

    #[test]
    fn stale_receives_do_not_count() {
        let now = STALE_RECEIVE_NS + 5;
        assert_eq!(decide(8, [(8, 0)], now, 8), BudgetDecision::Admit);
        assert_eq!(
            decide(8, [(8, 10)], now, 8),
            BudgetDecision::Defer {
                blocked_by_active: true
            }
        );
    }
}
