//! A roofline cost model from a Hugging Face `config.json` and a GPU.
//!
//! A [`Deployment`] is an [`Architecture`] on a [`Gpu`] with a [`Parallelism`], weight
//! and KV [`Precision`]s and [`Efficiency`] factors. For one forward of a
//! [`ForwardBatch`] it lists the FLOPs and bytes of every op on one GPU ([`ops`]) and
//! times each as `max(flops / (peak × eff_compute), bytes / (bandwidth × eff_memory))`;
//! collectives take `latency + bytes / (link bandwidth × eff_link)`. The simulator's
//! linear [`Coefficients`](crate::Coefficients) are fitted to that on a grid of batch
//! shapes by [`derive`].
//!
//! What it leaves out, so its times are a lower bound in those respects: kernel launch
//! gaps, norms and element-wise kernels, the overlap of communication with compute
//! (communication is charged in series), and routing skew (experts are picked
//! uniformly and independently, which makes the most distinct experts per batch).

mod derive;
mod gpus;
mod hf_config;
pub mod ops;
mod params;

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::profiles::KvGeometry;

pub use derive::{DeriveError, DerivedProfile, FitReport, derive_profile, fit_grid, held_out_grid};
pub use gpus::{Gpu, GpuError, gpu, gpus};
pub use hf_config::{Architecture, Attention, Experts, HfConfigError};
pub use ops::{Bound, ForwardBatch, ForwardTime, Op, OpKind, TimedOp};
pub use params::Parameters;

/// A number format of weights or of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bfloat16: 2 bytes.
    Bf16,
    /// FP8 (E4M3) with per-tensor or block scales (negligible bytes): 1 byte.
    Fp8,
    /// NVFP4: 4-bit elements and one FP8 scale per 16 of them, 9/16 byte.
    Nvfp4,
}

impl Precision {
    /// Bytes per element, scales included.
    pub fn bytes(self) -> f64 {
        match self {
            Precision::Bf16 => 2.0,
            Precision::Fp8 => 1.0,
            Precision::Nvfp4 => 9.0 / 16.0,
        }
    }

    /// The name configurations use.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp8 => "fp8",
            Precision::Nvfp4 => "nvfp4",
        }
    }

    /// Parses a configuration name (case-insensitive).
    pub fn parse(text: &str) -> Option<Precision> {
        [Precision::Bf16, Precision::Fp8, Precision::Nvfp4]
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(text))
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How one rank's work is spread over GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Parallelism {
    /// GPUs of one rank that split attention heads, dense MLPs and the LM head
    /// (1 with attention data parallelism: each rank is one GPU).
    pub tp: u32,
    /// GPUs the routed experts are spread over. Up to `tp`: within the rank; above it,
    /// `ep / tp` ranks share their experts (attention DP + EP), and every MoE layer
    /// dispatches and combines tokens all-to-all.
    pub ep: u32,
}

/// Achieved fractions of peak. The defaults are what well-tuned serving kernels reach
/// on large problems; small problems reach less, which the roofline does not model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Efficiency {
    /// GEMMs: cuBLAS/CUTLASS reach 70-80% of dense peak on large BF16/FP8 GEMMs.
    pub gemm_compute: f64,
    /// Attention math: FlashAttention-3 reports up to 75% of BF16 peak on long
    /// sequences and less with causal masks and short ones.
    pub attention_compute: f64,
    /// HBM: streaming kernels reach 80-90% of the datasheet bandwidth.
    pub memory: f64,
    /// NVLink and network: NCCL's bus bandwidth reaches 70-85% of the link's.
    pub link: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Efficiency {
            gemm_compute: 0.7,
            attention_compute: 0.6,
            memory: 0.8,
            link: 0.75,
        }
    }
}

impl Efficiency {
    fn validate(&self) -> Result<(), RooflineError> {
        for (key, value) in [
            ("gemm_compute", self.gemm_compute),
            ("attention_compute", self.attention_compute),
            ("memory", self.memory),
            ("link", self.link),
        ] {
            if !(value.is_finite() && value > 0.0 && value <= 1.0) {
                return Err(RooflineError::Efficiency { key, value });
            }
        }
        Ok(())
    }
}

/// Memory the runtime keeps besides weights and KV (CUDA context, collective
/// workspaces, the activation peak TensorRT-LLM measures in its warm-up forward), in
/// GiB: the order a free-memory query shows after loading.
pub const DEFAULT_RESERVED_MEMORY_GIB: f64 = 2.0;

/// TensorRT-LLM's default `kv_cache_config.free_gpu_memory_fraction`.
pub const DEFAULT_FREE_GPU_MEMORY_FRACTION: f64 = 0.9;

