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
//!
//! Where it can, a stretch is coasted in closed form ([`Sim::coast_stretch`]): each
//! iteration timed and recorded from the ranks' plans (`executor::stretch`), the
//! iterations applied to the ranks at once when the stretch ends, their tokens handed
//! to the front door as one run; the last iteration runs as a coasted one.

use lockstep_actors::vocab::TokenRun;

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
        if self.net.control_ns() == 0 && self.servers[s].stretch_begin() {
            return self.coast_stretch(s, limit, shutdown);
        }
        let mut coasted = 0;
        loop {
            let fetch_at = self.now;
            let ended = self.servers[s]
                .coast_iteration(fetch_at, shutdown, &self.backends[s])
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
            // client tokens (which reach the records when the door next takes anything:
            // `Client::on_responses`): the clock moves there, the responses leave, and
            // the next fetch reads what is there (nothing: any input would have been an
            // event before the horizon).
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

    /// Coasts server `s` in closed form (`executor::stretch`), from now, at most
    /// `limit` iterations, the first read bringing `shutdown`: each iteration is timed
    /// and recorded from the plan and its tokens served by the front door, under the
    /// same conditions as the loop above; the iterations are applied to the ranks and
    /// their tokens handed to the client once the stretch ends. Its last iteration,
    /// when the server goes on from [`Event::Coasted`], runs as a coasted one.
    fn coast_stretch(
        &mut self,
        s: usize,
        limit: u64,
        mut shutdown: bool,
    ) -> Result<bool, SimError> {
        // Nothing in the stretch moves the horizon: its responses are plain tokens.
        let horizon = self.horizon();
        let processes = self.client.door_processes();
        let mut shares = vec![0u64; processes];
        for rank in self.servers[s].group.ranks() {
            for r in rank.active() {
                shares[self.client.door_process_of(r.id().0)] += 1;
            }
        }
        let mut dues = vec![Vec::new(); processes];
        let mut step: u32 = 0;
        let mut last_fetch = self.now;
        loop {
            let fetch_at = self.now;
            step += 1;
            let ended = self.servers[s].stretch_time(fetch_at, step, &self.backends[s]);
            self.coasted.1 += 1;
            let more = u64::from(step) < limit
                && horizon.is_none_or(|h| ended < h)
                && self.servers[s].group.stretch_fits(step + 1);
            if !more {
                self.stretch_apply(s, step - 1, last_fetch, shutdown, dues)?;
                self.servers[s]
                    .stretch_last(step, fetch_at, ended, shutdown)
                    .map_err(|e| self.protocol(s, e))?;
                self.push(ended, Event::Coasted(s));
                return Ok(true);
            }
            self.servers[s].stretch_record(step, fetch_at, ended);
            self.client.serve_tokens(ended, &shares, &mut dues);
            self.now = ended;
            last_fetch = fetch_at;
            match self.servers[s].coast_read(self.now) {
                Some(more_shutdown) => shutdown |= more_shutdown,
                None => {
                    self.stretch_apply(s, step, last_fetch, shutdown, dues)?;
                    return self.step_on(s).map(|()| true);
                }
            }
        }
    }

    /// The first `steps` iterations of server `s`'s stretch applied (the last fetched
    /// at `last_fetch`), their tokens held by the front door (served at `dues`) for the
    /// client.
    fn stretch_apply(
        &mut self,
        s: usize,
        steps: u32,
        last_fetch: u64,
        shutdown: bool,
        dues: Vec<Vec<u64>>,
    ) -> Result<(), SimError> {
        if steps == 0 {
            return Ok(());
        }
        let mut run = TokenRun::default();
        self.servers[s]
            .stretch_apply(steps, last_fetch, shutdown, &mut run)
            .map_err(|e| self.protocol(s, e))?;
        self.iterations_without_response = 0;
        self.closed_form += u64::from(steps);
        self.client.hold_tokens(run, dues);
        if let Some(p) = self.opts.progress.as_mut() {
            let (finished, total) = self.client.progress();
            p(finished, total);
        }
        Ok(())
    }

    /// Server `s` goes on after a coasted iteration: coasting again if it can, else
    /// the next iteration in full.
    pub(crate) fn step_on(&mut self, s: usize) -> Result<(), SimError> {
        if self.try_coast(s)? {
            return Ok(());
        }
        let step = self.servers[s].step(self.now, &self.backends[s]);
        self.after_step(s, step)
    }

    /// The earliest time anything but a server's own coasting can happen: the next
    /// event, the next arrival, the front door's next job done that is more than plain
    /// tokens (those only reach their requests' records, and wait for what comes next:
    /// `Frontend::poll_timeout`).
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
}
