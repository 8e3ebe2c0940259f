//! The transformer's arithmetic, shared by the paged and the dense forward so that the
//! two differ only in where K/V live: RMSNorm, rotary embeddings, grouped-query
//! attention with a causal mask, and the gated MLP.

use candle_core::{D, Device, Tensor};
use pulp::Arch;

use super::config::Activation;
use super::error::Result;
use super::weights::LayerWeights;

/// `x / rms(x) * weight` for each row of `x` (rows as wide as `weight`).
pub(crate) fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let width = weight.len().max(1);
    let mut out = vec![0.0f32; x.len()];
    Arch::new().dispatch(
        #[inline(always)]
        || {
            for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
                let mean_square = sum_of_squares(row) / width as f32;
                let inverse_rms = 1.0 / (mean_square + eps as f32).sqrt();
                for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
                    *o = v * inverse_rms * w;
                }
            }
        },
    );
    out
}

/// `Σ v²`, in sixteen running sums so that the compiler keeps them in vector registers
/// (one running sum is a serial chain it may not reorder).
#[inline(always)]
fn sum_of_squares(row: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let chunks = row.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += v * v;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Cosines and sines of the rotary angles of a batch's positions, `head_dim / 2` of each
/// per position.
pub(crate) struct RotaryAngles {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl RotaryAngles {
    /// Angles for `positions` with the given inverse frequencies (`head_dim / 2` of
    /// them: `ModelConfig::inverse_frequencies`), computed in f64 so a long position
    /// loses no precision before the cast.
    pub(crate) fn new(positions: &[u32], inverse_frequencies: &[f64]) -> RotaryAngles {
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
        RotaryAngles { cos, sin, half }
    }

    /// Rotates `x` (`[tokens, heads, head_dim]` row-major, one token per position) in
    /// place, in the Hugging Face "rotate half" convention: dimension `i` pairs with
    /// `i + head_dim / 2`.
    pub(crate) fn apply(&self, x: &mut [f32]) {
        let half = self.half;
        if half == 0 {
            return;
        }
        let tokens = self.cos.len() / half;
        let width = x.len() / tokens.max(1);
        Arch::new().dispatch(
            #[inline(always)]
            || {
                for (t, token) in x.chunks_exact_mut(width).enumerate() {
                    let cos = &self.cos[t * half..(t + 1) * half];
                    let sin = &self.sin[t * half..(t + 1) * half];
                    for head in token.chunks_exact_mut(2 * half) {
                        let (first, second) = head.split_at_mut(half);
                        for (((a, b), &c), &s) in first.iter_mut().zip(second).zip(cos).zip(sin) {
                            let (x1, x2) = (*a, *b);
                            *a = x1 * c - x2 * s;
                            *b = x2 * c + x1 * s;
                        }
                    }
                }
            },
        );
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

/// The gated MLP: `down(act(gate(x)) * up(x))`, `act` SiLU (SwiGLU) or a GELU, for `x`
/// of `[rows, hidden]` row-major.
pub(crate) fn gated_mlp(x: &[f32], layer: &LayerWeights, act: Activation) -> Result<Vec<f32>> {
    let mut gate = layer.gate_proj.forward(x);
    let up = layer.up_proj.forward(x);
    match act {
        Activation::Silu => Arch::new().dispatch(
            #[inline(always)]
            || {
                // candle's SiLU, `v / (1 + e^-v)`, fused with the product by `up`.
                for (g, &u) in gate.iter_mut().zip(&up) {
                    *g = *g / (1.0 + (-*g).exp()) * u;
                }
            },
        ),
        Activation::Gelu | Activation::GeluTanh => {
            // Rare in the families served: candle's GELUs on a tensor of the rows.
            let len = gate.len();
            let rows = Tensor::from_vec(gate, len, &Device::Cpu)?;
            let rows = match act {
                Activation::Gelu => rows.gelu_erf()?,
                _ => rows.gelu()?,
            };
            gate = rows.to_vec1::<f32>()?;
            for (g, &u) in gate.iter_mut().zip(&up) {
                *g *= u;
            }
        }
    }
    Ok(layer.down_proj.forward(&gate))
}
