//! The paged forward against the dense reference, sampling, and bad model directories.

use std::path::{Path, PathBuf};

use super::*;

/// Paged and dense logits agree to this (absolute, logits of order one).
const TOLERANCE: f32 = 1e-4;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("lockstep-model-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny(name: &str, options: InitOptions) -> (TempDir, Model) {
    let dir = TempDir::new(name);
    write_random_model(&dir.0, &options).expect("init");
    let model = Model::load(&dir.0).expect("load");
    (dir, model)
}

fn llama(name: &str) -> (TempDir, Model) {
    tiny(
        name,
        InitOptions {
            seed: 7,
            ..InitOptions::default()
        },
    )
}

/// Deterministic pseudo-random token ids below `vocab`.
fn tokens(count: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..count as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 40_503)) % vocab as u32)
        .collect()
}

/// Logits of the dense reference after reading all of `sequence` in one forward.
fn dense_logits(model: &Model, sequence: &[u32]) -> Vec<f32> {
    let mut dense = [DenseSequence::new(model)];
    forward_dense(model, &mut dense, &[sequence])
        .expect("dense")
        .remove(0)
}

fn assert_close(paged: &[f32], dense: &[f32], what: &str) {
    assert_eq!(paged.len(), dense.len(), "{what}: lengths");
    let worst = paged
        .iter()
        .zip(dense)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= TOLERANCE,
        "{what}: paged differs from dense by {worst}"
    );
}

fn entry<'a>(table: &'a [u32], start: usize, ids: &'a [u32]) -> BatchEntry<'a> {
    BatchEntry {
        block_table: table,
        start_position: start,
        token_ids: ids,
        dummy: false,
    }
}

#[test]
fn chunked_prefill_and_decode_match_dense() {
    let (_dir, model) = llama("chunked");
    let vocab = model.config.vocab_size;
    let mut cache = model.paged_cache(16, 4).unwrap();
    // Non-contiguous, out-of-order blocks: the table alone decides where tokens live.
    let table = [7, 2, 9, 0, 13, 5, 11, 3];
    let prompt = tokens(23, 1, vocab);
    let mut start = 0;
    for chunk in [5usize, 6, 12] {
        let ids = &prompt[start..start + chunk];
        let logits = forward_paged(&model, &mut cache, &[entry(&table, start, ids)]).unwrap();
        start += chunk;
        assert_close(
            &logits[0],
            &dense_logits(&model, &prompt[..start]),
            "prefill chunk",
        );
    }
    let mut sequence = prompt.clone();
    for step in 0..5 {
        let next = tokens(1, 100 + step, vocab);
        let logits =
            forward_paged(&model, &mut cache, &[entry(&table, sequence.len(), &next)]).unwrap();
        sequence.extend_from_slice(&next);
        assert_close(&logits[0], &dense_logits(&model, &sequence), "decode");
    }
}

#[test]
fn block_placement_does_not_change_logits() {
    let (_dir, model) = llama("placement");
    let prompt = tokens(19, 2, model.config.vocab_size);
    let mut results = Vec::new();
    for table in [[0u32, 1, 2, 3, 4], [9, 4, 12, 1, 6]] {
        let mut cache = model.paged_cache(16, 4).unwrap();
        let first = forward_paged(&model, &mut cache, &[entry(&table, 0, &prompt[..10])]).unwrap();
        let second =
            forward_paged(&model, &mut cache, &[entry(&table, 10, &prompt[10..])]).unwrap();
        results.push((first.concat(), second.concat()));
    }
    assert_close(&results[0].0, &results[1].0, "first chunk");
    assert_close(&results[0].1, &results[1].1, "second chunk");
    assert_close(
        &results[1].1,
        &dense_logits(&model, &prompt),
        "against dense",
    );
}

#[test]
fn prefix_reuse_reads_shared_blocks() {
    let (_dir, model) = llama("prefix");
    let vocab = model.config.vocab_size;
    let mut cache = model.paged_cache(16, 4).unwrap();
    let prefix = tokens(8, 3, vocab);
    let mut first: Vec<u32> = prefix.clone();
    first.extend(tokens(5, 4, vocab));
    let first_table = [3, 8, 1, 10];
    forward_paged(&model, &mut cache, &[entry(&first_table, 0, &first)]).unwrap();
    // The second request shares the two full blocks of the common prefix and computes
    // only its own suffix, reading the prefix's K/V from the first request's blocks.
    let mut second: Vec<u32> = prefix.clone();
    second.extend(tokens(6, 5, vocab));
    let second_table = [3, 8, 5, 6];
    let logits =
        forward_paged(&model, &mut cache, &[entry(&second_table, 8, &second[8..])]).unwrap();
    assert_close(
        &logits[0],
        &dense_logits(&model, &second),
        "reusing request",
    );
    // The sharer wrote only into its own blocks: the first request decodes as before.
    let next = tokens(1, 6, vocab);
    let logits = forward_paged(
        &model,
        &mut cache,
        &[entry(&first_table, first.len(), &next)],
    )
    .unwrap();
    first.extend_from_slice(&next);
    assert_close(
        &logits[0],
        &dense_logits(&model, &first),
        "original request",
    );
}

