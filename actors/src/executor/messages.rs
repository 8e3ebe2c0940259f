//! What one rank contributes to each collective of an iteration, and what the backend and
//! the transceiver hand back. All serializable, so runs can be recorded and replayed and
//! the MPI driver can ship them as bytes.

use serde::{Deserialize, Serialize};

use crate::counts::RankCounts;
use crate::ids::{BatchNumber, RankId, ReqId};
use crate::request::{IngressItem, RequestSampling, RequestSpec, TokenBias};
use crate::vocab::{Response, TokenLogprobs, TransferEvent};

/// The collectives of one iteration, in their fixed order (§3). A collective is tagged
/// with `(iteration, phase)`; transports compare tags across ranks. A server's
/// [`CollectiveSchedule`] says which of them its configuration runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// 1. allgather of [`RankState`].
    Gather,
    /// 2. broadcast of [`FetchBatch`] from rank 0.
    Fetch,
    /// 3. allgather of [`PrefixMatches`] (KV-aware router only).
    PrefixMatch,
    /// 4. allreduce MAX of [`crate::vocab::PadIntent`] (non-overlap disaggregated path only).
    PadIntent,
    /// 6. allgather of [`BatchVote`].
    Vote,
    /// 8. gather of [`RankResponses`] to rank 0 (servers without transfers).
    Responses,
    /// 8. allgather of [`ResponsesAndStatus`] (ctx and gen servers).
    ///
    /// The transfer status every rank applies, fused with the response gather, whose data
    /// is ready at the same point: one round trip instead of two (the other ranks ignore
    /// the responses).
    Transfers,
}

impl Phase {
    /// Every phase, in iteration order.
    pub const ALL: [Phase; 7] = [
        Phase::Gather,
        Phase::Fetch,
        Phase::PrefixMatch,
        Phase::PadIntent,
        Phase::Vote,
        Phase::Responses,
        Phase::Transfers,
    ];

    /// The collective operation this phase runs.
    pub fn op(self) -> CollectiveOp {
        match self {
            Phase::Gather | Phase::PrefixMatch | Phase::Vote | Phase::Transfers => {
                CollectiveOp::Allgather
            }
            Phase::Fetch => CollectiveOp::Broadcast,
            Phase::PadIntent => CollectiveOp::AllreduceMax,
            Phase::Responses => CollectiveOp::Gather,
        }
    }

    /// Name used in logs and errors.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Gather => "gather",
            Phase::Fetch => "fetch",
            Phase::PrefixMatch => "prefix_match",
            Phase::PadIntent => "pad_intent",
            Phase::Vote => "vote",
            Phase::Responses => "responses",
            Phase::Transfers => "transfers",
        }
    }
}

/// The kind of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CollectiveOp {
    /// Everyone gets everyone's contribution.
    Allgather,
    /// Everyone gets rank 0's value.
    Broadcast,
    /// Everyone gets the maximum.
    AllreduceMax,
    /// Rank 0 gets everyone's contribution.
    Gather,
}

/// Which collectives one server's iteration runs. Fixed by the server's configuration,
/// never by data (§3): a collective the configuration can never need is left out of the
/// sequence, the rest run every iteration even when empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveSchedule {
    /// The prefix-match allgather: only a KV-aware router reads it.
    pub prefix_matches: bool,
    /// The pad-intent allreduce: only the non-overlap disaggregated path pads by intent.
    pub pad_intent: bool,
    /// The transfer-status allgather (which then carries the responses in place of the
    /// response gather): only ctx and gen servers transfer KV.
    pub transfers: bool,
}

impl CollectiveSchedule {
    /// Whether `phase` runs in this schedule.
    pub fn runs(&self, phase: Phase) -> bool {
        match phase {
            Phase::Gather | Phase::Fetch | Phase::Vote => true,
            Phase::PrefixMatch => self.prefix_matches,
            Phase::PadIntent => self.pad_intent,
            // The transfer-status allgather carries the responses when it runs.
            Phase::Responses => !self.transfers,
            Phase::Transfers => self.transfers,
        }
    }

