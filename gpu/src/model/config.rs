//! `config.json` of a Hugging Face causal LM: the numbers that fix every tensor's shape.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::error::{ModelError, Result};
use super::rope::RopeScaling;

/// The architectures this backend implements. They share one forward; they differ in
/// whether Q/K/V projections carry a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `Qwen2ForCausalLM`: Llama with biases on the Q, K and V projections.
    Qwen2,
    /// `MistralForCausalLM`: Llama with sliding-window attention where the config gives
    /// a window.
    Mistral,
}

impl Architecture {
    /// The name `config.json` uses in `architectures`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
        }
    }

    /// The name `config.json` uses in `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Mistral => "mistral",
        }
    }
}

/// The MLP's activation (`hidden_act`): the gate's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// `silu` (also spelled `swish`): SwiGLU.
    #[default]
    Silu,
    /// `gelu`: the exact, erf-based GELU.
    Gelu,
    /// `gelu_pytorch_tanh` / `gelu_new`: GELU's tanh approximation.
    GeluTanh,
}

impl Activation {
    /// The name `config.json` uses.
    pub fn hf_name(self) -> &'static str {
        match self {
            Activation::Silu => "silu",
            Activation::Gelu => "gelu",
            Activation::GeluTanh => "gelu_pytorch_tanh",
        }
    }
}

/// Sampling defaults of `generation_config.json`: what a request that says nothing
/// samples with (vLLM's `--generation-config auto`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GenerationDefaults {
    /// `temperature`, where `do_sample` is not false.
    pub temperature: Option<f64>,
    /// `top_p`.
    pub top_p: Option<f64>,
    /// `top_k`.
    pub top_k: Option<usize>,
}

/// The model's hyperparameters, as read from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which architecture the weights follow.
    pub architecture: Architecture,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's gate and up projections.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (fewer than query heads: grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size: rows of the embedding and of the LM head.
    pub vocab_size: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f64,
    /// Base of the rotary position embedding's frequencies.
    pub rope_theta: f64,
    /// How those frequencies are stretched for long contexts (`rope_scaling`).
    pub rope_scaling: RopeScaling,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest sequence the rotary tables cover.
    pub max_position_embeddings: usize,
    /// Whether Q/K/V projections have biases (Qwen2; Llama's `attention_bias`, which
    /// gives `o_proj` one too: see [`ModelConfig::o_proj_bias`]).
    pub attention_bias: bool,
    /// Whether the MLP's three projections have biases (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// The MLP gate's activation (`hidden_act`).
    pub hidden_act: Activation,
    /// End-of-sequence tokens: `eos_token_id` of `config.json` (an integer or a list)
    /// and of `generation_config.json`; every one ends generation.
    pub eos_token_ids: Vec<u32>,
    /// Sampling defaults of `generation_config.json`, where it has them.
    pub generation: GenerationDefaults,
    /// Sliding-window attention: a query sees only the keys of its last this-many
    /// positions, itself included (Mistral's `sliding_window`; `None`: all of them).
    pub sliding_window: Option<usize>,
}

impl ModelConfig {
    /// Whether a request of `tokens` positions (its prompt plus every output token)
    /// fits the model's `max_position_embeddings`: the one rule `serve` applies per
    /// request and `sim`/`run` to a whole workload at startup.
    pub fn holds_positions(max_position_embeddings: usize, tokens: u64) -> bool {
        tokens <= max_position_embeddings as u64
    }

