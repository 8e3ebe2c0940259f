//! FLOPs and bytes of every op of one forward on one GPU of a rank, summed over the
//! layers they occur in, and their roofline times.

use lockstep_actors::executor::BatchShape;

use super::{Attention, Deployment, Precision};

/// One context chunk of a forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextChunk {
    /// Tokens computed in this forward.
    pub tokens: u64,
    /// Tokens of the same request already in the KV cache (a reused prefix or earlier
    /// chunks), attended by every new token.
    pub cached: u64,
}

/// What one rank runs in one forward.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ForwardBatch {
    /// Context chunks.
    pub context: Vec<ContextChunk>,
    /// Generation requests.
    pub generation_requests: u64,
    /// Tokens each generation request computes (1, or 1 + draft tokens).
    pub tokens_per_generation_request: u64,
    /// Cached tokens attended, summed over the generation requests.
    pub generation_cached_tokens: u64,
}

impl ForwardBatch {
    /// `requests` prompts of `tokens` each, nothing cached.
    pub fn prefill(requests: u64, tokens: u64) -> ForwardBatch {
        ForwardBatch {
            context: vec![
                ContextChunk { tokens, cached: 0 };
                usize::try_from(requests).unwrap_or(0)
            ],
            ..ForwardBatch::default()
        }
    }

    /// `requests` generation steps of one token, each over `context` cached tokens.
    pub fn decode(requests: u64, context: u64) -> ForwardBatch {
        ForwardBatch {
            generation_requests: requests,
            tokens_per_generation_request: 1,
            generation_cached_tokens: requests * context,
            ..ForwardBatch::default()
        }
    }

    /// Tokens that pass through the weights.
    pub fn tokens(&self) -> u64 {
        self.context_tokens() + self.generation_tokens()
    }

    fn context_tokens(&self) -> u64 {
        self.context.iter().map(|c| c.tokens).sum()
    }

    fn generation_tokens(&self) -> u64 {
        self.generation_requests * self.tokens_per_generation_request
    }

    /// The batch as the simulator's cost model sees it.
    pub fn shape(&self) -> BatchShape {
        let sat = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
        BatchShape {
            ctx_requests: sat(self.context.len() as u64),
            ctx_tokens: sat(self.context_tokens()),
            ctx_attention: self
                .context
                .iter()
                .map(|c| c.tokens * (c.cached + c.tokens))
                .sum(),
            gen_requests: sat(self.generation_requests),
            gen_tokens: sat(self.generation_tokens()),
            gen_kv_tokens: self.generation_cached_tokens,
            dummies: 0,
        }
    }
}

/// What an op is limited by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// A GEMM over weights in the given precision.
    Gemm(Precision),
    /// Attention math (BF16 tensor cores).
    Attention,
    /// A collective over NVLink (`true`) or the network.
    Collective {
        /// Over NVLink rather than the network.
        nvlink: bool,
        /// Collective calls (each pays one latency).
        calls: u64,
    },
}

/// The FLOPs and bytes of one op on one GPU, over all layers it occurs in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Op {
    /// What it is.
    pub name: &'static str,
    /// How it is timed.
    pub kind: OpKind,
    /// Floating-point operations.
    pub flops: f64,
    /// HBM bytes read and written, or for a collective the bytes each GPU sends.
    pub bytes: f64,
}

/// Which side of the roofline an op sits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Tensor-core throughput.
    Compute,
    /// HBM bandwidth.
    Memory,
    /// Link bandwidth and latency.
    Link,
}

impl Bound {
    /// A short word for tables.
    pub fn name(self) -> &'static str {
        match self {
            Bound::Compute => "compute",
            Bound::Memory => "memory",
            Bound::Link => "link",
        }
    }
}

/// An op with its time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedOp {
    /// The op.
    pub op: Op,
    /// Its time in nanoseconds.
    pub ns: f64,
    /// What limits it.
    pub bound: Bound,
    /// The part of `ns` that is fixed latency (collectives only; 0 otherwise).
    pub latency_ns: f64,
}

