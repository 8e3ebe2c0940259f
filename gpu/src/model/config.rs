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
    /// Whether Q/K/V projections have biases (Qwen2).
    pub attention_bias: bool,
    /// End-of-sequence token, if the config names one.
    pub eos_token_id: Option<u32>,
    /// Sliding-window attention: a query sees only the keys of its last this-many
    /// positions, itself included (Mistral's `sliding_window`; `None`: all of them).
    pub sliding_window: Option<usize>,
}

impl ModelConfig {
    /// Reads and checks `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(&text, &path)
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
        let rope_scaling = RopeScaling::parse(value.get("rope_scaling")).map_err(invalid)?;
        let sliding_window = sliding_window_of(&value, architecture).map_err(invalid)?;
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
            rope_theta: float("rope_theta", 10_000.0),
            rope_scaling,
            tie_word_embeddings: value
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_position_embeddings: value
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map_or(4096, |v| v as usize),
            attention_bias: value
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(architecture == Architecture::Qwen2),
            eos_token_id: eos_of(&value),
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
            "torch_dtype": "float32",
        });
        if let Some(eos) = self.eos_token_id {
            value["eos_token_id"] = eos.into();
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
        let bias = if self.attention_bias { q + 2 * kv } else { 0 };
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

/// `eos_token_id` is an integer or a list (Llama 3); the first one ends generation.
fn eos_of(value: &Value) -> Option<u32> {
    match value.get("eos_token_id")? {
        Value::Number(n) => n.as_u64().map(|v| v as u32),
        Value::Array(a) => a.first().and_then(Value::as_u64).map(|v| v as u32),
        _ => None,
    }
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