    /// Reads and checks `DIR/config.json`, and `DIR/generation_config.json` when present
    /// (its end ids join the config's; its sampling becomes the defaults).
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        let mut config = Self::parse(&text, &path)?;
        let generation_path = dir.join("generation_config.json");
        if let Ok(text) = std::fs::read_to_string(&generation_path) {
            config.apply_generation_config(&text, &generation_path)?;
        }
        Ok(config)
    }

    /// Merges the text of a `generation_config.json`; `path` only names it in errors.
    pub fn apply_generation_config(&mut self, text: &str, path: &Path) -> Result<()> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        for id in eos_of(&value).map_err(|message| ModelError::InvalidConfig {
            path: path.to_path_buf(),
            message,
        })? {
            if !self.eos_token_ids.contains(&id) {
                self.eos_token_ids.push(id);
            }
        }
        // `do_sample: false` means greedy whatever the other fields say.
        let greedy = value.get("do_sample").and_then(Value::as_bool) == Some(false);
        self.generation = GenerationDefaults {
            temperature: if greedy {
                Some(0.0)
            } else {
                value.get("temperature").and_then(Value::as_f64)
            },
            top_p: value.get("top_p").and_then(Value::as_f64),
            top_k: value
                .get("top_k")
                .and_then(Value::as_u64)
                .map(|k| k as usize),
        };
        Ok(())
    }

    /// Parses the text of a `config.json`; `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let json_error = |message: String| ModelError::Json {
            path: path.to_path_buf(),
            message,
        };
        let value: Value = serde_json::from_str(text).map_err(|e| json_error(e.to_string()))?;
        let architecture = architecture_of(&value, path)?;
        let get = |field: &str| -> Result<usize> {
            value
                .get(field)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| json_error(format!("missing or non-integer field {field:?}")))
        };
        let hidden_size = get("hidden_size")?;
        let num_attention_heads = get("num_attention_heads")?;
        let num_key_value_heads = value
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map_or(num_attention_heads, |v| v as usize);
        let invalid = |message: String| ModelError::InvalidConfig {
            path: path.to_path_buf(),
            message,
        };
        if num_attention_heads == 0 || num_key_value_heads == 0 {
            return Err(invalid("attention heads must be positive".into()));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(invalid(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            )));
        }
        let head_dim = match value.get("head_dim").and_then(Value::as_u64) {
            Some(d) => d as usize,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(invalid(format!(
                        "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(invalid(format!(
                "head dim {head_dim} must be positive and even (rotary pairs)"
            )));
        }
        let float =
            |field: &str, default: f64| value.get(field).and_then(Value::as_f64).unwrap_or(default);
        let (rope_theta, rope_scaling) = rope_of(&value).map_err(invalid)?;
        let sliding_window = sliding_window_of(&value, architecture).map_err(invalid)?;
        refuse_unimplemented(&value, sliding_window.is_some()).map_err(invalid)?;
        let flag = |field: &str| -> std::result::Result<bool, String> {
            match value.get(field) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(other) => Err(format!("{field} must be true or false, got {other}")),
            }
        };
        // Only Llama reads `attention_bias` and `mlp_bias`; Qwen2 always has Q/K/V
        // biases and Mistral none, whatever the keys say (as in transformers).
        let attention_bias = match architecture {
            Architecture::Llama => flag("attention_bias").map_err(invalid)?,
            Architecture::Qwen2 => true,
            Architecture::Mistral => false,
        };
        let mlp_bias = architecture == Architecture::Llama && flag("mlp_bias").map_err(invalid)?;
        let hidden_act = activation_of(&value).map_err(invalid)?;
        let eos_token_ids = eos_of(&value).map_err(invalid)?;
        let config = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: get("intermediate_size")?,
            num_hidden_layers: get("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: get("vocab_size")?,
            rms_norm_eps: float("rms_norm_eps", 1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: value
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_position_embeddings: value
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map_or(4096, |v| v as usize),
            attention_bias,
            mlp_bias,
            hidden_act,
            eos_token_ids,
            generation: GenerationDefaults::default(),
            sliding_window,
        };
        if config.hidden_size == 0 || config.intermediate_size == 0 || config.vocab_size == 0 {
            return Err(invalid("sizes must be positive".into()));
        }
        Ok(config)
    }

    /// The config as `config.json` text (what `init` writes).
    pub fn to_json(&self) -> String {
        let mut value = serde_json::json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": self.architecture.model_type(),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": self.hidden_act.hf_name(),
            "torch_dtype": "float32",
        });
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => value["eos_token_id"] = (*one).into(),
            many => value["eos_token_id"] = many.into(),
        }
        if let Some(scaling) = self.rope_scaling.to_json() {
            value["rope_scaling"] = scaling;
        }
        if let Some(window) = self.sliding_window {
            value["sliding_window"] = window.into();
        }
        serde_json::to_string_pretty(&value).unwrap_or_default() + "\n"
    }

    /// The rotary inverse frequencies, `head_dim / 2` of them, scaled as configured.
    pub fn inverse_frequencies(&self) -> Vec<f64> {
        self.rope_scaling
            .inverse_frequencies(self.head_dim, self.rope_theta)
    }

    /// Whether `o_proj` has a bias: Llama's `attention_bias` covers all four attention
    /// projections, Qwen2's biases only Q/K/V.
    pub fn o_proj_bias(&self) -> bool {
        self.attention_bias && self.architecture == Architecture::Llama
    }

    /// The first end-of-sequence id, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }

    /// Query heads that share one key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The sizes a user reads to recognise the model, in one line.
    pub fn summary(&self) -> String {
        format!(
            "{} layers, hidden {}, {} heads, {} kv heads, vocab {}, intermediate {}, {:.1}M parameters",
            self.num_hidden_layers,
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.vocab_size,
            self.intermediate_size,
            self.parameter_count() as f64 / 1e6
        )
    }

    /// Parameters in the weights (the LM head counted once when tied).
    pub fn parameter_count(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut bias = if self.attention_bias { q + 2 * kv } else { 0 };
        if self.o_proj_bias() {
            bias += h;
        }
        if self.mlp_bias {
            bias += 2 * i + h;
        }
        let layer = h * q + 2 * h * kv + q * h + bias + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}

