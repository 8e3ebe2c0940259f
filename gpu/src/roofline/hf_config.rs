//! A Hugging Face `config.json` read into the architecture the roofline needs: layer
//! count, widths, the attention kind (grouped-query or DeepSeek's multi-head latent
//! attention), the dense MLP and, for mixtures of experts, the routed and shared
//! experts. Errors name the field and the file.

use std::path::Path;

use serde::Deserialize;

use super::Precision;

/// What is wrong with a `config.json`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HfConfigError {
    /// The file cannot be read.
    #[error("{path}: cannot read: {message}")]
    Read {
        /// The file.
        path: String,
        /// The operating system's words.
        message: String,
    },
    /// Not JSON, or a field of the wrong type.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// serde_json's words (they name the field and line).
        message: String,
    },
    /// A field the architecture needs is absent.
    #[error("{path}: missing field `{field}` ({why})")]
    Missing {
        /// The file.
        path: String,
        /// The absent field.
        field: &'static str,
        /// What it is needed for.
        why: &'static str,
    },
    /// A field whose value cannot be right.
    #[error("{path}: field `{field}` = {value}: {why}")]
    Invalid {
        /// The file.
        path: String,
        /// The field.
        field: &'static str,
        /// Its value as written.
        value: String,
        /// What it must be.
        why: String,
    },
}

/// How a layer attends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// Multi-head, grouped-query or multi-query attention: `kv_heads` of `heads` (equal
    /// for MHA, 1 for MQA).
    Grouped {
        /// Query heads.
        heads: u64,
        /// Key/value heads.
        kv_heads: u64,
        /// Elements per head.
        head_dim: u64,
        /// The q, k and v projections carry a bias (Qwen2).
        qkv_bias: bool,
    },
    /// DeepSeek's multi-head latent attention: K and V are decompressed from one cached
    /// latent of `kv_lora_rank` elements plus a shared RoPE key of `qk_rope_head_dim`.
    Latent {
        /// Query heads.
        heads: u64,
        /// Rank of the query compression; `None`: queries projected directly.
        q_lora_rank: Option<u64>,
        /// Rank of the KV latent (what is cached, with the RoPE key).
        kv_lora_rank: u64,
        /// Per-head query/key elements without position encoding.
        qk_nope_head_dim: u64,
        /// Per-head query elements with RoPE; the RoPE key is shared by all heads.
        qk_rope_head_dim: u64,
        /// Per-head value elements.
        v_head_dim: u64,
    },
}

/// Routed and shared experts of a mixture-of-experts model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    /// Routed experts per MoE layer.
    pub routed: u64,
    /// Routed experts each token goes to.
    pub per_token: u64,
    /// Intermediate width of one routed expert (SwiGLU: gate, up and down matrices).
    pub intermediate: u64,
    /// Intermediate width of all shared experts together (0: none).
    pub shared_intermediate: u64,
    /// The first layers that keep a dense MLP (DeepSeek's `first_k_dense_replace`).
    pub dense_layers: u64,
}

/// The architecture of a decoder-only transformer, as the roofline reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Architecture {
    /// `model_type` as written (`llama`, `qwen2`, `mixtral`, `deepseek_v3`, …).
    pub model_type: String,
    /// Residual stream width.
    pub hidden_size: u64,
    /// Decoder layers.
    pub layers: u64,
    /// Vocabulary size (embedding and LM head rows).
    pub vocab_size: u64,
    /// The LM head shares the embedding's weights.
    pub tie_word_embeddings: bool,
    /// Attention of every layer.
    pub attention: Attention,
    /// Intermediate width of a dense SwiGLU MLP (the dense layers of a MoE model).
    pub dense_intermediate: u64,
    /// Experts, if this is a MoE model.
    pub experts: Option<Experts>,
    /// The weight format the checkpoint ships in, from its `quantization_config`
    /// (`quant_method: "fp8"`, or ModelOpt's `quant_algo: "FP8"` / `"NVFP4"`); `None`:
    /// unquantized (BF16/FP16).
    pub checkpoint_precision: Option<Precision>,
}

/// The part of `quantization_config` that says the weights' format.
#[derive(Debug, Deserialize)]
struct RawQuantization {
    quant_method: Option<String>,
    quant_algo: Option<String>,
}

