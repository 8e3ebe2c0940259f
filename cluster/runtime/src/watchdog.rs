//! What a rank publishes about itself for a watchdog in another thread, and the
//! watchdog: a rank that shows no sign of life for longer than its bound (no collective
//! completed, no keep-alive sent or received) is stuck — a peer is lost, or a collective
//! never completes — and the job is aborted naming it, instead of hanging.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lockstep_actors::executor::{Phase, RankState};

use super::clock::{Clock, WallClock};

/// Progress published by a rank host: plain atomics, so a watchdog can describe a
/// stuck rank without touching its actors.
#[derive(Debug, Default)]
pub struct Progress {
    /// Iterations completed.
    pub iteration: AtomicU64,
    /// Last phase entered (its index in [`Phase::ALL`]).
    pub phase: AtomicU64,
    /// When the rank last showed a sign of life (ns on its clock).
    pub last_alive_ns: AtomicU64,
    /// Live requests at the last gather.
    pub live: AtomicU64,
    /// Routable requests at the last gather.
    pub routable: AtomicU64,
    /// Retiring requests at the last gather.
    pub retiring: AtomicU64,
    /// Schedulable requests at the last gather.
    pub schedulable: AtomicU64,
    /// Waiting queue length at the last gather.
    pub waiting: AtomicU64,
}

impl Progress {
    /// The rank enters a collective.
    pub fn enter(&self, phase: Phase, now_ns: u64) {
        let index = Phase::ALL.iter().position(|p| *p == phase).unwrap_or(0);
        self.phase.store(index as u64, Ordering::Relaxed);
        self.alive(now_ns);
    }

    /// A sign of life.
    pub fn alive(&self, now_ns: u64) {
        self.last_alive_ns.store(now_ns, Ordering::Relaxed);
    }

    /// The rank's counts at a gather.
    pub fn gathered(&self, mine: &RankState, waiting: usize) {
        let c = mine.counts;
        self.live.store(u64::from(c.live), Ordering::Relaxed);
        self.routable
            .store(u64::from(c.routable), Ordering::Relaxed);
        self.retiring
            .store(u64::from(c.retiring), Ordering::Relaxed);
        self.schedulable
            .store(u64::from(c.schedulable), Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
    }

    /// An iteration ended.
    pub fn iteration_done(&self, n: u64, now_ns: u64) {
        self.iteration.store(n, Ordering::Relaxed);
        self.alive(now_ns);
    }

    /// One line for a watchdog message.
    pub fn describe(&self) -> String {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let phase = Phase::ALL
            .get(l(&self.phase) as usize)
            .map_or("?", |p| p.name());
        format!(
            "iteration {}, last collective {phase}, live {}, routable {}, retiring {}, schedulable {}, waiting {}",
            l(&self.iteration),
            l(&self.live),
            l(&self.routable),
            l(&self.retiring),
            l(&self.schedulable),
            l(&self.waiting)
        )
    }
}

/// Watches `progress` from the calling thread: every `limit / 10`, `heartbeats()` says
/// whether a peer's keep-alive arrived (it counts as a sign of life); after `limit`
/// without one, `on_stuck` gets the description and the watch ends. Returns when
/// `finished()` says the rank is done.
pub fn watch(
    progress: &Progress,
    clock: &WallClock,
    limit: Duration,
    mut heartbeats: impl FnMut() -> bool,
    finished: impl Fn() -> bool,
    on_stuck: impl FnOnce(String),
) {
    let limit_ns = limit.as_nanos() as u64;
    loop {
        std::thread::sleep(limit / 10);
        if finished() {
            return;
        }
        let now = clock.now_ns();
        if heartbeats() {
            progress.alive(now);
        }
        let last = progress.last_alive_ns.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= limit_ns {
            on_stuck(format!(
                "no sign of life for {} ms (a peer is lost or stuck); {}",
                limit.as_millis(),
                progress.describe()
            ));
            return;
        }
    }
}