#[test]
fn mixed_batch_of_prefill_chunks_and_decodes_matches_dense() {
    let (_dir, model) = llama("mixed");
    let vocab = model.config.vocab_size;
    let mut cache = model.paged_cache(32, 4).unwrap();
    let (table_a, table_b, table_c) = ([0u32, 5, 9, 14], [2u32, 7, 11, 1], [20u32, 3, 17, 30]);
    let prompt_a = tokens(9, 7, vocab);
    let prompt_b = tokens(14, 8, vocab);
    forward_paged(&model, &mut cache, &[entry(&table_a, 0, &prompt_a)]).unwrap();
    forward_paged(&model, &mut cache, &[entry(&table_b, 0, &prompt_b[..6])]).unwrap();
    // One forward: A decodes, B prefills its second chunk, C prefills its first.
    let decode_a = tokens(1, 9, vocab);
    let prompt_c = tokens(7, 10, vocab);
    let logits = forward_paged(
        &model,
        &mut cache,
        &[
            entry(&table_a, 9, &decode_a),
            entry(&table_b, 6, &prompt_b[6..]),
            entry(&table_c, 0, &prompt_c),
        ],
    )
    .unwrap();
    let mut full_a = prompt_a.clone();
    full_a.extend_from_slice(&decode_a);
    assert_close(&logits[0], &dense_logits(&model, &full_a), "decode entry");
    assert_close(
        &logits[1],
        &dense_logits(&model, &prompt_b),
        "prefill chunk entry",
    );
    assert_close(
        &logits[2],
        &dense_logits(&model, &prompt_c),
        "first chunk entry",
    );
}

#[test]
fn dummy_entry_writes_nothing_a_real_request_reads() {
    let (_dir, model) = llama("dummy");
    let vocab = model.config.vocab_size;
    let mut cache = model.paged_cache(8, 4).unwrap();
    let table = [2u32, 4, 6];
    let mut sequence = tokens(6, 11, vocab);
    forward_paged(&model, &mut cache, &[entry(&table, 0, &sequence)]).unwrap();
    // The dummy names the real request's blocks and positions it has cached and is
    // about to fill; a dummy that wrote K/V would corrupt both.
    let garbage = tokens(5, 12, vocab);
    let next = tokens(1, 13, vocab);
    let logits = forward_paged(
        &model,
        &mut cache,
        &[
            BatchEntry {
                block_table: &table,
                start_position: 3,
                token_ids: &garbage,
                dummy: true,
            },
            entry(&table, 6, &next),
        ],
    )
    .unwrap();
    sequence.extend_from_slice(&next);
    assert_close(
        &logits[1],
        &dense_logits(&model, &sequence),
        "real entry beside a dummy",
    );
    let next = tokens(1, 14, vocab);
    let logits =
        forward_paged(&model, &mut cache, &[entry(&table, sequence.len(), &next)]).unwrap();
    sequence.extend_from_slice(&next);
    assert_close(
        &logits[0],
        &dense_logits(&model, &sequence),
        "real entry after a dummy",
    );
}

#[test]
fn qwen2_biases_are_loaded_and_applied() {
    let (dir, model) = tiny(
        "qwen2",
        InitOptions {
            architecture: Architecture::Qwen2,
            seed: 3,
            ..InitOptions::default()
        },
    );
    assert_eq!(model.config.architecture, Architecture::Qwen2);
    assert!(model.weights.layers[0].q_proj.bias.is_some());
    let vocab = model.config.vocab_size;
    let prompt = tokens(13, 15, vocab);
    let mut cache = model.paged_cache(8, 4).unwrap();
    let table = [5u32, 1, 3, 7];
    forward_paged(&model, &mut cache, &[entry(&table, 0, &prompt[..7])]).unwrap();
    let logits = forward_paged(&model, &mut cache, &[entry(&table, 7, &prompt[7..])]).unwrap();
    let with_bias = dense_logits(&model, &prompt);
    assert_close(&logits[0], &with_bias, "qwen2 paged");
    // The biases matter: the same weights without them give other logits.
    let mut unbiased = model.clone();
    for layer in &mut unbiased.weights.layers {
        layer.q_proj.bias = None;
        layer.k_proj.bias = None;
        layer.v_proj.bias = None;
    }
    let without = dense_logits(&unbiased, &prompt);
    let gap = with_bias
        .iter()
        .zip(&without)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(gap > 1e-2, "biases changed nothing ({gap})");
    // A Qwen2 directory without a bias tensor is an error naming it.
    let weights = dir.0.join("model.safetensors");
    drop_tensor(&weights, "model.layers.1.self_attn.k_proj.bias");
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(
        message.contains("model.layers.1.self_attn.k_proj.bias"),
        "{message}"
    );
}

#[test]
fn seeded_sampling_repeats_and_greedy_is_argmax() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
    let params = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        seed: 42,
    };
    let draw = |params: SamplingParams| -> Vec<u32> {
        let mut sampler = Sampler::new(params).unwrap();
        (0..32).map(|_| sampler.sample(&logits).unwrap()).collect()
    };
    assert_eq!(draw(params), draw(params), "same seed, same tokens");
    assert_ne!(draw(params), draw(SamplingParams { seed: 43, ..params }));
    let top = logits
        .iter()
        .enumerate()
        .fold(0, |best, (i, &l)| if l > logits[best] { i } else { best }) as u32;
    let greedy = draw(SamplingParams::default());
    assert!(greedy.iter().all(|&t| t == top));
    let top_one = draw(SamplingParams { top_k: 1, ..params });
    assert!(top_one.iter().all(|&t| t == top));
    // Top-k keeps only the k best; every draw is among them.
    let mut ranked: Vec<u32> = (0..50).collect();
    ranked.sort_by(|&a, &b| {
        logits[b as usize]
            .total_cmp(&logits[a as usize])
            .then(a.cmp(&b))
    });
    let top_three = draw(SamplingParams {
        top_k: 3,
        top_p: 1.0,
        ..params
    });
    assert!(
        top_three.iter().all(|t| ranked[..3].contains(t)),
        "{top_three:?}"
    );
    assert!(
        Sampler::new(SamplingParams {
            temperature: -1.0,
            ..params
        })
        .is_err()
    );
    assert!(
        Sampler::new(SamplingParams {
            top_p: 0.0,
            ..params
        })
        .is_err()
    );
}

