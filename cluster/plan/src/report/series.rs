//! The time series of a server: KV usage, waiting queue, running requests, preemptions
//! and the balance ratio over time, sampled per iteration on each rank and decimated so
//! a run of any length keeps fewer than [`MAX_POINTS`] points per rank (and per server);
//! beside it, the balance sums over every iteration ([`BalanceTally`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use lockstep_actors::executor::IterationStats;

use super::balance::BalanceTally;
use super::schema::SeriesPoint;

/// A rank keeps at most this many samples: when it has this many, every other one is
/// dropped and the sampling stride doubles.
pub const MAX_POINTS: usize = 2000;

/// One rank's sample at the end of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankSample {
    /// The iteration (the same number on every rank of a server).
    pub iteration: u64,
    /// When it ended, on the driver's clock (ns).
    pub t_ns: u64,
    /// KV blocks held by sequences.
    pub kv_blocks_used: u32,
    /// KV blocks free.
    pub kv_blocks_free: u32,
    /// The server's waiting queue (replicated on every rank).
    pub waiting: u32,
    /// Real requests this rank scheduled this iteration.
    pub running: u32,
    /// Preemptions (MAX_UTILIZATION pauses) on this rank so far.
    pub preemptions: u64,
    /// The most tokens any rank of the server carried this iteration.
    #[serde(default)]
    pub max_rank_tokens: u32,
    /// Every rank's tokens together.
    #[serde(default)]
    pub total_rank_tokens: u64,
    /// The server's DP ranks.
    #[serde(default)]
    pub dp_ranks: u32,
}

/// What a rank's sampler hands its summary: the decimated samples and the balance sums
/// over every iteration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RankSeries {
    /// The samples kept, in iteration order.
    pub points: Vec<RankSample>,
    /// The balance sums.
    pub balance: BalanceTally,
}

/// Samples every `stride`-th iteration (an iteration number divisible by it), halving
/// the kept points and doubling the stride when full. The rule depends only on the
/// iteration number, so every rank of a server keeps the same iterations.
#[derive(Debug, Clone)]
pub struct Sampler {
    stride: u64,
    points: Vec<RankSample>,
    balance: BalanceTally,
}

impl Default for Sampler {
    fn default() -> Sampler {
        Sampler {
            stride: 1,
            points: Vec::new(),
            balance: BalanceTally::default(),
        }
    }
}

impl Sampler {
    /// Records the iteration `stats` describes, ended at `t_ns`, with the rank's
    /// preemptions so far.
    pub fn record(&mut self, stats: &IterationStats, t_ns: u64, preemptions: u64) {
        self.balance.record(stats, t_ns);
        if !stats.iteration.is_multiple_of(self.stride) {
            return;
        }
        self.points.push(RankSample {
            iteration: stats.iteration,
            t_ns,
            kv_blocks_used: stats.kv_blocks_used,
            kv_blocks_free: stats.kv_blocks_free,
            waiting: stats.waiting,
            running: stats.num_scheduled_requests,
            preemptions,
            max_rank_tokens: stats.max_rank_tokens,
            total_rank_tokens: stats.total_rank_tokens,
            dp_ranks: stats.dp_ranks,
        });
        if self.points.len() >= MAX_POINTS {
            self.stride *= 2;
            let stride = self.stride;
            self.points.retain(|p| p.iteration.is_multiple_of(stride));
        }
    }

    /// The samples kept, in iteration order, and the balance sums.
    pub fn into_points(self) -> RankSeries {
        RankSeries {
            points: self.points,
            balance: self.balance,
        }
    }
}

