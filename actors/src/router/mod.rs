//! ADP routers (mechanisms.md §5): `balanced`, `conversation`, `kv_aware`, pinned ranks,
//! `expected`, and the routing invariant.
//!
//! Every rank runs the same router on the same gathered inputs and so computes the same
//! assignment; ties break by rank id; nothing depends on hash-map order.
//!
//! Guardrails: routing has no side effects on rank state (the executor applies the
//! assignment); the conversation router's LRU and round-robin pointer are its only state
//! and evolve identically on every rank.

mod balanced;
mod conversation;
mod kv_aware;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

use crate::config::RouterKind;
use crate::ids::{ConvId, RankId};
use crate::request::{PinnedRank, RequestSpec};

/// The load of one rank as the router sees it (from the gather).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankLoad {
    /// Routable requests.
    pub requests: u32,
    /// Prompt tokens of the routable requests.
    pub prompt_tokens: u64,
}

/// One routing round's inputs.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput<'a> {
    /// Per rank, from the gather (length = dp).
    pub loads: &'a [RankLoad],
    /// The requests popped by admission, in FIFO order.
    pub new: &'a [RequestSpec],
    /// `M`: requests admitted per rank.
    pub max_per_rank: u32,
    /// KV-aware only: `prefix_matches[rank][i]` = tokens of `new[i]` cached on `rank`.
    pub prefix_matches: Option<&'a [Vec<u32>]>,
}

/// The routing invariant failed: `Σ (expected - count_r) < n_new` (§5, §10).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error(
    "routing invariant: room below expected = {room} < {n_new} new requests (expected {expected}, counts {counts:?})"
)]
pub struct RoutingViolation {
    /// `expected`.
    pub expected: u32,
    /// Σ max(0, expected - count_r).
    pub room: u64,
    /// Requests to place.
    pub n_new: u32,
    /// Counts before routing.
    pub counts: Vec<u32>,
}

/// One routing round's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// `ranks[i]` is where `new[i]` goes.
    pub ranks: Vec<RankId>,
    /// The `expected` of this round (used by the pad need and the cap check).
    pub expected: u32,
    /// Set when the routing invariant did not hold (requests were then placed on the
    /// least-loaded rank so that none is lost).
    pub violation: Option<RoutingViolation>,
}

/// `expected(counts, n_new, mult, cap) = min(cap, max(ceil(mult * ceil((Σcounts + n_new)
/// / dp)), max(counts)))` (§5). `cap = None`: no cap.
pub fn expected(counts: &[u32], n_new: u32, mult: u32, cap: Option<u32>) -> u32 {
    expected_of(counts.iter().copied(), n_new, mult, cap)
}

/// [`expected`] over any re-iterable sequence of counts (the router reads them straight
/// from the gathered loads, without a copy).
fn expected_of(
    counts: impl ExactSizeIterator<Item = u32> + Clone,
    n_new: u32,
    mult: u32,
    cap: Option<u32>,
) -> u32 {
    let dp = counts.len() as u64;
    if dp == 0 {
        return 0;
    }
    // u64 so that neither the sum nor `mult * share` can overflow for u32 inputs.
    let total: u64 = counts.clone().map(u64::from).sum::<u64>() + u64::from(n_new);
    let share = u64::from(mult).saturating_mul(total.div_ceil(dp));
    let highest = counts.max().map_or(0, u64::from);
    let uncapped = share.max(highest);
    let capped = cap.map_or(uncapped, |c| uncapped.min(u64::from(c)));
    u32::try_from(capped).unwrap_or(u32::MAX)
}

/// Checks `Σ max(0, expected - count_r) >= n_new`.
pub fn check_routing_invariant(
    counts: &[u32],
    expected: u32,
    n_new: u32,
) -> Result<(), RoutingViolation> {
    let room: u64 = counts
        .iter()
        .map(|&c| u64::from(expected.saturating_sub(c)))
        .sum();
    if room >= u64::from(n_new) {
        Ok(())
    } else {
        Err(RoutingViolation {
            expected,
            room,
            n_new,
            counts: counts.to_vec(),
        })
    }
}

