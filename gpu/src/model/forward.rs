//! One batched forward over a mixed batch: prefill chunks and decode tokens of many
//! requests in one pass, their K/V read from and written to the paged store.
//!
//! Every token of the batch goes through the projections and the MLP together (one
//! matmul per weight per layer); only attention is per request, since each request
//! attends to its own cached tokens.

use candle_core::{Device, Tensor};
use rayon::prelude::*;

use super::Model;
use super::error::{ModelError, Result};
use super::ops::{RotaryAngles, gated_mlp, rms_norm};
use super::paged_attention::{AttentionShape, attend};
use super::paged_kv::PagedKvCache;

/// One request's share of a forward.
#[derive(Debug, Clone, Copy)]
pub struct BatchEntry<'a> {
    /// The request's block table: block ids in the paged store, in position order.
    pub block_table: &'a [u32],
    /// Position of the first new token (= tokens already cached for this request).
    pub start_position: usize,
    /// The new tokens: a prefill chunk, or one decode token.
    pub token_ids: &'a [u32],
    /// A dummy entry (padding a rank's batch) runs the arithmetic but writes no K/V and
    /// reads none from the cache: it attends to its own tokens only, so whatever its
    /// block table says, no real request's blocks change.
    pub dummy: bool,
}

/// One layer's queries, keys and values of a batch's new tokens, row-major: `[total,
/// heads * head_dim]` queries, `[total, kv_heads * head_dim]` keys and values.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerRows<'a> {
    pub queries: &'a [f32],
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub shape: AttentionShape,
}

impl LayerRows<'_> {
    /// The batch's new tokens (rows of `queries`).
    pub(crate) fn tokens(&self) -> usize {
        self.queries.len() / (self.shape.heads * self.shape.head_dim).max(1)
    }
}

/// Where the forward keeps K/V, and how it attends to them: the paged store with
/// in-place loops, or the dense reference's buffers with tensor ops.
pub(crate) trait KvStore {
    /// Stores the batch's new K/V of layer `layer` (the entries' tokens in order;
    /// `entries` gives each entry's start position and new tokens) and attends every
    /// entry's queries to its own context. Returns `[total, heads * head_dim]`.
    fn attend(
        &mut self,
        layer: usize,
        entries: &[(usize, &[u32])],
        rows: LayerRows<'_>,
    ) -> Result<Vec<f32>>;
}

/// Which rows of the batch's new tokens the LM head runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    /// Each entry's last position: what sampling reads.
    Last,
    /// Every new position (a prompt's log-probabilities).
    All,
}

/// Runs every layer over the batch's new tokens; returns the logits of the `rows`
/// asked (each entry's last position, or every new position in batch order).
/// `entries` gives each entry's start position and new tokens.
pub(crate) fn forward_with(
    model: &Model,
    entries: &[(usize, &[u32])],
    store: &mut impl KvStore,
    rows: Rows,
) -> Result<Vec<Vec<f32>>> {
    let config = &model.config;
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    for &(start, ids) in entries {
        if ids.is_empty() {
            return Err(ModelError::InvalidBatch(
                "an entry has no new tokens".into(),
            ));
        }
        if start + ids.len() > config.max_position_embeddings {
            return Err(ModelError::InvalidBatch(format!(
                "positions up to {} exceed max_position_embeddings {}",
                start + ids.len(),
                config.max_position_embeddings
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= config.vocab_size) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} outside the vocabulary of {}",
                config.vocab_size
            )));
        }
        tokens.extend_from_slice(ids);
        positions.extend((start..start + ids.len()).map(|p| p as u32));
    }
    if tokens.is_empty() {
        return Ok(Vec::new());
    }
    let total = tokens.len();
    let shape = AttentionShape {
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
        head_dim: config.head_dim,
        window: config.sliding_window,
    };
    let eps = config.rms_norm_eps;
    // The hidden states, `[total, hidden]` row-major, from the embedding's rows.
    let ids = Tensor::from_vec(tokens, total, &Device::Cpu)?;
    let mut x = model
        .weights
        .embed_tokens
        .index_select(&ids, 0)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let rotary = RotaryAngles::new(&positions, &config.inverse_frequencies());
    for (layer_index, layer) in model.weights.layers.iter().enumerate() {
        let h = rms_norm(&x, &layer.input_layernorm.to_vec1::<f32>()?, eps);
        let mut queries = layer.q_proj.forward(&h);
        let mut keys = layer.k_proj.forward(&h);
        let values = layer.v_proj.forward(&h);
        rotary.apply(&mut queries);
        rotary.apply(&mut keys);
        let rows = LayerRows {
            queries: &queries,
            keys: &keys,
            values: &values,
            shape,
        };
        let attended = store.attend(layer_index, entries, rows)?;
        add_to(&mut x, &layer.o_proj.forward(&attended));
        let h = rms_norm(&x, &layer.post_attention_layernorm.to_vec1::<f32>()?, eps);
        add_to(&mut x, &gated_mlp(&h, layer, config.hidden_act)?);
    }
    let norm = model.weights.norm.to_vec1::<f32>()?;
    if rows == Rows::All {
        return Ok(model.weights.lm_head.logits(&rms_norm(&x, &norm, eps)));
    }
    // Only each entry's last position is sampled from: the LM head (the widest matmul)
    // runs on those rows alone.
    let hidden = config.hidden_size;
    let mut last = Vec::with_capacity(entries.len() * hidden);
    let mut end = 0;
    for &(_, ids) in entries {
        end += ids.len();
        last.extend_from_slice(&x[(end - 1) * hidden..end * hidden]);
    }
    Ok(model.weights.lm_head.logits(&rms_norm(&last, &norm, eps)))
}

