//! The KV manager of one rank (mechanisms.md §4, §6, §7): a paged block pool, prefix reuse
//! by chained block hashes with LRU eviction of unreferenced blocks, the KV index pool
//! (one slot per sequence, sized from the seats), the dummy transaction, and counters.
//!
//! Inputs: `add_sequence`, `ensure_tokens`, `register_prefix`, `free_sequence`, the dummy
//! transaction (`allocate_dummy` then exactly one of `commit_dummy` / `rollback_dummy`).
//! Outputs: typed results ([`KvError`] for a refusal, [`Freed`] for what a free gave
//! back) and [`KvCounters`]. [`KvCommand`] is the same interface shaped as messages.
//!
//! Guardrails: used + free = total at all times; a failed call changes nothing; block
//! choice is deterministic (lowest free id first, LRU by a logical tick, never a hash-map
//! iteration order); the index pool size is received, never recomputed.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use serde::{Deserialize, Serialize};

use crate::ids::{BlockId, ReqId, Seat};
use crate::seats::SlotPool;

mod messages;
pub use messages::{KvCommand, KvReply};

#[cfg(test)]
mod tests;

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

/// What freeing a sequence gave back. Not an error either way: only the caller knows
/// whether the id should have held anything (a request that never got KV holds nothing).
#[must_use = "a caller that expects the id to hold KV must check it did"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freed {
    /// The sequence's index slot and its references to `blocks` blocks were released.
    Sequence {
        /// Block references dropped (a block shared with another sequence stays used).
        blocks: u32,
    },
    /// No sequence under that id: nothing changed.
    NothingHeld,
}

/// A dummy's tentative KV allocation (§6). Must be consumed by
/// [`KvManager::commit_dummy`] or [`KvManager::rollback_dummy`].
#[must_use = "a tentative dummy must be committed or rolled back"]
#[derive(Debug, PartialEq, Eq)]
pub struct TentativeDummyKv {
    _private: (),
}

impl TentativeDummyKv {
    /// Marks the token as consumed: it is dropped without the leak check.
    fn consume(self) {
        std::mem::forget(self);
    }
}

impl Drop for TentativeDummyKv {
    /// A tentative dummy dropped unconsumed would leak its slot and blocks past the
    /// iteration (the §6 defect); debug builds catch it here.
    fn drop(&mut self) {
        if cfg!(debug_assertions) && !std::thread::panicking() {
            panic!("TentativeDummyKv dropped without commit_dummy or rollback_dummy");
        }
    }
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

/// One sequence's holdings: its index slot and its blocks, in token order.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seq {
    slot: Seat,
    blocks: Vec<u32>,
}

/// A fixed, seedless hasher for integer keys (request ids, prefix keys): lookups are
/// cheap and, unlike `RandomState`, identical on every run; nothing iterates these maps
/// into a decision. One odd multiply: its low bits (the bucket) permute the key's low
/// bits, so consecutive ids never collide, and its high bits (the tag) mix all of them.
#[derive(Debug, Clone, Copy, Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// Unreferenced, unkeyed blocks as a bitset: `pop_first` takes the lowest id in amortized
/// O(1) (a cursor skips the leading empty words), `insert`/`remove`/`contains` are O(1).
#[derive(Debug, Clone)]
struct FreeList {
    words: Vec<u64>,
    len: usize,
    /// Every word before `first` is zero.
    first: usize,
}

