//! Real multi-rank drivers: every rank on its own OS thread (`threads`), or one process
//! per rank under `mpirun` (`mpi`). Both run the executor phases of `lockstep-actors`
//! unchanged through [`rank_loop::run_rank`], with real collectives between them.

pub mod client;
pub mod device;
pub mod disagg_threads;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "mpi")]
pub mod mpi_disagg;
pub mod overhead;
pub mod rank_loop;
pub mod threads;

/// A driver failure: a collective error (tag mismatch, timeout naming the missing
/// ranks), a malformed phase result, a stuck device, or a lost rank.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// A collective failed.
    #[error("rank {rank}: {source}")]
    Collective {
        /// The rank that saw it.
        rank: usize,
        /// The error.
        source: lockstep_transport::CollectiveError,
    },
    /// An executor phase refused its input.
    #[error("rank {rank}: {source}")]
    Executor {
        /// The rank.
        rank: usize,
        /// The error.
        source: lockstep_actors::executor::ExecutorError,
    },
    /// No iteration progress within the watchdog time.
    #[error(
        "watchdog: rank {rank} made no progress for {waited_ms} ms (stuck in {phase}); state: {state}"
    )]
    Stuck {
        /// The stuck rank.
        rank: usize,
        /// How long.
        waited_ms: u64,
        /// Where.
        phase: String,
        /// Its actors' state.
        state: String,
    },
    /// The device actor is gone or late.
    #[error("rank {rank}: device: {message}")]
    Device {
        /// The rank.
        rank: usize,
        /// What happened.
        message: String,
    },
    /// Bad input for this driver.
    #[error("{0}")]
    Invalid(String),
    /// A fatal invariant violation (the real executor would crash).
    #[error("crashed: {0}")]
    Crashed(lockstep_actors::invariants::Violation),
    /// A peer crashed; this rank stopped at the same iteration.
    #[error("rank {rank}: stopped because rank {peer} crashed")]
    PeerCrashed {
        /// This rank.
        rank: usize,
        /// The rank that crashed.
        peer: usize,
    },
}
