//! The capacity scheduler (§4): GUARANTEED_NO_EVICT, MAX_UTILIZATION (pause-and-reset),
//! STATIC_BATCH; switches `admission.charge_retiring` (window end) and
//! `gne.count_transfers_as_requests`.

use serde::{Deserialize, Serialize};

use crate::config::CapacitySchedulerPolicy;
use crate::kv::KvView;
use crate::request::{Request, SchedulableWindow};

/// How a capacity scheduler is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityConfig {
    /// Policy.
    pub policy: CapacitySchedulerPolicy,
    /// Logical request cap per rank (`M`).
    pub max_num_requests: u32,
    /// The published window.
    pub window: SchedulableWindow,
    /// Legacy `admission.charge_retiring`: the window ends at GENERATION_COMPLETE, so
    /// retiring requests take request slots (but are never put in a batch).
    pub window_ends_at_complete: bool,
    /// Legacy `gne.count_transfers_as_requests`.
    pub count_transfers_as_requests: bool,
}

/// What the capacity scheduler decided. Indices point into the `active` slice given.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CapacityOutput {
    /// Requests that may run this iteration (in `active` order). Never contains retiring
    /// or transfer-state requests.
    pub fitting: Vec<usize>,
    /// DISAGG_GENERATION_INIT requests whose blocks to completion fit: the executor
    /// reserves their KV and starts their receive.
    pub disagg_gen_init: Vec<usize>,
    /// MAX_UTILIZATION: started requests paused (reset to context, KV freed).
    pub paused: Vec<usize>,
}

/// The capacity scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityScheduler {
    config: CapacityConfig,
}

impl CapacityScheduler {
    /// A scheduler.
    pub fn new(config: CapacityConfig) -> CapacityScheduler {
        CapacityScheduler { config }
    }

    /// The published window.
    pub fn window(&self) -> SchedulableWindow {
        self.config.window
    }

    /// Decides which of `active` may run, given the KV pool. Pure.
    pub fn schedule(&self, active: &[Request], kv: &impl KvView) -> CapacityOutput {
        let _ = (active, kv);
        todo!()
    }
}
