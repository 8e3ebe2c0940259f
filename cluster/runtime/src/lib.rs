//! The runtime of the real drivers, written once: the rank host (the iteration protocol
//! over a real collective), the front host, the transceiver host, the device, the
//! client, the watchdog. They are written against three small traits —
//! [`lockstep_transport::Collective`], [`Net`] (point-to-point messages between hosts)
//! and [`Clock`] — and the backends (`threads`, `mpi`) implement only those and decide
//! where each host runs. Aggregated or disaggregated is scenario data: the same hosts run
//! both.
//!
//! Where the hosts run: [`threads`] (one process, a thread per host) and `mpi` (a process
//! per rank under `mpirun`, plus a front process; the `mpi` feature). [`overhead`]
//! measures the control plane's own cost per iteration on either.

#![forbid(unsafe_code)]

pub mod client;
pub mod clock;
pub mod device;
pub mod faults;
pub mod front_host;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod net;
mod options;
pub mod ordered;
pub mod overhead;
pub mod rank_host;
pub mod rank_setup;
pub mod status;
pub mod threads;
pub mod transceiver_host;
pub mod watchdog;

pub use clock::{Clock, WallClock};
pub use net::{Endpoint, Envelope, Inbox, Net, NetError, QueueInbox, Received};
pub use options::RealOptions;
pub(crate) use options::real_report;

/// A failure of a real run.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// `--model` cannot run this scenario.
    #[error(transparent)]
    Model(#[from] lockstep_plan::model_backend::ModelBackendError),
    /// A collective failed (tag mismatch, timeout naming the missing ranks, a broken
    /// group).
    #[error("server {server} rank {rank}: {source}")]
    Collective {
        /// The server.
        server: usize,
        /// The rank that saw it.
        rank: usize,
        /// The error.
        source: lockstep_transport::CollectiveError,
    },
    /// The executor refused a result.
    #[error("server {server} rank {rank}: {source}")]
    Executor {
        /// The server.
        server: usize,
        /// The rank.
        rank: usize,
        /// The error.
        source: lockstep_actors::executor::ExecutorError,
    },
    /// An ordered run's turn never came (a host stuck holding it).
    #[error(transparent)]
    Ordered(#[from] ordered::TurnStuck),
    /// The device failed.
    #[error("server {server} rank {rank}: device: {source}")]
    Device {
        /// The server.
        server: usize,
        /// The rank.
        rank: usize,
        /// The error.
        source: device::DeviceError,
    },
    /// A message could not be sent.
    #[error("server {server} rank {rank}: {source}")]
    Net {
        /// The server.
        server: usize,
        /// The rank.
        rank: usize,
        /// The error.
        source: NetError,
    },
    /// The client failed.
    #[error(transparent)]
    Client(#[from] client::ClientError),
    /// What runs in the client's place could not start (`lockstep serve`'s HTTP
    /// server under MPI: the address taken, say).
    #[error("the front's client could not start: {0}")]
    ClientStart(String),
    /// The scenario cannot run on this driver.
    #[error(transparent)]
    Plan(#[from] lockstep_plan::fleet::PlanError),
    /// After the client's shutdown no message reached the front for too long.
    #[error(
        "front: no message from any server for {waited_ms} ms; servers still running: {running_servers:?}; {summaries} of {ranks} ranks reported their end"
    )]
    FrontStarved {
        /// How long.
        waited_ms: u64,
        /// Servers that never reported they stopped.
        running_servers: Vec<usize>,
        /// Ranks that reported.
        summaries: usize,
        /// Ranks in all.
        ranks: usize,
    },
    /// A thread could not be started.
    #[error("starting {what}: {source}")]
    Spawn {
        /// Which thread.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// A host thread panicked.
    #[error("{what} panicked")]
    Panicked {
        /// Which thread.
        what: String,
    },
    /// The MPI world does not hold the processes the scenario needs.
    #[error(
        "world rank {world_rank}: MPI world size {world} does not match the scenario's {needed} processes (1 front + {layout})"
    )]
    WorldSize {
        /// The process reporting.
        world_rank: usize,
        /// The world's size.
        world: usize,
        /// Processes the scenario needs.
        needed: usize,
        /// The servers and their ranks.
        layout: String,
    },
    /// Processes loaded different scenarios.
    #[error(
        "world rank {world_rank}: processes disagree on the scenario: world rank 0 has digest {first:016x}, world rank {other} has {digest:016x}"
    )]
    ScenarioMismatch {
        /// The process reporting.
        world_rank: usize,
        /// World rank 0's digest.
        first: u64,
        /// The differing process.
        other: usize,
        /// Its digest.
        digest: u64,
    },
    /// A message from another process could not be decoded.
    #[error("malformed message from world rank {from}: {message}")]
    Malformed {
        /// The sender.
        from: usize,
        /// What went wrong.
        message: String,
    },
    /// The MPI setup failed (the world, the split).
    #[error("mpi: {0}")]
    Mpi(lockstep_transport::CollectiveError),
}
