//! `lockstep overhead`: per-iteration control-plane overhead with the zero-cost backend,
//! next to a raw loop of the same collectives with payloads of the same size and no
//! scheduling (the floor).

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockstep_actors::config::{KvCacheConfig, ServerConfig};
use lockstep_actors::counts::RankCounts;
use lockstep_actors::executor::{
    BatchVote, CollectiveTag, FetchBatch, FetchMode, Phase, PrefixMatches, RankExecutor,
    RankResponses, RankState, Response, TransferStatus,
};
use lockstep_actors::group::deterministic_token;
use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;
use lockstep_gpu::ZeroCostBackend;
use lockstep_transport::{Collective, InProcessGroup};

use super::DriverError;
use super::device::{DeviceHandle, DeviceTiming};
use super::rank_loop::{FrontDoor, LoopOptions, Progress, run_rank_until};

/// The measurement: per-iteration wall times of the control plane and of the raw
/// collective loop, taken in interleaved rounds (control, floor, control, floor, ...) so
/// that slow drift of a shared machine hits both alike. The medians are the figures (a
/// preempted iteration is the machine's noise, not the control plane's cost); the means
/// are reported beside them.
#[derive(Debug, Clone, Copy)]
pub struct Overhead {
    /// Control plane: median wall time per iteration, µs.
    pub overhead_us: f64,
    /// Raw collectives: median wall time per iteration, µs.
    pub floor_us: f64,
    /// Control plane: mean wall time per iteration, µs.
    pub overhead_mean_us: f64,
    /// Raw collectives: mean wall time per iteration, µs.
    pub floor_mean_us: f64,
}

impl Overhead {
    /// `overhead / floor` (medians).
    pub fn ratio(&self) -> f64 {
        self.overhead_us / self.floor_us
    }

