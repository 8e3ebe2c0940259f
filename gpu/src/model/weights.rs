//! The model's weights, read from safetensors files in the Hugging Face layout.
//!
//! Files are read whole into memory and parsed there: memory-mapping them would need
//! `unsafe`, which this crate forbids.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Storage, Tensor};
use safetensors::SafeTensors;

use super::config::ModelConfig;
use super::error::{ModelError, Result};
use super::panels::Panels;

/// A linear layer, packed into panels at load ([`Panels`]): every product, a decode
/// step's few rows or a prompt's many, runs as the panels' sums of outer products.
#[derive(Debug, Clone)]
pub struct Linear {
    /// The weight (`[out, in]` in the checkpoint), in panels.
    packed: Arc<Panels>,
    /// The bias, `[out]`, where the architecture has one (the tests take it away to
    /// see that it counts).
    pub(crate) bias: Option<Vec<f32>>,
}

impl Linear {
    /// The layer of `weight` (`[out, in]`) and `bias` (`[out]`).
    pub fn new(weight: &Tensor, bias: Option<&Tensor>) -> Result<Linear> {
        let (out, inner) = weight.dims2()?;
        Ok(Linear {
            packed: Arc::new(with_values(weight, |w| Panels::pack(w, out, inner))?),
            bias: bias.map(|b| b.to_vec1::<f32>()).transpose()?,
        })
    }

    /// The weight, `[out, in]` (unpacked: a copy).
    pub fn weight(&self) -> Result<Tensor> {
        unpacked(&self.packed)
    }

    /// The bias, `[out]`, where the architecture has one.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// `x @ W^T + b` for `x` of `[rows, in]` row-major; `[rows, out]` row-major.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let (out, inner) = self.packed.dims();
        let rows = x.len() / inner.max(1);
        let mut y = vec![0.0f32; rows * out];
        let mut outputs: Vec<&mut [f32]> = y.chunks_mut(out.max(1)).collect();
        self.packed.multiply(x, &mut outputs);
        if let Some(bias) = &self.bias {
            for row in &mut outputs {
                for (y, b) in row.iter_mut().zip(bias) {
                    *y += b;
                }
            }
        }
        y
    }
}

/// A packed matrix back as a `[out, inner]` tensor (a copy: for tests and inspection).
fn unpacked(packed: &Panels) -> Result<Tensor> {
    Ok(Tensor::from_vec(
        packed.unpack(),
        packed.dims(),
        &Device::Cpu,
    )?)
}

/// Calls `f` with a contiguous f32 CPU tensor's values, borrowed in place.
fn with_values<R>(tensor: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let tensor = tensor.contiguous()?;
    let (storage, layout) = tensor.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(ModelError::InvalidBatch(
            "a weight is not on the CPU".into(),
        ));
    };
    let values = cpu.as_slice::<f32>()?;
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(ModelError::InvalidBatch(
            "a weight is not contiguous".into(),
        ));
    };
    Ok(f(&values[start..end]))
}

/// The LM head (`[vocab, hidden]` in the checkpoint), packed into panels at load like
/// every linear layer: the logits of each row come straight out of the panels. A tied
/// head is packed from the embedding, which stays as it is for the lookup.
#[derive(Debug, Clone)]
pub struct LmHead {
    packed: Arc<Panels>,
}

impl LmHead {
    /// The head of `weight` (`[vocab, hidden]`).
    pub fn new(weight: &Tensor) -> Result<LmHead> {
        let (vocab, hidden) = weight.dims2()?;
        Ok(LmHead {
            packed: Arc::new(with_values(weight, |w| Panels::pack(w, vocab, hidden))?),
        })
    }

    /// The weight, `[vocab, hidden]` (unpacked: a copy).
    pub fn weight(&self) -> Result<Tensor> {
        unpacked(&self.packed)
    }

    /// The logits (`[vocab]` each) of every row of `x` (`[rows, hidden]` row-major).
    pub fn logits(&self, x: &[f32]) -> Vec<Vec<f32>> {
        let (vocab, hidden) = self.packed.dims();
        let rows = x.len() / hidden.max(1);
        let mut logits: Vec<Vec<f32>> = (0..rows).map(|_| vec![0.0f32; vocab]).collect();
        let mut outputs: Vec<&mut [f32]> = logits.iter_mut().map(Vec::as_mut_slice).collect();
        self.packed.multiply(x, &mut outputs);
        logits
    }
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm scale before attention.
    pub input_layernorm: Tensor,
    /// Query projection.
    pub q_proj: Linear,
    /// Key projection.
    pub k_proj: Linear,
    /// Value projection.
    pub v_proj: Linear,
    /// Attention output projection.
    pub o_proj: Linear,
    /// RMSNorm scale before the MLP.
    pub post_attention_layernorm: Tensor,
    /// SwiGLU gate projection.
    pub gate_proj: Linear,
    /// SwiGLU up projection.
    pub up_proj: Linear,
    /// MLP down projection.
    pub down_proj: Linear,
}

/// Every weight of the model, in f32 on the CPU.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// Token embeddings, `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// The transformer blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm scale.
    pub norm: Tensor,
    /// The LM head.
    pub lm_head: LmHead,
}

