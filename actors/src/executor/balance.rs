//! ADP balance (TensorRT-LLM's `attention_dp_config.enable_balance`; mechanisms.md §4.1):
//! whether this iteration may start context work, decided the same way on every rank.
//!
//! An iteration lasts as long as its slowest rank, so one rank prefilling while the
//! others decode holds the whole server to the prefill's time. The policy holds context
//! work back so that ranks prefill together:
//!
//! - **context wait** (`timeout_iters`): while some rank has context work and another
//!   has none, and every rank has generation work to keep it busy, no rank starts
//!   context; after `timeout_iters` iterations of waiting the held work runs anyway;
//! - **batching wait** (`batching_wait_iters`): once every rank has context work (and a
//!   free batch slot, and generation work), contexts are held `batching_wait_iters`
//!   iterations more so that more of them run in one forward, then run.
//!
//! The inputs are every rank's context and generation work at the gather plus what
//! routing just placed, which every rank knows alike, so every rank takes the same
//! decision without a collective of its own (TensorRT-LLM allgathers the counts its
//! schedulers produced; we decide before scheduling, from what the gather and routing
//! already gave every rank).

use serde::{Deserialize, Serialize};

use crate::config::AttentionDpConfig;
use crate::request::Request;

/// A rank's work as the balance decision sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BalanceLoad {
    /// Requests that still have a context phase to run (prefill pending or chunking).
    pub context: u32,
    /// Requests in generation (decoding, or KV received and ready to decode).
    pub generation: u32,
}

impl BalanceLoad {
    /// The load of one rank's resident requests (dummies are not work).
    pub fn of<'a>(resident: impl IntoIterator<Item = &'a Request>) -> BalanceLoad {
        let mut load = BalanceLoad::default();
        for r in resident {
            if r.is_dummy {
                continue;
            }
            if r.is_context() {
                load.context += 1;
            } else if r.is_generation() {
                load.generation += 1;
            }
        }
        load
    }
}

/// What the balance policy decided for one iteration (the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BalanceDecision {
    /// The policy is off: context work runs as scheduled.
    #[default]
    Off,
    /// Context work may run.
    Run,
    /// Context wait: some rank has no context work; context is held.
    WaitForContext,
    /// Context wait ended by `timeout_iters`: held context work runs although some rank
    /// still has none.
    TimedOut,
    /// Batching wait: every rank has context work; it is held to accumulate.
    WaitForBatching,
}

impl BalanceDecision {
    /// Whether this iteration's context work is held back.
    pub fn holds_context(self) -> bool {
        matches!(
            self,
            BalanceDecision::WaitForContext | BalanceDecision::WaitForBatching
        )
    }
}

/// The policy's state, replicated: every rank feeds it the same loads each iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdpBalance {
    timeout_iters: u32,
    batching_wait_iters: u32,
    max_batch_size: u32,
    /// Iterations context work has waited for every rank to have some.
    context_waited: u32,
    /// Iterations contexts have accumulated since every rank had some.
    batching_waited: u32,
}

impl AdpBalance {
    /// The policy of a server, or `None` when `enable_balance` is off. The iteration
    /// counts are checked non-negative by `ServerConfig::derive`.
    pub fn new(config: &AttentionDpConfig, max_batch_size: u32) -> Option<AdpBalance> {
        config.enable_balance.then(|| AdpBalance {
            timeout_iters: config.timeout_iters.clamp(0, i64::from(u32::MAX)) as u32,
            batching_wait_iters: config.batching_wait_iters.clamp(0, i64::from(u32::MAX)) as u32,
            max_batch_size,
            context_waited: 0,
            batching_waited: 0,
        })
    }

