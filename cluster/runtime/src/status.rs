//! What a rank publishes while it runs, for `lockstep serve`'s `/metrics`: its counters
//! and KV occupancy, sent to the front as an [`Envelope::Status`](super::Envelope) —
//! in both real drivers the same message — at most once per `every`, and whenever it
//! goes idle with something changed (so the last state before a quiet spell, a
//! cancelled request's KV freed, is never left unpublished).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockstep_actors::executor::RankExecutor;

pub use lockstep_hosts::status::RankStatus;

/// How often a running rank publishes its status when asked to (the scrape interval
/// of a Prometheus server is seconds; a quarter second keeps `/metrics` current).
pub const STATUS_EVERY: Duration = Duration::from_millis(250);

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
