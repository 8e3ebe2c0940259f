//! How a host of the real drivers waits for its messages: a timed receive over a
//! channel, an ingress queue or MPI probes. The simulator needs none of this: it hands
//! each host its inputs as events.

use std::time::{Duration, Instant};

use lockstep_transport::sync::Deadline;
use lockstep_transport::{IngressQueue, Popped};

pub use lockstep_hosts::net::{Endpoint, Envelope, Net, NetError};

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
