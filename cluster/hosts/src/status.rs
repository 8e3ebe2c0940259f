//! What a rank publishes while it runs (`lockstep serve`'s `/metrics`): its counters
//! and KV occupancy, as an [`Envelope::Status`](crate::net::Envelope).

use serde::{Deserialize, Serialize};

use lockstep_actors::executor::{RankExecutor, RankTotals};
use lockstep_actors::kv::KvCounters;

/// One rank's state as the front last heard it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankStatus {
    /// Server index (scenario order).
    pub server: u32,
    /// Rank.
    pub rank: u32,
    /// Cumulative counters.
    pub totals: RankTotals,
    /// KV counters (prefix-cache hits among them).
    pub kv: KvCounters,
    /// KV blocks held by a sequence.
    pub kv_blocks_used: u32,
    /// KV blocks of the rank.
    pub kv_blocks_total: u32,
    /// Requests resident on the rank (started, not ended).
    pub resident: u32,
    /// The server's waiting queue (replicated on every rank).
    pub waiting: u32,
}

impl RankStatus {
    /// The status of `exec`, a rank of server `server`.
    pub fn of(server: usize, exec: &RankExecutor) -> RankStatus {
        RankStatus {
            server: server as u32,
            rank: exec.rank().0,
            totals: *exec.totals(),
            kv: *exec.kv().counters(),
            kv_blocks_used: exec.kv().used_blocks(),
            kv_blocks_total: exec.kv().total_blocks(),
            resident: (exec.active().len() + exec.sending().len()) as u32,
            waiting: exec.waiting().len() as u32,
        }
    }

    /// Nothing resident or waiting.
    pub fn idle(&self) -> bool {
        self.resident == 0 && self.waiting == 0
    }

    /// The same apart from the iteration count (an idle rank that iterated again has
    /// nothing new to say).
    pub fn same_state(&self, other: &RankStatus) -> bool {
        let strip = |s: &RankStatus| {
            let mut s = s.clone();
            s.totals.iterations = 0;
            s
        };
        strip(self) == strip(other)
    }
}
