//! The micro-batch scheduler (§4): `B` requests, `T` tokens, chunked prefill
//! (FIRST_COME_FIRST_SERVED, EQUAL_PROGRESS; chunk unit = tokens per block).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::config::ContextChunkingPolicy;
use crate::ids::ReqId;
use crate::request::Request;

/// How a micro-batch scheduler is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MicroBatchConfig {
    /// B.
    pub max_batch_size: u32,
    /// T.
    pub max_num_tokens: u32,
    /// Chunked prefill on.
    pub enable_chunked_prefill: bool,
    /// Chunking policy.
    pub chunking_policy: ContextChunkingPolicy,
    /// Chunk unit.
    pub tokens_per_block: u32,
}

/// What a batch entry does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EntryKind {
    /// Prefill `chunk` prompt tokens (the last chunk samples the first token).
    Context {
        /// Prompt tokens computed by this forward.
        chunk: u32,
    },
    /// One generation step of `1 + draft` tokens.
    Generation {
        /// Tokens this step consumes.
        tokens: u32,
    },
}

/// One request in a micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchEntry {
    /// Index into the `active` slice given to the scheduler.
    pub index: usize,
    /// What it does.
    pub kind: EntryKind,
}

impl BatchEntry {
    /// Tokens this entry puts into the forward.
    pub fn tokens(&self) -> u32 {
        match self.kind {
            EntryKind::Context { chunk } => chunk,
            EntryKind::Generation { tokens } => tokens,
        }
    }
}

/// The micro-batch scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MicroBatchScheduler {
    config: MicroBatchConfig,
}

impl MicroBatchScheduler {
    /// A scheduler.
    pub fn new(config: MicroBatchConfig) -> MicroBatchScheduler {
        MicroBatchScheduler { config }
    }

    /// Walks `fitting` (indices into `active`, in order), skips requests in `in_flight`,
    /// and builds a batch of at most `B` entries and `T` tokens. A context costs
    /// `max(1, remaining prompt)` tokens plus its draft; a generation step `1 + draft`.
    /// Without chunked prefill a context that does not fit stops the walk (FCFS); with
    /// it, contexts are chunked to the remaining budget per policy, in multiples of the
    /// chunk unit unless the chunk finishes the prompt. Pure.
    ///
    /// A context with nothing left to compute (its whole prompt was reused) still gets
    /// `Context { chunk: 1 }`: the forward must recompute one prompt token to sample the
    /// first output token (§4 `max(1, prompt - reused)`). Indices out of range, repeated
    /// indices and requests that are neither context nor generation are skipped. With
    /// chunked prefill a scheduled context is charged its draft tokens on top of its
    /// chunk, and a context whose chunk would be 0 is left out.
    pub fn schedule(
        &self,
        active: &[Request],
        fitting: &[usize],
        in_flight: &BTreeSet<ReqId>,
    ) -> Vec<BatchEntry> {
        let mut entries = Vec::new();
        self.schedule_into(active, fitting, in_flight, &mut entries);
        entries
    }

