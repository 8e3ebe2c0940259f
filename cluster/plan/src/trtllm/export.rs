//! `lockstep export trtllm`: scenario → TensorRT-LLM YAML.

use std::path::Path;

use serde_norway::{Mapping, Value};

use lockstep_actors::config::{Role, ServerConfig};
use lockstep_actors::policy::Policy;

use super::TrtllmError;
use super::import::relative_path;
use crate::scenario::Scenario;

/// The YAML written and what the scenario says that it cannot.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// The YAML text.
    pub yaml: String,
    /// Scenario keys TensorRT-LLM's YAML has no place for.
    pub not_expressible: Vec<String>,
}

/// Writes `scenario` as TensorRT-LLM YAML to be saved at `out`: an
/// `extra-llm-api-config.yml` for one aggregated server, a disaggregated serving YAML
/// for ctx and gen servers (servers of a role must be alike: the YAML has one config
/// per role and a `num_instances`).
pub fn export(scenario: &Scenario, out: &Path) -> Result<Exported, TrtllmError> {
    let mut not_expressible = Vec::new();
    let by_role = |role: Role| -> Vec<&ServerConfig> {
        scenario.servers.iter().filter(|s| s.role == role).collect()
    };
    let (agg, ctx, gen_servers) = (by_role(Role::Agg), by_role(Role::Ctx), by_role(Role::Gen));
    let m = &scenario.model;
    let out_dir = out.parent().unwrap_or(Path::new("."));
    let model_path = m
        .hf_config
        .as_ref()
        .map(|p| relative_path(&scenario.base_dir.join(p), out_dir));
    if m.hf_config.is_none() {
        not_expressible.push(format!(
            "model.profile = \"{}\": a lockstep cost profile; TensorRT-LLM needs the model's checkpoint",
            m.profile
        ));
    }
    let mut doc = Mapping::new();
    let profile_role = if gen_servers.is_empty() {
        Role::Agg
    } else {
        Role::Gen
    };
    if !agg.is_empty() {
        if !ctx.is_empty() || !gen_servers.is_empty() {
            return Err(TrtllmError::Export(
                "aggregated and disaggregated servers in one scenario: TensorRT-LLM's YAML describes one or the other".into(),
            ));
        }
        if agg.len() > 1 {
            return Err(TrtllmError::Export(format!(
                "{} aggregated servers: an extra-llm-api-config.yml describes one",
                agg.len()
            )));
        }
        doc = server_mapping(scenario, agg[0], profile_role, &mut not_expressible);
    } else {
        if let Some(path) = &model_path {
            doc.insert("model".into(), path.clone().into());
        }
        for (key, servers) in [
            ("context_servers", &ctx),
            ("generation_servers", &gen_servers),
        ] {
            let Some(first) = servers.first() else {
                return Err(TrtllmError::Export(format!(
                    "no {key}: a disaggregated YAML needs both roles"
                )));
            };
            let unnamed = |s: &ServerConfig| ServerConfig {
                name: String::new(),
                ..s.clone()
            };
            if let Some(other) = servers.iter().find(|s| unnamed(s) != unnamed(first)) {
                return Err(TrtllmError::Export(format!(
                    "servers `{}` and `{}` differ: a disaggregated YAML has one config for all {key}",
                    first.name, other.name
                )));
            }
            let own = |s: &ServerConfig| scenario.model.servers.get(&s.name);
            if let Some(other) = servers.iter().find(|s| own(s) != own(first)) {
                return Err(TrtllmError::Export(format!(
                    "servers `{}` and `{}` are costed differently ([model.servers]): a disaggregated YAML has one config for all {key}",
                    first.name, other.name
                )));
            }
            let mut t = Mapping::new();
            t.insert("num_instances".into(), (servers.len() as u64).into());
            for (k, v) in server_mapping(scenario, first, profile_role, &mut not_expressible) {
                t.insert(k, v);
            }
            doc.insert(key.into(), Value::Mapping(t));
        }
    }
    if scenario.policy != Policy::FIXED {
        not_expressible.push("[policy]: lockstep's mechanism switches".into());
    }
    if scenario.workload.is_some() {
        not_expressible.push("[workload]: the benchmark client's, not the server's".into());
    }
    if m.link != crate::model::LinkConfig::default() {
        not_expressible.push("model.link: the simulated network".into());
    }
    if m.coefficients != crate::model::CoefficientOverrides::default()
        || m.servers
            .values()
            .any(|own| own.coefficients != crate::model::CoefficientOverrides::default())
    {
        not_expressible.push("model.coefficients: cost-model overrides".into());
    }
    if m.servers.values().any(|own| own.tp.is_some()) {
        not_expressible.push(
            "model.servers.*.tp: a server's ranks costed apart; its tensor_parallel_size says its GPUs".into(),
        );
    }
    if m.efficiency.is_some() || m.reserved_memory_gib.is_some() {
        not_expressible
            .push("model.efficiency / model.reserved_memory_gib: roofline settings".into());
    }
    if m.hf_config.is_some() {
        not_expressible.push(format!(
            "model.gpu / model.hardware and model.weight_precision ({}): the GPU and the checkpoint's format, given again to `import trtllm`",
            m.weight_precision.map_or("the checkpoint's", |p| p.name())
        ));
    }
    let mut yaml = String::from("# Written by `lockstep export trtllm`.\n");
    if agg.len() == 1
        && let Some(path) = &model_path
    {
        yaml.push_str(&format!(
            "# model: {path} (an extra-llm-api-config.yml does not name its model)\n"
        ));
    }
    yaml.push_str(
        &serde_norway::to_string(&Value::Mapping(doc))
            .map_err(|e| TrtllmError::Export(e.to_string()))?,
    );
    Ok(Exported {
        yaml,
        not_expressible,
    })
}

