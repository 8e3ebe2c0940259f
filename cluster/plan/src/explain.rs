//! `lockstep explain`: what the roofline says about a model on a GPU — parameters, KV
//! per token and the pool's capacity, a typical prefill and decode step op by op with
//! what bounds each, and the linear coefficients the simulator would run with their
//! fit error.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use lockstep_gpu::roofline::{
    self, Deployment, Efficiency, ForwardBatch, ForwardTime, Precision, derive_profile,
};

use crate::model::{ModelConfig, ModelError};
use crate::scenario::{Scenario, ScenarioError};

/// `lockstep explain`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct ExplainArgs {
    /// A Hugging Face `config.json` (e.g. data/models/llama-3-8b/config.json).
    #[arg(long, value_name = "PATH", required_unless_present_any = ["scenario", "list_gpus"])]
    pub hf_config: Option<PathBuf>,
    /// Explain the `[model]` section of this scenario instead (its `hf_config` and
    /// roofline keys).
    #[arg(long, value_name = "PATH", conflicts_with = "hf_config")]
    pub scenario: Option<PathBuf>,
    /// Print the GPU table and exit.
    #[arg(long)]
    pub list_gpus: bool,
    /// A GPU of the table.
    #[arg(long, default_value = "H200")]
    pub gpu: String,
    /// GPUs one rank's attention and dense layers are split over.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// GPUs the routed experts are spread over.
    #[arg(long, default_value_t = 1)]
    pub ep: u32,
    /// bf16, fp8 or nvfp4 (default: the checkpoint's `quantization_config`, else bf16).
    #[arg(long, value_parser = parse_precision)]
    pub weight_precision: Option<Precision>,
    /// bf16, fp8 or nvfp4.
    #[arg(long, default_value = "bf16", value_parser = parse_precision)]
    pub kv_precision: Precision,
    /// Share of the memory left after weights that the KV pool takes.
    #[arg(long, default_value_t = roofline::DEFAULT_FREE_GPU_MEMORY_FRACTION)]
    pub free_gpu_memory_fraction: f64,
    /// GiB per GPU kept by the runtime besides weights and KV.
    #[arg(long, default_value_t = roofline::DEFAULT_RESERVED_MEMORY_GIB)]
    pub reserved_memory_gib: f64,
    /// Override an efficiency factor: `gemm_compute=0.6`, `attention_compute=`,
    /// `memory=`, `link=` (repeatable).
    #[arg(long = "efficiency", value_name = "KEY=VALUE")]
    pub efficiency: Vec<String>,
    /// Tokens of the typical prefill (one request, nothing cached).
    #[arg(long, default_value_t = 8192)]
    pub prefill_tokens: u64,
    /// Requests of the typical decode step (one token each).
    #[arg(long, default_value_t = 64)]
    pub decode_batch: u64,
    /// Cached tokens each decode request attends.
    #[arg(long, default_value_t = 4096)]
    pub decode_context: u64,
}

/// A `--weight-precision` or `--kv-precision` value that is none of the formats.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}`: expected bf16, fp8 or nvfp4")]
pub struct UnknownPrecision(String);

/// A `--weight-precision` or `--kv-precision` value.
pub fn parse_precision(text: &str) -> Result<Precision, UnknownPrecision> {
    Precision::parse(text).ok_or_else(|| UnknownPrecision(text.to_string()))
}

/// Why there is nothing to explain.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// The scenario cannot be loaded.
    #[error(transparent)]
    Scenario(#[from] ScenarioError),
    /// The model section or the options are wrong.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The scenario's `[model]` has no `hf_config`.
    #[error("{0}: [model] has no hf_config: nothing for the roofline to explain")]
    NoHfConfig(String),
    /// A bad `--efficiency`.
    #[error("--efficiency {assignment}: {why}")]
    Efficiency {
        /// As given.
        assignment: String,
        /// What is wrong.
        why: String,
    },
}

