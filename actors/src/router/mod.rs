//! ADP routers (mechanisms.md §5): `balanced`, `conversation`, `kv_aware`, pinned ranks,
//! `expected`, and the routing invariant.
//!
//! Every rank runs the same router on the same gathered inputs and so computes the same
//! assignment; ties break by rank id; nothing depends on hash-map order.
//!
//! Guardrails: routing has no side effects on rank state (the executor applies the
//! assignment); the conversation router's LRU and round-robin pointer are its only state
//! and evolve identically on every rank.

use serde::{Deserialize, Serialize};

use crate::config::RouterKind;
use crate::ids::{ConvId, RankId};
use crate::request::RequestSpec;

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
    let _ = (counts, n_new, mult, cap);
    todo!()
}

/// Checks `Σ max(0, expected - count_r) >= n_new`.
pub fn check_routing_invariant(
    counts: &[u32],
    expected: u32,
    n_new: u32,
) -> Result<(), RoutingViolation> {
    let _ = (counts, expected, n_new);
    todo!()
}

/// A router with its (replicated) state.
#[derive(Debug, Clone, PartialEq)]
pub struct Router {
    kind: RouterKind,
    _todo: (),
}

/// Entries kept by the conversation router's LRU.
pub const CONVERSATION_LRU_CAPACITY: usize = 65_536;

impl Router {
    /// A router of `kind` for `dp` ranks.
    pub fn new(kind: RouterKind, dp: u32) -> Router {
        let _ = dp;
        Router { kind, _todo: () }
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
        let _ = conversation;
        todo!()
    }

    /// Routes one round. Pinned requests (`spec.pinned`) go to their rank first while it
    /// is under `M`, strict before relaxed; the rest per the router's rule. Deterministic.
    pub fn route(&mut self, input: RouteInput<'_>) -> Assignment {
        let _ = input;
        todo!()
    }
}
