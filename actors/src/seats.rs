//! Seats (mechanisms.md §7): one number, computed once, delivered to every seat-indexed
//! pool, and the two-sided validator.
//!
//! Guardrails: [`max_num_sequences`] is the only place seats are computed; pools receive
//! the number and never recompute it (except the legacy `seats.rederive` index pool).

use serde::{Deserialize, Serialize};

use crate::ids::Seat;

/// The inputs of [`max_num_sequences`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeatInputs {
    /// Pipeline stages.
    pub pp: u32,
    /// `max_batch_size`.
    pub max_batch_size: u32,
    /// Overlap scheduler on.
    pub overlap: bool,
    /// Attention DP on.
    pub attention_dp: bool,
    /// The server takes part in disaggregated serving (ctx or gen).
    pub disaggregated: bool,
    /// Hybrid / SSM model (the headroom does not apply).
    pub hybrid: bool,
}

/// §7: `seats = pp*B (+B headroom for ADP+overlap, pp=1, not hybrid)`, then at least
/// `2*pp*B` when disaggregated.
pub fn max_num_sequences(i: SeatInputs) -> u32 {
    let mut seats = i.pp * i.max_batch_size;
    let headroom = i.attention_dp && i.overlap && i.pp == 1 && !i.hybrid;
    if headroom {
        seats += i.max_batch_size;
    }
    if i.disaggregated {
        seats = seats.max(2 * i.pp * i.max_batch_size);
    }
    seats
}

/// The size the legacy KV index pool gives itself under `seats.rederive`.
pub fn legacy_rederived_index_pool(pp: u32, max_batch_size: u32) -> u32 {
    pp * max_batch_size + 1
}

/// Every pool indexed by sequence slot, with its admissible count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotPools {
    /// The seat (sequence slot) pool.
    pub seat_pool: u32,
    /// The KV cache manager's per-sequence index pool.
    pub kv_index_pool: u32,
    /// Sampler state slots.
    pub sampler_pool: u32,
    /// Speculative-decoding slots.
    pub draft_pool: u32,
}

impl SlotPools {
    /// All pools sized from `seats`.
    pub fn uniform(seats: u32) -> SlotPools {
        SlotPools {
            seat_pool: seats,
            kv_index_pool: seats,
            sampler_pool: seats,
            draft_pool: seats,
        }
    }

    /// `(name, size)` in a fixed order.
    pub fn entries(&self) -> [(&'static str, u32); 4] {
        [
            ("seat_pool", self.seat_pool),
            ("kv_index_pool", self.kv_index_pool),
            ("sampler_pool", self.sampler_pool),
            ("draft_pool", self.draft_pool),
        ]
    }
}

/// Which way a pool disagrees with the seats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum SkewDirection {
    /// Admitted requests defer silently for lack of a slot.
    #[error("pool too small: admitted requests would defer silently")]
    TooSmall,
    /// An admitted request cannot be seated and the rank dies mid-collective.
    #[error("pool too large: an admitted request could not be seated")]
    TooLarge,
}

/// A pool whose admissible count differs from the seats.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error(
    "seat skew: {pool} admits {pool_size} sequences but seats (max_num_sequences) = {seats}; \
     {direction}; every seat-indexed pool must be sized from the one seats number"
)]
pub struct SeatSkew {
    /// The pool's name.
    pub pool: String,
    /// Its admissible count.
    pub pool_size: u32,
    /// The seats.
    pub seats: u32,
    /// Too small or too large.
    pub direction: SkewDirection,
}

/// The two-sided startup check: every pool must admit exactly `seats`.
pub fn validate_pools(seats: u32, pools: &SlotPools) -> Result<(), SeatSkew> {
    for (name, size) in pools.entries() {
        if size != seats {
            return Err(SeatSkew {
                pool: name.to_string(),
                pool_size: size,
                seats,
                direction: if size < seats {
                    SkewDirection::TooSmall
                } else {
                    SkewDirection::TooLarge
                },
            });
        }
    }
    Ok(())
}

