//! `lockstep model`: write a random model, generate text with the CPU transformer over
//! the paged KV cache, and benchmark the paged forward against the dense reference.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::stdout::outln;
use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use lockstep_gpu::model::{
    Architecture, BatchEntry, DenseSequence, InitOptions, Model, PagedKvCache, Sampler,
    SamplingParams, TextTokenizer, forward_dense, forward_paged, write_random_model,
};
use rand::{Rng, SeedableRng};

/// The model family `init` writes.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum InitArchitecture {
    /// Llama: no biases.
    Llama,
    /// Qwen2: biases on the Q, K and V projections.
    Qwen2,
}

/// `lockstep model ...`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write a random model (config.json, model.safetensors with seeded weights, a
    /// byte-level BPE tokenizer.json, tokenizer_config.json) into DIR.
    Init {
        /// The directory to write (created if absent; a directory that already holds a
        /// model's files is refused unless --force).
        dir: PathBuf,
        /// Overwrite the model files of an existing directory.
        #[arg(long)]
        force: bool,
        /// Transformer blocks.
        #[arg(long, default_value_t = 2)]
        layers: usize,
        /// Width of the residual stream.
        #[arg(long, default_value_t = 64)]
        hidden: usize,
        /// Query heads.
        #[arg(long, default_value_t = 4)]
        heads: usize,
        /// Key/value heads (grouped-query attention when fewer than heads).
        #[arg(long, default_value_t = 2)]
        kv_heads: usize,
        /// Vocabulary size (over 259: 256 bytes and 3 special tokens).
        #[arg(long, default_value_t = 512)]
        vocab: usize,
        /// MLP width (default: 8/3 of hidden, rounded up to a multiple of 64).
        #[arg(long)]
        intermediate: Option<usize>,
        /// Seed of the weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Model family.
        #[arg(long, value_enum, default_value_t = InitArchitecture::Llama)]
        architecture: InitArchitecture,
    },
    /// Generate text: prefill the prompt in chunks, then decode, through the paged KV
    /// cache.
    Generate {
        /// A Hugging Face model directory (Llama, Qwen2 or Mistral) or one `init` wrote.
        #[arg(long)]
        model: PathBuf,
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// Wrap the prompt in the model's chat template as one user message.
        #[arg(long)]
        chat: bool,
        /// Most tokens to generate.
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        /// Seed of the request's sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Prompt tokens per prefill forward.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
        chunk: u64,
        /// Token slots per KV block.
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
        tokens_per_block: u64,
    },
    /// Fit the cost model's device coefficients to this machine's forwards of the model
    /// and write a profile file that `[model] profile = "FILE"` reads.
    Calibrate {
        /// The model directory.
        #[arg(long)]
        model: PathBuf,
        /// The profile file to write (TOML).
        #[arg(long)]
        out: PathBuf,
        /// The shipped profile whose host coefficients (scheduling time per iteration and
        /// per request) the file keeps.
        #[arg(long, default_value = "llama3-8b-h100-bf16")]
        host_from: String,
        /// Token slots per KV block.
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
        tokens_per_block: u64,
        /// Timed forwards per batch shape; the median counts.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
        repeats: u64,
        /// Fit the forwards a real run logged (`lockstep run SCENARIO --model DIR
        /// --forward-log PATH`) instead of timing a grid of shapes: the calibration then
        /// comes from that workload's own batch mixes.
        #[arg(long, value_name = "PATH")]
        from_log: Option<PathBuf>,
    },
    /// Decode tokens/s of the paged forward and of the dense reference on the same model.
    Bench {
        /// The model directory.
        #[arg(long)]
        model: PathBuf,
        /// Prompt tokens per request (random ids, prefilled before timing).
        #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
        prompt_len: u64,
        /// Decode steps timed.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
        decode_tokens: u64,
        /// Requests decoding together in one forward.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
        /// Token slots per KV block.
        #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
        tokens_per_block: u64,
        /// Timed rounds of each path, alternating; the fastest round of each counts.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
        rounds: u64,
        /// Ranks decoding at once, each on its own thread with its own K/V and batch
        /// (attention data parallelism on one machine); tokens/s counts them all.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
        dp: u64,
    },
}

