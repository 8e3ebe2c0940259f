//! The device of the real drivers. A modeled forward takes the pure [`Device`] time
//! model's time (forwards one at a time, in launch order) on the wall clock: the output
//! is sampled at launch and handed back no earlier than its modeled end, so under the
//! overlap scheduler the host schedules batch N+1 while batch N "runs", as on a GPU,
//! without a thread per rank doing nothing but sleep (on a small machine those threads'
//! wake-ups cost more than the control plane does). With the zero-cost backend the
//! output is ready at launch. With a real model (`--model`) the forward runs at launch,
//! on the rank's thread, and takes the time it takes.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use lockstep_actors::device::{Device, DeviceIn};
use lockstep_actors::executor::{ForwardOutput, RankExecutor, ScheduledBatch};
use lockstep_actors::group::{DeterministicTokens, ForwardError, TokenSource};
use lockstep_actors::ids::BatchNumber;

/// Why the device failed a forward step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The awaited batch was never launched.
    #[error("no output for batch {batch}: it was never launched")]
    NeverLaunched {
        /// The batch.
        batch: BatchNumber,
    },
    /// The model backend failed the forward.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// A rank's device.
pub struct DeviceHandle {
    /// Outputs sampled at launch, in launch order.
    queued: VecDeque<ForwardOutput>,
    /// Output vectors handed back by the host, reused.
    spare: Vec<ForwardOutput>,
    /// Modeled time: the time model and its clock's origin (`None`: zero cost, or a
    /// real model's own time).
    modeled: Option<(Device, Instant)>,
    /// Where tokens come from.
    tokens: Box<dyn TokenSource + Send>,
}

impl DeviceHandle {
    /// A device whose outputs are ready at launch.
    pub fn zero_cost() -> DeviceHandle {
        DeviceHandle {
            queued: VecDeque::new(),
            spare: Vec::new(),
            modeled: None,
            tokens: Box::new(DeterministicTokens),
        }
    }

    /// A device that runs a real model: each forward computes at launch.
    pub fn real(tokens: Box<dyn TokenSource + Send>) -> DeviceHandle {
        DeviceHandle {
            tokens,
            ..DeviceHandle::zero_cost()
        }
    }

    /// A device whose forwards take their modeled time (passed, scaled, at launch) on
    /// the wall clock.
    pub fn modeled() -> DeviceHandle {
        DeviceHandle {
            modeled: Some((Device::new(), Instant::now())),
            ..DeviceHandle::zero_cost()
        }
    }

    /// Launches `exec`'s batch whose forward takes `forward_ns` of wall time (returns at
    /// once, unless a real model computes it).
    pub fn launch(
        &mut self,
        exec: &RankExecutor,
        batch: &ScheduledBatch,
        forward_ns: u64,
    ) -> Result<(), DeviceError> {
        if let Some((device, origin)) = &mut self.modeled {
            device.handle(
                origin.elapsed().as_nanos() as u64,
                DeviceIn::Launch {
                    batch: batch.number,
                    forward_ns,
                },
            );
        }
        let mut out = self.spare.pop().unwrap_or(ForwardOutput {
            batch: batch.number,
            sampled: Vec::new(),
        });
        self.tokens.sample_into(exec, batch, &mut out)?;
        self.queued.push_back(out);
        Ok(())
    }

    /// The output of batch `number`, once its forward ended (outputs come in launch
    /// order; older ones nobody awaited are dropped).
    pub fn await_output(&mut self, number: BatchNumber) -> Result<ForwardOutput, DeviceError> {
        if let Some((device, origin)) = &mut self.modeled {
            if let Some(at) = device.ready_at(number) {
                let now = origin.elapsed().as_nanos() as u64;
                if at > now {
                    std::thread::sleep(Duration::from_nanos(at - now));
                }
            }
            device.handle_timeout(origin.elapsed().as_nanos() as u64);
            while device.poll_out().is_some() {}
        }
        while let Some(out) = self.queued.pop_front() {
            if out.batch == number {
                return Ok(out);
            }
        }
        Err(DeviceError::NeverLaunched { batch: number })
    }

    /// Hands back a processed output so its vector is reused.
    pub fn recycle(&mut self, output: ForwardOutput) {
        if self.spare.len() < 4 {
            self.spare.push(output);
        }
    }
}
