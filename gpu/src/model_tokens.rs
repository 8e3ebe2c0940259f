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
use std::sync::{Arc, Mutex, MutexGuard};

use rayon::prelude::*;

use lockstep_actors::executor::{ForwardKind, ForwardOutput, ScheduledBatch};
use lockstep_actors::group::{ForwardError, TokenSource};
use lockstep_actors::ids::ReqId;
use lockstep_actors::kv::{chain_keys, mix};
use lockstep_actors::request::RequestSpec;
use lockstep_actors::transceiver::{KvBlock, KvStore, SequenceKv};
use lockstep_actors::vocab::TokenLogprobs;

use lockstep_actors::executor::{EntryInputs, ForwardInputs};

use crate::model::{
    BatchEntry, Model, ModelError, PagedKvCache, Penalties, PenaltyScratch, Sampler,
    SamplingParams, apply_logit_bias, apply_penalties, forward_paged, mask_tokens, token_logprobs,
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
/// it serves, the rank's paged K/V pool and its requests' token histories. The
/// simulator runs one per server inline; a real driver runs each rank's [`RankModel`]
/// on the rank's device thread, handing it a copy of each launched batch, so the host
/// schedules batch N+1 while the model computes batch N, as on a GPU. Either way the
/// launched batch is all the model reads of its rank: block tables, prompts and
/// sampling come in it ([`ScheduledBatch::inputs`]).
pub struct ModelTokens {
    model: Arc<Model>,
    sampling: ModelSampling,
    ranks: Vec<RankModel>,
}

impl ModelTokens {
    /// A backend. Sampling parameters out of range fail every forward: check them first
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
        let block = model
            .paged_geometry(1, tokens_per_block as usize)
            .block_bytes();
        u64::from(blocks).saturating_mul(block as u64)
    }

    /// The one rule on a rank's pool size: at most [`MAX_POOL_BYTES`] (the error names
    /// both numbers).
    pub fn check_pool(model: &Model, blocks: u32, tokens_per_block: u32) -> Result<(), String> {
        let bytes = Self::pool_bytes(model, blocks, tokens_per_block);
        if bytes > MAX_POOL_BYTES {
            return Err(format!(
                "{blocks} KV blocks of {tokens_per_block} tokens need a K/V pool of {} MiB per rank for this model, more than {} MiB",
                bytes >> 20,
                MAX_POOL_BYTES >> 20
            ));
        }
        Ok(())
    }
}

impl TokenSource for ModelTokens {
    fn sample_into(
        &mut self,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), ForwardError> {
        self.rank(batch.rank.index()).compute_into(batch, out)
    }

    fn reads_forward_inputs(&self) -> bool {
        true
    }
}

impl ModelTokens {
    /// Rank `index`'s model (made on first use).
    pub fn rank(&mut self, index: usize) -> &mut RankModel {
        while self.ranks.len() <= index {
            self.ranks
                .push(RankModel::new(self.model.clone(), self.sampling));
        }
        &mut self.ranks[index]
    }
}

/// The rank's device memory: the K/V pool and each request's token history. Only its
/// forwards touch it (the device thread, or the simulator inline), as only a GPU's
/// stream touches its memory; transfers go through [`Handoffs`].
#[derive(Default)]
struct RankMemory {
    cache: Option<PagedKvCache>,
    histories: HashMap<ReqId, Vec<u32>>,
}

impl RankMemory {
    /// The pool, made on first use with `blocks` blocks of `tokens_per_block` tokens.
    fn pool(
        &mut self,
        model: &Model,
        blocks: u32,
        tokens_per_block: u32,
    ) -> Result<&mut PagedKvCache, String> {
        if self.cache.is_none() {
            ModelTokens::check_pool(model, blocks, tokens_per_block)?;
            let cache = model
                .paged_cache(blocks as usize, tokens_per_block as usize)
                .map_err(|e| e.to_string())?;
            self.cache = Some(cache);
        }
        self.cache.as_mut().ok_or_else(|| "no K/V pool".into())
    }
}

