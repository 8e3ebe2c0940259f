//! The `[model]` section: which cost profile (a shipped one, a profile file, or one
//! derived from a Hugging Face `config.json` on a GPU by the roofline), coefficient
//! overrides, and the KV link used to model ctx → gen transfers.

use serde::{Deserialize, Serialize};

use lockstep_gpu::roofline::{
    self, Architecture, Deployment, DeriveError, Efficiency, Gpu, HfConfigError, Parallelism,
    Precision, RooflineError,
};
use lockstep_gpu::{Coefficients, KvGeometry, ModelProfile, UnknownProfile};

/// A bad `[model]` section: the key and the value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// No such profile.
    #[error("model.profile: {0}")]
    Profile(#[from] UnknownProfile),
    /// A profile file (`model.profile = "….toml"`) that cannot be read or parsed.
    #[error("model.profile = \"{path}\": {message}")]
    ProfileFile {
        /// The path as given.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// `model.hf_config` cannot be read as an architecture.
    #[error("model.hf_config: {0}")]
    HfConfig(#[from] HfConfigError),
    /// The roofline refuses the deployment (the message names the key and value).
    #[error("[model] {0}")]
    Roofline(#[from] RooflineError),
    /// The roofline could not be fitted to linear coefficients.
    #[error("[model] {0}")]
    Derive(#[from] DeriveError),
    /// Keys that exclude or need each other.
    #[error("model.{key}: {why}")]
    Conflict {
        /// The key given.
        key: &'static str,
        /// What it conflicts with or needs.
        why: &'static str,
    },
    /// A server's own cost model (`[model.servers.NAME]`) is refused.
    #[error("model.servers.{name}: {source}")]
    Server {
        /// The server.
        name: String,
        /// Why.
        source: Box<ModelError>,
    },
    /// A coefficient or link value out of range.
    #[error("model.{key} must be {want}, got {value}")]
    OutOfRange {
        /// The key under `[model]`.
        key: String,
        /// What it must be.
        want: &'static str,
        /// What it was.
        value: f64,
    },
}

/// Coefficient overrides: each given field replaces the profile's value.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoefficientOverrides {
    /// See [`Coefficients::forward_base_ns`].
    pub forward_base_ns: Option<f64>,
    /// See [`Coefficients::ctx_token_ns`].
    pub ctx_token_ns: Option<f64>,
    /// See [`Coefficients::ctx_attention_ns`].
    pub ctx_attention_ns: Option<f64>,
    /// See [`Coefficients::gen_request_ns`].
    pub gen_request_ns: Option<f64>,
    /// See [`Coefficients::gen_token_ns`].
    pub gen_token_ns: Option<f64>,
    /// See [`Coefficients::kv_read_ns`].
    pub kv_read_ns: Option<f64>,
    /// See [`Coefficients::collective_ns`].
    pub collective_ns: Option<f64>,
    /// See [`Coefficients::host_base_ns`].
    pub host_base_ns: Option<f64>,
    /// See [`Coefficients::host_per_request_ns`].
    pub host_per_request_ns: Option<f64>,
}

impl CoefficientOverrides {
    /// Every coefficient of `c` given: a profile written as overrides.
    pub fn every(c: &Coefficients) -> CoefficientOverrides {
        CoefficientOverrides {
            forward_base_ns: Some(c.forward_base_ns),
            ctx_token_ns: Some(c.ctx_token_ns),
            ctx_attention_ns: Some(c.ctx_attention_ns),
            gen_request_ns: Some(c.gen_request_ns),
            gen_token_ns: Some(c.gen_token_ns),
            kv_read_ns: Some(c.kv_read_ns),
            collective_ns: Some(c.collective_ns),
            host_base_ns: Some(c.host_base_ns),
            host_per_request_ns: Some(c.host_per_request_ns),
        }
    }

    /// These overrides with `over`'s given fields replacing theirs.
    pub fn overridden_by(&self, over: &CoefficientOverrides) -> CoefficientOverrides {
        CoefficientOverrides {
            forward_base_ns: over.forward_base_ns.or(self.forward_base_ns),
            ctx_token_ns: over.ctx_token_ns.or(self.ctx_token_ns),
            ctx_attention_ns: over.ctx_attention_ns.or(self.ctx_attention_ns),
            gen_request_ns: over.gen_request_ns.or(self.gen_request_ns),
            gen_token_ns: over.gen_token_ns.or(self.gen_token_ns),
            kv_read_ns: over.kv_read_ns.or(self.kv_read_ns),
            collective_ns: over.collective_ns.or(self.collective_ns),
            host_base_ns: over.host_base_ns.or(self.host_base_ns),
            host_per_request_ns: over.host_per_request_ns.or(self.host_per_request_ns),
        }
    }

    fn apply(&self, c: &mut Coefficients) -> Result<(), ModelError> {
        let fields = [
            (
                "forward_base_ns",
                self.forward_base_ns,
                &mut c.forward_base_ns,
            ),
            ("ctx_token_ns", self.ctx_token_ns, &mut c.ctx_token_ns),
            (
                "ctx_attention_ns",
                self.ctx_attention_ns,
                &mut c.ctx_attention_ns,
            ),
            ("gen_request_ns", self.gen_request_ns, &mut c.gen_request_ns),
            ("gen_token_ns", self.gen_token_ns, &mut c.gen_token_ns),
            ("kv_read_ns", self.kv_read_ns, &mut c.kv_read_ns),
            ("collective_ns", self.collective_ns, &mut c.collective_ns),
            ("host_base_ns", self.host_base_ns, &mut c.host_base_ns),
            (
                "host_per_request_ns",
                self.host_per_request_ns,
                &mut c.host_per_request_ns,
            ),
        ];
        for (name, value, slot) in fields {
            if let Some(v) = value {
                if !coefficient_in_range(v) {
                    return Err(ModelError::OutOfRange {
                        key: format!("coefficients.{name}"),
                        want: COEFFICIENT_RANGE,
                        value: v,
                    });
                }
                *slot = v;
            }
        }
        Ok(())
    }
}

/// What a coefficient may be, from an override or a profile file.
const COEFFICIENT_RANGE: &str = "a finite number >= 0";

fn coefficient_in_range(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

/// Reads a profile file: a [`ModelProfile`] in TOML, every coefficient a finite number
/// of 0 or more.
fn load_profile_file(path: &str, base_dir: &std::path::Path) -> Result<ModelProfile, ModelError> {
    let err = |message: String| ModelError::ProfileFile {
        path: path.to_string(),
        message,
    };
    let text = std::fs::read_to_string(base_dir.join(path)).map_err(|e| err(e.to_string()))?;
    let p: ModelProfile = toml::from_str(&text).map_err(|e| err(e.to_string()))?;
    for (name, v) in p.coefficients.terms() {
        if !coefficient_in_range(v) {
            return Err(err(format!(
                "coefficients.{name} must be {COEFFICIENT_RANGE}, got {v}"
            )));
        }
    }
    Ok(p)
}

/// The simulated network: the links between ranks of different servers (KV
/// transfers, generation-first notices) and between the front and the servers.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConfig {
    /// Bandwidth between ranks in GB/s (10^9 bytes per second).
    pub bandwidth_gb_per_s: f64,
    /// Latency of one message between ranks of different servers.
    pub latency_us: f64,
    /// Latency of one message between the front and a server (requests, responses).
    pub control_latency_us: f64,
}

impl Default for LinkConfig {
    fn default() -> Self {
        // One 400 Gb/s NIC per GPU, as in common disaggregated deployments.
        LinkConfig {
            bandwidth_gb_per_s: 50.0,
            latency_us: 20.0,
            control_latency_us: 0.0,
        }
    }
}

/// `[model.servers.NAME]`: one server's ranks costed apart from the fleet's (a
/// disaggregated fleet's context servers at another tensor parallelism than its
/// generation servers). Absent keys keep `[model]`'s.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerModel {
    /// GPUs one of its ranks is split over (with `hf_config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    /// GPUs its routed experts spread over (with `hf_config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ep: Option<u32>,
    /// Coefficient overrides on top of `[model.coefficients]`.
    #[serde(default)]
    pub coefficients: CoefficientOverrides,
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// A profile name from `lockstep_gpu::profiles()`, or the path of a profile file
    /// (ending in `.toml`, relative to the scenario file; `lockstep model calibrate`
    /// writes one).
    pub profile: String,
    /// Coefficient overrides.
    pub coefficients: CoefficientOverrides,
    /// KV geometry override.
    pub kv: Option<KvGeometry>,
    /// ctx → gen link.
    pub link: LinkConfig,
    /// A Hugging Face `config.json` (relative to the scenario file): the profile is
    /// derived from the roofline of this model on `gpu` (or `hardware`) instead of
    /// `profile`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hf_config: Option<String>,
    /// A GPU of the roofline's table (`lockstep explain --list-gpus`), with `hf_config`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// A custom GPU instead of `gpu`: the table's fields.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hardware: Option<Gpu>,
    /// GPUs one rank's attention and dense layers are split over (default 1: with
    /// attention DP a rank is one GPU).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tp: Option<u32>,
    /// GPUs the routed experts are spread over (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ep: Option<u32>,
    /// `bf16`, `fp8` or `nvfp4`: the transformer blocks' weights (default: the
    /// checkpoint's `quantization_config`, else `bf16`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_precision: Option<Precision>,
    /// `bf16` (default), `fp8` or `nvfp4`: the KV cache.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_precision: Option<Precision>,
    /// TensorRT-LLM's `kv_cache_config.free_gpu_memory_fraction` (default 0.9): the
    /// share of the memory left after weights that the KV pool takes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_gpu_memory_fraction: Option<f64>,
    /// GiB per GPU kept by the runtime besides weights and KV (default 2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_memory_gib: Option<f64>,
    /// Achieved fractions of peak (`gemm_compute`, `attention_compute`, `memory`,
    /// `link`); absent ones keep their defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<Efficiency>,
    /// Servers whose ranks are costed apart, by name.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub servers: std::collections::BTreeMap<String, ServerModel>,
}

/// The default `profile`, which `hf_config` replaces.
const DEFAULT_PROFILE: &str = "llama3-8b-h100-bf16";

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            profile: DEFAULT_PROFILE.into(),
            coefficients: CoefficientOverrides::default(),
            kv: None,
            link: LinkConfig::default(),
            hf_config: None,
            gpu: None,
            hardware: None,
            tp: None,
            ep: None,
            weight_precision: None,
            kv_precision: None,
            free_gpu_memory_fraction: None,
            reserved_memory_gib: None,
            efficiency: None,
            servers: std::collections::BTreeMap::new(),
        }
    }
}

