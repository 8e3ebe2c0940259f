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
    pub fn schedule(
        &self,
        active: &[Request],
        fitting: &[usize],
        in_flight: &BTreeSet<ReqId>,
    ) -> Vec<BatchEntry> {
        let _ = (active, fitting, in_flight);
        todo!()
    }
}