/// K/V in transit between a rank's forwards and its transceiver, the staging buffers a
/// transfer engine copies through. The transceiver never waits for a forward: a ctx rank
/// stages a request's prompt blocks and tokens when the forward that ends its prefill
/// runs, and the pull takes them; a gen rank's arrivals wait here until its next
/// forward writes them into the pool first thing (its executor hears `Done` only after
/// they are staged, so every forward that reads them comes later).
#[derive(Default)]
struct Handoffs {
    /// A ctx rank: stage each finished prefill.
    stages_prefills: bool,
    /// ctx side: request → (its prompt's blocks, its tokens so far), until pulled.
    outgoing: HashMap<ReqId, SequenceKv>,
    /// gen side: what arrived, to write before the next forward.
    incoming: Vec<Arrival>,
}

/// A request's K/V that reached a gen rank.
struct Arrival {
    id: ReqId,
    /// Where it goes: the blocks the rank's KV manager reserved, in order.
    block_ids: Vec<u32>,
    /// One block's bytes each.
    blocks: Vec<Vec<u8>>,
    /// The request's tokens so far.
    tokens: Vec<u32>,
}

fn lock(handoffs: &Mutex<Handoffs>) -> MutexGuard<'_, Handoffs> {
    // A holder that panicked left whole entries behind: each is inserted or taken whole.
    handoffs.lock().unwrap_or_else(|p| p.into_inner())
}

/// The device's half of one rank: its K/V pool and its requests' token histories.
pub struct RankModel {
    model: Arc<Model>,
    sampling: ModelSampling,
    memory: RankMemory,
    handoffs: Arc<Mutex<Handoffs>>,
    /// Every entry's input token ids of the forward in progress, one after the other
    /// (kept across forwards: refilled, not reallocated).
    ids: Vec<u32>,
    /// Per entry: its start position and its ids' range in `ids`.
    spans: Vec<(usize, std::ops::Range<usize>)>,
}

/// An entry's sampled token and, where its request asks, its log-probabilities.
type Pick = (u32, Option<TokenLogprobs>);

/// A copy of one entry's logits with its request's rules applied, and the counts the
/// penalties need: refilled per entry of a sampling split, so a split allocates them
/// once, and only when one of its entries has rules.
#[derive(Default)]
struct RuleScratch {
    logits: Vec<f32>,
    penalties: PenaltyScratch,
}

/// A rank's memory as its transceiver sees it ([`KvStore`]): the ctx side takes a
/// request's staged blocks and tokens, the gen side stages what arrived.
struct RankKvStore {
    handoffs: Arc<Mutex<Handoffs>>,
    pool: (u32, u32),
    block_bytes: u64,
}

impl KvStore for RankKvStore {
    fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    fn export(&self, id: ReqId, wanted: u32) -> Result<SequenceKv, String> {
        let (mut blocks, tokens) = lock(&self.handoffs)
            .outgoing
            .remove(&id)
            .ok_or_else(|| format!("no K/V of request {} staged on this rank", id.0))?;
        if blocks.len() < wanted as usize {
            return Err(format!(
                "{wanted} blocks were asked for, {} are staged",
                blocks.len()
            ));
        }
        // The prompt's blocks (the gen rank reserved those); a last block that holds
        // only the first token's slot stays behind.
        blocks.truncate(wanted as usize);
        Ok((blocks, tokens))
    }

