//! The client side of the real drivers: plays the workload in real time (scaled) into the
//! ingress queue, takes the responses rank 0 gathers, and keeps a record per request.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use lockstep_actors::executor::RankResponses;
use lockstep_actors::ids::ReqId;
use lockstep_actors::request::RequestSpec;
use lockstep_transport::IngressQueue;

use super::DriverError;
use crate::report::ClientRecord;
use crate::workload::Workload;

/// What reaches rank 0 through the front door.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum IngressItem {
    /// A new request.
    Request(RequestSpec),
    /// Finish the work in hand, then stop.
    Shutdown,
    /// ctx server, generation-first mode: the front named this request's gen peer.
    PeerReady(lockstep_actors::ids::ReqId),
}

/// The client.
pub struct Client {
    workload: Workload,
    records: BTreeMap<ReqId, ClientRecord>,
    ingress: IngressQueue<IngressItem>,
    responses: Receiver<Vec<RankResponses>>,
    clock: Instant,
    scale: f64,
    preload: bool,
    shutdown_sent: bool,
}

/// What the client saw.
pub struct ClientResult {
    /// One record per request.
    pub records: Vec<ClientRecord>,
    /// Wall time from the client's start to the last response.
    pub end_ns: u64,
}

impl Client {
    /// A client feeding `ingress`; `time_scale` wall seconds per workload second (0:
    /// every arrival as soon as possible); `preload` sends everything and the shutdown
    /// now, before any rank runs.
    pub fn new(
        workload: Workload,
        ingress: IngressQueue<IngressItem>,
        responses: Receiver<Vec<RankResponses>>,
        time_scale: f64,
        preload: bool,
    ) -> Result<Client, DriverError> {
        let mut c = Client {
            workload,
            records: BTreeMap::new(),
            ingress,
            responses,
            clock: Instant::now(),
            scale: time_scale.max(0.0),
            preload,
            shutdown_sent: false,
        };
        if preload {
            while let Some(t) = c.workload.next_arrival_ns() {
                let Some(a) = c.workload.pop_due(t) else {
                    break;
                };
                c.records
                    .insert(a.spec.id, ClientRecord::new(a.spec.clone(), 0));
                c.push(IngressItem::Request(a.spec))?;
            }
            c.push(IngressItem::Shutdown)?;
            c.shutdown_sent = true;
        }
        Ok(c)
    }

    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn push(&self, item: IngressItem) -> Result<(), DriverError> {
        self.ingress
            .push(item)
            .map_err(|e| DriverError::Invalid(format!("ingress: {e}")))
    }

    /// Runs until rank 0 stops delivering (its end of the response channel closes).
    pub fn run(mut self) -> Result<ClientResult, DriverError> {
        loop {
            if !self.preload {
                while let Some(t) = self.workload.next_arrival_ns() {
                    if (t as f64 * self.scale) as u64 > self.now() {
                        break;
                    }
                    let Some(a) = self.workload.pop_due(t) else {
                        break;
                    };
                    let now = self.now();
                    self.records
                        .insert(a.spec.id, ClientRecord::new(a.spec.clone(), now));
                    self.push(IngressItem::Request(a.spec))?;
                }
                if !self.shutdown_sent
                    && self.workload.exhausted()
                    && self.records.values().all(|r| r.end_ns.is_some())
                {
                    self.push(IngressItem::Shutdown)?;
                    self.shutdown_sent = true;
                }
            }
            let wait = match self.workload.next_arrival_ns() {
                Some(t) if !self.preload => Duration::from_nanos(
                    ((t as f64 * self.scale) as u64)
                        .saturating_sub(self.now())
                        .min(20_000_000),
                ),
                _ => Duration::from_millis(20),
            };
            match self.responses.recv_timeout(wait) {
                Ok(batch) => {
                    let now = self.now();
                    for resp in batch.iter().flat_map(|r| &r.responses) {
                        if let Some(rec) = self.records.get_mut(&resp.id) {
                            let was_open = rec.end_ns.is_none();
                            rec.on_response(resp, now);
                            if was_open && rec.end_ns.is_some() {
                                self.workload.on_finished(resp.id, now, rec.completed);
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        self.ingress.close();
        let end_ns = self.now();
        Ok(ClientResult {
            records: self.records.into_values().collect(),
            end_ns,
        })
    }
}