/// The fields read from `config.json`; everything else in the file is ignored (configs
/// carry many keys about rope scaling, token ids and the like that cost nothing).
#[derive(Debug, Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    hidden_size: Option<u64>,
    num_hidden_layers: Option<u64>,
    vocab_size: Option<u64>,
    num_attention_heads: Option<u64>,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    intermediate_size: Option<u64>,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    // Multi-head latent attention (DeepSeek-V2/V3).
    q_lora_rank: Option<u64>,
    kv_lora_rank: Option<u64>,
    qk_nope_head_dim: Option<u64>,
    qk_rope_head_dim: Option<u64>,
    v_head_dim: Option<u64>,
    // Experts: Mixtral says num_local_experts, DeepSeek n_routed_experts, Qwen-MoE
    // num_experts.
    num_local_experts: Option<u64>,
    n_routed_experts: Option<u64>,
    num_experts: Option<u64>,
    num_experts_per_tok: Option<u64>,
    moe_intermediate_size: Option<u64>,
    n_shared_experts: Option<u64>,
    shared_expert_intermediate_size: Option<u64>,
    first_k_dense_replace: Option<u64>,
    moe_layer_freq: Option<u64>,
    quantization_config: Option<RawQuantization>,
}

impl Architecture {
    /// Reads and checks `path`.
    pub fn from_file(path: &Path) -> Result<Architecture, HfConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| HfConfigError::Read {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        Architecture::from_json(&text, &shown)
    }

    /// Parses config text; `path` is only used in errors.
    pub fn from_json(text: &str, path: &str) -> Result<Architecture, HfConfigError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| HfConfigError::Parse {
            path: path.to_string(),
            message: e.to_string(),
        })?;
        Reader { path, raw: &raw }.architecture()
    }
}

struct Reader<'a> {
    path: &'a str,
    raw: &'a RawConfig,
}