#[test]
fn generated_tokenizer_round_trips_text() {
    let (dir, model) = llama("tokenizer");
    let tokenizer = TextTokenizer::load(&dir.0).unwrap();
    assert_eq!(tokenizer.vocab_size(), model.config.vocab_size);
    let text = "the model reads the tokens of a prompt: ünïcode ✓ 42";
    let ids = tokenizer.encode(text).unwrap();
    assert!(
        ids.len() < text.len(),
        "merges shorten text ({} ids)",
        ids.len()
    );
    assert!(ids.iter().all(|&t| (t as usize) < model.config.vocab_size));
    assert_eq!(tokenizer.decode(&ids).unwrap(), text);
    assert!(tokenizer.has_chat_template());
    let chat = tokenizer
        .encode(&tokenizer.chat_prompt("hi").unwrap())
        .unwrap();
    assert_eq!(Some(chat[0]), tokenizer.token_id("<|im_start|>"));
}

#[test]
fn bad_batches_are_errors() {
    let (_dir, model) = llama("badbatch");
    let mut cache = model.paged_cache(4, 4).unwrap();
    let ids = tokens(6, 1, model.config.vocab_size);
    let short = forward_paged(&model, &mut cache, &[entry(&[0], 0, &ids)]);
    assert!(short.unwrap_err().to_string().contains("covers 4 tokens"));
    let outside = forward_paged(&model, &mut cache, &[entry(&[0, 4], 0, &ids)]);
    assert!(outside.unwrap_err().to_string().contains("block id 4"));
    let unknown = [model.config.vocab_size as u32];
    let token = forward_paged(&model, &mut cache, &[entry(&[0], 0, &unknown)]);
    assert!(
        token
            .unwrap_err()
            .to_string()
            .contains("outside the vocabulary")
    );
}

/// A tensor to write: name, shape, raw little-endian bytes.
type RawTensor = (String, Vec<usize>, Vec<u8>);

/// Rewrites a safetensors file without one tensor.
fn drop_tensor(path: &Path, name: &str) {
    rewrite(path, |tensor, shape| (tensor != name).then_some(shape));
}

