//! Writes a tiny random model into a directory (`config.json`, `model.safetensors` with
//! seeded weights, a small byte-level BPE `tokenizer.json`, `tokenizer_config.json` with
//! a chat template), so tests and users need no download.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use super::config::{Activation, Architecture, GenerationDefaults, ModelConfig};
use super::error::{ModelError, Result};
use super::rope::RopeScaling;

/// The shape and seed of a random model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InitOptions {
    /// Llama (no biases) or Qwen2 (Q/K/V biases).
    pub architecture: Architecture,
    /// Transformer blocks.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Vocabulary size (at least 260: 256 bytes, 3 special tokens, one merge).
    pub vocab: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Seed of every weight.
    pub seed: u64,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            architecture: Architecture::Llama,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            vocab: 512,
            intermediate: 128,
            seed: 0,
        }
    }
}

/// The special tokens, right after the 256 byte tokens.
const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A ChatML template in the Jinja form Hugging Face tokenizer configs carry.
const CHATML_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Text the BPE merges are learned from: any English prose gives merges that make
/// everyday prompts a few tokens shorter than bytes.
const MERGE_CORPUS: &str = "the quick brown fox jumps over the lazy dog. \
a model reads the tokens of a prompt and writes the next token, one at a time. \
the cache keeps the keys and the values of every token the model has seen, \
so the next step reads them instead of computing them again. \
blocks of the cache are handed out by the manager and returned when a request ends. \
hello world, this is a small tokenizer for a small random model that runs on the cpu. \
when the prompt is long the server splits it into chunks and runs them in turn. \
the answer is written to the user as soon as each token is ready. \
there are many requests at once, and each one has its own table of blocks. \
what is the time? it is the time to test the model and to measure how fast it runs.";

/// Writes a random model of shape `options` into `dir` (created if absent) and
/// returns its config.
pub fn write_random_model(dir: &Path, options: &InitOptions) -> Result<ModelConfig> {
    let config_path = dir.join("config.json");
    let invalid = |message: String| ModelError::InvalidConfig {
        path: config_path.clone(),
        message,
    };
    if options.layers == 0 || options.hidden == 0 || options.intermediate == 0 {
        return Err(invalid(
            "layers, hidden and intermediate must be positive".into(),
        ));
    }
    if options.heads == 0
        || options.kv_heads == 0
        || !options.heads.is_multiple_of(options.kv_heads)
    {
        return Err(invalid(format!(
            "heads {} must be a positive multiple of kv heads {}",
            options.heads, options.kv_heads
        )));
    }
    if !options.hidden.is_multiple_of(options.heads)
        || !(options.hidden / options.heads).is_multiple_of(2)
    {
        return Err(invalid(format!(
            "hidden {} must split into {} heads of even width",
            options.hidden, options.heads
        )));
    }
    let first_merge = 256 + SPECIAL_TOKENS.len();
    if options.vocab <= first_merge {
        return Err(invalid(format!(
            "vocab {} must exceed {first_merge} (256 bytes and {} special tokens)",
            options.vocab,
            SPECIAL_TOKENS.len()
        )));
    }
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let config = ModelConfig {
        architecture: options.architecture,
        hidden_size: options.hidden,
        intermediate_size: options.intermediate,
        num_hidden_layers: options.layers,
        num_attention_heads: options.heads,
        num_key_value_heads: options.kv_heads,
        head_dim: options.hidden / options.heads,
        vocab_size: options.vocab,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::None,
        sliding_window: None,
        tie_word_embeddings: false,
        max_position_embeddings: 4096,
        attention_bias: options.architecture == Architecture::Qwen2,
        mlp_bias: false,
        hidden_act: Activation::Silu,
        eos_token_ids: vec![256],
        generation: GenerationDefaults::default(),
    };
    write(&config_path, config.to_json().as_bytes())?;
    write_random_weights(dir, &config, options.seed)?;
    write(
        &dir.join("tokenizer.json"),
        tokenizer_json(options.vocab).as_bytes(),
    )?;
    let tokenizer_config = json!({
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|endoftext|>",
        "bos_token": null,
    });
    write(
        &dir.join("tokenizer_config.json"),
        (serde_json::to_string_pretty(&tokenizer_config).unwrap_or_default() + "\n").as_bytes(),
    )?;
    Ok(config)
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Seeded weights in the Hugging Face layout, f32. Projections are uniform with a
/// standard deviation of `1 / sqrt(fan_in)`, which keeps activations of order one
/// through the layers; norm scales sit near one so that a forward which skipped one
/// would still differ from one that applies it.
/// Writes seeded weights for `config` to `DIR/model.safetensors`: every tensor the config
/// asks for, biases included (a test edits `config.json`, then rewrites the weights).
pub fn write_random_weights(dir: &Path, config: &ModelConfig, seed: u64) -> Result<()> {
    write_weights(&dir.join("model.safetensors"), config, seed)
}

fn write_weights(path: &Path, config: &ModelConfig, seed: u64) -> Result<()> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let mut add = |name: String, shape: Vec<usize>, center: f32, spread: f32| {
        let count: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(count * 4);
        for _ in 0..count {
            let value = center + spread * (rng.random::<f32>() * 2.0 - 1.0);
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        tensors.insert(name, (shape, bytes));
    };
    // Uniform on [-a, a] has standard deviation a / sqrt(3).
    let spread = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let h = config.hidden_size;
    let q = config.num_attention_heads * config.head_dim;
    let kv = config.num_key_value_heads * config.head_dim;
    let i = config.intermediate_size;
    add(
        "model.embed_tokens.weight".into(),
        vec![config.vocab_size, h],
        0.0,
        1.0,
    );
    for n in 0..config.num_hidden_layers {
        let p = format!("model.layers.{n}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 1.0, 0.1);
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![q, h],
            0.0,
            spread(h),
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv, h],
            0.0,
            spread(h),
        );
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv, h],
            0.0,
            spread(h),
        );
        if config.attention_bias {
            add(format!("{p}.self_attn.q_proj.bias"), vec![q], 0.0, 0.5);
            add(format!("{p}.self_attn.k_proj.bias"), vec![kv], 0.0, 0.5);
            add(format!("{p}.self_attn.v_proj.bias"), vec![kv], 0.0, 0.5);
        }
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, q],
            0.0,
            spread(q),
        );
        if config.o_proj_bias() {
            add(format!("{p}.self_attn.o_proj.bias"), vec![h], 0.0, 0.5);
        }
        if config.mlp_bias {
            add(format!("{p}.mlp.gate_proj.bias"), vec![i], 0.0, 0.5);
            add(format!("{p}.mlp.up_proj.bias"), vec![i], 0.0, 0.5);
            add(format!("{p}.mlp.down_proj.bias"), vec![h], 0.0, 0.5);
        }
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            1.0,
            0.1,
        );
        add(
            format!("{p}.mlp.gate_proj.weight"),
            vec![i, h],
            0.0,
            spread(h),
        );
        add(
            format!("{p}.mlp.up_proj.weight"),
            vec![i, h],
            0.0,
            spread(h),
        );
        add(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, i],
            0.0,
            spread(i),
        );
    }
    add("model.norm.weight".into(), vec![h], 1.0, 0.1);
    add(
        "lm_head.weight".into(),
        vec![config.vocab_size, h],
        0.0,
        spread(h),
    );
    let mut views = Vec::with_capacity(tensors.len());
    for (name, (shape, bytes)) in &tensors {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                .map_err(|e| ModelError::Safetensors {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
        views.push((name.as_str(), view));
    }
    safetensors::serialize_to_file(views, None, path).map_err(|e| ModelError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes
/// stand for themselves, the rest take the code points from 256 up, so every token is
/// a string without spaces or control characters.
pub(super) fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for byte in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&byte)
            || (0xA1..=0xAC).contains(&byte)
            || (0xAE..=0xFF).contains(&byte);
        table[byte as usize] = if printable {
            char::from(byte)
        } else {
            let c = char::from_u32(next).unwrap_or('?');
            next += 1;
            c
        };
    }
    table
}

