//! The collectives of one iteration (mechanisms.md §3) as a trait every driver uses, so
//! the executor loop is written once for threads in one process and for MPI ranks.
//!
//! Guardrails: every rank calls the same collectives in the same order with the same
//! [`CollectiveTag`] (§3: a skipped or reordered collective hangs or corrupts the fleet);
//! an implementation checks the tags and reports a mismatch instead of mixing up
//! payloads. Payloads travel as bincode 2 bytes on every transport, so the in-process
//! group exercises the encoding the MPI group sends.

use lockstep_actors::executor::CollectiveTag;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The collectives of one iteration. Every call is collective: every rank of the group
/// makes it, in the same order, with the same tag (and root).
pub trait Collective {
    /// This member's rank, `0..size()`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Every rank contributes `mine`; everyone gets all contributions in rank order.
    fn allgather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        mine: &T,
    ) -> Result<Vec<T>, CollectiveError>;

    /// The root's value to everyone (count first, then payload, on byte transports).
    /// Non-roots pass `None`; a value passed at a non-root is ignored.
    fn broadcast<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        value: Option<&T>,
    ) -> Result<T, CollectiveError>;

    /// The maximum of every rank's `mine`, on every rank.
    fn allreduce_max(&mut self, tag: CollectiveTag, mine: u64) -> Result<u64, CollectiveError>;

    /// Everyone's value at the root (`Some` there, `None` elsewhere), in rank order.
    fn gather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        mine: &T,
    ) -> Result<Option<Vec<T>>, CollectiveError>;

    /// Tells the other members this one is alive though it is not in a collective (rank
    /// 0 waiting for an input while its peers wait in the fetch broadcast), so a peer's
    /// timeout or watchdog measures a stuck rank, not an idle server. Not collective.
    fn keep_alive(&mut self) {}
}

/// Why a collective failed. Every variant except `Encode`/`Decode` leaves the group
/// unusable: later calls fail fast rather than hang.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// Two ranks entered the same round with different tags: the ranks disagree about
    /// which collective comes next.
    #[error(
        "collective tag mismatch: rank {rank_a} sent {tag_a:?} but rank {rank_b} sent {tag_b:?}"
    )]
    TagMismatch {
        /// The first rank (the lower rank id of the first differing pair).
        rank_a: usize,
        /// Its tag.
        tag_a: CollectiveTag,
        /// The rank whose tag differs.
        rank_b: usize,
        /// Its tag.
        tag_b: CollectiveTag,
    },
    /// This rank waited longer than the group's timeout.
    #[error("collective {tag:?} timed out after {waited_ms} ms; ranks {missing:?} did not arrive")]
    Timeout {
        /// The collective this rank was in.
        tag: CollectiveTag,
        /// How long it waited.
        waited_ms: u64,
        /// The ranks it was waiting for.
        missing: Vec<usize>,
    },
    /// This rank's value could not be encoded (or the call was malformed at this rank).
    #[error("could not encode this rank's contribution: {0}")]
    Encode(String),
    /// A rank's contribution could not be decoded as the expected type.
    #[error("could not decode the contribution of rank {rank}: {message}")]
    Decode {
        /// Whose bytes.
        rank: usize,
        /// What went wrong.
        message: String,
    },
    /// The group is unusable (an earlier mismatch or timeout, a member gone, ranks
    /// calling different collectives under one tag).
    #[error("collective group broken: {0}")]
    GroupBroken(String),
}

/// The one encoding every transport uses.
pub(crate) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CollectiveError> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
        .map_err(|e| CollectiveError::Encode(e.to_string()))
}

/// Decodes `rank`'s bytes; trailing bytes mean the ranks disagree about the type.
pub(crate) fn decode<T: DeserializeOwned>(rank: usize, bytes: &[u8]) -> Result<T, CollectiveError> {
    let (value, read) =
        bincode::serde::decode_from_slice::<T, _>(bytes, bincode::config::standard()).map_err(
            |e| CollectiveError::Decode {
                rank,
                message: e.to_string(),
            },
        )?;
    if read != bytes.len() {
        return Err(CollectiveError::Decode {
            rank,
            message: format!("{} trailing bytes after {read}", bytes.len() - read),
        });
    }
    Ok(value)
}