/// Rewrites a safetensors file, keeping each tensor with the shape `keep` returns.
fn rewrite(path: &Path, keep: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>) {
    let bytes = std::fs::read(path).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept: Vec<RawTensor> = Vec::new();
    for (name, view) in parsed.tensors() {
        if let Some(shape) = keep(&name, view.shape().to_vec()) {
            let count: usize = shape.iter().product();
            let data = view
                .data()
                .iter()
                .copied()
                .cycle()
                .take(count * 4)
                .collect();
            kept.push((name, shape, data));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
        .iter()
        .map(|(n, s, d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                .unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn bad_model_directories_name_the_file_and_tensor() {
    let dir = TempDir::new("baddir");
    write_random_model(&dir.0, &InitOptions::default()).unwrap();
    let config = dir.0.join("config.json");
    let weights = dir.0.join("model.safetensors");
    let original = std::fs::read_to_string(&config).unwrap();
    let original_weights = std::fs::read(&weights).unwrap();

    std::fs::rename(&config, dir.0.join("moved.json")).unwrap();
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(message.contains("config.json"), "{message}");
    std::fs::rename(dir.0.join("moved.json"), &config).unwrap();

    let gpt = original.replace("LlamaForCausalLM", "GPT2LMHeadModel");
    std::fs::write(&config, gpt).unwrap();
    let error = Model::load(&dir.0).unwrap_err();
    assert!(
        matches!(error, ModelError::UnsupportedArchitecture { .. }),
        "{error}"
    );
    let message = error.to_string();
    assert!(
        message.contains("config.json") && message.contains("GPT2LMHeadModel"),
        "{message}"
    );
    std::fs::write(&config, &original).unwrap();

    let wider = original.replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    assert_ne!(wider, original);
    std::fs::write(&config, wider).unwrap();
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(
        message.contains("model.safetensors")
            && message.contains("model.layers.0.mlp.gate_proj.weight")
            && message.contains("[128, 64]")
            && message.contains("[96, 64]"),
        "{message}"
    );
    std::fs::write(&config, &original).unwrap();

    drop_tensor(&weights, "model.layers.1.mlp.up_proj.weight");
    let error = Model::load(&dir.0).unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, ModelError::MissingTensor { .. })
            && message.contains("model.safetensors")
            && message.contains("model.layers.1.mlp.up_proj.weight"),
        "{message}"
    );
    std::fs::write(&weights, &original_weights).unwrap();

    rewrite(&weights, |name, shape| {
        Some(if name == "model.norm.weight" {
            vec![shape[0] + 1]
        } else {
            shape
        })
    });
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(message.contains("model.norm.weight"), "{message}");

    std::fs::write(&weights, b"not safetensors").unwrap();
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(message.contains("model.safetensors"), "{message}");

    std::fs::remove_file(&weights).unwrap();
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(message.contains("model.safetensors"), "{message}");
}

#[test]
fn tied_embeddings_need_no_lm_head() {
    let dir = TempDir::new("tied");
    write_random_model(&dir.0, &InitOptions::default()).unwrap();
    let config = dir.0.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let tied = text.replace(
        "\"tie_word_embeddings\": false",
        "\"tie_word_embeddings\": true",
    );
    assert_ne!(tied, text);
    std::fs::write(&config, tied).unwrap();
    drop_tensor(&dir.0.join("model.safetensors"), "lm_head.weight");
    let model = Model::load(&dir.0).unwrap();
    let gap = (&model.weights.lm_head.weight().unwrap() - &model.weights.embed_tokens)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(gap, 0.0, "the tied head is the embedding");
}

/// A scalar, f64 transformer written from the Llama/Qwen2 definitions with plain loops:
/// an independent check of the arithmetic the paged and dense forwards share (RMSNorm,
/// rotate-half RoPE, grouped-query causal attention, SwiGLU, biases).
/// `stretch` divides every position before rotation (linear `rope_scaling`, written as
/// position interpolation rather than as scaled frequencies).
fn scalar_reference_logits(model: &Model, sequence: &[u32], stretch: f64) -> Vec<f32> {
    let config = &model.config;
    let matrix = |t: &candle_core::Tensor| -> Vec<Vec<f64>> {
        t.to_vec2::<f32>()
            .unwrap()
            .into_iter()
            .map(|row| row.into_iter().map(f64::from).collect())
            .collect()
    };
    let vector = |t: &candle_core::Tensor| -> Vec<f64> {
        t.to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    // weight is [out, in]: y[o] = sum_i x[i] * w[o][i] + b[o].
    let linear = |l: &Linear, x: &[f64]| -> Vec<f64> {
        let w = matrix(&l.weight().unwrap());
        let mut y = match l.bias() {
            Some(b) => b.iter().map(|&v| f64::from(v)).collect(),
            None => vec![0.0; w.len()],
        };
        for (o, row) in w.iter().enumerate() {
            for (i, weight) in row.iter().enumerate() {
                y[o] += x[i] * weight;
            }
        }
        y
    };
    let norm = |x: &[f64], w: &candle_core::Tensor| -> Vec<f64> {
        let scale = vector(w);
        let rms =
            (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + config.rms_norm_eps).sqrt();
        x.iter().zip(&scale).map(|(v, s)| v / rms * s).collect()
    };
    let (hd, heads, group) = (
        config.head_dim,
        config.num_attention_heads,
        config.group_size(),
    );
    let rope = |v: &mut [f64], position: usize| {
        for head in v.chunks_mut(hd) {
            for i in 0..hd / 2 {
                let angle =
                    position as f64 / stretch * config.rope_theta.powf(-2.0 * i as f64 / hd as f64);
                let (a, b) = (head[i], head[i + hd / 2]);
                head[i] = a * angle.cos() - b * angle.sin();
                head[i + hd / 2] = b * angle.cos() + a * angle.sin();
            }
        }
    };
    let embed = matrix(&model.weights.embed_tokens);
    let mut xs: Vec<Vec<f64>> = sequence
        .iter()
        .map(|&t| embed[t as usize].clone())
        .collect();
    for layer in &model.weights.layers {
        let hs: Vec<Vec<f64>> = xs.iter().map(|x| norm(x, &layer.input_layernorm)).collect();
        let mut qs: Vec<Vec<f64>> = hs.iter().map(|h| linear(&layer.q_proj, h)).collect();
        let mut ks: Vec<Vec<f64>> = hs.iter().map(|h| linear(&layer.k_proj, h)).collect();
        let vs: Vec<Vec<f64>> = hs.iter().map(|h| linear(&layer.v_proj, h)).collect();
        for p in 0..xs.len() {
            rope(&mut qs[p], p);
            rope(&mut ks[p], p);
        }
        for p in 0..xs.len() {
            let mut attended = vec![0.0; heads * hd];
            for h in 0..heads {
                let kv = h / group;
                let q = &qs[p][h * hd..(h + 1) * hd];
                // Mistral's window: the last `w` positions, this one included.
                let first = config
                    .sliding_window
                    .map_or(0, |w| (p + 1).saturating_sub(w));
                let scores: Vec<f64> = (first..=p)
                    .map(|j| {
                        let k = &ks[j][kv * hd..(kv + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for (j, w) in (first..=p).zip(&weights) {
                    for d in 0..hd {
                        attended[h * hd + d] += w / total * vs[j][kv * hd + d];
                    }
                }
            }
            let projected = linear(&layer.o_proj, &attended);
            xs[p].iter_mut().zip(projected).for_each(|(x, y)| *x += y);
        }
        for x in &mut xs {
            let h = norm(x, &layer.post_attention_layernorm);
            let gate = linear(&layer.gate_proj, &h);
            let up = linear(&layer.up_proj, &h);
            let act = |g: f64| match config.hidden_act {
                Activation::Silu => g / (1.0 + (-g).exp()),
                Activation::GeluTanh => {
                    let c = (2.0 / std::f64::consts::PI).sqrt();
                    0.5 * g * (1.0 + (c * (g + 0.044_715 * g * g * g)).tanh())
                }
                // std has no erf: the exact GELU is checked paged against dense only.
                Activation::Gelu => panic!("the scalar reference has no exact GELU"),
            };
            let product: Vec<f64> = gate.iter().zip(&up).map(|(g, u)| act(*g) * u).collect();
            let down = linear(&layer.down_proj, &product);
            x.iter_mut().zip(down).for_each(|(a, b)| *a += b);
        }
    }
    let last = norm(&xs[xs.len() - 1], &model.weights.norm);
    // The head is [vocab, hidden]: logit[o] = sum_i head[o][i] * last[i].
    matrix(&model.weights.lm_head.weight().unwrap())
        .iter()
        .map(|row| row.iter().zip(&last).map(|(w, x)| w * x).sum::<f64>() as f32)
        .collect()
}

/// A model small enough for the scalar reference.
fn scalar_sized() -> InitOptions {
    InitOptions {
        layers: 2,
        hidden: 32,
        heads: 4,
        kv_heads: 2,
        vocab: 300,
        intermediate: 48,
        ..InitOptions::default()
    }
}

fn largest_gap(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

#[test]
fn forward_arithmetic_matches_a_scalar_reference() {
    for (name, architecture) in [
        ("scalar-llama", Architecture::Llama),
        ("scalar-qwen2", Architecture::Qwen2),
    ] {
        let (_dir, model) = tiny(
            name,
            InitOptions {
                architecture,
                seed: 9,
                ..scalar_sized()
            },
        );
        let sequence = tokens(9, 21, model.config.vocab_size);
        let reference = scalar_reference_logits(&model, &sequence, 1.0);
        let mut cache = model.paged_cache(4, 4).unwrap();
        let table = [3u32, 0, 2];
        forward_paged(&model, &mut cache, &[entry(&table, 0, &sequence[..4])]).unwrap();
        let paged = forward_paged(&model, &mut cache, &[entry(&table, 4, &sequence[4..])]).unwrap();
        let worst = largest_gap(&paged[0], &reference);
        assert!(
            worst < 1e-3,
            "{name}: paged differs from the scalar reference by {worst}"
        );
    }
}

#[test]
fn linear_rope_scaling_interpolates_positions() {
    let (dir, plain, scaled) = with_config_field(
        "rope-linear",
        Architecture::Llama,
        "rope_scaling",
        serde_json::json!({"rope_type": "linear", "factor": 4.0}),
    );
    let scaled = scaled.expect("a scaled model loads");
    let path = dir.0.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let sequence = tokens(12, 3, 300);
    let mut cache = scaled.paged_cache(4, 4).unwrap();
    let paged = forward_paged(&scaled, &mut cache, &[entry(&[1, 0, 3], 0, &sequence)]).unwrap();
    let gap = largest_gap;
    let reference = scalar_reference_logits(&scaled, &sequence, 4.0);
    assert!(
        gap(&paged[0], &reference) < 1e-3,
        "scaled vs interpolated reference"
    );
    // Negative control: the scaling changes the logits.
    let unscaled = scalar_reference_logits(&plain, &sequence, 1.0);
    assert!(
        gap(&paged[0], &unscaled) > 1e-3,
        "rope_scaling had no effect"
    );
    assert_close(&paged[0], &dense_logits(&scaled, &sequence), "scaled dense");
    // A scaling this backend cannot apply is refused, naming it.
    config["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    std::fs::write(&path, config.to_string()).unwrap();
    let err = Model::load(&dir.0)
        .expect_err("yarn is refused")
        .to_string();
    assert!(
        err.contains("config.json") && err.contains("\"yarn\""),
        "{err}"
    );
}

/// Writes a scalar-sized model of `architecture`, then sets `field` of its config.
fn with_config_field(
    name: &str,
    architecture: Architecture,
    field: &str,
    value: serde_json::Value,
) -> (TempDir, Model, Result<Model>) {
    let dir = TempDir::new(name);
    let options = InitOptions {
        architecture,
        seed: 5,
        ..scalar_sized()
    };
    write_random_model(&dir.0, &options).expect("init");
    let plain = Model::load(&dir.0).expect("load");
    let path = dir.0.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config[field] = value;
    std::fs::write(&path, config.to_string()).unwrap();
    let changed = Model::load(&dir.0);
    (dir, plain, changed)
}

#[test]
fn mistrals_sliding_window_hides_keys_older_than_the_window() {
    let (_dir, plain, windowed) =
        with_config_field("window", Architecture::Mistral, "sliding_window", 5.into());
    let windowed = windowed.expect("a windowed model loads");
    assert_eq!(windowed.config.sliding_window, Some(5));
    let sequence = tokens(13, 4, 300);
    // Chunked prefill (4 + 6 tokens) then three decode steps, over scattered blocks.
    let table = [2u32, 0, 3, 1];
    let mut cache = windowed.paged_cache(4, 4).unwrap();
    forward_paged(&windowed, &mut cache, &[entry(&table, 0, &sequence[..4])]).unwrap();
    let mut last =
        forward_paged(&windowed, &mut cache, &[entry(&table, 4, &sequence[4..10])]).unwrap();
    for p in 10..13 {
        last = forward_paged(&windowed, &mut cache, &[entry(&table, p, &sequence[p..=p])]).unwrap();
    }
    let reference = scalar_reference_logits(&windowed, &sequence, 1.0);
    assert!(
        largest_gap(&last[0], &reference) < 1e-3,
        "windowed vs the scalar reference"
    );
    assert_close(
        &last[0],
        &dense_logits(&windowed, &sequence),
        "windowed dense",
    );
    // Negative control: without the window the same weights answer otherwise.
    let unwindowed = scalar_reference_logits(&plain, &sequence, 1.0);
    assert!(
        largest_gap(&last[0], &unwindowed) > 1e-3,
        "the window had no effect"
    );
    // Qwen2's per-layer window is refused, naming the field; a bad window too.
    let (_d, _, qwen) = with_config_field(
        "qwen-window",
        Architecture::Qwen2,
        "use_sliding_window",
        true.into(),
    );
    let err = qwen.expect_err("refused").to_string();
    assert!(
        err.contains("config.json") && err.contains("use_sliding_window true"),
        "{err}"
    );
    let (_d, _, zero) = with_config_field(
        "zero-window",
        Architecture::Mistral,
        "sliding_window",
        0.into(),
    );
    let err = zero.expect_err("refused").to_string();
    assert!(
        err.contains("sliding_window must be a positive integer or null, got 0"),
        "{err}"
    );
}

#[test]
fn sharded_bf16_checkpoints_load() {
    let dir = TempDir::new("sharded");
    write_random_model(&dir.0, &InitOptions::default()).unwrap();
    let single = dir.0.join("model.safetensors");
    let original = Model::load(&dir.0).unwrap();
    let bytes = std::fs::read(&single).unwrap();
    let parsed = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Two shards, every tensor stored as BF16 (the top 16 bits of its f32: truncation).
    let mut shards: [Vec<RawTensor>; 2] = [Vec::new(), Vec::new()];
    let mut weight_map = serde_json::Map::new();
    for (index, (name, view)) in parsed.tensors().into_iter().enumerate() {
        let bf16: Vec<u8> = view
            .data()
            .chunks_exact(4)
            .flat_map(|f| [f[2], f[3]])
            .collect();
        let shard = index % 2;
        weight_map.insert(
            name.clone(),
            serde_json::json!(format!("model-0000{}-of-00002.safetensors", shard + 1)),
        );
        shards[shard].push((name, view.shape().to_vec(), bf16));
    }
    for (shard, tensors) in shards.iter().enumerate() {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, d)| {
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), d)
                        .unwrap();
                (n.clone(), view)
            })
            .collect();
        let path = dir
            .0
            .join(format!("model-0000{}-of-00002.safetensors", shard + 1));
        safetensors::serialize_to_file(views, None, &path).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::remove_file(&single).unwrap();
    let loaded = Model::load(&dir.0).unwrap();
    let truncate = |t: &candle_core::Tensor| -> Vec<f32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xFFFF_0000))
            .collect()
    };
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(
        flat(&loaded.weights.embed_tokens),
        truncate(&original.weights.embed_tokens)
    );
    assert_eq!(
        flat(&loaded.weights.layers[1].down_proj.weight().unwrap()),
        truncate(&original.weights.layers[1].down_proj.weight().unwrap())
    );
    // A tensor the index lists nowhere is reported against the index.
    let text = std::fs::read_to_string(dir.0.join("model.safetensors.index.json")).unwrap();
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        text.replace("model-00002-of-00002", "model-00001-of-00002"),
    )
    .unwrap();
    std::fs::remove_file(dir.0.join("model-00002-of-00002.safetensors")).unwrap();
    let message = Model::load(&dir.0).unwrap_err().to_string();
    assert!(
        message.contains("model.safetensors.index.json") && message.contains("missing tensor"),
        "{message}"
    );
}

/// Rewrites `DIR/config.json` as `base` edited by `edit`, then loads the directory.
fn load_edited(
    dir: &Path,
    base: &serde_json::Value,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Result<Model> {
    let mut config = base.clone();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    Model::load(dir)
}

fn config_of(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn rope_parameters_read_as_the_top_level_keys() {
    use serde_json::json;
    let dir = TempDir::new("rope-parameters");
    write_random_model(
        &dir.0,
        &InitOptions {
            seed: 9,
            ..scalar_sized()
        },
    )
    .unwrap();
    let base = config_of(&dir.0);
    let prompt = tokens(10, 6, 300);
    let generate = |model: &Model| greedy_reference(model, &prompt, 8).unwrap();
    let old = load_edited(&dir.0, &base, |c| c["rope_theta"] = json!(500_000.0)).unwrap();
    let new = load_edited(&dir.0, &base, |c| {
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 500_000.0});
    })
    .unwrap();
    assert_eq!(new.config.rope_theta, 500_000.0);
    assert_eq!(
        generate(&old),
        generate(&new),
        "the two layouts generate alike"
    );
    // The key is read: θ = 10000 answers otherwise.
    let ten_thousand = load_edited(&dir.0, &base, |c| {
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 10_000.0});
    })
    .unwrap();
    assert!(
        largest_gap(
            &dense_logits(&new, &prompt),
            &dense_logits(&ten_thousand, &prompt)
        ) > 1e-3,
        "rope_parameters.rope_theta had no effect"
    );
    // Scaling inside rope_parameters reads as rope_scaling does.
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8});
    let old = load_edited(&dir.0, &base, |c| c["rope_scaling"] = llama3.clone()).unwrap();
    let new = load_edited(&dir.0, &base, |c| {
        let mut parameters = llama3.clone();
        parameters["rope_theta"] = json!(10_000.0);
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = parameters;
    })
    .unwrap();
    assert_eq!(new.config.rope_scaling, old.config.rope_scaling);
    assert!(matches!(
        new.config.rope_scaling,
        RopeScaling::Llama3 { .. }
    ));
    assert_eq!(generate(&old), generate(&new));
    // A type not implemented is refused at load, naming it.
    let err = load_edited(&dir.0, &base, |c| {
        c["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0});
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("rope_parameters.rope_type \"yarn\""), "{err}");
}

#[test]
fn llama_attention_and_mlp_biases_load_and_apply() {
    let dir = TempDir::new("llama-biases");
    write_random_model(
        &dir.0,
        &InitOptions {
            seed: 4,
            ..scalar_sized()
        },
    )
    .unwrap();
    let mut base = config_of(&dir.0);
    base["attention_bias"] = true.into();
    base["mlp_bias"] = true.into();
    std::fs::write(dir.0.join("config.json"), base.to_string()).unwrap();
    let config = ModelConfig::load(&dir.0).unwrap();
    assert!(config.o_proj_bias() && config.mlp_bias);
    write_random_weights(&dir.0, &config, 4).unwrap();
    let model = Model::load(&dir.0).unwrap();
    let layer = &model.weights.layers[0];
    assert!(layer.q_proj.bias.is_some() && layer.o_proj.bias.is_some());
    assert!(layer.gate_proj.bias.is_some() && layer.down_proj.bias.is_some());
    let sequence = tokens(9, 2, 300);
    let mut cache = model.paged_cache(4, 4).unwrap();
    let paged = forward_paged(&model, &mut cache, &[entry(&[3, 1, 0], 0, &sequence)]).unwrap();
    assert_close(&paged[0], &dense_logits(&model, &sequence), "biased dense");
    assert!(largest_gap(&paged[0], &scalar_reference_logits(&model, &sequence, 1.0)) < 1e-3);
    // Each bias matters: without it the same weights answer otherwise.
    let mut no_o = model.clone();
    no_o.weights
        .layers
        .iter_mut()
        .for_each(|l| l.o_proj.bias = None);
    assert!(
        largest_gap(&paged[0], &dense_logits(&no_o, &sequence)) > 1e-2,
        "o_proj bias"
    );
    let mut no_mlp = model.clone();
    for l in &mut no_mlp.weights.layers {
        l.gate_proj.bias = None;
        l.up_proj.bias = None;
        l.down_proj.bias = None;
    }
    assert!(
        largest_gap(&paged[0], &dense_logits(&no_mlp, &sequence)) > 1e-2,
        "mlp bias"
    );
    // A missing bias tensor is an error naming it.
    drop_tensor(
        &dir.0.join("model.safetensors"),
        "model.layers.0.self_attn.o_proj.bias",
    );
    let err = Model::load(&dir.0).unwrap_err().to_string();
    assert!(
        err.contains("model.layers.0.self_attn.o_proj.bias"),
        "{err}"
    );
}

#[test]
fn gelu_activations_apply_and_others_are_refused() {
    let dir = TempDir::new("hidden-act");
    write_random_model(
        &dir.0,
        &InitOptions {
            seed: 8,
            ..scalar_sized()
        },
    )
    .unwrap();
    let base = config_of(&dir.0);
    let silu = Model::load(&dir.0).unwrap();
    let sequence = tokens(9, 5, 300);
    let silu_logits = dense_logits(&silu, &sequence);
    for name in ["gelu_pytorch_tanh", "gelu"] {
        let model = load_edited(&dir.0, &base, |c| c["hidden_act"] = name.into()).unwrap();
        let mut cache = model.paged_cache(4, 4).unwrap();
        let paged = forward_paged(&model, &mut cache, &[entry(&[2, 0, 1], 0, &sequence)]).unwrap();
        assert_close(&paged[0], &dense_logits(&model, &sequence), name);
        assert!(
            largest_gap(&paged[0], &silu_logits) > 1e-3,
            "{name} changed nothing"
        );
        if name == "gelu_pytorch_tanh" {
            let reference = scalar_reference_logits(&model, &sequence, 1.0);
            assert!(
                largest_gap(&paged[0], &reference) < 1e-3,
                "tanh GELU vs the scalar reference"
            );
        }
    }
    let refused = [
        (
            "hidden_act",
            serde_json::json!("relu"),
            "hidden_act \"relu\"",
        ),
        (
            "quantization_config",
            serde_json::json!({"quant_method": "awq"}),
            "quantization_config",
        ),
        (
            "layer_types",
            serde_json::json!(["full_attention", "sliding_attention"]),
            "layer_types entry \"sliding_attention\"",
        ),
        (
            "mlp_bias",
            serde_json::json!("yes"),
            "mlp_bias must be true or false",
        ),
    ];
    for (key, value, named) in refused {
        let err = load_edited(&dir.0, &base, |c| c[key] = value.clone())
            .expect_err(key)
            .to_string();
        assert!(
            err.contains("config.json") && err.contains(named),
            "{key}: {err}"
        );
    }
}

#[test]
fn every_eos_id_and_generation_config_are_read() {
    let dir = TempDir::new("eos-list");
    write_random_model(&dir.0, &scalar_sized()).unwrap();
    let base = config_of(&dir.0);
    let model = load_edited(&dir.0, &base, |c| {
        c["eos_token_id"] = serde_json::json!([256, 258])
    })
    .unwrap();
    assert_eq!(model.config.eos_token_ids, vec![256, 258]);
    assert_eq!(model.config.generation, GenerationDefaults::default());
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"eos_token_id": [258, 299], "temperature": 0.6, "top_p": 0.9, "top_k": 20}"#,
    )
    .unwrap();
    let config = ModelConfig::load(&dir.0).unwrap();
    assert_eq!(config.eos_token_ids, vec![256, 258, 299]);
    assert_eq!(
        config.generation,
        GenerationDefaults {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(20)
        }
    );
    let tokenizer = TextTokenizer::load(&dir.0).unwrap();
    let ends = tokenizer.end_of_answer_ids(&config.eos_token_ids);
    assert!(
        [256, 258, 299].iter().all(|id| ends.contains(id)),
        "{ends:?}"
    );
    std::fs::write(
        dir.0.join("generation_config.json"),
        r#"{"eos_token_id": "x"}"#,
    )
    .unwrap();
    let err = ModelConfig::load(&dir.0).unwrap_err().to_string();
    assert!(
        err.contains("generation_config.json") && err.contains("eos_token_id"),
        "{err}"
    );
}