/// A server's series from its ranks' samples (in rank order): per sampled iteration,
/// rank 0's time, the KV blocks and running requests summed over ranks, the waiting
/// queue (replicated: the largest any rank saw), the preemptions summed, the balance
/// ratio (server-wide on every rank: the first rank's).
pub fn server_series<'a>(ranks: impl IntoIterator<Item = &'a [RankSample]>) -> Vec<SeriesPoint> {
    let mut by_iteration: BTreeMap<u64, (SeriesPoint, u64)> = BTreeMap::new();
    for samples in ranks {
        for s in samples {
            let (p, free) = by_iteration.entry(s.iteration).or_insert_with(|| {
                let tokens = IterationStats {
                    max_rank_tokens: s.max_rank_tokens,
                    total_rank_tokens: s.total_rank_tokens,
                    dp_ranks: s.dp_ranks,
                    ..IterationStats::default()
                };
                let point = SeriesPoint {
                    iteration: s.iteration,
                    t_s: s.t_ns as f64 / 1e9,
                    balance_ratio: tokens.balance_ratio(),
                    ..SeriesPoint::default()
                };
                (point, 0)
            });
            p.kv_blocks_used += u64::from(s.kv_blocks_used);
            *free += u64::from(s.kv_blocks_free);
            p.waiting = p.waiting.max(u64::from(s.waiting));
            p.running += u64::from(s.running);
            p.preemptions += s.preemptions;
        }
    }
    by_iteration
        .into_values()
        .map(|(mut p, free)| {
            let total = p.kv_blocks_used + free;
            if total > 0 {
                p.kv_usage = p.kv_blocks_used as f64 / total as f64;
            }
            p
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(iteration: u64) -> IterationStats {
        IterationStats {
            iteration,
            kv_blocks_used: 3,
            kv_blocks_free: 1,
            waiting: 5,
            num_scheduled_requests: 2,
            ..IterationStats::default()
        }
    }

    #[test]
    fn a_long_run_keeps_a_bounded_evenly_spaced_series() {
        let mut s = Sampler::default();
        for i in 0..1_000_000 {
            s.record(&stats(i), i * 10, 0);
        }
        let p = s.into_points().points;
        assert!(p.len() < MAX_POINTS, "{} points", p.len());
        assert!(p.len() >= MAX_POINTS / 4, "{} points", p.len());
        let stride = p[1].iteration - p[0].iteration;
        assert!(
            p.windows(2)
                .all(|w| w[1].iteration - w[0].iteration == stride)
        );
        assert_eq!(p[0].iteration, 0);
        assert!(p.last().unwrap().iteration > 1_000_000 - 2 * stride);
    }

    #[test]
    fn a_server_point_sums_the_ranks_and_takes_the_replicated_queue_once() {
        let mut a = Sampler::default();
        let mut b = Sampler::default();
        for i in 0..10 {
            a.record(&stats(i), i * 1_000_000_000, i);
            b.record(&stats(i), i * 1_000_000_000 + 7, 1);
        }
        let (a, b) = (a.into_points().points, b.into_points().points);
        let s = server_series([&a[..], &b[..]]);
        assert_eq!(s.len(), 10);
        assert_eq!(s[4].t_s, 4.0);
        assert_eq!(s[4].kv_blocks_used, 6);
        assert_eq!(s[4].kv_usage, 0.75);
        assert_eq!(s[4].waiting, 5);
        assert_eq!(s[4].running, 4);
        assert_eq!(s[4].preemptions, 5);
        // No tokens anywhere: no balance ratio.
        assert_eq!(s[4].balance_ratio, None);
    }

    #[test]
    fn a_server_point_carries_the_iterations_balance_ratio_and_the_tally_every_iteration() {
        let mut a = Sampler::default();
        for i in 0..3 {
            // Two ranks carried 30 and 10 tokens: mean 20 over max 30.
            let s = IterationStats {
                started_ns: i * 100,
                max_rank_tokens: 30,
                total_rank_tokens: 40,
                dp_ranks: 2,
                ..stats(i)
            };
            a.record(&s, i * 100 + 60, 0);
        }
        let series = a.into_points();
        let s = server_series([&series.points[..]]);
        assert_eq!(s[1].balance_ratio, Some(20.0 / 30.0));
        assert_eq!(series.balance.measured_iterations, 3);
        assert_eq!(series.balance.busy_ns, 180);
        // Each 60 ns iteration loses a third of its time to imbalance.
        assert_eq!(series.balance.imbalance_ns, 60);
    }
}
