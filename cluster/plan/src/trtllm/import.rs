//! `lockstep import trtllm`: TensorRT-LLM YAML → scenario TOML.

use std::path::{Component, Path, PathBuf};

use serde_norway::Value;

use lockstep_actors::config::{Role, ServerConfig};
use lockstep_gpu::roofline::Precision;

use super::TrtllmError;
use super::server::{KeyReader, ServerYaml};
use crate::model::ModelConfig;

/// The benchmark client the imported scenario runs (TensorRT-LLM's YAML describes
/// servers, not their load).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadOptions {
    /// Requests outstanding at once (closed loop).
    pub concurrency: u64,
    /// Requests in total.
    pub num_requests: u64,
    /// Prompt tokens.
    pub input_len: u64,
    /// Output tokens.
    pub output_len: u64,
}

/// What `import` needs besides the YAML.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportOptions {
    /// The YAML file.
    pub yaml: PathBuf,
    /// The model's `config.json`; absent: the YAML's `model:` must lead to one.
    pub hf_config: Option<PathBuf>,
    /// A GPU of the roofline's table.
    pub gpu: String,
    /// Weight format (TensorRT-LLM reads it from the checkpoint, not the YAML); `None`:
    /// the `config.json`'s `quantization_config`, else BF16.
    pub weight_precision: Option<Precision>,
    /// KV format where `kv_cache_config.dtype` is absent or `auto`.
    pub kv_precision: Precision,
    /// Where the scenario will be written (its `hf_config` is relative to it).
    pub out: PathBuf,
    /// The scenario's name; default the YAML's file stem.
    pub name: Option<String>,
    /// The load.
    pub workload: WorkloadOptions,
}

/// The scenario written and what it could not carry.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    /// The scenario as TOML.
    pub scenario_toml: String,
    /// `key = value` of every YAML key lockstep does not model.
    pub unmodeled: Vec<String>,
    /// Simplifications made (one cost profile for servers that differ, …).
    pub notes: Vec<String>,
}

/// TensorRT-LLM's LLM API defaults for keys a YAML leaves out.
const TRTLLM_MAX_BATCH_SIZE: i64 = 2048;
const TRTLLM_MAX_NUM_TOKENS: i64 = 8192;
const TRTLLM_TOKENS_PER_BLOCK: i64 = 32;

struct Group {
    role: Role,
    key: &'static str,
    instances: u64,
    yaml: ServerYaml,
}