/// The raw bytes of the weight files and which file holds each tensor.
struct WeightFiles {
    files: Vec<(PathBuf, Vec<u8>)>,
    /// Where an absent tensor is reported: the single file, or the shard index.
    listing: PathBuf,
}

impl WeightFiles {
    fn read(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| ModelError::Io {
                path: path.to_path_buf(),
                source,
            })
        };
        if !single.exists() && index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
                path: index.clone(),
                source,
            })?;
            let value: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Json {
                    path: index.clone(),
                    message: e.to_string(),
                })?;
            let map = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Json {
                    path: index.clone(),
                    message: "missing \"weight_map\"".into(),
                })?;
            let mut names: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            let mut files = Vec::new();
            for name in names {
                let path = dir.join(name);
                let bytes = read(&path)?;
                files.push((path, bytes));
            }
            return Ok(WeightFiles {
                files,
                listing: index,
            });
        }
        let bytes = read(&single)?;
        Ok(WeightFiles {
            files: vec![(single.clone(), bytes)],
            listing: single,
        })
    }
}

/// Looks tensors up across the parsed files and checks their shapes.
struct TensorSource<'a> {
    parsed: Vec<(&'a Path, SafeTensors<'a>)>,
    location: HashMap<String, usize>,
    listing: &'a Path,
}

impl<'a> TensorSource<'a> {
    fn new(files: &'a WeightFiles) -> Result<Self> {
        let mut parsed = Vec::new();
        let mut location = HashMap::new();
        for (index, (path, bytes)) in files.files.iter().enumerate() {
            let tensors = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Safetensors {
                path: path.clone(),
                message: e.to_string(),
            })?;
            for name in tensors.names() {
                location.insert(name.to_string(), index);
            }
            parsed.push((path.as_path(), tensors));
        }
        Ok(TensorSource {
            parsed,
            location,
            listing: &files.listing,
        })
    }

    /// The tensor `name` as f32, checked to have `expected` shape.
    fn get(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let Some(&index) = self.location.get(name) else {
            return Err(ModelError::MissingTensor {
                path: self.listing.to_path_buf(),
                tensor: name.to_string(),
            });
        };
        let (path, tensors) = &self.parsed[index];
        let view = tensors.tensor(name).map_err(|e| ModelError::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if view.shape() != expected {
            return Err(ModelError::ShapeMismatch {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                expected: expected.to_vec(),
                found: view.shape().to_vec(),
            });
        }
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::F16 => DType::F16,
            safetensors::Dtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    tensor: name.to_string(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let tensor = Tensor::from_raw_buffer(view.data(), dtype, expected, &Device::Cpu)?;
        Ok(tensor.to_dtype(DType::F32)?)
    }

    /// A linear layer stored as HF does, `[out, in]`.
    fn linear(&self, prefix: &str, input: usize, output: usize, bias: bool) -> Result<Linear> {
        let weight = self.get(&format!("{prefix}.weight"), &[output, input])?;
        let bias = if bias {
            Some(self.get(&format!("{prefix}.bias"), &[output])?)
        } else {
            None
        };
        Linear::new(&weight, bias.as_ref())
    }
}

impl ModelWeights {
    /// Reads `DIR/model.safetensors` (or the shards `model.safetensors.index.json`
    /// lists) and checks every tensor against `config`.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Self> {
        let files = WeightFiles::read(dir)?;
        let source = TensorSource::new(&files)?;
        let h = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let i = config.intermediate_size;
        let bias = config.attention_bias;
        let (o_bias, mlp_bias) = (config.o_proj_bias(), config.mlp_bias);
        let embed_tokens = source.get("model.embed_tokens.weight", &[config.vocab_size, h])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for n in 0..config.num_hidden_layers {
            let p = format!("model.layers.{n}");
            layers.push(LayerWeights {
                input_layernorm: source.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                q_proj: source.linear(&format!("{p}.self_attn.q_proj"), h, q, bias)?,
                k_proj: source.linear(&format!("{p}.self_attn.k_proj"), h, kv, bias)?,
                v_proj: source.linear(&format!("{p}.self_attn.v_proj"), h, kv, bias)?,
                o_proj: source.linear(&format!("{p}.self_attn.o_proj"), q, h, o_bias)?,
                post_attention_layernorm: source
                    .get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                gate_proj: source.linear(&format!("{p}.mlp.gate_proj"), h, i, mlp_bias)?,
                up_proj: source.linear(&format!("{p}.mlp.up_proj"), h, i, mlp_bias)?,
                down_proj: source.linear(&format!("{p}.mlp.down_proj"), i, h, mlp_bias)?,
            });
        }
        let norm = source.get("model.norm.weight", &[h])?;
        // Some tied checkpoints still ship lm_head.weight; a tied config ignores it.
        let lm_head = if config.tie_word_embeddings {
            LmHead::new(&embed_tokens)?
        } else {
            LmHead::new(&source.get("lm_head.weight", &[config.vocab_size, h])?)?
        };
        Ok(ModelWeights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}
