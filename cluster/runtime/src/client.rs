//! The client of the real drivers: plays the workload in real time (scaled) into the
//! front, takes the responses the front passes on, and keeps a record per request.

use std::collections::BTreeMap;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use lockstep_actors::ids::ReqId;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::{FailureKind, Response};

use super::clock::{Clock, WallClock};
use lockstep_plan::report::{ClientRecord, Itl};
use lockstep_plan::workload::Workload;

/// What the client tells the front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientItem {
    /// A new request.
    Request(RequestSpec),
    /// Cancel a request.
    Cancel(ReqId),
    /// Nothing more will come.
    Shutdown,
}

/// Why the client could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// `--preload` with a workload whose later requests depend on earlier ones
    /// finishing.
    #[error("--preload delivers every request before the first iteration, but {0}")]
    NotPreloadable(String),
    /// The front is gone before the client finished.
    #[error("the front stopped before the client sent everything")]
    FrontGone,
}

/// The client.
pub struct Client {
    workload: Workload,
    records: BTreeMap<ReqId, ClientRecord>,
    itl: Itl,
    to_front: Sender<ClientItem>,
    responses: Receiver<Vec<Response>>,
    clock: WallClock,
    scale: f64,
    preload: bool,
    shutdown_sent: bool,
    front_gone: bool,
}

/// The failure of a request the client could not send: the fleet had stopped.
const FRONT_STOPPED: &str = "not served: every server had stopped before the request was sent";

/// What the client saw.
pub struct ClientResult {
    /// One record per request.
    pub records: Vec<ClientRecord>,
    /// Inter-token gaps (wall time).
    pub itl: Itl,
    /// Wall time from the client's start to the last response.
    pub end_ns: u64,
}

impl Client {
    /// A client feeding the front; `time_scale` wall seconds per workload second (0:
    /// every arrival as soon as possible); `preload` sends every request and the
    /// shutdown now, before any rank runs (refused for a workload whose arrivals wait on
    /// completions).
    pub fn new(
        mut workload: Workload,
        to_front: Sender<ClientItem>,
        responses: Receiver<Vec<Response>>,
        clock: WallClock,
        time_scale: f64,
        preload: bool,
    ) -> Result<Client, ClientError> {
        let mut records = BTreeMap::new();
        if preload {
            if let Some(why) = workload.preload_blocker() {
                return Err(ClientError::NotPreloadable(why));
            }
            while let Some(t) = workload.next_arrival_ns() {
                let Some(a) = workload.pop_due(t) else {
                    break;
                };
                records.insert(a.spec.id, ClientRecord::new(&a.spec, 0));
                to_front
                    .send(ClientItem::Request(a.spec))
                    .map_err(|_| ClientError::FrontGone)?;
            }
            to_front
                .send(ClientItem::Shutdown)
                .map_err(|_| ClientError::FrontGone)?;
        }
        Ok(Client {
            itl: Itl::new(workload.warmup_requests()),
            workload,
            records,
            to_front,
            responses,
            clock,
            scale: time_scale.max(0.0),
            preload,
            shutdown_sent: preload,
            front_gone: false,
        })
    }

    /// The front stopped (it does once every server has stopped, e.g. a deadlocked
    /// server) before the workload was played out: `refused`, if the front refused it,
    /// and every request still to come fail with the reason, as in the simulator, where
    /// requests sent to a stopped fleet fail.
    fn front_stopped(&mut self, refused: Option<ReqId>) {
        self.front_gone = true;
        let now = self.clock.now_ns();
        let fail = |rec: &mut ClientRecord, workload: &mut Workload| {
            rec.fail(now, FailureKind::Unavailable, FRONT_STOPPED);
            workload.on_finished(rec.id, now, false);
        };
        if let Some(rec) = refused.and_then(|id| self.records.get_mut(&id)) {
            fail(rec, &mut self.workload);
        }
        // Requests still open stay open (the report fails them as "still open when the
        // run ended (OUTCOME)", as the simulator's does), but their clients are free, so
        // a closed loop's remaining requests are all drawn and failed below.
        for rec in self.records.values().filter(|r| r.end_ns.is_none()) {
            self.workload.on_finished(rec.id, now, false);
        }
        while let Some(t) = self.workload.next_arrival_ns() {
            let Some(a) = self.workload.pop_due(t) else {
                break;
            };
            let mut rec = ClientRecord::new(&a.spec, now);
            fail(&mut rec, &mut self.workload);
            self.records.insert(rec.id, rec);
        }
    }

    fn send(&self, item: ClientItem) -> Result<(), ClientError> {
        self.to_front.send(item).map_err(|_| ClientError::FrontGone)
    }

    /// Runs until the front stops passing responses (its end of the channel closes).
    pub fn run(mut self) -> Result<ClientResult, ClientError> {
        loop {
            if !self.preload {
                while let Some(t) = self.workload.next_arrival_ns() {
                    if (t as f64 * self.scale) as u64 > self.clock.now_ns() {
                        break;
                    }
                    let Some(a) = self.workload.pop_due(t) else {
                        break;
                    };
                    let now = self.clock.now_ns();
                    let id = a.spec.id;
                    self.records.insert(id, ClientRecord::new(&a.spec, now));
                    if self.send(ClientItem::Request(a.spec)).is_err() {
                        self.front_stopped(Some(id));
                        break;
                    }
                }
                if self.front_gone {
                    break;
                }
                if !self.shutdown_sent
                    && self.workload.exhausted()
                    && self.records.values().all(|r| r.end_ns.is_some())
                {
                    // The front may be gone already (every server stopped); nothing
                    // is lost then: every request has ended.
                    let _ = self.send(ClientItem::Shutdown);
                    self.shutdown_sent = true;
                }
            }
            let wait = match self.workload.next_arrival_ns() {
                Some(t) if !self.preload => Duration::from_nanos(
                    ((t as f64 * self.scale) as u64)
                        .saturating_sub(self.clock.now_ns())
                        .min(20_000_000),
                ),
                _ => Duration::from_millis(20),
            };
            match self.responses.recv_timeout(wait) {
                Ok(batch) => {
                    let now = self.clock.now_ns();
                    for resp in &batch {
                        if let Some(rec) = self.records.get_mut(&resp.id) {
                            let was_open = rec.end_ns.is_none();
                            rec.on_response(resp, now, &mut self.itl);
                            if was_open && rec.end_ns.is_some() {
                                self.workload.on_finished(resp.id, now, rec.completed);
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.front_stopped(None);
                    break;
                }
            }
        }
        let end_ns = self.clock.now_ns();
        Ok(ClientResult {
            records: self.records.into_values().collect(),
            itl: self.itl,
            end_ns,
        })
    }
}