/// Reads `opts.yaml` and writes the scenario it describes.
pub fn import(opts: &ImportOptions) -> Result<Imported, TrtllmError> {
    let file = opts.yaml.display().to_string();
    let text = std::fs::read_to_string(&opts.yaml).map_err(|e| TrtllmError::Io {
        file: file.clone(),
        message: e.to_string(),
    })?;
    let doc: Value = serde_norway::from_str(&text).map_err(|e| TrtllmError::Yaml {
        file: file.clone(),
        message: e.to_string(),
    })?;
    let mut top = match doc {
        Value::Mapping(m) => m,
        other => {
            return Err(TrtllmError::Key {
                file,
                key: "(document)".into(),
                message: format!(
                    "expected a mapping of keys, got {}",
                    super::server::one_line(&other)
                ),
            });
        }
    };
    for key in top.keys() {
        if let Some(k) = key.as_str()
            && k.ends_with("_servers")
            && k != "context_servers"
            && k != "generation_servers"
        {
            return Err(TrtllmError::UnknownRole {
                file,
                key: k.to_string(),
            });
        }
    }
    let mut unmodeled = Vec::new();
    let mut reader = KeyReader {
        file: &file,
        unmodeled: &mut unmodeled,
    };
    let model_name: Option<String> = reader.take(&mut top, "", "model")?;
    let disaggregated =
        top.contains_key("context_servers") || top.contains_key("generation_servers");
    let mut groups = Vec::new();
    if disaggregated {
        for (key, role) in [
            ("context_servers", Role::Ctx),
            ("generation_servers", Role::Gen),
        ] {
            let mut t = reader.table(&mut top, "", key)?;
            if t.is_empty() {
                continue;
            }
            let instances: Option<u64> = reader.take(&mut t, key, "num_instances")?;
            let instances = instances.unwrap_or(1);
            if instances == 0 {
                return Err(TrtllmError::Key {
                    file: file.clone(),
                    key: format!("{key}.num_instances"),
                    message: "must be at least 1".into(),
                });
            }
            groups.push(Group {
                role,
                key,
                instances,
                yaml: reader.server(t, key)?,
            });
        }
        if !groups.iter().any(|g| g.role == Role::Ctx)
            || !groups.iter().any(|g| g.role == Role::Gen)
        {
            return Err(TrtllmError::Key {
                file,
                key: "context_servers / generation_servers".into(),
                message: "a disaggregated YAML needs both roles".into(),
            });
        }
        // Addresses and the HTTP front's own settings.
        reader.rest(top, "");
    } else {
        groups.push(Group {
            role: Role::Agg,
            key: "(server)",
            instances: 1,
            yaml: reader.server(top, "")?,
        });
    }

    let out_dir = opts
        .out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let hf_config = find_hf_config(opts, model_name.as_deref(), &file)?;
    let hf_relative = relative_path(&hf_config, &out_dir);
    let mut notes = Vec::new();
    let mut servers = Vec::new();
    let mut models = Vec::new();
    for g in &groups {
        let model = model_for(opts, &hf_relative, g, &file)?;
        let capacity = model
            .kv_capacity_tokens(&out_dir)
            .map_err(|source| TrtllmError::Model {
                file: file.clone(),
                server: g.key.into(),
                source: Box::new(source),
            })?
            .unwrap_or(u64::MAX);
        // TensorRT-LLM's pool is the smaller of max_tokens and the memory fraction.
        let max_tokens = match g.yaml.kv_max_tokens {
            Some(given) => given.min(capacity as i64),
            None => capacity as i64,
        };
        if g.yaml.pipeline_parallel_size.is_some_and(|pp| pp > 1) {
            notes.push(format!(
                "{}: pipeline_parallel_size > 1: the roofline times a forward as one stage holding the whole model",
                g.key
            ));
        }
        for i in 0..g.instances {
            servers.push(server_config(g, i, max_tokens));
        }
        models.push((g.key, model));
    }
    // One cost profile serves every server: the generation servers' (decode sets the
    // pace), else the only one.
    let profile_index = groups.iter().position(|g| g.role == Role::Gen).unwrap_or(0);
    let (profile_key, model) = models[profile_index].clone();
    for (key, other) in &models {
        if *key != profile_key
            && (other.tp != model.tp
                || other.ep != model.ep
                || other.kv_precision != model.kv_precision)
        {
            notes.push(format!(
                "{key}: tp {} / ep {} / KV {} differ from {profile_key}'s tp {} / ep {} / KV {}; one cost profile serves all servers, so they run with {profile_key}'s (their KV capacity is their own)",
                other.tp.unwrap_or(1),
                other.ep.unwrap_or(1),
                other.kv_precision.unwrap_or(Precision::Bf16),
                model.tp.unwrap_or(1),
                model.ep.unwrap_or(1),
                model.kv_precision.unwrap_or(Precision::Bf16),
            ));
        }
    }
    let name = opts.name.clone().unwrap_or_else(|| {
        opts.yaml
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "trtllm".into())
    });
    let scenario_toml = render(opts, &name, &servers, &model, &unmodeled, &notes)?;
    Ok(Imported {
        scenario_toml,
        unmodeled,
        notes,
    })
}

fn kv_precision(g: &Group, opts: &ImportOptions, file: &str) -> Result<Precision, TrtllmError> {
    match g.yaml.kv_dtype.as_deref() {
        None | Some("auto") => Ok(opts.kv_precision),
        Some("fp8") => Ok(Precision::Fp8),
        Some("nvfp4") => Ok(Precision::Nvfp4),
        // FP16 is two bytes as BF16 is: the same for memory and bandwidth.
        Some("bf16" | "bfloat16" | "fp16" | "float16") => Ok(Precision::Bf16),
        Some(other) => Err(TrtllmError::Key {
            file: file.to_string(),
            key: prefixed(g.key, "kv_cache_config.dtype"),
            message: format!("`{other}`: lockstep models auto, fp8, nvfp4, bf16 and fp16"),
        }),
    }
}

fn prefixed(group: &str, key: &str) -> String {
    if group.starts_with('(') {
        key.to_string()
    } else {
        format!("{group}.{key}")
    }
}

