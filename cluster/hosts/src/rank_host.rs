//! The rank host's policy, written once (§3.2): how rank 0 reads its server's ingress
//! into a fetch, when a wait ends — an input came, the ingress closed, or a bounded
//! stall lasted the stall bound — and when a forward launches in modeled time. The
//! simulator (`SimServer`, which steps a server's ranks through `ServerGroup` in one
//! thread) and the real drivers (`run_rank`, one rank over a real collective) drive
//! it; they only move items in, wait as told, and launch where it says.
//!
//! Time, as every driver spends it: an iteration starts with its fetch; the host step
//! takes the cost model's host time, so the batch launches that long after the fetch;
//! the device (`lockstep_actors::device::Device`) runs forwards one at a time in launch
//! order, each for the cost model's device time. The real drivers scale both to wall
//! time; the simulator runs them at scale 1 in virtual time.

use std::collections::VecDeque;

use lockstep_actors::device::{Device, DeviceIn};
use lockstep_actors::executor::{BatchShape, FetchBatch, FetchMode};
use lockstep_actors::ids::BatchNumber;
use lockstep_actors::request::IngressItem;
use lockstep_gpu::Backend;

use crate::stall::StallTimer;

/// What a read of the ingress comes to.
#[derive(Debug, PartialEq)]
pub enum Read {
    /// The fetch to hand the executor now.
    Fetch(FetchBatch),
    /// Nothing to read yet: wait for an input — until this time, if the stall bound
    /// applies — then ask [`RankHost::poll_wait`].
    Wait {
        /// When a bounded stall ends as deadlocked.
        stall_ends_at: Option<u64>,
    },
}

/// When a launched forward runs, in the driver's time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForwardTimes {
    /// The host step's end: the batch launches then.
    pub launch_at: u64,
    /// The forward's time on the device.
    pub forward_ns: u64,
    /// The host step's time.
    pub host_ns: u64,
}

/// One rank's host policy. Rank 0's holds the server's ingress as it was delivered;
/// every rank's times its forwards.
#[derive(Debug)]
pub struct RankHost {
    queued: VecDeque<IngressItem>,
    closed: bool,
    stall: StallTimer,
    /// The read that waits, with its stall deadline.
    waiting: Option<Option<u64>>,
    /// The running iteration's fetch, in the driver's time.
    fetched_at: u64,
    /// Driver time per modeled nanosecond.
    time_scale: f64,
    /// The modeled device: forwards one at a time, in launch order.
    device: Device,
}

/// Every iteration takes at least this long in modeled time, so the clock always
/// advances (wall time does that by itself in the real drivers' paced runs).
pub const MIN_ITERATION_NS: u64 = 1_000;

impl RankHost {
    /// A rank host whose bounded stalls end after `stall_bound_ns` and whose modeled
    /// times are scaled by `time_scale` (1: virtual time).
    pub fn new(stall_bound_ns: u64, time_scale: f64) -> RankHost {
        RankHost {
            queued: VecDeque::new(),
            closed: false,
            stall: StallTimer::new(stall_bound_ns),
            waiting: None,
            fetched_at: 0,
            time_scale,
            device: Device::new(),
        }
    }

    /// Items reached the ingress (in the order sent).
    pub fn deliver(&mut self, items: impl IntoIterator<Item = IngressItem>) {
        self.queued.extend(items);
    }

    /// Nothing will ever reach the ingress again: the next read is a shutdown.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// The executor asks for the ingress in `mode` at `now`. `Poll` takes what is there;
    /// `Block` and `Stalled` take it too when there is something, and otherwise wait.
    pub fn read(&mut self, mode: FetchMode, now: u64) -> Read {
        let stall_ends_at = self.stall.on_read(mode, now);
        if mode != FetchMode::Poll && self.queued.is_empty() && !self.closed {
            self.waiting = Some(stall_ends_at);
            return Read::Wait { stall_ends_at };
        }
        Read::Fetch(self.fetch(now, None))
    }

    /// Whether a read waits, and until when if the stall bound applies.
    pub fn waiting(&self) -> Option<Option<u64>> {
        self.waiting
    }

