//! Weight matrices packed into panels, and their products with a batch's rows.
//!
//! Every projection and the LM head are packed once at load as panels of [`PANEL`]
//! output rows, each panel input-major (`[inner][PANEL]`): a panel is one contiguous run
//! the prefetcher streams, and its product with input rows is a sum of outer products.
//! For each inner index, the panel's [`PANEL`] weights (a few SIMD vectors) are loaded
//! once and multiplied by each row's input value, broadcast, into accumulators that
//! hold the rows' outputs for the panel. No horizontal sums: a dot product per output
//! would end in one each, a quarter of a tile's work at an inner size of 256.

use pulp::{Arch, Simd, WithSimd};
use rayon::prelude::*;

/// Vocabulary entries per panel: two AVX-512 vectors, four AVX2 ones.
pub(crate) const PANEL: usize = 32;
/// Rows multiplied together at most (a decode step's batch, or a block of a prompt's).
const ROW_BLOCK: usize = 256;
/// Work (multiply-adds, or weights read, whichever is more) each parallel task gets at
/// least; below twice this a product runs on the calling thread.
const TASK_MIN_WORK: usize = 1 << 18;

/// A `[out, inner]` weight matrix packed panel by panel (the last panel padded with
/// zeros).
#[derive(Debug, Clone)]
pub(crate) struct Panels {
    values: Vec<f32>,
    out: usize,
    inner: usize,
}

impl Panels {
    /// Packs `weight`, `[out, inner]` row-major.
    pub(crate) fn pack(weight: &[f32], out: usize, inner: usize) -> Panels {
        assert_eq!(weight.len(), out * inner, "weight is out × inner");
        let panels = out.div_ceil(PANEL);
        let mut values = vec![0.0f32; panels * inner * PANEL];
        for (o, row) in weight.chunks_exact(inner.max(1)).enumerate() {
            let panel = &mut values[(o / PANEL) * inner * PANEL..][..inner * PANEL];
            for (k, &w) in row.iter().enumerate() {
                panel[k * PANEL + o % PANEL] = w;
            }
        }
        Panels { values, out, inner }
    }

    /// The matrix's rows (outputs) and columns (inner).
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.out, self.inner)
    }

    /// The matrix back in `[out, inner]` row-major order.
    pub(crate) fn unpack(&self) -> Vec<f32> {
        let inner = self.inner;
        let mut weight = vec![0.0f32; self.out * inner];
        for (o, row) in weight.chunks_exact_mut(inner.max(1)).enumerate() {
            let panel = &self.values[(o / PANEL) * inner * PANEL..][..inner * PANEL];
            for (k, w) in row.iter_mut().enumerate() {
                *w = panel[k * PANEL + o % PANEL];
            }
        }
        weight
    }

    /// `outputs[r] = x[r] @ W^T` for `x` of `outputs.len()` rows of `inner` values.
    pub(crate) fn multiply(&self, x: &[f32], outputs: &mut [&mut [f32]]) {
        let (out, inner) = (self.out, self.inner);
        assert_eq!(x.len(), outputs.len() * inner, "x is rows × inner");
        assert!(
            outputs.iter().all(|o| o.len() == out),
            "each output row is out long"
        );
        // A prompt's many rows go [`ROW_BLOCK`] at a time, so the rows a panel meets
        // stay in L2 while every panel passes over them.
        for (x, outputs) in x
            .chunks(ROW_BLOCK * inner.max(1))
            .zip(outputs.chunks_mut(ROW_BLOCK))
        {
            self.multiply_block(x, outputs);
        }
    }

    fn multiply_block(&self, x: &[f32], outputs: &mut [&mut [f32]]) {
        let (out, inner) = (self.out, self.inner);
        let rows = outputs.len();
        let panels = out.div_ceil(PANEL);
        let work = (rows * inner * out).max(self.values.len());
        let threads = rayon::current_num_threads();
        let tasks = (work / TASK_MIN_WORK).clamp(1, 4 * threads).min(panels);
        if tasks < 2 || threads == 1 {
            Arch::new().dispatch(PanelRun {
                panels: &self.values,
                inner,
                x,
                outputs,
            });
            return;
        }
        let per_task = panels.div_ceil(tasks);
        let chunk = per_task * PANEL;
        let mut pieces: Vec<Vec<&mut [f32]>> = (0..out.div_ceil(chunk))
            .map(|_| Vec::with_capacity(rows))
            .collect();
        for row in outputs.iter_mut() {
            for (t, piece) in row.chunks_mut(chunk).enumerate() {
                pieces[t].push(piece);
            }
        }
        let values = &self.values;
        pieces
            .into_par_iter()
            .enumerate()
            .for_each(|(t, mut outputs)| {
                let first = t * per_task * inner * PANEL;
                let last = (first + per_task * inner * PANEL).min(values.len());
                Arch::new().dispatch(PanelRun {
                    panels: &values[first..last],
                    inner,
                    x,
                    outputs: &mut outputs,
                });
            });
    }
}