/// A router with its (replicated) state.
#[derive(Debug, Clone, PartialEq)]
pub struct Router {
    kind: RouterKind,
    /// The conversation router's LRU and round-robin pointer; untouched by other kinds.
    conversations: conversation::Conversations,
}

/// Entries kept by the conversation router's LRU.
pub const CONVERSATION_LRU_CAPACITY: usize = 65_536;

impl Router {
    /// A router of `kind`. It takes no rank count: each round's comes from
    /// `RouteInput::loads`, so no copy of `dp` can disagree with the gather.
    pub fn new(kind: RouterKind) -> Router {
        Router {
            kind,
            conversations: conversation::Conversations::new(CONVERSATION_LRU_CAPACITY),
        }
    }

    /// A conversation router whose LRU keeps `capacity` entries (tests of eviction).
    #[cfg(test)]
    fn with_lru_capacity(capacity: usize) -> Router {
        Router {
            kind: RouterKind::Conversation,
            conversations: conversation::Conversations::new(capacity),
        }
    }

    /// The kind.
    pub fn kind(&self) -> RouterKind {
        self.kind
    }

    /// Whether this router needs the prefix-match allgather.
    pub fn needs_prefix_matches(&self) -> bool {
        self.kind == RouterKind::KvAware
    }

    /// The rank a conversation is bound to, if any (conversation router only).
    pub fn bound_rank(&self, conversation: ConvId) -> Option<RankId> {
        self.conversations.peek(conversation)
    }

    /// Routes one round. Pinned requests (`spec.pinned`) go to their rank first while it
    /// is under `M`, strict before relaxed; the rest per the router's rule. Deterministic.
    pub fn route(&mut self, input: RouteInput<'_>) -> Assignment {
        if input.new.is_empty() {
            return self.route_nothing(input.loads, input.max_per_rank);
        }
        let counts_before: Vec<u32> = input.loads.iter().map(|l| l.requests).collect();
        let n_new = u32::try_from(input.new.len()).unwrap_or(u32::MAX);
        let m = input.max_per_rank;
        let (mult, cap) = self.multiplier_and_cap(m);
        let expected = expected(&counts_before, n_new, mult, cap);
        // §10: the invariant is checked on the counts before this round; a failure is
        // reported, never turned into a dropped request.
        let violation = check_routing_invariant(&counts_before, expected, n_new).err();

        if input.loads.is_empty() {
            // No rank to place on (dp = 0): the violation above already says so whenever
            // there was something to place; answer rank 0 rather than panic.
            return Assignment {
                ranks: vec![RankId(0); input.new.len()],
                expected,
                violation,
            };
        }

        let mut round = Round::new(input.loads, input.new.len());
        let pinned = round.place_pins(input.new, m);
        match self.kind {
            RouterKind::Balanced => balanced::route(&mut round, input.new, expected),
            RouterKind::Conversation => self
                .conversations
                .route(&mut round, input.new, &pinned, expected, m),
            RouterKind::KvAware => {
                kv_aware::route(&mut round, input.new, input.prefix_matches, expected)
            }
        }
        let ranks = round.finish(input.new);
        // Pins and sticky conversations may place up to M, above the balance target; the
        // reported `expected` covers what was placed (never past M), so the cap check of
        // §10 still catches a rank above M (e.g. a dummy that survived a rejected
        // iteration) without flagging a legal placement.
        let mut final_counts = counts_before.clone();
        for r in &ranks {
            if let Some(c) = final_counts.get_mut(r.index()) {
                *c += 1;
            }
        }
        let placed_max = ranks
            .iter()
            .filter_map(|r| final_counts.get(r.index()))
            .copied()
            .max()
            .unwrap_or(0);
        Assignment {
            ranks,
            expected: expected.max(placed_max.min(m)),
            violation,
        }
    }
}