    /// This iteration's decision from every rank's load (in rank order).
    pub fn decide(&mut self, loads: &[BalanceLoad]) -> BalanceDecision {
        let every_rank_has_context = loads.iter().all(|l| l.context > 0);
        let any_rank_has_context = loads.iter().any(|l| l.context > 0);
        let every_rank_has_generation = loads.iter().all(|l| l.generation > 0);
        let every_rank_has_a_free_slot = loads.iter().all(|l| l.generation < self.max_batch_size);
        if every_rank_has_context && every_rank_has_a_free_slot {
            self.context_waited = 0;
            // Without generation work somewhere, holding would leave a rank idle.
            if !every_rank_has_generation {
                return BalanceDecision::Run;
            }
            if self.batching_waited < self.batching_wait_iters {
                self.batching_waited += 1;
                return BalanceDecision::WaitForBatching;
            }
            self.batching_waited = 0;
            return BalanceDecision::Run;
        }
        if !any_rank_has_context || !every_rank_has_generation {
            // Nothing is held (TensorRT-LLM's counter also runs here; ours starts when
            // context work first waits, so a wait is never cut short by idle iterations
            // before it).
            self.context_waited = 0;
            return BalanceDecision::Run;
        }
        self.context_waited += 1;
        if self.context_waited >= self.timeout_iters {
            // `timeout_iters` of 0 or 1 never held anything: that is no timeout.
            let held = self.context_waited > 1;
            self.context_waited = 0;
            return if held {
                BalanceDecision::TimedOut
            } else {
                BalanceDecision::Run
            };
        }
        BalanceDecision::WaitForContext
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(timeout: i64, batching: i64) -> AdpBalance {
        let config = AttentionDpConfig {
            enable_balance: true,
            timeout_iters: timeout,
            batching_wait_iters: batching,
            ..AttentionDpConfig::default()
        };
        AdpBalance::new(&config, 8).expect("enabled")
    }

    fn load(context: u32, generation: u32) -> BalanceLoad {
        BalanceLoad {
            context,
            generation,
        }
    }

    #[test]
    fn off_by_default_with_tensorrt_llm_defaults() {
        let d = AttentionDpConfig::default();
        assert!(!d.enable_balance);
        assert_eq!((d.timeout_iters, d.batching_wait_iters), (50, 10));
        assert!(AdpBalance::new(&d, 8).is_none());
    }

    #[test]
    fn context_waits_for_every_rank_until_the_timeout() {
        let mut p = policy(3, 0);
        let lopsided = [load(1, 4), load(0, 4)];
        // Held twice, released on the third iteration of waiting.
        assert_eq!(p.decide(&lopsided), BalanceDecision::WaitForContext);
        assert_eq!(p.decide(&lopsided), BalanceDecision::WaitForContext);
        assert_eq!(p.decide(&lopsided), BalanceDecision::TimedOut);
        // The count starts again.
        assert_eq!(p.decide(&lopsided), BalanceDecision::WaitForContext);
        // Every rank has context now: it runs at once (no batching wait).
        assert_eq!(p.decide(&[load(1, 4), load(2, 4)]), BalanceDecision::Run);
    }

    #[test]
    fn a_rank_without_generation_work_is_never_held_idle() {
        let mut p = policy(50, 10);
        assert_eq!(p.decide(&[load(1, 0), load(0, 4)]), BalanceDecision::Run);
        assert_eq!(p.decide(&[load(1, 0), load(1, 4)]), BalanceDecision::Run);
    }

    #[test]
    fn batching_wait_holds_then_runs_once_every_rank_has_context() {
        let mut p = policy(50, 2);
        let all = [load(1, 4), load(1, 4)];
        assert_eq!(p.decide(&all), BalanceDecision::WaitForBatching);
        assert_eq!(p.decide(&all), BalanceDecision::WaitForBatching);
        assert_eq!(p.decide(&all), BalanceDecision::Run);
        assert_eq!(p.decide(&all), BalanceDecision::WaitForBatching);
    }

    #[test]
    fn a_full_rank_keeps_the_context_wait_going() {
        let mut p = policy(2, 0);
        // Both have context, but rank 1's batch is full of generation work.
        let full = [load(1, 4), load(1, 8)];
        assert_eq!(p.decide(&full), BalanceDecision::WaitForContext);
        assert_eq!(p.decide(&full), BalanceDecision::TimedOut);
    }

    #[test]
    fn zero_or_one_iterations_never_hold_nor_time_out() {
        for timeout in [0, 1] {
            let mut p = policy(timeout, 0);
            for loads in [
                [load(1, 4), load(0, 4)],
                [load(1, 4), load(1, 4)],
                [load(0, 4), load(0, 4)],
                [load(1, 4), load(0, 4)],
            ] {
                assert_eq!(p.decide(&loads), BalanceDecision::Run);
            }
        }
    }
}
