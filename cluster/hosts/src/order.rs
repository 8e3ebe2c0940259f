//! The order of a run's events, written once: by time, then within an instant by
//! [`Phase`], then by participant. The simulator keys its event queue this way; an
//! ordered real run ([`Turns`]) gives its hosts their turns the same way, one at a
//! time, so its real ranks, transceivers and front see their inputs in the order the
//! simulator gives them, however the threads are scheduled.
//!
//! Sans-I/O: [`Turns`] holds what each participant has to do (its own next time and
//! the inputs sent to it, each stamped with the time it arrives) and says whose turn is
//! next; the driver blocks its threads around it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use lockstep_actors::vocab::KvAddress;

use crate::net::Endpoint;

/// The order of events within one instant (then by participant): every server's
/// process point first (its outputs are sent and its next fetch reads what had arrived
/// before this instant), then the front (what the servers sent it), then the
/// transceivers (the commands and messages of this instant), then deliveries to the
/// servers' ingress, and last the waiting servers' reads, which see everything that
/// arrived up to and including this instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// A server's iteration reaches its process point.
    Process,
    /// The front handles what reached it.
    Front,
    /// A transceiver host runs.
    Transceiver,
    /// Items reach a server's ingress.
    Delivery,
    /// A waiting server's read ends (an input came, or its stall bound passed).
    Resume,
}

/// Where an event stands in the run's order: time, phase, participant.
pub type Place = (u64, Phase, u32);

/// A participant of an ordered run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Party {
    /// A server (its rank 0 takes the turns; its other ranks follow in collectives).
    Server(u32),
    /// The front.
    Front,
    /// A rank's transceiver, by its place among all of them (server by server, rank by
    /// rank).
    Transceiver(u32),
}

/// How long a message from a sender in phase `from` takes to reach `to`, in modeled
/// time: between the front and a server, the control link's latency; a transceiver's
/// wake-up of its own server, and a message between transceivers (whose receiving host
/// holds it on its modeled wire), at once. The simulator and an ordered real run both
/// time their messages by this.
pub fn arrives_after(to: Endpoint, from: Phase, control_ns: u64) -> u64 {
    match (to, from) {
        (Endpoint::Transceiver(_), _) | (Endpoint::Ingress(_), Phase::Transceiver) => 0,
        (Endpoint::Front | Endpoint::Ingress(_), _) => control_ns,
    }
}

/// Each server's first transceiver's place among all of them (server by server, rank
/// by rank), from the servers' data-parallel sizes.
pub fn first_transceivers(dp: &[u32]) -> Vec<u32> {
    let mut all = 0u32;
    dp.iter()
        .map(|&n| {
            let first = all;
            all += n;
            first
        })
        .collect()
}

/// A rank's transceiver's place among all of them, from [`first_transceivers`].
pub fn transceiver_place(first_transceiver: &[u32], at: KvAddress) -> u32 {
    let first = first_transceiver
        .get(at.server as usize)
        .copied()
        .unwrap_or(u32::MAX);
    first.saturating_add(at.rank.0)
}

/// What a server does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerNext {
    /// Its next turn is at this time: the process point of the iteration it runs (or,
    /// at the start, its first read).
    Busy(u64),
    /// Its rank 0 waits for an input: its turn comes with the first one, or when the
    /// stall bound passes.
    Waiting {
        /// When a bounded stall ends.
        stall_ends_at: Option<u64>,
    },
}

/// The inputs sent to a participant: by arrival time, then by the sender's phase and
/// place, then as sent.
struct Inbox<T> {
    items: BTreeMap<(u64, Phase, u32, u64), T>,
}

impl<T> Inbox<T> {
    fn first(&self) -> Option<(u64, u32)> {
        self.items.keys().next().map(|&(at, _, from, _)| (at, from))
    }
}

struct Slot<T> {
    /// Its own next time (a server's turn, the front's or a transceiver's deadline).
    own: Option<u64>,
    /// A server waits for an input.
    waiting: bool,
    inbox: Inbox<T>,
    gone: bool,
}

impl<T> Slot<T> {
    fn new(own: Option<u64>) -> Slot<T> {
        Slot {
            own,
            waiting: false,
            inbox: Inbox {
                items: BTreeMap::new(),
            },
            gone: false,
        }
    }
}