fn server_mapping(
    scenario: &Scenario,
    s: &ServerConfig,
    profile_role: Role,
    not_expressible: &mut Vec<String>,
) -> Mapping {
    let m = &scenario.model;
    let mut t = Mapping::new();
    let put = |t: &mut Mapping, k: &str, v: Value| {
        t.insert(k.into(), v);
    };
    put(
        &mut t,
        "tensor_parallel_size",
        s.tensor_parallel_size.into(),
    );
    put(
        &mut t,
        "pipeline_parallel_size",
        s.pipeline_parallel_size.into(),
    );
    // A server's experts spread: its own (`[model.servers.NAME]`), else the profile's,
    // which is the generation servers' (or the only one's).
    let own_ep = m.servers.get(&s.name).and_then(|own| own.ep);
    if let Some(ep) = own_ep.or(m.ep.filter(|_| s.role == profile_role)) {
        put(&mut t, "moe_expert_parallel_size", u64::from(ep).into());
    }
    put(&mut t, "enable_attention_dp", s.enable_attention_dp.into());
    put(&mut t, "max_batch_size", s.max_batch_size.into());
    put(&mut t, "max_num_tokens", s.max_num_tokens.into());
    put(
        &mut t,
        "disable_overlap_scheduler",
        s.disable_overlap_scheduler.into(),
    );
    put(
        &mut t,
        "enable_chunked_prefill",
        s.enable_chunked_prefill.into(),
    );
    let mut kv = Mapping::new();
    put(
        &mut kv,
        "tokens_per_block",
        s.kv_cache_config.tokens_per_block.into(),
    );
    put(&mut kv, "max_tokens", s.kv_cache_config.max_tokens.into());
    put(
        &mut kv,
        "enable_block_reuse",
        s.kv_cache_config.enable_block_reuse.into(),
    );
    // The scenario keeps one fraction, the profile servers'; the others' pools are
    // already sized in max_tokens.
    if s.role == profile_role
        && let Some(f) = m.free_gpu_memory_fraction
    {
        put(&mut kv, "free_gpu_memory_fraction", f.into());
    }
    if let Some(p) = m.kv_precision {
        put(&mut kv, "dtype", p.name().into());
    }
    put(&mut t, "kv_cache_config", Value::Mapping(kv));
    let mut sched = Mapping::new();
    put(
        &mut sched,
        "capacity_scheduler_policy",
        serde_name(&s.scheduler_config.capacity_scheduler_policy).into(),
    );
    put(
        &mut sched,
        "context_chunking_policy",
        serde_name(&s.scheduler_config.context_chunking_policy).into(),
    );
    put(&mut t, "scheduler_config", Value::Mapping(sched));
    if s.role != Role::Agg {
        let c = &s.cache_transceiver_config;
        let mut ct = Mapping::new();
        put(
            &mut ct,
            "max_tokens_in_buffer",
            c.max_tokens_in_buffer.into(),
        );
        put(
            &mut ct,
            "kv_transfer_timeout_ms",
            c.kv_transfer_timeout_ms.into(),
        );
        put(&mut t, "cache_transceiver_config", Value::Mapping(ct));
    }
    let adp = &s.attention_dp_config;
    if s.enable_attention_dp && adp.enable_balance {
        let mut a = Mapping::new();
        put(&mut a, "enable_balance", true.into());
        put(&mut a, "timeout_iters", adp.timeout_iters.into());
        put(
            &mut a,
            "batching_wait_iters",
            adp.batching_wait_iters.into(),
        );
        put(&mut t, "attention_dp_config", Value::Mapping(a));
    }
    if s.max_draft_len > 0 {
        let mut spec = Mapping::new();
        put(&mut spec, "max_draft_len", s.max_draft_len.into());
        put(&mut t, "speculative_config", Value::Mapping(spec));
    }
    let d = ServerConfig::default();
    let lockstep_only = [
        ("ranks", s.ranks != d.ranks),
        ("encoder_decoder", s.encoder_decoder != d.encoder_decoder),
        ("hybrid_model", s.hybrid_model != d.hybrid_model),
        (
            "attention_dp_config.router",
            s.attention_dp_config.router != d.attention_dp_config.router,
        ),
        ("slot_pools", s.slot_pools != d.slot_pools),
        (
            "cache_transceiver_config.kv_pull_timeout_ms",
            s.cache_transceiver_config.kv_pull_timeout_ms
                != d.cache_transceiver_config.kv_pull_timeout_ms,
        ),
        (
            "cache_transceiver_config.generation_first",
            s.cache_transceiver_config.generation_first
                != d.cache_transceiver_config.generation_first,
        ),
    ];
    for (key, differs) in lockstep_only {
        if differs {
            let line = format!("server.{}: {key} (lockstep's own)", s.name);
            not_expressible.push(line);
        }
    }
    t
}

/// An enum's serde name: the one TensorRT-LLM's YAML uses too.
fn serde_name(v: &impl serde::Serialize) -> String {
    serde_json::to_value(v)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}
