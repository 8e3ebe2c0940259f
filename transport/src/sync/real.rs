//! The `std` side of the shim.

use std::time::{Duration, Instant};

pub use std::sync::{Arc, MutexGuard, atomic};
pub use std::thread;

/// A mutual-exclusion lock whose `lock` never reports poisoning.
#[derive(Debug, Default)]
pub struct Mutex<T>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `value`.
    pub fn new(value: T) -> Mutex<T> {
        Mutex(std::sync::Mutex::new(value))
    }

    /// Locks, blocking until the lock is free. A poisoned lock is recovered: callers
    /// validate the protected state themselves.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// A condition variable paired with [`Mutex`].
#[derive(Debug, Default)]
pub struct Condvar(std::sync::Condvar);

impl Condvar {
    /// A new condition variable.
    pub fn new() -> Condvar {
        Condvar(std::sync::Condvar::new())
    }

    /// Releases the guard, waits for a notification (or a spurious wake-up), relocks.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.0
            .wait(guard)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Like [`Condvar::wait`], but gives up at `deadline`. Returns the guard and whether
    /// the deadline has passed; the caller re-checks its condition either way, because a
    /// wake-up and the deadline can coincide.
    pub fn wait_until<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        deadline: &Deadline,
    ) -> (MutexGuard<'a, T>, bool) {
        let now = Instant::now();
        if now >= deadline.end {
            return (guard, true);
        }
        let (guard, _) = self
            .0
            .wait_timeout(guard, deadline.end - now)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (guard, Instant::now() >= deadline.end)
    }

    /// Wakes one waiter.
    pub fn notify_one(&self) {
        self.0.notify_one();
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        self.0.notify_all();
    }
}

/// When a wait gives up. Under loom it never arrives.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    start: Instant,
    end: Instant,
}

impl Deadline {
    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        let start = Instant::now();
        // An absurdly long timeout saturates instead of overflowing `Instant`.
        let end = start
            .checked_add(timeout)
            .unwrap_or(start + Duration::from_secs(365 * 24 * 3600));
        Deadline { start, end }
    }

    /// Milliseconds since the deadline was set (for error reports).
    pub fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Interior mutability with loom's closure API.
pub mod cell {
    /// `std::cell::UnsafeCell` with loom's `with` / `with_mut`, so code is written once,
    /// loom-style.
    #[derive(Debug, Default)]
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        /// A new cell holding `value`.
        pub fn new(value: T) -> UnsafeCell<T> {
            UnsafeCell(std::cell::UnsafeCell::new(value))
        }

        /// Runs `f` with a shared raw pointer to the value.
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        /// Runs `f` with a mutable raw pointer to the value.
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}
