//! The client-side records, indexed by request id. Workloads issue ids densely from 1,
//! so a vector indexed by id replaces a map lookup per response; iteration stays in id
//! order, as reports need.

use lockstep_actors::ids::ReqId;

/// A map from request id to `T` stored densely by id.
#[derive(Debug)]
pub(crate) struct ById<T> {
    slots: Vec<Option<T>>,
}

impl<T> ById<T> {
    pub(crate) fn new() -> ById<T> {
        ById { slots: Vec::new() }
    }

    /// Inserts or replaces the entry of `id`.
    pub(crate) fn insert(&mut self, id: ReqId, value: T) {
        let i = usize::try_from(id.0).expect("request id fits in usize");
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(value);
    }

    pub(crate) fn get_mut(&mut self, id: &ReqId) -> Option<&mut T> {
        let i = usize::try_from(id.0).ok()?;
        self.slots.get_mut(i)?.as_mut()
    }

    /// Entries in id order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }

    /// Entries in id order, by value, in the slots' own allocation: std collects a
    /// `filter_map` over a vector's `into_iter` in place, where `flatten` allocates a
    /// second vector (a million 88-byte records held twice at the run's end).
    #[allow(clippy::filter_map_identity)]
    pub(crate) fn into_values(self) -> Vec<T> {
        self.slots.into_iter().filter_map(|slot| slot).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_come_out_in_id_order_in_the_slots_own_allocation() {
        let mut records = ById::new();
        for id in [3u64, 1, 2] {
            records.insert(ReqId(id), [id; 11]);
        }
        let slots = records.slots.as_ptr() as usize;
        let values = records.into_values();
        assert_eq!(values, vec![[1; 11], [2; 11], [3; 11]]);
        assert_eq!(
            values.as_ptr() as usize,
            slots,
            "copied, not collected in place"
        );
    }
}
