//! The device actor: the model backend's forward runs on its own thread, so under the
//! overlap scheduler the host really schedules batch N+1 while batch N runs.

use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, bounded};

use lockstep_actors::executor::{ForwardOutput, ScheduledBatch};
use lockstep_actors::group::{DeterministicTokens, TokenSource};
use lockstep_actors::ids::BatchNumber;
use lockstep_gpu::{Backend, BatchShape};

enum DeviceCommand {
    Launch(ScheduledBatch),
    Stop,
}

/// A rank's handle on its device: a thread running the modeled forward, or — for the
/// zero-cost backend, where there is no forward time to overlap — the same sampling done
/// inline at launch, so overhead measurements count the control plane, not thread
/// hand-offs of empty work.
pub struct DeviceHandle {
    rank: usize,
    commands: Sender<DeviceCommand>,
    outputs: Receiver<ForwardOutput>,
    thread: Option<std::thread::JoinHandle<()>>,
    timeout: Duration,
    inline: Option<std::cell::RefCell<InlineDevice>>,
}

/// The zero-cost device: outputs sampled at launch, queued in launch order; their
/// vectors come back through [`DeviceHandle::recycle`].
#[derive(Default)]
struct InlineDevice {
    queued: std::collections::VecDeque<ForwardOutput>,
    spare: Vec<ForwardOutput>,
}

/// How the device models time.
#[derive(Debug, Clone, Copy)]
pub struct DeviceTiming {
    /// Sleep `forward_ns * time_scale`; 0 runs at zero cost.
    pub time_scale: f64,
}

impl DeviceHandle {
    /// Starts the device thread of `rank`.
    pub fn start<B: Backend + Send + 'static>(
        rank: usize,
        backend: B,
        timing: DeviceTiming,
        timeout: Duration,
    ) -> DeviceHandle {
        if timing.time_scale <= 0.0 {
            let (commands, _) = bounded::<DeviceCommand>(1);
            let (_, outputs) = bounded::<ForwardOutput>(1);
            return DeviceHandle {
                rank,
                commands,
                outputs,
                thread: None,
                timeout,
                inline: Some(Default::default()),
            };
        }
        // Two batches can be outstanding under overlap; a little slack costs nothing.
        let (commands, command_rx) = bounded::<DeviceCommand>(4);
        let (output_tx, outputs) = bounded::<ForwardOutput>(4);
        let thread = std::thread::Builder::new()
            .name(format!("device-{rank}"))
            .spawn(move || {
                let mut tokens = DeterministicTokens;
                while let Ok(DeviceCommand::Launch(batch)) = command_rx.recv() {
                    let ns = backend.forward_ns(&BatchShape::of(&batch)) as f64 * timing.time_scale;
                    if ns >= 1.0 {
                        std::thread::sleep(Duration::from_nanos(ns as u64));
                    }
                    if output_tx.send(tokens.sample(&batch)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn device thread");
        DeviceHandle {
            rank,
            commands,
            outputs,
            thread: Some(thread),
            timeout,
            inline: None,
        }
    }

    /// Launches a batch (returns at once). The device thread gets its own copy; the
    /// zero-cost device samples in place.
    pub fn launch(&self, batch: &ScheduledBatch) -> Result<(), super::DriverError> {
        if let Some(device) = &self.inline {
            let mut device = device.borrow_mut();
            let mut out = device.spare.pop().unwrap_or(ForwardOutput {
                batch: batch.number,
                sampled: Vec::new(),
            });
            DeterministicTokens.sample_into(batch, &mut out);
            device.queued.push_back(out);
            return Ok(());
        }
        self.commands
            .send(DeviceCommand::Launch(batch.clone()))
            .map_err(|_| super::DriverError::Device {
                rank: self.rank,
                message: "device thread is gone".into(),
            })
    }

    /// Waits for the output of batch `number` (outputs arrive in launch order).
    pub fn await_output(&self, number: BatchNumber) -> Result<ForwardOutput, super::DriverError> {
        if let Some(device) = &self.inline {
            let mut device = device.borrow_mut();
            while let Some(out) = device.queued.pop_front() {
                if out.batch == number {
                    return Ok(out);
                }
            }
            return Err(super::DriverError::Device {
                rank: self.rank,
                message: format!("no output for batch {number}: it was never launched"),
            });
        }
        loop {
            let out = self.outputs.recv_timeout(self.timeout).map_err(|e| {
                super::DriverError::Device {
                    rank: self.rank,
                    message: format!(
                        "no output for batch {number} within {:?}: {e}",
                        self.timeout
                    ),
                }
            })?;
            if out.batch == number {
                return Ok(out);
            }
            if out.batch > number {
                return Err(super::DriverError::Device {
                    rank: self.rank,
                    message: format!("output for batch {} while awaiting {number}", out.batch),
                });
            }
        }
    }
}

impl DeviceHandle {
    /// Hands back a processed output so the zero-cost device reuses its vector.
    pub fn recycle(&self, output: ForwardOutput) {
        if let Some(device) = &self.inline {
            let mut device = device.borrow_mut();
            if device.spare.len() < 4 {
                device.spare.push(output);
            }
        }
    }
}

impl Drop for DeviceHandle {
    fn drop(&mut self) {
        let _ = self.commands.send(DeviceCommand::Stop);
        // Unblock a device blocked on a full output channel.
        while self.outputs.try_recv().is_ok() {}
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
