//! `lockstep overhead`: per-iteration control-plane overhead with the zero-cost backend,
//! next to its floor: the same collectives of the same server, carrying the payloads the
//! control plane's last iteration carried, with nothing between them.
//!
//! The control run is the runtime's own rank host ([`run_rank`]) on a dp-rank server
//! preloaded with `active` decoding requests per rank. While it runs, a recording
//! collective keeps what each rank contributed to each collective of the iteration; the
//! floor replays exactly that sequence (same operations, same tags' phases, the same
//! bytes), so the ratio measures the scheduling work between collectives and nothing
//! else.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use lockstep_actors::config::{KvCacheConfig, ServerConfig};
use lockstep_actors::executor::{
    BatchVote, CollectiveTag, Exchange, FetchBatch, Phase, PrefixMatches, RankExecutor,
    RankResponses, RankState, ResponsesAndStatus,
};
use lockstep_actors::ids::RankId;
use lockstep_actors::policy::Policy;
use lockstep_actors::request::IngressItem;
use lockstep_actors::request::RequestSpec;
use lockstep_actors::vocab::PadIntent;
use lockstep_transport::{Collective, CollectiveError, InProcessGroup, exchange};

use crate::device::DeviceHandle;
use crate::rank_host::{RankOptions, RankPorts, run_rank};
use crate::watchdog::Progress;
use crate::{Endpoint, Envelope, Inbox, Net, NetError, Received, RuntimeError, WallClock};

/// The measurement: per-iteration wall times of the control plane and of its floor,
/// taken in interleaved rounds (control, floor, control, floor, ...) so that slow drift
/// of a shared machine hits both alike. The medians are the figures (a preempted
/// iteration is the machine's noise, not the control plane's cost); the means are
/// reported beside them.
#[derive(Debug, Clone, Copy)]
pub struct Overhead {
    /// Control plane: median wall time per iteration, µs.
    pub overhead_us: f64,
    /// Floor: median wall time per iteration, µs.
    pub floor_us: f64,
    /// Control plane: mean wall time per iteration, µs.
    pub overhead_mean_us: f64,
    /// Floor: mean wall time per iteration, µs.
    pub floor_mean_us: f64,
    /// Collectives per iteration (the server's schedule).
    pub collectives: usize,
}

impl Overhead {
    /// `overhead / floor` (medians).
    pub fn ratio(&self) -> f64 {
        self.overhead_us / self.floor_us
    }

    fn of(mut control: Vec<Duration>, mut floor: Vec<Duration>, collectives: usize) -> Overhead {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let median = |v: &mut Vec<Duration>| {
            v.sort_unstable();
            v.get(v.len() / 2).map_or(0.0, |&d| us(d))
        };
        let mean = |v: &[Duration]| v.iter().map(|&d| us(d)).sum::<f64>() / v.len().max(1) as f64;
        Overhead {
            overhead_mean_us: mean(&control),
            floor_mean_us: mean(&floor),
            overhead_us: median(&mut control),
            floor_us: median(&mut floor),
            collectives,
        }
    }
}

/// Interleaved rounds of a measurement.
pub const ROUNDS: u64 = 5;

/// Iterations run before timing starts, in every round.
pub const WARMUP: u64 = 200;

/// The server the benchmark runs: `dp` ranks, room for `active` decoding requests each.
pub fn bench_server(dp: u32, active: u32) -> ServerConfig {
    ServerConfig {
        name: "overhead".into(),
        tensor_parallel_size: i64::from(dp),
        enable_attention_dp: true,
        max_batch_size: i64::from(active),
        max_num_tokens: i64::from(active) * 64,
        kv_cache_config: KvCacheConfig {
            tokens_per_block: 64,
            max_tokens: i64::from(active) * 16_512,
            enable_block_reuse: false,
        },
        ..ServerConfig::default()
    }
}

/// Requests that stay active for the whole measurement.
pub fn bench_requests(dp: u32, active: u32) -> Vec<RequestSpec> {
    (1..=u64::from(dp * active))
        .map(|id| RequestSpec::new(id, 16, 16_384))
        .collect()
}

/// Rank 0's ingress: the benchmark's requests, once.
struct Preloaded(Vec<IngressItem>);

impl Inbox<IngressItem> for Preloaded {
    fn recv_until(&mut self, _deadline: Option<Instant>) -> Received<IngressItem> {
        match self.0.pop() {
            Some(item) => Received::Message(item),
            None => Received::TimedOut,
        }
    }
}

/// Responses go nowhere: there is no front.
struct Discard;

impl Net for Discard {
    fn send(&self, _to: Endpoint, _envelope: Envelope) -> Result<(), NetError> {
        Ok(())
    }
}