/// Why an input could not be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum OrderError {
    /// The participant has left the run.
    #[error("{0:?} has left the run")]
    Gone(Party),
    /// No such participant in this run.
    #[error("{0:?} is not in this run")]
    Unknown(Party),
}

/// Whose turn it is, in an ordered run.
pub struct Turns<T> {
    servers: Vec<Slot<T>>,
    front: Slot<T>,
    transceivers: Vec<Slot<T>>,
    holder: Option<Party>,
    /// The place of the turn granted last (places only grow).
    last: Option<Place>,
    /// Each server's last turn.
    last_of_server: Vec<Option<Place>>,
    /// Servers to stall out, in order: nothing could end their waits.
    backstop: Vec<u32>,
    now: u64,
    sent: u64,
}

impl<T> Turns<T> {
    /// A run of `servers` servers, each to take its first turn at time 0, and
    /// `transceivers` transceivers.
    pub fn new(servers: usize, transceivers: usize) -> Turns<T> {
        Turns {
            servers: (0..servers).map(|_| Slot::new(Some(0))).collect(),
            front: Slot::new(None),
            transceivers: (0..transceivers).map(|_| Slot::new(None)).collect(),
            holder: None,
            last: None,
            last_of_server: vec![None; servers],
            backstop: Vec::new(),
            now: 0,
            sent: 0,
        }
    }

    fn slot(&self, p: Party) -> Option<&Slot<T>> {
        match p {
            Party::Server(s) => self.servers.get(s as usize),
            Party::Front => Some(&self.front),
            Party::Transceiver(t) => self.transceivers.get(t as usize),
        }
    }

    fn slot_mut(&mut self, p: Party) -> Option<&mut Slot<T>> {
        match p {
            Party::Server(s) => self.servers.get_mut(s as usize),
            Party::Front => Some(&mut self.front),
            Party::Transceiver(t) => self.transceivers.get_mut(t as usize),
        }
    }

    /// The time of the turn running (or of the last one).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Who holds the turn.
    pub fn holder(&self) -> Option<Party> {
        self.holder
    }

    /// The place of the turn granted last.
    pub fn last(&self) -> Option<Place> {
        self.last
    }

    /// Server `s`'s last turn.
    pub fn last_of_server(&self, s: u32) -> Option<Place> {
        self.last_of_server.get(s as usize).copied().flatten()
    }

    /// Whether `p` left the run.
    pub fn is_gone(&self, p: Party) -> bool {
        self.slot(p).is_none_or(|s| s.gone)
    }

    /// Sends `item` to `to`, arriving at `at` (never before now), from a sender in
    /// `phase` at place `from` (the order among inputs that arrive together).
    pub fn post(
        &mut self,
        to: Party,
        at: u64,
        (phase, from): (Phase, u32),
        item: T,
    ) -> Result<(), OrderError> {
        let at = at.max(self.now);
        self.sent += 1;
        let sent = self.sent;
        let slot = self.slot_mut(to).ok_or(OrderError::Unknown(to))?;
        if slot.gone {
            return Err(OrderError::Gone(to));
        }
        slot.inbox.items.insert((at, phase, from, sent), item);
        Ok(())
    }

    /// Where `p`'s next turn stands (`None`: it has nothing to do until an input
    /// comes).
    pub fn place(&self, p: Party) -> Option<Place> {
        let slot = self.slot(p)?;
        if slot.gone {
            return None;
        }
        let first = slot.inbox.first();
        match p {
            Party::Server(s) if slot.waiting => {
                let at = match (first.map(|(at, _)| at), slot.own) {
                    (Some(a), Some(b)) => a.min(b),
                    (a, b) => a.or(b)?,
                };
                Some((at, Phase::Resume, s))
            }
            // A busy server's inputs wait for its next read.
            Party::Server(s) => slot.own.map(|at| (at, Phase::Process, s)),
            Party::Front => {
                let input = first.map(|(at, from)| (at, Phase::Front, from));
                let timer = slot.own.map(|at| (at, Phase::Front, u32::MAX));
                match (input, timer) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            }
            Party::Transceiver(t) => {
                let at = match (first.map(|(at, _)| at), slot.own) {
                    (Some(a), Some(b)) => a.min(b),
                    (a, b) => a.or(b)?,
                };
                Some((at, Phase::Transceiver, t))
            }
        }
    }

