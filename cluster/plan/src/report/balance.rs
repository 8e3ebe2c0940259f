//! How evenly a server's ranks shared each forward (TensorRT-LLM's "ADP Balance
//! Strategy" metrics, mechanisms.md §9.1): the per-iteration balance ratio, its mean, and
//! the speed-of-light throughput the server would reach if every iteration were
//! perfectly balanced.
//!
//! Read from the per-iteration record every driver already produces
//! ([`IterationStats`]: every rank's tokens ride in the vote, so each rank knows the
//! whole server's) and the iteration's start (rank 0's fetch) and end on the driver's
//! clock; no driver computes anything of its own.

use serde::{Deserialize, Serialize};

use lockstep_actors::executor::{BalanceDecision, IterationStats};

use super::schema::BalanceReport;

/// One rank's running sums over every iteration (never decimated). Every rank's are the
/// server's figures; the server report reads rank 0's, whose clock the iteration's start
/// was taken on.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct BalanceTally {
    /// Iterations in which some rank carried tokens (those with a balance ratio).
    pub measured_iterations: u64,
    /// Σ balance ratio over those.
    pub ratio_sum: f64,
    /// Σ iteration time (fetch to end), ns.
    pub busy_ns: u64,
    /// Σ iteration time × (1 − balance ratio), ns: what perfect balance would save.
    pub imbalance_ns: u64,
    /// The first iteration's start, ns (`None` before any).
    pub first_start_ns: Option<u64>,
    /// The last iteration's end, ns.
    pub last_end_ns: u64,
    /// Iterations the balance policy held context work (context or batching wait).
    pub held_iterations: u64,
    /// Iterations whose held context work ran because `timeout_iters` passed.
    pub timed_out_iterations: u64,
}

impl BalanceTally {
    /// Adds the iteration `stats` describes, which ended at `end_ns`.
    pub fn record(&mut self, stats: &IterationStats, end_ns: u64) {
        let start = stats.started_ns.min(end_ns);
        let time = end_ns - start;
        self.first_start_ns.get_or_insert(start);
        self.last_end_ns = self.last_end_ns.max(end_ns);
        self.busy_ns += time;
        if let Some(ratio) = stats.balance_ratio() {
            self.measured_iterations += 1;
            self.ratio_sum += ratio;
            self.imbalance_ns += (time as f64 * (1.0 - ratio)).round() as u64;
        }
        match stats.balance {
            BalanceDecision::WaitForContext | BalanceDecision::WaitForBatching => {
                self.held_iterations += 1;
            }
            BalanceDecision::TimedOut => self.timed_out_iterations += 1,
            BalanceDecision::Off | BalanceDecision::Run => {}
        }
    }

    /// The same sums with every time mapped by `f` (the real drivers' wall time to
    /// modeled time).
    pub fn map_times(&mut self, f: impl Fn(u64) -> u64) {
        self.busy_ns = f(self.busy_ns);
        self.imbalance_ns = f(self.imbalance_ns);
        self.first_start_ns = self.first_start_ns.map(&f);
        self.last_end_ns = f(self.last_end_ns);
    }

    /// The server's figures, with the output tokens its ranks produced.
    ///
    /// Speed of light, after the blog: `sol_time = Σ time_i × ratio_i` and `sol_tps =
    /// elapsed / sol_time × actual_tps`. We take `elapsed` as the span from the first
    /// iteration's start to the last one's end and remove only what imbalance cost,
    /// `sol_time = elapsed − Σ time_i × (1 − ratio_i)`: the two agree when the server
    /// iterates without pause (the blog's offline runs), and a pause waiting for
    /// requests is not counted as imbalance.
    pub fn report(&self, output_tokens: u64) -> BalanceReport {
        let span_ns = self
            .first_start_ns
            .map_or(0, |first| self.last_end_ns.saturating_sub(first));
        let span_s = span_ns as f64 / 1e9;
        let sol_s = span_ns.saturating_sub(self.imbalance_ns) as f64 / 1e9;
        let output_tokens_per_s = if span_s > 0.0 {
            output_tokens as f64 / span_s
        } else {
            0.0
        };
        let sol_speedup = if sol_s > 0.0 { span_s / sol_s } else { 1.0 };
        BalanceReport {
            measured_iterations: self.measured_iterations,
            mean_ratio: (self.measured_iterations > 0)
                .then(|| self.ratio_sum / self.measured_iterations as f64),
            busy_time_s: self.busy_ns as f64 / 1e9,
            span_s,
            imbalance_time_s: self.imbalance_ns as f64 / 1e9,
            output_tokens_per_s,
            sol_output_tokens_per_s: output_tokens_per_s * sol_speedup,
            sol_speedup,
            sol_gap: 1.0 - 1.0 / sol_speedup,
            held_iterations: self.held_iterations,
            timed_out_iterations: self.timed_out_iterations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iteration(started_ns: u64, total: u64, max: u32, dp: u32) -> IterationStats {
        IterationStats {
            started_ns,
            total_rank_tokens: total,
            max_rank_tokens: max,
            dp_ranks: dp,
            ..IterationStats::default()
        }
    }

    #[test]
    fn speed_of_light_removes_exactly_the_imbalanced_share_of_each_iteration() {
        let mut t = BalanceTally::default();
        // 1 s at ratio 1/4 (one rank of four carries everything), then 1 s balanced.
        t.record(&iteration(0, 100, 100, 4), 1_000_000_000);
        t.record(&iteration(1_000_000_000, 40, 10, 4), 2_000_000_000);
        // An idle iteration: no tokens, no ratio, no imbalance.
        t.record(&iteration(2_000_000_000, 0, 0, 4), 3_000_000_000);
        let r = t.report(6_000);
        assert_eq!(r.measured_iterations, 2);
        assert_eq!(r.mean_ratio, Some((0.25 + 1.0) / 2.0));
        assert_eq!(r.span_s, 3.0);
        assert_eq!(r.imbalance_time_s, 0.75);
        // 3 s of span, 0.75 s of it imbalance: 2.25 s at the speed of light.
        assert_eq!(r.output_tokens_per_s, 2_000.0);
        assert!((r.sol_speedup - 3.0 / 2.25).abs() < 1e-12);
        assert!((r.sol_output_tokens_per_s - 2_000.0 * 3.0 / 2.25).abs() < 1e-9);
        assert!((r.sol_gap - 0.25).abs() < 1e-12);
    }

    #[test]
    fn nothing_measured_reports_no_ratio_and_no_gap() {
        let r = BalanceTally::default().report(0);
        assert_eq!(r.mean_ratio, None);
        assert_eq!((r.sol_speedup, r.sol_gap), (1.0, 0.0));
    }
}