/// The `[model]` section these options describe, relative to the current folder.
pub fn model_config(args: &ExplainArgs) -> Result<(ModelConfig, PathBuf), ExplainError> {
    if let Some(path) = &args.scenario {
        let s = Scenario::load(path)?;
        if s.model.hf_config.is_none() {
            return Err(ExplainError::NoHfConfig(path.display().to_string()));
        }
        return Ok((s.model, s.base_dir));
    }
    let mut efficiency = Efficiency::default();
    for assignment in &args.efficiency {
        let bad = |why: String| ExplainError::Efficiency {
            assignment: assignment.clone(),
            why,
        };
        let (key, value) = assignment
            .split_once('=')
            .ok_or_else(|| bad("expected KEY=VALUE".into()))?;
        let value: f64 = value
            .trim()
            .parse()
            .map_err(|e| bad(format!("not a number: {e}")))?;
        let slot = match key.trim() {
            "gemm_compute" => &mut efficiency.gemm_compute,
            "attention_compute" => &mut efficiency.attention_compute,
            "memory" => &mut efficiency.memory,
            "link" => &mut efficiency.link,
            other => {
                return Err(bad(format!(
                    "unknown factor `{other}`; known: gemm_compute, attention_compute, memory, link"
                )));
            }
        };
        *slot = value;
    }
    let model = ModelConfig {
        hf_config: args.hf_config.as_ref().map(|p| p.display().to_string()),
        gpu: Some(args.gpu.clone()),
        tp: Some(args.tp),
        ep: Some(args.ep),
        weight_precision: args.weight_precision,
        kv_precision: Some(args.kv_precision),
        free_gpu_memory_fraction: Some(args.free_gpu_memory_fraction),
        reserved_memory_gib: Some(args.reserved_memory_gib),
        efficiency: Some(efficiency),
        ..ModelConfig::default()
    };
    Ok((model, PathBuf::from(".")))
}

/// The GPU table as text.
pub fn gpu_table() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>10}",
        "gpu",
        "mem GiB",
        "HBM TB/s",
        "BF16 TF",
        "FP8 TF",
        "FP4 TF",
        "NVLink GB/s",
        "domain",
        "net GB/s"
    );
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    for g in roofline::gpus() {
        let _ = writeln!(
            out,
            "{:<10} {:>8.0} {:>9.2} {:>9.0} {:>9} {:>9} {:>10.0} {:>7} {:>10.0}",
            g.name,
            g.memory_gib,
            g.memory_tb_per_s,
            g.bf16_tflops,
            opt(g.fp8_tflops),
            opt(g.fp4_tflops),
            g.nvlink_gb_per_s,
            g.nvlink_domain_gpus,
            g.network_gb_per_s
        );
    }
    out
}

/// Everything `lockstep explain` prints.
pub fn explain(args: &ExplainArgs) -> Result<String, ExplainError> {
    if args.list_gpus {
        return Ok(gpu_table());
    }
    let (model, base_dir) = model_config(args)?;
    render(&model, &base_dir, args)
}

