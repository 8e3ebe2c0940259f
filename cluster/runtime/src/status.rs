//! What a rank publishes while it runs, for `lockstep serve`'s `/metrics`: its counters
//! and KV occupancy, sent to the front as an [`Envelope::Status`](super::Envelope) —
//! in both real drivers the same message — at most once per `every`, and whenever it
//! goes idle with something changed (so the last state before a quiet spell, a
//! cancelled request's KV freed, is never left unpublished).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use lockstep_actors::executor::{RankExecutor, RankTotals};
use lockstep_actors::kv::KvCounters;

/// How often a running rank publishes its status when asked to (the scrape interval
/// of a Prometheus server is seconds; a quarter second keeps `/metrics` current).
pub const STATUS_EVERY: Duration = Duration::from_millis(250);

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
    fn idle(&self) -> bool {
        self.resident == 0 && self.waiting == 0
    }

    /// The same apart from the iteration count (an idle rank that iterated again has
    /// nothing new to say).
    fn same_state(&self, other: &RankStatus) -> bool {
        let strip = |s: &RankStatus| {
            let mut s = s.clone();
            s.totals.iterations = 0;
            s
        };
        strip(self) == strip(other)
    }
}

/// Decides when a rank publishes.
#[derive(Debug)]
pub struct StatusPublisher {
    every: Duration,
    last_at: Option<Instant>,
    last: Option<RankStatus>,
}

impl StatusPublisher {
    /// At most once per `every`, and on going idle.
    pub fn new(every: Duration) -> StatusPublisher {
        StatusPublisher {
            every,
            last_at: None,
            last: None,
        }
    }

    /// After an iteration of `exec`: the status to send, if one is due.
    pub fn after_iteration(&mut self, server: usize, exec: &RankExecutor) -> Option<RankStatus> {
        let now = Instant::now();
        let due = self
            .last_at
            .is_none_or(|t| now.duration_since(t) >= self.every);
        let status = RankStatus::of(server, exec);
        if !due && !status.idle() {
            return None;
        }
        if self.last.as_ref().is_some_and(|l| l.same_state(&status)) {
            return None;
        }
        self.last_at = Some(now);
        self.last = Some(status.clone());
        Some(status)
    }
}

/// The latest status of every rank, as the front host heard it; cheap to clone (one
/// shared table), read by `/metrics` at each scrape.
#[derive(Debug, Clone, Default)]
pub struct StatusBoard(Arc<Mutex<BTreeMap<(u32, u32), RankStatus>>>);

impl StatusBoard {
    /// Keeps `status` as its rank's latest.
    pub fn update(&self, status: RankStatus) {
        if let Ok(mut table) = self.0.lock() {
            table.insert((status.server, status.rank), status);
        }
    }

    /// Every rank's latest, in (server, rank) order.
    pub fn snapshot(&self) -> Vec<RankStatus> {
        self.0
            .lock()
            .map(|t| t.values().cloned().collect())
            .unwrap_or_default()
    }
}
