//! One TensorRT-LLM server configuration (the keys of an `extra-llm-api-config.yml`, or
//! of a `context_servers` / `generation_servers` entry) read into typed fields. Every
//! key read is taken out of the mapping, so what is left is exactly what lockstep does
//! not model, and is listed.

use serde::de::DeserializeOwned;
use serde_norway::{Mapping, Value};

use lockstep_actors::config::{CapacitySchedulerPolicy, ContextChunkingPolicy};

use super::TrtllmError;

/// The keys of one server that lockstep models; absent ones take TensorRT-LLM's
/// defaults when the scenario is written.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerYaml {
    /// `tensor_parallel_size`.
    pub tensor_parallel_size: Option<i64>,
    /// `pipeline_parallel_size`.
    pub pipeline_parallel_size: Option<i64>,
    /// `moe_expert_parallel_size`.
    pub moe_expert_parallel_size: Option<i64>,
    /// `enable_attention_dp`.
    pub enable_attention_dp: Option<bool>,
    /// `max_batch_size`.
    pub max_batch_size: Option<i64>,
    /// `max_num_tokens`.
    pub max_num_tokens: Option<i64>,
    /// `disable_overlap_scheduler`.
    pub disable_overlap_scheduler: Option<bool>,
    /// `enable_chunked_prefill`.
    pub enable_chunked_prefill: Option<bool>,
    /// `kv_cache_config.free_gpu_memory_fraction`.
    pub free_gpu_memory_fraction: Option<f64>,
    /// `kv_cache_config.tokens_per_block`.
    pub tokens_per_block: Option<i64>,
    /// `kv_cache_config.max_tokens`.
    pub kv_max_tokens: Option<i64>,
    /// `kv_cache_config.enable_block_reuse`.
    pub enable_block_reuse: Option<bool>,
    /// `kv_cache_config.dtype` (`auto`, `fp8`, `nvfp4`, `bf16`).
    pub kv_dtype: Option<String>,
    /// `scheduler_config.capacity_scheduler_policy`.
    pub capacity_scheduler_policy: Option<CapacitySchedulerPolicy>,
    /// `scheduler_config.context_chunking_policy`.
    pub context_chunking_policy: Option<ContextChunkingPolicy>,
    /// `cache_transceiver_config.max_tokens_in_buffer`.
    pub max_tokens_in_buffer: Option<i64>,
    /// `cache_transceiver_config.kv_transfer_timeout_ms`.
    pub kv_transfer_timeout_ms: Option<i64>,
    /// `speculative_config.max_draft_len` (or MTP's `num_nextn_predict_layers`).
    pub max_draft_len: Option<i64>,
    /// `attention_dp_config.enable_balance`.
    pub enable_balance: Option<bool>,
    /// `attention_dp_config.timeout_iters`.
    pub timeout_iters: Option<i64>,
    /// `attention_dp_config.batching_wait_iters`.
    pub batching_wait_iters: Option<i64>,
}

/// Reads keys out of a mapping, naming `prefix.key` and the file in errors and
/// collecting what is left as unmodeled.
pub struct KeyReader<'a> {
    /// The file, for errors.
    pub file: &'a str,
    /// `prefix.key = value` of every key not modeled.
    pub unmodeled: &'a mut Vec<String>,
}

