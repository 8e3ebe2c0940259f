//! Requests: the state numbering of mechanisms.md §1, the schedulable window, and the
//! per-request bookkeeping a rank keeps.
//!
//! Guardrails: the window and readiness are published by the scheduler
//! ([`SchedulableWindow::published`]); nobody re-derives them. KV blocks are owned by the
//! KV manager (keyed by [`ReqId`]), not mirrored here.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::ids::{ConvId, RankId, ReqId, Seat};

/// Request states with the integer values of §1. Order is chronological:
/// `has_reached(s) == (self as i32 >= s as i32)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(i32)]
pub enum RequestState {
    /// Transfer failed.
    DisaggTransError = -1,
    /// Encoder phase (encoder-decoder models).
    EncoderInit = 1,
    /// ctx server, generation-first mode: waiting for the gen peer.
    DisaggContextWaitScheduler = 7,
    /// gen server: arrived, KV not yet received.
    DisaggGenerationInit = 8,
    /// gen server: KV receive in flight.
    DisaggGenerationTransInProgress = 9,
    /// Prefill pending (start of the schedulable window).
    ContextInit = 10,
    /// Layer-wise prefill while sending.
    DisaggContextInitAndTrans = 11,
    /// gen server: KV received, schedulable as generation.
    DisaggGenerationTransComplete = 12,
    /// Decoding.
    GenerationInProgress = 13,
    /// Overlap only: last token in flight (retiring).
    GenerationToComplete = 14,
    /// Done.
    GenerationComplete = 20,
    /// ctx server: prefill done, KV send in flight.
    DisaggContextTransInProgress = 21,
    /// ctx server: send finished.
    DisaggContextComplete = 22,
}

impl RequestState {
    /// The integer value used in logs and traces.
    pub fn as_int(self) -> i32 {
        self as i32
    }

    /// `state >= other` in the chronological order of §1.
    pub fn has_reached(self, other: RequestState) -> bool {
        self.as_int() >= other.as_int()
    }

    /// Retiring: the last token is in flight (overlap only).
    pub fn is_retiring(self) -> bool {
        self == RequestState::GenerationToComplete
    }

    /// A KV transfer state (either side) or a transfer error.
    pub fn is_transfer_state(self) -> bool {
        matches!(
            self,
            RequestState::DisaggGenerationInit
                | RequestState::DisaggGenerationTransInProgress
                | RequestState::DisaggContextInitAndTrans
                | RequestState::DisaggContextTransInProgress
                | RequestState::DisaggContextWaitScheduler
        )
    }
}

/// The scheduler's schedulable window `[no_schedule_until, no_schedule_after)` (§1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulableWindow {
    /// First state inside the window.
    pub no_schedule_until: RequestState,
    /// First state past the window.
    pub no_schedule_after: RequestState,
}

impl SchedulableWindow {
    /// The window the scheduler publishes: `[CONTEXT_INIT, GENERATION_TO_COMPLETE)`, with
    /// the lower bound at ENCODER_INIT for encoder-decoder models.
    pub fn published(encoder_decoder: bool) -> SchedulableWindow {
        SchedulableWindow {
            no_schedule_until: if encoder_decoder {
                RequestState::EncoderInit
            } else {
                RequestState::ContextInit
            },
            no_schedule_after: RequestState::GenerationToComplete,
        }
    }

    /// Whether `state` lies inside the window. Transfer-side states that sort inside the
    /// numeric range but belong to the ctx sender (11) or wait for a peer (7, 8, 9) are
    /// outside: only their own handlers move them.
    pub fn contains(&self, state: RequestState) -> bool {
        state.has_reached(self.no_schedule_until)
            && !state.has_reached(self.no_schedule_after)
            && !matches!(
                state,
                RequestState::DisaggContextWaitScheduler
                    | RequestState::DisaggGenerationInit
                    | RequestState::DisaggGenerationTransInProgress
                    | RequestState::DisaggContextInitAndTrans
            )
    }
}

