//! Server configuration (TensorRT-LLM key names where one exists) and every derived size,
//! computed in one place: [`ServerConfig::derive`].
//!
//! The types are serde-derived; parsing them (TOML, files) is the loading layer's job
//! (`cluster::scenario`). Unknown keys are rejected with the key's name; sizes are read as
//! signed integers so that a negative value gets our own error naming the field and the
//! value.

use serde::{Deserialize, Serialize};

use crate::policy::Policy;
use crate::seats::{self, SeatInputs, SeatSkew, SlotPools};

/// A configuration error. Each names the field and the offending value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// A size that must be positive is zero or negative.
    #[error("server `{server}`: `{field}` must be a positive integer, got {value}")]
    NotPositive {
        /// Server name.
        server: String,
        /// Key.
        field: &'static str,
        /// Value given.
        value: i64,
    },
    /// A count that may be zero is negative.
    #[error("server `{server}`: `{field}` must be an integer >= 0, got {value}")]
    Negative {
        /// Server name.
        server: String,
        /// Key.
        field: &'static str,
        /// Value given.
        value: i64,
    },
    /// A size too large for the runtime's counters.
    #[error("server `{server}`: `{field}` = {value} is too large (at most {max})")]
    TooLarge {
        /// Server name.
        server: String,
        /// Key.
        field: &'static str,
        /// Value given.
        value: i64,
        /// Largest accepted.
        max: i64,
    },
    /// `tensor_parallel_size * pipeline_parallel_size` differs from the ranks given.
    #[error(
        "server `{server}`: tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}) = {product} \
         does not match ranks = {ranks}"
    )]
    RanksMismatch {
        /// Server name.
        server: String,
        /// tp.
        tp: u32,
        /// pp.
        pp: u32,
        /// tp*pp.
        product: u32,
        /// Ranks given.
        ranks: u32,
    },
    /// Two keys whose values cannot go together.
    #[error("server `{server}`: {message}")]
    Inconsistent {
        /// Server name.
        server: String,
        /// What is wrong, naming both keys and values.
        message: String,
    },
    /// A seat-indexed pool disagrees with the seats.
    #[error(
        "server `{server}`: {skew} (refused under the fixed policy; `--set policy.seats.rederive=true` or `--policy legacy` runs it anyway, the skew then a note under the report)"
    )]
    SeatSkew {
        /// Server name.
        server: String,
        /// The skew, naming both numbers.
        skew: SeatSkew,
    },
}

/// The role of a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode.
    #[default]
    Agg,
    /// Prefill only; hands KV to a gen server.
    Ctx,
    /// Decode only; receives KV.
    Gen,
}

impl Role {
    /// The name used in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Role::Agg => "agg",
            Role::Ctx => "ctx",
            Role::Gen => "gen",
        }
    }
}

/// Capacity scheduler policies (§4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum CapacitySchedulerPolicy {
    /// Reserve blocks to completion; never evict.
    #[default]
    #[serde(rename = "GUARANTEED_NO_EVICT")]
    GuaranteedNoEvict,
    /// Schedule while one more step fits; pause the newest otherwise.
    #[serde(rename = "MAX_UTILIZATION")]
    MaxUtilization,
    /// New work only when nothing is in progress.
    #[serde(rename = "STATIC_BATCH")]
    StaticBatch,
}

/// Chunked-prefill policies (§4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum ContextChunkingPolicy {
    /// The first contexts get their whole remaining prompt; the last one is chunked.
    #[default]
    #[serde(rename = "FIRST_COME_FIRST_SERVED")]
    FirstComeFirstServed,
    /// Every context advances by one chunk unit per round.
    #[serde(rename = "EQUAL_PROGRESS")]
    EqualProgress,
}

/// `scheduler_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Capacity policy.
    pub capacity_scheduler_policy: CapacitySchedulerPolicy,
    /// Chunking policy.
    pub context_chunking_policy: ContextChunkingPolicy,
}