    fn import(
        &self,
        id: ReqId,
        block_ids: &[u32],
        blocks: &[KvBlock],
        tokens: &[u32],
    ) -> Result<(), String> {
        if block_ids.len() != blocks.len() {
            return Err(format!(
                "{} blocks arrived for {} reserved",
                blocks.len(),
                block_ids.len()
            ));
        }
        // The blocks hold the prompt; the tokens are the prompt and the first token.
        let prompt = tokens.len().saturating_sub(1);
        if tokens.is_empty() || prompt.div_ceil(self.pool.1.max(1) as usize) != blocks.len() {
            return Err(format!(
                "{} token ids arrived with {} blocks of {} tokens",
                tokens.len(),
                blocks.len(),
                self.pool.1
            ));
        }
        // Everything the forward's write could refuse is checked here, where the
        // transfer can still fail: the staged write cannot.
        if let Some(bad) = blocks
            .iter()
            .find(|b| b.bytes.len() as u64 != self.block_bytes)
        {
            return Err(format!(
                "block {} is {} bytes, a block of this model is {}",
                bad.index,
                bad.bytes.len(),
                self.block_bytes
            ));
        }
        if let Some(&bad) = block_ids.iter().find(|&&b| b >= self.pool.0) {
            return Err(format!(
                "block id {bad} outside the pool of {} blocks",
                self.pool.0
            ));
        }
        lock(&self.handoffs).incoming.push(Arrival {
            id,
            block_ids: block_ids.to_vec(),
            blocks: blocks.iter().map(|b| b.bytes.clone()).collect(),
            tokens: tokens.to_vec(),
        });
        Ok(())
    }
}

impl RankModel {
    /// A rank's model with an empty pool (sized on the first batch).
    pub fn new(model: Arc<Model>, sampling: ModelSampling) -> RankModel {
        RankModel {
            model,
            sampling,
            memory: RankMemory::default(),
            handoffs: Arc::default(),
            ids: Vec::new(),
            spans: Vec::new(),
        }
    }

    /// The rank's memory as its transceiver sees it, for a pool of `blocks` blocks of
    /// `tokens_per_block` tokens (the size the rank's KV manager gives its forwards).
    /// `sends`: a ctx rank, which stages every finished prefill for the pull.
    pub fn kv_store(&self, blocks: u32, tokens_per_block: u32, sends: bool) -> Arc<dyn KvStore> {
        lock(&self.handoffs).stages_prefills = sends;
        Arc::new(RankKvStore {
            handoffs: self.handoffs.clone(),
            pool: (blocks, tokens_per_block),
            block_bytes: self
                .model
                .paged_geometry(1, tokens_per_block as usize)
                .block_bytes() as u64,
        })
    }

    /// Runs the forward of `batch` and samples one token per entry into `out`. The
    /// batch must carry its forward inputs (its executor was asked for them:
    /// `RankExecutor::set_forward_inputs`).
    pub fn compute_into(
        &mut self,
        batch: &ScheduledBatch,
        out: &mut ForwardOutput,
    ) -> Result<(), ForwardError> {
        let (rank, number) = (batch.rank, batch.number);
        // The whole step runs on one of rayon's threads: the products', the attention's
        // and the sampling's splits then join there, where from this thread each split
        // would wake it again (tens of sleeps and wake-ups a step).
        rayon::scope(|_| self.compute(batch, out)).map_err(|reason| ForwardError {
            rank,
            batch: number,
            reason,
        })
    }

