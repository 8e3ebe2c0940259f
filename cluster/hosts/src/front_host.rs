//! The front's host, written once: the pure [`Front`] fed with the client's items and
//! the servers' messages, its outputs sent over a [`Net`] — ingress items batched per
//! server and turn (a server's rank 0 reads what one turn produced all at once), a
//! server's control items after its requests, messages for transceivers as they were
//! made. It collects every rank's summary and knows when the run is over.
//!
//! Sans-I/O: `now` comes in with every input, and the [`Net`] is whatever the driver
//! implements — channels (threads), MPI messages, or the simulator's events in virtual
//! time. The real drivers' blocking loop around it lives in `lockstep-runtime`.

use std::collections::VecDeque;

use lockstep_actors::front::{Front, FrontIn, ServerIngress};
use lockstep_actors::ids::RankId;
use lockstep_actors::request::IngressItem;
use lockstep_actors::vocab::Response;

use crate::client::ClientItem;
use crate::net::{Endpoint, Envelope, Net, NetError};
use lockstep_plan::fleet::WireModel;
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
pub struct FrontHost {
    front: Front,
    /// Responses for the client, in the order they were made, until the driver takes
    /// them.
    for_client: Vec<Response>,
    /// Servers that reported they stopped: nothing more is sent to them.
    stopped: Vec<bool>,
    summaries: Vec<RankSummary>,
    ranks: usize,
    client_done: bool,
    lost: Option<String>,
    /// A generation-first notice's time on the link between the servers (`None`: it
    /// goes at once).
    notice_ns: Option<u64>,
    /// Notices on that link, in the order made: when each is due, its ctx server.
    on_link: VecDeque<(u64, usize, IngressItem)>,
}

impl FrontHost {
    /// A host over `front`, for a fleet of `servers` servers with `ranks` ranks in all.
    pub fn new(front: Front, servers: usize, ranks: usize) -> FrontHost {
        FrontHost {
            front,
            for_client: Vec::new(),
            stopped: vec![false; servers],
            summaries: Vec::with_capacity(ranks),
            ranks,
            client_done: false,
            lost: None,
            notice_ns: None,
            on_link: VecDeque::new(),
        }
    }

    /// Generation-first notices take the link's time for a small message between the
    /// servers (`WireModel::notice_ns`): they stand for the gen peer's answer to the ctx
    /// server. Every driver with modeled time gives its wire model (the simulator at
    /// scale 1); without one a notice goes at once.
    pub fn with_notice_link(mut self, wire: Option<WireModel>) -> FrontHost {
        self.notice_ns = wire.map(|w| w.notice_ns()).filter(|&ns| ns > 0);
        self
    }

    /// When the next notice on the link is due ([`FrontHost::handle_timeout`]).
    pub fn poll_timeout(&self) -> Option<u64> {
        self.on_link.front().map(|&(due, _, _)| due)
    }

    /// Sends the notices due by `now`, each server's in one message.
    pub fn handle_timeout(&mut self, now: u64, net: &dyn Net) {
        let mut due: Vec<(usize, Vec<IngressItem>)> = Vec::new();
        while let Some(&(at, server, _)) = self.on_link.front()
            && at <= now
        {
            let (_, _, notice) = self.on_link.pop_front().expect("just seen");
            if self.stopped[server] {
                continue;
            }
            match due.iter_mut().find(|(s, _)| *s == server) {
                Some((_, items)) => items.push(notice),
                None => due.push((server, vec![notice])),
            }
        }
        for (server, items) in due {
            // A server that stopped meanwhile has nothing to do with them.
            let _ = net.send(Endpoint::Ingress(server), Envelope::Ingress(items));
        }
    }

    /// Whether every server stopped and every rank's summary arrived (or the fleet was
    /// lost).
    pub fn finished(&self) -> bool {
        self.front.all_stopped() && (self.summaries.len() >= self.ranks || self.lost.is_some())
    }

    /// Whether the client said it is done.
    pub fn client_done(&self) -> bool {
        self.client_done
    }

    /// The servers that have not said they stopped.
    pub fn running_servers(&self) -> Vec<usize> {
        (0..self.stopped.len())
            .filter(|&s| !self.stopped[s])
            .collect()
    }

    /// Rank summaries received, and expected.
    pub fn summaries_received(&self) -> (usize, usize) {
        (self.summaries.len(), self.ranks)
    }

    /// Handles one input at `now` and sends what it produced.
    pub fn handle(&mut self, now: u64, input: FrontInbound, net: &dyn Net) {
        self.take(now, input);
        self.flush(now, net);
    }

