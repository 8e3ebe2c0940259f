//! The device of the real drivers. A modeled forward takes the pure [`Device`] time
//! model's time (forwards one at a time, in launch order) on the wall clock: the output
//! is sampled at launch and handed back no earlier than its modeled end, so under the
//! overlap scheduler the host schedules batch N+1 while batch N "runs", as on a GPU,
//! without a thread per rank doing nothing but sleep (on a small machine those threads'
//! wake-ups cost more than the control plane does). With the zero-cost backend the
//! output is ready at launch. With a real model (`--model`) the forward runs on the
//! rank's device thread (the CPU's stand-in for a GPU stream): launch hands it a copy of
//! the batch (into a recycled buffer: the batch carries its block tables and prompts,
//! so the thread needs nothing of the executor) and returns, so under the overlap
//! scheduler the host schedules batch N+1 while the model computes batch N, and the
//! forward takes the time it takes.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, unbounded};
use lockstep_actors::device::{Device, DeviceIn};
use lockstep_actors::executor::{ForwardOutput, ScheduledBatch};
use lockstep_actors::group::{DeterministicTokens, ForwardError, TokenSource};
use lockstep_actors::ids::BatchNumber;
use lockstep_gpu::model_tokens::RankModel;

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
    /// The device thread is gone (it could not start, or it panicked).
    #[error("the model's device thread is gone")]
    ThreadGone,
    /// A forward ran past the bound (a stuck device is an error, not a hang).
    #[error(
        "batch {batch}: the model's forward took longer than {limit:?} (--timeout-ms raises the bound)"
    )]
    ForwardTimeout {
        /// The batch awaited.
        batch: BatchNumber,
        /// The bound.
        limit: Duration,
    },
}

/// Where a real model's device threads write one JSON line per forward: the rank's batch
/// shape and the forward's measured time (`run --forward-log`, which `lockstep model
/// calibrate --from-log` fits).
pub type ForwardLog = std::sync::Arc<std::sync::Mutex<dyn std::io::Write + Send>>;

/// One line of a [`ForwardLog`].
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct ForwardRecord {
    /// The server's index.
    pub server: usize,
    /// The rank.
    pub rank: u32,
    /// The batch's shape.
    pub shape: lockstep_gpu::BatchShape,
    /// The forward's wall time.
    pub ns: u64,
}

/// A forward the device thread ran: the result, and the batch copy and output buffer
/// it was handed (they come back to be reused).
struct Ran {
    result: Result<(), ForwardError>,
    batch: ScheduledBatch,
    out: ForwardOutput,
}

/// A real model's device thread: batches in, outputs out, in launch order.
struct ModelThread {
    launches: Option<Sender<(ScheduledBatch, ForwardOutput)>>,
    outputs: Receiver<Ran>,
    /// Batch copies the thread handed back, reused for the next launches.
    spare_batches: Vec<ScheduledBatch>,
    launched: u64,
    answered: u64,
    /// The longest one forward may take.
    limit: Duration,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ModelThread {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.launches.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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
    /// Where tokens come from (the stand-in backend).
    tokens: Box<dyn TokenSource + Send>,
    /// A real model's thread, in place of `tokens`.
    model: Option<ModelThread>,
}

impl DeviceHandle {
    /// A device whose outputs are ready at launch.
    pub fn zero_cost() -> DeviceHandle {
        DeviceHandle {
            queued: VecDeque::new(),
            spare: Vec::new(),
            modeled: None,
            tokens: Box::new(DeterministicTokens),
            model: None,
        }
    }

