//! lockstep's plans: everything a driver reads and derives before it runs, and the report
//! it writes after. No driver, no network.
//!
//! - [`scenario`]: the scenario file (servers, front, workload, model, policy);
//!   [`policy_keys`]: the `[policy]` table and `--set policy.KEY=VALUE`.
//! - [`frontend`]: the serving front door's costs (`[frontend]`).
//! - [`model`]: the cost model (coefficients, a roofline from `config.json`, the link).
//! - [`fleet`]: what every driver checks and derives from a scenario before it runs.
//! - [`workload`]: arrivals, lengths, prefixes, conversations, traces.
//! - [`report`]: records, statistics, tables, plots, the HTML report.
//! - [`model_backend`]: a real model's weights behind the ranks (`--model`).
//! - [`validate`], [`explain`], [`trtllm`].

#![forbid(unsafe_code)]

pub mod explain;
pub mod fleet;
pub mod frontend;
pub mod model;
pub mod model_backend;
pub mod policy_keys;
pub mod report;
pub mod scenario;
pub mod trtllm;
pub mod validate;
pub mod workload;