    fn of(mut control: Vec<Duration>, mut floor: Vec<Duration>) -> Overhead {
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

struct Preloaded {
    pending: Option<FetchBatch>,
}

impl FrontDoor for Preloaded {
    fn fetch(&mut self, _mode: FetchMode) -> FetchBatch {
        self.pending.take().unwrap_or_default()
    }
    fn deliver(&mut self, _responses: Vec<RankResponses>) {}
}

/// One rank's part of a control-plane run: the benchmark fleet preloaded at rank 0,
/// `warmup + iterations` iterations with the zero-cost backend, and this rank's
/// per-iteration times past the warmup.
fn control_run<C: Collective>(
    member: &mut C,
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Vec<Duration>, DriverError> {
    let rank = member.rank();
    let server = bench_server(dp, active);
    let sizes = server
        .derive(&Policy::FIXED)
        .map_err(|e| DriverError::Invalid(e.to_string()))?
        .sizes;
    // A fresh device per run: an overlapped run ends with one output never awaited.
    let device = DeviceHandle::start(
        rank,
        ZeroCostBackend,
        DeviceTiming { time_scale: 0.0 },
        Duration::from_secs(60),
    );
    let exec = RankExecutor::new(RankId(rank as u32), &server, &sizes, Policy::FIXED);
    let mut front = (rank == 0).then(|| Preloaded {
        pending: Some(FetchBatch {
            requests: bench_requests(dp, active),
            ..FetchBatch::default()
        }),
    });
    let run = run_rank_until(
        exec,
        member,
        front.as_mut().map(|f| f as &mut dyn FrontDoor),
        &device,
        &Arc::new(Progress::default()),
        &LoopOptions {
            max_iterations: Some(warmup + iterations),
            time_iterations: true,
            ..LoopOptions::default()
        },
    )?;
    Ok(run
        .iteration_times
        .into_iter()
        .skip(warmup as usize)
        .collect())
}

/// [`ROUNDS`] rounds, each running the control plane for `warmup + iterations / ROUNDS`
/// iterations on `dp` threads and then the raw collective loop for as many; reports
/// rank 0's per-iteration times past the warmup.
pub fn threads(
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Overhead, DriverError> {
    let per_round = iterations.div_ceil(ROUNDS).max(1);
    let control_round = || -> Result<Vec<Duration>, DriverError> {
        let handles: Vec<_> = InProcessGroup::new(dp as usize, Duration::from_secs(60))
            .into_iter()
            .map(|mut member| {
                std::thread::spawn(move || control_run(&mut member, dp, active, per_round, warmup))
            })
            .collect();
        let mut rank0 = None;
        for h in handles {
            let times = h
                .join()
                .map_err(|_| DriverError::Invalid("rank thread panicked".into()))??;
            rank0.get_or_insert(times);
        }
        Ok(rank0.unwrap_or_default())
    };
    let mut control = Vec::new();
    let mut floor = Vec::new();
    for _ in 0..ROUNDS {
        control.extend(control_round()?);
        floor.extend(raw_floor(dp, active, per_round, warmup)?);
    }
    Ok(Overhead::of(control, floor))
}

/// Payloads shaped like one iteration's, with `active` responses per rank whose values
/// take the encoded widths the control plane's take (bincode writes integers as varints):
/// request ids of a `dp * active` fleet (spread over the ranks as the router spreads them), vocabulary-sized tokens, hundreds of tokens
/// generated. A floor of smaller numbers would be cheaper to move than the real thing.
pub fn floor_payloads(rank: usize, dp: u32, active: u32) -> (RankState, RankResponses) {
    let state = RankState {
        rank: RankId(rank as u32),
        counts: RankCounts {
            live: active,
            routable: active,
            routable_prompt_tokens: u64::from(active) * 16,
            retiring: 0,
            schedulable: active,
            pad_schedulable: active,
        },
        responses_due: false,
    };
    let generated = 500;
    let responses = RankResponses {
        rank: RankId(rank as u32),
        responses: (0..u64::from(active))
            .map(|i| {
                let id = 1 + rank as u64 + u64::from(dp) * i;
                Response {
                    id: ReqId(id),
                    new_tokens: 1,
                    last_token: deterministic_token(id, generated),
                    generated,
                    finish: None,
                }
            })
            .collect(),
    };
    (state, responses)
}

/// One iteration's collectives with no scheduling between them.
pub fn raw_iteration<C: Collective>(
    c: &mut C,
    iteration: u64,
    state: &RankState,
    responses: &RankResponses,
    active: u32,
) -> Result<(), DriverError> {
    let rank = c.rank();
    let tag = |phase| CollectiveTag { iteration, phase };
    let err = |source| DriverError::Collective { rank, source };
    let _: Vec<RankState> = c.allgather(tag(Phase::Gather), state).map_err(err)?;
    let empty = FetchBatch::default();
    let _: FetchBatch = c
        .broadcast(tag(Phase::Fetch), 0, (rank == 0).then_some(&empty))
        .map_err(err)?;
    let _: Vec<PrefixMatches> = c
        .allgather(tag(Phase::PrefixMatch), &PrefixMatches::default())
        .map_err(err)?;
    let _ = c.allreduce_max(tag(Phase::PadIntent), 0).map_err(err)?;
    let _: Vec<BatchVote> = c
        .allgather(tag(Phase::Vote), &BatchVote { batch_size: active })
        .map_err(err)?;
    let _: Option<Vec<RankResponses>> =
        c.gather(tag(Phase::Responses), 0, responses).map_err(err)?;
    let _: Vec<TransferStatus> = c
        .allgather(tag(Phase::Transfers), &TransferStatus::default())
        .map_err(err)?;
    Ok(())
}

fn raw_floor(
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Vec<Duration>, DriverError> {
    let members = InProcessGroup::new(dp as usize, Duration::from_secs(60));
    let handles: Vec<_> = members
        .into_iter()
        .enumerate()
        .map(|(r, mut member)| {
            std::thread::spawn(move || {
                timed_raw_loop(&mut member, r, dp, active, iterations, warmup)
            })
        })
        .collect();
    let mut times = Vec::new();
    for h in handles {
        let t = h
            .join()
            .map_err(|_| DriverError::Invalid("rank thread panicked".into()))??;
        if times.is_empty() {
            times = t;
        }
    }
    Ok(times)
}

/// The raw loop on one rank: per-iteration times past the warmup.
fn timed_raw_loop<C: Collective>(
    member: &mut C,
    rank: usize,
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Vec<Duration>, DriverError> {
    let (state, responses) = floor_payloads(rank, dp, active);
    let mut times = Vec::with_capacity(iterations as usize);
    for i in 0..warmup + iterations {
        let started = Instant::now();
        raw_iteration(member, i, &state, &responses, active)?;
        if i >= warmup {
            times.push(started.elapsed());
        }
    }
    Ok(times)
}

/// One process of `lockstep overhead --driver mpi` (under mpirun, one process per rank):
/// the same two measurements over MPI. Rank 0 returns the figures.
#[cfg(feature = "mpi")]
pub fn mpi_rank(
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Option<Overhead>, DriverError> {
    use lockstep_transport::MpiMember;
    let mut member =
        MpiMember::init().map_err(|source| DriverError::Collective { rank: 0, source })?;
    let rank = member.rank();
    if member.size() != dp as usize {
        return Err(DriverError::Invalid(format!(
            "rank {rank}: MPI world size {} does not match --dp {dp}",
            member.size()
        )));
    }
    let per_round = iterations.div_ceil(ROUNDS).max(1);
    let mut control = Vec::new();
    let mut floor = Vec::new();
    for _ in 0..ROUNDS {
        control.extend(control_run(&mut member, dp, active, per_round, warmup)?);
        floor.extend(timed_raw_loop(
            &mut member,
            rank,
            dp,
            active,
            per_round,
            warmup,
        )?);
    }
    Ok((rank == 0).then(|| Overhead::of(control, floor)))
}