/// The `[model]` section for one server group: its parallelism as the roofline sees
/// it (a rank is one GPU with attention DP), its KV format and memory fraction.
fn model_for(
    opts: &ImportOptions,
    hf_relative: &str,
    g: &Group,
    file: &str,
) -> Result<ModelConfig, TrtllmError> {
    let tp = g.yaml.tensor_parallel_size.unwrap_or(1);
    let adp = g.yaml.enable_attention_dp.unwrap_or(false);
    let positive = |key: &str, v: i64| -> Result<u32, TrtllmError> {
        u32::try_from(v)
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| TrtllmError::Key {
                file: file.to_string(),
                key: prefixed(g.key, key),
                message: format!("{v}: must be a positive integer"),
            })
    };
    let tp = positive("tensor_parallel_size", tp)?;
    let ep = match g.yaml.moe_expert_parallel_size {
        Some(ep) => positive("moe_expert_parallel_size", ep)?,
        // With attention DP the experts span the server's GPUs; without, they are
        // split by tensor parallelism within each expert.
        None if adp => tp,
        None => 1,
    };
    let mut model = ModelConfig {
        hf_config: Some(hf_relative.to_string()),
        gpu: Some(opts.gpu.clone()),
        tp: Some(if adp { 1 } else { tp }),
        ep: Some(ep),
        weight_precision: opts.weight_precision,
        kv_precision: Some(kv_precision(g, opts, file)?),
        free_gpu_memory_fraction: Some(
            g.yaml
                .free_gpu_memory_fraction
                .unwrap_or(lockstep_gpu::roofline::DEFAULT_FREE_GPU_MEMORY_FRACTION),
        ),
        ..ModelConfig::default()
    };
    // A dense model has no experts to spread: TensorRT-LLM ignores the setting.
    let arch_dir = opts
        .out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let arch = lockstep_gpu::roofline::Architecture::from_file(&arch_dir.join(hf_relative))
        .map_err(|e| TrtllmError::Model {
            file: file.to_string(),
            server: g.key.into(),
            source: Box::new(e.into()),
        })?;
    if arch.experts.is_none() {
        model.ep = Some(1);
    }
    Ok(model)
}

fn server_config(g: &Group, index: u64, max_tokens: i64) -> ServerConfig {
    let y = &g.yaml;
    let d = ServerConfig::default();
    let mut s = ServerConfig {
        name: format!("{}{index}", g.role.name()),
        role: g.role,
        ranks: None,
        tensor_parallel_size: y.tensor_parallel_size.unwrap_or(1),
        pipeline_parallel_size: y.pipeline_parallel_size.unwrap_or(1),
        enable_attention_dp: y.enable_attention_dp.unwrap_or(false),
        max_batch_size: y.max_batch_size.unwrap_or(TRTLLM_MAX_BATCH_SIZE),
        max_num_tokens: y.max_num_tokens.unwrap_or(TRTLLM_MAX_NUM_TOKENS),
        disable_overlap_scheduler: y.disable_overlap_scheduler.unwrap_or(false),
        enable_chunked_prefill: y.enable_chunked_prefill.unwrap_or(false),
        max_draft_len: y.max_draft_len.unwrap_or(0),
        ..d
    };
    s.kv_cache_config.tokens_per_block = y.tokens_per_block.unwrap_or(TRTLLM_TOKENS_PER_BLOCK);
    s.kv_cache_config.max_tokens = max_tokens;
    s.kv_cache_config.enable_block_reuse = y.enable_block_reuse.unwrap_or(true);
    if let Some(p) = y.capacity_scheduler_policy {
        s.scheduler_config.capacity_scheduler_policy = p;
    }
    if let Some(p) = y.context_chunking_policy {
        s.scheduler_config.context_chunking_policy = p;
    }
    if let Some(b) = y.max_tokens_in_buffer {
        s.cache_transceiver_config.max_tokens_in_buffer = b;
    }
    if let Some(t) = y.kv_transfer_timeout_ms {
        s.cache_transceiver_config.kv_transfer_timeout_ms = t;
    }
    let adp = &mut s.attention_dp_config;
    adp.enable_balance = y.enable_balance.unwrap_or(adp.enable_balance);
    adp.timeout_iters = y.timeout_iters.unwrap_or(adp.timeout_iters);
    adp.batching_wait_iters = y.batching_wait_iters.unwrap_or(adp.batching_wait_iters);
    s
}

