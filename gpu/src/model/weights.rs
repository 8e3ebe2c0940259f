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
use super::skinny;

/// Rows for which a product runs as [`skinny::multiply`] (a decode step's batch, or a
/// short prefill chunk). Above, candle's gemm, whose packing pays off on many rows; a
/// single row, gemm's own matrix-vector path, which serving at concurrency 1 measured
/// faster.
const SKINNY_ROWS: std::ops::RangeInclusive<usize> = 2..=64;

/// A linear layer, stored as checkpoints hold it (`[out, in]`): the few-row product
/// streams each weight row in order, and candle's gemm takes the transposed view as it
/// is (strides, no copy).
#[derive(Debug, Clone)]
pub struct Linear {
    /// The weight, `[out, in]`.
    pub weight: Tensor,
    /// The bias, `[out]`, where the architecture has one.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// `x @ W^T + b` for `x` of shape `[rows, in]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        if SKINNY_ROWS.contains(&rows) {
            let out = self.weight.dim(0)?;
            let mut y = vec![0.0f32; rows * out];
            let mut outputs: Vec<&mut [f32]> = y.chunks_mut(out.max(1)).collect();
            product(x, &self.weight, self.bias.as_ref(), &mut outputs)?;
            return Ok(Tensor::from_vec(y, (rows, out), &Device::Cpu)?);
        }
        let y = if rows == 1 {
            // `W @ x^T`: gemm's matrix-vector product then streams each weight row in
            // order, as in the LM head; `[out, 1]` is `[1, out]`'s memory.
            self.weight
                .matmul(&x.t()?)?
                .reshape((1, self.weight.dim(0)?))?
        } else {
            x.matmul(&self.weight.t()?)?
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// `outputs[r] = x[r] @ weight^T (+ bias)` through [`skinny::multiply`], reading the
/// weight and bias where candle holds them.
fn product(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    outputs: &mut [&mut [f32]],
) -> Result<()> {
    let inner = weight.dim(1)?;
    let x = x.flatten_all()?.to_vec1::<f32>()?;
    with_values(weight, |weight| match bias {
        Some(bias) => with_values(bias, |bias| {
            skinny::multiply(&x, inner, weight, Some(bias), outputs)
        }),
        None => {
            skinny::multiply(&x, inner, weight, None, outputs);
            Ok(())
        }
    })?
}

/// Calls `f` with a contiguous f32 CPU tensor's values, borrowed in place.
fn with_values<R>(tensor: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
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

/// The LM head, stored as checkpoints hold it (`[vocab, hidden]`) and packed into
/// panels. A decode step's few rows go through the panels ([`Panels::multiply`])
/// straight into each row's logits; one row and many rows (a prompt's log-probabilities)
/// through candle's gemm as `W @ x^T`, which streams each vocabulary row contiguously,
/// then a transpose into per-row logits.
#[derive(Debug, Clone)]
pub struct LmHead {
    /// The weight, `[vocab, hidden]` (the embedding itself when tied).
    pub weight: Tensor,
    /// The same weight in panels (shared by clones).
    packed: Arc<Panels>,
}

/// Rows for which the head runs through its panels.
const PANEL_ROWS: std::ops::RangeInclusive<usize> = 1..=64;

/// Vocabulary entries per block of the logits' transpose: a block of 32 rows is 8 KiB.
const TRANSPOSE_BLOCK: usize = 64;

impl LmHead {
    /// The head of `weight` (`[vocab, hidden]`), packed once here.
    pub fn new(weight: Tensor) -> Result<LmHead> {
        let (vocab, hidden) = weight.dims2()?;
        let packed = with_values(&weight, |w| Panels::pack(w, vocab, hidden))?;
        Ok(LmHead {
            weight,
            packed: Arc::new(packed),
        })
    }

    /// The logits (`[vocab]` each) of every row of `x` (`[rows, hidden]`).
    pub fn logits(&self, x: &Tensor) -> Result<Vec<Vec<f32>>> {
        let rows = x.dim(0)?;
        if PANEL_ROWS.contains(&rows) {
            let vocab = self.weight.dim(0)?;
            let mut logits = vec![vec![0.0f32; vocab]; rows];
            let mut outputs: Vec<&mut [f32]> = logits.iter_mut().map(Vec::as_mut_slice).collect();
            let x = x.flatten_all()?.to_vec1::<f32>()?;
            self.packed.multiply(&x, &mut outputs);
            return Ok(logits);
        }
        // `[vocab, rows]`, contiguous: one copy out of candle, then a transpose that
        // reads it in order (candle's strided copy indexes element by element).
        let columns = self
            .weight
            .matmul(&x.t()?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        if rows == 1 {
            // One row: its column is its logits.
            return Ok(vec![columns]);
        }
        let vocab = columns.len() / rows.max(1);
        let mut logits: Vec<Vec<f32>> = (0..rows).map(|_| Vec::with_capacity(vocab)).collect();
        // Block by block of the vocabulary, so that a block's columns stay in L1 while
        // every row takes its part of them (one row at a time wrote 32 streams at once).
        for block in columns.chunks(TRANSPOSE_BLOCK * rows.max(1)) {
            let width = block.len() / rows;
            for (r, row) in logits.iter_mut().enumerate() {
                row.extend((0..width).map(|v| block[v * rows + r]));
            }
        }
        Ok(logits)
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
        Ok(Linear { weight, bias })
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
        let lm_head = LmHead::new(if config.tie_word_embeddings {
            // A candle tensor is shared, not copied, when cloned.
            embed_tokens.clone()
        } else {
            source.get("lm_head.weight", &[config.vocab_size, h])?
        })?;
        Ok(ModelWeights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}