/// Why a deployment cannot be modeled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RooflineError {
    /// The GPU lacks what is asked of it.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A parallel size that does not split the model.
    #[error("{key} = {value}: {why}")]
    Parallelism {
        /// `tp` or `ep`.
        key: &'static str,
        /// Its value.
        value: u32,
        /// What it must be.
        why: String,
    },
    /// An efficiency factor outside (0, 1].
    #[error("efficiency.{key} = {value}: must be above 0 and at most 1")]
    Efficiency {
        /// The factor.
        key: &'static str,
        /// Its value.
        value: f64,
    },
    /// A memory setting out of range.
    #[error("{key} = {value}: {why}")]
    Memory {
        /// The setting.
        key: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        why: String,
    },
    /// The weights leave no memory for KV.
    #[error(
        "the weights need {weights_gib:.1} GiB per GPU and {reserved_gib:.1} GiB stay reserved, \
         more than the {memory_gib:.1} GiB of {gpu}: no room for KV (raise tp or ep, or \
         quantize the weights)"
    )]
    NoRoomForKv {
        /// The GPU.
        gpu: String,
        /// Weights per GPU.
        weights_gib: f64,
        /// The runtime's reserve.
        reserved_gib: f64,
        /// The GPU's memory.
        memory_gib: f64,
    },
}

/// A model on a GPU with its parallelism and precisions.
#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    /// The model.
    pub architecture: Architecture,
    /// The GPU.
    pub gpu: Gpu,
    /// How a rank is spread.
    pub parallelism: Parallelism,
    /// Format of the transformer blocks' linear weights (embedding, LM head and norms
    /// stay BF16, as FP8 and NVFP4 checkpoints keep them).
    pub weight_precision: Precision,
    /// Format of the KV cache.
    pub kv_precision: Precision,
    /// Achieved fractions of peak.
    pub efficiency: Efficiency,
    /// Parameter counts of the architecture.
    pub parameters: Parameters,
}

