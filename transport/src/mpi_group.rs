//! The MPI group (feature `mpi`): one process per rank under `mpirun`, collectives over
//! `MPI_COMM_WORLD` — or, when the world holds several servers, over each server's own
//! communicator split from it — through rsmpi; point-to-point messages between servers
//! (front door to a server's rank 0, transceiver to transceiver) go over the world. Every payload travels with its `(iteration, phase)`
//! tag; a rank whose tag differs gets `TagMismatch` naming both ranks and both tags
//! instead of corrupted data. MPI collectives cannot time out: a stuck peer is caught by
//! the driver's watchdog, which aborts the whole job.

use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::point_to_point::MatchedReceiveVec;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use serde::Serialize;
use serde::de::DeserializeOwned;

use lockstep_actors::executor::CollectiveTag;

use crate::collective::{Collective, CollectiveError};

/// The channel (MPI tag) of [`Collective::keep_alive`]'s heartbeats, which a rank's
/// watchdog thread drains.
pub const HEARTBEAT_CHANNEL: i32 = 199;

/// This process's membership of the MPI world.
pub struct MpiMember {
    /// The group the collectives run over: the world, or this process's server.
    comm: SimpleCommunicator,
    /// Point-to-point messages between servers.
    world: SimpleCommunicator,
    /// The world ranks of the group's members, in group order.
    group_world_ranks: Vec<usize>,
    // Dropped last: finalises MPI.
    _universe: mpi::environment::Universe,
}

impl MpiMember {
    /// Initialises MPI (once per process) with full thread support: a rank's
    /// transceiver and watchdog threads exchange point-to-point messages while its main
    /// thread is in a collective. A binary started without `mpirun` is a world of
    /// size 1.
    pub fn init() -> Result<MpiMember, CollectiveError> {
        let (universe, provided) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| CollectiveError::GroupBroken("MPI was already initialised".into()))?;
        if provided < mpi::Threading::Multiple {
            return Err(CollectiveError::GroupBroken(format!(
                "this MPI provides thread level {provided:?}; lockstep needs Multiple"
            )));
        }
        let world = universe.world();
        let size = world.size() as usize;
        Ok(MpiMember {
            comm: universe.world(),
            world,
            group_world_ranks: (0..size).collect(),
            _universe: universe,
        })
    }

    /// Collectives from now on run among the processes that passed the same `group`
    /// (a collective call on every process of the world), ranked in world order.
    pub fn split(self, group: usize) -> Result<MpiMember, CollectiveError> {
        let color = mpi::topology::Color::with_value(group as i32);
        let comm = self
            .world
            .split_by_color_with_key(color, self.world.rank())
            .ok_or_else(|| {
                CollectiveError::GroupBroken(format!("splitting the MPI world by group {group}"))
            })?;
        let me = self.world.rank();
        let mut ranks = vec![0i32; comm.size() as usize];
        comm.all_gather_into(&me, &mut ranks[..]);
        Ok(MpiMember {
            comm,
            group_world_ranks: ranks.into_iter().map(|r| r as usize).collect(),
            ..self
        })
    }

    /// The world ranks of this group's members, in group order.
    pub fn group_world_ranks(&self) -> &[usize] {
        &self.group_world_ranks
    }

    /// This process's rank in the world.
    pub fn world_rank(&self) -> usize {
        self.world.rank() as usize
    }

    /// Processes in the world.
    pub fn world_size(&self) -> usize {
        self.world.size() as usize
    }

    /// A handle for point-to-point messages over the world, usable while this member is
    /// borrowed for collectives (its own duplicate of the world communicator: a
    /// collective call on every process of the world).
    pub fn peers(&self) -> MpiPeers {
        MpiPeers {
            world: self.world.duplicate(),
        }
    }

    /// Aborts every process of the job (used by the watchdog path).
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

/// Point-to-point messages between processes of the world, on numbered channels (MPI
/// tags). Bytes only: callers encode. Drop every handle before its [`MpiMember`].
pub struct MpiPeers {
    world: SimpleCommunicator,
}

impl MpiPeers {
    /// A handle for the calling thread (MPI is initialised with full thread support, so
    /// any thread may send and receive over the world). Not `Send`: make one per thread.
    pub fn for_this_thread() -> MpiPeers {
        MpiPeers {
            world: SimpleCommunicator::world(),
        }
    }

    /// This process's rank in the world.
    pub fn world_rank(&self) -> usize {
        self.world.rank() as usize
    }

    /// Sends `bytes` to world rank `to` on `channel` (returns once MPI holds them).
    pub fn send_to(&self, to: usize, channel: i32, bytes: &[u8]) {
        self.world
            .process_at_rank(to as i32)
            .send_with_tag(bytes, channel);
    }

    /// A message waiting on `channel`, from any process: its sender's world rank and its
    /// bytes.
    pub fn try_receive(&self, channel: i32) -> Option<(usize, Vec<u8>)> {
        let probed = self
            .world
            .any_process()
            .immediate_matched_probe_with_tag(channel)?;
        let (bytes, status) = probed.matched_receive_vec::<u8>();
        Some((status.source_rank() as usize, bytes))
    }
}

fn encode<T: Serialize>(tag: CollectiveTag, value: &T) -> Result<Vec<u8>, CollectiveError> {
    bincode::serde::encode_to_vec((tag, value), bincode::config::standard())
        .map_err(|e| CollectiveError::Encode(e.to_string()))
}

