//! The KV-aware router (§5): among ranks below `expected`, the least
//! `(tokens - match) + β · load_r / max(Σload, tokens) · tokens` wins, ties by (load, rank).

use super::Round;
use crate::request::RequestSpec;

/// β of §5: how much a rank's share of the load weighs against uncached tokens.
const BETA: f64 = 1.0;

/// The cached tokens of `new[i]` on `rank` as the router counts them: matches below 10%
/// of the prompt are noise and count as 0 (§5); a missing entry counts as 0; a match is
/// never more than the prompt.
fn effective_match(prefix_matches: Option<&[Vec<u32>]>, rank: usize, i: usize, tokens: u32) -> u32 {
    let raw = prefix_matches
        .and_then(|pm| pm.get(rank))
        .and_then(|row| row.get(i))
        .copied()
        .unwrap_or(0)
        .min(tokens);
    if u64::from(raw) * 10 < u64::from(tokens) {
        0
    } else {
        raw
    }
}

/// Routes every request the pins left, in FIFO order, updating `round`.
pub(super) fn route(
    round: &mut Round,
    new: &[RequestSpec],
    prefix_matches: Option<&[Vec<u32>]>,
    expected: u32,
) {
    for i in round.unplaced() {
        let tokens = new[i].prompt_len;
        // Σload includes what this round placed so far, so successive requests see it.
        let total: u64 = round.tokens.iter().sum();
        let denominator = total.max(u64::from(tokens)) as f64;
        let score = |r: usize| {
            let uncached = f64::from(tokens - effective_match(prefix_matches, r, i, tokens));
            // A zero denominator means an empty fleet and an empty prompt: no load term.
            let load_term = if denominator > 0.0 {
                BETA * round.tokens[r] as f64 / denominator * f64::from(tokens)
            } else {
                0.0
            };
            uncached + load_term
        };
        let rank = round
            .under(expected)
            .map(|r| (score(r), round.tokens[r], r))
            // total_cmp: a total order on f64, so ties are decided by (load, rank id).
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)))
            .map(|(_, _, r)| r)
            .unwrap_or_else(|| round.least_loaded());
        round.place(i, rank, &new[i]);
    }
}