    /// A device that runs a real model on its own thread, named `name`; a forward longer
    /// than `limit` fails the rank; with a log, each forward's shape and time go to it,
    /// tagged `(server, rank)`.
    pub fn real(
        mut model: RankModel,
        name: String,
        limit: Duration,
        log: Option<(ForwardLog, usize, u32)>,
    ) -> DeviceHandle {
        let (launches, inbox) = unbounded::<(ScheduledBatch, ForwardOutput)>();
        // At most two forwards in flight under the overlap scheduler.
        let (outbox, outputs) = bounded(4);
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            while let Ok((batch, mut out)) = inbox.recv() {
                let started = Instant::now();
                let result = model.compute_into(&batch, &mut out);
                if let Some((log, server, rank)) = &log {
                    let record = ForwardRecord {
                        server: *server,
                        rank: *rank,
                        shape: lockstep_gpu::BatchShape::of(&batch),
                        ns: started.elapsed().as_nanos() as u64,
                    };
                    if let (Ok(line), Ok(mut w)) = (serde_json::to_string(&record), log.lock()) {
                        // One write of the whole line: rank processes under mpirun
                        // append to one file, and whole lines cannot interleave. A log
                        // that cannot be written loses lines, not the run.
                        let _ = w.write_all(format!("{line}\n").as_bytes());
                    }
                }
                if outbox.send(Ran { result, batch, out }).is_err() {
                    break;
                }
            }
        });
        DeviceHandle {
            model: Some(ModelThread {
                launches: thread.is_ok().then_some(launches),
                outputs,
                spare_batches: Vec::new(),
                launched: 0,
                answered: 0,
                limit,
                thread: thread.ok(),
            }),
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

    /// Whether the device reads each batch's forward inputs (block tables, prompts): a
    /// real model does; its rank's executor must fill them
    /// (`RankExecutor::set_forward_inputs`).
    pub fn reads_forward_inputs(&self) -> bool {
        self.model.is_some()
    }

    /// Launches `batch` (the executor's [`lockstep_actors::executor::Io::Forward`]),
    /// whose forward takes `forward_ns` of wall time (returns at once, unless a real
    /// model computes it).
    pub fn launch(&mut self, batch: &ScheduledBatch, forward_ns: u64) -> Result<(), DeviceError> {
        if let Some(m) = &mut self.model {
            // The thread gets its own copy, in a buffer it handed back earlier.
            let mut copy = m.spare_batches.pop().unwrap_or_default();
            copy.clone_from(batch);
            let mut out = self.spare.pop().unwrap_or(ForwardOutput {
                batch: batch.number,
                sampled: Vec::new(),
                logprobs: Vec::new(),
            });
            out.batch = batch.number;
            out.sampled.clear();
            out.logprobs.clear();
            m.launched += 1;
            let sent = m
                .launches
                .as_ref()
                .is_some_and(|l| l.send((copy, out)).is_ok());
            return if sent {
                Ok(())
            } else {
                Err(DeviceError::ThreadGone)
            };
        }
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
            logprobs: Vec::new(),
        });
        self.tokens.sample_into(batch, &mut out)?;
        self.queued.push_back(out);
        Ok(())
    }

    /// The output of batch `number`, once its forward ended (outputs come in launch
    /// order; older ones nobody awaited are dropped).
    pub fn await_output(&mut self, number: BatchNumber) -> Result<ForwardOutput, DeviceError> {
        if let Some(m) = &mut self.model {
            // The thread answers every launch in order: older outputs nobody awaited
            // are dropped, a batch never launched is never answered.
            while m.answered < m.launched {
                let out = match m.outputs.recv_timeout(m.limit) {
                    Ok(Ran { result, batch, out }) => {
                        if m.spare_batches.len() < 4 {
                            m.spare_batches.push(batch);
                        }
                        result?;
                        out
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                        return Err(DeviceError::ForwardTimeout {
                            batch: number,
                            limit: m.limit,
                        });
                    }
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                        return Err(DeviceError::ThreadGone);
                    }
                };
                m.answered += 1;
                if out.batch == number {
                    return Ok(out);
                }
                if self.spare.len() < 4 {
                    self.spare.push(out);
                }
            }
            return Err(DeviceError::NeverLaunched { batch: number });
        }
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