#[test]
fn plain_prompts_get_the_bos_the_tokenizer_adds() {
    let dir = TempDir::new("bos");
    write_random_model(&dir.0, &scalar_sized()).unwrap();
    let bos = "<|endoftext|>";
    let path = dir.0.join("tokenizer.json");
    let mut tokenizer: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    tokenizer["post_processor"] = serde_json::json!({
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [256], "tokens": [bos]}},
    });
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let loaded = TextTokenizer::load(&dir.0).unwrap();
    let plain = loaded.encode("hello").unwrap();
    assert_ne!(plain[0], 256);
    let prompt = loaded.encode_prompt("hello").unwrap();
    assert_eq!(prompt[0], 256, "the post-processor's BOS");
    assert_eq!(&prompt[1..], &plain[..]);
    // A chat renders through its template, encoded as written: no BOS added to it.
    let chat = loaded
        .encode(&loaded.chat_prompt("hello").unwrap())
        .unwrap();
    assert_ne!(chat[0], 256);
    // `add_bos_token` in tokenizer_config.json overrides the post-processor.
    let config_path = dir.0.join("tokenizer_config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["bos_token"] = bos.into();
    config["add_bos_token"] = false.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    assert_eq!(
        TextTokenizer::load(&dir.0)
            .unwrap()
            .encode_prompt("hello")
            .unwrap(),
        plain
    );
    tokenizer["post_processor"] = serde_json::Value::Null;
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    config["add_bos_token"] = true.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    assert_eq!(
        TextTokenizer::load(&dir.0)
            .unwrap()
            .encode_prompt("hello")
            .unwrap(),
        prompt
    );
}

