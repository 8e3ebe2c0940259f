//! The vocabulary every actor shares: where a rank is, what the executor asks of a
//! transceiver and what it hears back, a rank's forward intent. A leaf module (it
//! imports only [`crate::ids`]), so no actor imports another actor to name a type.

use serde::{Deserialize, Serialize};

use crate::ids::{RankId, ReqId};

/// Where a rank is: the server's index in the scenario and the rank inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct KvAddress {
    /// Server index (scenario order).
    pub server: u32,
    /// DP rank inside that server.
    pub rank: RankId,
}

/// How long a ctx rank holds a request's KV for a gen rank that has not pulled it
/// (`cache_transceiver_config.kv_pull_timeout_ms`): 480 s, the bound vLLM's prefill
/// instances use before they release KV that no decode instance read.
pub const DEFAULT_PULL_TIMEOUT_MS: u64 = 480_000;

/// Phase 4 contribution (§6): forward intent, combined by MAX. Only the non-overlap
/// disaggregated path reads it; other paths contribute `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[repr(u8)]
pub enum PadIntent {
    /// Nothing to run.
    #[default]
    None = 0,
    /// Generation work.
    Generation = 1,
    /// Context work.
    Context = 2,
}

impl PadIntent {
    /// The value the allreduce MAX combines.
    pub fn as_u64(self) -> u64 {
        self as u64
    }

    /// The intent a combined value stands for (anything above `Context` is `Context`).
    pub fn from_u64(v: u64) -> PadIntent {
        match v {
            0 => PadIntent::None,
            1 => PadIntent::Generation,
            _ => PadIntent::Context,
        }
    }
}

/// A transfer the transceiver must start (driver-side effect of an iteration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferCommand {
    /// ctx side: send the KV of `id` (`blocks` blocks).
    Send {
        /// Request.
        id: ReqId,
        /// Blocks to send.
        blocks: u32,
    },
    /// gen side: receive the KV of `id` into `blocks` reserved blocks.
    Receive {
        /// Request.
        id: ReqId,
        /// Blocks to receive.
        blocks: u32,
        /// Where the KV lives, if the request said (`RequestSpec::kv_source`).
        from: Option<KvAddress>,
        /// The reserved blocks' ids in this rank's pool, in sequence order (where a
        /// model backend's K/V is written).
        block_ids: Vec<u32>,
    },
    /// Either side: the executor dropped `id` while its transfer was in flight
    /// (cancelled, or failed with its server); end it and tell the counterpart.
    Abort {
        /// Request.
        id: ReqId,
        /// Why.
        reason: String,
    },
}

/// How a transfer ended, as reported by the transceiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferOutcome {
    /// Done.
    Done,
    /// Failed or timed out, with a reason.
    Failed(String),
}

/// A transfer event delivered to a rank by its driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferEvent {
    /// Request.
    pub id: ReqId,
    /// Outcome.
    pub outcome: TransferOutcome,
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finish {
    /// Reached its length (aggregated or gen server).
    Completed,
    /// ctx server: first token out, KV send started (§8).
    ContextDone,
    /// Failed, with a reason.
    Failed(String),
    /// Cancelled by the client.
    Cancelled,
}

/// One response for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The request.
    pub id: ReqId,
    /// Tokens added this iteration.
    pub new_tokens: u32,
    /// The last token sampled (meaningful when `new_tokens > 0`).
    pub last_token: u32,
    /// Total output tokens so far.
    pub generated: u32,
    /// Set when the request ended.
    pub finish: Option<Finish>,
}
