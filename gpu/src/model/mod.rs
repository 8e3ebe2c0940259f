//! A CPU transformer of the Llama family (Llama, Qwen2, Mistral) whose attention reads
//! and writes the paged KV cache through the KV manager's block tables.
//!
//! [`Model::load`] reads a Hugging Face directory (`config.json`, safetensors weights);
//! [`forward_paged`] runs one batched forward over a mixed batch of prefill chunks and
//! decode tokens; [`DenseSequence`] is the same model without paging, the reference the
//! paged path is tested and benchmarked against.

mod chat_template;
mod config;
mod dense;
mod error;
mod forward;
mod init;
mod ops;
mod paged_attention;
mod paged_kv;
mod panels;
mod rope;
mod sampling;
mod tokenizer;
mod weights;

use std::path::Path;

pub use chat_template::ChatTemplate;
pub use config::{Activation, Architecture, GenerationDefaults, ModelConfig};
pub use dense::{DenseSequence, forward_dense, greedy_reference, prompt_logprobs};
pub use error::{ModelError, Result};
pub use forward::{BatchEntry, forward_paged};
pub use init::{InitOptions, write_random_model, write_random_weights};
pub use paged_kv::{PagedKvCache, PagedKvGeometry};
pub use rope::RopeScaling;
pub use sampling::{
    Penalties, PenaltyScratch, Sampler, SamplingParams, apply_logit_bias, apply_penalties, argmax,
    mask_tokens, token_logprobs,
};
pub use tokenizer::TextTokenizer;
pub use weights::{LayerWeights, Linear, LmHead, ModelWeights};

/// A loaded model: its config and its weights.
#[derive(Debug, Clone)]
pub struct Model {
    /// The hyperparameters.
    pub config: ModelConfig,
    /// The weights, f32 on the CPU.
    pub weights: ModelWeights,
}

impl Model {
    /// Loads `DIR/config.json` and the weights it describes.
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::load(dir)?;
        let weights = ModelWeights::load(dir, &config)?;
        Ok(Model { config, weights })
    }

    /// The geometry of a paged K/V store of `num_blocks` blocks for this model.
    pub fn paged_geometry(&self, num_blocks: usize, tokens_per_block: usize) -> PagedKvGeometry {
        PagedKvGeometry {
            layers: self.config.num_hidden_layers,
            num_blocks,
            tokens_per_block,
            kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
        }
    }

    /// A paged K/V store sized for this model.
    pub fn paged_cache(&self, num_blocks: usize, tokens_per_block: usize) -> Result<PagedKvCache> {
        PagedKvCache::new(self.paged_geometry(num_blocks, tokens_per_block))
    }
}

#[cfg(test)]
mod tests;