    /// While a read waits (after items came, the ingress closed, or time passed): the
    /// fetch, once the wait is over — with what came, or with a stall-out once a
    /// bounded stall has lasted the bound.
    pub fn poll_wait(&mut self, now: u64) -> Option<FetchBatch> {
        let stall_ends_at = self.waiting?;
        if !self.queued.is_empty() || self.closed {
            return Some(self.fetch(now, None));
        }
        if stall_ends_at.is_some_and(|at| now >= at) {
            let why = self.stall.reason();
            return Some(self.fetch(now, Some(why)));
        }
        None
    }

    /// Ends a waiting read with a stall-out for `reason` (the simulator's, when no
    /// event is left that could end the wait).
    pub fn stall_out(&mut self, now: u64, reason: String) -> Option<FetchBatch> {
        self.waiting?;
        Some(self.fetch(now, Some(reason)))
    }

    fn fetch(&mut self, now: u64, stalled_out: Option<String>) -> FetchBatch {
        self.waiting = None;
        let mut batch = FetchBatch {
            shutdown: self.closed,
            now_ns: now,
            stalled_out,
            ..FetchBatch::default()
        };
        for item in self.queued.drain(..) {
            batch.add(item);
        }
        batch
    }

    /// The iteration's fetch happened at `now` (on every rank: the host step counts
    /// from it).
    pub fn fetched(&mut self, now: u64) {
        self.fetched_at = now;
    }

    /// The running iteration's fetch.
    pub fn fetched_at(&self) -> u64 {
        self.fetched_at
    }

    /// The forward step's times, from every rank's batch shape (every rank computes
    /// the same, and so does the simulator: the forward ends with the slowest rank's,
    /// whose collectives every rank waits for).
    pub fn forward_times(
        &self,
        backend: &impl Backend,
        shapes: &[BatchShape],
        launched: bool,
    ) -> ForwardTimes {
        // Overlap only changes the total, which no driver uses: the device's order does.
        let time = backend.iteration_ns(shapes, launched, true);
        let host_ns = self.scaled(time.host_ns);
        ForwardTimes {
            launch_at: self.fetched_at.saturating_add(host_ns),
            forward_ns: self.scaled(time.device_ns),
            host_ns,
        }
    }

    /// Launches the iteration's forward (`launched`: its batch number) on the modeled
    /// device and says when the iteration reaches its process point, where the update
    /// runs and responses and KV sends leave: the awaited output is ready (this batch's
    /// without overlap, the previous one's with it) and the host step is done, and at
    /// least [`MIN_ITERATION_NS`] after the fetch. Where virtual time is all there is
    /// (the simulator, an ordered real run) this is when the iteration ends.
    pub fn process_point(
        &mut self,
        times: &ForwardTimes,
        launched: Option<BatchNumber>,
        awaited: Option<BatchNumber>,
    ) -> u64 {
        // Outputs ready by the fetch are behind us.
        self.device.handle_timeout(self.fetched_at);
        while self.device.poll_out().is_some() {}
        if let Some(batch) = launched {
            self.device.handle(
                times.launch_at,
                DeviceIn::Launch {
                    batch,
                    forward_ns: times.forward_ns,
                },
            );
        }
        let ready = awaited.and_then(|n| self.device.ready_at(n)).unwrap_or(0);
        times
            .launch_at
            .max(ready)
            .max(self.fetched_at + MIN_ITERATION_NS)
    }

