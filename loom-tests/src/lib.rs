//! loom models of lockstep's synchronisation protocols. The models drive the shipped
//! code: `lockstep-transport`'s in-process collective and ingress queue (built on its
//! `sync` shim, which re-exports loom's primitives under `--cfg lockstep_loom`) and
//! `lockstep-actors`' decisions (`idle_decision`, `pad_need`, `KvManager`).
//!
//! # Running
//!
//! ```text
//! RUSTFLAGS="--cfg lockstep_loom" CARGO_TARGET_DIR=/work/target-transport-loom \
//!     cargo test --release -p loom-tests
//! ```
//!
//! A separate target directory keeps the loom build from invalidating the normal one.
//! Without the cfg every test file is compiled out and `cargo test -p loom-tests` runs
//! zero tests. Each model bounds preemptions at 2 unless `LOOM_MAX_PREEMPTIONS` says
//! otherwise (1 is a quicker local run); `LOOM_LOG=1` and `LOOM_LOCATION=1` help read a
//! failure, `LOOM_CHECKPOINT_FILE` replays one.
//!
//! # Models
//!
//! - `tests/loom_idle.rs` (mechanisms.md §3.2): two ranks and a closed-loop client.
//!   `live_predicate_never_deadlocks_a_closed_loop_client` proves the fixed idle
//!   decision over every interleaving. `routable_predicate_deadlocks_a_closed_loop_client`
//!   is the negative control (deciding idleness from the routable count, which ignores
//!   retiring requests); it is `#[ignore]`d because a loom deadlock aborts the process,
//!   and `legacy_predicate_deadlock_is_found_by_loom` runs it in a child process and
//!   asserts that loom reports the deadlock.
//! - `tests/loom_dummy.rs` (§6, §10): two ranks with real KV managers vote through the
//!   real allgather; `no_dummy_outlives_its_iteration` checks the dummy transaction on
//!   both a rejected and an accepted vote.

#![forbid(unsafe_code)]