/// Panels and the outputs they give (each of `outputs` starts at the first panel's
/// first entry and is as long as the entries the panels hold, the padding excepted).
struct PanelRun<'a, 'o> {
    panels: &'a [f32],
    inner: usize,
    x: &'a [f32],
    outputs: &'a mut [&'o mut [f32]],
}

impl WithSimd for PanelRun<'_, '_> {
    type Output = ();

    #[inline(always)]
    fn with_simd<S: Simd>(self, simd: S) {
        // Rows per tile so that the accumulators (rows × vectors per panel) fill about
        // half the registers: 8 × 2 with AVX-512's 32, 2 × 4 with AVX2's 16.
        match core::mem::size_of::<S::f32s>() {
            64 => run::<S, 8, 2>(simd, self),
            32 => run::<S, 2, 4>(simd, self),
            16 => run::<S, 2, 8>(simd, self),
            _ => run::<S, 1, { PANEL }>(simd, self),
        }
    }
}

/// The tiles of `R` rows over every panel, `V` SIMD vectors per panel.
#[inline(always)]
fn run<S: Simd, const R: usize, const V: usize>(simd: S, job: PanelRun<'_, '_>) {
    let PanelRun {
        panels,
        inner,
        x,
        outputs,
    } = job;
    let rows = outputs.len();
    let width = outputs.first().map_or(0, |o| o.len());
    for (p, panel) in panels.chunks_exact(inner * PANEL).enumerate() {
        let start = p * PANEL;
        let end = (start + PANEL).min(width);
        let mut r = 0;
        while r < rows {
            let height = (rows - r).min(R);
            let tile_rows = &mut outputs[r..r + height];
            match height {
                1 => tile::<S, 1, V>(simd, panel, inner, x, r, tile_rows, start..end),
                2 => tile::<S, 2, V>(simd, panel, inner, x, r, tile_rows, start..end),
                3 => tile::<S, 3, V>(simd, panel, inner, x, r, tile_rows, start..end),
                4 => tile::<S, 4, V>(simd, panel, inner, x, r, tile_rows, start..end),
                5 => tile::<S, 5, V>(simd, panel, inner, x, r, tile_rows, start..end),
                6 => tile::<S, 6, V>(simd, panel, inner, x, r, tile_rows, start..end),
                7 => tile::<S, 7, V>(simd, panel, inner, x, r, tile_rows, start..end),
                _ => tile::<S, R, V>(simd, panel, inner, x, r, tile_rows, start..end),
            }
            r += height;
        }
    }
}

/// Rows `r..r + H` times one panel (`V` vectors wide) into `outputs[..][entries]`.
#[inline(always)]
fn tile<S: Simd, const H: usize, const V: usize>(
    simd: S,
    panel: &[f32],
    inner: usize,
    x: &[f32],
    r: usize,
    outputs: &mut [&mut [f32]],
    entries: std::ops::Range<usize>,
) {
    let zero = simd.splat_f32s(0.0);
    let mut acc = [[zero; V]; H];
    let xs: [&[f32]; H] = std::array::from_fn(|i| &x[(r + i) * inner..(r + i + 1) * inner]);
    for (k, weights) in panel.chunks_exact(PANEL).enumerate() {
        let w = &S::as_simd_f32s(weights).0[..V];
        for i in 0..H {
            let b = simd.splat_f32s(xs[i][k]);
            for v in 0..V {
                acc[i][v] = simd.mul_add_f32s(b, w[v], acc[i][v]);
            }
        }
    }
    for (i, out) in outputs.iter_mut().enumerate().take(H) {
        let out = &mut out[entries.clone()];
        if out.len() == PANEL {
            // A whole panel's outputs take the accumulators straight (a copy through a
            // buffer was a call to memcpy per row and panel).
            for (lane, a) in S::as_mut_simd_f32s(out).0.iter_mut().zip(&acc[i]) {
                *lane = *a;
            }
        } else {
            let mut sums = [0.0f32; PANEL];
            for (lane, a) in S::as_mut_simd_f32s(&mut sums).0.iter_mut().zip(&acc[i]) {
                *lane = *a;
            }
            out.copy_from_slice(&sums[..out.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for &(rows, inner, out) in &[
            (1, 1, 1),
            (1, 7, 33),
            (2, 16, 32),
            (3, 33, 65),
            (9, 64, 100),
            (17, 100, 301),
            (32, 256, 2000),
            (33, 257, 1031),
            (300, 40, 70),
        ] {
            let x = values(rows * inner, 1);
            let weight = values(out * inner, 2);
            let panels = Panels::pack(&weight, out, inner);
            let mut flat = vec![f32::NAN; rows * out];
            let mut outputs: Vec<&mut [f32]> = flat.chunks_mut(out).collect();
            panels.multiply(&x, &mut outputs);
            assert_eq!(panels.unpack(), weight, "unpacking gives the weight back");
            for r in 0..rows {
                for o in 0..out {
                    let want: f64 = (0..inner)
                        .map(|k| x[r * inner + k] as f64 * weight[o * inner + k] as f64)
                        .sum();
                    let got = flat[r * out + o] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "rows {rows} inner {inner} out {out}: [{r}][{o}] = {got}, want {want}"
                    );
                }
            }
        }
    }
}
