//! A [`Collective`] for ranks that are threads of one process: a shared `Mutex` +
//! `Condvar` rendezvous. Used by the multi-threaded driver, the tests and the loom models.
//!
//! Each round is two-phase. *Filling*: every member deposits `(tag, op, bytes)` in its
//! slot; the last to arrive checks that all tags (and operations) agree and flips the
//! round to *draining*. *Draining*: every member copies out what it needs; the last to
//! read clears the slots and bumps the generation, which lets the next round fill. A
//! member that comes back for the next round while others are still reading waits, so no
//! rank can lap another and overwrite a slot that is still being read.
//!
//! Guardrails: nothing waits forever on real threads. A mismatch, a timeout or a dropped
//! member marks the group broken and wakes everyone; later calls fail fast with
//! [`CollectiveError::GroupBroken`]. Correctness never depends on a timeout firing
//! (under loom none ever does): the timeout only turns a hang into an error.

use std::time::Duration;

use lockstep_actors::executor::CollectiveTag;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::collective::{Collective, CollectiveError, decode, encode};
use crate::sync::{Arc, Condvar, Deadline, Mutex, thread};

/// Builds the members of an in-process group.
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// `size` members sharing one rendezvous, member `i` at index `i`; move each to its
    /// own thread. A member that waits longer than `timeout` in one collective gets
    /// [`CollectiveError::Timeout`] (never under loom).
    #[expect(
        clippy::new_ret_no_self,
        reason = "the group is only the rendezvous its members share; callers hold members"
    )]
    pub fn new(size: usize, timeout: Duration) -> Vec<InProcessMember> {
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                stage: Stage::Filling,
                slots: (0..size).map(|_| None).collect(),
                arrived: 0,
                read: vec![false; size],
                failure: None,
                broken: None,
                alive: 0,
            }),
            changed: Condvar::new(),
        });
        (0..size)
            .map(|rank| InProcessMember {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }
}

/// One rank's handle on an in-process group. `Send`: move it to the rank's thread.
/// Dropping it (the thread exited or panicked) breaks the group, so peers waiting for
/// this rank fail instead of hanging.
#[derive(Debug)]
pub struct InProcessMember {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    /// Notified on every stage change and when the group breaks.
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    /// Number of the round that is filling or draining.
    generation: u64,
    stage: Stage,
    /// This round's deposits, by rank.
    slots: Vec<Option<Deposit>>,
    arrived: usize,
    /// While draining: which ranks have copied out their result.
    read: Vec<bool>,
    /// A failure of the whole round (tag or operation mismatch), returned on every rank.
    failure: Option<CollectiveError>,
    broken: Option<Broken>,
    /// Bumped by [`Collective::keep_alive`]: a waiter whose deadline passed while a
    /// member kept the group alive waits on.
    alive: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Filling,
    Draining,
}

/// Which collective a deposit belongs to: a tag alone does not stop two ranks from
/// calling different operations with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Allgather,
    Broadcast { root: usize },
    AllreduceMax,
    Gather { root: usize },
}

#[derive(Debug)]
struct Deposit {
    tag: CollectiveTag,
    op: Op,
    /// The encoded contribution, or why this rank has none; peers still complete the
    /// round so one bad value cannot hang the group.
    payload: Payload,
}

/// Why the group stopped working.
#[derive(Debug, Clone)]
enum Broken {
    Mismatch(CollectiveError),
    OpMismatch(String),
    Timeout {
        generation: u64,
        rank: usize,
        missing: Vec<usize>,
    },
    Dropped {
        rank: usize,
        panicked: bool,
    },
}

impl Broken {
    fn describe(&self) -> String {
        match self {
            Broken::Mismatch(e) => format!("an earlier round failed: {e}"),
            Broken::OpMismatch(s) => s.clone(),
            Broken::Timeout {
                generation,
                rank,
                missing,
            } => {
                format!("rank {rank} timed out in round {generation} waiting for ranks {missing:?}")
            }
            Broken::Dropped { rank, panicked } => {
                let how = if *panicked { "panicked" } else { "exited" };
                format!("rank {rank} {how} and left the group")
            }
        }
    }
}

/// An encoded contribution, or why the rank has none.
type Payload = Result<Vec<u8>, String>;

/// Whose payloads a rank copies out of a completed round.
#[derive(Debug, Clone, Copy)]
enum Want {
    All,
    One(usize),
    Nothing,
}

