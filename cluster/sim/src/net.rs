//! The simulated network: every message between the front and a server takes the
//! control link's latency (a generation-first notice too, once the front host lets it
//! leave the link between the servers, as in the real drivers). Messages between ranks'
//! transceivers go straight to the receiving transceiver host, which holds each on its
//! modeled wire (latency plus size over bandwidth) as the real drivers' hosts do, and
//! loses the KV the faults name as they do.

use lockstep_plan::model::ModelConfig;

/// The simulated network's parameters.
#[derive(Debug, Clone)]
pub struct SimNet {
    model: ModelConfig,
}

impl SimNet {
    /// The network of a scenario's `[model.link]`.
    pub fn new(model: &ModelConfig) -> SimNet {
        SimNet {
            model: model.clone(),
        }
    }

    /// A message between the front and a server.
    pub fn control_ns(&self) -> u64 {
        self.model.control_ns()
    }
}
