//! An ordered real run (`--ordered`): the real hosts — every rank over its real
//! collective, every transceiver moving real bytes, the front — take turns in the
//! simulator's order of events ([`lockstep_hosts::order`]), in modeled time, one turn at
//! a time. A message between hosts is stamped with the modeled time it arrives (the
//! control link's latency, as the simulator charges it) and waits in the [`Sequencer`]
//! until its receiver's turn. So which fetch reads a handoff and which iteration sees a
//! KV transfer's completion follow the time model, not the threads' scheduling: a busy
//! machine changes how long the run takes, never what it does.
//!
//! Nothing sleeps: time is virtual. The [`Order`] is the [`Sequencer`] itself in the
//! threads driver; under MPI the front process holds it and the rank processes reach it
//! by calls that each wait for their answer (`mpi.rs`), so what a rank sends is in the
//! sequencer before it goes on.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use lockstep_actors::request::IngressItem;
use lockstep_actors::transceiver::{PeerMessage, TransceiverIn};
use lockstep_actors::vocab::{KvAddress, TransferCommand};
use lockstep_hosts::order::{
    OrderError, Party, Phase, Place, ServerNext, Turns, arrives_after, first_transceivers,
    transceiver_place,
};

use crate::{Endpoint, Envelope, Net, NetError};

/// What waits in the sequencer for its receiver's turn.
#[derive(Debug, Serialize, Deserialize)]
pub enum Item {
    /// Into a server's ingress.
    Ingress(Vec<IngressItem>),
    /// To the front.
    Front(Envelope),
    /// To a transceiver: a command of its rank.
    Command(TransferCommand),
    /// To a transceiver: a peer's message.
    Peer(PeerMessage),
}

impl Item {
    /// A transceiver's input, if this is one.
    pub fn into_transceiver_input(self) -> Option<TransceiverIn> {
        match self {
            Item::Command(c) => Some(TransceiverIn::Command(c)),
            Item::Peer(m) => Some(TransceiverIn::Message(m)),
            Item::Ingress(_) | Item::Front(_) => None,
        }
    }
}

/// The order of an ordered run, as its hosts use it: the [`Sequencer`] in the process
/// that holds it, or a proxy to it.
pub trait Order: Send + Sync {
    /// A rank's transceiver as a party (the simulator's order: server by server).
    fn transceiver(&self, at: KvAddress) -> Party;
    /// A message between the front and a server, in modeled time.
    fn control_ns(&self) -> u64;
    /// The time of the turn running.
    fn now(&self) -> u64;
    /// Whether `p` holds the turn.
    fn holds(&self, p: Party) -> bool;
    /// Waits for `me`'s turn; `slice`: give up after this much wall time with
    /// [`Turn::Slice`].
    fn wait_turn(&self, me: Party, slice: Option<Duration>) -> Result<Turn, TurnStuck>;
    /// A server's other ranks, at their iteration's process point: waits until its
    /// rank 0 takes the server's next turn after the fetch at `fetched_at` (that
    /// process point; every rank of a server has the same), and says when it is.
    fn wait_server_turn_after(&self, server: usize, fetched_at: u64) -> Result<u64, TurnStuck>;
    /// The inputs of `p` that arrived before `upto` (`inclusive`: at `upto` too).
    fn take(&self, p: Party, upto: u64, inclusive: bool) -> Vec<Item>;
    /// Server `s` ends its turn.
    fn end_server(&self, s: usize, next: ServerNext);
    /// The front or a transceiver ends its turn, with its next deadline.
    fn end(&self, p: Party, deadline: Option<u64>);
    /// `p` leaves the run.
    fn leave(&self, p: Party);
    /// Sends `item` to `to`, arriving `delay_ns` after now.
    fn post(
        &self,
        to: Party,
        delay_ns: u64,
        from: (Phase, u32),
        item: Item,
    ) -> Result<(), OrderError>;
}

/// How a wait for a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Turn {
    /// The turn is ours, at this modeled time.
    Granted(u64),
    /// The wall-time slice passed first (a waiting rank 0 keeps its group alive).
    Slice,
    /// Nothing in the run can end this server's wait: it stalls out, holding the turn,
    /// at this time.
    StallOut(u64),
    /// Nothing is left to do for anyone (the front ends its loop).
    Quiet,
    /// We have left the run.
    Gone,
}

