//! The client-side records, indexed by request id. Workloads issue ids densely from 1,
//! so a vector indexed by id replaces a map lookup per response; iteration stays in id
//! order, as reports need.

use lockstep_actors::ids::ReqId;

/// A map from request id to `T` stored densely by id.
#[derive(Debug)]
pub(super) struct ById<T> {
    slots: Vec<Option<T>>,
}

impl<T> ById<T> {
    pub(super) fn new() -> ById<T> {
        ById { slots: Vec::new() }
    }

    /// Inserts or replaces the entry of `id`.
    pub(super) fn insert(&mut self, id: ReqId, value: T) {
        let i = usize::try_from(id.0).expect("request id fits in usize");
        if i >= self.slots.len() {
            self.slots.resize_with(i + 1, || None);
        }
        self.slots[i] = Some(value);
    }

    pub(super) fn get_mut(&mut self, id: &ReqId) -> Option<&mut T> {
        let i = usize::try_from(id.0).ok()?;
        self.slots.get_mut(i)?.as_mut()
    }

    /// Entries in id order.
    pub(super) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().flatten()
    }
}