impl Reader<'_> {
    fn need(
        &self,
        value: Option<u64>,
        field: &'static str,
        why: &'static str,
    ) -> Result<u64, HfConfigError> {
        let v = value.ok_or(HfConfigError::Missing {
            path: self.path.to_string(),
            field,
            why,
        })?;
        if v == 0 {
            return Err(self.invalid(field, v, "must be at least 1".into()));
        }
        Ok(v)
    }

    fn invalid(&self, field: &'static str, value: u64, why: String) -> HfConfigError {
        HfConfigError::Invalid {
            path: self.path.to_string(),
            field,
            value: value.to_string(),
            why,
        }
    }

    fn architecture(&self) -> Result<Architecture, HfConfigError> {
        let r = self.raw;
        let model_type = r.model_type.clone().unwrap_or_default();
        let hidden_size = self.need(r.hidden_size, "hidden_size", "residual width")?;
        let layers = self.need(r.num_hidden_layers, "num_hidden_layers", "layer count")?;
        let vocab_size = self.need(r.vocab_size, "vocab_size", "embedding and LM head")?;
        let heads = self.need(
            r.num_attention_heads,
            "num_attention_heads",
            "attention width",
        )?;
        let attention = if r.kv_lora_rank.is_some() {
            self.latent(heads)?
        } else {
            self.grouped(heads, hidden_size, &model_type)?
        };
        let experts = self.experts(layers)?;
        // A MoE model without dense layers needs no dense width (Mixtral's
        // `intermediate_size` is its experts').
        let dense_intermediate = match experts {
            Some(e) if e.dense_layers == 0 => 0,
            Some(_) => self.need(
                r.intermediate_size,
                "intermediate_size",
                "the dense MLP of the first_k_dense_replace layers",
            )?,
            None => self.need(r.intermediate_size, "intermediate_size", "the MLP width")?,
        };
        let checkpoint_precision = r.quantization_config.as_ref().and_then(|q| {
            let algo = q.quant_algo.as_deref().unwrap_or_default();
            match (q.quant_method.as_deref().unwrap_or_default(), algo) {
                ("fp8", _) => Some(Precision::Fp8),
                (_, a) if a.eq_ignore_ascii_case("fp8") => Some(Precision::Fp8),
                (_, a) if a.eq_ignore_ascii_case("nvfp4") => Some(Precision::Nvfp4),
                _ => None,
            }
        });
        Ok(Architecture {
            checkpoint_precision,
            model_type,
            hidden_size,
            layers,
            vocab_size,
            tie_word_embeddings: r.tie_word_embeddings,
            attention,
            dense_intermediate,
            experts,
        })
    }

    fn grouped(
        &self,
        heads: u64,
        hidden_size: u64,
        model_type: &str,
    ) -> Result<Attention, HfConfigError> {
        let r = self.raw;
        // Absent num_key_value_heads means MHA, as transformers reads it.
        let kv_heads = match r.num_key_value_heads {
            Some(_) => self.need(
                r.num_key_value_heads,
                "num_key_value_heads",
                "KV heads per layer",
            )?,
            None => heads,
        };
        if !heads.is_multiple_of(kv_heads) {
            return Err(self.invalid(
                "num_key_value_heads",
                kv_heads,
                format!("must divide num_attention_heads = {heads}"),
            ));
        }
        let head_dim = match r.head_dim {
            Some(_) => self.need(r.head_dim, "head_dim", "elements per head")?,
            None if hidden_size.is_multiple_of(heads) => hidden_size / heads,
            None => {
                return Err(self.invalid(
                    "num_attention_heads",
                    heads,
                    format!("does not divide hidden_size = {hidden_size} and there is no head_dim"),
                ));
            }
        };
        // Qwen2 always has q/k/v biases and its config does not say so.
        let qkv_bias = r.attention_bias.unwrap_or(model_type == "qwen2");
        Ok(Attention::Grouped {
            heads,
            kv_heads,
            head_dim,
            qkv_bias,
        })
    }

    fn latent(&self, heads: u64) -> Result<Attention, HfConfigError> {
        let r = self.raw;
        let why = "multi-head latent attention (kv_lora_rank is set)";
        Ok(Attention::Latent {
            heads,
            // DeepSeek-V2-Lite writes `"q_lora_rank": null`: queries projected directly.
            q_lora_rank: match r.q_lora_rank {
                Some(_) => Some(self.need(r.q_lora_rank, "q_lora_rank", why)?),
                None => None,
            },
            kv_lora_rank: self.need(r.kv_lora_rank, "kv_lora_rank", why)?,
            qk_nope_head_dim: self.need(r.qk_nope_head_dim, "qk_nope_head_dim", why)?,
            qk_rope_head_dim: self.need(r.qk_rope_head_dim, "qk_rope_head_dim", why)?,
            v_head_dim: self.need(r.v_head_dim, "v_head_dim", why)?,
        })
    }

    fn experts(&self, layers: u64) -> Result<Option<Experts>, HfConfigError> {
        let r = self.raw;
        let (routed, field) = match (r.n_routed_experts, r.num_local_experts, r.num_experts) {
            (Some(n), _, _) => (n, "n_routed_experts"),
            (None, Some(n), _) => (n, "num_local_experts"),
            (None, None, Some(n)) => (n, "num_experts"),
            (None, None, None) => return Ok(None),
        };
        let routed = self.need(Some(routed), field, "routed experts")?;
        let why = "a mixture of experts needs it";
        let per_token = self.need(r.num_experts_per_tok, "num_experts_per_tok", why)?;
        if per_token > routed {
            return Err(self.invalid(
                "num_experts_per_tok",
                per_token,
                format!("exceeds the {routed} routed experts"),
            ));
        }
        // Mixtral's experts are as wide as its intermediate_size; DeepSeek and Qwen-MoE
        // give a separate moe_intermediate_size.
        let intermediate = match r.moe_intermediate_size {
            Some(_) => self.need(r.moe_intermediate_size, "moe_intermediate_size", why)?,
            None => self.need(r.intermediate_size, "intermediate_size", why)?,
        };
        let shared_intermediate = match (r.n_shared_experts, r.shared_expert_intermediate_size) {
            (Some(n), _) => n * intermediate,
            (None, Some(width)) => width,
            (None, None) => 0,
        };
        if r.moe_layer_freq.is_some_and(|f| f != 1) {
            return Err(self.invalid(
                "moe_layer_freq",
                r.moe_layer_freq.unwrap_or_default(),
                "only 1 (every layer after the dense ones) is modeled".into(),
            ));
        }
        let dense_layers = r.first_k_dense_replace.unwrap_or(0);
        if dense_layers > layers {
            return Err(self.invalid(
                "first_k_dense_replace",
                dense_layers,
                format!("exceeds num_hidden_layers = {layers}"),
            ));
        }
        Ok(Some(Experts {
            routed,
            per_token,
            intermediate,
            shared_intermediate,
            dense_layers,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str = r#"{"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,
        "vocab_size":128256,"num_attention_heads":32,"num_key_value_heads":8,
        "intermediate_size":14336,"rope_theta":500000.0}"#;

    #[test]
    fn a_llama_config_reads_as_grouped_query_attention() {
        let a = Architecture::from_json(LLAMA, "llama.json").unwrap();
        assert_eq!(
            a.attention,
            Attention::Grouped {
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                qkv_bias: false
            }
        );
        assert_eq!(a.experts, None);
        assert!(!a.tie_word_embeddings);
        assert_eq!(a.checkpoint_precision, None);
    }

    #[test]
    fn a_quantized_checkpoint_says_its_weight_format() {
        let with = |q: &str| {
            let text = LLAMA.replace(
                "\"rope_theta\"",
                &format!("\"quantization_config\": {q}, \"rope_theta\""),
            );
            Architecture::from_json(&text, "c.json")
                .unwrap()
                .checkpoint_precision
        };
        assert_eq!(
            with(r#"{"quant_method": "fp8", "weight_block_size": [128, 128]}"#),
            Some(Precision::Fp8)
        );
        assert_eq!(
            with(r#"{"quant_method": "modelopt", "quant_algo": "NVFP4"}"#),
            Some(Precision::Nvfp4)
        );
        assert_eq!(
            with(r#"{"quant_method": "modelopt", "quant_algo": "FP8"}"#),
            Some(Precision::Fp8)
        );
        assert_eq!(with(r#"{"quant_method": "awq", "bits": 4}"#), None);
    }

    #[test]
    fn a_missing_field_is_named_with_the_file() {
        let text = LLAMA.replace(r#""num_hidden_layers":32,"#, "");
        let err = Architecture::from_json(&text, "dir/config.json").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("dir/config.json"), "{msg}");
        assert!(msg.contains("`num_hidden_layers`"), "{msg}");
        let text = LLAMA.replace(r#""intermediate_size":14336,"#, "");
        let msg = Architecture::from_json(&text, "c.json")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`intermediate_size`"), "{msg}");
    }

    #[test]
    fn a_wrong_type_or_impossible_value_is_named() {
        let text = LLAMA.replace(r#""hidden_size":4096"#, r#""hidden_size":"big""#);
        let msg = Architecture::from_json(&text, "c.json")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("c.json") && msg.contains("invalid type"),
            "{msg}"
        );
        let text = LLAMA.replace(r#""num_key_value_heads":8"#, r#""num_key_value_heads":5"#);
        let msg = Architecture::from_json(&text, "c.json")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`num_key_value_heads` = 5"), "{msg}");
        let text = LLAMA.replace(r#""vocab_size":128256"#, r#""vocab_size":0"#);
        let msg = Architecture::from_json(&text, "c.json")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`vocab_size` = 0"), "{msg}");
    }

    #[test]
    fn an_expert_model_without_top_k_is_refused_naming_it() {
        let text = r#"{"hidden_size":4096,"num_hidden_layers":32,"vocab_size":32000,
            "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
            "num_local_experts":8}"#;
        let msg = Architecture::from_json(text, "mixtral.json")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`num_experts_per_tok`"), "{msg}");
    }

    #[test]
    fn latent_attention_needs_every_latent_width() {
        let text = r#"{"hidden_size":7168,"num_hidden_layers":61,"vocab_size":129280,
            "num_attention_heads":128,"intermediate_size":18432,"kv_lora_rank":512,
            "qk_nope_head_dim":128,"qk_rope_head_dim":64}"#;
        let msg = Architecture::from_json(text, "ds.json")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`v_head_dim`"), "{msg}");
    }
}
