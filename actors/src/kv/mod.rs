//! The KV manager of one rank (mechanisms.md §4, §6, §7): a paged block pool, prefix reuse
//! by chained block hashes with LRU eviction of unreferenced blocks, the KV index pool
//! (one slot per sequence, sized from the seats), the dummy transaction, and counters.
//!
//! Inputs: `add_sequence`, `ensure_tokens`, `register_prefix`, `free_sequence`, the dummy
//! transaction (`allocate_dummy` then exactly one of `commit_dummy` / `rollback_dummy`).
//! Outputs: typed results and [`KvCounters`].
//!
//! Guardrails: used + free = total at all times; a failed call changes nothing; block
//! choice is deterministic (lowest free id first, LRU by a logical tick, never a hash-map
//! iteration order); the index pool size is received, never recomputed.

use serde::{Deserialize, Serialize};

use crate::ids::ReqId;

/// How a KV manager is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvConfig {
    /// Tokens per block.
    pub tokens_per_block: u32,
    /// Blocks in the pool.
    pub total_blocks: u32,
    /// Prefix reuse on.
    pub enable_block_reuse: bool,
    /// Slots in the KV index pool (the seats, or `pp*B+1` under legacy `seats.rederive`).
    pub index_pool_size: u32,
}

/// Counters for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvCounters {
    /// Blocks taken from the free list or by eviction.
    pub allocations: u64,
    /// Blocks served from the prefix cache.
    pub reuse_hits: u64,
    /// Cached blocks evicted to satisfy an allocation.
    pub evictions: u64,
    /// `add_sequence` calls refused for lack of an index slot.
    pub deferrals_no_free_index_slot: u64,
    /// Dummies allocated tentatively.
    pub dummy_allocations: u64,
    /// Dummies committed.
    pub dummy_commits: u64,
    /// Dummies rolled back.
    pub dummy_rollbacks: u64,
}

/// A refused KV operation. The call changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum KvError {
    /// Every index slot is held.
    #[error("no free index slot ({used} of {size} held)")]
    NoFreeIndexSlot {
        /// Slots held.
        used: u32,
        /// Pool size.
        size: u32,
    },
    /// Not enough free (or evictable) blocks.
    #[error("out of KV blocks: need {needed}, {free} free")]
    OutOfBlocks {
        /// Blocks needed.
        needed: u32,
        /// Blocks free or evictable.
        free: u32,
    },
    /// The sequence is not known.
    #[error("unknown sequence {0}")]
    UnknownSequence(ReqId),
    /// The sequence already exists.
    #[error("sequence {0} already exists")]
    DuplicateSequence(ReqId),
}

/// A dummy's tentative KV allocation (§6). Must be consumed by
/// [`KvManager::commit_dummy`] or [`KvManager::rollback_dummy`].
#[must_use = "a tentative dummy must be committed or rolled back"]
#[derive(Debug, PartialEq, Eq)]
pub struct TentativeDummyKv {
    _private: (),
}

/// A structured invariant failure of the KV pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("kv invariant `{name}`: {detail}")]
pub struct KvInvariantViolation {
    /// Which invariant.
    pub name: &'static str,
    /// The numbers.
    pub detail: String,
}

/// The read-only view of a KV pool that schedulers need. [`KvManager`] implements it;
/// scheduler tests may use a fake.
pub trait KvView {
    /// Tokens per block.
    fn tokens_per_block(&self) -> u32;
    /// Blocks not referenced by any sequence (free or cached-evictable).
    fn free_blocks(&self) -> u32;
    /// Whether `id` holds a sequence.
    fn has_sequence(&self, id: ReqId) -> bool;
    /// Additional blocks `id` needs to hold `tokens` tokens (all of them if `id` has no
    /// sequence yet).
    fn blocks_needed(&self, id: ReqId, tokens: u32) -> u32;
    /// Blocks held by `id` (0 if unknown).
    fn blocks_of(&self, id: ReqId) -> u32;
}

/// The KV manager of one rank.
#[derive(Debug, Clone)]
pub struct KvManager {
    _todo: (),
}

impl KvManager {
    /// A manager with every block free and every index slot free.
    pub fn new(config: KvConfig) -> KvManager {
        let _ = config;
        todo!()
    }

