//! A rank's transceiver host ([`lockstep_hosts::transceiver_host`]) on its own thread
//! (bytes move while iterations continue), woken at its next deadline or input. The
//! events it produces go to the rank's executor, and each time there are some, the
//! server's rank 0 gets a wake-up: a rank 0 waiting for an input (nothing changed last
//! iteration) runs the iteration that applies them.

use crossbeam_channel::{Receiver, Sender};

use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::{Transceiver, TransceiverIn};
use lockstep_actors::vocab::{TransferCommand, TransferEvent};
pub use lockstep_hosts::transceiver_host::TransceiverEnd;
use lockstep_hosts::transceiver_host::TransceiverHost;

use super::clock::WallClock;
use super::net::{Endpoint, Envelope, Inbox, Net, Received};
use crate::Clock;
use crate::ordered::{Order, OrderedNet, Turn, TurnStuck};
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

/// Runs a transceiver host until [`TransceiverInput::Stop`] (or its inbox closes), on
/// its own thread in wall time: it sleeps until its next deadline or input, runs the
/// host, hands the events to the rank and wakes the server's rank 0.
/// `lose_kv_every`: fault injection; `wire`: modeled time on the wire (`None`: messages
/// count from their arrival).
pub fn run_transceiver(
    transceiver: Transceiver,
    inbox: &mut dyn Inbox<TransceiverInput>,
    net: &dyn Net,
    events: &Sender<TransferEvent>,
    clock: &WallClock,
    lose_kv_every: Option<u64>,
    wire: Option<WireModel>,
) -> TransceiverEnd {
    let mut host = TransceiverHost::new(transceiver, lose_kv_every, wire);
    let at = host.address();
    let server = at.server as usize;
    let _span = tracing::info_span!("transceiver", server, rank = at.rank.index()).entered();
    let mut out = Vec::new();
    loop {
        let deadline = host.poll_timeout().map(|ns| clock.instant(ns));
        let mut stop = false;
        match inbox.recv_until(deadline) {
            Received::Message(TransceiverInput::In(input)) => host.handle(clock.now_ns(), input),
            Received::Message(TransceiverInput::Stop) | Received::Closed => stop = true,
            Received::TimedOut => {}
        }
        // Whatever else is there now, in order.
        while !stop && let Some(next) = inbox.try_recv() {
            match next {
                TransceiverInput::In(input) => host.handle(clock.now_ns(), input),
                TransceiverInput::Stop => stop = true,
            }
        }
        let woke = host.run(clock.now_ns(), net, &mut out);
        for event in out.drain(..) {
            if events.send(event).is_err() {
                stop = true;
                break;
            }
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
            return host.end();
        }
    }
}

/// Runs a transceiver host in an ordered run ([`crate::ordered`]) until it leaves the
/// run: in its turns, at modeled time, it takes the commands and messages of the
/// instant, runs, hands its events to the rank and wakes its server.
pub fn run_transceiver_ordered(
    transceiver: Transceiver,
    sequencer: &dyn Order,
    events: &Sender<TransferEvent>,
    direct: &dyn Net,
    lose_kv_every: Option<u64>,
    wire: Option<WireModel>,
) -> Result<TransceiverEnd, TurnStuck> {
    let mut host = TransceiverHost::new(transceiver, lose_kv_every, wire);
    let at = host.address();
    let me = sequencer.transceiver(at);
    let net = OrderedNet::transceiver(sequencer, at, direct);
    let server = at.server as usize;
    let _span = tracing::info_span!("transceiver", server, rank = at.rank.index()).entered();
    let mut out = Vec::new();
    loop {
        let now = match sequencer.wait_turn(me, None)? {
            Turn::Granted(now) => now,
            Turn::Gone => return Ok(host.end()),
            Turn::Slice | Turn::StallOut(_) | Turn::Quiet => continue,
        };
        for item in sequencer.take(me, now, true) {
            if let Some(input) = item.into_transceiver_input() {
                host.handle(now, input);
            }
        }
        let woke = host.run(now, &net, &mut out);
        for event in out.drain(..) {
            // A rank that ended has nothing to apply.
            let _ = events.send(event);
        }
        if woke {
            // After the events, as in every driver.
            let _ = net.send(
                Endpoint::Ingress(server),
                Envelope::Ingress(vec![IngressItem::Wake]),
            );
        }
        sequencer.end(me, host.poll_timeout());
    }
}