    /// The phases one iteration runs, in order.
    pub fn phases(&self) -> Vec<Phase> {
        Phase::ALL.into_iter().filter(|p| self.runs(*p)).collect()
    }
}

/// The tag every collective carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CollectiveTag {
    /// Iteration number (0-based).
    pub iteration: u64,
    /// Phase.
    pub phase: Phase,
}

/// Phase 1 contribution (§3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankState {
    /// The rank.
    pub rank: RankId,
    /// Its counts.
    pub counts: RankCounts,
    /// It holds responses for this iteration's response gather that no live request
    /// accounts for (requests failed by a transfer event after the last gather): the
    /// iteration must run even if nothing is live.
    #[serde(default)]
    pub responses_due: bool,
    /// The rank's previous iteration changed something (a real forward, a response, an
    /// admission, a transfer event, ...). When no rank's did, the next iteration would
    /// be the same: rank 0 waits for an input instead of spinning.
    #[serde(default)]
    pub progressed: bool,
    /// A KV transfer of this rank is in flight: its end (done, failed or timed out) is an
    /// input still to come, so a wait for it is not a deadlock.
    #[serde(default)]
    pub awaiting_transfer: bool,
    /// ADP balance on: the rank's context and generation work (zero when off).
    #[serde(default)]
    pub balance: super::balance::BalanceLoad,
}

/// What rank 0 read from the ingress queue, broadcast to every rank (§3.2).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FetchBatch {
    /// New requests, in arrival order.
    pub requests: Vec<RequestSpec>,
    /// Requests to cancel.
    pub cancellations: Vec<ReqId>,
    /// Stop after the work in hand.
    pub shutdown: bool,
    /// ctx server, generation-first mode (§8): requests whose gen peer the front has
    /// named. Broadcast with the fetch, so every rank agrees on the promoted set.
    #[serde(default)]
    pub peers_ready: Vec<ReqId>,
    /// Rank 0's clock when it fetched (virtual in the simulator): broadcast, so every
    /// rank applies time-based rules (the transport budget's stale receives) alike.
    pub now_ns: u64,
    /// Rank 0 waited in [`FetchMode::Stalled`] `{ bounded: true }` for longer than the
    /// host's stall bound and nothing came: the server is deadlocked. Every rank fails
    /// what it holds with the reason, and the server winds down.
    #[serde(default)]
    pub stalled_out: Option<String>,
}

impl FetchBatch {
    /// Adds one item read from the ingress (every host reads it into the batch this way).
    pub fn add(&mut self, item: IngressItem) {
        match item {
            IngressItem::Request(spec) => self.requests.push(spec),
            IngressItem::Cancel(id) => self.cancellations.push(id),
            IngressItem::Shutdown => self.shutdown = true,
            IngressItem::PeerReady(id) => self.peers_ready.push(id),
            IngressItem::Wake => {}
        }
    }
}

/// Rank 0's decision of how to read the ingress queue (§3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FetchMode {
    /// Σ live == 0, waiting queue empty, no shutdown: block until something arrives, as
    /// long as it takes.
    Block,
    /// Drain what is there and go on.
    Poll,
    /// Work remains but no rank's last iteration changed anything: the next would be the
    /// same, so wait for the next input (a request, a cancellation, a transfer event's
    /// wake-up) instead of spinning. `bounded`: no transfer is in flight either, so
    /// nothing pending will bring an input; a wait past the host's stall bound is a
    /// deadlock, answered with [`FetchBatch::stalled_out`].
    Stalled {
        /// Whether the wait is bounded by the stall bound.
        bounded: bool,
    },
}

/// Phase 3 contribution: this rank's cached-prefix match (tokens) for each request popped
/// this iteration; empty unless the router is KV-aware.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PrefixMatches {
    /// One entry per popped request, in pop order.
    pub tokens: Vec<u32>,
}