impl InProcessMember {
    /// One rendezvous: deposit, wait for the round, copy out the wanted payloads.
    fn rendezvous(
        &mut self,
        tag: CollectiveTag,
        op: Op,
        payload: Payload,
        want: Want,
    ) -> Result<Vec<(usize, Payload)>, CollectiveError> {
        let shared = &*self.shared;
        let mut deadline = Deadline::after(shared.timeout);
        let mut st = shared.state.lock();
        let mut timed_out = false;
        let mut alive = st.alive;

        // Wait for the previous round to drain: its slots are still being read.
        loop {
            if let Some(b) = &st.broken {
                return Err(CollectiveError::GroupBroken(b.describe()));
            }
            if st.stage == Stage::Filling {
                break;
            }
            if timed_out && st.alive != alive {
                // A member said it is alive meanwhile: wait a full timeout more.
                alive = st.alive;
                deadline = Deadline::after(shared.timeout);
                timed_out = false;
                continue;
            } else if timed_out {
                let missing = (0..shared.size).filter(|&r| !st.read[r]).collect();
                return Err(self.time_out(&mut st, tag, &deadline, missing));
            }
            (st, timed_out) = shared.changed.wait_until(st, &deadline);
        }

        let generation = st.generation;
        debug_assert!(
            st.slots[self.rank].is_none(),
            "rank {} deposited twice",
            self.rank
        );
        st.slots[self.rank] = Some(Deposit { tag, op, payload });
        st.arrived += 1;
        if st.arrived == shared.size {
            complete_round(&mut st);
            shared.changed.notify_all();
        }

        // Wait for this round to complete. Completion is checked before breakage: a
        // round every rank reached is valid even if a member has since left.
        loop {
            if st.generation == generation && st.stage == Stage::Draining {
                break;
            }
            if let Some(b) = &st.broken {
                return Err(match b {
                    // Everyone stuck in the round that timed out reports the same missing
                    // ranks, not just the one whose clock fired first.
                    Broken::Timeout {
                        generation: g,
                        missing,
                        ..
                    } if *g == generation => CollectiveError::Timeout {
                        tag,
                        waited_ms: deadline.elapsed_ms(),
                        missing: missing.clone(),
                    },
                    other => CollectiveError::GroupBroken(other.describe()),
                });
            }
            if timed_out && st.alive != alive {
                alive = st.alive;
                deadline = Deadline::after(shared.timeout);
                timed_out = false;
                continue;
            } else if timed_out {
                let missing = (0..shared.size)
                    .filter(|&r| st.slots[r].is_none())
                    .collect();
                return Err(self.time_out(&mut st, tag, &deadline, missing));
            }
            (st, timed_out) = shared.changed.wait_until(st, &deadline);
        }

        let result = match &st.failure {
            Some(e) => Err(e.clone()),
            None => {
                let pick = |r: usize| {
                    let d = st.slots[r]
                        .as_ref()
                        .expect("a draining round has every slot");
                    (r, d.payload.clone())
                };
                Ok(match want {
                    Want::All => (0..shared.size).map(pick).collect(),
                    Want::One(r) if r < shared.size => vec![pick(r)],
                    Want::One(_) | Want::Nothing => Vec::new(),
                })
            }
        };
        st.read[self.rank] = true;
        if st.read.iter().all(|&r| r) {
            st.slots.iter_mut().for_each(|s| *s = None);
            st.read.iter_mut().for_each(|r| *r = false);
            st.arrived = 0;
            st.failure = None;
            st.generation += 1;
            st.stage = Stage::Filling;
            shared.changed.notify_all();
        }
        result
    }

    /// Marks the group broken by this rank's timeout and wakes everyone.
    fn time_out(
        &self,
        st: &mut State,
        tag: CollectiveTag,
        deadline: &Deadline,
        missing: Vec<usize>,
    ) -> CollectiveError {
        st.broken = Some(Broken::Timeout {
            generation: st.generation,
            rank: self.rank,
            missing: missing.clone(),
        });
        self.shared.changed.notify_all();
        CollectiveError::Timeout {
            tag,
            waited_ms: deadline.elapsed_ms(),
            missing,
        }
    }

