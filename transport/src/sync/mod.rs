//! The one switch point between `std` and loom: protocol code never names either.
//!
//! Protocol code imports only `crate::sync`, never `std::sync` or `loom::sync`, so the
//! code loom checks is the code that ships. Both sides have identical signatures:
//!
//! - [`Mutex::lock`] returns the guard directly. Poisoning is not exposed: a peer that
//!   panicked while holding a lock leaves state that the protocol checks itself (the
//!   group is marked broken by the member's `Drop`), so on `std` the guard is recovered.
//! - [`Condvar::wait_until`] waits for a notification or a [`Deadline`]. Under loom it
//!   never times out (loom's `wait_timeout` does not), so protocols must be correct when
//!   no timeout ever fires; timeouts only turn a hang into an error on real threads.
//! - [`cell::UnsafeCell`] offers loom's closure API (`with` / `with_mut`) on both sides.
//!
//! Build with the `loom` feature to get the loom side (`loom-tests` does).

#[cfg(feature = "loom")]
mod mocked;
#[cfg(feature = "loom")]
pub use mocked::*;

#[cfg(not(feature = "loom"))]
mod real;
#[cfg(not(feature = "loom"))]
pub use real::*;
