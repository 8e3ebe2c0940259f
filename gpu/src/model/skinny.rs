//! The product of a few rows by a weight matrix, as a decode step needs it: `y = x W^T`
//! with `x` of `rows` rows (one per request, 1 to a few dozen) and `W` in the
//! checkpoint's `[out, in]` layout.
//!
//! A general GEMM (candle's `gemm`) packs both operands into cache-sized panels and
//! shines on square-ish products; with a few rows the packing is not repaid and its
//! kernels run at a fraction of the machine (issue 28's profile). Here every output is
//! a dot product of a weight row, read once from memory in order, with each input row,
//! which stays in L1/L2: a tile of [`TILE_ROWS`] rows by [`TILE_OUTPUTS`] weight rows
//! keeps its dot products in registers, so each loaded weight vector feeds
//! `TILE_ROWS` FMAs and each loaded input vector `TILE_OUTPUTS`. The outputs are split
//! across the rayon pool (the same threads candle's gemm uses) in chunks of whole weight
//! rows.
//!
//! SIMD goes through `pulp`, which picks the widest instruction set the CPU has at run
//! time behind a safe interface (this crate forbids `unsafe`).

use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// Input rows one tile multiplies at once.
const TILE_ROWS: usize = 4;
/// Weight rows (outputs) one tile multiplies at once. 3 × 3 accumulators, 3 weight
/// vectors and an input vector fit AVX2's 16 registers.
const TILE_OUTPUTS: usize = 4;
/// Work (in multiply-adds) below which a product runs on the calling thread alone:
/// waking the pool costs more than it saves.
const PARALLEL_MIN_WORK: usize = 1 << 20;
/// Work each parallel task gets at least.
const TASK_MIN_WORK: usize = 1 << 18;
/// What streaming one weight from memory costs, in multiply-adds from cache: with a few
/// rows a product is bound by reading its weights (one row's decode step reads each
/// weight once), so their size, not the multiply-adds, says whether two threads pay.
const WEIGHT_READ_WORK: usize = 16;

/// `outputs[r][o] = x[r] · weight[o] (+ bias[o])` for `x` of `rows` rows of `inner`
/// values (row-major), `weight` of `out` rows of `inner` values (row-major, `[out,
/// in]`), and each `outputs[r]` of `out` values.
///
/// # Panics
///
/// If the slices' lengths disagree with `inner` and `out` (a caller's bug, not input).
pub(crate) fn multiply(
    x: &[f32],
    inner: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    outputs: &mut [&mut [f32]],
) {
    let rows = outputs.len();
    assert_eq!(x.len(), rows * inner, "x is rows × inner");
    let out = weight.len().checked_div(inner).unwrap_or(0);
    assert_eq!(weight.len(), out * inner, "weight is out × inner");
    assert!(
        outputs.iter().all(|o| o.len() == out),
        "each output row is out long"
    );
    if let Some(b) = bias {
        assert_eq!(b.len(), out, "bias is out long");
    }
    let work = (rows * inner * out).max(weight.len() * WEIGHT_READ_WORK);
    let threads = rayon::current_num_threads();
    if work < PARALLEL_MIN_WORK || threads == 1 || out < 2 * TILE_OUTPUTS {
        let task = Task {
            x,
            inner,
            weight,
            bias,
            outputs,
        };
        Arch::new().dispatch(task);
        return;
    }
    // Several tasks per thread so a thread slowed by the machine does not hold the rest;
    // each a whole number of tiles.
    let tasks = (work / TASK_MIN_WORK).clamp(1, 4 * threads);
    let chunk = out.div_ceil(tasks).div_ceil(TILE_OUTPUTS) * TILE_OUTPUTS;
    let tasks = out.div_ceil(chunk);
    let mut pieces: Vec<Vec<&mut [f32]>> = (0..tasks).map(|_| Vec::with_capacity(rows)).collect();
    for row in outputs.iter_mut() {
        for (t, piece) in row.chunks_mut(chunk).enumerate() {
            pieces[t].push(piece);
        }
    }
    pieces
        .into_par_iter()
        .enumerate()
        .for_each(|(t, mut outputs)| {
            let first = t * chunk;
            let last = (first + chunk).min(out);
            Arch::new().dispatch(Task {
                x,
                inner,
                weight: &weight[first * inner..last * inner],
                bias: bias.map(|b| &b[first..last]),
                outputs: &mut outputs,
            });
        });
}

/// One thread's share: the outputs whose weight rows `weight` holds (and `bias`, and
/// each of `outputs`, starts at the same output).
struct Task<'a, 'o> {
    x: &'a [f32],
    inner: usize,
    weight: &'a [f32],
    bias: Option<&'a [f32]>,
    outputs: &'a mut [&'o mut [f32]],
}

impl WithSimd for Task<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        let Task {
            x,
            inner,
            weight,
            bias,
            outputs,
        } = self;
        let rows = outputs.len();
        let out = weight.len() / inner.max(1);
        let mut o = 0;
        while o < out {
            let width = (out - o).min(TILE_OUTPUTS);
            let mut r = 0;
            while r < rows {
                let height = (rows - r).min(TILE_ROWS);
                let sums = match (height, width) {
                    (4, 4) => tile::<S, 4, 4>(simd, x, inner, weight, r, o),
                    _ => small_tile(simd, x, inner, weight, r, o, height, width),
                };
                for (dr, row_sums) in sums.iter().enumerate().take(height) {
                    for (dc, &sum) in row_sums.iter().enumerate().take(width) {
                        let b = bias.map_or(0.0, |b| b[o + dc]);
                        outputs[r + dr][o + dc] = sum + b;
                    }
                }
                r += height;
            }
            o += width;
        }
    }
}