    /// Decodes copied-out payloads in rank order; this rank's own encode failure is an
    /// `Encode` error, a peer's a `Decode` error naming it.
    fn decode_all<T: DeserializeOwned>(
        &self,
        payloads: Vec<(usize, Payload)>,
    ) -> Result<Vec<T>, CollectiveError> {
        payloads
            .into_iter()
            .map(|(r, p)| match p {
                Ok(bytes) => decode(r, &bytes),
                Err(m) if r == self.rank => Err(CollectiveError::Encode(m)),
                Err(m) => Err(CollectiveError::Decode {
                    rank: r,
                    message: format!("rank {r} sent no value: {m}"),
                }),
            })
            .collect()
    }

    fn check_root(&self, root: usize) -> Result<(), CollectiveError> {
        if root < self.shared.size {
            Ok(())
        } else {
            Err(CollectiveError::Encode(format!(
                "root {root} out of range for a group of {}",
                self.shared.size
            )))
        }
    }
}

/// The last arrival validates the round and opens it for reading.
fn complete_round(st: &mut State) {
    let first = st.slots[0].as_ref().expect("a full round has every slot");
    let (tag0, op0) = (first.tag, first.op);
    for (r, slot) in st.slots.iter().enumerate().skip(1) {
        let d = slot.as_ref().expect("a full round has every slot");
        if d.tag != tag0 {
            let e = CollectiveError::TagMismatch {
                rank_a: 0,
                tag_a: tag0,
                rank_b: r,
                tag_b: d.tag,
            };
            st.broken = Some(Broken::Mismatch(e.clone()));
            st.failure = Some(e);
            break;
        }
        if d.op != op0 {
            let m = format!(
                "under tag {tag0:?} rank 0 called {op0:?} but rank {r} called {:?}",
                d.op
            );
            st.broken = Some(Broken::OpMismatch(m.clone()));
            st.failure = Some(CollectiveError::GroupBroken(m));
            break;
        }
    }
    st.stage = Stage::Draining;
    st.read.iter_mut().for_each(|r| *r = false);
}

impl Drop for InProcessMember {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        if st.broken.is_none() {
            st.broken = Some(Broken::Dropped {
                rank: self.rank,
                panicked: thread::panicking(),
            });
        }
        drop(st);
        self.shared.changed.notify_all();
    }
}

impl Collective for InProcessMember {
    fn rank(&self) -> usize {
        self.rank
    }

    fn keep_alive(&mut self) {
        let mut st = self.shared.state.lock();
        st.alive = st.alive.wrapping_add(1);
        drop(st);
        self.shared.changed.notify_all();
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn allgather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        mine: &T,
    ) -> Result<Vec<T>, CollectiveError> {
        let payload = encode(mine).map_err(|e| e.to_string());
        let got = self.rendezvous(tag, Op::Allgather, payload, Want::All)?;
        self.decode_all(got)
    }

    fn broadcast<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        value: Option<&T>,
    ) -> Result<T, CollectiveError> {
        let payload = if self.rank != root {
            Ok(Vec::new())
        } else {
            match value {
                Some(v) => encode(v).map_err(|e| e.to_string()),
                None => Err(format!("broadcast root {root} passed no value")),
            }
        };
        let got = self.rendezvous(tag, Op::Broadcast { root }, payload, Want::One(root))?;
        // Every rank agreed on `root` (operations are checked), so all fail alike here.
        self.check_root(root)?;
        self.decode_all(got)?
            .pop()
            .ok_or_else(|| CollectiveError::GroupBroken("broadcast produced no value".into()))
    }

    fn allreduce_max(&mut self, tag: CollectiveTag, mine: u64) -> Result<u64, CollectiveError> {
        let payload = encode(&mine).map_err(|e| e.to_string());
        let got = self.rendezvous(tag, Op::AllreduceMax, payload, Want::All)?;
        let all: Vec<u64> = self.decode_all(got)?;
        Ok(all.into_iter().max().unwrap_or(mine))
    }

    fn gather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        mine: &T,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        let payload = encode(mine).map_err(|e| e.to_string());
        let own_failure = payload.as_ref().err().cloned();
        let want = if self.rank == root {
            Want::All
        } else {
            Want::Nothing
        };
        let got = self.rendezvous(tag, Op::Gather { root }, payload, want)?;
        self.check_root(root)?;
        if self.rank != root {
            // A non-root still learns that its own value did not go out.
            return match own_failure {
                Some(m) => Err(CollectiveError::Encode(m)),
                None => Ok(None),
            };
        }
        self.decode_all(got).map(Some)
    }
}
