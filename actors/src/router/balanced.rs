//! The balanced router (§5, the default): longest prompt first, each to the rank with the
//! least (prompt tokens, request count, rank id) among ranks below `expected`.

use std::cmp::Reverse;

use super::Round;
use crate::request::RequestSpec;

/// Routes every request the pins left, updating `round`.
pub(super) fn route(round: &mut Round, new: &[RequestSpec], expected: u32) {
    let mut order = round.unplaced();
    // Longest first so the big prompts spread before the small ones fill the gaps; the
    // sort is stable, so equal prompts keep FIFO order.
    order.sort_by_key(|&i| Reverse(new[i].prompt_len));
    for i in order {
        let rank = round
            .under(expected)
            .min_by_key(|&r| (round.tokens[r], round.counts[r], r))
            // Only when the routing invariant failed: nowhere is under `expected`.
            .unwrap_or_else(|| round.least_loaded());
        round.place(i, rank, &new[i]);
    }
}
