//! A rank's transceiver on its own thread (bytes move while iterations continue): the
//! pure [`Transceiver`] fed with its executor's commands and its peers' messages, woken
//! at its next deadline. The events it produces go to the rank's executor, and each time
//! there are some, the server's rank 0 gets a wake-up: a rank 0 waiting for an input
//! (nothing changed last iteration) runs the iteration that applies them.

use crossbeam_channel::{Receiver, Sender};

use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::{
    Outgoing, PeerMessage, Transceiver, TransceiverIn, TransferStats, lost_on_the_wire,
};
use lockstep_actors::vocab::{TransferCommand, TransferEvent};

use super::clock::WallClock;
use super::net::{Endpoint, Envelope, Inbox, Net, Received};
use crate::Clock;
use lockstep_plan::fleet::WireModel;

/// What reaches a transceiver host.
#[derive(Debug)]
pub enum TransceiverInput {
    /// A command or a message.
    In(TransceiverIn),
    /// Its rank's loop ended: stop.
    Stop,
}

/// The rank host's side of its transceiver: commands in, events out.
pub struct TransceiverLink {
    /// Commands to the transceiver host.
    pub commands: Sender<TransceiverInput>,
    /// Events from it.
    pub events: Receiver<TransferEvent>,
}

impl TransceiverLink {
    /// Hands the executor's commands over.
    pub fn send_commands(&self, commands: &[TransferCommand]) {
        for c in commands {
            // A transceiver that stopped has nothing left to do with a command.
            let _ = self
                .commands
                .send(TransceiverInput::In(TransceiverIn::Command(c.clone())));
        }
    }

    /// Tells the transceiver host to stop.
    pub fn stop(&self) {
        let _ = self.commands.send(TransceiverInput::Stop);
    }
}

/// What a transceiver host hands back when it stops.
#[derive(Debug, Clone, Default)]
pub struct TransceiverEnd {
    /// Its counters.
    pub stats: TransferStats,
    /// KV messages the wire lost (fault injection).
    pub lost: u64,
}

/// Runs a transceiver until [`TransceiverInput::Stop`] (or its inbox closes).
/// `lose_kv_every`: fault injection, [`lost_on_the_wire`]; `wire`: modeled time on the
/// wire (`None`: messages count from their arrival).
pub fn run_transceiver(
    mut transceiver: Transceiver,
    inbox: &mut dyn Inbox<TransceiverInput>,
    net: &dyn Net,
    events: &Sender<TransferEvent>,
    clock: &WallClock,
    lose_kv_every: Option<u64>,
    wire: Option<WireModel>,
) -> TransceiverEnd {
    let server = transceiver.address().server as usize;
    let _span = tracing::info_span!(
        "transceiver",
        server,
        rank = transceiver.address().rank.index()
    )
    .entered();
    let mut lost = 0;
    // Messages on the modeled wire, by due time (then arrival order).
    let mut on_wire: std::collections::BTreeMap<(u64, u64), TransceiverIn> = Default::default();
    let mut arrivals = 0u64;
    let mut accept =
        |t: &mut Transceiver,
         input: TransceiverIn,
         wire_queue: &mut std::collections::BTreeMap<(u64, u64), TransceiverIn>| {
            let now = clock.now_ns();
            match (&input, wire) {
                (TransceiverIn::Message(m), Some(w)) => {
                    arrivals += 1;
                    wire_queue.insert((now + w.delay_ns(m), arrivals), input);
                }
                _ => t.handle(now, input),
            }
        };
    loop {
        let next_due = on_wire.keys().next().map(|&(at, _)| at);
        let next = match (transceiver.poll_timeout(), next_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let deadline = next.map(|ns| clock.instant(ns));
        let mut stop = false;
        match inbox.recv_until(deadline) {
            Received::Message(TransceiverInput::In(input)) => {
                accept(&mut transceiver, input, &mut on_wire)
            }
            Received::Message(TransceiverInput::Stop) | Received::Closed => stop = true,
            Received::TimedOut => {}
        }
        // Whatever else is there now, in order.
        while !stop && let Some(next) = inbox.try_recv() {
            match next {
                TransceiverInput::In(input) => accept(&mut transceiver, input, &mut on_wire),
                TransceiverInput::Stop => stop = true,
            }
        }
        let now = clock.now_ns();
        while let Some(entry) = on_wire.first_entry() {
            if entry.key().0 > now {
                break;
            }
            transceiver.handle(now, entry.remove());
        }
        transceiver.handle_timeout(clock.now_ns());
        while let Some(Outgoing { to, message }) = transceiver.poll_transmit() {
            if let PeerMessage::KvBlocks { id, .. } = &message
                && lost_on_the_wire(*id, lose_kv_every)
            {
                lost += 1;
                tracing::debug!(%id, "fault injection: KV blocks lost on the wire");
                continue;
            }
            // A peer that stopped has nothing to do with it: its counterpart times out.
            let _ = net.send(Endpoint::Transceiver(to), Envelope::Peer(message));
        }
        let mut woke = false;
        while let Some(event) = transceiver.poll_event() {
            if events.send(event).is_err() {
                stop = true;
                break;
            }
            woke = true;
        }
        if woke {
            // After the events: a rank 0 that reads the wake-up finds them applied in
            // that iteration's transfer phase.
            let _ = net.send(
                Endpoint::Ingress(server),
                Envelope::Ingress(vec![IngressItem::Wake]),
            );
        }
        if stop {
            return TransceiverEnd {
                stats: transceiver.stats().clone(),
                lost,
            };
        }
    }
}