impl ModelConfig {
    /// The profile with overrides applied; errors name the key and value. A profile file
    /// is read relative to `base_dir` (the scenario file's folder).
    pub fn resolve(&self, base_dir: &std::path::Path) -> Result<ModelProfile, ModelError> {
        let mut p = if let Some(d) = self.deployment(base_dir)? {
            // Weights that leave no room for KV are refused here, not at the first run.
            self.kv_capacity_tokens(base_dir)?;
            roofline::derive_profile(&d, &self.roofline_profile_name(&d))?.profile
        } else if self.profile.ends_with(".toml") {
            load_profile_file(&self.profile, base_dir)?
        } else {
            lockstep_gpu::profile(&self.profile)?
        };
        self.coefficients.apply(&mut p.coefficients)?;
        if let Some(kv) = self.kv {
            p.kv = kv;
        }
        let l = &self.link;
        if !(l.bandwidth_gb_per_s.is_finite() && l.bandwidth_gb_per_s > 0.0) {
            return Err(ModelError::OutOfRange {
                key: "link.bandwidth_gb_per_s".into(),
                want: "> 0",
                value: l.bandwidth_gb_per_s,
            });
        }
        if !(l.latency_us.is_finite() && l.latency_us >= 0.0) {
            return Err(ModelError::OutOfRange {
                key: "link.latency_us".into(),
                want: ">= 0",
                value: l.latency_us,
            });
        }
        if !(l.control_latency_us.is_finite() && l.control_latency_us >= 0.0) {
            return Err(ModelError::OutOfRange {
                key: "link.control_latency_us".into(),
                want: ">= 0",
                value: l.control_latency_us,
            });
        }
        Ok(p)
    }

