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
        cause: AbortCause,
    },
}

/// How a transfer ended, as reported by the transceiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferOutcome {
    /// Done.
    Done,
    /// Failed or timed out.
    Failed(TransferFailure),
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
    /// Failed.
    Failed(Failure),
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
    /// The last token's log-probabilities, when its request asked for them
    /// (`logprobs`) and a model computed them.
    #[serde(default)]
    pub logprobs: Option<TokenLogprobs>,
}

/// The plain tokens of a run of consecutive iterations, as one message: in each
/// iteration every request of `ids` got one token and nothing else happened to it (no
/// ending, no log-probabilities). What a host that runs such a stretch at once
/// (coasting, in the simulator) hands on instead of one [`Response`] per request and
/// iteration; the client applies it token by token, as those responses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenRun {
    /// The requests, in the order their responses would come (rank, then batch).
    pub ids: Vec<ReqId>,
    /// Iterations in the run.
    pub steps: u32,
    /// The tokens, request by request: `tokens[i * steps + j]` is request `ids[i]`'s
    /// token of iteration `j`.
    pub tokens: Vec<u32>,
}

impl TokenRun {
    /// Request `i`'s tokens, one per iteration.
    pub fn tokens_of(&self, i: usize) -> &[u32] {
        let steps = self.steps as usize;
        &self.tokens[i * steps..(i + 1) * steps]
    }

    /// Empties it, keeping its buffers.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.tokens.clear();
        self.steps = 0;
    }
}

/// One sampled token's log-probabilities (the OpenAI API's `logprobs`): its own and
/// the `top` most likely tokens', log-softmax of the model's logits.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The sampled token.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// The most likely tokens with theirs, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

// A log-softmax of finite logits is never NaN, so equality is reflexive here.
impl Eq for TokenLogprobs {}

/// Why a request failed. Whoever decides something from a failure (the report's kind,
/// the HTTP status, the swarm's classification) matches on the variant; `Display` is
/// the text a client and a report read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Failure {
    /// The server refused the request at admission: it can never run there (§3.3).
    Refused(String),
    /// The front refused it: no server of a role it needs can ever run it (each
    /// server's limit named); it reached no server.
    Unservable(crate::config::Unservable),
    /// No server of the role the request needs next (`agg`, `ctx`, or `gen` once a ctx
    /// server produced its first token).
    NoServer {
        /// The role's name.
        role: String,
    },
    /// The server could not take it: its ingress was full or closed.
    Undeliverable(String),
    /// The server stalled out (§3.2): work remained and nothing could move it within
    /// the stall bound; the text names every rank's state.
    Deadlocked(String),
    /// The ctx side's KV send failed (its first token had gone out).
    KvSend(TransferFailure),
    /// The gen side's KV receive failed.
    KvReceive(TransferFailure),
    /// The fleet was lost (a rank crashed or could not be reached); the text names the
    /// ranks.
    FleetLost(String),
}

impl Failure {
    /// What kind of failure this is, for reports and for whoever classifies runs.
    pub fn kind(&self) -> FailureKind {
        match self {
            Failure::Refused(_) | Failure::Unservable(_) => FailureKind::Refused,
            Failure::NoServer { .. } | Failure::Undeliverable(_) => FailureKind::Unavailable,
            Failure::Deadlocked(_) => FailureKind::Deadlocked,
            Failure::KvSend(t) | Failure::KvReceive(t) if t.is_timeout() => {
                FailureKind::TransferTimeout
            }
            Failure::KvSend(_) | Failure::KvReceive(_) => FailureKind::TransferFailed,
            Failure::FleetLost(_) => FailureKind::FleetLost,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused(why) | Failure::Undeliverable(why) | Failure::FleetLost(why) => {
                f.write_str(why)
            }
            Failure::Unservable(u) => {
                write!(f, "no {} server can run the request: {u}", u.role.name())
            }
            Failure::NoServer { role } => write!(f, "no {role} server to take the request"),
            Failure::Deadlocked(why) => write!(f, "deadlocked: {why}"),
            Failure::KvSend(t) => write!(f, "kv send failed: {t}"),
            Failure::KvReceive(t) => write!(f, "kv receive failed: {t}"),
        }
    }
}

/// The kinds of [`Failure`] (and of the failures only a client or a report sees), as a
/// report records them: one word each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// Refused at admission, or by the front (no server could run it).
    Refused,
    /// No server could take it (none of the role, or its ingress full or closed).
    Unavailable,
    /// Its server stalled out.
    Deadlocked,
    /// Its KV transfer timed out, or its KV was not pulled in time (lost or slow KV),
    /// on either side, or its peer's did.
    TransferTimeout,
    /// Its KV transfer failed otherwise (checksum, geometry, an abort).
    TransferFailed,
    /// The fleet was lost.
    FleetLost,
    /// Cancelled by the client.
    Cancelled,
    /// Still open when the run ended (the run failed or crashed around it).
    Unfinished,
    /// The client's exchange with an HTTP server failed (`lockstep bench`).
    Client,
}

impl FailureKind {
    /// The one word a report records (as serialised).
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Refused => "refused",
            FailureKind::Unavailable => "unavailable",
            FailureKind::Deadlocked => "deadlocked",
            FailureKind::TransferTimeout => "transfer_timeout",
            FailureKind::TransferFailed => "transfer_failed",
            FailureKind::FleetLost => "fleet_lost",
            FailureKind::Cancelled => "cancelled",
            FailureKind::Unfinished => "unfinished",
            FailureKind::Client => "client",
        }
    }
}