/// Phase 6 contribution: how many entries (dummies included) this rank scheduled, and
/// whether it hit a violation that crashes the real executor (every rank reads every
/// flag in the same collective, so all stop at the same point instead of one leaving
/// its peers waiting in the next collective).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BatchVote {
    /// Batch size.
    pub batch_size: u32,
    /// A fatal violation on this rank this iteration (cap check, unseatable request).
    #[serde(default)]
    pub fatal: bool,
    /// What this rank's batch would cost the device: with every rank's shape, every host
    /// computes the same iteration time (the forward ends when the slowest rank's
    /// does: its collectives wait for all).
    #[serde(default)]
    pub shape: super::shape::BatchShape,
}

/// What one forward entry does, as the backend sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ForwardKind {
    /// Prefill `chunk` tokens; `samples` when this chunk finishes the prefill.
    Context {
        /// Tokens computed.
        chunk: u32,
        /// Whether the forward samples a token for this entry.
        samples: bool,
    },
    /// A generation step consuming `tokens` tokens.
    Generation {
        /// `1 + draft`.
        tokens: u32,
    },
}

/// A run of one of a [`ScheduledBatch`]'s flat buffers: `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Span {
    /// First index.
    pub start: u32,
    /// Length.
    pub len: u32,
}

impl Span {
    /// The indices it covers.
    pub fn range(self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }

    /// The span that the items pushed onto `buf` since it held `start` items cover.
    fn since(start: usize, buf_len: usize) -> Span {
        Span {
            start: start as u32,
            len: (buf_len - start) as u32,
        }
    }
}

/// One entry of a scheduled batch: what the control plane does with it. The one entry
/// type from the executor to the model backend; what a model needs beyond it (its
/// block table, prompt, sampling) is its [`EntryInputs`], at the same index in the
/// launched batch's [`ForwardInputs::entries`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardEntry {
    /// Request (or [`ReqId::DUMMY`]).
    pub id: ReqId,
    /// The request's rank-local admission number (see `Request::seq`).
    pub seq: u64,
    /// What it does.
    pub kind: ForwardKind,
    /// KV tokens attended before this step.
    pub kv_tokens: u32,
    /// Output position of the token this entry samples (for deterministic backends).
    pub position: u32,
    /// Where this step's token comes from, for deterministic backends to mix into the
    /// token ([`crate::token_path::token_path`]): the rank that runs it and, on an aggregated
    /// server, the batch number; on a gen server the ctx server and rank its KV came
    /// from. 0 for a dummy.
    pub path: u64,
    /// A pad dummy.
    pub is_dummy: bool,
}

/// What a model needs of one entry beyond the [`ForwardEntry`] itself, filled at launch
/// (kept apart so the control plane's entries stay small: it never reads these).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct EntryInputs {
    /// The request's prompt length (output position `p` is sequence position
    /// `prompt_len + p`). 0 for a dummy.
    pub prompt_len: u32,
    /// The request's own sampling, if it gave one (the control plane never reads it).
    pub sampling: Option<RequestSampling>,
    /// Its block table (KV block ids in token order) in [`ForwardInputs::block_ids`],
    /// as the KV manager held it when the batch launched. Empty for a dummy.
    pub blocks: Span,
    /// A context entry: its prompt's token ids in [`ForwardInputs::prompt_ids`] (empty
    /// when the request carries none: a model makes one up from its block hashes).
    pub prompt: Span,
    /// A context entry: its prompt's block hashes in [`ForwardInputs::block_hashes`].
    pub hashes: Span,
    /// The request's `logit_bias` in [`ForwardInputs::logit_bias`] (empty: none).
    pub logit_bias: Span,
    /// The request's end ids in [`ForwardInputs::end_ids`] (empty: none to mask).
    pub end_ids: Span,
}

impl ForwardKind {
    /// Tokens the step puts into the forward.
    pub fn tokens(self) -> u32 {
        match self {
            ForwardKind::Context { chunk, .. } => chunk,
            ForwardKind::Generation { tokens } => tokens,
        }
    }

    /// Whether the forward samples a token for the step (a prefill's last chunk, every
    /// generation step).
    pub fn samples(self) -> bool {
        match self {
            ForwardKind::Context { samples, .. } => samples,
            ForwardKind::Generation { .. } => true,
        }
    }
}

impl ForwardEntry {
    /// Tokens this entry puts into the forward.
    pub fn tokens(&self) -> u32 {
        self.kind.tokens()
    }
}

