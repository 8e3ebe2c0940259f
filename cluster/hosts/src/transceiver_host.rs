//! A rank's transceiver host, written once: the pure [`Transceiver`] fed with its
//! executor's commands and its peers' messages, each message held on the modeled wire
//! until the link's latency and its size over the bandwidth have passed (when the run
//! models time), the KV a fault names lost on the way out, and the events for the rank
//! handed back. Sans-I/O: `now` comes in with every call, messages go out over the
//! [`Net`], and [`TransceiverHost::poll_timeout`] says when it must run next. The real
//! drivers run it on its own thread (bytes move while iterations continue); the
//! simulator at its events.

use std::collections::BTreeMap;

use lockstep_actors::transceiver::{
    Outgoing, PeerMessage, Transceiver, TransceiverIn, TransferStats, lost_on_the_wire,
};
use lockstep_actors::vocab::{KvAddress, TransferEvent};
use lockstep_plan::fleet::WireModel;

use crate::net::{Endpoint, Envelope, Net};

/// What a transceiver host hands back when it stops.
#[derive(Debug, Clone, Default)]
pub struct TransceiverEnd {
    /// Its counters.
    pub stats: TransferStats,
    /// KV messages the wire lost (fault injection).
    pub lost: u64,
}

/// A rank's transceiver host.
pub struct TransceiverHost {
    transceiver: Transceiver,
    /// Messages on the modeled wire, by due time (then arrival order).
    on_wire: BTreeMap<(u64, u64), PeerMessage>,
    arrivals: u64,
    lost: u64,
    lose_kv_every: Option<u64>,
    wire: Option<WireModel>,
    timeouts_fire: bool,
}

impl TransceiverHost {
    /// A host over `transceiver`. `lose_kv_every`: fault injection
    /// ([`lost_on_the_wire`]); `wire`: modeled time on the wire (`None`: a message
    /// counts from its arrival).
    pub fn new(
        transceiver: Transceiver,
        lose_kv_every: Option<u64>,
        wire: Option<WireModel>,
    ) -> TransceiverHost {
        TransceiverHost {
            transceiver,
            on_wire: BTreeMap::new(),
            arrivals: 0,
            lost: 0,
            lose_kv_every,
            wire,
            timeouts_fire: true,
        }
    }

    /// Its transfers never time out (`[faults] timeouts_lost`, a simulator-only fault).
    pub fn without_timeouts(mut self) -> TransceiverHost {
        self.timeouts_fire = false;
        self
    }

    /// The rank it serves.
    pub fn address(&self) -> KvAddress {
        self.transceiver.address()
    }

    /// A command from its executor, or a message from the network (which stays on the
    /// modeled wire until due).
    pub fn handle(&mut self, now: u64, input: TransceiverIn) {
        match (input, self.wire) {
            (TransceiverIn::Message(m), Some(w)) => {
                self.arrivals += 1;
                self.on_wire
                    .insert((now.saturating_add(w.delay_ns(&m)), self.arrivals), m);
            }
            (input, _) => self.transceiver.handle(now, input),
        }
    }

    /// When it must run next: the next message due off the wire, or the transceiver's
    /// next deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        let due = self.on_wire.keys().next().map(|&(at, _)| at);
        let deadline = self
            .transceiver
            .poll_timeout()
            .filter(|_| self.timeouts_fire);
        match (due, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs at `now`: the messages due reach the transceiver, its deadlines fire, what
    /// it sends goes out over `net` (but the KV the fault names), and its events for the
    /// rank are appended to `events`. Returns whether there were any.
    pub fn run(&mut self, now: u64, net: &dyn Net, events: &mut Vec<TransferEvent>) -> bool {
        while let Some(entry) = self.on_wire.first_entry() {
            if entry.key().0 > now {
                break;
            }
            self.transceiver
                .handle(now, TransceiverIn::Message(entry.remove()));
        }
        if self.timeouts_fire {
            self.transceiver.handle_timeout(now);
        }
        while let Some(Outgoing { to, message }) = self.transceiver.poll_transmit() {
            if let PeerMessage::KvBlocks { id, .. } = &message
                && lost_on_the_wire(*id, self.lose_kv_every)
            {
                self.lost += 1;
                tracing::debug!(%id, "fault injection: KV blocks lost on the wire");
                continue;
            }
            // A peer that stopped has nothing to do with it: its counterpart times out.
            let _ = net.send(Endpoint::Transceiver(to), Envelope::Peer(message));
        }
        let before = events.len();
        while let Some(event) = self.transceiver.poll_event() {
            events.push(event);
        }
        events.len() > before
    }

    /// Its counters and losses.
    pub fn end(&self) -> TransceiverEnd {
        TransceiverEnd {
            stats: self.transceiver.stats().clone(),
            lost: self.lost,
        }
    }
}

#[cfg(test)]
mod tests {
    use lockstep_actors::ids::{RankId, ReqId};
    use lockstep_actors::transceiver::KvCodec;
    use lockstep_actors::vocab::TransferCommand;