impl KeyReader<'_> {
    /// Takes `key` out of `map` as a `T`; wrong types name the key.
    pub fn take<T: DeserializeOwned>(
        &mut self,
        map: &mut Mapping,
        prefix: &str,
        key: &str,
    ) -> Result<Option<T>, TrtllmError> {
        let Some(value) = map.remove(key) else {
            return Ok(None);
        };
        if value.is_null() {
            return Ok(None);
        }
        serde_norway::from_value(value.clone())
            .map(Some)
            .map_err(|e| TrtllmError::Key {
                file: self.file.to_string(),
                key: join(prefix, key),
                message: format!("{e} (got {})", one_line(&value)),
            })
    }

    /// Takes the table `key` out of `map` (empty when absent).
    pub fn table(
        &mut self,
        map: &mut Mapping,
        prefix: &str,
        key: &str,
    ) -> Result<Mapping, TrtllmError> {
        match map.remove(key) {
            None | Some(Value::Null) => Ok(Mapping::new()),
            Some(Value::Mapping(m)) => Ok(m),
            Some(other) => Err(TrtllmError::Key {
                file: self.file.to_string(),
                key: join(prefix, key),
                message: format!("expected a mapping, got {}", one_line(&other)),
            }),
        }
    }

    /// Lists every key left in `map` as unmodeled.
    pub fn rest(&mut self, map: Mapping, prefix: &str) {
        for (k, v) in map {
            let key = match &k {
                Value::String(s) => s.clone(),
                other => one_line(other),
            };
            self.unmodeled
                .push(format!("{} = {}", join(prefix, &key), one_line(&v)));
        }
    }

    /// Reads one server's keys out of `map`, listing the rest under `prefix`.
    pub fn server(&mut self, mut map: Mapping, prefix: &str) -> Result<ServerYaml, TrtllmError> {
        let mut s = ServerYaml {
            tensor_parallel_size: self.take(&mut map, prefix, "tensor_parallel_size")?,
            pipeline_parallel_size: self.take(&mut map, prefix, "pipeline_parallel_size")?,
            moe_expert_parallel_size: self.take(&mut map, prefix, "moe_expert_parallel_size")?,
            enable_attention_dp: self.take(&mut map, prefix, "enable_attention_dp")?,
            max_batch_size: self.take(&mut map, prefix, "max_batch_size")?,
            max_num_tokens: self.take(&mut map, prefix, "max_num_tokens")?,
            disable_overlap_scheduler: self.take(&mut map, prefix, "disable_overlap_scheduler")?,
            enable_chunked_prefill: self.take(&mut map, prefix, "enable_chunked_prefill")?,
            ..ServerYaml::default()
        };
        let kv_prefix = join(prefix, "kv_cache_config");
        let mut kv = self.table(&mut map, prefix, "kv_cache_config")?;
        s.free_gpu_memory_fraction = self.take(&mut kv, &kv_prefix, "free_gpu_memory_fraction")?;
        s.tokens_per_block = self.take(&mut kv, &kv_prefix, "tokens_per_block")?;
        s.kv_max_tokens = self.take(&mut kv, &kv_prefix, "max_tokens")?;
        s.enable_block_reuse = self.take(&mut kv, &kv_prefix, "enable_block_reuse")?;
        s.kv_dtype = self.take(&mut kv, &kv_prefix, "dtype")?;
        self.rest(kv, &kv_prefix);

        let sched_prefix = join(prefix, "scheduler_config");
        let mut sched = self.table(&mut map, prefix, "scheduler_config")?;
        s.capacity_scheduler_policy =
            self.take(&mut sched, &sched_prefix, "capacity_scheduler_policy")?;
        s.context_chunking_policy =
            self.take(&mut sched, &sched_prefix, "context_chunking_policy")?;
        self.rest(sched, &sched_prefix);

        let ct_prefix = join(prefix, "cache_transceiver_config");
        let mut ct = self.table(&mut map, prefix, "cache_transceiver_config")?;
        s.max_tokens_in_buffer = self.take(&mut ct, &ct_prefix, "max_tokens_in_buffer")?;
        s.kv_transfer_timeout_ms = self.take(&mut ct, &ct_prefix, "kv_transfer_timeout_ms")?;
        self.rest(ct, &ct_prefix);

        let spec_prefix = join(prefix, "speculative_config");
        let mut spec = self.table(&mut map, prefix, "speculative_config")?;
        let draft: Option<i64> = self.take(&mut spec, &spec_prefix, "max_draft_len")?;
        // MTP configs say how many next-token layers they predict with.
        let mtp: Option<i64> = self.take(&mut spec, &spec_prefix, "num_nextn_predict_layers")?;
        s.max_draft_len = draft.or(mtp);
        self.rest(spec, &spec_prefix);

        let adp_prefix = join(prefix, "attention_dp_config");
        let mut adp = self.table(&mut map, prefix, "attention_dp_config")?;
        s.enable_balance = self.take(&mut adp, &adp_prefix, "enable_balance")?;
        s.timeout_iters = self.take(&mut adp, &adp_prefix, "timeout_iters")?;
        s.batching_wait_iters = self.take(&mut adp, &adp_prefix, "batching_wait_iters")?;
        self.rest(adp, &adp_prefix);

        // The MoE backend shapes kernels the cost model does not see: listed, not
        // dropped.
        let moe = self.table(&mut map, prefix, "moe_config")?;
        self.rest(moe, &join(prefix, "moe_config"));
        self.rest(map, prefix);
        Ok(s)
    }
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// A YAML value on one line (JSON-like), for listings and errors.
pub fn one_line(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| format!("{v:?}"))
}
