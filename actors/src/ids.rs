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