fn architecture_of(value: &Value, path: &Path) -> Result<Architecture> {
    let named = value
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| {
            value
                .get("model_type")
                .and_then(Value::as_str)
                .map(str::to_owned)
        });
    let Some(name) = named else {
        return Err(ModelError::Json {
            path: path.to_path_buf(),
            message: "neither \"architectures\" nor \"model_type\" is given".into(),
        });
    };
    match name.as_str() {
        "LlamaForCausalLM" | "llama" => Ok(Architecture::Llama),
        "Qwen2ForCausalLM" | "qwen2" => Ok(Architecture::Qwen2),
        "MistralForCausalLM" | "mistral" => Ok(Architecture::Mistral),
        _ => Err(ModelError::UnsupportedArchitecture {
            path: PathBuf::from(path),
            found: name,
        }),
    }
}

/// `eos_token_id` is an integer or a list (Llama 3); every one ends generation.
fn eos_of(value: &Value) -> std::result::Result<Vec<u32>, String> {
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| format!("eos_token_id must be token ids, got {v}"))
    };
    match value.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a.iter().map(id).collect(),
        Some(one) => Ok(vec![id(one)?]),
    }
}

/// θ and the scaling: transformers 5's `rope_parameters` (θ inside it) or the older
/// top-level `rope_theta` and `rope_scaling`. Both layouts at once must agree.
fn rope_of(value: &Value) -> std::result::Result<(f64, RopeScaling), String> {
    let theta_in = |v: &Value, key: &str| -> std::result::Result<Option<f64>, String> {
        match v.get("rope_theta") {
            None | Some(Value::Null) => Ok(None),
            Some(t) => match t.as_f64() {
                Some(t) if t.is_finite() && t > 0.0 => Ok(Some(t)),
                _ => Err(format!(
                    "{key}rope_theta must be a positive number, got {t}"
                )),
            },
        }
    };
    let top_theta = theta_in(value, "")?;
    let top_scaling = RopeScaling::parse_in(value.get("rope_scaling"), "rope_scaling")?;
    let Some(parameters) = value.get("rope_parameters").filter(|v| !v.is_null()) else {
        return Ok((top_theta.unwrap_or(10_000.0), top_scaling));
    };
    if !parameters.is_object() {
        return Err(format!(
            "rope_parameters must be an object, got {parameters}"
        ));
    }
    let theta = theta_in(parameters, "rope_parameters.")?;
    let scaling = RopeScaling::parse_in(Some(parameters), "rope_parameters")?;
    if let (Some(a), Some(b)) = (theta, top_theta)
        && a != b
    {
        return Err(format!(
            "rope_parameters.rope_theta {a} disagrees with rope_theta {b}"
        ));
    }
    if value.get("rope_scaling").is_some_and(|v| !v.is_null()) && top_scaling != scaling {
        return Err("rope_parameters and rope_scaling disagree".into());
    }
    Ok((theta.or(top_theta).unwrap_or(10_000.0), scaling))
}