/// `kv_cache_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvCacheConfig {
    /// Tokens per KV block.
    pub tokens_per_block: i64,
    /// KV capacity per rank in tokens.
    pub max_tokens: i64,
    /// Prefix reuse on.
    pub enable_block_reuse: bool,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        KvCacheConfig {
            tokens_per_block: 32,
            max_tokens: 1 << 20,
            enable_block_reuse: true,
        }
    }
}

/// The ADP router (§5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RouterKind {
    /// Longest prompt first to the least-loaded rank.
    #[default]
    Balanced,
    /// Sticky by conversation id.
    Conversation,
    /// Longest cached prefix, balanced by load.
    KvAware,
}

/// `attention_dp_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AttentionDpConfig {
    /// Which router.
    pub router: RouterKind,
    /// TensorRT-LLM's ADP balance: hold context phases so that ranks start them together
    /// (`executor/balance.rs`). Off by default, as in TensorRT-LLM.
    pub enable_balance: bool,
    /// Balance: how many iterations a context phase waits for every rank to have context
    /// work (TensorRT-LLM's default, 50).
    pub timeout_iters: i64,
    /// Balance: once every rank has context work, how many more iterations contexts
    /// accumulate before they run (TensorRT-LLM's default, 10).
    pub batching_wait_iters: i64,
}

impl Default for AttentionDpConfig {
    fn default() -> Self {
        AttentionDpConfig {
            router: RouterKind::default(),
            enable_balance: false,
            timeout_iters: 50,
            batching_wait_iters: 10,
        }
    }
}

/// `cache_transceiver_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheTransceiverConfig {
    /// Transport budget of the gen server, in tokens (§8).
    pub max_tokens_in_buffer: i64,
    /// Per-transfer timeout, from the start of each side's part (the gen rank's receive,
    /// the ctx rank's answer to the pull).
    pub kv_transfer_timeout_ms: i64,
    /// How long a ctx rank holds a request's KV for a gen rank that has not pulled it yet
    /// (the request waits in the gen server's queue meanwhile); then it is released and
    /// the request fails. vLLM's prefill instances use the same bound, 480 s.
    pub kv_pull_timeout_ms: i64,
    /// ctx server, generation-first mode (§8): an arriving request waits in
    /// DISAGG_CONTEXT_WAIT_SCHEDULER until the front names its gen peer; the promotion
    /// is a transfer event, so every rank applies it in the same consensus phase.
    pub generation_first: bool,
}

impl Default for CacheTransceiverConfig {
    fn default() -> Self {
        CacheTransceiverConfig {
            max_tokens_in_buffer: 8192,
            kv_transfer_timeout_ms: 30_000,
            kv_pull_timeout_ms: crate::vocab::DEFAULT_PULL_TIMEOUT_MS as i64,
            generation_first: false,
        }
    }
}

/// Explicit sizes for seat-indexed pools. Absent: sized from the seats (the only correct
/// choice; an explicit size exists to reproduce deployments whose pools were configured
/// separately, and the validator rejects any that differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SlotPoolOverrides {
    /// Seat pool.
    pub seat_pool: Option<i64>,
    /// KV index pool.
    pub kv_index_pool: Option<i64>,
    /// Sampler slots.
    pub sampler_pool: Option<i64>,
    /// Speculative-decoding slots.
    pub draft_pool: Option<i64>,
}

