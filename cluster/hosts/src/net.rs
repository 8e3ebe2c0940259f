//! How the hosts reach each other point to point: the front, each server's ingress
//! (read by its rank 0), and each rank's transceiver. A driver implements [`Net`]
//! (channels between threads, MPI messages between processes, the simulator's events in
//! virtual time); the hosts are written once against it.
//!
//! Messages between two endpoints arrive in the order they were sent.

use serde::{Deserialize, Serialize};

use lockstep_actors::executor::RankResponses;
use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::PeerMessage;
use lockstep_actors::vocab::KvAddress;

use lockstep_plan::report::RankSummary;

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Endpoint {
    /// The front (in the front process).
    Front,
    /// A server's ingress queue, read by its rank 0.
    Ingress(usize),
    /// A rank's transceiver.
    Transceiver(KvAddress),
}

/// A message between the runtime's hosts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Envelope {
    /// → a server's ingress: items a reader sees all at once.
    Ingress(Vec<IngressItem>),
    /// → the front: responses gathered by a server's rank 0, one vector per rank.
    Responses {
        /// The server.
        server: u32,
        /// Its ranks' responses, in rank order.
        responses: Vec<RankResponses>,
    },
    /// → the front: a server's rank 0 left its loop (sent after its last responses).
    ServerStopped {
        /// The server.
        server: u32,
    },
    /// → the front: a rank's summary when its loop ended.
    RankEnded(Box<RankSummary>),
    /// → the front: a rank's counters while it runs (`lockstep serve`'s `/metrics`).
    Status(Box<crate::status::RankStatus>),
    /// → a transceiver.
    Peer(PeerMessage),
}

/// A message the network refused. Nothing was delivered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    /// The endpoint's queue is full.
    #[error("{endpoint:?} is full ({capacity} items)")]
    Full {
        /// Where.
        endpoint: Endpoint,
        /// Its bound.
        capacity: usize,
    },
    /// The endpoint is gone (its host stopped).
    #[error("{endpoint:?} is closed")]
    Closed {
        /// Where.
        endpoint: Endpoint,
    },
    /// No such endpoint in this run.
    #[error("{endpoint:?} does not exist in this run")]
    Unknown {
        /// Where.
        endpoint: Endpoint,
    },
}

/// Sends messages between hosts. Shared by every host of a process.
pub trait Net: Send + Sync {
    /// Delivers `envelope` to `to`, or refuses it (and delivers nothing).
    fn send(&self, to: Endpoint, envelope: Envelope) -> Result<(), NetError>;
}

/// A [`Net`] that keeps what is sent until someone takes it: the simulator's (which
/// turns it into events at the times its network says) and the hosts' tests'. A lock
/// no other thread takes: hosts are written against a `Net` that is `Sync`.
#[derive(Debug, Default)]
pub struct Outbox(std::sync::Mutex<Vec<(Endpoint, Envelope)>>);

impl Outbox {
    /// Everything sent since the last call, in order.
    pub fn take(&self) -> Vec<(Endpoint, Envelope)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Net for Outbox {
    fn send(&self, to: Endpoint, envelope: Envelope) -> Result<(), NetError> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((to, envelope));
        Ok(())
    }
}