    /// Server `name`'s cost model: the fleet's, or with its `[model.servers.NAME]` keys
    /// applied (errors name the server and the key).
    pub fn resolve_server(
        &self,
        name: &str,
        base_dir: &std::path::Path,
    ) -> Result<ModelProfile, ModelError> {
        let Some(own) = self.servers.get(name) else {
            return self.resolve(base_dir);
        };
        self.for_server(own)
            .resolve(base_dir)
            .map_err(|e| ModelError::Server {
                name: name.to_string(),
                source: Box::new(e),
            })
    }

    /// The fleet's `[model]` with a server's own keys applied (and no servers of its own).
    pub fn for_server(&self, own: &ServerModel) -> ModelConfig {
        let mut m = self.clone();
        m.servers.clear();
        m.tp = own.tp.or(m.tp);
        m.ep = own.ep.or(m.ep);
        m.coefficients = m.coefficients.overridden_by(&own.coefficients);
        m
    }

    /// The roofline deployment `hf_config` and its keys describe; `None` without
    /// `hf_config`. Errors name the key.
    pub fn deployment(&self, base_dir: &std::path::Path) -> Result<Option<Deployment>, ModelError> {
        let Some(path) = &self.hf_config else {
            let roofline_keys = [
                ("gpu", self.gpu.is_some()),
                ("hardware", self.hardware.is_some()),
                ("tp", self.tp.is_some()),
                ("ep", self.ep.is_some()),
                ("weight_precision", self.weight_precision.is_some()),
                ("kv_precision", self.kv_precision.is_some()),
                (
                    "free_gpu_memory_fraction",
                    self.free_gpu_memory_fraction.is_some(),
                ),
                ("reserved_memory_gib", self.reserved_memory_gib.is_some()),
                ("efficiency", self.efficiency.is_some()),
            ];
            if let Some((key, _)) = roofline_keys.iter().find(|(_, given)| *given) {
                return Err(ModelError::Conflict {
                    key,
                    why: "is a roofline key and needs model.hf_config",
                });
            }
            return Ok(None);
        };
        if self.profile != DEFAULT_PROFILE {
            return Err(ModelError::Conflict {
                key: "hf_config",
                why: "replaces model.profile: give one of them",
            });
        }
        let gpu = match (&self.gpu, &self.hardware) {
            (Some(name), None) => roofline::gpu(name).map_err(RooflineError::from)?,
            (None, Some(custom)) => custom.clone(),
            (Some(_), Some(_)) => {
                return Err(ModelError::Conflict {
                    key: "hardware",
                    why: "replaces model.gpu: give one of them",
                });
            }
            (None, None) => {
                return Err(ModelError::Conflict {
                    key: "hf_config",
                    why: "needs model.gpu (a GPU of the table) or a [model.hardware] table",
                });
            }
        };
        let architecture = Architecture::from_file(&base_dir.join(path))?;
        let weight_precision = self
            .weight_precision
            .or(architecture.checkpoint_precision)
            .unwrap_or(Precision::Bf16);
        let d = Deployment::new(
            architecture,
            gpu,
            Parallelism {
                tp: self.tp.unwrap_or(1),
                ep: self.ep.unwrap_or(1),
            },
            // Absent: the checkpoint's own format (an FP8 checkpoint says so).
            weight_precision,
            self.kv_precision.unwrap_or(Precision::Bf16),
            self.efficiency.unwrap_or_default(),
        )?;
        Ok(Some(d))
    }

