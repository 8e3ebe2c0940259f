//! Parameter counts of an [`Architecture`], grouped the way the roofline reads weights:
//! what every token passes through, what only the routed experts it picks hold, and
//! what is only looked up (the embedding).

use super::hf_config::{Architecture, Attention};

/// Parameters by group. Norm weights are counted; biases only where the architecture
/// has them (Qwen2's q/k/v).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parameters {
    /// Input embedding (looked up, never multiplied).
    pub embedding: u64,
    /// LM head (0 when tied to the embedding).
    pub lm_head: u64,
    /// One layer's attention projections (norm weights of the latent included).
    pub attention_per_layer: u64,
    /// One layer's dense SwiGLU MLP.
    pub dense_mlp_per_layer: u64,
    /// Layers with a dense MLP.
    pub dense_layers: u64,
    /// Layers with experts.
    pub moe_layers: u64,
    /// One routed expert (gate, up, down).
    pub routed_expert: u64,
    /// Routed experts per MoE layer.
    pub routed_experts_per_layer: u64,
    /// Routed experts a token activates per MoE layer.
    pub routed_experts_per_token: u64,
    /// One MoE layer's shared experts.
    pub shared_experts_per_layer: u64,
    /// One MoE layer's router (a `hidden × experts` matrix).
    pub router_per_layer: u64,
    /// RMSNorm weights of every layer (two each) and the final norm.
    pub norms: u64,
}

impl Parameters {
    /// Counts the parameters of `a`.
    pub fn of(a: &Architecture) -> Parameters {
        let h = a.hidden_size;
        let attention_per_layer = match a.attention {
            Attention::Grouped {
                heads,
                kv_heads,
                head_dim,
                qkv_bias,
            } => {
                let q = heads * head_dim;
                let kv = kv_heads * head_dim;
                let bias = if qkv_bias { q + 2 * kv } else { 0 };
                // q, k, v, o.
                h * q + 2 * h * kv + q * h + bias
            }
            Attention::Latent {
                heads,
                q_lora_rank,
                kv_lora_rank,
                qk_nope_head_dim,
                qk_rope_head_dim,
                v_head_dim,
            } => {
                let qk = qk_nope_head_dim + qk_rope_head_dim;
                let q = match q_lora_rank {
                    // Down-projection, its norm, up-projection.
                    Some(r) => h * r + r + r * heads * qk,
                    None => h * heads * qk,
                };
                // KV down-projection (latent + shared RoPE key), its norm, the
                // up-projection into per-head K (no RoPE part) and V, the output.
                let kv_a = h * (kv_lora_rank + qk_rope_head_dim) + kv_lora_rank;
                let kv_b = kv_lora_rank * heads * (qk_nope_head_dim + v_head_dim);
                q + kv_a + kv_b + heads * v_head_dim * h
            }
        };
        let swiglu = |width: u64| 3 * h * width;
        let (dense_layers, moe_layers) = match a.experts {
            Some(e) => (e.dense_layers, a.layers - e.dense_layers),
            None => (a.layers, 0),
        };
        let e = a.experts;
        Parameters {
            embedding: a.vocab_size * h,
            lm_head: if a.tie_word_embeddings {
                0
            } else {
                a.vocab_size * h
            },
            attention_per_layer,
            dense_mlp_per_layer: swiglu(a.dense_intermediate),
            dense_layers,
            moe_layers,
            routed_expert: e.map_or(0, |e| swiglu(e.intermediate)),
            routed_experts_per_layer: e.map_or(0, |e| e.routed),
            routed_experts_per_token: e.map_or(0, |e| e.per_token),
            shared_experts_per_layer: e.map_or(0, |e| swiglu(e.shared_intermediate)),
            router_per_layer: e.map_or(0, |e| h * e.routed),
            norms: a.layers * 2 * h + h,
        }
    }

    /// Layers in all.
    pub fn layers(&self) -> u64 {
        self.dense_layers + self.moe_layers
    }

    /// Everything a token passes through in an MoE layer except its routed experts.
    fn moe_layer_common(&self) -> u64 {
        self.shared_experts_per_layer + self.router_per_layer
    }

    /// All parameters.
    pub fn total(&self) -> u64 {
        self.embedding
            + self.lm_head
            + self.norms
            + self.layers() * self.attention_per_layer
            + self.dense_layers * self.dense_mlp_per_layer
            + self.moe_layers
                * (self.moe_layer_common() + self.routed_experts_per_layer * self.routed_expert)
    }

    /// Parameters one token uses: all but the routed experts it does not pick (the
    /// embedding included, as model cards count it).
    pub fn active(&self) -> u64 {
        self.total()
            - self.moe_layers
                * (self.routed_experts_per_layer - self.routed_experts_per_token)
                * self.routed_expert
    }

    /// Parameters one token multiplies by (active without the embedding lookup): a
    /// forward costs about twice this many FLOPs per token.
    pub fn active_matmul(&self) -> u64 {
        self.active() - self.embedding - self.lm_head - self.norms + self.lm_head_matmul()
    }

    /// The LM head's matrix: its own, or the embedding's when tied.
    pub fn lm_head_matmul(&self) -> u64 {
        if self.lm_head == 0 {
            self.embedding
        } else {
            self.lm_head
        }
    }
}