fn decode<T: DeserializeOwned>(
    rank: usize,
    bytes: &[u8],
) -> Result<(CollectiveTag, T), CollectiveError> {
    let ((tag, value), used): ((CollectiveTag, T), usize) =
        bincode::serde::decode_from_slice(bytes, bincode::config::standard()).map_err(|e| {
            CollectiveError::Decode {
                rank,
                message: e.to_string(),
            }
        })?;
    if used != bytes.len() {
        return Err(CollectiveError::Decode {
            rank,
            message: format!("{} trailing bytes", bytes.len() - used),
        });
    }
    Ok((tag, value))
}

/// Displacements of each rank's bytes and a buffer for all of them.
fn layout(lens: &[i32]) -> (Vec<i32>, Vec<u8>) {
    let displs: Vec<i32> = lens
        .iter()
        .scan(0i32, |acc, &l| {
            let d = *acc;
            *acc += l;
            Some(d)
        })
        .collect();
    let total: i32 = lens.iter().sum();
    (displs, vec![0u8; total as usize])
}

impl MpiMember {
    fn allgather_bytes(&self, mine: &[u8]) -> Vec<Vec<u8>> {
        let size = self.comm.size() as usize;
        let len = mine.len() as i32;
        let mut lens = vec![0i32; size];
        self.comm.all_gather_into(&len, &mut lens[..]);
        let (displs, mut buf) = layout(&lens);
        {
            let mut partition = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
            self.comm.all_gather_varcount_into(mine, &mut partition);
        }
        lens.iter()
            .zip(&displs)
            .map(|(&l, &d)| buf[d as usize..(d + l) as usize].to_vec())
            .collect()
    }

    fn check_tags(
        &self,
        mine: CollectiveTag,
        tags: impl IntoIterator<Item = (usize, CollectiveTag)>,
    ) -> Result<(), CollectiveError> {
        let me = self.comm.rank() as usize;
        for (rank, tag) in tags {
            if tag != mine {
                return Err(CollectiveError::TagMismatch {
                    rank_a: me,
                    tag_a: mine,
                    rank_b: rank,
                    tag_b: tag,
                });
            }
        }
        Ok(())
    }
}

impl Collective for MpiMember {
    fn rank(&self) -> usize {
        self.comm.rank() as usize
    }

    fn keep_alive(&mut self) {
        let me = self.world.rank() as usize;
        for &peer in &self.group_world_ranks {
            if peer != me {
                self.world
                    .process_at_rank(peer as i32)
                    .send_with_tag(&[0u8][..], HEARTBEAT_CHANNEL);
            }
        }
    }

    fn size(&self) -> usize {
        self.comm.size() as usize
    }

    fn allgather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        mine: &T,
    ) -> Result<Vec<T>, CollectiveError> {
        let bytes = encode(tag, mine)?;
        let all = self.allgather_bytes(&bytes);
        let mut out = Vec::with_capacity(all.len());
        let mut tags = Vec::with_capacity(all.len());
        for (rank, b) in all.iter().enumerate() {
            let (t, v) = decode::<T>(rank, b)?;
            tags.push((rank, t));
            out.push(v);
        }
        self.check_tags(tag, tags)?;
        Ok(out)
    }

    fn broadcast<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        value: Option<&T>,
    ) -> Result<T, CollectiveError> {
        let is_root = self.rank() == root;
        let mut bytes = match (is_root, value) {
            (true, Some(v)) => encode(tag, v)?,
            (true, None) => Vec::new(),
            (false, _) => Vec::new(),
        };
        // Count first, then payload.
        let mut len = bytes.len() as u64;
        let root_process = self.comm.process_at_rank(root as i32);
        root_process.broadcast_into(&mut len);
        if !is_root {
            bytes = vec![0u8; len as usize];
        }
        root_process.broadcast_into(&mut bytes[..]);
        if len == 0 {
            return Err(CollectiveError::Encode(format!(
                "broadcast root {root} had no value at {tag:?}"
            )));
        }
        let (t, v) = decode::<T>(root, &bytes)?;
        self.check_tags(tag, [(root, t)])?;
        Ok(v)
    }

    fn allreduce_max(&mut self, tag: CollectiveTag, mine: u64) -> Result<u64, CollectiveError> {
        // Tags travel by allgather so a mismatch names the ranks; the reduction is MPI's.
        let tags: Vec<CollectiveTag> = self.allgather(tag, &tag)?;
        let _ = tags;
        let mut out = 0u64;
        self.comm
            .all_reduce_into(&mine, &mut out, SystemOperation::max());
        Ok(out)
    }

    fn gather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        mine: &T,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        let bytes = encode(tag, mine)?;
        let size = self.size();
        let root_process = self.comm.process_at_rank(root as i32);
        let len = bytes.len() as i32;
        if self.rank() != root {
            root_process.gather_into(&len);
            root_process.gather_varcount_into(&bytes[..]);
            return Ok(None);
        }
        let mut lens = vec![0i32; size];
        root_process.gather_into_root(&len, &mut lens[..]);
        let (displs, mut buf) = layout(&lens);
        {
            let mut partition = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
            root_process.gather_varcount_into_root(&bytes[..], &mut partition);
        }
        let mut out = Vec::with_capacity(size);
        let mut tags = Vec::with_capacity(size);
        for (rank, (&l, &d)) in lens.iter().zip(&displs).enumerate() {
            let (t, v) = decode::<T>(rank, &buf[d as usize..(d + l) as usize])?;
            tags.push((rank, t));
            out.push(v);
        }
        self.check_tags(tag, tags)?;
        Ok(Some(out))
    }
}