/// One server of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Name used in reports and errors.
    pub name: String,
    /// agg, ctx or gen.
    pub role: Role,
    /// Ranks the server is launched with; when given it must equal tp*pp.
    pub ranks: Option<i64>,
    /// TP size; with attention DP this is the number of DP ranks.
    pub tensor_parallel_size: i64,
    /// Pipeline stages.
    pub pipeline_parallel_size: i64,
    /// Attention data parallelism.
    pub enable_attention_dp: bool,
    /// B: per-rank forward batch.
    pub max_batch_size: i64,
    /// T: per-rank token budget of one forward.
    pub max_num_tokens: i64,
    /// Overlap scheduler off.
    pub disable_overlap_scheduler: bool,
    /// Chunked prefill.
    pub enable_chunked_prefill: bool,
    /// Speculative draft tokens per step (0: none).
    pub max_draft_len: i64,
    /// Encoder-decoder model (window starts at ENCODER_INIT).
    pub encoder_decoder: bool,
    /// Hybrid / SSM model (no seat headroom).
    pub hybrid_model: bool,
    /// Scheduler.
    pub scheduler_config: SchedulerConfig,
    /// KV cache.
    pub kv_cache_config: KvCacheConfig,
    /// ADP router.
    pub attention_dp_config: AttentionDpConfig,
    /// Transceiver (ctx/gen).
    pub cache_transceiver_config: CacheTransceiverConfig,
    /// Explicit pool sizes (normally absent).
    pub slot_pools: SlotPoolOverrides,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            name: "server0".into(),
            role: Role::Agg,
            ranks: None,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            enable_attention_dp: true,
            max_batch_size: 8,
            max_num_tokens: 8192,
            disable_overlap_scheduler: false,
            enable_chunked_prefill: false,
            max_draft_len: 0,
            encoder_decoder: false,
            hybrid_model: false,
            scheduler_config: SchedulerConfig::default(),
            kv_cache_config: KvCacheConfig::default(),
            attention_dp_config: AttentionDpConfig::default(),
            cache_transceiver_config: CacheTransceiverConfig::default(),
            slot_pools: SlotPoolOverrides::default(),
        }
    }
}

/// Every size the runtime uses, derived once from a [`ServerConfig`] and a [`Policy`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DerivedSizes {
    /// DP ranks (tp with attention DP, else 1: one attention batch for the TP group).
    pub dp: u32,
    /// Tensor parallel size.
    pub tp: u32,
    /// Pipeline stages.
    pub pp: u32,
    /// B.
    pub max_batch_size: u32,
    /// T.
    pub max_num_tokens: u32,
    /// Draft tokens per step.
    pub draft_len: u32,
    /// M: requests admitted per rank, `pp*B` tightened to `T/(1+draft)` (§3.3).
    pub max_admitted_per_rank: u32,
    /// `dp * M`.
    pub capacity: u32,
    /// §7 seats.
    pub seats: u32,
    /// The pools as they will be built (may differ from seats only under
    /// `seats.rederive`, or with explicit overrides, which the validator rejects).
    pub pools: SlotPools,
    /// Tokens per KV block.
    pub tokens_per_block: u32,
    /// KV blocks per rank.
    pub kv_blocks_per_rank: u32,
    /// Transport budget in blocks (§8): `ceil(max_tokens_in_buffer / tokens_per_block)`.
    pub transfer_budget_blocks: u32,
    /// Overlap scheduler on.
    pub overlap: bool,
}

/// The derivation's result: sizes, plus a warning when the legacy switch lets a skew
/// through.
#[derive(Debug, Clone, PartialEq)]
pub struct Derived {
    /// The sizes.
    pub sizes: DerivedSizes,
    /// The skew reported as a warning under `seats.rederive`.
    pub warning: Option<String>,
}

/// Ranks of one server at most (`tensor_parallel_size`).
pub const MAX_RANKS: u32 = 4096;
/// Pipeline stages at most.
pub const MAX_PIPELINE: u32 = 64;
/// `max_batch_size` at most.
pub const MAX_BATCH: u32 = 65_536;
/// `max_draft_len` at most (a step of `1 + draft` tokens must fit the counters).
pub const MAX_DRAFT: u32 = 65_536;
/// KV blocks over all ranks of a server at most (~24 bytes of bookkeeping each, so under
/// 1 GiB), which caps `kv_cache_config.max_tokens` per rank far above any GPU's KV.
pub const MAX_KV_BLOCKS_PER_SERVER: u32 = 1 << 25;

fn positive(server: &str, field: &'static str, value: i64) -> Result<u32, ConfigError> {
    const MAX: i64 = 1 << 30;
    if value <= 0 {
        return Err(ConfigError::NotPositive {
            server: server.to_string(),
            field,
            value,
        });
    }
    if value > MAX {
        return Err(ConfigError::TooLarge {
            server: server.to_string(),
            field,
            value,
            max: MAX,
        });
    }
    Ok(value as u32)
}