/// One forward's ops and their sum.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardTime {
    /// Every op with work, in forward order.
    pub ops: Vec<TimedOp>,
}

impl ForwardTime {
    /// The forward's time in nanoseconds (ops in series).
    pub fn ns(&self) -> f64 {
        self.ops.iter().map(|o| o.ns).sum()
    }

    /// The fixed latency of the forward's collectives.
    pub fn latency_ns(&self) -> f64 {
        self.ops.iter().map(|o| o.latency_ns).sum()
    }

    /// FLOPs of the forward on one GPU.
    pub fn flops(&self) -> f64 {
        self.ops.iter().map(|o| o.op.flops).sum()
    }
}

/// BF16 activations between ops.
const ACTIVATION_BYTES: f64 = 2.0;
/// FP32 logits.
const LOGIT_BYTES: f64 = 4.0;

/// The ops of `batch` on one GPU of a rank of `d`.
pub fn ops(d: &Deployment, batch: &ForwardBatch) -> Vec<Op> {
    let a = &d.architecture;
    let p = &d.parameters;
    let tp = f64::from(d.parallelism.tp);
    let h = a.hidden_size as f64;
    let w = d.weight_precision.bytes();
    let tokens = batch.tokens() as f64;
    let layers = a.layers as f64;
    let kv_token_layer = d.kv_bytes_per_token_per_gpu() / layers;
    let mut ops = Vec::new();
    let gemm = |name, params_per_gpu: f64, tokens: f64, extra_bytes: f64, precision| Op {
        name,
        kind: OpKind::Gemm(precision),
        flops: 2.0 * tokens * params_per_gpu,
        bytes: params_per_gpu * precision_bytes(precision, w) + extra_bytes,
    };

    // Attention projections: every token through q, k, v, o (MLA's up-projections
    // included: absorbed into q and o for decode, they cost the same FLOPs).
    let attention_params = p.attention_per_layer as f64 / tp;
    ops.push(gemm(
        "attention projections",
        attention_params * layers,
        tokens,
        tokens * h * ACTIVATION_BYTES * 2.0 * layers,
        d.weight_precision,
    ));

    // Attention over the cache: per (query, key) pair and head.
    let (heads, pair_flops_prefill, pair_flops_decode) = match a.attention {
        Attention::Grouped {
            heads, head_dim, ..
        } => {
            let hd = head_dim as f64;
            // QK^T and PV, 2 FLOPs per multiply-add each.
            (heads as f64, 4.0 * hd, 4.0 * hd)
        }
        Attention::Latent {
            heads,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            ..
        } => {
            let (r, nope, rope, v) = (
                kv_lora_rank as f64,
                qk_nope_head_dim as f64,
                qk_rope_head_dim as f64,
                v_head_dim as f64,
            );
            // Prefill decompresses K and V and attends per head; decode attends the
            // latent directly (queries absorbed into the latent space).
            (
                heads as f64,
                2.0 * (nope + rope) + 2.0 * v,
                2.0 * (r + rope) + 2.0 * r,
            )
        }
    };
    let heads_per_gpu = heads / tp;
    if !batch.context.is_empty() {
        // Causal: each new token attends the cached prefix and the chunk up to itself.
        let pairs: f64 = batch
            .context
            .iter()
            .map(|c| {
                let (t, cached) = (c.tokens as f64, c.cached as f64);
                t * cached + t * (t + 1.0) / 2.0
            })
            .sum();
        let cached: f64 = batch.context.iter().map(|c| c.cached as f64).sum();
        let new: f64 = batch.context.iter().map(|c| c.tokens as f64).sum();
        // A reused MLA prefix is decompressed again through kv_b for every chunk.
        let decompress = match a.attention {
            Attention::Latent {
                kv_lora_rank,
                qk_nope_head_dim,
                v_head_dim,
                ..
            } => {
                2.0 * cached
                    * kv_lora_rank as f64
                    * heads_per_gpu
                    * (qk_nope_head_dim + v_head_dim) as f64
            }
            Attention::Grouped { .. } => 0.0,
        };
        ops.push(Op {
            name: "attention (context)",
            kind: OpKind::Attention,
            flops: (pairs * heads_per_gpu * pair_flops_prefill + decompress) * layers,
            // The chunk's KV written, the prefix's read once (flash attention keeps
            // each query block's keys on chip).
            bytes: ((new + cached) * kv_token_layer
                + new * heads_per_gpu * 2.0 * head_width(a) * ACTIVATION_BYTES)
                * layers,
        });
    }
    if batch.generation_requests > 0 {
        let queries = batch.tokens_per_generation_request as f64;
        let cached = batch.generation_cached_tokens as f64;
        ops.push(Op {
            name: "attention (generation)",
            kind: OpKind::Attention,
            flops: cached * queries * heads_per_gpu * pair_flops_decode * layers,
            // Each request's cache is read once for all its query tokens.
            bytes: (cached + batch.generation_tokens() as f64) * kv_token_layer * layers,
        });
    }

    let dense_layers = p.dense_layers as f64;
    if dense_layers > 0.0 && p.dense_mlp_per_layer > 0 {
        ops.push(gemm(
            "dense MLP",
            p.dense_mlp_per_layer as f64 / tp * dense_layers,
            tokens,
            tokens * h * ACTIVATION_BYTES * 2.0 * dense_layers,
            d.weight_precision,
        ));
    }

    let moe_layers = p.moe_layers as f64;
    if moe_layers > 0.0 {
        if p.shared_experts_per_layer > 0 {
            ops.push(gemm(
                "shared experts",
                p.shared_experts_per_layer as f64 / tp * moe_layers,
                tokens,
                tokens * h * ACTIVATION_BYTES * 2.0 * moe_layers,
                d.weight_precision,
            ));
        }
        let group = f64::from(d.expert_group());
        let routed = p.routed_experts_per_layer as f64;
        let top_k = p.routed_experts_per_token as f64;
        // Tokens of every rank meeting in the expert group (ranks alike in lockstep).
        let group_tokens = tokens * f64::from(d.ranks_per_expert_group());
        // Each expert is untouched by a token with probability 1 - k/E.
        let touched = 1.0 - (1.0 - top_k / routed).powf(group_tokens);
        let expert = p.routed_expert as f64;
        ops.push(Op {
            name: "routed experts",
            kind: OpKind::Gemm(d.weight_precision),
            // The group's token-expert pairs split evenly over its GPUs, plus the
            // router on this rank's tokens.
            flops: (2.0 * group_tokens * top_k * expert / group
                + 2.0 * tokens * p.router_per_layer as f64 / tp)
                * moe_layers,
            bytes: (touched * routed * expert * w / group
                + p.router_per_layer as f64 * Precision::Bf16.bytes()
                + group_tokens * top_k / group * h * ACTIVATION_BYTES * 2.0)
                * moe_layers,
        });
    }

    // Logits for the tokens that sample: every generation token and the last token of
    // each context chunk.
    let sampled = batch.generation_tokens() as f64 + batch.context.len() as f64;
    if sampled > 0.0 {
        let vocab = a.vocab_size as f64;
        ops.push(gemm(
            "LM head",
            p.lm_head_matmul() as f64 / tp,
            sampled,
            sampled * vocab / tp * LOGIT_BYTES,
            Precision::Bf16,
        ));
    }

    collectives(d, batch, &mut ops);
    ops.retain(|o| o.flops > 0.0 || o.bytes > 0.0);
    ops
}