/// A batch the backend runs (one rank's share of one forward): what [`super::Io::Forward`]
/// hands the host to launch. With its [`ForwardInputs`] it is everything a forward
/// needs: a token source reads nothing else of the rank.
#[derive(Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ScheduledBatch {
    /// Its number.
    pub number: BatchNumber,
    /// The rank.
    pub rank: RankId,
    /// Entries.
    pub entries: Vec<ForwardEntry>,
    /// What a model reads beyond the entries (filled at launch, when the host said its
    /// device reads them: [`super::RankExecutor::set_forward_inputs`]).
    #[serde(default)]
    pub inputs: Box<ForwardInputs>,
}

impl Clone for ScheduledBatch {
    fn clone(&self) -> Self {
        ScheduledBatch {
            number: self.number,
            rank: self.rank,
            entries: self.entries.clone(),
            inputs: self.inputs.clone(),
        }
    }

    /// Field by field, so a recycled batch's buffers are reused (a device that keeps
    /// its own copy of each launched batch allocates nothing in steady state).
    fn clone_from(&mut self, source: &Self) {
        self.number = source.number;
        self.rank = source.rank;
        self.entries.clone_from(&source.entries);
        self.inputs.clone_from(&source.inputs);
    }
}

/// The rank's KV pool as a forward sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvPool {
    /// Blocks in the pool.
    pub blocks: u32,
    /// Tokens per block.
    pub tokens_per_block: u32,
}

/// Every how many batches a launched batch lists the requests the rank still holds
/// ([`ForwardInputs::live`]), so a device can forget what it keeps for the others.
pub const LIVE_EVERY: u64 = 256;

/// What a model reads of a launched batch beyond its entries: flat buffers the entries'
/// [`Span`]s index, cleared and refilled at each launch (no allocation per request in
/// steady state).
#[derive(Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ForwardInputs {
    /// Whether the executor filled them (a batch of a rank whose device reads none is
    /// launched without).
    pub filled: bool,
    /// The rank's KV pool.
    pub pool: KvPool,
    /// One per entry of the batch, in batch order.
    pub entries: Vec<EntryInputs>,
    /// Every entry's block table, one after the other.
    pub block_ids: Vec<u32>,
    /// The context entries' prompt token ids, one after the other.
    pub prompt_ids: Vec<u32>,
    /// The context entries' prompt block hashes, one after the other.
    pub block_hashes: Vec<u64>,
    /// The logit biases of the entries whose request has any, one after the other.
    pub logit_bias: Vec<TokenBias>,
    /// The end ids of the entries whose request masks them, one after the other.
    pub end_ids: Vec<u32>,
    /// Every [`LIVE_EVERY`]-th batch (not the first): every request the rank still
    /// holds (resident, sending, waiting); the device may forget the others.
    pub live: Option<Vec<ReqId>>,
}

impl Clone for ForwardInputs {
    fn clone(&self) -> Self {
        let mut c = ForwardInputs::default();
        c.clone_from(self);
        c
    }

    fn clone_from(&mut self, source: &Self) {
        self.filled = source.filled;
        self.pool = source.pool;
        self.entries.clone_from(&source.entries);
        self.block_ids.clone_from(&source.block_ids);
        self.prompt_ids.clone_from(&source.prompt_ids);
        self.block_hashes.clone_from(&source.block_hashes);
        self.logit_bias.clone_from(&source.logit_bias);
        self.end_ids.clone_from(&source.end_ids);
        // Option's `clone_from` reuses the vector when both hold one.
        self.live.clone_from(&source.live);
    }
}

impl ForwardInputs {
    /// Empties the buffers, keeping their capacity.
    pub fn clear(&mut self) {
        self.filled = false;
        self.entries.clear();
        self.block_ids.clear();
        self.prompt_ids.clear();
        self.block_hashes.clear();
        self.logit_bias.clear();
        self.end_ids.clear();
        self.live = None;
    }

    /// Appends one entry's block table; returns its span.
    pub fn push_blocks(&mut self, blocks: impl IntoIterator<Item = u32>) -> Span {
        let start = self.block_ids.len();
        self.block_ids.extend(blocks);
        Span::since(start, self.block_ids.len())
    }