    fn compute(&mut self, batch: &ScheduledBatch, out: &mut ForwardOutput) -> Result<(), String> {
        if !batch.inputs.filled {
            return Err(
                "the batch carries no block tables or prompts: its rank was not asked for its forward inputs".into(),
            );
        }
        if batch.inputs.entries.len() != batch.entries.len() {
            return Err(format!(
                "the batch carries forward inputs for {} of its {} entries",
                batch.inputs.entries.len(),
                batch.entries.len()
            ));
        }
        let inputs = &batch.inputs;
        let model = &*self.model;
        let (blocks, tokens_per_block) =
            (batch.inputs.pool.blocks, batch.inputs.pool.tokens_per_block);
        let memory = &mut self.memory;
        let pool = memory.pool(model, blocks, tokens_per_block)?;
        // K/V that arrived since the last forward goes in first (checked when staged).
        let mut arrived_tokens = Vec::new();
        let (arrived, stages_prefills) = {
            let mut h = lock(&self.handoffs);
            (std::mem::take(&mut h.incoming), h.stages_prefills)
        };
        for a in arrived {
            for (&to, bytes) in a.block_ids.iter().zip(&a.blocks) {
                pool.write_block(to, bytes).map_err(|e| e.to_string())?;
            }
            arrived_tokens.push((a.id, a.tokens));
        }
        memory.histories.extend(arrived_tokens);
        let vocab = model.config.vocab_size as u32;
        // Per entry: start position and token ids (a range of `ids`).
        let (ids, spans) = (&mut self.ids, &mut self.spans);
        ids.clear();
        spans.clear();
        for (e, inp) in batch.with_inputs() {
            let tokens = e.kind.tokens();
            let from = ids.len();
            if e.is_dummy {
                // Arithmetic only: a dummy writes and reads no block.
                ids.resize(from + tokens.max(1) as usize, 0);
                spans.push((0, from..ids.len()));
                continue;
            }
            let history = match memory.histories.entry(e.id) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    if !matches!(e.kind, ForwardKind::Context { .. }) {
                        return Err(format!(
                            "request {} decodes but its prompt was never seen",
                            e.id.0
                        ));
                    }
                    let given = inputs.prompt_ids(inp);
                    if !given.is_empty() && given.len() != inp.prompt_len as usize {
                        return Err(format!(
                            "request {} carries {} prompt ids for a prompt of {} tokens",
                            e.id.0,
                            given.len(),
                            inp.prompt_len
                        ));
                    }
                    v.insert(prompt_tokens_of(
                        e.id,
                        inp.prompt_len,
                        inputs.block_hashes(inp),
                        given,
                        tokens_per_block,
                        vocab,
                    ))
                }
            };
            let start = e.kv_tokens as usize;
            let known = match e.kind {
                ForwardKind::Context { chunk, .. } => history.get(start..start + chunk as usize),
                ForwardKind::Generation { tokens: 1 } => history.get(start..start + 1),
                ForwardKind::Generation { tokens } => {
                    return Err(format!(
                        "request {} drafts {} tokens: the model backend does not run speculative decoding",
                        e.id.0,
                        tokens - 1
                    ));
                }
            };
            let known = known.ok_or_else(|| {
                format!(
                    "request {} needs tokens {start}..{} but only {} are known",
                    e.id.0,
                    start + tokens as usize,
                    history.len()
                )
            })?;
            ids.extend_from_slice(known);
            spans.push((start, from..ids.len()));
        }
        let entries: Vec<BatchEntry<'_>> = batch
            .with_inputs()
            .zip(spans.iter())
            .map(|((e, inp), (start, range))| BatchEntry {
                block_table: inputs.block_table(inp),
                start_position: *start,
                token_ids: &ids[range.clone()],
                dummy: e.is_dummy,
            })
            .collect();
        let cache = memory.cache.as_mut().ok_or("no K/V pool")?;
        let logits = forward_paged(model, cache, &entries).map_err(|e| e.to_string())?;
        out.batch = batch.number;
        out.sampled.clear();
        out.logprobs.clear();
        // Each entry's token (and log-probabilities, where asked) is a pure function of
        // its logits: the entries sample across the thread pool, each split with its own
        // scratch, while the histories change below, in batch order.
        let histories = &memory.histories;
        let sampling = self.sampling;
        let picks: Vec<Result<Option<Pick>, String>> = batch
            .with_inputs()
            .zip(&logits)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map_init(RuleScratch::default, |scratch, ((e, inp), logits)| {
                if e.is_dummy {
                    return Ok(None);
                }
                let raw = logits;
                let history = histories.get(&e.id).map(Vec::as_slice);
                let logits = with_logit_rules(logits, inputs, inp, e.position, history, scratch);
                let token = sample_one(sampling, inp.sampling, e.id, e.position, logits)?;
                // vLLM's default (`raw_logprobs`): the model's own distribution, before
                // the request's bias, penalties and temperature. Only a request that asks
                // pays.
                let logprobs = inp
                    .sampling
                    .and_then(|s| s.logprobs)
                    .filter(|_| e.kind.samples())
                    .map(|top| {
                        let (logprob, top) = token_logprobs(raw, token, top as usize);
                        TokenLogprobs {
                            token,
                            logprob,
                            top,
                        }
                    });
                Ok(Some((token, logprobs)))
            })
            .collect();
        for (index, ((e, inp), pick)) in batch.with_inputs().zip(picks).enumerate() {
            let Some((token, logprobs)) = pick? else {
                out.sampled.push(0);
                continue;
            };
            if let Some(logprobs) = logprobs {
                out.logprobs.push((index as u32, logprobs));
            }
            if e.kind.samples()
                && let Some(history) = memory.histories.get_mut(&e.id)
            {
                let at = inp.prompt_len as usize + e.position as usize;
                history.truncate(at);
                if history.len() == at {
                    history.push(token);
                }
            }
            out.sampled.push(token);
        }
        if stages_prefills {
            self.stage_prefills(batch)?;
        }
        if let Some(live) = &batch.inputs.live {
            let live: std::collections::HashSet<ReqId> = live.iter().copied().collect();
            self.memory.histories.retain(|id, _| live.contains(id));
            lock(&self.handoffs)
                .outgoing
                .retain(|id, _| live.contains(id));
        }
        Ok(())
    }
}

