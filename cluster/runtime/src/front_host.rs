//! The front's host in the real drivers (a thread, or the front process's main thread):
//! the pure [`Front`] fed with the client's items and the servers' messages; its outputs
//! go out over the [`Net`] — ingress items batched per server and turn, so a server's
//! rank 0 reads what one turn produced all at once. It collects every rank's summary
//! and returns them when every server has stopped.

use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use lockstep_actors::front::{Front, FrontIn, ServerIngress};
use lockstep_actors::request::IngressItem;
use lockstep_actors::vocab::Response;

use super::RuntimeError;
use super::client::ClientItem;
use super::clock::{Clock, WallClock};
use super::net::{Endpoint, Envelope, Inbox, Net, NetError, Received};
use super::status::StatusBoard;
use lockstep_plan::report::RankSummary;

/// What reaches the front host.
#[derive(Debug)]
pub enum FrontInbound {
    /// From the client.
    Client(ClientItem),
    /// From a server.
    Net(Envelope),
    /// The driver lost contact with some of the fleet's ranks (the MPI driver's
    /// liveness check): the run ends now, every request in flight failing with this
    /// reason, which names the ranks lost.
    Lost(String),
}

/// How the front's run ended.
#[derive(Debug)]
pub struct FrontEnd {
    /// The summaries of the ranks that reported their end (all of them, unless the
    /// fleet was lost).
    pub summaries: Vec<RankSummary>,
    /// Set when the fleet was lost ([`FrontInbound::Lost`]): why.
    pub lost: Option<String>,
}

/// The front's host.
pub struct FrontHost<'a> {
    front: Front,
    net: &'a dyn Net,
    to_client: Option<Sender<Vec<Response>>>,
    clock: WallClock,
    /// Servers that reported they stopped: nothing more is sent to them.
    stopped: Vec<bool>,
    summaries: Vec<RankSummary>,
    ranks: usize,
    client_done: bool,
    lost: Option<String>,
    status: Option<StatusBoard>,
}