/// The LM head, embedding and norms stay BF16; everything else is in the deployment's
/// weight precision.
fn precision_bytes(precision: Precision, weight_bytes: f64) -> f64 {
    match precision {
        Precision::Bf16 => Precision::Bf16.bytes(),
        _ => weight_bytes,
    }
}

/// The width of one head's query (and output) vector.
fn head_width(a: &super::Architecture) -> f64 {
    match a.attention {
        Attention::Grouped { head_dim, .. } => head_dim as f64,
        Attention::Latent {
            qk_nope_head_dim,
            qk_rope_head_dim,
            ..
        } => (qk_nope_head_dim + qk_rope_head_dim) as f64,
    }
}

/// Tensor-parallel all-reduces and expert-parallel all-to-alls.
fn collectives(d: &Deployment, batch: &ForwardBatch, ops: &mut Vec<Op>) {
    let tp = d.parallelism.tp;
    let a = &d.architecture;
    let layers = a.layers;
    if tp > 1 {
        let message = batch.tokens() as f64 * a.hidden_size as f64 * ACTIVATION_BYTES;
        let t = f64::from(tp);
        // Two per layer (after attention, after the MLP); a ring sends 2(n-1)/n of the
        // message per GPU.
        let calls = 2 * layers;
        ops.push(Op {
            name: "TP all-reduce",
            kind: OpKind::Collective {
                nvlink: tp <= d.gpu.nvlink_domain_gpus,
                calls,
            },
            flops: 0.0,
            bytes: calls as f64 * message * 2.0 * (t - 1.0) / t,
        });
    }
    let group = d.expert_group();
    if d.parallelism.ep > tp {
        let p = &d.parameters;
        let g = f64::from(group);
        let k = p.routed_experts_per_token as f64;
        // A token goes once to every other GPU holding one of its top-k experts
        // (DeepEP-style dispatch deduplicates per GPU): each of the g - 1 others holds
        // one with probability 1 - (1 - 1/g)^k under uniform routing.
        let copies = (g - 1.0) * (1.0 - (1.0 - 1.0 / g).powf(k));
        // Dispatch sends activations quantized to the weights' format (at most BF16);
        // combine returns BF16. A rank's tokens are spread over its tp GPUs.
        let dispatch_bytes = d.weight_precision.bytes().min(ACTIVATION_BYTES);
        let tokens_per_gpu = batch.tokens() as f64 / f64::from(tp);
        let per_layer =
            tokens_per_gpu * copies * a.hidden_size as f64 * (dispatch_bytes + ACTIVATION_BYTES);
        ops.push(Op {
            name: "EP all-to-all",
            kind: OpKind::Collective {
                nvlink: group <= d.gpu.nvlink_domain_gpus,
                calls: 2 * p.moe_layers,
            },
            flops: 0.0,
            bytes: per_layer * p.moe_layers as f64,
        });
    }
}