/// `hidden_act`: SiLU and the two GELUs are implemented; anything else is refused
/// rather than run with the wrong nonlinearity.
fn activation_of(value: &Value) -> std::result::Result<Activation, String> {
    match value.get("hidden_act") {
        None | Some(Value::Null) => Ok(Activation::Silu),
        Some(Value::String(name)) => match name.as_str() {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu" => Ok(Activation::Gelu),
            "gelu_pytorch_tanh" | "gelu_new" => Ok(Activation::GeluTanh),
            other => Err(format!(
                "hidden_act {other:?} is not supported by the CPU backend (supported: silu, gelu, gelu_pytorch_tanh, gelu_new)"
            )),
        },
        Some(other) => Err(format!("hidden_act must be a string, got {other}")),
    }
}

/// Keys that change the arithmetic in ways this backend does not implement: refused at
/// load, naming the key, rather than served wrong.
fn refuse_unimplemented(value: &Value, windowed: bool) -> std::result::Result<(), String> {
    if let Some(q) = value.get("quantization_config").filter(|v| !v.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        return Err(format!(
            "quantization_config (quant_method {method:?}) is not supported by the CPU backend: it reads unquantized weights only"
        ));
    }
    if let Some(types) = value.get("layer_types").and_then(Value::as_array)
        && let Some(other) = types.iter().find(|t| match t.as_str() {
            Some("full_attention") => windowed,
            // Every layer windowed is what `sliding_window` alone already means.
            Some("sliding_attention") => !windowed,
            _ => true,
        })
    {
        return Err(format!(
            "layer_types entry {other} is not supported by the CPU backend (all layers must be \"full_attention\", or all \"sliding_attention\" with a sliding_window)"
        ));
    }
    Ok(())
}

/// The attention window: Mistral's `sliding_window` (a positive integer, or null for
/// none). Qwen2 configs carry a `sliding_window` too, applied only under
/// `use_sliding_window` and then to some layers: that case is refused rather than run
/// with the wrong attention. Llama has no window.
fn sliding_window_of(
    value: &Value,
    architecture: Architecture,
) -> std::result::Result<Option<usize>, String> {
    match architecture {
        Architecture::Llama => Ok(None),
        Architecture::Qwen2 => match value.get("use_sliding_window").and_then(Value::as_bool) {
            Some(true) => Err(
                "use_sliding_window true is not supported by the CPU backend (Qwen2 applies it to some layers only)"
                    .into(),
            ),
            _ => Ok(None),
        },
        Architecture::Mistral => match value.get("sliding_window") {
            None | Some(Value::Null) => Ok(None),
            Some(w) => match w.as_u64() {
                Some(w) if w > 0 => Ok(Some(w as usize)),
                _ => Err(format!("sliding_window must be a positive integer or null, got {w}")),
            },
        },
    }
}
