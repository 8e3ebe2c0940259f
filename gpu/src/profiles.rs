//! Shipped model profiles: coefficients of the analytic model and KV geometry, with the
//! reasoning behind each number written down next to it.
//!
//! Public hardware figures used throughout (dense, i.e. without the 2:4 sparsity factor
//! NVIDIA quotes in headline numbers):
//! - H100 SXM: 80 GB HBM3 at 3.35 TB/s; 989 TFLOPS BF16, 1979 TFLOPS FP8.
//! - H200 SXM: 141 GB HBM3e at 4.8 TB/s; same tensor cores as H100.
//!
//! The model is linear, so it cannot express the roofline's max(memory, compute): decode
//! charges the weight read once per forward (`forward_base_ns`, amortised over the
//! batch) plus a modest per-token compute term; prefill charges ~2 × active params FLOPs
//! per token at a realistic fraction of peak, plus the quadratic attention term.

use serde::{Deserialize, Serialize};

use crate::cost::Coefficients;

/// KV geometry of a model, for transfer sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvGeometry {
    /// Transformer layers that keep KV.
    pub layers: u32,
    /// KV heads (1 for MLA's shared latent).
    pub kv_heads: u32,
    /// Elements per head and token (for MLA: latent rank + decoupled RoPE dimension).
    pub head_dim: u32,
    /// Bytes per element as cached.
    pub dtype_bytes: u32,
    /// Multi-head latent attention: one compressed latent per token and layer serves as
    /// both K and V, so nothing is stored twice.
    #[serde(default)]
    pub mla: bool,
}

impl KvGeometry {
    /// Bytes of KV cache one token occupies across all layers (the whole model, not one
    /// tensor-parallel shard): `2 (K and V) * layers * kv_heads * head_dim * dtype_bytes`,
    /// with factor 1 instead of 2 for MLA.
    pub fn bytes_per_token(&self) -> u64 {
        let kv_factor = if self.mla { 1 } else { 2 };
        kv_factor
            * u64::from(self.layers)
            * u64::from(self.kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }
}

/// A named set of coefficients with its KV geometry and the assumptions behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    /// The name configurations refer to.
    pub name: String,
    /// Hardware, parallelism, precision, and where the numbers come from.
    pub assumptions: String,
    /// The cost model's coefficients for one rank.
    pub coefficients: Coefficients,
    /// KV geometry, for transfer sizes.
    pub kv: KvGeometry,
}

/// A profile name that is not shipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown model profile `{name}`; known profiles: {}", .known.join(", "))]
pub struct UnknownProfile {
    /// The name asked for.
    pub name: String,
    /// The shipped names, in [`profiles`] order.
    pub known: Vec<String>,
}

/// The shipped profiles, in a fixed order.
pub fn profiles() -> Vec<ModelProfile> {
    vec![
        llama3_8b_h100_bf16(),
        llama3_70b_h200_fp8_tp8(),
        deepseek_v3_h200_fp8_adp(),
    ]
}

/// The shipped profile called `name`.
pub fn profile(name: &str) -> Result<ModelProfile, UnknownProfile> {
    let all = profiles();
    let known = all.iter().map(|p| p.name.clone()).collect();
    all.into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| UnknownProfile {
            name: name.to_owned(),
            known,
        })
}

/// Host costs shared by all profiles: they model the serving framework's scheduler, not
/// the model (a Python-side executor measures ~0.5 ms per iteration plus a few µs per
/// request for bookkeeping, token appends and responses).
const HOST_BASE_NS: f64 = 500_000.0;
const HOST_PER_REQUEST_NS: f64 = 5_000.0;