    /// Appends a prompt's token ids and block hashes; returns their spans.
    pub fn push_prompt(&mut self, ids: &[u32], hashes: &[u64]) -> (Span, Span) {
        let start = self.prompt_ids.len();
        self.prompt_ids.extend_from_slice(ids);
        let prompt = Span::since(start, self.prompt_ids.len());
        let start = self.block_hashes.len();
        self.block_hashes.extend_from_slice(hashes);
        (prompt, Span::since(start, self.block_hashes.len()))
    }

    /// Appends a request's logit biases and end ids; returns their spans.
    pub fn push_logit_rules(&mut self, bias: &[TokenBias], end_ids: &[u32]) -> (Span, Span) {
        let start = self.logit_bias.len();
        self.logit_bias.extend_from_slice(bias);
        let bias = Span::since(start, self.logit_bias.len());
        let start = self.end_ids.len();
        self.end_ids.extend_from_slice(end_ids);
        (bias, Span::since(start, self.end_ids.len()))
    }
}

impl ScheduledBatch {
    /// Real (non-dummy) entries.
    pub fn real_entries(&self) -> impl Iterator<Item = &ForwardEntry> {
        self.entries.iter().filter(|e| !e.is_dummy)
    }

    /// Each entry with its [`EntryInputs`] (none when the batch carries no forward
    /// inputs).
    pub fn with_inputs(&self) -> impl Iterator<Item = (&ForwardEntry, &EntryInputs)> {
        self.entries.iter().zip(&self.inputs.entries)
    }
}

impl ForwardInputs {
    /// An entry's block table.
    pub fn block_table(&self, entry: &EntryInputs) -> &[u32] {
        self.block_ids.get(entry.blocks.range()).unwrap_or(&[])
    }

    /// A context entry's prompt token ids (empty: none carried).
    pub fn prompt_ids(&self, entry: &EntryInputs) -> &[u32] {
        self.prompt_ids.get(entry.prompt.range()).unwrap_or(&[])
    }

    /// A context entry's prompt block hashes.
    pub fn block_hashes(&self, entry: &EntryInputs) -> &[u64] {
        self.block_hashes.get(entry.hashes.range()).unwrap_or(&[])
    }

    /// An entry's logit biases (empty: none).
    pub fn logit_bias(&self, entry: &EntryInputs) -> &[TokenBias] {
        self.logit_bias.get(entry.logit_bias.range()).unwrap_or(&[])
    }

    /// An entry's end ids, masked before its `min_tokens` (empty: none).
    pub fn end_ids(&self, entry: &EntryInputs) -> &[u32] {
        self.end_ids.get(entry.end_ids.range()).unwrap_or(&[])
    }
}

/// What the backend returns for a batch: one sampled token per entry (the last accepted
/// one for a draft step), aligned with `entries`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForwardOutput {
    /// The batch these tokens belong to.
    pub batch: BatchNumber,
    /// One token per entry.
    pub sampled: Vec<u32>,
    /// `(entry index, its token's log-probabilities)` for the entries whose request
    /// asked for them, in entry order (empty when none did: nothing is computed).
    #[serde(default)]
    pub logprobs: Vec<(u32, TokenLogprobs)>,
}

/// Phase 8 contribution, gathered to rank 0 every iteration (even when empty).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankResponses {
    /// The rank.
    pub rank: RankId,
    /// Responses in the order they were produced.
    pub responses: Vec<Response>,
}

/// The transfer events this rank applies this iteration (§3.9: a consensus collective,
/// so every rank agrees on the iteration an event took effect).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TransferStatus {
    /// Events, in delivery order.
    pub events: Vec<TransferEvent>,
}

/// The [`Phase::Transfers`] contribution of a ctx or gen rank: its responses (for rank 0)
/// and its transfer status (for every rank), in one allgather.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResponsesAndStatus {
    /// This rank's responses.
    pub responses: RankResponses,
    /// This rank's transfer status.
    pub status: TransferStatus,
}