impl RankModel {
    /// ctx rank: copies the blocks and tokens of every request whose prefill this batch
    /// finished into the staging area, where its transceiver's pull takes as many
    /// blocks as the gen rank reserved.
    fn stage_prefills(&mut self, batch: &ScheduledBatch) -> Result<(), String> {
        let pool = self.memory.cache.as_ref().ok_or("no K/V pool")?;
        let mut staged = Vec::new();
        for (e, inp) in batch.with_inputs() {
            if e.is_dummy || !matches!(e.kind, ForwardKind::Context { samples: true, .. }) {
                continue;
            }
            let Some(tokens) = self.memory.histories.get(&e.id) else {
                continue;
            };
            let contents = batch
                .inputs
                .block_table(inp)
                .iter()
                .map(|&b| {
                    pool.read_block(b)
                        .ok_or_else(|| format!("block id {b} outside the pool"))
                })
                .collect::<Result<Vec<_>, String>>()?;
            staged.push((e.id, (contents, tokens.clone())));
        }
        lock(&self.handoffs).outgoing.extend(staged);
        Ok(())
    }
}

/// `logits` as the entry's request asks them changed before sampling, in vLLM's order:
/// its `logit_bias` added, its end ids masked while `position` is below its
/// `min_tokens`, then its penalties over its `history` (prompt, then output). `logits`
/// itself, uncopied, when the request asks for none of these.
fn with_logit_rules<'a>(
    logits: &'a [f32],
    inputs: &ForwardInputs,
    entry: &EntryInputs,
    position: u32,
    history: Option<&[u32]>,
    scratch: &'a mut RuleScratch,
) -> &'a [f32] {
    let (penalties, min_tokens) = entry.sampling.map_or((Penalties::NONE, 0), |s| {
        (
            Penalties {
                presence: s.presence_penalty,
                frequency: s.frequency_penalty,
                repetition: s.repetition_penalty,
            },
            s.min_tokens,
        )
    });
    let bias = inputs.logit_bias(entry);
    let masked = if position < min_tokens {
        inputs.end_ids(entry)
    } else {
        &[]
    };
    if bias.is_empty() && masked.is_empty() && penalties.is_none() {
        return logits;
    }
    scratch.logits.clear();
    scratch.logits.extend_from_slice(logits);
    let adjusted = &mut scratch.logits;
    apply_logit_bias(adjusted, bias.iter().map(|b| (b.token, b.bias)));
    mask_tokens(adjusted, masked);
    if !penalties.is_none() {
        let history = history.unwrap_or(&[]);
        let prompt_len = (entry.prompt_len as usize).min(history.len());
        let (prompt, rest) = history.split_at(prompt_len);
        // The output before this position (a recompute's history may hold more).
        let output = &rest[..rest.len().min(position as usize)];
        apply_penalties(adjusted, penalties, prompt, output, &mut scratch.penalties);
    }
    adjusted
}