fn llama3_8b_h100_bf16() -> ModelProfile {
    ModelProfile {
        name: "llama3-8b-h100-bf16".into(),
        assumptions: "\
Llama-3-8B, BF16 weights and KV, one H100 SXM (80 GB, 3.35 TB/s, 989 dense BF16 TFLOPS) \
per rank (TP1); ADP across the 8 GPUs of a node. \
Decode: the 16 GB of weights are read once per forward at ~2.7 TB/s achieved (~80% of \
peak), about 6 ms, plus CUDA-graph launch overhead: forward_base 6.5 ms. Per generation \
token 15 us of GEMM work beyond the weight read (16 GFLOP at a partly overlapped \
roofline); per request 2 us (sampling, metadata). KV read: 131072 B/token at 2.7 TB/s = \
~49 ns, so 50 ns. \
Prefill: 2 x 8B = 16 GFLOP/token at ~45% MFU (~445 TFLOPS) = 36 us/token. Attention: \
32 layers x 32 heads x 4 x 128 = 0.52 MFLOP per (query, key) pair, causal so half of \
ctx_attention counts, at ~480 TFLOPS (FlashAttention-3 BF16): 0.55 ns per unit. \
Collective: only the lockstep batch-size exchange over NVLink, ~50 us. \
Headlines: decode batch 64 at 4k context ~21 ms; an 8k-token prefill ~340 ms. \
Order-of-magnitude estimates from public figures, not measurements."
            .into(),
        coefficients: Coefficients {
            forward_base_ns: 6_500_000.0,
            ctx_token_ns: 36_000.0,
            ctx_attention_ns: 0.55,
            gen_request_ns: 2_000.0,
            gen_token_ns: 15_000.0,
            kv_read_ns: 50.0,
            collective_ns: 50_000.0,
            host_base_ns: HOST_BASE_NS,
            host_per_request_ns: HOST_PER_REQUEST_NS,
        },
        kv: KvGeometry {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            mla: false,
        },
    }
}

fn llama3_70b_h200_fp8_tp8() -> ModelProfile {
    ModelProfile {
        name: "llama3-70b-h200-fp8-tp8".into(),
        assumptions: "\
Llama-3-70B, FP8 weights and FP8 KV, one rank = one TP8 group of H200 SXM (141 GB, \
4.8 TB/s, 1979 dense FP8 TFLOPS each) in one node; ADP across nodes. Times are per TP \
group; each GPU holds 1/8 of weights and of KV (one KV head). \
Decode: 70 GB / 8 = 8.8 GB per GPU read at ~3.8 TB/s = 2.3 ms, plus 160 small TP \
all-reduces (2 per layer) at ~15 us = 2.4 ms: forward_base 5 ms. Per generation token \
12 us (17.5 GFLOP per GPU, overlapped with the weight read); per request 2 us. KV read: \
163840 B/token / 8 GPUs = 20 KB per GPU at 3.8 TB/s = 5.3 ns, so 6 ns. \
Prefill: 140 GFLOP/token / 8 = 17.5 GFLOP per GPU at ~45% of FP8 peak = ~20 us, plus \
~8 us of exposed TP all-reduce traffic (2.6 MB/token of activations): 28 us/token. \
Attention: 80 layers x 64 heads x 4 x 128 / 8 GPUs = 0.33 MFLOP per pair per GPU, half \
of ctx_attention, at ~550 TFLOPS: 0.3 ns per unit. \
Collective: lockstep batch-size exchange across nodes over InfiniBand, ~100 us. \
Headlines: decode batch 128 at 4k context ~10 ms; an 8k-token prefill ~255 ms. \
Order-of-magnitude estimates from public figures, not measurements."
            .into(),
        coefficients: Coefficients {
            forward_base_ns: 5_000_000.0,
            ctx_token_ns: 28_000.0,
            ctx_attention_ns: 0.3,
            gen_request_ns: 2_000.0,
            gen_token_ns: 12_000.0,
            kv_read_ns: 6.0,
            collective_ns: 100_000.0,
            host_base_ns: HOST_BASE_NS,
            host_per_request_ns: HOST_PER_REQUEST_NS,
        },
        kv: KvGeometry {
            layers: 80,
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 1,
            mla: false,
        },
    }
}

