//! The `[model]` section: which cost profile, coefficient overrides, and the KV link used
//! to model ctx → gen transfers.

use serde::{Deserialize, Serialize};

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
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            profile: "llama3-8b-h100-bf16".into(),
            coefficients: CoefficientOverrides::default(),
            kv: None,
            link: LinkConfig::default(),
        }
    }
}

impl ModelConfig {
    /// The profile with overrides applied; errors name the key and value. A profile file
    /// is read relative to `base_dir` (the scenario file's folder).
    pub fn resolve(&self, base_dir: &std::path::Path) -> Result<ModelProfile, ModelError> {
        let mut p = if self.profile.ends_with(".toml") {
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

    /// Modeled time of one message of `bytes` between ranks: bytes / bandwidth +
    /// latency.
    pub fn wire_ns(&self, bytes: u64) -> u64 {
        let ns = bytes as f64 / self.link.bandwidth_gb_per_s + self.link.latency_us * 1_000.0;
        ns.round().max(1.0) as u64
    }

    /// Modeled latency of a message between the front and a server.
    pub fn control_ns(&self) -> u64 {
        (self.link.control_latency_us * 1_000.0).round() as u64
    }
}