fn render(
    model: &ModelConfig,
    base_dir: &Path,
    args: &ExplainArgs,
) -> Result<String, ExplainError> {
    let Some(d) = model.deployment(base_dir)? else {
        return Err(ExplainError::NoHfConfig("the options".into()));
    };
    let capacity = model.kv_capacity_tokens(base_dir)?.unwrap_or(0);
    let profile = model.resolve(base_dir)?;
    let derived = derive_profile(&d, &profile.name).map_err(ModelError::from)?;
    let p = &d.parameters;
    let a = &d.architecture;
    let mut out = String::new();
    let gib = |bytes: f64| bytes / (1024.0 * 1024.0 * 1024.0);
    let _ = writeln!(
        out,
        "{} ({}) on {}: tp {}, ep {}, weights {}, KV {}",
        a.model_type,
        model.hf_config.as_deref().unwrap_or_default(),
        d.gpu.name,
        d.parallelism.tp,
        d.parallelism.ep,
        d.weight_precision,
        d.kv_precision
    );
    let _ = writeln!(
        out,
        "parameters:        {:.2} B total, {:.2} B active ({} layers, hidden {})",
        p.total() as f64 / 1e9,
        p.active() as f64 / 1e9,
        a.layers,
        a.hidden_size
    );
    let _ = writeln!(
        out,
        "weights per GPU:   {:.2} GiB of {:.0} GiB",
        gib(d.weight_bytes_per_gpu()),
        d.gpu.memory_gib
    );
    let _ = writeln!(
        out,
        "KV per token:      {} B (whole model), {} B per GPU",
        d.kv_geometry().bytes_per_token(),
        d.kv_bytes_per_token_per_gpu()
    );
    let _ = writeln!(
        out,
        "KV capacity:       {capacity} tokens per rank (free_gpu_memory_fraction {}, {} GiB reserved)",
        model
            .free_gpu_memory_fraction
            .unwrap_or(roofline::DEFAULT_FREE_GPU_MEMORY_FRACTION),
        model
            .reserved_memory_gib
            .unwrap_or(roofline::DEFAULT_RESERVED_MEMORY_GIB)
    );
    let e = d.efficiency;
    let _ = writeln!(
        out,
        "efficiency:        gemm_compute {}, attention_compute {}, memory {}, link {}",
        e.gemm_compute, e.attention_compute, e.memory, e.link
    );
    let prefill = ForwardBatch::prefill(1, args.prefill_tokens);
    let _ = writeln!(out, "\nprefill 1 x {} tokens:", args.prefill_tokens);
    write_ops(&mut out, &d, &d.forward(&prefill), args.prefill_tokens);
    let decode = ForwardBatch::decode(args.decode_batch, args.decode_context);
    let _ = writeln!(
        out,
        "\ndecode {} x 1 token at {} context:",
        args.decode_batch, args.decode_context
    );
    write_ops(&mut out, &d, &d.forward(&decode), args.decode_batch);
    let _ = writeln!(
        out,
        "\nfitted linear coefficients (ns), profile `{}`:",
        profile.name
    );
    for (key, value) in profile.coefficients.terms() {
        let _ = writeln!(out, "  {key:<20} {value:.4}");
    }
    let f = derived.fit;
    let w = f.worst_shape;
    let _ = writeln!(
        out,
        "fit error vs the roofline: worst {:.1}% on the {} fitted shapes; mean {:.1}%, worst {:.1}% on {} held-out shapes (worst: {} ctx tokens over {} attention pairs, {} gen requests over {} cached tokens)",
        f.fitted_max_error * 100.0,
        f.fitted,
        f.held_out_mean_error * 100.0,
        f.held_out_max_error * 100.0,
        f.held_out,
        w.ctx_tokens,
        w.ctx_attention,
        w.gen_requests,
        w.gen_kv_tokens
    );
    let sim_prefill = lockstep_gpu::AnalyticBackend::new(profile.coefficients);
    use lockstep_gpu::Backend as _;
    let _ = writeln!(
        out,
        "linear model: prefill {:.2} ms, decode {:.2} ms (+ {:.3} ms collective latency per forward)",
        sim_prefill.forward_ns(&prefill.shape()) as f64 / 1e6,
        sim_prefill.forward_ns(&decode.shape()) as f64 / 1e6,
        profile.coefficients.collective_ns / 1e6
    );
    Ok(out)
}

fn write_ops(out: &mut String, d: &Deployment, t: &ForwardTime, tokens: u64) {
    let _ = writeln!(
        out,
        "  {:<24} {:>12} {:>12} {:>10} {:>8}",
        "op", "GFLOP", "MB", "ms", "bound"
    );
    for o in &t.ops {
        let _ = writeln!(
            out,
            "  {:<24} {:>12.2} {:>12.2} {:>10.3} {:>8}",
            o.op.name,
            o.op.flops / 1e9,
            o.op.bytes / 1e6,
            o.ns / 1e6,
            o.bound.name()
        );
    }
    let ms = t.ns() / 1e6;
    let _ = writeln!(
        out,
        "  total {ms:.3} ms per forward: {:.0} tokens/s per rank, {:.0} tokens/s per GPU",
        tokens as f64 / (ms / 1e3),
        tokens as f64 / (ms / 1e3) / f64::from(d.parallelism.tp)
    );
}