/// The working state of one routing round: counts and prompt-token loads as requests are
/// placed, and where each new request went so far.
impl Router {
    /// The round of most iterations: nothing new to place. The same `expected` as the
    /// general path, without its buffers; with no new request the invariant holds
    /// (room >= 0) and no router state changes.
    fn route_nothing(&self, loads: &[RankLoad], m: u32) -> Assignment {
        let (mult, cap) = self.multiplier_and_cap(m);
        let expected = expected_of(loads.iter().map(|l| l.requests), 0, mult, cap);
        Assignment {
            ranks: Vec::new(),
            expected,
            violation: None,
        }
    }

    /// §5: balanced caps `expected` at M with multiplier 1; conversation uses mult 2 and
    /// no cap (stickiness may go up to M anyway); kv_aware uses mult 2 capped at M.
    fn multiplier_and_cap(&self, m: u32) -> (u32, Option<u32>) {
        match self.kind {
            RouterKind::Balanced => (1, Some(m)),
            RouterKind::Conversation => (2, None),
            RouterKind::KvAware => (2, Some(m)),
        }
    }
}

#[derive(Debug)]
struct Round {
    counts: Vec<u32>,
    tokens: Vec<u64>,
    ranks: Vec<Option<usize>>,
}

impl Round {
    fn new(loads: &[RankLoad], n: usize) -> Round {
        Round {
            counts: loads.iter().map(|l| l.requests).collect(),
            tokens: loads.iter().map(|l| l.prompt_tokens).collect(),
            ranks: vec![None; n],
        }
    }

    fn dp(&self) -> usize {
        self.counts.len()
    }

    fn place(&mut self, i: usize, rank: usize, spec: &RequestSpec) {
        self.ranks[i] = Some(rank);
        self.counts[rank] = self.counts[rank].saturating_add(1);
        self.tokens[rank] = self.tokens[rank].saturating_add(u64::from(spec.prompt_len));
    }

    /// Indices of the requests not placed yet, in FIFO (input) order.
    fn unplaced(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&i| self.ranks[i].is_none())
            .collect()
    }

    /// Ranks whose count is below `limit`, in rank order.
    fn under(&self, limit: u32) -> impl Iterator<Item = usize> + '_ {
        (0..self.dp()).filter(move |&r| self.counts[r] < limit)
    }

    /// The fallback when no rank is under `expected` (§5 "else the least loaded"): the
    /// least (count, rank id). Requires dp > 0.
    fn least_loaded(&self) -> usize {
        (0..self.dp())
            .min_by_key(|&r| (self.counts[r], r))
            .unwrap_or(0)
    }

    /// §5: requests with an explicit rank go there first while it is under `M`, strict
    /// ones before relaxed ones, FIFO otherwise. A pin to a full (or nonexistent) rank is
    /// left for the router's rule. Returns the placed indices in placement order.
    fn place_pins(&mut self, new: &[RequestSpec], m: u32) -> Vec<usize> {
        let mut pins: Vec<(usize, PinnedRank)> = new
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.pinned.map(|p| (i, p)))
            .collect();
        // Stable: ties (same strictness) keep FIFO order.
        pins.sort_by_key(|&(_, p)| !p.strict);
        let mut placed = Vec::new();
        for (i, pin) in pins {
            let r = pin.rank.index();
            if r < self.dp() && self.counts[r] < m {
                self.place(i, r, &new[i]);
                placed.push(i);
            }
        }
        placed
    }

    /// Places anything a rule left unplaced on the least-loaded rank (no request is ever
    /// dropped) and returns the ranks in input order.
    fn finish(mut self, new: &[RequestSpec]) -> Vec<RankId> {
        for i in self.unplaced() {
            let r = self.least_loaded();
            self.place(i, r, &new[i]);
        }
        self.ranks
            .iter()
            .map(|r| RankId(r.map_or(0, |r| u32::try_from(r).unwrap_or(u32::MAX))))
            .collect()
    }
}
