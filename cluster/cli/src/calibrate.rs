//! `lockstep model calibrate`: times the CPU model's paged forward on a grid of batch
//! shapes, fits the analytic cost model's device coefficients to the times
//! (`lockstep_gpu::fit`), and writes a profile file that `[model] profile = "FILE"`
//! reads, so the simulator models this machine running this model.

use std::path::Path;
use std::time::Instant;

use crate::stdout::outln;
use anyhow::Context;
use lockstep_gpu::fit::{Sample, fit_device};
use lockstep_gpu::model::{BatchEntry, Model, forward_paged};
use lockstep_gpu::{BatchShape, KvGeometry, ModelProfile};
use rand::{Rng, SeedableRng};

/// Context batches timed: (requests, chunk tokens, tokens already cached).
const CONTEXT_GRID: [(usize, usize, usize); 12] = [
    (1, 16, 0),
    (2, 16, 0),
    (1, 16, 128),
    (2, 16, 128),
    (1, 64, 0),
    (2, 64, 0),
    (1, 64, 128),
    (2, 64, 128),
    (1, 192, 0),
    (2, 192, 0),
    (1, 192, 128),
    (2, 192, 128),
];

/// Generation batches timed: (requests, tokens each has cached).
const GENERATION_GRID: [(usize, usize); 8] = [
    (1, 32),
    (2, 32),
    (4, 32),
    (8, 32),
    (1, 256),
    (2, 256),
    (4, 256),
    (8, 256),
];

/// Shapes timed but not fitted, to say how well the fit predicts batches it has not
/// seen: (context requests, chunk, cached) and (generation requests, cached).
const HELD_OUT_CONTEXT: [(usize, usize, usize); 2] = [(3, 96, 64), (1, 320, 0)];
const HELD_OUT_GENERATION: [(usize, usize); 2] = [(6, 128), (3, 512)];

/// What `calibrate` is asked for.
pub struct CalibrateOptions<'a> {
    /// The model directory.
    pub model_dir: &'a Path,
    /// Where the profile file goes.
    pub out: &'a Path,
    /// The shipped profile whose host coefficients the file keeps (the model's forward
    /// says nothing about the rank's scheduling time).
    pub host_from: &'a str,
    /// Token slots per KV block.
    pub tokens_per_block: usize,
    /// Timed forwards per shape; the median counts.
    pub repeats: usize,
    /// Fit the forwards of a real run instead (`run --model DIR --forward-log PATH`):
    /// every batch mix the workload produced, timed as it ran.
    pub from_log: Option<&'a Path>,
}

/// The forwards of a `--forward-log`, as samples (errors name the line).
fn samples_of_log(path: &Path) -> anyhow::Result<Vec<Sample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut samples = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let r: lockstep_runtime::device::ForwardRecord = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a forward record", path.display(), i + 1))?;
        samples.push(Sample {
            shape: r.shape,
            ns: r.ns as f64,
        });
    }
    if samples.len() < 10 {
        anyhow::bail!(
            "{}: {} forwards logged; a fit needs at least 10",
            path.display(),
            samples.len()
        );
    }
    Ok(samples)
}

/// Prints a fit over many logged forwards by kind of batch: count, mean measured, mean
/// fitted, mean absolute error; returns the worst kind's relative error of the means.
fn report_by_kind(fit: &lockstep_gpu::fit::DeviceFit, samples: &[Sample]) -> f64 {
    outln!("batch kind        forwards   measured ms   fitted ms   error of means   mean |error|");
    let mut worst: f64 = 0.0;
    type IsKind = fn(&BatchShape) -> bool;
    let kinds: [(&str, IsKind); 3] = [
        ("prefill only", |s| {
            s.ctx_requests > 0 && s.gen_requests == 0
        }),
        ("decode only", |s| s.ctx_requests == 0 && s.gen_requests > 0),
        ("mixed", |s| s.ctx_requests > 0 && s.gen_requests > 0),
    ];
    for (label, is) in kinds {
        let of: Vec<&Sample> = samples.iter().filter(|s| is(&s.shape)).collect();
        if of.is_empty() {
            continue;
        }
        let n = of.len() as f64;
        let measured = of.iter().map(|s| s.ns).sum::<f64>() / n;
        let fitted = of.iter().map(|s| fit.predict(&s.shape)).sum::<f64>() / n;
        let mean_abs = of
            .iter()
            .map(|s| ((fit.predict(&s.shape) - s.ns) / s.ns).abs())
            .sum::<f64>()
            / n;
        let error = (fitted - measured) / measured;
        worst = worst.max(error.abs());
        outln!(
            "{label:<16} {:>9} {:>13.3} {:>11.3} {:>+15.1}% {:>13.1}%",
            of.len(),
            measured / 1e6,
            fitted / 1e6,
            error * 100.0,
            mean_abs * 100.0
        );
    }
    worst
}