    /// Handles several inputs, then sends what they produced together: a server's rank
    /// 0 reads one batch (the preloaded requests reach every first fetch whole).
    pub fn handle_all(
        &mut self,
        now: u64,
        inputs: impl IntoIterator<Item = FrontInbound>,
        net: &dyn Net,
    ) {
        for input in inputs {
            self.take(now, input);
        }
        self.flush(now, net);
    }

    /// The network could not hand `items` to server `server` after all (the
    /// simulator's: they reached a server that had stopped meanwhile): its requests fail.
    pub fn bounced(&mut self, now: u64, server: usize, items: Vec<IngressItem>, net: &dyn Net) {
        let error = NetError::Closed {
            endpoint: Endpoint::Ingress(server),
        };
        self.fail_requests(now, server, items, &error);
        self.flush(now, net);
    }

    /// A server's rank's gathered responses, handled in place (the simulator's way,
    /// which passes the same slice on to its client): nothing is sent until
    /// [`FrontHost::send_turn`].
    pub fn gathered(&mut self, now: u64, server: usize, rank: RankId, responses: &mut [Response]) {
        self.front.handle_responses(now, server, rank, responses);
    }

    /// Sends what the front produced since the last turn.
    pub fn send_turn(&mut self, now: u64, net: &dyn Net) {
        self.flush(now, net);
    }

    /// The responses for the client since the last call, in order.
    pub fn take_for_client(&mut self) -> Vec<Response> {
        std::mem::take(&mut self.for_client)
    }

    /// Whether responses wait for the client.
    pub fn has_for_client(&self) -> bool {
        !self.for_client.is_empty()
    }

    /// The end of the run: the summaries and, if it was, why the fleet was lost.
    pub fn into_end(self) -> FrontEnd {
        FrontEnd {
            summaries: self.summaries,
            lost: self.lost,
        }
    }

