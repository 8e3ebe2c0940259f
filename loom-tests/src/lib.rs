//! loom models of lockstep's synchronisation protocols, on the shipped code: the models
//! run `lockstep-runtime`'s rank host (`rank_host::run_rank`, what the `threads`
//! and `mpi` drivers run) with the real executor protocol, over `lockstep-transport`'s
//! in-process collective group and ingress queue. Those are built on the transport's
//! `sync` shim, which re-exports loom's primitives under its `loom` feature, so loom
//! explores every interleaving of the ranks' collectives and the client's queue
//! operations. Nothing of the iteration is copied into the models.
//!
//! # Running
//!
//! ```text
//! cargo test --release -p loom-tests --features loom
//! ```
//!
//! (`scripts/test.sh` runs exactly this.) The feature changes only the crates the models
//! check (the transport and what builds on it); every other crate's release artifacts
//! are shared with the release build. Without the feature every model is compiled out
//! and `cargo test -p loom-tests` runs zero tests. Each model bounds preemptions at 2
//! unless `LOOM_MAX_PREEMPTIONS` says otherwise; `LOOM_LOG=1` and `LOOM_LOCATION=1` help
//! read a failure, `LOOM_CHECKPOINT_FILE` replays one.
//!
//! Under loom a deadline never passes (the shim's timed waits are plain waits), so a
//! protocol that needs a timeout to make progress shows up as a loom deadlock.
//!
//! # Models
//!
//! `tests/loom_rank_host.rs`: two ranks of an aggregated server and a closed-loop client.
//! - the fixed policy serves the client in every interleaving: the request is answered,
//!   both ranks drain, no invariant is violated, nothing stays allocated (§3.2, §10);
//! - with votes vetoed while rank 1 holds a tentative dummy, the rollback keeps every
//!   iteration dummy-free (§6);
//! - negative controls: `idle.predicate = "routable"` deadlocks the closed loop (loom
//!   reports it; run in a child process because the report aborts), and
//!   `pad.rollback = false` lets a vetoed dummy survive.

#![forbid(unsafe_code)]
