//! The real drivers' loop around the front's host ([`lockstep_hosts::front_host`]): on
//! a thread, or the front process's main thread, it waits for the next input (from the
//! client or a server), hands it to the host with the wall clock's time, passes the
//! host's responses to the client's channel, and keeps the ranks' statuses for
//! `/metrics`. After the client's shutdown, a quiet spell too long is an error naming
//! what is still missing.

use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use lockstep_actors::front::Front;
use lockstep_actors::vocab::Response;
use lockstep_hosts::front_host::FrontHost;
pub use lockstep_hosts::front_host::{FrontEnd, FrontInbound};

use super::RuntimeError;
use super::clock::{Clock, WallClock};
use super::net::{Envelope, Inbox, Net, Received};
use super::status::StatusBoard;
use crate::ordered::{Item, Order, Sequencer, Turn};
use lockstep_hosts::order::Party;

/// How often an ordered run's front looks at what comes outside the order.
const DIRECT_EVERY: Duration = Duration::from_millis(5);

/// The front host in wall time, over a real [`Net`].
pub struct FrontLoop<'a> {
    host: FrontHost,
    net: &'a dyn Net,
    to_client: Option<Sender<Vec<Response>>>,
    clock: WallClock,
    status: Option<StatusBoard>,
}

impl<'a> FrontLoop<'a> {
    /// A loop over `front`, for a fleet of `servers` servers with `ranks` ranks in all.
    pub fn new(
        front: Front,
        servers: usize,
        ranks: usize,
        net: &'a dyn Net,
        to_client: Sender<Vec<Response>>,
        clock: WallClock,
    ) -> FrontLoop<'a> {
        FrontLoop {
            host: FrontHost::new(front, servers, ranks),
            net,
            to_client: Some(to_client),
            clock,
            status: None,
        }
    }

    /// Generation-first notices take the link's time between the servers (the wire
    /// model of a paced run; without one they go at once).
    pub fn with_notice_link(
        mut self,
        wire: Option<lockstep_plan::fleet::WireModel>,
    ) -> FrontLoop<'a> {
        self.host = self.host.with_notice_link(wire);
        self
    }

    /// Keeps the ranks' live status on `board` (without one it is dropped).
    pub fn with_status(mut self, board: Option<StatusBoard>) -> FrontLoop<'a> {
        self.status = board;
        self
    }

    /// Whether every server stopped and every rank's summary arrived (or the fleet was
    /// lost).
    pub fn finished(&self) -> bool {
        self.host.finished()
    }

    /// Handles one input and sends what it produced.
    pub fn handle(&mut self, input: FrontInbound) {
        self.handle_all([input]);
    }

    /// Handles several inputs, then sends what they produced together: a server's rank
    /// 0 reads one batch (the preloaded requests reach every first fetch whole).
    pub fn handle_all(&mut self, inputs: impl IntoIterator<Item = FrontInbound>) {
        self.handle_all_at(self.clock.now_ns(), inputs);
    }

    /// [`FrontLoop::handle_all`] at `now` (an ordered run's modeled time).
    pub fn handle_all_at(&mut self, now: u64, inputs: impl IntoIterator<Item = FrontInbound>) {
        let status = &self.status;
        let inputs = inputs.into_iter().filter_map(|input| match input {
            FrontInbound::Net(Envelope::Status(s)) => {
                if let Some(board) = status {
                    board.update(*s);
                }
                None
            }
            other => Some(other),
        });
        self.host.handle_all(now, inputs, self.net);
        let responses = self.host.take_for_client();
        if !responses.is_empty()
            && let Some(c) = &self.to_client
        {
            // A client that left has nothing to do with them.
            let _ = c.send(responses);
        }
    }

    /// Runs until [`FrontLoop::finished`]; then the client's channel closes. After the
    /// client's shutdown, `quiet_limit` without any message is an error naming the
    /// servers and ranks still missing.
    pub fn run(
        mut self,
        inbox: &mut dyn Inbox<FrontInbound>,
        quiet_limit: Duration,
    ) -> Result<FrontEnd, RuntimeError> {
        let _span = tracing::info_span!("front").entered();
        while !self.finished() {
            let quiet = self
                .host
                .client_done()
                .then(|| Instant::now() + quiet_limit);
            // Notices on the link are due at the host's deadline.
            let link = self.host.poll_timeout().map(|ns| self.clock.instant(ns));
            let deadline = match (quiet, link) {
                (Some(q), Some(l)) => Some(q.min(l)),
                (q, l) => q.or(l),
            };
            match inbox.recv_until(deadline) {
                Received::Message(m) => self.handle(m),
                // The link's deadline, not the quiet bound's (sends what is due).
                Received::TimedOut
                    if link.is_some() && quiet.is_none_or(|q| Instant::now() < q) =>
                {
                    self.host.handle_timeout(self.clock.now_ns(), self.net);
                }
                Received::TimedOut | Received::Closed => {
                    return Err(self.starved(quiet_limit));
                }
            }
        }
        // Closing the client's channel ends the client.
        self.to_client = None;
        Ok(self.host.into_end())
    }

    /// The error of a front that heard nothing for `quiet_limit`: what is missing.
    fn starved(&self, quiet_limit: Duration) -> RuntimeError {
        let (summaries, ranks) = self.host.summaries_received();
        RuntimeError::FrontStarved {
            waited_ms: quiet_limit.as_millis() as u64,
            running_servers: self.host.running_servers(),
            summaries,
            ranks,
        }
    }

    /// Runs in an ordered run ([`crate::ordered`]) until nothing is left to do: in its
    /// turns, at modeled time, it handles the servers' messages one at a time, in order,
    /// and sends the notices due on the link; then it collects the ranks' summaries,
    /// which come over `direct` (a quiet spell of `quiet_limit` is an error naming what
    /// is missing).
    pub fn run_ordered(
        mut self,
        sequencer: &Sequencer,
        direct: &mut dyn Inbox<FrontInbound>,
        quiet_limit: Duration,
    ) -> Result<FrontEnd, RuntimeError> {
        let _span = tracing::info_span!("front", ordered = true).entered();
        // What the preloaded requests left on the link is due at the host's deadline.
        sequencer.end(Party::Front, self.host.poll_timeout());
        let ended = loop {
            // In slices: between turns the ranks' summaries (and, under MPI, the
            // liveness check) come over `direct`, which must not wait for the end (a
            // large summary can hold up its sender's later calls).
            match sequencer.wait_turn(Party::Front, Some(DIRECT_EVERY)) {
                Ok(Turn::Granted(now)) => {
                    match sequencer.take_first(Party::Front, now) {
                        Some(Item::Front(envelope)) => {
                            self.handle_all_at(now, [FrontInbound::Net(envelope)]);
                        }
                        Some(other) => tracing::warn!(?other, "not for the front"),
                        None => self.host.handle_timeout(now, self.net),
                    }
                    sequencer.end(Party::Front, self.host.poll_timeout());
                }
                Ok(Turn::Quiet | Turn::Gone) => break Ok(()),
                Ok(Turn::Slice) => {
                    while let Received::Message(m) = direct.recv_until(Some(Instant::now())) {
                        self.handle(m);
                    }
                    if self.finished() {
                        // The fleet was lost.
                        break Ok(());
                    }
                }
                Ok(Turn::StallOut(_)) => {}
                Err(e) => break Err(e),
            }
        };
        sequencer.leave(Party::Front);
        ended?;
        while !self.finished() {
            match direct.recv_until(Some(Instant::now() + quiet_limit)) {
                Received::Message(m) => self.handle(m),
                Received::TimedOut | Received::Closed => {
                    return Err(self.starved(quiet_limit));
                }
            }
        }
        self.to_client = None;
        Ok(self.host.into_end())
    }
}
