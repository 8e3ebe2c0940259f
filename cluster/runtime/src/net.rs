//! How the runtime's hosts reach each other point to point: the front, each server's
//! ingress (read by its rank 0), and each rank's transceiver. A backend implements
//! [`Net`] (channels between threads, MPI messages between processes); the hosts are
//! written once against it.
//!
//! Messages between two endpoints arrive in the order they were sent.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use lockstep_transport::sync::Deadline;
use lockstep_transport::{IngressQueue, Popped};

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
    Status(Box<super::status::RankStatus>),
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

/// What a timed receive found.
#[derive(Debug)]
pub enum Received<T> {
    /// A message.
    Message(T),
    /// Nothing before the deadline.
    TimedOut,
    /// Nothing will ever come (every sender is gone, or the inbox was closed).
    Closed,
}

/// One host's incoming messages.
pub trait Inbox<T> {
    /// The next message, waiting until `deadline` at most (`None`: as long as it
    /// takes).
    fn recv_until(&mut self, deadline: Option<std::time::Instant>) -> Received<T>;

    /// The next message if one is there now.
    fn try_recv(&mut self) -> Option<T> {
        match self.recv_until(Some(std::time::Instant::now())) {
            Received::Message(m) => Some(m),
            Received::TimedOut | Received::Closed => None,
        }
    }
}

/// A bounded [`IngressQueue`] as an inbox: how a server's rank 0 reads its ingress in
/// one process (the threads backend, the loom model).
#[derive(Debug)]
pub struct QueueInbox<T>(pub IngressQueue<T>);

impl<T> Inbox<T> for QueueInbox<T> {
    fn recv_until(&mut self, deadline: Option<Instant>) -> Received<T> {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(365 * 24 * 3600),
        };
        match self.0.pop_until(&Deadline::after(wait)) {
            Popped::Item(i) => Received::Message(i),
            Popped::TimedOut => Received::TimedOut,
            Popped::Closed => Received::Closed,
        }
    }

    // Never waits, also under loom, where a deadline never passes.
    fn try_recv(&mut self) -> Option<T> {
        self.0.try_pop()
    }
}
