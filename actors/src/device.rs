//! The device as a time model (mechanisms.md §3, overlap): forwards run one at a time in
//! launch order, each taking its modeled time from when the device is free. Under the
//! overlap scheduler the host launches batch N+1 while batch N still runs, so N+1 starts
//! when N ends, not when it was launched.
//!
//! Pure: the simulator reads ready times from it directly; the real drivers' device
//! handle (`cluster/runtime/src/device.rs`) drives the same actor inline on the rank's
//! thread, handing an output back no earlier than its modeled end on the wall clock.

use std::collections::VecDeque;

use crate::ids::BatchNumber;

/// An input of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceIn {
    /// A batch launched, whose forward takes `forward_ns` of device time.
    Launch {
        /// The batch.
        batch: BatchNumber,
        /// Its modeled device time.
        forward_ns: u64,
    },
}

/// An output of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOut {
    /// The batch's output is ready.
    Ready(BatchNumber),
}

/// One device's queue of forwards.
#[derive(Debug, Default)]
pub struct Device {
    /// When the last queued forward ends.
    busy_until_ns: u64,
    /// Forwards not yet reported ready, in launch order, with their end times.
    running: VecDeque<(BatchNumber, u64)>,
    ready: VecDeque<BatchNumber>,
}

impl Device {
    /// An idle device.
    pub fn new() -> Device {
        Device::default()
    }

    /// The one funnel for inputs.
    pub fn handle(&mut self, now_ns: u64, input: DeviceIn) {
        match input {
            DeviceIn::Launch { batch, forward_ns } => {
                let start = now_ns.max(self.busy_until_ns);
                self.busy_until_ns = start.saturating_add(forward_ns);
                self.running.push_back((batch, self.busy_until_ns));
            }
        }
    }

    /// When `batch` will be ready (it was launched and not yet reported).
    pub fn ready_at(&self, batch: BatchNumber) -> Option<u64> {
        self.running
            .iter()
            .find(|(b, _)| *b == batch)
            .map(|&(_, at)| at)
    }

    /// When the next forward ends.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<u64> {
        self.running.front().map(|&(_, at)| at)
    }

    /// Reports the forwards that ended by `now_ns` (spurious calls are harmless).
    pub fn handle_timeout(&mut self, now_ns: u64) {
        while let Some(&(batch, at)) = self.running.front() {
            if at > now_ns {
                break;
            }
            self.running.pop_front();
            self.ready.push_back(batch);
        }
    }

    /// The next output ready, in launch order.
    #[must_use]
    pub fn poll_out(&mut self) -> Option<DeviceOut> {
        self.ready.pop_front().map(DeviceOut::Ready)
    }

    /// Forgets every forward (a host that stops).
    pub fn reset(&mut self) {
        self.running.clear();
        self.ready.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_run_one_at_a_time_in_launch_order() {
        let mut d = Device::new();
        d.handle(
            0,
            DeviceIn::Launch {
                batch: BatchNumber(0),
                forward_ns: 10,
            },
        );
        // Launched while batch 0 runs (the overlap scheduler): starts at 10.
        d.handle(
            4,
            DeviceIn::Launch {
                batch: BatchNumber(1),
                forward_ns: 10,
            },
        );
        assert_eq!(d.ready_at(BatchNumber(1)), Some(20));
        assert_eq!(d.poll_timeout(), Some(10));
        d.handle_timeout(9);
        assert_eq!(d.poll_out(), None);
        d.handle_timeout(20);
        assert_eq!(d.poll_out(), Some(DeviceOut::Ready(BatchNumber(0))));
        assert_eq!(d.poll_out(), Some(DeviceOut::Ready(BatchNumber(1))));
        // Idle again: a launch starts at once.
        d.handle(
            50,
            DeviceIn::Launch {
                batch: BatchNumber(2),
                forward_ns: 5,
            },
        );
        assert_eq!(d.ready_at(BatchNumber(2)), Some(55));
    }
}
