//! The device actor of the real drivers: the forward runs on its own thread, so under
//! the overlap scheduler the host really schedules batch N+1 while batch N runs. The
//! thread drives the pure [`Device`] time model (forwards one at a time, in launch
//! order) with the wall clock, sleeping each forward's scaled modeled time. With the
//! zero-cost backend there is no forward time to overlap: the same sampling is done
//! inline at launch, so overhead measurements count the control plane, not thread
//! hand-offs of empty work.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded};

use lockstep_actors::device::{Device, DeviceIn, DeviceOut};
use lockstep_actors::executor::{ForwardOutput, ScheduledBatch};
use lockstep_actors::group::{DeterministicTokens, TokenSource};
use lockstep_actors::ids::BatchNumber;

/// Why the device failed a forward step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The device thread is gone.
    #[error("the device thread is gone")]
    Gone,
    /// The awaited output did not come in time.
    #[error("no output for batch {batch} within {waited_ms} ms")]
    Late {
        /// The batch.
        batch: BatchNumber,
        /// How long the host waited.
        waited_ms: u64,
    },
    /// The awaited batch was never launched.
    #[error("no output for batch {batch}: it was never launched")]
    NeverLaunched {
        /// The batch.
        batch: BatchNumber,
    },
    /// Outputs came out of order.
    #[error("output for batch {got} while awaiting {want}")]
    OutOfOrder {
        /// What came.
        got: BatchNumber,
        /// What was awaited.
        want: BatchNumber,
    },
}

enum Command {
    Launch(ScheduledBatch, u64),
    Stop,
}

/// A rank's handle on its device.
pub struct DeviceHandle {
    commands: Sender<Command>,
    outputs: Receiver<ForwardOutput>,
    thread: Option<std::thread::JoinHandle<()>>,
    timeout: Duration,
    /// The zero-cost device: outputs sampled at launch, in launch order, and spare
    /// vectors handed back by the host.
    inline: Option<(VecDeque<ForwardOutput>, Vec<ForwardOutput>)>,
}

impl DeviceHandle {
    /// A device that samples at launch, at zero cost.
    pub fn zero_cost(timeout: Duration) -> DeviceHandle {
        let (commands, _) = bounded::<Command>(1);
        let (_, outputs) = bounded::<ForwardOutput>(1);
        DeviceHandle {
            commands,
            outputs,
            thread: None,
            timeout,
            inline: Some(Default::default()),
        }
    }

    /// A device thread of `rank` that runs each forward for its modeled time (the host
    /// passes it, already scaled, at launch).
    pub fn start(rank: usize, timeout: Duration) -> Result<DeviceHandle, std::io::Error> {
        // Two batches can be outstanding under overlap; a little slack costs nothing.
        let (commands, command_rx) = bounded::<Command>(4);
        let (output_tx, outputs) = bounded::<ForwardOutput>(4);
        let thread = std::thread::Builder::new()
            .name(format!("device-{rank}"))
            .spawn(move || run_device(command_rx, output_tx))?;
        Ok(DeviceHandle {
            commands,
            outputs,
            thread: Some(thread),
            timeout,
            inline: None,
        })
    }

    /// Launches a batch whose forward takes `forward_ns` of wall time (returns at once).
    pub fn launch(&mut self, batch: &ScheduledBatch, forward_ns: u64) -> Result<(), DeviceError> {
        if let Some((queued, spare)) = &mut self.inline {
            let mut out = spare.pop().unwrap_or(ForwardOutput {
                batch: batch.number,
                sampled: Vec::new(),
            });
            DeterministicTokens.sample_into(batch, &mut out);
            queued.push_back(out);
            return Ok(());
        }
        self.commands
            .send(Command::Launch(batch.clone(), forward_ns))
            .map_err(|_| DeviceError::Gone)
    }

    /// Waits for the output of batch `number` (outputs arrive in launch order).
    pub fn await_output(&mut self, number: BatchNumber) -> Result<ForwardOutput, DeviceError> {
        if let Some((queued, _)) = &mut self.inline {
            while let Some(out) = queued.pop_front() {
                if out.batch == number {
                    return Ok(out);
                }
            }
            return Err(DeviceError::NeverLaunched { batch: number });
        }
        let started = Instant::now();
        loop {
            let out = self.outputs.recv_timeout(self.timeout).map_err(|_| {
                if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
                    DeviceError::Gone
                } else {
                    DeviceError::Late {
                        batch: number,
                        waited_ms: started.elapsed().as_millis() as u64,
                    }
                }
            })?;
            if out.batch == number {
                return Ok(out);
            }
            if out.batch > number {
                return Err(DeviceError::OutOfOrder {
                    got: out.batch,
                    want: number,
                });
            }
        }
    }

    /// Hands back a processed output so the zero-cost device reuses its vector.
    pub fn recycle(&mut self, output: ForwardOutput) {
        if let Some((_, spare)) = &mut self.inline
            && spare.len() < 4
        {
            spare.push(output);
        }
    }
}

/// The device thread: the [`Device`] time model on the wall clock.
fn run_device(commands: Receiver<Command>, outputs: Sender<ForwardOutput>) {
    let origin = Instant::now();
    let now = || origin.elapsed().as_nanos() as u64;
    let mut device = Device::new();
    let mut pending: VecDeque<ScheduledBatch> = VecDeque::new();
    let mut tokens = DeterministicTokens;
    loop {
        // The next forward's end, or wait for a launch.
        let command = match device.poll_timeout() {
            Some(at) => {
                let wait = Duration::from_nanos(at.saturating_sub(now()));
                match commands.recv_timeout(wait) {
                    Ok(c) => Some(c),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                }
            }
            None => match commands.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            },
        };
        match command {
            Some(Command::Launch(batch, forward_ns)) => {
                device.handle(
                    now(),
                    DeviceIn::Launch {
                        batch: batch.number,
                        forward_ns,
                    },
                );
                pending.push_back(batch);
            }
            Some(Command::Stop) => return,
            None => {}
        }
        device.handle_timeout(now());
        while let Some(DeviceOut::Ready(number)) = device.poll_out() {
            let Some(batch) = pending.pop_front() else {
                return;
            };
            debug_assert_eq!(batch.number, number, "forwards end in launch order");
            if outputs.send(tokens.sample(&batch)).is_err() {
                return;
            }
        }
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Stop);
        // Unblock a device blocked on a full output channel.
        while self.outputs.try_recv().is_ok() {}
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