/// Times the grid, fits, prints measured against fitted, and writes the profile.
pub fn calibrate(o: &CalibrateOptions<'_>) -> anyhow::Result<()> {
    let host = lockstep_gpu::profile(o.host_from).context("--host-from")?;
    let model = Model::load(o.model_dir)
        .with_context(|| format!("loading the model in {}", o.model_dir.display()))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let vocab = model.config.vocab_size as u32;
    let mut tokens =
        |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let mut time_grid = |context: &[(usize, usize, usize)],
                         generation: &[(usize, usize)]|
     -> anyhow::Result<Vec<Sample>> {
        let mut samples = Vec::new();
        for &(requests, chunk, cached) in context {
            let prompts: Vec<Vec<u32>> = (0..requests).map(|_| tokens(cached + chunk)).collect();
            let ns = time_batch(&model, &prompts, cached, o)?;
            let shape = BatchShape {
                ctx_requests: requests as u32,
                ctx_tokens: (requests * chunk) as u32,
                ctx_attention: (requests * chunk * (cached + chunk)) as u64,
                ..BatchShape::default()
            };
            samples.push(Sample { shape, ns });
        }
        for &(requests, cached) in generation {
            let prompts: Vec<Vec<u32>> = (0..requests).map(|_| tokens(cached + 1)).collect();
            let ns = time_batch(&model, &prompts, cached, o)?;
            let shape = BatchShape {
                gen_requests: requests as u32,
                gen_tokens: requests as u32,
                gen_kv_tokens: (requests * cached) as u64,
                ..BatchShape::default()
            };
            samples.push(Sample { shape, ns });
        }
        Ok(samples)
    };
    let (fit, worst, worst_held_out, source) = match o.from_log {
        Some(log) => {
            let samples = samples_of_log(log)?;
            let fit = fit_device(&samples)?;
            let worst = report_by_kind(&fit, &samples);
            let source = format!(
                "{} forwards of a real run ({})",
                samples.len(),
                log.display()
            );
            (fit, worst, f64::NAN, source)
        }
        None => {
            let samples = time_grid(&CONTEXT_GRID, &GENERATION_GRID)?;
            let held_out = time_grid(&HELD_OUT_CONTEXT, &HELD_OUT_GENERATION)?;
            let fit = fit_device(&samples)?;
            outln!("shape                                   measured ms   fitted ms   error");
            let report = |label: &str, samples: &[Sample]| -> f64 {
                outln!("{label}");
                let mut worst: f64 = 0.0;
                for s in samples {
                    let predicted = fit.predict(&s.shape);
                    let error = (predicted - s.ns) / s.ns;
                    worst = worst.max(error.abs());
                    let b = &s.shape;
                    outln!(
                        "ctx {:>2} req {:>4} tok {:>6} attn | gen {:>2} req {:>5} kv {:>10.3} {:>11.3} {:>+7.1}%",
                        b.ctx_requests,
                        b.ctx_tokens,
                        b.ctx_attention,
                        b.gen_requests,
                        b.gen_kv_tokens,
                        s.ns / 1e6,
                        predicted / 1e6,
                        error * 100.0
                    );
                }
                worst
            };
            let worst = report("fitted shapes:", &samples);
            let worst_held_out = report("held-out shapes (timed, not fitted):", &held_out);
            let source = format!("{} timed batch shapes", samples.len());
            (fit, worst, worst_held_out, source)
        }
    };
    let held_out_text = if worst_held_out.is_nan() {
        "none held out".to_string()
    } else {
        format!("{:.1} % on held-out ones", worst_held_out * 100.0)
    };
    // One process: the forward has no collectives of its own.
    let c = fit.coefficients(
        0.0,
        host.coefficients.host_base_ns,
        host.coefficients.host_per_request_ns,
    );
    let config = &model.config;
    let profile = ModelProfile {
        name: format!("calibrated:{}", o.model_dir.display()),
        assumptions: format!(
            "fitted by `lockstep model calibrate` to {source} of the CPU model in {} \
             ({}) on the machine that ran it; worst relative error {:.1} % on the fitted \
             shapes{}, {held_out_text}; host coefficients from {}",
            o.model_dir.display(),
            config.summary(),
            worst * 100.0,
            if o.from_log.is_some() {
                " (means by batch kind)"
            } else {
                ""
            },
            o.host_from
        ),
        coefficients: c,
        kv: KvGeometry {
            layers: config.num_hidden_layers as u32,
            kv_heads: config.num_key_value_heads as u32,
            head_dim: config.head_dim as u32,
            // The paged store keeps f32.
            dtype_bytes: 4,
            mla: false,
        },
    };
    let text = toml::to_string(&profile).context("encoding the profile")?;
    std::fs::write(o.out, text).with_context(|| format!("writing {}", o.out.display()))?;
    outln!(
        "fitted: forward_base_ns {:.0}, ctx_token_ns {:.1}, ctx_attention_ns {:.4}, gen_request_ns {:.1}, kv_read_ns {:.3}; worst error {:.1} % fitted, {held_out_text}",
        c.forward_base_ns,
        c.ctx_token_ns,
        c.ctx_attention_ns,
        c.gen_request_ns,
        c.kv_read_ns,
        worst * 100.0,
    );
    outln!(
        "wrote {} (use it with --set 'model.profile=\"{}\"')",
        o.out.display(),
        o.out.display()
    );
    Ok(())
}

