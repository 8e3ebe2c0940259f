//! lockstep's drivers, scenario loading and reports.
//!
//! - [`fleet`]: what every driver checks and derives from a scenario before it runs.
//! - [`runtime`]: the hosts of the real drivers, written once over small traits.
//! - [`backends`]: `sim` (one thread, virtual time), `threads`, `mpi`.
//! - [`bench`]: `lockstep bench`, a client that plays a workload against any
//!   OpenAI-compatible server over HTTP.
//! - [`report`], [`workload`], [`scenario`], [`model`], [`validate`].

#![forbid(unsafe_code)]

pub mod backends;
pub mod bench;
pub mod explain;
pub mod fleet;
pub mod model;
pub mod model_backend;
pub mod overhead;
pub mod policy_keys;
pub mod report;
pub mod runtime;
pub mod scenario;
pub mod serve;
pub mod swarm;
pub mod trtllm;
pub mod validate;
pub mod workload;

pub use backends::sim;
