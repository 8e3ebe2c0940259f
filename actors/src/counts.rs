//! The three counts per rank (mechanisms.md §2), each defined once.
//!
//! Guardrails: every caller (router load, admission window, idle decision, padding need,
//! invariants, logs) receives these numbers from [`RankCounts::of`]; nobody recounts.

use serde::{Deserialize, Serialize};

use crate::policy::{PadPredicate, Policy};
use crate::request::{Request, RequestState, SchedulableWindow};

/// The counts of one rank at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankCounts {
    /// Every resident request: active, retiring, dummies. Drives the idle decision.
    pub live: u32,
    /// Live minus retiring (legacy `admission.charge_retiring`: live). Drives admission
    /// and router balance.
    pub routable: u32,
    /// Prompt tokens of the routable requests (router balance).
    pub routable_prompt_tokens: u64,
    /// Retiring requests (GENERATION_TO_COMPLETE), whatever the policy.
    pub retiring: u32,
    /// Inside the scheduler's published window and ready. Drives the pad need.
    pub schedulable: u32,
    /// What the pad need reads: `schedulable` under the fixed predicate; under legacy
    /// `pad.predicate` also GENERATION_TO_COMPLETE and transfer states.
    pub pad_schedulable: u32,
    /// gen side: requests whose KV receive is in flight (a transfer event will come).
    #[serde(default)]
    pub receiving: u32,
}

/// The one retiring predicate (§2).
pub fn is_retiring(r: &Request) -> bool {
    r.state.is_retiring()
}

/// Whether a request is charged against admission (counted routable): live minus
/// retiring. A dummy counts like any resident request; under the fixed policy none is
/// alive when counts are gathered, and one that survived a rejected iteration (legacy
/// `pad.rollback`) is counted in the next gather, as historically.
pub fn is_routable(r: &Request, policy: &Policy) -> bool {
    policy.admission.charge_retiring || !is_retiring(r)
}

/// The scheduler's schedulable predicate: inside the published window and ready.
pub fn is_schedulable(r: &Request, window: &SchedulableWindow) -> bool {
    window.contains(r.state) && !r.awaiting_encoder_output
}

/// The predicate the padding decision reads (§6, switch `pad.predicate`).
pub fn is_pad_schedulable(r: &Request, window: &SchedulableWindow, policy: &Policy) -> bool {
    pad_schedulable_given(r, is_schedulable(r, window), policy)
}

/// [`is_pad_schedulable`] given `schedulable = is_schedulable(r, window)`, so a count
/// of both evaluates the window once per request.
fn pad_schedulable_given(r: &Request, schedulable: bool, policy: &Policy) -> bool {
    match policy.pad.predicate {
        PadPredicate::Fixed => schedulable,
        // The historical predicate: GENERATION_TO_COMPLETE and every later state, and
        // DISAGG_CONTEXT_WAIT_SCHEDULER, count as schedulable; the gen-side transfer
        // states (DISAGG_GENERATION_INIT, ..._TRANS_IN_PROGRESS) were already excluded.
        // So a gen rank whose requests all await KV pads, and a rank holding only
        // retiring requests does not, schedules zero, and vetoes the fleet's forward.
        PadPredicate::Legacy => {
            schedulable
                || r.state.has_reached(RequestState::GenerationToComplete)
                || r.state == RequestState::DisaggContextWaitScheduler
        }
    }
}