/// Prefills `cached` tokens of each prompt (untimed), then times the forward of the
/// rest of every prompt together, `repeats` times; the median in nanoseconds. A repeat
/// writes the same slots again, which leaves the cache as it was.
fn time_batch(
    model: &Model,
    prompts: &[Vec<u32>],
    cached: usize,
    o: &CalibrateOptions<'_>,
) -> anyhow::Result<f64> {
    let per_request = prompts
        .iter()
        .map(Vec::len)
        .max()
        .unwrap_or(0)
        .div_ceil(o.tokens_per_block);
    let mut cache = model.paged_cache(per_request * prompts.len(), o.tokens_per_block)?;
    let tables: Vec<Vec<u32>> = (0..prompts.len())
        .map(|r| {
            (0..per_request)
                .map(|i| (i * prompts.len() + r) as u32)
                .collect()
        })
        .collect();
    if cached > 0 {
        let prefix: Vec<BatchEntry<'_>> = prompts
            .iter()
            .zip(&tables)
            .map(|(p, t)| BatchEntry {
                block_table: t,
                start_position: 0,
                token_ids: &p[..cached],
                dummy: false,
            })
            .collect();
        forward_paged(model, &mut cache, &prefix)?;
    }
    let timed: Vec<BatchEntry<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| BatchEntry {
            block_table: t,
            start_position: cached,
            token_ids: &p[cached..],
            dummy: false,
        })
        .collect();
    let mut times = Vec::with_capacity(o.repeats);
    for _ in 0..o.repeats {
        let started = Instant::now();
        forward_paged(model, &mut cache, &timed)?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times
        .get(times.len() / 2)
        .copied()
        .unwrap_or_default()
        .as_nanos() as f64)
}
