//! The `lockstep import trtllm` and `lockstep export trtllm` command lines.

use std::path::PathBuf;

use lockstep_gpu::roofline::Precision;

use crate::stdout::{out, outln};
use lockstep_plan::explain::parse_precision;
use lockstep_plan::scenario::Scenario;
use lockstep_plan::trtllm::{ImportOptions, TrtllmError, WorkloadOptions, export, import};

/// `lockstep import FORMAT`.
#[derive(Debug, clap::Subcommand)]
pub enum ImportCommand {
    /// A TensorRT-LLM `extra-llm-api-config.yml` (one aggregated server) or a
    /// disaggregated serving YAML (`context_servers` / `generation_servers`) → a
    /// scenario TOML. Keys lockstep does not model are listed on stderr and in the
    /// scenario's header.
    Trtllm(ImportTrtllmArgs),
}

/// `lockstep import trtllm`'s options.
#[derive(Debug, clap::Args)]
pub struct ImportTrtllmArgs {
    /// The YAML file.
    pub yaml: PathBuf,
    /// The model's Hugging Face `config.json` (default: from the YAML's `model:`).
    #[arg(long, value_name = "PATH")]
    pub hf_config: Option<PathBuf>,
    /// A GPU of the roofline's table (`lockstep explain --list-gpus`).
    #[arg(long, default_value = "H200")]
    pub gpu: String,
    /// The weight format: bf16, fp8 or nvfp4 (default: the checkpoint's
    /// `quantization_config` in its config.json, else bf16).
    #[arg(long, value_parser = parse_precision)]
    pub weight_precision: Option<Precision>,
    /// The KV format where `kv_cache_config.dtype` is absent or `auto`.
    #[arg(long, default_value = "bf16", value_parser = parse_precision)]
    pub kv_precision: Precision,
    /// Where to write the scenario.
    #[arg(long, short, value_name = "PATH")]
    pub out: PathBuf,
    /// The scenario's name (default: the YAML's file stem).
    #[arg(long)]
    pub name: Option<String>,
    /// Closed-loop workload: requests outstanding at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: u64,
    /// Requests in total.
    #[arg(long, default_value_t = 512)]
    pub num_requests: u64,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 1024)]
    pub input_len: u64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 256)]
    pub output_len: u64,
}

/// `lockstep export FORMAT`.
#[derive(Debug, clap::Subcommand)]
pub enum ExportCommand {
    /// A scenario → TensorRT-LLM YAML (an `extra-llm-api-config.yml` for one
    /// aggregated server, a disaggregated serving YAML for ctx and gen servers). What
    /// the YAML cannot say is listed on stderr.
    Trtllm(ExportTrtllmArgs),
}

/// `lockstep export trtllm`'s options.
#[derive(Debug, clap::Args)]
pub struct ExportTrtllmArgs {
    /// The scenario file.
    pub scenario: PathBuf,
    /// Where to write the YAML (default: stdout).
    #[arg(long, short, value_name = "PATH")]
    pub out: Option<PathBuf>,
}

/// Runs `lockstep import …`.
pub fn run_import(command: ImportCommand) -> Result<(), TrtllmError> {
    let ImportCommand::Trtllm(a) = command;
    let imported = import(&ImportOptions {
        yaml: a.yaml.clone(),
        hf_config: a.hf_config,
        gpu: a.gpu,
        weight_precision: a.weight_precision,
        kv_precision: a.kv_precision,
        out: a.out.clone(),
        name: a.name,
        workload: WorkloadOptions {
            concurrency: a.concurrency,
            num_requests: a.num_requests,
            input_len: a.input_len,
            output_len: a.output_len,
        },
    })?;
    std::fs::write(&a.out, &imported.scenario_toml).map_err(|e| TrtllmError::Io {
        file: a.out.display().to_string(),
        message: e.to_string(),
    })?;
    for u in &imported.unmodeled {
        eprintln!("not modeled: {u}");
    }
    for n in &imported.notes {
        eprintln!("note: {n}");
    }
    outln!(
        "wrote {} from {} ({} keys not modeled)",
        a.out.display(),
        a.yaml.display(),
        imported.unmodeled.len()
    );
    Ok(())
}

/// Runs `lockstep export …`.
pub fn run_export(command: ExportCommand) -> Result<(), TrtllmError> {
    let ExportCommand::Trtllm(a) = command;
    let scenario = Scenario::load(&a.scenario)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("stdout.yaml"));
    let exported = export(&scenario, &out)?;
    match &a.out {
        Some(path) => std::fs::write(path, &exported.yaml).map_err(|e| TrtllmError::Io {
            file: path.display().to_string(),
            message: e.to_string(),
        })?,
        None => out!("{}", exported.yaml),
    }
    for n in &exported.not_expressible {
        eprintln!("not in TensorRT-LLM's YAML: {n}");
    }
    Ok(())
}
