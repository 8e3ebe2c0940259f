//! The conversation router (§5): an LRU map conversation id → rank; a bound conversation
//! sticks while its rank is under `M`, otherwise round robin among ranks under `expected`
//! (mult 2, no cap), else the least loaded.
//!
//! The LRU is two `BTreeMap`s (conversation → (rank, tick) and tick → conversation) so
//! that eviction order is the same on every rank; no hash-map order is involved.

use std::collections::BTreeMap;

use super::Round;
use crate::ids::{ConvId, RankId};
use crate::request::RequestSpec;

/// The conversation router's replicated state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Conversations {
    /// Conversation → (rank, tick of its last use).
    bound: BTreeMap<ConvId, (RankId, u64)>,
    /// Tick of last use → conversation; the first entry is the least recently used.
    by_tick: BTreeMap<u64, ConvId>,
    /// The next tick to hand out.
    tick: u64,
    /// Entries kept.
    capacity: usize,
    /// The rank round robin tries first.
    next: usize,
}

impl Conversations {
    pub(super) fn new(capacity: usize) -> Conversations {
        Conversations {
            bound: BTreeMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
            capacity,
            next: 0,
        }
    }

    /// The bound rank, without refreshing the entry.
    pub(super) fn peek(&self, conversation: ConvId) -> Option<RankId> {
        self.bound.get(&conversation).map(|&(rank, _)| rank)
    }

    /// Binds (or refreshes) `conversation` to `rank` as most recently used, evicting the
    /// least recently used entries beyond capacity.
    fn bind(&mut self, conversation: ConvId, rank: RankId) {
        let tick = self.tick;
        // 2^64 binds never happen; wrapping keeps this free of panics regardless.
        self.tick = self.tick.wrapping_add(1);
        if let Some((_, old)) = self.bound.insert(conversation, (rank, tick)) {
            self.by_tick.remove(&old);
        }
        self.by_tick.insert(tick, conversation);
        while self.bound.len() > self.capacity {
            let Some((_, evicted)) = self.by_tick.pop_first() else {
                break;
            };
            self.bound.remove(&evicted);
        }
    }

    /// The next rank under `expected` from the round-robin pointer, which then moves past
    /// it; the least loaded rank when none is under `expected` (the pointer stays).
    fn round_robin(&mut self, round: &Round, expected: u32) -> usize {
        let dp = round.dp();
        for k in 0..dp {
            let r = (self.next + k) % dp;
            if round.counts[r] < expected {
                self.next = (r + 1) % dp;
                return r;
            }
        }
        round.least_loaded()
    }

    /// Routes every request the pins left, in FIFO order, updating `round`. `pinned` are
    /// the requests the pins placed, in placement order: their conversations are bound to
    /// the pinned rank first, since that is where their KV now lives.
    pub(super) fn route(
        &mut self,
        round: &mut Round,
        new: &[RequestSpec],
        pinned: &[usize],
        expected: u32,
        m: u32,
    ) {
        for &i in pinned {
            if let (Some(conversation), Some(rank)) = (new[i].conversation, round.ranks[i]) {
                self.bind(conversation, rank_id(rank));
            }
        }
        for i in round.unplaced() {
            let conversation = new[i].conversation;
            // Sticky while the bound rank is under M (§5), not merely under `expected`:
            // keeping a conversation's KV local is worth a less even spread.
            let sticky = conversation
                .and_then(|c| self.peek(c))
                .map(RankId::index)
                .filter(|&r| r < round.dp() && round.counts[r] < m);
            let rank = match sticky {
                Some(r) => r,
                None => self.round_robin(round, expected),
            };
            round.place(i, rank, &new[i]);
            if let Some(c) = conversation {
                self.bind(c, rank_id(rank));
            }
        }
    }
}

fn rank_id(index: usize) -> RankId {
    RankId(u32::try_from(index).unwrap_or(u32::MAX))
}
