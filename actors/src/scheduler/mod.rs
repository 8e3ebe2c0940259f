//! Schedulers of one rank (mechanisms.md §4): the capacity scheduler (which requests may
//! run at all, given KV) and the micro-batch scheduler (which of those run in this
//! forward, within `B` requests and `T` tokens, with chunked prefill).
//!
//! Guardrails: both are pure functions of their inputs (no side effects; the executor
//! applies the result); the schedulable window is published here ([`published_window`])
//! and read by everyone else.

mod capacity;
mod micro_batch;

pub(crate) use capacity::Classes;
pub use capacity::{CapacityConfig, CapacityOutput, CapacityScheduler, PauseRule};
pub use micro_batch::{BatchEntry, EntryKind, MicroBatchConfig, MicroBatchScheduler};

use crate::request::SchedulableWindow;

/// The window the scheduler publishes (§1).
pub fn published_window(encoder_decoder: bool) -> SchedulableWindow {
    SchedulableWindow::published(encoder_decoder)
}

#[cfg(test)]
mod tests;
