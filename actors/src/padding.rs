//! Dummy padding (mechanisms.md §6): the need decision on both paths and the tentative
//! dummy that the vote commits or rolls back.
//!
//! Guardrails: the need reads the counts it is given (it never recounts); a tentative
//! dummy is a `#[must_use]` token consumed by the executor's commit or rollback.

use serde::{Deserialize, Serialize};

use crate::ids::Seat;
use crate::kv::TentativeDummyKv;
use crate::vocab::PadIntent;

/// The kind of dummy to add.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DummyKind {
    /// A generation dummy of `1 + draft` tokens.
    Generation,
    /// A context dummy of 1 prompt token (ctx servers).
    Context,
}

/// Which path decides the need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PadPath {
    /// A single rank: nobody waits for it in a collective, so it never pads (padding is
    /// an ADP mechanism, §6).
    Never,
    /// `expected > 0 && schedulable == 0`.
    Expected,
    /// Non-overlap disaggregated: fresh intent each iteration, combined by MAX.
    Intent,
}

/// The pre-schedule need (§6). `pad_schedulable` is the count the policy's predicate
/// gives; `global_intent` is the MAX-reduced intent (ignored on the expected path).
pub fn pad_need(
    path: PadPath,
    expected: u32,
    pad_schedulable: u32,
    global_intent: PadIntent,
    ctx_server: bool,
) -> Option<DummyKind> {
    match path {
        PadPath::Never => None,
        PadPath::Expected => (expected > 0 && pad_schedulable == 0).then_some(if ctx_server {
            DummyKind::Context
        } else {
            DummyKind::Generation
        }),
        PadPath::Intent => match (global_intent, pad_schedulable) {
            (PadIntent::None, _) | (_, 1..) => None,
            (PadIntent::Generation, 0) => Some(DummyKind::Generation),
            (PadIntent::Context, 0) => Some(DummyKind::Context),
        },
    }
}

/// A dummy allocated tentatively this iteration. Consumed by the executor's commit (after
/// a positive vote) or rollback (after a rejection).
#[must_use = "a tentative dummy must be committed or rolled back"]
#[derive(Debug)]
pub struct TentativeDummy {
    /// Its KV (index slot and blocks).
    pub kv: TentativeDummyKv,
    /// Its seat.
    pub seat: Seat,
    /// Its kind.
    pub kind: DummyKind,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_path_pads_only_when_peers_have_work_and_this_rank_has_nothing() {
        let table = [
            (1, 0, Some(DummyKind::Generation)),
            (0, 0, None),
            (1, 1, None),
            (3, 2, None),
        ];
        for (i, (expected, sched, want)) in table.into_iter().enumerate() {
            assert_eq!(
                pad_need(PadPath::Expected, expected, sched, PadIntent::None, false),
                want,
                "#{i}"
            );
        }
        assert_eq!(
            pad_need(PadPath::Expected, 1, 0, PadIntent::None, true),
            Some(DummyKind::Context)
        );
    }

    #[test]
    fn intent_path_pads_with_the_peers_role() {
        let table = [
            (PadIntent::None, 0, None),
            (PadIntent::Generation, 0, Some(DummyKind::Generation)),
            (PadIntent::Context, 0, Some(DummyKind::Context)),
            (PadIntent::Context, 3, None),
        ];
        for (i, (intent, sched, want)) in table.into_iter().enumerate() {
            assert_eq!(
                pad_need(PadPath::Intent, 0, sched, intent, false),
                want,
                "#{i}"
            );
        }
    }
}
