//! lockstep's control plane: the attention-data-parallel (ADP) serving executor as
//! deterministic actors with typed messages and no I/O, no clock, no threads.
//!
//! Behaviour follows `mechanisms.md` (section numbers are cited as §N throughout).
//! A driver (the simulator in `lockstep-sim`, threads or MPI in `lockstep-runtime`) owns time and moves
//! messages; the [`executor::RankExecutor`] runs one rank's phases, each taking the
//! previous collective's result and returning this rank's contribution to the next.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod config;
pub mod counts;
pub mod device;
pub mod executor;
pub mod front;
pub mod group;
pub mod ids;
pub mod invariants;
pub mod kv;
pub mod padding;
pub mod policy;
pub mod request;
pub mod router;
pub mod scheduler;
pub mod seats;
pub mod token_path;
pub mod transceiver;
pub mod transfer_budget;
pub mod vocab;