/// The model's `config.json`: `--hf-config`, else the YAML's `model:` as a path (a
/// folder holding `config.json`, or the file itself, relative to the YAML), else a
/// folder of `data/models` named like its last component.
fn find_hf_config(
    opts: &ImportOptions,
    model: Option<&str>,
    file: &str,
) -> Result<PathBuf, TrtllmError> {
    if let Some(p) = &opts.hf_config {
        return Ok(p.clone());
    }
    let Some(model) = model else {
        return Err(TrtllmError::MissingModel {
            file: file.to_string(),
            why: "missing model: the YAML has no `model:` key; give --hf-config".into(),
        });
    };
    let yaml_dir = opts.yaml.parent().unwrap_or(Path::new("."));
    let as_path = yaml_dir.join(model);
    let mut tried = Vec::new();
    for candidate in [as_path.join("config.json"), as_path.clone()] {
        if candidate.is_file() {
            return Ok(candidate);
        }
        tried.push(candidate.display().to_string());
    }
    let last = model.rsplit('/').next().unwrap_or(model).to_lowercase();
    let stripped = last.strip_prefix("meta-").unwrap_or(&last).to_string();
    for name in [last.as_str(), stripped.as_str()] {
        let candidate = Path::new("data/models").join(name).join("config.json");
        if candidate.is_file() {
            return Ok(candidate);
        }
        tried.push(candidate.display().to_string());
    }
    Err(TrtllmError::MissingModel {
        file: file.to_string(),
        why: format!(
            "model: {model}: no config.json found (tried {}); give --hf-config",
            tried.join(", ")
        ),
    })
}

/// `target` relative to `base` (both taken as absolute from the current folder), with
/// `/` separators so scenario files read the same everywhere.
pub(super) fn relative_path(target: &Path, base: &Path) -> String {
    // An empty path (the parent of a bare file name) is the current folder.
    let abs = |p: &Path| {
        let p = if p.as_os_str().is_empty() {
            Path::new(".")
        } else {
            p
        };
        std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
    };
    let normal = |p: PathBuf| -> Vec<String> {
        let mut parts: Vec<String> = Vec::new();
        for c in p.components() {
            match c {
                Component::ParentDir => {
                    parts.pop();
                }
                Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
                _ => {}
            }
        }
        parts
    };
    let t = normal(abs(target));
    let b = normal(abs(base));
    let common = t.iter().zip(&b).take_while(|(x, y)| x == y).count();
    let mut parts: Vec<String> = vec!["..".to_string(); b.len() - common];
    parts.extend(t[common..].iter().cloned());
    parts.join("/")
}

fn render(
    opts: &ImportOptions,
    name: &str,
    servers: &[ServerConfig],
    model: &ModelConfig,
    unmodeled: &[String],
    notes: &[String],
) -> Result<String, TrtllmError> {
    let to_toml = |what: &str, e: toml::ser::Error| TrtllmError::Export(format!("{what}: {e}"));
    let mut doc = toml::Table::new();
    doc.insert("name".into(), name.into());
    doc.insert(
        "description".into(),
        format!(
            "Imported from TensorRT-LLM YAML by `lockstep import trtllm` on {}",
            opts.gpu
        )
        .into(),
    );
    let mut array = Vec::new();
    for s in servers {
        array.push(toml::Value::Table(
            toml::Table::try_from(s).map_err(|e| to_toml("server", e))?,
        ));
    }
    doc.insert("server".into(), toml::Value::Array(array));
    let w = opts.workload;
    let mut workload = toml::Table::new();
    workload.insert("kind".into(), "closed_loop".into());
    workload.insert("concurrency".into(), int(w.concurrency));
    workload.insert("num_requests".into(), int(w.num_requests));
    workload.insert("input_len".into(), int(w.input_len));
    workload.insert("output_len".into(), int(w.output_len));
    doc.insert("workload".into(), toml::Value::Table(workload));
    let mut model_table = toml::Table::try_from(model).map_err(|e| to_toml("model", e))?;
    // hf_config replaces the profile; the default name would only mislead.
    model_table.remove("profile");
    doc.insert("model".into(), toml::Value::Table(model_table));
    let mut out = String::from(
        "# Written by `lockstep import trtllm`. The workload is lockstep's (the YAML describes\n# servers, not their load).\n",
    );
    if !unmodeled.is_empty() {
        out.push_str("# TensorRT-LLM keys lockstep does not model:\n");
        for u in unmodeled {
            out.push_str(&format!("#   {u}\n"));
        }
    }
    for n in notes {
        out.push_str(&format!("# note: {n}\n"));
    }
    out.push('\n');
    out.push_str(&toml::to_string(&doc).map_err(|e| to_toml("scenario", e))?);
    if !out.ends_with('\n') {
        out.push('\n');
    }
    Ok(out)
}

fn int(v: u64) -> toml::Value {
    toml::Value::Integer(i64::try_from(v).unwrap_or(i64::MAX))
}