/// A pin to an explicit DP rank (`attention_dp_rank`, §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedRank {
    /// The rank the request asks for.
    pub rank: RankId,
    /// Strict pins are placed before relaxed ones; a relaxed pin may fall back to routing.
    pub strict: bool,
}

/// How a model backend samples one request's tokens, when the request says
/// (`lockstep serve --model`: the body's `temperature`, `top_p`, `top_k`, `seed`, the
/// penalties and `min_tokens`). The control plane carries it and never reads it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RequestSampling {
    /// 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass, in (0, 1].
    pub top_p: f32,
    /// The k most likely tokens (0: all).
    pub top_k: u32,
    /// The request's random stream: the same seed and prompt give the same tokens.
    pub seed: u64,
    /// OpenAI's `presence_penalty`, in [-2, 2]: subtracted once from the logit of every
    /// token the output holds already.
    #[serde(default)]
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty`, in [-2, 2]: subtracted from a token's logit once
    /// per time the output holds it.
    #[serde(default)]
    pub frequency_penalty: f32,
    /// vLLM's `repetition_penalty`, above 0 (1: none): a token of the prompt or the
    /// output has a positive logit divided by it, a negative one multiplied.
    #[serde(default = "no_repetition_penalty")]
    pub repetition_penalty: f32,
    /// Output positions before this one cannot sample the ids of
    /// [`RequestSpec::end_ids`] (`min_tokens`).
    #[serde(default)]
    pub min_tokens: u32,
    /// `logprobs`: the sampled token's log-probability and those of this many most
    /// likely tokens are returned with it (`None`: none computed).
    #[serde(default)]
    pub logprobs: Option<u32>,
}

fn no_repetition_penalty() -> f32 {
    1.0
}

impl Default for RequestSampling {
    /// Greedy, no penalty.
    fn default() -> Self {
        RequestSampling {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            min_tokens: 0,
            logprobs: None,
        }
    }
}

// The API checks every field finite before a request is built, so equality is
// reflexive here (f32's only exception is NaN).
impl Eq for RequestSampling {}

/// One entry of a request's `logit_bias`: `bias` is added to token `token`'s logit
/// before sampling.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenBias {
    /// The token id.
    pub token: u32,
    /// In [-100, 100] (checked finite by the API).
    pub bias: f32,
}

impl Eq for TokenBias {}

/// What a client submits: everything a rank needs to serve the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestSpec {
    /// Unique, non-zero.
    pub id: ReqId,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Output tokens to generate (length stop; EOS is not modelled).
    pub max_new_tokens: u32,
    /// Conversation, for the conversation router.
    pub conversation: Option<ConvId>,
    /// Explicit DP rank.
    pub pinned: Option<PinnedRank>,
    /// Speculative draft tokens per step.
    pub draft_len: u32,
    /// One content hash per full prompt block of `tokens_per_block` tokens, in order; the
    /// KV manager chains them into prefix keys. Empty: no prefix reuse. Shared, not
    /// copied, by the front and every rank that holds the request (a replicated waiting
    /// queue holds one per rank).
    pub block_hashes: Arc<[u64]>,
    /// Disaggregated gen side: tokens already generated by the ctx server (the first
    /// token). 0 for aggregated and ctx servers.
    pub generated_before: u32,
    /// Disaggregated gen side: where the request's KV lives (ctx server and rank), as the
    /// front forwards it with the first token; the receive pulls from there.
    #[serde(default)]
    pub kv_source: Option<crate::vocab::KvAddress>,
    /// The prompt's token ids, when the client sent text a tokenizer turned into ids
    /// (`lockstep serve --model`): `prompt_len` of them. Empty: a model backend makes
    /// up a deterministic prompt (equal prefix blocks get equal tokens). The control
    /// plane itself only counts tokens.
    #[serde(default)]
    pub prompt_tokens: Vec<u32>,
    /// How a model backend samples this request (`None`: the run's setting).
    #[serde(default)]
    pub sampling: Option<RequestSampling>,
    /// A model backend adds these to the logits before sampling (`logit_bias`; empty:
    /// none). The control plane carries them and never reads them.
    #[serde(default)]
    pub logit_bias: Vec<TokenBias>,
    /// The ids that end this request's answer, which a model backend masks before
    /// output position [`RequestSampling::min_tokens`] (empty: nothing masked).
    #[serde(default)]
    pub end_ids: Vec<u32>,
}

impl RequestSpec {
    /// A plain request with no conversation, pin, draft or prefix hashes.
    pub fn new(id: u64, prompt_len: u32, max_new_tokens: u32) -> RequestSpec {
        RequestSpec {
            id: ReqId(id),
            prompt_len,
            max_new_tokens,
            conversation: None,
            pinned: None,
            draft_len: 0,
            block_hashes: Arc::default(),
            generated_before: 0,
            kv_source: None,
            prompt_tokens: Vec::new(),
            sampling: None,
            logit_bias: Vec::new(),
            end_ids: Vec::new(),
        }
    }
}

/// A request resident on a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// What the client asked for.
    pub spec: RequestSpec,
    /// Current state.
    pub state: RequestState,
    /// Output tokens produced so far (including `generated_before`).
    pub generated: u32,
    /// Tokens the prefill must cover: the prompt, or after a MAX_UTILIZATION pause the
    /// prompt plus the tokens generated so far (they are recomputed).
    pub context_len: u32,
    /// Prefill progress: tokens of `context_len` already in the KV cache (computed or
    /// reused).
    pub context_pos: u32,
    /// Tokens whose KV is in the cache (grows with prefill chunks and generation steps).
    pub kv_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub reused_tokens: u32,
    /// The seat, once the request has been scheduled (§7).
    pub seat: Option<Seat>,
    /// A pad dummy (§6): never a client request.
    pub is_dummy: bool,
    /// Output positions handed to launched steps so far: the position the next sampling
    /// step produces. Under overlap it runs ahead of `generated` by the step in flight.
    pub next_position: u32,
    /// gen side: when its KV receive started (the fetch's clock), for the transport
    /// budget's stale rule (§8).
    pub transfer_started_ns: Option<u64>,
    /// Whether the rank's KV manager holds a sequence (index slot and blocks) for it.
    /// The end-of-iteration leak check compares this view with the KV manager's.
    pub holds_kv: bool,
    /// Tokens the KV manager is known to hold blocks for (a lower bound; 0 without a
    /// sequence): a step that stays within it needs no KV call, which is most decode
    /// steps (a block holds many tokens).
    pub kv_room: u32,
    /// Rank-local admission number: the active list is sorted by it, so a batch entry
    /// finds its request by binary search however the list changed since scheduling.
    pub seq: u64,
    /// Readiness: a decoder request waiting for its encoder output is not ready.
    pub awaiting_encoder_output: bool,
}

impl Request {
    /// A new request in its arrival state.
    pub fn new(spec: RequestSpec, state: RequestState) -> Request {
        let generated = spec.generated_before;
        let context_len = spec.prompt_len;
        Request {
            spec,
            state,
            generated,
            context_len,
            context_pos: 0,
            kv_tokens: 0,
            reused_tokens: 0,
            seat: None,
            is_dummy: false,
            seq: 0,
            holds_kv: false,
            kv_room: 0,
            transfer_started_ns: None,
            next_position: generated,
            awaiting_encoder_output: false,
        }
    }

    /// The id.
    pub fn id(&self) -> ReqId {
        self.spec.id
    }

    /// Tokens one iteration produces for this request (`1 + draft`).
    pub fn tokens_per_iteration(&self) -> u32 {
        1 + self.spec.draft_len
    }

    /// §1: `generated + tokens_per_iteration >= max_new_tokens` (length only).
    pub fn will_complete_next_iteration(&self) -> bool {
        self.generated + self.tokens_per_iteration() >= self.spec.max_new_tokens
    }

    /// Tokens still to prefill.
    pub fn context_remaining(&self) -> u32 {
        self.context_len.saturating_sub(self.context_pos)
    }

    /// Whether the request is in its prefill phase.
    pub fn is_context(&self) -> bool {
        matches!(
            self.state,
            RequestState::ContextInit | RequestState::EncoderInit
        )
    }

    /// Whether the request's next step is a generation step.
    pub fn is_generation(&self) -> bool {
        matches!(
            self.state,
            RequestState::GenerationInProgress | RequestState::DisaggGenerationTransComplete
        )
    }

    /// Total tokens the request's KV holds at completion: prompt plus output.
    pub fn tokens_at_completion(&self) -> u32 {
        self.spec.prompt_len + self.spec.max_new_tokens
    }

    /// Tokens whose KV is in the cache: the prefilled tokens plus every generation step's
    /// input (the newest sampled token's KV is written by the step that consumes it).
    pub fn tokens_in_cache(&self) -> u32 {
        self.kv_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_integers_match_mechanisms_section_1() {
        let table = [
            (RequestState::EncoderInit, 1),
            (RequestState::DisaggContextWaitScheduler, 7),
            (RequestState::DisaggGenerationInit, 8),
            (RequestState::DisaggGenerationTransInProgress, 9),
            (RequestState::ContextInit, 10),
            (RequestState::DisaggContextInitAndTrans, 11),
            (RequestState::DisaggGenerationTransComplete, 12),
            (RequestState::GenerationInProgress, 13),
            (RequestState::GenerationToComplete, 14),
            (RequestState::GenerationComplete, 20),
            (RequestState::DisaggContextTransInProgress, 21),
            (RequestState::DisaggContextComplete, 22),
            (RequestState::DisaggTransError, -1),
        ];
        for (i, (state, int)) in table.iter().enumerate() {
            assert_eq!(state.as_int(), *int, "#{i}: {state:?}");
        }
        assert!(RequestState::GenerationComplete.has_reached(RequestState::GenerationToComplete));
        assert!(!RequestState::ContextInit.has_reached(RequestState::GenerationInProgress));
    }

    #[test]
    fn published_window_excludes_retiring_and_transfer_waits() {
        let w = SchedulableWindow::published(false);
        assert!(w.contains(RequestState::ContextInit));
        assert!(w.contains(RequestState::GenerationInProgress));
        assert!(w.contains(RequestState::DisaggGenerationTransComplete));
        assert!(!w.contains(RequestState::GenerationToComplete));
        assert!(!w.contains(RequestState::DisaggGenerationInit));
        assert!(!w.contains(RequestState::DisaggGenerationTransInProgress));
        assert!(!w.contains(RequestState::EncoderInit));
        assert!(SchedulableWindow::published(true).contains(RequestState::EncoderInit));
    }

    #[test]
    fn will_complete_next_iteration_is_length_only() {
        let mut r = Request::new(
            RequestSpec::new(1, 8, 3),
            RequestState::GenerationInProgress,
        );
        r.generated = 1;
        assert!(!r.will_complete_next_iteration());
        r.generated = 2;
        assert!(r.will_complete_next_iteration());
        r.spec.draft_len = 1;
        r.generated = 1;
        assert!(r.will_complete_next_iteration());
    }
}

/// What reaches a server's rank 0 through its ingress queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum IngressItem {
    /// A new request.
    Request(RequestSpec),
    /// Cancel a request.
    Cancel(ReqId),
    /// Finish the work in hand, then stop.
    Shutdown,
    /// ctx server, generation-first mode: this request's gen peer is named.
    PeerReady(ReqId),
    /// Something concerning the server happened elsewhere (a transfer event reached one
    /// of its ranks): a waiting rank 0 should run an iteration. Carries no data.
    Wake,
}
