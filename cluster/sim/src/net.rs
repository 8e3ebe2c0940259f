//! The simulated network: every message between the front and a server takes the
//! control link's latency; every message between ranks of different servers (KV
//! transfers, pulls, acknowledgements, generation-first notices) takes the link's
//! latency plus its size over the link's bandwidth. Faults are deterministic: the KV of
//! the requests [`lost_on_the_wire`](lockstep_actors::transceiver::lost_on_the_wire)
//! names is dropped, as the real drivers drop it.

use lockstep_plan::model::ModelConfig;
use lockstep_plan::scenario::Faults;

/// The simulated network's parameters.
#[derive(Debug, Clone)]
pub struct SimNet {
    model: ModelConfig,
    faults: Faults,
}

impl SimNet {
    /// The network of a scenario's `[model.link]` and `[faults]`.
    pub fn new(model: &ModelConfig, faults: Faults) -> SimNet {
        SimNet {
            model: model.clone(),
            faults,
        }
    }

    /// A message between the front and a server.
    pub fn control_ns(&self) -> u64 {
        self.model.control_ns()
    }

    /// A message of `bytes` between ranks of different servers.
    pub fn wire_ns(&self, bytes: u64) -> u64 {
        self.model.wire_ns(bytes)
    }

    /// `[faults] lost_transfer_every`.
    pub fn lose_kv_every(&self) -> Option<u64> {
        self.faults.lost_transfer_every
    }

    /// Whether transceivers' timeouts fire (`[faults] timeouts_lost` turns them off).
    pub fn timeouts_fire(&self) -> bool {
        !self.faults.timeouts_lost
    }
}