    fn parties(&self) -> impl Iterator<Item = Party> + '_ {
        (0..self.servers.len() as u32)
            .map(Party::Server)
            .chain(std::iter::once(Party::Front))
            .chain((0..self.transceivers.len() as u32).map(Party::Transceiver))
    }

    /// Whose turn is next, and where it stands; `None` while a turn runs, or when
    /// nobody has anything to do.
    pub fn next(&self) -> Option<(Party, Place)> {
        if self.holder.is_some() {
            return None;
        }
        if let Some(&s) = self.backstop.first() {
            return Some((Party::Server(s), (self.now, Phase::Resume, s)));
        }
        self.parties()
            .filter_map(|p| self.place(p).map(|place| (p, place)))
            .min_by_key(|&(_, place)| place)
    }

    /// Nobody has anything to do and nobody holds the turn: every waiting server is
    /// to be stalled out, in order (their waits would never end). Whether there was
    /// any.
    pub fn stall_out_waiting(&mut self) -> bool {
        if self.holder.is_some() || !self.backstop.is_empty() || self.next().is_some() {
            return false;
        }
        self.backstop = (0..self.servers.len() as u32)
            .filter(|&s| {
                let slot = &self.servers[s as usize];
                slot.waiting && !slot.gone
            })
            .collect();
        !self.backstop.is_empty()
    }

    /// `p` takes the turn [`Turns::next`] named; its time. A server stalled out by
    /// [`Turns::stall_out_waiting`] takes it at the current time.
    pub fn begin(&mut self, p: Party) -> u64 {
        let Some((next, place)) = self.next() else {
            panic!("{p:?} began a turn nobody has");
        };
        assert_eq!(next, p, "{p:?} began {next:?}'s turn");
        if self.backstop.first().map(|&s| Party::Server(s)) == Some(p) {
            self.backstop.remove(0);
        }
        self.holder = Some(p);
        self.now = place.0;
        self.last = Some(self.last.map_or(place, |l| l.max(place)));
        if let Party::Server(s) = p {
            self.last_of_server[s as usize] = Some(place);
        }
        place.0
    }

    /// The inputs of `p` that arrived before `upto` (`inclusive`: at `upto` too), in
    /// order.
    pub fn take(&mut self, p: Party, upto: u64, inclusive: bool) -> Vec<T> {
        let Some(slot) = self.slot_mut(p) else {
            return Vec::new();
        };
        let mut taken = Vec::new();
        while let Some(entry) = slot.inbox.items.first_entry() {
            let at = entry.key().0;
            if at > upto || (at == upto && !inclusive) {
                break;
            }
            taken.push(entry.remove());
        }
        taken
    }

    /// The first input of `p` if it arrived by `upto`.
    pub fn take_first(&mut self, p: Party, upto: u64) -> Option<T> {
        let slot = self.slot_mut(p)?;
        let entry = slot.inbox.items.first_entry()?;
        (entry.key().0 <= upto).then(|| entry.remove())
    }

    fn release(&mut self, p: Party) {
        if self.holder == Some(p) {
            self.holder = None;
        }
    }

    /// Server `s` ends its turn: what it does next.
    pub fn end_server(&mut self, s: u32, next: ServerNext) {
        if let Some(slot) = self.servers.get_mut(s as usize) {
            (slot.own, slot.waiting) = match next {
                ServerNext::Busy(at) => (Some(at.max(self.now)), false),
                ServerNext::Waiting { stall_ends_at } => {
                    (stall_ends_at.map(|at| at.max(self.now)), true)
                }
            };
        }
        self.release(Party::Server(s));
    }

    /// The front (or a transceiver) ends its turn: its next deadline.
    pub fn end(&mut self, p: Party, deadline: Option<u64>) {
        let now = self.now;
        if let Some(slot) = self.slot_mut(p) {
            // A deadline already passed is due now (time never goes back).
            slot.own = deadline.map(|at| at.max(now));
        }
        self.release(p);
    }

    /// `p` leaves the run (ending its turn if it holds it): nothing reaches it any
    /// more.
    pub fn leave(&mut self, p: Party) {
        if let Some(slot) = self.slot_mut(p) {
            slot.gone = true;
            slot.own = None;
            slot.inbox.items.clear();
        }
        self.backstop.retain(|&s| Party::Server(s) != p);
        self.release(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instant_runs_process_points_then_the_front_then_transceivers_then_reads() {
        let mut t: Turns<&str> = Turns::new(2, 2);
        // Both servers' first turns at 0, in order.
        assert_eq!(t.begin(Party::Server(0)), 0);
        t.end_server(0, ServerNext::Busy(10));
        t.begin(Party::Server(1));
        t.end_server(
            1,
            ServerNext::Waiting {
                stall_ends_at: None,
            },
        );
        // Server 1 waits for what server 0's process point at 10 sends through the
        // front; a transceiver's deadline is at 10 too.
        t.end(Party::Transceiver(1), Some(10));
        assert_eq!(t.next(), Some((Party::Server(0), (10, Phase::Process, 0))));
        t.begin(Party::Server(0));
        t.post(Party::Front, 10, (Phase::Front, 0), "responses")
            .unwrap();
        t.end_server(0, ServerNext::Busy(20));
        assert_eq!(t.next().map(|n| n.0), Some(Party::Front));
        t.begin(Party::Front);
        assert_eq!(t.take_first(Party::Front, 10), Some("responses"));
        t.post(Party::Server(1), 10, (Phase::Delivery, 0), "handoff")
            .unwrap();
        t.end(Party::Front, None);
        assert_eq!(t.next().map(|n| n.0), Some(Party::Transceiver(1)));
        t.begin(Party::Transceiver(1));
        t.end(Party::Transceiver(1), None);
        assert_eq!(t.next(), Some((Party::Server(1), (10, Phase::Resume, 1))));
        t.begin(Party::Server(1));
        assert_eq!(t.take(Party::Server(1), 10, true), vec!["handoff"]);
    }

    #[test]
    fn a_busy_servers_inputs_wait_for_its_read_and_a_process_point_takes_only_earlier_ones() {
        let mut t: Turns<u32> = Turns::new(1, 0);
        t.begin(Party::Server(0));
        t.end_server(0, ServerNext::Busy(50));
        t.post(Party::Server(0), 20, (Phase::Delivery, 0), 1)
            .unwrap();
        t.post(Party::Server(0), 50, (Phase::Delivery, 0), 2)
            .unwrap();
        // The inputs give a busy server no turn of its own.
        assert_eq!(t.next(), Some((Party::Server(0), (50, Phase::Process, 0))));
        t.begin(Party::Server(0));
        assert_eq!(t.take(Party::Server(0), 50, false), vec![1]);
        t.end_server(
            0,
            ServerNext::Waiting {
                stall_ends_at: None,
            },
        );
        // What arrives in the instant of the process point is read after it.
        assert_eq!(t.next(), Some((Party::Server(0), (50, Phase::Resume, 0))));
        t.begin(Party::Server(0));
        assert_eq!(t.take(Party::Server(0), 50, true), vec![2]);
    }

    #[test]
    fn when_nothing_can_happen_every_waiting_server_is_stalled_out_in_order() {
        let mut t: Turns<u32> = Turns::new(3, 0);
        for s in 0..3 {
            t.begin(Party::Server(s));
            t.end_server(
                s,
                ServerNext::Waiting {
                    stall_ends_at: None,
                },
            );
        }
        t.leave(Party::Server(1));
        assert_eq!(t.next(), None);
        assert!(t.stall_out_waiting());
        assert_eq!(t.next().map(|n| n.0), Some(Party::Server(0)));
        t.begin(Party::Server(0));
        t.end_server(0, ServerNext::Busy(5));
        // The others are stalled out before anything else happens.
        assert_eq!(t.next().map(|n| n.0), Some(Party::Server(2)));
        assert_eq!(
            t.post(Party::Server(1), 0, (Phase::Delivery, 0), 9),
            Err(OrderError::Gone(Party::Server(1)))
        );
    }
}