impl FreeList {
    /// Every block of `0..n` free.
    fn full(n: u32) -> FreeList {
        let n = n as usize;
        let mut words = vec![u64::MAX; n.div_ceil(64)];
        if !n.is_multiple_of(64)
            && let Some(last) = words.last_mut()
        {
            *last = (1u64 << (n % 64)) - 1;
        }
        FreeList {
            words,
            len: n,
            first: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn contains(&self, b: u32) -> bool {
        let (w, bit) = (b as usize / 64, b % 64);
        self.words.get(w).is_some_and(|x| x & (1 << bit) != 0)
    }

    fn insert(&mut self, b: u32) {
        let (w, bit) = (b as usize / 64, b % 64);
        if self.words[w] & (1 << bit) == 0 {
            self.words[w] |= 1 << bit;
            self.len += 1;
            self.first = self.first.min(w);
        }
    }

    fn remove(&mut self, b: u32) {
        let (w, bit) = (b as usize / 64, b % 64);
        if self.words[w] & (1 << bit) != 0 {
            self.words[w] &= !(1 << bit);
            self.len -= 1;
        }
    }

    /// The lowest free block, taken.
    fn pop_first(&mut self) -> Option<u32> {
        while let Some(&x) = self.words.get(self.first) {
            if x != 0 {
                let bit = x.trailing_zeros();
                self.words[self.first] &= x - 1;
                self.len -= 1;
                return Some(self.first as u32 * 64 + bit);
            }
            self.first += 1;
        }
        None
    }
}

impl PartialEq for FreeList {
    /// The same blocks; the cursor is only a search hint.
    fn eq(&self, other: &FreeList) -> bool {
        self.words == other.words
    }
}

impl Eq for FreeList {}

/// Unreferenced, keyed blocks in release order: ticks only grow, so a queue appended at
/// the back is ordered by tick and its front is the least recently used. A block taken out
/// of the middle (a reuse hit) leaves a stale entry, recognised because the block's tick
/// no longer matches; stale entries are skipped on pop and compacted away when they
/// outnumber the live ones.
#[derive(Debug, Clone)]
struct Lru {
    queue: VecDeque<(u64, u32)>,
    /// Per block: its tick, while it is cached.
    tick_of: Vec<Option<u64>>,
    len: usize,
}

impl Lru {
    fn new(blocks: usize) -> Lru {
        Lru {
            queue: VecDeque::new(),
            tick_of: vec![None; blocks],
            len: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn contains(&self, b: u32) -> bool {
        self.tick_of[b as usize].is_some()
    }

    /// Appends `b` as the most recently used; `tick` exceeds every tick before it.
    fn push(&mut self, tick: u64, b: u32) {
        self.queue.push_back((tick, b));
        self.tick_of[b as usize] = Some(tick);
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        if self.tick_of[b as usize].take().is_some() {
            self.len -= 1;
            if self.queue.len() > 2 * self.len + 64 {
                let tick_of = &self.tick_of;
                self.queue.retain(|&(t, b)| tick_of[b as usize] == Some(t));
            }
        }
    }

    /// The least recently used block, taken.
    fn pop_first(&mut self) -> Option<u32> {
        while let Some((t, b)) = self.queue.pop_front() {
            if self.tick_of[b as usize] == Some(t) {
                self.tick_of[b as usize] = None;
                self.len -= 1;
                return Some(b);
            }
        }
        None
    }

    /// Live entries of the queue, each checked against its block's tick.
    fn live_entries(&self) -> usize {
        self.queue
            .iter()
            .filter(|&&(t, b)| self.tick_of.get(b as usize) == Some(&Some(t)))
            .count()
    }
}

impl PartialEq for Lru {
    /// The same blocks at the same ticks (which fixes the order); stale entries aside.
    fn eq(&self, other: &Lru) -> bool {
        self.len == other.len && self.tick_of == other.tick_of
    }
}

impl Eq for Lru {}

/// Everything a failed call must leave untouched (counters live apart so a refused
/// `add_sequence` can count its deferral while the pool compares equal).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pool {
    /// Unreferenced, unkeyed blocks; allocation takes the lowest id.
    free: FreeList,
    /// Unreferenced, keyed blocks by the logical tick they were released at: the first
    /// entry is the least recently used, so eviction order never depends on hashing.
    lru: Lru,
    /// Per block: how many sequences list it.
    refcount: Vec<u32>,
    /// Per block: the prefix key it is published under, if any.
    block_key: Vec<Option<u64>>,
    /// Prefix key -> block. Only looked up, never iterated into a decision. An entry is
    /// live while its block still carries that key (`block_key`); eviction only clears
    /// the block's side, leaving a stale entry (a random-access removal per evicted block
    /// cost more than the rest of the eviction), purged in bulk once stale entries
    /// outnumber live ones.
    key_to_block: KeyMap<u64, u32>,
    /// Stale entries in `key_to_block`.
    stale_keys: usize,
    /// Live sequences. Only looked up; the full check iterates it to count.
    seqs: KeyMap<ReqId, Seq>,
    /// The KV index pool (lowest free slot first).
    slots: SlotPool,
    /// Blocks with a non-zero reference count.
    used: u32,
    /// Logical clock for the LRU.
    tick: u64,
}

/// The KV manager of one rank.
#[derive(Debug, Clone)]
pub struct KvManager {
    config: KvConfig,
    pool: Pool,
    counters: KvCounters,
}

impl KvManager {
    /// A manager with every block free and every index slot free. A `tokens_per_block`
    /// of 0 is treated as 1 (it would otherwise divide by zero).
    pub fn new(config: KvConfig) -> KvManager {
        let config = KvConfig {
            tokens_per_block: config.tokens_per_block.max(1),
            ..config
        };
        let n = config.total_blocks as usize;
        KvManager {
            config,
            pool: Pool {
                free: FreeList::full(config.total_blocks),
                lru: Lru::new(n),
                refcount: vec![0; n],
                block_key: vec![None; n],
                key_to_block: KeyMap::default(),
                stale_keys: 0,
                seqs: KeyMap::default(),
                slots: SlotPool::new(config.index_pool_size),
                used: 0,
                tick: 0,
            },
            counters: KvCounters::default(),
        }
    }

    /// The configuration (with `tokens_per_block` at least 1).
    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    /// Tokens per block.
    pub fn tokens_per_block(&self) -> u32 {
        self.config.tokens_per_block
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> u32 {
        self.config.total_blocks
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_blocks(&self) -> u32 {
        self.pool.used
    }

    /// Blocks not referenced: truly free plus cached-evictable. `used + free == total`.
    pub fn free_blocks(&self) -> u32 {
        (self.pool.free.len() + self.pool.lru.len()) as u32
    }

    /// Unreferenced blocks that still hold a cached prefix (evictable).
    pub fn cached_blocks(&self) -> u32 {
        self.pool.lru.len() as u32
    }

    /// Index slots held / pool size.
    pub fn index_slots_used(&self) -> u32 {
        self.pool.slots.used()
    }

    /// The index pool size.
    pub fn index_pool_size(&self) -> u32 {
        self.pool.slots.size()
    }

    /// Whether `id` holds a sequence (and so an index slot).
    pub fn has_sequence(&self, id: ReqId) -> bool {
        self.pool.seqs.contains_key(&id)
    }

    /// The index slot `id` holds, if it is a sequence.
    pub fn slot_of(&self, id: ReqId) -> Option<Seat> {
        self.pool.seqs.get(&id).map(|s| s.slot)
    }

    /// The blocks `id` holds, in token order (empty if unknown).
    pub fn block_ids_of(&self, id: ReqId) -> Vec<BlockId> {
        self.pool
            .seqs
            .get(&id)
            .map(|s| s.blocks.iter().map(|&b| BlockId(b)).collect())
            .unwrap_or_default()
    }

    /// The blocks `id` holds, in token order, as block ids (empty if unknown): the
    /// block table a forward reads, without a copy.
    pub fn block_table(&self, id: ReqId) -> &[u32] {
        self.pool.seqs.get(&id).map_or(&[], |s| &s.blocks)
    }

    /// Blocks held by `id` (0 if unknown).
    pub fn blocks_of(&self, id: ReqId) -> u32 {
        self.pool.seqs.get(&id).map_or(0, |s| s.blocks.len() as u32)
    }

    /// `ceil(tokens / tokens_per_block)`.
    pub fn blocks_for_tokens(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.config.tokens_per_block)
    }

    /// Additional blocks `id` needs to hold `tokens` tokens (all of them if `id` has no
    /// sequence yet).
    pub fn blocks_needed(&self, id: ReqId, tokens: u32) -> u32 {
        self.blocks_for_tokens(tokens)
            .saturating_sub(self.blocks_of(id))
    }

    /// Longest cached prefix of the chained `block_hashes`, in tokens. Read-only (the
    /// KV-aware router calls it on every rank).
    pub fn longest_prefix_match(&self, block_hashes: &[u64]) -> u32 {
        if !self.config.enable_block_reuse {
            return 0;
        }
        let matched = chain_keys(block_hashes)
            .take_while(|&k| self.pool.block_of_key(k).is_some())
            .count() as u32;
        matched.saturating_mul(self.config.tokens_per_block)
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
        if self.has_sequence(id) {
            return Err(KvError::DuplicateSequence(id));
        }
        let Some(slot) = self.pool.slots.try_take() else {
            self.counters.deferrals_no_free_index_slot += 1;
            return Err(KvError::NoFreeIndexSlot {
                used: self.pool.slots.used(),
                size: self.pool.slots.size(),
            });
        };
        let mut blocks = Vec::new();
        if self.config.enable_block_reuse {
            // Cap so the last prompt token is always computed (its logits are needed).
            let cap = (prompt_len.saturating_sub(1) / self.config.tokens_per_block) as usize;
            for key in chain_keys(block_hashes).take(cap) {
                match self.pool.block_of_key(key) {
                    Some(b) => blocks.push(b),
                    None => break,
                }
            }
        }
        for &b in &blocks {
            self.pool.reference(b);
        }
        let matched = blocks.len() as u32;
        self.counters.reuse_hits += u64::from(matched);
        self.pool.seqs.insert(id, Seq { slot, blocks });
        Ok(matched * self.config.tokens_per_block)
    }

    /// Grows `id` to hold `tokens` tokens, allocating blocks (free list first, lowest id
    /// first; then evicting the least recently used cached block). Never shrinks.
    pub fn ensure_tokens(&mut self, id: ReqId, tokens: u32) -> Result<(), KvError> {
        let want = self.blocks_for_tokens(tokens);
        let free = self.free_blocks();
        let Some(seq) = self.pool.seqs.get_mut(&id) else {
            return Err(KvError::UnknownSequence(id));
        };
        let needed = want.saturating_sub(seq.blocks.len() as u32);
        // The common step: the sequence's last block still has room.
        if needed == 0 {
            return Ok(());
        }
        if needed > free {
            return Err(KvError::OutOfBlocks { needed, free });
        }
        // Out of the map while blocks are taken (that borrows the whole pool), then back.
        let mut blocks = std::mem::take(&mut seq.blocks);
        self.take_blocks_into(needed, &mut blocks);
        if let Some(seq) = self.pool.seqs.get_mut(&id) {
            seq.blocks = blocks;
        }
        Ok(())
    }

    /// Makes the full prompt blocks of `id` covered by `computed_tokens` reusable under
    /// their chained keys (idempotent; a key already cached keeps its block).
    pub fn register_prefix(
        &mut self,
        id: ReqId,
        block_hashes: &[u64],
        computed_tokens: u32,
    ) -> Result<(), KvError> {
        let Pool {
            seqs,
            key_to_block,
            block_key,
            stale_keys,
            ..
        } = &mut self.pool;
        let Some(seq) = seqs.get(&id) else {
            return Err(KvError::UnknownSequence(id));
        };
        if !self.config.enable_block_reuse {
            return Ok(());
        }
        let n = (computed_tokens / self.config.tokens_per_block) as usize;
        for (key, &b) in chain_keys(block_hashes).zip(&seq.blocks).take(n) {
            // One key per block and one block per key: an existing mapping on either side
            // wins, so a published block is never re-keyed under a reader's feet.
            if block_key[b as usize].is_some() {
                continue;
            }
            match key_to_block.entry(key) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(b);
                }
                std::collections::hash_map::Entry::Occupied(mut o) => {
                    if block_key[*o.get() as usize] == Some(key) {
                        continue;
                    }
                    // A stale entry is no mapping: take it over.
                    o.insert(b);
                    *stale_keys -= 1;
                }
            }
            block_key[b as usize] = Some(key);
        }
        Ok(())
    }

    /// Frees everything `id` holds: its index slot and block references. Blocks with a key
    /// and no other reference go to the LRU (most recent end); others to the free list.
    pub fn free_sequence(&mut self, id: ReqId) -> Freed {
        let Some(seq) = self.pool.seqs.remove(&id) else {
            return Freed::NothingHeld;
        };
        self.pool.slots.release(seq.slot);
        // Tail first: deeper prefix blocks get older ticks and are evicted before the
        // head blocks every longer match depends on.
        for &b in seq.blocks.iter().rev() {
            self.pool.release(b);
        }
        Freed::Sequence {
            blocks: seq.blocks.len() as u32,
        }
    }

    /// Dummy transaction, step 1: capacity pre-check (an index slot and the blocks for
    /// `tokens`), then a tentative allocation under [`ReqId::DUMMY`].
    pub fn allocate_dummy(&mut self, tokens: u32) -> Result<TentativeDummyKv, KvError> {
        if self.has_sequence(ReqId::DUMMY) {
            return Err(KvError::DuplicateSequence(ReqId::DUMMY));
        }
        // Check both resources before touching either, so a refusal changes nothing.
        if self.pool.slots.free() == 0 {
            return Err(KvError::NoFreeIndexSlot {
                used: self.pool.slots.used(),
                size: self.pool.slots.size(),
            });
        }
        let needed = self.blocks_for_tokens(tokens);
        self.check_blocks(needed)?;
        let Some(slot) = self.pool.slots.try_take() else {
            // Unreachable after the check above; refuse rather than panic.
            return Err(KvError::NoFreeIndexSlot {
                used: self.pool.slots.used(),
                size: self.pool.slots.size(),
            });
        };
        let mut blocks = Vec::with_capacity(needed as usize);
        self.take_blocks_into(needed, &mut blocks);
        self.pool.seqs.insert(ReqId::DUMMY, Seq { slot, blocks });
        self.counters.dummy_allocations += 1;
        Ok(TentativeDummyKv { _private: () })
    }

    /// Dummy transaction, commit: the dummy stays until `free_sequence(ReqId::DUMMY)`.
    pub fn commit_dummy(&mut self, dummy: TentativeDummyKv) {
        dummy.consume();
        self.counters.dummy_commits += 1;
    }

    /// Dummy transaction, rollback: frees exactly the dummy's slot and blocks. A cached
    /// block its allocation evicted stays evicted. `NothingHeld` only if the caller freed
    /// `ReqId::DUMMY` in between; then there was nothing to undo.
    pub fn rollback_dummy(&mut self, dummy: TentativeDummyKv) -> Freed {
        dummy.consume();
        self.counters.dummy_rollbacks += 1;
        self.free_sequence(ReqId::DUMMY)
    }

    /// Counters.
    pub fn counters(&self) -> &KvCounters {
        &self.counters
    }

    /// The O(1) checks run every iteration: used + free == total and index slots held ==
    /// sequences.
    pub fn check_conservation(&self) -> Result<(), KvInvariantViolation> {
        let total = self.total_blocks();
        if self.used_blocks() + self.free_blocks() != total {
            return Err(KvInvariantViolation {
                name: "blocks_conserved",
                detail: format!(
                    "used {} + free {} != total {total}",
                    self.used_blocks(),
                    self.free_blocks()
                ),
            });
        }
        if self.index_slots_used() as usize != self.pool.seqs.len() {
            return Err(KvInvariantViolation {
                name: "slots_match_sequences",
                detail: format!(
                    "{} index slots held for {} sequences",
                    self.index_slots_used(),
                    self.pool.seqs.len()
                ),
            });
        }
        Ok(())
    }

    /// The full structural check (O(blocks)): used + free == total; every block is in
    /// exactly one of free list / LRU / referenced; reference counts equal the number of
    /// sequences holding the block; index slots held == sequences.
    pub fn check_invariants(&self) -> Result<(), KvInvariantViolation> {
        let p = &self.pool;
        let total = self.total_blocks();
        let fail = |name: &'static str, detail: String| Err(KvInvariantViolation { name, detail });

        if self.used_blocks() + self.free_blocks() != total {
            return fail(
                "blocks_conserved",
                format!(
                    "used {} + free {} (list {}, lru {}) != total {total}",
                    self.used_blocks(),
                    self.free_blocks(),
                    p.free.len(),
                    p.lru.len()
                ),
            );
        }
        let mut listed = vec![0u32; total as usize];
        for (id, seq) in &p.seqs {
            for &b in &seq.blocks {
                match listed.get_mut(b as usize) {
                    Some(c) => *c += 1,
                    None => {
                        return fail(
                            "block_in_range",
                            format!("sequence {id} lists block {b} of {total}"),
                        );
                    }
                }
            }
        }
        let mut referenced = 0u32;
        let mut keyed = 0u32;
        for b in 0..total {
            let i = b as usize;
            let in_free = p.free.contains(b);
            // Whether the queue holds the entry this tick names is checked in bulk below.
            let in_lru = p.lru.contains(b);
            let refs = p.refcount[i];
            let places = u32::from(in_free) + u32::from(in_lru) + u32::from(refs > 0);
            if places != 1 {
                return fail(
                    "block_in_one_place",
                    format!("block {b}: free list {in_free}, lru {in_lru}, refcount {refs}"),
                );
            }
            if refs != listed[i] {
                return fail(
                    "refcount_matches_holders",
                    format!(
                        "block {b}: refcount {refs}, listed by {} sequences",
                        listed[i]
                    ),
                );
            }
            if in_free && p.block_key[i].is_some() {
                return fail(
                    "free_blocks_unkeyed",
                    format!("block {b} is free but keyed"),
                );
            }
            if in_lru && p.block_key[i].is_none() {
                return fail(
                    "lru_blocks_keyed",
                    format!("block {b} is cached without a key"),
                );
            }
            if let Some(k) = p.block_key[i]
                && p.key_to_block.get(&k) != Some(&b)
            {
                return fail(
                    "key_maps_back",
                    format!(
                        "block {b} has key {k:#x}, map gives {:?}",
                        p.key_to_block.get(&k)
                    ),
                );
            }
            keyed += u32::from(p.block_key[i].is_some());
            referenced += u32::from(refs > 0);
        }
        if referenced != p.used {
            return fail(
                "used_count",
                format!("{referenced} blocks referenced, used counter {}", p.used),
            );
        }
        let ticked = p.lru.tick_of.iter().flatten().count();
        let live = p.lru.live_entries();
        if p.lru.len() != ticked || live != ticked {
            return fail(
                "lru_ticks",
                format!(
                    "lru holds {}, {live} queued, {ticked} blocks carry a tick",
                    p.lru.len(),
                ),
            );
        }
        // Every keyed block maps back (above), so the map is a bijection on the live
        // entries exactly when they number the keyed blocks; the rest must be the stale
        // entries counted as blocks were evicted.
        let live = p
            .key_to_block
            .iter()
            .filter(|&(&k, &b)| p.block_key.get(b as usize).copied().flatten() == Some(k))
            .count();
        if live != keyed as usize || p.key_to_block.len() - live != p.stale_keys {
            return fail(
                "key_reverse",
                format!(
                    "{} keys map to blocks, {live} live for {keyed} keyed blocks, {} counted stale",
                    p.key_to_block.len(),
                    p.stale_keys
                ),
            );
        }
        if p.slots.used() as usize != p.seqs.len() {
            return fail(
                "index_slots_match_sequences",
                format!(
                    "{} index slots held, {} sequences",
                    p.slots.used(),
                    p.seqs.len()
                ),
            );
        }
        Ok(())
    }

    /// `OutOfBlocks` unless `needed` blocks are free or evictable.
    fn check_blocks(&self, needed: u32) -> Result<(), KvError> {
        let free = self.free_blocks();
        if needed > free {
            return Err(KvError::OutOfBlocks { needed, free });
        }
        Ok(())
    }

    /// Takes `n` blocks onto `out`; the caller has checked `n <= free_blocks()`.
    fn take_blocks_into(&mut self, n: u32, out: &mut Vec<u32>) {
        out.reserve(n as usize);
        for _ in 0..n {
            let b = if let Some(b) = self.pool.free.pop_first() {
                b
            } else if let Some(b) = self.pool.lru.pop_first() {
                // Evict: the block's cached prefix is forgotten before it is reused.
                let i = b as usize;
                if self.pool.block_key[i].take().is_some() {
                    self.pool.forget_key();
                }
                self.counters.evictions += 1;
                b
            } else {
                break;
            };
            self.pool.refcount[b as usize] = 1;
            self.pool.used += 1;
            self.counters.allocations += 1;
            out.push(b);
        }
    }
}

impl Pool {
    /// The block published under `key`, if the mapping is live.
    fn block_of_key(&self, key: u64) -> Option<u32> {
        let &b = self.key_to_block.get(&key)?;
        (self.block_key[b as usize] == Some(key)).then_some(b)
    }

    /// A block's key was just cleared: its map entry is stale. Purges stale entries once
    /// they outnumber the live ones (amortized O(1) per eviction, and sequential).
    fn forget_key(&mut self) {
        self.stale_keys += 1;
        if self.stale_keys > 1024 && self.stale_keys > self.key_to_block.len() / 2 {
            let block_key = &self.block_key;
            self.key_to_block
                .retain(|&k, &mut b| block_key[b as usize] == Some(k));
            self.stale_keys = 0;
        }
    }

    /// Adds a reference to `b`, pulling it out of the LRU or free list when it was idle.
    fn reference(&mut self, b: u32) {
        let i = b as usize;
        if self.refcount[i] == 0 {
            if self.lru.contains(b) {
                self.lru.remove(b);
            } else {
                self.free.remove(b);
            }
            self.used += 1;
        }
        self.refcount[i] += 1;
    }

    /// Drops a reference to `b`; at zero a keyed block becomes the most recently used
    /// cached block and an unkeyed one returns to the free list.
    fn release(&mut self, b: u32) {
        let i = b as usize;
        self.refcount[i] = self.refcount[i].saturating_sub(1);
        if self.refcount[i] > 0 {
            return;
        }
        self.used -= 1;
        if self.block_key[i].is_some() {
            self.tick += 1;
            self.lru.push(self.tick, b);
        } else {
            self.free.insert(b);
        }
    }
}

impl KvView for KvManager {
    fn tokens_per_block(&self) -> u32 {
        KvManager::tokens_per_block(self)
    }
    fn free_blocks(&self) -> u32 {
        KvManager::free_blocks(self)
    }
    fn has_sequence(&self, id: ReqId) -> bool {
        KvManager::has_sequence(self, id)
    }
    fn blocks_needed(&self, id: ReqId, tokens: u32) -> u32 {
        KvManager::blocks_needed(self, id, tokens)
    }
    fn blocks_of(&self, id: ReqId) -> u32 {
        KvManager::blocks_of(self, id)
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