/// `x += y`, element by element (the residual connections).
fn add_to(x: &mut [f32], y: &[f32]) {
    for (x, y) in x.iter_mut().zip(y) {
        *x += y;
    }
}

/// The paged store seen through the batch's block tables.
struct PagedStore<'c, 'b> {
    cache: &'c mut PagedKvCache,
    batch: &'b [BatchEntry<'b>],
}

impl KvStore for PagedStore<'_, '_> {
    fn attend(
        &mut self,
        layer: usize,
        entries: &[(usize, &[u32])],
        rows: LayerRows<'_>,
    ) -> Result<Vec<f32>> {
        let total = rows.tokens();
        let LayerRows {
            queries,
            keys,
            values,
            shape,
        } = rows;
        let AttentionShape {
            heads,
            kv_heads,
            head_dim,
            ..
        } = shape;
        let (width, stride) = (heads * head_dim, kv_heads * head_dim);
        let mut row = 0;
        for (e, &(start, ids)) in self.batch.iter().zip(entries) {
            let rows = row * stride..(row + ids.len()) * stride;
            if !e.dummy {
                self.cache.write(
                    layer,
                    e.block_table,
                    start,
                    &keys[rows.clone()],
                    &values[rows],
                );
            }
            row += ids.len();
        }
        // Each entry attends to its own context into its own rows of `out`: the entries
        // run across the thread pool (the device thread would otherwise do them alone
        // while the pool's threads, busy only in the products, wait).
        let mut out = vec![0.0f32; total * width];
        let mut jobs = Vec::with_capacity(self.batch.len());
        let (mut rest, mut row) = (out.as_mut_slice(), 0);
        for (e, &(start, ids)) in self.batch.iter().zip(entries) {
            let n = ids.len();
            let (mine, tail) = rest.split_at_mut(n * width);
            jobs.push((e, start, row, mine));
            (rest, row) = (tail, row + n);
        }
        let cache = &*self.cache;
        let attend_one = |(e, start, row, out): (&BatchEntry<'_>, usize, usize, &mut [f32])| {
            let n = out.len() / width;
            let queries = &queries[row * width..(row + n) * width];
            if e.dummy {
                // A dummy attends to its own new tokens only (it wrote nothing).
                let (keys, values) = (&keys[row * stride..], &values[row * stride..]);
                let own = |p: usize| {
                    let at = (p - start) * stride;
                    (&keys[at..at + stride], &values[at..at + stride])
                };
                attend(shape, queries, start, start, own, out);
            } else {
                let cached = |p: usize| cache.token(layer, e.block_table, p);
                attend(shape, queries, start, 0, cached, out);
            }
        };
        if jobs.len() > 1 {
            jobs.into_par_iter().for_each(attend_one);
        } else {
            jobs.into_iter().for_each(attend_one);
        }
        Ok(out)
    }
}

/// Runs one forward over `batch`, writing each real entry's new K/V into `cache` at the
/// slots its block table names and attending over its cached and new tokens. Returns
/// each entry's logits at its last new position (`[vocab]` per entry, dummies included).
pub fn forward_paged(
    model: &Model,
    cache: &mut PagedKvCache,
    batch: &[BatchEntry<'_>],
) -> Result<Vec<Vec<f32>>> {
    let geometry = cache.geometry();
    if geometry.layers != model.config.num_hidden_layers
        || geometry.kv_heads != model.config.num_key_value_heads
        || geometry.head_dim != model.config.head_dim
    {
        return Err(ModelError::InvalidBatch(
            "the paged store's geometry does not match the model".into(),
        ));
    }
    for entry in batch.iter().filter(|e| !e.dummy) {
        cache.check_table(
            entry.block_table,
            entry.start_position + entry.token_ids.len(),
        )?;
    }
    let entries: Vec<(usize, &[u32])> = batch
        .iter()
        .map(|e| (e.start_position, e.token_ids))
        .collect();
    // On one of rayon's threads (inline if already there): the forward's parallel splits
    // join there, where from a thread outside the pool each would put it to sleep and
    // wake it again.
    rayon::scope(|_| {
        forward_with(
            model,
            &entries,
            &mut PagedStore { cache, batch },
            Rows::Last,
        )
    })
}