/// The dot products of input rows `r..r + R` with weight rows `o..o + O`, in registers.
#[inline(always)]
fn tile<S: Simd, const R: usize, const O: usize>(
    simd: S,
    x: &[f32],
    inner: usize,
    weight: &[f32],
    r: usize,
    o: usize,
) -> [[f32; TILE_OUTPUTS]; TILE_ROWS] {
    let zero = simd.splat_f32s(0.0);
    let mut acc = [[zero; O]; R];
    let xs: [&[f32]; R] = std::array::from_fn(|i| &x[(r + i) * inner..(r + i + 1) * inner]);
    let ws: [&[f32]; O] = std::array::from_fn(|j| &weight[(o + j) * inner..(o + j + 1) * inner]);
    let xv: [(&[S::f32s], &[f32]); R] = std::array::from_fn(|i| S::as_simd_f32s(xs[i]));
    let wv: [(&[S::f32s], &[f32]); O] = std::array::from_fn(|j| S::as_simd_f32s(ws[j]));
    let lanes = wv[0].0.len();
    for k in 0..lanes {
        let w: [S::f32s; O] = std::array::from_fn(|j| wv[j].0[k]);
        for i in 0..R {
            let xk = xv[i].0[k];
            for j in 0..O {
                acc[i][j] = simd.mul_add_f32s(xk, w[j], acc[i][j]);
            }
        }
    }
    let mut sums = [[0.0; TILE_OUTPUTS]; TILE_ROWS];
    for i in 0..R {
        for j in 0..O {
            let tail: f32 = xv[i].1.iter().zip(wv[j].1).map(|(a, b)| a * b).sum();
            sums[i][j] = simd.reduce_sum_f32s(acc[i][j]) + tail;
        }
    }
    sums
}

/// A tile at the edge: `height` rows by `width` outputs, each below the full tile's.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn small_tile<S: Simd>(
    simd: S,
    x: &[f32],
    inner: usize,
    weight: &[f32],
    r: usize,
    o: usize,
    height: usize,
    width: usize,
) -> [[f32; TILE_OUTPUTS]; TILE_ROWS] {
    match (height, width) {
        (1, 1) => tile::<S, 1, 1>(simd, x, inner, weight, r, o),
        (1, 2) => tile::<S, 1, 2>(simd, x, inner, weight, r, o),
        (1, 3) => tile::<S, 1, 3>(simd, x, inner, weight, r, o),
        (1, _) => tile::<S, 1, 4>(simd, x, inner, weight, r, o),
        (2, 1) => tile::<S, 2, 1>(simd, x, inner, weight, r, o),
        (2, 2) => tile::<S, 2, 2>(simd, x, inner, weight, r, o),
        (2, 3) => tile::<S, 2, 3>(simd, x, inner, weight, r, o),
        (2, _) => tile::<S, 2, 4>(simd, x, inner, weight, r, o),
        (3, 1) => tile::<S, 3, 1>(simd, x, inner, weight, r, o),
        (3, 2) => tile::<S, 3, 2>(simd, x, inner, weight, r, o),
        (3, 3) => tile::<S, 3, 3>(simd, x, inner, weight, r, o),
        (3, _) => tile::<S, 3, 4>(simd, x, inner, weight, r, o),
        (_, 1) => tile::<S, 4, 1>(simd, x, inner, weight, r, o),
        (_, 2) => tile::<S, 4, 2>(simd, x, inner, weight, r, o),
        _ => tile::<S, 4, 3>(simd, x, inner, weight, r, o),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same product in f64, term by term.
    fn reference(x: &[f32], inner: usize, weight: &[f32], bias: Option<&[f32]>) -> Vec<Vec<f64>> {
        let rows = x.len() / inner;
        let out = weight.len() / inner;
        (0..rows)
            .map(|r| {
                (0..out)
                    .map(|o| {
                        let dot: f64 = (0..inner)
                            .map(|k| x[r * inner + k] as f64 * weight[o * inner + k] as f64)
                            .sum();
                        dot + bias.map_or(0.0, |b| b[o] as f64)
                    })
                    .collect()
            })
            .collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed.wrapping_mul(40_503));
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn every_shape_matches_the_term_by_term_product() {
        // Rows and outputs off the tile sizes, inner off the SIMD widths, and products
        // large enough to be split across the pool.
        for &(rows, inner, out) in &[
            (1, 1, 1),
            (1, 7, 5),
            (2, 16, 4),
            (3, 33, 7),
            (4, 64, 10),
            (5, 256, 11),
            (8, 256, 512),
            (17, 100, 301),
            (32, 256, 2000),
            (33, 257, 1031),
        ] {
            let x = values(rows * inner, 1);
            let weight = values(out * inner, 2);
            let bias = values(out, 3);
            for bias in [None, Some(bias.as_slice())] {
                let mut flat = vec![f32::NAN; rows * out];
                let mut outputs: Vec<&mut [f32]> = flat.chunks_mut(out).collect();
                multiply(&x, inner, &weight, bias, &mut outputs);
                let expected = reference(&x, inner, &weight, bias);
                for r in 0..rows {
                    for o in 0..out {
                        let got = flat[r * out + o] as f64;
                        let want = expected[r][o];
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "rows {rows} inner {inner} out {out} bias {}: [{r}][{o}] = {got}, want {want}",
                            bias.is_some()
                        );
                    }
                }
            }
        }
    }
}