/// A count that may be zero (an iteration count), capped like every size.
fn non_negative(server: &str, field: &'static str, value: i64) -> Result<u32, ConfigError> {
    if value < 0 {
        return Err(ConfigError::Negative {
            server: server.to_string(),
            field,
            value,
        });
    }
    if value == 0 {
        return Ok(0);
    }
    positive(server, field, value)
}

impl ServerConfig {
    /// Whether the overlap scheduler runs.
    pub fn overlap(&self) -> bool {
        !self.disable_overlap_scheduler
    }

    /// Validates every value and derives every size. The only place sizes are computed.
    pub fn derive(&self, policy: &Policy) -> Result<Derived, ConfigError> {
        let name = self.name.as_str();
        let tp = positive(name, "tensor_parallel_size", self.tensor_parallel_size)?;
        let pp = positive(name, "pipeline_parallel_size", self.pipeline_parallel_size)?;
        let b = positive(name, "max_batch_size", self.max_batch_size)?;
        let t = positive(name, "max_num_tokens", self.max_num_tokens)?;
        let tpb = positive(
            name,
            "kv_cache_config.tokens_per_block",
            self.kv_cache_config.tokens_per_block,
        )?;
        let kv_tokens = positive(
            name,
            "kv_cache_config.max_tokens",
            self.kv_cache_config.max_tokens,
        )?;
        let buffer = positive(
            name,
            "cache_transceiver_config.max_tokens_in_buffer",
            self.cache_transceiver_config.max_tokens_in_buffer,
        )?;
        positive(
            name,
            "cache_transceiver_config.kv_transfer_timeout_ms",
            self.cache_transceiver_config.kv_transfer_timeout_ms,
        )?;
        positive(
            name,
            "cache_transceiver_config.kv_pull_timeout_ms",
            self.cache_transceiver_config.kv_pull_timeout_ms,
        )?;
        if self.max_draft_len < 0 {
            return Err(ConfigError::NotPositive {
                server: name.to_string(),
                field: "max_draft_len",
                value: self.max_draft_len,
            });
        }
        if self.max_draft_len > i64::from(MAX_DRAFT) {
            return Err(ConfigError::TooLarge {
                server: name.to_string(),
                field: "max_draft_len",
                value: self.max_draft_len,
                max: MAX_DRAFT.into(),
            });
        }
        let draft = self.max_draft_len as u32;
        let adp = &self.attention_dp_config;
        non_negative(name, "attention_dp_config.timeout_iters", adp.timeout_iters)?;
        non_negative(
            name,
            "attention_dp_config.batching_wait_iters",
            adp.batching_wait_iters,
        )?;
        if let Some(ranks) = self.ranks {
            let ranks = positive(name, "ranks", ranks)?;
            if ranks != tp * pp {
                return Err(ConfigError::RanksMismatch {
                    server: name.to_string(),
                    tp,
                    pp,
                    product: tp * pp,
                    ranks,
                });
            }
        }
        if kv_tokens < tpb {
            return Err(ConfigError::Inconsistent {
                server: name.to_string(),
                message: format!(
                    "kv_cache_config.max_tokens = {kv_tokens} is smaller than one block \
                     (kv_cache_config.tokens_per_block = {tpb})"
                ),
            });
        }
        if t < 1 + draft {
            return Err(ConfigError::Inconsistent {
                server: name.to_string(),
                message: format!(
                    "max_num_tokens = {t} cannot hold one generation step of 1 + max_draft_len = {} tokens",
                    1 + draft
                ),
            });
        }
        // A prefill chunk is a whole number of KV blocks: a budget below one block would
        // round every chunk down to nothing, and a long prompt would never start (§4). A
        // gen server never prefills (a MAX_UTILIZATION pause never picks a request whose
        // recompute could not run there).
        if self.enable_chunked_prefill && t < tpb && self.role != Role::Gen {
            return Err(ConfigError::Inconsistent {
                server: name.to_string(),
                message: format!(
                    "max_num_tokens = {t} is smaller than one KV block \
                     (kv_cache_config.tokens_per_block = {tpb}): with chunked prefill a chunk \
                     is a whole number of blocks, so no chunk could ever run"
                ),
            });
        }
        // Every rank is a thread or a process and holds its pools in memory: sizes far
        // beyond any deployment are refused naming the key, before anything allocates.
        let too_large = |field: &'static str, value: i64, max: i64| ConfigError::TooLarge {
            server: name.to_string(),
            field,
            value,
            max,
        };
        if tp > MAX_RANKS {
            return Err(too_large(
                "tensor_parallel_size",
                tp.into(),
                MAX_RANKS.into(),
            ));
        }
        if pp > MAX_PIPELINE {
            return Err(too_large(
                "pipeline_parallel_size",
                pp.into(),
                MAX_PIPELINE.into(),
            ));
        }
        if b > MAX_BATCH {
            return Err(too_large("max_batch_size", b.into(), MAX_BATCH.into()));
        }
        let max_kv_tokens = i64::from(MAX_KV_BLOCKS_PER_SERVER / tp.max(1)) * i64::from(tpb);
        if i64::from(kv_tokens) > max_kv_tokens {
            return Err(too_large(
                "kv_cache_config.max_tokens",
                kv_tokens.into(),
                max_kv_tokens,
            ));
        }
        let dp = if self.enable_attention_dp { tp } else { 1 };
        let m = (pp * b).min(t / (1 + draft));
        let seats = seats::max_num_sequences(SeatInputs {
            pp,
            max_batch_size: b,
            overlap: self.overlap(),
            attention_dp: self.enable_attention_dp,
            disaggregated: self.role != Role::Agg,
            hybrid: self.hybrid_model,
        });
        let o = &self.slot_pools;
        let pool = |field: &'static str, v: Option<i64>, default: u32| match v {
            Some(v) => positive(name, field, v),
            None => Ok(default),
        };
        let index_default = if policy.seats.rederive {
            seats::legacy_rederived_index_pool(pp, b)
        } else {
            seats
        };
        let pools = SlotPools {
            seat_pool: pool("slot_pools.seat_pool", o.seat_pool, seats)?,
            kv_index_pool: pool("slot_pools.kv_index_pool", o.kv_index_pool, index_default)?,
            sampler_pool: pool("slot_pools.sampler_pool", o.sampler_pool, seats)?,
            draft_pool: pool("slot_pools.draft_pool", o.draft_pool, seats)?,
        };
        let warning = match seats::validate_pools(seats, &pools) {
            Ok(()) => None,
            Err(skew) if policy.seats.rederive => Some(format!(
                "server `{name}`: {skew} (continuing: seats.rederive is the legacy behaviour)"
            )),
            Err(skew) => {
                return Err(ConfigError::SeatSkew {
                    server: name.to_string(),
                    skew,
                });
            }
        };
        Ok(Derived {
            sizes: DerivedSizes {
                dp,
                tp,
                pp,
                max_batch_size: b,
                max_num_tokens: t,
                draft_len: draft,
                max_admitted_per_rank: m,
                capacity: dp * m,
                seats,
                pools,
                tokens_per_block: tpb,
                kv_blocks_per_rank: kv_tokens / tpb,
                transfer_budget_blocks: buffer.div_ceil(tpb),
                overlap: self.overlap(),
            },
            warning,
        })
    }
}

