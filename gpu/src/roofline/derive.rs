//! A [`ModelProfile`] from the roofline: the roofline is timed on a grid of batch
//! shapes and the linear coefficients fitted to it with [`crate::fit`]'s non-negative
//! least squares, as `lockstep model calibrate` fits measured forwards. The fit is then
//! scored on shapes it did not see.
//!
//! A linear model cannot express the roofline's `max(compute, memory)`: small decode
//! batches are memory-bound (the weight read, a constant), large ones compute-bound (a
//! per-token cost), and MoE weights grow with the experts a batch touches. The fit
//! spreads that knee over its terms; the held-out error says how much it costs.

use lockstep_actors::executor::BatchShape;

use super::ops::{ContextChunk, ForwardBatch};
use super::{Attention, Deployment};
use crate::fit::{FitError, Sample, fit_device};
use crate::profiles::ModelProfile;

/// Host costs: the serving framework's scheduler, not the model, so the same as the
/// shipped profiles' (a Python-side executor: ~0.5 ms per iteration, a few µs per
/// request).
const HOST_BASE_NS: f64 = 500_000.0;
const HOST_PER_REQUEST_NS: f64 = 5_000.0;

/// How well the fitted coefficients follow the roofline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FitReport {
    /// Shapes fitted.
    pub fitted: usize,
    /// Worst relative error on the fitted shapes.
    pub fitted_max_error: f64,
    /// Held-out shapes scored.
    pub held_out: usize,
    /// Mean relative error on the held-out shapes.
    pub held_out_mean_error: f64,
    /// Worst relative error on the held-out shapes.
    pub held_out_max_error: f64,
    /// The held-out shape with the worst error.
    pub worst_shape: BatchShape,
}

/// A profile derived from the roofline and how well it fits.
#[derive(Debug, Clone, PartialEq)]
pub struct DerivedProfile {
    /// The profile the simulator runs.
    pub profile: ModelProfile,
    /// The fit's error.
    pub fit: FitReport,
}

/// Why no profile could be derived.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeriveError {
    /// The fit failed.
    #[error("fitting the roofline: {0}")]
    Fit(#[from] FitError),
}

fn chunks(requests: u64, tokens: u64, cached: u64) -> ForwardBatch {
    ForwardBatch {
        context: vec![ContextChunk { tokens, cached }; requests as usize],
        ..ForwardBatch::default()
    }
}

fn mixed(chunk: u64, cached: u64, decodes: u64, context: u64) -> ForwardBatch {
    ForwardBatch {
        context: vec![ContextChunk {
            tokens: chunk,
            cached,
        }],
        ..ForwardBatch::decode(decodes, context)
    }
}

/// The shapes the coefficients are fitted to: prefill chunks with and without a cached
/// prefix, decode batches from 1 to 512 over 256 to 32k tokens of context, and a few
/// mixed batches (chunked prefill beside decodes).
pub fn fit_grid() -> Vec<ForwardBatch> {
    let mut grid = Vec::new();
    for tokens in [256, 1024, 4096, 8192] {
        for cached in [0, 8192] {
            for requests in [1, 2] {
                grid.push(chunks(requests, tokens, cached));
            }
        }
    }
    for requests in [1, 8, 32, 128, 512] {
        for context in [256, 2048, 8192, 32768] {
            grid.push(ForwardBatch::decode(requests, context));
        }
    }
    for (chunk, decodes) in [(512, 16), (2048, 64), (4096, 128)] {
        grid.push(mixed(chunk, 0, decodes, 4096));
    }
    grid
}

/// Shapes the fit never sees, between and beside the grid's.
pub fn held_out_grid() -> Vec<ForwardBatch> {
    let mut grid = Vec::new();
    for tokens in [512, 2048, 6144] {
        for cached in [0, 4096] {
            grid.push(chunks(1, tokens, cached));
        }
    }
    for requests in [2, 4, 16, 64, 256] {
        for context in [1024, 4096, 16384] {
            grid.push(ForwardBatch::decode(requests, context));
        }
    }
    grid.push(mixed(1024, 2048, 32, 2048));
    grid.push(mixed(3072, 0, 96, 8192));
    grid
}

/// Fits a profile called `name` to the roofline of `d`.
pub fn derive_profile(d: &Deployment, name: &str) -> Result<DerivedProfile, DeriveError> {
    // The collectives' fixed latency is charged once per forward by the cost model's
    // `collective_ns`; the fit takes the rest.
    let sample = |b: &ForwardBatch| {
        let t = d.forward(b);
        Sample {
            shape: b.shape(),
            ns: t.ns() - t.latency_ns(),
        }
    };
    let fitted: Vec<Sample> = fit_grid().iter().map(sample).collect();
    let fit = fit_device(&fitted)?;
    let error = |s: &Sample| (fit.predict(&s.shape) - s.ns).abs() / s.ns;
    let fitted_max_error = fitted.iter().map(error).fold(0.0, f64::max);
    let held: Vec<Sample> = held_out_grid().iter().map(sample).collect();
    let worst = held
        .iter()
        .max_by(|a, b| error(a).total_cmp(&error(b)))
        .copied()
        .unwrap_or(fitted[0]);
    let report = FitReport {
        fitted: fitted.len(),
        fitted_max_error,
        held_out: held.len(),
        held_out_mean_error: held.iter().map(error).sum::<f64>() / held.len() as f64,
        held_out_max_error: error(&worst),
        worst_shape: worst.shape,
    };
    let collective_ns = d.forward(&ForwardBatch::decode(1, 1)).latency_ns();
    Ok(DerivedProfile {
        profile: ModelProfile {
            name: name.to_string(),
            assumptions: assumptions(d, &report),
            coefficients: fit.coefficients(collective_ns, HOST_BASE_NS, HOST_PER_REQUEST_NS),
            kv: d.kv_geometry(),
        },
        fit: report,
    })
}

fn assumptions(d: &Deployment, r: &FitReport) -> String {
    let a = &d.architecture;
    let attention = match a.attention {
        Attention::Grouped {
            heads, kv_heads, ..
        } => format!("{heads} heads, {kv_heads} KV heads"),
        Attention::Latent { heads, .. } => format!("{heads} heads, latent attention"),
    };
    format!(
        "Roofline of a `{model}` config ({layers} layers, hidden {hidden}, {attention}; \
         {total:.2}B parameters, {active:.2}B active) on {gpu} with tp {tp}, ep {ep}, \
         {wp} weights, {kvp} KV; efficiencies gemm {ge}, attention {ae}, memory {me}, \
         link {le}. Coefficients fitted by NNLS to {n} roofline shapes (worst {fe:.1}%); \
         on {h} held-out shapes mean error {hm:.1}%, worst {hx:.1}%. Host costs as the \
         shipped profiles. A model, not a measurement.",
        model = a.model_type,
        layers = a.layers,
        hidden = a.hidden_size,
        total = d.parameters.total() as f64 / 1e9,
        active = d.parameters.active() as f64 / 1e9,
        gpu = d.gpu.name,
        tp = d.parallelism.tp,
        ep = d.parallelism.ep,
        wp = d.weight_precision,
        kvp = d.kv_precision,
        ge = d.efficiency.gemm_compute,
        ae = d.efficiency.attention_compute,
        me = d.efficiency.memory,
        le = d.efficiency.link,
        n = r.fitted,
        fe = r.fitted_max_error * 100.0,
        h = r.held_out,
        hm = r.held_out_mean_error * 100.0,
        hx = r.held_out_max_error * 100.0,
    )
}