/// How tokens are sampled: `model generate`, and `--model` on `sim`, `run`, `serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// 0 samples greedily; above 0 divides the logits before sampling.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling's probability mass, in (0, 1] (1 keeps every token).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
}

impl SamplingArgs {
    /// The sampling parameters, with `seed`.
    pub fn params(&self, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed,
        }
    }
}

/// Runs one `lockstep model` subcommand.
pub fn run(command: ModelCommand) -> anyhow::Result<ExitCode> {
    match command {
        ModelCommand::Init {
            dir,
            force,
            layers,
            hidden,
            heads,
            kv_heads,
            vocab,
            intermediate,
            seed,
            architecture,
        } => {
            let options = InitOptions {
                architecture: match architecture {
                    InitArchitecture::Llama => Architecture::Llama,
                    InitArchitecture::Qwen2 => Architecture::Qwen2,
                },
                layers,
                hidden,
                heads,
                kv_heads,
                vocab,
                intermediate: intermediate.unwrap_or_else(|| (hidden * 8 / 3).div_ceil(64) * 64),
                seed,
            };
            if !force {
                let taken: Vec<&str> = [
                    "config.json",
                    "model.safetensors",
                    "tokenizer.json",
                    "tokenizer_config.json",
                ]
                .into_iter()
                .filter(|f| dir.join(f).exists())
                .collect();
                anyhow::ensure!(
                    taken.is_empty(),
                    "{} already holds {}: choose another directory, or give --force to overwrite them",
                    dir.display(),
                    taken.join(", ")
                );
            }
            let config = write_random_model(&dir, &options)?;
            outln!("wrote {} ({})", dir.display(), config.summary());
            Ok(ExitCode::SUCCESS)
        }
        ModelCommand::Generate {
            model,
            prompt,
            chat,
            max_tokens,
            sampling,
            seed,
            chunk,
            tokens_per_block,
        } => {
            let params = sampling.params(seed);
            let started = std::time::Instant::now();
            let generated = generate(
                &model,
                &prompt,
                chat,
                max_tokens,
                params,
                chunk as usize,
                tokens_per_block as usize,
            )?;
            outln!("{}", generated.text);
            // What vLLM's offline example shows beside the text, on stderr so that
            // stdout stays the text alone.
            let secs = started.elapsed().as_secs_f64();
            eprintln!(
                "{} prompt tokens, {} generated ({:.1} tokens/s decode and prefill together, {:.2} s); finish reason: {}",
                generated.prompt_tokens,
                generated.tokens,
                generated.tokens as f64 / secs.max(1e-9),
                secs,
                if generated.stopped { "stop" } else { "length" }
            );
            Ok(ExitCode::SUCCESS)
        }
        ModelCommand::Calibrate {
            model,
            out,
            host_from,
            tokens_per_block,
            repeats,
            from_log,
        } => {
            crate::calibrate::calibrate(&crate::calibrate::CalibrateOptions {
                from_log: from_log.as_deref(),
                model_dir: &model,
                out: &out,
                host_from: &host_from,
                tokens_per_block: tokens_per_block as usize,
                repeats: repeats as usize,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        ModelCommand::Bench {
            model,
            prompt_len,
            decode_tokens,
            batch,
            tokens_per_block,
            rounds,
            dp,
        } => {
            bench(
                &model,
                BenchShape {
                    prompt_len: prompt_len as usize,
                    decode_tokens: decode_tokens as usize,
                    batch: batch as usize,
                    tokens_per_block: tokens_per_block as usize,
                },
                rounds as usize,
                dp as usize,
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn load(dir: &Path) -> anyhow::Result<Model> {
    Model::load(dir).with_context(|| format!("loading the model in {}", dir.display()))
}

/// Prefill in chunks, then decode one token per forward until the end-of-sequence
/// token or `max_tokens`; returns the generated text.
/// What `model generate` produced.
struct Generated {
    text: String,
    prompt_tokens: usize,
    tokens: usize,
    /// An end-of-answer token stopped it (else `--max-tokens` did).
    stopped: bool,
}

fn generate(
    dir: &Path,
    prompt: &str,
    chat: bool,
    max_tokens: usize,
    params: SamplingParams,
    chunk: usize,
    tokens_per_block: usize,
) -> anyhow::Result<Generated> {
    let model = load(dir)?;
    let tokenizer = TextTokenizer::load(dir)?;
    let mut sampler = Sampler::new(params)?;
    // A chat's template writes its own BOS; a plain prompt gets the tokenizer's.
    let prompt_ids = if chat {
        tokenizer.encode(&tokenizer.chat_prompt(prompt)?)?
    } else {
        tokenizer.encode_prompt(prompt)?
    };
    anyhow::ensure!(!prompt_ids.is_empty(), "the prompt encodes to no tokens");
    let stop = tokenizer.end_of_answer_ids(&model.config.eos_token_ids);
    let capacity = prompt_ids.len() + max_tokens;
    let num_blocks = capacity.div_ceil(tokens_per_block);
    let mut cache = model.paged_cache(num_blocks, tokens_per_block)?;
    // One request owns the whole pool here; its table is the blocks in order.
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let mut logits = Vec::new();
    let mut position = 0;
    for piece in prompt_ids.chunks(chunk) {
        let entry = BatchEntry {
            block_table: &table,
            start_position: position,
            token_ids: piece,
            dummy: false,
        };
        logits = forward_paged(&model, &mut cache, &[entry])?.remove(0);
        position += piece.len();
    }
    let mut generated = Vec::with_capacity(max_tokens);
    let mut stopped = false;
    while generated.len() < max_tokens {
        let next = sampler.sample(&logits)?;
        if stop.contains(&next) {
            stopped = true;
            break;
        }
        generated.push(next);
        if generated.len() == max_tokens {
            break;
        }
        let entry = BatchEntry {
            block_table: &table,
            start_position: position,
            token_ids: &[next],
            dummy: false,
        };
        logits = forward_paged(&model, &mut cache, &[entry])?.remove(0);
        position += 1;
    }
    Ok(Generated {
        text: tokenizer.decode(&generated)?,
        prompt_tokens: prompt_ids.len(),
        tokens: generated.len(),
        stopped,
    })
}

#[derive(Debug, Clone, Copy)]
struct BenchShape {
    prompt_len: usize,
    decode_tokens: usize,
    batch: usize,
    tokens_per_block: usize,
}

/// Times `decode_tokens` batched decode steps of `batch` requests on both paths, after
/// an untimed prefill of the same prompts, and prints tokens/s and their ratio.
/// `dp` copies of `time` at once, one thread each: the slowest one's time.
fn on_ranks(
    dp: usize,
    time: impl Fn() -> anyhow::Result<Duration> + Sync,
) -> anyhow::Result<Duration> {
    let times: Vec<anyhow::Result<Duration>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..dp).map(|_| scope.spawn(&time)).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank's thread panicked")))
            })
            .collect()
    });
    let mut slowest = Duration::ZERO;
    for t in times {
        slowest = slowest.max(t?);
    }
    Ok(slowest)
}

fn bench(dir: &Path, shape: BenchShape, rounds: usize, dp: usize) -> anyhow::Result<()> {
    let model = load(dir)?;
    let config = &model.config;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let prompts: Vec<Vec<u32>> = (0..shape.batch)
        .map(|_| {
            (0..shape.prompt_len)
                .map(|_| rng.random_range(0..config.vocab_size as u32))
                .collect()
        })
        .collect();
    outln!("model {}: {}", dir.display(), config.summary());
    outln!(
        "decode: dp {dp}, batch {} per rank, prompt {} tokens, {} steps timed, {} tokens per block, best of {rounds}",
        shape.batch,
        shape.prompt_len,
        shape.decode_tokens,
        shape.tokens_per_block
    );
    let mut paged_best = Duration::MAX;
    let mut dense_best = Duration::MAX;
    for _ in 0..rounds {
        paged_best = paged_best.min(on_ranks(dp, || time_paged(&model, &prompts, shape))?);
        dense_best = dense_best.min(on_ranks(dp, || time_dense(&model, &prompts, shape))?);
    }
    let tokens = (dp * shape.batch * shape.decode_tokens) as f64;
    let paged_rate = tokens / paged_best.as_secs_f64();
    let dense_rate = tokens / dense_best.as_secs_f64();
    outln!(
        "paged: {paged_rate:.1} tokens/s ({:.2} ms per step)",
        paged_best.as_secs_f64() * 1e3 / shape.decode_tokens as f64
    );
    outln!(
        "dense: {dense_rate:.1} tokens/s ({:.2} ms per step)",
        dense_best.as_secs_f64() * 1e3 / shape.decode_tokens as f64
    );
    outln!(
        "paged/dense per-token cost: {:.3}x (target at most 1.3x)",
        dense_rate / paged_rate
    );
    Ok(())
}

/// Next tokens of a decode step: the greedy choice of each request.
fn greedy(logits: &[Vec<f32>]) -> anyhow::Result<Vec<u32>> {
    let mut sampler = Sampler::new(SamplingParams::default())?;
    logits
        .iter()
        .map(|l| Ok(sampler.sample(l)?))
        .collect::<anyhow::Result<_>>()
}

fn time_paged(model: &Model, prompts: &[Vec<u32>], shape: BenchShape) -> anyhow::Result<Duration> {
    let per_request = (shape.prompt_len + shape.decode_tokens).div_ceil(shape.tokens_per_block);
    let mut cache: PagedKvCache =
        model.paged_cache(per_request * shape.batch, shape.tokens_per_block)?;
    // Interleaved tables, as a KV manager serving requests that arrived together hands
    // out: request r owns blocks r, r + batch, r + 2 * batch, ...
    let tables: Vec<Vec<u32>> = (0..shape.batch)
        .map(|r| {
            (0..per_request)
                .map(|i| (i * shape.batch + r) as u32)
                .collect()
        })
        .collect();
    let prefill: Vec<BatchEntry<'_>> = prompts
        .iter()
        .zip(&tables)
        .map(|(p, t)| BatchEntry {
            block_table: t,
            start_position: 0,
            token_ids: p,
            dummy: false,
        })
        .collect();
    let mut next = greedy(&forward_paged(model, &mut cache, &prefill)?)?;
    let started = Instant::now();
    for step in 0..shape.decode_tokens {
        let entries: Vec<BatchEntry<'_>> = tables
            .iter()
            .zip(&next)
            .map(|(t, token)| BatchEntry {
                block_table: t,
                start_position: shape.prompt_len + step,
                token_ids: std::slice::from_ref(token),
                dummy: false,
            })
            .collect();
        let logits = forward_paged(model, &mut cache, &entries)?;
        next = greedy(&logits)?;
    }
    Ok(started.elapsed())
}

fn time_dense(model: &Model, prompts: &[Vec<u32>], shape: BenchShape) -> anyhow::Result<Duration> {
    let mut sequences: Vec<DenseSequence> =
        prompts.iter().map(|_| DenseSequence::new(model)).collect();
    let prompt_refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let mut next = greedy(&forward_dense(model, &mut sequences, &prompt_refs)?)?;
    let started = Instant::now();
    for _ in 0..shape.decode_tokens {
        let new: Vec<&[u32]> = next.iter().map(std::slice::from_ref).collect();
        let logits = forward_dense(model, &mut sequences, &new)?;
        next = greedy(&logits)?;
    }
    Ok(started.elapsed())
}
