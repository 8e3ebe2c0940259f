//! The loom side of the shim: same signatures as the `std` side.

use std::time::Duration;

pub use loom::sync::{Arc, MutexGuard, atomic};
pub use loom::thread;

/// loom's mutex; `lock` returns the guard (loom never poisons a lock it reports on).
#[derive(Debug, Default)]
pub struct Mutex<T>(loom::sync::Mutex<T>);

impl<T> Mutex<T> {
    /// A new unlocked mutex holding `value`.
    pub fn new(value: T) -> Mutex<T> {
        Mutex(loom::sync::Mutex::new(value))
    }

    /// Locks, blocking until the lock is free.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// loom's condition variable.
#[derive(Debug, Default)]
pub struct Condvar(loom::sync::Condvar);

impl Condvar {
    /// A new condition variable.
    pub fn new() -> Condvar {
        Condvar(loom::sync::Condvar::new())
    }

    /// Releases the guard, waits for a notification, relocks.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.0
            .wait(guard)
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Under loom a deadline never passes: this is [`Condvar::wait`], so a model that
    /// needs a timeout to make progress shows up as a loom deadlock.
    pub fn wait_until<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        _deadline: &Deadline,
    ) -> (MutexGuard<'a, T>, bool) {
        (self.wait(guard), false)
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

/// When a wait gives up. Under loom it never arrives, and reading the clock would make
/// executions differ, so it holds nothing.
#[derive(Debug, Clone, Copy)]
pub struct Deadline;

impl Deadline {
    /// A deadline that never passes.
    pub fn after(_timeout: Duration) -> Deadline {
        Deadline
    }

    /// Always 0 under loom.
    pub fn elapsed_ms(&self) -> u64 {
        0
    }
}

/// Interior mutability with loom's closure API.
pub mod cell {
    pub use loom::cell::UnsafeCell;
}
