//! lockstep's drivers, scenario loading and reports.

#![forbid(unsafe_code)]

pub mod drivers;
pub mod model;
pub mod report;
pub mod scenario;
pub mod sim;
pub mod validate;
pub mod workload;