/// The sizes of a request that decide whether a server can ever serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestShape {
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Output tokens.
    pub max_new_tokens: u32,
    /// Draft tokens per step.
    pub draft_len: u32,
    /// The DP rank it is pinned to, if any (`attention_dp_rank`).
    pub pinned_rank: Option<u32>,
}

impl RequestShape {
    /// A request's shape.
    pub fn of(spec: &crate::request::RequestSpec) -> RequestShape {
        RequestShape {
            prompt_len: spec.prompt_len,
            max_new_tokens: spec.max_new_tokens,
            draft_len: spec.draft_len,
            pinned_rank: spec.pinned.map(|p| p.rank.0),
        }
    }
}

/// Whether a context of `context_len` tokens (a prompt, or a paused request's
/// recompute) with `draft_len` draft tokens can ever run in a forward of `max_num_tokens`
/// tokens: whole, or, with chunked prefill, a block-sized chunk at a time (§4: a chunk
/// that does not finish the context is a whole number of blocks, and the draft rides
/// with it).
pub fn context_can_run(
    context_len: u32,
    draft_len: u32,
    max_num_tokens: u32,
    chunked_prefill: bool,
    tokens_per_block: u32,
) -> bool {
    let t = u64::from(max_num_tokens);
    let draft = u64::from(draft_len);
    u64::from(context_len) + draft <= t
        || (chunked_prefill && u64::from(tokens_per_block) + draft <= t)
}

