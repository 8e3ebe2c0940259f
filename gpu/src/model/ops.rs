//! The transformer's arithmetic, shared by the paged and the dense forward so that the
//! two differ only in where K/V live: RMSNorm, rotary embeddings, grouped-query
//! attention with a causal mask, and the gated MLP.

use candle_core::{D, Device, Tensor};

use super::config::Activation;
use super::error::Result;
use super::weights::LayerWeights;

/// `x / rms(x) * weight` over the last dimension.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inverse_rms = (mean_square + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inverse_rms)?.broadcast_mul(weight)?)
}

/// Cosines and sines of the rotary angles of a batch's positions, `[tokens, 1, head_dim / 2]`
/// each (the 1 broadcasts over heads).
pub(crate) struct RotaryAngles {
    cos: Tensor,
    sin: Tensor,
}

impl RotaryAngles {
    /// Angles for `positions` with the given inverse frequencies (`head_dim / 2` of
    /// them: `ModelConfig::inverse_frequencies`), computed in f64 so a long position
    /// loses no precision before the cast.
    pub(crate) fn new(positions: &[u32], inverse_frequencies: &[f64]) -> Result<Self> {
        let half = inverse_frequencies.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &inverse_frequency in inverse_frequencies {
                let angle = p as f64 * inverse_frequency;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = (positions.len(), 1, half);
        Ok(RotaryAngles {
            cos: Tensor::from_vec(cos, shape, &Device::Cpu)?,
            sin: Tensor::from_vec(sin, shape, &Device::Cpu)?,
        })
    }

    /// Rotates `x` (`[tokens, heads, head_dim]`) in the Hugging Face "rotate half"
    /// convention: dimension `i` pairs with `i + head_dim / 2`.
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let half = x.dim(D::Minus1)? / 2;
        let first = x.narrow(D::Minus1, 0, half)?;
        let second = x.narrow(D::Minus1, half, half)?;
        let rotated_first = (first.broadcast_mul(&self.cos)? - second.broadcast_mul(&self.sin)?)?;
        let rotated_second =
            (second.broadcast_mul(&self.cos)? + first.broadcast_mul(&self.sin)?)?;
        Ok(Tensor::cat(&[rotated_first, rotated_second], D::Minus1)?)
    }
}

/// Causal grouped-query attention of one request's new tokens.
///
/// `queries` is `[n, heads, head_dim]` for positions `start..start + n`; `keys` and
/// `values` are `[ctx, kv_heads, head_dim]` for positions `context_start..context_start +
/// ctx`. Query `i` sees key `j` iff `context_start + j <= start + i` and, with a sliding
/// `window`, `start + i - (context_start + j) < window`. Returns `[n, heads * head_dim]`.
pub(crate) fn attention(
    queries: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    start: usize,
    context_start: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let (n, heads, head_dim) = queries.dims3()?;
    let (context, kv_heads, _) = keys.dims3()?;
    let group = heads / kv_heads;
    // Query head h reads KV head h / group: folding the group into the rows lets one
    // batched matmul per KV head serve all of its query heads without repeating K/V.
    let q = queries
        .transpose(0, 1)?
        .contiguous()?
        .reshape((kv_heads, group * n, head_dim))?;
    let k = keys.transpose(0, 1)?.contiguous()?;
    let v = values.transpose(0, 1)?.contiguous()?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut scores = (q.matmul(&k.t()?)? * scale)?;
    let last_key = context_start + context;
    let last_query = start + n.max(1) - 1;
    let outside_window = window.is_some_and(|w| last_query.saturating_sub(context_start) >= w);
    if last_key > start + 1 || outside_window {
        // Some key lies after some query, or too far before it: mask it. (A decode
        // step's single query sees every key of its window, so it skips the mask.)
        let mut mask = Vec::with_capacity(group * n * context);
        for _ in 0..group {
            for i in 0..n {
                for j in 0..context {
                    let (query, key) = (start + i, context_start + j);
                    let visible = key <= query && window.is_none_or(|w| query - key < w);
                    mask.push(if visible { 0.0f32 } else { f32::NEG_INFINITY });
                }
            }
        }
        let mask = Tensor::from_vec(mask, (1, group * n, context), &Device::Cpu)?;
        scores = scores.broadcast_add(&mask)?;
    }
    let max = scores.max_keepdim(D::Minus1)?;
    let exp = scores.broadcast_sub(&max)?.exp()?;
    let probabilities = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;
    let out = probabilities.matmul(&v)?; // [kv_heads, group * n, head_dim]
    Ok(out
        .reshape((heads, n, head_dim))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n, heads * head_dim))?)
}

/// The gated MLP: `down(act(gate(x)) * up(x))`, `act` SiLU (SwiGLU) or a GELU.
pub(crate) fn gated_mlp(x: &Tensor, layer: &LayerWeights, act: Activation) -> Result<Tensor> {
    let gate = layer.gate_proj.forward(x)?;
    let gate = match act {
        Activation::Silu => gate.silu()?,
        Activation::Gelu => gate.gelu_erf()?,
        Activation::GeluTanh => gate.gelu()?,
    };
    let up = layer.up_proj.forward(x)?;
    layer.down_proj.forward(&(gate * up)?)
}
