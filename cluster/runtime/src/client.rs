//! The real drivers' loop around the client ([`lockstep_hosts::client`]): it plays the
//! workload in real time (scaled) into the front's channel, hands the client the
//! responses the front passes on, and ends when the front closes its end.

use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use lockstep_actors::vocab::Response;
use lockstep_hosts::client::Client;
pub use lockstep_hosts::client::{ClientItem, ClientResult};
use lockstep_hosts::frontend::Frontend;
use lockstep_plan::frontend::FrontendCosts;

use super::clock::{Clock, WallClock};
use lockstep_plan::workload::Workload;

/// Why the client could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// `--preload` with a workload whose later requests depend on earlier ones
    /// finishing.
    #[error(transparent)]
    NotPreloadable(#[from] lockstep_hosts::client::NotPreloadable),
    /// The front is gone before the client finished.
    #[error("the front stopped before the client sent everything")]
    FrontGone,
}

/// The client in wall time.
pub struct ClientLoop {
    client: Client,
    to_front: Sender<ClientItem>,
    responses: Receiver<Vec<Response>>,
    clock: WallClock,
    scale: f64,
    preload: bool,
    front_gone: bool,
}

impl ClientLoop {
    /// A client feeding the front through `frontend`'s front door; `time_scale` wall
    /// seconds per workload second (0: every arrival as soon as possible, and the front
    /// door free); `preload` sends every request and the shutdown now, before any rank
    /// runs (refused for a workload whose arrivals wait on completions).
    pub fn new(
        workload: Workload,
        frontend: FrontendCosts,
        to_front: Sender<ClientItem>,
        responses: Receiver<Vec<Response>>,
        clock: WallClock,
        time_scale: f64,
        preload: bool,
    ) -> Result<ClientLoop, ClientError> {
        let mut client = Client::new(workload, Frontend::new(frontend, time_scale));
        if preload {
            for item in client.preload()? {
                to_front.send(item).map_err(|_| ClientError::FrontGone)?;
            }
        }
        Ok(ClientLoop {
            client,
            to_front,
            responses,
            clock,
            scale: time_scale.max(0.0),
            preload,
            front_gone: false,
        })
    }

    fn wall_ns(&self, workload_ns: u64) -> u64 {
        (workload_ns as f64 * self.scale) as u64
    }

    /// Sends `items` to the front; false when it is gone (the first request it could
    /// not take, and every one still to come, fail).
    fn send(&mut self, items: &mut Vec<ClientItem>) -> bool {
        for item in items.drain(..) {
            let id = match &item {
                ClientItem::Request(spec) => Some(spec.id),
                _ => None,
            };
            if self.to_front.send(item).is_err() {
                self.front_gone = true;
                self.client.front_stopped(self.clock.now_ns(), id);
                return false;
            }
        }
        true
    }

    /// Runs until the front stops passing responses (its end of the channel closes).
    pub fn run(mut self) -> Result<ClientResult, ClientError> {
        let mut items = Vec::new();
        loop {
            if !self.preload {
                // What the front door finished, then what the workload has due.
                self.client.handle_timeout(self.clock.now_ns(), &mut items);
                while let Some(t) = self.client.next_arrival_ns()
                    && self.wall_ns(t) <= self.clock.now_ns()
                {
                    self.client.send_due(t, self.clock.now_ns(), &mut items);
                }
                if !self.send(&mut items) {
                    break;
                }
                if let Some(shutdown) = self.client.shutdown_due() {
                    // The front may be gone already (every server stopped); nothing
                    // is lost then: every request has ended.
                    let _ = self.to_front.send(shutdown);
                }
            }
            let next_wall = [
                self.client.next_arrival_ns().map(|t| self.wall_ns(t)),
                self.client.poll_timeout(),
            ]
            .into_iter()
            .flatten()
            .min();
            let wait = match next_wall {
                Some(t) if !self.preload => {
                    Duration::from_nanos(t.saturating_sub(self.clock.now_ns()).min(20_000_000))
                }
                _ => Duration::from_millis(20),
            };
            match self.responses.recv_timeout(wait) {
                Ok(batch) => self.client.on_responses(self.clock.now_ns(), &batch),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.client.front_stopped(self.clock.now_ns(), None);
                    break;
                }
            }
        }
        let end_ns = self.clock.now_ns();
        Ok(self.client.into_result(end_ns))
    }
}