/// The penalties against a hand computation: prompt [1, 2], output [2, 3, 3];
/// repetition 2 over {1, 2, 3}, then frequency 0.5 per count and presence 0.25 once
/// over the output's {2: 1, 3: 2}.
#[test]
fn penalties_follow_vllm_formulas_on_a_hand_computed_case() {
    use super::sampling::{Penalties, PenaltyScratch, apply_penalties};
    let logits = [1.0f32, 4.0, -2.0, 3.0, 5.0];
    let (prompt, output) = ([1u32, 2], [2u32, 3, 3]);
    let mut scratch = PenaltyScratch::default();
    let mut got = logits;
    apply_penalties(
        &mut got,
        Penalties {
            presence: 0.25,
            frequency: 0.5,
            repetition: 2.0,
        },
        &prompt,
        &output,
        &mut scratch,
    );
    // 0 unseen; 1 prompt only: 4/2; 2 prompt and once in output: -2*2 - 0.5 - 0.25;
    // 3 twice in output: 3/2 - 2*0.5 - 0.25; 4 unseen.
    assert_eq!(got, [1.0, 2.0, -4.75, 0.25, 5.0]);
    // The scratch is left clean: the same call again gives the same answer.
    let mut again = logits;
    apply_penalties(
        &mut again,
        Penalties {
            presence: 0.25,
            frequency: 0.5,
            repetition: 2.0,
        },
        &prompt,
        &output,
        &mut scratch,
    );
    assert_eq!(again, got);
    // Presence and frequency see the output only; a negative presence rewards.
    let mut only_output = logits;
    apply_penalties(
        &mut only_output,
        Penalties {
            presence: -1.0,
            ..Penalties::NONE
        },
        &prompt,
        &output,
        &mut scratch,
    );
    assert_eq!(only_output, [1.0, 4.0, -1.0, 4.0, 5.0]);
    let mut none = logits;
    apply_penalties(&mut none, Penalties::NONE, &prompt, &output, &mut scratch);
    assert_eq!(none, logits);
}