/// No turn changed hands for this long (wall time): a host is stuck.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error(
    "ordered run: {waiting:?} waited {waited_ms} ms for its turn while {holder:?} held it and nothing moved"
)]
pub struct TurnStuck {
    /// Who waited.
    pub waiting: Party,
    /// Who held the turn (`None`: nobody did).
    pub holder: Option<Party>,
    /// How long.
    pub waited_ms: u64,
}

/// The turns of an ordered run, shared by its threads.
pub struct Sequencer {
    turns: Mutex<Turns<Item>>,
    changed: Condvar,
    /// A message between the front and a server, in modeled time.
    control_ns: u64,
    /// Each server's first transceiver's place among all of them.
    first_transceiver: Vec<u32>,
    /// No turn changing hands for this long is an error.
    stuck_after: Duration,
}

impl Sequencer {
    /// The turns of a fleet whose servers have these data-parallel sizes; `control_ns`
    /// between the front and a server.
    pub fn new(dp: &[u32], control_ns: u64, stuck_after: Duration) -> Sequencer {
        let first_transceiver = first_transceivers(dp);
        let all: u32 = dp.iter().sum();
        Sequencer {
            turns: Mutex::new(Turns::new(dp.len(), all as usize)),
            changed: Condvar::new(),
            control_ns,
            first_transceiver,
            stuck_after,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Turns<Item>> {
        self.turns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first input of `p`, if it arrived by `upto` (the front's, one per turn).
    pub fn take_first(&self, p: Party, upto: u64) -> Option<Item> {
        self.lock().take_first(p, upto)
    }
}

impl Order for Sequencer {
    fn transceiver(&self, at: KvAddress) -> Party {
        Party::Transceiver(transceiver_place(&self.first_transceiver, at))
    }

    fn control_ns(&self) -> u64 {
        self.control_ns
    }

    fn now(&self) -> u64 {
        self.lock().now()
    }

    fn holds(&self, p: Party) -> bool {
        self.lock().holder() == Some(p)
    }

    fn wait_turn(&self, me: Party, slice: Option<Duration>) -> Result<Turn, TurnStuck> {
        let started = Instant::now();
        let slice_ends = slice.map(|s| started + s);
        let mut turns = self.lock();
        let mut last_change = (turns.last(), turns.holder(), Instant::now());
        loop {
            if turns.is_gone(me) {
                return Ok(Turn::Gone);
            }
            if turns.holder().is_none() {
                match turns.next() {
                    Some((p, _)) if p == me => {
                        let stalled = matches!(me, Party::Server(_)) && turns.place(me).is_none();
                        let at = turns.begin(me);
                        // A server's other ranks wait for its turn to begin.
                        self.changed.notify_all();
                        return Ok(if stalled {
                            Turn::StallOut(at)
                        } else {
                            Turn::Granted(at)
                        });
                    }
                    Some(_) => self.changed.notify_all(),
                    None => {
                        if turns.stall_out_waiting() {
                            self.changed.notify_all();
                            continue;
                        }
                        if me == Party::Front {
                            return Ok(Turn::Quiet);
                        }
                    }
                }
            }
            let now = Instant::now();
            if slice_ends.is_some_and(|e| now >= e) {
                return Ok(Turn::Slice);
            }
            let seen = (turns.last(), turns.holder());
            if seen != (last_change.0, last_change.1) {
                last_change = (seen.0, seen.1, now);
            } else if now.duration_since(last_change.2) > self.stuck_after {
                return Err(TurnStuck {
                    waiting: me,
                    holder: turns.holder(),
                    waited_ms: now.duration_since(last_change.2).as_millis() as u64,
                });
            }
            let mut wait = Duration::from_millis(50);
            if let Some(e) = slice_ends {
                wait = wait.min(e.saturating_duration_since(now));
            }
            turns = self
                .changed
                .wait_timeout(turns, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn wait_server_turn_after(&self, server: usize, fetched_at: u64) -> Result<u64, TurnStuck> {
        let s = server as u32;
        let fetch: Place = (fetched_at, Phase::Resume, s);
        let mut turns = self.lock();
        let mut since = Instant::now();
        let mut seen = turns.last();
        // A server whose rank 0 left takes no more turns (its group ends on its own).
        while turns.last_of_server(s).is_none_or(|l| l <= fetch) && !turns.is_gone(Party::Server(s))
        {
            if turns.last() != seen {
                seen = turns.last();
                since = Instant::now();
            } else if since.elapsed() > self.stuck_after {
                return Err(TurnStuck {
                    waiting: Party::Server(s),
                    holder: turns.holder(),
                    waited_ms: since.elapsed().as_millis() as u64,
                });
            }
            turns = self
                .changed
                .wait_timeout(turns, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(turns.now())
    }

    fn take(&self, p: Party, upto: u64, inclusive: bool) -> Vec<Item> {
        self.lock().take(p, upto, inclusive)
    }

    fn end_server(&self, s: usize, next: ServerNext) {
        self.lock().end_server(s as u32, next);
        self.changed.notify_all();
    }

    fn end(&self, p: Party, deadline: Option<u64>) {
        self.lock().end(p, deadline);
        self.changed.notify_all();
    }

    fn leave(&self, p: Party) {
        self.lock().leave(p);
        self.changed.notify_all();
    }

    fn post(
        &self,
        to: Party,
        delay_ns: u64,
        from: (Phase, u32),
        item: Item,
    ) -> Result<(), OrderError> {
        let mut turns = self.lock();
        let at = turns.now().saturating_add(delay_ns);
        turns.post(to, at, from, item)
    }
}

/// A host's [`Net`] in an ordered run: what it sends waits in the sequencer, stamped
/// with its arrival time, except what no decision depends on (rank summaries and
/// statuses), which goes over `direct` at once.
pub struct OrderedNet<'a> {
    sequencer: &'a dyn Order,
    /// The sender's phase and place (the order among inputs that arrive together).
    from: (Phase, u32),
    direct: &'a dyn Net,
}

impl<'a> OrderedNet<'a> {
    /// The front's net.
    pub fn front(sequencer: &'a dyn Order, direct: &'a dyn Net) -> OrderedNet<'a> {
        // Its items reach a server's ingress in the deliveries' phase.
        OrderedNet {
            sequencer,
            from: (Phase::Delivery, 0),
            direct,
        }
    }

    /// Server `server`'s ranks' net (their responses, their end).
    pub fn server(sequencer: &'a dyn Order, server: usize, direct: &'a dyn Net) -> OrderedNet<'a> {
        OrderedNet {
            sequencer,
            from: (Phase::Process, server as u32),
            direct,
        }
    }

    /// A transceiver's net (peer messages, and the wake-up of its server).
    pub fn transceiver(
        sequencer: &'a dyn Order,
        at: KvAddress,
        direct: &'a dyn Net,
    ) -> OrderedNet<'a> {
        let Party::Transceiver(me) = sequencer.transceiver(at) else {
            unreachable!("a transceiver's party")
        };
        OrderedNet {
            sequencer,
            from: (Phase::Transceiver, me),
            direct,
        }
    }
}

impl Net for OrderedNet<'_> {
    fn send(&self, to: Endpoint, envelope: Envelope) -> Result<(), NetError> {
        let s = self.sequencer;
        let (party, delay, item) = match (to, envelope) {
            (Endpoint::Front, e @ Envelope::Responses { server, .. })
            | (Endpoint::Front, e @ Envelope::ServerStopped { server }) => {
                // Inputs that reach the front together: by server.
                let item = Item::Front(e);
                let delay = arrives_after(to, self.from.0, s.control_ns());
                return s
                    .post(Party::Front, delay, (Phase::Front, server), item)
                    .map_err(|_| NetError::Closed { endpoint: to });
            }
            (Endpoint::Front, e) => return self.direct.send(to, e),
            (Endpoint::Ingress(server), Envelope::Ingress(items)) => (
                Party::Server(server as u32),
                arrives_after(to, self.from.0, s.control_ns()),
                Item::Ingress(items),
            ),
            (Endpoint::Transceiver(at), Envelope::Peer(message)) => (
                s.transceiver(at),
                arrives_after(to, self.from.0, s.control_ns()),
                Item::Peer(message),
            ),
            (Endpoint::Ingress(_) | Endpoint::Transceiver(_), _) => {
                return Err(NetError::Unknown { endpoint: to });
            }
        };
        s.post(party, delay, self.from, item).map_err(|e| match e {
            OrderError::Gone(_) => NetError::Closed { endpoint: to },
            OrderError::Unknown(_) => NetError::Unknown { endpoint: to },
        })
    }
}
