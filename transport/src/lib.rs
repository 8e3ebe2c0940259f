//! How lockstep's messages travel between ranks.
//!
//! - [`Collective`]: the iteration's collectives (mechanisms.md §3), one trait for every
//!   driver; [`exchange`] runs one step of the executor's protocol over it. [`InProcessGroup`] implements it for ranks that are threads of one process;
//!   payloads are bincode bytes, as on the MPI path.
//! - [`IngressQueue`]: the bounded front door → rank 0 queue that the idle decision
//!   (§3.2) blocks on or drains.
//! - [`sync`]: the std/loom shim; protocol code imports only it, so `loom-tests` checks
//!   the shipped code (built with the `loom` feature).

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod collective;
pub mod exchange;
pub mod in_process;
pub mod ingress;
#[cfg(feature = "mpi")]
pub mod mpi_group;
pub mod sync;

pub use collective::{Collective, CollectiveError};
pub use exchange::{Exchanged, exchange};
pub use in_process::{InProcessGroup, InProcessMember};
pub use ingress::{IngressError, IngressQueue, Popped};
#[cfg(feature = "mpi")]
pub use mpi_group::{HEARTBEAT_CHANNEL, MpiMember, MpiPeers};

#[cfg(all(test, not(feature = "loom")))]
mod tests;