#[test]
fn logit_bias_adds_and_masked_tokens_cannot_be_drawn() {
    use super::sampling::{apply_logit_bias, mask_tokens};
    let mut logits = vec![0.5f32, 2.0, 1.0, -1.0];
    apply_logit_bias(&mut logits, [(0, 3.0), (3, -100.0), (99, 5.0)]);
    assert_eq!(logits, [3.5, 2.0, 1.0, -101.0]);
    assert_eq!(argmax(&logits), 0);
    mask_tokens(&mut logits, &[0, 77]);
    assert_eq!(argmax(&logits), 1, "the masked best is passed over");
    // Sampled at a high temperature, a masked token never comes out.
    let mut sampler = Sampler::new(SamplingParams {
        temperature: 5.0,
        seed: 9,
        ..SamplingParams::default()
    })
    .unwrap();
    for _ in 0..200 {
        assert_ne!(sampler.sample(&logits).unwrap(), 0);
    }
}

/// Log-softmax against a direct computation: the sampled token's own value whatever its
/// rank, the top k most likely first, ties by id, and exp of them summing to 1 over the
/// whole vocabulary.
#[test]
fn token_logprobs_are_the_log_softmax_with_the_top_k_in_order() {
    use super::sampling::token_logprobs;
    let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5, 2.0];
    let norm: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
    let expect = |i: usize| (f64::from(logits[i]) - norm) as f32;
    let (own, top) = token_logprobs(&logits, 2, 3);
    assert!((own - expect(2)).abs() < 1e-6, "{own} vs {}", expect(2));
    let ids: Vec<u32> = top.iter().map(|&(id, _)| id).collect();
    assert_eq!(ids, [1, 3, 5], "most likely first, the tie by id");
    for &(id, lp) in &top {
        assert!((lp - expect(id as usize)).abs() < 1e-6);
    }
    let total: f64 = (0..logits.len())
        .map(|t| f64::from(token_logprobs(&logits, t as u32, 0).0).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
    assert!(token_logprobs(&logits, 0, 0).1.is_empty());
    // More asked for than the vocabulary holds: every token, in order.
    assert_eq!(token_logprobs(&logits, 0, 20).1.len(), logits.len());
}
