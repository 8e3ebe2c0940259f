//! Structured invariant violations (mechanisms.md §10): a violation is a value with the
//! iteration, the rank and the numbers, never a panic in the middle of a collective.

use serde::{Deserialize, Serialize};

use crate::ids::RankId;

/// Which invariant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum InvariantKind {
    /// Seat holders exceed the seats, or a seat-indexed pool disagrees with them.
    Seats,
    /// An admitted request could not be given a seat (the real rank dies mid-collective).
    SeatUnavailable,
    /// used + free != total, or block bookkeeping disagrees.
    Blocks,
    /// A finished or failed request still holds KV (outside an in-flight send).
    BlockLeak,
    /// A dummy is alive at the end of an iteration.
    DummySurvived,
    /// The rank's admission count exceeds `expected` (checked before padding; the
    /// historical `assert expected >= len(active)`).
    Cap,
    /// `Σ (expected - count_r) < n_new`.
    Routing,
    /// A request is in no place or in two.
    Accounting,
}

impl InvariantKind {
    /// Whether the real executor crashes on this violation (it asserted or could not
    /// seat a request). The simulator ends such a run as `crashed`.
    pub fn is_fatal(self) -> bool {
        matches!(self, InvariantKind::Cap | InvariantKind::SeatUnavailable)
    }

    /// Name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            InvariantKind::Seats => "seats",
            InvariantKind::SeatUnavailable => "seat_unavailable",
            InvariantKind::Blocks => "blocks",
            InvariantKind::BlockLeak => "block_leak",
            InvariantKind::DummySurvived => "dummy_survived",
            InvariantKind::Cap => "cap",
            InvariantKind::Routing => "routing",
            InvariantKind::Accounting => "accounting",
        }
    }
}

/// One violation: where, which, and the numbers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("iteration {iteration}, rank {rank}: {} violated: {detail}", kind.name())]
pub struct Violation {
    /// Iteration.
    pub iteration: u64,
    /// Rank.
    pub rank: RankId,
    /// Which invariant.
    pub kind: InvariantKind,
    /// The numbers, in words.
    pub detail: String,
}
