//! lockstep's drivers, scenario loading and reports.

#![forbid(unsafe_code)]

pub mod scenario;
pub mod validate;
pub mod workload;
