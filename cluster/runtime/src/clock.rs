//! Time as the real drivers read it: nanoseconds since the run's origin. Below the hosts
//! nothing reads a clock; the actors get `now` as an input.

use std::time::{Duration, Instant};

/// A host's clock.
pub trait Clock: Send + Sync {
    /// Nanoseconds since the origin.
    fn now_ns(&self) -> u64;

    /// Sleeps until `at_ns` (returns at once if it has passed).
    fn sleep_until(&self, at_ns: u64) {
        let now = self.now_ns();
        if at_ns > now {
            std::thread::sleep(Duration::from_nanos(at_ns - now));
        }
    }
}

/// The wall clock from a fixed origin.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    origin: Instant,
}

impl WallClock {
    /// A clock whose origin is now.
    pub fn start() -> WallClock {
        WallClock {
            origin: Instant::now(),
        }
    }

    /// The instant `ns` after the origin.
    pub fn instant(&self, ns: u64) -> Instant {
        self.origin + Duration::from_nanos(ns)
    }
}

impl Clock for WallClock {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}