fn deepseek_v3_h200_fp8_adp() -> ModelProfile {
    ModelProfile {
        name: "deepseek-v3-h200-fp8-adp".into(),
        assumptions: "\
DeepSeek-V3 (671B total, 37B active), FP8 block-scaled weights, FP8 MLA latent KV, on 16 \
H200 SXM (two nodes): attention DP 16 (one GPU per rank, all 128 heads local), MoE EP16. \
Two nodes because one does not hold batch 256 x 8k per rank: weights are ~56 GB per GPU \
(~15 GB replicated attention/shared/dense + 1/16 of ~656 GB routed experts) and that \
KV is 2.1M tokens x 35136 B = 74 GB. \
Decode: at production batch sizes nearly every local expert is touched, so each forward \
reads the ~56 GB at ~4.7 TB/s: forward_base 12 ms. Per generation token 30 us (74 GFLOP \
of MoE/MLA GEMMs, partly hidden under the weight read); per request 2 us. KV read: \
absorbed MLA with 128 heads is compute-bound, 61 layers x 128 heads x 2 x (576 + 512) = \
17 MFLOP per cached token at ~680 TFLOPS (FlashMLA-class): 25 ns. \
Prefill: 2 x 37B = 74 GFLOP/token at ~1 PFLOPS (~53% of FP8 peak, DeepGEMM-class): \
70 us/token. Attention: 61 layers x 128 heads x 2 x (192 + 128) = 5 MFLOP per pair, \
half of ctx_attention, at ~550 TFLOPS BF16: 4.5 ns per unit. \
Collective: per-layer EP dispatch/combine that two-micro-batch overlap leaves exposed, \
plus the ADP sync: ~5 ms per forward (the all-to-all bandwidth part scales with tokens \
and sits in the per-token terms). \
Headlines: decode at batch 256 per rank with 8k context ~73 ms per rank (~78 ms with the \
collective, ~3.3k tokens/s per GPU); an 8k-token prefill chunk ~0.9 s per rank (the \
FLOPs alone need 0.31 s at 100% of FP8 peak, and public large-EP deployments report \
~6-9k prefill tokens/s per GPU). Order-of-magnitude estimates, not measurements."
            .into(),
        coefficients: Coefficients {
            forward_base_ns: 12_000_000.0,
            ctx_token_ns: 70_000.0,
            ctx_attention_ns: 4.5,
            gen_request_ns: 2_000.0,
            gen_token_ns: 30_000.0,
            kv_read_ns: 25.0,
            collective_ns: 5_000_000.0,
            host_base_ns: HOST_BASE_NS,
            host_per_request_ns: HOST_PER_REQUEST_NS,
        },
        kv: KvGeometry {
            layers: 61,
            kv_heads: 1,
            head_dim: 576,
            dtype_bytes: 1,
            mla: true,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{AnalyticBackend, Backend};
    use lockstep_actors::executor::BatchShape;

    const MS: u64 = 1_000_000;

    fn backend(name: &str) -> AnalyticBackend {
        AnalyticBackend::new(profile(name).unwrap().coefficients)
    }

    fn decode(batch: u32, context: u64) -> BatchShape {
        BatchShape {
            gen_requests: batch,
            gen_tokens: batch,
            gen_kv_tokens: u64::from(batch) * context,
            ..BatchShape::default()
        }
    }

    fn prefill(chunk: u32, cached: u64) -> BatchShape {
        BatchShape {
            ctx_requests: 1,
            ctx_tokens: chunk,
            ctx_attention: u64::from(chunk) * (cached + u64::from(chunk)),
            ..BatchShape::default()
        }
    }

    #[test]
    fn an_unknown_profile_errors_listing_the_known_names() {
        let err = profile("nope").unwrap_err();
        assert_eq!(err.name, "nope");
        let names: Vec<String> = profiles().into_iter().map(|p| p.name).collect();
        assert_eq!(err.known, names);
        let msg = err.to_string();
        assert!(msg.contains("`nope`"), "{msg}");
        for n in &names {
            assert!(msg.contains(n.as_str()), "{msg} lacks {n}");
        }
    }

    #[test]
    fn every_profile_is_found_by_its_name_and_names_are_unique() {
        let all = profiles();
        assert!(all.len() >= 3);
        for p in &all {
            assert_eq!(&profile(&p.name).unwrap(), p);
            assert_eq!(all.iter().filter(|q| q.name == p.name).count(), 1);
        }
    }

    #[test]
    fn every_profile_has_assumptions_and_positive_coefficients() {
        for p in profiles() {
            assert!(!p.assumptions.trim().is_empty(), "{}", p.name);
            for (term, v) in p.coefficients.terms() {
                assert!(v.is_finite() && v > 0.0, "{} {term} = {v}", p.name);
            }
            assert!(p.kv.bytes_per_token() > 0, "{}", p.name);
        }
    }

    #[test]
    fn kv_bytes_per_token_doubles_for_k_and_v_but_not_for_mla() {
        let llama = profile("llama3-8b-h100-bf16").unwrap().kv;
        assert_eq!(llama.bytes_per_token(), 2 * 32 * 8 * 128 * 2);
        assert_eq!(llama.bytes_per_token(), 131_072);
        let ds = profile("deepseek-v3-h200-fp8-adp").unwrap().kv;
        assert!(ds.mla);
        assert_eq!(ds.bytes_per_token(), 61 * 576);
        assert_eq!(ds.bytes_per_token(), 35_136);
    }

    #[test]
    fn kv_geometry_without_mla_field_deserializes_as_not_mla() {
        let g: KvGeometry =
            serde_json::from_str(r#"{"layers":2,"kv_heads":4,"head_dim":8,"dtype_bytes":2}"#)
                .unwrap();
        assert!(!g.mla);
        assert_eq!(g.bytes_per_token(), 2 * 2 * 4 * 8 * 2);
    }

    #[test]
    fn profiles_round_trip_through_serde_and_reject_unknown_coefficients() {
        for p in profiles() {
            let json = serde_json::to_string(&p).unwrap();
            let back: ModelProfile = serde_json::from_str(&json).unwrap();
            assert_eq!(back, p);
        }
        let mut v = serde_json::to_value(profiles()[0].coefficients).unwrap();
        v["typo_ns"] = 1.0.into();
        assert!(serde_json::from_value::<Coefficients>(v).is_err());
    }

    #[test]
    fn deepseek_decode_at_batch_256_and_8k_context_takes_tens_of_ms() {
        let b = backend("deepseek-v3-h200-fp8-adp");
        let fwd = b.forward_ns(&decode(256, 8192));
        assert!((60 * MS..90 * MS).contains(&fwd), "decode forward {fwd} ns");
        let it = b.iteration_ns(&[decode(256, 8192); 16], true, true);
        assert!(
            (65 * MS..100 * MS).contains(&it.total_ns),
            "decode iteration {it:?}"
        );
    }

    #[test]
    fn deepseek_8k_prefill_chunk_takes_about_a_second() {
        let b = backend("deepseek-v3-h200-fp8-adp");
        let fwd = b.forward_ns(&prefill(8192, 0));
        assert!(
            (700 * MS..1100 * MS).contains(&fwd),
            "prefill forward {fwd} ns"
        );
        // The same chunk over 8k of cached prefix pays more attention, not more GEMMs.
        let later = b.forward_ns(&prefill(8192, 8192));
        assert!(later > fwd && later < fwd + 400 * MS, "{later} vs {fwd}");
    }

    #[test]
    fn llama_headlines_match_their_assumptions() {
        let b8 = backend("llama3-8b-h100-bf16");
        let d = b8.forward_ns(&decode(64, 4096));
        assert!((15 * MS..30 * MS).contains(&d), "8b decode {d}");
        let p = b8.forward_ns(&prefill(8192, 0));
        assert!((250 * MS..450 * MS).contains(&p), "8b prefill {p}");
        let b70 = backend("llama3-70b-h200-fp8-tp8");
        let d = b70.forward_ns(&decode(128, 4096));
        assert!((7 * MS..15 * MS).contains(&d), "70b decode {d}");
        let p = b70.forward_ns(&prefill(8192, 0));
        assert!((200 * MS..350 * MS).contains(&p), "70b prefill {p}");
    }
}
