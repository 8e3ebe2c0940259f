//! Model backends for lockstep.
//!
//! For now this is the analytic cost model the simulator runs in virtual time: a
//! [`BatchShape`] summarises one rank's share of a forward, a [`Backend`] turns shapes
//! into modeled host and device times, and [`profiles`] ships named coefficient sets
//! with the reasoning behind their numbers. [`model`] is a real CPU transformer of the
//! Llama family whose attention reads and writes the paged KV cache.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod cost;
pub mod fit;
pub mod kv_contents;
pub mod model;
pub mod model_tokens;
mod profiles;
pub mod roofline;

pub use cost::{AnalyticBackend, Backend, Coefficients, IterationTime, ZeroCostBackend};
pub use lockstep_actors::executor::BatchShape;
pub use profiles::{KvGeometry, ModelProfile, UnknownProfile, profile, profiles};