    /// Tokens per block.
    pub fn tokens_per_block(&self) -> u32 {
        todo!()
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> u32 {
        todo!()
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_blocks(&self) -> u32 {
        todo!()
    }

    /// Blocks not referenced: truly free plus cached-evictable. `used + free == total`.
    pub fn free_blocks(&self) -> u32 {
        todo!()
    }

    /// Index slots held / pool size.
    pub fn index_slots_used(&self) -> u32 {
        todo!()
    }

    /// The index pool size.
    pub fn index_pool_size(&self) -> u32 {
        todo!()
    }

    /// Whether `id` holds a sequence (and so an index slot).
    pub fn has_sequence(&self, id: ReqId) -> bool {
        let _ = id;
        todo!()
    }

    /// Blocks held by `id` (0 if unknown).
    pub fn blocks_of(&self, id: ReqId) -> u32 {
        let _ = id;
        todo!()
    }

    /// `ceil(tokens / tokens_per_block)`.
    pub fn blocks_for_tokens(&self, tokens: u32) -> u32 {
        let _ = tokens;
        todo!()
    }

    /// Additional blocks `id` needs to hold `tokens` tokens (all of them if `id` has no
    /// sequence yet).
    pub fn blocks_needed(&self, id: ReqId, tokens: u32) -> u32 {
        let _ = (id, tokens);
        todo!()
    }

    /// Longest cached prefix of the chained `block_hashes`, in tokens. Read-only (the
    /// KV-aware router calls it on every rank).
    pub fn longest_prefix_match(&self, block_hashes: &[u64]) -> u32 {
        let _ = block_hashes;
        todo!()
    }

    /// Starts a sequence: takes an index slot and references the cached prefix blocks of
    /// `block_hashes` (at most `(prompt_len - 1) / tokens_per_block` of them, so at least
    /// one prompt token is computed). Returns the reused prompt tokens. On
    /// `NoFreeIndexSlot` counts a deferral and changes nothing else.
    pub fn add_sequence(
        &mut self,
        id: ReqId,
        block_hashes: &[u64],
        prompt_len: u32,
    ) -> Result<u32, KvError> {
        let _ = (id, block_hashes, prompt_len);
        todo!()
    }

    /// Grows `id` to hold `tokens` tokens, allocating blocks (free list first, lowest id
    /// first; then evicting the least recently used cached block). Never shrinks.
    pub fn ensure_tokens(&mut self, id: ReqId, tokens: u32) -> Result<(), KvError> {
        let _ = (id, tokens);
        todo!()
    }

    /// Makes the full prompt blocks of `id` covered by `computed_tokens` reusable under
    /// their chained keys (idempotent; a key already cached keeps its block).
    pub fn register_prefix(
        &mut self,
        id: ReqId,
        block_hashes: &[u64],
        computed_tokens: u32,
    ) -> Result<(), KvError> {
        let _ = (id, block_hashes, computed_tokens);
        todo!()
    }

    /// Frees everything `id` holds: its index slot and block references. Blocks with a key
    /// and no other reference go to the LRU (most recent end); others to the free list.
    pub fn free_sequence(&mut self, id: ReqId) -> Result<(), KvError> {
        let _ = id;
        todo!()
    }

    /// Dummy transaction, step 1: capacity pre-check (an index slot and the blocks for
    /// `tokens`), then a tentative allocation under [`ReqId::DUMMY`].
    pub fn allocate_dummy(&mut self, tokens: u32) -> Result<TentativeDummyKv, KvError> {
        let _ = tokens;
        todo!()
    }

    /// Dummy transaction, commit: the dummy stays until `free_sequence(ReqId::DUMMY)`.
    pub fn commit_dummy(&mut self, dummy: TentativeDummyKv) {
        let _ = dummy;
        todo!()
    }

    /// Dummy transaction, rollback: frees exactly the dummy's slot and blocks.
    pub fn rollback_dummy(&mut self, dummy: TentativeDummyKv) {
        let _ = dummy;
        todo!()
    }

    /// Counters.
    pub fn counters(&self) -> &KvCounters {
        todo!()
    }

    /// Conservation and bookkeeping checks: used + free == total; every block is in
    /// exactly one of free list / LRU / referenced; reference counts equal the number of
    /// sequences holding the block; index slots held == sequences.
    pub fn check_invariants(&self) -> Result<(), KvInvariantViolation> {
        todo!()
    }
}

/// Chains block hashes into prefix keys: `key[i] = mix(key[i-1], hash[i])`.
pub fn chain_keys(block_hashes: &[u64]) -> impl Iterator<Item = u64> + '_ {
    let mut prev = 0x9E37_79B9_7F4A_7C15u64;
    block_hashes.iter().map(move |&h| {
        prev = mix(prev ^ h.rotate_left(17));
        prev
    })
}

/// splitmix64 finaliser: deterministic across runs and platforms.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