    /// [`MicroBatchScheduler::schedule`] into `entries` (cleared first), a buffer the
    /// caller keeps across iterations.
    pub fn schedule_into(
        &self,
        active: &[Request],
        fitting: &[usize],
        in_flight: &BTreeSet<ReqId>,
        entries: &mut Vec<BatchEntry>,
    ) {
        entries.clear();
        let max_entries = self.config.max_batch_size as usize;
        let max_tokens = u64::from(self.config.max_num_tokens);
        let chunking = self.config.enable_chunked_prefill;
        // Entries in `fitting` order; a context awaiting its chunk is a `Context` entry
        // with chunk 0 until the budget is shared out below.
        let mut used: u64 = 0;
        // The capacity scheduler hands out strictly increasing indices, which cannot
        // repeat; only other input needs the set of indices already taken.
        let increasing = fitting.windows(2).all(|w| w[0] < w[1]);
        let mut seen: BTreeSet<usize> = BTreeSet::new();
        for &index in fitting {
            if entries.len() >= max_entries {
                break;
            }
            let Some(r) = active.get(index) else { continue };
            if (!in_flight.is_empty() && in_flight.contains(&r.id()))
                || (!increasing && !seen.insert(index))
            {
                continue;
            }
            let draft = u64::from(r.spec.draft_len);
            if r.is_generation() {
                let tokens = 1 + draft;
                if used + tokens > max_tokens {
                    break;
                }
                used += tokens;
                entries.push(BatchEntry {
                    index,
                    kind: EntryKind::Generation {
                        tokens: r.spec.draft_len.saturating_add(1),
                    },
                });
            } else if r.is_context() {
                if chunking {
                    // Collected now (it takes one of the `B` entries); its chunk comes
                    // from what the generation steps leave.
                    entries.push(BatchEntry {
                        index,
                        kind: EntryKind::Context { chunk: 0 },
                    });
                } else {
                    let chunk = r.context_remaining().max(1);
                    let cost = u64::from(chunk) + draft;
                    if used + cost > max_tokens {
                        break;
                    }
                    used += cost;
                    entries.push(BatchEntry {
                        index,
                        kind: EntryKind::Context { chunk },
                    });
                }
            }
        }
        if chunking {
            let budget = max_tokens.saturating_sub(used);
            let chunks = self.share_budget(active, entries, budget);
            let mut chunks = chunks.into_iter();
            for e in entries.iter_mut() {
                if let EntryKind::Context { chunk } = &mut e.kind {
                    *chunk = chunks.next().unwrap_or(0);
                }
            }
            entries.retain(|e| !matches!(e.kind, EntryKind::Context { chunk: 0 }));
        }
    }

    /// Chunked prefill: shares `budget` tokens among the collected contexts of `entries`
    /// (in order) per the chunking policy. Returns one chunk per context entry, 0 for a
    /// context that gets nothing.
    fn share_budget(&self, active: &[Request], entries: &[BatchEntry], budget: u64) -> Vec<u32> {
        // (prompt tokens still needed, draft tokens) per collected context.
        let contexts: Vec<(u32, u64)> = entries
            .iter()
            .filter(|e| matches!(e.kind, EntryKind::Context { .. }))
            .filter_map(|e| active.get(e.index))
            .map(|r| (r.context_remaining().max(1), u64::from(r.spec.draft_len)))
            .collect();
        let unit = self.config.tokens_per_block.max(1);
        let mut chunks = vec![0u32; contexts.len()];
        let mut left = budget;
        match self.config.chunking_policy {
            ContextChunkingPolicy::FirstComeFirstServed => {
                // Each context in order takes what it needs from what is left; a chunk
                // that does not finish the prompt is cut to whole chunk units, so the
                // next chunk starts on a block boundary.
                for (chunk, &(need, draft)) in chunks.iter_mut().zip(&contexts) {
                    let room = left.saturating_sub(draft);
                    let mut c = u64::from(need).min(room);
                    if c < u64::from(need) {
                        c = c / u64::from(unit) * u64::from(unit);
                    }
                    if c > 0 {
                        left -= c + draft;
                        *chunk = u32::try_from(c).unwrap_or(need);
                    }
                }
            }
            ContextChunkingPolicy::EqualProgress => {
                // Rounds: every context still needing tokens advances by one unit (less if
                // that finishes its prompt). An increment that does not fit is skipped, and
                // a later, smaller one may still fit; stop when a round adds nothing.
                loop {
                    let mut progressed = false;
                    for (chunk, &(need, draft)) in chunks.iter_mut().zip(&contexts) {
                        if *chunk >= need {
                            continue;
                        }
                        let inc = unit.min(need - *chunk);
                        // Draft tokens are charged with the context's first chunk.
                        let cost = u64::from(inc) + if *chunk == 0 { draft } else { 0 };
                        if cost > left {
                            continue;
                        }
                        left -= cost;
                        *chunk += inc;
                        progressed = true;
                    }
                    if !progressed {
                        break;
                    }
                }
            }
        }
        chunks
    }
}