    fn take(&mut self, now: u64, input: FrontInbound) {
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
                for mut r in responses {
                    self.gathered(now, server as usize, r.rank, &mut r.responses);
                    self.for_client.append(&mut r.responses);
                }
            }
            FrontInbound::Net(Envelope::ServerStopped { server }) => {
                self.stopped[server as usize] = true;
                self.front
                    .handle(now, FrontIn::ServerStopped(server as usize));
            }
            FrontInbound::Net(Envelope::RankEnded(summary)) => self.summaries.push(*summary),
            FrontInbound::Net(Envelope::Status(status)) => {
                // The driver keeps statuses (`lockstep serve`'s board); the front's
                // decisions never depend on them.
                tracing::trace!(server = status.server, rank = status.rank, "status");
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

    /// Sends everything the front produced, ingress items batched per server; what a
    /// server cannot take fails its request (which may produce more output).
    fn flush(&mut self, now: u64, net: &dyn Net) {
        loop {
            let turn = self.front.take_turn();
            for (to, message) in turn.to_peers {
                if !self.stopped[to.server as usize] {
                    // A rank that stopped has nothing left to free.
                    let _ = net.send(Endpoint::Transceiver(to), Envelope::Peer(message));
                }
            }
            self.for_client.extend(turn.to_client);
            if turn.ingress.is_empty() && turn.notices.is_empty() {
                return;
            }
            for (server, ServerIngress { requests, control }) in turn.ingress {
                if !requests.is_empty()
                    && let Err(e) = self.send_ingress(net, server, requests.clone())
                {
                    self.fail_requests(now, server, requests, &e);
                }
                if !control.is_empty() {
                    // A server that stopped has nothing to do with them.
                    let _ = self.send_ingress(net, server, control);
                }
            }
            // After the servers' requests, so a notice never overtakes the request it
            // concerns.
            for (server, notice) in turn.notices {
                if self.stopped[server] {
                    continue;
                }
                match self.notice_ns {
                    Some(ns) => self.on_link.push_back((now + ns, server, notice)),
                    None => {
                        let _ =
                            net.send(Endpoint::Ingress(server), Envelope::Ingress(vec![notice]));
                    }
                }
            }
        }
    }

    fn fail_requests(&mut self, now: u64, server: usize, items: Vec<IngressItem>, e: &NetError) {
        for item in items {
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

    fn send_ingress(
        &self,
        net: &dyn Net,
        server: usize,
        items: Vec<IngressItem>,
    ) -> Result<(), NetError> {
        if self.stopped[server] {
            return Err(NetError::Closed {
                endpoint: Endpoint::Ingress(server),
            });
        }
        net.send(Endpoint::Ingress(server), Envelope::Ingress(items))
    }
}

#[cfg(test)]
mod tests {
    use lockstep_actors::config::{Role, ServerLimits};
    use lockstep_actors::front::{FrontConfig, FrontPolicy, FrontServer};
    use lockstep_actors::ids::ReqId;
    use lockstep_actors::request::RequestSpec;
    use lockstep_actors::vocab::Finish;

    use super::*;
    use crate::net::Outbox;

    fn host(servers: &[(Role, bool)]) -> FrontHost {
        let front = Front::new(&FrontConfig {
            policy: FrontPolicy::RoundRobin,
            servers: servers
                .iter()
                .map(|&(role, generation_first)| FrontServer {
                    name: String::new(),
                    role,
                    generation_first,
                    limits: ServerLimits::UNBOUNDED,
                })
                .collect(),
            prefix_memory: 0,
        });
        FrontHost::new(front, servers.len(), servers.len())
    }

    fn request(id: u64) -> FrontInbound {
        FrontInbound::Client(ClientItem::Request(RequestSpec::new(id, 100, 8)))
    }

    #[test]
    fn a_request_for_a_server_that_stopped_fails_at_the_front_and_is_not_sent() {
        let mut h = host(&[(Role::Agg, false)]);
        let net = Outbox::default();
        h.handle(0, request(1), &net);
        assert_eq!(net.take().len(), 1, "the first request goes out");
        h.handle(
            1,
            FrontInbound::Net(Envelope::ServerStopped { server: 0 }),
            &net,
        );
        h.handle(2, request(2), &net);
        assert_eq!(net.take().len(), 0, "nothing more is sent");
        let answers = h.take_for_client();
        assert!(
            answers
                .iter()
                .any(|r| r.id == ReqId(2) && matches!(r.finish, Some(Finish::Failed(_)))),
            "{answers:?}"
        );
    }

    #[test]
    fn a_network_that_bounces_a_request_fails_it() {
        let mut h = host(&[(Role::Agg, false)]);
        let net = Outbox::default();
        h.handle(0, request(1), &net);
        let (_, sent) = net.take().pop().unwrap();
        let Envelope::Ingress(items) = sent else {
            panic!("not an ingress message: {sent:?}")
        };
        h.bounced(5, 0, items, &net);
        let answers = h.take_for_client();
        assert!(
            answers
                .iter()
                .any(|r| r.id == ReqId(1) && matches!(r.finish, Some(Finish::Failed(_)))),
            "{answers:?}"
        );
    }

    fn items_to(sent: &[(Endpoint, Envelope)], server: usize) -> Vec<IngressItem> {
        sent.iter()
            .filter(|(to, _)| *to == Endpoint::Ingress(server))
            .flat_map(|(_, e)| match e {
                Envelope::Ingress(items) => items.clone(),
                other => panic!("not an ingress message: {other:?}"),
            })
            .collect()
    }

    fn is_notice(item: &IngressItem) -> bool {
        matches!(item, IngressItem::PeerReady(_))
    }

    #[test]
    fn without_a_link_a_generation_first_notice_goes_at_once_after_its_servers_requests() {
        let mut h = host(&[(Role::Ctx, true), (Role::Gen, false)]);
        let net = Outbox::default();
        h.handle(0, request(1), &net);
        let to_ctx = items_to(&net.take(), 0);
        let notice_at = to_ctx.iter().position(is_notice);
        let request_at = to_ctx
            .iter()
            .rposition(|i| matches!(i, IngressItem::Request(_)));
        match (notice_at, request_at) {
            (Some(n), Some(r)) => assert!(n > r, "{to_ctx:?}"),
            _ => panic!("expected a request and a notice for the ctx server: {to_ctx:?}"),
        }
        assert_eq!(h.poll_timeout(), None);
    }

    #[test]
    fn a_generation_first_notice_takes_the_links_time_for_a_small_message() {
        let wire = WireModel {
            latency_ns: 5_000.0,
            bytes_per_ns: 64.0,
            block_bytes: 1 << 20,
            time_scale: 2.0,
        };
        // 5 us + 64 B at 64 B/ns, scaled by 2.
        assert_eq!(wire.notice_ns(), 10_002);
        let mut h = host(&[(Role::Ctx, true), (Role::Gen, false)]).with_notice_link(Some(wire));
        let net = Outbox::default();
        h.handle(100, request(1), &net);
        let to_ctx = items_to(&net.take(), 0);
        assert!(
            to_ctx.iter().any(|i| matches!(i, IngressItem::Request(_))),
            "the request goes at once: {to_ctx:?}"
        );
        assert!(!to_ctx.iter().any(is_notice), "{to_ctx:?}");
        assert_eq!(h.poll_timeout(), Some(10_102));
        h.handle_timeout(10_101, &net);
        assert!(net.take().is_empty(), "not due yet");
        h.handle_timeout(10_102, &net);
        let to_ctx = items_to(&net.take(), 0);
        assert_eq!(to_ctx.len(), 1);
        assert!(is_notice(&to_ctx[0]), "{to_ctx:?}");
        assert_eq!(h.poll_timeout(), None);
    }
}