impl Deployment {
    /// Checks that the parallelism splits the model and the GPU runs the precision.
    pub fn new(
        architecture: Architecture,
        gpu: Gpu,
        parallelism: Parallelism,
        weight_precision: Precision,
        kv_precision: Precision,
        efficiency: Efficiency,
    ) -> Result<Deployment, RooflineError> {
        gpu.validate()?;
        gpu.tensor_flops(weight_precision)?;
        efficiency.validate()?;
        let Parallelism { tp, ep } = parallelism;
        let bad = |key, value, why: String| RooflineError::Parallelism { key, value, why };
        if tp == 0 {
            return Err(bad("tp", tp, "must be at least 1".into()));
        }
        if ep == 0 {
            return Err(bad("ep", ep, "must be at least 1".into()));
        }
        let heads = match architecture.attention {
            Attention::Grouped {
                heads, kv_heads, ..
            } => {
                let kv = kv_heads as u32;
                if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
                    return Err(bad(
                        "tp",
                        tp,
                        format!("must divide the {kv_heads} KV heads or be a multiple of them"),
                    ));
                }
                heads
            }
            Attention::Latent { heads, .. } => heads,
        };
        if !heads.is_multiple_of(u64::from(tp)) {
            return Err(bad(
                "tp",
                tp,
                format!("must divide the {heads} attention heads"),
            ));
        }
        match architecture.experts {
            Some(e) => {
                if !e.routed.is_multiple_of(u64::from(ep)) {
                    return Err(bad(
                        "ep",
                        ep,
                        format!("must divide the {} routed experts", e.routed),
                    ));
                }
                if !tp.is_multiple_of(ep) && !ep.is_multiple_of(tp) {
                    return Err(bad(
                        "ep",
                        ep,
                        format!("must divide tp = {tp} or be a multiple of it"),
                    ));
                }
            }
            None if ep != 1 => {
                return Err(bad(
                    "ep",
                    ep,
                    "must be 1 for a model without experts".into(),
                ));
            }
            None => {}
        }
        let parameters = Parameters::of(&architecture);
        Ok(Deployment {
            architecture,
            gpu,
            parallelism,
            weight_precision,
            kv_precision,
            efficiency,
            parameters,
        })
    }

    /// GPUs the routed experts of one MoE layer live on (`max(tp, ep)`).
    pub fn expert_group(&self) -> u32 {
        self.parallelism.tp.max(self.parallelism.ep)
    }

    /// Ranks whose tokens meet in one expert group (1 without attention DP + EP).
    pub fn ranks_per_expert_group(&self) -> u32 {
        self.expert_group() / self.parallelism.tp
    }

    /// KV geometry of the whole model (not a TP shard), for transfer sizes. NVFP4's
    /// elements are half a byte, which [`KvGeometry`]'s whole bytes cannot say: its
    /// `head_dim` is then the packed bytes of one head (9/16 byte per element, scales
    /// included) and `dtype_bytes` 1, so [`KvGeometry::bytes_per_token`] stays exact.
    pub fn kv_geometry(&self) -> KvGeometry {
        let a = &self.architecture;
        let (kv_heads, elements, mla) = match a.attention {
            Attention::Grouped {
                kv_heads, head_dim, ..
            } => (kv_heads, head_dim, false),
            Attention::Latent {
                kv_lora_rank,
                qk_rope_head_dim,
                ..
            } => (1, kv_lora_rank + qk_rope_head_dim, true),
        };
        let (head_dim, dtype_bytes) = match self.kv_precision {
            Precision::Bf16 => (elements, 2),
            Precision::Fp8 => (elements, 1),
            // 16 elements pack into 8 bytes and a 1-byte scale; a partial group of 16
            // still takes its scale.
            Precision::Nvfp4 => (elements.div_ceil(16) * 9, 1),
        };
        KvGeometry {
            layers: a.layers as u32,
            kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            dtype_bytes,
            mla,
        }
    }

    /// KV bytes one token occupies on one GPU of a rank: a KV head per GPU at least
    /// (heads are replicated when `tp` exceeds them), and MLA's latent whole on every
    /// GPU (each needs it for all its heads).
    pub fn kv_bytes_per_token_per_gpu(&self) -> f64 {
        let g = self.kv_geometry();
        let tp = u64::from(self.parallelism.tp);
        let heads_per_gpu = if g.mla {
            1
        } else {
            u64::from(g.kv_heads).div_ceil(tp)
        };
        let factor = if g.mla { 1 } else { 2 };
        (factor
            * u64::from(g.layers)
            * heads_per_gpu
            * u64::from(g.head_dim)
            * u64::from(g.dtype_bytes)) as f64
    }

    /// Weight bytes held by one GPU.
    pub fn weight_bytes_per_gpu(&self) -> f64 {
        let p = &self.parameters;
        let tp = f64::from(self.parallelism.tp);
        let w = self.weight_precision.bytes();
        let bf16 = Precision::Bf16.bytes();
        let embedding_and_head = (p.embedding + p.lm_head) as f64 * bf16 / tp;
        let blocks = (p.layers() * p.attention_per_layer
            + p.dense_layers * p.dense_mlp_per_layer
            + p.moe_layers * p.shared_experts_per_layer) as f64
            * w
            / tp;
        let experts = (p.moe_layers * p.routed_experts_per_layer * p.routed_expert) as f64 * w
            / f64::from(self.expert_group());
        // Routers and norms are replicated and kept in BF16.
        let replicated = (p.moe_layers * p.router_per_layer + p.norms) as f64 * bf16;
        embedding_and_head + blocks + experts + replicated
    }

    /// KV tokens one rank holds, as TensorRT-LLM sizes its pool: the memory left after
    /// the weights and the runtime's reserve, times `free_gpu_memory_fraction`, over the
    /// KV bytes of a token on one GPU.
    pub fn kv_capacity_tokens(
        &self,
        free_gpu_memory_fraction: f64,
        reserved_memory_gib: f64,
    ) -> Result<u64, RooflineError> {
        if !(free_gpu_memory_fraction.is_finite()
            && free_gpu_memory_fraction > 0.0
            && free_gpu_memory_fraction <= 1.0)
        {
            return Err(RooflineError::Memory {
                key: "free_gpu_memory_fraction",
                value: free_gpu_memory_fraction,
                why: "must be above 0 and at most 1".into(),
            });
        }
        if !(reserved_memory_gib.is_finite() && reserved_memory_gib >= 0.0) {
            return Err(RooflineError::Memory {
                key: "reserved_memory_gib",
                value: reserved_memory_gib,
                why: "must be a finite number >= 0".into(),
            });
        }
        const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
        let weights = self.weight_bytes_per_gpu();
        let free = self.gpu.memory_bytes() - weights - reserved_memory_gib * GIB;
        if free <= 0.0 {
            return Err(RooflineError::NoRoomForKv {
                gpu: self.gpu.name.clone(),
                weights_gib: weights / GIB,
                reserved_gib: reserved_memory_gib,
                memory_gib: self.gpu.memory_gib,
            });
        }
        Ok((free * free_gpu_memory_fraction / self.kv_bytes_per_token_per_gpu()).floor() as u64)
    }

    /// Times one forward of `batch` on one GPU of a rank, op by op.
    pub fn forward(&self, batch: &ForwardBatch) -> ForwardTime {
        ops::time(self, batch)
    }
}

#[cfg(test)]
mod tests;