    /// The KV tokens one rank holds under the roofline (`free_gpu_memory_fraction` of
    /// the memory left after weights); `None` without `hf_config`.
    pub fn kv_capacity_tokens(
        &self,
        base_dir: &std::path::Path,
    ) -> Result<Option<u64>, ModelError> {
        let Some(d) = self.deployment(base_dir)? else {
            return Ok(None);
        };
        Ok(Some(
            d.kv_capacity_tokens(
                self.free_gpu_memory_fraction
                    .unwrap_or(roofline::DEFAULT_FREE_GPU_MEMORY_FRACTION),
                self.reserved_memory_gib
                    .unwrap_or(roofline::DEFAULT_RESERVED_MEMORY_GIB),
            )?,
        ))
    }

    fn roofline_profile_name(&self, d: &Deployment) -> String {
        format!(
            "roofline:{}@{}-tp{}-ep{}-{}",
            self.hf_config.as_deref().unwrap_or_default(),
            d.gpu.name,
            d.parallelism.tp,
            d.parallelism.ep,
            d.weight_precision
        )
    }

    /// Modeled latency of a message between the front and a server.
    pub fn control_ns(&self) -> u64 {
        (self.link.control_latency_us * 1_000.0).round() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models_dir() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/models")
    }

    fn parse(text: &str) -> Result<ModelConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn hf_config_derives_the_profile_and_its_kv_geometry() {
        let m = parse(
            r#"hf_config = "deepseek-v3/config.json"
gpu = "H200"
ep = 8
weight_precision = "fp8"
kv_precision = "fp8"
[efficiency]
memory = 0.85"#,
        )
        .unwrap();
        let p = m.resolve(&models_dir()).unwrap();
        // The MLA latent as profiles.rs's deepseek-v3 profile has it: 61 · 576 bytes.
        assert_eq!(p.kv.bytes_per_token(), 35_136);
        assert!(p.kv.mla);
        assert!(p.name.contains("H200-tp1-ep8-fp8"), "{}", p.name);
        assert!(p.coefficients.forward_base_ns > 0.0);
        assert!(p.assumptions.contains("memory 0.85"), "{}", p.assumptions);
        let tokens = m.kv_capacity_tokens(&models_dir()).unwrap().unwrap();
        assert!(tokens > 100_000, "{tokens}");
        // Coefficient overrides still apply on top.
        let mut m = m;
        m.coefficients.forward_base_ns = Some(1.0);
        assert_eq!(
            m.resolve(&models_dir())
                .unwrap()
                .coefficients
                .forward_base_ns,
            1.0
        );
    }