    fn scaled(&self, ns: u64) -> u64 {
        if self.time_scale == 1.0 {
            ns
        } else {
            (ns as f64 * self.time_scale).round() as u64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_actors::ids::ReqId;
    use lockstep_actors::request::RequestSpec;
    use lockstep_gpu::{AnalyticBackend, Coefficients};

    fn request(id: u64) -> IngressItem {
        IngressItem::Request(RequestSpec::new(id, 16, 4))
    }

    #[test]
    fn a_poll_takes_what_is_there_and_a_blocking_read_waits_for_an_input() {
        let mut h = RankHost::new(1_000, 1.0);
        h.deliver([request(1), IngressItem::Cancel(ReqId(7))]);
        let Read::Fetch(batch) = h.read(FetchMode::Poll, 5) else {
            panic!("a poll never waits")
        };
        assert_eq!(batch.requests.len(), 1);
        assert_eq!(batch.cancellations, vec![ReqId(7)]);
        assert_eq!(batch.now_ns, 5);
        assert_eq!(
            h.read(FetchMode::Poll, 6),
            Read::Fetch(FetchBatch {
                now_ns: 6,
                ..FetchBatch::default()
            })
        );
        assert_eq!(
            h.read(FetchMode::Block, 7),
            Read::Wait {
                stall_ends_at: None
            }
        );
        assert_eq!(
            h.poll_wait(1_000_000),
            None,
            "a block waits as long as it takes"
        );
        h.deliver([request(2)]);
        let batch = h.poll_wait(20).expect("an input ends the wait");
        assert_eq!((batch.requests.len(), batch.now_ns), (1, 20));
        assert_eq!(h.waiting(), None);
        assert_eq!(h.poll_wait(21), None, "no read waits");
    }

    #[test]
    fn a_bounded_stall_ends_with_a_stall_out_at_the_bound_and_not_before() {
        let mut h = RankHost::new(1_000, 1.0);
        assert_eq!(
            h.read(FetchMode::Stalled { bounded: true }, 100),
            Read::Wait {
                stall_ends_at: Some(1_100)
            }
        );
        assert_eq!(h.poll_wait(1_099), None);
        let batch = h.poll_wait(1_100).expect("the bound passed");
        assert_eq!(batch.stalled_out, Some(h.stall.reason()));
        // An unbounded stall never ends by itself.
        assert_eq!(
            h.read(FetchMode::Stalled { bounded: false }, 2_000),
            Read::Wait {
                stall_ends_at: None
            }
        );
        assert_eq!(h.poll_wait(u64::MAX), None);
        let batch = h.stall_out(2_500, "no event".into()).unwrap();
        assert_eq!(batch.stalled_out.as_deref(), Some("no event"));
    }

    #[test]
    fn a_closed_ingress_reads_as_a_shutdown() {
        let mut h = RankHost::new(1_000, 1.0);
        assert!(matches!(h.read(FetchMode::Block, 0), Read::Wait { .. }));
        h.close();
        let batch = h.poll_wait(3).expect("closing ends the wait");
        assert!(batch.shutdown);
        let Read::Fetch(batch) = h.read(FetchMode::Block, 4) else {
            panic!("a closed ingress never waits")
        };
        assert!(batch.shutdown);
    }

    #[test]
    fn a_forward_launches_a_host_step_after_the_fetch_scaled() {
        let backend = AnalyticBackend::new(Coefficients {
            forward_base_ns: 1000.0,
            ctx_token_ns: 10.0,
            ctx_attention_ns: 0.5,
            gen_request_ns: 7.0,
            gen_token_ns: 3.0,
            kv_read_ns: 2.0,
            collective_ns: 500.0,
            host_base_ns: 100.0,
            host_per_request_ns: 4.0,
        });
        let shapes = [BatchShape {
            gen_requests: 8,
            gen_tokens: 8,
            gen_kv_tokens: 800,
            ..BatchShape::default()
        }];
        let unscaled = backend.iteration_ns(&shapes, true, true);
        assert!(unscaled.host_ns > 0 && unscaled.device_ns > 0);
        let mut h = RankHost::new(1_000, 1.0);
        h.fetched(1_000);
        let t = h.forward_times(&backend, &shapes, true);
        assert_eq!(t.launch_at, 1_000 + unscaled.host_ns);
        assert_eq!(t.forward_ns, unscaled.device_ns);
        let mut slow = RankHost::new(1_000, 2.0);
        slow.fetched(1_000);
        let t = slow.forward_times(&backend, &shapes, true);
        assert_eq!(t.launch_at, 1_000 + 2 * unscaled.host_ns);
        assert_eq!(t.forward_ns, 2 * unscaled.device_ns);
        assert_eq!(h.forward_times(&backend, &shapes, false).forward_ns, 0);
    }
}