/// A pool of sequence slots: lowest free slot first, so runs are reproducible.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotPool {
    in_use: Vec<bool>,
    used: u32,
}

impl SlotPool {
    /// A pool of `size` slots.
    pub fn new(size: u32) -> SlotPool {
        SlotPool {
            in_use: vec![false; size as usize],
            used: 0,
        }
    }

    /// Capacity.
    pub fn size(&self) -> u32 {
        self.in_use.len() as u32
    }

    /// Slots held.
    pub fn used(&self) -> u32 {
        self.used
    }

    /// Slots free.
    pub fn free(&self) -> u32 {
        self.size() - self.used
    }

    /// Takes the lowest free slot, or `None` when full.
    pub fn try_take(&mut self) -> Option<Seat> {
        let i = self.in_use.iter().position(|u| !u)?;
        self.in_use[i] = true;
        self.used += 1;
        Some(Seat(i as u32))
    }

    /// Returns a slot. Returns `false` (and changes nothing) if it was not held.
    pub fn release(&mut self, seat: Seat) -> bool {
        match self.in_use.get_mut(seat.0 as usize) {
            Some(u) if *u => {
                *u = false;
                self.used -= 1;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(pp: u32, b: u32, overlap: bool, adp: bool, disagg: bool) -> SeatInputs {
        SeatInputs {
            pp,
            max_batch_size: b,
            overlap,
            attention_dp: adp,
            disaggregated: disagg,
            hybrid: false,
        }
    }

    #[test]
    fn seats_table_of_section_7() {
        let b = 8;
        let table = [
            (inputs(1, b, false, true, false), b),    // plain: overlap off
            (inputs(1, b, true, false, false), b),    // plain: no ADP
            (inputs(2, b, true, true, false), 2 * b), // pp>1: headroom closed
            (inputs(3, b, false, false, false), 3 * b), // pp>1
            (inputs(1, b, true, true, false), 2 * b), // ADP + overlap
            (inputs(1, b, false, true, true), 2 * b), // disaggregated
            (inputs(2, b, false, true, true), 4 * b), // disaggregated pp=2
            (inputs(1, b, true, true, true), 2 * b),  // ADP+overlap+disagg
        ];
        for (i, (inp, want)) in table.iter().enumerate() {
            assert_eq!(max_num_sequences(*inp), *want, "#{i}: {inp:?}");
        }
        let mut hybrid = inputs(1, b, true, true, false);
        hybrid.hybrid = true;
        assert_eq!(max_num_sequences(hybrid), b);
    }

    #[test]
    fn validator_is_two_sided_and_names_both_numbers() {
        let mut pools = SlotPools::uniform(16);
        assert!(validate_pools(16, &pools).is_ok());
        pools.kv_index_pool = 9;
        let e = validate_pools(16, &pools).unwrap_err();
        assert_eq!(e.direction, SkewDirection::TooSmall);
        let msg = e.to_string();
        assert!(
            msg.contains("kv_index_pool") && msg.contains("9") && msg.contains("16"),
            "{msg}"
        );
        pools.kv_index_pool = 17;
        let e = validate_pools(16, &pools).unwrap_err();
        assert_eq!(e.direction, SkewDirection::TooLarge);
        assert!(e.to_string().contains("17"));
    }

    #[test]
    fn slot_pool_hands_out_lowest_free_slot() {
        let mut p = SlotPool::new(2);
        assert_eq!(p.try_take(), Some(Seat(0)));
        assert_eq!(p.try_take(), Some(Seat(1)));
        assert_eq!(p.try_take(), None);
        assert!(p.release(Seat(0)));
        assert!(!p.release(Seat(0)));
        assert_eq!(p.try_take(), Some(Seat(0)));
        assert_eq!(p.used(), 2);
    }
}
