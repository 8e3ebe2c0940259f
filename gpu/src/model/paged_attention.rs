//! Causal grouped-query attention of one request, read in place from where its K/V
//! live: plain f32 loops, no tensor per request and no gathered copy of its context.
//!
//! A decode step has one query token per request: as candle tensor ops its attention is
//! a dozen tiny allocations and dispatches per request and layer plus a copy of the
//! request's whole K/V out of its blocks, which cost more than the arithmetic. Here each
//! key and value row is read once from its block and used by every head of its group.

use pulp::Arch;

/// Shape of the attention: `heads` query heads sharing `kv_heads` K/V heads, each
/// `head_dim` wide, and an optional sliding `window` (a key is visible iff it is at most
/// `window - 1` positions before the query).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
}

/// Attends the `n` new tokens of one request, at positions `start..start + n`, to the keys
/// at positions `context_start..start + n`.
///
/// `queries` is `[n, heads * head_dim]` row-major; `kv_row(p)` gives the K and V rows
/// (`[kv_heads * head_dim]` each) of position `p`; `out` receives `[n, heads * head_dim]`.
/// Query `i` sees key `p` iff `p <= start + i` and, with a window, `start + i - p < window`:
/// the same mask as [`super::ops::attention`], the dense reference's.
pub(crate) fn attend<'a>(
    shape: AttentionShape,
    queries: &[f32],
    start: usize,
    context_start: usize,
    kv_row: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    // Compiled for the widest SIMD the CPU has (the loops inline into pulp's dispatch):
    // the build targets baseline x86-64.
    Arch::new().dispatch(
        #[inline(always)]
        || {
            let AttentionShape {
                heads,
                kv_heads,
                head_dim,
                window,
            } = shape;
            let group = heads / kv_heads;
            let width = heads * head_dim;
            let scale = 1.0 / (head_dim as f32).sqrt();
            let n = queries.len() / width;
            // Scores of every head against the visible keys, `[heads, keys]`, reused per
            // query.
            let mut scores = Vec::new();
            for i in 0..n {
                let position = start + i;
                let first = window.map_or(context_start, |w| {
                    context_start.max((position + 1).saturating_sub(w))
                });
                let keys = position + 1 - first;
                let query = &queries[i * width..(i + 1) * width];
                scores.clear();
                scores.resize(heads * keys, 0.0);
                for (j, p) in (first..=position).enumerate() {
                    let (key, _) = kv_row(p);
                    for h in 0..heads {
                        let g = h / group;
                        scores[h * keys + j] = dot(
                            &query[h * head_dim..(h + 1) * head_dim],
                            &key[g * head_dim..(g + 1) * head_dim],
                        ) * scale;
                    }
                }
                for row in scores.chunks_exact_mut(keys) {
                    softmax(row);
                }
                let out = &mut out[i * width..(i + 1) * width];
                out.fill(0.0);
                for (j, p) in (first..=position).enumerate() {
                    let (_, value) = kv_row(p);
                    for h in 0..heads {
                        let g = h / group;
                        let weight = scores[h * keys + j];
                        let value = &value[g * head_dim..(g + 1) * head_dim];
                        for (o, v) in out[h * head_dim..(h + 1) * head_dim].iter_mut().zip(value) {
                            *o += weight * v;
                        }
                    }
                }
            }
        },
    )
}

/// `a · b`, in sixteen running sums so the compiler can keep them in vector registers
/// (a single running sum is a serial chain it may not reorder).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let (a8, b8) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for ((lane, x), y) in lanes.iter_mut().zip(x).zip(y) {
            *lane += x * y;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// In-place softmax of one row, max subtracted first as the reference does.
#[inline(always)]
fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in row.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for s in row.iter_mut() {
        *s /= sum;
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::*;

    /// The loops agree with the dense reference's tensor attention, with GQA, a prefill
    /// chunk after cached tokens (causal mask) and a sliding window.
    #[test]
    fn the_loops_match_the_reference_tensor_attention() {
        let (heads, kv_heads, head_dim) = (4, 2, 12);
        let (start, n) = (5, 3);
        let context = start + n;
        let values_of = |len: usize, salt: f32| -> Vec<f32> {
            (0..len)
                .map(|i| (i as f32 * 0.37 + salt).sin() * 1.7)
                .collect()
        };
        let q = values_of(n * heads * head_dim, 0.1);
        let k = values_of(context * kv_heads * head_dim, 0.7);
        let v = values_of(context * kv_heads * head_dim, 1.3);
        let stride = kv_heads * head_dim;
        for window in [None, Some(4)] {
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim,
                window,
            };
            let mut out = vec![0.0; n * heads * head_dim];
            attend(
                shape,
                &q,
                start,
                0,
                |p| {
                    (
                        &k[p * stride..(p + 1) * stride],
                        &v[p * stride..(p + 1) * stride],
                    )
                },
                &mut out,
            );
            let cpu = &Device::Cpu;
            let reference = crate::model::ops::attention(
                &Tensor::from_slice(&q, (n, heads, head_dim), cpu).unwrap(),
                &Tensor::from_slice(&k, (context, kv_heads, head_dim), cpu).unwrap(),
                &Tensor::from_slice(&v, (context, kv_heads, head_dim), cpu).unwrap(),
                start,
                0,
                window,
            )
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
            for (a, b) in out.iter().zip(&reference) {
                assert!((a - b).abs() < 1e-5, "{window:?}: {a} vs {b}");
            }
        }
    }
}