/// Request `id`'s token at output `position`: a pure function of the sampling, the
/// request's seed (its own, or the run's mixed with its id), the position and the logits.
fn sample_one(
    run: ModelSampling,
    own: Option<lockstep_actors::request::RequestSampling>,
    id: ReqId,
    position: u32,
    logits: &[f32],
) -> Result<u32, String> {
    let (params, seed) = match own {
        Some(o) => (
            SamplingParams {
                temperature: o.temperature,
                top_p: o.top_p,
                top_k: o.top_k as usize,
                seed: 0,
            },
            o.seed,
        ),
        None => (run.params, run.seed ^ mix(id.0)),
    };
    let params = SamplingParams {
        seed: mix(seed ^ u64::from(position).rotate_left(40)),
        ..params
    };
    Sampler::new(params)
        .and_then(|mut s| s.sample(logits))
        .map_err(|e| e.to_string())
}

/// The prompt's token ids: the request's own, or a made-up prompt whose full blocks'
/// tokens follow from their prefix keys (shared blocks, shared tokens) and whose tail
/// follows from the request id.
pub fn prompt_tokens(spec: &RequestSpec, tokens_per_block: u32, vocab: u32) -> Vec<u32> {
    prompt_tokens_of(
        spec.id,
        spec.prompt_len,
        &spec.block_hashes,
        &spec.prompt_tokens,
        tokens_per_block,
        vocab,
    )
}

