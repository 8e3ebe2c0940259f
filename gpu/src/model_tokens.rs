//! The real model as a rank's token source: every launched batch runs one paged forward
//! of the CPU transformer, its attention over the blocks the rank's KV manager handed
//! out, and each entry's token is sampled from the logits.
//!
//! The control plane only counts tokens, so this source keeps what it needs beside it:
//! each request's token history (prompt, then every token sampled), from which a prefill
//! chunk takes its tokens, a decode step its input (the token last sampled) and a
//! recompute after a pause the tokens it recomputes. A request that carries no prompt
//! ids (a trace replay) gets a made-up one, a pure function of the request, with the
//! tokens of each full prompt block derived from that block's prefix key: two requests
//! the KV manager lets share a block have the same tokens in it, so the shared K/V is
//! exactly what either would have computed.
//!
//! Sampling is a pure function of the request's seed, its output position and the
//! logits, so a request gets the same tokens on every driver and under any batching.

use std::collections::HashMap;
use std::sync::Arc;

use lockstep_actors::executor::{ForwardKind, ForwardOutput, RankExecutor, ScheduledBatch};
use lockstep_actors::group::{ForwardError, TokenSource};
use lockstep_actors::ids::ReqId;
use lockstep_actors::kv::{chain_keys, mix};
use lockstep_actors::request::{Request, RequestSpec};

use crate::model::{
    BatchEntry, Model, ModelError, PagedKvCache, Sampler, SamplingParams, forward_paged,
};

/// Largest K/V pool one rank may ask for (its pages are touched only as blocks are
/// written, but a pool this large is a configuration mistake, not a plan).
pub const MAX_POOL_BYTES: u64 = 64 << 30;

/// How the rank samples: one setting for every request; each request's random stream
/// is seeded from `seed` and its id.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ModelSampling {
    /// Temperature, top-p and top-k (the seed field is ignored: see `seed`).
    pub params: SamplingParams,
    /// The run's seed.
    pub seed: u64,
}

impl ModelSampling {
    /// An error naming the parameter out of range.
    pub fn check(&self) -> Result<(), ModelError> {
        Sampler::new(self.params).map(|_| ())
    }
}


/// A server's model backend: the model (shared by every rank of a process) and, per rank
/// it serves, the rank's paged K/V pool and its requests' token histories. A real
/// driver gives each rank host its own; the simulator one per server.
pub struct ModelTokens {
    model: Arc<Model>,
    sampling: ModelSampling,
    ranks: Vec<RankModel>,
}

/// One rank's share of a [`ModelTokens`].
#[derive(Default)]
struct RankModel {
    cache: Option<PagedKvCache>,
    histories: HashMap<ReqId, Vec<u32>>,
    batches: u64,
}

impl ModelTokens {
    /// A backend; each rank's pool is sized on its first batch, from the rank's KV
    /// manager. Sampling parameters out of range fail every forward: check them first
    /// ([`ModelSampling::check`]).
    pub fn new(model: Arc<Model>, sampling: ModelSampling) -> ModelTokens {
        ModelTokens {
            model,
            sampling,
            ranks: Vec::new(),
        }
    }

    /// The K/V pool's size for `blocks` blocks of `tokens_per_block` tokens.
    pub fn pool_bytes(model: &Model, blocks: u32, tokens_per_block: u32) -> u64 {
        let c = &model.config;
        // K and V, f32.
        2 * 4
            * c.num_hidden_layers as u64
            * u64::from(blocks)
            * u64::from(tokens_per_block)
            * c.num_key_value_heads as u64
            * c.head_dim as u64
    }

    fn run(
        &mut self,
        exec: &RankExecutor,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), String> {
        let index = exec.rank().index();
        if self.ranks.len() <= index {
            self.ranks.resize_with(index + 1, RankModel::default);
        }
        let model = &self.model;
        let sampling = self.sampling;
        let rank = &mut self.ranks[index];
        rank.run(model, sampling, exec, batch, out)
    }
}

