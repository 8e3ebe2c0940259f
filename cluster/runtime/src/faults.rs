//! Fault injection for the real drivers' tests: a collective whose rank tags one gather
//! with the wrong phase, as a rank that reordered its collectives would. The transport
//! must answer with a tag mismatch naming both ranks, not a hang.

use serde::Serialize;
use serde::de::DeserializeOwned;

use lockstep_actors::executor::{CollectiveTag, Phase};
use lockstep_transport::{Collective, CollectiveError};

/// Wraps a collective: at iteration `at`, this rank's gather carries the vote's phase.
pub struct MisTagged<'a, C: ?Sized> {
    /// The real collective.
    pub inner: &'a mut C,
    /// The iteration whose gather is mis-tagged (`None`: no fault).
    pub at: Option<u64>,
}

impl<C: Collective + ?Sized> MisTagged<'_, C> {
    fn tag(&self, tag: CollectiveTag) -> CollectiveTag {
        if self.at == Some(tag.iteration) && tag.phase == Phase::Gather {
            CollectiveTag {
                phase: Phase::Vote,
                ..tag
            }
        } else {
            tag
        }
    }
}

impl<C: Collective + ?Sized> Collective for MisTagged<'_, C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn allgather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        mine: &T,
    ) -> Result<Vec<T>, CollectiveError> {
        let tag = self.tag(tag);
        self.inner.allgather(tag, mine)
    }

    fn broadcast<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        value: Option<&T>,
    ) -> Result<T, CollectiveError> {
        let tag = self.tag(tag);
        self.inner.broadcast(tag, root, value)
    }

    fn allreduce_max(&mut self, tag: CollectiveTag, mine: u64) -> Result<u64, CollectiveError> {
        let tag = self.tag(tag);
        self.inner.allreduce_max(tag, mine)
    }

    fn gather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        mine: &T,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        let tag = self.tag(tag);
        self.inner.gather(tag, root, mine)
    }

    fn keep_alive(&mut self) {
        self.inner.keep_alive();
    }
}
