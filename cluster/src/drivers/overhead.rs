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
use lockstep_actors::ids::{RankId, ReqId};
use lockstep_actors::policy::Policy;
use lockstep_actors::request::RequestSpec;
use lockstep_gpu::ZeroCostBackend;
use lockstep_transport::{Collective, InProcessGroup};

use super::DriverError;
use super::device::{DeviceHandle, DeviceTiming};
use super::rank_loop::{FrontDoor, LoopOptions, Progress, run_rank_until};

/// The measurement.
#[derive(Debug, Clone, Copy)]
pub struct Overhead {
    /// Control plane: wall time per iteration, µs.
    pub overhead_us: f64,
    /// Raw collectives: wall time per iteration, µs.
    pub floor_us: f64,
}

impl Overhead {
    /// `overhead / floor`.
    pub fn ratio(&self) -> f64 {
        self.overhead_us / self.floor_us
    }
}

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
    fn deliver(&mut self, _responses: Vec<Response>) {}
}

/// Runs the control plane for `warmup + iterations` iterations on `dp` threads and the raw
/// collective loop for as many, and reports both per-iteration times.
pub fn threads(
    dp: u32,
    active: u32,
    iterations: u64,
    warmup: u64,
) -> Result<Overhead, DriverError> {
    let server = bench_server(dp, active);
    let sizes = server
        .derive(&Policy::FIXED)
        .map_err(|e| DriverError::Invalid(e.to_string()))?
        .sizes;
    let timed = |total: u64| -> Result<Duration, DriverError> {
        let members = InProcessGroup::new(dp as usize, Duration::from_secs(60));
        let start = Instant::now();
        let handles: Vec<_> = members
            .into_iter()
            .enumerate()
            .map(|(r, mut member)| {
                let exec = RankExecutor::new(RankId(r as u32), &server, &sizes, Policy::FIXED);
                let mut front = (r == 0).then(|| Preloaded {
                    pending: Some(FetchBatch {
                        requests: bench_requests(dp, active),
                        ..FetchBatch::default()
                    }),
                });
                std::thread::spawn(move || {
                    let device = DeviceHandle::start(
                        r,
                        ZeroCostBackend,
                        DeviceTiming { time_scale: 0.0 },
                        Duration::from_secs(60),
                    );
                    run_rank_until(
                        exec,
                        &mut member,
                        front.as_mut().map(|f| f as &mut dyn FrontDoor),
                        &device,
                        &Arc::new(Progress::default()),
                        &LoopOptions {
                            max_iterations: Some(total),
                            mismatch_tag_at: None,
                        },
                    )
                    .map(|run| run.iterations)
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| DriverError::Invalid("rank thread panicked".into()))??;
        }
        Ok(start.elapsed())
    };
    let short = timed(warmup)?;
    let long = timed(warmup + iterations)?;
    let overhead_us = (long.saturating_sub(short)).as_secs_f64() * 1e6 / iterations as f64;
    let floor_us = raw_floor(dp, active, iterations, warmup)?;
    Ok(Overhead {
        overhead_us,
        floor_us,
    })
}

/// Payloads shaped like one iteration's, with `active` responses per rank.
pub fn floor_payloads(rank: usize, active: u32) -> (RankState, RankResponses) {
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
    };
    let responses = RankResponses {
        rank: RankId(rank as u32),
        responses: (0..active)
            .map(|i| Response {
                id: ReqId(u64::from(i) + 1),
                new_tokens: 1,
                last_token: 17,
                generated: 100,
                finish: None,
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

fn raw_floor(dp: u32, active: u32, iterations: u64, warmup: u64) -> Result<f64, DriverError> {
    let members = InProcessGroup::new(dp as usize, Duration::from_secs(60));
    let handles: Vec<_> = members
        .into_iter()
        .enumerate()
        .map(|(r, mut member)| {
            std::thread::spawn(move || -> Result<Duration, DriverError> {
                let (state, responses) = floor_payloads(r, active);
                for i in 0..warmup {
                    raw_iteration(&mut member, i, &state, &responses, active)?;
                }
                let start = Instant::now();
                for i in warmup..warmup + iterations {
                    raw_iteration(&mut member, i, &state, &responses, active)?;
                }
                Ok(start.elapsed())
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    for h in handles {
        let d = h
            .join()
            .map_err(|_| DriverError::Invalid("rank thread panicked".into()))??;
        worst = worst.max(d);
    }
    Ok(worst.as_secs_f64() * 1e6 / iterations as f64)
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
    let server = bench_server(dp, active);
    let sizes = server
        .derive(&Policy::FIXED)
        .map_err(|e| DriverError::Invalid(e.to_string()))?
        .sizes;
    let control = |total: u64, member: &mut MpiMember| -> Result<Duration, DriverError> {
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
        let start = Instant::now();
        run_rank_until(
            exec,
            member,
            front.as_mut().map(|f| f as &mut dyn FrontDoor),
            &device,
            &Arc::new(Progress::default()),
            &LoopOptions {
                max_iterations: Some(total),
                mismatch_tag_at: None,
            },
        )?;
        Ok(start.elapsed())
    };
    let short = control(warmup, &mut member)?;
    let long = control(warmup + iterations, &mut member)?;
    let (state, responses) = floor_payloads(rank, active);
    for i in 0..warmup {
        raw_iteration(&mut member, i, &state, &responses, active)?;
    }
    let start = Instant::now();
    for i in warmup..warmup + iterations {
        raw_iteration(&mut member, i, &state, &responses, active)?;
    }
    let floor = start.elapsed();
    Ok((rank == 0).then(|| Overhead {
        overhead_us: long.saturating_sub(short).as_secs_f64() * 1e6 / iterations as f64,
        floor_us: floor.as_secs_f64() * 1e6 / iterations as f64,
    }))
}