/// [`prompt_tokens`] from the parts a launched batch carries: request `id`'s prompt of
/// `prompt_len` tokens, its block hashes and the ids it came with (empty: made up).
pub fn prompt_tokens_of(
    id: ReqId,
    prompt_len: u32,
    block_hashes: &[u64],
    given: &[u32],
    tokens_per_block: u32,
    vocab: u32,
) -> Vec<u32> {
    if !given.is_empty() {
        return given.to_vec();
    }
    let vocab = u64::from(vocab.max(1));
    let block = tokens_per_block.max(1) as usize;
    let mut tokens = Vec::with_capacity(prompt_len as usize);
    for key in chain_keys(block_hashes) {
        if tokens.len() + block > prompt_len as usize {
            break;
        }
        tokens.extend((0..block as u64).map(|slot| (mix(key ^ slot) % vocab) as u32));
    }
    let tail_seed = mix(id.0 ^ 0x7E11);
    while tokens.len() < prompt_len as usize {
        tokens.push((mix(tail_seed ^ tokens.len() as u64) % vocab) as u32);
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{InitOptions, write_random_model};

    fn tiny_rank(name: &str) -> (std::path::PathBuf, RankModel) {
        let dir =
            std::env::temp_dir().join(format!("lockstep-handoff-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        write_random_model(&dir, &InitOptions::default()).expect("init");
        let model = Arc::new(Model::load(&dir).expect("load"));
        (dir, RankModel::new(model, ModelSampling::default()))
    }

    #[test]
    fn an_arrival_the_pool_cannot_take_is_refused_naming_why_and_nothing_is_staged() {
        let (dir, rank) = tiny_rank("refused");
        // 8 blocks of 4 tokens.
        let store = rank.kv_store(8, 4, false);
        let size = store.block_bytes() as usize;
        let block = |index, len| KvBlock {
            index,
            bytes: vec![0; len],
            checksum: 0,
        };
        let err = |ids: &[u32], blocks: &[KvBlock], tokens: &[u32]| {
            store.import(ReqId(1), ids, blocks, tokens).unwrap_err()
        };
        // A 6-token prompt and its first token fill 2 blocks.
        let good = [block(0, size), block(1, size)];
        let tokens = [1, 2, 3, 4, 5, 6, 7];
        assert!(err(&[3], &good, &tokens).contains("2 blocks arrived for 1 reserved"));
        assert!(
            err(&[3, 4], &good, &tokens[..4])
                .contains("4 token ids arrived with 2 blocks of 4 tokens")
        );
        let short = [block(0, size), block(1, size - 4)];
        let e = err(&[3, 4], &short, &tokens);
        assert!(e.contains(&format!("block 1 is {} bytes", size - 4)), "{e}");
        assert!(err(&[3, 8], &good, &tokens).contains("block id 8 outside the pool of 8 blocks"));
        assert!(
            lock(&rank.handoffs).incoming.is_empty(),
            "a refused arrival stages nothing"
        );
        store
            .import(ReqId(1), &[3, 4], &good, &tokens)
            .expect("fits");
        assert_eq!(lock(&rank.handoffs).incoming.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_batch_without_its_forward_inputs_is_refused_naming_why() {
        use lockstep_actors::executor::{EntryInputs, ForwardEntry};
        use lockstep_actors::ids::{BatchNumber, RankId};
        let (dir, mut rank) = tiny_rank("no-inputs");
        let entry = ForwardEntry {
            id: ReqId(1),
            seq: 0,
            kind: ForwardKind::Context {
                chunk: 4,
                samples: true,
            },
            kv_tokens: 0,
            position: 0,
            path: 0,
            is_dummy: false,
        };
        let mut batch = ScheduledBatch {
            number: BatchNumber(3),
            rank: RankId(1),
            entries: vec![entry],
            ..ScheduledBatch::default()
        };
        let mut out = ForwardOutput {
            batch: BatchNumber(0),
            sampled: Vec::new(),
            logprobs: Vec::new(),
        };
        let e = rank.compute_into(&batch, &mut out).unwrap_err();
        assert_eq!((e.rank, e.batch), (RankId(1), BatchNumber(3)));
        assert!(e.reason.contains("no block tables"), "{}", e.reason);
        // With them (one block of 4 tokens in a pool of 8), the same entry runs.
        batch.inputs.filled = true;
        batch.inputs.pool = lockstep_actors::executor::KvPool {
            blocks: 8,
            tokens_per_block: 4,
        };
        let blocks = batch.inputs.push_blocks([5]);
        batch.inputs.entries.push(EntryInputs {
            prompt_len: 4,
            blocks,
            ..EntryInputs::default()
        });
        rank.compute_into(&batch, &mut out).expect("runs");
        assert_eq!((out.batch, out.sampled.len()), (BatchNumber(3), 1));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_export_takes_the_staged_blocks_the_gen_rank_reserved_once() {
        let (dir, rank) = tiny_rank("export");
        let store = rank.kv_store(8, 4, true);
        let e = store.export(ReqId(2), 1).unwrap_err();
        assert!(e.contains("no K/V of request 2 staged"), "{e}");
        lock(&rank.handoffs)
            .outgoing
            .insert(ReqId(2), (vec![vec![1], vec![2], vec![3]], vec![9; 9]));
        assert!(
            store
                .export(ReqId(2), 4)
                .unwrap_err()
                .contains("4 blocks were asked for, 3 are staged")
        );
        lock(&rank.handoffs)
            .outgoing
            .insert(ReqId(2), (vec![vec![1], vec![2], vec![3]], vec![9; 9]));
        let (blocks, tokens) = store.export(ReqId(2), 2).expect("staged");
        assert_eq!(
            blocks,
            vec![vec![1], vec![2]],
            "the reserved count, in order"
        );
        assert_eq!(tokens, vec![9; 9]);
        assert!(store.export(ReqId(2), 2).is_err(), "taken");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