/// One contribution of the control plane's last iteration, typed as its phase's
/// collective carries it, so that the floor pays the same encoding and decoding.
#[derive(Debug, Clone)]
enum Call {
    States(RankState),
    Fetch(Option<FetchBatch>),
    PrefixMatches(PrefixMatches),
    PadIntent(u64),
    Votes(BatchVote),
    Responses(RankResponses),
    TransferStatus(ResponsesAndStatus),
}

impl Call {
    /// The typed contribution of `phase`, from its encoding (`None` if it does not
    /// decode as that phase's payload).
    fn of(phase: Phase, bytes: Option<&[u8]>) -> Option<Call> {
        fn decode<T: DeserializeOwned>(bytes: Option<&[u8]>) -> Option<T> {
            let (v, _) =
                bincode::serde::decode_from_slice(bytes?, bincode::config::standard()).ok()?;
            Some(v)
        }
        Some(match phase {
            Phase::Gather => Call::States(decode(bytes)?),
            Phase::Fetch => Call::Fetch(match bytes {
                Some(_) => Some(decode(bytes)?),
                None => None,
            }),
            Phase::PrefixMatch => Call::PrefixMatches(decode(bytes)?),
            Phase::PadIntent => Call::PadIntent(decode(bytes)?),
            Phase::Vote => Call::Votes(decode(bytes)?),
            Phase::Responses => Call::Responses(decode(bytes)?),
            Phase::Transfers => Call::TransferStatus(decode(bytes)?),
        })
    }

    /// The collective this contribution goes into, as the rank host runs it.
    fn exchange(&mut self, tag: CollectiveTag) -> Exchange<'_> {
        match self {
            Call::States(mine) => Exchange::States { tag, mine },
            Call::Fetch(mine) => Exchange::Fetch {
                tag,
                mine: mine.as_ref(),
            },
            Call::PrefixMatches(mine) => Exchange::PrefixMatches { tag, mine },
            Call::PadIntent(v) => Exchange::PadIntent {
                tag,
                mine: PadIntent::from_u64(*v),
            },
            Call::Votes(mine) => Exchange::Votes { tag, mine },
            Call::Responses(mine) => Exchange::Responses { tag, mine },
            Call::TransferStatus(both) => Exchange::TransferStatus {
                tag,
                mine: &both.status,
                responses: &mut both.responses,
            },
        }
    }
}

/// A collective that keeps the contributions of one iteration, `last` (encoding only
/// then, so the control run pays nothing for the recording before it).
struct Recording<'a, C> {
    inner: &'a mut C,
    last: u64,
    calls: Vec<(Phase, Call)>,
}

fn bytes_of<T: Serialize>(v: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(v, bincode::config::standard()).unwrap_or_default()
}

impl<C: Collective> Recording<'_, C> {
    fn record<T: Serialize>(&mut self, tag: CollectiveTag, mine: Option<&T>) {
        if tag.iteration != self.last {
            return;
        }
        let bytes = mine.map(bytes_of);
        if let Some(call) = Call::of(tag.phase, bytes.as_deref()) {
            self.calls.push((tag.phase, call));
        }
    }
}

impl<C: Collective> Collective for Recording<'_, C> {
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
        self.record(tag, Some(mine));
        self.inner.allgather(tag, mine)
    }

    fn broadcast<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        value: Option<&T>,
    ) -> Result<T, CollectiveError> {
        self.record(tag, value);
        self.inner.broadcast(tag, root, value)
    }

    fn allreduce_max(&mut self, tag: CollectiveTag, mine: u64) -> Result<u64, CollectiveError> {
        self.record(tag, Some(&mine));
        self.inner.allreduce_max(tag, mine)
    }

    fn gather<T: Serialize + DeserializeOwned>(
        &mut self,
        tag: CollectiveTag,
        root: usize,
        mine: &T,
    ) -> Result<Option<Vec<T>>, CollectiveError> {
        self.record(tag, Some(mine));
        self.inner.gather(tag, root, mine)
    }

    fn keep_alive(&mut self) {
        self.inner.keep_alive();
    }
}

/// A control run's per-iteration times and the calls of its last iteration.
type ControlRun = (Vec<Duration>, Vec<(Phase, Call)>);

