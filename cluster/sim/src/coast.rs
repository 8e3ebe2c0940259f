//! Coasting through steady decode: when a server's ranks hold only requests decoding
//! one token each and nothing else can happen to the server before its next iteration
//! ends, the simulator runs that iteration without the protocol's collectives (the
//! group's `coast`: the same steps, the same effects), and keeps going while the
//! conditions hold. Every coasted iteration is timed, sampled and reported like any
//! other, and its responses leave at its process point, so the report is the same as
//! without coasting (`--no-skip`), byte for byte.
//!
//! What only the simulator can see: the fetch reads nothing (no input reached the
//! server), and no event of any other participant, no arrival and no front-door job
//! comes before the coasted iteration's fetch — the *horizon*. An iteration's inputs
//! are read at its fetch; what reaches the server later waits for the next one, which
//! then runs in full. A transfer event could reach a rank before its iteration ends,
//! but a coasting rank has no transfer in flight. The last coasted iteration's
//! responses leave at its process point, as an event ([`Event::Coasted`]), so they meet
//! the front and the client in the order of every other event.

use super::{Event, Sim, SimError};

impl Sim<'_, '_> {
    /// After server `s`'s iteration ended now: coasts as many iterations as it can;
    /// whether it coasted any (then the server goes on from [`Event::Coasted`]).
    pub(crate) fn try_coast(&mut self, s: usize) -> Result<bool, SimError> {
        if !self.opts.skip || self.opts.iter_log.is_some() || self.opts.model.is_some() {
            return Ok(false);
        }
        let limit = self.servers[s].group.coast_limit();
        if limit == 0 || self.horizon().is_some_and(|h| h <= self.now) {
            return Ok(false);
        }
        if !self.servers[s].group.coast_step_fits() {
            return Ok(false);
        }
        let Some(mut shutdown) = self.servers[s].coast_read(self.now) else {
            return Ok(false);
        };
        self.servers[s].group.coast_begin();
        self.coasted.0 += 1;
        let mut coasted = 0;
        loop {
            let fetch_at = self.now;
            let ended = self.servers[s]
                .coast_iteration(fetch_at, shutdown, &self.backend)
                .map_err(|e| self.protocol(s, e))?;
            coasted += 1;
            self.coasted.1 += 1;
            let more = coasted < limit
                && self.horizon().is_none_or(|h| ended < h)
                && self.servers[s].group.coast_step_fits();
            if !more {
                self.push(ended, Event::Coasted(s));
                return Ok(true);
            }
            // Nothing else happens before the next fetch but the front door handing the
            // client tokens: the clock moves there, the responses leave, and the next
            // fetch reads what is there (nothing: any input would have been an event
            // before the horizon).
            self.release_tokens_until(ended);
            self.now = ended;
            self.emit_responses(s);
            if self.horizon().is_some_and(|h| h <= self.now) {
                // What the responses set off comes first.
                return self.step_on(s).map(|()| true);
            }
            match self.servers[s].coast_read(self.now) {
                Some(more_shutdown) => shutdown = more_shutdown,
                None => return self.step_on(s).map(|()| true),
            }
        }
    }

    /// Server `s` goes on after a coasted iteration: coasting again if it can, else
    /// the next iteration in full.
    pub(crate) fn step_on(&mut self, s: usize) -> Result<(), SimError> {
        if self.try_coast(s)? {
            return Ok(());
        }
        let step = self.servers[s].step(self.now, &self.backend);
        self.after_step(s, step)
    }

    /// The earliest time anything but a server's own coasting can happen: the next
    /// event, the next arrival, the front door's next job done that is more than plain
    /// tokens (those only reach their requests' records: [`Sim::release_tokens_until`]).
    fn horizon(&mut self) -> Option<u64> {
        let arrival = if self.opts.preload {
            None
        } else {
            self.client.next_arrival_ns()
        };
        [
            self.next_event_time(),
            arrival,
            self.client.next_due_beyond_tokens(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The front door hands the client what it is done with by `until`, each at its
    /// time, as the event loop would (only plain tokens: anything else is past the
    /// horizon).
    fn release_tokens_until(&mut self, until: u64) {
        let mut items = Vec::new();
        while let Some(due) = self.client.poll_timeout().filter(|&d| d <= until) {
            self.client.handle_timeout(due, &mut items);
        }
        debug_assert!(
            items.is_empty(),
            "a request passed the door inside the horizon"
        );
    }
}
