//! Typed identifiers. Each indexes one kind of thing; none is interchangeable with another.

use serde::{Deserialize, Serialize};

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
        )]
        pub struct $name(pub $inner);

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}", self.0)
            }
        }
    };
}

id_type!(
    /// A request id. `ReqId::DUMMY` (0) is reserved for pad dummies (mechanisms.md §6);
    /// real requests start at 1.
    ReqId(u64)
);
id_type!(
    /// A DP rank inside one server, `0..dp`.
    RankId(u32)
);
id_type!(
    /// A sequence slot ("seat"): the index into every seat-indexed pool (§7).
    Seat(u32)
);
id_type!(
    /// A physical KV block in one rank's pool.
    BlockId(u32)
);
id_type!(
    /// A conversation id, used by the conversation router (§5).
    ConvId(u64)
);
id_type!(
    /// The number of a scheduled batch; outputs of the backend are matched to it.
    BatchNumber(u64)
);

impl ReqId {
    /// The id every pad dummy carries (§6).
    pub const DUMMY: ReqId = ReqId(0);
}

impl RankId {
    /// The rank as a slice index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A set of request ids that stays small for the dense ids clients use (1, 2, 3, …): a
/// bitmap below `DENSE_LIMIT`, a tree above. Every rank remembers every id it accepted
/// (to refuse duplicates), so over a long run this is most of a rank's memory per
/// request: one bit instead of a tree node.
#[derive(Debug, Clone, Default)]
pub struct ReqIdSet {
    dense: Vec<u64>,
    sparse: std::collections::BTreeSet<u64>,
}

impl ReqIdSet {
    /// Ids below this go in the bitmap (at most 2^27 bits = 16 MiB).
    pub const DENSE_LIMIT: u64 = 1 << 27;

    /// Adds `id`; whether it was new.
    pub fn insert(&mut self, id: ReqId) -> bool {
        if id.0 < Self::DENSE_LIMIT {
            let (word, bit) = ((id.0 / 64) as usize, id.0 % 64);
            if word >= self.dense.len() {
                self.dense.resize(word + 1, 0);
            }
            let new = self.dense[word] & (1 << bit) == 0;
            self.dense[word] |= 1 << bit;
            new
        } else {
            self.sparse.insert(id.0)
        }
    }

    /// Whether `id` is in the set.
    pub fn contains(&self, id: &ReqId) -> bool {
        if id.0 < Self::DENSE_LIMIT {
            self.dense
                .get((id.0 / 64) as usize)
                .is_some_and(|w| w & (1 << (id.0 % 64)) != 0)
        } else {
            self.sparse.contains(&id.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_ids_are_remembered_once() {
        let mut s = ReqIdSet::default();
        for id in [
            1,
            64,
            65,
            1_000,
            ReqIdSet::DENSE_LIMIT - 1,
            ReqIdSet::DENSE_LIMIT,
            u64::MAX,
        ] {
            assert!(!s.contains(&ReqId(id)));
            assert!(s.insert(ReqId(id)), "{id} is new");
            assert!(!s.insert(ReqId(id)), "{id} is known");
            assert!(s.contains(&ReqId(id)));
        }
        assert!(!s.contains(&ReqId(2)) && !s.contains(&ReqId(63)) && !s.contains(&ReqId(1 << 40)));
        // A million dense ids take a million bits.
        let mut d = ReqIdSet::default();
        for id in 1..=1_000_000 {
            d.insert(ReqId(id));
        }
        assert!(d.dense.len() * 8 <= 1_000_000 / 8 + 8);
    }
}