/// A byte-level BPE `tokenizer.json` of exactly `vocab` tokens: 256 bytes, the special
/// tokens, merges learned from [`MERGE_CORPUS`], and `<unused_N>` fillers when the
/// corpus runs out of pairs worth merging.
fn tokenizer_json(vocab: usize) -> String {
    let table = byte_to_char();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    tokens.extend(SPECIAL_TOKENS.iter().map(|s| s.to_string()));
    let merges = learn_merges(&table, vocab - tokens.len());
    // Two merges can spell the same string ("t"+"he", "th"+"e"): it gets one id.
    let mut seen: std::collections::HashSet<String> = tokens.iter().cloned().collect();
    for (a, b) in &merges {
        let joined = format!("{a}{b}");
        if seen.insert(joined.clone()) {
            tokens.push(joined);
        }
    }
    let mut filler = 0;
    while tokens.len() < vocab {
        tokens.push(format!("<unused_{filler}>"));
        filler += 1;
    }
    let vocab_map: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), json!(id)))
        .collect();
    let added: Vec<serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": 256 + i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_map, "merges": merges,
        },
    });
    serde_json::to_string(&tokenizer).unwrap_or_default()
}

/// Up to `limit` merges, most frequent pair first (ties by the pair's text, so the
/// result is the same on every machine), over the corpus split into words with the
/// leading space attached as GPT-2's pre-tokenizer does.
fn learn_merges(table: &[char; 256], limit: usize) -> Vec<(String, String)> {
    let mut word_counts: HashMap<Vec<String>, usize> = HashMap::new();
    for (index, word) in MERGE_CORPUS
        .split(' ')
        .filter(|w| !w.is_empty())
        .enumerate()
    {
        let text = if index == 0 {
            word.to_string()
        } else {
            format!(" {word}")
        };
        let symbols: Vec<String> = text
            .bytes()
            .map(|b| table[b as usize].to_string())
            .collect();
        *word_counts.entry(symbols).or_default() += 1;
    }
    let mut words: Vec<(Vec<String>, usize)> = word_counts.into_iter().collect();
    words.sort();
    let mut merges = Vec::new();
    while merges.len() < limit {
        let mut pair_counts: BTreeMap<(String, String), usize> = BTreeMap::new();
        for (symbols, count) in &words {
            for pair in symbols.windows(2) {
                *pair_counts
                    .entry((pair[0].clone(), pair[1].clone()))
                    .or_default() += count;
            }
        }
        let Some((best, count)) = pair_counts
            .into_iter()
            .max_by(|(pa, ca), (pb, cb)| ca.cmp(cb).then(pb.cmp(pa)))
        else {
            break;
        };
        if count < 2 {
            break;
        }
        let joined = format!("{}{}", best.0, best.1);
        for (symbols, _) in &mut words {
            let mut merged = Vec::with_capacity(symbols.len());
            let mut i = 0;
            while i < symbols.len() {
                if i + 1 < symbols.len() && symbols[i] == best.0 && symbols[i + 1] == best.1 {
                    merged.push(joined.clone());
                    i += 2;
                } else {
                    merged.push(symbols[i].clone());
                    i += 1;
                }
            }
            *symbols = merged;
        }
        merges.push(best);
    }
    merges
}