/// What a server can run: the limits every request's shape is checked against, by the
/// server's ranks when it arrives and by the front when it picks a server for it (and
/// by `lockstep serve` before anything reaches the front). One rule, so the front never
/// sends a request where it would be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Chunked prefill on.
    pub chunked_prefill: bool,
    /// T.
    pub max_num_tokens: u32,
    /// Tokens per KV block.
    pub tokens_per_block: u32,
    /// KV blocks per rank.
    pub kv_blocks_per_rank: u32,
    /// `max_draft_len`.
    pub max_draft_len: u32,
    /// DP ranks.
    pub dp: u32,
}

impl ServerLimits {
    /// No limit at all (tests, and hosts that leave the check to the ranks).
    pub const UNBOUNDED: ServerLimits = ServerLimits {
        chunked_prefill: true,
        max_num_tokens: u32::MAX,
        tokens_per_block: 1,
        kv_blocks_per_rank: u32::MAX,
        max_draft_len: u32::MAX,
        dp: u32::MAX,
    };

    /// A server's limits, from its configuration and derived sizes.
    pub fn of(config: &ServerConfig, sizes: &DerivedSizes) -> ServerLimits {
        ServerLimits {
            chunked_prefill: config.enable_chunked_prefill,
            max_num_tokens: sizes.max_num_tokens,
            tokens_per_block: sizes.tokens_per_block,
            kv_blocks_per_rank: sizes.kv_blocks_per_rank,
            max_draft_len: sizes.draft_len,
            dp: sizes.dp,
        }
    }

    /// Why a server of `role` with these limits can never run a request of this shape,
    /// if it cannot.
    pub fn refusal(&self, role: Role, r: &RequestShape) -> Option<SizeRefusal> {
        if r.draft_len > self.max_draft_len {
            return Some(SizeRefusal::Draft {
                draft_len: r.draft_len,
                max_draft_len: self.max_draft_len,
            });
        }
        if let Some(rank) = r.pinned_rank
            && rank >= self.dp
        {
            return Some(SizeRefusal::Pin { rank, dp: self.dp });
        }
        // A gen server receives the prompt's KV; only prefilling servers compute it. (A
        // MAX_UTILIZATION pause recomputes a context anywhere; the capacity scheduler
        // never pauses a request whose recompute could not run, §4.)
        if role != Role::Gen
            && !context_can_run(
                r.prompt_len,
                r.draft_len,
                self.max_num_tokens,
                self.chunked_prefill,
                self.tokens_per_block,
            )
        {
            return Some(SizeRefusal::Prompt {
                prompt_len: r.prompt_len,
                draft_len: r.draft_len,
                max_num_tokens: self.max_num_tokens,
                chunk_tokens: self.chunked_prefill.then_some(self.tokens_per_block),
            });
        }
        let total = u64::from(r.prompt_len) + u64::from(r.max_new_tokens);
        let blocks = total.div_ceil(u64::from(self.tokens_per_block.max(1)));
        if blocks > u64::from(self.kv_blocks_per_rank) {
            return Some(SizeRefusal::KvBlocks {
                prompt_len: r.prompt_len,
                max_new_tokens: r.max_new_tokens,
                blocks,
                blocks_per_rank: self.kv_blocks_per_rank,
            });
        }
        None
    }
}