    #[test]
    fn roofline_keys_name_what_they_conflict_with_or_need() {
        let dir = models_dir();
        let err = |text: &str| parse(text).unwrap().resolve(&dir).unwrap_err().to_string();
        assert_eq!(
            err("gpu = \"H200\""),
            "model.gpu: is a roofline key and needs model.hf_config"
        );
        let msg = err("hf_config = \"llama-3-8b/config.json\"");
        assert!(msg.starts_with("model.hf_config: needs model.gpu"), "{msg}");
        let msg = err(
            "hf_config = \"llama-3-8b/config.json\"\nprofile = \"deepseek-v3-h200-fp8-adp\"\ngpu = \"H200\"",
        );
        assert!(msg.contains("replaces model.profile"), "{msg}");
        let msg = err("hf_config = \"nope/config.json\"\ngpu = \"H200\"");
        assert!(
            msg.starts_with("model.hf_config: ") && msg.contains("nope/config.json"),
            "{msg}"
        );
        let msg = err("hf_config = \"llama-3-8b/config.json\"\ngpu = \"V100\"");
        assert!(msg.contains("unknown GPU `V100`"), "{msg}");
        let msg = err("hf_config = \"qwen2.5-7b/config.json\"\ngpu = \"H200\"\ntp = 8");
        assert!(msg.contains("tp = 8"), "{msg}");
        let msg = err("hf_config = \"llama-3-70b/config.json\"\ngpu = \"H100-SXM\"");
        assert!(msg.contains("no room for KV"), "{msg}");
        let msg = err(
            "hf_config = \"llama-3-8b/config.json\"\ngpu = \"H200\"\nfree_gpu_memory_fraction = 0",
        );
        assert!(msg.contains("free_gpu_memory_fraction = 0"), "{msg}");
        let bad = parse("hf_config = \"x\"\nweight_precision = \"int4\"")
            .unwrap_err()
            .to_string();
        assert!(
            bad.contains("int4") && bad.contains("weight_precision"),
            "{bad}"
        );
        let bad = parse("hf_config = \"x\"\n[hardware]\nmemory_gib = 1")
            .unwrap_err()
            .to_string();
        assert!(bad.contains("missing field"), "{bad}");
    }

    #[test]
    fn a_custom_hardware_table_replaces_the_gpu() {
        let m = parse(
            r#"hf_config = "llama-3-8b/config.json"
[hardware]
name = "lab-gpu"
memory_gib = 96
memory_tb_per_s = 4.0
bf16_tflops = 900
nvlink_gb_per_s = 900
nvlink_domain_gpus = 8
nvlink_latency_us = 5
network_gb_per_s = 50
network_latency_us = 10"#,
        )
        .unwrap();
        let p = m.resolve(&models_dir()).unwrap();
        assert!(p.name.contains("lab-gpu"), "{}", p.name);
        let mut bad = m.clone();
        if let Some(h) = bad.hardware.as_mut() {
            h.memory_tb_per_s = -1.0;
        }
        let msg = bad.resolve(&models_dir()).unwrap_err().to_string();
        assert!(msg.contains("hardware.memory_tb_per_s = -1"), "{msg}");
    }
}