impl RankCounts {
    /// Counts one rank: its active requests (and dummy), plus `sending` ctx-side requests
    /// whose KV send is in flight. Those have left the active list (not routable, not
    /// schedulable) but are live: an iteration must run to poll their transfer (§3.9), so
    /// rank 0 must not block while one is pending.
    pub fn of_rank<'a>(
        resident: impl IntoIterator<Item = &'a Request>,
        sending: usize,
        window: &SchedulableWindow,
        policy: &Policy,
    ) -> RankCounts {
        let mut c = RankCounts::of(resident, window, policy);
        c.live += sending as u32;
        c
    }

    /// The counts of two disjoint sets of requests together.
    pub fn plus(self, other: RankCounts) -> RankCounts {
        RankCounts {
            live: self.live + other.live,
            routable: self.routable + other.routable,
            routable_prompt_tokens: self.routable_prompt_tokens + other.routable_prompt_tokens,
            retiring: self.retiring + other.retiring,
            schedulable: self.schedulable + other.schedulable,
            pad_schedulable: self.pad_schedulable + other.pad_schedulable,
            receiving: self.receiving + other.receiving,
        }
    }

    /// Counts the resident requests of one rank.
    pub fn of<'a>(
        resident: impl IntoIterator<Item = &'a Request>,
        window: &SchedulableWindow,
        policy: &Policy,
    ) -> RankCounts {
        let mut c = RankCounts::default();
        for r in resident {
            c.live += 1;
            if is_retiring(r) {
                c.retiring += 1;
            }
            if is_routable(r, policy) {
                c.routable += 1;
                c.routable_prompt_tokens += u64::from(r.spec.prompt_len);
            }
            let schedulable = is_schedulable(r, window);
            if schedulable {
                c.schedulable += 1;
            }
            if pad_schedulable_given(r, schedulable, policy) {
                c.pad_schedulable += 1;
            }
            if r.state == RequestState::DisaggGenerationTransInProgress {
                c.receiving += 1;
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestSpec;

    fn req(id: u64, state: RequestState) -> Request {
        Request::new(RequestSpec::new(id, 100, 4), state)
    }

    #[test]
    fn retiring_request_is_live_but_not_routable() {
        let w = SchedulableWindow::published(false);
        let rs = [
            req(1, RequestState::GenerationInProgress),
            req(2, RequestState::GenerationToComplete),
        ];
        let c = RankCounts::of(&rs, &w, &Policy::FIXED);
        assert_eq!(
            (c.live, c.routable, c.retiring, c.schedulable),
            (2, 1, 1, 1)
        );
        assert_eq!(c.routable_prompt_tokens, 100);
    }

    #[test]
    fn legacy_charge_retiring_makes_routable_equal_live() {
        let w = SchedulableWindow::published(false);
        let rs = [
            req(1, RequestState::GenerationToComplete),
            req(2, RequestState::GenerationToComplete),
        ];
        let c = RankCounts::of(&rs, &w, &Policy::LEGACY);
        assert_eq!((c.live, c.routable, c.retiring), (2, 2, 2));
    }

    #[test]
    fn legacy_pad_predicate_counts_retiring_and_waiting_ctx_but_not_gen_transfers() {
        let w = SchedulableWindow::published(false);
        let rs = [
            req(1, RequestState::GenerationToComplete),
            req(2, RequestState::DisaggContextWaitScheduler),
            req(3, RequestState::DisaggGenerationInit),
            req(4, RequestState::DisaggGenerationTransInProgress),
            req(5, RequestState::DisaggContextTransInProgress),
        ];
        let fixed = RankCounts::of(&rs, &w, &Policy::FIXED);
        let legacy = RankCounts::of(&rs, &w, &Policy::LEGACY);
        assert_eq!((fixed.schedulable, fixed.pad_schedulable), (0, 0));
        // 1, 2 and 5 count; the gen-side transfer states 3 and 4 do not.
        assert_eq!((legacy.schedulable, legacy.pad_schedulable), (0, 3));
        // The per-request predicate says the same, request by request.
        let each = |policy: &Policy| -> Vec<bool> {
            rs.iter()
                .map(|r| is_pad_schedulable(r, &w, policy))
                .collect()
        };
        assert_eq!(each(&Policy::FIXED), [false; 5]);
        assert_eq!(each(&Policy::LEGACY), [true, true, false, false, true]);
        // One request (4) is receiving its KV: the stall rule reads it (§3.2).
        assert_eq!((fixed.receiving, fixed.live), (1, 5));
    }

    #[test]
    fn counts_of_disjoint_sets_add_field_by_field() {
        let a = RankCounts {
            live: 7,
            routable: 5,
            routable_prompt_tokens: 500,
            retiring: 2,
            schedulable: 4,
            pad_schedulable: 3,
            receiving: 1,
        };
        let b = RankCounts {
            live: 1,
            routable: 2,
            routable_prompt_tokens: 30,
            retiring: 3,
            schedulable: 5,
            pad_schedulable: 6,
            receiving: 4,
        };
        assert_eq!(
            a.plus(b),
            RankCounts {
                live: 8,
                routable: 7,
                routable_prompt_tokens: 530,
                retiring: 5,
                schedulable: 9,
                pad_schedulable: 9,
                receiving: 5,
            }
        );
    }
}