/// Times every op of `batch`.
pub fn time(d: &Deployment, batch: &ForwardBatch) -> ForwardTime {
    let g = &d.gpu;
    let eff = &d.efficiency;
    let memory_bw = g.memory_tb_per_s * 1e12 * eff.memory;
    let ops = ops(d, batch)
        .into_iter()
        .map(|op| match op.kind {
            OpKind::Gemm(_) | OpKind::Attention => {
                let peak = match op.kind {
                    // A precision without tensor cores was refused by Deployment::new.
                    OpKind::Gemm(p) => g.tensor_flops(p).unwrap_or(g.bf16_tflops * 1e12),
                    _ => g.bf16_tflops * 1e12,
                };
                let e = match op.kind {
                    OpKind::Gemm(_) => eff.gemm_compute,
                    _ => eff.attention_compute,
                };
                let compute = op.flops / (peak * e) * 1e9;
                let memory = op.bytes / memory_bw * 1e9;
                let (ns, bound) = if compute >= memory {
                    (compute, Bound::Compute)
                } else {
                    (memory, Bound::Memory)
                };
                TimedOp {
                    op,
                    ns,
                    bound,
                    latency_ns: 0.0,
                }
            }
            OpKind::Collective { nvlink, calls } => {
                // NVLink figures count both directions; a NIC's is one direction.
                let (bw, latency_us) = if nvlink {
                    (g.nvlink_gb_per_s / 2.0, g.nvlink_latency_us)
                } else {
                    (g.network_gb_per_s, g.network_latency_us)
                };
                let latency_ns = calls as f64 * latency_us * 1e3;
                TimedOp {
                    op,
                    ns: latency_ns + op.bytes / (bw * 1e9 * eff.link) * 1e9,
                    bound: Bound::Link,
                    latency_ns,
                }
            }
        })
        .collect();
    ForwardTime { ops }
}