/// One rank's control run: the benchmark fleet preloaded at rank 0, `warmup +
/// iterations` iterations with the zero-cost backend; this rank's per-iteration times
/// past the warmup, and the calls of its last iteration.
fn control_run<C: Collective>(
    member: &mut C,
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<ControlRun, RuntimeError> {
    let rank = member.rank();
    let server = bench_server(dp, active);
    let sizes = server
        .derive(&Policy::FIXED)
        .map_err(|e| RuntimeError::Plan(lockstep_plan::fleet::PlanError::Scenario(e.into())))?
        .sizes;
    let mut exec = RankExecutor::new(RankId(rank as u32), &server, &sizes, Policy::FIXED);
    let mut ingress = Preloaded(
        bench_requests(dp, active)
            .into_iter()
            .rev()
            .map(IngressItem::Request)
            .collect(),
    );
    // A fresh device per run: an overlapped run ends with one output never awaited.
    let mut device = DeviceHandle::zero_cost();
    let clock = WallClock::start();
    let progress = Progress::default();
    let mut recording = Recording {
        inner: member,
        last: warmup + iterations - 1,
        calls: Vec::new(),
    };
    let run = run_rank(
        &mut exec,
        &mut recording,
        RankPorts {
            server: 0,
            ingress: (rank == 0).then_some(&mut ingress as &mut dyn Inbox<IngressItem>),
            net: &Discard,
            transfers: None,
            device: &mut device,
            clock: &clock,
            progress: &progress,
            ordered: None,
        },
        &RankOptions {
            max_iterations: Some(warmup + iterations),
            time_iterations: true,
            ..RankOptions::default()
        },
    )?;
    let times = run
        .iteration_times
        .into_iter()
        .skip(warmup as usize)
        .collect();
    Ok((times, recording.calls))
}

/// The floor on one rank: the recorded contributions, run through the same collectives
/// as the rank host runs them (`exchange`), `warmup + iterations` times; the
/// per-iteration times past the warmup.
fn floor_run<C: Collective>(
    member: &mut C,
    calls: &[(Phase, Call)],
    iterations: u64,
    warmup: u64,
) -> Result<Vec<Duration>, RuntimeError> {
    let rank = member.rank();
    let err = |source| RuntimeError::Collective {
        server: 0,
        rank,
        source,
    };
    let mut calls = calls.to_vec();
    let mut times = Vec::with_capacity(iterations as usize);
    for i in 0..warmup + iterations {
        let started = Instant::now();
        for (phase, call) in &mut calls {
            let tag = CollectiveTag {
                iteration: i,
                phase: *phase,
            };
            exchange(member, call.exchange(tag)).map_err(err)?;
        }
        if i >= warmup {
            times.push(started.elapsed());
        }
    }
    Ok(times)
}

/// [`ROUNDS`] rounds, each running the control plane for `warmup + iterations /
/// ROUNDS` iterations on `dp` threads and then its floor for as many; rank 0's figures.
pub fn threads(
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Overhead, RuntimeError> {
    let per_round = iterations.div_ceil(ROUNDS).max(1);
    let mut control = Vec::new();
    let mut floor = Vec::new();
    let mut collectives = 0;
    for _ in 0..ROUNDS {
        let runs = on_threads(dp, |member| {
            control_run(member, dp, active, per_round, warmup)
        })?;
        let calls: Vec<Vec<(Phase, Call)>> = runs.iter().map(|(_, c)| c.clone()).collect();
        collectives = calls[0].len();
        control.extend(runs.into_iter().next().map(|r| r.0).unwrap_or_default());
        let floors = on_threads(dp, |member| {
            let calls = &calls[member.rank()];
            floor_run(member, calls, per_round, warmup)
        })?;
        floor.extend(floors.into_iter().next().unwrap_or_default());
    }
    Ok(Overhead::of(control, floor, collectives))
}

/// Runs `f` on `dp` threads, one in-process group member each; results in rank order.
fn on_threads<T: Send>(
    dp: u32,
    f: impl Fn(&mut lockstep_transport::InProcessMember) -> Result<T, RuntimeError> + Sync,
) -> Result<Vec<T>, RuntimeError> {
    let members = InProcessGroup::new(dp as usize, Duration::from_secs(60));
    std::thread::scope(|scope| {
        let handles: Vec<_> = members
            .into_iter()
            .map(|mut m| {
                let f = &f;
                scope.spawn(move || f(&mut m))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().map_err(|_| RuntimeError::Panicked {
                    what: "a benchmark rank".into(),
                })?
            })
            .collect()
    })
}

/// One process of `lockstep overhead --driver mpi` (under mpirun, one process per
/// rank): the same measurement over MPI. Rank 0 returns the figures.
#[cfg(feature = "mpi")]
pub fn mpi_rank(
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Option<Overhead>, RuntimeError> {
    use lockstep_transport::MpiMember;
    let mut member = MpiMember::init().map_err(RuntimeError::Mpi)?;
    let rank = member.rank();
    if member.size() != dp as usize {
        return Err(RuntimeError::WorldSize {
            world_rank: rank,
            world: member.size(),
            needed: dp as usize,
            layout: format!("--dp {dp}, no front process"),
        });
    }
    let per_round = iterations.div_ceil(ROUNDS).max(1);
    let mut control = Vec::new();
    let mut floor = Vec::new();
    let mut collectives = 0;
    for _ in 0..ROUNDS {
        let (times, calls) = control_run(&mut member, dp, active, per_round, warmup)?;
        collectives = calls.len();
        control.extend(times);
        floor.extend(floor_run(&mut member, &calls, per_round, warmup)?);
    }
    Ok((rank == 0).then(|| Overhead::of(control, floor, collectives)))
}
