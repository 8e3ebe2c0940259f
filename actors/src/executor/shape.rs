//! The summary of one rank's batch that the cost model reads. Every rank sends its own
//! with its vote, so every host of the server computes the same iteration time.

use serde::{Deserialize, Serialize};

use super::messages::{ForwardKind, ScheduledBatch};

/// What a forward costs depends on: summary of one rank's batch.
///
/// Sums are over real entries; pad dummies are only counted, because the cost model
/// charges each like a one-token generation step (a dummy is a fresh request, so the KV
/// it attends is a token or two and its read is negligible).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BatchShape {
    /// Real context entries.
    pub ctx_requests: u32,
    /// Σ `chunk` over real context entries.
    pub ctx_tokens: u32,
    /// Σ `chunk * (kv_tokens + chunk)` over real context entries: the quadratic
    /// attention term (each computed token attends the cached prefix and the chunk).
    pub ctx_attention: u64,
    /// Real generation entries.
    pub gen_requests: u32,
    /// Σ `tokens` over real generation entries (draft tokens included).
    pub gen_tokens: u32,
    /// Σ `kv_tokens` attended over real generation entries.
    pub gen_kv_tokens: u64,
    /// Pad dummies, context or generation alike.
    pub dummies: u32,
}

impl BatchShape {
    /// Summarises a scheduled batch.
    pub fn of(batch: &ScheduledBatch) -> BatchShape {
        let mut s = BatchShape::default();
        for e in &batch.entries {
            if e.is_dummy {
                s.dummies += 1;
                continue;
            }
            match e.kind {
                ForwardKind::Context { chunk, .. } => {
                    s.ctx_requests += 1;
                    s.ctx_tokens += chunk;
                    s.ctx_attention +=
                        u64::from(chunk) * (u64::from(e.kv_tokens) + u64::from(chunk));
                }
                ForwardKind::Generation { tokens } => {
                    s.gen_requests += 1;
                    s.gen_tokens += tokens;
                    s.gen_kv_tokens += u64::from(e.kv_tokens);
                }
            }
        }
        s
    }

    /// No entry at all, real or dummy: the rank has nothing to run.
    pub fn is_empty(&self) -> bool {
        self.ctx_requests == 0
            && self.ctx_tokens == 0
            && self.ctx_attention == 0
            && self.gen_requests == 0
            && self.gen_tokens == 0
            && self.gen_kv_tokens == 0
            && self.dummies == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::ForwardEntry;
    use crate::ids::{BatchNumber, RankId, ReqId};

    fn entry(id: u64, kind: ForwardKind, kv_tokens: u32, is_dummy: bool) -> ForwardEntry {
        ForwardEntry {
            id: if is_dummy { ReqId::DUMMY } else { ReqId(id) },
            seq: id,
            kind,
            kv_tokens,
            position: 0,
            path: 0,
            is_dummy,
        }
    }

    #[test]
    fn shape_of_a_mixed_batch_gives_the_exact_sums() {
        let batch = ScheduledBatch {
            number: BatchNumber(7),
            rank: RankId(1),
            entries: vec![
                // A first chunk: 512 * (0 + 512).
                entry(
                    1,
                    ForwardKind::Context {
                        chunk: 512,
                        samples: false,
                    },
                    0,
                    false,
                ),
                // A later chunk over a cached prefix: 100 * (1000 + 100).
                entry(
                    2,
                    ForwardKind::Context {
                        chunk: 100,
                        samples: true,
                    },
                    1000,
                    false,
                ),
                entry(3, ForwardKind::Generation { tokens: 1 }, 300, false),
                // A speculative step: 1 + 3 draft tokens.
                entry(4, ForwardKind::Generation { tokens: 4 }, 2000, false),
                // A dummy counts only as a dummy, whatever its kind and KV.
                entry(0, ForwardKind::Generation { tokens: 4 }, 5, true),
                entry(
                    0,
                    ForwardKind::Context {
                        chunk: 1,
                        samples: true,
                    },
                    0,
                    true,
                ),
            ],
            ..ScheduledBatch::default()
        };
        assert_eq!(
            BatchShape::of(&batch),
            BatchShape {
                ctx_requests: 2,
                ctx_tokens: 612,
                ctx_attention: 512 * 512 + 100 * 1100,
                gen_requests: 2,
                gen_tokens: 5,
                gen_kv_tokens: 2300,
                dummies: 2,
            }
        );
    }

    #[test]
    fn an_empty_batch_has_an_empty_shape_and_a_dummy_alone_does_not() {
        let mut batch = ScheduledBatch {
            number: BatchNumber(0),
            rank: RankId(0),
            entries: vec![],
            ..ScheduledBatch::default()
        };
        assert!(BatchShape::of(&batch).is_empty());
        batch
            .entries
            .push(entry(0, ForwardKind::Generation { tokens: 1 }, 0, true));
        let s = BatchShape::of(&batch);
        assert!(!s.is_empty());
        assert_eq!(s.dummies, 1);
    }

    #[test]
    fn attention_term_does_not_overflow_for_long_contexts() {
        let batch = ScheduledBatch {
            number: BatchNumber(0),
            rank: RankId(0),
            entries: vec![entry(
                1,
                ForwardKind::Context {
                    chunk: 1 << 20,
                    samples: true,
                },
                u32::MAX,
                false,
            )],
            ..ScheduledBatch::default()
        };
        let want = (1u64 << 20) * (u64::from(u32::MAX) + (1 << 20));
        assert_eq!(BatchShape::of(&batch).ctx_attention, want);
    }
}