impl RankModel {
    fn run(
        &mut self,
        model: &Model,
        sampling: ModelSampling,
        exec: &RankExecutor,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), String> {
        let kv = exec.kv();
        if self.cache.is_none() {
            let bytes = ModelTokens::pool_bytes(model, kv.total_blocks(), kv.tokens_per_block());
            if bytes > MAX_POOL_BYTES {
                return Err(format!(
                    "the K/V pool of {} blocks of {} tokens needs {bytes} bytes, more than {MAX_POOL_BYTES}",
                    kv.total_blocks(),
                    kv.tokens_per_block()
                ));
            }
            let cache = model
                .paged_cache(kv.total_blocks() as usize, kv.tokens_per_block() as usize)
                .map_err(|e| e.to_string())?;
            self.cache = Some(cache);
        }
        let vocab = model.config.vocab_size as u32;
        let tokens_per_block = kv.tokens_per_block();
        // Per entry: block table, start position, token ids.
        let mut inputs: Vec<(Vec<u32>, usize, Vec<u32>)> = Vec::with_capacity(batch.entries.len());
        for e in &batch.entries {
            if e.is_dummy {
                // Arithmetic only: a dummy writes and reads no block.
                inputs.push((Vec::new(), 0, vec![0; e.tokens().max(1) as usize]));
                continue;
            }
            let request = find_request(exec, e.id)
                .ok_or_else(|| format!("request {} is in the batch but not on the rank", e.id.0))?;
            let history = self
                .histories
                .entry(e.id)
                .or_insert_with(|| prompt_tokens(&request.spec, tokens_per_block, vocab));
            let start = e.kv_tokens as usize;
            let ids = match e.kind {
                ForwardKind::Context { chunk, .. } => history
                    .get(start..start + chunk as usize)
                    .map(<[u32]>::to_vec),
                ForwardKind::Generation { tokens: 1 } => history.get(start).map(|&t| vec![t]),
                ForwardKind::Generation { tokens } => {
                    return Err(format!(
                        "request {} drafts {} tokens: the model backend does not run speculative decoding",
                        e.id.0,
                        tokens - 1
                    ));
                }
            }
            .ok_or_else(|| {
                format!(
                    "request {} needs tokens {start}..{} but only {} are known",
                    e.id.0,
                    start + e.tokens() as usize,
                    history.len()
                )
            })?;
            let table = kv.block_ids_of(e.id).iter().map(|b| b.0).collect();
            inputs.push((table, start, ids));
        }
        let entries: Vec<BatchEntry<'_>> = batch
            .entries
            .iter()
            .zip(&inputs)
            .map(|(e, (table, start, ids))| BatchEntry {
                block_table: table,
                start_position: *start,
                token_ids: ids,
                dummy: e.is_dummy,
            })
            .collect();
        let cache = self.cache.as_mut().ok_or("no K/V pool")?;
        let logits = forward_paged(model, cache, &entries).map_err(|e| e.to_string())?;
        out.batch = batch.number;
        out.sampled.clear();
        for (e, logits) in batch.entries.iter().zip(&logits) {
            if e.is_dummy {
                out.sampled.push(0);
                continue;
            }
            let token = sample_one(sampling, e.id, e.position, logits)?;
            let samples = match e.kind {
                ForwardKind::Context { samples, .. } => samples,
                ForwardKind::Generation { .. } => true,
            };
            if samples
                && let (Some(history), Some(request)) =
                    (self.histories.get_mut(&e.id), find_request(exec, e.id))
            {
                // Output position p is token prompt_len + p of the sequence.
                let at = request.spec.prompt_len as usize + e.position as usize;
                history.truncate(at);
                if history.len() == at {
                    history.push(token);
                }
            }
            out.sampled.push(token);
        }
        self.batches += 1;
        if self.batches.is_multiple_of(256) {
            self.forget_ended(exec);
        }
        Ok(())
    }

    /// Drops the histories of requests the rank no longer holds.
    fn forget_ended(&mut self, exec: &RankExecutor) {
        self.histories.retain(|id, _| {
            find_request(exec, *id).is_some() || exec.waiting().iter().any(|s| s.id == *id)
        });
    }
}

impl TokenSource for ModelTokens {
    fn sample_into(
        &mut self,
        exec: &RankExecutor,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), ForwardError> {
        self.run(exec, batch, out).map_err(|reason| ForwardError {
            rank: batch.rank,
            batch: batch.number,
            reason,
        })
    }
}

/// Request `id`'s token at output `position`: a pure function of the run's seed, the
/// request, the position and the logits.
fn sample_one(
    sampling: ModelSampling,
    id: ReqId,
    position: u32,
    logits: &[f32],
) -> Result<u32, String> {
    let params = SamplingParams {
        seed: mix(sampling.seed ^ mix(id.0) ^ u64::from(position).rotate_left(40)),
        ..sampling.params
    };
    Sampler::new(params)
        .and_then(|mut s| s.sample(logits))
        .map_err(|e| e.to_string())
}

fn find_request(exec: &RankExecutor, id: ReqId) -> Option<&Request> {
    exec.active()
        .iter()
        .chain(exec.sending())
        .find(|r| r.spec.id == id)
}

/// The prompt's token ids: the request's own, or a made-up prompt whose full blocks'
/// tokens follow from their prefix keys (shared blocks, shared tokens) and whose tail
/// follows from the request id.
pub fn prompt_tokens(spec: &RequestSpec, tokens_per_block: u32, vocab: u32) -> Vec<u32> {
    if !spec.prompt_tokens.is_empty() {
        return spec.prompt_tokens.clone();
    }
    let vocab = u64::from(vocab.max(1));
    let block = tokens_per_block.max(1) as usize;
    let mut tokens = Vec::with_capacity(spec.prompt_len as usize);
    for key in chain_keys(&spec.block_hashes) {
        if tokens.len() + block > spec.prompt_len as usize {
            break;
        }
        tokens.extend((0..block as u64).map(|slot| (mix(key ^ slot) % vocab) as u32));
    }
    let tail_seed = mix(spec.id.0 ^ 0x7E11);
    while tokens.len() < spec.prompt_len as usize {
        tokens.push((mix(tail_seed ^ tokens.len() as u64) % vocab) as u32);
    }
    tokens
}