impl<'a> FrontHost<'a> {
    /// A host over `front`, for a fleet of `servers` servers with `ranks` ranks in all.
    pub fn new(
        front: Front,
        servers: usize,
        ranks: usize,
        net: &'a dyn Net,
        to_client: Sender<Vec<Response>>,
        clock: WallClock,
    ) -> FrontHost<'a> {
        FrontHost {
            front,
            net,
            to_client: Some(to_client),
            clock,
            stopped: vec![false; servers],
            summaries: Vec::with_capacity(ranks),
            ranks,
            client_done: false,
            lost: None,
            status: None,
        }
    }

    /// Keeps the ranks' live status on `board` (without one it is dropped).
    pub fn with_status(mut self, board: Option<StatusBoard>) -> FrontHost<'a> {
        self.status = board;
        self
    }

    /// Whether every server stopped and every rank's summary arrived (or the fleet was
    /// lost).
    pub fn finished(&self) -> bool {
        self.front.all_stopped() && (self.summaries.len() >= self.ranks || self.lost.is_some())
    }

    /// Handles one input and sends what it produced.
    pub fn handle(&mut self, input: FrontInbound) {
        self.take(input);
        self.flush();
    }

    /// Handles several inputs, then sends what they produced together: a server's rank
    /// 0 reads one batch (the preloaded requests reach every first fetch whole).
    pub fn handle_all(&mut self, inputs: impl IntoIterator<Item = FrontInbound>) {
        for input in inputs {
            self.take(input);
        }
        self.flush();
    }

    fn take(&mut self, input: FrontInbound) {
        let now = self.clock.now_ns();
        match input {
            FrontInbound::Client(ClientItem::Request(spec)) => {
                self.front.handle(now, FrontIn::Request(spec))
            }
            FrontInbound::Client(ClientItem::Cancel(id)) => {
                self.front.handle(now, FrontIn::Cancel(id))
            }
            FrontInbound::Client(ClientItem::Shutdown) => {
                self.client_done = true;
                self.front.handle(now, FrontIn::Shutdown)
            }
            FrontInbound::Net(Envelope::Responses { server, responses }) => {
                let mut out = Vec::new();
                for mut r in responses {
                    self.front
                        .handle_responses(now, server as usize, r.rank, &mut r.responses);
                    out.append(&mut r.responses);
                }
                self.to_client(out);
            }
            FrontInbound::Net(Envelope::ServerStopped { server }) => {
                self.stopped[server as usize] = true;
                self.front
                    .handle(now, FrontIn::ServerStopped(server as usize));
            }
            FrontInbound::Net(Envelope::RankEnded(summary)) => self.summaries.push(*summary),
            FrontInbound::Net(Envelope::Status(status)) => {
                if let Some(board) = &self.status {
                    board.update(*status);
                }
            }
            FrontInbound::Lost(reason) => {
                self.stopped.iter_mut().for_each(|s| *s = true);
                self.front.handle(
                    now,
                    FrontIn::FleetLost {
                        reason: reason.clone(),
                    },
                );
                self.lost = Some(reason);
            }
            FrontInbound::Net(other @ (Envelope::Ingress(_) | Envelope::Peer(_))) => {
                tracing::warn!(?other, "the front got a message meant for a server");
            }
        }
    }

    fn to_client(&self, responses: Vec<Response>) {
        if !responses.is_empty()
            && let Some(c) = &self.to_client
        {
            // A client that left has nothing to do with them.
            let _ = c.send(responses);
        }
    }

    /// Sends everything the front produced, ingress items batched per server; what a
    /// server cannot take fails its request (which may produce more output).
    fn flush(&mut self) {
        loop {
            let turn = self.front.take_turn();
            for (to, message) in turn.to_peers {
                if !self.stopped[to.server as usize] {
                    // A rank that stopped has nothing left to free.
                    let _ = self
                        .net
                        .send(Endpoint::Transceiver(to), Envelope::Peer(message));
                }
            }
            self.to_client(turn.to_client);
            let mut ingress = turn.ingress;
            for (server, notice) in turn.notices {
                // Sent with the server's control items, after its requests.
                ingress.entry(server).or_default().control.push(notice);
            }
            if ingress.is_empty() {
                return;
            }
            let now = self.clock.now_ns();
            for (server, ServerIngress { requests, control }) in ingress {
                if !requests.is_empty()
                    && let Err(e) = self.send_ingress(server, requests.clone())
                {
                    for item in requests {
                        if let IngressItem::Request(spec) = item {
                            self.front.handle(
                                now,
                                FrontIn::SubmitFailed {
                                    server,
                                    id: spec.id,
                                    reason: format!("server {server}: {e}"),
                                },
                            );
                        }
                    }
                }
                if !control.is_empty() {
                    // A server that stopped has nothing to do with them.
                    let _ = self.send_ingress(server, control);
                }
            }
        }
    }

    fn send_ingress(&self, server: usize, items: Vec<IngressItem>) -> Result<(), NetError> {
        if self.stopped[server] {
            return Err(NetError::Closed {
                endpoint: Endpoint::Ingress(server),
            });
        }
        self.net
            .send(Endpoint::Ingress(server), Envelope::Ingress(items))
    }

    /// Runs until [`FrontHost::finished`]; then the client's channel closes. After the
    /// client's shutdown, `quiet_limit` without any message is an error naming the
    /// servers and ranks still missing.
    pub fn run(
        mut self,
        inbox: &mut dyn Inbox<FrontInbound>,
        quiet_limit: Duration,
    ) -> Result<FrontEnd, RuntimeError> {
        let _span = tracing::info_span!("front").entered();
        while !self.finished() {
            let deadline = self.client_done.then(|| Instant::now() + quiet_limit);
            match inbox.recv_until(deadline) {
                Received::Message(m) => self.handle(m),
                Received::TimedOut | Received::Closed => {
                    let running: Vec<usize> = (0..self.stopped.len())
                        .filter(|&s| !self.stopped[s])
                        .collect();
                    return Err(RuntimeError::FrontStarved {
                        waited_ms: quiet_limit.as_millis() as u64,
                        running_servers: running,
                        summaries: self.summaries.len(),
                        ranks: self.ranks,
                    });
                }
            }
        }
        // Closing the client's channel ends the client.
        self.to_client = None;
        Ok(FrontEnd {
            summaries: self.summaries,
            lost: self.lost,
        })
    }
}