/// Why a server can never run a request: the limit, with the request's numbers and the
/// server's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum SizeRefusal {
    /// The prompt cannot go through a forward: longer than `max_num_tokens` without
    /// chunked prefill, or with chunked prefill whose budget holds not even one block
    /// with the draft.
    #[error("{}", prompt_text(*.prompt_len, *.draft_len, *.max_num_tokens, *.chunk_tokens))]
    Prompt {
        /// Prompt tokens.
        prompt_len: u32,
        /// Draft tokens per step.
        draft_len: u32,
        /// T.
        max_num_tokens: u32,
        /// With chunked prefill, the smallest chunk (one block).
        chunk_tokens: Option<u32>,
    },
    /// Prompt plus output need more KV blocks than a rank has.
    #[error(
        "prompt_len {prompt_len} + max_new_tokens {max_new_tokens} needs {blocks} KV blocks, a rank has {blocks_per_rank}"
    )]
    KvBlocks {
        /// Prompt tokens.
        prompt_len: u32,
        /// Output tokens.
        max_new_tokens: u32,
        /// Blocks needed.
        blocks: u64,
        /// Blocks a rank has.
        blocks_per_rank: u32,
    },
    /// More draft tokens than the server's `max_draft_len`.
    #[error("draft_len {draft_len} exceeds the server's max_draft_len {max_draft_len}")]
    Draft {
        /// Asked for.
        draft_len: u32,
        /// The server's.
        max_draft_len: u32,
    },
    /// Pinned to a DP rank the server does not have.
    #[error("attention_dp_rank {rank} is out of range for dp = {dp}")]
    Pin {
        /// The rank asked for.
        rank: u32,
        /// The server's DP ranks.
        dp: u32,
    },
}

fn prompt_text(prompt_len: u32, draft_len: u32, t: u32, chunk: Option<u32>) -> String {
    let prompt = if draft_len == 0 {
        format!("prompt_len {prompt_len}")
    } else {
        format!("prompt_len {prompt_len} + draft_len {draft_len}")
    };
    match chunk {
        None => format!("{prompt} exceeds max_num_tokens {t} with chunked prefill off"),
        Some(block) => format!(
            "{prompt} exceeds max_num_tokens {t}, which cannot hold a chunk of one KV block \
             ({block} tokens) with the draft either"
        ),
    }
}

impl SizeRefusal {
    /// The configuration key whose value is the limit.
    pub fn field(&self) -> &'static str {
        match self {
            SizeRefusal::Prompt { .. } => "max_num_tokens",
            SizeRefusal::KvBlocks { .. } => "kv_cache_config.max_tokens",
            SizeRefusal::Draft { .. } => "max_draft_len",
            SizeRefusal::Pin { .. } => "tensor_parallel_size",
        }
    }
}

/// No server of a role can run a request: each server's refusal, in server order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}", list(.servers))]
pub struct Unservable {
    /// The role the request needed.
    pub role: Role,
    /// `(server name, why)` for every server of the role.
    pub servers: Vec<(String, SizeRefusal)>,
}

fn list(servers: &[(String, SizeRefusal)]) -> String {
    let parts: Vec<String> = servers
        .iter()
        .map(|(name, why)| format!("server `{name}`: {why}"))
        .collect();
    parts.join("; ")
}

/// The roles a request needs, in order: an aggregated server, or a ctx server and
/// (unless its one output token comes from the ctx server) a gen server.
pub fn roles_needed(disaggregated: bool, max_new_tokens: u32) -> &'static [Role] {
    match (disaggregated, max_new_tokens > 1) {
        (false, _) => &[Role::Agg],
        (true, true) => &[Role::Ctx, Role::Gen],
        (true, false) => &[Role::Ctx],
    }
}

/// Why no server of `role` among `servers` (`(name, role, limits)`, in server order)
/// can run a request of shape `r`, if none can.
pub fn unservable<'a>(
    role: Role,
    servers: impl IntoIterator<Item = (&'a str, Role, &'a ServerLimits)>,
    r: &RequestShape,
) -> Option<Unservable> {
    let mut why = Vec::new();
    for (name, server_role, limits) in servers {
        if server_role != role {
            continue;
        }
        match limits.refusal(role, r) {
            None => return None,
            Some(w) => why.push((name.to_string(), w)),
        }
    }
    Some(Unservable { role, servers: why })
}