/// Why a KV transfer failed, as the side that saw it says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferFailure {
    /// No transfer within `kv_transfer_timeout_ms` of its start.
    TimedOut {
        /// The bound.
        after_ms: u64,
    },
    /// The KV waited on the ctx side for a pull longer than `kv_pull_timeout_ms`.
    NotPulled {
        /// The bound.
        within_ms: u64,
    },
    /// A block arrived whose checksum does not match its bytes.
    Checksum {
        /// The block's index in the sequence.
        block: u32,
    },
    /// What arrived, or what was asked for, does not fit (block count or order, a
    /// payload of the wrong kind, no KV location known).
    Mismatch(String),
    /// The rank's K/V store could not read or write the blocks.
    Store(String),
    /// The transfer was ended on purpose, by an executor or the front.
    Aborted(AbortCause),
}

impl TransferFailure {
    /// A timeout on this side, or an abort caused by a timeout somewhere else.
    pub fn is_timeout(&self) -> bool {
        match self {
            TransferFailure::TimedOut { .. } | TransferFailure::NotPulled { .. } => true,
            TransferFailure::Aborted(cause) => cause.is_transfer_timeout(),
            _ => false,
        }
    }
}

impl std::fmt::Display for TransferFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransferFailure::TimedOut { after_ms } => {
                write!(f, "kv transfer timed out after {after_ms} ms")
            }
            TransferFailure::NotPulled { within_ms } => {
                write!(
                    f,
                    "kv not pulled within {within_ms} ms (kv_pull_timeout_ms)"
                )
            }
            TransferFailure::Checksum { block } => write!(f, "kv block {block} checksum mismatch"),
            TransferFailure::Mismatch(why) | TransferFailure::Store(why) => f.write_str(why),
            TransferFailure::Aborted(cause) => write!(f, "{cause}"),
        }
    }
}

/// Why a transfer was ended on purpose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AbortCause {
    /// The client cancelled the request.
    Cancelled,
    /// The request failed on this side.
    Failed(Box<Failure>),
    /// The request ended on the gen side; the ctx side frees its KV.
    GenSide(Box<AbortCause>),
}

impl AbortCause {
    /// Whether the abort goes back to a transfer that timed out.
    pub fn is_transfer_timeout(&self) -> bool {
        match self {
            AbortCause::Cancelled => false,
            AbortCause::Failed(f) => f.kind() == FailureKind::TransferTimeout,
            AbortCause::GenSide(cause) => cause.is_transfer_timeout(),
        }
    }
}

impl std::fmt::Display for AbortCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AbortCause::Cancelled => f.write_str("cancelled"),
            AbortCause::Failed(failure) => write!(f, "{failure}"),
            AbortCause::GenSide(cause) => write!(f, "gen side failed: {cause}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed_out() -> TransferFailure {
        TransferFailure::TimedOut { after_ms: 5 }
    }

    #[test]
    fn a_transfer_timeout_is_one_kind_on_either_side_and_through_an_abort() {
        let not_pulled = TransferFailure::NotPulled { within_ms: 5 };
        for f in [
            Failure::KvSend(timed_out()),
            Failure::KvReceive(timed_out()),
            Failure::KvSend(not_pulled),
            // The gen side timed out; the ctx side hears it as the gen side's abort.
            Failure::KvSend(TransferFailure::Aborted(AbortCause::GenSide(Box::new(
                AbortCause::Failed(Box::new(Failure::KvReceive(timed_out()))),
            )))),
        ] {
            assert_eq!(f.kind(), FailureKind::TransferTimeout, "{f}");
        }
        for f in [
            Failure::KvReceive(TransferFailure::Checksum { block: 1 }),
            Failure::KvSend(TransferFailure::Aborted(AbortCause::Cancelled)),
            Failure::KvSend(TransferFailure::Aborted(AbortCause::Failed(Box::new(
                Failure::Deadlocked("stuck".into()),
            )))),
        ] {
            assert_eq!(f.kind(), FailureKind::TransferFailed, "{f}");
        }
        assert_eq!(
            Failure::Deadlocked("x".into()).kind(),
            FailureKind::Deadlocked
        );
        assert_eq!(
            Failure::NoServer { role: "gen".into() }.kind(),
            FailureKind::Unavailable
        );
    }

    #[test]
    fn the_text_reads_as_the_chain_of_causes() {
        let f = Failure::KvSend(TransferFailure::Aborted(AbortCause::GenSide(Box::new(
            AbortCause::Failed(Box::new(Failure::KvReceive(timed_out()))),
        ))));
        assert_eq!(
            f.to_string(),
            "kv send failed: gen side failed: kv receive failed: kv transfer timed out after 5 ms"
        );
        assert_eq!(
            Failure::KvReceive(TransferFailure::NotPulled { within_ms: 30 }).to_string(),
            "kv receive failed: kv not pulled within 30 ms (kv_pull_timeout_ms)"
        );
        assert_eq!(
            Failure::KvSend(TransferFailure::Aborted(AbortCause::Failed(Box::new(
                Failure::Deadlocked("rank 0 waits".into())
            ))))
            .to_string(),
            "kv send failed: deadlocked: rank 0 waits"
        );
    }
}