    use super::*;
    use crate::net::Outbox;

    fn kv_blocks_sent(net: &Outbox) -> usize {
        net.take()
            .iter()
            .filter(|(_, e)| matches!(e, Envelope::Peer(PeerMessage::KvBlocks { .. })))
            .count()
    }

    const CTX: KvAddress = KvAddress {
        server: 0,
        rank: RankId(0),
    };
    const GEN: KvAddress = KvAddress {
        server: 1,
        rank: RankId(0),
    };

    /// 10 µs of latency, 1 byte per ns, 1,000-byte blocks.
    fn wire() -> WireModel {
        WireModel {
            latency_ns: 10_000.0,
            bytes_per_ns: 1.0,
            block_bytes: 1_000,
            time_scale: 1.0,
        }
    }

    /// A ctx rank's host that was told to send request 7 and then got the gen peer's
    /// pull at t = 0.
    fn ctx_host_pulled(lose_kv_every: Option<u64>) -> TransceiverHost {
        let t = Transceiver::new(CTX, 30_000, KvCodec::Modeled { block_bytes: 1_000 });
        let mut host = TransceiverHost::new(t, lose_kv_every, Some(wire()));
        let id = ReqId(7);
        host.handle(
            0,
            TransceiverIn::Command(TransferCommand::Send { id, blocks: 2 }),
        );
        let pull = PeerMessage::Pull {
            id,
            puller: GEN,
            blocks: 2,
        };
        host.handle(0, TransceiverIn::Message(pull));
        host
    }

    #[test]
    fn a_message_reaches_the_transceiver_only_when_the_wire_says() {
        let mut host = ctx_host_pulled(None);
        // A pull is a 64-byte header: 10,000 + 64 ns on the wire.
        assert_eq!(host.poll_timeout(), Some(10_064));
        let net = Outbox::default();
        let mut events = Vec::new();
        host.run(10_063, &net, &mut events);
        assert_eq!(kv_blocks_sent(&net), 0, "the pull is still on the wire");
        host.run(10_064, &net, &mut events);
        assert_eq!(kv_blocks_sent(&net), 1, "the pull arrived: the KV goes out");
        assert_eq!(host.end().lost, 0);
    }

    #[test]
    fn the_kv_the_fault_names_is_lost_on_the_way_out() {
        let mut host = ctx_host_pulled(Some(7));
        let net = Outbox::default();
        host.run(10_064, &net, &mut Vec::new());
        assert_eq!(kv_blocks_sent(&net), 0);
        assert_eq!(host.end().lost, 1);
    }

    #[test]
    fn without_a_wire_model_a_message_counts_from_its_arrival() {
        let t = Transceiver::new(CTX, 30_000, KvCodec::Modeled { block_bytes: 1_000 });
        let mut host = TransceiverHost::new(t, None, None);
        let id = ReqId(7);
        host.handle(
            0,
            TransceiverIn::Command(TransferCommand::Send { id, blocks: 2 }),
        );
        host.handle(
            0,
            TransceiverIn::Message(PeerMessage::Pull {
                id,
                puller: GEN,
                blocks: 2,
            }),
        );
        let net = Outbox::default();
        host.run(0, &net, &mut Vec::new());
        assert_eq!(kv_blocks_sent(&net), 1);
    }
}
